//! Reference-model test: random sequences of namespace and data operations
//! run on a real mount and on the project's reference model
//! (`converged_fs::refmodel`, the one the in-process property test uses,
//! here with the kernel's VFS checks). Every operation must give the same
//! result (success or the same errno), and the trees and bytes must match,
//! including after remounts.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};

use converged_fs::refmodel::{describe, Entry, Model};
use converged_metadata::types::RenameMode;
use std::path::Path;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type R<T> = Result<T, i32>;

fn real_tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let md = fs::symlink_metadata(&path).unwrap();
            let line = if md.is_dir() {
                stack.push(path);
                describe(Entry::Dir)
            } else if md.file_type().is_symlink() {
                describe(Entry::Symlink(&fs::read_link(&path).unwrap().to_string_lossy()))
            } else {
                describe(Entry::File { bytes: &fs::read(&path).unwrap(), links: md.nlink() })
            };
            out.insert(rel, line);
        }
    }
    out
}

fn errno_of<T>(r: std::io::Result<T>) -> R<()> {
    r.map(|_| ()).map_err(|e| e.raw_os_error().unwrap_or(-1))
}

const NAMES: [&str; 4] = ["a", "b", "c", "d"];

fn random_path(rng: &mut StdRng) -> String {
    let depth = rng.random_range(1..=3);
    (0..depth).map(|_| NAMES[rng.random_range(0..NAMES.len())]).collect::<Vec<_>>().join("/")
}

fn run_sequence(seed: u64, ops: usize, verify_reads: bool) {
    let mut m = if verify_reads { Mount::with_args(&["--verify-reads"]) } else { Mount::new() };
    run_on(seed, ops, &mut m, None);
}

/// Run `ops` random operations on `m`. With `other` (another node of the
/// same cluster), the remount step lists the whole tree there instead, and
/// the tree is checked there at the end.
fn run_on(seed: u64, ops: usize, m: &mut Mount, other: Option<&Mount>) {
    let mut model = Model::through_kernel();
    let mut rng = StdRng::seed_from_u64(seed);
    for step in 0..ops {
        let p = random_path(&mut rng);
        let full = m.path(&p);
        let (desc, want, got) = match rng.random_range(0..100u32) {
            0..=19 => {
                let len = [0, 1, 100, 70_000, 200_000][rng.random_range(0..5)];
                let data = pattern(len, rng.random());
                let got = errno_of(
                    OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o644)
                        .open(&full)
                        .and_then(|f| f.write_all_at(&data, 0)),
                );
                ("create", model.create(&p, &data).map(|_| ()), got)
            }
            20..=34 => {
                let off = rng.random_range(0..150_000);
                let data = pattern(rng.random_range(1..80_000), rng.random());
                let got = errno_of(
                    OpenOptions::new().write(true).open(&full).and_then(|f| f.write_all_at(&data, off as u64)),
                );
                ("write", model.write(&p, off as u64, &data), got)
            }
            35..=41 => {
                let len = rng.random_range(0..250_000);
                let got = errno_of(OpenOptions::new().write(true).open(&full).and_then(|f| f.set_len(len as u64)));
                ("truncate", model.truncate(&p, len as u64), got)
            }
            42..=56 => ("mkdir", model.mkdir(&p), errno_of(fs::create_dir(&full))),
            57..=63 => ("rmdir", model.rmdir(&p), errno_of(fs::remove_dir(&full))),
            64..=72 => ("unlink", model.unlink(&p), errno_of(fs::remove_file(&full))),
            73..=87 => {
                let to = random_path(&mut rng);
                let d = format!("rename {p} -> {to}");
                let got = errno_of(fs::rename(&full, m.path(&to)));
                return_if_mismatch(seed, step, &d, model.rename(&p, &to, RenameMode::Replace), got);
                continue;
            }
            88..=93 => {
                let to = random_path(&mut rng);
                let d = format!("link {p} -> {to}");
                let got = errno_of(fs::hard_link(&full, m.path(&to)));
                return_if_mismatch(seed, step, &d, model.link(&p, &to), got);
                continue;
            }
            94..=97 => {
                let target = format!("t{}", rng.random_range(0..4));
                ("symlink", model.symlink(&target, &p), errno_of(std::os::unix::fs::symlink(&target, &full)))
            }
            98.. => {
                match other {
                    // Past the flusher's delay: what was acknowledged commits,
                    // and later changes meet the committed records.
                    Some(_) if rng.random_bool(0.6) => std::thread::sleep(std::time::Duration::from_millis(80)),
                    Some(o) => assert_eq!(real_tree(&o.mnt), model.tree(), "seed {seed} step {step}: the other node"),
                    None => {
                        m.umount();
                        m.mount();
                        drop_caches();
                    }
                }
                continue;
            }
        };
        return_if_mismatch(seed, step, &format!("{desc} {p}"), want, got);
        if step % 50 == 49 {
            assert_eq!(real_tree(&m.mnt), model.tree(), "seed {seed} step {step}: trees differ");
        }
    }
    assert_eq!(real_tree(&m.mnt), model.tree(), "seed {seed}: trees differ at the end");
    if let Some(o) = other {
        assert_eq!(real_tree(&o.mnt), model.tree(), "seed {seed}: trees differ on the other node");
        return;
    }
    m.umount();
    m.mount();
    drop_caches();
    assert_eq!(real_tree(&m.mnt), model.tree(), "seed {seed}: trees differ after remount");
}

fn return_if_mismatch(seed: u64, step: usize, what: &str, want: R<()>, got: R<()>) {
    assert_eq!(got, want, "seed {seed} step {step}: {what}: filesystem gave {got:?}, model expects {want:?}");
}

#[test]
fn random_operations_match_the_model() {
    let seeds: Vec<u64> = match std::env::var("REFMODEL_SEED") {
        Ok(s) => vec![s.parse().expect("REFMODEL_SEED is a number")],
        Err(_) => vec![1, 2, 3, 4],
    };
    for seed in seeds {
        run_sequence(seed, 400, false);
    }
}

#[test]
fn random_operations_match_the_model_on_the_daemon_read_path() {
    for seed in [101, 102] {
        run_sequence(seed, 300, true);
    }
}

/// `--nowsync` on a 2-node cluster: operations on one node, in directories
/// it made (changes acknowledged before they commit, some sent past the
/// overlay), its tree checked against the model every 50 steps and, at
/// random, from the other node (whose listing has the first commit what it
/// acknowledged and give its directories up).
#[test]
fn random_operations_match_the_model_on_a_nowsync_cluster() {
    let Some(mut c) = common::cluster::Cluster::start(2, &["--nowsync"]) else { return };
    let seeds: Vec<u64> = match std::env::var("REFMODEL_SEED") {
        Ok(s) => vec![s.parse().expect("REFMODEL_SEED is a number")],
        Err(_) => vec![201, 204],
    };
    for seed in seeds {
        for name in NAMES {
            let _ = fs::remove_dir_all(c.node(0).path(name));
            let _ = fs::remove_file(c.node(0).path(name));
        }
        let (a, b) = c.nodes.split_at_mut(1);
        run_on(seed, 400, &mut a[0], Some(&b[0]));
    }
}
