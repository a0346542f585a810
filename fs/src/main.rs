fn main() -> std::process::ExitCode {
    converged_fs::cli::main_with(std::env::args_os(), &[])
}
