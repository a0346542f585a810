//! Bringing this node's copy of a file back to what the layout records,
//! after a writing session here lost its write lease, or after a crash of
//! a cluster node (see `Core::recover`): the backing file may hold writes
//! that were never published, or have lost some to a power cut. Every
//! chunk this node is recorded as holding is checked against its
//! checksums; a chunk that does not match is read again from another holder or the object store, and
//! when neither has it, this node is dropped from the chunk's holders.
//!
//! It runs with the file in the `Sealing` state (no writer, openers wait)
//! and no lock held.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use converged_metadata::types::Ino;
use converged_metadata::ChunkRecord;

use super::open::OpenInode;
use super::Core;
use crate::chunkstore::block_crcs;
use crate::error::{FsError, FsResult};
use crate::remote;

impl Core {
    /// Make the local copy of `ino` match its layout after its session
    /// (lease `epoch`) was fenced, and give the lease up if it is still
    /// held. Should that fail, the local copy is emptied: reads then go to
    /// the holders, checked, and the kernel never reads it directly.
    pub(super) fn reconcile_fenced(&self, ino: Ino, oi: &OpenInode, epoch: u64) {
        if let Err(e) = self.ns.release_lease(ino, epoch) {
            tracing::warn!(ino, error = %e, "could not release a fenced write lease");
        }
        match self.reconcile(ino, &oi.file) {
            Ok(refetched) => {
                tracing::warn!(ino, refetched, "fenced writer's local copy brought back to the published layout")
            }
            Err(e) => {
                tracing::error!(ino, error = %e, "could not reconcile a fenced writer's local copy; emptying it");
                if let Err(e) = oi.file.set_len(0) {
                    tracing::error!(ino, error = %e, "could not empty the local copy");
                }
            }
        }
    }

    /// Make `file`, the local copy of `ino`, match the layout. Returns how
    /// many chunks were read again or dropped.
    pub(super) fn reconcile(&self, ino: Ino, file: &std::fs::File) -> FsResult<usize> {
        let inode = self.ns.getattr(ino)?;
        let cs = inode.chunk_size.max(1) as u64;
        let mut fixed = 0;
        for (index, rec) in self.ns.chunks(ino)? {
            if !self.is_local(&rec) {
                continue;
            }
            let start = index as u64 * cs;
            let here = block_crcs(file, start, rec.len as u64).map_err(|e| FsError::io("checksum local copy", e))?;
            if here == rec.block_crcs {
                continue;
            }
            fixed += 1;
            match self.read_chunk_elsewhere(ino, index, &rec, start) {
                Ok(data) => {
                    file.write_all_at(&data, start).map_err(|e| FsError::io("rewrite local chunk", e))?;
                }
                Err(e) => {
                    tracing::warn!(ino, chunk = index, error = %e, "no other copy of a chunk this node overwrote; dropping this node's copy from its record");
                    self.ns.drop_holder(ino, index, rec.version)?;
                }
            }
        }
        file.set_len(inode.size).map_err(|e| FsError::io("size local copy", e))?;
        file.sync_data().map_err(|e| FsError::io("sync local copy", e))?;
        Ok(fixed)
    }

    /// The bytes of a chunk from a holder other than this node (verified),
    /// or from the object store when the file is backed.
    pub(super) fn read_chunk_elsewhere(
        &self,
        ino: Ino,
        index: u32,
        rec: &ChunkRecord,
        start: u64,
    ) -> FsResult<Vec<u8>> {
        let from_peers = match self.cluster.get() {
            Some(cluster) => {
                let chunk = converged_transport::ChunkRef { ino, index, version: rec.version, start };
                remote::fetch_chunk(cluster, chunk, Arc::new(rec.clone()))
            }
            None => Err(FsError::Peer("no cluster".into())),
        };
        match (from_peers, self.backed_object(ino)?) {
            (Ok(data), _) => Ok(data),
            (Err(_), Some(obj)) => {
                let t = self.tier.get().ok_or(FsError::Invalid("no object store"))?;
                let key = match &obj.source {
                    Some(_) => obj.key.clone(),
                    None => t.objects.home().key(&obj.key),
                };
                let data = t.objects.get_range(
                    obj.source.as_deref(),
                    &key,
                    obj.etag.as_deref(),
                    start,
                    start + rec.len as u64,
                )?;
                remote::verify(ino, rec, start, start, &data)?;
                Ok(data.to_vec())
            }
            (Err(e), None) => Err(e),
        }
    }
}
