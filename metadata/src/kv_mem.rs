//! `MemKv`: an in-memory engine for unit tests and reference models.
//! Writers run one at a time under a mutex; nothing survives the process.
//!
//! [`MemKv::new`] is a single node's engine, with no membership.
//! [`MemKv::cluster`] is one store shared by several in-process nodes: each
//! takes its own handle ([`MemKv::node_handle`]) and registers through it,
//! as each node of a real cluster has its own etcd client and lease. Leases
//! are measured with [`Instant`]; one that ran out drops its node's live
//! record (`L` key) before the next transaction starts, as etcd deletes the
//! keys of an expired lease.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::kv::{merge_pending, Durability, KvEngine, KvError, KvRead, KvResult, KvWrite, PendingWrites};
use crate::membership::{Heartbeat, Member, Membership, NodeInfo};
use crate::schema;

type Map = BTreeMap<Vec<u8>, Vec<u8>>;

/// Clones share the data, and the registration of the node they are a
/// client of (see [`MemKv::node_handle`]).
#[derive(Default, Clone)]
pub struct MemKv {
    map: Arc<Mutex<Map>>,
    // Serializes write transactions; reads take `map` briefly.
    writer: Arc<Mutex<()>>,
    /// Membership, when the store is shared by several nodes.
    cluster: Option<MemMembers>,
    /// The most keys one write transaction may carry (etcd's
    /// `--max-txn-ops`), when set by [`MemKv::with_txn_limit`].
    txn_limit: Option<usize>,
}

/// The membership of a shared store, as one node's client sees it.
#[derive(Clone)]
struct MemMembers {
    /// When each registered node's lease runs out (shared by every handle).
    leases: Arc<Mutex<HashMap<String, Instant>>>,
    /// The node this handle registered, and its lease's TTL.
    own: Arc<Mutex<Option<(String, Duration)>>>,
}

impl MemKv {
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store shared by several in-process nodes, with membership:
    /// each node takes its own [`MemKv::node_handle`] and registers through
    /// it. A namespace over it is clustered: marks (write leases, orphans)
    /// belong to the node that wrote them.
    pub fn cluster() -> Self {
        MemKv { cluster: Some(MemMembers { leases: Arc::default(), own: Arc::default() }), ..Self::default() }
    }

    /// The same store, refusing write transactions of more than `ops` keys
    /// as etcd refuses those past its `--max-txn-ops`: what splits large
    /// changes into several commits is then exercised.
    pub fn with_txn_limit(self, ops: usize) -> Self {
        MemKv { txn_limit: Some(ops), ..self }
    }

    /// Another node's client of the same store: the same data and members,
    /// and a registration of its own (`register` and `leave` through it act
    /// for that node only). On a single-node store ([`MemKv::new`]) it is a
    /// plain clone, without membership.
    pub fn node_handle(&self) -> MemKv {
        MemKv {
            cluster: self.cluster.as_ref().map(|c| MemMembers { leases: c.leases.clone(), own: Arc::default() }),
            ..self.clone()
        }
    }

    /// End `node`'s lease now, as if it had stopped heartbeating for its
    /// whole TTL (a node that died or was cut off). Its next heartbeat
    /// registers it again. Does nothing on a single-node store.
    pub fn expire_lease(&self, node: &str) {
        if let Some(c) = &self.cluster {
            if let Some(deadline) = c.leases.lock().get_mut(node) {
                *deadline = Instant::now();
            }
        }
        self.expire_leases();
    }

    /// Drop the live records of nodes whose lease ran out.
    fn expire_leases(&self) {
        let Some(c) = &self.cluster else { return };
        let now = Instant::now();
        let mut leases = c.leases.lock();
        let expired: Vec<String> = leases.iter().filter(|(_, d)| **d <= now).map(|(n, _)| n.clone()).collect();
        if expired.is_empty() {
            return;
        }
        let mut map = self.map.lock();
        for node in expired {
            leases.remove(&node);
            map.remove(&schema::live_node(&node));
        }
    }

    fn members_of(&self) -> KvResult<&MemMembers> {
        self.cluster.as_ref().ok_or_else(|| KvError::backend("a single-node memory store has no membership"))
    }

    /// Write `info` as known and live, its lease ending `ttl` from now.
    fn put_records(&self, c: &MemMembers, info: &NodeInfo, ttl: Duration) -> KvResult<()> {
        let value = postcard::to_allocvec(info).map_err(KvError::backend)?;
        // Between write transactions, as an etcd commit would be.
        let _writer = self.writer.lock();
        let mut leases = c.leases.lock();
        let mut map = self.map.lock();
        map.insert(schema::known_node(&info.id), value.clone());
        map.insert(schema::live_node(&info.id), value);
        leases.insert(info.id.clone(), Instant::now() + ttl);
        Ok(())
    }
}

fn scan_map(map: &Map, start: &[u8], end: &[u8], limit: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    map.range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
        .take(limit)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

struct MemRead<'a> {
    map: &'a Mutex<Map>,
}

impl KvRead for MemRead<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        Ok(self.map.lock().get(key).cloned())
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(scan_map(&self.map.lock(), start, end, limit))
    }
}

struct MemWrite<'a> {
    map: &'a Mutex<Map>,
    _writer: MutexGuard<'a, ()>,
    pending: PendingWrites,
    limit: Option<usize>,
}

impl KvRead for MemWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        Ok(self.map.lock().get(key).cloned())
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let base = scan_map(&self.map.lock(), start, end, usize::MAX);
        Ok(merge_pending(base, &self.pending, start, end, limit))
    }
}

impl KvWrite for MemWrite<'_> {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.pending.insert(key.to_vec(), Some(value.to_vec()));
    }
    fn delete(&mut self, key: &[u8]) {
        self.pending.insert(key.to_vec(), None);
    }
    fn commit(self: Box<Self>, _durability: Durability) -> KvResult<()> {
        if let Some(limit) = self.limit.filter(|l| self.pending.len() > *l) {
            return Err(KvError::backend(format!(
                "too many operations in txn request: {} past the limit of {limit}",
                self.pending.len()
            )));
        }
        let mut map = self.map.lock();
        for (k, v) in self.pending {
            match v {
                Some(v) => map.insert(k, v),
                None => map.remove(&k),
            };
        }
        Ok(())
    }
}

impl KvEngine for MemKv {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        self.expire_leases();
        Ok(Box::new(MemRead { map: &self.map }))
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        let writer = self.writer.lock();
        self.expire_leases();
        Ok(Box::new(MemWrite { map: &self.map, _writer: writer, pending: BTreeMap::new(), limit: self.txn_limit }))
    }
    fn txn_limit(&self) -> Option<usize> {
        self.txn_limit
    }
    fn sync(&self) -> KvResult<()> {
        Ok(())
    }
    fn membership(&self) -> Option<&dyn Membership> {
        self.cluster.as_ref().map(|_| self as &dyn Membership)
    }
}

impl Membership for MemKv {
    fn register(&self, info: &NodeInfo, ttl: Duration) -> KvResult<()> {
        let c = self.members_of()?;
        self.put_records(c, info, ttl)?;
        *c.own.lock() = Some((info.id.clone(), ttl));
        Ok(())
    }

    /// Renews the lease, or registers anew when it ran out: either way the
    /// node is live for another TTL.
    fn heartbeat(&self, info: &NodeInfo) -> KvResult<Heartbeat> {
        let c = self.members_of()?;
        let Some((_, ttl)) = c.own.lock().clone() else {
            return Err(KvError::backend("heartbeat before register"));
        };
        self.expire_leases();
        let lapsed = !c.leases.lock().contains_key(&info.id);
        self.put_records(c, info, ttl)?;
        Ok(if lapsed { Heartbeat::Rejoined } else { Heartbeat::Renewed })
    }

    fn members(&self) -> KvResult<Vec<Member>> {
        self.members_of()?;
        self.expire_leases();
        let decode = |v: &[u8]| postcard::from_bytes::<NodeInfo>(v).map_err(KvError::backend);
        let map = self.map.lock();
        let range = |p: &[u8]| {
            let (s, e) = schema::prefix_range(p);
            scan_map(&map, &s, &e, usize::MAX)
        };
        let live: BTreeMap<Vec<u8>, Vec<u8>> =
            range(schema::LIVE_NODES).into_iter().map(|(k, v)| (k[1..].to_vec(), v)).collect();
        let mut out = Vec::new();
        for (k, v) in range(schema::KNOWN_NODES) {
            match live.get(&k[1..]) {
                Some(lv) => out.push(Member { info: decode(lv)?, alive: true }),
                None => out.push(Member { info: decode(&v)?, alive: false }),
            }
        }
        Ok(out)
    }

    fn leave(&self) -> KvResult<()> {
        let c = self.members_of()?;
        let Some((node, _)) = c.own.lock().take() else { return Ok(()) };
        let _writer = self.writer.lock();
        c.leases.lock().remove(&node);
        self.map.lock().remove(&schema::live_node(&node));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{FileKind, NewNode, Timespec, ROOT_INO};
    use crate::{MetaError, Namespace};

    fn info(id: &str) -> NodeInfo {
        let now = Timespec::now();
        NodeInfo {
            id: id.into(),
            addr: format!("127.0.0.1:{}", 7400 + id.len()),
            capacity: 100,
            free: 50,
            labels: Default::default(),
            started: now,
            heartbeat: now,
        }
    }

    /// (node id, alive) of every member, by id.
    fn members(kv: &MemKv) -> Vec<(String, bool)> {
        let mut m: Vec<_> =
            kv.membership().unwrap().members().unwrap().into_iter().map(|m| (m.info.id, m.alive)).collect();
        m.sort();
        m
    }

    fn live(kv: &MemKv, id: &str) -> bool {
        kv.read_txn().unwrap().get(&schema::live_node(id)).unwrap().is_some()
    }

    const LONG: Duration = Duration::from_secs(600);

    #[test]
    fn a_plain_store_has_no_membership() {
        let kv = MemKv::new();
        assert!(kv.membership().is_none());
        assert!(kv.node_handle().membership().is_none());
        assert!(Membership::register(&kv, &info("a"), LONG).is_err());
        let ns = Namespace::open(Arc::new(kv), 0, 0).unwrap();
        assert!(!ns.clustered);
    }

    #[test]
    fn handles_share_data_and_members() {
        let a = MemKv::cluster();
        let b = a.node_handle();
        let mut w = a.write_txn().unwrap();
        w.put(b"x", b"1");
        w.commit(Durability::Buffered).unwrap();
        assert_eq!(b.read_txn().unwrap().get(b"x").unwrap().as_deref(), Some(&b"1"[..]));
        let ia = info("a");
        a.membership().unwrap().register(&ia, LONG).unwrap();
        b.membership().unwrap().register(&info("b"), LONG).unwrap();
        let both = vec![("a".to_string(), true), ("b".to_string(), true)];
        assert_eq!(members(&a), both);
        assert_eq!(members(&b), both);
        let m = b.membership().unwrap().members().unwrap();
        assert_eq!(m.iter().find(|m| m.info.id == "a").unwrap().info, ia, "a's record, as it registered");
        assert!(live(&b, "a"), "the live record is a key namespace transactions read");
    }

    #[test]
    fn a_lease_runs_out_with_time() {
        let a = MemKv::cluster();
        let b = a.node_handle();
        a.membership().unwrap().register(&info("a"), Duration::from_millis(20)).unwrap();
        b.membership().unwrap().register(&info("b"), LONG).unwrap();
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(members(&b), vec![("a".to_string(), false), ("b".to_string(), true)]);
        assert!(!live(&b, "a"), "an expired lease takes its live record with it");
    }

    #[test]
    fn heartbeat_renews_and_re_registers_after_expiry() {
        let a = MemKv::cluster();
        let b = a.node_handle();
        let ma = a.membership().unwrap();
        assert!(ma.heartbeat(&info("a")).is_err(), "heartbeat before register");
        ma.register(&info("a"), LONG).unwrap();
        let mut newer = info("a");
        newer.free = 7;
        assert_eq!(ma.heartbeat(&newer).unwrap(), Heartbeat::Renewed);
        assert_eq!(b.membership().unwrap().members().unwrap()[0].info.free, 7, "the record is refreshed");
        b.expire_lease("a");
        assert_eq!(members(&b), vec![("a".to_string(), false)]);
        assert_eq!(b.membership().unwrap().members().unwrap()[0].info.free, 7, "a dead node's last record");
        // Cut off and back: the next heartbeat registers anew, with the same TTL, and says so.
        assert_eq!(ma.heartbeat(&newer).unwrap(), Heartbeat::Rejoined);
        assert_eq!(members(&b), vec![("a".to_string(), true)]);
        // ... and so does a second register.
        b.expire_lease("a");
        ma.register(&info("a"), LONG).unwrap();
        assert_eq!(members(&b), vec![("a".to_string(), true)]);
    }

    #[test]
    fn leave_is_dead_at_once_and_for_that_node_only() {
        let a = MemKv::cluster();
        let b = a.node_handle();
        a.membership().unwrap().register(&info("a"), LONG).unwrap();
        b.membership().unwrap().register(&info("b"), LONG).unwrap();
        a.membership().unwrap().leave().unwrap();
        assert_eq!(members(&b), vec![("a".to_string(), false), ("b".to_string(), true)]);
        a.membership().unwrap().leave().unwrap(); // twice: nothing more to do
        assert!(a.membership().unwrap().heartbeat(&info("a")).is_err(), "left: register again first");
        assert_eq!(members(&a), vec![("a".to_string(), false), ("b".to_string(), true)]);
    }

    #[test]
    fn two_namespaces_over_two_handles_are_two_nodes() {
        let file = NewNode::plain(FileKind::Regular, 0o644);
        let akv = MemKv::cluster();
        let bkv = akv.node_handle();
        akv.membership().unwrap().register(&info("a"), LONG).unwrap();
        bkv.membership().unwrap().register(&info("b"), LONG).unwrap();
        let a = Namespace::open(Arc::new(akv.clone()), 0, 0).unwrap().with_node("a");
        let b = Namespace::open(Arc::new(bkv), 0, 0).unwrap().with_node("b");
        assert!(a.clustered && b.clustered);
        let f = a.mknod(ROOT_INO, b"ckpt.pt", &file).unwrap();
        assert_eq!(b.lookup(ROOT_INO, b"ckpt.pt").unwrap().ino, f.ino, "one volume");
        a.mark_unsealed(f.ino).unwrap();
        a.mark_unsealed(f.ino).unwrap(); // a second writer on the same node is fine
        match b.mark_unsealed(f.ino) {
            Err(MetaError::WriteLeased { holder }) => assert_eq!(holder, "a"),
            other => panic!("b took a's write lease: {other:?}"),
        }
        assert!(b.unsealed().unwrap().is_empty(), "b recovers only its own marks");
        assert_eq!(a.unsealed().unwrap().iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![f.ino]);
        // a dies (its lease runs out): b takes the write lease over.
        akv.expire_lease("a");
        b.mark_unsealed(f.ino).unwrap();
        assert_eq!(b.writer(f.ino).unwrap().as_deref(), Some("b"));
        assert!(a.unsealed().unwrap().is_empty(), "a, back, must not re-seal b's file");
    }
}
