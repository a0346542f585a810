//! The object store, converged's last tier: one object per file at
//! `<prefix>/<path>`, through the object_store crate (S3 and S3-compatible
//! endpoints, GCS, Azure, a local directory). This module moves bytes and
//! lists keys; which file is in which state is `backfill.rs`'s business.
//!
//! Calls are async inside the tier's own runtime and exposed as blocking
//! methods: the daemon's callers are FUSE and worker threads, never tasks of
//! that runtime. Every call has a deadline (the client's timeouts) and its
//! errors say whether a retry can help.

use std::collections::HashMap;
use std::fs::File;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use converged_metadata::held_locks::Mutex;
use object_store::path::Path;
use object_store::{
    ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};
use thiserror::Error;
use url::Url;

use crate::blocks::read_exact_at;

/// Objects up to this size are written with one PUT; larger ones as a
/// multipart upload with parts of this size.
pub const PART_SIZE: usize = 16 << 20;
/// Parts of one file in flight at once.
pub const PART_CONCURRENCY: usize = 8;
/// Size of one ranged GET, and how many are in flight at once.
pub const FETCH_RANGE: u64 = 8 << 20;
pub const FETCH_CONCURRENCY: usize = 8;

#[derive(Debug, Error)]
pub enum ObjectError {
    #[error("object store URI {uri:?}: {why}")]
    BadUri { uri: String, why: String },
    #[error("object {key:?} changed in the store (ETag no longer {etag:?})")]
    Changed { key: String, etag: String },
    #[error("object {key:?} not found")]
    NotFound { key: String },
    #[error("object store: {op} {key:?}: {msg}")]
    Store { op: &'static str, key: String, msg: String, retryable: bool },
    #[error("reading the file to upload: {0}")]
    Local(#[from] std::io::Error),
}

impl ObjectError {
    /// Whether the same call later may succeed (an outage, a timeout).
    pub fn is_retryable(&self) -> bool {
        match self {
            ObjectError::Store { retryable, .. } => *retryable,
            ObjectError::BadUri { .. } | ObjectError::Changed { .. } | ObjectError::NotFound { .. } => false,
            ObjectError::Local(_) => false,
        }
    }

    fn store(op: &'static str, key: &str, e: object_store::Error) -> Self {
        match e {
            object_store::Error::NotFound { .. } => ObjectError::NotFound { key: key.to_string() },
            object_store::Error::Precondition { .. } => {
                ObjectError::Changed { key: key.to_string(), etag: String::new() }
            }
            e => {
                // Configuration problems never heal by themselves; the rest
                // (connection refused, 5xx, timeouts) may.
                let retryable = !matches!(
                    e,
                    object_store::Error::NotSupported { .. }
                        | object_store::Error::NotImplemented { .. }
                        | object_store::Error::UnknownConfigurationKey { .. }
                        | object_store::Error::InvalidPath { .. }
                        | object_store::Error::PermissionDenied { .. }
                        | object_store::Error::Unauthenticated { .. }
                );
                ObjectError::Store { op, key: key.to_string(), msg: e.to_string(), retryable }
            }
        }
    }
}

pub type ObjectResult<T> = Result<T, ObjectError>;

/// How to reach object stores besides their URI.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// An S3-compatible endpoint (`http://127.0.0.1:9000`); path-style requests.
    pub s3_endpoint: Option<String>,
}

/// One bucket (or directory) and the client for it.
struct Bucket {
    store: Arc<dyn ObjectStore>,
    /// For S3: what import listing needs to sign its own requests.
    s3: Option<S3Listing>,
}

#[derive(Clone)]
struct S3Listing {
    bucket: rusty_s3::Bucket,
    credentials: Option<rusty_s3::Credentials>,
}

/// A parsed object location: which bucket (`s3://name`) and which key prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// `scheme://bucket`, or `file:///dir` for a local directory.
    pub base: String,
    /// Key prefix inside it, without leading or trailing `/`.
    pub prefix: String,
}

impl Location {
    pub fn parse(uri: &str) -> ObjectResult<Self> {
        let bad = |why: &str| ObjectError::BadUri { uri: uri.to_string(), why: why.to_string() };
        // Checked before parsing: the URL parser would resolve `a/../b` quietly.
        if let Some((_, rest)) = uri.split_once("://") {
            let path = rest.split_once('/').map_or("", |(_, p)| p).trim_end_matches('/');
            if !path.is_empty() && path.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
                return Err(bad("the path has an empty, `.` or `..` component"));
            }
        }
        let url = Url::parse(uri).map_err(|e| bad(&e.to_string()))?;
        match url.scheme() {
            "file" => {
                let path = url.to_file_path().map_err(|()| bad("not an absolute local path"))?;
                Ok(Location { base: format!("file://{}", path.display()), prefix: String::new() })
            }
            "s3" | "s3a" | "gs" | "az" | "abfs" | "abfss" => {
                let bucket = url.host_str().filter(|h| !h.is_empty()).ok_or_else(|| bad("no bucket name"))?;
                let prefix = url.path().trim_matches('/').to_string();
                Ok(Location { base: format!("{}://{bucket}", url.scheme()), prefix })
            }
            "memory" => Err(bad(MEMORY_REFUSED)),
            other => Err(bad(&format!("unsupported scheme {other:?} (use s3://, gs://, az:// or file://)"))),
        }
    }

    /// `key` under this location's prefix.
    pub fn key(&self, rel: &str) -> String {
        match (self.prefix.is_empty(), rel.is_empty()) {
            (true, _) => rel.to_string(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}/{rel}", self.prefix),
        }
    }

    pub fn url(&self) -> String {
        if self.prefix.is_empty() {
            self.base.clone()
        } else {
            format!("{}/{}", self.base, self.prefix)
        }
    }
}

/// Why `memory://` is no URI: its objects live in the process and vanish with it.
const MEMORY_REFUSED: &str = "memory:// is an in-process store for tests only (a daemon would lose every object when \
                              it exits); tests build it with ObjectTier::with_store";

/// What a listing of one level under a prefix found.
#[derive(Debug, Default)]
pub struct Listing {
    /// (full key, size, last modified (seconds since the epoch), ETag)
    pub objects: Vec<(String, u64, i64, Option<String>)>,
    /// Full key prefixes, ending in `/`.
    pub prefixes: Vec<String>,
}

/// The tier: the mount's own store plus any import sources, with the runtime their clients run on.
pub struct ObjectTier {
    rt: tokio::runtime::Runtime,
    home: Location,
    opts: StoreOptions,
    buckets: Mutex<HashMap<String, Arc<Bucket>>>,
    http: reqwest::Client,
}

fn install_crypto() {
    // reqwest is built without a bundled provider: use ring, as the transport does.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl ObjectTier {
    /// Run an object-store call on the tier's runtime and wait for it.
    fn block_on<T>(&self, fut: impl std::future::Future<Output = T>) -> T {
        converged_metadata::held_locks::assert_none_held("an object-store call");
        self.rt.block_on(fut)
    }

    /// Open the mount's store (`--object-store`). Builds its client; `probe` checks that it answers.
    pub fn open(uri: &str, opts: StoreOptions) -> ObjectResult<Self> {
        let home = Location::parse(uri)?;
        let tier = Self::new(home, opts)?;
        tier.bucket(&tier.home.base.clone())?;
        Ok(tier)
    }

    /// A tier whose own store is `store`, built by the caller, at `home`
    /// (whose `base` only names it: `memory://test` is fine here, though
    /// `Location::parse` refuses it). For tests: an
    /// `object_store::memory::InMemory`, perhaps wrapped in a
    /// `crate::object_faults::FaultyStore`, that the test keeps a handle on.
    /// Other bases (import sources) are built from their URIs as usual.
    pub fn with_store(home: Location, store: Arc<dyn ObjectStore>) -> ObjectResult<Self> {
        let tier = Self::new(home, StoreOptions::default())?;
        tier.buckets.lock().insert(tier.home.base.clone(), Arc::new(Bucket { store, s3: None }));
        Ok(tier)
    }

    fn new(home: Location, opts: StoreOptions) -> ObjectResult<Self> {
        install_crypto();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("converged-objects")
            .enable_all()
            .build()
            .map_err(ObjectError::Local)?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| ObjectError::BadUri { uri: home.url(), why: e.to_string() })?;
        Ok(ObjectTier { rt, home, opts, buckets: Mutex::default(), http })
    }

    /// Where the mount's own objects live.
    pub fn home(&self) -> &Location {
        &self.home
    }

    fn bucket(&self, base: &str) -> ObjectResult<Arc<Bucket>> {
        if let Some(b) = self.buckets.lock().get(base) {
            return Ok(b.clone());
        }
        let b = Arc::new(self.build(base)?);
        self.buckets.lock().insert(base.to_string(), b.clone());
        Ok(b)
    }

    fn build(&self, base: &str) -> ObjectResult<Bucket> {
        let bad = |why: String| ObjectError::BadUri { uri: base.to_string(), why };
        // The daemon retries the backlog itself, with a longer backoff: a
        // single call should fail within seconds when the store is down.
        let retry = RetryConfig { max_retries: 2, retry_timeout: Duration::from_secs(10), ..Default::default() };
        let client =
            ClientOptions::new().with_connect_timeout(Duration::from_secs(5)).with_timeout(Duration::from_secs(120));
        let url = Url::parse(base).map_err(|e| bad(e.to_string()))?;
        match url.scheme() {
            "file" => {
                let dir = url.to_file_path().map_err(|()| bad("not an absolute path".into()))?;
                std::fs::create_dir_all(&dir).map_err(|e| bad(format!("create {}: {e}", dir.display())))?;
                let store = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| bad(e.to_string()))?
                    .with_automatic_cleanup(true);
                Ok(Bucket { store: Arc::new(store), s3: None })
            }
            "s3" | "s3a" => {
                let name = url.host_str().unwrap_or_default().to_string();
                let region = std::env::var("AWS_REGION")
                    .or_else(|_| std::env::var("AWS_DEFAULT_REGION"))
                    .unwrap_or_else(|_| "us-east-1".into());
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_bucket_name(&name)
                    .with_region(&region)
                    .with_retry(retry)
                    .with_client_options(client);
                let endpoint = self.opts.s3_endpoint.clone().or_else(|| std::env::var("AWS_ENDPOINT_URL").ok());
                if let Some(ep) = &endpoint {
                    b = b
                        .with_endpoint(ep)
                        .with_allow_http(ep.starts_with("http://"))
                        .with_virtual_hosted_style_request(false);
                }
                let store = b.build().map_err(|e| bad(e.to_string()))?;
                let (ep_url, style) = match &endpoint {
                    Some(ep) => (ep.clone(), rusty_s3::UrlStyle::Path),
                    None => (format!("https://s3.{region}.amazonaws.com"), rusty_s3::UrlStyle::VirtualHost),
                };
                let ep_url = Url::parse(&ep_url).map_err(|e| bad(format!("S3 endpoint: {e}")))?;
                let bucket = rusty_s3::Bucket::new(ep_url, style, name, region).map_err(|e| bad(e.to_string()))?;
                let credentials = rusty_s3::Credentials::from_env();
                Ok(Bucket { store: Arc::new(store), s3: Some(S3Listing { bucket, credentials }) })
            }
            "gs" => {
                let store = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(base)
                    .with_retry(retry)
                    .with_client_options(client)
                    .build()
                    .map_err(|e| bad(e.to_string()))?;
                Ok(Bucket { store: Arc::new(store), s3: None })
            }
            "az" | "abfs" | "abfss" => {
                let store = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(base)
                    .with_retry(retry)
                    .with_client_options(client)
                    .build()
                    .map_err(|e| bad(e.to_string()))?;
                Ok(Bucket { store: Arc::new(store), s3: None })
            }
            "memory" => Err(bad(MEMORY_REFUSED.to_string())),
            other => Err(bad(format!("unsupported scheme {other:?}"))),
        }
    }

    /// The bucket `source` names, or the mount's own.
    fn store_of(&self, source: Option<&str>) -> ObjectResult<Arc<Bucket>> {
        match source {
            Some(base) => self.bucket(base),
            None => self.bucket(&self.home.base),
        }
    }

    fn path(key: &str) -> ObjectResult<Path> {
        Path::parse(key).map_err(|e| ObjectError::Store {
            op: "key",
            key: key.to_string(),
            msg: e.to_string(),
            retryable: false,
        })
    }

    /// Check that a store answers (a listing of one level under `loc`).
    pub fn probe(&self, loc: &Location) -> ObjectResult<()> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "probe");
        let b = self.bucket(&loc.base)?;
        let prefix = (!loc.prefix.is_empty()).then(|| Path::from(loc.prefix.as_str()));
        self.block_on(async { b.store.list_with_delimiter(prefix.as_ref()).await })
            .map(|_| ())
            .map_err(|e| ObjectError::store("list", &loc.prefix, e))
    }

    /// Upload `size` bytes of `file` as the object `key` of the mount's
    /// store: one PUT when small, else a multipart upload with parts in
    /// parallel. The object appears under `key` only when complete (a
    /// failed multipart upload is aborted). `check` sees every part before
    /// it is sent and may refuse it (the file changed under the upload).
    /// Returns the object's ETag.
    pub fn upload(
        &self,
        key: &str,
        file: &File,
        size: u64,
        check: &(dyn Fn(u64, &[u8]) -> bool + Sync),
    ) -> ObjectResult<Option<String>> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "put");
        let b = self.bucket(&self.home.base)?;
        let path = Self::path(key)?;
        let changed = || ObjectError::Changed { key: key.to_string(), etag: "(local file changed)".into() };
        if size <= PART_SIZE as u64 {
            let mut buf = vec![0u8; size as usize];
            read_exact_at(file, &mut buf, 0)?;
            if !check(0, &buf) {
                return Err(changed());
            }
            let r = self.block_on(async { b.store.put(&path, PutPayload::from(buf)).await });
            return r.map(|p| p.e_tag).map_err(|e| ObjectError::store("put", key, e));
        }
        self.block_on(async {
            let upload =
                b.store.put_multipart(&path).await.map_err(|e| ObjectError::store("start multipart", key, e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            let mut off = 0u64;
            let failed = loop {
                if off >= size {
                    break None;
                }
                if let Err(e) = w.wait_for_capacity(PART_CONCURRENCY).await {
                    break Some(ObjectError::store("upload part", key, e));
                }
                let n = (size - off).min(PART_SIZE as u64) as usize;
                let mut buf = vec![0u8; n];
                // A part read blocks this (non-runtime) thread only, while earlier parts upload.
                if let Err(e) = read_exact_at(file, &mut buf, off) {
                    break Some(ObjectError::Local(e));
                }
                if !check(off, &buf) {
                    break Some(changed());
                }
                w.put(Bytes::from(buf));
                off += n as u64;
            };
            match failed {
                None => w.finish().await.map(|p| p.e_tag).map_err(|e| ObjectError::store("complete multipart", key, e)),
                Some(e) => {
                    let _ = w.abort().await;
                    Err(e)
                }
            }
        })
    }

    /// Bytes `[start, end)` of an object, refused if its ETag is no longer `etag`.
    pub fn get_range(
        &self,
        source: Option<&str>,
        key: &str,
        etag: Option<&str>,
        start: u64,
        end: u64,
    ) -> ObjectResult<Bytes> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "get_range");
        let b = self.store_of(source)?;
        let path = Self::path(key)?;
        let ranges: Vec<(u64, u64)> =
            (start..end).step_by(FETCH_RANGE as usize).map(|a| (a, (a + FETCH_RANGE).min(end))).collect();
        let r = self.block_on(async {
            use futures::{StreamExt, TryStreamExt};
            let gets = ranges.iter().map(|(a, z)| {
                let opts = GetOptions {
                    range: Some(GetRange::Bounded(*a..*z)),
                    if_match: etag.map(str::to_string),
                    ..Default::default()
                };
                let (store, path) = (b.store.clone(), path.clone());
                async move { store.get_opts(&path, opts).await?.bytes().await }
            });
            // In order, FETCH_CONCURRENCY ranges in flight.
            futures::stream::iter(gets).buffered(FETCH_CONCURRENCY).try_collect::<Vec<_>>().await
        });
        match r {
            Ok(parts) if parts.len() == 1 => Ok(parts.into_iter().next().expect("one part")),
            Ok(parts) => {
                let mut out = Vec::with_capacity((end - start) as usize);
                for p in parts {
                    out.extend_from_slice(&p);
                }
                Ok(Bytes::from(out))
            }
            Err(object_store::Error::Precondition { .. }) => {
                Err(ObjectError::Changed { key: key.to_string(), etag: etag.unwrap_or_default().to_string() })
            }
            Err(e) => Err(ObjectError::store("get", key, e)),
        }
    }

    /// A whole object with one plain GET (the benchmark's baseline).
    pub fn get_whole(&self, key: &str) -> ObjectResult<Bytes> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "get");
        let b = self.bucket(&self.home.base)?;
        let path = Self::path(key)?;
        self.block_on(async { b.store.get(&path).await?.bytes().await }).map_err(|e| ObjectError::store("get", key, e))
    }

    /// Size, mtime (seconds) and ETag of an object.
    pub fn head(&self, source: Option<&str>, key: &str) -> ObjectResult<(u64, i64, Option<String>)> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "head");
        let b = self.store_of(source)?;
        let path = Self::path(key)?;
        let m = self.block_on(async { b.store.head(&path).await }).map_err(|e| ObjectError::store("head", key, e))?;
        Ok((m.size, m.last_modified.timestamp(), m.e_tag))
    }

    /// Copy an object of the mount's store to a new key (re-keying after a rename).
    pub fn copy(&self, from: &str, to: &str) -> ObjectResult<Option<String>> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "copy");
        let b = self.bucket(&self.home.base)?;
        let (f, t) = (Self::path(from)?, Self::path(to)?);
        self.block_on(async { b.store.copy(&f, &t).await }).map_err(|e| ObjectError::store("copy", from, e))?;
        Ok(self.head(None, to)?.2)
    }

    /// Delete an object of the mount's store; a missing one is already deleted.
    pub fn delete(&self, key: &str) -> ObjectResult<()> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "delete");
        let b = self.bucket(&self.home.base)?;
        let path = Self::path(key)?;
        match self.block_on(async { b.store.delete(&path).await }) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(ObjectError::store("delete", key, e)),
        }
    }

    /// One level of keys under `prefix` (which ends in `/`, or is empty) of
    /// the bucket `base`, every key as stored, valid path or not.
    pub fn list_level(&self, base: &str, prefix: &str) -> ObjectResult<Listing> {
        let _t = crate::latency::timer(crate::latency::Area::Object, "list");
        let b = self.bucket(base)?;
        match &b.s3 {
            Some(s3) => self.list_s3(s3, prefix),
            None => {
                let p = (!prefix.is_empty()).then(|| Path::from(prefix.trim_end_matches('/')));
                let r = self
                    .block_on(async { b.store.list_with_delimiter(p.as_ref()).await })
                    .map_err(|e| ObjectError::store("list", prefix, e))?;
                Ok(Listing {
                    objects: r
                        .objects
                        .into_iter()
                        .map(|o| (o.location.to_string(), o.size, o.last_modified.timestamp(), o.e_tag))
                        .collect(),
                    prefixes: r.common_prefixes.into_iter().map(|p| format!("{p}/")).collect(),
                })
            }
        }
    }

    /// ListObjectsV2 with `/` as delimiter, signed here so that keys which
    /// are not valid paths come back as they are (to be skipped and reported).
    fn list_s3(&self, s3: &S3Listing, prefix: &str) -> ObjectResult<Listing> {
        use rusty_s3::S3Action;
        let fail = |msg: String, retryable| ObjectError::Store { op: "list", key: prefix.to_string(), msg, retryable };
        let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        let mut out = Listing::default();
        let mut token: Option<String> = None;
        loop {
            let mut action = s3.bucket.list_objects_v2(s3.credentials.as_ref());
            action.with_prefix(prefix);
            action.with_delimiter("/");
            if let Some(t) = &token {
                action.with_continuation_token(t.as_str());
            }
            let url = action.sign(Duration::from_secs(300));
            let body = self.block_on(async {
                let resp = self.http.get(url).send().await.map_err(|e| fail(e.to_string(), true))?;
                let status = resp.status();
                let text = resp.text().await.map_err(|e| fail(e.to_string(), true))?;
                if !status.is_success() {
                    return Err(fail(format!("HTTP {status}: {text}"), status.is_server_error()));
                }
                Ok(text)
            })?;
            let page =
                rusty_s3::actions::ListObjectsV2::parse_response(&body).map_err(|e| fail(e.to_string(), false))?;
            for c in page.contents {
                let mtime = c
                    .last_modified
                    .as_deref()
                    .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                    .map_or(0, |t| t.as_second());
                out.objects.push((decode(&c.key), c.size.unwrap_or(0), mtime, c.etag));
            }
            out.prefixes.extend(page.common_prefixes.into_iter().map(|p| decode(&p.prefix)));
            match page.next_continuation_token {
                Some(t) if !t.is_empty() => token = Some(t),
                _ => return Ok(out),
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Write;

    use object_store::memory::InMemory;

    use super::*;

    /// `n` bytes that differ from part to part and range to range.
    pub(crate) fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| ((i ^ (i >> 9) ^ (i >> 17)) as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// An unnamed temporary file holding `data`.
    pub(crate) fn file_with(data: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(data).unwrap();
        f
    }

    /// Where the tests' tiers keep their objects: a made-up base, the `mnt` prefix.
    pub(crate) fn memory_home(name: &str) -> Location {
        Location { base: format!("memory://{name}"), prefix: "mnt".into() }
    }

    pub(crate) fn upload(tier: &ObjectTier, key: &str, data: &[u8]) -> ObjectResult<Option<String>> {
        tier.upload(key, &file_with(data), data.len() as u64, &|_, _| true)
    }

    /// A file of three parts, the last one short.
    pub(crate) const BIG: usize = 2 * PART_SIZE + 4321;

    #[test]
    fn memory_uris_are_refused() {
        for uri in ["memory://bucket/prefix", "memory:///prefix"] {
            let e = Location::parse(uri).unwrap_err().to_string();
            assert!(e.contains("tests only"), "{uri}: {e}");
            let e = ObjectTier::open(uri, StoreOptions::default()).err().expect("refused").to_string();
            assert!(e.contains("tests only"), "{uri}: {e}");
        }
    }

    #[test]
    fn memory_tier_moves_small_and_multipart_objects() {
        let store = Arc::new(InMemory::new());
        let tier = ObjectTier::with_store(memory_home("roundtrip"), store.clone()).unwrap();
        assert_eq!(tier.home().url(), "memory://roundtrip/mnt");
        tier.probe(tier.home()).unwrap();
        let (small_key, big_key) = (tier.home().key("a/small.bin"), tier.home().key("a/big.bin"));

        let small = pattern(1000, 1);
        let etag = upload(&tier, &small_key, &small).unwrap().expect("InMemory gives ETags");
        assert_eq!(&tier.get_whole(&small_key).unwrap()[..], &small[..]);
        assert_eq!(&tier.get_range(None, &small_key, Some(&etag), 100, 600).unwrap()[..], &small[100..600]);
        assert_eq!(tier.head(None, &small_key).unwrap().0, 1000);

        // Three parts, each seen by `check` before it is sent.
        let big = pattern(BIG, 2);
        let seen = Mutex::new(Vec::new());
        let check = |off: u64, part: &[u8]| {
            assert_eq!(part, &big[off as usize..off as usize + part.len()]);
            seen.lock().push(off);
            true
        };
        let big_etag = tier.upload(&big_key, &file_with(&big), BIG as u64, &check).unwrap().unwrap();
        assert_eq!(*seen.lock(), [0, PART_SIZE as u64, 2 * PART_SIZE as u64]);
        assert_eq!(tier.head(None, &big_key).unwrap().0, BIG as u64);
        assert!(tier.get_whole(&big_key).unwrap() == big);
        // Across a part boundary and several FETCH_RANGE requests; and all of it.
        let (a, z) = (PART_SIZE - 5, PART_SIZE + 2 * FETCH_RANGE as usize + 7);
        let got = tier.get_range(None, &big_key, Some(&big_etag), a as u64, z as u64).unwrap();
        assert!(got == big[a..z]);
        assert!(tier.get_range(None, &big_key, Some(&big_etag), 0, BIG as u64).unwrap() == big);
        // An ETag the object no longer has is refused, for good.
        let e = tier.get_range(None, &big_key, Some(&etag), 0, 10).unwrap_err();
        assert!(matches!(e, ObjectError::Changed { .. }) && !e.is_retryable(), "{e}");

        let copy_key = tier.home().key("b/copy.bin");
        assert!(tier.copy(&small_key, &copy_key).unwrap().is_some());
        assert_eq!(&tier.get_whole(&copy_key).unwrap()[..], &small[..]);

        let top = tier.list_level("memory://roundtrip", "mnt/").unwrap();
        assert!(top.objects.is_empty(), "{top:?}");
        assert_eq!(top.prefixes, ["mnt/a/", "mnt/b/"]);
        let a = tier.list_level("memory://roundtrip", "mnt/a/").unwrap();
        let mut objects: Vec<_> =
            a.objects.iter().map(|(k, size, _, etag)| (k.as_str(), *size, etag.is_some())).collect();
        objects.sort();
        assert_eq!(objects, [("mnt/a/big.bin", BIG as u64, true), ("mnt/a/small.bin", 1000, true)]);

        tier.delete(&small_key).unwrap();
        assert!(matches!(tier.get_whole(&small_key), Err(ObjectError::NotFound { .. })));
        tier.delete(&small_key).unwrap(); // already gone: deleted
        assert_eq!(&tier.get_whole(&copy_key).unwrap()[..], &small[..]);

        // The test's handle and the tier's are one store.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let direct = Path::from("mnt/direct");
        rt.block_on(store.put(&direct, PutPayload::from_static(b"put by the test"))).unwrap();
        assert_eq!(&tier.get_whole("mnt/direct").unwrap()[..], b"put by the test");
        assert!(rt.block_on(store.head(&Path::from(big_key.as_str()))).is_ok());
    }

    #[test]
    fn refused_part_aborts_the_upload_and_leaves_no_object() {
        let tier = ObjectTier::with_store(memory_home("refused"), Arc::new(InMemory::new())).unwrap();
        let key = tier.home().key("changed.bin");
        let big = pattern(BIG, 3);
        let e = tier.upload(&key, &file_with(&big), BIG as u64, &|off, _| off < PART_SIZE as u64).unwrap_err();
        assert!(matches!(e, ObjectError::Changed { .. }), "{e}");
        assert!(matches!(tier.head(None, &key), Err(ObjectError::NotFound { .. })));
        assert!(tier.list_level("memory://refused", "mnt/").unwrap().objects.is_empty());
    }

    #[test]
    fn locations_parse_or_say_why_not() {
        let l = Location::parse("s3://ckpt/run1/").unwrap();
        assert_eq!((l.base.as_str(), l.prefix.as_str()), ("s3://ckpt", "run1"));
        assert_eq!(l.key("a/b.pt"), "run1/a/b.pt");
        assert_eq!(l.url(), "s3://ckpt/run1");
        let l = Location::parse("gs://bucket").unwrap();
        assert_eq!((l.base.as_str(), l.key("x")), ("gs://bucket", "x".to_string()));
        let l = Location::parse("file:///srv/objects").unwrap();
        assert_eq!((l.base.as_str(), l.prefix.as_str()), ("file:///srv/objects", ""));
        for (bad, why) in [
            ("ftp://h/x", "unsupported scheme"),
            ("s3:///x", "no bucket name"),
            ("s3://b/a/../c", "component"),
            ("s3://b/a//c", "component"),
            ("file://relative", "absolute"),
            ("nonsense", "relative URL"),
        ] {
            let e = Location::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
