//! A real 3-member etcd cluster on loopback for tests, from Debian's
//! `etcd-server` (`/usr/bin/etcd`). Members are killed when it drops.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct EtcdCluster {
    pub endpoints: Vec<String>,
    children: Vec<Child>,
    _dir: tempfile::TempDir,
}

fn etcd_bin() -> Option<PathBuf> {
    let from_env = std::env::var_os("ETCD_BIN").map(PathBuf::from);
    from_env
        .into_iter()
        .chain([PathBuf::from("/usr/bin/etcd"), PathBuf::from("/usr/local/bin/etcd")])
        .find(|p| p.exists())
}

impl EtcdCluster {
    /// Start 3 members; `None` (outside CI) when etcd is not installed.
    /// A cluster that does not come up (a port picked here was taken by
    /// another test before etcd bound it, or a loaded machine) is started
    /// again on fresh ports.
    pub fn start() -> Option<Self> {
        let Some(bin) = etcd_bin() else {
            assert!(std::env::var_os("CI").is_none(), "etcd must be installed in CI (apt-get install etcd-server)");
            eprintln!("etcd not installed (apt-get install etcd-server); etcd tests not run");
            return None;
        };
        for attempt in 1..=3 {
            let cluster = Self::start_once(&bin);
            if cluster.wait_healthy(Duration::from_secs(30)) {
                return Some(cluster);
            }
            eprintln!("etcd cluster did not become healthy (attempt {attempt}); starting it again on new ports");
        }
        panic!("etcd cluster did not become healthy in 3 attempts");
    }

    fn start_once(bin: &std::path::Path) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> =
            ports.iter().enumerate().map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}")).collect();
        let token = format!("converged-test-{}-{}", std::process::id(), ports[0].0);
        let mut children = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let args =
                ["--initial-cluster-token".to_string(), token.clone(), "--initial-cluster-state".into(), "new".into()];
            children.push(spawn_member(
                bin,
                dir.path(),
                &format!("m{i}"),
                &format!("http://127.0.0.1:{client}"),
                *peer,
                &initial.join(","),
                &args,
            ));
        }
        let endpoints: Vec<String> = ports.iter().map(|(c, _)| format!("127.0.0.1:{c}")).collect();
        EtcdCluster { endpoints, children, _dir: dir }
    }

    /// The `--meta` URI of `volume` on this cluster (every member).
    #[allow(dead_code)] // used by some of the test crates that include this module
    pub fn uri(&self, volume: &str) -> String {
        format!("etcd://{}/{volume}", self.endpoints.join(","))
    }

    /// Whether every member answers a linearizable read (the cluster has a
    /// leader) within `limit`.
    fn wait_healthy(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        for ep in &self.endpoints {
            loop {
                let ok =
                    converged_metadata::EtcdKv::connect(std::slice::from_ref(ep), "health", Duration::from_secs(1))
                        .is_ok();
                if ok {
                    break;
                }
                if Instant::now() >= deadline {
                    eprintln!("etcd member {ep} did not become healthy");
                    return false;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        true
    }
}

/// Start one etcd member named `name`, serving clients at `client_url` and
/// peers on loopback port `peer`, its data and log under `dir`.
fn spawn_member(
    bin: &std::path::Path,
    dir: &std::path::Path,
    name: &str,
    client_url: &str,
    peer: u16,
    initial_cluster: &str,
    extra: &[String],
) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    Command::new(bin)
        .arg("--name")
        .arg(name)
        .arg("--data-dir")
        .arg(dir.join(name))
        .args(["--listen-client-urls", client_url, "--advertise-client-urls", client_url])
        .arg("--listen-peer-urls")
        .arg(format!("http://127.0.0.1:{peer}"))
        .arg("--initial-advertise-peer-urls")
        .arg(format!("http://127.0.0.1:{peer}"))
        .arg("--initial-cluster")
        .arg(initial_cluster)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start etcd")
}

/// One etcd member on a client port chosen before it starts (a mount may
/// already be waiting for it), over `scheme` (`http` or `https`, with the
/// TLS flags in `extra`), killed on drop. Panics when etcd is not installed.
#[allow(dead_code)]
pub struct EtcdMember {
    child: Child,
    _dir: tempfile::TempDir,
}

#[allow(dead_code)]
impl EtcdMember {
    pub fn start(client: u16, scheme: &str, extra: &[String]) -> EtcdMember {
        let bin = etcd_bin().expect("etcd is not installed (apt-get install etcd-server)");
        let dir = tempfile::tempdir().unwrap();
        let peer = free_port();
        let url = format!("{scheme}://127.0.0.1:{client}");
        let child = spawn_member(&bin, dir.path(), "m0", &url, peer, &format!("m0=http://127.0.0.1:{peer}"), extra);
        EtcdMember { child, _dir: dir }
    }
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port for a server a test starts, nobody else's until this
/// test process exits. Picked at random below the kernel's ephemeral range
/// (32768 and up: `bind(0)` hands a port one caller just released to the
/// next), free now for TCP and UDP, and held by a lock on a file named
/// after it in a directory every test process shares. Without the lock, a
/// port picked for a daemon's `--metrics` and not bound yet could be picked
/// again for an etcd member in the same test, or by a test beside it, and
/// the second server to start failed with `EADDRINUSE`. The lock is an
/// `flock`, which the kernel drops when the process ends however it ends,
/// so a test that dies leaves no port taken.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    use std::os::fd::AsRawFd;
    static HELD: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());
    std::fs::create_dir_all(port_registry()).expect("make the test port registry");
    let seed = std::collections::hash_map::RandomState::new();
    let mut attempt = 0u64;
    loop {
        let mut h = seed.build_hasher();
        h.write_u64(attempt);
        h.write_u32(std::process::id());
        attempt += 1;
        assert!(attempt < 100_000, "no loopback port free for a test's server in {:?}", port_registry());
        let port = 10_000 + (h.finish() % 22_000) as u16;
        let Ok(file) = std::fs::OpenOptions::new().create(true).append(true).open(port_lock(port)) else {
            continue;
        };
        // SAFETY: flock on a descriptor this function owns; a lock taken
        // through another open of the same file, in this process or
        // another, makes it fail with EWOULDBLOCK.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            HELD.lock().unwrap_or_else(|e| e.into_inner()).push(file);
            return port;
        }
    }
}

/// The directory every test process keeps its ports' lock files in.
fn port_registry() -> PathBuf {
    std::env::temp_dir().join("converged-test-ports")
}

/// The file whose `flock` holds `port` for the test process that took it.
pub fn port_lock(port: u16) -> PathBuf {
    port_registry().join(port.to_string())
}

impl EtcdCluster {
    /// Kill every member (an outage, or the end of the test).
    pub fn kill(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stop every member (SIGSTOP) without closing a connection: etcd is
    /// there and answers nothing, as when its hosts hang or a partition
    /// drops its packets. Killed as usual at the end.
    #[allow(dead_code)] // used by some of the test crates that include this module
    pub fn freeze(&self) {
        for c in &self.children {
            // SAFETY: kill(2) on a child this cluster started and has not reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGSTOP) };
        }
    }

    /// Let frozen members go on (SIGCONT).
    #[allow(dead_code)]
    pub fn thaw(&self) {
        for c in &self.children {
            // SAFETY: as in `freeze`.
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP relay to `target` whose traffic can be held: the connection stays
/// up and says nothing, as a partition without a reset leaves it.
pub struct Relay {
    pub addr: String,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    pub fn to(target: &str) -> Relay {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering::Relaxed;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let held = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (target, h) = (target.to_string(), held.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(&target) else { continue };
                let pairs = [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)];
                for (mut from, mut to) in pairs {
                    let held = h.clone();
                    std::thread::spawn(move || {
                        let wait = || {
                            while held.load(Relaxed) {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                        };
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            wait();
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            // Bytes read just as the hold began wait with the rest.
                            wait();
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Relay { addr, held }
    }

    pub fn hold(&self, on: bool) {
        self.held.store(on, std::sync::atomic::Ordering::Relaxed);
    }
}
