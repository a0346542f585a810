//! Changes acknowledged before they commit (`--nowsync`, `kv_deferred.rs`),
//! between two in-process nodes over one shared memory store: what the
//! holder of a delegation acknowledged is read nowhere else until it
//! commits; another node's read of the directory has it commit first; a
//! node that stops without committing loses whole changes only; a node
//! that lost its delegation commits nothing more there.

mod etcd_cluster;

use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::kv_deferred::DeferredKv;
use converged_metadata::kv_fault::{Fault, FaultyKv};
use converged_metadata::membership::NodeInfo;
use converged_metadata::types::*;
use converged_metadata::{schema, CachedKv, EtcdKv, KvEngine, MemKv, MetaError, Namespace, Seal};

struct Node {
    ns: Arc<Namespace>,
    deferred: Option<Arc<DeferredKv>>,
}

fn info(id: &str) -> NodeInfo {
    NodeInfo {
        id: id.into(),
        addr: String::new(),
        capacity: 1,
        free: 1,
        labels: Default::default(),
        started: Timespec::now(),
        heartbeat: Timespec::now(),
    }
}

/// Node `id` of the cluster over `store`, deferring (`nowsync`) or not.
fn node(store: &MemKv, id: &str, nowsync: bool) -> Node {
    node_with(store, id, nowsync, false)
}

/// [`node`], with the flusher running (`flushing`) or not.
fn node_with(store: &MemKv, id: &str, nowsync: bool, flushing: bool) -> Node {
    let handle = store.node_handle();
    handle.membership().unwrap().register(&info(id), std::time::Duration::from_secs(60)).unwrap();
    let plain: Arc<dyn KvEngine> = Arc::new(handle);
    let deferred = nowsync.then(|| match flushing {
        true => DeferredKv::wrap(plain.clone(), id),
        false => DeferredKv::wrap_manual(plain.clone(), id),
    });
    node_over(plain, deferred, id)
}

/// Node `id`'s namespace over `deferred` when it defers, else over `plain`.
fn node_over(plain: Arc<dyn KvEngine>, deferred: Option<Arc<DeferredKv>>, id: &str) -> Node {
    let engine: Arc<dyn KvEngine> = match &deferred {
        Some(d) => d.clone(),
        None => plain,
    };
    let mut ns = Namespace::open(engine, 0, 0).unwrap().with_node(id);
    if let Some(d) = &deferred {
        ns = ns.with_nowsync(d.clone());
    }
    Node { ns: Arc::new(ns), deferred }
}

/// `b` recalls delegations from `a` as the daemon does over the network.
fn recalls_from(b: &Node, a: &Node) {
    let a = a.ns.clone();
    b.ns.set_recall_handler(move |_, dir, holder| {
        assert_eq!(holder, a.node());
        a.release_dir(dir)
    });
}

/// A publish of `size` bytes in one chunk held by node a, ending its writing.
fn published(size: u32) -> Seal {
    Seal {
        size: size as u64,
        mtime: Timespec::now(),
        chunks: vec![(0, ChunkRecord { version: 1, len: size, replicas: vec!["a".into()], block_crcs: vec![size] })],
        keep_unsealed: false,
        lease: None,
        data_durable: true,
        attrs: None,
    }
}

fn dir() -> NewNode<'static> {
    NewNode::plain(FileKind::Directory, 0o755)
}

fn file() -> NewNode<'static> {
    NewNode::plain(FileKind::Regular, 0o644)
}

/// What the store itself holds, past every node's overlay.
fn committed(store: &MemKv, key: &[u8]) -> Option<Vec<u8>> {
    store.read_txn().unwrap().get(key).unwrap()
}

#[test]
fn a_delegated_directory_is_changed_in_memory_and_read_elsewhere_only_after_a_recall() {
    let store = MemKv::cluster();
    let (a, b) = (node(&store, "a", true), node(&store, "b", false));
    recalls_from(&b, &a);
    let d = a.ns.mknod(ROOT_INO, b"data", &dir()).unwrap();
    for i in 0..50 {
        a.ns.mknod(d.ino, format!("f{i}").as_bytes(), &file()).unwrap();
    }
    // Acknowledged, read back here, not in the store.
    assert_eq!(a.ns.readdir(d.ino).unwrap().len(), 50);
    assert!(committed(&store, &schema::dentry(ROOT_INO, b"data")).is_some(), "a mkdir in a plain directory is sent");
    assert!(committed(&store, &schema::dentry(d.ino, b"f0")).is_none(), "creates in a delegated one are not");
    assert_eq!(a.deferred.as_ref().unwrap().backlog(), (50, 1, 0));
    // Another node's lookup has it all committed first, and the
    // directory is a plain one from then on.
    a.deferred.as_ref().unwrap().flush_all().unwrap();
    assert!(committed(&store, &schema::delegation(d.ino)).is_some(), "delegated from birth");
    let found = b.ns.lookup(d.ino, b"f49").unwrap();
    assert_eq!(found.kind, FileKind::Regular);
    assert_eq!(b.ns.readdir(d.ino).unwrap().len(), 50);
    assert!(committed(&store, &schema::delegation(d.ino)).is_none(), "given up on the recall");
    // The holder's next create there is sent as usual.
    a.ns.mknod(d.ino, b"after", &file()).unwrap();
    assert!(committed(&store, &schema::dentry(d.ino, b"after")).is_some());
}

#[test]
fn a_lookup_elsewhere_recalls_changes_still_queued() {
    let store = MemKv::cluster();
    let (a, b) = (node(&store, "a", true), node(&store, "b", false));
    recalls_from(&b, &a);
    let top = a.ns.mknod(ROOT_INO, b"top", &dir()).unwrap();
    let sub = a.ns.mknod(top.ino, b"sub", &dir()).unwrap();
    a.ns.mknod(sub.ino, b"x", &file()).unwrap();
    assert!(committed(&store, &schema::dentry(top.ino, b"sub")).is_none(), "queued, not sent");
    // b reaches `top` (committed, delegated), recalls it: everything queued
    // commits, `sub` with it; `sub` is delegated in turn and recalled too.
    let sub_b = b.ns.lookup(top.ino, b"sub").unwrap();
    assert_eq!(sub_b.ino, sub.ino);
    assert!(b.ns.lookup(sub.ino, b"x").is_ok());
    assert!(committed(&store, &schema::delegation(top.ino)).is_none());
    assert!(committed(&store, &schema::delegation(sub.ino)).is_none());
}

#[test]
fn changes_of_a_node_that_stopped_before_its_flush_are_gone_whole() {
    let store = MemKv::cluster();
    let a = node(&store, "a", true);
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    a.deferred.as_ref().unwrap().flush_all().unwrap();
    let x = a.ns.mknod(d.ino, b"x", &file()).unwrap();
    a.ns.setattr(x.ino, &SetAttr { mode: Some(0o600), ..Default::default() }).unwrap();
    // The daemon dies (kill -9): its overlay and queue go with it.
    drop(a);
    let b = node(&store, "b", false);
    assert!(matches!(b.ns.lookup(d.ino, b"x"), Err(MetaError::NotFound)));
    assert!(committed(&store, &schema::inode(x.ino)).is_none(), "no record of the lost create");
    assert_eq!(b.ns.getattr(d.ino).unwrap().nlink, 2);
}

#[test]
fn a_file_being_written_is_held_back_until_it_is_published() {
    let store = MemKv::cluster();
    let a = node(&store, "a", true);
    let deferred = a.deferred.clone().unwrap();
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    deferred.flush_all().unwrap();
    let writing = NewNode { unsealed: true, ..file() };
    let x = a.ns.mknod(d.ino, b"x", &writing).unwrap();
    let y = a.ns.mknod(d.ino, b"y", &file()).unwrap();
    deferred.flush_due().unwrap();
    assert!(committed(&store, &schema::dentry(d.ino, b"y")).is_some(), "a file made closed commits when due");
    assert!(committed(&store, &schema::dentry(d.ino, b"x")).is_none(), "a file being written waits");
    assert!(a.ns.is_deferred(x.ino) && a.ns.is_deferred(y.ino));
    // Its publish: the create and the layout commit together.
    a.ns.seal(x.ino, &published(5), converged_metadata::Durability::Buffered).unwrap();
    deferred.flush_due().unwrap();
    assert!(committed(&store, &schema::dentry(d.ino, b"x")).is_some());
    assert!(committed(&store, &schema::chunk(x.ino, 0)).is_some());
    assert_eq!(deferred.backlog().0, 0);
}

#[test]
fn a_node_that_lost_its_delegation_commits_nothing_more_there() {
    let store = MemKv::cluster();
    let (a, b) = (node(&store, "a", true), node(&store, "b", false));
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    a.deferred.as_ref().unwrap().flush_all().unwrap();
    a.ns.mknod(d.ino, b"mine", &file()).unwrap();
    // a is cut off past its lease: b finds it dead and takes the directory over.
    b.ns.drop_delegation(d.ino, "a").unwrap();
    b.ns.mknod(d.ino, b"theirs", &file()).unwrap();
    // a comes back and flushes: fenced, nothing of it lands.
    a.deferred.as_ref().unwrap().flush_all().unwrap();
    assert!(committed(&store, &schema::dentry(d.ino, b"mine")).is_none());
    assert_eq!(a.deferred.as_ref().unwrap().backlog(), (0, 0, 1));
    let names: Vec<Vec<u8>> = b.ns.readdir(d.ino).unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec![b"theirs".to_vec()]);
    // And a reads what is committed again.
    assert!(matches!(a.ns.lookup(d.ino, b"mine"), Err(MetaError::NotFound)));
}

#[test]
fn a_change_that_reads_beyond_the_delegation_waits_for_what_is_queued() {
    let store = MemKv::cluster();
    let a = node(&store, "a", true);
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    let x = a.ns.mknod(d.ino, b"x", &file()).unwrap();
    // A rename out of the delegated directory into the root (a plain one):
    // sent, after the queue it depends on.
    a.ns.rename(d.ino, b"x", ROOT_INO, b"x2", RenameMode::Replace).unwrap();
    assert_eq!(a.deferred.as_ref().unwrap().backlog().0, 0);
    assert_eq!(committed(&store, &schema::dentry(ROOT_INO, b"x2")).map(|_| ()), Some(()));
    assert!(committed(&store, &schema::dentry(d.ino, b"x")).is_none());
    assert_eq!(a.ns.lookup(ROOT_INO, b"x2").unwrap().ino, x.ino);
}

#[test]
fn threads_changing_one_delegated_directory_while_the_flusher_runs_lose_nothing() {
    let store = MemKv::cluster();
    let a = node_with(&store, "a", true, true);
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    std::thread::scope(|s| {
        for t in 0..8 {
            let ns = &a.ns;
            s.spawn(move || {
                for i in 0..100 {
                    let x = ns.mknod(d.ino, format!("t{t}-{i}").as_bytes(), &file()).unwrap();
                    if i % 10 == 0 {
                        ns.setattr(x.ino, &SetAttr { mode: Some(0o600), ..Default::default() }).unwrap();
                        ns.mknod(d.ino, format!("dir{t}-{i}").as_bytes(), &dir()).unwrap();
                    }
                    if i % 25 == 0 {
                        ns.unlink(d.ino, format!("t{t}-{i}").as_bytes()).unwrap();
                    }
                }
            });
        }
    });
    a.deferred.as_ref().unwrap().flush_all().unwrap();
    let plain = node(&store, "c", false);
    let names = plain.ns.readdir(d.ino).unwrap();
    assert_eq!(names.len(), 8 * (100 + 10 - 4));
    assert_eq!(plain.ns.getattr(d.ino).unwrap().nlink, 2 + 8 * 10, "every mkdir counted once");
    let x = plain.ns.lookup(d.ino, b"t3-10").unwrap();
    assert_eq!(x.perm, 0o600);
}

#[test]
fn a_file_made_and_removed_before_the_flush_leaves_nothing_behind() {
    let store = MemKv::cluster();
    let a = node(&store, "a", true);
    let deferred = a.deferred.clone().unwrap();
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    deferred.flush_all().unwrap();
    let before = deferred.backlog().0;
    let x = a.ns.mknod(d.ino, b"tmp", &NewNode { unsealed: true, ..file() }).unwrap();
    a.ns.seal(x.ino, &published(3), converged_metadata::Durability::Buffered).unwrap();
    let gone = a.ns.unlink_purging(d.ino, b"tmp", &|_| true, None).unwrap();
    assert_eq!(gone.ino, x.ino);
    assert!(deferred.backlog().0 > before, "the create, its publish and the unlink were all acknowledged here");
    deferred.flush_all().unwrap();
    for key in [schema::inode(x.ino), schema::chunk(x.ino, 0), schema::dentry(d.ino, b"tmp"), schema::unsealed(x.ino)] {
        assert!(committed(&store, &key).is_none(), "{key:?} left behind");
    }
}

#[test]
fn a_file_made_while_others_queue_commits_with_its_publish_in_one_transaction() {
    // etcd's limit on one transaction splits a long queue into several
    // commits; the engine fails every commit after the first, as a node
    // that dies between two.
    let store = MemKv::cluster().with_txn_limit(128);
    let handle = store.node_handle();
    handle.membership().unwrap().register(&info("a"), std::time::Duration::from_secs(60)).unwrap();
    let faulty = Arc::new(FaultyKv::new(Arc::new(handle)));
    let deferred = DeferredKv::wrap_manual(faulty.clone(), "a");
    let ns = Namespace::open(deferred.clone(), 0, 0).unwrap().with_node("a").with_nowsync(deferred.clone());
    let d = ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    deferred.flush_all().unwrap();
    // Made and written, while many files are made and closed beside it;
    // then published: its create and its publish are far apart in the queue.
    let x = ns.mknod(d.ino, b"x", &NewNode { unsealed: true, ..file() }).unwrap();
    for i in 0..60 {
        ns.mknod(d.ino, format!("f{i}").as_bytes(), &file()).unwrap();
    }
    ns.seal(x.ino, &published(5), converged_metadata::Durability::Buffered).unwrap();
    faulty.fail_after(1, Fault::Unavailable, u32::MAX);
    assert!(deferred.flush_due().is_err(), "the queue takes more than one commit");
    assert!(committed(&store, &schema::dentry(d.ino, b"f0")).is_some(), "the first commit went through");
    let named = committed(&store, &schema::dentry(d.ino, b"x")).is_some();
    let laid_out = committed(&store, &schema::chunk(x.ino, 0)).is_some();
    assert_eq!(named, laid_out, "x's name committed without its publish (or the reverse)");
}

/// `rm -rf` of a tree made here: each `rmdir` is sent (it deletes the
/// child's delegation record), past the overlay, and what this node knows
/// the engine holds of the parent (a directory made here) must follow it,
/// or the parent still lists the removed child and will not be removed.
#[test]
fn a_removal_sent_past_the_overlay_is_what_the_directory_made_here_lists_after() {
    // On etcd behind the node cache: an engine with a change feed, where a
    // node answers the records of what it made from memory.
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let a = etcd_node(&cluster.endpoints, "removal", "a", true);
    let deferred = a.deferred.clone().unwrap();
    let top = a.ns.mknod(ROOT_INO, b"top", &dir()).unwrap();
    let mid = a.ns.mknod(top.ino, b"mid", &dir()).unwrap();
    let low = a.ns.mknod(mid.ino, b"low", &dir()).unwrap();
    a.ns.mknod(low.ino, b"f", &file()).unwrap();
    // Committed by the flusher: this node now answers `mid`'s names and
    // attributes from what that commit wrote.
    deferred.flush_all().unwrap();
    a.ns.unlink(low.ino, b"f").unwrap();
    a.ns.rmdir(mid.ino, b"low").unwrap();
    assert!(a.ns.readdir(mid.ino).unwrap().is_empty(), "a removed directory still listed");
    assert_eq!(a.ns.getattr(mid.ino).unwrap().nlink, 2, "the parent's link count after the rmdir");
    a.ns.rmdir(top.ino, b"mid").unwrap();
    a.ns.rmdir(ROOT_INO, b"top").unwrap();
    deferred.flush_all().unwrap();
    assert!(a.ns.lookup(ROOT_INO, b"top").is_err());
}

/// `rm -rf` right after an untar, the flusher committing beside it: a file
/// made in a directory made here was committed by one flush and its unlink
/// waits for the next, so `rmdir` reads the directory from what this node
/// knows the engine holds (the name) under the overlay (its removal). A
/// flush that lands while it reads moves the removal from one to the
/// other: a read of the two at different moments found it in neither,
/// listed the name, and `rmdir` failed with ENOTEMPTY on an empty directory.
#[test]
fn rmdir_reads_one_view_while_a_flush_commits_the_removals_it_empties() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let a = etcd_node(&cluster.endpoints, "relisted", "a", true);
    let deferred = a.deferred.clone().unwrap();
    let top = a.ns.mknod(ROOT_INO, b"top", &dir()).unwrap();
    let d = a.ns.mknod(top.ino, b"d", &dir()).unwrap();
    a.ns.mknod(d.ino, b"f", &file()).unwrap();
    deferred.flush_all().unwrap();
    a.ns.unlink(d.ino, b"f").unwrap();
    assert!(deferred.backlog().0 > 0, "the unlink is acknowledged, not committed");
    let flusher = deferred.clone();
    converged_metadata::kv_deferred::test_hooks::once_after_range_view(move || flusher.flush_all().unwrap());
    a.ns.rmdir(top.ino, b"d").unwrap();
    assert_eq!(deferred.backlog().0, 0, "the hook's flush ran");
    assert!(a.ns.readdir(top.ino).unwrap().is_empty());
}

/// Node `id` of volume `volume` on a real etcd, through the node cache a
/// cluster mount uses, deferring (`nowsync`) or not; no flusher.
fn etcd_node(endpoints: &[String], volume: &str, id: &str, nowsync: bool) -> Node {
    let etcd = EtcdKv::connect(endpoints, volume, Duration::from_secs(5)).unwrap();
    etcd.membership().unwrap().register(&info(id), Duration::from_secs(60)).unwrap();
    let plain = CachedKv::wrap(Arc::new(etcd)).unwrap();
    let deferred = nowsync.then(|| DeferredKv::wrap_manual(plain.clone(), id));
    node_over(plain, deferred, id)
}

/// When the change feed falls silent (the node's connection to etcd hangs
/// without a reset), changes of the files a node made may be missed: it
/// must stop answering their records from what its flusher committed, and
/// read them again (here, with the connection still held, the read fails
/// at its deadline instead of answering the replica list another node
/// changed meanwhile). Once the connection is back it reads the change.
#[test]
fn a_node_whose_feed_fell_silent_answers_nothing_it_made_from_memory() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let relay = etcd_cluster::Relay::to(&cluster.endpoints[0]);
    let a = etcd_node(std::slice::from_ref(&relay.addr), "silent", "a", true);
    // One try of a read etcd does not answer (a mount waits --meta-op-wait).
    a.ns.set_unanswered_wait(Duration::ZERO);
    let b = etcd_node(&cluster.endpoints, "silent", "b", false);
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    let f = a.ns.mknod(d.ino, b"f", &NewNode { unsealed: true, ..file() }).unwrap();
    a.ns.seal(f.ino, &published(3), converged_metadata::Durability::Buffered).unwrap();
    a.deferred.as_ref().unwrap().flush_all().unwrap();
    assert_eq!(a.ns.chunks(f.ino).unwrap()[0].1.replicas, ["a"]);
    relay.hold(true);
    assert!(b.ns.add_replicas(f.ino, 0, 1, &["b".to_string()]).unwrap());
    std::thread::sleep(converged_metadata::kv_etcd::WATCH_SILENCE + Duration::from_secs(2));
    let got = a.ns.chunks(f.ino).map(|c| c[0].1.replicas.clone());
    assert!(
        !matches!(&got, Ok(r) if r == &["a"]),
        "the node that made the file answered {got:?} from memory after its feed fell silent"
    );
    relay.hold(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match a.ns.chunks(f.ino).map(|c| c[0].1.replicas.clone()) {
            Ok(r) if r == ["a", "b"] => break,
            other => assert!(Instant::now() < deadline, "after the connection came back: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Repair, drains and rebalances change a file's chunk records by inode
/// number, past its directory's delegation: the node that made the file,
/// which answers its records from what its own flush committed, must take
/// such a change from its watch and read the records afresh.
#[test]
fn a_chunk_record_another_node_changes_is_read_afresh_where_the_file_was_made() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let a = etcd_node(&cluster.endpoints, "born", "a", true);
    let b = etcd_node(&cluster.endpoints, "born", "b", false);
    let d = a.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    let f = a.ns.mknod(d.ino, b"f", &NewNode { unsealed: true, ..file() }).unwrap();
    a.ns.seal(f.ino, &published(3), converged_metadata::Durability::Buffered).unwrap();
    a.deferred.as_ref().unwrap().flush_all().unwrap();
    assert_eq!(a.ns.chunks(f.ino).unwrap()[0].1.replicas, ["a"]);
    // b, as repair does, by inode number.
    assert!(b.ns.add_replicas(f.ino, 0, 1, &["b".to_string()]).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let replicas = a.ns.chunks(f.ino).unwrap()[0].1.replicas.clone();
        if replicas == ["a", "b"] {
            break;
        }
        assert!(Instant::now() < deadline, "the node that made the file still reads {replicas:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The sweep reads the records of many files at once
/// (`Namespace::sweep_facts`): what it answers for each file is what reading
/// that file alone answers (inode, chunk records, write lease; nothing for a
/// number with no inode), also for a file still in the overlay of the node
/// that made it; and on etcd a hundred files cost a handful of requests,
/// where reading them one by one cost three or four each.
#[test]
fn the_sweep_reads_a_hundred_files_records_in_a_few_requests() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let a = etcd_node(&cluster.endpoints, "sweep", "a", true);
    let b = etcd_node(&cluster.endpoints, "sweep", "b", false);
    let d = b.ns.mknod(ROOT_INO, b"d", &dir()).unwrap();
    let mut inos = Vec::new();
    for i in 0..100u32 {
        let f = b.ns.mknod(d.ino, format!("f{i}").as_bytes(), &NewNode { unsealed: true, ..file() }).unwrap();
        // Every third file stays open for writing (b holds its lease).
        if i % 3 != 0 {
            b.ns.seal(f.ino, &published(i + 1), converged_metadata::Durability::Buffered).unwrap();
        }
        inos.push(f.ino);
    }
    inos.push(inos.iter().max().unwrap() + 1_000_000);
    let before = converged_metadata::round_trips::on_this_thread();
    let facts = a.ns.sweep_facts(&inos).unwrap();
    let reads = converged_metadata::round_trips::on_this_thread() - before;
    // 404 keys in transactions of 128 reads, 101 chunk ranges in one.
    assert!(reads <= 5, "{reads} requests for the records of 101 files");
    assert_eq!(facts.len(), inos.len());
    for (ino, got) in inos.iter().zip(&facts) {
        match b.ns.layout(*ino) {
            Err(MetaError::NotFound) => assert!(got.is_none(), "facts of a number with no inode: {got:?}"),
            Ok((inode, chunks)) => {
                let got = got.as_ref().unwrap_or_else(|| panic!("no facts for {ino}"));
                assert_eq!((got.inode.ino, got.inode.size), (inode.ino, inode.size));
                assert_eq!(got.chunks, chunks, "chunk records of {ino}");
                assert_eq!(got.writer, b.ns.writer(*ino).unwrap(), "write lease of {ino}");
                assert!(got.tier.is_none());
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(facts.iter().filter(|f| f.as_ref().is_some_and(|f| f.writer.as_deref() == Some("b"))).count(), 34);
    // A file a made and published, still in its overlay (no flusher runs).
    let ad = a.ns.mknod(ROOT_INO, b"ad", &dir()).unwrap();
    let af = a.ns.mknod(ad.ino, b"f", &NewNode { unsealed: true, ..file() }).unwrap();
    a.ns.seal(af.ino, &published(7), converged_metadata::Durability::Buffered).unwrap();
    assert!(a.deferred.as_ref().unwrap().backlog().0 > 0, "the overlay holds the file");
    let mine = a.ns.sweep_facts(&[af.ino, inos[1]]).unwrap();
    let own = mine[0].as_ref().expect("the overlay's file");
    assert_eq!((own.inode.size, own.chunks.len(), own.writer.as_deref()), (7, 1, None));
    assert_eq!(mine[1].as_ref().map(|f| f.chunks.clone()), Some(b.ns.layout(inos[1]).unwrap().1));
}
