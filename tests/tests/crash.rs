//! kill -9 of the daemon in the middle of a workload: after the next mount
//! every fsynced byte is there, and metadata and chunks agree.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;

fn walk(dir: &Path, out: &mut BTreeMap<String, (u64, u64)>, root: &Path) {
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let md = fs::symlink_metadata(e.path()).unwrap();
        let rel = e.path().strip_prefix(root).unwrap().to_string_lossy().into_owned();
        if md.is_dir() {
            walk(&e.path(), out, root);
        } else if md.is_file() {
            out.insert(rel, (md.ino(), md.len()));
        }
    }
}

#[test]
fn kill_9_mid_workload_loses_no_fsynced_byte() {
    let mut m = Mount::new();
    fs::create_dir(m.path("ckpt")).unwrap();
    // A file left open and unlinked: an orphan the next mount must purge.
    let orphan = File::create(m.path("orphan")).unwrap();
    (&orphan).write_all(&pattern(300_000, 99)).unwrap();
    let orphan_ino = orphan.metadata().unwrap().ino();
    fs::remove_file(m.path("orphan")).unwrap();

    let acked: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (acked, stop, mnt) = (acked.clone(), stop.clone(), m.mnt.clone());
        std::thread::spawn(move || {
            for i in 0u64.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let len = 1000 + (i as usize * 37_771) % (3 << 20);
                let name = format!("ckpt/step{i}.pt");
                let tmp = mnt.join(format!("{name}.tmp"));
                // torch.save: write a temp file, fsync, rename, fsync the directory.
                let r = (|| -> std::io::Result<()> {
                    let mut f = File::create(&tmp)?;
                    f.write_all(&pattern(len, i))?;
                    f.sync_all()?;
                    drop(f);
                    fs::rename(&tmp, mnt.join(&name))?;
                    File::open(mnt.join("ckpt"))?.sync_all()?;
                    Ok(())
                })();
                if r.is_err() {
                    break;
                }
                acked.lock().unwrap().push((name, i));
                // Unsynced noise that may or may not survive.
                let _ = fs::write(mnt.join(format!("ckpt/scratch{}", i % 5)), pattern(50_000, i + 1000));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(1500));
    // Something is being written right now: open a file mid-write too.
    let mut mid = OpenOptions::new().create(true).truncate(true).write(true).open(m.path("midwrite")).unwrap();
    mid.write_all(&pattern(1 << 20, 5)).unwrap();
    m.crash();
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    drop(mid);
    drop(orphan);
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() >= 3, "workload made progress before the crash ({} files)", acked.len());

    // Mount again, reading every byte through the verifying daemon path.
    m.extra = vec!["--verify-reads".into()];
    m.mount();
    drop_caches();
    for (name, seed) in &acked {
        let got = fs::read(m.path(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let len = 1000 + (*seed as usize * 37_771) % (3 << 20);
        assert!(got == pattern(len, *seed), "{name}: fsynced bytes differ after crash");
    }
    // Metadata and chunks agree: every file reads in full with valid
    // checksums, and every backing file belongs to a live inode.
    let mut files = BTreeMap::new();
    walk(&m.mnt, &mut files, &m.mnt);
    for (name, (_, len)) in &files {
        let got = fs::read(m.path(name)).unwrap_or_else(|e| panic!("{name} unreadable after recovery: {e}"));
        assert_eq!(got.len() as u64, *len, "{name}");
    }
    let live: BTreeSet<u64> = files.values().map(|(ino, _)| *ino).collect();
    for entry in fs::read_dir(m.data.join("chunks")).unwrap() {
        let ino = u64::from_str_radix(entry.unwrap().file_name().to_str().unwrap(), 16).unwrap();
        assert!(live.contains(&ino), "backing file of inode {ino} has no file");
    }
    assert!(!live.contains(&orphan_ino));
    assert!(!m.data.join("chunks").join(format!("{orphan_ino:016x}")).exists(), "orphan purged");
}
