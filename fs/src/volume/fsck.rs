//! `converged fsck`: check the metadata and the objects of a volume.

use std::collections::HashSet;
use std::io::Write as _;
use std::time::Duration;

use anyhow::bail;
use converged_metadata::Namespace;
use indicatif::{ProgressBar, ProgressStyle};

use super::open;
use crate::config::DEFAULT_CLUSTER_REPLICAS;

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
