//! A full data disk: the writer gets ENOSPC and the namespace stays intact.

mod common;

use std::fs::{self, File};
use std::io::Write;
use std::process::Command;

use common::*;

struct Tmpfs(std::path::PathBuf);
impl Drop for Tmpfs {
    fn drop(&mut self) {
        lazy_umount(&self.0);
    }
}

#[test]
fn full_data_disk_returns_enospc_and_keeps_the_namespace() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let mnt = root.path().join("mnt");
    fs::create_dir(&data).unwrap();
    fs::create_dir(&mnt).unwrap();
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=48m", "tmpfs"]).arg(&data).status().unwrap();
    assert!(ok.success(), "mount tmpfs");
    let _t = Tmpfs(data.clone());
    let out = converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&data).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let _m = scopeguard(&mnt);

    fs::create_dir(mnt.join("keep")).unwrap();
    fs::write(mnt.join("keep/a"), pattern(1 << 20, 1)).unwrap();

    let mut f = File::create(mnt.join("big")).unwrap();
    let chunk = pattern(1 << 20, 2);
    let mut err = None;
    for _ in 0..100 {
        if let Err(e) = f.write_all(&chunk) {
            err = Some(e);
            break;
        }
    }
    let err = err.or_else(|| f.sync_all().err()).expect("writing 100 MiB to a 48 MiB disk must fail");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(f);

    // The namespace is intact and usable.
    assert_eq!(fs::read(mnt.join("keep/a")).unwrap(), pattern(1 << 20, 1));
    let names: Vec<_> = fs::read_dir(&mnt).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    fs::remove_file(mnt.join("big")).unwrap();
    // Space comes back once the removal is durable (a flush, within a second or so).
    let mut written = Err(std::io::Error::other("not tried"));
    for _ in 0..50 {
        written = fs::write(mnt.join("after"), pattern(8 << 20, 3));
        if written.is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    written.unwrap();
    assert_eq!(fs::read(mnt.join("after")).unwrap(), pattern(8 << 20, 3));
}

struct Unmount(std::path::PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = converged().arg("umount").arg(&self.0).output();
    }
}
fn scopeguard(p: &std::path::Path) -> Unmount {
    Unmount(p.to_path_buf())
}
