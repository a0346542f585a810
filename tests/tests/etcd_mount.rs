//! A mount whose metadata lives in a real 3-member etcd cluster.

mod common;
#[path = "../../metadata/tests/etcd_cluster/mod.rs"]
mod etcd_cluster;

use std::fs;

use common::*;

#[test]
fn mount_on_etcd_metadata_keeps_namespace_and_bytes() {
    let Some(cluster) = etcd_cluster::EtcdCluster::start() else { return };
    let uri = format!("etcd://{}/vol1", cluster.endpoints.join(","));
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
