//! Scrub: the copies this node holds are read back and checked against
//! their records' block checksums, so that a bit that rotted on the SSD is
//! found while other copies are still good, not when a reader needs it.
//!
//! A copy the record names here but that is missing altogether (a data
//! dir lost or replaced) drops this node from the record and is fetched
//! again from a holder. A bad block is rewritten from another holder (its bytes checked against
//! the same checksums) or, when none answers and the file is backed, from
//! the object store. One that nothing can repair is reported (logs,
//! metrics, `scrub --now`) and stays: reads of it go to the other holders
//! and fail only when none has it. A file being written here is skipped
//! (its backing file is ahead of its records). The scrub worker paces its
//! reads so that every local block is checked within `--scrub-period`;
//! `converged scrub --now PATH` checks files at once, through the
//! `user.converged.scrub` attribute.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use converged_metadata::types::*;
use converged_metadata::{ChunkRecord, MetaError};

use super::Core;
use crate::chunkstore::read_exact_at;
use crate::error::{FsError, FsResult};
use crate::remote;

/// What scrubbing some chunks found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scrubbed {
    pub chunks: u64,
    pub bytes: u64,
    pub bad_blocks: u64,
    pub repaired_blocks: u64,
}

impl Scrubbed {
    pub fn add(&mut self, o: Scrubbed) {
        self.chunks += o.chunks;
        self.bytes += o.bytes;
        self.bad_blocks += o.bad_blocks;
        self.repaired_blocks += o.repaired_blocks;
    }

    pub fn describe(&self) -> String {
        format!(
            "chunks={} bytes={} bad_blocks={} repaired_blocks={}\n",
            self.chunks, self.bytes, self.bad_blocks, self.repaired_blocks
        )
    }
}

impl Core {
    /// The chunks of the volume this node holds, in inode order.
    pub(crate) fn held_chunks(&self) -> FsResult<Vec<(Ino, u32)>> {
        let mut out = Vec::new();
        self.for_each_local_chunk(|ino, index, _| out.push((ino, index)))?;
        Ok(out)
    }

    /// Check every local chunk of `ino` now (and repair what can be).
    pub(crate) fn scrub_file(&self, ino: Ino) -> FsResult<Scrubbed> {
        let mut total = Scrubbed::default();
        for (index, _) in self.ns.chunks(ino)? {
            total.add(self.scrub_chunk(ino, index)?);
        }
        Ok(total)
    }

    /// Check this node's copy of chunk `index` of `ino` block by block,
    /// and rewrite bad blocks from a good source.
    pub(crate) fn scrub_chunk(&self, ino: Ino, index: u32) -> FsResult<Scrubbed> {
        let rec = self.ns.chunk(ino, index)?;
        self.scrub_recorded(ino, index, rec)
    }

    /// [`Core::scrub_chunk`] against `rec`, the chunk's record as read
    /// (with others, by the scrub worker): found rotten, the copy is
    /// checked against the record read again before anything is rewritten.
    pub(crate) fn scrub_recorded(&self, ino: Ino, index: u32, rec: Option<ChunkRecord>) -> FsResult<Scrubbed> {
        let mut s = Scrubbed::default();
        let Some(rec) = rec else { return Ok(s) };
        if !self.is_local(&rec) || self.rewrites_backing_file(ino) {
            return Ok(s);
        }
        let inode = match self.ns.getattr(ino) {
            Ok(i) => i,
            Err(MetaError::NotFound) => return Ok(s),
            Err(e) => return Err(e.into()),
        };
        let cs = inode.chunk_size.max(1) as u64;
        let start = index as u64 * cs;
        // The version as recorded: its version file, or the backing file.
        let (file, base) = match self.store.open_version(ino, index, rec.version) {
            Some(f) => (f, 0),
            None => match File::open(self.store.path(ino)) {
                Ok(f) => (f, start),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // Missing: acted on only as the record stands now.
                    return match self.ns.chunk(ino, index)? {
                        Some(now) if now == rec => self.copy_missing(ino, index, &rec),
                        _ => Ok(s),
                    };
                }
                Err(e) => return Err(FsError::io("open backing file to scrub", e)),
            },
        };
        let mut data = vec![0u8; rec.len as usize];
        read_exact_at(&file, &mut data, base).map_err(|e| FsError::io("read chunk to scrub", e))?;
        s.chunks = 1;
        s.bytes = data.len() as u64;
        let bs = BLOCK_SIZE as usize;
        let bad: Vec<usize> = data
            .chunks(bs)
            .enumerate()
            .filter(|(i, block)| match rec.block_crcs.get(*i) {
                Some(crc) => crc32c::crc32c(block) != *crc,
                None => block.iter().any(|b| *b != 0),
            })
            .map(|(i, _)| i)
            .collect();
        if bad.is_empty() {
            return Ok(s);
        }
        // Found rotten; the record may have moved on since it was read.
        if self.ns.chunk(ino, index)?.is_none_or(|now| now.version != rec.version) || self.rewrites_backing_file(ino) {
            return Ok(Scrubbed { chunks: 1, bytes: s.bytes, ..Default::default() });
        }
        s.bad_blocks = bad.len() as u64;
        tracing::error!(ino, chunk = index, blocks = ?bad, "scrub found blocks that fail their checksum");
        for i in bad {
            let at = (i * bs) as u64;
            let len = (rec.len as u64 - at).min(bs as u64) as u32;
            match self.good_block(ino, index, cs, &rec, at, len) {
                // Written only while the file is held closed here and still
                // at the scrubbed version: a writer that opened meanwhile
                // owns the backing file, and its bytes are not overwritten.
                Ok(good) => match self.while_closed(ino, || {
                    match self.ns.chunk(ino, index)?.is_some_and(|now| now.version == rec.version) {
                        true => rewrite(self, ino, index, rec.version, start, at, &good)
                            .map(|()| true)
                            .map_err(|e| FsError::io("rewrite a bad block", e)),
                        false => Ok(false),
                    }
                }) {
                    Some(Ok(true)) => {
                        s.repaired_blocks += 1;
                        tracing::warn!(ino, chunk = index, offset = start + at, "scrub repaired a block");
                    }
                    Some(Ok(false)) => {}
                    Some(Err(e)) => tracing::error!(ino, chunk = index, error = %e, "scrub could not rewrite a block"),
                    None => tracing::info!(
                        ino,
                        chunk = index,
                        "file opened during the scrub; the block is repaired next time"
                    ),
                },
                Err(e) => {
                    tracing::error!(ino, chunk = index, offset = start + at, error = %e, "no good copy of a bad block")
                }
            }
        }
        Ok(s)
    }

    /// The record names this node, but its copy is gone (a data dir lost or
    /// replaced): this node is dropped from the record, then copies the
    /// chunk back from a holder (or repair copies it elsewhere). Reported
    /// as all its blocks bad.
    fn copy_missing(&self, ino: Ino, index: u32, rec: &ChunkRecord) -> FsResult<Scrubbed> {
        let blocks = (rec.len as u64).div_ceil(BLOCK_SIZE as u64);
        let elsewhere = rec.replicas.iter().any(|r| r != self.node_id()) || self.backed_object(ino)?.is_some();
        if elsewhere {
            tracing::error!(
                ino,
                chunk = index,
                "scrub: the copy the record names here is missing; dropping this node from the record and copying it again"
            );
            self.ns.drop_holder(ino, index, rec.version)?;
            // Copied back here at once from a holder or the object; failing
            // that, repair finds the chunk short.
            if let Err(e) = self.stage_chunk(ino, index) {
                tracing::warn!(ino, chunk = index, error = %e, "could not copy a missing chunk back; repair will");
            }
        } else {
            tracing::error!(ino, chunk = index, "scrub: the only copy of this chunk, recorded here, is missing");
        }
        Ok(Scrubbed { chunks: 1, bytes: 0, bad_blocks: blocks, repaired_blocks: 0 })
    }

    /// Good bytes of one block: from another holder, else from the object.
    fn good_block(&self, ino: Ino, index: u32, cs: u64, rec: &ChunkRecord, at: u64, len: u32) -> FsResult<Vec<u8>> {
        let start = index as u64 * cs;
        if let Some(cluster) = self.cluster.get() {
            if rec.replicas.iter().any(|r| r != self.node_id()) {
                let chunk = remote::chunk_ref(ino, index as u64, cs, rec);
                let task = remote::fetch(cluster, chunk, Arc::new(rec.clone()), start + at, len);
                if let Ok(data) = remote::wait(cluster, task) {
                    return Ok(data);
                }
            }
        }
        if let (Some(t), Some(obj)) = (self.tier.get(), self.backed_object(ino)?) {
            let key = match &obj.source {
                Some(_) => obj.key.clone(),
                None => t.objects.home().key(&obj.key),
            };
            let from = start + at;
            let data =
                t.objects.get_range(obj.source.as_deref(), &key, obj.etag.as_deref(), from, from + len as u64)?;
            remote::verify(ino, rec, start, from, &data)?;
            return Ok(data.to_vec());
        }
        Err(FsError::Peer("no other holder answered and the file is not backed".into()))
    }
}

/// Write good bytes over a bad block of this node's copy of a chunk
/// version (`at` bytes into the chunk), on stable storage when this returns.
fn rewrite(
    core: &Core,
    ino: Ino,
    index: u32,
    version: u64,
    chunk_start: u64,
    at: u64,
    data: &[u8],
) -> std::io::Result<()> {
    if core.store.has_version(ino, index, version) {
        return core.store.patch_version(ino, index, version, at, data);
    }
    let f = std::fs::OpenOptions::new().write(true).open(core.store.path(ino))?;
    f.write_all_at(data, chunk_start + at)?;
    f.sync_data()
}
