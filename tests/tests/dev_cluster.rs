//! `converged dev-cluster`: etcd and three nodes on one machine, as the
//! README's demo runs it; files cross between its mount points, and SIGTERM
//! takes everything down.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::*;

#[test]
fn dev_cluster_mounts_three_nodes_that_share_files() {
    if !Path::new("/usr/bin/etcd").exists() {
        assert!(std::env::var_os("CI").is_none(), "etcd must be installed in CI (apt-get install etcd-server)");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("dev");
    let mut child = converged()
        .args(["dev-cluster", "--nodes", "3", "--dir"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    loop {
        let line = lines.next().unwrap_or_else(|| panic!("dev-cluster exited early; said: {seen:?}")).unwrap();
        let ready = line.starts_with("dev-cluster ready");
        seen.push(line);
        if ready {
            break;
        }
    }
    let mnt = |n: u32| dir.join(format!("n{n}/mnt"));
    let data = pattern((9 << 20) + 3, 21);
    std::fs::write(mnt(1).join("hello.bin"), &data).unwrap();
    assert!(std::fs::read(mnt(3).join("hello.bin")).unwrap() == data, "n3 reads what n1 wrote");
    let status = converged().args(["status", "--meta"]).arg(seen.iter().find_map(|l| meta_of(l)).unwrap()).output();
    let status = String::from_utf8_lossy(&status.unwrap().stdout).into_owned();
    assert!(status.contains("3 live, 0 dead"), "{status}");

    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let exit = child.wait().unwrap();
    assert!(exit.success(), "{exit}");
    std::thread::sleep(Duration::from_millis(100));
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(dir.to_str().unwrap()), "every node unmounted");
}

fn meta_of(line: &str) -> Option<String> {
    line.strip_prefix("metadata: ")?.split_whitespace().next().map(str::to_string)
}
