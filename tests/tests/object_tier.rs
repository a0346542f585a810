//! The object tier against a real S3-compatible server on 127.0.0.1 (moto,
//! from PyPI, started here): backfill, re-keying, deletion, import, eviction
//! and an outage of the store. What converged wrote is read back with boto3,
//! not with converged's own client.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::s3::S3Server;
use common::*;

/// Mount options for a store in `bucket` under `prefix`.
fn tier_args(s3: &S3Server, bucket: &str, prefix: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "--object-store".into(),
        format!("s3://{bucket}/{prefix}"),
        "--s3-endpoint".into(),
        s3.endpoint(),
        "--backfill-delay".into(),
        "300ms".into(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn mount(args: &[String]) -> Mount {
    // The daemon takes S3 credentials from the environment, as a user's would.
    std::env::set_var("AWS_ACCESS_KEY_ID", "test");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Mount::with_args(&refs)
}

fn xattr(p: &Path, name: &str) -> String {
    let out = Command::new("getfattr").args(["--only-values", "-n", name]).arg(p).output().expect("getfattr");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn tier(p: &Path) -> String {
    xattr(p, "user.converged.tier")
}

/// Wait until `f` holds, up to `secs`.
fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a == b
}

#[test]
fn backfill_uploads_each_file_as_one_object_and_follows_renames_and_unlinks() {
    let Some(s3) = S3Server::start() else { return };
    s3.client().mkbucket("ckpt");
    let m = mount(&tier_args(&s3, "ckpt", "run1", &[]));
    fs::create_dir_all(m.path("step100")).unwrap();
    // Over the 16 MiB part size: a multipart upload.
    let big = pattern(40 << 20, 1);
    fs::write(m.path("step100/model.pt"), &big).unwrap();
    fs::write(m.path("step100/meta.json"), b"{\"step\": 100}\n").unwrap();
    fs::File::create(m.path("empty")).unwrap();
    // Over 1024 bytes with the names joined: no S3 key can hold it.
    let deep: Vec<String> = (0..5).map(|i| format!("{i}{}", "x".repeat(240))).collect();
    fs::create_dir_all(m.path(&deep[..4].join("/"))).unwrap();
    fs::write(m.path(&deep.join("/")), b"deep").unwrap();
    for f in ["step100/model.pt", "step100/meta.json", "empty"] {
        eventually(60, &format!("{f} is backed"), || tier(&m.path(f)).starts_with("state=backed"));
    }
    std::thread::sleep(Duration::from_secs(1));
    let t = tier(&m.path(&deep.join("/")));
    assert!(t.starts_with("state=dirty"), "a path too long for a key stays local: {t}");
    assert_eq!(backfill_stat(&m, "failures"), 0.0, "an over-long path is not a store failure");
    fs::remove_dir_all(m.path(&deep[0])).unwrap();
    assert!(same(&s3.client().get("ckpt", "run1/step100/model.pt").expect("object"), &big));
    assert_eq!(s3.client().get("ckpt", "run1/step100/meta.json").unwrap(), b"{\"step\": 100}\n");
    assert_eq!(s3.client().get("ckpt", "run1/empty").unwrap(), b"");
    let t = tier(&m.path("step100/model.pt"));
    assert!(t.contains("etag="), "the ETag is kept: {t}");
    let status = converged().arg("status").arg(m.path("step100/model.pt")).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("object=s3://ckpt/run1/step100/model.pt"), "{status}");

    // An overwrite is uploaded again, and the object follows.
    let v2 = pattern(20 << 20, 2);
    fs::write(m.path("step100/model.pt"), &v2).unwrap();
    eventually(60, "the new version is backed", || {
        s3.client().get("ckpt", "run1/step100/model.pt").is_some_and(|o| same(&o, &v2))
    });

    // Rename: the namespace changes at once, the object moves in the background.
    fs::rename(m.path("step100/meta.json"), m.path("step100/meta-final.json")).unwrap();
    assert!(m.path("step100/meta-final.json").exists());
    eventually(60, "the object is re-keyed", || {
        s3.client().list("ckpt", "run1/step100/") == vec!["run1/step100/meta-final.json", "run1/step100/model.pt"]
    });
    // A directory rename re-keys every backed file below it.
    fs::rename(m.path("step100"), m.path("final")).unwrap();
    eventually(60, "the directory is re-keyed", || {
        s3.client().list("ckpt", "run1/") == vec!["run1/empty", "run1/final/meta-final.json", "run1/final/model.pt"]
    });
    assert!(same(&s3.client().get("ckpt", "run1/final/model.pt").unwrap(), &v2));

    // Unlink deletes the object.
    fs::remove_file(m.path("final/meta-final.json")).unwrap();
    eventually(60, "the object of the removed file is gone", || {
        s3.client().get("ckpt", "run1/final/meta-final.json").is_none()
    });
    assert!(s3.client().get("ckpt", "run1/final/model.pt").is_some(), "other objects stay");

    // torch.save over a backed checkpoint: a tmp file renamed over it. The
    // replaced file's object key now belongs to the renamed file, whose
    // bytes it must end up holding (not deleted as the replaced file's).
    let v3 = pattern(3 << 20, 3);
    fs::write(m.path("final/model.pt.tmp"), &v3).unwrap();
    fs::rename(m.path("final/model.pt.tmp"), m.path("final/model.pt")).unwrap();
    eventually(60, "the renamed checkpoint is backed", || {
        tier(&m.path("final/model.pt")).starts_with("state=backed")
            && s3.client().get("ckpt", "run1/final/model.pt").is_some_and(|o| same(&o, &v3))
    });
    std::thread::sleep(Duration::from_secs(3));
    let o = s3.client().get("ckpt", "run1/final/model.pt").expect("the object stays");
    assert!(same(&o, &v3));
    assert!(s3.client().get("ckpt", "run1/final/model.pt.tmp").is_none());
}

#[test]
fn import_shows_a_bucket_as_files_and_skips_keys_that_are_not_names() {
    let Some(s3) = S3Server::start() else { return };
    s3.client().mkbucket("datasets");
    s3.client().mkbucket("scratch");
    let shard0 = pattern(3 << 20, 10);
    let shard1 = pattern(100_000, 11);
    s3.client().put("datasets", "c4/train/shard-0000.bin", &shard0);
    s3.client().put("datasets", "c4/train/shard-0001.bin", &shard1);
    s3.client().put("datasets", "c4/README", b"c4 subset\n");
    s3.client().put("datasets", "c4/bad/../escape", b"no");
    let long = format!("c4/{}", "n".repeat(300));
    s3.client().put("datasets", &long, b"too long");
    s3.client().put("datasets", "other/unrelated", b"outside the prefix");
    let m = mount(&tier_args(&s3, "scratch", "vol", &[]));

    let out = converged()
        .args(["import", "s3://datasets/c4"])
        .arg(m.path("c4"))
        .args(["--s3-endpoint", &s3.endpoint()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("c4/bad/../") && stderr.contains(&long), "invalid keys are reported: {stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("3 objects"), "{}", String::from_utf8_lossy(&out.stdout));

    let mut names: Vec<String> =
        fs::read_dir(m.path("c4")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["README", "bad", "train"]);
    assert!(fs::read_dir(m.path("c4/bad")).unwrap().next().is_none(), "`..` is not followed");
    assert_eq!(fs::metadata(m.path("c4/train/shard-0000.bin")).unwrap().len(), shard0.len() as u64);
    // Nothing was copied: the bytes are fetched when read.
    assert!(tier(&m.path("c4/train/shard-0000.bin")).contains("local=0"));
    // Data loader workers open one shard several times: a handle opened while
    // the first (served by the daemon as it fetches) is still open reads too.
    let first = fs::File::open(m.path("c4/train/shard-0000.bin")).unwrap();
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut &first, &mut got).unwrap();
    assert!(same(&got, &shard0));
    let again = fs::read(m.path("c4/train/shard-0000.bin")).expect("a second open beside the first");
    assert!(same(&again, &shard0));
    drop(first);
    assert!(same(&fs::read(m.path("c4/train/shard-0000.bin")).unwrap(), &shard0));
    assert!(same(&fs::read(m.path("c4/train/shard-0001.bin")).unwrap(), &shard1));
    assert_eq!(fs::read(m.path("c4/README")).unwrap(), b"c4 subset\n");
    assert!(tier(&m.path("c4/train/shard-0000.bin")).contains("local=1"), "hydrated on read");
    // Read again from the SSD, with the page cache dropped.
    drop_caches();
    assert!(same(&fs::read(m.path("c4/train/shard-0000.bin")).unwrap(), &shard0));

    // A file read whole is served from the SSD as it was listed, even
    // after its object is replaced: old bytes, whole, never a mix.
    s3.client().put("datasets", "c4/train/shard-0001.bin", &pattern(150_000, 12));
    drop_caches();
    assert!(same(&fs::read(m.path("c4/train/shard-0001.bin")).unwrap(), &shard1));

    // A bad source or a target off converged is refused with the reason.
    let out = converged().args(["import", "s3:///c4"]).arg(m.path("x")).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no bucket name"));
    let elsewhere = tempfile::tempdir().unwrap();
    let out = converged()
        .args(["import", "s3://datasets/c4", "--no-scan"])
        .arg(elsewhere.path())
        .args(["--s3-endpoint", &s3.endpoint()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("not on a converged mount"), "{stderr}");

    // Only root may import: the daemon's credentials read the bucket.
    let open = m.path("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "setfattr", "-n", "user.converged.import"])
        .args(["-v", "s3://datasets/c4"])
        .arg(&open)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not permitted"), "{}", String::from_utf8_lossy(&out.stderr));

    // Staging an imported tree fetches what is not local yet.
    let out = converged().arg("stage").arg(m.path("c4")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(tier(&m.path("c4/README")).contains("local=1"));
}

#[test]
fn an_imported_object_changed_in_its_bucket_is_refreshed_not_mixed() {
    let Some(s3) = S3Server::start() else { return };
    s3.client().mkbucket("src");
    s3.client().mkbucket("home");
    s3.client().put("src", "d/a.bin", &pattern(200_000, 20));
    let m = mount(&tier_args(&s3, "home", "", &[]));
    let out =
        converged().args(["import", "s3://src/d"]).arg(m.path("d")).args(["--s3-endpoint", &s3.endpoint()]).output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::metadata(m.path("d/a.bin")).unwrap().len(), 200_000);
    let newer = pattern(300_000, 21);
    s3.client().put("src", "d/a.bin", &newer);
    drop_caches();
    assert!(same(&fs::read(m.path("d/a.bin")).unwrap(), &newer), "the new object, whole");
    assert!(m.log().contains("imported object changed in its bucket"), "the change is logged");
}

#[test]
fn a_full_data_disk_evicts_backed_chunks_and_reads_fetch_them_back() {
    let Some(s3) = S3Server::start() else { return };
    s3.client().mkbucket("evict");
    // A small data disk of its own, so the watermarks mean something.
    let disk = SmallDisk::new("160m");
    let mnt = disk.mount(&tier_args(&s3, "evict", "v", &["--evict-high", "50", "--evict-low", "30"]));
    let root = disk.dir.path();

    let files: Vec<(PathBuf, Vec<u8>)> =
        (0..8).map(|i| (mnt.join(format!("shard{i}")), pattern(15 << 20, 30 + i))).collect();
    for (p, data) in &files {
        fs::write(p, data).unwrap();
    }
    // 120 MiB on a 160 MiB disk: over the high watermark once backed.
    eventually(90, "some chunks are evicted", || files.iter().any(|(p, _)| tier(p).contains("local=0")));
    let usage = || {
        let st = nix_statvfs(&root.join("data"));
        1.0 - st.0 as f64 / st.1 as f64
    };
    eventually(30, "usage is down to the low watermark", || usage() <= 0.5);
    drop_caches();
    for (p, data) in &files {
        assert!(same(&fs::read(p).unwrap(), data), "{} reads back", p.display());
    }
    let b = xattr(&mnt, "user.converged.backfill");
    assert!(!b.contains("evicted_bytes=0 "), "{b}");
}

/// A tmpfs of its own holding a data dir and a mount point; unmounted on drop.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn new(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let c = cstr(dir.path());
        let fstype = std::ffi::CString::new("tmpfs").unwrap();
        let opts = std::ffi::CString::new(format!("size={size}")).unwrap();
        // SAFETY: mount(2) with valid C strings.
        let rc = unsafe { libc::mount(fstype.as_ptr(), c.as_ptr(), fstype.as_ptr(), 0, opts.as_ptr().cast()) };
        assert_eq!(rc, 0, "mount tmpfs: errno {}", errno());
        fs::create_dir(dir.path().join("data")).unwrap();
        fs::create_dir(dir.path().join("mnt")).unwrap();
        SmallDisk { dir }
    }

    /// Mount converged with its data dir on this disk; returns the mount point.
    fn mount(&self, args: &[String]) -> PathBuf {
        std::env::set_var("AWS_ACCESS_KEY_ID", "test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
        let mnt = self.dir.path().join("mnt");
        let out = converged()
            .arg("mount")
            .arg(&mnt)
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        mnt
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let mnt = self.dir.path().join("mnt");
        let _ = converged().arg("umount").arg(&mnt).output();
        lazy_umount(&mnt);
        lazy_umount(self.dir.path());
    }
}

/// In both I/O modes: with kernel passthrough (the default), a writer
/// opened on a nearly full disk goes through the daemon, so its writes too
/// can evict and retry; a reader opened beside it is not refused.
#[test]
fn a_write_that_finds_the_data_disk_full_evicts_instead_of_failing() {
    let Some(s3) = S3Server::start() else { return };
    s3.client().mkbucket("full");
    for (i, mode) in [&["--verify-reads"][..], &[][..]].into_iter().enumerate() {
        let disk = SmallDisk::new("160m");
        // A high watermark the background evictor never sees before the disk is full.
        let mut extra = vec!["--evict-high", "99", "--evict-low", "40"];
        extra.extend_from_slice(mode);
        let args = tier_args(&s3, "full", &format!("m{i}"), &extra);
        let mnt = disk.mount(&args);
        let old: Vec<(PathBuf, Vec<u8>)> =
            (0..4).map(|i| (mnt.join(format!("old{i}")), pattern(30 << 20, 60 + i))).collect();
        for (p, data) in &old {
            fs::write(p, data).unwrap();
        }
        for (p, _) in &old {
            eventually(60, "the old files are backed", || tier(p).starts_with("state=backed"));
        }
        // 120 MiB are on the 160 MiB disk: 60 more do not fit without eviction.
        let new = pattern(60 << 20, 70);
        let mut w = fs::File::create(mnt.join("new")).unwrap();
        w.write_all(&new).unwrap_or_else(|e| panic!("{mode:?}: a full disk of backed data makes room: {e}"));
        let beside = fs::read(mnt.join("new")).unwrap_or_else(|e| panic!("{mode:?}: a reader beside the writer: {e}"));
        assert!(same(&beside, &new), "{mode:?}");
        drop(w);
        assert!(same(&fs::read(mnt.join("new")).unwrap(), &new));
        for (p, data) in &old {
            assert!(same(&fs::read(p).unwrap(), data), "{mode:?}: {} reads back", p.display());
        }
    }
}

/// (available blocks, total blocks) of the filesystem holding `p`.
fn nix_statvfs(p: &Path) -> (u64, u64) {
    let c = cstr(p);
    // SAFETY: statvfs into a zeroed struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    (st.f_bavail, st.f_blocks)
}

#[test]
fn an_object_store_outage_keeps_the_backlog_and_drains_it_when_the_store_returns() {
    let Some(mut s3) = S3Server::start() else { return };
    s3.client().mkbucket("outage");
    let port = common::etcd_cluster::free_port();
    let metrics = format!("127.0.0.1:{port}");
    let m = mount(&tier_args(&s3, "outage", "p", &["--metrics", &metrics]));
    let big = pattern(48 << 20, 40);
    fs::write(m.path("big.bin"), &big).unwrap();
    // The store goes away in the middle of the upload.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !tier(&m.path("big.bin")).starts_with("state=uploading") {
        assert!(Instant::now() < deadline, "the upload never started: {}", tier(&m.path("big.bin")));
        std::thread::sleep(Duration::from_millis(10));
    }
    s3.stop();
    // Foreground I/O goes on.
    let mut written = vec![("big.bin".to_string(), big)];
    for i in 0..5 {
        let data = pattern(1 << 20, 41 + i);
        fs::write(m.path(&format!("during-{i}")), &data).unwrap();
        written.push((format!("during-{i}"), data));
    }
    for (name, data) in &written {
        assert!(same(&fs::read(m.path(name)).unwrap(), data));
    }
    // The backlog and the failures show in status and in the metrics.
    eventually(60, "the failures show", || {
        let b = xattr(&m.mnt, "user.converged.backfill");
        b.contains("last_error=") && !b.contains("backlog_files=0 ")
    });
    let text = scrape(&metrics);
    assert!(metric(&text, "converged_backfill_failures_total").unwrap_or(0.0) >= 1.0, "{text}");
    assert!(metric(&text, "converged_backfill_backlog_files").unwrap_or(0.0) >= 1.0, "{text}");
    // The file is not backed: dirty between attempts, uploading while a
    // worker's attempt against the absent store is in flight.
    let status = converged().arg("status").arg(m.path("during-0")).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        (status.contains("state=dirty") || status.contains("state=uploading")) && status.contains("last_error="),
        "{status}"
    );

    // The store comes back (empty: moto keeps objects in memory) and the backlog drains.
    s3.restart();
    s3.client().mkbucket("outage");
    for (name, _) in &written {
        eventually(120, &format!("{name} is backed"), || tier(&m.path(name)).starts_with("state=backed"));
    }
    for (name, data) in &written {
        let got = s3.client().get("outage", &format!("p/{name}")).unwrap_or_else(|| panic!("{name} has no object"));
        assert!(same(&got, data), "{name}: the object has the file's bytes");
    }
    let text = scrape(&metrics);
    assert_eq!(metric(&text, "converged_backfill_backlog_files"), Some(0.0), "{text}");
    // The daemon's own figures: every file written was opened and sealed.
    let opens: f64 = ["converged_opens_passthrough_total", "converged_opens_daemon_total"]
        .iter()
        .filter_map(|n| metric(&text, n))
        .sum();
    assert!(opens >= written.len() as f64, "{text}");
    assert!(metric(&text, "converged_seals_total").unwrap_or(0.0) >= written.len() as f64, "{text}");
    assert!(metric(&text, "converged_data_disk_bytes").unwrap_or(0.0) > 0.0, "{text}");
}

fn backfill_stat(m: &Mount, field: &str) -> f64 {
    let line = xattr(&m.mnt, "user.converged.backfill");
    let at = format!("{field}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&at))
        .map_or(0.0, |v| v.trim_end_matches('s').parse().unwrap_or(0.0))
}

/// The embedded default store (`file://`). A directory renamed while
/// the store fails, followed by a crash before its files were re-keyed, is
/// walked at the next mount and every object moves.
#[test]
fn a_directory_rename_cut_short_by_a_crash_is_re_keyed_at_the_next_mount() {
    let store = tempfile::tempdir().unwrap();
    let args: Vec<String> = vec![
        "--object-store".into(),
        format!("file://{}", store.path().display()),
        "--backfill-delay".into(),
        "300ms".into(),
    ];
    let mut m = mount(&args);
    fs::create_dir_all(m.path("run/step1")).unwrap();
    let a = pattern(3 << 20, 60);
    let b = pattern(1000, 61);
    fs::write(m.path("run/step1/a.pt"), &a).unwrap();
    fs::write(m.path("run/b.json"), &b).unwrap();
    for f in ["run/step1/a.pt", "run/b.json"] {
        eventually(60, &format!("{f} is backed"), || tier(&m.path(f)).starts_with("state=backed"));
    }
    assert!(same(&fs::read(store.path().join("run/step1/a.pt")).unwrap(), &a));
    assert_eq!(fs::read(store.path().join("run/b.json")).unwrap(), b);

    // The store starts failing (a file where a directory must go), and the backlog backs off.
    fs::write(store.path().join("blocker"), b"").unwrap();
    fs::create_dir(m.path("blocker")).unwrap();
    fs::write(m.path("blocker/f"), b"f").unwrap();
    eventually(60, "the backlog backs off for 2 s or more", || backfill_stat(&m, "retry_in") >= 2.0);
    fs::rename(m.path("run"), m.path("final")).unwrap();
    fs::File::open(&m.mnt).unwrap().sync_all().unwrap();
    let t = tier(&m.path("final/step1/a.pt"));
    assert!(t.starts_with("state=backed") && t.contains("/run/step1/a.pt"), "not re-keyed yet: {t}");
    m.crash();

    fs::remove_file(store.path().join("blocker")).unwrap();
    m.mount();
    eventually(60, "the renamed directory's objects moved", || {
        store.path().join("final/step1/a.pt").exists()
            && store.path().join("final/b.json").exists()
            && !store.path().join("run/step1/a.pt").exists()
            && !store.path().join("run/b.json").exists()
    });
    assert!(same(&fs::read(store.path().join("final/step1/a.pt")).unwrap(), &a));
    assert_eq!(fs::read(store.path().join("final/b.json")).unwrap(), b);
    eventually(60, "the blocked file is backed", || tier(&m.path("blocker/f")).starts_with("state=backed"));
    for f in ["final/step1/a.pt", "final/b.json"] {
        assert!(tier(&m.path(f)).starts_with("state=backed"), "{f}: {}", tier(&m.path(f)));
    }
}

/// `az://` against Azurite (Azure Blob Storage's emulator, from npm) on
/// 127.0.0.1, checked with azure-storage-blob: backfill (a block upload in
/// parts for the large file), re-key on rename, delete on unlink, and an
/// import of a container read back through the mount.
#[test]
fn azure_blob_storage_backfills_renames_deletes_and_imports() {
    let Some(az) = common::azure::AzureServer::start() else { return };
    az.client().mkbucket("vol");
    az.client().mkbucket("datasets");
    let shard = pattern(5 << 20, 80);
    az.client().put("datasets", "c4/train/shard-0.bin", &shard);
    az.client().put("datasets", "c4/README", b"c4 subset\n");
    let args: Vec<String> =
        ["--object-store", "az://vol/run", "--backfill-delay", "300ms"].iter().map(|s| s.to_string()).collect();
    let m = mount(&args);
    let big = pattern(40 << 20, 81);
    fs::write(m.path("model.pt"), &big).unwrap();
    fs::write(m.path("meta.json"), b"{\"step\": 1}\n").unwrap();
    for f in ["model.pt", "meta.json"] {
        eventually(60, &format!("{f} is backed"), || tier(&m.path(f)).starts_with("state=backed"));
    }
    assert!(same(&az.client().get("vol", "run/model.pt").expect("blob"), &big));
    assert_eq!(az.client().get("vol", "run/meta.json").unwrap(), b"{\"step\": 1}\n");

    fs::rename(m.path("meta.json"), m.path("meta-final.json")).unwrap();
    eventually(60, "the blob is re-keyed", || {
        az.client().list("vol", "run/") == vec!["run/meta-final.json", "run/model.pt"]
    });
    fs::remove_file(m.path("model.pt")).unwrap();
    eventually(60, "the blob of the removed file is gone", || az.client().get("vol", "run/model.pt").is_none());

    let out = converged().args(["import", "az://datasets/c4"]).arg(m.path("c4")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::read(m.path("c4/README")).unwrap(), b"c4 subset\n");
    let p = m.path("c4/train/shard-0.bin");
    assert!(tier(&p).contains("local=0"), "{}", tier(&p));
    assert!(same(&fs::read(&p).unwrap(), &shard));
    assert!(tier(&p).contains("local=1"), "read once, hydrated: {}", tier(&p));
}

/// Renaming an imported file that was never read keeps it reading as its
/// source object, and its object in the mount's store (the copy its rename
/// asks for) holds the source's bytes; the source is left alone.
#[test]
fn a_renamed_imported_file_keeps_its_bytes_and_its_object_gets_them() {
    let Some(s3) = S3Server::start() else { return };
    s3.client().mkbucket("datasets");
    s3.client().mkbucket("scratch");
    // Over the 16 MiB part size: the copy into the mount's store is a multipart upload.
    let a = pattern(40 << 20, 50);
    let b = pattern(3 << 20, 51);
    s3.client().put("datasets", "ds/a.bin", &a);
    s3.client().put("datasets", "ds/sub/b.bin", &b);
    let m = mount(&tier_args(&s3, "scratch", "vol", &[]));
    let out = converged()
        .args(["import", "s3://datasets/ds"])
        .arg(m.path("ds"))
        .args(["--s3-endpoint", &s3.endpoint()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Neither file is read before it is renamed (a directory rename for
    // one, listed first: a directory of an import lists its keys when first
    // read, and only files already listed move with it).
    assert_eq!(fs::read_dir(m.path("ds/sub")).unwrap().count(), 1);
    assert!(tier(&m.path("ds/a.bin")).contains("local=0"));
    assert!(tier(&m.path("ds/sub/b.bin")).contains("local=0"));
    fs::rename(m.path("ds/a.bin"), m.path("a.bin")).unwrap();
    fs::rename(m.path("ds/sub"), m.path("moved")).unwrap();
    drop_caches();
    assert!(same(&fs::read(m.path("a.bin")).unwrap(), &a), "a.bin reads as its source object");
    eventually(90, "a.bin's object is in the mount's store", || {
        s3.client().get("scratch", "vol/a.bin").is_some_and(|o| same(&o, &a))
    });
    eventually(90, "b.bin's object is in the mount's store", || {
        s3.client().get("scratch", "vol/moved/b.bin").is_some_and(|o| same(&o, &b))
    });
    eventually(30, "a.bin is backed by its own object", || {
        let t = tier(&m.path("a.bin"));
        t.starts_with("state=backed") && t.contains("object=s3://scratch/vol/a.bin")
    });
    assert!(same(&s3.client().get("datasets", "ds/a.bin").unwrap(), &a), "the source is untouched");
    drop_caches();
    assert!(same(&fs::read(m.path("a.bin")).unwrap(), &a));
    assert!(same(&fs::read(m.path("moved/b.bin")).unwrap(), &b));
}

/// Checkpoint rotation (`mv latest prev`, then a new `latest`) while the
/// store is cut off, so that the old file's re-key and the new file's
/// upload race for the key `latest` when it returns; then a second
/// rotation, with the store up; then eviction. Every file reads its
/// bytes, and every object holds its file's bytes. Objects are re-keyed
/// by uploads here (a copy limit below the files' size).
#[test]
fn checkpoint_rotation_with_a_lagging_backfill_and_eviction_keeps_files_and_objects() {
    let Some(s3) = S3Server::start() else { return };
    s3.client().mkbucket("rot");
    let target: std::net::SocketAddr = s3.endpoint().trim_start_matches("http://").parse().unwrap();
    let proxy = common::proxy::Proxy::start(target);
    let disk = SmallDisk::new("192m");
    let mut args =
        tier_args(&s3, "rot", "run", &["--evict-high", "60", "--evict-low", "40", "--object-copy-limit", "16M"]);
    args[3] = proxy.endpoint();
    let mnt = disk.mount(&args);
    let (v1, v2, v3) = (pattern(40 << 20, 60), pattern(36 << 20, 61), pattern(30 << 20, 62));
    fs::write(mnt.join("latest"), &v1).unwrap();
    eventually(90, "v1 is backed", || tier(&mnt.join("latest")).starts_with("state=backed"));

    proxy.cut();
    fs::rename(mnt.join("latest"), mnt.join("prev")).unwrap();
    fs::write(mnt.join("latest"), &v2).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    proxy.restore();
    eventually(120, "both files are backed after the outage", || {
        tier(&mnt.join("prev")).starts_with("state=backed") && tier(&mnt.join("latest")).starts_with("state=backed")
    });
    assert!(same(&s3.client().get("rot", "run/prev").expect("prev's object"), &v1), "prev's object is v1");
    assert!(same(&s3.client().get("rot", "run/latest").expect("latest's object"), &v2), "latest's object is v2");

    // The next rotation, store up: v1 goes, v2 becomes prev.
    fs::rename(mnt.join("latest"), mnt.join("prev")).unwrap();
    fs::write(mnt.join("latest"), &v3).unwrap();
    eventually(120, "the second rotation is backed", || {
        s3.client().get("rot", "run/prev").is_some_and(|o| same(&o, &v2))
            && s3.client().get("rot", "run/latest").is_some_and(|o| same(&o, &v3))
            && tier(&mnt.join("prev")).starts_with("state=backed")
            && tier(&mnt.join("latest")).starts_with("state=backed")
    });
    // 66 MiB of a 192 MiB disk is over the 60 % mark with the metadata: a filler pushes it.
    fs::write(mnt.join("filler"), pattern(60 << 20, 63)).unwrap();
    eventually(90, "chunks of the checkpoints are evicted", || {
        ["prev", "latest"].iter().any(|f| tier(&mnt.join(f)).contains("local=0"))
    });
    drop_caches();
    assert!(same(&fs::read(mnt.join("prev")).unwrap(), &v2), "prev reads v2");
    assert!(same(&fs::read(mnt.join("latest")).unwrap(), &v3), "latest reads v3");
    let keys = s3.client().list("rot", "run/");
    assert!(
        keys.iter().all(|k| ["run/filler", "run/latest", "run/prev"].contains(&k.as_str())),
        "no stray object: {keys:?}"
    );
}
