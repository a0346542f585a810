//! Self-healing on real daemons: four nodes on loopback, a real 3-member
//! etcd, QUIC between them. A node killed with `kill -9` is rebuilt around
//! after the repair delay, so a second failure loses nothing; a backed file
//! whose holders all died reads from the object store and is copied back
//! onto the live nodes; a drain moves every chunk off a node while readers
//! loop over the files without one error; a deleted file's copies leave
//! every node, at once for live ones and at return for one that was down.

mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::*;
use common::*;

const MIB: usize = 1 << 20;

/// The node options of these tests: a dead node is rebuilt around 4 s
/// after its lease expired (3 s lease), unneeded copies go 3 s after they
/// were found so.
const HEAL: [&str; 4] = ["--repair-delay", "4s", "--sweep-grace", "3s"];

/// Three nodes with a directory `d` whose files get a copy on each.
fn three_copies() -> Option<Cluster> {
    let c = Cluster::start(3, &HEAL)?;
    fs::create_dir(c.node(0).path("d")).unwrap();
    setxattr(&c.node(0).path("d"), "user.converged.replicas", b"3");
    Some(c)
}

/// Write `data` to `name` on n1; its inode number.
fn write_on_n1(c: &Cluster, name: &str, data: &[u8]) -> u64 {
    fs::write(c.node(0).path(name), data).unwrap();
    fs::metadata(c.node(0).path(name)).unwrap().ino()
}

/// (under-replicated, no live copy) from `status --meta`'s volume line.
fn health(c: &Cluster) -> (u64, u64) {
    let s = status(c);
    let line = s.lines().find(|l| l.contains(" under-replicated, ")).unwrap_or_else(|| panic!("no health line: {s}"));
    let num_before = |what: &str| -> u64 {
        let head = &line[..line.find(what).unwrap_or_else(|| panic!("{what:?} in {line}"))];
        head.trim_end().rsplit(' ').next().unwrap().parse().unwrap()
    };
    (num_before(" under-replicated"), num_before(" with no live copy"))
}

/// The state column and chunk count of `node` in `status --meta`.
fn node_line(c: &Cluster, node: &str) -> String {
    let s = status(c);
    s.lines().find(|l| l.starts_with(&format!("{node} "))).unwrap_or_else(|| panic!("{node} not in {s}")).to_string()
}

fn read_all(c: &Cluster, i: usize, files: &[(String, Vec<u8>)]) {
    for (name, data) in files {
        let got = fs::read(c.node(i).path(name)).unwrap_or_else(|e| panic!("read {name} on n{}: {e}", i + 1));
        same(&got, data, &format!("{name} on n{}", i + 1));
    }
}

/// With `--durability local`, `close` returns once the local copy is
/// durable and the writer's replicator copies each file to a peer in the
/// background, recording the copies a dozen chunks to a transaction: 40
/// small files and a 6 MiB one written on n1 soon have two copies each, and
/// with n1 killed then, n2 reads every byte from its own copies.
#[test]
fn copies_made_in_the_background_are_recorded_and_outlive_the_writer() {
    let Some(mut c) = Cluster::start(2, &["--durability", "local", "--repair-delay", "10m"]) else { return };
    fs::create_dir(c.node(0).path("d")).unwrap();
    let mut files: Vec<(String, Vec<u8>)> =
        (0..40u64).map(|i| (format!("d/small-{i}"), pattern(1000 + 37 * i as usize, 500 + i))).collect();
    files.push(("d/large".to_string(), pattern(6 * MIB, 600)));
    for (name, data) in &files {
        fs::write(c.node(0).path(name), data).unwrap();
    }
    eventually(60, "two copies of every chunk, made in the background", || health(&c) == (0, 0));
    c.nodes[0].crash();
    eventually(30, "n1 is seen dead", || status(&c).contains("1 live, 1 dead"));
    read_all(&c, 1, &files);
}

/// The writer killed (`kill -9`) while its replicator is copying 200
/// files written with `--durability local` (copies made on the peer and not
/// recorded yet, a record half way): once it mounts again every file reads
/// whole on both nodes, gets its two copies, and fsck finds nothing wrong.
#[test]
fn a_writer_killed_while_copying_in_the_background_loses_nothing() {
    let Some(mut c) = Cluster::start(2, &["--durability", "local", "--sweep-grace", "3s"]) else { return };
    fs::create_dir(c.node(0).path("d")).unwrap();
    let files: Vec<(String, Vec<u8>)> =
        (0..200u64).map(|i| (format!("d/f-{i}"), pattern(700 + 53 * i as usize, 800 + i))).collect();
    for (name, data) in &files {
        fs::write(c.node(0).path(name), data).unwrap();
    }
    c.nodes[0].crash();
    c.nodes[0].mount();
    read_all(&c, 0, &files);
    eventually(90, "two copies of every chunk after the writer came back", || health(&c) == (0, 0));
    read_all(&c, 1, &files);
    let (clean, report) = fsck(&c);
    assert!(clean, "fsck after the writer came back: {report}");
}

/// 600 MiB at two copies; n1 dies: within the repair delay plus a bound
/// every chunk has two live copies again; then n2 dies: every byte reads
/// back on n3 and n4.
#[test]
fn a_dead_nodes_chunks_are_rebuilt_before_a_second_failure() {
    let Some(mut c) = Cluster::start(4, &HEAL) else { return };
    fs::create_dir(c.node(0).path("ckpt")).unwrap();
    let files: Vec<(String, Vec<u8>)> =
        (0..6u64).map(|i| (format!("ckpt/shard-{i}.pt"), pattern(100 * MIB, 300 + i))).collect();
    for (name, data) in &files {
        fs::write(c.node(0).path(name), data).unwrap();
    }
    // A replica write that timed out on a loaded machine is topped up by
    // the writer's replicator.
    eventually(60, "two copies of every chunk after the writes", || health(&c) == (0, 0));

    c.nodes[0].crash();
    let killed = Instant::now();
    eventually(30, "n1 is seen dead", || status(&c).contains("3 live, 1 dead"));
    assert_ne!(health(&c).0, 0, "n1's chunks are under-replicated once it is dead");
    // The lease (3 s) and the repair delay (4 s) pass first; the bound on
    // the copying itself is generous for a loaded 2-core machine.
    eventually(180, "no chunk under-replicated after n1 died", || health(&c) == (0, 0));
    let took = killed.elapsed();
    let (clean, report) = fsck(&c);
    assert!(clean, "fsck after the repair: {report}");
    eprintln!("repaired 600 MiB of n1's copies {:.1}s after kill -9 (lease 3s + repair delay 4s)", took.as_secs_f64());
    assert!(node_line(&c, "n1").contains(" dead("), "{}", node_line(&c, "n1"));
    // Repair records a chunk's new copy, then drops the dead holder in a
    // second step: in between the chunk has its two live copies and still
    // names n1 (seen once in a full run), so the last drops may trail the
    // health line by a moment.
    eventually(30, "no record names n1", || node_line(&c, "n1").split_whitespace().nth(7) == Some("0"));

    c.nodes[1].crash();
    eventually(30, "n2 is seen dead", || status(&c).contains("2 live, 2 dead"));
    let (clean, report) = fsck(&c);
    assert!(
        !clean && report.contains("copies on live nodes, 2 asked"),
        "fsck names the under-replicated chunks: {report}"
    );
    assert!(report.contains("/ckpt/shard-"), "fsck names the paths: {report}");
    read_all(&c, 2, &files);
    read_all(&c, 3, &files);
}

/// How long a node has been dead is measured from when the others saw
/// etcd expire its lease, never from the dead node's clock: a node whose
/// clock ran an hour behind (by its heartbeats it died an hour ago) is
/// still waited for the repair delay, and one whose clock ran an hour
/// ahead (it seems to die in the future) is rebuilt around once the delay
/// has passed, not an hour later.
#[test]
fn repair_waits_its_delay_whatever_the_dead_nodes_clock_said() {
    const DELAY: [&str; 2] = ["--repair-delay", "10s"];
    let Some(mut c) = Cluster::start(2, &DELAY) else { return };
    c.add_node(&[DELAY[0], DELAY[1], "--clock-offset", "-3600"]);
    c.add_node(&[DELAY[0], DELAY[1], "--clock-offset", "3600"]);
    fs::create_dir(c.node(0).path("d")).unwrap();
    setxattr(&c.node(0).path("d"), "user.converged.replicas", b"2");
    let n1 = c.node(0).mnt.clone();
    let layout = |name: &str| xattr_value(&n1.join(name), "user.converged.layout");
    // Each file's writer holds a copy of it.
    let behind = pattern(8 * MIB, 61);
    fs::write(c.node(2).path("d/behind.bin"), &behind).unwrap();
    let ahead = pattern(8 * MIB, 62);
    fs::write(c.node(3).path("d/ahead.bin"), &ahead).unwrap();
    eventually(60, "two copies of every chunk", || health(&c) == (0, 0));
    assert!(layout("d/behind.bin").contains("n3"), "{}", layout("d/behind.bin"));
    assert!(layout("d/ahead.bin").contains("n4"), "{}", layout("d/ahead.bin"));

    // n3, an hour behind, dies: it is waited for.
    c.nodes[2].crash();
    eventually(30, "n3 is seen dead", || status(&c).contains("3 live, 1 dead"));
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        layout("d/behind.bin").contains("n3"),
        "n3's copy was given up before the repair delay: {}",
        layout("d/behind.bin")
    );
    eventually(60, "behind.bin rebuilt around n3 after the delay", || {
        let l = layout("d/behind.bin");
        !l.contains("n3") && health(&c) == (0, 0)
    });
    same(&fs::read(c.node(0).path("d/behind.bin")).unwrap(), &behind, "behind.bin");

    // n4, an hour ahead, dies: it is rebuilt around after the delay.
    c.nodes[3].crash();
    eventually(30, "n4 is seen dead", || status(&c).contains("2 live, 2 dead"));
    eventually(60, "ahead.bin rebuilt around n4 after the delay", || {
        let l = layout("d/ahead.bin");
        !l.contains("n4") && health(&c) == (0, 0)
    });
    same(&fs::read(c.node(1).path("d/ahead.bin")).unwrap(), &ahead, "ahead.bin");
}

/// A backed file at one copy whose only holder dies: it reads back from
/// the object store on the live nodes, and repair copies it onto one.
#[test]
fn a_backed_file_whose_holders_died_reads_from_the_object_store() {
    let Some(s3) = common::s3::S3Server::with_buckets(&["vol"]) else { return };
    let endpoint = s3.endpoint();
    let mut args = vec!["--object-store", "s3://vol/v", "--s3-endpoint", &endpoint, "--backfill-delay", "1s"];
    args.extend_from_slice(&HEAL);
    let Some(mut c) = Cluster::start(4, &args) else { return };
    fs::create_dir(c.node(0).path("solo")).unwrap();
    setxattr(&c.node(0).path("solo"), "user.converged.replicas", b"1");
    let data = pattern(24 * MIB, 77);
    fs::write(c.node(0).path("solo/a.bin"), &data).unwrap();
    eventually(60, "solo/a.bin is backed", || {
        xattr_value(&c.node(0).path("solo/a.bin"), "user.converged.tier").starts_with("state=backed")
    });
    c.nodes[0].crash();
    // Straight away (n1 still looks live for a few seconds), and after.
    let got = fs::read(c.node(2).path("solo/a.bin")).unwrap();
    same(&got, &data, "a.bin on n3 with its only holder dead");
    eventually(120, "a.bin has a copy on a live node again", || health(&c) == (0, 0));
    let got = fs::read(c.node(3).path("solo/a.bin")).unwrap();
    same(&got, &data, "a.bin on n4 after repair");

    // gc: an object under the volume's prefix that no file owns goes; the
    // file's own object stays.
    s3.client().put("vol", "v/stray/left-behind.bin", b"nobody's");
    let out = converged()
        .args(["gc", "--meta", &c.meta, "--object-store", "s3://vol/v", "--s3-endpoint", &endpoint, "--min-age", "0s"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("1 belong to no file"), "{text}");
    assert_eq!(s3.client().list("vol", "v/"), vec!["v/solo/a.bin".to_string()], "{text}");
    same(&s3.client().get("vol", "v/solo/a.bin").unwrap(), &data, "a.bin's object after gc");

    // fsck with the store: an object overwritten behind converged's back is
    // named; --repair has a live holder upload the file again.
    s3.client().put("vol", "v/solo/a.bin", b"clobbered");
    let fsck = |repair: bool| {
        let mut cmd = converged();
        cmd.args(["fsck", "--meta", &c.meta, "--object-store", "s3://vol/v", "--s3-endpoint", &endpoint]);
        if repair {
            cmd.arg("--repair");
        }
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let (clean, report) = fsck(false);
    assert!(!clean && report.contains("/solo/a.bin: object v/solo/a.bin holds 9 bytes"), "{report}");
    let (_, report) = fsck(true);
    assert!(report.contains("repaired 1"), "{report}");
    eventually(60, "a.bin is uploaded again", || s3.client().get("vol", "v/solo/a.bin").is_some_and(|o| o == data));
    eventually(30, "fsck is clean again", || fsck(false).0);
}

/// `node drain n3` while readers on two other nodes loop over every file:
/// no read fails, and at the end no record names n3, n3 holds no copy,
/// and status says it is drained.
#[test]
fn draining_a_node_moves_its_chunks_without_a_read_error() {
    let Some(c) = Cluster::start(4, &HEAL) else { return };
    fs::create_dir(c.node(0).path("data")).unwrap();
    let files: Vec<(String, Vec<u8>)> =
        (0..8u64).map(|i| (format!("data/part-{i}.bin"), pattern(24 * MIB + i as usize * 4097, 500 + i))).collect();
    for (name, data) in &files {
        fs::write(c.node(0).path(name), data).unwrap();
    }
    let inos: Vec<u64> = files.iter().map(|(n, _)| fs::metadata(c.node(0).path(n)).unwrap().ino()).collect();
    let held_before = node_line(&c, "n3");
    assert!(inos.iter().any(|ino| c.holds(2, *ino)), "n3 holds copies before the drain: {held_before}");

    let stop = Arc::new(AtomicBool::new(false));
    let (loops, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let readers: Vec<_> = [1usize, 3]
        .into_iter()
        .map(|i| {
            let (stop, loops, errors) = (stop.clone(), loops.clone(), errors.clone());
            let mnt = c.node(i).mnt.clone();
            let files = files.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for (name, data) in &files {
                        match fs::read(mnt.join(name)) {
                            Ok(got) if got == *data => {}
                            Ok(got) => {
                                eprintln!("n{}: {name}: {} bytes, not the file's", i + 1, got.len());
                                errors.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                eprintln!("n{}: {name}: {e}", i + 1);
                                errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    loops.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // Writers on the draining node and on another one, a few files each.
    let write_errors = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|i| {
            let mnt = c.node(i).mnt.clone();
            let errors = write_errors.clone();
            std::thread::spawn(move || {
                for k in 0..6u64 {
                    let name = format!("data/new-n{}-{k}.bin", i + 1);
                    if let Err(e) = fs::write(mnt.join(&name), pattern(8 * MIB, 900 + 10 * i as u64 + k)) {
                        eprintln!("{name}: {e}");
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        })
        .collect();
    let started = Instant::now();
    let out = converged().args(["node", "drain", "n3", "--meta", &c.meta]).output().unwrap();
    assert!(
        out.status.success(),
        "drain: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("drained n3 in {:.1}s", started.elapsed().as_secs_f64());
    for w in writers {
        w.join().unwrap();
    }
    // What n3 wrote after the drain was marked done is moved off too.
    let mut inos = inos;
    for i in [0u64, 2] {
        for k in 0..6u64 {
            inos.push(fs::metadata(c.node(0).path(&format!("data/new-n{}-{k}.bin", i + 1))).unwrap().ino());
        }
    }
    eventually(90, "no record names n3", || node_line(&c, "n3").split_whitespace().nth(7) == Some("0"));
    eventually(60, "n3 removed its copies", || inos.iter().all(|ino| !c.holds(2, *ino)));
    // Readers keep going a little past the last removal.
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    assert_eq!(errors.load(Ordering::Relaxed), 0, "reads failed during the drain");
    assert_eq!(write_errors.load(Ordering::Relaxed), 0, "writes failed during the drain");
    assert!(loops.load(Ordering::Relaxed) >= 2, "the readers read every file during the drain");
    let line = node_line(&c, "n3");
    assert!(line.contains("drained"), "{line}");
    assert_eq!(line.split_whitespace().nth(7), Some("0"), "no record names n3: {line}");
    assert_eq!(health(&c), (0, 0), "every chunk has its copies elsewhere");
    // Nothing new lands on a drained node, not even what it writes itself.
    let own = pattern(70 * MIB, 10);
    fs::write(c.node(2).path("data/own.bin"), &own).unwrap();
    let layout = xattr_value(&c.node(2).path("data/own.bin"), "user.converged.layout");
    assert!(!layout.contains("n3") && layout.lines().count() == 2, "a drained writer keeps no copy: {layout}");
    same(&fs::read(c.node(2).path("data/own.bin")).unwrap(), &own, "own.bin on n3");
    same(&fs::read(c.node(3).path("data/own.bin")).unwrap(), &own, "own.bin on n4");
    fs::write(c.node(0).path("data/after.bin"), pattern(8 * MIB, 9)).unwrap();
    let ino = fs::metadata(c.node(0).path("data/after.bin")).unwrap().ino();
    std::thread::sleep(Duration::from_secs(1));
    assert!(!c.holds(2, ino), "a drained node took a new copy");
    read_all(&c, 2, &files);
    for i in [0u64, 2] {
        for k in 0..6u64 {
            let name = format!("data/new-n{}-{k}.bin", i + 1);
            same(&fs::read(c.node(3).path(&name)).unwrap(), &pattern(8 * MIB, 900 + 10 * i + k), &name);
        }
    }
}

/// A deleted file's copies leave every node: live peers are told at once;
/// a peer that was down removes its copy when it comes back.
#[test]
fn a_deleted_files_copies_leave_every_node() {
    let Some(mut c) = three_copies() else { return };
    let names = ["d/a.bin", "d/b.bin", "d/c.bin"];
    let inos: Vec<u64> =
        names.iter().enumerate().map(|(i, name)| write_on_n1(&c, name, &pattern(12 * MIB, i as u64))).collect();
    for i in 0..3 {
        eventually(20, "every node holds every file", || inos.iter().all(|ino| c.holds(i, *ino)));
    }
    fs::remove_file(c.node(1).path(names[0])).unwrap();
    for i in 0..3 {
        eventually(20, &format!("n{} dropped the deleted file", i + 1), || !c.holds(i, inos[0]));
    }

    c.nodes[2].crash();
    fs::remove_file(c.node(0).path(names[1])).unwrap();
    for i in 0..2 {
        eventually(20, &format!("n{} dropped the second file", i + 1), || !c.holds(i, inos[1]));
    }
    assert!(c.holds(2, inos[1]), "the node that was down still has its copy");
    c.nodes[2].mount();
    let out = converged().args(["gc", "--meta", &c.meta, "--timeout", "60s"]).output().unwrap();
    assert!(
        out.status.success(),
        "gc: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for i in 0..3 {
        assert!(!c.holds(i, inos[1]), "n{} still holds the file deleted while n3 was down", i + 1);
    }
    let kept = fs::metadata(c.node(2).path("d/c.bin")).unwrap().ino();
    assert!((0..3).all(|i| c.holds(i, kept)), "gc kept the live file's copies");
}

/// `converged fsck --meta`: its output, and whether it exited 0.
fn fsck(c: &Cluster) -> (bool, String) {
    let out = converged().args(["fsck", "--meta", &c.meta]).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Bytes flipped in a peer's copy with `dd`: `scrub --now` on that peer
/// reports the bad blocks and rewrites them from the other holder, and a
/// second scrub finds the copy clean; the other node's copy is untouched,
/// and fsck finds nothing wrong.
#[test]
fn scrub_finds_and_repairs_a_flipped_copy() {
    let Some(c) = three_copies() else { return };
    let data = pattern(20 * MIB, 41);
    let ino = write_on_n1(&c, "d/w.bin", &data);
    // n2's copy, where it keeps it: the version file it received (one
    // chunk), or its backing file.
    assert!(c.stored_becomes(1, ino, &data), "n2 holds the file");
    let held = |i: usize| {
        let (backing, versions) = c.stored_files(i, ino);
        versions.last().map_or(backing, |(_, p)| p.clone())
    };
    let backing = held(1);
    let flip = |offset: u64| {
        let out = std::process::Command::new("dd")
            .args(["if=/dev/urandom", "bs=512", "count=1", "conv=notrunc,fsync", &format!("seek={}", offset / 512)])
            .arg(format!("of={}", backing.display()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    flip(3 << 20);
    flip((17 << 20) + 4096);
    drop_caches();
    let scrub = |i: usize| converged().args(["scrub", "--now"]).arg(c.node(i).path("d")).output().unwrap();
    let out = scrub(1);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("2 bad blocks, 2 repaired"), "{text}");
    assert!(c.stored(1, ino) == data, "n2's copy is whole again");
    let again = String::from_utf8_lossy(&scrub(1).stdout).into_owned();
    assert!(again.contains(": 0 bad blocks"), "{again}");
    let n1 = String::from_utf8_lossy(&scrub(0).stdout).into_owned();
    assert!(n1.contains(": 0 bad blocks"), "{n1}");
    same(&fs::read(c.node(2).path("d/w.bin")).unwrap(), &data, "w.bin on n3");
    let (clean, report) = fsck(&c);
    assert!(clean && report.contains(": 0 problems"), "{report}");

    // n3's copy deleted outright: its scrub reports it, drops n3 from the
    // record, and repair copies the chunk back.
    let gone = held(2);
    fs::remove_file(&gone).unwrap();
    let out = scrub(2);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success() && text.contains("320 bad blocks, 0 repaired"), "{text}");
    eventually(60, "n3 holds w.bin again", || c.stored(2, ino) == data);
    eventually(30, "every chunk has its copies", || health(&c) == (0, 0));
}

/// The scrub worker, not `scrub --now`: checking in the background the
/// copies of many small files (their chunk records read many to a
/// request), it finds the block flipped in one of them and rewrites it
/// from the other holder.
#[test]
fn the_background_scrub_repairs_a_flipped_block_among_many_small_files() {
    let Some(c) = Cluster::start(2, &["--scrub-period", "15s"]) else { return };
    fs::create_dir(c.node(0).path("s")).unwrap();
    let files: Vec<(u64, Vec<u8>)> = (0..40)
        .map(|i| {
            let data = pattern(8192, 500 + i);
            (write_on_n1(&c, &format!("s/f{i}"), &data), data)
        })
        .collect();
    for (ino, data) in &files {
        assert!(c.stored_becomes(1, *ino, data), "n2 holds a copy of inode {ino}");
    }
    let (ino, data) = &files[17];
    let (backing, versions) = c.stored_files(1, *ino);
    let held = versions.last().map_or(backing, |(_, p)| p.clone());
    let out = std::process::Command::new("dd")
        .args(["if=/dev/urandom", "bs=512", "count=1", "seek=4", "conv=notrunc,fsync"])
        .arg(format!("of={}", held.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    drop_caches();
    assert!(c.stored(1, *ino) != *data, "the block was flipped");
    eventually(90, "n2's background scrub rewrote the flipped block", || c.stored(1, *ino) == *data);
    for (ino, data) in &files {
        assert!(c.stored(1, *ino) == *data, "n2's copy of inode {ino}");
    }
}

/// The holders of each chunk of each file, as n`i` reads the layouts.
fn holders(c: &Cluster, i: usize, names: &[String]) -> Vec<Vec<String>> {
    names
        .iter()
        .flat_map(|n| {
            xattr_value(&c.node(i).path(n), "user.converged.layout")
                .lines()
                .map(|l| l.split_whitespace().nth(3).unwrap_or("").split(',').map(str::to_string).collect())
                .collect::<Vec<Vec<String>>>()
        })
        .collect()
}

/// Chunk copies per node from `status --meta`'s chunks column.
fn copies_per_node(c: &Cluster) -> std::collections::BTreeMap<String, u64> {
    status(c)
        .lines()
        .filter(|l| l.starts_with('n') && l.split_whitespace().count() >= 8)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((f[0].to_string(), f[7].parse().ok()?))
        })
        .collect()
}

/// A rebalance run, followed to its end (at most `secs`).
fn rebalance(c: &Cluster, secs: u64) -> std::process::Output {
    let mut child = converged()
        .args(["rebalance", "--meta", &c.meta])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("rebalance did not finish within {secs}s: {:?}", child.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    child.wait_with_output().unwrap()
}

/// 600 one-chunk files at two copies on four nodes; an empty n5 joins and
/// `rebalance` runs: killed midway with a node under it, no chunk has
/// fewer recorded copies than before; run again, it finishes and n5 holds
/// its share (a fifth of the copies, all disks the same size) within 15 %.
#[test]
fn rebalance_gives_a_new_node_its_share_and_survives_a_kill() {
    let Some(mut c) = Cluster::start(4, &HEAL) else { return };
    fs::create_dir(c.node(0).path("many")).unwrap();
    let names: Vec<String> = (0..600).map(|i| format!("many/f{i:04}")).collect();
    for (i, name) in names.iter().enumerate() {
        fs::write(c.node(i % 4).path(name), pattern(64 << 10, i as u64)).unwrap();
    }
    eventually(60, "two copies of every chunk", || health(&c) == (0, 0));
    c.add_node(&HEAL);
    eventually(30, "n5 is live", || status(&c).contains("5 live, 0 dead"));
    assert_eq!(copies_per_node(&c).get("n5"), Some(&0), "n5 starts empty");

    let mut first = converged()
        .args(["rebalance", "--meta", &c.meta])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    eventually(120, "n5 takes some copies", || copies_per_node(&c).get("n5").is_some_and(|n| *n >= 30));
    // The admin's session and a node moving copies die midway.
    let _ = first.kill();
    let _ = first.wait();
    c.nodes[1].crash();
    let now = holders(&c, 2, &names);
    assert_eq!(now.len(), 600, "one chunk per file");
    assert!(now.iter().all(|h| h.len() >= 2), "a chunk lost a recorded copy: {:?}", now.iter().find(|h| h.len() < 2));

    c.nodes[1].mount();
    let out = rebalance(&c, 300);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    eventually(60, "every chunk has its copies", || health(&c) == (0, 0));
    let copies = copies_per_node(&c);
    let total: u64 = copies.values().sum();
    let n5 = copies["n5"] as f64 / total as f64;
    eprintln!("n5 holds {:.1}% of {total} copies after the rebalance (weight: 20%)", 100.0 * n5);
    assert!((0.17..=0.23).contains(&n5), "n5's share {n5:.3} is not within 15% of 0.2: {copies:?}");
    for (i, name) in names.iter().enumerate().step_by(7) {
        same(&fs::read(c.node(4).path(name)).unwrap(), &pattern(64 << 10, i as u64), name);
    }
}

/// A truncate drops chunks from the layout: every node's copy of them is
/// punched out of its backing file or its version files deleted (the space
/// comes back), while the bytes
/// that remain read back everywhere.
#[test]
fn a_truncated_files_dropped_chunks_leave_every_node() {
    let Some(c) = three_copies() else { return };
    let data = pattern(130 * MIB, 8);
    let ino = write_on_n1(&c, "d/t.bin", &data);
    let allocated = |i: usize| c.allocated(i, ino);
    for i in 0..3 {
        eventually(30, &format!("n{} holds all of t.bin", i + 1), || allocated(i) >= 130 * MIB as u64);
    }
    let f = fs::OpenOptions::new().write(true).open(c.node(1).path("d/t.bin")).unwrap();
    f.set_len(10 * MIB as u64).unwrap();
    drop(f);
    for i in 0..3 {
        eventually(60, &format!("n{} punched out the dropped chunks", i + 1), || allocated(i) <= 70 * MIB as u64);
        same(&fs::read(c.node(i).path("d/t.bin")).unwrap(), &data[..10 * MIB], &format!("t.bin on n{}", i + 1));
    }
}
