//! Background work: one small trait, [`Worker`], and one [`Supervisor`]
//! that runs each worker on a thread of its own, stops them, and reports
//! their state (`converged status PATH` prints it, read from the mount as
//! the `user.converged.workers` attribute).
//!
//! A worker's step waits for its own work for at most about a second, so a
//! stop is seen within that; it holds a `Weak<Core>` and stops when the core
//! is gone. Adding a worker: a type implementing [`Worker`] in this folder,
//! and one `supervisor.start(...)` in `daemon.rs`.

mod jobs;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::held_locks::Mutex;

pub use jobs::{
    Backfiller, Evictor, Flusher, Repairer, Replicator, Scrubber, Settler, Slots, Spares, Streamer, Sweeper,
};

/// What one step did.
pub enum Step {
    /// Nothing to do this time.
    Idle,
    /// Did some work; the text says what (shown by `status`).
    Worked(String),
    /// Failed; wait this long before the next step.
    Failed(String, Duration),
    /// Nothing more to do, ever (the core or the tier is gone).
    Stop,
}

/// A background job: a name, and one step at a time.
pub trait Worker: Send + 'static {
    fn name(&self) -> String;
    /// One unit of work, waiting at most about a second for some.
    fn step(&mut self) -> Step;
}

/// The state of a worker, as `status` prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    Idle,
    Working,
    /// The last step failed; retrying after a pause.
    Failing,
    Stopped,
}

#[derive(Debug, Clone)]
pub struct WorkerStatus {
    pub name: String,
    pub state: WorkerState,
    pub steps: u64,
    pub failures: u64,
    /// What the last step that did something said, and when.
    pub last: String,
    pub last_at: Option<Instant>,
}

struct Slot {
    status: Mutex<WorkerStatus>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Starts, stops and reports the workers of one daemon.
#[derive(Default)]
pub struct Supervisor {
    slots: Mutex<Vec<Arc<Slot>>>,
    stop: Arc<AtomicBool>,
}

impl Supervisor {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Run `worker` on a thread of its own until [`Supervisor::stop`].
    pub fn start(&self, mut worker: impl Worker) -> std::io::Result<()> {
        let name = worker.name();
        let slot = Arc::new(Slot {
            status: Mutex::new(WorkerStatus {
                name: name.clone(),
                state: WorkerState::Idle,
                steps: 0,
                failures: 0,
                last: String::new(),
                last_at: None,
            }),
            thread: Mutex::new(None),
        });
        let stop = self.stop.clone();
        let s = slot.clone();
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let step = worker.step();
                if matches!(step, Step::Stop) {
                    break;
                }
                let pause = {
                    let mut st = s.status.lock();
                    st.steps += 1;
                    match step {
                        Step::Idle => {
                            st.state = WorkerState::Idle;
                            None
                        }
                        Step::Worked(what) => {
                            st.state = WorkerState::Working;
                            st.last = what;
                            st.last_at = Some(Instant::now());
                            None
                        }
                        Step::Failed(why, pause) => {
                            st.state = WorkerState::Failing;
                            st.failures += 1;
                            st.last = why;
                            st.last_at = Some(Instant::now());
                            Some(pause)
                        }
                        Step::Stop => None,
                    }
                };
                if let Some(pause) = pause {
                    pause_unless_stopped(&stop, pause);
                }
            }
            s.status.lock().state = WorkerState::Stopped;
        })?;
        *slot.thread.lock() = Some(handle);
        self.slots.lock().push(slot);
        Ok(())
    }

    /// Ask every worker to stop after its current step, and wait for them
    /// (at most `wait`).
    pub fn stop(&self, wait: Duration) {
        self.stop.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + wait;
        for slot in self.slots.lock().iter() {
            while slot.status.lock().state != WorkerState::Stopped && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if slot.status.lock().state == WorkerState::Stopped {
                if let Some(t) = slot.thread.lock().take() {
                    let _ = t.join();
                }
            }
        }
    }

    pub fn statuses(&self) -> Vec<WorkerStatus> {
        self.slots.lock().iter().map(|s| s.status.lock().clone()).collect()
    }

    /// One line per worker: name, state, steps, failures, and what it last did.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for st in self.statuses() {
            let state = match st.state {
                WorkerState::Idle => "idle",
                WorkerState::Working => "working",
                WorkerState::Failing => "failing",
                WorkerState::Stopped => "stopped",
            };
            let ago = st.last_at.map(|t| format!(" {:.1}s ago", t.elapsed().as_secs_f64())).unwrap_or_default();
            let last = if st.last.is_empty() { String::new() } else { format!(" last: {}{ago}", st.last) };
            out.push_str(&format!("{} {state} steps={} failures={}{last}\n", st.name, st.steps, st.failures));
        }
        out
    }
}

fn pause_unless_stopped(stop: &AtomicBool, pause: Duration) {
    let until = Instant::now() + pause;
    while !stop.load(Ordering::SeqCst) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50).min(until.saturating_duration_since(Instant::now())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter(Arc<Mutex<u32>>);

    impl Worker for Counter {
        fn name(&self) -> String {
            "counter".into()
        }
        fn step(&mut self) -> Step {
            let mut n = self.0.lock();
            *n += 1;
            std::thread::sleep(Duration::from_millis(5));
            match *n {
                3 => Step::Failed("third step fails".into(), Duration::from_millis(10)),
                10 => Step::Stop,
                _ => Step::Worked(format!("step {}", *n)),
            }
        }
    }

    #[test]
    fn a_worker_runs_reports_its_failures_and_stops() {
        let sup = Supervisor::new();
        let n = Arc::new(Mutex::new(0));
        sup.start(Counter(n.clone())).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while sup.statuses()[0].state != WorkerState::Stopped && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let st = &sup.statuses()[0];
        assert_eq!(st.state, WorkerState::Stopped);
        assert_eq!((*n.lock(), st.failures), (10, 1));
        assert_eq!(st.last, "step 9");
        assert!(sup.report().starts_with("counter stopped steps=9 failures=1 last: step 9"), "{}", sup.report());
    }

    struct Forever;

    impl Worker for Forever {
        fn name(&self) -> String {
            "forever".into()
        }
        fn step(&mut self) -> Step {
            std::thread::sleep(Duration::from_millis(20));
            Step::Idle
        }
    }

    #[test]
    fn stop_ends_every_worker_after_its_step() {
        let sup = Supervisor::new();
        sup.start(Forever).unwrap();
        sup.start(Forever).unwrap();
        sup.stop(Duration::from_secs(5));
        assert!(sup.statuses().iter().all(|s| s.state == WorkerState::Stopped));
    }
}
