//! The workers of a node daemon. Each holds a `Weak<Core>` and calls one
//! step of the core's own logic; the logic lives with the state it owns
//! (`core/durability.rs`, `core/replicate.rs`, `backfill.rs`, `evict.rs`).

use std::sync::Weak;
use std::time::{Duration, Instant};

use super::{Step, Worker};
use crate::core::{repair_trigger, Core, Pacer, RepairConfig, Replicated};

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

/// Evicts backed chunks when the data disk is above its high watermark.
pub struct Evictor {
    pub core: Weak<Core>,
}

impl Worker for Evictor {
    fn name(&self) -> String {
        "evictor".into()
    }

    fn step(&mut self) -> Step {
        std::thread::sleep(Duration::from_secs(1));
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        match core.evict_step() {
            Ok(0) => Step::Idle,
            Ok(n) => Step::Worked(format!("evicted {n} bytes")),
            Err(e) => {
                tracing::warn!(error = %e, "eviction failed");
                Step::Failed(format!("eviction: {e}"), Duration::from_secs(1))
            }
        }
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
        std::thread::sleep(Duration::from_secs(1));
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        match core.settle_step() {
            Ok(0) => Step::Idle,
            Ok(n) => Step::Worked(format!("settled {n} chunk versions")),
            Err(e) => {
                tracing::warn!(error = %e, "settling chunk versions failed");
                Step::Failed(format!("settle: {e}"), Duration::from_secs(5))
            }
        }
    }
}

/// Keeps every chunk at its policy's copy count on live, active nodes:
/// rebuilds the copies of dead nodes after the repair delay, and moves
/// chunks off draining nodes (see `core/repair.rs`). A pass runs when the
/// dead nodes or admin states change, soon again while work is left, and
/// every few minutes regardless.
pub struct Repairer {
    pub core: Weak<Core>,
    cfg: RepairConfig,
    pacer: Pacer,
    last: Option<(Instant, Trigger)>,
    unfinished: bool,
}

type Trigger =
    Option<(std::collections::BTreeMap<String, converged_metadata::NodeAdmin>, std::collections::BTreeSet<String>)>;

/// A pass at least this often, whatever changed.
const REPAIR_EVERY: Duration = Duration::from_secs(300);
/// How soon a pass that left work is followed by another.
const REPAIR_AGAIN: Duration = Duration::from_secs(2);

impl Repairer {
    pub fn new(core: Weak<Core>, cfg: RepairConfig) -> Self {
        Repairer { core, cfg, pacer: Pacer::new(cfg.bandwidth), last: None, unfinished: false }
    }
}

impl Worker for Repairer {
    fn name(&self) -> String {
        "repair".into()
    }

    fn step(&mut self) -> Step {
        std::thread::sleep(Duration::from_secs(1));
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        let trigger = repair_trigger(&core);
        let due = match &self.last {
            None => true,
            Some((at, seen)) => {
                *seen != trigger
                    || at.elapsed() >= REPAIR_EVERY
                    || (self.unfinished && at.elapsed() >= REPAIR_AGAIN)
                    // Dead nodes cross the repair delay with no change in the set.
                    || (trigger.as_ref().is_some_and(|t| !t.1.is_empty()) && at.elapsed() >= REPAIR_AGAIN)
            }
        };
        if !due {
            return Step::Idle;
        }
        let stop = || self.core.strong_count() == 0;
        let r = core.repair_pass(&self.cfg, &mut self.pacer, &stop);
        self.last = Some((Instant::now(), trigger));
        match r {
            Ok(pass) => {
                core.set_repair_report(&pass);
                self.unfinished = pass.unfinished();
                if pass.copied + pass.dropped + pass.failed > 0 {
                    Step::Worked(pass.summary())
                } else {
                    Step::Idle
                }
            }
            Err(e) => {
                self.unfinished = true;
                tracing::warn!(error = %e, "repair pass failed");
                Step::Failed(format!("repair: {e}"), Duration::from_secs(5))
            }
        }
    }
}

/// Removes the copies held here that no record names any more (see
/// `core/sweep.rs`).
pub struct Sweeper {
    pub core: Weak<Core>,
    grace: Duration,
    seen: std::collections::HashMap<converged_metadata::types::Ino, Instant>,
    last: Option<Instant>,
}

impl Sweeper {
    pub fn new(core: Weak<Core>, grace: Duration) -> Self {
        Sweeper { core, grace, seen: Default::default(), last: None }
    }

    /// How often the copies held here are looked at.
    fn period(&self) -> Duration {
        (self.grace / 2).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }
}

impl Worker for Sweeper {
    fn name(&self) -> String {
        "sweep".into()
    }

    fn step(&mut self) -> Step {
        std::thread::sleep(Duration::from_secs(1));
        if self.last.is_some_and(|t| t.elapsed() < self.period()) {
            return Step::Idle;
        }
        let Some(core) = self.core.upgrade() else { return Step::Stop };
        self.last = Some(Instant::now());
        match core.sweep(&mut self.seen, self.grace) {
            Ok(0) => Step::Idle,
            Ok(n) => Step::Worked(format!("removed the copies of {n} files no record names")),
            Err(e) => {
                tracing::warn!(error = %e, "sweep failed");
                Step::Failed(format!("sweep: {e}"), Duration::from_secs(5))
            }
        }
    }
}
