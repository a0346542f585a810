//! `converged gc`: collect what no record names, on the nodes and in the
//! object store.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use converged_metadata::types::Timespec;
use converged_metadata::Namespace;
use indicatif::{ProgressBar, ProgressStyle};

use super::open;

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
