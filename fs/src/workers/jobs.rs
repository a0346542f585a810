//! The workers of a node daemon. Each holds a `Weak<Core>` and calls one
//! step of the core's own logic; the logic lives with the state it owns
//! (`core/durability.rs`, `core/replicate.rs`, `backfill.rs`, `evict.rs`).

use std::sync::Weak;
use std::time::{Duration, Instant};

use super::{Step, Worker};
use crate::control::Since;
use crate::core::{repair_trigger, Core, Pacer, RepairConfig, RepairScope, Replicated};
use converged_metadata::schema::Control;

/// Makes buffered metadata durable every `period` (sooner when a purge
/// wants its space back), after the bytes of the seals it carries.
pub struct Flusher {
    pub core: Weak<Core>,
    pub period: Duration,
}

impl Worker for Flusher {
    fn name(&self) -> String {
        "flusher".into()
    }

    fn step(&mut self) -> Step {
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        core.wait_for_flush(self.period);
        match core.flush() {
            Ok(()) => Step::Idle,
            Err(e) => {
                tracing::error!(error = %e, "metadata flush failed");
                Step::Failed(format!("flush: {e}"), Duration::from_secs(1))
            }
        }
    }
}

/// Keeps backing files ready for the next inode numbers.
pub struct Spares {
    pub core: Weak<Core>,
}

impl Worker for Spares {
    fn name(&self) -> String {
        "spares".into()
    }

    fn step(&mut self) -> Step {
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        if !core.wait_for_spares_low(Duration::from_millis(100)) {
            return Step::Stop;
        }
        match core.make_spares() {
            0 => Step::Idle,
            n => Step::Worked(format!("made {n} spare backing files")),
        }
    }
}

/// Keeps slots ready in the chunk store: the files, their names already on
/// stable storage, that durable writes of small chunk versions fill.
pub struct Slots {
    pub core: Weak<Core>,
}

impl Worker for Slots {
    fn name(&self) -> String {
        "slots".into()
    }

    fn step(&mut self) -> Step {
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        match core.make_slots(Duration::from_millis(100)) {
            Ok(0) => Step::Idle,
            Ok(n) => Step::Worked(format!("made {n} slots for small chunk versions")),
            Err(e) => Step::Failed(format!("making slots: {e}"), Duration::from_secs(5)),
        }
    }
}

/// Gives under-replicated files the copies their policy asks for.
pub struct Replicator {
    pub core: Weak<Core>,
}

impl Worker for Replicator {
    fn name(&self) -> String {
        "replicator".into()
    }

    fn step(&mut self) -> Step {
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        match core.replicate_step(Duration::from_secs(1)) {
            Replicated::Idle => Step::Idle,
            Replicated::Done(n) => Step::Worked(format!("replicated {n} files")),
            // Too few live peers, or a failure: try again later.
            Replicated::Short(ino) => {
                Step::Failed(format!("inode {ino} still under-replicated"), Duration::from_secs(5))
            }
        }
    }
}

/// Copies the full chunks of files being written here to their replicas
/// while the writes go on (see `Core::stream_step`), so that a publish
/// waits for the tail only.
pub struct Streamer {
    pub core: Weak<Core>,
}

/// How often the streamer looks at this node's writers: about the time a
/// fast writer takes to fill a quarter of a 64 MiB chunk.
const STREAM_PERIOD: Duration = Duration::from_millis(50);

/// How long buffers of chunks sent to peers are kept after the last one was
/// asked for (the next checkpoint's chunks reuse them).
const KEEP_CHUNK_BUFFERS: Duration = Duration::from_secs(10);

impl Worker for Streamer {
    fn name(&self) -> String {
        "streamer".into()
    }

    fn step(&mut self) -> Step {
        std::thread::sleep(STREAM_PERIOD);
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        match core.stream_step() {
            0 => {
                crate::blocks::trim_chunk_spares(KEEP_CHUNK_BUFFERS);
                Step::Idle
            }
            n => Step::Worked(format!("streamed {n} chunks to replicas ahead of their publish")),
        }
    }
}

/// One step of a worker that looks once a second: `run` on the core, and
/// what it did (`did`), or its failure, tried again after `retry`.
fn each_second<T: PartialEq + Default>(
    core: &Weak<Core>,
    what: &str,
    retry: Duration,
    run: impl FnOnce(&Core) -> crate::error::FsResult<T>,
    did: impl FnOnce(T) -> String,
) -> Step {
    std::thread::sleep(Duration::from_secs(1));
    let Some(core) = core.upgrade() else { return Step::Stop };
    match run(&core) {
        Ok(n) if n == T::default() => Step::Idle,
        Ok(n) => Step::Worked(did(n)),
        Err(e) => {
            tracing::warn!(error = %e, "{what} failed");
            Step::Failed(format!("{what}: {e}"), retry)
        }
    }
}

/// Evicts backed chunks when the data disk is above its high watermark.
pub struct Evictor {
    pub core: Weak<Core>,
}

impl Worker for Evictor {
    fn name(&self) -> String {
        "evictor".into()
    }

    fn step(&mut self) -> Step {
        each_second(&self.core, "eviction", Duration::from_secs(1), Core::evict_step, |n| format!("evicted {n} bytes"))
    }
}

/// Uploads files to the object store and re-keys renamed ones, one file a step.
pub struct Backfiller {
    pub core: Weak<Core>,
    pub index: usize,
    last_garbage: Instant,
}

impl Backfiller {
    pub fn new(core: Weak<Core>, index: usize) -> Self {
        Backfiller { core, index, last_garbage: Instant::now() - Duration::from_secs(60) }
    }
}

impl Worker for Backfiller {
    fn name(&self) -> String {
        format!("backfill-{}", self.index)
    }

    fn step(&mut self) -> Step {
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        match core.backfill_step(&mut self.last_garbage) {
            None => Step::Stop,
            Some(did) if did.is_empty() => Step::Idle,
            Some(did) => Step::Worked(did),
        }
    }
}

/// Settles chunk versions held beside backing files: installs the ones the
/// layout records, removes the ones it moved past (see `core/versions.rs`).
pub struct Settler {
    pub core: Weak<Core>,
}

impl Worker for Settler {
    fn name(&self) -> String {
        "settler".into()
    }

    fn step(&mut self) -> Step {
        let did = |n| format!("settled {n} chunk versions");
        each_second(&self.core, "settling chunk versions", Duration::from_secs(5), Core::settle_step, did)
    }
}

/// Keeps every chunk at its policy's copy count on live, active nodes:
/// rebuilds the copies of dead nodes after the repair delay, and moves
/// chunks off draining nodes (see `core/repair.rs`). A pass runs when the
/// dead nodes or admin states change, when a dead node crosses the repair
/// delay, soon again after a pass that moved something, after a growing
/// pause while copies fail (no source, no room; the failed chunks are
/// looked at again then, whatever the pass reads), and every few minutes
/// regardless. Those every few minutes (jittered), the first after start
/// and those while a rebalance runs read every chunk record; the others
/// only the holder-index entries of the nodes that no longer count. What
/// triggers one is read again only when the change feed says those records
/// changed (see `control.rs`).
pub struct Repairer {
    pub core: Weak<Core>,
    cfg: RepairConfig,
    pacer: Pacer,
    last: Option<Last>,
    /// The trigger as last read, and what it follows.
    trigger: Trigger,
    since: Since,
    /// When the next pass over every record is due (`None`: at once).
    every_due: Option<Instant>,
    /// The chunks the last pass failed to copy: the next one looks at
    /// them again, whatever its scope.
    again: Vec<(converged_metadata::types::Ino, u32)>,
}

/// What a repair pass's trigger follows.
const TRIGGER_RECORDS: &[Control] = &[Control::Members, Control::Admin, Control::Rebalance];

/// What the last pass saw, and when the next one is due without a change.
struct Last {
    trigger: Trigger,
    next: Instant,
    /// The pause after a pass that failed and moved nothing (doubles).
    backoff: Duration,
}

type Trigger = Option<crate::core::RepairTrigger>;

/// A pass at least this often, whatever changed.
const REPAIR_EVERY: Duration = Duration::from_secs(300);
/// How often passes run while a live node is draining or drained.
const DRAINING_EVERY: Duration = Duration::from_secs(5);
/// How soon a pass that moved something is followed by another.
const REPAIR_AGAIN: Duration = Duration::from_secs(2);

impl Repairer {
    pub fn new(core: Weak<Core>, cfg: RepairConfig) -> Self {
        Repairer {
            core,
            cfg,
            pacer: Pacer::new(cfg.bandwidth),
            last: None,
            trigger: None,
            since: Since::new(TRIGGER_RECORDS),
            every_due: None,
            again: Vec::new(),
        }
    }
}

impl Worker for Repairer {
    fn name(&self) -> String {
        "repair".into()
    }

    fn step(&mut self) -> Step {
        std::thread::sleep(Duration::from_secs(1));
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        if core.control().due(&mut self.since) {
            self.trigger = repair_trigger(&core);
            if self.trigger.is_none() {
                self.since.retry();
            }
        }
        let trigger = self.trigger.clone();
        let due = self.last.as_ref().is_none_or(|l| l.trigger != trigger || Instant::now() >= l.next);
        if !due {
            return Step::Idle;
        }
        let stop = || self.core.strong_count() == 0;
        let scope = match self.every_due {
            Some(at) if Instant::now() < at => RepairScope::Leaving,
            _ => RepairScope::Every,
        };
        let r = core.repair_pass(scope, &self.again, &self.cfg, &mut self.pacer, &stop);
        if matches!(&r, Ok(p) if p.every) {
            self.every_due = Some(Instant::now() + crate::control::jittered(REPAIR_EVERY));
        }
        let backoff = self.last.as_ref().map_or(REPAIR_AGAIN, |l| l.backoff);
        let (wait, backoff) = match &r {
            Ok(p) if p.progressed() => (REPAIR_AGAIN, REPAIR_AGAIN),
            Ok(p) if p.failed > 0 => (backoff, (backoff * 2).min(REPAIR_EVERY)),
            Ok(_) => (REPAIR_EVERY, REPAIR_AGAIN),
            Err(_) => (backoff, (backoff * 2).min(REPAIR_EVERY)),
        };
        // While a live node drains (or is drained), its own writers keep
        // landing chunks on it: passes come often enough to move them off.
        let draining = trigger.as_ref().is_some_and(|(admin, dead, _)| admin.keys().any(|n| !dead.contains(n)));
        let wait = if draining { wait.min(DRAINING_EVERY) } else { wait };
        // A dead node crossing the repair delay is due at once.
        let wait = match &r {
            Ok(p) => p.next_due.map_or(wait, |d| wait.min(d + Duration::from_millis(500))),
            Err(_) => wait,
        };
        self.last = Some(Last { trigger, next: Instant::now() + wait, backoff });
        match r {
            Ok(pass) => {
                self.again.clone_from(&pass.retry);
                core.set_repair_report(&pass);
                if pass.copied + pass.dropped + pass.failed > 0 {
                    Step::Worked(pass.summary())
                } else {
                    Step::Idle
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "repair pass failed");
                Step::Failed(format!("repair: {e}"), Duration::from_secs(1))
            }
        }
    }
}

/// Removes the copies held here that no record names any more (see
/// `core/sweep.rs`): every half grace period it looks at the files whose
/// records changed and those waiting for a second look, and a slice of
/// its paced safety pass every second. It answers `converged gc`: a new
/// request makes it look at every copy at once, and once nothing found
/// is left waiting it records that it swept for that request.
pub struct Sweeper {
    pub core: Weak<Core>,
    grace: Duration,
    seen: crate::core::Seen,
    last: Option<Instant>,
    /// The safety pass: files still to look at (popped from the end), and
    /// when the next pass starts.
    pass: Vec<converged_metadata::types::Ino>,
    pass_due: Instant,
    /// While the pass that starts at mount runs: when the node mounted.
    /// That pass is for what changed while the node was down: a copy
    /// written or received since the mount is this node's own doing,
    /// and what changes it later the change feed reports (a job writing
    /// at once after the mount no longer costs four reads a file).
    mounted: Option<std::time::SystemTime>,
    /// The gc request being answered, and what reading requests follows.
    gc: (u64, Since),
    /// The gc request a sweep was started at once for.
    gc_started: u64,
}

impl Sweeper {
    pub fn new(core: Weak<Core>, grace: Duration) -> Self {
        Sweeper {
            core,
            grace,
            seen: Default::default(),
            last: None,
            // A node that was down missed the changes made meanwhile: its
            // first pass starts at mount.
            pass: Vec::new(),
            pass_due: Instant::now(),
            mounted: Some(std::time::SystemTime::now()),
            gc: (0, Since::new(&[Control::Gc])),
            gc_started: 0,
        }
    }

    /// How often changed files and those waiting are looked at.
    fn period(&self) -> Duration {
        (self.grace / 2).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// When the safety pass after one starting now is due.
    fn next_pass() -> Instant {
        Instant::now() + crate::control::jittered(crate::core::SAFETY_PASS_EVERY)
    }

    /// A gc request not answered yet, if there is one.
    fn pending_gc(&mut self, core: &Core) -> Option<u64> {
        if core.control().due(&mut self.gc.1) {
            match converged_metadata::ops::nodes::gc_state(core.namespace().engine()) {
                Ok((asked, done)) => {
                    let answered = done.get(core.node_id()).copied().unwrap_or(0);
                    self.gc.0 = if asked > answered { asked } else { 0 };
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read gc requests");
                    self.gc.1.retry();
                }
            }
        }
        (self.gc.0 > 0).then_some(self.gc.0)
    }

    /// This step's files: those changed or waiting when a period is up,
    /// and the safety pass's next slice. `None`: an admin asked for
    /// everything at once.
    fn due(
        &mut self,
        core: &Core,
        asked_now: bool,
    ) -> crate::error::FsResult<Option<Vec<converged_metadata::types::Ino>>> {
        if asked_now {
            return Ok(None);
        }
        let mut files = std::collections::BTreeSet::new();
        if self.last.is_none_or(|t| t.elapsed() >= self.period()) {
            self.last = Some(Instant::now());
            let (changed, everything) = core.sweep_hints().take();
            if everything {
                // Changes may have been missed since the mount too.
                self.pass.clear();
                self.pass_due = Instant::now();
                self.mounted = None;
            }
            files.extend(changed);
            files.extend(self.seen.waiting());
        }
        if self.pass.is_empty() && Instant::now() >= self.pass_due {
            self.pass = core.held_files()?;
            self.pass.reverse(); // popped from the end: inode order
            self.pass_due = Self::next_pass();
        }
        let slice = self.pass.len().saturating_sub(crate::core::SAFETY_PASS_RATE);
        let mut next: Vec<converged_metadata::types::Ino> = self.pass.drain(slice..).collect();
        if let Some(t) = self.mounted {
            next.retain(|ino| !core.copies_changed_since(*ino, t));
            if self.pass.is_empty() {
                self.mounted = None;
            }
        }
        files.extend(next);
        Ok(Some(files.into_iter().collect()))
    }
}

impl Worker for Sweeper {
    fn name(&self) -> String {
        "sweep".into()
    }

    fn step(&mut self) -> Step {
        std::thread::sleep(Duration::from_secs(1));
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        if core.cluster().is_none() {
            return Step::Idle;
        }
        let gc = self.pending_gc(&core);
        let asked_now = gc.is_some_and(|id| id != self.gc_started);
        if let Some(id) = gc.filter(|_| asked_now) {
            self.gc_started = id;
        }
        let r = match self.due(&core, asked_now) {
            Ok(None) => core.sweep_all(&mut self.seen, self.grace),
            Ok(Some(files)) if files.is_empty() && gc.is_none() => return Step::Idle,
            Ok(Some(files)) => core.sweep(&mut self.seen, self.grace, files),
            Err(e) => Err(e),
        };
        if let (Ok(_), Some(id)) = (&r, gc) {
            if self.seen.is_empty() {
                match core.namespace().gc_done(id) {
                    Ok(()) => self.gc.0 = 0,
                    Err(e) => tracing::warn!(error = %e, "cannot record the gc answer"),
                }
            }
        }
        match r {
            Ok(0) => Step::Idle,
            Ok(n) => Step::Worked(format!("removed {n} file copies or chunk ranges no record names")),
            Err(e) => {
                tracing::warn!(error = %e, "sweep failed");
                Step::Failed(format!("sweep: {e}"), Duration::from_secs(5))
            }
        }
    }
}

/// Reads back every chunk copy held here against its checksums, once per
/// `period`, one chunk a step, paced so that a pass spreads over the
/// period (see `core/scrub.rs`).
pub struct Scrubber {
    pub core: Weak<Core>,
    period: Duration,
    queue: Vec<(converged_metadata::types::Ino, u32)>,
    /// Bytes per second of this pass.
    rate: f64,
    next: Instant,
    pass_started: Option<Instant>,
    /// Records of the next chunks in the queue, read with the last one
    /// that was not here, and when.
    ahead: std::collections::HashMap<(converged_metadata::types::Ino, u32), Option<converged_metadata::ChunkRecord>>,
    ahead_read: Instant,
}

/// Chunks whose records the scrub reads at once (4 keys each: 32 in one
/// etcd request), where it read them one request a chunk: a pass over a
/// node's small files ran at a thousand requests a second.
const SCRUB_READ_AHEAD: usize = 32;

/// How long records read ahead are used: older, they are read again.
const SCRUB_AHEAD_FOR: Duration = Duration::from_secs(10);

/// The slowest a scrub reads, however long its period: a small node
/// finishes its pass early and waits for the next.
const SCRUB_MIN_RATE: f64 = (1 << 20) as f64;

impl Scrubber {
    pub fn new(core: Weak<Core>, period: Duration) -> Self {
        Scrubber {
            core,
            period,
            queue: Vec::new(),
            rate: SCRUB_MIN_RATE,
            next: Instant::now(),
            pass_started: None,
            ahead: Default::default(),
            ahead_read: Instant::now(),
        }
    }
}

impl Worker for Scrubber {
    fn name(&self) -> String {
        "scrub".into()
    }

    fn step(&mut self) -> Step {
        let now = Instant::now();
        if now < self.next {
            std::thread::sleep((self.next - now).min(Duration::from_secs(1)));
            return Step::Idle;
        }
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        if self.queue.is_empty() {
            if self.pass_started.is_some_and(|t| t.elapsed() < self.period) {
                self.next = self.pass_started.expect("checked") + self.period;
                return Step::Idle;
            }
            match core.held_chunks() {
                Ok(mut held) => {
                    held.reverse(); // popped from the end: inode order
                    let bytes = held.len() as f64 * core.namespace().chunk_size() as f64;
                    self.rate = (bytes / self.period.as_secs_f64().max(1.0)).max(SCRUB_MIN_RATE);
                    self.queue = held;
                    self.pass_started = Some(Instant::now());
                }
                Err(e) => return Step::Failed(format!("scrub: list held chunks: {e}"), Duration::from_secs(30)),
            }
        }
        let Some((ino, index)) = self.queue.pop() else { return Step::Idle };
        if self.ahead_read.elapsed() > SCRUB_AHEAD_FOR {
            self.ahead.clear();
        }
        let rec = match self.ahead.remove(&(ino, index)) {
            Some(rec) => rec,
            None => {
                // This chunk's record and the next ones', in one read.
                let at = self.queue.len().saturating_sub(SCRUB_READ_AHEAD - 1);
                let mut which: Vec<(converged_metadata::types::Ino, u32)> =
                    self.queue[at..].iter().rev().copied().collect();
                which.insert(0, (ino, index));
                match core.namespace().chunks_at(&which) {
                    Ok(recs) => {
                        let mut recs = which.into_iter().zip(recs);
                        let first = recs.next().and_then(|(_, rec)| rec);
                        self.ahead = recs.collect();
                        self.ahead_read = Instant::now();
                        first
                    }
                    Err(e) => {
                        self.queue.push((ino, index));
                        return Step::Failed(format!("scrub: read chunk records: {e}"), Duration::from_secs(5));
                    }
                }
            }
        };
        match core.scrub_recorded(ino, index, rec) {
            Ok(found) => {
                core.note_scrubbed(&found);
                self.next = Instant::now() + Duration::from_secs_f64(found.bytes as f64 / self.rate);
                if found.bad_blocks > 0 {
                    Step::Worked(format!(
                        "inode {ino} chunk {index}: {} bad blocks, {} repaired",
                        found.bad_blocks, found.repaired_blocks
                    ))
                } else {
                    Step::Idle
                }
            }
            Err(e) => Step::Failed(format!("scrub inode {ino} chunk {index}: {e}"), Duration::from_secs(5)),
        }
    }
}
