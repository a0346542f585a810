//! Bad options and URIs: one clear message naming the problem, a non-zero
//! exit, and nothing created.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::*;

fn mount_fails(args: &[&std::ffi::OsStr], want: &str) {
    let out = converged().arg("mount").args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mount {args:?} succeeded");
    assert!(err.contains(want), "mount {args:?}: expected {want:?} in: {err}");
}

fn entries(p: &Path) -> usize {
    fs::read_dir(p).map(|d| d.count()).unwrap_or(0)
}

#[test]
fn bad_mount_arguments_are_refused_and_create_nothing() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data");
    let mnt = t.path().join("mnt");
    fs::create_dir(&data).unwrap();
    fs::create_dir(&mnt).unwrap();
    let missing = t.path().join("missing");
    let file = t.path().join("file");
    fs::write(&file, b"").unwrap();
    let o = |p: &Path| p.as_os_str().to_owned();

    mount_fails(&[&o(&mnt), "--data-dir".as_ref(), &o(&missing)], "does not exist");
    assert!(!missing.exists(), "missing data dir was not created");
    mount_fails(&[&o(&mnt), "--data-dir".as_ref(), &o(&file)], "is not a directory");
    mount_fails(&[&o(&missing), "--data-dir".as_ref(), &o(&data)], "mount point");
    mount_fails(&[&o(&file), "--data-dir".as_ref(), &o(&data)], "is not a directory");
    mount_fails(&[&o(&mnt), "--data-dir".as_ref(), &o(&data), "--meta".as_ref(), "nonsense".as_ref()], "no scheme");
    mount_fails(
        &[&o(&mnt), "--data-dir".as_ref(), &o(&data), "--meta".as_ref(), "tikv://h:1/x".as_ref()],
        "unknown scheme",
    );
    mount_fails(
        &[&o(&mnt), "--data-dir".as_ref(), &o(&data), "--meta".as_ref(), "redb://relative/x".as_ref()],
        "absolute path",
    );
    mount_fails(&[&o(&mnt), "--data-dir".as_ref(), &o(&data), "--bogus".as_ref()], "--bogus");
    mount_fails(&[&o(&mnt), "--data-dir".as_ref(), &o(&data), "--threads".as_ref(), "0".as_ref()], "threads");
    let with = |extra: &[&str]| -> Vec<std::ffi::OsString> {
        let mut v = vec![o(&mnt), "--data-dir".into(), o(&data)];
        v.extend(extra.iter().map(std::ffi::OsString::from));
        v
    };
    let fails = |extra: &[&str], want: &str| {
        let args = with(extra);
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        mount_fails(&refs, want);
    };
    fails(&["--object-store", "ftp://host/x"], "unsupported scheme");
    fails(&["--object-store", "s3:///no-bucket"], "no bucket name");
    fails(&["--object-store", "s3://b/a/../c"], "component");
    fails(&["--object-store", "not a uri"], "--object-store");
    fails(&["--object-store", "file:///tmp/o", "--backfill-delay", "5x"], "duration unit");
    fails(&["--object-store", "file:///tmp/o", "--evict-low", "95", "--evict-high", "90"], "low below high");
    assert_eq!(entries(&data), 0, "nothing created in the data dir");
    assert_eq!(entries(&mnt), 0);

    // A read-only data disk.
    let ro = t.path().join("ro");
    fs::create_dir(&ro).unwrap();
    assert!(Command::new("mount")
        .args(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"])
        .arg(&ro)
        .status()
        .unwrap()
        .success());
    mount_fails(&[&o(&mnt), "--data-dir".as_ref(), &o(&ro)], "is not writable");
    lazy_umount(&ro);

    // Already mounted.
    let m = Mount::new();
    mount_fails(&[&o(&m.mnt), "--data-dir".as_ref(), &o(&data)], "already mounted");
    // The same data dir under a second mount point: refused by its lock.
    mount_fails(&[&o(&mnt), "--data-dir".as_ref(), &o(&m.data)], "in use");
    assert_eq!(entries(&data), 0);
}

#[test]
fn umount_of_something_not_mounted_says_so() {
    let t = tempfile::tempdir().unwrap();
    let out = converged().arg("umount").arg(t.path()).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not mounted"));
}

#[test]
fn help_explains_every_option() {
    let out = converged().args(["mount", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for opt in [
        "--data-dir",
        "--meta",
        "--foreground",
        "--verify-reads",
        "--threads",
        "--attr-timeout",
        "--object-store",
        "--s3-endpoint",
        "--backfill-delay",
        "--evict-high",
    ] {
        assert!(help.contains(opt), "--help lacks {opt}");
    }
}

/// Output to a pipe whose reader is gone (`converged status --meta URI |
/// grep -q dead` once grep has matched) ends quietly: no panic, no
/// backtrace.
#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = converged()
        .args(["status", "--meta", "memory:"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");
}
