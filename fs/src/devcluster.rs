//! `converged dev-cluster`: a whole cluster on one machine, for demos and
//! tests. It starts a one-member etcd on loopback, makes a cluster CA and a
//! certificate per node, and mounts N nodes (one data dir and one mount
//! point each, each in its own failure domain) that serve each other over
//! QUIC on 127.0.0.1. It stays in the foreground; Ctrl-C (or SIGTERM)
//! unmounts every node and stops etcd. The directory keeps its state, so a
//! second run over it brings the same volume back.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Printed once every node is mounted.
pub const READY: &str = "dev-cluster ready";

#[derive(clap::Args, Debug)]
pub struct DevClusterArgs {
    /// How many nodes to mount.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub nodes: u16,
    /// Directory for etcd's data, the certificates and each node's data dir and mount point
    /// (DIR/nN/data, DIR/nN/mnt). Created if missing; reused if it holds an earlier run.
    #[arg(long, value_name = "DIR", default_value = "/tmp/converged-dev")]
    pub dir: PathBuf,
    /// The etcd server binary (Debian: apt-get install etcd-server).
    #[arg(long, value_name = "PATH", default_value = "/usr/bin/etcd")]
    pub etcd: PathBuf,
    /// Extra options for every node's mount (for example --durability=local), one per flag.
    #[arg(long = "mount-opt", value_name = "OPTION", allow_hyphen_values = true)]
    pub mount_opts: Vec<String>,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

struct Etcd(Child);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start etcd on two free loopback ports, and wait until it answers. A
/// port taken between our finding it free and etcd's binding it (another
/// program on a busy host) makes etcd exit at once: it is started again on
/// other ports, up to three times.
fn start_etcd(args: &DevClusterArgs) -> anyhow::Result<(Etcd, String)> {
    if !args.etcd.exists() {
        bail!("{} not found: install etcd (apt-get install etcd-server) or pass --etcd PATH", args.etcd.display());
    }
    let log_path = args.dir.join("etcd.log");
    let mut said = String::new();
    for _ in 0..3 {
        let (client, peer) = (free_port()?, free_port()?);
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(&args.etcd)
            .args(["--name", "dev", "--data-dir"])
            .arg(args.dir.join("etcd"))
            // Every create and seal is a revision: without compaction etcd keeps
            // them all, grows to its space quota and then refuses writes. An
            // hour of history is about 1 KB a file made: 8 GiB (the most etcd
            // advises, not allocated ahead) lets one host's untar loops run
            // for hours where the 2 GiB default stops them.
            .args(["--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h"])
            .arg("--quota-backend-bytes")
            .arg((8u64 << 30).to_string())
            .arg("--listen-client-urls")
            .arg(format!("http://127.0.0.1:{client}"))
            .arg("--advertise-client-urls")
            .arg(format!("http://127.0.0.1:{client}"))
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-cluster")
            .arg(format!("dev=http://127.0.0.1:{peer}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", args.etcd.display()))?;
        let mut etcd = Etcd(child);
        let endpoint = format!("127.0.0.1:{client}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = etcd.0.try_wait()? {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                said = format!("{status}: {}", log.lines().rev().take(3).collect::<Vec<_>>().join(" | "));
                tracing::warn!(%said, "etcd exited at start; starting it again on other ports");
                break;
            }
            match converged_metadata::EtcdKv::connect(std::slice::from_ref(&endpoint), "dev", Duration::from_secs(2)) {
                Ok(_) => return Ok((etcd, endpoint)),
                Err(e) if Instant::now() > deadline => {
                    bail!("etcd did not answer within 30 s: {e} (its log: {})", log_path.display())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
    bail!("etcd exited at start three times; the last time, {said}")
}

fn certificates(dir: &Path, nodes: u16) -> anyhow::Result<()> {
    let ca_dir = dir.join("ca");
    let ca = if ca_dir.join("ca.key").exists() {
        converged_transport::ClusterCa::load(&ca_dir)?
    } else {
        let ca = converged_transport::ClusterCa::generate("converged dev-cluster")?;
        ca.save(&ca_dir)?;
        ca
    };
    for i in 1..=nodes {
        let node = format!("n{i}");
        if !ca_dir.join(&node).join("node.key").exists() {
            ca.issue(&node)?.save(&ca_dir.join(&node))?;
        }
    }
    Ok(())
}

/// Unmount each node, last first, waiting for its daemon's final sync. In
/// this process, not by running the binary again: a binary rebuilt while
/// the cluster ran is no longer at the path it was started from.
fn unmount_all(mounted: &[PathBuf]) {
    for mnt in mounted.iter().rev() {
        match crate::cli::umount(mnt) {
            Ok(()) => println!("unmounted {}", mnt.display()),
            Err(e) => eprintln!("umount {}: {e:#}", mnt.display()),
        }
    }
}

pub fn run(args: DevClusterArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir).with_context(|| format!("create {}", args.dir.display()))?;
    let dir = args.dir.canonicalize()?;
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP])?;
    let (etcd, endpoint) = start_etcd(&args)?;
    certificates(&dir, args.nodes)?;
    let meta = format!("etcd://{endpoint}/dev");
    let exe = std::env::current_exe().context("find own executable")?;
    let mut mounted = Vec::new();
    for i in 1..=args.nodes {
        let node = format!("n{i}");
        let (data, mnt) = (dir.join(&node).join("data"), dir.join(&node).join("mnt"));
        std::fs::create_dir_all(&data)?;
        std::fs::create_dir_all(&mnt)?;
        let out = Command::new(&exe)
            .arg("mount")
            .arg(&mnt)
            .arg("--data-dir")
            .arg(&data)
            .args(["--meta", &meta, "--listen", "127.0.0.1:0", "--node-id", &node])
            .arg("--tls-dir")
            .arg(dir.join("ca").join(&node))
            .arg("--labels")
            .arg(format!("rack=r{i}"))
            .args(&args.mount_opts)
            .output()?;
        if !out.status.success() {
            unmount_all(&mounted);
            drop(etcd);
            bail!("mount of {node} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        println!("{node}: {} (data {}, log {})", mnt.display(), data.display(), data.join("converged.log").display());
        mounted.push(mnt);
    }
    println!("metadata: {meta}   status: converged status --meta {meta}");
    println!("{READY}: {} nodes; Ctrl-C unmounts them and stops etcd", args.nodes);
    std::io::stdout().flush()?;
    let _ = signals.forever().next();
    unmount_all(&mounted);
    drop(etcd);
    println!("dev-cluster stopped; state kept in {}", dir.display());
    Ok(())
}
