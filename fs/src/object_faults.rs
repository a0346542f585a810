//! A fault-injecting `ObjectStore` for tests, like the other remotes have:
//! `FaultyStore` wraps any store (usually `object_store::memory::InMemory`)
//! and delegates every call to it until a `Fault` is switched on. Give an
//! `Arc<FaultyStore<_>>` to `ObjectTier::with_store` and keep a clone to
//! switch faults while the tier runs.
//!
//! A fault is read when a call starts (when its future is first polled; a
//! multipart part when it is handed to the upload), so switching one never
//! changes a call already under way. The errors are the ones a real store
//! gives: an outage is `object_store::Error::Generic` (which `ObjectError`
//! counts as retryable), a refusal `PermissionDenied` (which it does not).

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result, UploadPart,
};
use parking_lot::Mutex;

/// What goes wrong, until `FaultyStore::clear`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Every call fails as when the store cannot be reached (retryable).
    Down,
    /// Each multipart upload takes its first `n` parts; every later part
    /// fails (retryable), and so does completing that upload. Single PUTs
    /// and everything else work.
    FailAfterParts(usize),
    /// Every call (and every multipart part, and every location of a
    /// delete) waits this long first, then works.
    Slow(Duration),
    /// GETs return the object's bytes with the first byte of every chunk
    /// the store returns inverted (`!b`): the size and the metadata are
    /// right, the bytes are not. HEAD, listings and writes work.
    Corrupt,
    /// Every call fails with `PermissionDenied` (not retryable).
    DenyAll,
}

/// The switch and the counters, shared with uploads and streams in flight.
#[derive(Debug, Default)]
struct State {
    fault: Mutex<Option<Fault>>,
    /// Multipart parts the inner store took.
    parts: AtomicUsize,
    /// Multipart uploads aborted (whether the abort itself worked or not).
    aborts: AtomicUsize,
}

impl State {
    fn fault(&self) -> Option<Fault> {
        self.fault.lock().clone()
    }
}

/// An `ObjectStore` that is `inner` plus the fault switched on, if any.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    state: Arc<State>,
}

impl<S: ObjectStore> FaultyStore<S> {
    pub fn new(inner: S) -> Self {
        FaultyStore { inner, state: Arc::default() }
    }

    /// The wrapped store, to look at (or change) it behind the faults.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Switch `fault` on (replacing any other).
    pub fn set(&self, fault: Fault) {
        *self.state.fault.lock() = Some(fault);
    }

    /// Back to a working store.
    pub fn clear(&self) {
        *self.state.fault.lock() = None;
    }

    pub fn fault(&self) -> Option<Fault> {
        self.state.fault()
    }

    /// Multipart parts the inner store took, over all uploads.
    pub fn parts_stored(&self) -> usize {
        self.state.parts.load(Ordering::Relaxed)
    }

    /// Multipart uploads aborted, over all uploads.
    pub fn aborts(&self) -> usize {
        self.state.aborts.load(Ordering::Relaxed)
    }
}

impl<S: fmt::Display> fmt::Display for FaultyStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultyStore({})", self.inner)
    }
}

const STORE: &str = "FaultyStore";

fn down(op: &str, path: &str) -> object_store::Error {
    object_store::Error::Generic { store: STORE, source: format!("injected outage: {op} {path:?}").into() }
}

fn denied(op: &str, path: &str) -> object_store::Error {
    object_store::Error::PermissionDenied { path: path.to_string(), source: format!("injected: {op} denied").into() }
}

/// What every call goes through first: fail, wait, or pass.
async fn gate(state: &State, op: &str, path: &str) -> Result<()> {
    match state.fault() {
        Some(Fault::Down) => Err(down(op, path)),
        Some(Fault::DenyAll) => Err(denied(op, path)),
        Some(Fault::Slow(d)) => {
            tokio::time::sleep(d).await;
            Ok(())
        }
        Some(Fault::FailAfterParts(_) | Fault::Corrupt) | None => Ok(()),
    }
}

fn prefix_str(prefix: Option<&Path>) -> String {
    prefix.map(|p| p.to_string()).unwrap_or_default()
}

/// Invert the first byte of a chunk.
fn flip(chunk: Bytes) -> Bytes {
    if chunk.is_empty() {
        return chunk;
    }
    let mut v = chunk.to_vec();
    v[0] = !v[0];
    Bytes::from(v)
}

fn corrupt(r: GetResult) -> GetResult {
    let (meta, range, attributes, extensions) =
        (r.meta.clone(), r.range.clone(), r.attributes.clone(), r.extensions.clone());
    // `into_stream` reads a local file's payload in chunks too.
    let stream = r.into_stream().map(|chunk| chunk.map(flip)).boxed();
    GetResult { payload: GetResultPayload::Stream(stream), meta, range, attributes, extensions }
}

/// A listing stream that passes the gate when first polled.
fn gated_list(
    state: Arc<State>,
    prefix: String,
    inner: BoxStream<'static, Result<ObjectMeta>>,
) -> BoxStream<'static, Result<ObjectMeta>> {
    stream::once(async move {
        match gate(&state, "list", &prefix).await {
            Ok(()) => inner,
            Err(e) => stream::once(async move { Err(e) }).boxed(),
        }
    })
    .flatten()
    .boxed()
}

#[async_trait::async_trait]
impl<S: ObjectStore> ObjectStore for FaultyStore<S> {
    async fn put_opts(&self, location: &Path, payload: PutPayload, opts: PutOptions) -> Result<PutResult> {
        gate(&self.state, "put", location.as_ref()).await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(&self, location: &Path, opts: PutMultipartOptions) -> Result<Box<dyn MultipartUpload>> {
        gate(&self.state, "start multipart", location.as_ref()).await?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        let upload =
            FaultyUpload { inner, state: self.state.clone(), path: location.to_string(), parts: 0, refused: false };
        Ok(Box::new(upload) as Box<dyn MultipartUpload>)
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        gate(&self.state, if options.head { "head" } else { "get" }, location.as_ref()).await?;
        let head = options.head;
        let r = self.inner.get_opts(location, options).await?;
        Ok(if !head && self.state.fault() == Some(Fault::Corrupt) { corrupt(r) } else { r })
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        gate(&self.state, "get", location.as_ref()).await?;
        let r = self.inner.get_ranges(location, ranges).await?;
        Ok(if self.state.fault() == Some(Fault::Corrupt) { r.into_iter().map(flip).collect() } else { r })
    }

    /// Each location passes the gate when it comes up; a refused one reaches
    /// the inner store as an error, which the stores of object_store pass
    /// through without deleting anything.
    fn delete_stream(&self, locations: BoxStream<'static, Result<Path>>) -> BoxStream<'static, Result<Path>> {
        let state = self.state.clone();
        let gated = locations
            .then(move |location| {
                let state = state.clone();
                async move {
                    let location = location?;
                    gate(&state, "delete", location.as_ref()).await?;
                    Ok(location)
                }
            })
            .boxed();
        self.inner.delete_stream(gated)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        gated_list(self.state.clone(), prefix_str(prefix), self.inner.list(prefix))
    }

    fn list_with_offset(&self, prefix: Option<&Path>, offset: &Path) -> BoxStream<'static, Result<ObjectMeta>> {
        gated_list(self.state.clone(), prefix_str(prefix), self.inner.list_with_offset(prefix, offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        gate(&self.state, "list", &prefix_str(prefix)).await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        gate(&self.state, "copy", from.as_ref()).await?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        gate(&self.state, "rename", from.as_ref()).await?;
        self.inner.rename_opts(from, to, options).await
    }
}

/// One multipart upload through a `FaultyStore`, counting its parts.
#[derive(Debug)]
struct FaultyUpload {
    inner: Box<dyn MultipartUpload>,
    state: Arc<State>,
    path: String,
    /// Parts handed to this upload so far.
    parts: usize,
    /// Whether a part was refused: completing would make an object without it.
    refused: bool,
}

#[async_trait::async_trait]
impl MultipartUpload for FaultyUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.parts += 1;
        let fault = self.state.fault();
        let refusal = match &fault {
            Some(Fault::Down) => Some(down("upload part", &self.path)),
            Some(Fault::DenyAll) => Some(denied("upload part", &self.path)),
            Some(Fault::FailAfterParts(n)) if self.parts > *n => Some(object_store::Error::Generic {
                store: STORE,
                source: format!("injected: part {} of {:?} refused after {n}", self.parts, self.path).into(),
            }),
            _ => None,
        };
        if let Some(e) = refusal {
            self.refused = true;
            return Box::pin(async move { Err(e) });
        }
        let delay = match fault {
            Some(Fault::Slow(d)) => d,
            _ => Duration::ZERO,
        };
        let put = self.inner.put_part(data);
        let state = self.state.clone();
        Box::pin(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            put.await?;
            state.parts.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }

    async fn complete(&mut self) -> Result<PutResult> {
        gate(&self.state, "complete multipart", &self.path).await?;
        if self.refused {
            return Err(object_store::Error::Generic {
                store: STORE,
                source: format!("injected: {:?} lacks a refused part", self.path).into(),
            });
        }
        self.inner.complete().await
    }

    async fn abort(&mut self) -> Result<()> {
        self.state.aborts.fetch_add(1, Ordering::Relaxed);
        gate(&self.state, "abort multipart", &self.path).await?;
        self.inner.abort().await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use object_store::memory::InMemory;

    use super::*;
    use crate::objects::tests::{file_with, memory_home, pattern, upload, BIG};
    use crate::objects::{ObjectError, ObjectResult, ObjectTier, FETCH_RANGE, PART_SIZE};

    fn faulty_tier(name: &str) -> (ObjectTier, Arc<FaultyStore<InMemory>>) {
        let store = Arc::new(FaultyStore::new(InMemory::new()));
        (ObjectTier::with_store(memory_home(name), store.clone()).unwrap(), store)
    }

    /// Every call of the tier once, on `old` (which exists) and `new`
    /// (which does not): what each returned.
    fn every_call(tier: &ObjectTier, old: &str, new: &str) -> Vec<(&'static str, ObjectResult<()>)> {
        let base = tier.home().base.clone();
        let small = pattern(1000, 9);
        let big = pattern(BIG, 8);
        fn ok<T>(r: ObjectResult<T>) -> ObjectResult<()> {
            r.map(|_| ())
        }
        vec![
            ("probe", tier.probe(tier.home())),
            ("put new", ok(upload(tier, new, &small))),
            ("put over old", ok(upload(tier, old, &small))),
            ("multipart new", ok(upload(tier, new, &big))),
            ("multipart over old", ok(upload(tier, old, &big))),
            ("get_range", ok(tier.get_range(None, old, None, 10, 20))),
            ("get_whole", ok(tier.get_whole(old))),
            ("head", ok(tier.head(None, old))),
            ("copy", ok(tier.copy(old, new))),
            ("delete", tier.delete(old)),
            ("list_level", ok(tier.list_level(&base, "mnt/"))),
        ]
    }

    /// `old` still holds `data` and nothing else is under `mnt/`.
    fn only_old_remains(tier: &ObjectTier, store: &FaultyStore<InMemory>, old: &str, new: &str, data: &[u8]) {
        assert_eq!(store.fault(), None);
        assert!(tier.get_whole(old).unwrap() == data);
        let e = tier.head(None, new).unwrap_err();
        assert!(matches!(e, ObjectError::NotFound { .. }), "{e}");
        let listing = tier.list_level(&tier.home().base, "mnt/").unwrap();
        let keys: Vec<_> = listing.objects.iter().map(|o| o.0.as_str()).collect();
        assert_eq!(keys, [old]);
    }

    #[test]
    fn down_store_fails_every_call_retryably_and_leaves_nothing_partial() {
        let (tier, store) = faulty_tier("down");
        let (old, new) = (tier.home().key("old.bin"), tier.home().key("new.bin"));
        let data = pattern(5000, 1);
        upload(&tier, &old, &data).unwrap();

        store.set(Fault::Down);
        for (call, r) in every_call(&tier, &old, &new) {
            let e = r.err().unwrap_or_else(|| panic!("{call} worked on a store that is down"));
            assert!(matches!(e, ObjectError::Store { .. }) && e.is_retryable(), "{call}: {e}");
        }
        assert_eq!(store.parts_stored(), 0);

        store.clear();
        only_old_remains(&tier, &store, &old, &new, &data);
        for (call, r) in every_call(&tier, &old, &new) {
            r.unwrap_or_else(|e| panic!("{call} after the outage: {e}"));
        }
    }

    #[test]
    fn denied_store_errors_are_not_retryable() {
        let (tier, store) = faulty_tier("denied");
        let (old, new) = (tier.home().key("old.bin"), tier.home().key("new.bin"));
        let data = pattern(5000, 2);
        upload(&tier, &old, &data).unwrap();

        store.set(Fault::DenyAll);
        for (call, r) in every_call(&tier, &old, &new) {
            let e = r.err().unwrap_or_else(|| panic!("{call} worked on a store that denies all"));
            assert!(matches!(e, ObjectError::Store { .. }) && !e.is_retryable(), "{call}: {e}");
        }

        store.clear();
        only_old_remains(&tier, &store, &old, &new, &data);
        for (call, r) in every_call(&tier, &old, &new) {
            r.unwrap_or_else(|e| panic!("{call} once allowed: {e}"));
        }
    }

    #[test]
    fn failed_multipart_upload_is_aborted_and_leaves_the_old_object() {
        let (tier, store) = faulty_tier("parts");
        let (old, new) = (tier.home().key("old.bin"), tier.home().key("new.bin"));
        let data = pattern(5000, 3);
        upload(&tier, &old, &data).unwrap();
        let big = pattern(BIG, 4);

        store.set(Fault::FailAfterParts(1));
        for key in [&old, &new] {
            let e = upload(&tier, key, &big).unwrap_err();
            assert!(matches!(e, ObjectError::Store { .. }) && e.is_retryable(), "{e}");
        }
        assert_eq!(store.aborts(), 2, "each failed upload is aborted");
        assert!(store.parts_stored() <= 2, "one part per upload at most: {}", store.parts_stored());
        // Single PUTs are not multipart uploads.
        let small = tier.home().key("small.bin");
        upload(&tier, &small, b"one put").unwrap();
        tier.delete(&small).unwrap();

        store.clear();
        only_old_remains(&tier, &store, &old, &new, &data);
        upload(&tier, &old, &big).unwrap();
        assert!(tier.get_whole(&old).unwrap() == big);
        assert_eq!(store.aborts(), 2);
    }

    #[test]
    fn corrupt_store_returns_other_bytes_of_the_right_size() {
        let (tier, store) = faulty_tier("corrupt");
        let key = tier.home().key("big.bin");
        let big = pattern(BIG, 5);
        let etag = upload(&tier, &key, &big).unwrap();
        let (a, z) = (PART_SIZE as u64 - 5, PART_SIZE as u64 + 2 * FETCH_RANGE + 7);
        let want = &big[a as usize..z as usize];

        store.set(Fault::Corrupt);
        let got = tier.get_range(None, &key, etag.as_deref(), a, z).unwrap();
        assert_eq!(got.len(), want.len());
        assert!(got != want);
        // What callers check: the checksum recorded for these bytes.
        assert_ne!(crc32c::crc32c(&got), crc32c::crc32c(want));
        let whole = tier.get_whole(&key).unwrap();
        assert_eq!(whole.len(), BIG);
        assert!(whole != big);
        // Metadata and writes are untouched.
        let (size, _, head_etag) = tier.head(None, &key).unwrap();
        assert_eq!((size, head_etag), (BIG as u64, etag.clone()));
        assert_eq!(tier.list_level(&tier.home().base, "mnt/").unwrap().objects.len(), 1);

        store.clear();
        assert!(tier.get_range(None, &key, etag.as_deref(), a, z).unwrap() == want);
        assert!(tier.get_whole(&key).unwrap() == big);
    }

    #[test]
    fn slow_store_answers_late_but_right() {
        let (tier, store) = faulty_tier("slow");
        let key = tier.home().key("f.bin");
        let data = pattern(5000, 6);
        let delay = Duration::from_millis(150);

        store.set(Fault::Slow(delay));
        let t = Instant::now();
        let etag = upload(&tier, &key, &data).unwrap();
        assert!(t.elapsed() >= delay, "{:?}", t.elapsed());
        let t = Instant::now();
        assert!(tier.get_range(None, &key, etag.as_deref(), 0, 5000).unwrap() == data);
        assert!(t.elapsed() >= delay, "{:?}", t.elapsed());
        // Starting the upload, its parts and completing it each wait.
        let big = pattern(BIG, 7);
        let t = Instant::now();
        tier.upload(&key, &file_with(&big), BIG as u64, &|_, _| true).unwrap();
        assert!(t.elapsed() >= 2 * delay, "start, parts, complete: {:?}", t.elapsed());
        assert_eq!(store.parts_stored(), 3);

        store.clear();
        let t = Instant::now();
        assert!(tier.get_whole(&key).unwrap() == big);
        assert!(t.elapsed() < delay, "{:?}", t.elapsed());
    }
}
