//! A real S3-compatible server for the object tier tests: moto (from
//! PyPI) on a loopback port, and boto3 (through `tests/scripts/s3.py`) as an
//! S3 client that is not converged's own.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut s = S3Server { port, child: None };
        s.restart();
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

    pub fn s3(&self, args: &[&str]) -> std::process::Output {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/s3.py");
        Command::new("python3").arg(script).arg(self.endpoint()).args(args).output().expect("run s3.py")
    }

    pub fn mkbucket(&self, bucket: &str) {
        let out = self.s3(&["mkbucket", bucket]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn put(&self, bucket: &str, key: &str, data: &[u8]) {
        let f = tempfile::NamedTempFile::new().unwrap();
        fs::write(f.path(), data).unwrap();
        let out = self.s3(&["put", bucket, key, f.path().to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    /// The object's bytes, or `None` when there is no such key.
    pub fn get(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let f = tempfile::NamedTempFile::new().unwrap();
        let out = self.s3(&["get", bucket, key, f.path().to_str().unwrap()]);
        if out.status.code() == Some(3) {
            return None;
        }
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        Some(fs::read(f.path()).unwrap())
    }

    pub fn list(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let out = self.s3(&["list", bucket, prefix]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
