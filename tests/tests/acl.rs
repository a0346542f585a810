//! POSIX ACLs through the kernel (setfacl and getfacl, the permission
//! checks of a process running as `nobody`), on one node and across nodes.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use common::cluster::{eventually, Cluster};
use common::*;

fn setfacl(args: &[&str], path: &Path) {
    let out = Command::new("setfacl").args(args).arg(path).output().unwrap();
    assert!(out.status.success(), "setfacl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn getfacl(path: &Path) -> String {
    let out = Command::new("getfacl").args(["-cp"]).arg(path).output().unwrap();
    assert!(out.status.success(), "getfacl: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run `sh -c script` as nobody (uid and gid 65534, no other groups):
/// whether it succeeded.
fn as_nobody(script: &str) -> bool {
    Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups", "sh", "-c", script])
        .output()
        .unwrap()
        .status
        .success()
}

fn reachable(root: &Path) {
    fs::set_permissions(root, fs::Permissions::from_mode(0o755)).unwrap();
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().mode() & 0o7777
}

/// A named-user entry lets nobody read a 0640 file, and its mask limits
/// it; chmod rewrites the mask; a directory's default ACL is inherited
/// by a file and a directory made in it, in place of the umask; the ACLs
/// stay across a remount; removing an entry takes the access away.
#[test]
fn acls_are_enforced_inherited_and_kept() {
    let mut m = Mount::new();
    reachable(m.root.path());
    reachable(&m.mnt);
    let f = m.path("f");
    fs::write(&f, b"secret").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
    let cat = format!("cat {} >/dev/null", f.display());
    assert!(!as_nobody(&cat), "nobody reads a 0640 root file");
    setfacl(&["-m", "u:nobody:r"], &f);
    assert!(as_nobody(&cat), "a named-user entry lets nobody read: {}", getfacl(&f));
    assert_eq!(mode(&f), 0o640, "the group class shows the mask (r--)");
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
    assert!(getfacl(&f).contains("mask::---"), "chmod rewrites the mask: {}", getfacl(&f));
    assert!(!as_nobody(&cat), "the mask limits the named entry");
    fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
    assert!(as_nobody(&cat));

    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    setfacl(&["-d", "-m", "u:nobody:rwx,g::rx,o::-"], &d);
    setfacl(&["-m", "u:nobody:rwx"], &d);
    assert!(as_nobody(&format!("echo hi > {}/by-nobody", d.display())), "nobody writes in the directory");
    // Made by root with umask 022: the default ACL applies, not the umask.
    let made = Command::new("sh")
        .args(["-c", &format!("umask 022 && touch {0}/g && mkdir {0}/sub", d.display())])
        .status()
        .unwrap();
    assert!(made.success());
    let g = getfacl(&d.join("g"));
    assert!(g.contains("user:nobody:rwx") && g.contains("mask::rw-") && g.contains("other::---"), "{g}");
    assert_eq!(mode(&d.join("g")), 0o660);
    let sub = getfacl(&d.join("sub"));
    assert!(sub.contains("default:user:nobody:rwx"), "a new directory keeps the default ACL: {sub}");
    // No default ACL: the umask applies.
    let plain = Command::new("sh").args(["-c", &format!("umask 027 && touch {}", m.path("plain").display())]).status();
    assert!(plain.unwrap().success());
    assert_eq!(mode(&m.path("plain")), 0o640);

    m.umount();
    m.mount();
    assert!(as_nobody(&cat), "after a remount: {}", getfacl(&f));
    assert!(getfacl(&d.join("g")).contains("user:nobody:rwx"));
    setfacl(&["-x", "u:nobody"], &f);
    assert!(!as_nobody(&cat), "the entry removed: {}", getfacl(&f));
}

/// Setting an access ACL as a user outside the file's group (and not root)
/// clears set-group-ID; root keeps it.
#[test]
fn setting_an_acl_outside_the_files_group_clears_setgid() {
    let m = Mount::new();
    reachable(m.root.path());
    reachable(&m.mnt);
    let f = m.path("f");
    fs::write(&f, b"x").unwrap();
    std::os::unix::fs::chown(&f, Some(65534), Some(0)).unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o2775)).unwrap();
    setfacl(&["-m", "u:daemon:r"], &f);
    assert_eq!(mode(&f) & 0o2000, 0o2000, "root keeps set-group-ID");
    assert!(as_nobody(&format!("setfacl -m u:daemon:rw {}", f.display())), "the owner sets an ACL");
    assert_eq!(mode(&f) & 0o2000, 0, "set-group-ID cleared: nobody is not in group root");
}

/// An ACL set on one node is enforced on another at once, and so is its
/// removal (the other kernel drops the ACL it cached).
#[test]
fn an_acl_set_on_one_node_is_enforced_on_another() {
    let Some(c) = Cluster::start(2, &[]) else { return };
    for n in &c.nodes {
        reachable(n.root.path());
        reachable(&n.mnt);
    }
    let f = c.node(0).path("shared");
    fs::write(&f, b"from n1").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
    let on_n2 = format!("cat {} >/dev/null", c.node(1).path("shared").display());
    eventually(10, "n2 sees the file", || c.node(1).path("shared").exists());
    assert!(!as_nobody(&on_n2), "nobody reads a 0600 file on n2");
    setfacl(&["-m", "u:nobody:r"], &f);
    eventually(10, "the ACL set on n1 lets nobody read on n2", || as_nobody(&on_n2));
    setfacl(&["-x", "u:nobody"], &f);
    eventually(10, "the ACL removed on n1 is enforced on n2", || !as_nobody(&on_n2));
}
