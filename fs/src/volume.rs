//! Admin commands that work on a volume's metadata (`--meta URI`), from any
//! machine that reaches it: `status --meta`, and `node drain | undrain |
//! forget`. They change only records; the daemons' repair workers move the
//! bytes (see `core/repair.rs`), and these commands follow their progress.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Subcommand;
use converged_metadata::membership::Member;
use converged_metadata::types::{TierState, Timespec};
use converged_metadata::{KvEngine, MetaUri, Namespace, NodeAdmin};
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::DEFAULT_CLUSTER_REPLICAS;

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Move every chunk off a node: it takes no new copies, repair gives each of its chunks a
    /// copy elsewhere and then drops it; the node can then be taken down with nothing
    /// under-replicated. Shows progress until no chunk record names the node (Ctrl-C leaves
    /// the drain running; run the command again to follow it).
    Drain {
        /// The node's id, as `status --meta` lists it.
        node: String,
        /// Metadata URI of the volume, as given to `mount --meta`.
        #[arg(long, value_name = "URI")]
        meta: String,
        /// Mark the node draining and return at once.
        #[arg(long)]
        no_wait: bool,
    },
    /// Let a draining or drained node take new copies again.
    Undrain {
        node: String,
        #[arg(long, value_name = "URI")]
        meta: String,
    },
    /// Remove a node that will not come back from the volume. Refused while it is live or while
    /// a chunk record still names it (wait for repair, or drain it first).
    Forget {
        node: String,
        #[arg(long, value_name = "URI")]
        meta: String,
    },
}

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
    let mut policy: HashMap<u64, usize> = HashMap::new();
    let mut backed: HashMap<u64, bool> = HashMap::new();
    let mut err = None;
    ns.for_each_chunk(|ino, _, rec| {
        let want = *policy.entry(ino).or_insert_with(|| match ns.replicas_policy(ino) {
            Ok(p) => p.unwrap_or(DEFAULT_CLUSTER_REPLICAS) as usize,
            Err(e) => {
                err = Some(e);
                DEFAULT_CLUSTER_REPLICAS as usize
            }
        });
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
            if member.alive { "live".to_string() } else { format!("dead({}s)", (now.sec - i.heartbeat.sec).max(0)) };
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

pub fn run(cmd: NodeCmd) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::Drain { node, meta, no_wait } => drain(&node, &meta, no_wait),
        NodeCmd::Undrain { node, meta } => {
            let (engine, ns) = open(&meta)?;
            known(&members(engine.as_ref(), &meta)?, &node)?;
            ns.set_node_admin(&node, None)?;
            println!("{node} takes new copies again");
            Ok(())
        }
        NodeCmd::Forget { node, meta } => {
            let (engine, ns) = open(&meta)?;
            known(&members(engine.as_ref(), &meta)?, &node)?;
            ns.forget_node(&node).with_context(|| format!("forget {node}"))?;
            println!("{node} is no longer part of the volume");
            Ok(())
        }
    }
}

fn known<'a>(members: &'a [Member], node: &str) -> anyhow::Result<&'a Member> {
    match members.iter().find(|m| m.info.id == node) {
        Some(m) => Ok(m),
        None => {
            let ids: Vec<&str> = members.iter().map(|m| m.info.id.as_str()).collect();
            bail!("no node {node:?} in this volume (nodes: {})", ids.join(", "))
        }
    }
}

fn drain(node: &str, meta: &str, no_wait: bool) -> anyhow::Result<()> {
    let (engine, ns) = open(meta)?;
    let all = members(engine.as_ref(), meta)?;
    known(&all, node)?;
    let others = all.iter().filter(|m| m.alive && m.info.id != node).count();
    if others == 0 {
        bail!("no other live node to move {node}'s chunks to");
    }
    if ns.node_admin_states()?.get(node) != Some(&NodeAdmin::Drained) {
        ns.set_node_admin(node, Some(NodeAdmin::Draining))?;
    }
    let total = ns.chunks_naming(node)?;
    println!("{node} is draining: {total} chunks to move; the live nodes' repair workers copy them");
    if no_wait {
        return Ok(());
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} chunks moved, {elapsed} {msg}").expect("valid template"),
    );
    let mut last_change = Instant::now();
    let mut left = total;
    loop {
        let now_left = ns.chunks_naming(node)?;
        if now_left != left {
            last_change = Instant::now();
            left = now_left;
        }
        bar.set_position(total.saturating_sub(left));
        if left == 0 {
            break;
        }
        if last_change.elapsed() > Duration::from_secs(60) {
            bar.set_message("(no progress for a minute: are nodes with free space live?)");
        } else {
            bar.set_message("");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    bar.finish();
    ns.set_node_admin(node, Some(NodeAdmin::Drained))?;
    println!("{node} is drained: no chunk record names it; its own copies go within its --sweep-grace");
    Ok(())
}
