//! A real S3-compatible server for the object tier tests: moto (from
//! PyPI) on a loopback port, and boto3 (through `tests/scripts/s3.py`) as an
//! S3 client that is not converged's own.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::client::ScriptClient;

/// A moto S3 server on a loopback port; killed on drop.
pub struct S3Server {
    port: u16,
    child: Option<Child>,
}

fn moto_bin() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("moto_server")).find(|p| p.exists())
}

impl S3Server {
    /// `None` (outside CI) when moto is not installed.
    pub fn start() -> Option<Self> {
        if moto_bin().is_none() {
            assert!(std::env::var_os("CI").is_none(), "moto must be installed in CI (pip install 'moto[server]')");
            eprintln!("moto_server not installed (pip install 'moto[server]' boto3); object tier tests not run");
            return None;
        }
        let port = super::etcd_cluster::free_port();
        let mut s = S3Server { port, child: None };
        s.restart();
        Some(s)
    }

    /// A server with `buckets` made, and the S3 credentials a daemon reads
    /// from its environment set (moto accepts any).
    pub fn with_buckets(buckets: &[&str]) -> Option<Self> {
        let s = Self::start()?;
        for b in buckets {
            s.client().mkbucket(b);
        }
        std::env::set_var("AWS_ACCESS_KEY_ID", "test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
        Some(s)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Start (again) on the same port. moto keeps objects in memory: a
    /// restarted server is empty.
    pub fn restart(&mut self) {
        let child = Command::new(moto_bin().unwrap())
            .args(["-H", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto_server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kill the server (the store goes away mid-whatever).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// boto3, for checking what converged wrote.
    pub fn client(&self) -> ScriptClient {
        ScriptClient::new("s3.py", self.endpoint())
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
