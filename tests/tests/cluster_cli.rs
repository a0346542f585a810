//! `converged cluster init` and `issue-cert`: certificates a node can use,
//! and clear refusals.

mod common;

use common::*;
use converged_transport::NodeTls;

#[test]
fn cluster_init_and_issue_cert() {
    let t = tempfile::tempdir().unwrap();
    let ca = t.path().join("ca");
    let out =
        converged().args(["cluster", "init", "--name", "prod-a", "--node", "n1", "--out"]).arg(&ca).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let n1 = NodeTls::load(&ca.join("n1")).unwrap();
    assert_eq!(n1.node, "n1");
    n1.server_config().unwrap();
    n1.client_config().unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(ca.join("ca.key")).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "the CA key is private");

    let n2_dir = t.path().join("n2");
    let out = converged()
        .args(["cluster", "issue-cert", "--node", "n2", "--ca"])
        .arg(&ca)
        .arg("--out")
        .arg(&n2_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let n2 = NodeTls::load(&n2_dir).unwrap();
    assert_eq!(n2.ca_pem, n1.ca_pem, "both nodes trust the same CA");

    let again = converged().args(["cluster", "init", "--out"]).arg(&ca).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a cluster CA"));
    let bad = converged()
        .args(["cluster", "issue-cert", "--node", "no/slash", "--ca"])
        .arg(&ca)
        .arg("--out")
        .arg(t.path().join("x"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("node name"));
    let missing = converged()
        .args(["cluster", "issue-cert", "--node", "n3", "--ca"])
        .arg(t.path().join("nope"))
        .arg("--out")
        .arg(t.path().join("y"))
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("nope"));
}
