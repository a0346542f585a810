//! Stage (warm a file onto the SSDs ahead of reading it) and the read-only
//! views of the object tier that `converged status PATH` prints, served as
//! virtual extended attributes so they work through any node's mount.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use converged_metadata::types::*;

use std::os::unix::fs::FileExt;

use crate::core::Core;
use crate::error::{FsError, FsResult};

/// Stage requests to other nodes in flight at once for one file.
const REMOTE_STAGES_PER_FILE: usize = 4;

impl Core {
    /// Stage `ino`: on a single node, fetch every chunk it lacks from the
    /// object store. In a cluster, each chunk goes to the `replicas` nodes
    /// placement ranks first for it, and each of them fetches it itself
    /// (this node directly, the others on request, in parallel), so the
    /// object store is read once per copy, spread over the cluster. Chunks
    /// already in place are skipped, so staging again resumes where an
    /// interrupted run stopped.
    pub(crate) fn stage_file(&self, ino: Ino, replicas: u32) -> FsResult<()> {
        let inode = self.namespace().getattr(ino)?;
        match inode.kind {
            FileKind::Regular => {}
            FileKind::Directory => return Err(converged_metadata::MetaError::IsDir.into()),
            _ => return Ok(()),
        }
        if self.is_being_written(ino) {
            // Every chunk of a file being written here is here.
            return Ok(());
        }
        let Some(cluster) = self.cluster().cloned() else {
            let file = self.chunk_store().open_backing(ino)?;
            return self.fetch_missing(ino, &file);
        };
        let cs = inode.chunk_size.max(1) as u64;
        let records: std::collections::HashMap<u32, converged_metadata::ChunkRecord> =
            self.namespace().chunks(ino)?.into_iter().collect();
        let backed = self.backed_object(ino)?.is_some();
        let (mut here, mut there) = (Vec::new(), Vec::new());
        for index in 0..inode.size.div_ceil(cs) as u32 {
            let holders = records.get(&index).map(|r| r.replicas.clone()).unwrap_or_default();
            if !records.contains_key(&index) && !backed {
                continue; // a hole
            }
            let mut need = (replicas as usize).saturating_sub(holders.len());
            for target in cluster.stage_targets(ino, index, replicas as usize + holders.len()) {
                if need == 0 {
                    break;
                }
                if holders.contains(&target.id) {
                    continue;
                }
                need -= 1;
                if target.id == cluster.node() {
                    here.push(index);
                } else {
                    there.push((target, index));
                }
            }
        }
        let mut first_err = None;
        // Other nodes' shares, a few at a time per file, while this node fetches its own.
        for batch in there.chunks(REMOTE_STAGES_PER_FILE) {
            let tasks: Vec<_> = batch
                .iter()
                .map(|(node, index)| {
                    (node.id.clone(), cluster.spawn(cluster.clone().stage_on(node.clone(), ino, *index)))
                })
                .collect();
            if let Some(index) = here.pop() {
                if let Err(e) = self.stage_chunk(ino, index) {
                    first_err.get_or_insert(e);
                }
            }
            for (node, task) in tasks {
                let r = cluster.block_on(task).unwrap_or_else(|e| Err(FsError::Peer(e.to_string())));
                if let Err(e) = r {
                    tracing::warn!(ino, %node, error = %e, "a node could not stage its share");
                    first_err.get_or_insert(e);
                }
            }
        }
        for index in here {
            if let Err(e) = self.stage_chunk(ino, index) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Bring chunk `index` of `ino` onto this node's SSD and record the copy:
    /// from a peer that holds it, else from the object store. A peer's stage
    /// request runs this.
    pub(crate) fn stage_chunk(&self, ino: Ino, index: u32) -> FsResult<()> {
        let inode = self.namespace().getattr(ino)?;
        if inode.kind != FileKind::Regular || self.is_being_written(ino) {
            return Ok(());
        }
        let cs = inode.chunk_size.max(1) as u64;
        let rec = self.namespace().chunk(ino, index)?;
        if rec.as_ref().is_some_and(|r| self.is_local(r)) {
            return Ok(());
        }
        let file = self.chunk_store().open_backing(ino)?;
        let backed = self.backed_object(ino)?;
        match (rec, backed, self.cluster()) {
            (Some(r), backed, Some(cluster)) if !r.replicas.is_empty() => {
                let start = index as u64 * cs;
                let chunk = crate::remote::chunk_ref(ino, index as u64, cs, &r);
                let data = match crate::remote::fetch_chunk(cluster, chunk, std::sync::Arc::new(r.clone())) {
                    Ok(data) => data,
                    // No live holder has it whole: the object does, when the file is backed.
                    Err(e) => match backed {
                        Some(obj) => {
                            tracing::info!(ino, chunk = index, error = %e, "no holder answered; copying the chunk from the object store");
                            self.fetch_object_chunk(ino, &file, inode.size, cs, index, &obj, false)?;
                            return Ok(());
                        }
                        None => return Err(e),
                    },
                };
                file.write_all_at(&data, start).map_err(|e| FsError::io("write staged chunk", e))?;
                if file.metadata().map_err(|e| FsError::io("stat backing file", e))?.len() < inode.size {
                    file.set_len(inode.size).map_err(|e| FsError::io("size backing file", e))?;
                }
                file.sync_data().map_err(|e| FsError::io("sync staged chunk", e))?;
                if !self.namespace().add_replicas(ino, index, r.version, &[cluster.node().to_string()])?
                    && self.namespace().chunk(ino, index)?.is_none_or(|now| now.version != r.version)
                {
                    return Err(FsError::Peer(format!("chunk {index} of inode {ino} changed while it was copied")));
                }
            }
            (_, Some(obj), _) => {
                self.fetch_object_chunk(ino, &file, inode.size, cs, index, &obj, false)?;
            }
            (Some(_), None, _) => {
                return Err(FsError::Peer(format!("chunk {index} of inode {ino} has no copy to stage from")));
            }
            (None, None, _) => {}
        }
        Ok(())
    }

    /// `user.converged.tier`: the backfill state and where the bytes are.
    pub(crate) fn describe_tier(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let inode = self.namespace().getattr(ino)?;
        let mut out = String::new();
        if inode.kind == FileKind::Regular {
            let cs = inode.chunk_size.max(1) as u64;
            let total = inode.size.div_ceil(cs);
            let chunks = self.namespace().chunks(ino)?;
            let here = chunks.iter().filter(|(_, r)| self.is_local(r)).count();
            let object_only = total as usize - chunks.iter().filter(|(_, r)| !r.replicas.is_empty()).count();
            match self.namespace().tier(ino)? {
                None if self.tiering().is_none() => out.push_str("state=none (no object store)"),
                None => out.push_str("state=dirty (not sealed yet)"),
                Some(rec) => {
                    let writing = self.namespace().writer(ino)?.is_some();
                    let name = match rec.state {
                        TierState::Backed if !writing && here > 0 => "backed (evictable)",
                        TierState::Backed if object_only == total as usize && total > 0 => "backed (evicted)",
                        s => s.name(),
                    };
                    let _ = write!(out, "state={name} generation={}", rec.generation);
                    if !rec.key.is_empty() {
                        let key = match (&rec.source, self.tiering()) {
                            (Some(src), _) => format!("{src}/{}", rec.key),
                            (None, Some(t)) => format!("{}/{}", t.objects.home().base, t.objects.home().key(&rec.key)),
                            (None, None) => rec.key.clone(),
                        };
                        let _ = write!(out, " object={key}");
                    }
                    if let Some(e) = &rec.etag {
                        let _ = write!(out, " etag={e}");
                    }
                    if matches!(rec.state, TierState::Dirty | TierState::Uploading) {
                        let _ = write!(out, " uploader={}", rec.node);
                    }
                }
            }
            let _ = write!(out, " chunks={total} local={here} object_only={object_only}");
        } else {
            out.push_str("state=none (not a regular file)");
        }
        out.push('\n');
        Ok(out.into_bytes())
    }

    /// `user.converged.layout`: one line per chunk: index, version, length,
    /// and the nodes holding it (`object` when only the object store does).
    pub(crate) fn describe_layout(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let mut out = String::new();
        for (index, rec) in self.namespace().chunks(ino)? {
            let holders = if rec.replicas.is_empty() { "object".to_string() } else { rec.replicas.join(",") };
            let _ = writeln!(out, "{index} v{} {} {holders}", rec.version, rec.len);
        }
        Ok(out.into_bytes())
    }

    /// `user.converged.backfill`: this node's backlog and counters.
    pub(crate) fn describe_backfill(&self) -> FsResult<Vec<u8>> {
        let t = self.tiering().ok_or(FsError::Meta(converged_metadata::MetaError::NoAttr))?;
        let b = t.backlog();
        let s = &t.stats;
        let mut out = format!(
            "store={} backlog_files={} uploaded_files={} uploaded_bytes={} failures={} rekeyed={} deleted={} fetched_bytes={} evicted_bytes={}",
            t.objects.home().url(),
            b.files,
            s.uploaded_files.load(Ordering::Relaxed),
            s.uploaded_bytes.load(Ordering::Relaxed),
            s.failures.load(Ordering::Relaxed),
            s.rekeyed.load(Ordering::Relaxed),
            s.deleted.load(Ordering::Relaxed),
            s.fetched_bytes.load(Ordering::Relaxed),
            s.evicted_bytes.load(Ordering::Relaxed),
        );
        if let Some(r) = b.retry_in {
            let _ = write!(out, " retry_in={:.1}s", r.as_secs_f64());
        }
        if let Some(e) = b.last_error {
            let _ = write!(out, " last_error={e:?}");
        }
        out.push('\n');
        Ok(out.into_bytes())
    }
}
