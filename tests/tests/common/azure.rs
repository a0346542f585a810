//! A real Azure Blob Storage-compatible server for the object tier tests:
//! Azurite (from npm) on a loopback port, and azure-storage-blob (through
//! `tests/scripts/azblob.py`) as a client that is not converged's own.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::client::ScriptClient;

/// An Azurite blob server on a loopback port, its blobs in a temporary
/// directory; killed on drop.
pub struct AzureServer {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

fn azurite_bin() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("azurite-blob")).find(|p| p.exists())
}

impl AzureServer {
    /// `None` (outside CI) when Azurite is not installed. Points this
    /// process's environment (and so the daemons and commands it starts)
    /// at it, as `AZURE_STORAGE_USE_EMULATOR` does for object_store.
    pub fn start() -> Option<Self> {
        let Some(bin) = azurite_bin() else {
            assert!(std::env::var_os("CI").is_none(), "Azurite must be installed in CI (npm install -g azurite)");
            eprintln!("azurite-blob not installed (npm install -g azurite; pip install azure-storage-blob); not run");
            return None;
        };
        let port = super::etcd_cluster::free_port();
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new(bin)
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string(), "--skipApiVersionCheck", "--silent"])
            .arg("--location")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start azurite-blob");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "azurite-blob did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let s = AzureServer { port, child, _dir: dir };
        std::env::set_var("AZURE_STORAGE_USE_EMULATOR", "true");
        std::env::set_var("AZURITE_BLOB_STORAGE_URL", s.endpoint());
        Some(s)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// azure-storage-blob, for checking what converged wrote.
    pub fn client(&self) -> ScriptClient {
        ScriptClient::new("azblob.py", self.endpoint())
    }
}

impl Drop for AzureServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
