//! A data dir's identity: the volume and the node it belongs to, written
//! (`identity`, mode 0600) at its first mount and checked at every mount.
//!
//! At boot a data dir whose NVMe did not mount is an empty directory on the
//! root disk. Without an identity it would mount as a fresh single-node
//! volume, or join its cluster as a node whose chunk records promise copies
//! it does not have. With one, a mount of an empty or foreign data dir for a
//! volume or node that exists is refused unless `--new-node` says the disk is
//! new (the node's old copies are then forgotten, and repair makes them
//! again).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use converged_metadata::Namespace;

const FILE: &str = "identity";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub volume: String,
    pub node: String,
}

/// What was found in the data dir before the metadata was opened.
#[derive(Debug)]
pub enum Found {
    /// Its identity file.
    Known(Identity),
    /// No identity file, but chunks or an embedded metadata file: a data
    /// dir mounted by a version that wrote no identity. It is adopted.
    Unlabelled,
    /// Nothing of converged's.
    Empty,
}

fn path(data_dir: &Path) -> PathBuf {
    data_dir.join(FILE)
}

/// Look at the data dir before anything in it is created.
pub fn inspect(data_dir: &Path) -> anyhow::Result<Found> {
    let p = path(data_dir);
    match std::fs::read_to_string(&p) {
        Ok(text) => parse(&text).map(Found::Known).with_context(|| format!("{} is damaged", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A chunk store (even an empty one: a node that never got a
            // chunk) or an embedded metadata file: mounted before.
            let used = data_dir.join("chunks").is_dir() || data_dir.join("meta.redb").exists();
            Ok(if used { Found::Unlabelled } else { Found::Empty })
        }
        Err(e) => Err(e).with_context(|| format!("read {}", p.display())),
    }
}

fn parse(text: &str) -> anyhow::Result<Identity> {
    let (mut volume, mut node) = (None, None);
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        match line.split_once('=') {
            Some(("volume", v)) => volume = Some(v.trim().to_string()),
            Some(("node", v)) => node = Some(v.trim().to_string()),
            _ => bail!("unexpected line {line:?}"),
        }
    }
    match (volume, node) {
        (Some(volume), Some(node)) if !volume.is_empty() => Ok(Identity { volume, node }),
        _ => bail!("it must name a volume and a node"),
    }
}

/// Write the identity durably: a temporary file, synced, renamed over, the
/// directory synced.
fn write(data_dir: &Path, id: &Identity) -> anyhow::Result<()> {
    let tmp = data_dir.join(format!("{FILE}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("create {}", tmp.display()))?;
    writeln!(f, "# converged data dir: the volume and node it belongs to. Do not edit.")?;
    writeln!(f, "volume={}\nnode={}", id.volume, id.node)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path(data_dir))?;
    std::fs::File::open(data_dir)?.sync_all()?;
    Ok(())
}

/// What the mount asked for, as far as the identity goes.
pub struct Ask<'a> {
    pub node: &'a str,
    pub new_node: bool,
    pub read_only: bool,
    /// Several nodes share the volume: the node id must match too.
    pub clustered: bool,
    /// The metadata URI, for messages.
    pub meta: &'a str,
}

/// Refuse, before the volume is opened (which creates it when the metadata
/// holds none), the mounts that must not create one: a data dir that
/// belongs to a volume, and a read-only mount.
pub fn before_open(data_dir: &Path, found: &Found, volume_exists: bool, ask: &Ask) -> anyhow::Result<()> {
    if volume_exists {
        return Ok(());
    }
    let dd = data_dir.display();
    match found {
        Found::Known(id) => bail!(
            "data dir {dd} belongs to volume {}, but {} holds no volume: check --meta and --data-dir",
            id.volume,
            ask.meta
        ),
        Found::Unlabelled => bail!(
            "data dir {dd} was used before, but {} holds no volume: check --meta (this data dir's chunks \
             belong to another volume)",
            ask.meta
        ),
        Found::Empty if ask.read_only => bail!("{} holds no volume to mount read-only", ask.meta),
        Found::Empty => Ok(()),
    }
}

/// Check the data dir against the volume just opened (after
/// [`before_open`]: a used or labelled data dir, or a read-only mount, met an
/// existing volume), and label it when it
/// has no identity yet. Refusals say what to check.
pub fn settle(data_dir: &Path, found: Found, ns: &Namespace, ask: &Ask) -> anyhow::Result<()> {
    let dd = data_dir.display();
    let volume = ns.volume_id();
    let mine = Identity { volume: volume.to_string(), node: ask.node.to_string() };
    match found {
        Found::Known(id) => {
            if id.volume != volume {
                bail!(
                    "data dir {dd} belongs to volume {}, but {} holds volume {volume}: \
                     check --meta and --data-dir",
                    id.volume,
                    ask.meta
                );
            }
            if ask.clustered && id.node != ask.node {
                bail!("data dir {dd} belongs to node {}, not {} (check --node-id and --tls-dir)", id.node, ask.node);
            }
            Ok(())
        }
        Found::Unlabelled if ask.read_only => Ok(()),
        Found::Unlabelled => {
            tracing::info!(data_dir = %dd, volume, node = ask.node, "labelled a data dir mounted before identities existed");
            write(data_dir, &mine)
        }
        Found::Empty if ask.read_only => {
            // A reader node of a cluster holds no copies: an empty data dir
            // is right for it, and it is left unlabelled (nothing is written).
            if ask.clustered && !ns.knows_node(ask.node)? {
                return Ok(());
            }
            bail!(
                "data dir {dd} is empty: a read-only mount needs one mounted before (or, in a cluster, \
                 a node id the volume does not know)"
            )
        }
        Found::Empty => {
            if !ns.created_volume() && !ask.new_node {
                if !ask.clustered {
                    bail!(
                        "volume {volume} in {} exists, but data dir {dd} is empty: is its disk mounted? \
                         Mount with --new-node (option new_node) to use this empty data dir anyway",
                        ask.meta
                    );
                }
                if ns.knows_node(ask.node)? {
                    bail!(
                        "node {} has been part of volume {volume}, but data dir {dd} is empty: is its disk \
                         mounted? If the disk was replaced, mount with --new-node (option new_node): the node's \
                         old copies are forgotten and repair copies them back",
                        ask.node
                    );
                }
            }
            if ask.new_node && ask.clustered && ns.knows_node(ask.node)? {
                let (dropped, sole) = ns.forget_copies_of(ask.node)?;
                tracing::warn!(
                    node = ask.node,
                    dropped,
                    sole,
                    "new data dir for a known node: its old copies are forgotten (records it alone held keep naming it)"
                );
            }
            write(data_dir, &mine)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trips_and_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(inspect(dir.path()).unwrap(), Found::Empty));
        let id = Identity { volume: "abc".into(), node: "n1".into() };
        write(dir.path(), &id).unwrap();
        match inspect(dir.path()).unwrap() {
            Found::Known(got) => assert_eq!(got, id),
            other => panic!("{other:?}"),
        }
        std::fs::write(dir.path().join(FILE), "volume=\n").unwrap();
        let e = format!("{:#}", inspect(dir.path()).unwrap_err());
        assert!(e.contains("damaged"), "{e}");
    }

    #[test]
    fn a_data_dir_with_a_chunk_store_but_no_identity_is_unlabelled() {
        let dir = tempfile::tempdir().unwrap();
        // What this mount itself makes before looking: the log and the lock.
        std::fs::write(dir.path().join("converged.log"), b"").unwrap();
        std::fs::write(dir.path().join("converged.lock"), b"1").unwrap();
        assert!(matches!(inspect(dir.path()).unwrap(), Found::Empty));
        std::fs::create_dir(dir.path().join("chunks")).unwrap();
        assert!(matches!(inspect(dir.path()).unwrap(), Found::Unlabelled));
    }
}
