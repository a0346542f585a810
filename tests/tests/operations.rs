//! Running converged as an operator would: at boot (the metadata service not
//! up yet, a data dir whose disk did not mount, an automount, systemd), read
//! only, and with its defaults locked down (nosuid, nodev, private files).

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::{eventually, same, status, Cluster};
use common::etcd_cluster::{free_port, EtcdMember};
use common::*;

fn dirs() -> (TestDirs, PathBuf, PathBuf) {
    let t = tempfile::Builder::new().prefix("converged-ops").tempdir().unwrap();
    let (data, mnt) = (t.path().join("data"), t.path().join("mnt"));
    fs::create_dir(&data).unwrap();
    fs::create_dir(&mnt).unwrap();
    (TestDirs { mnt: mnt.clone(), t }, data, mnt)
}

/// A test's directories. A mount still on its mount point when they go (a
/// test that failed before its unmount) is taken down, so that its daemon
/// does not outlive the test holding the data dir.
struct TestDirs {
    mnt: PathBuf,
    t: tempfile::TempDir,
}

impl TestDirs {
    fn path(&self) -> &Path {
        self.t.path()
    }
}

impl Drop for TestDirs {
    fn drop(&mut self) {
        if is_mounted(&self.mnt) {
            take_down(&self.mnt);
        }
    }
}

fn is_mounted(mnt: &Path) -> bool {
    mount_type(mnt).is_some()
}

/// Whether the kernel can mount autofs, loading its module if one is there.
fn kernel_has_autofs() -> bool {
    let listed = || fs::read_to_string("/proc/filesystems").is_ok_and(|f| f.lines().any(|l| l.ends_with("\tautofs")));
    if listed() {
        return true;
    }
    let _ = Command::new("modprobe").arg("autofs4").stderr(Stdio::null()).status();
    listed()
}

fn mount_type(mnt: &Path) -> Option<String> {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    mounts.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (Path::new(f[1]) == mnt && f[2] != "autofs").then(|| format!("{} {}", f[2], f[3]))
    })
}

fn stop_mount(mnt: &Path) {
    let out = converged().arg("umount").arg(mnt).output().unwrap();
    assert!(out.status.success(), "umount: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_mount_started_before_etcd_comes_up_once_etcd_starts() {
    let (_t, data, mnt) = dirs();
    let port = free_port();
    let meta = format!("etcd://127.0.0.1:{port}/boot");
    // Without a wait, an unreachable etcd fails the mount at once, saying where.
    let out = converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&data).args(["--meta", &meta]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");

    let started = Instant::now();
    let mut mount = converged()
        .arg("mount")
        .arg(&mnt)
        .arg("--data-dir")
        .arg(&data)
        .args(["--meta", &meta, "--meta-wait", "2m"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    assert!(mount.try_wait().unwrap().is_none(), "the mount gave up while waiting for etcd");
    assert!(!is_mounted(&mnt));
    let log = fs::read_to_string(data.join("converged.log")).unwrap_or_default();
    assert!(log.contains("metadata service not reachable; waiting"), "the wait is not logged: {log}");

    let _etcd = EtcdMember::start(port, "http", &[]);
    let out = mount.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("mount came up {:?} after it started (etcd started after 4 s)", started.elapsed());
    fs::write(mnt.join("after-boot"), b"etcd came up").unwrap();
    assert_eq!(fs::read(mnt.join("after-boot")).unwrap(), b"etcd came up");
    stop_mount(&mnt);
}

/// Mount node `id` of `c`'s volume on `data`; its output on failure.
fn mount_node(c: &Cluster, id: &str, data: &Path, mnt: &Path, extra: &[&str]) -> std::process::Output {
    let tls = c.tls_dir(id);
    converged()
        .arg("mount")
        .arg(mnt)
        .arg("--data-dir")
        .arg(data)
        .args(["--meta", &c.meta, "--listen", "127.0.0.1:0", "--tls-dir"])
        .arg(&tls)
        .args(["--lease-ttl", "3", "--peer-timeout", "2"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn a_data_dir_that_is_empty_or_foreign_is_refused_for_a_known_node() {
    let Some(mut c) = Cluster::start(2, &["--replicas", "2"]) else { return };
    let want = pattern(3 << 20, 7);
    fs::write(c.node(0).path("ckpt"), &want).unwrap();
    let n1_data = c.node(0).data.clone();
    let n1_mnt = c.node(0).mnt.clone();
    c.nodes[0].umount();

    // n1's disk "did not mount": an empty directory where its data dir was.
    let t = tempfile::tempdir().unwrap();
    let empty = t.path().join("data");
    fs::create_dir(&empty).unwrap();
    let out = mount_node(&c, "n1", &empty, &n1_mnt, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node n1 has been part of volume")
            && err.contains("is its disk mounted")
            && err.contains("--new-node"),
        "{err}"
    );
    assert!(!is_mounted(&n1_mnt));

    // Another volume's metadata over n1's data dir.
    let other = c.meta.replace("/vol", "/other");
    let out = converged()
        .arg("mount")
        .arg(&n1_mnt)
        .arg("--data-dir")
        .arg(&n1_data)
        .args(["--meta", &other, "--listen", "127.0.0.1:0", "--tls-dir"])
        .arg(c.tls_dir("n1"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // Refused before the empty prefix got a volume of its own.
    assert!(err.contains("belongs to volume") && err.contains("holds no volume"), "{err}");

    // A replaced disk, said so: n1 joins with the empty dir, its old copies
    // are forgotten, and the file still reads whole from n2.
    let out = mount_node(&c, "n1", &empty, &n1_mnt, &["--new-node"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    same(&fs::read(n1_mnt.join("ckpt")).unwrap(), &want, "read on n1 after its disk was replaced");
    let status = status(&c);
    assert!(status.contains("n1"), "{status}");
    stop_mount(&n1_mnt);
    // The old data dir says it is n1's: another node may not take it.
    c.issue_cert("n3");
    let out = mount_node(&c, "n3", &n1_data, &n1_mnt, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to node n1, not n3"), "{err}");
    assert!(!is_mounted(&n1_mnt));
}

#[test]
fn an_empty_data_dir_for_an_existing_single_node_volume_is_refused() {
    let (t, data, mnt) = dirs();
    let meta = format!("redb://{}", t.path().join("meta.redb").display());
    let out = converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&data).args(["--meta", &meta]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    fs::write(mnt.join("f"), b"on the first disk").unwrap();
    stop_mount(&mnt);
    let empty = t.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let out =
        converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&empty).args(["--meta", &meta]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exists, but data dir") && err.contains("is its disk mounted"), "{err}");
    assert!(!is_mounted(&mnt));
}

#[test]
fn a_read_only_mount_refuses_writes_with_erofs_and_takes_no_lease() {
    let Some(c) = Cluster::start(1, &["--replicas", "1"]) else { return };
    let want = pattern(5 << 20, 11);
    fs::write(c.node(0).path("model.pt"), &want).unwrap();
    fs::create_dir(c.node(0).path("dir")).unwrap();

    // A reader node: its own data dir, its own certificate, read-only.
    c.issue_cert("r1");
    let (_t, data, mnt) = dirs();
    let out = mount_node(&c, "r1", &data, &mnt, &["--read-only"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let how = mount_type(&mnt).unwrap();
    assert!(how.contains(" ro,") || how.contains(" ro"), "{how}");

    same(&fs::read(mnt.join("model.pt")).unwrap(), &want, "read on the read-only node");
    let erofs = |r: std::io::Result<()>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{what}: {e}");
    };
    erofs(fs::OpenOptions::new().write(true).open(mnt.join("model.pt")).map(drop), "open for writing");
    erofs(fs::write(mnt.join("new"), b"x"), "create");
    erofs(fs::create_dir(mnt.join("d2")), "mkdir");
    erofs(fs::remove_file(mnt.join("model.pt")), "unlink");
    erofs(fs::rename(mnt.join("dir"), mnt.join("dir2")), "rename");
    erofs(fs::set_permissions(mnt.join("model.pt"), fs::Permissions::from_mode(0o600)), "chmod");

    // No membership lease: the volume does not list it, and nothing of it
    // is in the data dir but its lock and log.
    let st = status(&c);
    assert!(!st.contains("r1"), "a read-only node registered:\n{st}");
    let left: Vec<String> =
        fs::read_dir(&data).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    assert!(!left.iter().any(|n| n == "identity" || n == "converged.reserve"), "{left:?}");
    // The writer is not held up by a reader: it rewrites the file at once.
    let v2 = pattern(1 << 20, 12);
    fs::write(c.node(0).path("model.pt"), &v2).unwrap();
    eventually(20, "the reader sees the new version", || fs::read(mnt.join("model.pt")).is_ok_and(|b| b == v2));
    stop_mount(&mnt);
}

#[test]
fn mounts_are_nosuid_and_nodev_unless_asked_and_data_dir_files_are_private() {
    // nobody must be able to reach the mount point.
    let t = tempfile::Builder::new().prefix("converged-suid").tempdir().unwrap();
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let (data, mnt) = (t.path().join("data"), t.path().join("mnt"));
    fs::create_dir(&data).unwrap();
    fs::create_dir(&mnt).unwrap();
    let euid_via_setuid_copy = |extra: &[&str]| -> String {
        let out = converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&data).args(extra).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let id = mnt.join("id");
        if !id.exists() {
            fs::copy("/usr/bin/id", &id).unwrap();
            fs::set_permissions(&id, fs::Permissions::from_mode(0o4755)).unwrap();
        }
        assert_eq!(fs::metadata(&id).unwrap().mode() & 0o4000, 0o4000, "the setuid bit is stored");
        let out = Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(&id)
            .arg("-u")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let how = mount_type(&mnt).unwrap();
        stop_mount(&mnt);
        format!("{} {how}", String::from_utf8_lossy(&out.stdout).trim())
    };
    let default = euid_via_setuid_copy(&[]);
    assert!(default.starts_with("65534 "), "a setuid-root binary ran as root on a default mount: {default}");
    assert!(default.contains("nosuid") && default.contains("nodev"), "{default}");
    let asked = euid_via_setuid_copy(&["--suid"]);
    assert!(asked.starts_with("0 "), "--suid should honour the setuid bit: {asked}");

    // A device node made on the mount (here /dev/null's numbers) opens only with --dev.
    let open_device = |extra: &[&str]| -> std::io::Result<()> {
        let out = converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&data).args(extra).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let dev = mnt.join("null");
        if !dev.exists() {
            // SAFETY: mknod(2) on a NUL-terminated path.
            let r = unsafe { libc::mknod(cstr(&dev).as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
            assert_eq!(r, 0, "mknod: {}", std::io::Error::last_os_error());
        }
        let r = fs::OpenOptions::new().write(true).open(&dev).map(drop);
        stop_mount(&mnt);
        r
    };
    let refused = open_device(&[]).expect_err("a device node opened on a default (nodev) mount");
    assert_eq!(refused.raw_os_error(), Some(libc::EACCES), "{refused}");
    open_device(&["--dev"]).expect("--dev should let a device node open");

    for name in ["meta.redb", "converged.lock", "converged.log", "identity", "chunks"] {
        let mode = fs::metadata(data.join(name)).unwrap().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{name} is {mode:o}: readable by others");
    }
    // The files inside the chunk store too: a copy of the setuid binary's bytes is there.
    for e in fs::read_dir(data.join("chunks")).unwrap() {
        let e = e.unwrap();
        let mode = e.metadata().unwrap().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "chunks/{:?} is {mode:o}: readable by others", e.file_name());
    }
}

#[test]
fn an_x_systemd_automount_line_mounts_on_first_access() {
    // autofs is a kernel file system like any other: a kernel built without
    // it (and no module to load) cannot hold a trigger, and systemd's
    // automount units fail there too. Say so rather than fail the run.
    if !kernel_has_autofs() {
        eprintln!(
            "this kernel has no autofs (not in /proc/filesystems, no module loads): the automount line is not tried"
        );
        return;
    }
    install_helpers();
    let (t, data, mnt) = dirs();
    // The data dir's first mount, by hand.
    let out = converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&data).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    fs::write(mnt.join("hello"), b"behind an automount").unwrap();
    stop_mount(&mnt);

    let fstab = t.path().join("fstab");
    let line =
        format!("local {} converged data_dir={},_netdev,x-systemd.automount 0 0\n", mnt.display(), data.display());
    fs::write(&fstab, line).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/automount.py");
    let mut automounter = Command::new("python3")
        .arg(&script)
        .arg(&fstab)
        .arg(&mnt)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut armed = String::new();
    let mut out = std::io::BufReader::new(automounter.stdout.take().unwrap());
    std::io::BufRead::read_line(&mut out, &mut armed).unwrap();
    assert_eq!(armed.trim(), "armed");
    assert!(!is_mounted(&mnt), "nothing is mounted before the first access");

    // The first access waits for the mount, then sees the volume. Should the
    // mount hang, stopping the automounter releases the waiting access.
    let pid = automounter.id() as i32;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            eprintln!("the first access did not return within 60 s; stopping the automounter");
            // SAFETY: kill(2) of our child.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    });
    let got = fs::read(mnt.join("hello"));
    let _ = done_tx.send(());
    watchdog.join().unwrap();
    let how = mount_type(&mnt);
    if is_mounted(&mnt) {
        stop_mount(&mnt);
    }
    // SAFETY: kill(2) of our child.
    unsafe { libc::kill(automounter.id() as i32, libc::SIGTERM) };
    let _ = automounter.wait();
    assert_eq!(got.unwrap(), b"behind an automount");
    assert!(how.as_deref().is_some_and(|h| h.starts_with("fuse.converged")), "{how:?}");
}

#[test]
fn the_systemd_unit_verifies() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/systemd/converged@.service");
    let text = fs::read_to_string(&unit).unwrap();
    // The unit names the installed binary; verify it against this build's.
    let t = tempfile::tempdir().unwrap();
    let body = text.replace("/usr/local/bin/converged", bin("converged").to_str().unwrap());
    fs::write(t.path().join("converged@.service"), body).unwrap();
    std::os::unix::fs::symlink("converged@.service", t.path().join("converged@data.service")).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(t.path().join("converged@data.service")).output();
    let Ok(out) = out else {
        assert!(std::env::var_os("CI").is_none(), "systemd-analyze must be installed in CI (apt-get install systemd)");
        eprintln!("systemd-analyze not installed; unit not verified");
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "systemd-analyze verify: {err}");
    for want in ["After=network-online.target", "Restart=on-failure", "Type=notify", "--foreground"] {
        assert!(text.contains(want), "the unit lacks {want}");
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl.
fn make_certs(dir: &Path) {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let mut ca = vec!["req", "-x509", "-days", "2", "-subj", "/CN=etcd test CA", "-keyout", "ca.key", "-out", "ca.pem"];
    ca.extend(ec);
    openssl(dir, &ca);
    for (name, ext) in [
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        let (key, csr, pem, cn) =
            (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"), format!("/CN={name}"));
        let mut req = vec!["req", "-subj", &cn, "-keyout", &key, "-out", &csr];
        req.extend(ec);
        openssl(dir, &req);
        let ext = format!("{name}.ext");
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-days",
                "2",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-extfile",
                &ext,
            ],
        );
    }
}

#[test]
fn etcd_over_tls_with_a_client_certificate_and_a_user() {
    let certs = tempfile::tempdir().unwrap();
    let c = certs.path();
    make_certs(c);
    let p = |f: &str| c.join(f).to_str().unwrap().to_string();
    let port = free_port();
    let _etcd = EtcdMember::start(
        port,
        "https",
        &[
            "--client-cert-auth".into(),
            "--trusted-ca-file".into(),
            p("ca.pem"),
            "--cert-file".into(),
            p("server.pem"),
            "--key-file".into(),
            p("server.key"),
        ],
    );
    // A user allowed the volume's keys and nothing else, then auth on.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(fs::read(c.join("ca.pem")).unwrap()))
            .identity(etcd_client::Identity::from_pem(
                fs::read(c.join("client.pem")).unwrap(),
                fs::read(c.join("client.key")).unwrap(),
            ));
        let opts = etcd_client::ConnectOptions::new().with_tls(tls).with_connect_timeout(Duration::from_secs(2));
        let url = format!("https://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut admin = loop {
            if let Ok(mut cl) = etcd_client::Client::connect([url.as_str()], Some(opts.clone())).await {
                if cl.status().await.is_ok() {
                    break cl;
                }
            }
            assert!(Instant::now() < deadline, "etcd with TLS did not come up");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        admin.user_add("root", "root-secret", None).await.unwrap();
        admin.user_grant_role("root", "root").await.unwrap();
        admin.user_add("trainer", "s3cret pass", None).await.unwrap();
        admin.role_add("vol-sec").await.unwrap();
        admin
            .role_grant_permission("vol-sec", etcd_client::Permission::read_write("sec/").with_prefix())
            .await
            .unwrap();
        admin.user_grant_role("trainer", "vol-sec").await.unwrap();
        admin.auth_enable().await.unwrap();
    });
    fs::write(c.join("password"), "s3cret pass\n").unwrap();
    fs::write(c.join("wrong-password"), "guess\n").unwrap();

    let (_t, data, mnt) = dirs();
    let base = format!("etcds://127.0.0.1:{port}/sec");
    let mount_with = |uri: &str, extra: &[&str]| {
        converged()
            .arg("mount")
            .arg(&mnt)
            .arg("--data-dir")
            .arg(&data)
            .args(["--meta", uri])
            .args(extra)
            .output()
            .unwrap()
    };
    let mount = |uri: &str| mount_with(uri, &[]);
    let full = format!(
        "{base}?ca={}&cert={}&key={}&user=trainer&password_file={}",
        p("ca.pem"),
        p("client.pem"),
        p("client.key"),
        p("password")
    );
    // Refusals are final: under a long --meta-wait (as a boot mount has) a
    // refused certificate or password must fail the mount, not be waited out.
    let refused_under_wait = |uri: String, why: &[&str]| {
        let started = Instant::now();
        let out = mount_with(&uri, &["--meta-wait", "10m"]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "mounted with {uri}");
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "a refusal was waited on as if etcd were down ({:?}): {err}",
            started.elapsed()
        );
        assert!(why.iter().any(|w| err.to_lowercase().contains(w)), "unclear refusal for {uri}: {err}");
    };
    let refused = |uri: String, why: &[&str]| {
        let out = mount(&uri);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "mounted with {uri}");
        assert!(!is_mounted(&mnt));
        assert!(err.contains(&format!("127.0.0.1:{port}")), "the error does not say where: {err}");
        assert!(why.iter().any(|w| err.to_lowercase().contains(w)), "unclear refusal for {uri}: {err}");
        eprintln!("refused as it should be: {}", err.trim());
    };
    // No client certificate: the TLS handshake is refused.
    refused(
        format!("{base}?ca={}&user=trainer&password_file={}", p("ca.pem"), p("password")),
        &["certificate", "handshake", "tls"],
    );
    // Plain TCP to a TLS port.
    refused(format!("etcd://127.0.0.1:{port}/sec"), &["transport", "connection", "h2", "protocol"]);
    // The right certificate, the wrong password.
    refused(full.replace(&p("password"), &p("wrong-password")), &["authentication failed", "password"]);
    refused_under_wait(
        format!("{base}?ca={}&user=trainer&password_file={}", p("ca.pem"), p("password")),
        &["certificate", "handshake", "tls"],
    );
    refused_under_wait(full.replace(&p("password"), &p("wrong-password")), &["authentication failed", "password"]);

    let out = mount(&full);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    fs::write(mnt.join("secured"), b"over TLS, as trainer").unwrap();
    stop_mount(&mnt);
    let out = mount(&full);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let back = fs::read(mnt.join("secured")).unwrap();
    if back != b"over TLS, as trainer" {
        let log = fs::read_to_string(data.join("converged.log")).unwrap_or_default();
        panic!("read back {:?} after a remount; the daemons' log:\n{log}", String::from_utf8_lossy(&back));
    }
    // The admin commands take the same URI.
    let st = converged().args(["status", "--meta", &full]).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    stop_mount(&mnt);
}

/// The total count of histogram `name` with label `label`, summed over label values if `label` is empty.
fn histogram_count(scrape: &str, name: &str, label: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_count{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn latency_histograms_move_under_fio_and_stats_shows_the_rates() {
    if Command::new("fio").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "fio must be installed in CI (apt-get install fio)");
        eprintln!("fio not installed; latency test not run");
        return;
    }
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    // Reads and writes through the daemon (no passthrough), so FUSE sees them.
    let m = Mount::with_args(&["--verify-reads", "--metrics", &addr]);
    let before = scrape(&addr);
    let mut fio = Command::new("fio")
        .args(["--name=lat", "--rw=randrw", "--bs=64k", "--size=64m", "--numjobs=2", "--time_based", "--runtime=6"])
        .arg(format!("--directory={}", m.mnt.display()))
        .args(["--ioengine=psync", "--group_reporting", "--output-format=terse"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let stats = converged().arg("stats").arg(&m.mnt).args(["--interval", "1s", "--count", "2"]).output().unwrap();
    let status = fio.wait().unwrap();
    assert!(status.success(), "fio failed");
    let after = scrape(&addr);

    for (name, label) in [
        ("converged_fuse_op_seconds", "op=\"read\""),
        ("converged_fuse_op_seconds", "op=\"write\""),
        ("converged_meta_txn_seconds", ""),
    ] {
        let (b, a) = (histogram_count(&before, name, label), histogram_count(&after, name, label));
        assert!(a > b, "{name}{{{label}}} did not move under fio: {b} -> {a}");
    }
    let inf = |text: &str| {
        histogram_count(&text.replace("_bucket{", "_count{"), "converged_fuse_op_seconds", "le=\"+Inf\",op=\"write\"")
    };
    assert_eq!(
        inf(&after),
        histogram_count(&after, "converged_fuse_op_seconds", "op=\"write\""),
        "the +Inf bucket holds every write"
    );

    assert!(stats.status.success(), "{}", String::from_utf8_lossy(&stats.stderr));
    let text = String::from_utf8_lossy(&stats.stdout);
    eprintln!("{text}");
    let rate = |area: &str, op: &str| -> f64 {
        text.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() >= 6 && f[0] == area && f[1] == op).then(|| f[2].parse::<f64>().unwrap_or(0.0))
            })
            .fold(0.0, f64::max)
    };
    assert!(rate("fuse", "write") > 0.0 && rate("fuse", "read") > 0.0, "stats shows no read/write rate:\n{text}");
    let mbs = text.lines().find(|l| l.starts_with("through the daemon")).unwrap_or_default().to_string();
    assert!(!mbs.contains("write 0.0 MB/s"), "stats shows no write throughput: {mbs}");
}

/// Metric families (`# TYPE` names) a scrape has.
fn families(scrape: &str) -> std::collections::BTreeSet<String> {
    scrape.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next().map(str::to_string)).collect()
}

#[test]
fn the_grafana_dashboard_uses_only_metrics_the_daemon_serves() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/grafana/converged.json");
    let text = fs::read_to_string(&path).unwrap();
    let mut wanted = std::collections::BTreeSet::new();
    for (i, _) in text.match_indices("converged_") {
        let name: String =
            text[i..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
        let base = ["_bucket", "_count", "_sum", "_total"]
            .iter()
            .fold(name.clone(), |n, s| n.strip_suffix(s).map(str::to_string).unwrap_or(n));
        wanted.insert(base);
    }
    assert!(wanted.len() > 15, "the dashboard names few metrics: {wanted:?}");
    // A cluster node with an object store serves every family the dashboard uses.
    let store = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let uri = format!("file://{}", store.path().display());
    let Some(c) = Cluster::start(1, &["--metrics", &addr, "--object-store", &uri, "--backfill-delay", "100ms"]) else {
        return;
    };
    fs::write(c.node(0).path("f"), b"x").unwrap();
    let mut missing = Vec::new();
    eventually(30, "every dashboard metric is served", || {
        let have = families(&scrape(&addr));
        missing = wanted.iter().filter(|w| !have.contains(*w)).cloned().collect();
        missing.is_empty()
    });
    assert!(missing.is_empty(), "{missing:?}");
    // Served with samples, not only declared: the file's backfill timed its
    // object-store calls, and its create its FUSE operation and transactions.
    for (name, label) in [
        ("converged_object_store_seconds", ""),
        ("converged_fuse_op_seconds", "op=\"create\""),
        ("converged_meta_txn_seconds", ""),
    ] {
        eventually(30, &format!("{name}{{{label}}} has samples"), || {
            histogram_count(&scrape(&addr), name, label) > 0.0
        });
    }
}

#[test]
fn a_mount_point_left_dead_by_a_killed_daemon_mounts_again() {
    let mut m = Mount::new();
    let f = fs::File::create(m.path("f")).unwrap();
    std::io::Write::write_all(&mut &f, b"kept").unwrap();
    f.sync_all().unwrap();
    drop(f);
    // Supervisor and daemon both: the node died.
    common::kill_node(&m.data);
    assert!(is_mounted(&m.mnt), "the dead mount stays in the mount table");
    // What a restarting service unit does: mount again on the same point.
    m.mount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
}

#[test]
fn under_systemd_the_daemon_reports_ready_and_stops_cleanly_on_sigterm() {
    use std::os::unix::net::UnixDatagram;
    let (t, data, mnt) = dirs();
    let sock_path = t.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // What the unit runs: the daemon in the foreground, as systemd's child.
    let mut daemon = converged()
        .arg("mount")
        .arg("--foreground")
        .arg(&mnt)
        .arg("--data-dir")
        .arg(&data)
        .env("NOTIFY_SOCKET", &sock_path)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).expect("no READY=1 within 30 s");
    assert_eq!(&buf[..n], b"READY=1");
    assert!(is_mounted(&mnt), "READY=1 came before the mount");
    fs::write(mnt.join("f"), b"under systemd").unwrap();
    // systemctl stop: SIGTERM to the main process.
    // SAFETY: kill(2) of our child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let n = sock.recv(&mut buf).expect("no STOPPING=1 after SIGTERM");
    assert_eq!(&buf[..n], b"STOPPING=1");
    let status = daemon.wait().unwrap();
    assert!(status.success(), "the daemon exited with {status} on SIGTERM");
    assert!(!is_mounted(&mnt), "still mounted after a clean stop");
    // Clean: the next start finds everything in place.
    let out = converged().arg("mount").arg(&mnt).arg("--data-dir").arg(&data).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"under systemd");
    stop_mount(&mnt);
}
