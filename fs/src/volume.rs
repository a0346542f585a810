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
use converged_metadata::ops::xattr::Policies;
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

#[derive(clap::Args, Debug)]
pub struct RebalanceArgs {
    /// Metadata URI of the volume, as given to `mount --meta`.
    #[arg(long, value_name = "URI")]
    pub meta: String,
    /// Print what would move (per node: its share of chunk copies now and after) and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Bytes per second each node copies for the rebalance (`500M`, `1G`); the nodes'
    /// `--repair-bandwidth` still applies [default: the nodes' own limit].
    #[arg(long, value_name = "BYTES", value_parser = crate::config::parse_bytes)]
    pub max_bandwidth: Option<u64>,
    /// Stop a rebalance under way (copies made so far stay).
    #[arg(long, conflicts_with = "dry_run")]
    pub cancel: bool,
    /// The label naming a node's failure domain, as the nodes' `--failure-domain`.
    #[arg(long, default_value = "rack", value_name = "LABEL")]
    pub failure_domain: String,
}

/// Where chunk copies are against where a balanced volume has them.
struct Balance {
    /// Chunk copies per node now, and once balanced.
    now: BTreeMap<String, u64>,
    ideal: BTreeMap<String, u64>,
    /// Chunks with a copy off their ideal holders, and their bytes.
    misplaced: u64,
    misplaced_bytes: u64,
    /// Chunks left alone: under-replicated (repair's work first).
    skipped: u64,
}

fn balance(ns: &Namespace, engine: &dyn KvEngine, meta: &str, failure_domain: &str) -> anyhow::Result<Balance> {
    let all = members(engine, meta)?;
    let admin = ns.node_admin_states()?;
    let live: Vec<_> = all.iter().filter(|m| m.alive).map(|m| m.info.clone()).collect();
    let candidates = crate::placement::balance_candidates(&live, &admin, failure_domain);
    if candidates.is_empty() {
        bail!("no live node takes copies");
    }
    let ids: HashSet<&str> = candidates.iter().map(|c| c.id.as_str()).collect();
    let mut b = Balance { now: BTreeMap::new(), ideal: BTreeMap::new(), misplaced: 0, misplaced_bytes: 0, skipped: 0 };
    for c in &candidates {
        b.now.insert(c.id.clone(), 0);
        b.ideal.insert(c.id.clone(), 0);
    }
    let mut policies = Policies::new(ns, DEFAULT_CLUSTER_REPLICAS);
    ns.for_each_chunk(|ino, index, rec| {
        let want = policies.want(ino);
        for r in &rec.replicas {
            *b.now.entry(r.clone()).or_default() += 1;
        }
        let good = rec.replicas.iter().filter(|r| ids.contains(r.as_str())).count();
        let ideal = crate::placement::ideal(ino, index, want, &candidates);
        if good < want {
            b.skipped += 1;
            for n in &rec.replicas {
                *b.ideal.entry(n.clone()).or_default() += 1;
            }
            return;
        }
        for n in &ideal {
            *b.ideal.entry(n.clone()).or_default() += 1;
        }
        let misplaced = rec.replicas.iter().any(|r| !ideal.contains(r));
        let missing = ideal.iter().any(|n| !rec.replicas.contains(n));
        if misplaced && missing {
            b.misplaced += 1;
            b.misplaced_bytes += rec.len as u64;
        }
    })?;
    policies.finish()?;
    Ok(b)
}

fn share_table(b: &Balance) -> String {
    let total_now: u64 = b.now.values().sum::<u64>().max(1);
    let total_ideal: u64 = b.ideal.values().sum::<u64>().max(1);
    let mut out = format!("{:<16} {:>10} {:>8} {:>10} {:>8}\n", "node", "copies", "share", "balanced", "share");
    for (id, now) in &b.now {
        let ideal = b.ideal.get(id).copied().unwrap_or(0);
        out.push_str(&format!(
            "{:<16} {:>10} {:>7.1}% {:>10} {:>7.1}%\n",
            id,
            now,
            100.0 * *now as f64 / total_now as f64,
            ideal,
            100.0 * ideal as f64 / total_ideal as f64
        ));
    }
    out
}

/// `converged rebalance --meta URI`.
pub fn rebalance(a: RebalanceArgs) -> anyhow::Result<()> {
    let (engine, ns) = open(&a.meta)?;
    if a.cancel {
        ns.set_rebalance(None)?;
        println!("rebalance stopped; the copies made so far stay");
        return Ok(());
    }
    let first = balance(&ns, engine.as_ref(), &a.meta, &a.failure_domain)?;
    if a.dry_run {
        print!("{}", share_table(&first));
        println!(
            "{} chunks ({:.2} GiB) would move toward their balanced holders; {} under-replicated chunks are left to repair",
            first.misplaced,
            first.misplaced_bytes as f64 / (1u64 << 30) as f64,
            first.skipped
        );
        return Ok(());
    }
    let job = match converged_metadata::ops::nodes::rebalance(engine.as_ref())? {
        // Resume the one under way (its start stays), with this bandwidth if given.
        Some(j) => converged_metadata::Rebalance { bandwidth: a.max_bandwidth.unwrap_or(j.bandwidth), ..j },
        None => converged_metadata::Rebalance { bandwidth: a.max_bandwidth.unwrap_or(0), started: Timespec::now().sec },
    };
    ns.set_rebalance(Some(job))?;
    println!(
        "rebalancing: {} chunks ({:.2} GiB) to move; the live nodes' repair workers copy them (Ctrl-C leaves it running; run again to follow, --cancel to stop)",
        first.misplaced,
        first.misplaced_bytes as f64 / (1u64 << 30) as f64
    );
    let bar = ProgressBar::new(first.misplaced);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} chunks moved, {elapsed} {msg}").expect("valid template"),
    );
    let mut last = (Instant::now(), first.misplaced);
    let done = loop {
        let b = balance(&ns, engine.as_ref(), &a.meta, &a.failure_domain)?;
        if b.misplaced != last.1 {
            last = (Instant::now(), b.misplaced);
        }
        bar.set_length(bar.length().unwrap_or(0).max(b.misplaced));
        bar.set_position(bar.length().unwrap_or(0).saturating_sub(b.misplaced));
        if b.misplaced == 0 {
            break b;
        }
        let stalled = last.0.elapsed() > Duration::from_secs(60);
        bar.set_message(if stalled { "(no progress for a minute: see the nodes' repair workers)" } else { "" });
        std::thread::sleep(Duration::from_millis(500));
    };
    bar.finish();
    ns.set_rebalance(None)?;
    print!("{}", share_table(&done));
    println!("balanced: every chunk with its copies is on its balanced holders");
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct FsckArgs {
    /// Metadata URI of the volume, as given to `mount --meta`.
    #[arg(long, value_name = "URI")]
    pub meta: String,
    /// Fix what the metadata alone can: names of missing inodes, link counts, unreachable
    /// files (into /lost+found), records of missing inodes or past a file's end, holders
    /// that are not nodes of the volume; backed files whose object is missing or wrong are
    /// uploaded again (while a node holds their chunks). Missing copies are left to the nodes'
    /// repair.
    #[arg(long)]
    pub repair: bool,
    /// The volume's object store, as given to `mount --object-store`: every backed file's
    /// object is checked (it exists, with the file's size and recorded ETag).
    #[arg(long, value_name = "URI")]
    pub object_store: Option<String>,
    /// S3-compatible endpoint for an s3:// store, as for `mount --s3-endpoint`.
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
}

/// A backed file whose object is not what its record says.
struct BadObject {
    ino: u64,
    key: String,
    what: String,
    /// Its own store's object (an import's source is not converged's to rewrite).
    own: bool,
}

/// Check every backed file's object: it exists, with the file's size and the ETag recorded.
fn check_objects(ns: &Namespace, store: &str, endpoint: Option<String>) -> anyhow::Result<(u64, Vec<BadObject>)> {
    use crate::objects::{ObjectTier, StoreOptions};
    let tier = ObjectTier::open(store, StoreOptions { s3_endpoint: endpoint })?;
    let backed = ns.backed_files()?;
    let bar = ProgressBar::new(backed.len() as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} objects checked {msg}").expect("valid template"));
    let mut bad = Vec::new();
    for (ino, t) in &backed {
        bar.inc(1);
        let key = match &t.source {
            Some(_) => t.key.clone(),
            None => tier.home().key(&t.key),
        };
        let size = match ns.getattr(*ino) {
            Ok(i) => i.size,
            Err(_) => continue, // fsck's own checks report a missing inode
        };
        let what = match tier.head(t.source.as_deref(), &key) {
            Err(crate::objects::ObjectError::NotFound { .. }) => Some("is missing".to_string()),
            Err(e) => Some(format!("cannot be read: {e}")),
            Ok((len, _, _)) if len != size => Some(format!("holds {len} bytes, the file {size}")),
            Ok((_, _, etag)) if t.etag.is_some() && etag.is_some() && etag != t.etag => Some(format!(
                "changed (ETag {} where {} was recorded)",
                etag.unwrap_or_default(),
                t.etag.clone().unwrap_or_default()
            )),
            Ok(_) => None,
        };
        if let Some(what) = what {
            bad.push(BadObject { ino: *ino, key, what, own: t.source.is_none() });
        }
    }
    bar.finish_and_clear();
    Ok((backed.len() as u64, bad))
}

fn path_text(ns: &Namespace, ino: u64) -> String {
    match ns.path_of(ino) {
        Ok(Some(names)) => {
            let parts: Vec<String> = names.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect();
            format!("/{}", parts.join("/"))
        }
        _ => format!("(inode {ino}, no path)"),
    }
}

/// `converged fsck --meta URI`.
pub fn fsck(a: FsckArgs) -> anyhow::Result<()> {
    use converged_metadata::ops::fsck::{Finding, NodesView};
    let (engine, ns) = open(&a.meta)?;
    let members = match engine.membership() {
        Some(m) => Some(m.members()?),
        None => None,
    };
    let known: HashSet<String> = members.iter().flatten().map(|m| m.info.id.clone()).collect();
    let live: HashSet<String> = members.iter().flatten().filter(|m| m.alive).map(|m| m.info.id.clone()).collect();
    let view = NodesView { known: &known, live: &live, default_replicas: DEFAULT_CLUSTER_REPLICAS };
    let nodes = members.as_ref().map(|_| &view);
    let check = |what: &str| -> anyhow::Result<converged_metadata::ops::fsck::FsckReport> {
        let bar = ProgressBar::new_spinner();
        bar.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"));
        bar.enable_steady_tick(Duration::from_millis(200));
        let msg = what.to_string();
        let r = ns.fsck(nodes, &|n| bar.set_message(format!("{msg}: {n} records")));
        bar.finish_and_clear();
        Ok(r?)
    };
    let report = check("checking")?;
    let (objects, bad_objects) = match &a.object_store {
        Some(store) => check_objects(&ns, store, a.s3_endpoint.clone())?,
        None => (0, Vec::new()),
    };
    let mut out = String::new();
    for b in &bad_objects {
        out.push_str(&format!("{}: object {} {}\n", path_text(&ns, b.ino), b.key, b.what));
    }
    for f in &report.findings {
        let path = match f {
            Finding::DanglingName { parent, name, .. } => {
                format!("{}/{}", path_text(&ns, *parent).trim_end_matches('/'), String::from_utf8_lossy(name))
            }
            f => path_text(&ns, f.ino()),
        };
        out.push_str(&format!("{path}: {}\n", f.describe()));
    }
    let problems = report.findings.len() + bad_objects.len();
    out.push_str(&format!(
        "{} inodes, {} names, {} chunk records{} checked: {problems} problems\n",
        report.inodes,
        report.names,
        report.chunks,
        if a.object_store.is_some() { format!(", {objects} objects") } else { String::new() },
    ));
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
    if problems == 0 {
        return Ok(());
    }
    if !a.repair {
        bail!("{problems} problems (run with --repair to fix what the metadata alone can)");
    }
    let mut fixed = 0;
    for f in &report.findings {
        if ns.fsck_repair(f)? {
            fixed += 1;
        }
    }
    // Objects no live node can write again stay wrong: they count as left.
    let mut lost_objects = 0;
    for b in bad_objects.iter().filter(|b| b.own) {
        // Uploaded again by a live node holding its chunks.
        let holder =
            ns.chunks(b.ino)?.into_iter().flat_map(|(_, r)| r.replicas).find(|h| live.contains(h) || members.is_none());
        match holder {
            Some(node) if ns.reupload(b.ino, &node)? => fixed += 1,
            _ => {
                lost_objects += 1;
                println!("{}: no live node holds its chunks; its object cannot be written again", path_text(&ns, b.ino))
            }
        }
    }
    if bad_objects.iter().any(|b| b.own) {
        ns.request_backfill_rescan()?;
    }
    let after = check("checking again")?;
    let left = after.findings.len() + lost_objects;
    println!("repaired {fixed}; {left} problems left");
    for f in &after.findings {
        println!("{}: {}", path_text(&ns, f.ino()), f.describe());
    }
    if left > 0 {
        bail!("{left} problems left (missing copies are the nodes' repair work: see `converged status --meta`)");
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct GcArgs {
    /// Metadata URI of the volume, as given to `mount --meta`.
    #[arg(long, value_name = "URI")]
    pub meta: String,
    /// The volume's object store, as given to `mount --object-store`: objects under its
    /// prefix that no file owns are deleted too (S3 credentials from the AWS_* variables).
    #[arg(long, value_name = "URI")]
    pub object_store: Option<String>,
    /// S3-compatible endpoint for an s3:// store, as for `mount --s3-endpoint`.
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// Objects written less than this long ago are left alone (`1h`, `10m`).
    #[arg(long, default_value = "1h", value_name = "DURATION", value_parser = crate::config::parse_duration)]
    pub min_age: Duration,
    /// List the objects that would be deleted and delete none (the nodes still sweep).
    #[arg(long)]
    pub dry_run: bool,
    /// How long to wait for every live node to answer.
    #[arg(long, default_value = "600s", value_name = "DURATION", value_parser = crate::config::parse_duration)]
    pub timeout: Duration,
}

/// `converged gc --meta URI`.
pub fn gc(a: GcArgs) -> anyhow::Result<()> {
    let (engine, ns) = open(&a.meta)?;
    if let Some(store) = &a.object_store {
        gc_objects(&ns, store, &a)?;
    }
    let Some(m) = engine.membership() else {
        println!("{}: a single node: its copies are checked at every mount", a.meta);
        return Ok(());
    };
    let live: Vec<String> =
        m.members()?.into_iter().filter(|m| m.alive && !m.info.addr.is_empty()).map(|m| m.info.id).collect();
    let id = ns.request_gc()?;
    println!("asked {} live nodes to remove the copies no record names (gc request {id})", live.len());
    let bar = ProgressBar::new(live.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} nodes swept, {elapsed} {msg}").expect("valid template"),
    );
    let deadline = Instant::now() + a.timeout;
    loop {
        let (_, done) = converged_metadata::ops::nodes::gc_state(engine.as_ref())?;
        let waiting: Vec<&String> = live.iter().filter(|n| done.get(*n).copied().unwrap_or(0) < id).collect();
        bar.set_position((live.len() - waiting.len()) as u64);
        if waiting.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            bar.abandon();
            let names: Vec<&str> = waiting.iter().map(|s| s.as_str()).collect();
            bail!(
                "no answer within {:?} from {} (a copy is removed only once found unneeded twice --sweep-grace apart)",
                a.timeout,
                names.join(", ")
            );
        }
        bar.set_message(format!("waiting for {}", waiting.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")));
        std::thread::sleep(Duration::from_millis(500));
    }
    bar.finish_with_message("");
    println!("every live node removed its copies that no record names");
    Ok(())
}

/// Delete the objects under the store's prefix that no file refers to.
fn gc_objects(ns: &Namespace, store: &str, a: &GcArgs) -> anyhow::Result<()> {
    use crate::objects::{Location, ObjectTier, StoreOptions};
    let tier = ObjectTier::open(store, StoreOptions { s3_endpoint: a.s3_endpoint.clone() })?;
    let home = Location::parse(store)?;
    let (own, imported) = ns.referenced_object_keys()?;
    let root = if home.prefix.is_empty() { String::new() } else { format!("{}/", home.prefix) };
    let now = Timespec::now().sec;
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} listing {msg}").expect("valid template"));
    let mut stray = Vec::new();
    let mut listed = 0u64;
    let mut stack = vec![root.clone()];
    while let Some(prefix) = stack.pop() {
        bar.set_message(format!("{prefix} ({listed} objects)"));
        let level = tier.list_level(&home.base, &prefix)?;
        for (key, size, modified, _) in level.objects {
            listed += 1;
            let rel = key.strip_prefix(&root).unwrap_or(&key);
            if own.contains(rel) || imported.contains(&key) || now - modified < a.min_age.as_secs() as i64 {
                continue;
            }
            stray.push((key, size));
        }
        stack.extend(level.prefixes);
    }
    bar.finish_and_clear();
    let bytes: u64 = stray.iter().map(|s| s.1).sum();
    for (key, _) in &stray {
        if a.dry_run {
            println!("would delete {key}");
        } else {
            tier.delete(key).with_context(|| format!("delete {key}"))?;
        }
    }
    println!(
        "{listed} objects under {}: {} belong to no file ({:.1} MiB){}",
        home.url(),
        stray.len(),
        bytes as f64 / (1u64 << 20) as f64,
        if a.dry_run { ", none deleted (--dry-run)" } else { ", deleted" }
    );
    Ok(())
}
