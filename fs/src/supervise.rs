//! The supervisor: the process `converged mount` leaves behind. It opens
//! /dev/fuse, keeps that descriptor for the life of the mount, and runs the
//! daemon as a child on it. The kernel connection lives as long as one
//! descriptor of it is open, so when the daemon dies (a crash, an OOM
//! kill, `kill -9`) the mount stays: requests wait in the kernel, the
//! supervisor starts a new daemon on the same descriptor, and that one
//! takes the connection over (`fuse::Connection::Resume`): the handles the
//! kernel holds from the journal (`kernel_handles.rs`), and the requests
//! the dead daemon read and did not answer sent again by the kernel
//! (`FUSE_NOTIFY_RESEND`, Linux 6.9), or, under FUSE over io_uring, left
//! in the ring entries' memory the supervisor also keeps (a memfd) and
//! served from there by the next daemon.
//!
//! ```text
//!   Starting ──READY──▶ Serving ──daemon killed / failed──▶ Restarting ──▶ Serving
//!      │                   │  │                                  │ too many in the window
//!      │ exits first       │  └──SIGUSR1 (converged upgrade)──▶ Upgrading ──▶ Serving
//!      ▼                   ▼ exits 0 (unmounted)                 ▼
//!   (mount failed)      Done                                   GaveUp (the mount reports ENOTCONN)
//! ```
//!
//! The supervisor holds no lock, opens no data file and talks to no peer:
//! it waits for its child and for signals, nothing else.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{BufRead, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::config::MountArgs;

/// Where the supervisor says who it is, and where an upgrade asks for a
/// binary (both in the data dir).
pub const PID_FILE: &str = "converged.supervisor";
pub const UPGRADE_FILE: &str = "converged.upgrade";

/// How a daemon ends when it hands its connection to the next one (a
/// planned upgrade): its state synced, the mount left in place.
pub const EXIT_HANDOVER: i32 = 75;

/// The daemon's part of `converged mount`'s arguments: the command line
/// with the supervisor's internal flags added.
fn child_command(
    exe: &Path,
    exe_prefix: &[OsString],
    argv: &[OsString],
    fds: (i32, i32),
    generation: u64,
    last: &str,
) -> Command {
    let (fd, ring_fd) = fds;
    let mut cmd = Command::new(exe);
    cmd.args(exe_prefix)
        .args(argv)
        .args(["--fuse-fd", &fd.to_string(), "--fuse-ring-fd", &ring_fd.to_string()])
        .args(["--fuse-generation", &generation.to_string()])
        .arg("--last-exit")
        .arg(last);
    // Readiness under systemd is the supervisor's to report (NotifyAccess=main).
    cmd.env_remove("NOTIFY_SOCKET");
    // SAFETY: between fork and exec only async-signal-safe calls: fcntl(2)
    // keeps the connection's descriptors open across the exec.
    unsafe {
        cmd.pre_exec(move || {
            for fd in [fd, ring_fd] {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd
}

/// How a daemon ended, in words for the log and the next daemon.
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "ended".into(),
    }
}

/// Restarts within the window, to stop a crash loop.
struct RestartBudget {
    limit: u32,
    window: Duration,
    recent: Vec<Instant>,
}

impl RestartBudget {
    /// Count a restart now; false when it is one too many.
    fn take(&mut self) -> bool {
        let now = Instant::now();
        self.recent.retain(|t| now.duration_since(*t) < self.window);
        self.recent.push(now);
        self.recent.len() as u32 <= self.limit
    }
}

/// Run the supervisor until the mount ends. `argv` is the mount command's
/// arguments (after the program name), `exe_prefix` what the daemon binary
/// must be started with before them.
pub fn run(args: &MountArgs, data_dir: &Path, argv: &[OsString], exe_prefix: &[OsString]) -> anyhow::Result<()> {
    let log_file = match args.daemonized {
        true => Some(args.log_file.clone().unwrap_or_else(|| data_dir.join("converged.log"))),
        false => None,
    };
    crate::daemon::init_tracing(log_file.as_deref())?;
    let fuse: OwnedFd = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/fuse")
        .context("open /dev/fuse (is the fuse module loaded?)")?
        .into();
    let fd = fuse.as_raw_fd();
    // The memory FUSE over io_uring keeps its ring entries in, kept here
    // with the connection: a daemon taking over answers from it what the
    // dead one's entries held (see fuser's uring.rs). Empty until a daemon
    // starts rings.
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor is owned here.
    let rings = unsafe { libc::memfd_create(c"converged-fuse-rings".as_ptr(), libc::MFD_CLOEXEC) };
    if rings < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create for the FUSE rings");
    }
    // SAFETY: just made and owned by nothing else.
    let rings = unsafe { OwnedFd::from_raw_fd(rings) };
    let pid_file = data_dir.join(PID_FILE);
    std::fs::write(&pid_file, format!("{}\n", std::process::id()))
        .with_context(|| format!("write {}", pid_file.display()))?;
    let child_pid = Arc::new(AtomicI32::new(0));
    let stopping = Arc::new(AtomicBool::new(false));
    let upgrade = Arc::new(AtomicBool::new(false));
    forward_signals(child_pid.clone(), stopping.clone(), upgrade.clone())?;
    let mut budget = RestartBudget { limit: args.restart_limit, window: args.restart_window, recent: Vec::new() };
    let mut exe = std::env::current_exe().context("find own executable")?;
    let mut generation = 0u64;
    let mut last = String::from("none");
    loop {
        let mut cmd = child_command(&exe, exe_prefix, argv, (fd, rings.as_raw_fd()), generation, &last);
        let mut child = match generation {
            0 => cmd.stdout(Stdio::piped()),
            _ if args.daemonized => cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()),
            _ => &mut cmd,
        }
        .spawn()
        .with_context(|| format!("start the daemon {}", exe.display()))?;
        child_pid.store(child.id() as i32, Ordering::SeqCst);
        let started = Instant::now();
        if generation == 0 && !wait_ready(&mut child, args.daemonized)? {
            let status = child.wait()?;
            remove_own_pid_file(&pid_file);
            bail!("daemon {} before the mount was ready", describe(status));
        }
        let status = child.wait()?;
        child_pid.store(0, Ordering::SeqCst);
        if status.success() || stopping.load(Ordering::SeqCst) {
            tracing::info!(how = %describe(status), "daemon stopped; the mount is over");
            remove_own_pid_file(&pid_file);
            return match status.success() {
                true => Ok(()),
                false => Err(anyhow::anyhow!("daemon {}", describe(status))),
            };
        }
        let handover = status.code() == Some(EXIT_HANDOVER) && upgrade.swap(false, Ordering::SeqCst);
        if handover {
            if let Some(next) = upgrade_binary(data_dir) {
                exe = next;
            }
            tracing::info!(binary = %exe.display(), "daemon handed the connection over; starting the new binary on it");
        } else if !budget.take() {
            tracing::error!(
                how = %describe(status),
                limit = args.restart_limit,
                window = ?args.restart_window,
                "daemon keeps failing; giving up: the mount reports ENOTCONN until it is mounted again"
            );
            remove_own_pid_file(&pid_file);
            bail!(
                "daemon {} {} times within {:?}; gave up",
                describe(status),
                args.restart_limit + 1,
                args.restart_window
            );
        } else {
            tracing::warn!(
                how = %describe(status),
                ran = ?started.elapsed(),
                generation = generation + 1,
                "daemon died; starting a new one on the live connection"
            );
        }
        last = if handover { "upgrade".into() } else { describe(status) };
        generation += 1;
    }
}

/// Remove the pid file if it still names this process: a supervisor whose
/// data dir was replaced under it (removed and made again for a new mount)
/// leaves the new one's file alone.
fn remove_own_pid_file(path: &Path) {
    let named = std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<u32>().ok());
    if named == Some(std::process::id()) {
        let _ = std::fs::remove_file(path);
    }
}

/// Wait for the first daemon's readiness line: pass it on (stdout, or
/// systemd's socket) and detach from the mount command. Its other lines
/// are error messages for the command's caller. False when it exited first.
fn wait_ready(child: &mut Child, daemonized: bool) -> anyhow::Result<bool> {
    let out = child.stdout.take().context("daemon stdout")?;
    let mut lines = std::io::BufReader::new(out).lines();
    for line in lines.by_ref() {
        let line = line.context("read the daemon's output")?;
        if line != crate::daemon::READY {
            eprintln!("{line}");
            continue;
        }
        if daemonized {
            // SAFETY: setsid(2); the supervisor is not a process group leader.
            unsafe { libc::setsid() };
            println!("{line}");
            std::io::stdout().flush()?;
            crate::daemon::detach_stdio();
        }
        crate::daemon::notify_systemd("READY=1");
        // The rest of its output is read and dropped, so it never blocks.
        std::thread::spawn(move || lines.for_each(drop));
        return Ok(true);
    }
    Ok(false)
}

/// The binary `converged upgrade` asked for, taken once.
fn upgrade_binary(data_dir: &Path) -> Option<PathBuf> {
    let path = data_dir.join(UPGRADE_FILE);
    let named = std::fs::read_to_string(&path).ok()?;
    let _ = std::fs::remove_file(&path);
    Some(PathBuf::from(named.trim())).filter(|p| !p.as_os_str().is_empty())
}

/// SIGTERM, SIGINT and SIGHUP go to the daemon (it unmounts; the
/// supervisor then ends with it). SIGUSR1 asks for an upgrade: the daemon
/// gets SIGUSR2, syncs and hands the connection over.
fn forward_signals(child: Arc<AtomicI32>, stopping: Arc<AtomicBool>, upgrade: Arc<AtomicBool>) -> anyhow::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGUSR1])?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for sig in signals.forever() {
            let to = match sig {
                libc::SIGUSR1 => {
                    upgrade.store(true, Ordering::SeqCst);
                    libc::SIGUSR2
                }
                sig => {
                    stopping.store(true, Ordering::SeqCst);
                    crate::daemon::notify_systemd("STOPPING=1");
                    sig
                }
            };
            let pid = child.load(Ordering::SeqCst);
            if pid > 0 {
                // SAFETY: kill(2) of our own child.
                unsafe { libc::kill(pid, to) };
            }
        }
    })?;
    Ok(())
}

/// `converged upgrade MOUNTPOINT [--binary PATH]`: have the supervisor of
/// a mount start `binary` on the live connection, after the running daemon
/// synced and handed it over. Returns once the new daemon serves.
pub fn upgrade(mountpoint: &Path, binary: Option<&Path>, wait: Duration) -> anyhow::Result<()> {
    let data_dir = crate::cli::data_dir_of(mountpoint)?;
    let pid: i32 = std::fs::read_to_string(data_dir.join(PID_FILE))
        .with_context(|| format!("{} has no supervisor (mounted with --no-supervisor?)", mountpoint.display()))?
        .trim()
        .parse()
        .context("supervisor pid file")?;
    let binary = match binary {
        Some(b) => b.canonicalize().with_context(|| format!("binary {}", b.display()))?,
        None => std::env::current_exe().context("find own executable")?,
    };
    let before = daemon_pid(&data_dir);
    std::fs::write(data_dir.join(UPGRADE_FILE), binary.as_os_str().as_encoded_bytes())?;
    // SAFETY: kill(2).
    if unsafe { libc::kill(pid, libc::SIGUSR1) } != 0 {
        bail!("signal the supervisor (pid {pid}): {}", std::io::Error::last_os_error());
    }
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        let now = daemon_pid(&data_dir);
        if now.is_some() && now != before && crate::cli::serves(mountpoint) {
            println!("{}: now served by {} (pid {})", mountpoint.display(), binary.display(), now.unwrap_or(0));
            return Ok(());
        }
    }
    bail!("the new daemon did not serve {} within {wait:?}; see the log", mountpoint.display())
}

/// The pid of the daemon holding the data dir (from its lock file).
fn daemon_pid(data_dir: &Path) -> Option<i32> {
    std::fs::read_to_string(crate::daemon::lock_path(data_dir)).ok()?.trim().parse().ok()
}
