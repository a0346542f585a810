//! A cluster of daemons on loopback for the multi-node tests: a real
//! 3-member etcd (Debian's etcd-server), a cluster CA, and nodes n1..nN,
//! each mounted with its own data dir and serving its chunks over QUIC.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::etcd_cluster::EtcdCluster;
use super::*;

/// Nodes n1..nN of one volume on loopback, with a real 3-member etcd.
pub struct Cluster {
    etcd: EtcdCluster,
    _certs: tempfile::TempDir,
    pub nodes: Vec<Mount>,
    pub meta: String,
}

impl Cluster {
    /// `n` nodes named n1..nN; `extra` goes to every mount.
    pub fn start(n: usize, extra: &[&str]) -> Option<Self> {
        let etcd = EtcdCluster::start()?;
        let certs = tempfile::tempdir().unwrap();
        let ca = certs.path().join("ca");
        let out = converged().args(["cluster", "init", "--node", "n1", "--out"]).arg(&ca).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let uri = format!("etcd://{}/vol", etcd.endpoints.join(","));
        let mut c = Cluster { etcd, _certs: certs, nodes: Vec::new(), meta: uri };
        for _ in 1..=n {
            c.add_node(extra);
        }
        Some(c)
    }

    /// Start one more node, n<N+1>, with its own certificate; `extra` goes
    /// to its mount.
    pub fn add_node(&mut self, extra: &[&str]) {
        let meta = self.meta.clone();
        self.add_node_via(&meta, extra);
    }

    /// Kill every etcd member: the cluster's metadata store is gone.
    pub fn kill_etcd(&mut self) {
        self.etcd.kill();
    }

    /// Stop every etcd member: connections stay up, nothing answers.
    pub fn freeze_etcd(&self) {
        self.etcd.freeze();
    }

    /// Let the frozen etcd members answer again.
    pub fn thaw_etcd(&self) {
        self.etcd.thaw();
    }

    /// [`Cluster::add_node`], the node reaching the volume at `meta` (an
    /// etcd:// URI naming a proxy in front of one member, say).
    pub fn add_node_via(&mut self, meta: &str, extra: &[&str]) {
        let i = self.nodes.len() + 1;
        let id = format!("n{i}");
        let ca = self._certs.path().join("ca");
        let tls = ca.join(&id);
        if i > 1 {
            self.issue_cert(&id);
        }
        let mut args =
            vec!["--meta", meta, "--listen", "127.0.0.1:0", "--tls-dir", tls.to_str().unwrap(), "--lease-ttl", "3"];
        // A peer slower than this is passed over; a test may wait longer.
        if !extra.contains(&"--peer-timeout") {
            args.extend(["--peer-timeout", "2"]);
        }
        args.extend_from_slice(extra);
        self.nodes.push(Mount::with_args(&args));
    }

    /// The etcd members' client endpoints (`host:port`).
    pub fn etcd_endpoints(&self) -> &[String] {
        &self.etcd.endpoints
    }

    /// The directory of node `id`'s certificate (its --tls-dir).
    pub fn tls_dir(&self, id: &str) -> PathBuf {
        self._certs.path().join("ca").join(id)
    }

    /// Issue a certificate for node `id` from the cluster CA (into `tls_dir(id)`).
    pub fn issue_cert(&self, id: &str) {
        let ca = self._certs.path().join("ca");
        let out = converged()
            .args(["cluster", "issue-cert", "--node", id, "--ca"])
            .arg(&ca)
            .arg("--out")
            .arg(self.tls_dir(id))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn node(&self, i: usize) -> &Mount {
        &self.nodes[i]
    }

    /// The backing file of `ino` in node `i`'s data dir.
    pub fn backing(&self, i: usize, ino: u64) -> PathBuf {
        self.nodes[i].data.join("chunks").join(format!("{ino:016x}"))
    }

    /// Whether node `i` holds any copy of `ino`: its backing file, or a
    /// chunk version beside it (`<ino>.<index>.<version>`, not installed yet).
    pub fn holds(&self, i: usize, ino: u64) -> bool {
        let prefix = format!("{ino:016x}");
        chunk_files(&self.nodes[i].data).iter().any(|(name, _)| name.starts_with(&prefix))
    }

    /// The files node `i` keeps `ino` in: its backing file and its chunk
    /// versions (`<ino>.<index>.<version>`), with each version's chunk index.
    pub fn stored_files(&self, i: usize, ino: u64) -> (PathBuf, Vec<(u32, PathBuf)>) {
        let prefix = format!("{ino:016x}.");
        let mut versions: Vec<(u32, u64, PathBuf)> = chunk_files(&self.nodes[i].data)
            .into_iter()
            .filter_map(|(name, path)| {
                let rest = name.strip_prefix(&prefix)?;
                let (index, version) = rest.split_once('.')?;
                Some((u32::from_str_radix(index, 16).ok()?, u64::from_str_radix(version, 16).ok()?, path))
            })
            .collect();
        versions.sort();
        (self.backing(i, ino), versions.into_iter().map(|(index, _, p)| (index, p)).collect())
    }

    /// The bytes of `ino` as node `i` stores them (64 MiB chunks): its
    /// backing file, with each chunk held in a version file (the newest)
    /// read from there. What a replica keeps is read where it keeps it.
    pub fn stored(&self, i: usize, ino: u64) -> Vec<u8> {
        const CHUNK: usize = 64 << 20;
        let (backing, versions) = self.stored_files(i, ino);
        let mut out = fs::read(backing).unwrap_or_default();
        for (index, path) in versions {
            let data = fs::read(path).unwrap_or_default();
            let at = index as usize * CHUNK;
            if out.len() < at + data.len() {
                out.resize(at + data.len(), 0);
            }
            out[at..at + data.len()].copy_from_slice(&data);
        }
        out
    }

    /// Wait until node `i` stores `want` as the bytes of `ino`.
    pub fn stored_becomes(&self, i: usize, ino: u64, want: &[u8]) -> bool {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if self.stored(i, ino) == want {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Disk space node `i`'s copy of `ino` takes (backing file and versions).
    pub fn allocated(&self, i: usize, ino: u64) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let (backing, versions) = self.stored_files(i, ino);
        std::iter::once(backing)
            .chain(versions.into_iter().map(|(_, p)| p))
            .map(|p| fs::metadata(p).map_or(0, |m| m.blocks() * 512))
            .sum()
    }
}

pub fn status(c: &Cluster) -> String {
    let out = converged().args(["status", "--meta", &c.meta]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for (i, n) in self.nodes.iter().enumerate() {
                let log = n.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                eprintln!("---- log of n{} (last lines) ----", i + 1);
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        // The nodes unmount first, all at once, while etcd still answers:
        // an unmount commits what the node acknowledged and gives up its
        // leases, and one whose etcd is gone spends its retries first.
        let nodes = std::mem::take(&mut self.nodes);
        std::thread::scope(|s| {
            for n in nodes {
                s.spawn(move || drop(n));
            }
        });
    }
}

pub fn setxattr(path: &std::path::Path, name: &str, value: &[u8]) {
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: setxattr(2) with valid pointers.
    let rc = unsafe { libc::setxattr(cstr(path).as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    assert_eq!(rc, 0, "setxattr {name}: errno {}", errno());
}

/// Equal bytes, or a short report of where they differ.
pub fn same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        panic!("{what}: {} bytes read, {} expected, first difference at {first:?}", got.len(), want.len());
    }
}

/// Poll `f` until it is true or `secs` pass (cross-node changes arrive by watch).
pub fn eventually(secs: u64, what: &str, f: impl FnMut() -> bool) {
    eventually_showing(secs, what, f, String::new)
}

/// [`eventually`], its failure message followed by `show()` (a log, or
/// what was polled last).
pub fn eventually_showing(secs: u64, what: &str, mut f: impl FnMut() -> bool, show: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "not within {secs}s: {what}{}", show());
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn xattr_value(p: &std::path::Path, name: &str) -> String {
    let out = std::process::Command::new("getfattr").args(["--only-values", "-n", name]).arg(p).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The files of a data dir's chunk store, each by the name of what it
/// holds: a backing file or version file by its own name, a filled slot
/// (`slot.<n>`, a small chunk version a peer sent durably) by the version
/// its label names. Slots not filled yet are left out.
pub fn chunk_files(data: &Path) -> Vec<(String, PathBuf)> {
    let Ok(dir) = fs::read_dir(data.join("chunks")) else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            match name.starts_with("slot.") {
                true => slot_label(&e.path()).map(|label| (label, e.path())),
                false => Some((name, e.path())),
            }
        })
        .collect()
}

/// The label of a filled slot: the name of the version it holds.
fn slot_label(path: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: getxattr into a buffer of the length given, NUL-terminated path and name.
    let n = unsafe {
        libc::getxattr(c_path.as_ptr(), c"user.converged.version".as_ptr(), buf.as_mut_ptr().cast(), buf.len())
    };
    let n = usize::try_from(n).ok()?;
    String::from_utf8(buf[..n].to_vec()).ok()
}
