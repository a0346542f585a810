//! Reading chunks this node does not hold: ranges fetched from a peer in
//! windows, every block checked against the chunk record's crc32c before a
//! byte is returned, and a readahead of the next windows for sequential
//! readers so that the network stays busy while the reader copies.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use converged_metadata::held_locks::Mutex;
use converged_metadata::types::BLOCK_SIZE;
use converged_metadata::ChunkRecord;
use converged_transport::ChunkRef;
use parking_lot::Condvar;

use crate::cluster::Cluster;
use crate::error::{FsError, FsResult};

/// Bytes fetched per peer request. Chunk sizes are multiples of it: a
/// window never spans two chunks.
pub const WINDOW: u64 = 4 << 20;
const _: () = assert!((converged_metadata::types::DEFAULT_CHUNK_SIZE as u64).is_multiple_of(WINDOW));
/// Windows fetched ahead of a sequential reader (64 MiB in flight).
pub const READAHEAD: u64 = 16;

/// Check each block of `bytes`, which start at `offset` of the file (block
/// aligned), against the record of the chunk starting at `chunk_start`.
/// A block's checksum covers the chunk's data only: bytes past the chunk's
/// length (a hole up to a later chunk the file was extended into) must be
/// zeros.
pub fn verify(ino: u64, rec: &ChunkRecord, chunk_start: u64, offset: u64, bytes: &[u8]) -> FsResult<()> {
    let bs = BLOCK_SIZE as u64;
    let data_end = chunk_start + rec.len as u64;
    for (i, block) in bytes.chunks(bs as usize).enumerate() {
        let at = offset + i as u64 * bs;
        let idx = ((at - chunk_start) / bs) as usize;
        let (data, past) = block.split_at((data_end.saturating_sub(at) as usize).min(block.len()));
        let ok = past.iter().all(|b| *b == 0)
            && match rec.block_crcs.get(idx) {
                Some(crc) => crc32c::crc32c(data) == *crc,
                None => data.iter().all(|b| *b == 0),
            };
        if !ok {
            return Err(FsError::Corrupt { ino, offset: at });
        }
    }
    Ok(())
}

/// Start fetching `[offset, offset + len)` of the file (a file offset),
/// inside chunk version `chunk` whose record is `rec`, from the first
/// holder that answers, and verify it.
pub fn fetch(
    cluster: &Arc<Cluster>,
    chunk: ChunkRef,
    rec: Arc<ChunkRecord>,
    offset: u64,
    len: u32,
) -> tokio::task::JoinHandle<FsResult<Vec<u8>>> {
    cluster.spawn(fetching(cluster, chunk, rec, offset, len))
}

/// The fetch [`fetch`] spawns, to run on the transport runtime. The holders
/// are chosen here, on the caller's thread, because choosing asks
/// membership (a blocking call the transport runtime must not make).
fn fetching(
    cluster: &Arc<Cluster>,
    chunk: ChunkRef,
    rec: Arc<ChunkRecord>,
    offset: u64,
    len: u32,
) -> impl std::future::Future<Output = FsResult<Vec<u8>>> + Send + 'static {
    let order = cluster.read_order(&rec.replicas);
    let c = cluster.clone();
    // Each holder's answer is verified before the next is tried: a bad copy
    // on one peer is passed over for a good one on another.
    let check = move |data: &[u8]| verify(chunk.ino, &rec, chunk.start, offset, data);
    async move { c.fetch(chunk, offset - chunk.start, len, order, check).await }
}

/// A whole chunk version from its holders: every window fetched at once,
/// each verified. Call it outside the transport runtime.
pub fn fetch_chunk(cluster: &Arc<Cluster>, chunk: ChunkRef, rec: Arc<ChunkRecord>) -> FsResult<Vec<u8>> {
    let len = rec.len as u64;
    let tasks: Vec<_> = (0..len)
        .step_by(WINDOW as usize)
        .map(|at| fetch(cluster, chunk, rec.clone(), chunk.start + at, WINDOW.min(len - at) as u32))
        .collect();
    let mut data = Vec::with_capacity(len as usize);
    let mut failed = None;
    for task in tasks {
        match wait(cluster, task) {
            Ok(part) => data.extend_from_slice(&part),
            Err(e) => failed = Some(e),
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(data),
    }
}

/// The reference a peer request names for the chunk of `rec` at `index`.
pub fn chunk_ref(ino: u64, index: u64, chunk_size: u64, rec: &ChunkRecord) -> ChunkRef {
    ChunkRef { ino, index: index as u32, version: rec.version, start: index * chunk_size }
}

/// Wait for a [`fetch`] from outside the transport runtime.
pub fn wait(cluster: &Cluster, task: tokio::task::JoinHandle<FsResult<Vec<u8>>>) -> FsResult<Vec<u8>> {
    cluster.block_on(task).map_err(|e| FsError::Peer(e.to_string()))?
}

/// One window being fetched or fetched.
pub struct Window {
    result: Mutex<Option<Result<Arc<Vec<u8>>, FsError>>>,
    ready: Condvar,
}

impl Window {
    fn new() -> Arc<Self> {
        Arc::new(Window { result: Mutex::new(None), ready: Condvar::new() })
    }

    /// Fetch `len` bytes at file offset `at` of chunk version `chunk` in
    /// the background; a zero length is an empty answer at once.
    fn start(cluster: &Arc<Cluster>, chunk: ChunkRef, rec: Arc<ChunkRecord>, at: u64, len: u32) -> Arc<Self> {
        let w = Window::new();
        if len == 0 {
            w.set(Ok(Vec::new()));
            return w;
        }
        let fetch = fetching(cluster, chunk, rec, at, len);
        let w2 = w.clone();
        cluster.spawn(async move { w2.set(fetch.await) });
        w
    }

    /// Whether the fetch ended in an error (a later read starts it again).
    fn failed(&self) -> bool {
        matches!(*self.result.lock(), Some(Err(_)))
    }

    fn set(&self, r: FsResult<Vec<u8>>) {
        *self.result.lock() = Some(r.map(Arc::new));
        self.ready.notify_all();
    }

    /// Wait for the bytes; `deadline` is a safety net over the per-peer deadlines.
    pub fn wait(&self, deadline: Duration) -> FsResult<Arc<Vec<u8>>> {
        let mut r = self.result.lock();
        let until = std::time::Instant::now() + deadline;
        while r.is_none() {
            if r.wait_until(&self.ready, until) {
                return Err(FsError::Peer(format!("no answer from any replica within {deadline:?}")));
            }
        }
        match r.as_ref().expect("set above") {
            Ok(d) => Ok(d.clone()),
            Err(e) => Err(e.duplicate()),
        }
    }
}

/// What a file handle fetched remotely: windows by start offset, and where a
/// sequential reader is expected next.
#[derive(Default)]
pub struct Readahead {
    windows: HashMap<u64, Arc<Window>>,
    next: u64,
}

/// Where window `start` lies: its chunk record and the chunk version to ask for.
pub type Locate<'a> = &'a dyn Fn(u64) -> Option<(Arc<ChunkRecord>, ChunkRef)>;

/// Bytes `[start, end)` of the file, being fetched in one request: a whole
/// window, or, for a reader that jumps about, only the blocks it asked for.
/// Past the chunk's recorded length (inside `end`) the bytes are zeros.
pub struct Span {
    pub start: u64,
    pub end: u64,
    pub window: Arc<Window>,
}

impl Readahead {
    /// The fetches covering `[offset, end)`. A sequential reader (one that
    /// goes on where its last read ended, or starts at the beginning) is
    /// served whole windows, kept for the reads that follow, and the next
    /// [`READAHEAD`] windows are started. Any other read fetches only its
    /// own blocks, with nothing ahead: a 4 KiB random read costs a 4 KiB
    /// request, not a window. `locate` gives the chunk record of a window,
    /// or `None` when no peer is needed there (a hole, a local chunk, past
    /// the end).
    pub fn windows(
        &mut self,
        cluster: &Arc<Cluster>,
        offset: u64,
        end: u64,
        size: u64,
        locate: Locate<'_>,
    ) -> Vec<Span> {
        let sequential = offset == self.next || offset == 0;
        self.next = end;
        let first = offset / WINDOW * WINDOW;
        let last_needed = end.div_ceil(WINDOW) * WINDOW;
        if !sequential {
            return self.blocks(cluster, offset, end, locate);
        }
        // Windows behind the reader will not be read again by a sequential reader.
        self.windows.retain(|start, _| *start + 2 * WINDOW > first);
        let stop = (last_needed + READAHEAD * WINDOW).min(size.div_ceil(WINDOW) * WINDOW);
        let mut out = Vec::new();
        let mut start = first;
        while start < stop {
            if let Some((rec, chunk)) = locate(start) {
                let chunk_end = chunk.start + rec.len as u64;
                // A window that failed (a peer down, a bad copy) is fetched
                // again: the holders may answer now.
                if self.windows.get(&start).is_some_and(|w| w.failed()) {
                    self.windows.remove(&start);
                }
                let w = self.windows.entry(start).or_insert_with(|| {
                    let len = (start + WINDOW).min(chunk_end).saturating_sub(start) as u32;
                    Window::start(cluster, chunk, rec, start, len)
                });
                if start < last_needed {
                    out.push(Span { start, end: start + WINDOW, window: w.clone() });
                }
            }
            start += WINDOW;
        }
        out
    }

    /// The blocks of `[offset, end)`, one request per window they fall in,
    /// served from a window already fetched where one covers them.
    fn blocks(&mut self, cluster: &Arc<Cluster>, offset: u64, end: u64, locate: Locate<'_>) -> Vec<Span> {
        let bs = BLOCK_SIZE as u64;
        let mut out = Vec::new();
        let mut start = offset / WINDOW * WINDOW;
        while start < end {
            let slot_end = start + WINDOW;
            if let Some(w) = self.windows.get(&start).filter(|w| !w.failed()) {
                out.push(Span { start, end: slot_end, window: w.clone() });
            } else if let Some((rec, chunk)) = locate(start) {
                let from = (offset.max(start) / bs * bs).max(start);
                let to = end.min(slot_end).div_ceil(bs) * bs;
                let chunk_end = chunk.start + rec.len as u64;
                let len = to.min(chunk_end).saturating_sub(from) as u32;
                out.push(Span {
                    start: from,
                    end: to.min(slot_end),
                    window: Window::start(cluster, chunk, rec, from, len),
                });
            }
            start = slot_end;
        }
        out
    }
}
