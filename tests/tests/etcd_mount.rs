//! A mount whose metadata lives in a real 3-member etcd cluster.

mod common;

use std::fs;

use common::*;

#[test]
fn mount_on_etcd_metadata_keeps_namespace_and_bytes() {
    let Some(cluster) = common::etcd_cluster::EtcdCluster::start() else { return };
    let uri = cluster.uri("vol1");
    let mut m = Mount::with_args(&["--meta", &uri]);
    fs::create_dir_all(m.path("ckpt/run1")).unwrap();
    fs::write(m.path("ckpt/run1/step.tmp"), pattern(3 << 20, 5)).unwrap();
    fs::rename(m.path("ckpt/run1/step.tmp"), m.path("ckpt/run1/step100.pt")).unwrap();
    fs::write(m.path("gone"), b"x").unwrap();
    fs::remove_file(m.path("gone")).unwrap();
    m.umount();
    assert!(!m.data.join("meta.redb").exists(), "no embedded metadata when etcd is named");
    m.mount();
    drop_caches();
    assert_eq!(fs::read(m.path("ckpt/run1/step100.pt")).unwrap(), pattern(3 << 20, 5));
    assert!(!m.path("ckpt/run1/step.tmp").exists());
    assert!(!m.path("gone").exists());

    // A malformed etcd URI and an unreachable cluster are refused clearly.
    let t = tempfile::tempdir().unwrap();
    let out = converged()
        .arg("mount")
        .arg(t.path())
        .arg("--data-dir")
        .arg(&m.data)
        .args(["--meta", "etcd://nohostport/vol"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("etcd needs endpoints"));
}

fn status(uri: &str) -> String {
    let out = converged().args(["status", "--meta", uri]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn state_of(status: &str, node: &str) -> Option<String> {
    status
        .lines()
        .find(|l| l.split_whitespace().next() == Some(node))
        .and_then(|l| l.split_whitespace().nth(1))
        // `dead(<=12s)`: dead, at most 12 s since its last record was written.
        .map(|s| s.split('(').next().unwrap_or(s).to_string())
}

#[test]
fn nodes_register_heartbeat_and_are_seen_dead() {
    let Some(cluster) = common::etcd_cluster::EtcdCluster::start() else { return };
    let uri = cluster.uri("members");
    let mut a = Mount::with_args(&["--meta", &uri, "--node-id", "n1", "--labels", "rack=r1", "--lease-ttl", "2"]);
    let mut b = Mount::with_args(&["--meta", &uri, "--node-id", "n2", "--labels", "rack=r2", "--lease-ttl", "2"]);
    // Heartbeats keep both alive past their lease.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let s = status(&uri);
    assert_eq!(state_of(&s, "n1").as_deref(), Some("live"), "{s}");
    assert_eq!(state_of(&s, "n2").as_deref(), Some("live"), "{s}");
    assert!(s.contains("rack=r2"), "{s}");

    // A crashed node's lease expires: it shows as dead, the other stays live.
    b.crash();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let s = status(&uri);
        if state_of(&s, "n2").as_deref() == Some("dead") {
            assert_eq!(state_of(&s, "n1").as_deref(), Some("live"), "{s}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "n2 never declared dead:\n{s}");
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    // It comes back and is live again; a clean unmount leaves at once.
    b.mount();
    assert_eq!(state_of(&status(&uri), "n2").as_deref(), Some("live"));
    a.umount();
    assert_eq!(state_of(&status(&uri), "n1").as_deref(), Some("dead"), "left on unmount");
    let out = converged().args(["status", "--meta", "etcd://127.0.0.1:1/none"]).output().unwrap();
    assert!(!out.status.success(), "an unreachable etcd is an error");
}

/// etcd with its database full (its `--quota-backend-bytes` reached, the
/// NOSPACE alarm raised), as a long untar under a long history retention
/// can leave it: a change on the mount fails with ENOSPC (not EIO after
/// seconds of retries), what is there still reads back, and the data disk
/// keeps the reserve it holds for the embedded store, since etcd's quota is
/// not that disk's.
#[test]
fn a_full_etcd_answers_enospc_and_keeps_what_is_there() {
    use converged_metadata::{Durability, EtcdKv, KvEngine, KvError};
    use std::time::Duration;
    let port = common::etcd_cluster::free_port();
    let _etcd = common::etcd_cluster::EtcdMember::start(
        port,
        "http",
        &["--quota-backend-bytes".into(), (32u64 << 20).to_string()],
    );
    let endpoint = format!("127.0.0.1:{port}");
    let uri = format!("etcd://{endpoint}/full");
    let m = Mount::with_args(&["--meta", &uri, "--meta-wait", "1m"]);
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/before"), pattern(100_000, 3)).unwrap();
    let reserve = m.data.join("converged.reserve");
    assert!(reserve.exists(), "a mount keeps a reserve on its data disk");

    // Another volume of the same etcd fills it until etcd refuses.
    let kv = EtcdKv::connect(std::slice::from_ref(&endpoint), "filler", Duration::from_secs(10)).unwrap();
    let big = vec![7u8; 1 << 20];
    let refused = (0..200u32).find(|i| {
        let mut txn = kv.write_txn().unwrap();
        txn.put(format!("k{i}").as_bytes(), &big);
        match txn.commit(Durability::Durable) {
            Ok(()) => false,
            Err(e) => {
                let full = matches!(e, KvError::NoSpace) || e.to_string().contains("database space exceeded");
                assert!(full, "filling etcd, put {i}: {e}");
                true
            }
        }
    });
    let puts = refused.expect("etcd never refused a write at its 32 MiB quota");
    eprintln!("etcd refused the {puts}th MiB");
    let mut txn = kv.write_txn().unwrap();
    txn.put(b"one-more", b"x");
    let e = txn.commit(Durability::Durable).unwrap_err();
    assert!(matches!(e, KvError::NoSpace), "the engine's word for a full etcd: {e}");

    let e = fs::File::create(m.path("d/after")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "a create on a full etcd: {e}");
    let e = fs::create_dir(m.path("d/sub")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "a mkdir on a full etcd: {e}");
    assert!(!m.path("d/after").exists() && !m.path("d/sub").exists());
    drop_caches();
    assert_eq!(fs::read(m.path("d/before")).unwrap(), pattern(100_000, 3));
    assert!(reserve.exists(), "etcd's full database cost the data disk its reserve");
    assert!(
        m.log().contains("etcd's database is full"),
        "the daemon's log does not say what is full and what to do:\n{}",
        m.log()
    );
}

/// 64 small files written and closed at once on `m`, the releases the
/// kernel sends after each close(2) still queued or under way on return.
fn close_64_files(m: &Mount) {
    use std::io::Write;
    let files: Vec<fs::File> = (0..64)
        .map(|i| {
            let mut f = fs::File::create(m.path(&format!("f{i}"))).unwrap();
            f.write_all(&pattern(4096 + i, i as u64)).unwrap();
            f
        })
        .collect();
    drop(files);
}

fn all_64_read_back_whole(m: &Mount) {
    for i in 0..64 {
        let back = fs::read(m.path(&format!("f{i}"))).unwrap();
        assert!(
            back == pattern(4096 + i, i as u64),
            "f{i}: {} bytes back of {}; log:\n{}",
            back.len(),
            4096 + i,
            m.log()
        );
    }
}

/// The kernel sends a file's RELEASE in the background once close(2) has
/// returned, and an unmount drops those the daemon has not read yet (a FUSE
/// mount that is not a block device's gets no DESTROY to wait for them).
/// On a node that serves no peers a written file is sealed at its release:
/// files closed just before the unmount are sealed by it, as another node
/// of the volume sees at once (their sizes; before, from file 11 on they
/// were still unsealed and empty until the writer's next mount), and read
/// back whole at the next mount.
#[test]
fn files_closed_just_before_an_unmount_keep_their_bytes() {
    let Some(cluster) = common::etcd_cluster::EtcdCluster::start() else { return };
    let uri = cluster.uri("closing");
    let mut m = Mount::with_args(&["--meta", &uri]);
    close_64_files(&m);
    m.umount_at_once();
    let reader = Mount::with_args(&["--meta", &uri, "--read-only", "--node-id", "reader"]);
    for i in 0..64 {
        let size = fs::metadata(reader.path(&format!("f{i}"))).unwrap().len();
        assert_eq!(size, 4096 + i as u64, "f{i}'s size as another node sees it after the writer's unmount");
    }
    drop(reader);
    m.mount();
    all_64_read_back_whole(&m);
}

/// The same node killed (supervisor and daemon) right after the closes:
/// the files whose release it had not sealed are sealed again at the next
/// mount from what their backing files hold, as on a single node with
/// embedded metadata. Its closes publish nothing, so bringing them back to
/// what was published, as a node serving peers does, emptied them (5-14
/// of the 64 read wrong before).
#[test]
fn files_closed_just_before_the_node_is_killed_keep_their_bytes() {
    let Some(cluster) = common::etcd_cluster::EtcdCluster::start() else { return };
    let uri = cluster.uri("killed");
    let mut m = Mount::with_args(&["--meta", &uri]);
    close_64_files(&m);
    m.crash();
    m.mount();
    all_64_read_back_whole(&m);
}
