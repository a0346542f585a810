//! The kernel connection outlives the daemon: a daemon killed under a live
//! mount (or upgraded) is replaced on the same connection by its
//! supervisor, and the processes using the mount see nothing but a pause.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const READ_FILES: usize = 200;
const CKPT: usize = 64 << 20;

/// Errors the two processes' loops met, in words.
type Errors = Arc<Mutex<Vec<String>>>;

fn daemon_of(data: &Path) -> i32 {
    daemon_pid(data).expect("a daemon holds the data dir")
}

/// Wait until a daemon other than `old` holds the data dir.
fn replaced(data: &Path, old: i32) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(pid) = daemon_pid(data).filter(|p| *p != old && Path::new(&format!("/proc/{p}")).exists()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "no new daemon within 20 s of {old}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A reader hashing 200 files over and over, and a writer saving a 64 MiB
/// checkpoint as training code does (tmp, write, fsync, rename, fsync of
/// the directory), while `disturb(i)` runs `rounds` times, 3 s apart.
/// Neither may see an error; every read is right; the checkpoint is whole.
fn under_load(mnt: &Path, rounds: usize, disturb: impl FnMut(usize)) {
    under_load_on(mnt, &[mnt], rounds, disturb)
}

/// `under_load` with the writer on mount `writer` and one reader on each
/// of `readers` (mounts of one volume: the files are written once, through
/// `writer`, and each reader waits until it sees them).
fn under_load_on(writer: &Path, readers: &[&Path], rounds: usize, mut disturb: impl FnMut(usize)) {
    let dir = writer.join("load");
    fs::create_dir(&dir).unwrap();
    for i in 0..READ_FILES {
        fs::write(dir.join(format!("r{i}")), pattern(4096 + i * 97, i as u64)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let errors: Errors = Arc::default();
    let (reads, saves) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let reader_threads: Vec<_> = readers
        .iter()
        .map(|mnt| {
            let dir = mnt.join("load");
            let last = dir.join(format!("r{}", READ_FILES - 1));
            let deadline = Instant::now() + Duration::from_secs(20);
            while fs::metadata(&last).map(|m| m.len()).ok() != Some((4096 + (READ_FILES - 1) * 97) as u64) {
                assert!(Instant::now() < deadline, "{} never saw the files to read", mnt.display());
                std::thread::sleep(Duration::from_millis(50));
            }
            let (stop, errors, reads) = (stop.clone(), errors.clone(), reads.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    for i in 0..READ_FILES {
                        match fs::read(dir.join(format!("r{i}"))) {
                            Ok(got) if got == pattern(4096 + i * 97, i as u64) => {}
                            Ok(got) => errors.lock().unwrap().push(format!(
                                "{}: wrong bytes ({} long)",
                                dir.join(format!("r{i}")).display(),
                                got.len()
                            )),
                            Err(e) => errors
                                .lock()
                                .unwrap()
                                .push(format!("read {}: {e}", dir.join(format!("r{i}")).display())),
                        }
                    }
                    reads.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let writer = {
        let (dir, stop, errors, saves) = (dir.clone(), stop.clone(), errors.clone(), saves.clone());
        std::thread::spawn(move || {
            let mut generation = 0u64;
            while !stop.load(Ordering::SeqCst) {
                generation += 1;
                if let Err(e) = save(&dir, generation) {
                    errors.lock().unwrap().push(format!("checkpoint {generation}: {e}"));
                    continue;
                }
                saves.store(generation, Ordering::SeqCst);
            }
        })
    };
    for i in 0..rounds {
        std::thread::sleep(Duration::from_secs(3));
        disturb(i);
    }
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    for r in reader_threads {
        r.join().unwrap();
    }
    writer.join().unwrap();
    let errors = errors.lock().unwrap();
    assert!(errors.is_empty(), "{} errors, the first: {:?}", errors.len(), &errors[..errors.len().min(5)]);
    let last = saves.load(Ordering::SeqCst);
    eprintln!("{last} checkpoints saved, {} read passes over {READ_FILES} files", reads.load(Ordering::SeqCst));
    assert!(last >= 2 && reads.load(Ordering::SeqCst) >= 2 * readers.len() as u64, "the loops ran ({last} saves)");
    for mnt in readers {
        let ckpt = fs::read(mnt.join("load/ckpt")).unwrap();
        assert!(
            ckpt == pattern(CKPT, last),
            "the last checkpoint (generation {last}) reads back whole on {}",
            mnt.display()
        );
    }
}

fn save(dir: &Path, generation: u64) -> std::io::Result<()> {
    let tmp = dir.join("ckpt.tmp");
    let mut f = fs::File::create(&tmp)?;
    f.write_all(&pattern(CKPT, generation))?;
    f.sync_all()?;
    drop(f);
    fs::rename(&tmp, dir.join("ckpt"))?;
    fs::File::open(dir)?.sync_all()
}

fn restarts_in_log(m: &Mount) -> usize {
    m.log().matches("starting a new one on the live connection").count()
}

#[test]
fn a_daemon_killed_every_three_seconds_costs_the_reader_and_the_writer_nothing() {
    let m = Mount::new();
    let data = m.data.clone();
    let supervisor = m.supervisor_pid().expect("a supervisor runs the daemon");
    under_load(&m.mnt, 20, |_| {
        let old = daemon_of(&data);
        // SAFETY: kill(2).
        unsafe { libc::kill(old, libc::SIGKILL) };
        replaced(&data, old);
    });
    assert_eq!(restarts_in_log(&m), 20, "each kill was followed by a restart on the live connection");
    assert_eq!(m.supervisor_pid(), Some(supervisor), "one supervisor throughout");
}

/// The same on a 2-node cluster on etcd, the killed daemon being the
/// writer's node: its replicas, write leases and etcd session are taken
/// over by the next daemon, and a reader on each node sees nothing.
#[test]
fn a_cluster_nodes_daemon_killed_every_three_seconds_costs_its_writer_and_both_readers_nothing() {
    let Some(c) = cluster::Cluster::start(2, &[]) else { return };
    let (n1, n2) = (c.node(0), c.node(1));
    let supervisor = n1.supervisor_pid().expect("a supervisor runs the daemon");
    let data = n1.data.clone();
    under_load_on(&n1.mnt, &[&n1.mnt, &n2.mnt], 20, |_| {
        let old = daemon_of(&data);
        // SAFETY: kill(2).
        unsafe { libc::kill(old, libc::SIGKILL) };
        replaced(&data, old);
    });
    assert_eq!(restarts_in_log(n1), 20, "each kill was followed by a restart on the live connection");
    assert_eq!(n1.supervisor_pid(), Some(supervisor), "one supervisor throughout");
}

#[test]
fn a_kill_inside_an_fsync_still_leaves_the_fsynced_bytes() {
    let mut m = Mount::new();
    for (i, delay_ms) in [0u64, 15, 60, 150, 400].into_iter().enumerate() {
        let path = m.path(&format!("big{i}"));
        let want = pattern(256 << 20, i as u64);
        let mut f = fs::File::create(&path).unwrap();
        f.write_all(&want).unwrap();
        let old = daemon_of(&m.data);
        let killer = {
            let data = m.data.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(delay_ms));
                // SAFETY: kill(2).
                unsafe { libc::kill(daemon_of(&data), libc::SIGKILL) };
            })
        };
        let synced = f.sync_all();
        killer.join().unwrap();
        replaced(&m.data, old);
        synced.unwrap_or_else(|e| panic!("fsync with a kill after {delay_ms} ms: {e}"));
        drop(f);
        assert!(fs::read(&path).unwrap() == want, "after a kill {delay_ms} ms into its fsync, big{i} reads back whole");
    }
    // And from the disk, after the whole node died and mounted again.
    m.crash();
    m.mount();
    for i in 0..5 {
        assert!(
            fs::read(m.path(&format!("big{i}"))).unwrap() == pattern(256 << 20, i as u64),
            "big{i} after a remount"
        );
    }
}

#[test]
fn converged_upgrade_under_load_fails_no_request() {
    let m = Mount::new();
    let data = m.data.clone();
    let mnt: PathBuf = m.mnt.clone();
    under_load(&m.mnt, 4, |_| {
        let old = daemon_of(&data);
        let out = converged().arg("upgrade").arg(&mnt).output().unwrap();
        assert!(out.status.success(), "upgrade failed: {}", String::from_utf8_lossy(&out.stderr));
        assert_ne!(replaced(&data, old), old);
    });
    assert!(m.log().matches("connection handed over").count() == 4, "four hand-overs: {}", m.log());
    assert_eq!(restarts_in_log(&m), 0, "no daemon died");
}

#[test]
fn a_daemon_that_dies_at_every_start_makes_the_supervisor_give_up() {
    let root = tempfile::Builder::new().prefix("converged-test").tempdir().unwrap();
    let (data, mnt) = (root.path().join("data"), root.path().join("mnt"));
    fs::create_dir(&data).unwrap();
    fs::create_dir(&mnt).unwrap();
    let out = converged()
        .arg("mount")
        .arg(&mnt)
        .arg("--data-dir")
        .arg(&data)
        .args(["--restart-limit", "3", "--restart-window", "60s"])
        .env("CONVERGED_FAULT_DIE_ON_RESTART", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    fs::write(mnt.join("f"), b"before").unwrap();
    let supervisor = supervisor_pid(&data).unwrap();
    // SAFETY: kill(2).
    unsafe { libc::kill(daemon_of(&data), libc::SIGKILL) };
    wait_gone(supervisor);
    let err = fs::metadata(mnt.join("f")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "the mount reports ENOTCONN once the supervisor gave up");
    let log = fs::read_to_string(data.join("converged.log")).unwrap();
    assert!(log.contains("giving up"), "the reason is in the log: {log}");
    assert_eq!(log.matches("starting a new one on the live connection").count(), 3, "three restarts, then none");
    lazy_umount(&mnt);
}

#[test]
fn an_open_file_written_across_a_kill_reads_back_whole_after_close() {
    let m = Mount::new();
    let path = m.path("across");
    let mut f = fs::OpenOptions::new().create(true).write(true).truncate(true).open(&path).unwrap();
    let mut r = fs::File::open(&path).unwrap();
    f.write_all(&pattern(3 << 20, 1)).unwrap();
    let old = daemon_of(&m.data);
    // SAFETY: kill(2).
    unsafe { libc::kill(old, libc::SIGKILL) };
    replaced(&m.data, old);
    f.write_all(&pattern(1 << 20, 2)).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let mut got = Vec::new();
    r.read_to_end(&mut got).unwrap();
    let mut want = pattern(3 << 20, 1);
    want.extend(pattern(1 << 20, 2));
    assert!(got == want, "the reader opened before the kill reads what the writer wrote across it");
    assert!(fs::read(&path).unwrap() == want);
    assert!(m.log().contains("writers=1"), "the writer's session was taken over, not sealed at recovery");
}

/// A daemon that dies after a namespace change commits and before it
/// answers leaves the request to the next daemon, which the kernel sends
/// it to again: each change is answered as done (no EEXIST for a mkdir
/// or an O_EXCL create it made, no ENOENT for a rename or unlink), and is
/// made once. The fault switch makes the n-th daemon die after the n-th
/// operation it names.
#[test]
fn a_change_committed_by_a_daemon_that_died_before_answering_is_answered_as_done() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let ops = ["mkdir", "create", "mknod", "symlink", "link", "rename", "unlink", "rmdir"];
    let m = Mount::with_env(&["--restart-limit", "20"], &[("CONVERGED_FAULT_DIE_AFTER_COMMIT", &ops.join(","))]);
    let (data, mnt) = (m.data.clone(), m.mnt.clone());
    let p = |rel: &str| mnt.join(rel);
    let log = || fs::read_to_string(data.join("converged.log")).unwrap_or_default();
    let died = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while log().matches("starting a new one on the live connection").count() < n {
            assert!(Instant::now() < deadline, "daemon {n} did not die:\n{}", log());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    fs::create_dir(p("d")).expect("mkdir");
    died(1);
    fs::create_dir(p("d/e")).unwrap();
    let mut f = fs::OpenOptions::new().write(true).create_new(true).open(p("d/f")).expect("create with O_EXCL");
    died(2);
    f.write_all(b"written after the create").unwrap();
    drop(f);
    // SAFETY: mkfifo(3) with a valid path.
    assert_eq!(unsafe { libc::mkfifo(cstr(&p("d/p")).as_ptr(), 0o644) }, 0, "mknod: errno {}", errno());
    died(3);
    std::os::unix::fs::symlink("f", p("d/s")).expect("symlink");
    died(4);
    fs::hard_link(p("d/f"), p("d/h")).expect("link");
    died(5);
    fs::rename(p("d/f"), p("d/g")).expect("rename");
    died(6);
    fs::remove_file(p("d/h")).expect("unlink");
    died(7);
    fs::remove_dir(p("d/e")).expect("rmdir");
    died(8);
    // What each change left, once.
    assert_eq!(fs::read(p("d/g")).unwrap(), b"written after the create");
    assert_eq!(fs::metadata(p("d/g")).unwrap().nlink(), 1, "one name after link and unlink");
    assert!(fs::metadata(p("d/p")).unwrap().file_type().is_fifo());
    assert_eq!(fs::read_link(p("d/s")).unwrap(), Path::new("f"));
    let mut names: Vec<String> =
        fs::read_dir(p("d")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["g", "p", "s"]);
    assert_eq!(
        log().matches("a resent request's change had committed").count(),
        ops.len(),
        "each was answered from its record:\n{}",
        log()
    );
}
