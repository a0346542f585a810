//! The workers of a node daemon. Each holds a `Weak<Core>` and calls one
//! step of the core's own logic; the logic lives with the state it owns
//! (`core/durability.rs`, `core/replicate.rs`, `backfill.rs`, `evict.rs`).

use std::sync::Weak;
use std::time::{Duration, Instant};

use super::{Step, Worker};
use crate::core::{Core, Replicated};

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
