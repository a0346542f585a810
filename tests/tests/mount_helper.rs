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

#[test]
fn mount_t_converged_fuse_converged_and_fstab() {
    install_helpers();
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data");
    let mnt = t.path().join("mnt");
    fs::create_dir(&data).unwrap();
    fs::create_dir(&mnt).unwrap();
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
