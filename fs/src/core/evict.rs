//! Eviction: when the data disk is fuller than the high watermark, drop
//! local copies of backed chunks (their bytes are in the object store),
//! least recently read first, until it is below the low watermark. A later
//! read fetches them back. Chunks of files open on this node, and of files
//! not backed, are never evicted.

use std::sync::atomic::Ordering;

use converged_metadata::types::{Ino, TierState};

use crate::core::Core;
use crate::error::{FsError, FsResult};
use crate::tier::Tiering;

/// Used fraction of a filesystem with `avail` of `total` bytes free.
fn used_fraction(avail: u64, total: u64) -> f64 {
    if total == 0 {
        return 0.0;
    }
    1.0 - avail as f64 / total as f64
}

/// Used fraction of the filesystem holding `path`.
fn disk_usage(path: &std::path::Path) -> FsResult<f64> {
    let (avail, total) = crate::blocks::disk_space(path).map_err(|e| FsError::io("statvfs data dir", e))?;
    Ok(used_fraction(avail, total))
}

/// Free space below which writers go through the daemon rather than
/// kernel passthrough: about a second of NVMe writes, the evictor's period.
const PASSTHROUGH_WRITE_HEADROOM: u64 = 8 << 30;

impl Core {
    /// Whether a writer opened now may write through kernel passthrough. A
    /// write the kernel passes to the backing file cannot be retried after
    /// making room, so near a full disk (above the high watermark, or less
    /// free space than a burst of writes fills before the evictor runs)
    /// writes go through the daemon, which evicts and retries on ENOSPC.
    pub(crate) fn room_for_passthrough_writes(&self, t: &Tiering) -> bool {
        match crate::blocks::disk_space(self.data_dir()) {
            Ok((avail, total)) => {
                avail >= PASSTHROUGH_WRITE_HEADROOM && used_fraction(avail, total) <= t.cfg.evict_high
            }
            Err(_) => false,
        }
    }

    /// One step of the evictor: when the disk is fuller than the high
    /// watermark, evict down to the low one. Returns the bytes freed.
    pub(crate) fn evict_step(&self) -> FsResult<u64> {
        let Some(t) = self.tiering().cloned() else { return Ok(0) };
        if disk_usage(self.data_dir())? > t.cfg.evict_high {
            return self.evict_until(&t, t.cfg.evict_low);
        }
        Ok(0)
    }

    /// Evict backed chunks, least recently read first, until the disk is
    /// at most `target` full (or nothing more can go). Returns bytes freed.
    pub fn evict_until(&self, t: &Tiering, target: f64) -> FsResult<u64> {
        let mut backed: std::collections::HashMap<Ino, bool> = Default::default();
        let mut candidates = Vec::new();
        self.for_each_local_chunk(|ino, index, rec| candidates.push((ino, index, rec.version, rec.len)))?;
        // Only files whose object is where the record says, as recorded:
        // backed (not re-keying or uploading), and its ETag checked with the
        // store before the first chunk of the file goes.
        candidates.retain(|(ino, ..)| *backed.entry(*ino).or_insert_with(|| self.object_verified(t, *ino)));
        // Never read since this daemon started counts as oldest.
        candidates.sort_by_key(|(ino, index, ..)| (t.access.get(&(*ino, *index)).map_or(0, |a| *a), *ino, *index));
        let mut freed = 0u64;
        let mut files = std::collections::HashSet::new();
        for (ino, index, version, len) in candidates {
            if disk_usage(self.data_dir())? <= target {
                break;
            }
            // Opens of the file wait while its chunk goes: one that had
            // loaded the layout before could read the hole through passthrough.
            let Some(evicted) = self.while_closed(ino, || self.evict_chunk(ino, index, version)) else { continue };
            if evicted? {
                freed += len as u64;
                files.insert(ino);
                t.stats.evicted_bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
        }
        if freed > 0 {
            tracing::info!(bytes = freed, files = files.len(), "evicted backed chunks from the data disk");
        }
        Ok(freed)
    }

    /// Whether `ino` is backed and the store still holds its object as
    /// recorded (same ETag). An object replaced behind converged's back, or
    /// by an upload that lost to a newer seal, makes the file dirty again:
    /// it is uploaded anew before any of its chunks may be evicted.
    fn object_verified(&self, t: &Tiering, ino: Ino) -> bool {
        let ns = self.namespace();
        let Some(rec) = ns.tier(ino).ok().flatten().filter(|r| r.state == TierState::Backed) else { return false };
        let key = match &rec.source {
            Some(_) => rec.key.clone(),
            None => t.objects.home().key(&rec.key),
        };
        match t.objects.head(rec.source.as_deref(), &key) {
            Ok((_, _, etag)) if etag == rec.etag => true,
            Ok((_, _, etag)) => {
                tracing::warn!(ino, %key, recorded = ?rec.etag, found = ?etag, "object changed in the store; the file is uploaded again before anything is evicted");
                if let Err(e) = ns.object_changed(ino, rec.etag.as_deref()) {
                    tracing::warn!(ino, error = %e, "could not mark the file dirty");
                }
                if let Some(t) = self.tiering() {
                    t.enqueue(ino, std::time::Duration::ZERO);
                }
                false
            }
            Err(e) => {
                tracing::debug!(ino, error = %e, "cannot check the object; not evicting the file");
                false
            }
        }
    }

    /// Record that this node no longer holds the chunk, then free its bytes
    /// (in that order: a reader never finds a recorded copy that is a hole).
    fn evict_chunk(&self, ino: Ino, index: u32, version: u64) -> FsResult<bool> {
        if !self.namespace().drop_replica(ino, index, version)? {
            return Ok(false);
        }
        // A copy held in a version file goes at once (the disk is full).
        let store = self.chunk_store();
        for (_, v) in store.versions_of(ino).into_iter().filter(|(i, v)| *i == index && *v <= version) {
            store.remove_version(ino, index, v).map_err(|e| FsError::io("remove evicted chunk version", e))?;
        }
        let inode = self.namespace().getattr(ino)?;
        let cs = inode.chunk_size.max(1) as u64;
        let file = match std::fs::OpenOptions::new().write(true).open(self.chunk_store().path(ino)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
            Err(e) => return Err(FsError::io("open backing file to evict", e)),
        };
        crate::blocks::punch_hole(&file, index as u64 * cs, cs).map_err(|e| FsError::io("punch evicted chunk", e))?;
        Ok(true)
    }
}
