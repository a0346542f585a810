//! One suite per trait, run against every backend: the `KvEngine` contract
//! and the namespace operations, on `MemKv`, on `RedbKv` (a real file) and
//! on `EtcdKv` against a real 3-member etcd cluster on loopback.

mod etcd_cluster;

use std::sync::Arc;
use std::time::Duration;

use converged_metadata::kv::{Durability, KvEngine, KvError};
use converged_metadata::kv_fault::{Fault, FaultyKv};
use converged_metadata::types::*;
use converged_metadata::{
    CachedKv, EtcdKv, MemKv, MetaError, Namespace, RedbKv, SessionEnd, UploadEnd, UploadStart, ROOT,
};

fn engines() -> Vec<(&'static str, Arc<dyn KvEngine>, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let redb = RedbKv::open(&dir.path().join("meta.redb"), Duration::from_secs(1)).unwrap();
    vec![("memory", Arc::new(MemKv::new()), None), ("redb", Arc::new(redb), Some(dir))]
}

type Suite = fn(&str, Arc<dyn KvEngine>);

/// Every suite, run on every engine below.
const SUITES: &[(&str, Suite)] = &[
    ("kv_commit_is_atomic_and_abort_discards", kv_commit_is_atomic_and_abort_discards),
    ("kv_scan_is_ordered_bounded_and_sees_pending_writes", kv_scan_is_ordered_bounded_and_sees_pending_writes),
    ("kv_range_delete_hands_back_what_it_removed", kv_range_delete_hands_back_what_it_removed),
    ("kv_range_deletes_that_meet_each_take_their_own", kv_range_deletes_that_meet_each_take_their_own),
    ("namespace_create_lookup_link_unlink", namespace_create_lookup_link_unlink),
    ("namespace_rename_rules", namespace_rename_rules),
    ("changes_made_for_a_request_say_so", changes_made_for_a_request_say_so),
    ("a_change_whose_answer_was_lost_is_made_once", a_change_whose_answer_was_lost_is_made_once),
    ("a_change_whose_commit_lands_late_is_made_once", a_change_whose_commit_lands_late_is_made_once),
    ("tmpfiles_are_orphans_until_linked", tmpfiles_are_orphans_until_linked),
    ("namespace_setattr_xattr_and_seal", namespace_setattr_xattr_and_seal),
    ("large_directories_list_in_pages", large_directories_list_in_pages),
    ("large_layouts_seal_in_batches", large_layouts_seal_in_batches),
    ("replica_policy_is_checked_and_inherited", replica_policy_is_checked_and_inherited),
    ("tier_state_machine", tier_state_machine),
    ("seals_of_unsynced_bytes_stay_marked_until_synced", seals_of_unsynced_bytes_stay_marked_until_synced),
    ("write_lease_epochs_fence_stale_writers", write_lease_epochs_fence_stale_writers),
    ("object_keys_belong_to_one_file_at_a_time", object_keys_belong_to_one_file_at_a_time),
    ("large_layouts_switch_whole_across_a_crash", large_layouts_switch_whole_across_a_crash),
    ("copies_leave_a_record_only_after_their_replacements", copies_leave_a_record_only_after_their_replacements),
    ("many_files_closed_empty_lose_their_marks_together", many_files_closed_empty_lose_their_marks_together),
    ("published_sessions_end_together_under_their_own_lease", published_sessions_end_together_under_their_own_lease),
    ("a_seconds_sync_marks_clear_past_the_txn_limit", a_seconds_sync_marks_clear_past_the_txn_limit),
    ("sync_marks_written_before_their_new_prefix_are_kept", sync_marks_written_before_their_new_prefix_are_kept),
    ("fsck_finds_what_was_broken_and_repairs_what_it_can", fsck_finds_what_was_broken_and_repairs_what_it_can),
    (
        "holder_index_lists_every_holder_and_drops_what_no_record_names",
        holder_index_lists_every_holder_and_drops_what_no_record_names,
    ),
];

/// Seal `ino` as one 10-byte chunk at `version`, held by `replicas`.
fn seal_one_chunk(ns: &Namespace, ino: u64, version: u64, replicas: &[&str]) {
    let record = ChunkRecord {
        version,
        len: 10,
        replicas: replicas.iter().map(|r| r.to_string()).collect(),
        block_crcs: vec![7],
    };
    let seal = converged_metadata::Seal {
        size: 10,
        mtime: Timespec::now(),
        chunks: vec![(0, record)],
        keep_unsealed: false,
        lease: None,
        data_durable: true,
        attrs: None,
    };
    ns.seal(ino, &seal, Durability::Durable).unwrap();
}

/// The seal of a last close: `size` and `chunks`, the lease dropped, the
/// bytes durable.
fn closing_seal(size: u64, chunks: Vec<(u32, ChunkRecord)>) -> converged_metadata::Seal {
    converged_metadata::Seal {
        size,
        mtime: Timespec::now(),
        chunks,
        keep_unsealed: false,
        lease: None,
        data_durable: true,
        attrs: None,
    }
}

/// A closing seal of an empty file whose bytes are not known durable: it
/// leaves a sync-pending mark.
fn unsynced_seal() -> converged_metadata::Seal {
    converged_metadata::Seal { data_durable: false, ..closing_seal(0, Vec::new()) }
}

/// The record an upload starts from, when it may start.
fn go(start: UploadStart) -> converged_metadata::types::TierRecord {
    match start {
        UploadStart::Go(rec) => rec,
        other => panic!("the upload did not start: {other:?}"),
    }
}

#[test]
fn suites_on_memory_and_redb() {
    for (suite, run) in SUITES {
        for (name, kv, _dir) in engines() {
            eprintln!("{suite} on {name}");
            run(name, kv);
        }
    }
}

/// The holder index on an engine several in-process nodes share (the
/// suites' memory engine is a single node's, which keeps none); and a
/// volume made before the index gets it built at its next open.
#[test]
fn holder_index_on_a_shared_memory_engine_and_built_for_an_older_volume() {
    holder_index_lists_every_holder_and_drops_what_no_record_names("memory cluster", Arc::new(MemKv::cluster()));
    let kv = MemKv::cluster();
    let ns = Namespace::open(Arc::new(kv.clone()), 0, 0).unwrap().with_node("n1");
    let files: Vec<u64> =
        (0..5).map(|i| ns.mknod(ROOT, format!("f{i}").as_bytes(), &file(0o644)).unwrap().ino).collect();
    for &f in &files {
        seal_one_chunk(&ns, f, 1, &["n1", "n2"]);
    }
    // What the volume looked like before: no `h` keys, format 1.
    let mut txn = kv.write_txn().unwrap();
    txn.delete_range(b"h", b"i").unwrap();
    let mut volume: VolumeRecord = postcard::from_bytes(&txn.get(b"V").unwrap().unwrap()).unwrap();
    volume.format_version = FORMAT_BEFORE_HOLDER_INDEX;
    txn.put(b"V", &postcard::to_allocvec(&volume).unwrap());
    txn.commit(Durability::Durable).unwrap();
    assert!(held_by(&ns, "n2").0.is_empty());
    let reopened = Namespace::open(Arc::new(kv.clone()), 0, 0).unwrap().with_node("n1");
    let want: Vec<(u64, u32)> = files.iter().map(|&f| (f, 0)).collect();
    assert_eq!(held_by(&reopened, "n2").0, want, "the index is built at open");
    let volume: VolumeRecord = postcard::from_bytes(&kv.read_txn().unwrap().get(b"V").unwrap().unwrap()).unwrap();
    assert_eq!(volume.format_version, FORMAT_VERSION);
}

#[test]
fn suites_on_a_real_etcd_cluster() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    for (i, (suite, run)) in SUITES.iter().enumerate() {
        // A volume of its own for each suite: a fresh, empty namespace.
        let kv = EtcdKv::connect(&cluster.endpoints, &format!("suite{i}"), Duration::from_secs(5)).unwrap();
        eprintln!("{suite} on etcd");
        run("etcd", Arc::new(kv));
    }
}

/// The suites again, on etcd behind the node cache a cluster mount uses
/// (`CachedKv`): cached reads inside read-write transactions must commit
/// exactly as reads of the engine would.
#[test]
fn suites_on_a_real_etcd_cluster_through_the_node_cache() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    for (i, (suite, run)) in SUITES.iter().enumerate() {
        let kv = EtcdKv::connect(&cluster.endpoints, &format!("cached{i}"), Duration::from_secs(5)).unwrap();
        eprintln!("{suite} on etcd through the cache");
        run("etcd+cache", CachedKv::wrap(Arc::new(kv)).unwrap());
    }
}

/// A node's chunks are found through the holder index in requests that
/// grow with that node's chunks, not the volume's: 3,000 chunk records on
/// a real etcd, 30 of them naming one node. Counted in the requests this
/// thread made: walking that node's entries against reading every record.
#[test]
fn a_nodes_chunks_cost_requests_in_proportion_to_its_own() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let (ns, _kv) = etcd_node(&cluster.endpoints, "held", "n1");
    let f = ns.mknod(ROOT, b"f", &file(0o644)).unwrap().ino;
    let record = |holders: &[&str]| ChunkRecord {
        version: 1,
        len: DEFAULT_CHUNK_SIZE,
        replicas: holders.iter().map(|h| h.to_string()).collect(),
        block_crcs: vec![1; 16],
    };
    // One file of 3,000 chunks, n1 and n2 holding all, "rare" one in a hundred.
    let chunks: Vec<(u32, ChunkRecord)> =
        (0..3000).map(|i| (i, record(if i % 100 == 7 { &["n1", "rare"] } else { &["n1", "n2"] }))).collect();
    ns.seal(f, &closing_seal(3000 * DEFAULT_CHUNK_SIZE as u64, chunks), Durability::Durable).unwrap();
    let requests = |walk: &dyn Fn()| {
        let before = converged_metadata::round_trips::on_this_thread();
        walk();
        converged_metadata::round_trips::on_this_thread() - before
    };
    let walk = requests(&|| {
        let mut held = Vec::new();
        ns.for_each_chunk_held_by("rare", |_, index, _| held.push(index)).unwrap();
        assert_eq!(held, (0..30).map(|i| i * 100 + 7).collect::<Vec<u32>>());
    });
    let mut n = 0;
    let scan = requests(&|| ns.for_each_chunk(|_, _, r| assert!(!r.replicas.is_empty())).unwrap());
    ns.for_each_chunk(|_, _, _| n += 1).unwrap();
    assert_eq!(n, 3000);
    // The volume's inode bound, a page of entries and one read of their
    // records, and the empty windows after them up to the bound (a few,
    // doubling); a scan reads 64 records a request.
    assert!(walk <= 12, "walking 30 entries took {walk} requests");
    assert!(scan >= 3000 / 64, "a scan of every record took {scan} requests");
}

/// A node changing its own record (a directory's attributes, at every
/// create in it) keeps it cached while other nodes change other records,
/// as they do all the time on a busy cluster: its transactions compare the
/// cached version instead of reading the record again. Counted in the
/// requests this thread made.
#[test]
fn a_cache_keeps_what_it_commits_while_other_nodes_change_other_records() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let node = || {
        let kv = EtcdKv::connect(&cluster.endpoints, "busy", Duration::from_secs(5)).unwrap();
        CachedKv::wrap(Arc::new(kv)).unwrap()
    };
    let (a, b) = (node(), node());
    const KEY: &[u8] = b"I-a-directory";
    const ROUNDS: u64 = 100;
    let busy = std::sync::atomic::AtomicBool::new(true);
    let (reads, others) = std::thread::scope(|s| {
        let other = s.spawn(|| {
            let mut i = 0u64;
            while busy.load(std::sync::atomic::Ordering::Relaxed) {
                let mut t = b.write_txn().unwrap();
                t.put(format!("I-b-{i}").as_bytes(), b"x");
                t.commit(Durability::Buffered).unwrap();
                i += 1;
            }
            i
        });
        std::thread::sleep(Duration::from_millis(300));
        let before = converged_metadata::round_trips::on_this_thread();
        let mut commits = 0;
        for n in 0..ROUNDS {
            let mut t = a.write_txn().unwrap();
            t.get(KEY).unwrap();
            t.put(KEY, &n.to_be_bytes());
            t.commit(Durability::Buffered).unwrap();
            commits += 1;
        }
        let reads = converged_metadata::round_trips::on_this_thread() - before - commits;
        busy.store(false, std::sync::atomic::Ordering::Relaxed);
        (reads, other.join().unwrap())
    });
    assert!(others > ROUNDS, "the other node changed only {others} records meanwhile: the test proves nothing");
    assert!(
        reads <= ROUNDS / 10,
        "{reads} reads of its own record in {ROUNDS} transactions while the other node committed {others} changes"
    );
}

/// Two nodes, each with its own etcd client and cache, increment one cached
/// record from two threads each. A cached read that went stale (the other
/// node committed since) must fail the commit, never lose an increment; and
/// each node's cache must come to see the other's last write.
#[test]
fn cached_reads_in_transactions_never_lose_an_update() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let node = || {
        let kv = EtcdKv::connect(&cluster.endpoints, "counter", Duration::from_secs(5)).unwrap();
        CachedKv::wrap(Arc::new(kv)).unwrap()
    };
    let (a, b) = (node(), node());
    // An inode-prefixed key: one the cache keeps.
    const KEY: &[u8] = b"I-counter";
    let read = |kv: &dyn KvEngine| -> u64 {
        kv.read_txn().unwrap().get(KEY).unwrap().map_or(0, |v| u64::from_be_bytes(v.try_into().unwrap()))
    };
    const ROUNDS: u64 = 60;
    let conflicts = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for kv in [&a, &a, &b, &b] {
            let conflicts = &conflicts;
            s.spawn(move || {
                for _ in 0..ROUNDS {
                    loop {
                        let mut t = kv.write_txn().unwrap();
                        let n = t.get(KEY).unwrap().map_or(0, |v| u64::from_be_bytes(v.try_into().unwrap()));
                        t.put(KEY, &(n + 1).to_be_bytes());
                        match t.commit(Durability::Buffered) {
                            Ok(()) => break,
                            Err(KvError::Conflict) => {
                                conflicts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Err(e) => panic!("commit: {e}"),
                        }
                    }
                }
            });
        }
    });
    let fresh = EtcdKv::connect(&cluster.endpoints, "counter", Duration::from_secs(5)).unwrap();
    assert_eq!(read(&fresh), 4 * ROUNDS, "every increment landed once");
    assert!(conflicts.into_inner() > 0, "four writers of one key never conflicted: the test proves nothing");
    // Both caches converge on the last value (the watch evicts, or the
    // cache holds the node's own commit).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while read(a.as_ref()) != 4 * ROUNDS || read(b.as_ref()) != 4 * ROUNDS {
        assert!(std::time::Instant::now() < deadline, "a node's cache kept a stale value");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Put `value` at `key` as another node would.
fn put_now(kv: &dyn KvEngine, key: &[u8], value: &[u8]) {
    let mut t = kv.write_txn().unwrap();
    t.put(key, value);
    t.commit(Durability::Buffered).unwrap();
}

/// Read `key` through `kv` until a read of it costs no request (the
/// cache holds it; the feed's start may drop what the first read cached).
fn until_cached(kv: &dyn KvEngine, key: &[u8]) -> Option<Vec<u8>> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let before = converged_metadata::round_trips::on_this_thread();
        let v = kv.read_txn().unwrap().get(key).unwrap();
        if converged_metadata::round_trips::on_this_thread() == before {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "the node cache never kept {key:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two nodes of `volume`: one behind the node cache, one asking etcd.
fn cached_and_plain(endpoints: &[String], volume: &str) -> (Arc<dyn KvEngine>, EtcdKv) {
    let a = CachedKv::wrap(Arc::new(EtcdKv::connect(endpoints, volume, Duration::from_secs(5)).unwrap())).unwrap();
    (a, EtcdKv::connect(endpoints, volume, Duration::from_secs(5)).unwrap())
}

/// A node's cache keeps a record for minutes while its change feed is
/// alive (a stat, lookup or unlink of a file made a minute ago costs no
/// read), and still sees at once what another node changes. Records used
/// to expire after 10 s, the bound on staleness should the feed fail.
#[test]
fn a_cached_record_outlives_ten_seconds_and_still_sees_other_nodes_changes() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let (a, b) = cached_and_plain(&cluster.endpoints, "alive");
    put_now(&b, b"I-kept", b"one");
    put_now(&b, b"I-changed", b"one");
    assert_eq!(until_cached(a.as_ref(), b"I-kept").as_deref(), Some(&b"one"[..]));
    assert_eq!(until_cached(a.as_ref(), b"I-changed").as_deref(), Some(&b"one"[..]));
    std::thread::sleep(Duration::from_secs(6));
    put_now(&b, b"I-changed", b"two");
    std::thread::sleep(Duration::from_secs(6));
    let before = converged_metadata::round_trips::on_this_thread();
    let kept = a.read_txn().unwrap().get(b"I-kept").unwrap();
    let reads = converged_metadata::round_trips::on_this_thread() - before;
    assert_eq!(kept.as_deref(), Some(&b"one"[..]));
    assert_eq!(reads, 0, "a record cached 12 s ago was read from etcd again");
    assert_eq!(
        a.read_txn().unwrap().get(b"I-changed").unwrap().as_deref(),
        Some(&b"two"[..]),
        "the cache kept a record another node changed"
    );
}

/// A record a node holds stays a hit when another node changes or deletes
/// it: the change feed brings the new value and its revision, so the node
/// reads it from etcd neither time, and a transaction that relies on it
/// commits (the version it compares is the change's). A record the node
/// never read is not cached from the feed.
#[test]
fn a_record_another_node_changes_is_kept_current_not_dropped() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let (a, b) = cached_and_plain(&cluster.endpoints, "current");
    const KEY: &[u8] = b"I-watched";
    put_now(&b, KEY, b"one");
    assert_eq!(until_cached(a.as_ref(), KEY).as_deref(), Some(&b"one"[..]));
    // Reads until the node answers `want`; the read that first does must
    // cost no request.
    let until = |want: Option<&[u8]>| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let before = converged_metadata::round_trips::on_this_thread();
            let v = a.read_txn().unwrap().get(KEY).unwrap();
            let reads = converged_metadata::round_trips::on_this_thread() - before;
            if v.as_deref() == want {
                assert_eq!(reads, 0, "the node read {KEY:?} from etcd again after another node changed it");
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the node still answers {v:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    put_now(&b, KEY, b"two");
    until(Some(b"two"));
    let mut t = a.write_txn().unwrap();
    assert_eq!(t.get(KEY).unwrap().as_deref(), Some(&b"two"[..]));
    t.put(KEY, b"three");
    t.commit(Durability::Buffered).expect("a commit comparing the version the feed gave");
    let mut t = b.write_txn().unwrap();
    t.delete(KEY);
    t.commit(Durability::Buffered).unwrap();
    until(None);
    put_now(&b, b"I-unseen", b"x");
    std::thread::sleep(Duration::from_millis(500));
    let before = converged_metadata::round_trips::on_this_thread();
    assert_eq!(a.read_txn().unwrap().get(b"I-unseen").unwrap().as_deref(), Some(&b"x"[..]));
    assert_eq!(
        converged_metadata::round_trips::on_this_thread() - before,
        1,
        "a record the node never read was cached from the feed"
    );
}

/// When a node's connection to etcd hangs without a reset (a partition),
/// its change feed falls silent; within a few seconds the node stops
/// answering from its cache what another node may have changed meanwhile
/// (a read then waits for etcd, and fails at its deadline), and once the
/// connection is back it reads the other node's change.
#[test]
fn a_node_whose_change_feed_falls_silent_stops_answering_from_its_cache() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let relay = etcd_cluster::Relay::to(&cluster.endpoints[0]);
    let kv = EtcdKv::connect(std::slice::from_ref(&relay.addr), "silent", Duration::from_secs(2)).unwrap();
    let a = CachedKv::wrap(Arc::new(kv)).unwrap();
    let b = EtcdKv::connect(&cluster.endpoints, "silent", Duration::from_secs(5)).unwrap();
    const KEY: &[u8] = b"I-record";
    put_now(&b, KEY, b"old");
    assert_eq!(until_cached(a.as_ref(), KEY).as_deref(), Some(&b"old"[..]));
    relay.hold(true);
    put_now(&b, KEY, b"new");
    std::thread::sleep(converged_metadata::kv_etcd::WATCH_SILENCE + Duration::from_secs(2));
    let got = a.read_txn().and_then(|mut t| t.get(KEY));
    assert!(
        !matches!(&got, Ok(Some(v)) if v == b"old"),
        "read {:?} after the feed fell silent: the cache answered the record another node had changed",
        converged_metadata::kv_etcd::WATCH_SILENCE + Duration::from_secs(2)
    );
    relay.hold(false);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match a.read_txn().and_then(|mut t| t.get(KEY)) {
            Ok(Some(v)) if v == b"new" => break,
            other => {
                assert!(std::time::Instant::now() < deadline, "after the connection came back: {other:?}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

// ---- KvEngine contract ----

fn kv_commit_is_atomic_and_abort_discards(name: &str, kv: Arc<dyn KvEngine>) {
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

fn kv_scan_is_ordered_bounded_and_sees_pending_writes(name: &str, kv: Arc<dyn KvEngine>) {
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
    // Several ranges in one read: each as its own scan answers it, in order.
    let ranges: Vec<(Vec<u8>, Vec<u8>)> = (0..200u8)
        .map(|i| match i % 3 {
            0 => (vec![b'k', 4], vec![b'k', 8]),
            1 => (vec![b'x'], vec![b'y']),
            _ => (b"k".to_vec(), b"l".to_vec()),
        })
        .collect();
    let mut r = kv.read_txn().unwrap();
    let many = r.scan_many(&ranges, 2).unwrap();
    assert_eq!(many.len(), ranges.len(), "{name}: an answer per range");
    for ((start, end), got) in ranges.iter().zip(many) {
        assert_eq!(got, r.scan(start, end, 2).unwrap(), "{name}: scan_many of [{start:?}, {end:?})");
    }
}

/// A range delete that takes its records leaves, once committed, exactly
/// what the range held (keys as the caller names them, values), and the
/// range empty; also when the same transaction then writes into the range.
fn kv_range_delete_hands_back_what_it_removed(name: &str, kv: Arc<dyn KvEngine>) {
    for then_put in [false, true] {
        let mut t = kv.write_txn().unwrap();
        for i in [2u8, 4, 6] {
            t.put(&[b'r', i], &[i, i]);
        }
        t.put(b"s", b"outside");
        t.commit(Durability::Buffered).unwrap();
        let taken = converged_metadata::kv::Taken::default();
        let mut t = kv.write_txn().unwrap();
        t.delete_range_taking(b"r", b"s", &taken).unwrap();
        if then_put {
            t.put(&[b'r', 9], b"new");
        }
        t.commit(Durability::Buffered).unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = [2u8, 4, 6].iter().map(|i| (vec![b'r', *i], vec![*i, *i])).collect();
        assert_eq!(*taken.lock(), want, "{name}: records taken (then a put: {then_put})");
        let left: Vec<Vec<u8>> =
            kv.read_txn().unwrap().scan(b"r", b"t", 10).unwrap().into_iter().map(|(k, _)| k).collect();
        let want_left = match then_put {
            false => vec![b"s".to_vec()],
            true => vec![vec![b'r', 9], b"s".to_vec()],
        };
        assert_eq!(left, want_left, "{name}: what the range holds after (then a put: {then_put})");
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

/// Buffered commits are kept in memory and go into the database 32 at a
/// time: those of a daemon that stopped without a sync, written into the
/// database or not, are all there after a reopen (from the redo log), in
/// commit order.
#[test]
fn redb_keeps_unsynced_commits_across_reopen_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.redb");
    {
        let kv = RedbKv::open(&path, Duration::from_secs(1)).unwrap();
        for i in 0..100u32 {
            let mut t = kv.write_txn().unwrap();
            t.put(format!("k{i:03}").as_bytes(), &i.to_le_bytes());
            t.put(b"last", &i.to_le_bytes());
            if i % 10 == 9 {
                t.delete(format!("k{:03}", i - 1).as_bytes());
            }
            t.commit(Durability::Buffered).unwrap();
        }
        // Read back before the reopen: 3 batches in the database, 4 in memory.
        let mut r = kv.read_txn().unwrap();
        assert_eq!(r.scan(b"k", b"l", 1000).unwrap().len(), 90);
        assert_eq!(r.get(b"last").unwrap(), Some(99u32.to_le_bytes().to_vec()));
    }
    let kv = RedbKv::open(&path, Duration::from_secs(1)).unwrap();
    let mut r = kv.read_txn().unwrap();
    let keys: Vec<Vec<u8>> = r.scan(b"k", b"l", 1000).unwrap().into_iter().map(|(k, _)| k).collect();
    let want: Vec<Vec<u8>> = (0..100u32).filter(|i| i % 10 != 8).map(|i| format!("k{i:03}").into_bytes()).collect();
    assert_eq!(keys, want, "every commit, each delete after the put it removes");
    assert_eq!(r.get(b"last").unwrap(), Some(99u32.to_le_bytes().to_vec()), "the last commit's value");
}

/// A buffered commit whose redo record the full disk cut short fails, and
/// the commits acknowledged after the disk has room again survive a
/// restart: the torn record is cut off the log, not left for the replay to
/// stop at. On a real 4 MiB tmpfs filled to a few pages.
#[test]
fn redb_commits_after_a_torn_redo_record_survive_a_restart() {
    use std::io::Write;
    let root = tempfile::tempdir().unwrap();
    let disk = root.path();
    let ok = std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"]).arg(disk).status();
    assert!(ok.is_ok_and(|s| s.success()), "mount a tmpfs (the tests run as root)");
    struct Unmount<'a>(&'a std::path::Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
    let _u = Unmount(disk);
    let path = disk.join("m.redb");
    let put = |kv: &RedbKv, i: u32| {
        let mut t = kv.write_txn().unwrap();
        t.put(format!("k{i:03}").as_bytes(), &vec![i as u8; 5000]);
        t.commit(Durability::Buffered)
    };
    let mut made = Vec::new();
    {
        let kv = RedbKv::open(&path, Duration::from_secs(1)).unwrap();
        put(&kv, 0).unwrap();
        made.push(0);
        // Fill the disk, then give back four pages.
        let filler = disk.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        while f.write_all(&[7u8; 65536]).is_ok() {}
        let len = f.metadata().unwrap().len();
        f.set_len(len.saturating_sub(4 * 4096) / 4096 * 4096).unwrap();
        drop(f);
        let mut failed = None;
        for i in 1..30 {
            match put(&kv, i) {
                Ok(()) => made.push(i),
                Err(e) => {
                    assert!(matches!(e, KvError::NoSpace), "{e}");
                    failed = Some(i);
                    break;
                }
            }
        }
        let failed = failed.expect("a full disk fails a buffered commit");
        std::fs::remove_file(&filler).unwrap();
        for i in failed + 1..failed + 4 {
            put(&kv, i).unwrap();
            made.push(i);
        }
        // Dropped without a sync: the redo log holds every commit since the first.
    }
    let kv = RedbKv::open(&path, Duration::from_secs(1)).unwrap();
    let mut r = kv.read_txn().unwrap();
    let keys: Vec<Vec<u8>> = r.scan(b"k", b"l", 1000).unwrap().into_iter().map(|(k, _)| k).collect();
    let want: Vec<Vec<u8>> = made.iter().map(|i| format!("k{i:03}").into_bytes()).collect();
    assert_eq!(keys, want, "every acknowledged commit, and not the one that failed");
}

/// A read transaction is one consistent state while writers commit and
/// their commits move from memory into the database: two writers move
/// units between 8 accounts (the total never changes), readers sum them by
/// gets and by a scan in one transaction each, and a reader that stays
/// open keeps seeing the state it started at.
#[test]
fn redb_readers_see_one_state_while_commits_move_into_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(RedbKv::open(&dir.path().join("m.redb"), Duration::from_secs(1)).unwrap());
    let acct = |i: u32| format!("a{i}").into_bytes();
    let value = |v: Option<Vec<u8>>| u64::from_le_bytes(v.unwrap().try_into().unwrap());
    let mut t = kv.write_txn().unwrap();
    for i in 0..8 {
        t.put(&acct(i), &1000u64.to_le_bytes());
    }
    t.commit(Durability::Durable).unwrap();
    let mut early = kv.read_txn().unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..2u32)
            .map(|w| {
                let kv = kv.clone();
                s.spawn(move || {
                    for n in 0..1500u32 {
                        let (from, to) = ((n + w) % 8, (n * 3 + 1 + w) % 8);
                        if from == to {
                            continue;
                        }
                        let mut t = kv.write_txn().unwrap();
                        let a = value(t.get(&acct(from)).unwrap());
                        let b = value(t.get(&acct(to)).unwrap());
                        t.put(&acct(from), &(a - 1).to_le_bytes());
                        t.put(&acct(to), &(b + 1).to_le_bytes());
                        // Now and then a durable commit, as an fsync makes.
                        let d = if n % 100 == 0 { Durability::Durable } else { Durability::Buffered };
                        t.commit(d).unwrap();
                    }
                })
            })
            .collect();
        for _ in 0..2 {
            let (kv, done) = (kv.clone(), &done);
            s.spawn(move || {
                let mut reads = 0;
                while !done.load(std::sync::atomic::Ordering::SeqCst) || reads == 0 {
                    let mut r = kv.read_txn().unwrap();
                    let by_get: u64 = (0..8).map(|i| value(r.get(&acct(i)).unwrap())).sum();
                    let by_scan: u64 = r.scan(b"a", b"b", 100).unwrap().into_iter().map(|(_, v)| value(Some(v))).sum();
                    assert_eq!((by_get, by_scan), (8000, 8000), "read {reads}: one state");
                    reads += 1;
                }
            });
        }
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    for i in 0..8 {
        assert_eq!(value(early.get(&acct(i)).unwrap()), 1000, "the reader opened before the writers");
    }
    let moved: Vec<u64> = (0..8).map(|i| value(kv.read_txn().unwrap().get(&acct(i)).unwrap())).collect();
    assert_ne!(moved, vec![1000; 8], "the writers moved units");
    assert_eq!(moved.iter().sum::<u64>(), 8000);
}

/// A read never goes back in time while buffered commits move into the
/// database behind it (a background thread writes them every 32 commits,
/// and reads share one snapshot of the database per such write): a writer
/// counts up, commit by commit; readers see the count only grow, and each
/// count's own record with it.
#[test]
fn redb_reads_never_go_back_while_commits_move_into_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(RedbKv::open(&dir.path().join("m.redb"), Duration::from_secs(1)).unwrap());
    let count = |v: Option<Vec<u8>>| v.map_or(0, |v| u64::from_le_bytes(v.try_into().unwrap()));
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (kv, done) = (kv.clone(), &done);
            s.spawn(move || {
                let mut last = 0;
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let mut r = kv.read_txn().unwrap();
                    let now = count(r.get(b"count").unwrap());
                    assert!(now >= last, "a read saw count {now} after {last}");
                    if now > 0 {
                        let own = r.get(format!("n{now:08}").as_bytes()).unwrap();
                        assert!(own.is_some(), "count {now} without its record");
                    }
                    last = now;
                }
            });
        }
        for n in 1..=3000u64 {
            let mut t = kv.write_txn().unwrap();
            t.put(b"count", &n.to_le_bytes());
            t.put(format!("n{n:08}").as_bytes(), b"x");
            t.commit(if n % 1000 == 0 { Durability::Durable } else { Durability::Buffered }).unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    assert_eq!(count(kv.read_txn().unwrap().get(b"count").unwrap()), 3000);
    let n = kv.read_txn().unwrap().scan(b"n", b"o", 10_000).unwrap().len();
    assert_eq!(n, 3000, "every commit's record");
}

/// Range deletes that take their records, from many threads at once (on
/// etcd they share transactions: group commit), each get exactly the
/// records of their own range, never another commit's.
fn kv_range_deletes_that_meet_each_take_their_own(name: &str, kv: Arc<dyn KvEngine>) {
    std::thread::scope(|s| {
        for t in 0..16u8 {
            let kv = kv.clone();
            s.spawn(move || {
                for round in 0..10u8 {
                    // A different number of records per thread and round,
                    // so that a neighbour's answer cannot look like one's own.
                    let want: Vec<(Vec<u8>, Vec<u8>)> =
                        (0..1 + (t + round) % 4).map(|i| (vec![b'q', t, i], vec![t, round, i])).collect();
                    let mut w = kv.write_txn().unwrap();
                    for (k, v) in &want {
                        w.put(k, v);
                    }
                    w.commit(Durability::Buffered).unwrap();
                    let taken = converged_metadata::kv::Taken::default();
                    let mut w = kv.write_txn().unwrap();
                    w.delete_range_taking(&[b'q', t], &[b'q', t + 1], &taken).unwrap();
                    w.put(&[b'd', t], &[round]);
                    w.commit(Durability::Buffered).unwrap();
                    assert_eq!(*taken.lock(), want, "{name}: thread {t}, round {round}: records taken");
                }
            });
        }
    });
    let left = kv.read_txn().unwrap().scan(b"q", b"r", 10).unwrap();
    assert!(left.is_empty(), "{name}: every range was emptied: {left:?}");
}

// ---- namespace suite ----

/// A shared store that refuses every request (etcd stopped: connections
/// refused at once) is asked again for as long as the namespace's wait
/// (`--meta-op-wait`) lasts: a create made while it refuses for 8 s is made
/// once it answers, and made once. With no wait, or once the node stops
/// waiting (its unmount), the first refusal fails the create and nothing is
/// made. (Before, a refused commit was tried 64 times, 0.2 ms to 0.1 s
/// apart: some 6 s of refusals failed the create.)
#[test]
fn a_store_that_refuses_is_asked_again_while_the_wait_lasts() {
    let faulty = Arc::new(FaultyKv::new(Arc::new(MemKv::cluster())));
    let ns = ns(faulty.clone());
    assert!(ns.is_clustered());
    let injected = || faulty.injected.swap(0, std::sync::atomic::Ordering::SeqCst);
    ns.mknod(ROOT, b"first", &file(0o644)).unwrap();

    faulty.fail_next(Fault::Refused, u32::MAX);
    let made = std::thread::scope(|s| {
        let create = s.spawn(|| ns.mknod(ROOT, b"f", &file(0o644)));
        std::thread::sleep(Duration::from_secs(8));
        faulty.fail_next(Fault::Refused, 0);
        create.join().unwrap()
    });
    let f = made.unwrap_or_else(|e| panic!("a create while the store refused for 8 s, within the wait: {e:?}"));
    assert!(injected() > 1, "the store was asked again");
    assert_eq!(ns.lookup(ROOT, b"f").unwrap().ino, f.ino);

    ns.set_unanswered_wait(Duration::ZERO);
    faulty.fail_next(Fault::Refused, u32::MAX);
    let e = ns.mknod(ROOT, b"g", &file(0o644)).expect_err("refused, with no wait");
    assert!(e.is_unanswered(), "{e:?}");
    assert_eq!(injected(), 1, "one try");

    ns.set_unanswered_wait(Duration::from_secs(60));
    ns.stop_waiting();
    let e = ns.mknod(ROOT, b"g", &file(0o644)).expect_err("refused, stopping");
    assert!(e.is_unanswered(), "{e:?}");
    assert_eq!(injected(), 1, "one try");
    faulty.fail_next(Fault::Refused, 0);
    assert!(matches!(ns.lookup(ROOT, b"g"), Err(MetaError::NotFound)), "nothing made");
}

fn ns(kv: Arc<dyn KvEngine>) -> Namespace {
    Namespace::open(kv, 0, 0).unwrap()
}

fn file(perm: u16) -> NewNode<'static> {
    NewNode {
        kind: FileKind::Regular,
        perm,
        uid: 1,
        gid: 2,
        rdev: 0,
        target: None,
        unsealed: false,
        umask: 0,
        request: None,
    }
}

fn dir() -> NewNode<'static> {
    NewNode { request: None, ..NewNode::plain(FileKind::Directory, 0o755) }
}

fn errno<T: std::fmt::Debug>(r: Result<T, MetaError>) -> i32 {
    r.unwrap_err().errno()
}

fn namespace_create_lookup_link_unlink(name: &str, kv: Arc<dyn KvEngine>) {
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

/// A change made for a kernel request records it in its transaction: the
/// request's connection and id find it (with the inode it made or named),
/// another connection's same id or a failed change do not.
fn changes_made_for_a_request_say_so(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv.clone());
    let req = |unique: u64| RequestMark { connection: 7, unique, resent: false };
    let answered = |unique: u64| ns.answered(req(unique)).unwrap();
    let d = ns.mknod(ROOT, b"d", &NewNode { request: Some(req(2)), ..dir() }).unwrap();
    assert_eq!(answered(2), Some(d.ino), "{name}: mkdir");
    assert_eq!(
        ns.answered(RequestMark { connection: 8, unique: 2, resent: false }).unwrap(),
        None,
        "{name}: another connection"
    );
    assert_eq!(answered(4), None, "{name}: a request that made no change");
    assert_eq!(errno(ns.mknod(ROOT, b"d", &NewNode { request: Some(req(4)), ..dir() })), libc::EEXIST);
    assert_eq!(answered(4), None, "{name}: a change that failed");
    let f = ns.mknod(d.ino, b"f", &NewNode { request: Some(req(6)), ..file(0o644) }).unwrap();
    assert_eq!(answered(6), Some(f.ino), "{name}: create");
    ns.link_answering(f.ino, ROOT, b"g", Some(req(8))).unwrap();
    assert_eq!(answered(8), Some(f.ino), "{name}: link");
    ns.rename_answering(d.ino, b"f", ROOT, b"h", RenameMode::Replace, Some(req(10))).unwrap();
    assert!(answered(10).is_some(), "{name}: rename");
    ns.unlink_purging(ROOT, b"g", &|_| false, Some(req(12))).unwrap();
    assert_eq!(answered(12), Some(f.ino), "{name}: unlink");
    ns.rmdir_purging(ROOT, b"d", &|_| true, Some(req(14))).unwrap();
    assert_eq!(answered(14), Some(d.ino), "{name}: rmdir");
    // A ring: a record is overwritten by a request as many slots later.
    let later = 14 + 2 * 4096;
    ns.mknod(ROOT, b"e", &NewNode { request: Some(req(later)), ..dir() }).unwrap();
    assert_eq!(answered(14), None, "{name}: overwritten");
    assert!(answered(later).is_some(), "{name}");
    assert_eq!(answered(6), Some(f.ino), "{name}: other slots kept");
    // A record a daemon of a volume made before kept in its ring under
    // `J` (a request it committed, sent again to this daemon) is found, and
    // the change made again for it is answered as made.
    let slot = |unique: u64| ((unique >> 1) % 4096) as u16;
    let legacy = |unique: u64, ino: u64| [7u64.to_be_bytes(), unique.to_be_bytes(), ino.to_be_bytes()].concat();
    let x = ns.mknod(ROOT, b"x", &dir()).unwrap();
    let mut t = kv.write_txn().unwrap();
    t.put(&converged_metadata::schema::answered_before(ns.node(), slot(20)), &legacy(20, x.ino));
    t.commit(Durability::Durable).unwrap();
    assert_eq!(answered(20), Some(x.ino), "{name}: a record of the ring's earlier place");
    let again = ns.mknod(ROOT, b"x", &NewNode { request: Some(RequestMark { resent: true, ..req(20) }), ..dir() });
    assert!(
        matches!(again, Err(MetaError::AlreadyMade { ino }) if ino == x.ino),
        "{name}: a resent mkdir made before is found made: {again:?}"
    );
    // A node forgotten takes its records along (in both places); another
    // node's stay.
    let n9 = Namespace::open(kv.clone(), 0, 0).unwrap().with_node("n9");
    n9.mknod(ROOT, b"n9", &NewNode { request: Some(req(2)), ..dir() }).unwrap();
    let mut t = kv.write_txn().unwrap();
    t.put(&converged_metadata::schema::known_node("n9"), b"");
    t.put(&converged_metadata::schema::answered_before("n9", slot(22)), &legacy(22, x.ino));
    t.commit(Durability::Durable).unwrap();
    assert!(n9.answered(req(2)).unwrap().is_some(), "{name}");
    assert_eq!(n9.answered(req(22)).unwrap(), Some(x.ino), "{name}");
    n9.forget_node("n9").unwrap();
    assert_eq!(n9.answered(req(2)).unwrap(), None, "{name}: forgotten with its node");
    assert_eq!(n9.answered(req(22)).unwrap(), None, "{name}: the ring's earlier place too");
    assert_eq!(answered(6), Some(f.ino), "{name}: another node's kept");
}

/// A commit that lands though its answer is lost (a reset connection to
/// etcd) is made again by the namespace's retry, which must find it made
/// and answer with what the landed attempt returned, rather than fail with
/// EEXIST or ENOENT, or, worse, succeed again: a RENAME_EXCHANGE made twice
/// swaps the names back, a RENAME_WHITEOUT made twice renames the whiteout
/// over the file. The fault is injected above the engine here (the engine
/// saw its commit answered); below the node cache in
/// `a_change_whose_answer_was_lost_under_the_node_cache_is_made_once`.
fn a_change_whose_answer_was_lost_is_made_once(name: &str, kv: Arc<dyn KvEngine>) {
    let faulty = Arc::new(FaultyKv::new(kv));
    answer_lost_cases(name, &ns(faulty.clone()), &faulty);
}

#[test]
fn a_change_whose_answer_was_lost_under_the_node_cache_is_made_once() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let kv = EtcdKv::connect(&cluster.endpoints, "lost", Duration::from_secs(5)).unwrap();
    let faulty = Arc::new(FaultyKv::new(Arc::new(kv)));
    let cached = CachedKv::wrap(faulty.clone()).unwrap();
    answer_lost_cases("etcd, lost under the cache", &ns(cached), &faulty);
}

/// A commit whose error came back while it was still on its way, and that
/// lands during the next attempt, after that attempt read the request's
/// record (not there yet) and before its other reads (which show the
/// change, as the node cache the change feed keeps does): the change is
/// made once and answered as made. Before, that attempt answered from what
/// it read: a create `EEXIST`, an unlink `ENOENT`, for changes made
/// (`cluster::a_reset_connection_to_etcd_costs_a_node_nothing_and_a_long_cut_ends`
/// met it about once in fifteen runs).
fn a_change_whose_commit_lands_late_is_made_once(name: &str, kv: Arc<dyn KvEngine>) {
    let faulty = Arc::new(FaultyKv::new(kv));
    let ns = ns(faulty.clone());
    let req = |unique: u64, resent: bool| Some(RequestMark { connection: 7, unique, resent });
    let late = |what: &str| {
        assert_eq!(faulty.injected.swap(0, std::sync::atomic::Ordering::SeqCst), 1, "{name}: {what}: one commit late");
    };
    // The node's first create takes a range of inode numbers first.
    ns.mknod(ROOT, b"first", &file(0o644)).unwrap();

    faulty.fail_next(Fault::LandsLate, 1);
    let f = ns.mknod(ROOT, b"f", &NewNode { request: req(2, false), ..file(0o644) });
    late("create");
    let f = f.unwrap_or_else(|e| panic!("{name}: a create whose commit landed late: {e:?}"));
    assert_eq!(ns.lookup(ROOT, b"f").unwrap().ino, f.ino, "{name}: the file made is the one answered");

    faulty.fail_next(Fault::LandsLate, 1);
    let gone = ns.unlink_purging(ROOT, b"f", &|_| false, req(4, false));
    late("unlink");
    let gone = gone.unwrap_or_else(|e| panic!("{name}: an unlink whose commit landed late: {e:?}"));
    assert_eq!((gone.ino, gone.orphaned), (f.ino, true), "{name}");
    assert_eq!(errno(ns.lookup(ROOT, b"f")), libc::ENOENT, "{name}");

    // An exchange made again finds nothing wrong in what it reads (the
    // names swapped by the landed commit): its own commit is refused, as
    // the record it read before the landing changed, and it is not made
    // a second time.
    let a = ns.mknod(ROOT, b"a", &file(0o644)).unwrap().ino;
    let b = ns.mknod(ROOT, b"b", &file(0o644)).unwrap().ino;
    faulty.fail_next(Fault::LandsLate, 1);
    let r = ns.rename_answering(ROOT, b"a", ROOT, b"b", RenameMode::Exchange, req(6, false));
    late("exchange");
    r.unwrap_or_else(|e| panic!("{name}: an exchange whose commit landed late: {e:?}"));
    let ino_of = |n: &[u8]| ns.lookup(ROOT, n).unwrap().ino;
    assert_eq!((ino_of(b"a"), ino_of(b"b")), (b, a), "{name}: exchanged once, not swapped back");
}

/// A purge whose commit landed and whose answer was lost loses with it the
/// chunk records etcd hands back with the range delete: the caller is still
/// told whom to ask to remove their copies (every node that registered,
/// the holders among them), for an unlink's purge and an orphan's. Before,
/// it was told nobody and the copies waited for each holder's sweep.
#[test]
fn a_purge_whose_answer_was_lost_still_names_the_holders() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let (_n2, _) = etcd_node(&cluster.endpoints, "purged", "n2");
    let (_n3, _) = etcd_node(&cluster.endpoints, "purged", "n3");
    let kv = EtcdKv::connect(&cluster.endpoints, "purged", Duration::from_secs(5)).unwrap();
    let faulty = Arc::new(FaultyKv::new(Arc::new(kv)));
    let ns = ns(faulty.clone()).with_node("n1");
    assert!(ns.is_clustered());
    let lost = |what: &str| assert_eq!(faulty.injected.swap(0, std::sync::atomic::Ordering::SeqCst), 1, "{what}");
    let holders = |h: &[String]| {
        let mut h = h.to_vec();
        h.retain(|n| n != "n1");
        h.sort();
        h
    };

    let f = ns.mknod(ROOT, b"f", &file(0o644)).unwrap().ino;
    seal_one_chunk(&ns, f, 1, &["n1", "n2"]);
    // Answered: the holders the records named.
    let g = ns.mknod(ROOT, b"g", &file(0o644)).unwrap().ino;
    seal_one_chunk(&ns, g, 1, &["n1", "n3"]);
    let gone = ns.unlink_purging(ROOT, b"g", &|_| true, None).unwrap();
    assert!(gone.purged);
    assert_eq!(holders(&gone.holders), ["n3"]);

    let req = Some(RequestMark { connection: 9, unique: 2, resent: false });
    faulty.fail_next(Fault::Unanswered, 1);
    let gone = ns.unlink_purging(ROOT, b"f", &|_| true, req).unwrap();
    lost("unlink");
    assert!(gone.purged, "purged once");
    assert!(holders(&gone.holders).contains(&"n2".to_string()), "the holder is told: {:?}", gone.holders);
    assert_eq!(errno(ns.getattr(f)), libc::ENOENT);

    let t = ns.tmpfile(ROOT, &file(0o644)).unwrap().ino;
    seal_one_chunk(&ns, t, 1, &["n1", "n3"]);
    faulty.fail_next(Fault::Unanswered, 1);
    let told = ns.purge_orphan(t).unwrap();
    lost("orphan purge");
    let told = told.expect("the orphan is purged");
    assert!(holders(&told).contains(&"n3".to_string()), "the holder is told: {told:?}");
    assert_eq!(errno(ns.getattr(t)), libc::ENOENT);
}

fn answer_lost_cases(name: &str, ns: &Namespace, faulty: &FaultyKv) {
    let req = |unique: u64| Some(RequestMark { connection: 9, unique, resent: false });
    let lost = |what: &str| {
        assert_eq!(faulty.injected.swap(0, std::sync::atomic::Ordering::SeqCst), 1, "{name}: {what}: one answer lost");
    };
    let ino_of = |parent: u64, n: &[u8]| ns.lookup(parent, n).unwrap().ino;
    // The node's first create takes a range of inode numbers in a commit
    // of its own: taken here, so each fault below meets the change itself.
    ns.mknod(ROOT, b"first", &file(0o644)).unwrap();

    faulty.fail_next(Fault::Unanswered, 1);
    let d = ns.mknod(ROOT, b"d", &NewNode { request: req(2), ..dir() }).unwrap().ino;
    lost("mkdir");
    assert_eq!(d, ino_of(ROOT, b"d"), "{name}: the directory made is the one answered");
    let a = ns.mknod(d, b"a", &file(0o644)).unwrap().ino;
    let b = ns.mknod(d, b"b", &file(0o600)).unwrap().ino;

    faulty.fail_next(Fault::Unanswered, 1);
    let victim = ns.rename_answering(d, b"a", d, b"b", RenameMode::Exchange, req(4)).unwrap();
    lost("exchange");
    assert!(victim.is_none(), "{name}");
    assert_eq!((ino_of(d, b"a"), ino_of(d, b"b")), (b, a), "{name}: exchanged once, not swapped back");

    faulty.fail_next(Fault::Unanswered, 1);
    ns.rename_with_whiteout(d, b"a", ROOT, b"w", false, (0, 0), req(6)).unwrap();
    lost("whiteout");
    assert_eq!(ino_of(ROOT, b"w"), b, "{name}: the file kept its new name");
    assert_eq!(ns.lookup(d, b"a").unwrap().kind, FileKind::CharDevice, "{name}: a whiteout where it was");

    faulty.fail_next(Fault::Unanswered, 1);
    assert_eq!(ns.link_answering(a, ROOT, b"l", req(8)).unwrap().nlink, 2, "{name}");
    lost("link");
    assert_eq!(ns.getattr(a).unwrap().nlink, 2, "{name}: linked once");

    faulty.fail_next(Fault::Unanswered, 1);
    let gone = ns.unlink_purging(ROOT, b"l", &|_| false, req(10)).unwrap();
    lost("unlink");
    assert_eq!((gone.ino, gone.orphaned), (a, false), "{name}");
    assert_eq!(errno(ns.lookup(ROOT, b"l")), libc::ENOENT, "{name}");
    assert_eq!(ns.getattr(a).unwrap().nlink, 1, "{name}: unlinked once");
    // The last name: the caller learns the file is an orphan (its last
    // close purges it), as from a commit answered at once.
    faulty.fail_next(Fault::Unanswered, 1);
    let gone = ns.unlink_purging(d, b"b", &|_| false, req(12)).unwrap();
    lost("last unlink");
    assert_eq!((gone.ino, gone.orphaned), (a, true), "{name}: the orphan is told");

    // The kernel's second sending of a request whose change committed:
    // found on the first attempt, nothing made again, the record's inode
    // answered (the daemon that made it is gone with what it returned).
    let resent = RequestMark { connection: 9, unique: 8, resent: true };
    let r = ns.link_answering(b, ROOT, b"l", Some(resent));
    assert!(matches!(r, Err(MetaError::AlreadyMade { ino }) if ino == a), "{name}: resent: {r:?}");
    assert_eq!(errno(ns.lookup(ROOT, b"l")), libc::ENOENT, "{name}: not linked again");
    // One that never committed is made.
    let fresh = RequestMark { connection: 9, unique: 14, resent: true };
    ns.link_answering(b, ROOT, b"l2", Some(fresh)).unwrap();
    assert_eq!(ino_of(ROOT, b"l2"), b, "{name}");
}

/// O_TMPFILE: an inode with no name, this node's orphan (purged at a crash
/// recovery) until its first link, which names it like any file; an
/// unlinked orphan gets no name back.
fn tmpfiles_are_orphans_until_linked(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    let d = ns.mknod(ROOT, b"d", &dir()).unwrap();
    let before = ns.getattr(d.ino).unwrap();
    let t = ns.tmpfile(d.ino, &NewNode { unsealed: true, ..file(0o640) }).unwrap();
    assert_eq!(ns.getattr(t.ino).unwrap().nlink, 0, "{name}");
    assert_eq!(ns.orphans().unwrap(), vec![t.ino], "{name}: a crash now purges it");
    assert!(ns.readdir(d.ino).unwrap().iter().all(|(_, e)| e.ino != t.ino), "{name}: no name in its directory");
    assert_eq!(ns.getattr(d.ino).unwrap().mtime, before.mtime, "{name}: the directory is not changed");
    assert_eq!(errno(ns.tmpfile(d.ino, &dir())), libc::EINVAL, "{name}");

    // Its first link names it: no longer an orphan, a file like any other.
    let linked = ns.link(t.ino, d.ino, b"ckpt").unwrap();
    assert_eq!((linked.nlink, linked.parent, linked.name.as_slice()), (1, d.ino, &b"ckpt"[..]), "{name}");
    assert_eq!(ns.lookup(d.ino, b"ckpt").unwrap().ino, t.ino, "{name}");
    assert!(ns.orphans().unwrap().is_empty(), "{name}");
    assert!(!ns.purge(t.ino).unwrap(), "{name}: a last close racing the link keeps the file");
    assert_eq!(ns.lookup(d.ino, b"ckpt").unwrap().ino, t.ino, "{name}");

    // Unlinked while open, it is an ordinary orphan: no name back.
    assert!(ns.unlink(d.ino, b"ckpt").unwrap().orphaned, "{name}");
    assert_eq!(errno(ns.link(t.ino, ROOT, b"again")), libc::ENOENT, "{name}");
    assert!(ns.purge(t.ino).unwrap(), "{name}");

    // A tmpfile never linked goes with its purge.
    let t2 = ns.tmpfile(ROOT, &file(0o600)).unwrap();
    assert!(ns.purge(t2.ino).unwrap(), "{name}");
    assert_eq!(errno(ns.getattr(t2.ino)), libc::ENOENT, "{name}");
    assert!(ns.orphans().unwrap().is_empty(), "{name}");
}

fn namespace_rename_rules(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    let a = ns.mknod(ROOT, b"a", &dir()).unwrap();
    let b = ns.mknod(a.ino, b"b", &dir()).unwrap();
    ns.mknod(b.ino, b"f", &file(0o600)).unwrap();
    let e = ns.mknod(ROOT, b"e", &dir()).unwrap();
    assert_eq!(errno(ns.rename(ROOT, b"a", b.ino, b"x", RenameMode::Replace)), libc::EINVAL, "{name}: into itself");
    assert_eq!(errno(ns.rename(a.ino, b"b", ROOT, b"e", RenameMode::NoReplace)), libc::EEXIST, "{name}");
    // The replaced empty directory is an orphan (nlink 0) for the caller to
    // purge at once, or once no handle is open on it.
    let gone = ns.rename(a.ino, b"b", ROOT, b"e", RenameMode::Replace).unwrap();
    assert!(
        gone.as_ref().is_some_and(|g| g.dir && g.orphaned && g.ino == e.ino),
        "{name}: empty dir replaced: {gone:?}"
    );
    assert_eq!(ns.getattr(e.ino).unwrap().nlink, 0, "{name}: a replaced directory has no link");
    assert!(ns.purge(e.ino).unwrap(), "{name}");
    assert_eq!(errno(ns.getattr(e.ino)), libc::ENOENT, "{name}: empty dir replaced and purged");
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

fn namespace_setattr_xattr_and_seal(name: &str, kv: Arc<dyn KvEngine>) {
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
    let epoch = ns.mark_unsealed(f.ino).unwrap();
    assert_eq!(ns.unsealed().unwrap(), vec![(f.ino, epoch)], "{name}");
    let seal = converged_metadata::Seal {
        size: 100,
        mtime: t,
        chunks: vec![(0, record.clone())],
        keep_unsealed: false,
        lease: None,
        data_durable: true,
        attrs: None,
    };
    ns.seal(f.ino, &seal, Durability::Durable).unwrap();
    assert!(ns.unsealed().unwrap().is_empty(), "{name}");
    assert_eq!(ns.chunks(f.ino).unwrap(), vec![(0, record)], "{name}");
    assert_eq!(ns.getattr(f.ino).unwrap().size, 100, "{name}");
    ns.setattr(f.ino, &SetAttr { size: Some(0), ..Default::default() }).unwrap();
    assert!(ns.chunks(f.ino).unwrap().is_empty(), "{name}: truncate drops chunk records");
}

/// Checkpoint rotation: `latest` is backed, then renamed to `prev` while
/// its object waits to move, and a new `latest` is written. The new file's
/// upload may not write the key until the old file's object has moved off
/// it; a purged file's object is deleted only if no other file owns its key.
fn object_keys_belong_to_one_file_at_a_time(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv).with_tier();
    let old = ns.mknod(ROOT, b"latest", &file(0o644)).unwrap();
    seal_one_chunk(&ns, old.ino, 1, &["n1"]);
    let up = go(ns.begin_upload(old.ino, "latest").unwrap());
    ns.end_upload(old.ino, up.generation, "latest", Some("\"v1\"".into())).unwrap();

    ns.rename(ROOT, b"latest", ROOT, b"prev", RenameMode::Replace).unwrap();
    assert_eq!(ns.tier(old.ino).unwrap().unwrap().state, TierState::ReKeying, "{name}");
    let new = ns.mknod(ROOT, b"latest", &file(0o644)).unwrap();
    seal_one_chunk(&ns, new.ino, 1, &["n1"]);
    assert_eq!(
        ns.begin_upload(new.ino, "latest").unwrap(),
        UploadStart::KeyBusy { owner: old.ino },
        "{name}: the old file's object is still under the key"
    );
    assert!(!ns.drop_replica(old.ino, 0, 1).unwrap(), "{name}: a re-keying file is not evictable");
    // The old file's object moves to its new key; the key is free then.
    assert_eq!(ns.claim_rekey(old.ino, "prev").unwrap(), Ok(()), "{name}");
    assert_eq!(ns.end_rekey(old.ino, "latest", None, "prev", Some("\"v1b\"".into())).unwrap(), (true, true), "{name}");
    let up = go(ns.begin_upload(new.ino, "latest").unwrap());
    assert_eq!(ns.end_upload(new.ino, up.generation, "latest", None).unwrap(), UploadEnd::Backed { stale: None });
    // Another backed file, renamed, cannot claim `prev`'s key while prev owns it...
    let other = ns.mknod(ROOT, b"other", &file(0o644)).unwrap();
    seal_one_chunk(&ns, other.ino, 1, &["n1"]);
    let up = go(ns.begin_upload(other.ino, "other").unwrap());
    ns.end_upload(other.ino, up.generation, "other", None).unwrap();
    ns.rename(ROOT, b"other", ROOT, b"moved", RenameMode::Replace).unwrap();
    assert_eq!(ns.claim_rekey(other.ino, "prev").unwrap(), Err(old.ino), "{name}");
    // ... and once prev is purged, its garbage may go only if no one else claimed it.
    let gone = ns.unlink_purging(ROOT, b"prev", &|_| true, None).unwrap();
    assert!(gone.purged, "{name}");
    assert_eq!(ns.claim_rekey(other.ino, "prev").unwrap(), Ok(()), "{name}: a purged owner lets go");
    assert!(!ns.release_garbage_key(old.ino, "prev").unwrap(), "{name}: prev's object is other's now");
}

/// A take of a write lease the node does not hold gets a higher epoch than
/// any before it for that file, across seals that drop the mark; a take of
/// a lease it holds keeps it. A seal made under a stale epoch is refused
/// whole (nothing of it is recorded) and so is a release; chunk versions
/// made under different epochs never collide.
fn write_lease_epochs_fence_stale_writers(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    let mut created = file(0o644);
    created.unsealed = true;
    let f = ns.mknod(ROOT, b"f", &created).unwrap();
    assert_eq!(ns.unsealed().unwrap(), vec![(f.ino, converged_metadata::CREATE_LEASE)], "{name}");
    assert_eq!(ns.mark_unsealed(f.ino).unwrap(), converged_metadata::CREATE_LEASE, "{name}: the create's lease");
    assert!(ns.release_lease(f.ino, converged_metadata::CREATE_LEASE).unwrap(), "{name}");
    let seal = |epoch: u64, version: u64, keep_unsealed: bool| converged_metadata::Seal {
        size: 10,
        mtime: Timespec::now(),
        chunks: vec![(
            0,
            ChunkRecord { version, len: 10, replicas: vec!["n1".into()], block_crcs: vec![version as u32] },
        )],
        keep_unsealed,
        lease: Some(epoch),
        data_durable: true,
        attrs: None,
    };
    let e1 = ns.mark_unsealed(f.ino).unwrap();
    assert!(e1 > converged_metadata::CREATE_LEASE, "{name}");
    assert!(ns.release_lease(f.ino, e1).unwrap(), "{name}");
    let e2 = ns.mark_unsealed(f.ino).unwrap();
    assert!(e2 > e1, "{name}: a new take, a new epoch");
    let v1 = converged_metadata::next_version(None, e1);
    let err = ns.seal(f.ino, &seal(e1, v1, true), Durability::Durable).unwrap_err();
    assert!(matches!(err, MetaError::LeaseLost { .. }), "{name}: {err}");
    assert!(ns.chunks(f.ino).unwrap().is_empty(), "{name}: nothing of a fenced seal is recorded");
    assert!(!ns.release_lease(f.ino, e1).unwrap(), "{name}: a stale epoch releases nothing");
    let v2 = converged_metadata::next_version(None, e2);
    assert_ne!(v1, v2, "{name}: versions of two epochs differ");
    ns.seal(f.ino, &seal(e2, v2, false), Durability::Durable).unwrap();
    assert!(ns.unsealed().unwrap().is_empty(), "{name}");
    // The mark is gone; the next take still gets a higher epoch, and its
    // versions follow every earlier one.
    let e3 = ns.mark_unsealed(f.ino).unwrap();
    assert!(e3 > e2, "{name}");
    let v3 = converged_metadata::next_version(Some(v2), e3);
    assert!(v3 > v2, "{name}");
    assert_eq!(converged_metadata::next_version(Some(v3), e3), v3 + 1, "{name}: one epoch counts up");
    assert!(ns.release_lease(f.ino, e3).unwrap(), "{name}");
    assert!(ns.unsealed().unwrap().is_empty(), "{name}");
    assert_eq!(ns.chunks(f.ino).unwrap()[0].1.version, v2, "{name}: a release keeps the last seal");
}

/// A seal whose bytes are not on stable storage yet leaves a sync-pending
/// mark; a clear for an older seal keeps the mark of a newer one; a seal of
/// synced bytes, or a purge, drops it.
fn seals_of_unsynced_bytes_stay_marked_until_synced(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    let f = ns.mknod(ROOT, b"f", &file(0o644)).unwrap();
    let g = ns.mknod(ROOT, b"g", &file(0o644)).unwrap();
    let record = ChunkRecord { version: 1, len: 10, replicas: vec!["n1".into()], block_crcs: vec![1] };
    let seal = |data_durable| converged_metadata::Seal {
        size: 10,
        mtime: Timespec::now(),
        chunks: vec![(0, record.clone())],
        keep_unsealed: false,
        lease: None,
        data_durable,
        attrs: None,
    };
    assert!(ns.sync_pending().unwrap().is_empty(), "{name}");
    ns.seal(f.ino, &seal(false), Durability::Buffered).unwrap();
    ns.seal(g.ino, &seal(false), Durability::Buffered).unwrap();
    let first = ns.sync_pending().unwrap();
    assert_eq!(first.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![f.ino, g.ino], "{name}");
    assert_eq!(ns.sync_pending_since().unwrap(), first, "{name}: the flusher's look finds the marks");
    // f is sealed again after its sync began: its newer mark survives the clear.
    ns.seal(f.ino, &seal(false), Durability::Buffered).unwrap();
    ns.clear_sync_pending(&first).unwrap();
    let left = ns.sync_pending().unwrap();
    assert_eq!(left.len(), 1, "{name}");
    assert_eq!(left[0].0, f.ino, "{name}");
    assert_ne!(left[0].1, first[0].1, "{name}");
    ns.seal(f.ino, &seal(true), Durability::Durable).unwrap();
    assert!(ns.sync_pending().unwrap().is_empty(), "{name}: a seal of synced bytes drops the mark");
    ns.seal(g.ino, &seal(false), Durability::Buffered).unwrap();
    ns.unlink(ROOT, b"g").unwrap();
    ns.purge(g.ino).unwrap();
    assert!(ns.sync_pending().unwrap().is_empty(), "{name}: a purge drops the mark");
    // The flusher's look: none found, then a seal's mark is found by the
    // next look however soon it comes.
    assert!(ns.sync_pending_since().unwrap().is_empty(), "{name}");
    assert!(ns.sync_pending_since().unwrap().is_empty(), "{name}");
    ns.seal(f.ino, &seal(false), Durability::Buffered).unwrap();
    assert_eq!(ns.sync_pending_since().unwrap().len(), 1, "{name}: a mark written after a look that found none");
}

fn large_directories_list_in_pages(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    for i in 0..2500 {
        ns.mknod(ROOT, format!("f{i:05}").as_bytes(), &file(0o644)).unwrap();
    }
    let names = ns.readdir(ROOT).unwrap();
    assert_eq!(names.len(), 2500, "{name}");
    assert!(names.windows(2).all(|w| w[0].0 < w[1].0), "{name}: ordered");
}

fn large_layouts_seal_in_batches(name: &str, kv: Arc<dyn KvEngine>) {
    // 300 chunks of 64 MiB (a 19 GiB checkpoint shard): more records than
    // one etcd transaction or response may carry.
    let ns = ns(kv);
    let f = ns.mknod(ROOT, b"big", &file(0o644)).unwrap();
    let blocks = (DEFAULT_CHUNK_SIZE / BLOCK_SIZE) as usize;
    let record = |i: u32| ChunkRecord {
        version: 1,
        len: DEFAULT_CHUNK_SIZE,
        replicas: vec!["n1".into(), "n2".into()],
        block_crcs: (0..blocks as u32).map(|b| b.wrapping_mul(2_654_435_761) ^ i).collect(),
    };
    ns.mark_unsealed(f.ino).unwrap();
    let chunks: Vec<(u32, ChunkRecord)> = (0..300).map(|i| (i, record(i))).collect();
    let size = 300 * DEFAULT_CHUNK_SIZE as u64;
    let seal = closing_seal(size, chunks.clone());
    ns.seal(f.ino, &seal, Durability::Durable).unwrap();
    assert_eq!(ns.chunks(f.ino).unwrap(), chunks, "{name}: every record back, in order");
    assert_eq!(ns.getattr(f.ino).unwrap().size, size, "{name}");
    assert!(ns.add_replicas(f.ino, 7, 1, &["n3".into()]).unwrap(), "{name}");
    assert!(!ns.add_replicas(f.ino, 7, 2, &["n4".into()]).unwrap(), "{name}: a stale version is refused");
    assert_eq!(ns.chunks(f.ino).unwrap()[7].1.replicas, vec!["n1", "n2", "n3"], "{name}");
    // Copies of several chunks at once, as the replicator records what it
    // copied: each applied as it would be alone, in one transaction.
    let copies = |index: u32, version: u64| NewCopies { ino: f.ino, index, version, nodes: vec!["n3".into()] };
    let mut batch: Vec<NewCopies> = (10..22).map(|i| copies(i, if i == 11 { 2 } else { 1 })).collect();
    batch.push(copies(7, 1));
    assert_eq!(ns.add_replicas_many(&batch).unwrap(), 11, "{name}: 11 added, a stale version and a named node left");
    let records = ns.chunks(f.ino).unwrap();
    for (i, record) in &records[10..22] {
        let want: &[&str] = if *i == 11 { &["n1", "n2"] } else { &["n1", "n2", "n3"] };
        assert_eq!(record.replicas, want, "{name}: chunk {i}");
    }
    assert_eq!(records[7].1.replicas, ["n1", "n2", "n3"], "{name}: named once");
    ns.unlink(ROOT, b"big").unwrap();
    assert!(ns.chunks(f.ino).unwrap().is_empty() || ns.purge(f.ino).unwrap(), "{name}");
    assert!(ns.chunks(f.ino).unwrap().is_empty(), "{name}: purge drops the whole layout");
}

/// The chunks `node` holds, as the holder index finds them, and the walk.
fn held_by(ns: &Namespace, node: &str) -> (Vec<(u64, u32)>, converged_metadata::HeldWalk) {
    let mut held = Vec::new();
    let walk = ns.for_each_chunk_held_by(node, |ino, index, _| held.push((ino, index))).unwrap();
    (held, walk)
}

/// The holder index names every holder a record names, through seals
/// (plain and batched), replicas added and dropped, and loses entries no
/// record names: dropped with the holder, found stale by a walk (a new
/// version held elsewhere, a truncate), or after a purge's flush.
fn holder_index_lists_every_holder_and_drops_what_no_record_names(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv).with_node("n1");
    let a = ns.mknod(ROOT, b"a", &file(0o644)).unwrap().ino;
    seal_one_chunk(&ns, a, 1, &["n1", "n2"]);
    if !ns.is_clustered() {
        // A single node holds every chunk of its volume and keeps no index.
        assert_eq!(held_by(&ns, "n1").1.entries, 0, "{name}");
        return;
    }
    let big = ns.mknod(ROOT, b"big", &file(0o644)).unwrap().ino;
    let record = |i: u32| ChunkRecord {
        version: 1,
        len: DEFAULT_CHUNK_SIZE,
        replicas: vec!["n1".into(), "n2".into(), "n3".into()],
        block_crcs: vec![i; 4],
    };
    // 150 records of 3 holders: 600 operations, written in batches.
    let seal = closing_seal;
    let chunk = DEFAULT_CHUNK_SIZE as u64;
    ns.seal(big, &seal(150 * chunk, (0..150).map(|i| (i, record(i))).collect()), Durability::Durable).unwrap();
    let bigs = |n: u32| (0..n).map(|i| (big, i)).collect::<Vec<_>>();
    let (n2, walk) = held_by(&ns, "n2");
    assert_eq!(n2, [vec![(a, 0)], bigs(150)].concat(), "{name}");
    assert_eq!((walk.entries, walk.held, walk.dropped), (151, 151, 0), "{name}");
    assert_eq!(held_by(&ns, "n3").0, bigs(150), "{name}");
    assert!(ns.add_replicas(a, 0, 1, &["n3".into()]).unwrap(), "{name}");
    assert_eq!(held_by(&ns, "n3").0, [vec![(a, 0)], bigs(150)].concat(), "{name}: an added holder is indexed");
    assert!(ns.drop_holders(a, 0, 1, &["n2".into()], 1).unwrap(), "{name}");
    let (n2, walk) = held_by(&ns, "n2");
    assert_eq!((n2, walk.dropped), (bigs(150), 0), "{name}: a dropped holder loses its entry in the same commit");
    // A new version of `a` held elsewhere: n3's entry is stale, and the
    // first walk that finds it drops it.
    seal_one_chunk(&ns, a, 2, &["n1", "n4"]);
    let (n3, walk) = held_by(&ns, "n3");
    assert_eq!((n3, walk.entries, walk.dropped), (bigs(150), 151, 1), "{name}");
    assert_eq!(held_by(&ns, "n3").1.entries, 150, "{name}: gone for the next walk");
    assert_eq!(held_by(&ns, "n4").0, vec![(a, 0)], "{name}");
    // A truncate leaves entries past the end to the walk.
    ns.seal(big, &seal(100 * chunk, Vec::new()), Durability::Durable).unwrap();
    let (n3, walk) = held_by(&ns, "n3");
    assert_eq!((n3, walk.dropped), (bigs(100), 50), "{name}");
    // A purge's entries go at the next flush, without a walk.
    ns.unlink(ROOT, b"big").unwrap();
    assert!(ns.chunks(big).unwrap().is_empty() || ns.purge(big).unwrap(), "{name}");
    assert_eq!(ns.flush_unindexed().unwrap(), 300, "{name}: n1, n2 and n3 of 100 chunks");
    assert_eq!(held_by(&ns, "n3").1.entries, 0, "{name}");
    assert_eq!(held_by(&ns, "n1").0, vec![(a, 0)], "{name}");
    // fsck finds a holder the index lacks, and lists it again.
    use converged_metadata::ops::fsck::Finding;
    let known: std::collections::HashSet<String> = ["n1", "n4"].map(String::from).into();
    let view = converged_metadata::ops::fsck::NodesView { known: &known, live: &known, default_replicas: 2 };
    let unindexed = |ns: &Namespace| -> Vec<Finding> {
        let report = ns.fsck(Some(&view), &|_| {}).unwrap();
        report.findings.into_iter().filter(|f| matches!(f, Finding::Unindexed { .. })).collect()
    };
    assert!(unindexed(&ns).is_empty(), "{name}");
    let mut txn = ns.engine().write_txn().unwrap();
    txn.delete(&converged_metadata::schema::held_chunk("n4", a, 0));
    txn.commit(Durability::Durable).unwrap();
    let found = unindexed(&ns);
    assert_eq!(found, vec![Finding::Unindexed { ino: a, index: 0, node: "n4".into() }], "{name}");
    assert!(ns.fsck_repair(&found[0]).unwrap(), "{name}");
    assert!(unindexed(&ns).is_empty(), "{name}");
    assert_eq!(held_by(&ns, "n4").0, vec![(a, 0)], "{name}");
}

/// A seal of a 300-chunk layout cut short at each point where a crash can
/// land: readers see the whole old layout (with its size) or the whole new
/// one, never a mix, and the next seal or move finishes what was left.
fn large_layouts_switch_whole_across_a_crash(name: &str, kv: Arc<dyn KvEngine>) {
    let faulty = Arc::new(FaultyKv::new(kv));
    let ns = ns(faulty.clone());
    let f = ns.mknod(ROOT, b"big", &file(0o644)).unwrap();
    let blocks = (DEFAULT_CHUNK_SIZE / BLOCK_SIZE) as usize;
    let layout = |version: u64, n: u32| -> Vec<(u32, ChunkRecord)> {
        (0..n)
            .map(|i| {
                let crcs = (0..blocks as u32).map(|b| b ^ i ^ version as u32).collect();
                (i, ChunkRecord { version, len: DEFAULT_CHUNK_SIZE, replicas: vec!["n1".into()], block_crcs: crcs })
            })
            .collect()
    };
    let seal =
        |chunks: &[(u32, ChunkRecord)]| closing_seal(chunks.len() as u64 * DEFAULT_CHUNK_SIZE as u64, chunks.to_vec());
    let (v1, v2, v3) = (layout(1, 300), layout(2, 280), layout(3, 300));
    ns.seal(f.ino, &seal(&v1), Durability::Durable).unwrap();
    let now = |what: &str, want: &[(u32, ChunkRecord)]| {
        assert!(ns.chunks(f.ino).unwrap() == want, "{name}: {what}: the layout is not the one expected");
        assert_eq!(ns.getattr(f.ino).unwrap().size, want.len() as u64 * DEFAULT_CHUNK_SIZE as u64, "{name}: {what}");
    };
    // Written in batches where the engine limits a transaction (etcd),
    // then the commit; else the commit alone. Cut short after each of its
    // transactions in turn, until the cut lands past the commit.
    let mut cuts = 0;
    loop {
        faulty.fail_after(cuts, Fault::Unavailable, 1);
        if ns.seal(f.ino, &seal(&v2), Durability::Durable).is_ok() {
            break;
        }
        now(&format!("crash after {cuts} of the seal's transactions"), &v1);
        cuts += 1;
    }
    faulty.fail_after(0, Fault::Unavailable, 0);
    // The last cut landed in the move to plain records, or nowhere.
    let batches = cuts - 1;
    assert_eq!(batches > 0, faulty.txn_limit().is_some(), "{name}: {batches} batches");
    ns.seal(f.ino, &seal(&v2), Durability::Durable).unwrap();
    now("a seal after the crashes", &v2);
    if batches > 0 {
        // Made current, then the move to plain records cut short: the
        // first cut past its batches and commit (v3 has more records).
        let mut cut = batches;
        loop {
            use std::sync::atomic::Ordering::SeqCst;
            let before = faulty.injected.load(SeqCst);
            faulty.fail_after(cut, Fault::Unavailable, 1);
            if ns.seal(f.ino, &seal(&v3), Durability::Durable).is_ok() {
                assert!(faulty.injected.load(SeqCst) > before, "{name}: the cut landed in the move");
                break;
            }
            now("a cut before the commit", &v2);
            cut += 1;
        }
        now("current before it is moved", &v3);
        assert!(!ns.add_replicas(f.ino, 7, 3, &["n9".into()]).unwrap(), "{name}: updates wait for the move");
        ns.finish_layout_move(f.ino).unwrap();
        now("moved", &v3);
        assert!(ns.add_replicas(f.ino, 7, 3, &["n9".into()]).unwrap(), "{name}");
    }
}

fn replica_policy_is_checked_and_inherited(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    let d = ns.mknod(ROOT, b"ckpt", &dir()).unwrap();
    assert_eq!(errno(ns.setxattr(d.ino, REPLICAS_XATTR, b"zero", XattrMode::Any)), libc::EINVAL, "{name}");
    assert_eq!(errno(ns.setxattr(d.ino, REPLICAS_XATTR, b"0", XattrMode::Any)), libc::EINVAL, "{name}");
    ns.setxattr(d.ino, REPLICAS_XATTR, b"3", XattrMode::Any).unwrap();
    let sub = ns.mknod(d.ino, b"run1", &dir()).unwrap();
    let f = ns.mknod(sub.ino, b"step1.pt", &file(0o644)).unwrap();
    assert_eq!(ns.replicas_policy(f.ino).unwrap(), Some(3), "{name}: inherited through a subdirectory");
    let other = ns.mknod(ROOT, b"other", &file(0o644)).unwrap();
    assert_eq!(ns.replicas_policy(other.ino).unwrap(), None, "{name}");
}

// ---- faults ----

/// The object tier's state machine: seals make a file dirty, an upload
/// counts only if no seal came in while it ran, a rename re-keys a backed
/// file, a purge queues its object for deletion, eviction and fetches move
/// the chunk's copy, and imports are files with no copy anywhere.
fn tier_state_machine(name: &str, kv: Arc<dyn KvEngine>) {
    use converged_metadata::ImportEntry;
    let ns = Namespace::open(kv, 0, 0).unwrap().with_node("n1").with_tier();
    let d = ns.mknod(ROOT, b"ckpt", &dir()).unwrap();
    let f = ns.mknod(d.ino, b"a.pt", &file(0o644)).unwrap();
    assert_eq!(ns.path_of(f.ino).unwrap(), Some(vec![b"ckpt".to_vec(), b"a.pt".to_vec()]), "{name}");
    let t = Timespec { sec: 1, nsec: 0 };
    let record = ChunkRecord { version: 1, len: 10, replicas: vec!["n1".into()], block_crcs: vec![7] };
    let seal = |chunks| converged_metadata::Seal {
        size: 10,
        mtime: t,
        chunks,
        keep_unsealed: false,
        lease: None,
        data_durable: true,
        attrs: None,
    };
    ns.seal(f.ino, &seal(vec![(0, record.clone())]), Durability::Durable).unwrap();
    let rec = ns.tier(f.ino).unwrap().expect("a sealed file has a tier record");
    assert_eq!((rec.state, rec.generation), (TierState::Dirty, 1), "{name}");

    // An upload superseded by a seal does not count; the next one does.
    let up = go(ns.begin_upload(f.ino, "ckpt/a.pt").unwrap());
    assert_eq!(ns.tier(f.ino).unwrap().unwrap().state, TierState::Uploading, "{name}");
    ns.seal(f.ino, &seal(vec![(0, ChunkRecord { version: 2, ..record.clone() })]), Durability::Durable).unwrap();
    assert_eq!(ns.end_upload(f.ino, up.generation, "ckpt/a.pt", None).unwrap(), UploadEnd::Superseded, "{name}");
    assert_eq!(ns.tier(f.ino).unwrap().unwrap().state, TierState::Dirty, "{name}");
    let up = go(ns.begin_upload(f.ino, "ckpt/a.pt").unwrap());
    let end = ns.end_upload(f.ino, up.generation, "ckpt/a.pt", Some("\"e1\"".into())).unwrap();
    assert_eq!(end, UploadEnd::Backed { stale: None }, "{name}");
    let rec = ns.tier(f.ino).unwrap().unwrap();
    assert_eq!((rec.state, rec.key.as_str(), rec.etag.as_deref()), (TierState::Backed, "ckpt/a.pt", Some("\"e1\"")));
    // A seal with nothing changed keeps it backed.
    ns.seal(f.ino, &seal(vec![]), Durability::Durable).unwrap();
    assert_eq!(ns.tier(f.ino).unwrap().unwrap().state, TierState::Backed, "{name}");

    // Eviction drops the copy of a backed chunk; a fetch records it again.
    assert!(ns.drop_replica(f.ino, 0, 2).unwrap(), "{name}");
    assert!(ns.chunk(f.ino, 0).unwrap().unwrap().replicas.is_empty(), "{name}");
    assert!(ns.record_fetched(f.ino, 0, Some(2), 10, &[7]).unwrap(), "{name}");
    assert_eq!(ns.chunk(f.ino, 0).unwrap().unwrap().replicas, vec!["n1".to_string()], "{name}");

    // A rename re-keys; the new key is recorded and the old one handed back.
    ns.rename(d.ino, b"a.pt", ROOT, b"b.pt", RenameMode::Replace).unwrap();
    assert_eq!(ns.path_of(f.ino).unwrap(), Some(vec![b"b.pt".to_vec()]), "{name}");
    assert_eq!(ns.tier(f.ino).unwrap().unwrap().state, TierState::ReKeying, "{name}");
    assert_eq!(ns.end_rekey(f.ino, "ckpt/a.pt", None, "b.pt", None).unwrap(), (true, true), "{name}");
    assert_eq!(ns.tier(f.ino).unwrap().unwrap().state, TierState::Backed, "{name}");
    // A dirty file cannot be evicted.
    ns.seal(f.ino, &seal(vec![(0, ChunkRecord { version: 3, ..record.clone() })]), Durability::Durable).unwrap();
    assert!(!ns.drop_replica(f.ino, 0, 3).unwrap(), "{name}");

    // Unlink purges the file and queues its object for deletion.
    let gone = ns.unlink_purging(ROOT, b"b.pt", &|_| true, None).unwrap();
    assert!(gone.purged, "{name}");
    let garbage = ns.garbage().unwrap();
    assert_eq!(garbage.len(), 1, "{name}");
    assert_eq!((garbage[0].0, garbage[0].1.key.as_str()), (f.ino, "b.pt"), "{name}");
    ns.drop_garbage(f.ino).unwrap();
    assert!(ns.garbage().unwrap().is_empty() && ns.tier(f.ino).unwrap().is_none(), "{name}");

    // Imported objects: backed files with no chunk record until fetched.
    let entries = vec![
        ImportEntry::File {
            name: b"x.bin".to_vec(),
            size: 5,
            mtime: t,
            key: "data/x.bin".into(),
            etag: Some("\"e\"".into()),
            source: Some("s3://data".into()),
        },
        ImportEntry::Dir { name: b"sub".to_vec(), url: "s3://data/sub".into() },
    ];
    assert_eq!(ns.import_entries(d.ino, &entries, 0, 0).unwrap(), 2, "{name}");
    assert_eq!(ns.import_entries(d.ino, &entries, 0, 0).unwrap(), 0, "{name}: a resumed listing adds nothing");
    let x = ns.lookup(d.ino, b"x.bin").unwrap();
    assert_eq!(x.size, 5, "{name}");
    assert!(ns.chunks(x.ino).unwrap().is_empty(), "{name}");
    assert_eq!(ns.tier(x.ino).unwrap().unwrap().source.as_deref(), Some("s3://data"), "{name}");
    let sub = ns.lookup(d.ino, b"sub").unwrap();
    assert_eq!(ns.getxattr(sub.ino, IMPORT_XATTR).unwrap(), b"s3://data/sub", "{name}");
    assert!(ns.record_fetched(x.ino, 0, None, 5, &[9]).unwrap(), "{name}");
    assert_eq!(ns.chunk(x.ino, 0).unwrap().unwrap().block_crcs, vec![9], "{name}");
    // A changed object drops what was fetched from the old one.
    ns.refresh_import(x.ino, 8, t, Some("\"f\"".into())).unwrap();
    assert!(ns.chunks(x.ino).unwrap().is_empty(), "{name}");
    assert_eq!(ns.getattr(x.ino).unwrap().size, 8, "{name}");
    // Deleting an imported file never queues its source object.
    ns.unlink_purging(d.ino, b"x.bin", &|_| true, None).unwrap();
    assert!(ns.garbage().unwrap().is_empty(), "{name}");

    // A renamed directory stays marked until its walk is done; a walk that
    // raced a second rename leaves the newer mark.
    assert!(ns.renamed_dirs(true).unwrap().is_empty(), "{name}");
    ns.rename(ROOT, b"ckpt", ROOT, b"ckpt2", RenameMode::Replace).unwrap();
    let marks = ns.renamed_dirs(true).unwrap();
    assert_eq!(marks.iter().map(|(i, m)| (*i, m.node.as_str())).collect::<Vec<_>>(), vec![(d.ino, "n1")], "{name}");
    let first = marks[0].1.clone();
    std::thread::sleep(std::time::Duration::from_millis(2));
    ns.rename(ROOT, b"ckpt2", ROOT, b"ckpt3", RenameMode::Replace).unwrap();
    ns.renamed_dir_walked(d.ino, &first).unwrap();
    let marks = ns.renamed_dirs(true).unwrap();
    assert_eq!(marks.len(), 1, "{name}: the second rename is still owed its walk");
    ns.renamed_dir_walked(d.ino, &marks[0].1).unwrap();
    assert!(ns.renamed_dirs(true).unwrap().is_empty(), "{name}");
    // rmdir drops a mark not walked yet.
    ns.rename(ROOT, b"ckpt3", ROOT, b"ckpt4", RenameMode::Replace).unwrap();
    assert_eq!(ns.renamed_dirs(true).unwrap().len(), 1, "{name}");
    ns.rmdir(d.ino, b"sub").unwrap();
    ns.rmdir(ROOT, b"ckpt4").unwrap();
    assert!(ns.renamed_dirs(true).unwrap().is_empty(), "{name}");
}

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

/// A transaction that cannot begin for a full disk (redb reopening its
/// database after a disk-full error writes first) frees the reserve as a
/// failed commit does, for a change and for a read; with no reserve left
/// the change fails with ENOSPC and leaves nothing. Before, the error went
/// straight back: an unlink on a full data disk answered ENOSPC while the
/// reserve was still there (`enospc::full_data_disk…`, about one run in 60).
#[test]
fn a_transaction_that_cannot_begin_on_a_full_disk_frees_the_reserve() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    let faulty = Arc::new(FaultyKv::new(Arc::new(MemKv::new())));
    let ns = Namespace::open(faulty.clone(), 0, 0).unwrap();
    // A reserve that can be given back twice.
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    ns.set_no_space_handler(move || c.fetch_add(1, SeqCst) < 2);
    // The node's first create takes a range of inode numbers first.
    ns.mknod(ROOT, b"first", &file(0o644)).unwrap();
    // A create reads the directory's replica policy, then begins its
    // change: the second transaction to begin is the change's.
    faulty.fail_after(1, Fault::FullAtBegin, 1);
    let a = ns.mknod(ROOT, b"a", &file(0o644)).expect("a change that could not begin, once");
    assert_eq!((faulty.injected.load(SeqCst), calls.load(SeqCst)), (1, 1));
    faulty.fail_next(Fault::FullAtBegin, 1);
    assert_eq!(ns.lookup(ROOT, b"a").expect("a read that could not begin, once").ino, a.ino);
    assert_eq!((faulty.injected.load(SeqCst), calls.load(SeqCst)), (2, 2));
    // Nothing left to free.
    faulty.fail_after(1, Fault::FullAtBegin, 1);
    assert_eq!(errno(ns.mknod(ROOT, b"b", &file(0o644))), libc::ENOSPC);
    assert_eq!((faulty.injected.load(SeqCst), calls.load(SeqCst)), (3, 3));
    assert_eq!(errno(ns.lookup(ROOT, b"b")), libc::ENOENT, "a change that could not begin leaves nothing");
}

#[test]
fn etcd_detects_conflicts_and_two_nodes_share_one_namespace() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let connect = || EtcdKv::connect(&cluster.endpoints, "shared", Duration::from_secs(5)).unwrap();

    // Raw engine: a write based on a stale read loses.
    let (a, b) = (connect(), connect());
    let mut t = a.write_txn().unwrap();
    t.put(b"counter", b"0");
    t.commit(Durability::Durable).unwrap();
    let mut ta = a.write_txn().unwrap();
    let mut tb = b.write_txn().unwrap();
    assert_eq!(ta.get(b"counter").unwrap().as_deref(), Some(&b"0"[..]));
    assert_eq!(tb.get(b"counter").unwrap().as_deref(), Some(&b"0"[..]));
    ta.put(b"counter", b"a");
    tb.put(b"counter", b"b");
    ta.commit(Durability::Durable).unwrap();
    assert!(matches!(tb.commit(Durability::Durable), Err(KvError::Conflict)), "stale read must conflict");
    // A scanned range that gained a key conflicts too (phantoms).
    let mut ta = a.write_txn().unwrap();
    assert!(ta.scan(b"dir/", b"dir0", 10).unwrap().is_empty());
    let mut tb = b.write_txn().unwrap();
    tb.put(b"dir/new", b"x");
    tb.commit(Durability::Durable).unwrap();
    ta.put(b"dir-was-empty", b"yes");
    assert!(matches!(ta.commit(Durability::Durable), Err(KvError::Conflict)));

    // Two namespaces ("nodes") creating in one directory at once: every
    // create lands once, with distinct inode numbers, retried on conflict.
    let ns1 = Arc::new(Namespace::open(Arc::new(connect()), 0, 0).unwrap());
    let ns2 = Arc::new(Namespace::open(Arc::new(connect()), 0, 0).unwrap());
    let d = ns1.mknod(ROOT, b"d", &dir()).unwrap();
    let workers: Vec<_> = [ns1.clone(), ns2.clone()]
        .into_iter()
        .enumerate()
        .map(|(n, ns)| {
            std::thread::spawn(move || {
                for i in 0..60 {
                    ns.mknod(d.ino, format!("n{n}-{i}").as_bytes(), &file(0o644)).unwrap();
                    ns.mknod(d.ino, format!("sub{n}-{i}").as_bytes(), &dir()).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let entries = ns2.readdir(d.ino).unwrap();
    assert_eq!(entries.len(), 240);
    let inos: std::collections::BTreeSet<u64> = entries.iter().map(|(_, e)| e.ino).collect();
    assert_eq!(inos.len(), 240, "inode numbers are unique across nodes");
    assert_eq!(ns1.getattr(d.ino).unwrap().nlink, 2 + 120, "no lost link-count update");
}

/// A node `id` registered in the cluster's membership, with its namespace
/// of `volume` on a connection of its own.
fn etcd_node(endpoints: &[String], volume: &str, id: &str) -> (Namespace, Arc<EtcdKv>) {
    use converged_metadata::membership::NodeInfo;
    let kv = Arc::new(EtcdKv::connect(endpoints, volume, Duration::from_secs(5)).unwrap());
    let now = Timespec::now();
    let info = NodeInfo {
        id: id.into(),
        addr: String::new(),
        capacity: 0,
        free: 0,
        labels: Default::default(),
        started: now,
        heartbeat: now,
    };
    kv.membership().unwrap().register(&info, Duration::from_secs(5)).unwrap();
    (Namespace::open(kv.clone(), 0, 0).unwrap().with_node(id), kv)
}

/// What another node's change feed hears of a create and an unlink made
/// for kernel requests: the records nodes use (the inode, the name, the
/// directory), not the writer's ring of answered requests, which only the
/// writer reads. Every change writes one; watched, it cost etcd and every
/// other node an event per change.
#[test]
fn other_nodes_hear_of_a_change_only_the_records_they_use() {
    use converged_metadata::schema;
    use converged_metadata::KvEngine as _;
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let (n1, kv1) = etcd_node(&cluster.endpoints, "heard", "n1");
    let (_n2, kv2) = etcd_node(&cluster.endpoints, "heard", "n2");
    let heard = Arc::new(parking_lot::Mutex::new(Vec::<Vec<u8>>::new()));
    let h = heard.clone();
    kv2.watch(Arc::new(move |key: &[u8], _: Option<&[u8]>| h.lock().push(key.to_vec()))).unwrap();
    // The feed says "start over" (the empty key) once its watch is in place.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !heard.lock().iter().any(|k| k.is_empty()) {
        assert!(std::time::Instant::now() < deadline, "the watch started");
        std::thread::sleep(Duration::from_millis(10));
    }
    // What n2's feed heard up to a marker n1 writes after `what`, from the
    // start of `what` (events come in commit order; a node's feed skips
    // its own commits).
    let hear = |what: &dyn Fn()| -> Vec<Vec<u8>> {
        heard.lock().clear();
        what();
        let mut t = kv1.write_txn().unwrap();
        t.put(schema::GC_REQUEST, b"marker");
        t.commit(Durability::Durable).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let keys = heard.lock().clone();
            if let Some(end) = keys.iter().position(|k| k == schema::GC_REQUEST) {
                let mut keys = keys[..end].to_vec();
                keys.retain(|k| !k.is_empty());
                keys.sort();
                return keys;
            }
            assert!(std::time::Instant::now() < deadline, "the feed heard the marker");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let req = |unique: u64| Some(RequestMark { connection: 3, unique, resent: false });
    // The node's first create takes a range of inode numbers first.
    hear(&|| drop(n1.mknod(ROOT, b"first", &file(0o644)).unwrap()));
    let f = std::sync::atomic::AtomicU64::new(0);
    let created = hear(&|| {
        let ino = n1.mknod(ROOT, b"f", &NewNode { request: req(2), ..file(0o644) }).unwrap().ino;
        f.store(ino, std::sync::atomic::Ordering::SeqCst);
    });
    let f = f.into_inner();
    let mut want = vec![schema::dentry(ROOT, b"f"), schema::inode(ROOT), schema::inode(f)];
    want.sort();
    assert_eq!(created, want, "a create: its name, its inode and the directory's");
    let removed = hear(&|| {
        n1.unlink_purging(ROOT, b"f", &|_| true, req(4)).unwrap();
    });
    assert!(removed.contains(&schema::dentry(ROOT, b"f")), "{removed:?}");
    let ring = schema::answered_of("n1");
    let before = schema::answered_before_of("n1");
    assert!(!removed.iter().any(|k| k.starts_with(&ring) || k.starts_with(&before)), "{removed:?}");
}

#[test]
fn etcd_write_lease_admits_one_writing_node() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let node = |id: &str| etcd_node(&cluster.endpoints, "lease", id);
    let (a, akv) = node("a");
    let (b, _bkv) = node("b");
    let f = a.mknod(ROOT, b"ckpt.pt", &file(0o644)).unwrap();
    let first = a.mark_unsealed(f.ino).unwrap();
    let a_lease = a.mark_unsealed(f.ino).unwrap(); // a second take on the same node is fine...
    assert_eq!(a_lease, first, "... and keeps the lease it holds");
    let e = b.mark_unsealed(f.ino).unwrap_err();
    assert_eq!(e.errno(), libc::ETXTBSY, "{e}");
    assert!(b.unsealed().unwrap().is_empty(), "b recovers only its own marks");
    assert_eq!(a.unsealed().unwrap(), vec![(f.ino, a_lease)]);
    // a dies (its membership lease is gone): b takes the write lease over.
    akv.membership().unwrap().leave().unwrap();
    let b_lease = b.mark_unsealed(f.ino).unwrap();
    assert!(b_lease > a_lease, "epochs of one file only grow, whoever takes the lease");
    assert_eq!(b.writer(f.ino).unwrap().as_deref(), Some("b"));
    assert!(a.unsealed().unwrap().is_empty(), "a, back, must not re-seal b's file");
    // a's writer, paused through all this, cannot publish over b: fenced.
    let record = ChunkRecord { version: 1, len: 4, replicas: vec!["a".into()], block_crcs: vec![1] };
    let seal = |lease, node: &str| converged_metadata::Seal {
        size: 4,
        mtime: Timespec::now(),
        chunks: vec![(0, ChunkRecord { replicas: vec![node.into()], ..record.clone() })],
        keep_unsealed: true,
        lease: Some(lease),
        data_durable: true,
        attrs: None,
    };
    let e = a.seal(f.ino, &seal(a_lease, "a"), Durability::Durable).unwrap_err();
    assert!(matches!(e, MetaError::LeaseLost { ref holder } if holder == "b"), "{e}");
    assert_eq!(e.errno(), libc::EIO);
    assert!(a.chunks(f.ino).unwrap().is_empty(), "nothing of a's seal was recorded");
    assert!(!a.release_lease(f.ino, a_lease).unwrap(), "a cannot drop b's lease");
    b.seal(f.ino, &seal(b_lease, "b"), Durability::Durable).unwrap();
    assert_eq!(b.chunks(f.ino).unwrap()[0].1.replicas, vec!["b".to_string()]);
}

#[test]
fn etcd_a_dead_nodes_backfill_is_taken_over() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let node = |id: &str| {
        let (ns, kv) = etcd_node(&cluster.endpoints, "adopt", id);
        (ns.with_tier(), kv)
    };
    let (a, akv) = node("a");
    let (b, _bkv) = node("b");
    let d = a.mknod(ROOT, b"run", &dir()).unwrap();
    let f = a.mknod(d.ino, b"x.pt", &file(0o644)).unwrap();
    seal_one_chunk(&a, f.ino, 1, &["a", "b"]);
    // Opened for writing again when a dies: its write lease is left behind.
    a.mark_unsealed(f.ino).unwrap();
    a.rename(ROOT, b"run", ROOT, b"run2", RenameMode::Replace).unwrap();
    assert_eq!(a.tier(f.ino).unwrap().unwrap().node, "a");
    let marks = b.renamed_dirs(false).unwrap();
    assert_eq!(marks.len(), 1);
    assert!(b.renamed_dirs(true).unwrap().is_empty(), "a's walk, not b's");
    // While a lives, its work stays its own.
    assert!(!b.adopt_backfill(f.ino, "a").unwrap());
    assert!(!b.adopt_renamed_dir(d.ino, &marks[0].1).unwrap());
    assert_eq!(b.begin_upload(f.ino, "run/f").unwrap(), UploadStart::Skip, "b does not upload a's file");
    // a dies: b takes the upload and the walk over, once.
    akv.membership().unwrap().leave().unwrap();
    assert!(b.adopt_backfill(f.ino, "a").unwrap());
    assert!(!b.adopt_backfill(f.ino, "a").unwrap(), "taken once");
    let rec = b.tier(f.ino).unwrap().unwrap();
    assert_eq!((rec.state, rec.node.as_str()), (TierState::Dirty, "b"));
    assert!(matches!(b.begin_upload(f.ino, "run2/f").unwrap(), UploadStart::Go(_)), "b uploads what a last published");
    assert!(b.adopt_renamed_dir(d.ino, &marks[0].1).unwrap());
    assert_eq!(b.renamed_dirs(true).unwrap().len(), 1);
    assert!(a.renamed_dirs(true).unwrap().is_empty(), "a, back, leaves it to b");
}

/// Repair and drain change chunk records in two steps: new holders are
/// added at the chunk's version, then holders that no longer count are
/// dropped, never below the copies asked for; a node is marked drained only
/// once no record names it, and forgotten only then.
fn copies_leave_a_record_only_after_their_replacements(name: &str, kv: Arc<dyn KvEngine>) {
    use converged_metadata::NodeAdmin;
    let ns = ns(kv);
    let f = ns.mknod(ROOT, b"f", &file(0o644)).unwrap();
    seal_one_chunk(&ns, f.ino, 3, &["n1", "n3"]);
    ns.set_node_admin("n3", Some(NodeAdmin::Draining)).unwrap();
    assert_eq!(ns.node_admin_states().unwrap().get("n3"), Some(&NodeAdmin::Draining), "{name}");
    assert!(ns.set_node_admin("n3", Some(NodeAdmin::Drained)).is_err(), "{name}: a record still names n3");
    let gone = ["n3".to_string()];
    // Dropping n3 would leave one copy where two are asked: refused.
    assert!(!ns.drop_holders(f.ino, 0, 3, &gone, 2).unwrap(), "{name}");
    // A copy of another version does not count.
    assert!(!ns.add_replicas(f.ino, 0, 2, &["n4".into()]).unwrap(), "{name}");
    assert!(ns.add_replicas(f.ino, 0, 3, &["n4".into()]).unwrap(), "{name}");
    assert!(!ns.drop_holders(f.ino, 0, 2, &gone, 2).unwrap(), "{name}: stale version");
    assert!(ns.drop_holders(f.ino, 0, 3, &gone, 2).unwrap(), "{name}");
    assert_eq!(ns.chunks(f.ino).unwrap()[0].1.replicas, vec!["n1".to_string(), "n4".to_string()], "{name}");
    assert_eq!(ns.chunks_naming("n3").unwrap(), 0, "{name}");
    ns.set_node_admin("n3", Some(NodeAdmin::Drained)).unwrap();
    // n1 is named by a record: it cannot be forgotten.
    assert!(ns.forget_node("n1").is_err(), "{name}");
    ns.set_node_admin("n3", None).unwrap();
    assert!(ns.node_admin_states().unwrap().is_empty(), "{name}");
}

/// Thousands of files created and closed empty have their unsealed marks
/// (their write leases) cleared in one call, whatever the engine's limit
/// on operations per transaction (etcd: 128).
fn many_files_closed_empty_lose_their_marks_together(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv).with_tier();
    let mut inos = Vec::new();
    for i in 0..300 {
        let f = ns.mknod(ROOT, format!("empty-{i}").as_bytes(), &file(0o644)).unwrap();
        ns.mark_unsealed(f.ino).unwrap();
        inos.push(f.ino);
    }
    assert_eq!(ns.unsealed().unwrap().len(), 300, "{name}");
    let ends: Vec<SessionEnd> = inos.iter().map(|i| SessionEnd::Empty(*i)).collect();
    ns.end_sessions(&ends).unwrap();
    assert!(ns.unsealed().unwrap().is_empty(), "{name}: every mark cleared");
    assert!(inos.iter().all(|i| ns.tier(*i).unwrap().is_some_and(|t| t.state == TierState::Dirty)), "{name}");
}

/// Writing sessions that ended unchanged since their publish give up their
/// leases in batches, past the engine's limit per transaction, each with a
/// sync-pending mark and its published layout kept; a session whose lease
/// was taken again since (a later epoch) keeps the new lease, with no mark.
fn published_sessions_end_together_under_their_own_lease(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    let mut ends = Vec::new();
    for i in 0..100 {
        let f = ns.mknod(ROOT, format!("published-{i}").as_bytes(), &file(0o644)).unwrap();
        let lease = ns.mark_unsealed(f.ino).unwrap();
        let record = ChunkRecord { version: 1, len: 10, replicas: vec!["n1".into()], block_crcs: vec![i] };
        let publish = converged_metadata::Seal {
            size: 10,
            mtime: Timespec::now(),
            chunks: vec![(0, record)],
            keep_unsealed: true,
            lease: Some(lease),
            data_durable: false,
            attrs: None,
        };
        ns.seal(f.ino, &publish, Durability::Buffered).unwrap();
        ends.push(SessionEnd::Published { ino: f.ino, lease });
    }
    // The last one's lease was given up and taken again: a later epoch.
    let SessionEnd::Published { ino: retaken, lease: old } = ends[99] else { unreachable!() };
    assert!(ns.release_lease(retaken, old).unwrap(), "{name}");
    let new = ns.mark_unsealed(retaken).unwrap();
    assert!(new > old, "{name}");
    ns.end_sessions(&ends).unwrap();
    assert_eq!(ns.unsealed().unwrap(), vec![(retaken, new)], "{name}: only the retaken lease stays");
    let marked: Vec<Ino> = ns.sync_pending().unwrap().into_iter().map(|(ino, _)| ino).collect();
    assert_eq!(marked.len(), 99, "{name}: each ended session's copy waits for its sync");
    assert!(!marked.contains(&retaken), "{name}");
    for (i, end) in ends.iter().enumerate() {
        let chunks = ns.chunks(end.ino()).unwrap();
        assert_eq!(chunks.len(), 1, "{name}");
        assert_eq!(chunks[0].1.block_crcs, vec![i as u32], "{name}: the published layout stays");
        assert_eq!(ns.getattr(end.ino()).unwrap().size, 10, "{name}");
    }
}

/// More seals of unsynced bytes than one etcd transaction can clear (a
/// second of an untar): the flusher's clear drops every mark.
fn a_seconds_sync_marks_clear_past_the_txn_limit(name: &str, kv: Arc<dyn KvEngine>) {
    let ns = ns(kv);
    let mut inos = Vec::new();
    for i in 0..200 {
        let f = ns.mknod(ROOT, format!("unsynced-{i}").as_bytes(), &file(0o644)).unwrap();
        ns.seal(f.ino, &unsynced_seal(), Durability::Buffered).unwrap();
        inos.push(f.ino);
    }
    let pending = ns.sync_pending().unwrap();
    assert_eq!(pending.len(), 200, "{name}: every seal left its mark");
    ns.clear_sync_pending(&pending).unwrap();
    assert!(ns.sync_pending().unwrap().is_empty(), "{name}: every mark cleared");
}

/// Sync-pending marks left under `S` (where they were written before they
/// moved past the watched range, to `s`) by a crash of an older daemon: the
/// node's look finds them beside new ones, the flusher's clear drops them,
/// as does the purge of their file; new marks go under `s` only.
fn sync_marks_written_before_their_new_prefix_are_kept(name: &str, kv: Arc<dyn KvEngine>) {
    use converged_metadata::schema;
    let ns = ns(kv.clone());
    let mut inos = Vec::new();
    for i in 0..3 {
        let f = ns.mknod(ROOT, format!("m{i}").as_bytes(), &file(0o644)).unwrap();
        ns.seal(f.ino, &unsynced_seal(), Durability::Buffered).unwrap();
        inos.push(f.ino);
    }
    // Two of the three marks as an older daemon wrote them.
    let mut t = kv.write_txn().unwrap();
    for ino in &inos[..2] {
        let mark = t.get(&schema::sync_pending(*ino)).unwrap().expect("a new mark is under s");
        assert!(t.get(&schema::sync_pending_before(*ino)).unwrap().is_none(), "{name}: and not under S");
        t.delete(&schema::sync_pending(*ino));
        t.put(&schema::sync_pending_before(*ino), &mark);
    }
    t.commit(Durability::Durable).unwrap();
    let mut found: Vec<Ino> = ns.sync_pending().unwrap().into_iter().map(|(ino, _)| ino).collect();
    found.sort();
    assert_eq!(found, inos, "{name}: the old marks are found beside the new one");
    ns.unlink(ROOT, b"m1").unwrap();
    ns.purge(inos[1]).unwrap();
    let pending = ns.sync_pending().unwrap();
    assert_eq!(
        pending.iter().map(|(ino, _)| *ino).collect::<Vec<_>>(),
        vec![inos[2], inos[0]],
        "{name}: purged with its file"
    );
    ns.clear_sync_pending(&pending).unwrap();
    assert!(ns.sync_pending().unwrap().is_empty(), "{name}: every mark cleared, old and new");
    let mut t = kv.read_txn().unwrap();
    for ino in &inos {
        assert!(t.get(&schema::sync_pending_before(*ino)).unwrap().is_none(), "{name}");
    }
}

/// Records broken behind the namespace's back (raw deletes, as a bug or a
/// bad restore would leave them): fsck names each, `fsck_repair` fixes what
/// the metadata alone can, and a second check is clean but for the chunk
/// that no live node holds.
fn fsck_finds_what_was_broken_and_repairs_what_it_can(name: &str, kv: Arc<dyn KvEngine>) {
    use converged_metadata::ops::fsck::{Finding, NodesView};
    use converged_metadata::schema;
    let ns = ns(kv.clone());
    let a = ns.mknod(ROOT, b"a", &file(0o644)).unwrap();
    seal_one_chunk(&ns, a.ino, 1, &["n1"]);
    let b = ns.mknod(ROOT, b"b", &file(0o644)).unwrap();
    ns.link(b.ino, ROOT, b"b2").unwrap();
    let c = ns.mknod(ROOT, b"c", &file(0o644)).unwrap();
    let d = ns.mknod(ROOT, b"d", &file(0o644)).unwrap();
    seal_one_chunk(&ns, d.ino, 1, &["n1", "n9"]);
    let nothing = |_| {};
    assert!(ns.fsck(None, &nothing).unwrap().findings.is_empty(), "{name}: a fresh namespace is clean");

    let mut t = kv.write_txn().unwrap();
    t.delete(&schema::inode(a.ino));
    t.delete(&schema::dentry(ROOT, b"b2"));
    t.delete(&schema::dentry(ROOT, b"c"));
    t.commit(Durability::Durable).unwrap();
    let known: std::collections::HashSet<String> = ["n1".to_string()].into();
    let live = std::collections::HashSet::new();
    let nodes = NodesView { known: &known, live: &live, default_replicas: 2 };
    let found = ns.fsck(Some(&nodes), &nothing).unwrap().findings;
    let want = vec![
        Finding::DanglingName { parent: ROOT, name: b"a".to_vec(), ino: a.ino },
        Finding::LinkCount { ino: b.ino, recorded: 2, names: 1 },
        Finding::Unreachable { ino: c.ino, kind: FileKind::Regular },
        Finding::UnknownHolder { ino: d.ino, index: 0, node: "n9".into() },
        Finding::Lost { ino: d.ino, index: 0 },
        Finding::ChunksOfMissingInode { ino: a.ino, chunks: 1 },
    ];
    assert_eq!(found, want, "{name}");
    for f in &found {
        let fixable = !matches!(f, Finding::Lost { .. });
        assert_eq!(ns.fsck_repair(f).unwrap(), fixable, "{name}: {f:?}");
    }
    let after = ns.fsck(Some(&nodes), &nothing).unwrap().findings;
    assert_eq!(after, vec![Finding::Lost { ino: d.ino, index: 0 }], "{name}");
    assert_eq!(ns.getattr(b.ino).unwrap().nlink, 1, "{name}");
    let lf = ns.lookup(ROOT, b"lost+found").unwrap();
    assert_eq!(ns.lookup(lf.ino, format!("#{}", c.ino).as_bytes()).unwrap().ino, c.ino, "{name}");
    assert_eq!(ns.chunks(d.ino).unwrap()[0].1.replicas, vec!["n1".to_string()], "{name}");
}

/// `--nowsync` on a real etcd behind the node cache: node a acknowledges
/// creates in a directory it made before they commit, from four threads,
/// while its flusher commits them; node b's listing recalls the
/// delegation and sees every one of them, with the link count right. A
/// third node that lost its delegation while cut off commits nothing of
/// what it acknowledged there.
#[test]
fn nowsync_on_a_real_etcd_cluster_through_the_node_cache() {
    use converged_metadata::kv_deferred::DeferredKv;
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let node = |id: &str, deferred: Option<bool>| {
        let (_, raw) = etcd_node(&cluster.endpoints, "nowsync", id);
        let cached = CachedKv::wrap(raw).unwrap();
        let d = deferred.map(|running| match running {
            true => DeferredKv::wrap(cached.clone(), id),
            false => DeferredKv::wrap_manual(cached.clone(), id),
        });
        let engine: Arc<dyn KvEngine> = match &d {
            Some(d) => d.clone(),
            None => cached,
        };
        let mut ns = Namespace::open(engine, 0, 0).unwrap().with_node(id);
        if let Some(d) = &d {
            ns = ns.with_nowsync(d.clone());
        }
        (Arc::new(ns), d)
    };
    let (a, _) = node("a", Some(true));
    let (b, _) = node("b", None);
    let holder = a.clone();
    b.set_recall_handler(move |ns, dir, id| match id {
        "a" => holder.release_dir(dir),
        // Any other holder here is dead: its delegation is taken over.
        _ => ns.drop_delegation(dir, id),
    });
    let d = a.mknod(ROOT, b"d", &dir()).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let a = &a;
            s.spawn(move || {
                for i in 0..50 {
                    a.mknod(d.ino, format!("t{t}-{i}").as_bytes(), &file(0o644)).unwrap();
                    if i % 10 == 0 {
                        a.mknod(d.ino, format!("dir{t}-{i}").as_bytes(), &dir()).unwrap();
                    }
                }
            });
        }
    });
    let names = b.readdir(d.ino).unwrap();
    assert_eq!(names.len(), 4 * 55, "every acknowledged create is read on b");
    assert_eq!(b.getattr(d.ino).unwrap().nlink, 2 + 20);
    assert!(b.lookup(d.ino, b"t3-49").is_ok());

    // c acknowledges a create in its own directory, is cut off, and b
    // takes the directory over (c found dead): c's flush is fenced.
    let (c, cd) = node("c", Some(false));
    let e = c.mknod(ROOT, b"e", &dir()).unwrap();
    c.mknod(e.ino, b"lost", &file(0o644)).unwrap();
    b.drop_delegation(e.ino, "c").unwrap();
    b.mknod(e.ino, b"kept", &file(0o644)).unwrap();
    cd.as_ref().unwrap().flush_all().unwrap();
    assert_eq!(cd.unwrap().backlog(), (0, 0, 1), "c dropped its acknowledged create");
    let names: Vec<Vec<u8>> = b.readdir(e.ino).unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec![b"kept".to_vec()]);
}

/// The embedded engine keeps its last buffered commits in memory, as layers
/// over the database, and a background thread moves them into it. Against
/// a plain map, over many buffered commits (some still layers, some already
/// in the database): every key read and every scan (one file's records,
/// ranges inside one file's, ranges across files, a whole record kind)
/// answers as the map does, in a write transaction as in a read one. A read
/// that took a layer's value over a newer one, or the database's over a
/// layer's, would answer with an older value.
#[test]
fn redb_reads_through_buffered_commits_match_a_plain_map() {
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    // Keys shaped as the namespace's: a kind byte, a big-endian inode
    // number, then a suffix (a name, a chunk index), or just the kind + inode.
    fn key(kind: u8, ino: u64, suffix: &[u8]) -> Vec<u8> {
        let mut k = vec![kind];
        k.extend_from_slice(&ino.to_be_bytes());
        k.extend_from_slice(suffix);
        k
    }
    let op = (0..3u8, 0..12u64, prop::collection::vec(0..4u8, 0..3), any::<bool>(), any::<u8>());
    let commit = prop::collection::vec(op, 1..8);
    let config = ProptestConfig { cases: 24, ..ProptestConfig::default() };
    proptest!(config, |(commits in prop::collection::vec(commit, 1..120), probes in prop::collection::vec((0..3u8, 0..12u64, prop::collection::vec(0..4u8, 0..3)), 1..40))| {
        let dir = tempfile::tempdir().unwrap();
        let kv = RedbKv::open(&dir.path().join("m.redb"), Duration::from_secs(1)).unwrap();
        let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for (n, ops) in commits.iter().enumerate() {
            let mut t = kv.write_txn().unwrap();
            for (kind, ino, suffix, put, v) in ops {
                let k = key(b'A' + kind, *ino, suffix);
                if *put {
                    t.put(&k, &[*v, n as u8]);
                    model.insert(k, vec![*v, n as u8]);
                } else {
                    t.delete(&k);
                    model.remove(&k);
                }
            }
            t.commit(Durability::Buffered).unwrap();
        }
        let ranges = |kind: u8, ino: u64, suffix: &[u8]| {
            let whole = key(b'A' + kind, ino, b"");
            let mut whole_end = whole.clone();
            *whole_end.last_mut().unwrap() += 1;
            vec![
                (whole.clone(), whole_end),                                   // one file's records
                (key(b'A' + kind, ino, suffix), key(b'A' + kind, ino, &[9])), // within one file's
                (whole, key(b'A' + kind, ino + 3, b"")),                      // across files
                (key(b'A' + kind, 0, b""), key(b'A' + kind + 1, 0, b"")),     // a whole kind
            ]
        };
        for reading in ["read", "write"] {
            let mut r: Box<dyn converged_metadata::kv::KvRead> = match reading {
                "read" => kv.read_txn().unwrap(),
                _ => kv.write_txn().unwrap(),
            };
            for (kind, ino, suffix) in &probes {
                let k = key(b'A' + kind, *ino, suffix);
                prop_assert_eq!(r.get(&k).unwrap(), model.get(&k).cloned(), "{} get {:?}", reading, k);
                for (start, end) in ranges(*kind, *ino, suffix) {
                    let want: Vec<(Vec<u8>, Vec<u8>)> =
                        model.range(start.clone()..end.clone()).map(|(k, v)| (k.clone(), v.clone())).collect();
                    prop_assert_eq!(r.scan(&start, &end, usize::MAX).unwrap(), want, "{} scan [{:?}, {:?})", reading, start, end);
                }
            }
        }
    });
}

/// The servers the tests start (etcd members, moto, a daemon's metrics
/// endpoint) take their ports from `etcd_cluster::free_port`, which must
/// never hand one out twice while the process that took it lives: 300
/// asked in one process are all different (ports picked at random and
/// only checked free, as before, repeat among 300 about seven times in
/// eight), and another process cannot take one of them while this one
/// lives.
#[test]
fn test_ports_are_handed_out_once() {
    let ports: std::collections::HashSet<u16> = (0..300).map(|_| etcd_cluster::free_port()).collect();
    assert_eq!(ports.len(), 300, "a port was handed out twice");
    let held = *ports.iter().next().unwrap();
    let other = std::process::Command::new("flock")
        .arg("--nonblock")
        .arg(etcd_cluster::port_lock(held))
        .arg("true")
        .status()
        .expect("run flock(1)");
    assert!(!other.success(), "another process took port {held}, which this one holds");
}
