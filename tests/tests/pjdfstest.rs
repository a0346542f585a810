//! pjdfstest (the POSIX conformance suite) against a converged mount.
//! Every case that fails or is skipped must be listed, with a reason, in
//! tests/pjdfstest-excludes.txt. Needs `cargo install pjdfstest --locked`
//! and root; `.ci/run` installs it. Outside CI a missing binary skips.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use common::*;

fn pjdfstest_bin() -> Option<std::path::PathBuf> {
    let candidates = [
        std::env::var_os("PJDFSTEST").map(Into::into),
        std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo/bin/pjdfstest")),
        Some("/usr/local/bin/pjdfstest".into()),
    ];
    candidates.into_iter().flatten().find(|p: &std::path::PathBuf| p.exists())
}

/// pjdfstest with configuration `conf` on `m` (the cases whose names
/// contain `only`, or all): its output and its summary line.
fn run(bin: &Path, conf: &Path, m: &Mount, only: Option<&str>) -> (String, String) {
    let secondary = m.root.path().join("secondary");
    std::fs::create_dir_all(&secondary).unwrap();
    let out = Command::new(bin)
        .arg("-c")
        .arg(conf)
        .arg("-p")
        .arg(&m.mnt)
        .arg("-s")
        .arg(&secondary)
        .args(only)
        .current_dir(&m.mnt)
        .output()
        .expect("run pjdfstest");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let summary = text.lines().find(|l| l.starts_with("Summary:")).unwrap_or("no summary line").to_string();
    (text, summary)
}

#[test]
fn pjdfstest_passes_except_listed_cases() {
    let Some(bin) = pjdfstest_bin() else {
        assert!(std::env::var_os("CI").is_none(), "pjdfstest must be installed in CI");
        eprintln!("pjdfstest not installed (cargo install pjdfstest --locked); not run");
        return;
    };
    let m = Mount::new();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (text, summary) = run(&bin, &manifest.join("pjdfstest/pjdfstest.toml"), &m, None);
    eprintln!("pjdfstest on converged: {summary}");
    println!("pjdfstest on converged: {summary}");

    let excludes: BTreeSet<String> = std::fs::read_to_string(manifest.join("pjdfstest-excludes.txt"))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    let mut unexpected = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(name), Some(verdict)) = (words.next(), words.last()) else { continue };
        if !name.contains("::") {
            continue;
        }
        let bad = verdict.eq_ignore_ascii_case("failed") || verdict == "skipped";
        if bad && !excludes.contains(name) {
            unexpected.push(line.trim().to_string());
        }
    }
    assert!(summary.starts_with("Summary:"), "pjdfstest did not finish:\n{text}");
    assert!(
        unexpected.is_empty(),
        "pjdfstest cases failed or skipped that are not in the excludes:\n{}",
        unexpected.join("\n")
    );
}

/// The EROFS cases, in a run of their own: each remounts the mount
/// read-only with `mount -o remount,ro` (through the helper), checks that
/// the call fails with EROFS, and remounts it read-write. Apart from the
/// rest because a case of the full run (posix_fallocate's
/// affected_only_create_flags) leaks two descriptors open for writing,
/// and the kernel refuses a read-only remount while they are open, on any
/// filesystem.
#[test]
fn pjdfstest_erofs_cases_pass_with_remounts() {
    let Some(bin) = pjdfstest_bin() else {
        assert!(std::env::var_os("CI").is_none(), "pjdfstest must be installed in CI");
        return;
    };
    install_helpers();
    let m = Mount::new();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let conf = std::fs::read_to_string(manifest.join("pjdfstest/pjdfstest.toml")).unwrap();
    assert!(conf.contains("allow_remount = false"), "the full run's configuration changed: update this test");
    let remounts = m.root.path().join("pjdfstest-remount.toml");
    std::fs::write(&remounts, conf.replace("allow_remount = false", "allow_remount = true")).unwrap();
    let (text, summary) = run(&bin, &remounts, &m, Some("erofs"));
    println!("pjdfstest EROFS cases on converged: {summary}");
    let ran: Vec<&str> = text.lines().filter(|l| l.contains("::erofs")).collect();
    let listed = std::fs::read_to_string(manifest.join("pjdfstest-excludes.txt")).unwrap();
    let expected = listed.lines().filter(|l| l.contains("::erofs")).count();
    assert!(
        expected > 0 && ran.len() == expected,
        "expected the {expected} EROFS cases listed in the excludes:\n{text}"
    );
    assert!(ran.iter().all(|l| l.trim_end().ends_with(" ok")), "EROFS cases failed or skipped:\n{text}");
}
