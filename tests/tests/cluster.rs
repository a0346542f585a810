//! Three nodes on loopback sharing one volume: a real 3-member etcd for the
//! namespace, each daemon serving its SSD to the others over QUIC with mutual
//! TLS. What one node closes, the others read byte for byte; a node killed
//! after fsync loses nothing; a node that stops answering costs its own
//! chunks, promptly, and nothing else.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use common::cluster::*;
use common::*;

#[test]
fn three_nodes_share_files_close_to_open() {
    let Some(c) = Cluster::start(3, &[]) else { return };
    let (a, b, cc) = (c.node(0), c.node(1), c.node(2));

    // Write on A, close, read identical bytes on B and C: 150 MiB is three
    // chunks, each on A and on one peer, so B and C each read some chunks
    // locally and some from a peer.
    let data = pattern(150 << 20, 7);
    fs::create_dir(a.path("datasets")).unwrap();
    fs::write(a.path("datasets/shard-0000.tar"), &data).unwrap();
    for n in [b, cc] {
        let got = fs::read(n.path("datasets/shard-0000.tar")).unwrap();
        assert!(got.len() == data.len() && got == data, "bytes differ on {}", n.mnt.display());
    }
    let ino = fs::metadata(a.path("datasets/shard-0000.tar")).unwrap().ino();
    let copies = (0..3).filter(|i| c.holds(*i, ino)).count();
    assert!(copies >= 2, "replicas=2 by default: found {copies} backing files");

    // A directory policy of 3 replicas, inherited: every node holds the file.
    fs::create_dir(a.path("ckpt")).unwrap();
    setxattr(&a.path("ckpt"), "user.converged.replicas", b"3");
    fs::create_dir(a.path("ckpt/run1")).unwrap();
    let small = pattern(3 << 20, 8);
    fs::write(a.path("ckpt/run1/weights.bin"), &small).unwrap();
    let ino = fs::metadata(a.path("ckpt/run1/weights.bin")).unwrap().ino();
    for i in 0..3 {
        assert!(c.stored_becomes(i, ino, &small), "node {i} holds a full copy");
    }

    // Rename and unlink on B are seen on A.
    fs::rename(b.path("datasets/shard-0000.tar"), b.path("datasets/shard-0001.tar")).unwrap();
    fs::write(b.path("datasets/notes"), b"scratch").unwrap();
    fs::remove_file(b.path("datasets/notes")).unwrap();
    eventually(5, "rename seen on A", || {
        !a.path("datasets/shard-0000.tar").exists() && a.path("datasets/shard-0001.tar").exists()
    });
    assert!(!a.path("datasets/notes").exists());
    same(&fs::read(a.path("datasets/shard-0001.tar")).unwrap(), &data, "datasets/shard-0001.tar on a");

    // The torch.save pattern on A: tmp file, fsync, rename, fsync the
    // directory; B opens the final name and reads the new bytes.
    let step = pattern((5 << 20) + 12345, 9);
    {
        let mut f = fs::File::create(a.path("ckpt/run1/step100.pt.tmp")).unwrap();
        f.write_all(&step).unwrap();
        f.sync_all().unwrap();
    }
    fs::rename(a.path("ckpt/run1/step100.pt.tmp"), a.path("ckpt/run1/step100.pt")).unwrap();
    fs::File::open(a.path("ckpt/run1")).unwrap().sync_all().unwrap();
    eventually(5, "checkpoint visible on B", || b.path("ckpt/run1/step100.pt").exists());
    same(&fs::read(b.path("ckpt/run1/step100.pt")).unwrap(), &step, "ckpt/run1/step100.pt on b");

    // Overwrite in place on A; B's next open sees the new bytes.
    let step2 = pattern(4 << 20, 10);
    fs::write(a.path("ckpt/run1/step100.pt"), &step2).unwrap();
    eventually(5, "new size seen on B", || {
        fs::metadata(b.path("ckpt/run1/step100.pt")).is_ok_and(|m| m.len() == step2.len() as u64)
    });
    same(&fs::read(b.path("ckpt/run1/step100.pt")).unwrap(), &step2, "ckpt/run1/step100.pt on b");

    // One writing node per file: while A writes, B may read but not write.
    let mut w = fs::OpenOptions::new().write(true).open(a.path("ckpt/run1/step100.pt")).unwrap();
    w.write_all(b"x").unwrap();
    let e = fs::OpenOptions::new().write(true).open(b.path("ckpt/run1/step100.pt")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ETXTBSY), "{e}");
    assert!(fs::File::open(b.path("ckpt/run1/step100.pt")).is_ok(), "readers anywhere are fine");
    drop(w);
    // Released at close: B may write now, and what B writes A reads.
    fs::OpenOptions::new().write(true).open(b.path("ckpt/run1/step100.pt")).unwrap().write_all(b"B").unwrap();
    eventually(5, "B's write seen on A", || fs::read(a.path("ckpt/run1/step100.pt")).is_ok_and(|d| d[0] == b'B'));
    let got = fs::read(a.path("ckpt/run1/step100.pt")).unwrap();
    same(&got[1..], &step2[1..], "the rest of the file came along to B and back");
}

#[test]
fn killed_node_loses_no_fsynced_byte_and_comes_back() {
    let Some(mut c) = Cluster::start(3, &[]) else { return };
    // Only on A (replicas=1): readable elsewhere only while A serves.
    fs::create_dir(c.node(0).path("solo")).unwrap();
    setxattr(&c.node(0).path("solo"), "user.converged.replicas", b"1");
    let solo = pattern(2 << 20, 11);
    fs::write(c.node(0).path("solo/a-only.bin"), &solo).unwrap();

    // fsync returns, then A dies before close: B and C read every byte.
    let data = pattern((70 << 20) + 4321, 12);
    let mut f = fs::File::create(c.node(0).path("ckpt.pt")).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    c.nodes[0].crash();
    drop(f);
    for i in [1, 2] {
        let got = fs::read(c.node(i).path("ckpt.pt")).unwrap();
        assert!(got == data, "node {i} reads the fsynced checkpoint from replicas");
    }
    // A's own file is out of reach while A is down: EIO, not a hang.
    let t = Instant::now();
    let e = fs::read(c.node(1).path("solo/a-only.bin")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());

    // status sees A dead, its lone chunk without a live copy, and the
    // checkpoint's chunks down to one live copy.
    eventually(10, "status reports A dead", || status(&c).contains("2 live, 1 dead"));
    let s = status(&c);
    assert!(s.contains("2 under-replicated, 1 with no live copy"), "{s}");

    // A comes back and serves again.
    c.nodes[0].mount();
    same(&fs::read(c.node(0).path("ckpt.pt")).unwrap(), &data, "ckpt.pt on node 0");
    eventually(10, "A serves its chunks again", || {
        fs::read(c.node(1).path("solo/a-only.bin")).is_ok_and(|d| d == solo)
    });
}

/// A peer keeps its copy of a small file in a slot (a file made ahead, its
/// name synced already, labelled with the version it holds): killed and
/// started again, it finds each copy from its label and serves it with the
/// writer down.
#[test]
fn a_peers_small_copies_in_slots_are_found_again_after_it_restarts() {
    let port = format!("127.0.0.1:{}", etcd_cluster::free_port());
    let Some(mut c) = Cluster::start(1, &[]) else { return };
    c.add_node(&["--metrics", &port]);
    // Until n1's member list hears of n2, n1 acknowledges a close with its
    // own copy alone and the replicator copies it later: wait until n1
    // places copies on n2.
    fs::create_dir(c.node(0).path("warm")).unwrap();
    eventually(30, "n1 places copies on n2", || {
        let warm = c.node(0).path("warm/w");
        fs::write(&warm, b"warm").unwrap();
        xattr_value(&warm, "user.converged.layout").contains("n2")
    });
    // Then enough slots ready, not merely on disk: a slot file exists
    // before the directory sync that makes it ready.
    eventually(30, "n2 made its slots", || metric(&scrape(&port), "converged_chunk_slots_ready") >= Some(32.0));
    fs::create_dir(c.node(0).path("small")).unwrap();
    let files: Vec<(String, Vec<u8>)> =
        (0..30).map(|i| (format!("small/f{i}"), pattern(1000 + i * 331, i as u64))).collect();
    let mut inos = std::collections::BTreeSet::new();
    for (name, data) in &files {
        fs::write(c.node(0).path(name), data).unwrap();
        inos.insert(format!("{:016x}.", fs::metadata(c.node(0).path(name)).unwrap().ino()));
    }
    // n2's copies of these files: version names (ino.chunk.version), in a
    // slot or in a file of their own.
    let copies: Vec<(String, bool)> = chunk_files(&c.node(1).data)
        .into_iter()
        .filter(|(name, _)| name.get(..17).is_some_and(|ino| inos.contains(ino)))
        .map(|(name, path)| (name, path.file_name().unwrap().to_string_lossy().starts_with("slot.")))
        .collect();
    let in_slots = copies.iter().filter(|(_, slotted)| *slotted).count();
    assert_eq!(in_slots, files.len(), "n2 keeps each small file's copy in a slot: {copies:?}");

    c.nodes[1].crash();
    c.nodes[1].mount();
    c.nodes[0].crash();
    for (name, data) in &files {
        same(&fs::read(c.node(1).path(name)).unwrap(), data, &format!("{name} on n2, n1 down"));
    }
}

#[test]
fn a_corrupt_local_copy_is_read_from_a_replica_and_repaired() {
    // --verify-reads: every read goes through the daemon's checks.
    let ports: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", etcd_cluster::free_port())).collect();
    let Some(mut c) = Cluster::start(1, &["--verify-reads", "--metrics", &ports[0]]) else { return };
    c.add_node(&["--verify-reads", "--metrics", &ports[1]]);
    let data = pattern(3 << 20, 15);
    fs::write(c.node(0).path("weights.bin"), &data).unwrap();
    let ino = fs::metadata(c.node(0).path("weights.bin")).unwrap().ino();
    // The kernel releases a closed file after close(2) returns, and the
    // seal at release reads the backing file: tamper only once it is done.
    eventually(10, "A released weights.bin", || metric(&scrape(&ports[0]), "converged_open_files") == Some(0.0));
    // Flip a byte of A's own copy behind the daemon's back.
    let backing = c.backing(0, ino);
    let mut raw = fs::read(&backing).unwrap();
    raw[(1 << 20) + 5] ^= 0xff;
    fs::write(&backing, &raw).unwrap();
    drop_caches();
    same(&fs::read(c.node(0).path("weights.bin")).unwrap(), &data, "A reads good bytes from B");
    assert!(c.node(0).log().contains("repaired a corrupt local range"), "{}", c.node(0).log());
    same(&fs::read(&backing).unwrap(), &data, "A's copy is repaired");
}

#[test]
fn a_stopped_node_costs_only_its_own_chunks_promptly() {
    let Some(c) = Cluster::start(3, &[]) else { return };
    let (a, b, cc) = (c.node(0), c.node(1), c.node(2));
    fs::create_dir(cc.path("only-c")).unwrap();
    setxattr(&cc.path("only-c"), "user.converged.replicas", b"1");
    let only_c = pattern(6 << 20, 13);
    fs::write(cc.path("only-c/part.bin"), &only_c).unwrap();
    let shared = pattern(6 << 20, 14);
    fs::create_dir(a.path("both")).unwrap();
    setxattr(&a.path("both"), "user.converged.replicas", b"2");
    fs::write(a.path("both/part.bin"), &shared).unwrap();
    same(&fs::read(b.path("only-c/part.bin")).unwrap(), &only_c, "C serves while it runs");

    // C stops answering (its process is frozen, as a node cut off would be).
    let pid = cc.daemon_pid();
    // SAFETY: kill(2).
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let t = Instant::now();
    let e = fs::read(a.path("only-c/part.bin")).unwrap_err();
    let waited = t.elapsed();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(waited < Duration::from_secs(20), "EIO took {waited:?}: a deadline, not a hang");
    // What A and B hold is still served.
    same(&fs::read(b.path("both/part.bin")).unwrap(), &shared, "both/part.bin on b");
    same(&fs::read(a.path("both/part.bin")).unwrap(), &shared, "both/part.bin on a");
    // SAFETY: kill(2).
    unsafe { libc::kill(pid, libc::SIGCONT) };
    eventually(15, "C serves again", || fs::read(a.path("only-c/part.bin")).is_ok_and(|d| d == only_c));
}

/// `converged stage` on one node of three: every chunk of an imported
/// object lands on the node placement picks for it, each node fetching its
/// own share from the S3 server; more replicas later add copies; any node
/// reads the bytes back.
#[test]
fn stage_spreads_an_imported_dataset_over_the_cluster() {
    let Some(s3) = common::s3::S3Server::with_buckets(&["datasets", "vol"]) else { return };
    // Five 64 MiB chunks, so rendezvous hashing has something to spread.
    let data = pattern(300 << 20, 77);
    s3.client().put("datasets", "web/shard.bin", &data);
    let endpoint = s3.endpoint();
    let Some(c) = Cluster::start(3, &["--object-store", "s3://vol/v", "--s3-endpoint", &endpoint]) else { return };
    let out = converged()
        .args(["import", "s3://datasets/web"])
        .arg(c.node(0).path("web"))
        .args(["--s3-endpoint", &endpoint])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = converged().arg("stage").arg(c.node(0).path("web")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let layout = |i: usize| {
        let out = converged().arg("status").arg(c.node(i).path("web/shard.bin")).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let holders = |l: &str| -> Vec<Vec<String>> {
        l.lines()
            .skip_while(|l| !l.starts_with("chunks"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .map(|l| l.split_whitespace().nth(3).unwrap_or("").split(',').map(str::to_string).collect())
            .collect()
    };
    let l = layout(0);
    let per_chunk = holders(&l);
    assert_eq!(per_chunk.len(), 5, "{l}");
    assert!(per_chunk.iter().all(|h| h.len() == 1 && h[0] != "object"), "one copy of each chunk: {l}");
    let nodes: std::collections::HashSet<&String> = per_chunk.iter().map(|h| &h[0]).collect();
    assert!(nodes.len() >= 2, "the chunks are spread over the nodes: {l}");
    // Each node fetched its share itself, from the object store.
    let fetched: Vec<bool> =
        (0..3).map(|i| !xattr_value(&c.node(i).mnt, "user.converged.backfill").contains("fetched_bytes=0 ")).collect();
    assert!(fetched.iter().filter(|f| **f).count() >= 2, "{fetched:?}");

    // Staging again with more replicas adds copies; nothing is fetched twice by one node.
    let out = converged().args(["stage", "--replicas", "2"]).arg(c.node(1).path("web")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let l = layout(2);
    assert!(holders(&l).iter().all(|h| h.len() == 2 && h[0] != h[1]), "two copies of each chunk: {l}");
    drop_caches();
    same(&fs::read(c.node(2).path("web/shard.bin")).unwrap(), &data, "read on n3 after stage");
}

/// A node killed before its files were uploaded: once its membership lease
/// is gone, the live nodes take its backfill over and upload the files
/// from the replicas, byte for byte.
#[test]
fn a_dead_nodes_dirty_files_are_backfilled_by_the_live_nodes() {
    let Some(s3) = common::s3::S3Server::with_buckets(&["vol"]) else { return };
    let endpoint = s3.endpoint();
    let args = ["--object-store", "s3://vol/v", "--s3-endpoint", &endpoint, "--backfill-delay", "4s"];
    let Some(mut c) = Cluster::start(3, &args) else { return };
    fs::create_dir(c.node(0).path("ckpt")).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..6u64)
        .map(|i| (format!("ckpt/shard-{i}.pt"), pattern(if i == 0 { 100 << 20 } else { 1 << 20 }, 90 + i)))
        .collect();
    for (name, data) in &files {
        fs::write(c.node(0).path(name), data).unwrap();
    }
    // Closed (so replicated), not yet quiet for the backfill delay: A dies.
    c.nodes[0].crash();
    assert!(s3.client().list("vol", "v/").is_empty(), "nothing was uploaded before the crash");
    for (name, data) in &files {
        eventually(120, &format!("{name} is uploaded by a live node"), || {
            s3.client().get("vol", &format!("v/{name}")).is_some_and(|o| o == *data)
        });
    }
    let t = xattr_value(&c.node(1).path("ckpt/shard-0.pt"), "user.converged.tier");
    assert!(t.starts_with("state=backed"), "{t}");
    let took: Vec<bool> =
        (1..3).map(|i| !xattr_value(&c.node(i).mnt, "user.converged.backfill").contains("uploaded_files=0 ")).collect();
    assert!(took.iter().any(|t| *t), "{took:?}");
}

/// A reader that jumps about a file held on another node costs the wire
/// the blocks it reads, not a window each: n2's 4 KiB reads at scattered
/// offsets of a one-copy file on n1 return n1's bytes and bring at most two
/// checksum blocks each over the network (n2's own metrics); a sequential
/// read of the same file then reads it whole.
#[test]
fn scattered_reads_of_a_remote_file_fetch_only_their_blocks() {
    const BLOCK: usize = 4096;
    let ports: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", etcd_cluster::free_port())).collect();
    let Some(mut c) = Cluster::start(1, &["--metrics", &ports[0]]) else { return };
    c.add_node(&["--metrics", &ports[1]]);
    eventually(10, "n1 sees n2 live", || metric(&scrape(&ports[0]), "converged_live_peers").unwrap_or(0.0) >= 1.0);
    let fetched = || metric(&scrape(&ports[1]), "converged_peer_read_bytes_total").unwrap_or(0.0) as usize;

    fs::create_dir(c.node(0).path("solo")).unwrap();
    setxattr(&c.node(0).path("solo"), "user.converged.replicas", b"1");
    let data = pattern(96 << 20, 51);
    fs::write(c.node(0).path("solo/samples.bin"), &data).unwrap();

    let f = fs::File::open(c.node(1).path("solo/samples.bin")).unwrap();
    // SAFETY: fadvise on a descriptor we own; it only sets readahead off.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_RANDOM) };
    let before = fetched();
    let offsets: Vec<usize> =
        (0..64).map(|i| ((i * 7_340_033 + 12_345) % (data.len() - 2 * BLOCK)) / BLOCK * BLOCK + 100).collect();
    for at in &offsets {
        let mut buf = vec![0u8; BLOCK];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, *at as u64).unwrap();
        assert!(buf == data[*at..*at + BLOCK], "bytes differ at {at} on n2");
    }
    let cost = fetched() - before;
    assert!(cost >= offsets.len() * BLOCK, "n2 read only {cost} bytes from n1 for {} reads", offsets.len());
    // Each read needs the 64 KiB checksum block (two, across a boundary)
    // its pages fall in; a window is 4 MiB.
    assert!(
        cost <= offsets.len() * 2 * (64 << 10),
        "{} scattered 4 KiB reads brought {cost} bytes over the network",
        offsets.len()
    );
    drop(f);
    let got = fs::read(c.node(1).path("solo/samples.bin")).unwrap();
    assert!(got == data, "a sequential read on n2 differs");
}

/// A writer killed (kill -9) right after closing many small files, before
/// its flusher gave up their write leases (files unchanged since the close
/// that published them give theirs up in a batch at the next flush): every
/// file reads whole on the other node, which takes the dead node's leases
/// over and appends; the killed node, mounted again, reads the appends.
#[test]
fn a_writer_killed_before_giving_up_its_leases_loses_no_closed_file() {
    const FILES: usize = 50;
    let Some(mut c) = Cluster::start(2, &[]) else { return };
    fs::create_dir(c.node(0).path("closed")).unwrap();
    for i in 0..FILES {
        fs::write(c.node(0).path(&format!("closed/f{i}")), pattern(3000 + i, i as u64 + 1)).unwrap();
    }
    c.nodes[0].crash();
    for i in 0..FILES {
        let got = fs::read(c.node(1).path(&format!("closed/f{i}"))).unwrap();
        same(&got, &pattern(3000 + i, i as u64 + 1), &format!("f{i} on n2 after n1's kill"));
    }
    eventually(20, "status reports n1 dead", || status(&c).contains("1 live, 1 dead"));
    for i in 0..FILES {
        let mut f = fs::OpenOptions::new().append(true).open(c.node(1).path(&format!("closed/f{i}"))).unwrap();
        f.write_all(b"+n2").unwrap();
    }
    c.nodes[0].mount();
    for i in 0..FILES {
        let mut want = pattern(3000 + i, i as u64 + 1);
        want.extend_from_slice(b"+n2");
        same(&fs::read(c.node(0).path(&format!("closed/f{i}"))).unwrap(), &want, &format!("f{i} on n1, back"));
    }
}

/// Files unlinked on one node while another node writes them (the
/// unlinking node does not know they are open there): every writer's
/// writes and `close(2)` succeed, as for a file unlinked where it is open,
/// and the names are gone on both nodes. Eight files at once, the unlinks
/// landing between the writers' writes.
#[test]
fn files_unlinked_on_one_node_while_another_writes_them_close_cleanly() {
    use std::os::fd::IntoRawFd;
    let Some(c) = Cluster::start(2, &[]) else { return };
    let (a, b) = (c.node(0), c.node(1));
    fs::create_dir(a.path("scratch")).unwrap();
    let names: Vec<String> = (0..8).map(|i| format!("scratch/part-{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        fs::write(a.path(name), pattern(1 << 20, i as u64)).unwrap();
    }
    let mut writers: Vec<fs::File> = names
        .iter()
        .map(|name| {
            let mut w = fs::OpenOptions::new().write(true).open(b.path(name)).unwrap();
            w.write_all(&pattern(2 << 20, 40)).unwrap();
            w
        })
        .collect();
    for name in &names {
        fs::remove_file(a.path(name)).unwrap();
    }
    for (w, name) in writers.iter_mut().zip(&names) {
        w.write_all(&pattern(1 << 20, 41)).unwrap_or_else(|e| panic!("write to {name} after its unlink on a: {e}"));
    }
    for (w, name) in writers.into_iter().zip(&names) {
        let fd = w.into_raw_fd();
        // SAFETY: fd is ours, taken from the File, and closed once.
        let rc = unsafe { libc::close(fd) };
        let err = std::io::Error::last_os_error();
        assert_eq!(rc, 0, "close of {name} on b after its unlink on a: {err}");
    }
    for n in [a, b] {
        for name in &names {
            eventually(5, "the name gone", || !n.path(name).exists());
        }
        assert_eq!(fs::read_dir(n.path("scratch")).unwrap().count(), 0, "scratch empty on {}", n.mnt.display());
    }
}

/// A reader node that learned a file's size before its writer's fsync
/// (a listing, a stat) reads every byte the fsync published: the copy the
/// writer pushed to it is installed at the size the publish recorded, not
/// at the size it had cached (it read zeros, as a checksum mismatch, EIO).
#[test]
fn a_file_fsynced_while_open_reads_whole_where_its_old_size_was_cached() {
    let Some(c) = Cluster::start(2, &[]) else { return };
    let (a, b) = (c.node(0), c.node(1));
    fs::create_dir(a.path("logs")).unwrap();
    for i in 0..12 {
        let name = format!("logs/run{i}.log");
        let mut f = fs::File::create(a.path(&name)).unwrap();
        let line = pattern(100 + i * 7, i as u64);
        f.write_all(&line).unwrap();
        assert_eq!(fs::metadata(b.path(&name)).unwrap().len(), 0, "{name}: empty until published");
        f.sync_all().unwrap();
        same(&fs::read(b.path(&name)).unwrap(), &line, &name);
        drop(f);
    }
}

/// Compact etcd's history up to its current revision: a watch that resumes
/// from an older revision is cancelled, the changes in between lost to it.
fn compact_etcd(endpoint: &str) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut client = etcd_client::Client::connect([endpoint], None).await.unwrap();
        let rev = client.get("compact", None).await.unwrap().header().unwrap().revision();
        let physical = etcd_client::CompactionOptions::new().with_physical();
        client.compact(rev, Some(physical)).await.unwrap();
    });
}

/// A node whose change feed missed changes (its connection to etcd was cut,
/// and etcd compacted its history past where the watch stopped, so the
/// watch cannot resume) drops the names and attributes its kernel cached,
/// not only its own cache: another node's unlinks and rename are seen there
/// at once, not when `--attr-timeout` (60 s here) runs out. Before, the
/// kernel kept answering the removed names until their timeout.
#[test]
fn a_node_whose_change_feed_missed_changes_drops_what_its_kernel_cached() {
    let Some(mut c) = Cluster::start(1, &[]) else { return };
    let proxy = common::proxy::Proxy::start(c.etcd_endpoints()[0].parse().unwrap());
    c.add_node_via(&format!("etcd://{}/vol", proxy.addr()), &["--attr-timeout", "60"]);
    let (a, b) = (c.node(0), c.node(1));
    fs::create_dir(a.path("d")).unwrap();
    for p in ["d/gone", "d/old", "top"] {
        fs::write(a.path(p), p).unwrap();
    }
    // B's kernel caches the names and attributes for 60 s.
    for p in ["d/gone", "d/old", "top"] {
        assert_eq!(fs::read(b.path(p)).unwrap(), p.as_bytes(), "{p} on B");
    }
    proxy.cut();
    fs::remove_file(a.path("d/gone")).unwrap();
    fs::rename(a.path("d/old"), a.path("d/new")).unwrap();
    fs::remove_file(a.path("top")).unwrap();
    compact_etcd(&c.etcd_endpoints()[0]);
    proxy.restore();
    let t = Instant::now();
    // Gone means ENOENT, not a lookup that failed while etcd came back.
    let gone = |p: &str| fs::symlink_metadata(b.path(p)).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound);
    eventually(20, "B to see A's unlinks and rename", || gone("d/gone") && gone("d/old") && gone("top"));
    eprintln!("B saw the changes {:?} after etcd was reachable again", t.elapsed());
    assert_eq!(fs::read(b.path("d/new")).unwrap(), b"d/old", "the renamed file on B");
    // B still works against etcd: what it writes, A reads.
    fs::write(b.path("d/from-b"), b"after").unwrap();
    assert_eq!(fs::read(a.path("d/from-b")).unwrap(), b"after");
}

/// A node whose change feed is reset and resumes where it stopped keeps
/// what its kernel cached: the watch is sent the changes it missed, so no
/// name needs looking up again (only a feed that starts from the present,
/// as in the test above, costs every cached name a lookup). Before, every
/// restart of the watch had the kernel look up every name it held again.
/// Counted in the node's FUSE lookups.
#[test]
fn a_node_whose_change_feed_resumes_keeps_what_its_kernel_cached() {
    let Some(mut c) = Cluster::start(1, &[]) else { return };
    let proxy = common::proxy::Proxy::start(c.etcd_endpoints()[0].parse().unwrap());
    let port = format!("127.0.0.1:{}", etcd_cluster::free_port());
    c.add_node_via(&format!("etcd://{}/vol", proxy.addr()), &["--attr-timeout", "60", "--metrics", &port]);
    let (a, b) = (c.node(0), c.node(1));
    let names: Vec<String> = (0..20).map(|i| format!("d/f{i}")).collect();
    fs::create_dir(a.path("d")).unwrap();
    for p in &names {
        fs::write(a.path(p), p).unwrap();
    }
    let lookups = || {
        let text = scrape(&port);
        let line = text.lines().find(|l| l.starts_with("converged_fuse_ops_total{op=\"lookup\"}")).map(str::to_string);
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).unwrap_or(0.0) as u64
    };
    let stat_all = || {
        for p in &names {
            fs::metadata(b.path(p)).unwrap();
        }
    };
    // B's change feed may deliver A's creates after B looked the names up
    // (more so on a loaded host), and each then drops its name from B's
    // kernel as changed: stat until a round costs no lookup, and from then
    // on B's kernel holds every name (60 s).
    eventually(20, "B's kernel to hold the names", || {
        let before = lookups();
        stat_all();
        lookups() == before
    });
    proxy.cut();
    proxy.restore();
    // The feed is back: a file A makes after the reset reaches B.
    fs::write(a.path("d/after"), b"after").unwrap();
    eventually(20, "B to see A's new file", || fs::read(b.path("d/after")).is_ok_and(|d| d == b"after"));
    assert!(b.log().contains("etcd watch ended"), "B's watch was reset");
    let before = lookups();
    stat_all();
    assert_eq!(lookups(), before, "B's kernel looked up no name it held again");
}

/// A node whose connection to etcd is reset (a proxy in between
/// restarting, the etcd member it talks to restarting in a rolling
/// upgrade) loses nothing: its membership lease has not run out, so the
/// file it is writing meanwhile closes whole, every small file it creates
/// meanwhile is made once and reads back, and it stays live. Cut off for
/// longer than the lease, it is seen dead, and it is live again once etcd
/// answers. Before, any failed heartbeat was taken for an expired lease (a
/// reset fenced every writer on the node: `fsync` failed with `EIO`, the
/// writes were dropped), a read on the broken connection failed its
/// lookup with `EIO`, a create whose commit landed without its answer was
/// made again and failed with `EEXIST`, and a heartbeat that found etcd
/// unreachable left the node unable to register again: dead for good.
#[test]
fn a_reset_connection_to_etcd_costs_a_node_nothing_and_a_long_cut_ends() {
    let Some(mut c) = Cluster::start(1, &[]) else { return };
    let proxy = common::proxy::Proxy::start(c.etcd_endpoints()[0].parse().unwrap());
    c.add_node_via(&format!("etcd://{}/vol", proxy.addr()), &[]);
    let (a, b) = (c.node(0), c.node(1));
    let data = pattern(8 << 20, 11);
    let mut f = fs::File::create(b.path("ckpt")).unwrap();
    f.write_all(&data[..4 << 20]).unwrap();
    fs::create_dir(b.path("small")).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (dir, halt) = (b.path("small"), stop.clone());
    let creator = std::thread::spawn(move || {
        let mut n = 0;
        while !halt.load(std::sync::atomic::Ordering::Relaxed) {
            if let Err(e) = fs::write(dir.join(format!("f{n}")), format!("{n}")) {
                panic!("creating f{n} while the connection to etcd was reset: {e}");
            }
            n += 1;
        }
        n
    });
    // Five resets, a heartbeat (every second: the cluster's 3 s lease)
    // meeting each.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(1100));
        proxy.cut();
        proxy.restore();
    }
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let made = creator.join().expect("every create succeeded");
    assert!(made > 0, "no file was made");
    for n in 0..made {
        assert_eq!(fs::read(a.path(&format!("small/f{n}"))).unwrap(), format!("{n}").as_bytes(), "f{n} on A");
    }
    f.write_all(&data[4 << 20..]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let got = fs::read(a.path("ckpt")).unwrap();
    assert!(got == data, "the file written across the resets reads back {} bytes, not its 8 MiB", got.len());
    assert!(status(&c).contains("2 live, 0 dead"), "{}", status(&c));

    // Cut off past the lease: seen dead, then live again.
    proxy.cut();
    eventually(15, "n2 seen dead while cut off", || status(&c).contains("1 live, 1 dead"));
    proxy.restore();
    eventually(15, "n2 live again once etcd answers", || status(&c).contains("2 live, 0 dead"));
    fs::write(b.path("after"), b"back").unwrap();
    assert_eq!(fs::read(a.path("after")).unwrap(), b"back");
}

/// An unmount while etcd answers nothing (its hosts hang, or a partition
/// drops its packets): the daemon asks the store once, leaves what only
/// the store can record for later (the write leases of files closed just
/// before, to its next mount or to the membership lease's end; its
/// membership, to the lease), and ends; and nothing is lost by it. (Before,
/// the unmount took 21-24 s here, each of its steps waiting out the 5 s
/// deadline, and a transaction it retried could wait 64 of them.)
#[test]
fn an_unmount_while_etcd_answers_nothing_ends_and_loses_nothing() {
    let Some(mut c) = Cluster::start(2, &[]) else { return };
    // Closed just before etcd stops answering: each leaves its write
    // session's end to the next flush (once a second), the unmount's.
    let files: Vec<(String, Vec<u8>)> = (0..60u64)
        .map(|i| (format!("f{i}"), if i % 3 == 0 { Vec::new() } else { pattern(3000 + i as usize, i) }))
        .collect();
    for (name, data) in &files {
        fs::write(c.node(0).path(name), data).unwrap();
    }
    let pid = c.nodes[0].daemon_pid();
    c.freeze_etcd();
    // Succeeds only once the daemon released its data dir.
    c.nodes[0].umount();
    wait_gone(pid);
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "n1's daemon outlived its unmount");

    // etcd back: the other node reads every file and writes each anew
    // (n1's leases end with its membership), and n1 mounts again.
    c.thaw_etcd();
    let b = c.node(1);
    for (name, data) in &files {
        same(&fs::read(b.path(name)).unwrap(), data, &format!("{name} read on n2"));
    }
    for (name, data) in &files {
        let mut f = fs::OpenOptions::new().append(true).open(b.path(name)).unwrap();
        f.write_all(b"+n2").unwrap();
        drop(f);
        let mut want = data.clone();
        want.extend_from_slice(b"+n2");
        same(&fs::read(b.path(name)).unwrap(), &want, &format!("{name} appended on n2"));
    }
    c.nodes[0].mount();
    for (name, data) in &files {
        let mut want = data.clone();
        want.extend_from_slice(b"+n2");
        same(&fs::read(c.node(0).path(name)).unwrap(), &want, &format!("{name} on n1 mounted again"));
    }
}

/// While etcd answers nothing, a file operation waits for it as long as
/// `--meta-op-wait` says, reads and commits alike, then fails with `EIO`.
/// A lookup etcd must answer (a name no node has, in the root) gets its
/// answer once etcd is back 8 s later, past the client's 5 s deadline
/// (before, an unanswered read failed after that one deadline); a create
/// whose commit etcd does not answer for longer than the wait fails with
/// `EIO` (before, the commit was tried 64 times, each waiting out the
/// deadline: 336 s). Nothing else is lost by either, and the node goes on.
#[test]
fn a_file_operation_waits_for_etcd_as_long_as_meta_op_wait_says_then_fails_with_eio() {
    // The membership lease (3 s here) ends in both freezes: the nodes fence
    // their writers and register anew once etcd is back.
    let Some(c) = Cluster::start(2, &["--meta-op-wait", "20s"]) else { return };
    let (a, b) = (c.node(0), c.node(1));
    fs::write(a.path("kept"), b"kept before").unwrap();
    // A directory this node made: its node cache holds all of it, so a
    // create there reads nothing from etcd and only its commit waits.
    fs::create_dir(a.path("made")).unwrap();
    fs::write(a.path("made/sibling"), b"sibling").unwrap();

    c.freeze_etcd();
    let asked = a.path("asked-while-frozen");
    let looking = std::thread::spawn(move || fs::metadata(asked).map(|_| ()).map_err(|e| e.raw_os_error()));
    std::thread::sleep(Duration::from_secs(8));
    c.thaw_etcd();
    assert_eq!(looking.join().unwrap(), Err(Some(libc::ENOENT)), "a lookup across an 8 s outage, within the wait");

    c.freeze_etcd();
    let during = a.path("made/during");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(fs::File::create_new(during).map(|_| ()).map_err(|e| e.raw_os_error()));
    });
    // The wait (20 s) and the try it ends in (up to one 5 s deadline), with
    // room: a create that has not returned by then waits on past the wait.
    let created = rx.recv_timeout(Duration::from_secs(90));
    c.thaw_etcd();
    assert_eq!(created.expect("a create still waiting 90 s into the outage"), Err(Some(libc::EIO)));

    // etcd back: what was there is there on both nodes, the failed create
    // is whole or absent (its commit, sent before the deadline, may land
    // once etcd reads it), and both nodes make files again.
    for n in [a, b] {
        same(&fs::read(n.path("kept")).unwrap(), b"kept before", "kept");
        same(&fs::read(n.path("made/sibling")).unwrap(), b"sibling", "made/sibling");
    }
    let on = |n: &Mount| fs::metadata(n.path("made/during")).map(|m| m.len()).map_err(|e| e.raw_os_error());
    eventually(10, "the failed create looks the same from both nodes", || {
        let (x, y) = (on(a), on(b));
        x == y && matches!(x, Ok(0) | Err(Some(libc::ENOENT)))
    });
    fs::write(a.path("made/after"), b"after").unwrap();
    same(&fs::read(b.path("made/after")).unwrap(), b"after", "made/after on n2");
}

/// etcd's revision now.
fn etcd_revision(endpoint: &str) -> i64 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut client = etcd_client::Client::connect([endpoint], None).await.unwrap();
        client.get("revision", None).await.unwrap().header().unwrap().revision()
    })
}

/// The keys under `prefix` now.
fn etcd_keys(endpoint: &str, prefix: &str) -> Vec<Vec<u8>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut client = etcd_client::Client::connect([endpoint], None).await.unwrap();
        let opts = etcd_client::GetOptions::new().with_prefix().with_keys_only();
        let got = client.get(prefix, Some(opts)).await.unwrap();
        got.kvs().iter().map(|kv| kv.key().to_vec()).collect()
    })
}

/// The inode numbers whose `kind` record (an inode-keyed one, e.g. `s`, the
/// sync-pending marks) etcd put from revision `from` up to now, in volume
/// `vol`: its history replayed with a watch of the whole volume, which ends
/// at the last revision (every revision here is the volume's).
fn etcd_puts_since(endpoint: &str, kind: u8, from: i64) -> std::collections::BTreeSet<u64> {
    let to = etcd_revision(endpoint);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut client = etcd_client::Client::connect([endpoint], None).await.unwrap();
        let opts = etcd_client::WatchOptions::new().with_prefix().with_start_revision(from);
        let mut stream = client.watch("vol/", Some(opts)).await.unwrap();
        let mut puts = std::collections::BTreeSet::new();
        let mut seen = from - 1;
        while seen < to {
            let r = tokio::time::timeout(Duration::from_secs(10), stream.message()).await;
            let r = r.expect("etcd replays its history").unwrap().expect("the watch goes on");
            assert!(!r.canceled(), "the watch from {from} was cancelled (compacted?)");
            for ev in r.events() {
                let kv = ev.kv().unwrap();
                seen = seen.max(kv.mod_revision());
                let key = &kv.key()[b"vol/".len()..];
                if ev.event_type() == etcd_client::EventType::Put && key[0] == kind {
                    puts.insert(u64::from_be_bytes(key[1..9].try_into().unwrap()));
                }
            }
        }
        puts
    })
}

/// Under `--nowsync` a small file made in a directory the node made is
/// sealed at its release, and that seal syncs its copy on the writer's disk
/// beside the peer's durable copy: etcd is asked for no sync-pending mark
/// for it (a put and a delete a file fewer: an untar's files are small),
/// and its lease is given up all the same. A large file's copy here is
/// still left to the flusher, under a mark put and then cleared, so that a
/// release does not wait for a checkpoint's local writeback; so is a small
/// file whose close published it (close(2) waits for that one: the root is
/// not delegated). Each reads back whole on the other node.
#[test]
fn a_small_files_last_seal_syncs_its_copy_here_and_leaves_no_sync_mark() {
    let Some(c) = Cluster::start(2, &["--nowsync"]) else { return };
    let (a, b) = (c.node(0), c.node(1));
    let ep = c.etcd_endpoints()[0].clone();
    let from = etcd_revision(&ep) + 1;
    fs::create_dir(a.path("small")).unwrap();
    let mut small = Vec::new();
    for i in 0..20 {
        let name = format!("small/f{i}");
        let data = pattern(1000 + i * 997, i as u64);
        fs::write(a.path(&name), &data).unwrap();
        small.push((fs::metadata(a.path(&name)).unwrap().ino(), name, data));
    }
    // Left to the flusher: a large file, and a small one its close published.
    let mut flushed = Vec::new();
    for (name, data) in [("small/big", pattern(6 << 20, 99)), ("top", pattern(3000, 98))] {
        fs::write(a.path(name), &data).unwrap();
        flushed.push((fs::metadata(a.path(name)).unwrap().ino(), name.to_string(), data));
    }
    eventually(30, "every write lease given up", || etcd_keys(&ep, "vol/U").is_empty());
    eventually(30, "every sync mark cleared", || etcd_keys(&ep, "vol/s").is_empty());
    let marked = etcd_puts_since(&ep, b's', from);
    for (ino, name, data) in &small {
        assert!(!marked.contains(ino), "{name}: a sync mark was put for a {} byte file: {marked:?}", data.len());
        same(&fs::read(b.path(name)).unwrap(), data, name);
    }
    for (ino, name, data) in &flushed {
        assert!(marked.contains(ino), "{name}: its copy here is left to the flusher, under a mark: {marked:?}");
        same(&fs::read(b.path(name)).unwrap(), data, name);
    }
}
