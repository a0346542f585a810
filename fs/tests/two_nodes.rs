//! Cluster behaviour in one process: two or three filesystem cores, peers of
//! each other (the harness's [`TestCluster`]: shared in-memory metadata, a
//! [`converged_transport::MemNetwork`], a faulty transport per node the
//! tests use to make a peer unreachable or corrupt on purpose).

mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_fs::core::Core;
use converged_fs::error::FsResult;
use converged_metadata::kv_fault::Fault;
use converged_metadata::types::{FileKind, Ino, NewNode, XattrMode, LAYOUT_XATTR, REPLICAS_XATTR};
use converged_metadata::ROOT;
use converged_transport::PeerFault;
use harness::cluster::{pattern, TestCluster, CHUNK};
use object_store::memory::InMemory;

/// Bytes asked for by each read, as the kernel would (max_read).
const READ_PIECE: u32 = 128 << 10;

/// What the kernel asks for on open(O_CREAT) for writing.
fn file_node() -> NewNode<'static> {
    NewNode { unsealed: true, ..NewNode::plain(FileKind::Regular, 0o644) }
}

fn dir_node() -> NewNode<'static> {
    NewNode::plain(FileKind::Directory, 0o755)
}

/// Write `data` at `offset` through a handle, one MiB per call (max_write).
fn write_all(core: &Core, fh: u64, offset: u64, data: &[u8]) -> FsResult<()> {
    for (i, piece) in data.chunks(1 << 20).enumerate() {
        let n = core.write(fh, offset + (i << 20) as u64, piece)?;
        assert_eq!(n as usize, piece.len(), "short write through the core");
    }
    Ok(())
}

/// open(O_CREAT|O_EXCL|O_WRONLY) in `parent`, write, close, release.
/// create, write, close, release, then the node's flush (its flusher's
/// work, every second in a daemon; no worker runs here), which gives up the
/// write lease of a file its close published.
fn create_in(core: &Core, parent: Ino, name: &str, data: &[u8]) -> FsResult<Ino> {
    let (attr, opened) = core.create(parent, name.as_bytes(), &file_node())?;
    let written = write_all(core, opened.fh, 0, data).and_then(|()| core.close(opened.fh).map(|_| ()));
    let released = core.release(opened.fh);
    written.and(released)?;
    core.flush()?;
    Ok(attr.ino)
}

fn create(core: &Core, name: &str, data: &[u8]) -> FsResult<Ino> {
    create_in(core, ROOT, name, data)
}

/// open(O_WRONLY), pwrite at `offset`, close, release, and the node's
/// flush (as [`create_in`]).
fn overwrite(core: &Core, ino: Ino, offset: u64, data: &[u8]) -> FsResult<()> {
    let fh = core.open(ino, true)?.fh;
    let written = write_all(core, fh, offset, data).and_then(|()| core.close(fh).map(|_| ()));
    let released = core.release(fh);
    written.and(released)?;
    core.flush()
}

/// open(O_RDONLY), read `[offset, offset + len)` (less at the end), release.
fn read_range(core: &Core, ino: Ino, offset: u64, len: u64) -> FsResult<Vec<u8>> {
    let fh = core.open(ino, false)?.fh;
    let mut out = Vec::new();
    let r = loop {
        let want = (len - out.len() as u64).min(READ_PIECE as u64) as u32;
        if want == 0 {
            break Ok(());
        }
        match core.read(fh, offset + out.len() as u64, want) {
            Ok(piece) if piece.is_empty() => break Ok(()),
            Ok(piece) => out.extend_from_slice(&piece),
            Err(e) => break Err(e),
        }
    };
    let released = core.release(fh);
    r?;
    released?;
    Ok(out)
}

/// open(O_RDONLY), read to the end, release.
fn read_all(core: &Core, ino: Ino) -> FsResult<Vec<u8>> {
    read_range(core, ino, 0, u64::MAX)
}

/// The errno a result failed with, for messages that name the bytes, not dump them.
fn errno<T>(r: FsResult<T>) -> Result<T, i32> {
    r.map_err(|e| e.errno())
}

/// Each chunk's holders, by index, from the metadata.
fn holders(core: &Core, ino: Ino) -> Vec<Vec<String>> {
    core.namespace().chunks(ino).unwrap().into_iter().map(|(_, r)| r.replicas).collect()
}

/// The `user.converged.layout` attribute: one line per chunk, `index vN len holders`.
fn layout(core: &Core, ino: Ino) -> String {
    String::from_utf8(core.getxattr(ino, LAYOUT_XATTR).unwrap()).unwrap()
}

fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(at) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!("{what}: bytes differ from offset {at}");
    }
}

#[test]
fn a_file_closed_on_one_node_reads_back_on_the_other_from_its_own_copy() {
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    let data = pattern(1, 2 * CHUNK + 12_345);
    let ino = create(a, "ckpt.pt", &data).unwrap();

    // Close-to-open: an open on b after a's close sees the file whole.
    let attr = b.lookup(ROOT, b"ckpt.pt").unwrap();
    assert_eq!((attr.ino, attr.size), (ino, data.len() as u64));
    assert_same(&read_all(b, ino).unwrap(), &data, "read on b");

    // Both copies were written before close returned: the writer's and b's.
    let h = holders(b, ino);
    assert_eq!(h.len(), 3);
    for (i, chunk) in h.iter().enumerate() {
        assert_eq!(chunk, &["a", "b"], "chunk {i}");
    }
    let lines: Vec<String> = layout(b, ino).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines.iter().all(|l| l.ends_with(" a,b")), "{lines:?}");
    assert!(lines[2].contains(" 12345 "), "the last chunk is short: {lines:?}");

    // b's reads are its own copy's: they do not need a.
    c.node("b").faults.set("a", Some(PeerFault::Down));
    assert_same(&read_all(b, ino).unwrap(), &data, "read on b with a down");
}

#[test]
fn chunks_only_another_node_holds_are_read_from_it() {
    let c = TestCluster::start(&["a", "b"], 1);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    let data = pattern(2, 3 * CHUNK);
    let ino = create(a, "only-on-a", &data).unwrap();
    assert_eq!(holders(b, ino), vec![vec!["a".to_string()]; 3], "one copy, the writer's");

    assert_same(&read_all(b, ino).unwrap(), &data, "remote read on b");
    // Any range, not only from the start: across the first chunk boundary,
    // and within the last chunk.
    let from = CHUNK as u64 - 1000;
    assert_same(&read_range(b, ino, from, 5000).unwrap(), &data[from as usize..from as usize + 5000], "a range");
    let from = 2 * CHUNK as u64 + 77;
    assert_same(&read_range(b, ino, from, 100).unwrap(), &data[from as usize..from as usize + 100], "the last chunk");
    assert_eq!(holders(b, ino), vec![vec!["a".to_string()]; 3], "a read copies nothing in");

    // It came from a: with a unreachable it cannot be read.
    c.node("b").faults.set("a", Some(PeerFault::Down));
    assert_eq!(errno(read_range(b, ino, 0, 10)), Err(libc::EIO));
}

#[test]
fn with_a_peer_down_local_chunks_read_and_its_chunks_are_eio_until_it_is_back() {
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    let mut data = pattern(3, 3 * CHUNK);
    let ino = create(a, "mixed", &data).unwrap();
    // Chunk 1 is rewritten on a while b refuses the copy: its new version
    // is on a only; chunks 0 and 2 keep their copies on both.
    c.node("a").faults.set("b", Some(PeerFault::RefuseWrites(libc::ENOSPC)));
    let patch = pattern(4, 1000);
    let at = CHUNK + 4096;
    overwrite(a, ino, at as u64, &patch).unwrap();
    data[at..at + patch.len()].copy_from_slice(&patch);
    c.node("a").faults.set("b", None);
    let (ab, a_only) = (vec!["a".to_string(), "b".to_string()], vec!["a".to_string()]);
    assert_eq!(holders(b, ino), vec![ab.clone(), a_only, ab], "the layout this test needs");

    c.node("b").faults.set("a", Some(PeerFault::Down));
    let cs = CHUNK as u64;
    assert_same(&read_range(b, ino, 0, cs).unwrap(), &data[..CHUNK], "chunk 0, local on b");
    assert_same(&read_range(b, ino, 2 * cs, cs).unwrap(), &data[2 * CHUNK..], "chunk 2, local on b");
    assert_eq!(errno(read_range(b, ino, cs, cs)), Err(libc::EIO), "chunk 1 is on a only");
    assert_eq!(errno(read_range(b, ino, cs + 4096, 10)), Err(libc::EIO), "any part of it");
    assert_eq!(errno(read_all(b, ino)), Err(libc::EIO), "the whole file");

    c.node("b").faults.set("a", None);
    assert_same(&read_all(b, ino).unwrap(), &data, "a is back");
}

#[test]
fn a_handle_that_saw_a_peer_down_reads_once_it_is_back() {
    let c = TestCluster::start(&["a", "b"], 1);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    let data = pattern(5, CHUNK / 2);
    let ino = create(a, "flaky", &data).unwrap();
    let fh = b.open(ino, false).unwrap().fh;
    c.node("b").faults.set("a", Some(PeerFault::Down));
    assert_eq!(errno(b.read(fh, 0, READ_PIECE)), Err(libc::EIO));
    c.node("b").faults.set("a", None);
    let r = errno(b.read(fh, 0, READ_PIECE));
    b.release(fh).unwrap();
    assert_eq!(r.map(|d| d == data[..READ_PIECE as usize]), Ok(true), "the same handle, a retry after a is back");
}

#[test]
fn a_corrupt_peer_reads_as_eio_never_as_wrong_bytes() {
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    // One copy of what is written under `one/`: the writer's.
    let dir = a.mknod(ROOT, b"one", &dir_node()).unwrap();
    a.setxattr(dir.ino, REPLICAS_XATTR, b"1", XattrMode::Any, &converged_fs::core::Caller::ROOT).unwrap();
    let data = pattern(6, 2 * CHUNK + 100);
    let ino = create_in(a, dir.ino, "x", &data).unwrap();
    assert_eq!(holders(b, ino), vec![vec!["a".to_string()]; 3]);

    c.node("b").faults.set("a", Some(PeerFault::CorruptReads));
    for (offset, len) in [(0, 10), (CHUNK as u64 - 5, 10), (2 * CHUNK as u64, 100), (0, u64::MAX)] {
        assert_eq!(errno(read_range(b, ino, offset, len)), Err(libc::EIO), "[{offset}, +{len})");
    }
    c.node("b").faults.set("a", None);
    assert_same(&read_all(b, ino).unwrap(), &data, "a serves good bytes again");
}

/// Three copies wanted, two made (b refused its own): a chunk b reads
/// remotely has two holders, a and c.
fn held_by_a_and_c(seed: u64) -> (TestCluster, Ino, Vec<u8>) {
    let c = TestCluster::start(&["a", "b", "c"], 3);
    let a = &c.node("a").core;
    c.node("a").faults.set("b", Some(PeerFault::RefuseWrites(libc::EROFS)));
    let data = pattern(seed, CHUNK + 5000);
    let ino = create(a, "two-copies", &data).unwrap();
    c.node("a").faults.set("b", None);
    let ac = vec!["a".to_string(), "c".to_string()];
    assert_eq!(holders(a, ino), vec![ac.clone(), ac], "the layout this test needs");
    (c, ino, data)
}

#[test]
fn a_down_replica_is_passed_over_for_a_live_one() {
    let (c, ino, data) = held_by_a_and_c(7);
    let b = &c.node("b").core;
    c.node("b").faults.set("a", Some(PeerFault::Down));
    assert_same(&read_all(b, ino).unwrap(), &data, "read from c");
    c.node("b").faults.set("c", Some(PeerFault::Down));
    assert_eq!(errno(read_all(b, ino)), Err(libc::EIO), "no holder reachable");
}

#[test]
fn a_corrupt_replica_is_passed_over_for_a_good_one() {
    let (c, ino, data) = held_by_a_and_c(8);
    let b = &c.node("b").core;
    // a is the first holder b asks (the writer, first in the replica list).
    c.node("b").faults.set("a", Some(PeerFault::CorruptReads));
    assert_same(&read_all(b, ino).unwrap(), &data, "read from c after a's copy failed its checksums");
}

#[test]
fn a_second_writing_node_gets_etxtbsy_until_the_first_closes() {
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    let first = pattern(9, CHUNK + 10);
    let (attr, opened) = a.create(ROOT, b"log", &file_node()).unwrap();
    let ino = attr.ino;
    write_all(a, opened.fh, 0, &first).unwrap();

    // a holds the write lease from its create until its last release.
    let t = Instant::now();
    assert_eq!(errno(b.open(ino, true).map(|o| o.fh)), Err(libc::ETXTBSY));
    assert!(t.elapsed() >= Duration::from_secs(1), "b waited for a's lease before giving up");
    a.close(opened.fh).unwrap();
    // Reading is fine meanwhile, and sees what a published at close.
    assert_same(&read_all(b, ino).unwrap(), &first, "a reader on b");
    assert_eq!(
        errno(b.open(ino, true).map(|o| o.fh)),
        Err(libc::ETXTBSY),
        "closed, but a's handle is not released yet"
    );
    a.release(opened.fh).unwrap();
    assert_eq!(
        errno(b.open(ino, true).map(|o| o.fh)),
        Err(libc::ETXTBSY),
        "released, but a gives up the lease of the file its close published at its next flush"
    );
    a.flush().unwrap();

    // a released and flushed: b writes, and a, opening after b's close, sees it.
    let patch = pattern(10, 3000);
    overwrite(b, ino, 100, &patch).unwrap();
    let mut want = first.clone();
    want[100..3100].copy_from_slice(&patch);
    assert_same(&read_all(a, ino).unwrap(), &want, "b's write, read on a");
    assert_same(&read_all(b, ino).unwrap(), &want, "b's write, read on b");
    // And a may write again once b is done.
    overwrite(a, ino, 0, b"A").unwrap();
    want[0] = b'A';
    assert_same(&read_all(b, ino).unwrap(), &want, "a's second write, read on b");
}

/// The paused-writer scenario: a holds the file open for writing with
/// unpublished bytes and is cut off for longer than its membership lease;
/// b takes the write lease over and writes. When a comes back its close
/// fails (EIO), and b's bytes are what every node reads, a included.
#[test]
fn a_writer_that_lost_its_lease_cannot_publish_over_the_new_writer() {
    let c = TestCluster::start(&["a", "b", "c"], 2);
    let (a, b, n3) = (&c.node("a").core, &c.node("b").core, &c.node("c").core);
    let mut want = pattern(11, 2 * CHUNK + 77);
    let ino = create(a, "f", &want).unwrap();

    let fh = a.open(ino, true).unwrap().fh;
    write_all(a, fh, 0, b"AAAA").unwrap();
    c.node("a").lapse();
    overwrite(b, ino, 0, b"BBBB").unwrap();
    want[..4].copy_from_slice(b"BBBB");
    assert_same(&read_all(n3, ino).unwrap(), &want, "c reads b's write");

    // a resumes, unaware: it writes on, and its close is refused.
    write_all(a, fh, 4, b"aa").unwrap();
    assert_eq!(errno(a.close(fh)), Err(libc::EIO), "a's publish is fenced");
    assert_eq!(errno(a.release(fh)), Err(libc::EIO), "a's last release reports the lost writes");
    for (name, node) in [("a", a), ("b", b), ("c", n3)] {
        assert_same(&read_all(node, ino).unwrap(), &want, &format!("read on {name}"));
    }
    // a writes again, under a new lease, once it is back in the cluster.
    assert_eq!(c.node("a").heartbeat(), converged_metadata::membership::Heartbeat::Rejoined);
    overwrite(a, ino, 8, b"A2").unwrap();
    want[8..10].copy_from_slice(b"A2");
    assert_same(&read_all(b, ino).unwrap(), &want, "a's later write, read on b");
}

/// A node that finds its membership lapsed fences its writers even when
/// nobody took their leases: they get EIO, and nothing they wrote since
/// their last publish becomes visible.
#[test]
fn a_node_back_from_a_lapse_fences_its_own_writers() {
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    let want = pattern(12, CHUNK + 5);
    let ino = create(a, "g", &want).unwrap();
    let fh = a.open(ino, true).unwrap().fh;
    write_all(a, fh, 0, b"unpublished").unwrap();
    c.node("a").lapse();
    assert_eq!(c.node("a").heartbeat(), converged_metadata::membership::Heartbeat::Rejoined);
    assert_eq!(errno(a.fsync(fh, false)), Err(libc::EIO), "fsync of a fenced writer");
    let _ = a.release(fh);
    let other = b.open(ino, true).expect("the lease was given up").fh;
    b.release(other).unwrap();
    assert_same(&read_all(b, ino).unwrap(), &want, "b reads the last published bytes");
    assert_same(&read_all(a, ino).unwrap(), &want, "so does a, its copy reconciled");
}

/// The rewrite scenario: a file is published, then its writer changes a
/// byte in every chunk and keeps it open. Readers on the other nodes read
/// the published bytes, whole, never EIO, whichever node they ask; after
/// the writer's fsync they read the new bytes, and what it writes after
/// that stays unseen until its next publish. With one copy (the writer's
/// only), the published version is kept beside the one being written.
#[test]
fn readers_elsewhere_read_the_published_version_while_a_writer_rewrites_it() {
    for replicas in [2, 1] {
        let c = TestCluster::start(&["a", "b", "c"], replicas);
        let (a, b, n3) = (&c.node("a").core, &c.node("b").core, &c.node("c").core);
        let old = pattern(20 + replicas as u64, 3 * CHUNK);
        let ino = create(a, "f", &old).unwrap();
        let fh = a.open(ino, true).unwrap().fh;
        let mut new = old.clone();
        for i in 0..3 {
            let at = i * CHUNK + 100;
            new[at] ^= 0xff;
            write_all(a, fh, at as u64, &new[at..at + 1]).unwrap();
        }
        for (name, node) in [("b", b), ("c", n3)] {
            assert_same(&read_all(node, ino).unwrap(), &old, &format!("replicas={replicas}: {name} while a writes"));
        }
        a.fsync(fh, false).unwrap();
        for (name, node) in [("b", b), ("c", n3)] {
            assert_same(&read_all(node, ino).unwrap(), &new, &format!("replicas={replicas}: {name} after a's fsync"));
        }
        let fsynced = new.clone();
        write_all(a, fh, 5, b"later").unwrap();
        new[5..10].copy_from_slice(b"later");
        for (name, node) in [("b", b), ("c", n3)] {
            let got = read_all(node, ino).unwrap();
            assert_same(&got, &fsynced, &format!("replicas={replicas}: {name} while a writes on"));
        }
        a.release(fh).unwrap();
        for (name, node) in [("a", a), ("b", b), ("c", n3)] {
            assert_same(&read_all(node, ino).unwrap(), &new, &format!("replicas={replicas}: {name} after a's close"));
        }
    }
}

/// A writer whose publish is cut short after the replicas received the new
/// version but before the layout commit (its node killed there): every
/// other node reads the last published version, whole, and still does with
/// the writer's node gone for good.
#[test]
fn a_publish_cut_short_before_its_commit_leaves_the_last_version_everywhere() {
    let c = TestCluster::start(&["a", "b", "c"], 3);
    let (a, b, n3) = (&c.node("a").core, &c.node("b").core, &c.node("c").core);
    let old = pattern(30, 2 * CHUNK + 5);
    let ino = create(a, "ckpt", &old).unwrap();
    let fh = a.open(ino, true).unwrap().fh;
    write_all(a, fh, 0, &pattern(31, 2 * CHUNK + 5)).unwrap();
    c.node("a").meta.fail_next(Fault::Unavailable, 1);
    assert_eq!(errno(a.fsync(fh, false)), Err(libc::EIO), "the commit failed");
    // a is gone, and its disk with it.
    for n in ["b", "c"] {
        c.node(n).faults.set("a", Some(PeerFault::Down));
    }
    for (name, node) in [("b", b), ("c", n3)] {
        assert_same(&read_all(node, ino).unwrap(), &old, &format!("{name} reads the last published version"));
    }
}

/// A backed file whose every holder is unreachable reads from the object
/// store (and a corrupt copy everywhere does too).
#[test]
fn a_backed_file_with_no_live_holder_reads_from_the_object_store() {
    let store: Arc<dyn object_store::ObjectStore> = Arc::new(InMemory::new());
    let c = TestCluster::start_with(&["a", "b", "c"], 2, Some(store));
    let (a, b, n3) = (&c.node("a").core, &c.node("b").core, &c.node("c").core);
    let dir = a.mknod(ROOT, b"two", &dir_node()).unwrap();
    let data = pattern(40, 2 * CHUNK + 9);
    let ino = create_in(a, dir.ino, "shard", &data).unwrap();
    let mut worker = converged_fs::workers::Backfiller::new(Arc::downgrade(a), 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !a.namespace().tier(ino).unwrap().is_some_and(|r| r.state == converged_metadata::types::TierState::Backed) {
        assert!(Instant::now() < deadline, "not backed in time");
        let _ = converged_fs::workers::Worker::step(&mut worker);
    }
    // The holders: a and one of b, c. The third node reads with both gone.
    let h = holders(a, ino);
    let reader = ["b", "c"].into_iter().find(|n| !h[0].contains(&n.to_string())).unwrap();
    let reader_core = if reader == "b" { b } else { n3 };
    for holder in ["a", "b", "c"].into_iter().filter(|n| *n != reader) {
        c.node(reader).faults.set(holder, Some(PeerFault::Down));
    }
    assert_same(&read_all(reader_core, ino).unwrap(), &data, "read from the object store");
}

/// Writes through one handle while another handle's fsync publishes the
/// file (on a cluster node, where fsync seals what was written so far),
/// then the last close: the seal's checksums describe the bytes the file
/// holds, so it reads back whole, here and on the other node. A write
/// marked dirty only after its bytes landed could fall between a publish's
/// stat of the file and its taking the dirty set; the last close, finding
/// the file as that stat saw it, sealed stale checksums. Each round: two
/// writable handles on one file of 256 KiB; one thread overwrites 64 KiB
/// pieces in place (the size never changes) while the other fsyncs.
#[test]
fn writes_racing_a_publish_are_in_the_seal() {
    const LEN: usize = 256 << 10;
    const PIECE: usize = 64 << 10;
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (c.node("a").core.clone(), &c.node("b").core);
    for round in 0..100u64 {
        let mut want = pattern(round, LEN);
        let ino = create(&a, &format!("f{round}"), &want).unwrap();
        let (w, p) = (a.open(ino, true).unwrap().fh, a.open(ino, true).unwrap().fh);
        let publisher = {
            let a = a.clone();
            std::thread::spawn(move || {
                for _ in 0..10 {
                    a.fsync(p, false).unwrap();
                }
            })
        };
        for i in 0..24u64 {
            let at = (i as usize % (LEN / PIECE)) * PIECE;
            let piece = pattern(round * 1000 + i + 1, PIECE);
            write_all(&a, w, at as u64, &piece).unwrap();
            want[at..at + PIECE].copy_from_slice(&piece);
        }
        publisher.join().unwrap();
        for fh in [w, p] {
            a.close(fh).and_then(|_| a.release(fh)).unwrap();
        }
        for (node, core) in [("a", &a), ("b", b)] {
            match read_all(core, ino) {
                Ok(got) => assert_same(&got, &want, &format!("round {round} on {node}")),
                Err(e) => panic!("round {round}: the file does not read back on {node}: errno {}: {e}", e.errno()),
            }
        }
    }
}

/// A file extended by a write into its next chunk: the first chunk's data
/// stops short of the chunk's end and the rest of it is a hole. Every node
/// reads the hole as zeros, the writer from its own copy too (whose blocks'
/// checksums cover the data only), not EIO.
#[test]
fn a_hole_between_a_short_chunk_and_the_next_reads_as_zeros_everywhere() {
    let c = TestCluster::start(&["a", "b", "c"], 2);
    let a = &c.node("a").core;
    let ino = create(a, "sparse", b"x").unwrap();
    overwrite(a, ino, CHUNK as u64, b"y").unwrap();
    let mut want = vec![0u8; CHUNK + 1];
    want[0] = b'x';
    want[CHUNK] = b'y';
    for node in &c.nodes {
        assert_same(&read_all(&node.core, ino).unwrap(), &want, &format!("read on {}", node.id));
    }
}

/// A file unlinked on one node while another node holds it open for
/// writing (the unlinking node does not know, and purges it): the writer's
/// close and release succeed, as they would for a file unlinked where it
/// is open, its bytes go with it, and no record of it is left.
#[test]
fn a_file_unlinked_elsewhere_while_being_written_closes_without_error() {
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    let ino = create(a, "doomed", b"first").unwrap();
    let fh = b.open(ino, true).unwrap().fh;
    write_all(b, fh, 0, b"second").unwrap();
    a.unlink(ROOT, b"doomed").unwrap();
    write_all(b, fh, 6, b" and more").unwrap();
    assert_eq!(errno(b.close(fh)), Ok(true), "close of the writer");
    assert_eq!(errno(b.release(fh)), Ok(()), "release of the writer");
    b.flush().unwrap();
    for node in [a, b] {
        assert_eq!(errno(node.lookup(ROOT, b"doomed").map(|_| ())), Err(libc::ENOENT));
        assert!(node.namespace().getattr(ino).is_err(), "no inode record left");
    }
}

/// A chunk left with one copy (the writer's peer refused its copy) whose
/// repair fails in the pass over every record (neither node reaches the
/// other) gets its second copy from the next passes once the nodes reach
/// each other again: those read only the records of the nodes that no
/// longer count, none here, and the failed chunk besides. Before, it waited
/// for the next pass over every record, five minutes on.
#[test]
fn a_repair_copy_that_failed_is_made_by_the_next_pass() {
    use converged_fs::workers::{Repairer, Worker};
    let c = TestCluster::start(&["a", "b"], 2);
    let (a, b) = (&c.node("a").core, &c.node("b").core);
    c.node("a").faults.set("b", Some(PeerFault::RefuseWrites(libc::ENOSPC)));
    let data = pattern(9, CHUNK / 3);
    let ino = create(a, "short", &data).unwrap();
    assert_eq!(holders(b, ino), vec![vec!["a".to_string()]], "the layout this test needs");

    // Each node's repairer: one of them reads the slice of records the
    // file is in. No copy can be made while the nodes cannot reach each other.
    let config = converged_fs::core::RepairConfig { delay: Duration::from_secs(60), bandwidth: 0 };
    let mut repairers = [Repairer::new(Arc::downgrade(a), config), Repairer::new(Arc::downgrade(b), config)];
    c.node("a").faults.set("b", Some(PeerFault::Down));
    c.node("b").faults.set("a", Some(PeerFault::Down));
    for r in &mut repairers {
        r.step();
    }
    assert_eq!(holders(b, ino), vec![vec!["a".to_string()]], "no copy while neither reaches the other");
    let failed: u64 = [a, b].iter().filter_map(|n| n.repair_report()).map(|p| p.failed).sum();
    assert_eq!(failed, 1, "the pass over every record tried the chunk and failed");

    c.node("a").faults.set("b", None);
    c.node("b").faults.set("a", None);
    // A pass after a failed one waits 2 s (then 4, 8, ...); each step
    // sleeps a second first. Eight rounds cover the first retries, far
    // short of the next pass over every record.
    for _ in 0..8 {
        if holders(b, ino)[0].len() == 2 {
            break;
        }
        for r in &mut repairers {
            r.step();
        }
    }
    let mut got = holders(b, ino);
    got[0].sort();
    assert_eq!(got, vec![vec!["a".to_string(), "b".to_string()]], "the next passes made the copy");
    c.node("a").faults.set("b", Some(PeerFault::Down));
    assert_same(&read_all(b, ino).unwrap(), &data, "b reads its own copy");
}

#[test]
fn a_peer_the_change_feed_has_not_reported_yet_still_takes_its_copy() {
    let mut c = TestCluster::start(&["a"], 2);
    // A change feed is attached and says nothing: a feed behind a loaded
    // etcd, or starting over, while another node registers.
    let a = c.node("a").core.clone();
    a.control().watching();
    assert!(a.cluster().unwrap().live_peers().is_empty(), "a alone, as a last read the member list");

    c.join("b");
    let data = pattern(21, CHUNK + 1000);
    let ino = create(&a, "after", &data).unwrap();
    let b = &c.node("b").core;
    for (i, mut chunk) in holders(b, ino).into_iter().enumerate() {
        chunk.sort();
        assert_eq!(chunk, ["a", "b"], "chunk {i}: the node registered since the last read took a copy");
    }
    c.node("b").faults.set("a", Some(PeerFault::Down));
    assert_same(&read_all(b, ino).unwrap(), &data, "b reads its own copy");
}
