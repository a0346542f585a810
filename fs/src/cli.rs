//! The `converged` command line: `mount` (which starts the daemon and returns
//! once the mount answers), `umount`, and the daemon itself.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use converged_metadata::{MetaUri, Namespace};

use crate::core::{Core, CoreConfig};
use crate::fuse::FuseAdapter;

/// Copies of each chunk in a cluster when neither the mount nor a directory says otherwise.
const DEFAULT_CLUSTER_REPLICAS: u32 = 2;

/// Printed by a background daemon on its stdout once the mount answers.
const READY: &str = "converged: mount ready";

#[derive(Parser, Debug)]
#[command(
    name = "converged",
    version,
    about = "converged: the local NVMe SSDs of GPU nodes as one shared POSIX namespace",
    long_about = "converged mounts a POSIX filesystem whose file data lives in chunks on local SSDs \
                  and whose namespace lives in a transactional key-value store (embedded redb by default)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Mount a volume; returns once the mount answers (the daemon keeps running in the background).
    Mount(Box<MountArgs>),
    /// Unmount a converged mount and wait for its daemon to exit.
    Umount {
        /// The mount point to unmount.
        mountpoint: PathBuf,
    },
    /// Show a file's tiers (where its chunks are, its backfill state and object), or, with
    /// --meta, the nodes of a volume (live or dead, capacity, labels) and chunk health.
    Status {
        /// A file or directory on a converged mount: its chunks, tier and backfill state, and
        /// this node's backfill backlog.
        #[arg(required_unless_present = "meta")]
        path: Option<PathBuf>,
        /// Metadata URI of the volume, as given to `mount --meta`.
        #[arg(long, value_name = "URI")]
        meta: Option<String>,
    },
    /// Make the objects under a bucket prefix appear as files under a directory of a mount,
    /// without copying: listed on first access, fetched (and kept on the SSDs) when read.
    /// Keys that are not valid POSIX names are skipped and listed here.
    Import(crate::admin::ImportArgs),
    /// Warm files onto the SSDs: fetch every chunk a node lacks from peers or the object store,
    /// with a progress bar. Run it again after an interruption and it resumes.
    Stage(crate::admin::StageArgs),
    /// Cluster certificates: peers talk QUIC with mutual TLS from a cluster CA.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Try a cluster on one machine: start etcd and N nodes on loopback, each with its own
    /// mount point, until Ctrl-C.
    DevCluster(crate::devcluster::DevClusterArgs),
}

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// Create the cluster CA (ca.pem, ca.key, ca.cn) in OUT, and a first node certificate in OUT/NODE.
    Init {
        /// Directory for the CA; created if missing. Keep ca.key off the nodes if you can.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// A name for the cluster, written into the CA certificate.
        #[arg(long, default_value = "converged")]
        name: String,
        /// The first node's name (its certificate goes to OUT/NODE).
        #[arg(long, default_value = "n1")]
        node: String,
    },
    /// Issue a node certificate signed by the cluster CA (ca.pem, node.pem, node.key, node.name in OUT).
    IssueCert {
        /// The node's name; peers address it by this name.
        #[arg(long)]
        node: String,
        /// Directory holding the CA made by `cluster init`.
        #[arg(long, value_name = "DIR")]
        ca: PathBuf,
        /// Directory for the node's files (the --tls-dir of that node's mount).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

fn cluster(cmd: ClusterCmd) -> anyhow::Result<()> {
    use converged_transport::ClusterCa;
    match cmd {
        ClusterCmd::Init { out, name, node } => {
            if out.join("ca.key").exists() {
                bail!("{} already holds a cluster CA (ca.key); refusing to replace it", out.display());
            }
            let ca = ClusterCa::generate(&format!("converged cluster {name}"))?;
            ca.save(&out)?;
            ca.issue(&node)?.save(&out.join(&node))?;
            println!("cluster CA in {}; certificate of node {node} in {}", out.display(), out.join(&node).display());
        }
        ClusterCmd::IssueCert { node, ca, out } => {
            let ca = ClusterCa::load(&ca)?;
            ca.issue(&node)?.save(&out)?;
            println!("certificate of node {node} in {}", out.display());
        }
    }
    Ok(())
}

#[derive(Args, Debug, Clone)]
pub struct MountArgs {
    /// Directory to mount on. Must exist, be a directory, and not already be a mount of converged.
    pub mountpoint: PathBuf,

    /// Directory on the local SSD that holds chunk backing files (and, by default, the metadata).
    /// Must already exist and be writable; nothing is created when it is missing.
    #[arg(long, value_name = "DIR")]
    pub data_dir: PathBuf,

    /// Metadata store URI: `redb:///abs/path/meta.redb` (embedded, the default is
    /// `redb://<data-dir>/meta.redb`) or `memory:` (nothing persists; for tests).
    #[arg(long, value_name = "URI")]
    pub meta: Option<String>,

    /// Stay in the foreground and log to stderr instead of starting a background daemon.
    #[arg(long)]
    pub foreground: bool,

    /// Serve every read through the daemon so every block is checked against its crc32c.
    /// Turns kernel passthrough off (reads become slower).
    #[arg(long)]
    pub verify_reads: bool,

    /// Number of threads serving FUSE requests.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,

    /// Seconds the kernel may cache names and attributes. On a single node every change goes
    /// through this kernel, which keeps its cache coherent, so a long timeout is safe.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub attr_timeout: f64,

    /// Log file of the background daemon [default: <data-dir>/converged.log].
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,

    /// This node's id, recorded as the holder of the chunks it writes [default: the host name].
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,

    /// Serve this node's chunks to peers over QUIC on ADDR (host:port; port 0 picks one). Needs --tls-dir.
    #[arg(long, value_name = "ADDR", requires = "tls_dir")]
    pub listen: Option<std::net::SocketAddr>,

    /// Directory with this node's certificate (from `converged cluster init` / `issue-cert`).
    #[arg(long, value_name = "DIR", requires = "listen")]
    pub tls_dir: Option<PathBuf>,

    /// Failure-domain labels of this node, as `key=value,key=value` (for example rack=r1).
    #[arg(long, value_name = "LABELS", default_value = "")]
    pub labels: String,

    /// Copies of each chunk (the writing node's included) for files whose directory sets no
    /// `user.converged.replicas` policy [default: 2 with --listen, else 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=8))]
    pub replicas: Option<u32>,

    /// When fsync and close return: `replicated` once every replica is on stable storage,
    /// `local` once the local copy is (replicas follow in the background).
    #[arg(long, value_enum, default_value = "replicated")]
    pub durability: crate::cluster::DurabilityMode,

    /// The label naming a node's failure domain; replicas go to distinct domains first.
    #[arg(long, default_value = "rack", value_name = "LABEL")]
    pub failure_domain: String,

    /// Seconds one call to a peer may take before the next replica is tried.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub peer_timeout: f64,

    /// Seconds without a heartbeat after which the cluster considers this node dead.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600), value_name = "SECONDS")]
    pub lease_ttl: u64,

    /// Back every file with an object store: `s3://bucket/prefix`, `gs://bucket/prefix`,
    /// `az://container/prefix` or `file:///dir`. Each closed file is uploaded as one object at
    /// `<prefix>/<path>`; backed chunks may then be evicted from the SSDs. S3 credentials come
    /// from the usual AWS_* variables.
    #[arg(long, value_name = "URI")]
    pub object_store: Option<String>,

    /// S3-compatible endpoint for s3:// stores and imports (path-style requests), for example
    /// http://127.0.0.1:9000 [default: AWS_ENDPOINT_URL, else AWS].
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,

    /// How long a closed file must stay unchanged before it is uploaded (`500ms`, `5s`, `2m`).
    #[arg(long, default_value = "5s", value_name = "DURATION", value_parser = parse_duration)]
    pub backfill_delay: Duration,

    /// Files uploaded in parallel (each large file also uploads its parts in parallel).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub backfill_workers: u16,

    /// Keep a file's object when the file is deleted (by default the object goes too).
    #[arg(long)]
    pub keep_deleted_objects: bool,

    /// Percent of the data disk in use above which backed chunks are evicted.
    #[arg(long, default_value_t = 90.0, value_name = "PERCENT")]
    pub evict_high: f64,

    /// Percent of the data disk in use that eviction brings usage down to.
    #[arg(long, default_value_t = 80.0, value_name = "PERCENT")]
    pub evict_low: f64,

    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,

    /// Source name shown by mount(8) and df.
    #[arg(long, hide = true)]
    pub source: Option<String>,

    /// Internal: run as the background daemon, reporting readiness on stdout.
    #[arg(long, hide = true)]
    pub daemonized: bool,
}

/// Everything `mount` needs, checked before anything is created or started.
struct Checked {
    mountpoint: PathBuf,
    data_dir: PathBuf,
    meta: MetaUri,
    meta_str: String,
}

fn check(args: &MountArgs) -> anyhow::Result<Checked> {
    let dd = &args.data_dir;
    match std::fs::metadata(dd) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!("data dir {} does not exist", dd.display()),
        Err(e) => bail!("data dir {}: {e}", dd.display()),
        Ok(m) if !m.is_dir() => bail!("data dir {} is not a directory", dd.display()),
        Ok(_) => {}
    }
    if !access_writable(dd) {
        bail!("data dir {} is not writable", dd.display());
    }
    let data_dir = dd.canonicalize().with_context(|| format!("data dir {}", dd.display()))?;
    let mp = &args.mountpoint;
    match std::fs::metadata(mp) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!("mount point {} does not exist", mp.display()),
        Err(e) => bail!("mount point {}: {e}", mp.display()),
        Ok(m) if !m.is_dir() => bail!("mount point {} is not a directory", mp.display()),
        Ok(_) => {}
    }
    let mountpoint = mp.canonicalize().with_context(|| format!("mount point {}", mp.display()))?;
    if let Some(src) = mount_source(&mountpoint) {
        bail!("mount point {} is already mounted (by {src})", mountpoint.display());
    }
    if data_dir.starts_with(&mountpoint) {
        bail!("data dir {} lies inside the mount point {}", data_dir.display(), mountpoint.display());
    }
    let meta_str = match &args.meta {
        Some(m) => m.clone(),
        None => format!("redb://{}", data_dir.join("meta.redb").display()),
    };
    let meta: MetaUri = meta_str.parse()?;
    parse_labels(&args.labels)?;
    if let Some(dir) = &args.tls_dir {
        let tls = converged_transport::NodeTls::load(dir).with_context(|| format!("--tls-dir {}", dir.display()))?;
        if let Some(id) = args.node_id.as_ref().filter(|id| **id != tls.node) {
            bail!("--node-id {id} does not match the certificate in {}, which is for node {}", dir.display(), tls.node);
        }
    }
    if let Some(uri) = &args.object_store {
        crate::objects::Location::parse(uri).map_err(|e| anyhow::anyhow!("--object-store: {e}"))?;
    }
    let pct = |v: f64| v.is_finite() && (1.0..=99.0).contains(&v);
    if !pct(args.evict_high) || !pct(args.evict_low) || args.evict_low >= args.evict_high {
        bail!(
            "--evict-low ({}) and --evict-high ({}) must be percentages between 1 and 99, low below high",
            args.evict_low,
            args.evict_high
        );
    }
    if !(args.attr_timeout.is_finite() && (0.0..=3600.0).contains(&args.attr_timeout)) {
        bail!("--attr-timeout must be between 0 and 3600 seconds, got {}", args.attr_timeout);
    }
    Ok(Checked { mountpoint, data_dir, meta, meta_str })
}

/// `500ms`, `5s`, `2m`, `1h`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration (try 500ms, 5s, 2m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        other => return Err(format!("unknown duration unit {other:?} (use ms, s, m or h)")),
    };
    if !secs.is_finite() || !(0.0..=86_400.0 * 7.0).contains(&secs) {
        return Err(format!("{s:?} is out of range (0 to 7 days)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_labels(s: &str) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=').filter(|(k, v)| !k.is_empty() && !v.is_empty()) else {
            bail!("label {part:?} is not key=value");
        };
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}

fn node_id(args: &MountArgs) -> String {
    let from_cert = args.tls_dir.as_ref().and_then(|d| std::fs::read_to_string(d.join("node.name")).ok());
    args.node_id.clone().or(from_cert.map(|s| s.trim().to_string())).unwrap_or_else(hostname)
}

fn node_info(
    args: &MountArgs,
    data_dir: &Path,
    addr: String,
) -> anyhow::Result<converged_metadata::membership::NodeInfo> {
    let (capacity, free) = disk_space(data_dir);
    let now = converged_metadata::types::Timespec::now();
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

fn disk_space(p: &Path) -> (u64, u64) {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else { return (0, 0) };
    // SAFETY: statvfs into a zeroed struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return (0, 0);
    }
    (st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)
}

/// Register in the volume's membership (etcd) and heartbeat until the
/// engine goes away. Embedded engines have no membership: a single node.
fn join_cluster(
    engine: &Arc<dyn converged_metadata::KvEngine>,
    args: &MountArgs,
    data_dir: &Path,
    addr: String,
) -> anyhow::Result<()> {
    let Some(m) = engine.membership() else { return Ok(()) };
    let ttl = Duration::from_secs(args.lease_ttl);
    let mut info = node_info(args, data_dir, addr)?;
    m.register(&info, ttl).context("register in the cluster")?;
    tracing::info!(node = %info.id, ttl = args.lease_ttl, "registered in the cluster");
    let weak = Arc::downgrade(engine);
    let data_dir = data_dir.to_path_buf();
    std::thread::Builder::new().name("heartbeat".into()).spawn(move || loop {
        std::thread::sleep(ttl / 3);
        let Some(engine) = weak.upgrade() else { return };
        let Some(m) = engine.membership() else { return };
        (info.capacity, info.free) = disk_space(&data_dir);
        info.heartbeat = converged_metadata::types::Timespec::now();
        if let Err(e) = m.heartbeat(&info) {
            tracing::warn!(error = %e, "heartbeat failed; retrying");
        }
    })?;
    Ok(())
}

fn status(meta: &str) -> anyhow::Result<()> {
    let uri: MetaUri = meta.parse()?;
    let engine = converged_metadata::open_engine(&uri).with_context(|| format!("open metadata {meta}"))?;
    let Some(m) = engine.membership() else {
        println!("{meta}: embedded metadata ({}), a single node", engine.name());
        return Ok(());
    };
    let members = m.members()?;
    println!("{:<16} {:<6} {:<22} {:>12} {:>12}  labels", "node", "state", "address", "capacity", "free");
    for member in &members {
        let i = &member.info;
        let labels: Vec<String> = i.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<16} {:<6} {:<22} {:>9} GiB {:>9} GiB  {}",
            i.id,
            if member.alive { "live" } else { "dead" },
            if i.addr.is_empty() { "-" } else { &i.addr },
            i.capacity >> 30,
            i.free >> 30,
            labels.join(",")
        );
    }
    let live = members.iter().filter(|m| m.alive).count();
    println!("{live} live, {} dead", members.len() - live);

    if members.is_empty() {
        return Ok(());
    }
    // Chunk health: copies on live nodes against each file's policy.
    let alive: std::collections::HashSet<&str> =
        members.iter().filter(|m| m.alive).map(|m| m.info.id.as_str()).collect();
    let ns = Namespace::open(engine.clone(), 0, 0)?;
    let mut policy: std::collections::HashMap<u64, usize> = Default::default();
    let (mut total, mut under, mut lost, mut bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut policy_err = None;
    ns.for_each_chunk(|ino, _, rec| {
        let want = *policy.entry(ino).or_insert_with(|| match ns.replicas_policy(ino) {
            Ok(p) => p.unwrap_or(DEFAULT_CLUSTER_REPLICAS) as usize,
            Err(e) => {
                policy_err = Some(e);
                DEFAULT_CLUSTER_REPLICAS as usize
            }
        });
        let copies = rec.replicas.iter().filter(|r| alive.contains(r.as_str())).count();
        total += 1;
        bytes += rec.len as u64;
        if copies == 0 {
            lost += 1;
        } else if copies < want {
            under += 1;
        }
    })?;
    if let Some(e) = policy_err {
        return Err(e.into());
    }
    println!(
        "{total} chunks ({} GiB): {under} under-replicated, {lost} with no live copy (policy: user.converged.replicas, default {DEFAULT_CLUSTER_REPLICAS})",
        bytes >> 30
    );
    Ok(())
}

fn access_writable(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: access(2) with a valid C string.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// Undo mountinfo's octal escapes (`\040` for a space).
pub(crate) fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The source of the mount at exactly `path`, if one is there.
pub fn mount_source(path: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut found = None;
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else { continue };
        if fields.len() < sep + 3 || fields.len() < 5 {
            continue;
        }
        if Path::new(&unescape_mountinfo(fields[4])) == path {
            // The last matching line is the mount on top.
            found = Some(format!("{} {}", fields[sep + 1], unescape_mountinfo(fields[sep + 2])));
        }
    }
    found
}

fn lock_path(data_dir: &Path) -> PathBuf {
    data_dir.join("converged.lock")
}

/// Hold an exclusive lock on the data dir for the daemon's life, so two
/// daemons never share one. Waits a while for a daemon that is exiting.
fn lock_data_dir(data_dir: &Path, wait: Duration) -> anyhow::Result<File> {
    let path = lock_path(data_dir);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
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

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "local".into())
}

fn init_tracing(log_file: Option<&Path>) -> anyhow::Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("CONVERGED_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match log_file {
        Some(path) => {
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("open log file {}", path.display()))?;
            builder.with_ansi(false).with_writer(std::sync::Mutex::new(file)).init();
        }
        None => builder.with_writer(std::io::stderr).init(),
    }
    Ok(())
}

/// Run the daemon in this process until the filesystem is unmounted.
fn run_daemon(args: &MountArgs, c: Checked) -> anyhow::Result<()> {
    let log_file = if args.daemonized {
        Some(args.log_file.clone().unwrap_or_else(|| c.data_dir.join("converged.log")))
    } else {
        None
    };
    init_tracing(log_file.as_deref())?;
    let _lock = lock_data_dir(&c.data_dir, Duration::from_secs(10))?;
    let engine = converged_metadata::open_engine(&c.meta).with_context(|| format!("open metadata {}", c.meta_str))?;
    // Shared metadata: a node-local cache of inodes and names, kept honest
    // by the engine's change feed.
    let engine = if engine.membership().is_some() {
        converged_metadata::CachedKv::wrap(engine).context("watch the metadata for other nodes' changes")?
    } else {
        engine
    };
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let tier = match &args.object_store {
        Some(uri) => {
            let opts = crate::objects::StoreOptions { s3_endpoint: args.s3_endpoint.clone() };
            let objects =
                crate::objects::ObjectTier::open(uri, opts).with_context(|| format!("--object-store {uri}"))?;
            // Mount even while the store is down: the backlog waits for it.
            if let Err(e) = objects.probe(objects.home()) {
                tracing::warn!(error = %e, "object store not reachable yet; backfill will retry");
            }
            Some(Arc::new(crate::backfill::Tiering::new(
                objects,
                crate::backfill::TierConfig {
                    backfill_delay: args.backfill_delay,
                    keep_deleted: args.keep_deleted_objects,
                    evict_high: args.evict_high / 100.0,
                    evict_low: args.evict_low / 100.0,
                    workers: args.backfill_workers as usize,
                },
            )))
        }
        None => None,
    };
    let mut ns = Namespace::open(engine.clone(), uid, gid).context("open namespace")?.with_node(&node_id(args));
    if tier.is_some() {
        ns = ns.with_tier();
    }
    let core = Arc::new(Core::start(
        ns,
        CoreConfig {
            data_dir: c.data_dir.clone(),
            node_id: node_id(args),
            verify_reads: args.verify_reads,
            meta_file: match &c.meta {
                MetaUri::Redb(path) => Some(path.clone()),
                MetaUri::Memory | MetaUri::Etcd { .. } => None,
            },
        },
    )?);
    // The peer data plane: this node's chunks, served over QUIC with mutual
    // TLS, and the replicas and remote reads of its own files.
    let mut addr = String::new();
    if let (Some(listen), Some(dir)) = (&args.listen, &args.tls_dir) {
        let tls = converged_transport::NodeTls::load(dir)?;
        let node = tls.node.clone();
        let cluster = crate::cluster::Cluster::start(
            crate::cluster::ClusterConfig {
                node: node_id(args),
                listen: *listen,
                tls,
                default_replicas: args.replicas.unwrap_or(DEFAULT_CLUSTER_REPLICAS),
                durability: args.durability,
                failure_domain: args.failure_domain.clone(),
                peer_timeout: Duration::from_secs_f64(args.peer_timeout.max(0.1)),
            },
            engine.clone(),
            core.chunk_store(),
        )
        .with_context(|| format!("listen on {listen}"))?;
        addr = cluster.local_addr().to_string();
        tracing::info!(%addr, %node, replicas = cluster.default_replicas(), durability = ?args.durability, "serving chunks to peers");
        core.attach_cluster(cluster);
    }
    join_cluster(&engine, args, &c.data_dir, addr)?;
    if let Some(t) = &tier {
        core.attach_tier(t.clone());
        core.resume_backfill()?;
        for i in 0..t.cfg.workers {
            let weak = Arc::downgrade(&core);
            std::thread::Builder::new().name(format!("backfill-{i}")).spawn(move || Core::run_backfill(weak))?;
        }
        let weak = Arc::downgrade(&core);
        std::thread::Builder::new().name("evictor".into()).spawn(move || Core::run_evictor(weak))?;
        tracing::info!(store = %t.objects.home().url(), delay = ?t.cfg.backfill_delay, "backfilling to the object store");
    }
    if let Some(addr) = args.metrics {
        let bound = crate::metrics::serve(addr, Arc::downgrade(&core)).with_context(|| format!("--metrics {addr}"))?;
        tracing::info!(%bound, "serving Prometheus metrics at /metrics");
    }

    // Buffered namespace commits become durable within a second (as a local
    // filesystem's journal commit); fsync makes them durable at once.
    let weak = Arc::downgrade(&core);
    std::thread::Builder::new()
        .name("flusher".into())
        .spawn(move || Core::run_flusher(weak, Duration::from_secs(1)))?;
    let weak = Arc::downgrade(&core);
    std::thread::Builder::new().name("spares".into()).spawn(move || Core::run_spares(weak))?;
    let weak = Arc::downgrade(&core);
    std::thread::Builder::new().name("replicator".into()).spawn(move || Core::run_replicator(weak))?;
    let adapter = FuseAdapter::new(core, Duration::from_secs_f64(args.attr_timeout), !args.verify_reads);
    let mut config = fuser::Config::default();
    let source = args.source.clone().unwrap_or_else(|| format!("converged:{}", c.data_dir.display()));
    config.mount_options = vec![
        fuser::MountOption::FSName(source),
        // Passed to the kernel so mounts show as type fuse.converged.
        fuser::MountOption::CUSTOM("subtype=converged".into()),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::RW,
        fuser::MountOption::Dev,
        fuser::MountOption::Suid,
    ];
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(args.threads as usize);
    config.clone_fd = true;
    let mut session = fuser::Session::new(adapter, &c.mountpoint, &config)
        .with_context(|| format!("mount {}", c.mountpoint.display()))?;
    // Changes other nodes make evict what this kernel caches of them.
    engine.watch(crate::fuse::kernel_invalidator(&session)?)?;
    tracing::info!(mountpoint = %c.mountpoint.display(), data_dir = %c.data_dir.display(), meta = %c.meta_str, "mounted");

    let mut unmounter = session.unmount_callable();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP])?;
    let mp = c.mountpoint.clone();
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        if let Some(sig) = signals.forever().next() {
            tracing::info!(signal = sig, mountpoint = %mp.display(), "unmounting on signal");
            if let Err(e) = unmounter.unmount() {
                tracing::error!(error = %e, "unmount on signal failed");
            }
        }
    })?;

    if args.daemonized {
        println!("{READY}");
        std::io::stdout().flush()?;
        detach_stdio();
    }
    session.run().context("FUSE session")?;
    if let Some(m) = engine.membership() {
        if let Err(e) = m.leave() {
            tracing::warn!(error = %e, "could not leave the cluster cleanly; the lease will expire");
        }
    }
    if let Some(t) = &tier {
        t.stop();
    }
    tracing::info!(mountpoint = %c.mountpoint.display(), "unmounted");
    Ok(())
}

/// Point stdin/stdout/stderr at /dev/null so the parent sees end-of-file.
fn detach_stdio() {
    if let Ok(null) = OpenOptions::new().read(true).write(true).open("/dev/null") {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}

/// Start the daemon in the background with the very arguments this
/// command was given (it checks them again, from the same working
/// directory, and mounts), and return once the mount answers.
fn spawn_daemon(argv: &[OsString], exe_prefix: &[OsString]) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("find own executable")?;
    let (mut reader, writer) = std::io::pipe().context("pipe")?;
    let mut cmd = Command::new(exe);
    cmd.args(exe_prefix).args(argv).arg("--daemonized");
    cmd.stdin(Stdio::null()).stdout(writer.try_clone()?).stderr(writer);
    // SAFETY: setsid is async-signal-safe; the daemon leaves our session so a
    // closing terminal does not take it down.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("start daemon")?;
    drop(cmd);
    let mut out = String::new();
    reader.read_to_string(&mut out).context("read daemon output")?;
    if out.lines().any(|l| l == READY) {
        for l in out.lines().filter(|l| *l != READY) {
            eprintln!("{l}");
        }
        return Ok(());
    }
    let status = child.wait()?;
    let msg = out.trim();
    bail!("daemon exited ({status}) before the mount was ready{}{msg}", if msg.is_empty() { "" } else { ": " })
}

fn umount(mountpoint: &Path) -> anyhow::Result<()> {
    let mp = mountpoint.canonicalize().with_context(|| format!("mount point {}", mountpoint.display()))?;
    let Some(src) = mount_source(&mp) else {
        bail!("{} is not mounted", mp.display());
    };
    let data_dir = src.split_once(' ').map(|(_, s)| s).and_then(|s| s.strip_prefix("converged:")).map(PathBuf::from);
    let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())?;
    // SAFETY: umount2 with a valid path.
    if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EBUSY) {
            bail!("{} is busy (files are open or a process has its cwd there)", mp.display());
        }
        bail!("umount {}: {e}", mp.display());
    }
    // Wait for the daemon to finish its final metadata sync and release the data dir.
    if let Some(dd) = data_dir {
        if dd.exists() {
            let _ = lock_data_dir(&dd, Duration::from_secs(30))?;
        }
    }
    Ok(())
}

/// Entry point of the `converged` binary; `exe_prefix` is what the daemon
/// must be started with before `mount` (the mount helper passes its own).
pub fn main_with(args: impl IntoIterator<Item = OsString>, exe_prefix: &[OsString]) -> ExitCode {
    let argv: Vec<OsString> = args.into_iter().collect();
    let cli = Cli::parse_from(&argv);
    let result = match cli.command {
        Cmd::Mount(args) => match check(&args) {
            Err(e) => Err(e),
            Ok(c) if args.foreground || args.daemonized => run_daemon(&args, c),
            Ok(_) => spawn_daemon(argv.get(1..).unwrap_or_default(), exe_prefix),
        },
        Cmd::Umount { mountpoint } => umount(&mountpoint),
        Cmd::Cluster(cmd) => cluster(cmd),
        Cmd::Status { path: Some(p), meta: None } => crate::admin::status_path(&p),
        Cmd::Status { path: None, meta: Some(m) } => status(&m),
        Cmd::Status { .. } => Err(anyhow::anyhow!("give either a PATH on a mount or --meta URI, not both")),
        Cmd::Import(a) => crate::admin::import(a),
        Cmd::Stage(a) => crate::admin::stage(a),
        Cmd::DevCluster(args) => crate::devcluster::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("converged: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
