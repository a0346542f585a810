//! An object store client that is not converged's own: a Python script
//! under `tests/scripts/` (boto3 for S3, azure-storage-blob for Azure),
//! both with one command line: mkbucket, put, get (exit 3 when the key is
//! missing), list.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

pub struct ScriptClient {
    script: &'static str,
    endpoint: String,
}

impl ScriptClient {
    /// `script` in `tests/scripts/`, talking to the server at `endpoint`.
    pub fn new(script: &'static str, endpoint: String) -> Self {
        ScriptClient { script, endpoint }
    }

    fn run(&self, args: &[&str]) -> Output {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts").join(self.script);
        Command::new("python3").arg(script).arg(&self.endpoint).args(args).output().expect("run the object client")
    }

    fn ok(&self, args: &[&str]) -> Output {
        let out = self.run(args);
        assert!(out.status.success(), "{} {args:?}: {}", self.script, String::from_utf8_lossy(&out.stderr));
        out
    }

    /// Create a bucket (an Azure container).
    pub fn mkbucket(&self, bucket: &str) {
        self.ok(&["mkbucket", bucket]);
    }

    pub fn put(&self, bucket: &str, key: &str, data: &[u8]) {
        let f = tempfile::NamedTempFile::new().unwrap();
        fs::write(f.path(), data).unwrap();
        self.ok(&["put", bucket, key, f.path().to_str().unwrap()]);
    }

    /// The object's bytes, or `None` when there is no such key.
    pub fn get(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let f = tempfile::NamedTempFile::new().unwrap();
        let args = ["get", bucket, key, f.path().to_str().unwrap()];
        let out = self.run(&args);
        if out.status.code() == Some(3) {
            return None;
        }
        assert!(out.status.success(), "{} {args:?}: {}", self.script, String::from_utf8_lossy(&out.stderr));
        Some(fs::read(f.path()).unwrap())
    }

    /// Keys under `prefix`, in order.
    pub fn list(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let out = self.ok(&["list", bucket, prefix]);
        String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
    }
}
