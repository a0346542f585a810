//! `converged rebalance`: give every node its share of the chunks.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::bail;
use converged_metadata::ops::xattr::Policies;
use converged_metadata::types::Timespec;
use converged_metadata::{KvEngine, Namespace};
use indicatif::{ProgressBar, ProgressStyle};

use super::{members, open};
use crate::config::DEFAULT_CLUSTER_REPLICAS;

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
