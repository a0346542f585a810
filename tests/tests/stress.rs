//! Sixteen processes of random file operations on the same few names,
//! through a real kernel mount, for a minute: none of them may stall.
//!
//! A lock-order deadlock in the daemon does not fail an operation, it hangs
//! the processes touching the mount in uninterruptible FUSE waits (and the
//! test with them). `python/stress.py` watches its workers' progress and
//! exits with status 3 and the daemon's thread stacks when one stops moving;
//! this test then aborts the FUSE connection, kills what is left and fails
//! with that report, so a hang ends as a failed test, not a stuck machine.
//! `STRESS_SECONDS` and `STRESS_SEED` change the run's length and seed.

mod common;

use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

const PROCS: u32 = 16;
const STALL_SECS: u64 = 30;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Wait for `child` until `deadline`; `None` when it is still running then.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().expect("wait for stress.py") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Run `f` on its own thread, giving up after `limit` (it may be stuck on
/// the mount).
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// The mount still answers after the run: a listing of the root and a new
/// file written and read back.
fn mount_answers(mnt: PathBuf) -> Result<(), String> {
    let names = fs::read_dir(&mnt).map_err(|e| format!("readdir: {e}"))?.count();
    if names < 4 {
        return Err(format!("root lists {names} entries, want d0..d3"));
    }
    let data = pattern(300_000, 42);
    fs::write(mnt.join("after-stress"), &data).map_err(|e| format!("write: {e}"))?;
    let got = fs::read(mnt.join("after-stress")).map_err(|e| format!("read: {e}"))?;
    if got != data {
        return Err("a file written after the run reads back different bytes".into());
    }
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The first `head` and last `tail` lines of `text` (a report that went
/// wrong can be long).
fn clip(text: &str, head: usize, tail: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    if all.len() <= head + tail {
        return text.to_string();
    }
    let left_out = all.len() - head - tail;
    format!("{}\n[... {left_out} lines left out ...]\n{}", all[..head].join("\n"), all[all.len() - tail..].join("\n"))
}

#[test]
fn sixteen_processes_of_random_operations_never_stall() {
    let seconds = env_or("STRESS_SECONDS", 60);
    let seed = env_or("STRESS_SEED", 1);
    let mut m = Mount::new();
    // Before anything can hang the mount: stat of a stuck mount blocks too.
    let dev = fs::metadata(&m.mnt).unwrap().dev();
    let daemon = m.daemon_pid();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/stress.py");
    // To a file, not a pipe: stuck workers would hold a pipe open.
    let out_path = m.root.path().join("stress.out");
    let out = File::create(&out_path).unwrap();
    let mut child = Command::new("python3")
        .arg(&script)
        .arg(&m.mnt)
        .args(["--procs", &PROCS.to_string(), "--seconds", &seconds.to_string()])
        .args(["--stall", &STALL_SECS.to_string(), "--daemon-pid", &daemon.to_string()])
        .args(["--seed", &seed.to_string()])
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        // Its own process group: the workers can be killed together.
        .process_group(0)
        .spawn()
        .expect("run python3 tests/python/stress.py");
    let pgid = child.id() as i32;
    // The script stops itself; this bounds a script that does not (a stall
    // found late, then up to two minutes of gdb on the daemon).
    let deadline = Instant::now() + Duration::from_secs(seconds + STALL_SECS + 180);
    let status = wait_until(&mut child, deadline);

    let mut problem = match status {
        Some(s) if s.success() => None,
        Some(s) => Some(format!("stress.py failed ({s})")),
        None => Some(format!("stress.py still running after {}s", seconds + STALL_SECS + 180)),
    };
    if problem.is_none() {
        let mnt = m.mnt.clone();
        match bounded(Duration::from_secs(60), move || mount_answers(mnt)) {
            Some(Ok(())) => {}
            Some(Err(e)) => problem = Some(format!("the mount is wrong after the run: {e}")),
            None => problem = Some("the mount does not answer after the run".into()),
        }
    }
    if let Some(problem) = problem {
        // The workers die as soon as the abort ends their FUSE waits.
        // SAFETY: kill(2) of the script's process group (it and its workers).
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let aborted = abort_connection(dev, &m.mnt);
        let _ = child.wait();
        m.crash();
        let report = clip(&fs::read_to_string(&out_path).unwrap_or_default(), 2000, 200);
        panic!(
            "{problem} (seed {seed}); {aborted}\n--- stress.py ---\n{report}\n--- daemon log (tail) ---\n{}",
            tail(&m.log(), 80)
        );
    }
    let report = fs::read_to_string(&out_path).unwrap();
    eprintln!("{}", tail(&report, 1));
    assert!(report.contains(" failures=0"), "{report}");
    assert!(!m.log().contains("panicked"), "the daemon panicked:\n{}", tail(&m.log(), 80));
}
