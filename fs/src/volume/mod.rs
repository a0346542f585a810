//! Admin commands that work on a volume's metadata (`--meta URI`), from any
//! machine that reaches it, one module each: `status --meta` (here),
//! `node drain | undrain | forget` (`nodes.rs`), `rebalance`, `fsck` and
//! `gc`. They change only records; the daemons' repair workers move the
//! bytes (see `core/repair.rs`), and these commands follow their progress.

mod fsck;
mod gc;
mod nodes;
mod rebalance;

pub use fsck::{fsck, FsckArgs};
pub use gc::{gc, GcArgs};
pub use nodes::{run, NodeCmd};
pub use rebalance::{rebalance, RebalanceArgs};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write as _;
use std::sync::Arc;

use anyhow::{bail, Context};
use converged_metadata::membership::Member;
use converged_metadata::ops::xattr::Policies;
use converged_metadata::types::{TierState, Timespec};
use converged_metadata::{KvEngine, MetaUri, Namespace, NodeAdmin};

use crate::config::DEFAULT_CLUSTER_REPLICAS;

fn open(meta: &str) -> anyhow::Result<(Arc<dyn KvEngine>, Namespace)> {
    let uri: MetaUri = meta.parse()?;
    let engine = converged_metadata::open_engine(&uri).with_context(|| format!("open metadata {meta}"))?;
    let ns = Namespace::open(engine.clone(), 0, 0)?;
    Ok((engine, ns))
}

fn members(engine: &dyn KvEngine, meta: &str) -> anyhow::Result<Vec<Member>> {
    match engine.membership() {
        Some(m) => Ok(m.members()?),
        None => bail!("{meta} is embedded metadata (a single node): no nodes to manage"),
    }
}

/// Chunk health of the volume, per node and in all.
#[derive(Default)]
struct Health {
    chunks: u64,
    bytes: u64,
    /// Fewer copies on live, active nodes than the policy asks, and at least one live copy.
    under: u64,
    /// No copy on a live node, but the file is backed: readable from the object store.
    backed_only: u64,
    /// No copy on a live node and not backed: unreadable until a holder returns.
    lost: u64,
    /// Chunk records naming each node.
    held: HashMap<String, u64>,
}

fn health(ns: &Namespace, members: &[Member], admin: &BTreeMap<String, NodeAdmin>) -> anyhow::Result<Health> {
    let alive: HashSet<&str> = members.iter().filter(|m| m.alive).map(|m| m.info.id.as_str()).collect();
    let mut h = Health::default();
    let mut policies = Policies::new(ns, DEFAULT_CLUSTER_REPLICAS);
    let mut backed: HashMap<u64, bool> = HashMap::new();
    let mut err = None;
    ns.for_each_chunk(|ino, _, rec| {
        let want = policies.want(ino);
        h.chunks += 1;
        h.bytes += rec.len as u64;
        for r in &rec.replicas {
            *h.held.entry(r.clone()).or_default() += 1;
        }
        let live = rec.replicas.iter().filter(|r| alive.contains(r.as_str())).count();
        let good = rec.replicas.iter().filter(|r| alive.contains(r.as_str()) && !admin.contains_key(*r)).count();
        if live > 0 && good < want {
            h.under += 1;
        }
        if live == 0 {
            let is_backed = *backed.entry(ino).or_insert_with(|| match ns.tier(ino) {
                Ok(t) => t.is_some_and(|t| matches!(t.state, TierState::Backed | TierState::ReKeying)),
                Err(e) => {
                    err = Some(e);
                    false
                }
            });
            if is_backed {
                h.backed_only += 1;
            } else {
                h.lost += 1;
            }
        }
    })?;
    policies.finish()?;
    if let Some(e) = err {
        return Err(e.into());
    }
    Ok(h)
}

/// `converged status --meta URI`.
pub fn status(meta: &str) -> anyhow::Result<()> {
    let (engine, ns) = open(meta)?;
    let Some(m) = engine.membership() else {
        println!("{meta}: embedded metadata ({}), a single node", engine.name());
        return Ok(());
    };
    let members = m.members()?;
    let admin = ns.node_admin_states()?;
    let h = health(&ns, &members, &admin)?;
    let now = Timespec::now();
    let mut out = String::new();
    out.push_str(&format!(
        "{:<16} {:<18} {:<22} {:>12} {:>12} {:>8}  labels\n",
        "node", "state", "address", "capacity", "free", "chunks"
    ));
    for member in &members {
        let i = &member.info;
        let labels: Vec<String> = i.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut state =
            // Its record is written when it changes and every few minutes
            // (`RECORD_EVERY`): it died at most this long ago.
            if member.alive { "live".to_string() } else { format!("dead(<={}s)", (now.sec - i.heartbeat.sec).max(0)) };
        if let Some(a) = admin.get(&i.id) {
            state.push_str(&format!("/{}", a.as_str()));
        }
        out.push_str(&format!(
            "{:<16} {:<18} {:<22} {:>9} GiB {:>9} GiB {:>8}  {}\n",
            i.id,
            state,
            if i.addr.is_empty() { "-" } else { &i.addr },
            i.capacity >> 30,
            i.free >> 30,
            h.held.get(&i.id).copied().unwrap_or(0),
            labels.join(",")
        ));
    }
    let live = members.iter().filter(|m| m.alive).count();
    out.push_str(&format!("{live} live, {} dead\n", members.len() - live));
    if !members.is_empty() {
        out.push_str(&format!(
            "{} chunks ({} GiB): {} under-replicated, {} with no live copy ({} readable from the object store, {} lost until a holder returns) (policy: user.converged.replicas, default {DEFAULT_CLUSTER_REPLICAS})\n",
            h.chunks,
            h.bytes >> 30,
            h.under,
            h.backed_only + h.lost,
            h.backed_only,
            h.lost
        ));
    }
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
    Ok(())
}
