//! The POSIX surface across nodes: copy_file_range, O_TMPFILE, file handles
//! and atime, on three daemons over a 3-member etcd (ACLs: acl.rs).

mod common;

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;

use common::cluster::{eventually, Cluster};
use common::*;

/// A file written on n1 is copied with copy_file_range on n2 (its chunks
/// fetched from n1) and the copy reads whole on n3; a tmpfile written and
/// linked on n2 reads whole on n3; a hole punched on n1 and a range zeroed
/// on n2 read as zeros on n3; a file handle made on
/// n1 opens the file on n2, and goes stale there once n1 unlinks it; a
/// read on n2 moves atime as n1 sees it (relatime).
#[test]
fn copies_handles_and_atime_work_across_nodes() {
    let Some(c) = Cluster::start(3, &[]) else { return };
    let data = pattern((70 << 20) + 999, 31);
    fs::write(c.node(0).path("src"), &data).unwrap();

    let n = copy_range(&c.node(1).path("src"), 0, &c.node(1).path("copy"), 0, data.len());
    assert_eq!(n, data.len());
    drop_caches();
    assert!(fs::read(c.node(2).path("copy")).unwrap() == data, "the copy made on n2 reads whole on n3");
    let stats = common::cluster::xattr_value(&c.node(1).mnt, "user.converged.stats");
    assert!(stats.contains("copy_file_range"), "n2's daemon served the copy: {stats}");

    fs::write(c.node(0).path("h"), b"by handle").unwrap();
    let mut h = FileHandleBuf::of(&c.node(0).path("h"));
    let mut got = String::new();
    h.open(&c.node(1).mnt, libc::O_RDONLY).unwrap().read_to_string(&mut got).unwrap();
    assert_eq!(got, "by handle", "n1's handle opened on n2");
    fs::remove_file(c.node(0).path("h")).unwrap();
    drop_caches();
    eventually(10, "the handle is stale on n2 once n1 unlinked the file", || {
        h.open(&c.node(1).mnt, libc::O_RDONLY).err() == Some(libc::ESTALE)
    });

    // A hole punched on n1 and a range zeroed on n2 (the file's writer now):
    // n3 reads zeros there and the rest unchanged.
    let mut want = data.clone();
    let fallocate = |node: usize, mode: i32, off: usize, len: usize| {
        let f = fs::OpenOptions::new().write(true).open(c.node(node).path("src")).unwrap();
        // SAFETY: fallocate(2) on a descriptor we own.
        let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), mode, off as i64, len as i64) };
        assert_eq!(rc, 0, "fallocate on n{}: {}", node + 1, std::io::Error::last_os_error());
    };
    fallocate(0, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 1 << 20, 3 << 20);
    want[1 << 20..4 << 20].fill(0);
    fallocate(1, libc::FALLOC_FL_ZERO_RANGE, (64 << 20) - 4096, 1 << 20);
    want[(64 << 20) - 4096..(65 << 20) - 4096].fill(0);
    drop_caches();
    assert!(fs::read(c.node(2).path("src")).unwrap() == want, "n3 reads n1's hole and n2's zeroed range");

    // O_TMPFILE on n2, named by linkat there: whole on n3 at once.
    let t = open_tmpfile(&c.node(1).mnt, 0).expect("O_TMPFILE");
    let ckpt = pattern((65 << 20) + 7, 33);
    std::os::unix::fs::FileExt::write_all_at(&t, &ckpt, 0).unwrap();
    link_open_file(&t, &c.node(1).path("ckpt.pt")).unwrap();
    t.sync_all().unwrap();
    drop(t);
    drop_caches();
    assert!(fs::read(c.node(2).path("ckpt.pt")).unwrap() == ckpt, "n2's linked tmpfile reads whole on n3");

    fs::write(c.node(0).path("a"), b"read me").unwrap();
    let before = fs::metadata(c.node(0).path("a")).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    fs::read(c.node(1).path("a")).unwrap();
    eventually(10, "n1 sees the atime n2's read set", || {
        let now = fs::metadata(c.node(0).path("a")).unwrap();
        (now.atime(), now.atime_nsec()) > (before.atime(), before.atime_nsec())
    });
}

/// SEEK_DATA and SEEK_HOLE on n2, where the file's chunks are not (they are
/// on n1): no hole where they are held elsewhere, or cp and tar --sparse
/// would copy zeros there.
#[test]
fn seek_data_finds_no_hole_where_chunks_are_held_elsewhere() {
    // One copy, on the writer: n2 holds none of the file.
    let Some(c) = Cluster::start(2, &["--replicas", "1"]) else { return };
    let s = pattern(70 << 20, 32);
    fs::write(c.node(0).path("s"), &s).unwrap();
    let f = fs::File::open(c.node(1).path("s")).unwrap();
    // SAFETY: lseek on a descriptor we own.
    let (data, hole) = unsafe {
        use std::os::fd::AsRawFd;
        (libc::lseek(f.as_raw_fd(), 0, libc::SEEK_DATA), libc::lseek(f.as_raw_fd(), 0, libc::SEEK_HOLE))
    };
    assert_eq!((data, hole), (0, s.len() as i64), "SEEK_DATA and SEEK_HOLE from 0 on n2");
    drop(f);
}
