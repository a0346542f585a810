//! Daemon assembly: the one place that builds a node from its mount
//! options, in order: metadata engine → namespace → core → cluster (peers,
//! membership) → object tier → workers → the kernel mount. `cli.rs` parses
//! and checks the options; `fuse.rs` is the only module that knows fuser.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use converged_metadata::{MetaUri, Namespace};

use crate::config::{node_id, parse_labels, Checked, MountArgs, DEFAULT_CLUSTER_REPLICAS};
use crate::core::{Core, CoreConfig};
use crate::fuse::Connection;
use crate::kernel_handles::{HandleJournal, Settled};

/// Printed by a background daemon on its stdout once the mount answers.
pub const READY: &str = "converged: mount ready";

fn node_info(
    args: &MountArgs,
    data_dir: &Path,
    addr: String,
) -> anyhow::Result<converged_metadata::membership::NodeInfo> {
    let (free, capacity) = crate::blocks::disk_space(data_dir).unwrap_or((0, 0));
    let now = wall_clock(args.clock_offset);
    Ok(converged_metadata::membership::NodeInfo {
        id: node_id(args),
        addr,
        capacity,
        free,
        labels: parse_labels(&args.labels)?,
        started: now,
        heartbeat: now,
    })
}

/// This node's wall clock as it writes it into its membership records
/// (`--clock-offset` shifts it, for tests). Nothing compares it with another
/// node's: how long a node has been dead is measured where it is seen dead.
fn wall_clock(offset: i64) -> converged_metadata::types::Timespec {
    let mut t = converged_metadata::types::Timespec::now();
    t.sec += offset;
    t
}

/// Register in the volume's membership (etcd) and heartbeat until the
/// engine goes away. Embedded engines have no membership: a single node.
///
/// A node that finds its membership lapsed (no heartbeat got through for
/// longer than the lease, or the next one found the lease expired) may have
/// been declared dead and had its write leases taken over: its writing
/// sessions are fenced at once (see `core/write.rs`). The lapse is watched
/// by a thread of its own ([`lapse_watch`]): a heartbeat may be blocked in
/// its round trips for longer than the lease. Both threads end once the
/// returned flag is set (the node leaves the cluster at its unmount).
fn join_cluster(
    engine: &Arc<dyn converged_metadata::KvEngine>,
    args: &MountArgs,
    data_dir: &Path,
    addr: String,
    core: std::sync::Weak<Core>,
) -> anyhow::Result<Arc<AtomicBool>> {
    use converged_metadata::membership::Heartbeat;
    let left = Arc::new(AtomicBool::new(false));
    let Some(m) = engine.membership() else { return Ok(left) };
    let ttl = Duration::from_secs(args.lease_ttl);
    let mut info = node_info(args, data_dir, addr)?;
    let asked = Instant::now();
    m.register(&info, ttl).context("register in the cluster")?;
    tracing::info!(node = %info.id, ttl = args.lease_ttl, "registered in the cluster");
    if let Some(core) = core.upgrade() {
        core.control().moved(converged_metadata::schema::Control::Members);
    }
    let weak = Arc::downgrade(engine);
    let clock = Arc::new(LeaseClock::new(asked));
    lapse_watch(weak.clone(), clock.clone(), ttl, core.clone(), left.clone())?;
    let data_dir = data_dir.to_path_buf();
    let offset = args.clock_offset;
    let leaving = left.clone();
    std::thread::Builder::new().name("heartbeat".into()).spawn(move || loop {
        std::thread::sleep(ttl / 3);
        if leaving.load(Ordering::Acquire) {
            return;
        }
        let Some(engine) = weak.upgrade() else { return };
        let Some(m) = engine.membership() else { return };
        (info.free, info.capacity) = crate::blocks::disk_space(&data_dir).unwrap_or((0, 0));
        info.heartbeat = wall_clock(offset);
        // etcd renews the lease when it takes the keepalive, at or after
        // this instant: the lease runs at least `ttl` from here.
        let asked = Instant::now();
        let lapsed = clock.lapsed(ttl);
        match m.heartbeat(&info) {
            Ok(Heartbeat::Renewed) => {
                clock.renewed(asked);
                if lapsed {
                    tracing::info!("heartbeat renewed the membership lease again");
                }
            }
            Ok(Heartbeat::Rejoined) => {
                // Fenced before the lease is counted renewed: no writer
                // opened under the new lease is fenced for the old one.
                if !lapsed {
                    tracing::warn!("membership lease had expired; registered again and fencing this node's writers");
                    if let Some(core) = core.upgrade() {
                        core.fence_all_writers();
                    }
                }
                clock.renewed(asked);
                // This node's own records: the change feed does not report them here.
                if let Some(core) = core.upgrade() {
                    core.control().moved(converged_metadata::schema::Control::Members);
                }
                if lapsed {
                    tracing::info!("membership lease had expired; registered in the cluster again");
                }
            }
            Err(_) if leaving.load(Ordering::Acquire) => return,
            Err(e) => tracing::warn!(error = %e, "heartbeat failed; retrying"),
        }
    })?;
    Ok(left)
}

/// When this node's membership lease was last renewed: the instant its
/// renewal was asked for (etcd renews it when the request arrives, so the
/// lease runs at least the TTL from then). Written by the heartbeat thread,
/// read by the lapse watch.
struct LeaseClock {
    base: Instant,
    /// Milliseconds from `base` to the last renewal.
    renewed_ms: std::sync::atomic::AtomicU64,
}

impl LeaseClock {
    fn new(at: Instant) -> Self {
        Self { base: at, renewed_ms: Default::default() }
    }

    fn renewed(&self, at: Instant) {
        let ms = at.saturating_duration_since(self.base).as_millis() as u64;
        self.renewed_ms.fetch_max(ms, Ordering::AcqRel);
    }

    fn since(&self) -> Duration {
        let at = self.base + Duration::from_millis(self.renewed_ms.load(Ordering::Acquire));
        at.elapsed()
    }

    fn lapsed(&self, ttl: Duration) -> bool {
        self.since() > ttl
    }
}

/// Fence this node's writers once no renewal of its membership lease got
/// through for the lease's TTL (paused, or cut off from the metadata), and
/// at each look after while it stays lapsed (a writer may open meanwhile);
/// said once a lapse. Looks ten times a lease, so a writer is fenced at
/// most a tenth of a lease after it may have been declared dead.
fn lapse_watch(
    engine: std::sync::Weak<dyn converged_metadata::KvEngine>,
    clock: Arc<LeaseClock>,
    ttl: Duration,
    core: std::sync::Weak<Core>,
    left: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let every = (ttl / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
    std::thread::Builder::new().name("lapse-watch".into()).spawn(move || {
        let mut told = false;
        loop {
            std::thread::sleep(every);
            if engine.strong_count() == 0 || left.load(Ordering::Acquire) {
                return;
            }
            let since = clock.since();
            if since <= ttl {
                told = false;
                continue;
            }
            if !told {
                tracing::warn!(
                    ?since,
                    "no heartbeat for longer than the membership lease; fencing this node's writers"
                );
                told = true;
            }
            let Some(core) = core.upgrade() else { return };
            core.fence_all_writers();
        }
    })?;
    Ok(())
}

pub(crate) fn lock_path(data_dir: &Path) -> PathBuf {
    data_dir.join("converged.lock")
}

/// Hold an exclusive lock on the data dir for the daemon's life, so two
/// daemons never share one. Waits a while for a daemon that is exiting.
pub(crate) fn lock_data_dir(data_dir: &Path, wait: Duration) -> anyhow::Result<File> {
    let path = lock_path(data_dir);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    let deadline = Instant::now() + wait;
    loop {
        // SAFETY: flock on our own fd.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            break;
        }
        if Instant::now() >= deadline {
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            bail!("data dir {} is in use by another converged daemon (pid {})", data_dir.display(), pid.trim());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f.set_len(0)?;
    write!(f, "{}", std::process::id())?;
    Ok(f)
}

pub(crate) fn init_tracing(log_file: Option<&Path>) -> anyhow::Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("CONVERGED_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match log_file {
        Some(path) => {
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("open log file {}", path.display()))?;
            builder.with_ansi(false).with_writer(std::sync::Mutex::new(file)).init();
        }
        None => builder.with_writer(std::io::stderr).init(),
    }
    // A background daemon's stderr is /dev/null: a panic goes to the log too.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        tracing::error!(%info, "panicked");
        default_hook(info);
    }));
    Ok(())
}

/// Open the metadata engine, retrying for up to `wait` while the service
/// does not answer (etcd still starting at boot), with backoff; each wait
/// is logged with its reason.
fn open_engine_waiting(c: &Checked, wait: Duration) -> anyhow::Result<Arc<dyn converged_metadata::KvEngine>> {
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(250);
    loop {
        match converged_metadata::open_engine(&c.meta) {
            Ok(engine) => return Ok(engine),
            Err(e) if e.is_retryable() && Instant::now() + pause < deadline => {
                let left = deadline.saturating_duration_since(Instant::now());
                tracing::warn!(error = %e, retry_in = ?pause, gives_up_in = ?left, "metadata service not reachable; waiting (--meta-wait)");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(e) if e.is_retryable() && !wait.is_zero() => {
                return Err(e)
                    .with_context(|| format!("open metadata {} (gave up after --meta-wait {wait:?})", c.meta_str))
            }
            Err(e) => return Err(e).with_context(|| format!("open metadata {}", c.meta_str)),
        }
    }
}

/// Tell systemd (a `Type=notify` unit) how the daemon stands, when it
/// started us with a notify socket; a no-op otherwise.
pub(crate) fn notify_systemd(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(_) => return,
    };
    let bytes = path.as_encoded_bytes();
    let sent = if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)
            .and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    if let Err(e) = sent {
        tracing::warn!(error = %e, "could not notify systemd");
    }
}

/// Set in a daemon's environment, makes every daemon after the first of a
/// connection fail at start: how the tests make a crash loop.
pub const FAULT_DIE_ON_RESTART: &str = "CONVERGED_FAULT_DIE_ON_RESTART";

/// Set in a daemon's environment to a comma-separated list of namespace
/// operations (`mkdir,rename`), makes the n-th daemon of a supervised
/// connection die right after it commits the n-th operation of the list,
/// before it answers: how the tests make the kernel send a request whose
/// change is done.
pub const FAULT_DIE_AFTER_COMMIT: &str = "CONVERGED_FAULT_DIE_AFTER_COMMIT";

/// Set in a daemon's environment, has the kernel refuse its ring entries'
/// registrations, which turns FUSE over io_uring off for the
/// connection (`fuser::Config::io_uring_refused`): how the tests make a
/// kernel that offered the transport at INIT send every request through
/// /dev/fuse after all.
pub const FAULT_RING_REFUSED: &str = "CONVERGED_FAULT_RING_REFUSED";

/// File handles of the n-th daemon of a connection start at n << this, so
/// that none repeats one an earlier daemon gave the kernel.
const FH_GENERATION_SHIFT: u32 = 40;

/// Run the daemon in this process until the filesystem is unmounted.
/// The kernel connection a daemon serves, and what an earlier daemon of
/// it left (see supervise.rs): the journal of handles, the settled state,
/// and the handles to adopt.
struct KernelSide {
    conn: Connection,
    journal: Arc<HandleJournal>,
    settled: Option<Settled>,
    adopted: Vec<crate::kernel_handles::Recorded>,
}

pub fn run(args: &MountArgs, c: Checked) -> anyhow::Result<()> {
    // Everything the daemon creates in the data dir (metadata, chunks, the
    // lock, the log) is its own: 0600 files, 0700 directories.
    // SAFETY: umask(2) cannot fail.
    unsafe { libc::umask(0o077) };
    let log_file = if args.daemonized {
        Some(args.log_file.clone().unwrap_or_else(|| c.data_dir.join("converged.log")))
    } else {
        None
    };
    init_tracing(log_file.as_deref())?;
    converged_metadata::set_txn_observer(|kind, d| crate::latency::observe(crate::latency::Area::Meta, kind, d));
    if args.fuse_generation > 0 && std::env::var_os(FAULT_DIE_ON_RESTART).is_some() {
        bail!("fault switch {FAULT_DIE_ON_RESTART} is set: a restarted daemon dies at start");
    }
    let _lock = lock_data_dir(&c.data_dir, Duration::from_secs(10))?;
    let kernel = kernel_side(args, &c)?;
    let found = crate::identity::inspect(&c.data_dir)?;
    // A read-only reader node of a cluster may have an empty data dir (see `identity::settle`).
    if matches!(found, crate::identity::Found::Empty) && args.require_identity && !args.new_node && !args.read_only {
        bail!(
            "data dir {} has no converged identity: it was never mounted, or its disk is not mounted. \
             For a new data dir, mount it once with the new_node option (--new-node)",
            c.data_dir.display()
        );
    }
    let (engine, deferred) = metadata_engine(args, &c)?;
    let tier = object_tier(args)?;
    let ns = namespace(args, &c, &engine, deferred, tier.is_some(), found)?;
    let core = start_core(args, &c, ns, &kernel)?;
    let workers = crate::workers::Supervisor::new();
    let w = Arc::downgrade(&workers);
    core.report_workers_with(move || w.upgrade().map(|w| w.report()).unwrap_or_default());
    let addr = serve_peers(args, &core, &engine, &workers)?;
    // A read-only node is a reader: it does not register, so placement sends
    // it no copies and no membership lease is taken.
    let left = match args.read_only {
        false => Some(join_cluster(&engine, args, &c.data_dir, addr, Arc::downgrade(&core))?),
        true => None,
    };
    if let Some(t) = &tier {
        // Read-only: reads of evicted or imported files come from the
        // store, and nothing is uploaded or evicted.
        core.attach_tier(t.clone());
    }
    if let Some(t) = tier.as_ref().filter(|_| !args.read_only) {
        core.resume_backfill()?;
        for i in 0..t.cfg.workers {
            workers.start(crate::workers::Backfiller::new(Arc::downgrade(&core), i))?;
        }
        workers.start(crate::workers::Evictor { core: Arc::downgrade(&core) })?;
        tracing::info!(store = %t.objects.home().url(), delay = ?t.cfg.backfill_delay, "backfilling to the object store");
    }
    if let Some(addr) = args.metrics {
        let bound = crate::metrics::serve(addr, Arc::downgrade(&core)).with_context(|| format!("--metrics {addr}"))?;
        tracing::info!(%bound, "serving Prometheus metrics at /metrics");
    }
    if !args.read_only {
        start_local_workers(args, &core, &workers)?;
    }
    let stopped = Arc::downgrade(&core);
    mount_and_serve(args, &c, core, &engine, kernel)?;
    notify_systemd("STOPPING=1");
    if let Some(left) = &left {
        left.store(true, Ordering::Release);
    }
    if let Some(m) = engine.membership() {
        if stopped.upgrade().is_some_and(|core| !core.store_answered_at_stop()) {
            tracing::warn!(
                "not leaving the cluster: etcd did not answer the unmount; the membership lease will expire"
            );
        } else if let Err(e) = m.leave() {
            tracing::warn!(error = %e, "could not leave the cluster cleanly; the lease will expire");
        }
    }
    if let Some(t) = &tier {
        t.stop();
    }
    workers.stop(Duration::from_secs(5));
    tracing::info!(mountpoint = %c.mountpoint.display(), "unmounted");
    Ok(())
}

/// The kernel connection: this daemon's own, or the supervisor's, new or
/// taken over from a daemon that died (see supervise.rs).
fn kernel_side(args: &MountArgs, c: &Checked) -> anyhow::Result<KernelSide> {
    let fresh = |conn| -> anyhow::Result<KernelSide> {
        let journal = Arc::new(HandleJournal::create(&c.data_dir, Settled::default())?);
        Ok(KernelSide { conn, journal, settled: None, adopted: Vec::new() })
    };
    let Some(fd) = args.fuse_fd else { return fresh(Connection::Mount) };
    // SAFETY: the supervisor opened this descriptor for this process.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    if args.fuse_generation == 0 {
        return fresh(Connection::Fresh(fd));
    }
    let (journal, settled, adopted) = HandleJournal::take_over(&c.data_dir)?;
    tracing::info!(
        generation = args.fuse_generation,
        last = args.last_exit.as_deref().unwrap_or("?"),
        handles = adopted.len(),
        "taking over the live FUSE connection"
    );
    Ok(KernelSide { conn: Connection::Resume(fd), journal: Arc::new(journal), settled: Some(settled), adopted })
}

/// The metadata engine as this node uses it: the engine the URI names; for
/// a shared one, a node-local cache of inodes and names kept honest by its
/// change feed; with --nowsync, the deferring layer in front (see
/// metadata/src/kv_deferred.rs), also returned on its own.
type Engine = Arc<dyn converged_metadata::KvEngine>;
type Deferred = Option<Arc<converged_metadata::kv_deferred::DeferredKv>>;

fn metadata_engine(args: &MountArgs, c: &Checked) -> anyhow::Result<(Engine, Deferred)> {
    let engine = open_engine_waiting(c, args.meta_wait)?;
    let engine = match engine.membership() {
        Some(_) => converged_metadata::CachedKv::wrap(engine).context("watch the metadata for other nodes' changes")?,
        None => engine,
    };
    let deferred = (args.nowsync && !args.read_only)
        .then(|| converged_metadata::kv_deferred::DeferredKv::wrap(engine.clone(), &node_id(args)));
    let engine: Engine = match &deferred {
        Some(d) => d.clone(),
        None => engine,
    };
    Ok((engine, deferred))
}

/// The object tier, when the mount has one (`--object-store`).
fn object_tier(args: &MountArgs) -> anyhow::Result<Option<Arc<crate::tier::Tiering>>> {
    let Some(uri) = &args.object_store else { return Ok(None) };
    let opts = crate::objects::StoreOptions { s3_endpoint: args.s3_endpoint.clone() };
    let objects = crate::objects::ObjectTier::open(uri, opts).with_context(|| format!("--object-store {uri}"))?;
    // Mount even while the store is down: the backlog waits for it.
    if let Err(e) = objects.probe(objects.home()) {
        tracing::warn!(error = %e, "object store not reachable yet; backfill will retry");
    }
    Ok(Some(Arc::new(crate::tier::Tiering::new(
        objects,
        crate::tier::TierConfig {
            backfill_delay: args.backfill_delay,
            keep_deleted: args.keep_deleted_objects,
            evict_high: args.evict_high / 100.0,
            evict_low: args.evict_low / 100.0,
            workers: args.backfill_workers as usize,
            copy_limit: args.object_copy_limit,
        },
    ))))
}

/// The volume's namespace for this node, once the data dir's identity
/// agrees with the volume (see `identity.rs`).
fn namespace(
    args: &MountArgs,
    c: &Checked,
    engine: &Engine,
    deferred: Deferred,
    tiered: bool,
    found: crate::identity::Found,
) -> anyhow::Result<Namespace> {
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let node = node_id(args);
    let ask = crate::identity::Ask {
        node: &node,
        new_node: args.new_node,
        read_only: args.read_only,
        clustered: engine.membership().is_some(),
        meta: &c.meta_str,
    };
    let exists = converged_metadata::volume_exists(&**engine).context("read the volume record")?;
    crate::identity::before_open(&c.data_dir, &found, exists, &ask)?;
    let mut ns = Namespace::open(engine.clone(), uid, gid).context("open namespace")?.with_node(&node);
    ns.set_unanswered_wait(args.meta_op_wait);
    crate::identity::settle(&c.data_dir, found, &ns, &ask)?;
    if tiered {
        ns = ns.with_tier();
    }
    if let Some(d) = deferred {
        ns = ns.with_nowsync(d);
    }
    Ok(ns)
}

/// The filesystem core over `ns` (recovery runs here), serving from the
/// start the handles an earlier daemon of the connection left.
fn start_core(args: &MountArgs, c: &Checked, ns: Namespace, kernel: &KernelSide) -> anyhow::Result<Arc<Core>> {
    let core = Arc::new(Core::start(
        ns,
        CoreConfig {
            data_dir: c.data_dir.clone(),
            node_id: node_id(args),
            verify_reads: args.verify_reads,
            read_only: args.read_only,
            atime: if args.read_only { converged_metadata::AtimeRule::Never } else { args.atime.rule() },
            diratime: !args.nodiratime,
            meta_file: match &c.meta {
                MetaUri::Redb(path) => Some(path.clone()),
                MetaUri::Memory | MetaUri::Etcd { .. } => None,
            },
            kernel_open: kernel.adopted.iter().map(|r| r.handle).collect(),
            fh_base: args.fuse_generation << FH_GENERATION_SHIFT,
            serves_peers: args.listen.is_some() && args.tls_dir.is_some(),
        },
    )?);
    if let Some(settled) = &kernel.settled {
        core.set_passthrough(settled.passthrough);
    }
    core.set_daemon_life(crate::core::DaemonLife {
        started: std::time::SystemTime::now(),
        restarts: args.fuse_generation,
        last_exit: args.last_exit.clone(),
    });
    Ok(core)
}

/// The peer data plane, with `--listen`: this node's chunks served over
/// QUIC with mutual TLS, the replicas and remote reads of its own files,
/// and the workers that act on other nodes' changes (repair, sweep).
/// Returns the address peers reach it at (empty without one).
fn serve_peers(
    args: &MountArgs,
    core: &Arc<Core>,
    engine: &Engine,
    workers: &Arc<crate::workers::Supervisor>,
) -> anyhow::Result<String> {
    let (Some(listen), Some(dir)) = (&args.listen, &args.tls_dir) else { return Ok(String::new()) };
    let tls = converged_transport::NodeTls::load(dir)?;
    let node = tls.node.clone();
    let cluster = crate::cluster::Cluster::start(
        crate::cluster::ClusterConfig {
            node: node_id(args),
            default_replicas: args.replicas.unwrap_or(DEFAULT_CLUSTER_REPLICAS),
            durability: args.durability,
            failure_domain: args.failure_domain.clone(),
            peer_timeout: Duration::from_secs_f64(args.peer_timeout.max(0.1)),
        },
        *listen,
        &tls,
        engine.clone(),
        core.chunk_store(),
    )
    .with_context(|| format!("listen on {listen}"))?;
    let addr = cluster.local_addr().to_string();
    tracing::info!(%addr, %node, replicas = cluster.default_replicas(), durability = ?args.durability, "serving chunks to peers");
    core.attach_cluster(cluster);
    if !args.read_only {
        let repair = crate::core::RepairConfig { delay: args.repair_delay, bandwidth: args.repair_bandwidth };
        workers.start(crate::workers::Repairer::new(Arc::downgrade(core), repair))?;
        // Peers' durable copies of small chunk versions fill slots made ahead.
        workers.start(crate::workers::Slots { core: Arc::downgrade(core) })?;
        // The sweep hears which files other nodes changed, and the
        // workers which control-plane records did.
        engine.watch(core.sweep_hints().feed(core.node_id().to_string()))?;
        engine.watch(core.peer_leases().feed())?;
        engine.watch(core.recorded_copies_feed())?;
        if engine.watch(core.control().feed())? {
            core.control().watching();
        }
        workers.start(crate::workers::Sweeper::new(Arc::downgrade(core), args.sweep_grace))?;
    }
    Ok(addr)
}

/// The workers of a node that writes: the flusher (buffered namespace
/// commits become durable within a second, as a local filesystem's journal
/// commit; fsync makes them durable at once), spares, replicator, streamer,
/// settler, scrubber.
fn start_local_workers(
    args: &MountArgs,
    core: &Arc<Core>,
    workers: &Arc<crate::workers::Supervisor>,
) -> anyhow::Result<()> {
    workers.start(crate::workers::Flusher { core: Arc::downgrade(core), period: Duration::from_secs(1) })?;
    workers.start(crate::workers::Spares { core: Arc::downgrade(core) })?;
    workers.start(crate::workers::Replicator { core: Arc::downgrade(core) })?;
    workers.start(crate::workers::Streamer { core: Arc::downgrade(core) })?;
    workers.start(crate::workers::Settler { core: Arc::downgrade(core) })?;
    workers.start(crate::workers::Scrubber::new(Arc::downgrade(core), args.scrub_period))?;
    Ok(())
}

/// Mount (or resume the connection), say so, and serve until unmounted.
fn mount_and_serve(
    args: &MountArgs,
    c: &Checked,
    core: Arc<Core>,
    engine: &Engine,
    kernel: KernelSide,
) -> anyhow::Result<()> {
    let source = args.source.clone().unwrap_or_else(|| format!("converged:{}", c.data_dir.display()));
    let spec = crate::fuse::MountSpec {
        mountpoint: &c.mountpoint,
        source,
        attr_timeout: Duration::from_secs_f64(args.attr_timeout),
        want_passthrough: !args.verify_reads,
        fuse_uring: match (args.fuse_uring, args.no_fuse_uring) {
            (_, true) => crate::fuse::Uring::Off,
            (true, _) => crate::fuse::Uring::Asked,
            (false, false) => crate::fuse::Uring::Default,
        },
        ring_memory: args.fuse_ring_fd,
        resumed_uring: kernel.settled.is_some_and(|s| s.io_uring),
        threads: args.threads.unwrap_or(match engine.membership() {
            Some(_) => crate::config::CLUSTER_FUSE_THREADS,
            None => crate::config::FUSE_THREADS,
        }) as usize,
        read_only: args.read_only,
        suid: args.suid,
        dev: args.dev,
        noexec: args.noexec,
        noatime: args.atime == crate::config::AtimePolicy::Noatime,
        // The n-th daemon of a supervised connection dies after the n-th
        // operation the list names.
        die_after_commit: std::env::var(FAULT_DIE_AFTER_COMMIT)
            .ok()
            .filter(|_| args.fuse_fd.is_some())
            .and_then(|ops| ops.split(',').nth(args.fuse_generation as usize).map(str::to_string)),
    };
    let KernelSide { conn, journal, adopted, .. } = kernel;
    crate::fuse::serve(core, spec, conn, journal, &adopted, |feed| {
        // Changes other nodes make evict what this kernel caches of them.
        engine.watch(feed)?;
        tracing::info!(mountpoint = %c.mountpoint.display(), data_dir = %c.data_dir.display(), meta = %c.meta_str, "mounted");
        if args.daemonized {
            // Leave the mount command's session now that the mount exists, so
            // a closing terminal does not take the daemon down.
            // SAFETY: setsid(2); the daemon is not a process group leader.
            unsafe { libc::setsid() };
            println!("{READY}");
            std::io::stdout().flush()?;
            detach_stdio();
        } else if args.fuse_fd.is_some() {
            // In the foreground under a supervisor, which reports readiness.
            println!("{READY}");
            std::io::stdout().flush()?;
        }
        notify_systemd("READY=1");
        Ok(())
    })?;
    Ok(())
}

/// Point stdin/stdout/stderr at /dev/null so the parent sees end-of-file.
pub(crate) fn detach_stdio() {
    if let Ok(null) = OpenOptions::new().read(true).write(true).open("/dev/null") {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}
