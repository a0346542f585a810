//! Cluster correctness under failure, on real daemons: three nodes on
//! loopback, a real 3-member etcd, QUIC between them. A writer paused for
//! longer than its membership lease cannot overwrite what another node
//! wrote meanwhile; readers elsewhere read the last published version while
//! a file is rewritten, never EIO; a writer killed in the middle of a large
//! fsync leaves every other node reading the old version or the new one,
//! whole, even with its disk gone; and an open after another node's close
//! sees that close, size and bytes together, round after round. A writer
//! whose connection to etcd hangs is fenced as a paused one is.

mod common;

use std::fs::{self, OpenOptions};
use std::os::fd::IntoRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::time::{Duration, Instant};

use common::cluster::*;
use common::*;

const MIB: usize = 1 << 20;

/// close(2) of a descriptor, with its result: what a writer whose close
/// publishes the file sees (Rust's `File` drops that result).
fn close(f: fs::File) -> Result<(), i32> {
    // SAFETY: close(2) of a descriptor we own and give up here.
    match unsafe { libc::close(f.into_raw_fd()) } {
        0 => Ok(()),
        _ => Err(errno()),
    }
}

fn signal(m: &Mount, sig: i32) {
    // SAFETY: kill(2).
    assert_eq!(unsafe { libc::kill(m.daemon_pid(), sig) }, 0);
}

/// A writer in a process of its own: opens `path` for reading and writing,
/// writes `first` at 0, then waits for a line on stdin, writes `then` right
/// after `first` and closes, printing what close(2) returned. (The test
/// process itself must hold no descriptor on a node it freezes: the close
/// of its close-on-exec descriptors at every exec would wait on that node.)
struct Writer(std::process::Child);

impl Writer {
    fn start(path: &std::path::Path, first: &[u8], then: &[u8]) -> Self {
        let script = r#"
import os, sys
path, first, then = sys.argv[1], sys.argv[2].encode(), sys.argv[3].encode()
fd = os.open(path, os.O_RDWR)
os.pwrite(fd, first, 0)
print("written", flush=True)
sys.stdin.readline()
os.pwrite(fd, then, len(first))
try:
    os.close(fd)
    print("close ok", flush=True)
except OSError as e:
    print("close errno", e.errno, flush=True)
"#;
        let mut child = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(path)
            .arg(std::str::from_utf8(first).unwrap())
            .arg(std::str::from_utf8(then).unwrap())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.as_mut().unwrap()), &mut line).unwrap();
        assert_eq!(line.trim(), "written");
        Writer(child)
    }

    /// Write the rest and close; what close(2) said.
    fn finish(mut self) -> String {
        use std::io::Write;
        self.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let out = self.0.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

/// The paused-writer scenario: n1 holds a file open for writing with bytes
/// it has not published, and is frozen for longer than its membership
/// lease. n2 takes the write lease over and writes; n3 reads n2's bytes.
/// n1, resumed, writes on and closes: its close fails (EIO) and n2's bytes
/// are what every node reads, n1 included.
#[test]
fn a_paused_writer_cannot_overwrite_another_nodes_acknowledged_write() {
    let Some(c) = Cluster::start(3, &[]) else { return };
    let (n1, n2, n3) = (c.node(0), c.node(1), c.node(2));
    let mut want = pattern(3 * MIB, 1);
    fs::write(n1.path("f"), &want).unwrap();

    let writer = Writer::start(&n1.path("f"), b"AAAA", b"aa");
    signal(n1, libc::SIGSTOP);
    // Longer than the 3 s membership lease of the test cluster.
    std::thread::sleep(Duration::from_secs(6));
    eventually(10, "n1 is seen dead", || status(&c).contains("2 live, 1 dead"));

    let f2 = OpenOptions::new().write(true).open(n2.path("f")).unwrap();
    f2.write_all_at(b"BBBB", 0).unwrap();
    assert_eq!(close(f2), Ok(()), "n2's write is acknowledged");
    want[..4].copy_from_slice(b"BBBB");
    // (No drop_caches while n1 is frozen: it would wait on n1's mount.)
    same(&fs::read(n3.path("f")).unwrap(), &want, "n3 reads n2's write");

    signal(n1, libc::SIGCONT);
    assert_eq!(writer.finish(), format!("close errno {}", libc::EIO), "n1's close reports its unpublished writes");
    drop_caches();
    for (i, n) in [n1, n2, n3].into_iter().enumerate() {
        eventually(10, &format!("n{} reads n2's bytes", i + 1), || fs::read(n.path("f")).is_ok_and(|d| d == want));
    }
    assert!(n1.log().contains("write lease lost"), "n1 says why its close failed");
}

/// The rewrite scenario: a 192 MiB file (three chunks) is written and
/// closed on n1; n1 opens it again and changes one byte in each chunk
/// without closing. n2 and n3 read the closed version, whole, no EIO; after
/// n1's fsync they read the new bytes.
/// The paused-writer scenario with the daemon running and its network to
/// etcd hung instead (bytes held in both directions, no reset): its
/// heartbeat waits in a round trip while its membership lease runs out in
/// etcd. The node fences its writers on its own once its lease may have
/// run out, before etcd answers again (its log says so); n1 takes the
/// write lease over and writes. Once etcd answers, the hung node's close
/// fails (EIO) and n1's bytes are what every node reads.
#[test]
fn a_writer_whose_connection_to_etcd_hangs_cannot_overwrite_another_nodes_write() {
    let Some(mut c) = Cluster::start(2, &[]) else { return };
    let proxy = common::proxy::Proxy::start(c.etcd_endpoints()[0].parse().unwrap());
    c.add_node_via(&format!("etcd://{}/vol", proxy.addr()), &[]);
    let (n1, n2, hung) = (c.node(0), c.node(1), c.node(2));
    let mut want = pattern(3 * MIB, 2);
    fs::write(hung.path("f"), &want).unwrap();
    eventually(10, "n1 reads the file", || fs::read(n1.path("f")).is_ok_and(|d| d == want));

    let writer = Writer::start(&hung.path("f"), b"HHHH", b"hh");
    proxy.stall();
    eventually(20, "the hung node is seen dead", || status(&c).contains("2 live, 1 dead"));
    // Its lease ran out in etcd while its heartbeat still waits for an
    // answer (two 5 s deadlines): the node fences without that answer.
    eventually(5, "the hung node fences its writers while etcd still hangs", || {
        hung.log().contains("no heartbeat for longer than the membership lease")
    });

    let f1 = OpenOptions::new().write(true).open(n1.path("f")).unwrap();
    f1.write_all_at(b"AAAA", 0).unwrap();
    assert_eq!(close(f1), Ok(()), "n1's write is acknowledged");
    want[..4].copy_from_slice(b"AAAA");
    same(&fs::read(n2.path("f")).unwrap(), &want, "n2 reads n1's write");

    proxy.restore();
    assert_eq!(
        writer.finish(),
        format!("close errno {}", libc::EIO),
        "the hung node's close reports its dropped writes"
    );
    drop_caches();
    for (name, n) in [("n1", n1), ("n2", n2), ("the hung node", hung)] {
        eventually(15, &format!("{name} reads n1's bytes"), || fs::read(n.path("f")).is_ok_and(|d| d == want));
    }
    eventually(20, "the hung node is live again", || status(&c).contains("3 live, 0 dead"));
}

#[test]
fn readers_elsewhere_read_the_last_published_version_while_a_file_is_rewritten() {
    let Some(c) = Cluster::start(3, &[]) else { return };
    let (n1, n2, n3) = (c.node(0), c.node(1), c.node(2));
    let old = pattern(192 * MIB, 2);
    fs::write(n1.path("big"), &old).unwrap();

    let f = OpenOptions::new().read(true).write(true).open(n1.path("big")).unwrap();
    let mut new = old.clone();
    for chunk in 0..3 {
        let at = chunk * 64 * MIB + 4097;
        new[at] ^= 0x5a;
        f.write_all_at(&new[at..at + 1], at as u64).unwrap();
    }
    for round in 0..2 {
        drop_caches();
        for (name, n) in [("n2", n2), ("n3", n3)] {
            let got = fs::read(n.path("big")).unwrap_or_else(|e| panic!("{name} round {round}: {e}"));
            same(&got, &old, &format!("{name} while n1 rewrites (round {round})"));
        }
    }
    // A reader that jumps about (block-sized requests, no readahead) reads
    // the published version too, at the bytes being rewritten and elsewhere.
    drop_caches();
    for (name, n) in [("n2", n2), ("n3", n3)] {
        let r = fs::File::open(n.path("big")).unwrap();
        // SAFETY: fadvise on a descriptor we own; it only turns readahead off.
        unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&r), 0, 0, libc::POSIX_FADV_RANDOM) };
        for i in 0..48usize {
            let at = if i % 2 == 0 { (i % 3) * 64 * MIB + 4096 } else { (i * 3_999_971) % (old.len() - 8192) };
            let mut buf = vec![0u8; 4096];
            r.read_exact_at(&mut buf, at as u64).unwrap_or_else(|e| panic!("{name} at {at}: {e}"));
            same(&buf, &old[at..at + 4096], &format!("{name} at {at} while n1 rewrites"));
        }
    }
    f.sync_all().unwrap();
    drop_caches();
    for (name, n) in [("n2", n2), ("n3", n3)] {
        same(&fs::read(n.path("big")).unwrap(), &new, &format!("{name} after n1's fsync"));
    }
    assert_eq!(close(f), Ok(()));
}

/// `kill -9` of the writer while a large fsync publishes a new version of
/// a checkpoint, at delays spread over the whole fsync (its length is
/// measured first, on a cluster of its own): the other nodes read the old
/// version or the new one, whole; and still do once the killed node's disk
/// is gone.
#[test]
fn a_writer_killed_in_the_middle_of_a_large_fsync_leaves_one_whole_version() {
    let len = 160 * MIB;
    let (old, new) = (pattern(len, 3), pattern(len, 4));
    let fsync_took = {
        let Some(c) = Cluster::start(3, &[]) else { return };
        fs::write(c.node(0).path("ckpt.pt"), &old).unwrap();
        let f = OpenOptions::new().write(true).open(c.node(0).path("ckpt.pt")).unwrap();
        f.write_all_at(&new, 0).unwrap();
        let t = Instant::now();
        f.sync_all().unwrap();
        t.elapsed()
    };
    eprintln!("a 160 MiB fsync takes {fsync_took:?} here");
    for tenths in [0u32, 2, 4, 6, 8] {
        let delay = fsync_took * tenths / 10;
        let Some(mut c) = Cluster::start(3, &[]) else { return };
        fs::write(c.node(0).path("ckpt.pt"), &old).unwrap();
        // The old version is on two nodes (each chunk) before the rewrite.
        let layout = || xattr_value(&c.node(0).path("ckpt.pt"), "user.converged.layout");
        let copies = |l: &str| l.lines().map(|r| r.rsplit(' ').next().unwrap_or("").split(',').count()).min();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let l = layout();
            if copies(&l) == Some(2) {
                break;
            }
            assert!(Instant::now() < deadline, "the old version is not on two nodes within 20 s:\n{l}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let f = OpenOptions::new().write(true).open(c.node(0).path("ckpt.pt")).unwrap();
        f.write_all_at(&new, 0).unwrap();
        // The fsync runs (and never returns: its node dies under it).
        let syncing = std::thread::spawn(move || {
            let _ = f.sync_all();
            std::mem::forget(f);
        });
        std::thread::sleep(delay);
        c.nodes[0].crash();
        let _ = syncing.join();
        fs::remove_dir_all(&c.node(0).data).unwrap();
        drop_caches();
        for i in [1, 2] {
            let got = fs::read(c.node(i).path("ckpt.pt"))
                .unwrap_or_else(|e| panic!("n{} after a kill at {delay:?}: {e}", i + 1));
            assert!(
                got == old || got == new,
                "n{} after a kill at {delay:?} reads neither version whole ({} bytes)",
                i + 1,
                got.len()
            );
        }
    }
}

/// Close-to-open across nodes: n1 rewrites a file with a new size and
/// closes it, then n2 opens, reads and hashes it; 2,000 rounds, no mismatch.
#[test]
fn an_open_after_another_nodes_close_sees_that_close() {
    let Some(c) = Cluster::start(3, &[]) else { return };
    let (n1, n2) = (c.node(0), c.node(1));
    let rounds: usize = std::env::var("CLOSE_TO_OPEN_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let started = Instant::now();
    let mut mismatches = Vec::new();
    for round in 0..rounds {
        // Sizes that grow and shrink, across block and chunk-window boundaries.
        let len = (round * 7919) % (300 << 10) + round % 3;
        let data = pattern(len, round as u64);
        fs::write(n1.path("f"), &data).unwrap();
        match fs::read(n2.path("f")) {
            Ok(got) if got == data => {}
            Ok(got) => mismatches.push(format!("round {round}: {} bytes read, {len} written", got.len())),
            Err(e) => mismatches.push(format!("round {round}: {e}")),
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {rounds} rounds saw another close: {:?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(10)]
    );
    eprintln!("{rounds} close-to-open rounds in {:?}", started.elapsed());
}

/// Each copy is written once. A file written on n1 with replicas=2 lands in
/// n2's data dir as one write of its bytes (counted by n2's own metrics),
/// and stays so once n2's settler has had several passes: a received
/// version is where n2 reads it from, not copied again into a backing file.
/// n1, whose writer wrote the file in place, writes no chunk file of its
/// own. Only a local open on n2, which hands the kernel the backing file
/// (passthrough), copies the chunks into it, once.
#[test]
fn a_replica_writes_each_chunk_once() {
    let ports: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", etcd_cluster::free_port())).collect();
    let Some(mut c) = Cluster::start(1, &["--metrics", &ports[0]]) else { return };
    c.add_node(&["--metrics", &ports[1]]);
    eventually(10, "n1 sees n2 live", || metric(&scrape(&ports[0]), "converged_live_peers").unwrap_or(0.0) >= 1.0);
    let bytes = |i: usize, what: &str| -> u64 {
        let name = format!("converged_chunk_{what}_bytes_total");
        metric(&scrape(&ports[i]), &name).unwrap_or_else(|| panic!("{name} on n{}", i + 1)) as u64
    };
    let data = pattern(100 * MIB + 12345, 21);
    let f = fs::File::create(c.node(0).path("ckpt.bin")).unwrap();
    f.write_all_at(&data, 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let ino = fs::metadata(c.node(0).path("ckpt.bin")).unwrap().ino();
    assert!(c.stored_becomes(1, ino, &data), "n2 holds a copy of ckpt.bin");
    // The settler passes once a second; give it several.
    std::thread::sleep(Duration::from_secs(4));
    let len = data.len() as u64;
    assert_eq!(bytes(1, "received"), len, "n2 received each chunk once");
    assert_eq!(bytes(1, "installed"), 0, "n2 wrote a received chunk a second time");
    assert_eq!(bytes(1, "kept"), 0);
    assert!(c.stored(1, ino) == data, "n2's copy is the file");
    let on_disk = c.allocated(1, ino);
    assert!((len..len + 2 * MIB as u64).contains(&on_disk), "n2's copy takes {on_disk} bytes for {len}");
    for what in ["received", "kept", "installed"] {
        assert_eq!(bytes(0, what), 0, "n1 wrote {what} chunk bytes for its own file");
    }
    // A read on n2: the bytes, and one copy into the backing file for the
    // kernel (passthrough), made once.
    same(&fs::read(c.node(1).path("ckpt.bin")).unwrap(), &data, "ckpt.bin on n2");
    same(&fs::read(c.node(1).path("ckpt.bin")).unwrap(), &data, "ckpt.bin on n2, again");
    assert!(bytes(1, "installed") <= len, "n2 copied its chunks into the backing file more than once");
}

/// Replication overlaps the write: the full chunks of a file being written
/// reach the replica while the writer goes on, before any fsync or close,
/// and the fsync then sends only the tail (n2 receives each byte once). A
/// streamed chunk rewritten before the fsync is sent again, as a newer
/// version, and that is what every node reads.
#[test]
fn full_chunks_reach_the_replica_before_the_fsync() {
    const CHUNK: usize = 64 * MIB;
    let ports: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", etcd_cluster::free_port())).collect();
    let Some(mut c) = Cluster::start(1, &["--metrics", &ports[0]]) else { return };
    c.add_node(&["--metrics", &ports[1]]);
    let received = || metric(&scrape(&ports[1]), "converged_chunk_received_bytes_total").unwrap_or(0.0) as usize;
    eventually(10, "n1 sees n2 live", || metric(&scrape(&ports[0]), "converged_live_peers").unwrap_or(0.0) >= 1.0);

    // Two full chunks and a tail, written and left open.
    let mut data = pattern(2 * CHUNK + MIB, 31);
    let f = OpenOptions::new().create(true).write(true).truncate(true).open(c.node(0).path("stream.bin")).unwrap();
    f.write_all_at(&data, 0).unwrap();
    eventually(30, "both full chunks on n2 before the fsync", || received() >= 2 * CHUNK);
    f.sync_all().unwrap();
    assert_eq!(received(), data.len(), "n2 received each byte once: the fsync sent the tail only");
    same(&fs::read(c.node(1).path("stream.bin")).unwrap(), &data, "stream.bin on n2");

    // Another file: its first chunk streamed, then rewritten before close.
    let before = received();
    let g = OpenOptions::new().create(true).write(true).truncate(true).open(c.node(0).path("again.bin")).unwrap();
    g.write_all_at(&data[..CHUNK + MIB], 0).unwrap();
    eventually(30, "the first chunk on n2", || received() >= before + CHUNK);
    data[12345..12345 + 4096].fill(0xa5);
    g.write_all_at(&data[12345..12345 + 4096], 12345).unwrap();
    close(g).unwrap();
    for i in 0..2 {
        same(
            &fs::read(c.node(i).path("again.bin")).unwrap(),
            &data[..CHUNK + MIB],
            &format!("again.bin on n{}", i + 1),
        );
    }
    assert_eq!(received(), before + 2 * CHUNK + MIB, "the rewritten chunk was sent again, once");
    drop(f);
}

/// A replica killed and restarted between a stream and the publish: the
/// fsync still succeeds, its record does not count that replica for the
/// chunks it received before its restart (it cannot vouch for them: a
/// crash may have left them half written), and once the file is closed the
/// replicator gives every chunk its second copy, durably. Then the writer's
/// node dies and the replica alone reads the file whole.
#[test]
fn a_replica_restarted_after_a_stream_holds_nothing_it_cannot_vouch_for() {
    const CHUNK: usize = 64 * MIB;
    let ports: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", etcd_cluster::free_port())).collect();
    let Some(mut c) = Cluster::start(1, &["--metrics", &ports[0]]) else { return };
    c.add_node(&["--metrics", &ports[1]]);
    let live = || metric(&scrape(&ports[0]), "converged_live_peers").unwrap_or(0.0) >= 1.0;
    eventually(10, "n1 sees n2 live", live);
    let received = || metric(&scrape(&ports[1]), "converged_chunk_received_bytes_total").unwrap_or(0.0) as usize;

    let data = pattern(2 * CHUNK + MIB, 41);
    let path = c.node(0).path("r.bin");
    let f = OpenOptions::new().create(true).write(true).truncate(true).open(&path).unwrap();
    f.write_all_at(&data, 0).unwrap();
    eventually(30, "both full chunks streamed to n2", || received() >= 2 * CHUNK);
    c.nodes[1].crash();
    c.nodes[1].mount();
    eventually(10, "n1 sees n2 live again", live);
    // n1 reaches the new n2 (its address, its connection) again: a small
    // file of its own gets its copy there.
    fs::write(c.node(0).path("warm"), b"warm").unwrap();
    eventually(30, "n1 copies a new file to the restarted n2", || {
        xattr_value(&c.node(0).path("warm"), "user.converged.layout").contains("n1,n2")
    });

    f.sync_all().unwrap();
    let holders = |l: &str, index: &str| -> String {
        let row =
            l.lines().find(|r| r.starts_with(&format!("{index} "))).unwrap_or_else(|| panic!("chunk {index}: {l}"));
        row.rsplit(' ').next().unwrap().to_string()
    };
    let layout = xattr_value(&path, "user.converged.layout");
    for index in ["0", "1"] {
        assert_eq!(
            holders(&layout, index),
            "n1",
            "n2 was recorded for a chunk it received before its restart:\n{layout}"
        );
    }
    drop(f);
    eventually(60, "the replicator gave every chunk its second copy", || {
        let l = xattr_value(&path, "user.converged.layout");
        ["0", "1", "2"].iter().all(|i| holders(&l, i).split(',').count() == 2)
    });

    c.nodes[0].crash();
    drop_caches();
    same(&fs::read(c.node(1).path("r.bin")).unwrap(), &data, "r.bin on n2 with n1 gone");
}
