//! `converged node drain | undrain | forget`: an admin's word on a node,
//! and a drain followed until no chunk record names the node.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Subcommand;
use converged_metadata::membership::Member;
use converged_metadata::NodeAdmin;
use indicatif::{ProgressBar, ProgressStyle};

use super::{members, open};

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
