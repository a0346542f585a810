//! Cluster membership: each node registers a record under a lease and keeps
//! the lease alive with heartbeats; a node whose lease expired is dead. The
//! trait knows no backend; `EtcdKv` implements it with etcd leases.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::KvResult;
use crate::types::Timespec;

/// What a node says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: String,
    /// Where peers reach its transport (`host:port`), empty when it serves none.
    pub addr: String,
    /// Bytes of the data disk, and bytes free, at the last heartbeat.
    pub capacity: u64,
    pub free: u64,
    /// Failure-domain labels (`rack=r1`).
    pub labels: BTreeMap<String, String>,
    pub started: Timespec,
    pub heartbeat: Timespec,
}

/// A node as `status` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub info: NodeInfo,
    /// Its lease is live.
    pub alive: bool,
}

/// What a heartbeat found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heartbeat {
    /// The lease was live and is renewed.
    Renewed,
    /// The lease had expired (the node was paused or cut off for longer than
    /// its TTL, and the others saw it dead): the node registered anew. Every
    /// write lease it held may have been taken over meanwhile.
    Rejoined,
}

pub trait Membership: Send + Sync {
    /// Register (or re-register) this node with a lease of `ttl`.
    fn register(&self, info: &NodeInfo, ttl: Duration) -> KvResult<()>;
    /// Renew the lease and refresh the record; re-registers when the lease
    /// had expired (a node that was cut off and came back), and says so.
    fn heartbeat(&self, info: &NodeInfo) -> KvResult<Heartbeat>;
    /// Every node that ever registered on this volume, live or dead.
    fn members(&self) -> KvResult<Vec<Member>>;
    /// Leave: the node shows as dead at once.
    fn leave(&self) -> KvResult<()>;
}
