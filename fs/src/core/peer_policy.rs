//! What a peer may have this node do, by the metadata: store a chunk
//! version (its writer's copies, a copy it is recorded to hold), drop a
//! file's copies (only once the file is gone), and give up a directory
//! delegation (`--nowsync`). A certificate of the cluster alone does not
//! let a node write over another node's files.

use converged_metadata::types::Ino;

use super::Core;
use crate::error::FsResult;

impl Core {
    /// Whether a peer may store chunk version `c` here: it holds the file's
    /// write lease (a writer's replicas), or the chunk record at that
    /// version names it as a holder (background replication and staging of
    /// a copy it has). Repair and rebalance pull copies, they do not push.
    /// A certificate of the cluster alone does not let a node write over
    /// another node's files.
    pub(crate) fn peer_may_write(
        &self,
        caller: &converged_transport::Caller,
        c: &converged_transport::ChunkRef,
    ) -> Result<(), converged_transport::ServiceError> {
        let meta = |e: converged_metadata::MetaError| converged_transport::ServiceError {
            errno: libc::EAGAIN,
            msg: format!("metadata: {e}"),
        };
        self.refuse_peers_if_read_only(|| format!("write of chunk {} of inode {}", c.index, c.ino))?;
        // The change feed's word first: the lease of a file a peer writes
        // was usually taken long enough ago for its mark to have arrived.
        if self.peer_leases.holder_is(c.ino, |holder| caller.is(holder)) {
            return Ok(());
        }
        let (holder, chunk, exists) = self.ns.write_facts(c.ino, c.index).map_err(meta)?;
        if holder.is_some_and(|holder| caller.is(&holder)) {
            return Ok(());
        }
        if chunk.is_some_and(|rec| rec.version == c.version && rec.replicas.iter().any(|r| caller.is(r))) {
            return Ok(());
        }
        // A file its sender made in a directory delegated to it (--nowsync)
        // and has not committed yet: no record names it, read past the
        // cache. Its versions here are the sender's alone; one that no
        // record comes to name is removed after its grace (versions.rs).
        if !exists {
            return Ok(());
        }
        Err(converged_transport::ServiceError {
            errno: libc::EACCES,
            msg: format!(
                "write of chunk {} v{} of inode {} refused: the sender holds neither the file's write lease nor \
                 a recorded copy of that version",
                c.index, c.version, c.ino
            ),
        })
    }

    /// Whether a peer may store chunk version `c` here of a file it made in
    /// directory `dir` (`--nowsync`) and has not committed yet: `dir` is
    /// delegated to it, as this node's cache of the records knows (one
    /// read per directory, not one per file), and this node holds no copy
    /// of that version already (none is ever replaced this way). Otherwise
    /// the usual check, by the file's records.
    pub(crate) fn peer_may_write_made(
        &self,
        caller: &converged_transport::Caller,
        c: &converged_transport::ChunkRef,
        dir: Ino,
    ) -> Result<(), converged_transport::ServiceError> {
        self.refuse_peers_if_read_only(|| format!("write of chunk {} of inode {}", c.index, c.ino))?;
        let delegate = self
            .ns
            .delegate_of(dir)
            .map_err(|e| converged_transport::ServiceError { errno: libc::EAGAIN, msg: format!("metadata: {e}") })?;
        if delegate.is_some_and(|holder| caller.is(&holder)) && !self.store.has_version(c.ino, c.index, c.version) {
            return Ok(());
        }
        self.peer_may_write(caller, c)
    }

    /// A read-only node changes nothing on its disk for peers: it is not
    /// registered, so placement never names it, and copies it may still
    /// hold are dropped by its sweep once it mounts read-write.
    fn refuse_peers_if_read_only(&self, what: impl Fn() -> String) -> Result<(), converged_transport::ServiceError> {
        match self.cfg.read_only {
            false => Ok(()),
            true => Err(converged_transport::ServiceError {
                errno: libc::EROFS,
                msg: format!("{} refused: this node is mounted read-only", what()),
            }),
        }
    }

    /// Whether a peer may have this node drop its copies of `ino`: only
    /// once the file is gone from the metadata (its purge, which removed
    /// its chunk records in the same transaction, is committed: the only
    /// time a node sends a delete). Known without a read when the change
    /// feed reported the purge (usually before the request arrives); read
    /// past the node-local cache otherwise.
    pub(crate) fn peer_may_delete(&self, ino: Ino) -> Result<(), converged_transport::ServiceError> {
        self.refuse_peers_if_read_only(|| format!("delete of inode {ino}"))?;
        if self.sweep_hints().purged(ino) {
            return Ok(());
        }
        match self.ns.layout(ino) {
            Err(converged_metadata::MetaError::NotFound) => Ok(()),
            Ok(_) => Err(converged_transport::ServiceError {
                errno: libc::EACCES,
                msg: format!("delete of inode {ino} refused: the file still exists"),
            }),
            Err(e) => Err(converged_transport::ServiceError { errno: libc::EAGAIN, msg: format!("metadata: {e}") }),
        }
    }

    /// A peer is about to read or change directory `dir`: commit what this
    /// node acknowledged there and give up its delegation (`--nowsync`).
    pub(crate) fn recall_dir(&self, dir: Ino) -> FsResult<i64> {
        self.publish_owed();
        Ok(self.ns.release_dir(dir)?)
    }
}
