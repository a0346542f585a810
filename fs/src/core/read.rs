//! The read path. A sealed file is read chunk by chunk; for each chunk one
//! step, [`Core::locate`], says where its bytes come from (a hole, the
//! local copy, a peer, the object store), and the readers, the writer's
//! hydration and staging all follow that one answer.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use converged_metadata::types::*;
use converged_metadata::ChunkRecord;

use super::open::OpenInode;
use super::Core;
use crate::chunkstore::read_exact_at;
use crate::error::{FsError, FsResult};
use crate::remote::{self, Readahead, WINDOW};
use crate::tier::Tiering;

/// A sealed file as an open handle reads it: size and chunk records, loaded
/// at open (close-to-open: a later open sees a later seal).
pub(super) struct Layout {
    pub size: u64,
    pub chunk_size: u64,
    pub chunks: Vec<Option<Arc<ChunkRecord>>>,
    /// The object holding the file's current bytes, when it is backed:
    /// chunks with no copy (and chunks with no record) are read from it.
    pub object: Option<Arc<TierRecord>>,
}

/// Where the bytes of one chunk come from.
pub(super) enum Source<'a> {
    /// No record and no object: zeros.
    Hole,
    /// This node's copy.
    Local(&'a ChunkRecord),
    /// A peer's copy (this node has none).
    Peer(&'a ChunkRecord),
    /// The object store: no copy on any node (evicted, or imported and not fetched).
    Object(&'a TierRecord),
    /// Recorded, but with no copy anywhere and no object: unreadable.
    Lost,
}

impl Layout {
    fn record(&self, index: u64) -> Option<&ChunkRecord> {
        self.chunks.get(index as usize).and_then(|c| c.as_deref())
    }
}

/// A chunk's slot in the tier's fetch table, removed when its fetch ends.
struct FetchSlot<'a>(&'a Tiering, (Ino, u32));

impl Drop for FetchSlot<'_> {
    fn drop(&mut self) {
        self.0.fetching.remove(&self.1);
    }
}

/// Bytes `[from, to)` of a file, inside chunk `index`, which starts at `chunk_start`.
struct Part<'a> {
    rec: &'a ChunkRecord,
    index: u32,
    chunk_start: u64,
    from: u64,
    to: u64,
}

impl Part<'_> {
    /// The block-aligned range to read and verify, clipped to the chunk's data.
    fn blocks(&self) -> (u64, u64) {
        let bs = BLOCK_SIZE as u64;
        let stop = (self.to.div_ceil(bs) * bs).min(self.chunk_start + self.rec.len as u64).max(self.to);
        (self.from / bs * bs, stop)
    }

    /// The chunk version a peer request names.
    fn chunk_ref(&self, ino: Ino) -> converged_transport::ChunkRef {
        converged_transport::ChunkRef { ino, index: self.index, version: self.rec.version, start: self.chunk_start }
    }
}

impl Core {
    /// Where chunk `index` of a file with this layout is read from.
    pub(super) fn locate<'a>(&self, layout: &'a Layout, index: u64) -> Source<'a> {
        let object = layout.object.as_deref();
        match (layout.record(index), object) {
            (None, Some(obj)) => Source::Object(obj),
            (None, None) => Source::Hole,
            (Some(rec), _) if self.is_local(rec) => Source::Local(rec),
            (Some(rec), _) if !rec.replicas.is_empty() && self.cluster.get().is_some() => Source::Peer(rec),
            (Some(_), Some(obj)) => Source::Object(obj),
            (Some(_), None) => Source::Lost,
        }
    }

    /// Read through the daemon. A file being written here reads straight
    /// from its backing file; a sealed file is read chunk by chunk, from the
    /// local copy or from a peer, every block checked against its crc32c.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let out = self.read_handle(fh, offset, size)?;
        self.stats.read_bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// A writer on this node changes its backing file in place. A read of
    /// the sealed layout that it overtakes fails its checksums although
    /// nothing is corrupt: such a read is done again (from the backing file
    /// once the file is unsealed, or with the new layout once it is sealed
    /// again). A read whose layout was published over while it was open,
    /// and whose old versions are gone from every holder, is done again
    /// with the layout as it is now. A failure that neither explains is
    /// the answer (`EIO`).
    fn read_handle(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        const ATTEMPTS: usize = 4;
        let (ino, _, oi) = self.open.handle(fh)?;
        let mut attempt = 1;
        loop {
            let (r, layout) = self.read_once(ino, &oi, offset, size);
            let overtaken = matches!(r, Err(FsError::Corrupt { .. }))
                && layout.as_ref().is_some_and(|used| {
                    let st = oi.state();
                    st.write.reads_backing_file() || !st.layout.as_ref().is_some_and(|l| Arc::ptr_eq(l, used))
                });
            let superseded = matches!(r, Err(FsError::Peer(_) | FsError::Corrupt { .. }))
                && layout.as_ref().is_some_and(|used| self.layout_changed(ino, used));
            if !(overtaken || superseded) || attempt == ATTEMPTS {
                return r;
            }
            if superseded {
                oi.state().forget_layout();
            }
            tracing::debug!(ino, offset, attempt, superseded, "a read overtaken by a writer; reading again");
            attempt += 1;
        }
    }

    /// Whether the layout recorded now differs from `used`: another seal,
    /// or copies moved (repair, a drain) so that the holders it names are
    /// not the ones to ask.
    fn layout_changed(&self, ino: Ino, used: &Layout) -> bool {
        match self.load_layout(ino) {
            Ok(now) => {
                now.size != used.size
                    || now.chunks.len() != used.chunks.len()
                    || now.chunks.iter().zip(&used.chunks).any(|(a, b)| {
                        a.as_ref().map(|r| (r.version, &r.replicas)) != b.as_ref().map(|r| (r.version, &r.replicas))
                    })
            }
            Err(_) => false,
        }
    }

    /// One read of `[offset, offset + size)`, and the layout it used (none
    /// when it read the backing file of a file being written here).
    fn read_once(
        &self,
        ino: Ino,
        oi: &Arc<OpenInode>,
        offset: u64,
        size: u32,
    ) -> (FsResult<Vec<u8>>, Option<Arc<Layout>>) {
        if oi.state().write.reads_backing_file() {
            return (self.read_unsealed(oi, offset, size), None);
        }
        let layout = match self.layout(ino, oi) {
            Ok(l) => l,
            Err(e) => return (Err(e), None),
        };
        (self.read_sealed(ino, oi, &layout, offset, size), Some(layout))
    }

    /// Being written here: the backing file holds the bytes, checksums are not computed yet.
    fn read_unsealed(&self, oi: &OpenInode, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let file_size = oi.file.metadata().map_err(|e| FsError::io("stat backing file", e))?.len();
        if offset >= file_size || size == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; ((offset + size as u64).min(file_size) - offset) as usize];
        read_exact_at(&oi.file, &mut buf, offset).map_err(|e| FsError::io("read backing file", e))?;
        Ok(buf)
    }

    /// A sealed file, chunk by chunk from where `locate` says, every block verified.
    fn read_sealed(&self, ino: Ino, oi: &OpenInode, layout: &Layout, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        if offset >= layout.size || size == 0 {
            return Ok(Vec::new());
        }
        let end = (offset + size as u64).min(layout.size);
        let cs = layout.chunk_size;
        let mut out = Vec::with_capacity((end - offset) as usize);
        let mut windows = None;
        let mut pos = offset;
        while pos < end {
            let index = pos / cs;
            let chunk_start = index * cs;
            let to = end.min(chunk_start + cs);
            if let Some(t) = self.tier.get() {
                t.touch(ino, index as u32);
            }
            match self.locate(layout, index) {
                Source::Hole => out.resize(out.len() + (to - pos) as usize, 0),
                Source::Lost => {
                    return Err(FsError::Peer(format!("chunk {index} of inode {ino} has no copy anywhere")));
                }
                Source::Object(obj) => {
                    self.fetch_ahead(ino, oi, layout, index as u32 + 1);
                    let rec = self.fetch_object_chunk(ino, &oi.file, layout.size, cs, index as u32, obj, false)?;
                    // Local from now on: the next read of this open uses the new layout.
                    oi.state().forget_layout();
                    self.read_local(
                        ino,
                        oi,
                        &Part { rec: &rec, index: index as u32, chunk_start, from: pos, to },
                        &mut out,
                    )?;
                }
                Source::Local(rec) => {
                    let before = out.len();
                    let part = Part { rec, index: index as u32, chunk_start, from: pos, to };
                    match self.read_local(ino, oi, &part, &mut out) {
                        Ok(()) => {}
                        // A bad local copy: read another source and repair ours.
                        Err(e @ FsError::Corrupt { .. }) => {
                            out.truncate(before);
                            if let Err(elsewhere) = self.read_elsewhere_and_repair(ino, oi, layout, &part, &mut out) {
                                // The checksum failure is the answer (a read
                                // overtaken by a local writer is done again).
                                tracing::debug!(ino, error = %elsewhere, "no other source of a chunk whose local copy failed its checksum");
                                return Err(e);
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                Source::Peer(_) => {
                    let windows = windows.get_or_insert_with(|| self.remote_windows(ino, oi, layout, offset, end));
                    let cluster = self.cluster.get().expect("a chunk held elsewhere implies a cluster");
                    let before = out.len();
                    let mut failed = None;
                    for span in windows.iter() {
                        let (start, stop) = (span.start, span.end);
                        if start >= to || stop <= pos {
                            continue;
                        }
                        let data = match span.window.wait(cluster.call_deadline()) {
                            Ok(data) => data,
                            Err(e) => {
                                failed = Some(e);
                                break;
                            }
                        };
                        let from = pos.max(start);
                        let upto = to.min(stop);
                        let have = data.len() as u64;
                        let a = (from - start).min(have) as usize;
                        let b = (upto - start).min(have) as usize;
                        out.extend_from_slice(&data[a..b]);
                        // Past the chunk's recorded length: zeros.
                        out.resize(out.len() + ((upto - from) as usize - (b - a)), 0);
                    }
                    if let Some(e) = failed {
                        // No holder answered with good bytes: the object
                        // store has them when the file is backed.
                        let Some(obj) = layout.object.as_deref() else { return Err(e) };
                        tracing::warn!(ino, chunk = index, error = %e, "no holder served the chunk; reading it from the object store");
                        out.truncate(before);
                        let rec = self.fetch_object_chunk(ino, &oi.file, layout.size, cs, index as u32, obj, true)?;
                        oi.state().forget_layout();
                        let part = Part { rec: &rec, index: index as u32, chunk_start, from: pos, to };
                        self.read_local(ino, oi, &part, &mut out)?;
                    }
                }
            }
            pos = to;
        }
        Ok(out)
    }

    /// Start fetching chunk `index` from the object store in the background
    /// when it is there only: a sequential reader finds it local (or being
    /// fetched, and waits for that) instead of starting the fetch itself.
    fn fetch_ahead(&self, ino: Ino, oi: &OpenInode, layout: &Layout, index: u32) {
        let cs = layout.chunk_size;
        if index as u64 * cs >= layout.size {
            return;
        }
        let Source::Object(obj) = self.locate(layout, index as u64) else { return };
        let Some(t) = self.tier.get() else { return };
        if t.fetching.contains_key(&(ino, index)) {
            return;
        }
        let (Some(me), obj, file, size) = (self.me.get().cloned(), obj.clone(), oi.file.clone(), layout.size) else {
            return;
        };
        let spawned = std::thread::Builder::new().name("fetch-ahead".into()).spawn(move || {
            let Some(core) = me.upgrade() else { return };
            if let Err(e) = core.fetch_object_chunk(ino, &file, size, cs, index, &obj, false) {
                tracing::debug!(ino, chunk = index, error = %e, "readahead fetch failed; the read will retry");
            }
        });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "no thread for readahead");
        }
    }

    /// The tier record of `ino` when its object holds the current bytes.
    pub(crate) fn backed_object(&self, ino: Ino) -> FsResult<Option<TierRecord>> {
        if self.tier.get().is_none() {
            return Ok(None);
        }
        Ok(self.ns.tier(ino)?.filter(|r| matches!(r.state, TierState::Backed | TierState::ReKeying)))
    }

    /// Fetch chunk `index` of `ino` from its object into `file` (this
    /// node's backing file), verified against the chunk's checksums when it
    /// has them (computed here when it does not: an imported object), and
    /// record the copy. The object must still carry the ETag it had when
    /// listed or uploaded: a changed object is refused, never mixed in.
    /// With `force`, a local copy recorded as present is fetched again.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fetch_object_chunk(
        &self,
        ino: Ino,
        file: &File,
        size: u64,
        cs: u64,
        index: u32,
        obj: &TierRecord,
        force: bool,
    ) -> FsResult<ChunkRecord> {
        let t = self.tier.get().ok_or(FsError::Invalid("no object store"))?;
        // One fetch of a chunk at a time; the slot goes when this one ends
        // (declared first, so dropped after the lock is released).
        let _slot = FetchSlot(t, (ino, index));
        let lock = t.fetching.entry((ino, index)).or_default().clone();
        let _one = lock.lock();
        let current = self.ns.chunk(ino, index)?;
        if let Some(r) = &current {
            if self.is_local(r) && !force {
                return Ok(r.clone());
            }
        }
        let start = index as u64 * cs;
        let len = current.as_ref().map_or_else(|| size.saturating_sub(start).min(cs), |r| r.len as u64);
        let key = match &obj.source {
            Some(_) => obj.key.clone(),
            None => t.objects.home().key(&obj.key),
        };
        let data = t.objects.get_range(obj.source.as_deref(), &key, obj.etag.as_deref(), start, start + len)?;
        if data.len() as u64 != len {
            return Err(FsError::Object(crate::objects::ObjectError::Changed {
                key,
                etag: format!("{} bytes where {len} were expected", data.len()),
            }));
        }
        let crcs: Vec<u32> = data.chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect();
        if let Some(r) = &current {
            if !r.block_crcs.is_empty() && r.block_crcs != crcs {
                tracing::error!(ino, chunk = index, %key, "object bytes do not match the sealed checksums; refused");
                return Err(FsError::Corrupt { ino, offset: start });
            }
        }
        if let Err(e) = file.write_all_at(&data, start) {
            // A disk full of other backed chunks makes room for this one.
            if e.raw_os_error() != Some(libc::ENOSPC) || self.evict_until(t, t.cfg.evict_low)? == 0 {
                return Err(FsError::io("write fetched chunk", e));
            }
            file.write_all_at(&data, start).map_err(|e| FsError::io("write fetched chunk", e))?;
        }
        if file.metadata().map_err(|e| FsError::io("stat backing file", e))?.len() < size {
            file.set_len(size).map_err(|e| FsError::io("size backing file", e))?;
        }
        // Recorded as here only once it is on stable storage.
        file.sync_data().map_err(|e| FsError::io("sync fetched chunk", e))?;
        let version = current.as_ref().map(|r| r.version);
        self.ns.record_fetched(ino, index, version, len as u32, &crcs)?;
        t.stats.fetched_bytes.fetch_add(len, Ordering::Relaxed);
        tracing::debug!(ino, chunk = index, bytes = len, "fetched from the object store");
        Ok(ChunkRecord {
            version: version.unwrap_or(1),
            len: len as u32,
            replicas: vec![self.node_id().to_string()],
            block_crcs: crcs,
        })
    }

    /// Bytes `[from, to)` of a chunk this node holds, read block-aligned and
    /// verified: from the version file of the chunk's version when this
    /// node holds one (the backing file may hold another version), else
    /// from the backing file.
    fn read_local(&self, ino: Ino, oi: &OpenInode, part: &Part<'_>, out: &mut Vec<u8>) -> FsResult<()> {
        let (start, stop) = part.blocks();
        let mut buf = vec![0u8; (stop - start) as usize];
        let read = match self.store.open_version(ino, part.index, part.rec.version) {
            Some(f) => read_exact_at(&f, &mut buf, start - part.chunk_start),
            None => read_exact_at(&oi.file, &mut buf, start),
        };
        read.map_err(|e| FsError::io("read backing file", e))?;
        if let Err(e) = remote::verify(ino, part.rec, part.chunk_start, start, &buf) {
            if let FsError::Corrupt { offset, .. } = &e {
                self.stats.corrupt_blocks.fetch_add(1, Ordering::Relaxed);
                tracing::error!(ino, offset, "checksum mismatch reading local chunk; returning EIO");
            }
            return Err(e);
        }
        out.extend_from_slice(&buf[(part.from - start) as usize..(part.to - start) as usize]);
        Ok(())
    }

    /// Bytes `[from, to)` of a chunk whose local copy failed its checksum:
    /// from another holder (verified), else from the object store when the
    /// file is backed. Good bytes from a holder are written over the bad
    /// local ones (an object fetch rewrites the whole chunk).
    fn read_elsewhere_and_repair(
        &self,
        ino: Ino,
        oi: &OpenInode,
        layout: &Layout,
        part: &Part<'_>,
        out: &mut Vec<u8>,
    ) -> FsResult<()> {
        let (start, stop) = part.blocks();
        let (from, to) = (part.from, part.to);
        let from_peer = match self.cluster.get() {
            Some(cluster) if part.rec.replicas.iter().any(|r| r != self.node_id()) => {
                let task = remote::fetch(
                    cluster,
                    part.chunk_ref(ino),
                    Arc::new(part.rec.clone()),
                    start,
                    (stop - start) as u32,
                );
                remote::wait(cluster, task)
            }
            _ => Err(FsError::Peer("no other holder".into())),
        };
        match (from_peer, layout.object.as_deref()) {
            (Ok(data), _) => {
                let version = part.rec.version;
                let repaired = match self.store.has_version(ino, part.index, version) {
                    true => self.store.patch_version(ino, part.index, version, start - part.chunk_start, &data),
                    false => oi.file.write_all_at(&data, start),
                };
                match repaired {
                    Ok(()) => tracing::warn!(
                        ino,
                        offset = start,
                        len = data.len(),
                        "repaired a corrupt local range from a replica"
                    ),
                    Err(e) => tracing::warn!(ino, error = %e, "could not repair a corrupt local range"),
                }
                out.extend_from_slice(&data[(from - start) as usize..(to - start) as usize]);
                Ok(())
            }
            (Err(_), Some(obj)) => {
                let cs = layout.chunk_size;
                let rec = self.fetch_object_chunk(ino, &oi.file, layout.size, cs, part.index, obj, true)?;
                oi.state().forget_layout();
                self.read_local(ino, oi, &Part { rec: &rec, ..*part }, out)
            }
            (Err(e), None) => Err(e),
        }
    }

    /// The peer windows covering `[offset, end)` (and readahead beyond).
    fn remote_windows(&self, ino: Ino, oi: &OpenInode, layout: &Layout, offset: u64, end: u64) -> Vec<remote::Span> {
        let cluster = self.cluster.get().expect("a chunk held elsewhere implies a cluster");
        let cs = layout.chunk_size;
        let peer_chunk = |start: u64| {
            let index = start / cs;
            match self.locate(layout, index) {
                Source::Peer(rec) => {
                    Some((layout.chunks[index as usize].clone()?, remote::chunk_ref(ino, index, cs, rec)))
                }
                _ => None,
            }
        };
        oi.readahead.lock().windows(cluster, offset, end, layout.size, &peer_chunk)
    }

    /// The layout of `ino` as the metadata has it now.
    /// The size and the chunks are read together, past the node's cache,
    /// so an open after another node's close sees that close whole.
    fn load_layout(&self, ino: Ino) -> FsResult<Layout> {
        let (inode, records) = self.ns.layout(ino)?;
        let mut chunks: Vec<Option<Arc<ChunkRecord>>> = Vec::new();
        for (index, record) in records {
            let index = index as usize;
            if chunks.len() <= index {
                chunks.resize(index + 1, None);
            }
            chunks[index] = Some(Arc::new(record));
        }
        let object = self.backed_object(ino)?.map(Arc::new);
        Ok(Layout { size: inode.size, chunk_size: inode.chunk_size.max(1) as u64, chunks, object })
    }

    /// The layout of a sealed file open here, loaded once per open.
    pub(super) fn layout(&self, ino: Ino, oi: &OpenInode) -> FsResult<Arc<Layout>> {
        if let Some(l) = oi.state().layout.clone() {
            return Ok(l);
        }
        let epoch = oi.state().layout_epoch;
        let layout = Arc::new(self.load_layout(ino)?);
        {
            let mut st = oi.state();
            // A seal (or a fetch) that ended while this one loaded made it
            // stale: it serves this read only, and the next loads again.
            if st.layout_epoch != epoch {
                return Ok(layout);
            }
            st.layout = Some(layout.clone());
        }
        *oi.readahead.lock() = Readahead::default();
        Ok(layout)
    }

    /// Copy into `file` every chunk of `ino` this node does not hold, so
    /// that the backing file holds the whole current file before it is
    /// written or truncated here.
    pub(super) fn hydrate(&self, ino: Ino, file: &File) -> FsResult<()> {
        if self.cluster.get().is_none() && self.tier.get().is_none() {
            return Ok(());
        }
        self.fetch_missing(ino, file)
    }

    /// Copy into `file` every chunk of `ino` this node lacks: from the peers
    /// that hold it, or else from the object store (verified either way),
    /// and clear ranges that have no chunk.
    pub(crate) fn fetch_missing(&self, ino: Ino, file: &File) -> FsResult<()> {
        let layout = self.load_layout(ino)?;
        let cs = layout.chunk_size;
        let mut wanted = Vec::new();
        let mut from_object = 0u64;
        for index in 0..layout.size.div_ceil(cs) {
            let chunk_start = index * cs;
            match self.locate(&layout, index) {
                Source::Local(rec) => {
                    // Held in a version file: the backing file needs it in place.
                    if self.store.open_version(ino, index as u32, rec.version).is_some() {
                        self.store
                            .install_version(file, ino, index as u32, rec.version, chunk_start)
                            .map_err(|e| FsError::io("install a chunk version", e))?;
                    }
                }
                Source::Peer(rec) => {
                    let chunk = remote::chunk_ref(ino, index, cs, rec);
                    let rec = Arc::new(rec.clone());
                    let end = chunk_start + rec.len as u64;
                    let mut off = chunk_start;
                    while off < end {
                        wanted.push((rec.clone(), chunk, off, WINDOW.min(end - off) as u32));
                        off += WINDOW;
                    }
                }
                Source::Object(obj) => {
                    let rec = self.fetch_object_chunk(ino, file, layout.size, cs, index as u32, obj, false)?;
                    from_object += rec.len as u64;
                }
                Source::Lost => {
                    return Err(FsError::Peer(format!("chunk {index} of inode {ino} has no copy anywhere")));
                }
                Source::Hole => {
                    // A hole in the file: stale bytes from an older copy must not show through.
                    let _ = crate::blocks::punch_hole(file, chunk_start, cs);
                }
            }
        }
        if from_object > 0 {
            tracing::info!(ino, bytes = from_object, "fetched chunks from the object store before writing here");
        }
        if let Some(cluster) = self.cluster.get() {
            for batch in wanted.chunks(16) {
                let tasks: Vec<_> = batch
                    .iter()
                    .map(|(rec, chunk, off, len)| (*off, remote::fetch(cluster, *chunk, rec.clone(), *off, *len)))
                    .collect();
                for (off, task) in tasks {
                    let data = remote::wait(cluster, task)?;
                    file.write_all_at(&data, off).map_err(|e| FsError::io("write hydrated chunk", e))?;
                }
            }
            if !wanted.is_empty() {
                tracing::info!(
                    ino,
                    bytes = wanted.iter().map(|w| w.3 as u64).sum::<u64>(),
                    "fetched chunks held by peers before writing here"
                );
            }
        }
        file.set_len(layout.size).map_err(|e| FsError::io("size hydrated backing file", e))?;
        Ok(())
    }
}
