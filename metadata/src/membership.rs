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

/// A node's record is written again at a heartbeat only when it changed in
/// a way others act on (see [`NodeInfo::worth_recording`]), or this long
/// after it was last written: every write of it reaches every node's watch,
/// so a record rewritten at each heartbeat costs the cluster a number of
/// watch events that grows with the square of its size.
pub const RECORD_EVERY: Duration = Duration::from_secs(300);

impl NodeInfo {
    /// Whether this node's record, last written as `recorded`, is worth
    /// writing again now: its address, capacity, labels or start changed,
    /// or its free space moved by 1 % of its capacity (what placement
    /// weighs), or more. The heartbeat time alone is not.
    pub fn worth_recording(&self, recorded: &NodeInfo) -> bool {
        let moved = self.free.abs_diff(recorded.free);
        self.addr != recorded.addr
            || self.capacity != recorded.capacity
            || self.labels != recorded.labels
            || self.started != recorded.started
            || moved >= (self.capacity / 100).max(1)
    }
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
    /// Renew the lease, and write the record again when it is worth it
    /// ([`NodeInfo::worth_recording`], or [`RECORD_EVERY`]); re-registers
    /// when the lease had expired (a node that was cut off and came back),
    /// and says so.
    fn heartbeat(&self, info: &NodeInfo) -> KvResult<Heartbeat>;
    /// Every node that ever registered on this volume, live or dead.
    fn members(&self) -> KvResult<Vec<Member>>;
    /// Leave: the node shows as dead at once.
    fn leave(&self) -> KvResult<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(free: u64) -> NodeInfo {
        NodeInfo {
            id: "n1".into(),
            addr: "127.0.0.1:7000".into(),
            capacity: 1000 << 30,
            free,
            labels: BTreeMap::from([("rack".to_string(), "r1".to_string())]),
            started: Timespec { sec: 100, nsec: 0 },
            heartbeat: Timespec { sec: 100, nsec: 0 },
        }
    }

    #[test]
    fn a_record_is_written_again_only_for_what_others_act_on() {
        let recorded = info(500 << 30);
        let mut now = info(500 << 30);
        now.heartbeat = Timespec { sec: 200, nsec: 0 };
        assert!(!now.worth_recording(&recorded), "a later heartbeat alone");
        now.free = (500 << 30) - (9 << 30);
        assert!(!now.worth_recording(&recorded), "free space moved by less than 1 % of capacity");
        now.free = (500 << 30) - (10 << 30);
        assert!(now.worth_recording(&recorded), "free space moved by 1 % of capacity");
        let mut moved = info(500 << 30);
        moved.addr = "127.0.0.1:7001".into();
        assert!(moved.worth_recording(&recorded), "a new address");
        let mut relabelled = info(500 << 30);
        relabelled.labels.insert("zone".into(), "z2".into());
        assert!(relabelled.worth_recording(&recorded), "new labels");
    }
}
