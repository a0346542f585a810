//! The `converged` command line: `mount` (which starts the daemon and returns
//! once the mount answers), `umount`, and the daemon itself.

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

use crate::config::check;
pub use crate::config::{mount_source, parse_duration, MountArgs};
use crate::daemon::READY;

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
    /// Start a new daemon binary on a live mount: the running daemon finishes the requests it
    /// is answering, syncs and hands the kernel connection over; the new one takes it over
    /// with every open file. No request fails. Needs the supervisor (not --no-supervisor).
    Upgrade {
        /// The mount point of a converged mount.
        mountpoint: PathBuf,
        /// The converged binary to run (default: this one).
        #[arg(long, value_name = "PATH")]
        binary: Option<PathBuf>,
        /// How long to wait for the new daemon to serve.
        #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = crate::config::parse_duration)]
        wait: Duration,
    },
    /// Change a converged mount's flags in place (what `mount -o remount,ro` does): read-only
    /// or read-write, and nosuid, nodev, noexec and the atime policy. Files stay open; a
    /// switch to read-only is refused (EBUSY) while a file is open for writing.
    Remount(crate::remount::RemountArgs),
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
    /// Node administration of a cluster volume: drain a node before maintenance, let it take
    /// copies again, forget one that will not come back.
    #[command(subcommand)]
    Node(crate::volume::NodeCmd),
    /// Move chunk copies toward placement's balanced holders after nodes joined or capacity
    /// changed (weights: disk capacity), with a progress bar; never drops a copy before its
    /// replacement is recorded. Resumable: run it again after an interruption.
    Rebalance(crate::volume::RebalanceArgs),
    /// Check a volume's metadata: names, link counts, reachability, chunk records against the
    /// files and the nodes; names the paths; exits non-zero when something is wrong.
    Fsck(crate::volume::FsckArgs),
    /// Remove what nothing refers to: every live node removes its chunk copies that no record
    /// names, and, with --object-store, objects under the store's prefix that no file owns.
    Gc(crate::volume::GcArgs),
    /// Check this node's copies of files against their block checksums and repair bad blocks
    /// from a replica or the object store (--now), or show the background scrub's state.
    Scrub(crate::admin::ScrubArgs),
    /// A live view of a mount's daemon, like top: operations per second, latency percentiles
    /// (FUSE, metadata transactions, peer requests, object-store calls) and throughput, over
    /// each interval.
    Stats(crate::admin::StatsArgs),
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

/// Start the daemon in the background with the very arguments this
/// command was given (it checks them again, from the same working
/// directory, and mounts), and return once the mount answers.
fn spawn_daemon(argv: &[OsString], exe_prefix: &[OsString]) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("find own executable")?;
    let (mut reader, writer) = std::io::pipe().context("pipe")?;
    let mut cmd = Command::new(exe);
    cmd.args(exe_prefix).args(argv).arg("--daemonized");
    // The daemon stays in our process group until its mount exists, and
    // only then leaves our session (see `daemon::run`): under an automount
    // (x-systemd.automount) the kernel lets only the automounter's process
    // group through the mount point while the mount is pending.
    cmd.stdin(Stdio::null()).stdout(writer.try_clone()?).stderr(writer);
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

/// The data dir of the converged mount at `mountpoint` (from its source).
pub(crate) fn data_dir_of(mountpoint: &Path) -> anyhow::Result<PathBuf> {
    let mp = mountpoint.canonicalize().with_context(|| format!("mount point {}", mountpoint.display()))?;
    let Some(src) = mount_source(&mp) else {
        bail!("{} is not mounted", mp.display());
    };
    source_data_dir(&src)
        .with_context(|| format!("{} is not a converged mount with its data dir in its source", mp.display()))
}

/// The data dir named in a mount's source as [`mount_source`] gives it
/// (`fstype converged:DATA_DIR`).
fn source_data_dir(src: &str) -> Option<PathBuf> {
    src.split_once(' ').map(|(_, s)| s).and_then(|s| s.strip_prefix("converged:")).map(PathBuf::from)
}

/// Whether the mount at `mountpoint` answers (statfs; waits while no daemon serves it).
pub(crate) fn serves(mountpoint: &Path) -> bool {
    crate::blocks::statvfs(mountpoint).is_ok()
}

pub(crate) fn umount(mountpoint: &Path) -> anyhow::Result<()> {
    let mp = mountpoint.canonicalize().with_context(|| format!("mount point {}", mountpoint.display()))?;
    let Some(src) = mount_source(&mp) else {
        bail!("{} is not mounted", mp.display());
    };
    let data_dir = source_data_dir(&src);
    if let Err(e) = crate::blocks::unmount(&mp, false) {
        if e.raw_os_error() == Some(libc::EBUSY) {
            bail!("{} is busy (files are open or a process has its cwd there)", mp.display());
        }
        bail!("umount {}: {e}", mp.display());
    }
    // Wait for the daemon to finish its final metadata sync and release the data dir.
    if let Some(dd) = data_dir {
        if dd.exists() {
            let _ = crate::daemon::lock_data_dir(&dd, Duration::from_secs(30))?;
        }
    }
    Ok(())
}

/// Entry point of the `converged` binary; `exe_prefix` is what the daemon
/// must be started with before `mount` (the mount helper passes its own).
pub fn main_with(args: impl IntoIterator<Item = OsString>, exe_prefix: &[OsString]) -> ExitCode {
    let argv: Vec<OsString> = args.into_iter().collect();
    let cli = Cli::parse_from(&argv);
    // A command whose output goes to a pipe that closed (`| head`, `| grep -q`)
    // ends quietly, as Unix tools do, instead of failing on the write. The
    // daemon and dev-cluster keep Rust's default (a write fails with EPIPE):
    // they clean up before they exit.
    let serving = match &cli.command {
        Cmd::Mount(args) => args.foreground || args.daemonized,
        Cmd::DevCluster(_) => true,
        _ => false,
    };
    if !serving {
        // SAFETY: restores the default disposition of one signal, before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Cmd::Mount(args) => match check(&args) {
            Err(e) => Err(e),
            Ok(c) if (args.foreground || args.daemonized) && !args.no_supervisor && args.fuse_fd.is_none() => {
                crate::supervise::run(&args, &c.data_dir, argv.get(1..).unwrap_or_default(), exe_prefix)
            }
            Ok(c) if args.foreground || args.daemonized => crate::daemon::run(&args, c),
            Ok(_) => spawn_daemon(argv.get(1..).unwrap_or_default(), exe_prefix),
        },
        Cmd::Umount { mountpoint } => umount(&mountpoint),
        Cmd::Upgrade { mountpoint, binary, wait } => crate::supervise::upgrade(&mountpoint, binary.as_deref(), wait),
        Cmd::Remount(a) => crate::remount::remount(&a),
        Cmd::Cluster(cmd) => cluster(cmd),
        Cmd::Status { path: Some(p), meta: None } => crate::admin::status_path(&p),
        Cmd::Status { path: None, meta: Some(m) } => crate::volume::status(&m),
        Cmd::Node(cmd) => crate::volume::run(cmd),
        Cmd::Rebalance(a) => crate::volume::rebalance(a),
        Cmd::Fsck(a) => crate::volume::fsck(a),
        Cmd::Gc(a) => crate::volume::gc(a),
        Cmd::Status { .. } => Err(anyhow::anyhow!("give either a PATH on a mount or --meta URI, not both")),
        Cmd::Import(a) => crate::admin::import(a),
        Cmd::Stage(a) => crate::admin::stage(a),
        Cmd::Scrub(a) => crate::admin::scrub(a),
        Cmd::Stats(a) => crate::admin::stats(a),
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
