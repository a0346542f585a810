//! Stage (warm a file onto the SSDs ahead of reading it) and the read-only
//! views of the object tier that `converged status PATH` prints, served as
//! virtual extended attributes so they work through any node's mount.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use converged_metadata::types::*;

use crate::core::Core;
use crate::error::{FsError, FsResult};

impl Core {
    /// Fetch every chunk of `ino` this node lacks (from a peer holding it,
    /// else from the object store), then, in a cluster, copy chunks to
    /// peers until each has `replicas` copies. Chunks already in place are
    /// skipped, so staging again resumes where an interrupted run stopped.
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
        let file = self.chunk_store().open_backing(ino)?;
        self.fetch_missing(ino, &file)?;
        if self.cluster().is_some() && replicas > 1 {
            self.replicate_file_to(ino, Some(replicas as usize))?;
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
