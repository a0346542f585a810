//! mount(8) integration: `mount -t converged`, `mount -t fuse.converged`
//! and an fstab line all go through mount.converged.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::*;

fn fstype(mnt: &Path) -> Option<String> {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (Path::new(f[1]) == mnt).then(|| f[2].to_string())
    })
}

fn umount(mnt: &Path) {
    let out = converged().arg("umount").arg(mnt).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The helpers installed, and an empty data dir and mount point (removed with the guard).
fn fresh_dirs() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    install_helpers();
    let t = tempfile::tempdir().unwrap();
    let (data, mnt) = (t.path().join("data"), t.path().join("mnt"));
    fs::create_dir(&data).unwrap();
    fs::create_dir(&mnt).unwrap();
    (t, data, mnt)
}

#[test]
fn mount_t_converged_fuse_converged_and_fstab() {
    let (t, data, mnt) = fresh_dirs();
    let dd = format!("data_dir={}", data.display());

    // The boot path never makes a volume of an empty data dir (a disk that did not mount)...
    let out = Command::new("mount").args(["-t", "converged", "local"]).arg(&mnt).args(["-o", &dd]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no converged identity") && err.contains("new_node"), "{err}");
    assert!(fstype(&mnt).is_none());
    // ...unless told it is new.
    let st = Command::new("mount")
        .args(["-t", "converged", "local"])
        .arg(&mnt)
        .args(["-o", &format!("{dd},new_node")])
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(fstype(&mnt).as_deref(), Some("fuse.converged"));
    fs::write(mnt.join("hello"), b"from mount -t converged").unwrap();
    umount(&mnt);

    let st = Command::new("mount")
        .args(["-t", "fuse.converged", "local"])
        .arg(&mnt)
        .args(["-o", &format!("rw,{dd},verify_reads")])
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(fs::read(mnt.join("hello")).unwrap(), b"from mount -t converged");
    umount(&mnt);

    let fstab = t.path().join("fstab");
    fs::write(&fstab, format!("local {} converged {dd},_netdev,nofail 0 0\n", mnt.display())).unwrap();
    let st = Command::new("mount").arg("-T").arg(&fstab).arg(&mnt).status().unwrap();
    assert!(st.success(), "mount from an fstab line");
    assert_eq!(fs::read(mnt.join("hello")).unwrap(), b"from mount -t converged");
    umount(&mnt);

    let out = Command::new("mount")
        .args(["-t", "converged", "local"])
        .arg(&mnt)
        .args(["-o", &format!("{dd},colour=blue")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("colour=blue"));
    assert!(fstype(&mnt).is_none());
}

/// `mount -o remount,ro` makes a mount read-only in place (EROFS for
/// writes; reads and open files go on), `remount,rw` makes it writable
/// again; both keep the flags not named (nosuid by default, dev as asked
/// with allow_dev). A remount to read-only is refused
/// while a file is open for writing.
#[test]
fn remount_ro_and_rw_in_place() {
    let (_t, data, mnt) = fresh_dirs();
    // allow_dev: mount(8) drops `dev` before it calls the helper.
    let dd = format!("data_dir={},new_node,allow_dev", data.display());
    let st = Command::new("mount").args(["-t", "converged", "converged:named"]).arg(&mnt).args(["-o", &dd]).status();
    assert!(st.unwrap().success());
    // The source is shown as given, so findmnt and umount find the mount by it.
    let out = Command::new("findmnt").args(["-rn", "-S", "converged:named", "-o", "TARGET"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), mnt.to_str().unwrap());
    fs::write(mnt.join("a"), b"before").unwrap();
    let reader = fs::File::open(mnt.join("a")).unwrap();

    let writer = fs::OpenOptions::new().append(true).open(mnt.join("a")).unwrap();
    let out = Command::new("mount").args(["-o", "remount,ro"]).arg(&mnt).output().unwrap();
    assert!(!out.status.success(), "remount,ro with a writer open");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("open for writing"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(writer);

    let out = Command::new("mount").args(["-o", "remount,ro"]).arg(&mnt).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let opts = mount_options(&mnt);
    assert!(opts.starts_with("ro,") && opts.contains("nosuid") && !opts.contains("nodev"), "{opts}");
    assert_eq!(fs::write(mnt.join("b"), b"x").unwrap_err().raw_os_error(), Some(libc::EROFS));
    assert_eq!(fs::remove_file(mnt.join("a")).unwrap_err().raw_os_error(), Some(libc::EROFS));
    let mut got = String::new();
    std::io::Read::read_to_string(&mut &reader, &mut got).unwrap();
    assert_eq!(got, "before", "a file open before the remount reads on");

    let out = Command::new("mount").args(["-o", "remount,rw"]).arg(&mnt).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let opts = mount_options(&mnt);
    assert!(opts.starts_with("rw,") && opts.contains("nosuid"), "{opts}");
    fs::write(mnt.join("b"), b"after").unwrap();
    drop(reader);
    let st = Command::new("umount").arg("converged:named").status().unwrap();
    assert!(st.success(), "umount by source");
    assert!(fstype(&mnt).is_none());
}

fn mount_options(mnt: &Path) -> String {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (Path::new(f[1]) == mnt).then(|| f[3].to_string())
        })
        .unwrap_or_default()
}
