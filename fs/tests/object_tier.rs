//! The object tier in one process: a core over `MemKv` whose files are
//! backfilled to an in-memory object store, with no kernel, no root and no
//! S3 server. The backfill and eviction workers are stepped by the tests.
//! (The same behaviours against a real S3 server through a mount are in
//! `tests/tests/object_tier.rs`.)

mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_fs::object_faults::{Fault, FaultyStore};
use converged_fs::tier::TierConfig;
use converged_fs::workers::{Backfiller, Evictor, Step, Worker};
use converged_metadata::types::TierState;
use harness::*;
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStoreExt;

fn cfg(evict: bool) -> TierConfig {
    TierConfig {
        backfill_delay: Duration::ZERO,
        keep_deleted: false,
        // Evicting: any use of the data disk is above the watermark.
        evict_high: if evict { 1e-9 } else { 0.99 },
        evict_low: if evict { 1e-10 } else { 0.98 },
        workers: 1,
        copy_limit: converged_fs::tier::COPY_LIMIT,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Step a backfill worker until `path` is backed (or `limit` passes).
fn backfill_until_backed(tc: &TestCore, path: &str, limit: Duration) -> Result<(), String> {
    let ino = resolve(&tc.core, path).map_err(|e| e.to_string())?.ino;
    let mut worker = Backfiller::new(Arc::downgrade(&tc.core), 0);
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let rec = tc.core.namespace().tier(ino).map_err(|e| e.to_string())?;
        if rec.as_ref().is_some_and(|r| r.state == TierState::Backed) {
            return Ok(());
        }
        if let Step::Stop = worker.step() {
            return Err("the backfill worker stopped".into());
        }
    }
    Err(format!("{path} not backed within {limit:?}: {:?}", tc.core.namespace().tier(ino)))
}

fn object(store: &InMemory, key: &str) -> Option<Vec<u8>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async { Some(store.get(&ObjectPath::from(key)).await.ok()?.bytes().await.ok()?.to_vec()) })
}

#[test]
fn a_closed_file_becomes_one_object_and_reads_back_from_it_once_evicted() {
    let store = Arc::new(InMemory::new());
    let tc = TestCore::with_object_store(store.clone(), cfg(true));
    mkdir(&tc.core, "ckpt").unwrap();
    let data = pattern(3 << 20, 7);
    create_file(&tc.core, "ckpt/step1.pt", &data).unwrap();
    tc.core.flush().unwrap();
    backfill_until_backed(&tc, "ckpt/step1.pt", Duration::from_secs(20)).unwrap();
    assert_eq!(object(&store, "mnt/ckpt/step1.pt").as_deref(), Some(&data[..]), "the object holds the file's bytes");

    // Evict every backed chunk, then read the file: its bytes come back from the store.
    let mut evictor = Evictor { core: Arc::downgrade(&tc.core) };
    match evictor.step() {
        Step::Worked(what) => assert!(what.contains("evicted"), "{what}"),
        _ => panic!("the evictor evicted nothing"),
    }
    let ino = resolve(&tc.core, "ckpt/step1.pt").unwrap().ino;
    let chunks = tc.core.namespace().chunks(ino).unwrap();
    assert!(chunks.iter().all(|(_, r)| r.replicas.is_empty()), "every chunk was evicted: {chunks:?}");
    assert_eq!(read_file(&tc.core, "ckpt/step1.pt").unwrap(), data, "read back from the object store");
    let chunks = tc.core.namespace().chunks(ino).unwrap();
    assert!(chunks.iter().all(|(_, r)| !r.replicas.is_empty()), "the read hydrated the SSD again");
}

#[test]
fn a_store_outage_loses_nothing_and_the_backlog_drains_after_it() {
    let faulty = Arc::new(FaultyStore::new(InMemory::new()));
    let tc = TestCore::with_object_store(faulty.clone(), cfg(false));
    faulty.set(Fault::Down);
    let files: Vec<(String, Vec<u8>)> = (0..3).map(|i| (format!("f{i}"), pattern(100_000 + i, i as u8))).collect();
    for (name, data) in &files {
        create_file(&tc.core, name, data).unwrap();
    }
    tc.core.flush().unwrap();
    // While the store is down, uploads fail and files stay readable, not backed.
    let mut worker = Backfiller::new(Arc::downgrade(&tc.core), 0);
    for _ in 0..5 {
        worker.step();
    }
    for (name, data) in &files {
        let ino = resolve(&tc.core, name).unwrap().ino;
        let state = tc.core.namespace().tier(ino).unwrap().map(|r| r.state);
        assert_ne!(state, Some(TierState::Backed), "{name} cannot be backed while the store is down");
        assert_eq!(&read_file(&tc.core, name).unwrap(), data);
    }
    faulty.clear();
    for (name, data) in &files {
        backfill_until_backed(&tc, name, Duration::from_secs(60)).unwrap();
        let key = format!("mnt/{name}");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let got =
            rt.block_on(async { faulty.inner().get(&ObjectPath::from(key.as_str())).await.unwrap().bytes().await });
        assert_eq!(&got.unwrap()[..], &data[..], "{name}: the object holds the file's bytes");
    }
}
