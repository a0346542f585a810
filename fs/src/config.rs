//! Mount options: what `converged mount` (and `mount.converged`) accept,
//! and the checks made before anything is created or started.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use converged_metadata::MetaUri;

/// Copies of each chunk in a cluster when neither the mount nor a directory says otherwise.
pub const DEFAULT_CLUSTER_REPLICAS: u32 = 2;

/// FUSE threads of a mount on the embedded store: its requests spend CPU, not waits.
pub const FUSE_THREADS: u16 = 8;

/// FUSE threads of a mount on etcd: its namespace requests wait for commits, and as many
/// as wait at once share one (16 processes creating in 16 directories on two nodes:
/// 1,289–1,498 creates/s on 8 threads, 1,762–2,034 on 16, 1,624–1,800 on 32 or 64).
pub const CLUSTER_FUSE_THREADS: u16 = 16;

/// How reads update atime. The daemon updates it when a file is opened for reading (or a
/// directory for listing): passthrough reads never reach it.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtimePolicy {
    /// Never update atime.
    Noatime,
    /// Update atime when it is older than mtime or ctime, or a day old.
    Relatime,
    /// Update atime on every read.
    Strictatime,
}

impl AtimePolicy {
    pub fn rule(self) -> converged_metadata::AtimeRule {
        match self {
            AtimePolicy::Noatime => converged_metadata::AtimeRule::Never,
            AtimePolicy::Relatime => converged_metadata::AtimeRule::Relative,
            AtimePolicy::Strictatime => converged_metadata::AtimeRule::Always,
        }
    }
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

    /// Stay in the foreground and log to stderr instead of starting a background daemon
    /// (under systemd, `Type=notify`: readiness is reported on $NOTIFY_SOCKET).
    #[arg(long)]
    pub foreground: bool,

    /// How long to keep trying the metadata service (etcd not reachable yet at boot) before
    /// giving up, with backoff; each wait is logged with its reason (`0`: fail at once, `2m`).
    #[arg(long, default_value = "0s", value_name = "DURATION", value_parser = parse_duration)]
    pub meta_wait: Duration,

    /// Mount read-only: writes fail with EROFS, no write lease is taken, nothing runs in the
    /// background that writes (no recovery, flushing, repair, sweep, scrub, backfill or
    /// eviction), and a cluster node does not register (it serves no copies to peers).
    #[arg(long)]
    pub read_only: bool,

    /// Honour set-user-ID and set-group-ID bits of files on the mount (off: `nosuid`). Anyone
    /// who can write the metadata service can then make a root-owned setuid file.
    #[arg(long)]
    pub suid: bool,

    /// Honour device files on the mount (off: `nodev`).
    #[arg(long)]
    pub dev: bool,

    /// Do not allow programs on the mount to be executed (`noexec`).
    #[arg(long)]
    pub noexec: bool,

    /// When reads update atime: `relatime` (when atime is not after mtime or ctime, or is a
    /// day old), `noatime` or `strictatime` (every open for reading).
    #[arg(long, value_enum, default_value_t = AtimePolicy::Relatime, value_name = "POLICY")]
    pub atime: AtimePolicy,

    /// Never update the atime of directories (`nodiratime`).
    #[arg(long)]
    pub nodiratime: bool,

    /// This data dir is new: give it its identity even when the volume already knows this node
    /// id (a replaced disk: the records of the node's old copies are dropped and repair copies
    /// them back) or the volume already exists. Without it an empty data dir is refused for a
    /// node the volume knows, since it would claim chunks it does not have.
    #[arg(long)]
    pub new_node: bool,

    /// Refuse a data dir that has no identity yet instead of creating one (what
    /// `mount.converged` does unless given `new_node`: at boot, a data dir whose disk is not
    /// mounted is an empty directory, and must not become a new volume).
    #[arg(long)]
    pub require_identity: bool,

    /// Serve every read through the daemon so every block is checked against its crc32c.
    /// Turns kernel passthrough off (reads become slower).
    #[arg(long)]
    pub verify_reads: bool,

    /// Number of threads serving FUSE requests [default: 8 on the embedded store, 16 on etcd].
    ///
    /// On etcd a thread waits out its request's commit off the CPU, and the requests waiting
    /// at once share one transaction: with fewer threads than processes creating or removing
    /// files, the rest wait in the kernel and their commits go out in the next transaction.
    /// On the embedded store the threads spend CPU instead, and more of them than cores only
    /// contend.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: Option<u16>,

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

    /// Acknowledge namespace changes in the directories this node makes before they reach
    /// etcd (as CephFS's `nowsync`): such a directory is delegated to this node, creates,
    /// attribute changes and the metadata of first publishes there are committed a few
    /// milliseconds later, many per etcd transaction. fsync of the file or the directory, and
    /// any other node's lookup or listing there, commit them first. After a crash or kill -9,
    /// a file made and not fsynced is gone or whole, never a name without its bytes. Needs an
    /// etcd volume; a read-only mount ignores it.
    #[arg(long)]
    pub nowsync: bool,

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

    /// For tests: shift the wall-clock time this node writes into its membership records
    /// (registration, heartbeats) by this many seconds, as a node with a wrong clock would.
    #[arg(long, default_value_t = 0, hide = true, allow_hyphen_values = true, value_name = "SECONDS")]
    pub clock_offset: i64,

    /// Seconds without a heartbeat after which the cluster considers this node dead. A
    /// heartbeat (one lease keepalive) goes every third of it: 15 s costs etcd 0.2 requests
    /// a second a node.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=600), value_name = "SECONDS")]
    pub lease_ttl: u64,

    /// How long a file operation keeps asking etcd while etcd does not answer, before it
    /// fails with EIO (`30s`, `1h`; `0`: one try). Each try waits out the 5 s deadline; reads
    /// and commits alike. A process waiting cannot be interrupted, only killed (as on a
    /// `hard` NFS mount); past the membership lease (`--lease-ttl`) open writers are fenced
    /// anyway. An unmount asks once.
    #[arg(long, default_value = "5m", value_name = "DURATION", value_parser = parse_duration)]
    pub meta_op_wait: Duration,

    /// How long a dead node's copies are waited for before its chunks are copied elsewhere
    /// (`30s`, `5m`): a node that comes back within it is not rebuilt around.
    #[arg(long, default_value = "5m", value_name = "DURATION", value_parser = parse_duration)]
    pub repair_delay: Duration,

    /// Bytes per second this node copies for repair and drains (`500M`, `1G`; 0: unpaced).
    #[arg(long, default_value = "500M", value_name = "BYTES", value_parser = parse_bytes)]
    pub repair_bandwidth: u64,

    /// How long a copy that no chunk record names any more (moved by repair or a drain, or
    /// of a file deleted while this node was down) is kept before this node removes it.
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = parse_duration)]
    pub sweep_grace: Duration,

    /// Every chunk copy on this node is read back against its checksums once per this
    /// period (`168h`, `12h`), bad blocks rewritten from a good copy; reads are paced to
    /// spread the pass over the period (at least 1 MiB/s).
    #[arg(long, default_value = "168h", value_name = "DURATION", value_parser = parse_duration)]
    pub scrub_period: Duration,

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

    /// The largest object a rename re-keys by a copy inside the store (`5G`, `512M`); a larger
    /// one is uploaded again from the file's chunks, in parts. S3's CopyObject stops at 5 GiB.
    #[arg(long, default_value = "5G", value_name = "BYTES", value_parser = parse_bytes)]
    pub object_copy_limit: u64,

    /// Keep a file's object when the file is deleted (by default the object goes too).
    #[arg(long)]
    pub keep_deleted_objects: bool,

    /// Percent of the data disk in use above which backed chunks are evicted.
    #[arg(long, default_value_t = 90.0, value_name = "PERCENT")]
    pub evict_high: f64,

    /// Percent of the data disk in use that eviction brings usage down to.
    #[arg(long, default_value_t = 80.0, value_name = "PERCENT")]
    pub evict_low: f64,

    /// Serve Prometheus metrics at http://ADDR/metrics (and the `converged stats` feed). The
    /// endpoint has no authentication: bind it to loopback or a management network.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,

    /// Source name shown by mount(8) and df.
    #[arg(long, hide = true)]
    pub source: Option<String>,

    /// Internal: run as the background daemon, reporting readiness on stdout.
    #[arg(long, hide = true)]
    pub daemonized: bool,

    /// Serve the mount from one process, with no supervisor: a crash of the daemon then ends
    /// the mount (every process using it gets ENOTCONN) until it is mounted again. By default
    /// a small supervisor keeps the kernel connection open and starts a new daemon on it when
    /// the daemon dies; open files keep working (README: "When the daemon dies").
    #[arg(long)]
    pub no_supervisor: bool,

    /// Serve FUSE requests through io_uring where the kernel offers it (Linux 6.14 with the
    /// fuse module's `enable_uring` set: `echo Y > /sys/module/fuse/parameters/enable_uring`),
    /// instead of threads reading /dev/fuse: a reply and the next request in one system call,
    /// on the CPU the request was made on. On this project's 2-core test host one process's
    /// creates ran at 1.4-1.6x and its unlinks at 1.3-1.5x their rate through /dev/fuse
    /// (bench/metadata.sh, TARGETS="one uring"). The ring entries' buffers live in memory the
    /// supervisor keeps, so a daemon that takes over after a crash answers the requests the
    /// dead one's rings held. On by default; where the kernel does not offer it the mount
    /// serves /dev/fuse (given explicitly, the log says why).
    #[arg(long, overrides_with = "no_fuse_uring")]
    pub fuse_uring: bool,

    /// Serve FUSE requests through /dev/fuse even where the kernel offers io_uring.
    #[arg(long, overrides_with = "fuse_uring")]
    pub no_fuse_uring: bool,

    /// Daemon restarts the supervisor makes within --restart-window before it gives up (a
    /// daemon that dies at start); the mount then reports ENOTCONN, with the reason in the log.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub restart_limit: u32,

    /// The window --restart-limit counts restarts in.
    #[arg(long, default_value = "10s", value_name = "DURATION", value_parser = parse_duration)]
    pub restart_window: Duration,

    /// Internal: the supervisor's /dev/fuse descriptor, for the daemon to serve.
    #[arg(long, hide = true, value_name = "FD")]
    pub fuse_fd: Option<i32>,

    /// Internal: the supervisor's memfd for the FUSE ring entries' buffers.
    #[arg(long, hide = true, value_name = "FD")]
    pub fuse_ring_fd: Option<i32>,

    /// Internal: how many daemons served this connection before this one (0: none; it mounts).
    #[arg(long, hide = true, default_value_t = 0)]
    pub fuse_generation: u64,

    /// Internal: how the last daemon of this connection ended.
    #[arg(long, hide = true)]
    pub last_exit: Option<String>,
}

/// Everything `mount` needs, checked before anything is created or started.
pub struct Checked {
    pub mountpoint: PathBuf,
    pub data_dir: PathBuf,
    pub meta: MetaUri,
    pub meta_str: String,
}

pub fn check(args: &MountArgs) -> anyhow::Result<Checked> {
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
    if args.fuse_generation > 0 {
        // A daemon taking a live connection over: the mount is its own, and
        // any look at it would wait for this very daemon to answer.
        let mountpoint = std::path::absolute(mp).with_context(|| format!("mount point {}", mp.display()))?;
        return finish_check(args, mountpoint, data_dir);
    }
    // A converged mount whose daemon was killed answers ENOTCONN to any look
    // at it: detach it first (what a restarting service unit needs).
    if std::fs::metadata(mp).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN)) {
        let parent = mp.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if let (Ok(dir), Some(name)) = (parent.canonicalize(), mp.file_name()) {
            let at = dir.join(name);
            if mount_source(&at).is_some_and(|src| src.starts_with("fuse.converged ")) {
                detach_dead_mount(&at);
            }
        }
    }
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
    finish_check(args, mountpoint, data_dir)
}

/// The checks of `check` that do not look at the mount point.
fn finish_check(args: &MountArgs, mountpoint: PathBuf, data_dir: PathBuf) -> anyhow::Result<Checked> {
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
    if args.nowsync && !matches!(meta, MetaUri::Etcd { .. }) {
        bail!("--nowsync defers commits to a shared etcd volume; {meta_str} is a single node's (use etcd://...)");
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

/// A byte count: a number with an optional K, M, G or T suffix (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (try 16M, 5G)"))?;
    let shift = match unit.trim_end_matches(['B', 'b', 'i']) {
        "" => 0,
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        "T" | "t" => 40,
        other => return Err(format!("unknown size unit {other:?} (use K, M, G or T)")),
    };
    n.checked_mul(1 << shift).ok_or_else(|| format!("{s:?} is too large"))
}

pub fn parse_labels(s: &str) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=').filter(|(k, v)| !k.is_empty() && !v.is_empty()) else {
            bail!("label {part:?} is not key=value");
        };
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}

pub fn node_id(args: &MountArgs) -> String {
    let from_cert = args.tls_dir.as_ref().and_then(|d| std::fs::read_to_string(d.join("node.name")).ok());
    args.node_id.clone().or(from_cert.map(|s| s.trim().to_string())).unwrap_or_else(hostname)
}

fn access_writable(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: access(2) with a valid C string.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// Undo mountinfo's octal escapes (`\040` for a space).
pub fn unescape_mountinfo(s: &str) -> String {
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

/// Detach the converged mount at `mountpoint`, which answered ENOTCONN: its
/// daemon is gone (killed, crashed), and a restarting service unit must be
/// able to mount there again.
fn detach_dead_mount(mountpoint: &Path) {
    if crate::blocks::unmount(mountpoint, true).is_ok() {
        eprintln!("converged: detached the dead converged mount at {} (its daemon had exited)", mountpoint.display());
    }
}

/// The source of the mount at exactly `path`, if one is there. An autofs
/// mount does not count: it is the trigger an automount (`x-systemd.automount`)
/// puts there, and the real mount goes on top of it.
pub fn mount_source(path: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut found = None;
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else { continue };
        if fields.len() < sep + 3 || fields.len() < 5 {
            continue;
        }
        if Path::new(&unescape_mountinfo(fields[4])) == path && fields[sep + 1] != "autofs" {
            // The last matching line is the mount on top.
            found = Some(format!("{} {}", fields[sep + 1], unescape_mountinfo(fields[sep + 2])));
        }
    }
    found
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "local".into())
}
