//! A property test of the cluster, in process: three cores over one
//! in-memory metadata store and a [`converged_transport::MemNetwork`], two
//! copies of each chunk, every file backfilled to one object store, and
//! random sequences of operations on any node checked against a plain model
//! of what every node must read.
//!
//! The model is close-to-open across nodes: what a writer published (its
//! close, or its fsync) is what any node reads; a node holding a file open
//! for writing reads its own unpublished bytes, every other node the
//! published ones (reads during a rewrite). Faults injected between steps:
//! a node cut off from the network (its peers cannot reach it nor it them;
//! at most one at a time), a node whose membership lease lapses (a writer
//! it holds is fenced: its fsync and close fail with EIO and publish
//! nothing), and the object store going down while chunks are evicted from
//! nodes' disks (a read may then fail with EIO, and only when a chunk has
//! no copy left that the reader can reach). Nothing else may fail, and no
//! read may return other bytes than the model's.
//!
//! Case count and seed are fixed for CI (`PROPTEST_CASES` and
//! `PROPTEST_RNG_SEED` override them); proptest shrinks a failing sequence
//! and prints it.

mod harness;

use std::collections::HashMap;
use std::sync::Arc;

use converged_fs::core::Core;
use converged_fs::error::FsResult;
use converged_fs::object_faults::{Fault, FaultyStore};
use converged_fs::workers::{Backfiller, Evictor, Worker};
use converged_metadata::membership::Heartbeat;
use converged_metadata::types::{Ino, TierState};
use converged_transport::PeerFault;
use harness::cluster::{pattern, tier_config, TestCluster, CHUNK};
use harness::{put_file, read_ino, resolve, truncate, unlink, write_all, write_file};
use object_store::memory::InMemory;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed};

const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// Names in the root the operations use: few, so that they meet.
const NAMES: usize = 3;
/// Sizes and offsets: small ones, and ones about the end of the first
/// chunk (the harness's chunks are 4 MiB, one remote read window), so that
/// files of one and of two chunks both come up.
fn extent() -> impl Strategy<Value = usize> {
    prop_oneof![0..(64usize << 10), (CHUNK - (64 << 10))..(CHUNK + (64 << 10))]
}
const SEED: u64 = 0x00c1_0057_e000_0001;

#[derive(Debug, Clone)]
enum Op {
    /// open(O_CREAT|O_TRUNC), write `len` bytes, close, release (and the
    /// node's flush, which gives up its write lease).
    Put {
        node: usize,
        name: usize,
        len: usize,
        seed: u8,
    },
    /// open(O_WRONLY), pwrite, close, release, flush.
    Patch {
        node: usize,
        name: usize,
        offset: usize,
        len: usize,
        seed: u8,
    },
    Truncate {
        node: usize,
        name: usize,
        size: usize,
    },
    Read {
        node: usize,
        name: usize,
    },
    Unlink {
        node: usize,
        name: usize,
    },
    /// link(2): a second name for a file.
    Link {
        node: usize,
        from: usize,
        to: usize,
    },
    Rename {
        node: usize,
        from: usize,
        to: usize,
    },
    /// Open a file for writing and write, leaving it open.
    Hold {
        node: usize,
        name: usize,
        offset: usize,
        len: usize,
        seed: u8,
    },
    /// fsync of the held handle.
    Publish,
    /// close and release of the held handle.
    Close,
    /// The node's membership lease runs out and it registers anew.
    Lapse {
        node: usize,
    },
    /// The node's core stops as at an unmount and starts again (recovery).
    Restart {
        node: usize,
    },
    /// The node leaves the network.
    Cut {
        node: usize,
    },
    /// Every node reaches every other again.
    Heal,
    /// A few steps of the node's backfill worker.
    Backfill {
        node: usize,
    },
    /// One step of the node's evictor (every backed chunk goes).
    Evict {
        node: usize,
    },
    StoreDown,
    StoreUp,
}

fn op() -> impl Strategy<Value = Op> {
    let node = 0..NODES.len();
    let name = 0..NAMES;
    prop_oneof![
        4 => (node.clone(), name.clone(), extent(), any::<u8>())
            .prop_map(|(node, name, len, seed)| Op::Put { node, name, len, seed }),
        3 => (node.clone(), name.clone(), extent(), 1..(128usize << 10), any::<u8>())
            .prop_map(|(node, name, offset, len, seed)| Op::Patch { node, name, offset, len, seed }),
        1 => (node.clone(), name.clone(), extent()).prop_map(|(node, name, size)| Op::Truncate { node, name, size }),
        6 => (node.clone(), name.clone()).prop_map(|(node, name)| Op::Read { node, name }),
        1 => (node.clone(), name.clone()).prop_map(|(node, name)| Op::Unlink { node, name }),
        1 => (node.clone(), name.clone(), name.clone()).prop_map(|(node, from, to)| Op::Rename { node, from, to }),
        1 => (node.clone(), name.clone(), name.clone()).prop_map(|(node, from, to)| Op::Link { node, from, to }),
        2 => (node.clone(), name.clone(), extent(), 1..(128usize << 10), any::<u8>())
            .prop_map(|(node, name, offset, len, seed)| Op::Hold { node, name, offset, len, seed }),
        1 => Just(Op::Publish),
        2 => Just(Op::Close),
        1 => node.clone().prop_map(|node| Op::Lapse { node }),
        1 => node.clone().prop_map(|node| Op::Restart { node }),
        1 => node.clone().prop_map(|node| Op::Cut { node }),
        1 => Just(Op::Heal),
        1 => node.clone().prop_map(|node| Op::Backfill { node }),
        1 => node.clone().prop_map(|node| Op::Evict { node }),
        1 => Just(Op::StoreDown),
        1 => Just(Op::StoreUp),
    ]
}

/// `bytes` with `data` written at `offset` (a hole of zeros before it).
fn patched(bytes: &[u8], offset: usize, data: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    if out.len() < offset + data.len() {
        out.resize(offset + data.len(), 0);
    }
    out[offset..offset + data.len()].copy_from_slice(data);
    out
}

/// A file held open for writing.
struct Held {
    node: usize,
    ino: Ino,
    fh: u64,
    /// What its fsync or close would publish.
    bytes: Vec<u8>,
    /// Its node's lease lapsed: it may publish nothing more.
    fenced: bool,
}

/// What every node must read: by name, the inode; by inode, the bytes
/// published last.
#[derive(Default)]
struct Model {
    names: [Option<Ino>; NAMES],
    published: HashMap<Ino, Vec<u8>>,
    held: Option<Held>,
    cut: Option<usize>,
    store_down: bool,
}

struct World {
    cluster: TestCluster,
    store: Arc<FaultyStore<InMemory>>,
    model: Model,
}

fn path(name: usize) -> String {
    format!("f{name}")
}

fn errno<T>(r: FsResult<T>) -> Result<T, i32> {
    r.map_err(|e| e.errno())
}

impl World {
    fn new() -> Self {
        let store = Arc::new(FaultyStore::new(InMemory::new()));
        let objects: Arc<dyn object_store::ObjectStore> = store.clone();
        let cluster = TestCluster::start_tiered(&NODES, 2, CHUNK, Some((objects, tier_config(1e-9))));
        World { cluster, store, model: Model::default() }
    }

    fn core(&self, node: usize) -> &Arc<Core> {
        &self.cluster.nodes[node].core
    }

    /// Whether `node` may be asked to do something: it is on the network.
    fn reachable(&self, node: usize) -> bool {
        self.model.cut != Some(node)
    }

    /// Whether `ino` is the file held open for writing.
    fn is_held(&self, ino: Ino) -> bool {
        self.model.held.as_ref().is_some_and(|h| h.ino == ino)
    }

    /// Whether `ino` has a name (a file unlinked or renamed over while
    /// held open for writing has none: its writer's close succeeds and its
    /// bytes go, as at the last close of an unlinked file).
    fn named(&self, ino: Ino) -> bool {
        self.model.names.contains(&Some(ino))
    }

    /// Apply `op` to the cluster and the model; a difference is an error.
    /// Operations that the model leaves out (on a node that is cut off, on
    /// the held file from a writer's path, a second held writer) are
    /// skipped and return Ok.
    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Put { node, name, len, seed } => {
                let existing = self.model.names[name];
                if !self.reachable(node) || existing.is_some_and(|i| self.is_held(i)) {
                    return Ok(());
                }
                let data = pattern(seed as u64 + 1, len);
                let core = self.core(node);
                put_file(core, &path(name), &data).and_then(|()| core.flush()).map_err(|e| format!("put: {e}"))?;
                let ino = resolve(core, &path(name)).map_err(|e| format!("resolve after put: {e}"))?.ino;
                if let Some(old) = existing {
                    if old != ino {
                        return Err(format!("put replaced inode {old} with {ino}"));
                    }
                }
                self.model.names[name] = Some(ino);
                self.model.published.insert(ino, data);
            }
            Op::Patch { node, name, offset, len, seed } => {
                if !self.reachable(node) || self.model.names[name].is_some_and(|i| self.is_held(i)) {
                    return Ok(());
                }
                let data = pattern(seed as u64 + 1, len);
                let core = self.core(node);
                let got = errno(write_file(core, &path(name), offset as u64, &data).and_then(|()| core.flush()));
                match self.model.names[name] {
                    None => expect_errno(got, libc::ENOENT, "patch of a missing name")?,
                    Some(ino) => {
                        got.map_err(|e| format!("patch: errno {e}"))?;
                        let bytes = patched(&self.model.published[&ino], offset, &data);
                        self.model.published.insert(ino, bytes);
                    }
                }
            }
            Op::Truncate { node, name, size } => {
                if !self.reachable(node) || self.model.names[name].is_some_and(|i| self.is_held(i)) {
                    return Ok(());
                }
                let core = self.core(node);
                let got = errno(truncate(core, &path(name), size as u64).and_then(|_| core.flush()));
                match self.model.names[name] {
                    None => expect_errno(got, libc::ENOENT, "truncate of a missing name")?,
                    Some(ino) => {
                        got.map_err(|e| format!("truncate: errno {e}"))?;
                        self.model.published.get_mut(&ino).expect("a named inode").resize(size, 0);
                    }
                }
            }
            Op::Read { node, name } => {
                if !self.reachable(node) {
                    return Ok(());
                }
                return self.check_read(node, name);
            }
            Op::Unlink { node, name } => {
                if !self.reachable(node) {
                    return Ok(());
                }
                let got = errno(unlink(self.core(node), &path(name)));
                match self.model.names[name].take() {
                    None => expect_errno(got, libc::ENOENT, "unlink of a missing name")?,
                    Some(_) => got.map_err(|e| format!("unlink: errno {e}"))?,
                }
            }
            Op::Rename { node, from, to } => {
                if !self.reachable(node) {
                    return Ok(());
                }
                let got = errno(harness::rename(
                    self.core(node),
                    &path(from),
                    &path(to),
                    converged_metadata::types::RenameMode::Replace,
                ));
                match self.model.names[from] {
                    None => expect_errno(got, libc::ENOENT, "rename of a missing name")?,
                    Some(ino) => {
                        got.map_err(|e| format!("rename: errno {e}"))?;
                        // Two names of one file: rename does nothing.
                        if self.model.names[to] != Some(ino) {
                            self.model.names[from] = None;
                            self.model.names[to] = Some(ino);
                        }
                    }
                }
            }
            Op::Link { node, from, to } => {
                if !self.reachable(node) {
                    return Ok(());
                }
                let got = errno(harness::link(self.core(node), &path(from), &path(to)).map(|_| ()));
                match (self.model.names[from], self.model.names[to]) {
                    (None, _) => expect_errno(got, libc::ENOENT, "link of a missing name")?,
                    (Some(_), Some(_)) => expect_errno(got, libc::EEXIST, "link onto a name in use")?,
                    (Some(ino), None) => {
                        got.map_err(|e| format!("link: errno {e}"))?;
                        self.model.names[to] = Some(ino);
                    }
                }
            }
            Op::Hold { node, name, offset, len, seed } => {
                let Some(ino) = self.model.names[name] else { return Ok(()) };
                if !self.reachable(node) || self.model.held.is_some() {
                    return Ok(());
                }
                let data = pattern(seed as u64 + 1, len);
                let core = self.core(node);
                let fh = core.open(ino, true).map_err(|e| format!("open for writing: {e}"))?.fh;
                write_all(core, fh, offset as u64, &data).map_err(|e| format!("held write: {e}"))?;
                let bytes = patched(&self.model.published[&ino], offset, &data);
                self.model.held = Some(Held { node, ino, fh, bytes, fenced: false });
            }
            Op::Publish => {
                let Some(h) = &self.model.held else { return Ok(()) };
                if !self.reachable(h.node) {
                    return Ok(());
                }
                let got = errno(self.core(h.node).fsync(h.fh, false));
                if h.fenced && !self.named(h.ino) {
                    // Fenced, and its name gone elsewhere: nothing to publish either way.
                } else if h.fenced {
                    expect_errno(got, libc::EIO, "fsync of a fenced writer")?;
                } else {
                    got.map_err(|e| format!("fsync of the held writer: errno {e}"))?;
                    let (ino, bytes) = (h.ino, h.bytes.clone());
                    self.model.published.insert(ino, bytes);
                }
            }
            Op::Close => {
                let Some(h) = &self.model.held else { return Ok(()) };
                if !self.reachable(h.node) {
                    return Ok(());
                }
                let h = self.model.held.take().expect("held");
                let core = self.core(h.node);
                let closed = errno(core.close(h.fh));
                let released = errno(core.release(h.fh));
                let flushed = errno(core.flush());
                if h.fenced && !self.named(h.ino) {
                    // As for Publish.
                } else if h.fenced {
                    if closed.is_ok() && released.is_ok() {
                        return Err("a fenced writer closed and released without an error".into());
                    }
                } else {
                    closed.map_err(|e| format!("close of the held writer: errno {e}"))?;
                    released.map_err(|e| format!("release of the held writer: errno {e}"))?;
                    flushed.map_err(|e| format!("flush after the held writer: errno {e}"))?;
                    self.model.published.insert(h.ino, h.bytes);
                }
            }
            Op::Lapse { node } => {
                let n = &self.cluster.nodes[node];
                n.lapse();
                if n.heartbeat() != Heartbeat::Rejoined {
                    return Err(format!("{} did not rejoin after its lease lapsed", n.id));
                }
                if let Some(h) = self.model.held.as_mut().filter(|h| h.node == node) {
                    h.fenced = true;
                }
            }
            Op::Restart { node } => {
                // Not with a writer there (the model does not say what a
                // restart makes of unpublished bytes), nor while cut off.
                if !self.reachable(node) || self.model.held.as_ref().is_some_and(|h| h.node == node) {
                    return Ok(());
                }
                self.cluster.restart(node);
            }
            Op::Cut { node } => {
                if self.model.cut.is_some() {
                    return Ok(());
                }
                self.set_cut(node, Some(PeerFault::Down));
                self.model.cut = Some(node);
            }
            Op::Heal => {
                if let Some(node) = self.model.cut.take() {
                    self.set_cut(node, None);
                }
            }
            Op::Backfill { node } => {
                if !self.reachable(node) {
                    return Ok(());
                }
                let mut worker = Backfiller::new(Arc::downgrade(self.core(node)), 0);
                for _ in 0..4 {
                    worker.step();
                }
            }
            Op::Evict { node } => {
                if !self.reachable(node) {
                    return Ok(());
                }
                Evictor { core: Arc::downgrade(self.core(node)) }.step();
            }
            Op::StoreDown => {
                self.store.set(Fault::Down);
                self.model.store_down = true;
            }
            Op::StoreUp => {
                self.store.clear();
                self.model.store_down = false;
            }
        }
        Ok(())
    }

    fn set_cut(&self, node: usize, fault: Option<PeerFault>) {
        let id = NODES[node];
        for (i, other) in self.cluster.nodes.iter().enumerate() {
            if i != node {
                other.faults.set(id, fault.clone());
                self.cluster.nodes[node].faults.set(NODES[i], fault.clone());
            }
        }
    }

    /// Read `name` whole on `node` and compare it with the model.
    fn check_read(&self, node: usize, name: usize) -> Result<(), String> {
        let core = self.core(node);
        let Some(ino) = self.model.names[name] else {
            return expect_errno(errno(resolve(core, &path(name))), libc::ENOENT, "lookup of a missing name");
        };
        let found = resolve(core, &path(name)).map_err(|e| format!("lookup of {}: {e}", path(name)))?.ino;
        if found != ino {
            return Err(format!("{} is inode {found} on {}, the model says {ino}", path(name), NODES[node]));
        }
        let want = match &self.model.held {
            Some(h) if h.ino == ino && h.node == node && !h.fenced => &h.bytes,
            _ => &self.model.published[&ino],
        };
        match errno(read_ino(core, ino)) {
            Ok(got) if got == *want => Ok(()),
            Ok(got) => Err(format!(
                "{} on {} read {} bytes, the model has {} (first difference at {:?})",
                path(name),
                NODES[node],
                got.len(),
                want.len(),
                got.iter().zip(want.iter()).position(|(a, b)| a != b)
            )),
            Err(libc::EIO) if self.copy_out_of_reach(node, ino) => Ok(()),
            Err(e) => Err(format!("read of {} on {}: errno {e}", path(name), NODES[node])),
        }
    }

    /// Whether some chunk of `ino` has no copy `reader` can reach, and
    /// no object to read instead (the store is down, or the file is not
    /// backed yet). Out of reach: a holder cut off from the network, and
    /// the copy of a node rewriting the file in place (its writer keeps the
    /// published version aside only when no live peer holds it, and a peer
    /// cut off the network is live: see the README's known gaps).
    fn copy_out_of_reach(&self, reader: usize, ino: Ino) -> bool {
        let cut = self.model.cut.map(|c| NODES[c]);
        let writer = self.model.held.as_ref().filter(|h| h.ino == ino && h.node != reader).map(|h| NODES[h.node]);
        let ns = self.core(reader).namespace();
        let chunks = ns.chunks(ino).unwrap_or_default();
        let stranded = chunks.iter().any(|(_, rec)| {
            rec.replicas.iter().all(|holder| Some(holder.as_str()) == cut || Some(holder.as_str()) == writer)
        });
        let backed = matches!(ns.tier(ino), Ok(Some(t)) if t.state == TierState::Backed);
        stranded && (self.model.store_down || !backed)
    }

    /// The end of a sequence: the network and the store back, the held
    /// writer closed, and every name read on every node.
    fn settle(&mut self) -> Result<(), String> {
        self.apply(&Op::Heal)?;
        self.apply(&Op::StoreUp)?;
        self.apply(&Op::Close)?;
        for node in 0..NODES.len() {
            for name in 0..NAMES {
                self.check_read(node, name).map_err(|e| format!("after settling: {e}"))?;
            }
        }
        Ok(())
    }
}

fn expect_errno<T>(got: Result<T, i32>, want: i32, what: &str) -> Result<(), String> {
    match got {
        Err(e) if e == want => Ok(()),
        Err(e) => Err(format!("{what}: errno {e}, expected {want}")),
        Ok(_) => Err(format!("{what}: succeeded, expected errno {want}")),
    }
}

fn config() -> ProptestConfig {
    let mut c = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = 48;
    }
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        c.rng_seed = RngSeed::Fixed(SEED);
    }
    c.failure_persistence = None;
    c
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_node_reads_what_the_model_says(ops in prop::collection::vec(op(), 1..40)) {
        let mut world = World::new();
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = world.apply(op) {
                prop_assert!(false, "step {i} ({op:?}): {e}");
            }
        }
        if let Err(e) = world.settle() {
            prop_assert!(false, "{e}");
        }
    }
}
