//! File layouts: chunk records, and the sealed / unsealed state of a file.
//!
//! A file open for writing on this node is *unsealed* (a `U` key): its
//! checksums may be stale. Sealing records the size, mtime and fresh chunk
//! records in one transaction and drops the `U` key.

use crate::error::MetaResult;
use crate::kv::{Durability, KvWrite};
use crate::namespace::{decode, get_inode, put_inode, scan_all, Namespace};
use crate::schema;
use crate::types::{ChunkRecord, Ino, Inode, Timespec};

/// What [`Namespace::seal`] records.
#[derive(Debug, Clone)]
pub struct Seal {
    pub size: u64,
    pub mtime: Timespec,
    /// Chunks whose records change; others are kept.
    pub chunks: Vec<(u32, ChunkRecord)>,
    /// Whether the file stays unsealed (fsync while writers remain).
    pub keep_unsealed: bool,
}

/// Delete the layout records of chunks `first` and beyond (one range delete).
pub(crate) fn drop_chunks_from(txn: &mut (impl KvWrite + ?Sized), ino: Ino, first: u64) -> MetaResult<()> {
    let (_, end) = schema::prefix_range(&schema::chunks_of(ino));
    let Ok(first) = u32::try_from(first) else { return Ok(()) };
    Ok(txn.delete_range(&schema::chunk(ino, first), &end)?)
}

impl Namespace {
    pub fn chunks(&self, ino: Ino) -> MetaResult<Vec<(u32, ChunkRecord)>> {
        self.read(|txn| {
            scan_all(txn, &schema::chunks_of(ino))?
                .into_iter()
                .map(|(k, v)| Ok((schema::chunk_index(&k), decode(&k, &v)?)))
                .collect()
        })
    }

    /// Mark a file as being written on this node. Must be durable before the
    /// first byte of a sealed file changes, or a crash could leave old
    /// checksums over new bytes.
    pub fn mark_unsealed(&self, ino: Ino) -> MetaResult<()> {
        self.write(Durability::Durable, |txn| {
            get_inode(txn, ino)?;
            txn.put(&schema::unsealed(ino), b"");
            Ok(())
        })
    }

    /// Record size, mtime and chunk records; drop chunks past the end.
    pub fn seal(&self, ino: Ino, seal: &Seal, durability: Durability) -> MetaResult<Inode> {
        self.write(durability, |txn| {
            let mut inode = get_inode(txn, ino)?;
            let chunk_size = inode.chunk_size.max(1) as u64;
            let keep = seal.size.div_ceil(chunk_size);
            drop_chunks_from(txn, ino, keep)?;
            for (index, record) in &seal.chunks {
                if (*index as u64) < keep {
                    txn.put(&schema::chunk(ino, *index), &crate::namespace::encode(record));
                }
            }
            if inode.size != seal.size || inode.mtime != seal.mtime {
                inode.size = seal.size;
                if seal.mtime > inode.mtime {
                    inode.mtime = seal.mtime;
                    inode.ctime = inode.ctime.max(seal.mtime);
                }
                put_inode(txn, &inode);
            }
            if !seal.keep_unsealed {
                txn.delete(&schema::unsealed(ino));
            }
            Ok(inode)
        })
    }

    /// Drop the unsealed mark of files known to need no checksums (closed
    /// while still empty), many in one transaction.
    pub fn clear_unsealed(&self, inos: &[Ino]) -> MetaResult<()> {
        if inos.is_empty() {
            return Ok(());
        }
        self.write(Durability::Buffered, |txn| {
            for ino in inos {
                txn.delete(&schema::unsealed(*ino));
            }
            Ok(())
        })
    }

    /// Files that were open for writing when the daemon stopped.
    pub fn unsealed(&self) -> MetaResult<Vec<Ino>> {
        self.read(|txn| Ok(scan_all(txn, &schema::unsealed_all())?.iter().map(|(k, _)| schema::key_ino(k)).collect()))
    }
}
