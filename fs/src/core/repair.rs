//! Repair: every chunk keeps the copies its policy asks for, on live nodes
//! that take new copies.
//!
//! A pass reads chunk records and sorts each holder. Which records: those
//! the holder index lists for the nodes that no longer count (draining,
//! drained, dead past the delay; see `metadata/src/ops/holders.rs`), so
//! that a death or a drain costs reads in proportion to that node's chunks;
//! or every record of the volume, in the safety pass every few minutes
//! (which also finds chunks left short by a write that could not reach
//! enough nodes, or a forgotten node's) and while a rebalance runs. The
//! safety pass is shared out: each live node reads the slices of inode
//! numbers rendezvous hashing gives it and acts on every chunk there, so
//! the cluster reads each record once a pass, not once per node. The
//! chunks whose copy failed in a pass (a peer that did not answer, one
//! that was starting again) are read again by the next passes, whatever
//! their scope, until their copies are made or no longer needed: a
//! failure found by the safety pass is not left for the next one.
//!
//! | holder                                   | counts as a copy | read from | dropped from the record |
//! |------------------------------------------|------------------|-----------|-------------------------|
//! | live, no admin state                     | yes              | yes       | no                      |
//! | live, draining or drained                | no               | yes       | once enough others hold |
//! | dead for less than `--repair-delay`      | no, not repaired | no        | no (it may come back)   |
//! | dead for longer, or forgotten            | no               | no        | once enough others hold |
//!
//! A node is dead once etcd expired its membership lease; how long it has
//! been dead is measured on this node's monotonic clock from the first
//! member list read here without its lease ([`Cluster::dead_for`](crate::cluster::Cluster::dead_for)), so no
//! node's wall clock (the dead node's last heartbeat time included) moves
//! the repair earlier or later. A node that starts counts the nodes it finds
//! dead from its start: repair waits at most one more delay.
//!
//! A chunk with fewer good copies than its policy, not counting holders that
//! are only briefly down, gets new copies now: one live node chosen by
//! rendezvous hashing over (inode, chunk) does it, so the work spreads over
//! the cluster and no two nodes copy the same chunk. The new holder pulls the
//! chunk itself (`stage_chunk`): from any live holder, each block checked
//! against the record's checksums, or from the object store when the file is
//! backed; it records itself only once its copy is on stable storage, and
//! only if the chunk is still at that version. Holders that no longer count
//! are dropped from the record after that, by a transaction that checks
//! enough good copies remain. Every step is a record change, so a pass cut
//! short by a crash is simply done again by the next one.
//!
//! Repair bytes are paced by `--repair-bandwidth` per node. No lock is held
//! across the copies.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use converged_metadata::types::*;
use converged_metadata::{MetaError, NodeAdmin};

use super::Core;
use crate::error::FsResult;

/// How repair runs on this node.
#[derive(Debug, Clone, Copy)]
pub struct RepairConfig {
    /// How long a dead node's copies are waited for before they are rebuilt.
    pub delay: Duration,
    /// Bytes per second this node copies for repair (0: unpaced).
    pub bandwidth: u64,
}

/// What a holder of a chunk is, for repair (see the module's head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    Good,
    Leaving,
    Down,
    Gone,
}

/// Inode numbers per slice of the safety pass (see [`RepairScope::Every`]).
const SAFETY_SLICE: u64 = 1 << 16;

/// Which chunk records a repair pass reads (see the module's head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairScope {
    /// Every record of the volume, shared out: the inode numbers in
    /// slices of [`SAFETY_SLICE`], each read (and acted on, whole) by the
    /// live node rendezvous hashing gives it.
    Every,
    /// The records the holder index lists for the nodes that no longer count.
    Leaving,
}

/// What one pass found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairPass {
    /// Whether it read every record (else the index of the nodes that no
    /// longer count).
    pub every: bool,
    /// Holder-index entries read (a pass over the index).
    pub index_entries: u64,
    /// Slices of the volume's inode numbers this node read (a safety pass).
    pub slices: u64,
    /// Chunk records looked at: every record, or in a pass over the index
    /// the records of this node's share of the leaving nodes' chunks (the
    /// counts below cover the same).
    pub chunks: u64,
    /// Chunks with fewer good copies than their policy.
    pub under: u64,
    /// Of those, chunks waiting for a briefly dead holder (inside the delay).
    pub waiting: u64,
    /// Chunks with no copy on a live node.
    pub unavailable: u64,
    /// Copies this node made (or had made) in this pass.
    pub copied: u64,
    /// Holders this node dropped from records in this pass.
    pub dropped: u64,
    /// Chunks this node moves toward their ideal holders (a rebalance).
    pub misplaced: u64,
    /// Chunks this node should have repaired and could not.
    pub failed: u64,
    /// Those chunks, for the next pass to look at again.
    pub retry: Vec<(Ino, u32)>,
    /// When the first briefly dead holder crosses the repair delay (a
    /// pass is due then).
    pub next_due: Option<Duration>,
}

impl RepairPass {
    pub fn summary(&self) -> String {
        let scope = match self.every {
            true => format!("{} slices of every record", self.slices),
            false => format!("{} index entries", self.index_entries),
        };
        format!(
            "{} chunks ({scope}): {} under-replicated ({} waiting for the repair delay), {} with no live copy; made {} copies, dropped {} holders, {} failed",
            self.chunks, self.under, self.waiting, self.unavailable, self.copied, self.dropped, self.failed
        )
    }

    /// Whether this pass changed anything (a pass soon may do more).
    pub fn progressed(&self) -> bool {
        self.copied + self.dropped > 0
    }
}

/// Paces repair copies to a byte rate.
pub struct Pacer {
    rate: u64,
    /// The node's own limit (`--repair-bandwidth`).
    own: u64,
    next: Instant,
}

impl Pacer {
    pub fn new(rate: u64) -> Self {
        Pacer { rate, own: rate, next: Instant::now() }
    }

    /// Pace to the lower of the node's own rate and `job`'s (0: no job limit).
    pub fn limit(&mut self, job: u64) {
        self.rate = match (self.own, job) {
            (0, j) => j,
            (o, 0) => o,
            (o, j) => o.min(j),
        };
    }

    /// Wait until `bytes` more fit the rate, or `stop` says so.
    fn take(&mut self, bytes: u64, stop: &dyn Fn() -> bool) {
        if self.rate == 0 {
            return;
        }
        let now = Instant::now();
        self.next = self.next.max(now) + Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        // The first copy starts at once; later ones wait for their turn.
        let start_at = self.next - Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        while Instant::now() < start_at && !stop() {
            std::thread::sleep((start_at - Instant::now()).min(Duration::from_millis(100)));
        }
    }
}

/// The holders' standing at the time of a pass.
struct View {
    standing: HashMap<String, Holder>,
    /// How long until the first `Down` node becomes `Gone`.
    next_due: Option<Duration>,
}

impl View {
    fn of(&self, node: &str) -> Holder {
        // A node no longer in membership was forgotten.
        self.standing.get(node).copied().unwrap_or(Holder::Gone)
    }
}

/// One chunk this node repairs.
struct Job {
    ino: Ino,
    index: u32,
    version: u64,
    len: u64,
    /// Copies to add now.
    add: usize,
    /// Holders to drop once enough good copies are recorded.
    drop: Vec<String>,
    want: usize,
    /// The nodes to copy to (a rebalance's ideal holders); placement's
    /// choice when `None`.
    targets: Option<Vec<String>>,
}

impl Core {
    /// How each registered node stands, for repair.
    fn repair_view(&self, delay: Duration) -> FsResult<Option<View>> {
        let Some(cluster) = self.cluster.get() else { return Ok(None) };
        let members = cluster.members_now()?;
        let admin = self.ns.node_admin_states()?;
        let mut standing = HashMap::new();
        let mut next_due: Option<Duration> = None;
        for m in members {
            let h = match (m.alive, admin.get(&m.info.id)) {
                (true, None) => Holder::Good,
                (true, Some(_)) => Holder::Leaving,
                (false, _) => {
                    let dead_for = cluster.dead_for(&m.info.id).unwrap_or_default();
                    let drained = admin.contains_key(&m.info.id);
                    if drained || dead_for >= delay {
                        Holder::Gone
                    } else {
                        let due = delay - dead_for;
                        next_due = Some(next_due.map_or(due, |d| d.min(due)));
                        Holder::Down
                    }
                }
            };
            standing.insert(m.info.id, h);
        }
        Ok(Some(View { standing, next_due }))
    }

    /// One repair pass over the chunk records `scope` names, and the
    /// chunks in `again` (the last pass's failures; see the module's
    /// head). `stop` ends it early (the daemon stops).
    pub(crate) fn repair_pass(
        &self,
        scope: RepairScope,
        again: &[(Ino, u32)],
        cfg: &RepairConfig,
        pacer: &mut Pacer,
        stop: &dyn Fn() -> bool,
    ) -> FsResult<RepairPass> {
        let mut pass = RepairPass::default();
        let Some(view) = self.repair_view(cfg.delay)? else { return Ok(pass) };
        pass.next_due = view.next_due;
        let cluster = self.cluster.get().expect("a view means a cluster").clone();
        let mut policies = converged_metadata::ops::xattr::Policies::new(&self.ns, cluster.default_replicas());
        // A rebalance under way: copies also move toward the ideal holders.
        let balance = match converged_metadata::ops::nodes::rebalance(self.ns.engine())? {
            Some(job) => {
                pacer.limit(job.bandwidth);
                let live: Vec<_> = cluster.members_now()?.into_iter().filter(|m| m.alive).map(|m| m.info).collect();
                let admin = self.ns.node_admin_states()?;
                Some(crate::placement::balance_candidates(&live, &admin, cluster.failure_domain()))
            }
            None => {
                pacer.limit(0);
                None
            }
        };
        // One live node per chunk does its work (the same one on every node
        // that sees the same live set).
        let repairers = cluster.repairers();
        let mut jobs = Vec::new();
        pass.every = scope == RepairScope::Every || balance.is_some();
        let every = pass.every;
        let mut index_entries = 0;
        // `ours`: the chunk is this node's to repair whoever rendezvous
        // hashing names (its slice of the safety pass, or a retry).
        let mut visit = |ino: Ino, index: u32, rec: &ChunkRecord, ours: bool| {
            pass.chunks += 1;
            let want = policies.want(ino);
            let count = |kind: Holder| rec.replicas.iter().filter(|r| view.of(r) == kind).count();
            let (good, leaving, down) = (count(Holder::Good), count(Holder::Leaving), count(Holder::Down));
            if good + leaving == 0 {
                pass.unavailable += 1;
            }
            let add = want.saturating_sub(good + down);
            if good < want {
                pass.under += 1;
                if add == 0 {
                    pass.waiting += 1;
                }
            }
            let drop: Vec<String> =
                rec.replicas.iter().filter(|r| matches!(view.of(r), Holder::Leaving | Holder::Gone)).cloned().collect();
            let work = add > 0 || (!drop.is_empty() && good >= want);
            // A slice of the safety pass is this node's whole; over the
            // index, only this node's share was read.
            let share = ours || cluster.is_first(ino, index, &repairers);
            if work && share {
                let len = rec.len as u64;
                jobs.push(Job { ino, index, version: rec.version, len, add, drop, want, targets: None });
            } else if !work && good >= want {
                if let Some(candidates) = &balance {
                    let ideal = crate::placement::ideal(ino, index, want, candidates);
                    let misplaced: Vec<String> = rec.replicas.iter().filter(|r| !ideal.contains(r)).cloned().collect();
                    let missing: Vec<String> = ideal.iter().filter(|n| !rec.replicas.contains(n)).cloned().collect();
                    if !misplaced.is_empty() && !missing.is_empty() && share {
                        pass.misplaced += 1;
                        jobs.push(Job {
                            ino,
                            index,
                            version: rec.version,
                            len: rec.len as u64,
                            add: missing.len(),
                            drop: misplaced,
                            want,
                            targets: Some(missing),
                        });
                    }
                }
            }
        };
        if every {
            // The volume's inode numbers in slices, each read by one live
            // node (rendezvous over the slice): together the nodes read
            // every record once a pass, not once each.
            let bound = self.ns.inode_bound()?;
            for slice in 0..bound.div_ceil(SAFETY_SLICE) {
                let first = slice * SAFETY_SLICE;
                if cluster.is_first(first, u32::MAX, &repairers) {
                    pass.slices += 1;
                    self.ns.for_each_chunk_in(first..first + SAFETY_SLICE, &mut |ino, index, rec: &ChunkRecord| {
                        visit(ino, index, rec, true)
                    })?;
                }
            }
        } else {
            // A chunk two leaving nodes hold is listed under both.
            let mut seen = HashSet::new();
            for (node, standing) in &view.standing {
                if matches!(standing, Holder::Leaving | Holder::Gone) {
                    // Only this node's share of the chunks: their records alone are read.
                    let mine = |ino, index| cluster.is_first(ino, index, &repairers);
                    let walk = self.ns.for_each_chunk_held_by_where(node, mine, |ino, index, rec| {
                        if seen.insert((ino, index)) {
                            visit(ino, index, rec, false)
                        }
                    })?;
                    index_entries += walk.entries;
                }
            }
            // The safety pass read these with the rest.
            for &(ino, index) in again {
                if seen.insert((ino, index)) {
                    if let Some(rec) = self.ns.chunk(ino, index)? {
                        visit(ino, index, &rec, true);
                    }
                }
            }
        }
        pass.index_entries = index_entries;
        policies.finish()?;
        for job in jobs {
            if stop() {
                break;
            }
            match self.repair_chunk(&job, &view, pacer, stop) {
                Ok((copied, dropped)) => {
                    pass.copied += copied;
                    pass.dropped += dropped;
                    if copied < job.add as u64 {
                        pass.failed += 1;
                        pass.retry.push((job.ino, job.index));
                    }
                }
                Err(e) => {
                    tracing::warn!(ino = job.ino, chunk = job.index, error = %e, "repair of a chunk failed; the next pass tries again");
                    pass.failed += 1;
                    pass.retry.push((job.ino, job.index));
                }
            }
        }
        Ok(pass)
    }

    /// Give one chunk its missing copies, then drop the holders that no
    /// longer count. Returns (copies made, holders dropped).
    fn repair_chunk(&self, job: &Job, view: &View, pacer: &mut Pacer, stop: &dyn Fn() -> bool) -> FsResult<(u64, u64)> {
        let cluster = self.cluster.get().expect("repair runs in a cluster").clone();
        let mut copied = 0;
        if job.add > 0 {
            let Some(rec) = self.ns.chunk(job.ino, job.index)? else { return Ok((0, 0)) };
            if rec.version != job.version {
                return Ok((0, 0)); // sealed again since the scan: the writer replicates it
            }
            let holders: BTreeSet<&String> = rec.replicas.iter().collect();
            // Placement's ranking over the nodes that take copies, this one
            // included, without the holders; or the ideal holders asked for.
            let ranked = match &job.targets {
                None => cluster.stage_targets(job.ino, job.index, job.add + holders.len() + 1),
                Some(ids) => cluster
                    .stage_targets(job.ino, job.index, usize::MAX)
                    .into_iter()
                    .filter(|n| ids.contains(&n.id))
                    .collect(),
            };
            let targets: Vec<_> = ranked.into_iter().filter(|n| !holders.contains(&n.id)).take(job.add).collect();
            for target in targets {
                if stop() {
                    break;
                }
                pacer.take(job.len, stop);
                let r = if target.id == cluster.node() {
                    self.stage_chunk(job.ino, job.index)
                } else {
                    cluster.block_on(cluster.clone().stage_on(target.clone(), job.ino, job.index))
                };
                match r {
                    Ok(()) => {
                        copied += 1;
                        tracing::info!(ino = job.ino, chunk = job.index, node = %target.id, "repaired: new copy");
                    }
                    Err(e) => {
                        tracing::warn!(ino = job.ino, chunk = job.index, node = %target.id, error = %e, "repair copy failed")
                    }
                }
            }
        }
        let mut dropped = 0;
        if !job.drop.is_empty() {
            let Some(rec) = self.ns.chunk(job.ino, job.index)? else { return Ok((copied, 0)) };
            let good = rec.replicas.iter().filter(|r| view.of(r) == Holder::Good).count();
            if rec.version == job.version && good >= job.want {
                match self.ns.drop_holders(job.ino, job.index, job.version, &job.drop, job.want) {
                    Ok(true) => {
                        dropped = job.drop.len() as u64;
                        if job.drop.iter().any(|n| n == cluster.node()) {
                            // This node's own change: the change feed does not
                            // report it here.
                            self.sweep_hints.note(job.ino);
                        }
                        tracing::info!(ino = job.ino, chunk = job.index, holders = ?job.drop, "dropped holders that no longer count");
                    }
                    Ok(false) => {}
                    Err(MetaError::NotFound) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok((copied, dropped))
    }
}

/// What makes a repair pass due at once when it changes: the admin
/// states, the dead nodes, and whether a rebalance is under way.
pub type RepairTrigger = (BTreeMap<String, NodeAdmin>, BTreeSet<String>, Option<converged_metadata::Rebalance>);

/// The trigger as it stands now (none without a cluster, or when the
/// metadata does not answer).
pub fn repair_trigger(core: &Core) -> Option<RepairTrigger> {
    let cluster = core.cluster.get()?;
    let admin = core.ns.node_admin_states().ok()?;
    let dead = cluster.dead_nodes().ok()?;
    let rebalance = converged_metadata::ops::nodes::rebalance(core.ns.engine()).ok()?;
    Some((admin, dead, rebalance))
}
