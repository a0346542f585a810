//! One suite per trait, run against every backend: the `KvEngine` contract
//! and the namespace operations, on `MemKv` and on `RedbKv` (a real file).

use std::sync::Arc;
use std::time::Duration;

use converged_metadata::kv::{Durability, KvEngine, KvError};
use converged_metadata::kv_fault::{Fault, FaultyKv};
use converged_metadata::types::*;
use converged_metadata::{MemKv, MetaError, Namespace, RedbKv, ROOT};

fn engines() -> Vec<(&'static str, Arc<dyn KvEngine>, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let redb = RedbKv::open(&dir.path().join("meta.redb"), Duration::from_secs(1)).unwrap();
    vec![("memory", Arc::new(MemKv::new()), None), ("redb", Arc::new(redb), Some(dir))]
}

// ---- KvEngine contract ----

#[test]
fn kv_commit_is_atomic_and_abort_discards() {
    for (name, kv, _d) in engines() {
        let mut t = kv.write_txn().unwrap();
        t.put(b"a", b"1");
        t.put(b"b", b"2");
        assert_eq!(t.get(b"a").unwrap().as_deref(), Some(&b"1"[..]), "{name}: reads its own writes");
        drop(t); // abort
        assert_eq!(kv.read_txn().unwrap().get(b"a").unwrap(), None, "{name}: abort discards");
        let mut t = kv.write_txn().unwrap();
        t.put(b"a", b"1");
        t.put(b"b", b"2");
        t.commit(Durability::Buffered).unwrap();
        let mut r = kv.read_txn().unwrap();
        assert_eq!(r.get(b"b").unwrap().as_deref(), Some(&b"2"[..]), "{name}");
    }
}

#[test]
fn kv_scan_is_ordered_bounded_and_sees_pending_writes() {
    for (name, kv, _d) in engines() {
        let mut t = kv.write_txn().unwrap();
        for i in [5u8, 1, 9, 3, 7] {
            t.put(&[b'k', i], &[i]);
        }
        t.put(b"z", b"outside");
        t.commit(Durability::Durable).unwrap();
        let mut t = kv.write_txn().unwrap();
        t.delete(&[b'k', 3]);
        t.put(&[b'k', 4], &[4]);
        let got: Vec<u8> = t.scan(b"k", b"l", 10).unwrap().into_iter().map(|(k, _)| k[1]).collect();
        assert_eq!(got, vec![1, 4, 5, 7, 9], "{name}: merged view in order");
        let got = t.scan(b"k", b"l", 2).unwrap();
        assert_eq!(got.len(), 2, "{name}: limit");
        t.commit(Durability::Buffered).unwrap();
        kv.sync().unwrap();
        let got: Vec<u8> =
            kv.read_txn().unwrap().scan(&[b'k', 4], &[b'k', 8], 10).unwrap().into_iter().map(|(k, _)| k[1]).collect();
        assert_eq!(got, vec![4, 5, 7], "{name}: [start, end)");
    }
}

#[test]
fn redb_keeps_commits_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.redb");
    {
        let kv = RedbKv::open(&path, Duration::from_secs(1)).unwrap();
        let mut t = kv.write_txn().unwrap();
        t.put(b"k", b"v");
        t.commit(Durability::Durable).unwrap();
    }
    let kv = RedbKv::open(&path, Duration::from_secs(1)).unwrap();
    assert_eq!(kv.read_txn().unwrap().get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
}

// ---- namespace suite ----

fn ns(kv: Arc<dyn KvEngine>) -> Namespace {
    Namespace::open(kv, 0, 0).unwrap()
}

fn file(perm: u16) -> NewNode<'static> {
    NewNode { kind: FileKind::Regular, perm, uid: 1, gid: 2, rdev: 0, target: None, unsealed: false }
}

fn dir() -> NewNode<'static> {
    NewNode { kind: FileKind::Directory, perm: 0o755, uid: 0, gid: 0, rdev: 0, target: None, unsealed: false }
}

fn errno<T: std::fmt::Debug>(r: Result<T, MetaError>) -> i32 {
    r.unwrap_err().errno()
}

#[test]
fn namespace_create_lookup_link_unlink() {
    for (name, kv, _d) in engines() {
        let ns = ns(kv);
        let f = ns.mknod(ROOT, b"f", &file(0o644)).unwrap();
        assert_eq!(ns.lookup(ROOT, b"f").unwrap().ino, f.ino, "{name}");
        assert_eq!(errno(ns.mknod(ROOT, b"f", &file(0o644))), libc::EEXIST, "{name}");
        assert_eq!(errno(ns.mknod(ROOT, &[b'x'; 256], &file(0o644))), libc::ENAMETOOLONG, "{name}");
        assert_eq!(errno(ns.lookup(ROOT, b"nope")), libc::ENOENT, "{name}");
        let d = ns.mknod(ROOT, b"d", &dir()).unwrap();
        assert_eq!(ns.getattr(ROOT).unwrap().nlink, 3, "{name}: root has . .. and d");
        assert_eq!(ns.link(f.ino, d.ino, b"g").unwrap().nlink, 2, "{name}");
        assert_eq!(errno(ns.link(d.ino, ROOT, b"dd")), libc::EPERM, "{name}");
        let gone = ns.unlink(ROOT, b"f").unwrap();
        assert!(!gone.orphaned, "{name}: still linked as d/g");
        let gone = ns.unlink(d.ino, b"g").unwrap();
        assert!(gone.orphaned, "{name}");
        assert_eq!(ns.orphans().unwrap(), vec![f.ino], "{name}");
        assert!(ns.purge(f.ino).unwrap(), "{name}");
        assert_eq!(errno(ns.getattr(f.ino)), libc::ENOENT, "{name}");
        assert!(ns.orphans().unwrap().is_empty(), "{name}");
        assert_eq!(errno(ns.unlink(ROOT, b"d")), libc::EISDIR, "{name}");
        ns.rmdir(ROOT, b"d").unwrap();
        assert_eq!(ns.getattr(ROOT).unwrap().nlink, 2, "{name}");
    }
}

#[test]
fn namespace_rename_rules() {
    for (name, kv, _d) in engines() {
        let ns = ns(kv);
        let a = ns.mknod(ROOT, b"a", &dir()).unwrap();
        let b = ns.mknod(a.ino, b"b", &dir()).unwrap();
        ns.mknod(b.ino, b"f", &file(0o600)).unwrap();
        let e = ns.mknod(ROOT, b"e", &dir()).unwrap();
        assert_eq!(errno(ns.rename(ROOT, b"a", b.ino, b"x", RenameMode::Replace)), libc::EINVAL, "{name}: into itself");
        assert_eq!(errno(ns.rename(a.ino, b"b", ROOT, b"e", RenameMode::NoReplace)), libc::EEXIST, "{name}");
        ns.rename(a.ino, b"b", ROOT, b"e", RenameMode::Replace).unwrap();
        assert_eq!(errno(ns.getattr(e.ino)), libc::ENOENT, "{name}: empty dir replaced");
        assert_eq!(ns.lookup(ROOT, b"e").unwrap().ino, b.ino, "{name}");
        assert_eq!(ns.getattr(b.ino).unwrap().parent, ROOT, "{name}");
        assert_eq!(ns.getattr(a.ino).unwrap().nlink, 2, "{name}: a lost its subdir");
        let g = ns.mknod(a.ino, b"g", &file(0o600)).unwrap();
        ns.rename(a.ino, b"g", b.ino, b"f", RenameMode::Exchange).unwrap();
        assert_eq!(ns.lookup(b.ino, b"f").unwrap().ino, g.ino, "{name}: exchanged");
        let victim = ns.rename(b.ino, b"f", a.ino, b"g", RenameMode::Replace).unwrap();
        assert!(victim.is_some_and(|v| v.orphaned), "{name}: replaced file is orphaned");
        assert_eq!(errno(ns.rename(ROOT, b"e", ROOT, b"a", RenameMode::Replace)), libc::ENOTEMPTY, "{name}");
    }
}

#[test]
fn namespace_setattr_xattr_and_seal() {
    for (name, kv, _d) in engines() {
        let ns = ns(kv);
        let f = ns.mknod(ROOT, b"f", &file(0o644)).unwrap();
        let t = Timespec { sec: 12345, nsec: 678 };
        let set = SetAttr { mode: Some(0o4700), uid: Some(7), mtime: Some(TimeSet::At(t)), ..Default::default() };
        let i = ns.setattr(f.ino, &set).unwrap();
        assert_eq!((i.perm, i.uid, i.mtime), (0o4700, 7, t), "{name}");
        ns.setxattr(f.ino, b"user.k", b"v", XattrMode::Create).unwrap();
        assert_eq!(errno(ns.setxattr(f.ino, b"user.k", b"v", XattrMode::Create)), libc::EEXIST, "{name}");
        assert_eq!(errno(ns.setxattr(f.ino, b"user.n", b"v", XattrMode::Replace)), libc::ENODATA, "{name}");
        assert_eq!(ns.listxattr(f.ino).unwrap(), b"user.k\0", "{name}");
        let record = ChunkRecord { version: 1, len: 100, replicas: vec!["n1".into()], block_crcs: vec![42] };
        ns.mark_unsealed(f.ino).unwrap();
        assert_eq!(ns.unsealed().unwrap(), vec![f.ino], "{name}");
        let seal =
            converged_metadata::Seal { size: 100, mtime: t, chunks: vec![(0, record.clone())], keep_unsealed: false };
        ns.seal(f.ino, &seal, Durability::Durable).unwrap();
        assert!(ns.unsealed().unwrap().is_empty(), "{name}");
        assert_eq!(ns.chunks(f.ino).unwrap(), vec![(0, record)], "{name}");
        assert_eq!(ns.getattr(f.ino).unwrap().size, 100, "{name}");
        ns.setattr(f.ino, &SetAttr { size: Some(0), ..Default::default() }).unwrap();
        assert!(ns.chunks(f.ino).unwrap().is_empty(), "{name}: truncate drops chunk records");
    }
}

#[test]
fn large_directories_list_in_pages() {
    for (name, kv, _d) in engines() {
        let ns = ns(kv);
        for i in 0..2500 {
            ns.mknod(ROOT, format!("f{i:05}").as_bytes(), &file(0o644)).unwrap();
        }
        let names = ns.readdir(ROOT).unwrap();
        assert_eq!(names.len(), 2500, "{name}");
        assert!(names.windows(2).all(|w| w[0].0 < w[1].0), "{name}: ordered");
    }
}

// ---- faults ----

#[test]
fn conflicts_are_retried_and_full_disks_reported() {
    let faulty = Arc::new(FaultyKv::new(Arc::new(MemKv::new())));
    let ns = Namespace::open(faulty.clone(), 0, 0).unwrap();
    faulty.fail_next(Fault::Conflict, 3);
    ns.mknod(ROOT, b"a", &file(0o644)).unwrap();
    assert_eq!(faulty.injected.load(std::sync::atomic::Ordering::SeqCst), 3, "three conflicts, then success");
    assert!(ns.lookup(ROOT, b"a").is_ok());
    faulty.fail_next(Fault::NoSpace, 1);
    let e = ns.mknod(ROOT, b"b", &file(0o644)).unwrap_err();
    assert!(matches!(e, MetaError::Kv(KvError::NoSpace)));
    assert_eq!(e.errno(), libc::ENOSPC);
    assert_eq!(errno(ns.lookup(ROOT, b"b")), libc::ENOENT, "a failed commit leaves nothing behind");
}

#[test]
fn no_space_handler_gets_one_retry() {
    let faulty = Arc::new(FaultyKv::new(Arc::new(MemKv::new())));
    let ns = Namespace::open(faulty.clone(), 0, 0).unwrap();
    let freed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f2 = freed.clone();
    ns.set_no_space_handler(move || !f2.swap(true, std::sync::atomic::Ordering::SeqCst));
    faulty.fail_next(Fault::NoSpace, 1);
    ns.mknod(ROOT, b"a", &file(0o644)).unwrap();
    assert!(freed.load(std::sync::atomic::Ordering::SeqCst));
}
