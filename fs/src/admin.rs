//! Admin commands that work through a mount: `import`, `stage` and
//! `status PATH`. They talk to the daemon with extended attributes
//! (`user.converged.*`), so they work the same on any node of a cluster and
//! need nothing but the mount.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use anyhow::{bail, Context};
use clap::Args;
use converged_metadata::types::{
    BACKFILL_XATTR, IMPORT_XATTR, LAYOUT_XATTR, SCRUB_XATTR, STAGE_XATTR, STATS_XATTR, TIER_XATTR, WORKERS_XATTR,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::core::import::invalid_key;
use crate::objects::{Location, ObjectTier, StoreOptions};

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Where the objects are: `s3://bucket/prefix`, `gs://…`, `az://…`.
    pub source: String,
    /// A directory on a converged mount (created if missing) to show them under.
    pub dir: PathBuf,
    /// S3-compatible endpoint (path-style), as for `mount --s3-endpoint`; the daemon uses its own.
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// Do not list the source here first (no count, no report of skipped keys).
    #[arg(long)]
    pub no_scan: bool,
}

#[derive(Args, Debug)]
pub struct StageArgs {
    /// A file or directory on a converged mount; directories are staged whole.
    pub path: PathBuf,
    /// Copies of each chunk on the SSDs of the cluster when done.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub replicas: u32,
    /// Files staged at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub jobs: u16,
}

fn cpath(p: &Path) -> anyhow::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).context("path has a NUL byte")
}

fn set_xattr(p: &Path, name: &[u8], value: &[u8]) -> std::io::Result<()> {
    let c = cpath(p).map_err(std::io::Error::other)?;
    let n = CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: valid C strings and a buffer of the given length.
    let rc = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn get_xattr(p: &Path, name: &[u8]) -> std::io::Result<String> {
    let c = cpath(p).map_err(std::io::Error::other)?;
    let n = CString::new(name).map_err(std::io::Error::other)?;
    let mut buf = vec![0u8; 64 << 10];
    // SAFETY: valid C strings and a buffer of the given length.
    let rc = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(rc as usize);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Fail unless `p` exists and lies on a converged mount (by the type of
/// the innermost mount holding it, `fuse.converged`).
fn on_converged(p: &Path) -> anyhow::Result<()> {
    let abs = p.canonicalize().with_context(|| format!("{} does not exist", p.display()))?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
    let mut best: Option<(usize, bool)> = None;
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else { continue };
        if fields.len() < 5 || fields.len() < sep + 2 {
            continue;
        }
        let mp = crate::config::unescape_mountinfo(fields[4]);
        if abs.starts_with(&mp) && best.is_none_or(|(len, _)| mp.len() >= len) {
            best = Some((mp.len(), fields[sep + 1] == "fuse.converged"));
        }
    }
    match best {
        Some((_, true)) => Ok(()),
        _ => bail!("{} is not on a converged mount", p.display()),
    }
}

/// `converged import URL DIR`.
pub fn import(a: ImportArgs) -> anyhow::Result<()> {
    let loc = Location::parse(&a.source)?;
    if loc.base.starts_with("file://") {
        bail!("import reads buckets (s3://, gs://, az://); {} is a local directory", a.source);
    }
    if !a.no_scan {
        let tier = ObjectTier::open(&a.source, StoreOptions { s3_endpoint: a.s3_endpoint.clone() })?;
        let (objects, bytes, skipped) = scan(&tier, &loc)?;
        for (key, why) in &skipped {
            eprintln!("skipped {key:?}: {why}");
        }
        println!(
            "{}: {objects} objects, {:.1} GiB; {} keys skipped (not valid POSIX names)",
            loc.url(),
            bytes as f64 / (1u64 << 30) as f64,
            skipped.len()
        );
    }
    std::fs::create_dir_all(&a.dir).with_context(|| format!("create {}", a.dir.display()))?;
    on_converged(&a.dir)?;
    set_xattr(&a.dir, IMPORT_XATTR, loc.url().as_bytes()).with_context(|| {
        format!("import into {} (see the daemon's log: is the mount started with --object-store?)", a.dir.display())
    })?;
    println!("{} now shows {} (listed on first access; bytes fetched when read)", a.dir.display(), loc.url());
    Ok(())
}

/// Keys skipped by an import, with the reason.
type Skipped = Vec<(String, &'static str)>;

/// Every key under `loc`: (objects, bytes, keys skipped).
fn scan(tier: &ObjectTier, loc: &Location) -> anyhow::Result<(u64, u64, Skipped)> {
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} listing {msg}").expect("valid template"));
    let root = if loc.prefix.is_empty() { String::new() } else { format!("{}/", loc.prefix) };
    let mut stack = vec![root.clone()];
    let (mut objects, mut bytes, mut skipped) = (0u64, 0u64, Vec::new());
    while let Some(prefix) = stack.pop() {
        bar.set_message(format!("{prefix} ({objects} objects)"));
        let l = tier.list_level(&loc.base, &prefix)?;
        for (key, size, ..) in l.objects {
            let rel = &key[root.len().min(key.len())..];
            // Directory marker objects (`dir/`) some tools write.
            if rel.is_empty() || key.ends_with('/') {
                continue;
            }
            match invalid_key(rel) {
                Some(why) => skipped.push((key, why)),
                None => {
                    objects += 1;
                    bytes += size;
                }
            }
        }
        for p in l.prefixes {
            let rel = &p[root.len().min(p.len())..];
            match invalid_key(rel) {
                Some(why) => skipped.push((p, why)),
                None => stack.push(p),
            }
        }
    }
    bar.finish_and_clear();
    Ok((objects, bytes, skipped))
}

/// Regular files under `p` (or `p` itself) with their sizes.
fn walk(p: &Path, out: &mut Vec<(PathBuf, u64)>) -> anyhow::Result<()> {
    let md = std::fs::symlink_metadata(p).with_context(|| format!("stat {}", p.display()))?;
    if md.is_file() {
        out.push((p.to_path_buf(), md.len()));
    } else if md.is_dir() {
        for e in std::fs::read_dir(p).with_context(|| format!("list {}", p.display()))? {
            walk(&e?.path(), out)?;
        }
    }
    Ok(())
}

/// A progress bar over `total` bytes of files.
fn bytes_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}")
            .expect("valid template"),
    );
    bar
}

/// `converged stage PATH`.
pub fn stage(a: StageArgs) -> anyhow::Result<()> {
    on_converged(&a.path)?;
    let mut files = Vec::new();
    walk(&a.path, &mut files)?;
    let total: u64 = files.iter().map(|f| f.1).sum();
    let bar = bytes_bar(total);
    let next = AtomicUsize::new(0);
    let failed = Mutex::new(Vec::new());
    let done = AtomicU64::new(0);
    let value = a.replicas.to_string();
    std::thread::scope(|s| {
        for _ in 0..a.jobs.min(files.len().max(1) as u16) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((path, size)) = files.get(i) else { return };
                if let Err(e) = set_xattr(path, STAGE_XATTR, value.as_bytes()) {
                    failed.lock().expect("not poisoned").push(format!("{}: {e}", path.display()));
                }
                done.fetch_add(1, Ordering::Relaxed);
                bar.inc(*size);
                bar.set_message(format!("{}/{} files", done.load(Ordering::Relaxed), files.len()));
            });
        }
    });
    bar.finish();
    let failed = failed.into_inner().expect("not poisoned");
    for f in &failed {
        eprintln!("not staged: {f}");
    }
    if !failed.is_empty() {
        bail!("{} of {} files not staged; run the same command again to resume", failed.len(), files.len());
    }
    println!(
        "staged {} files, {:.2} GiB, {} cop(ies) of each chunk",
        files.len(),
        total as f64 / (1u64 << 30) as f64,
        a.replicas
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct ScrubArgs {
    /// A file or directory on a converged mount.
    pub path: PathBuf,
    /// Check this node's copies of every file under PATH now (progress bar), repairing bad
    /// blocks from a replica or the object store; without it, show the background scrub.
    #[arg(long)]
    pub now: bool,
}

/// `converged scrub [--now] PATH`.
pub fn scrub(a: ScrubArgs) -> anyhow::Result<()> {
    on_converged(&a.path)?;
    if !a.now {
        let workers = get_xattr(&a.path, WORKERS_XATTR).unwrap_or_default();
        match workers.lines().find(|l| l.starts_with("scrub ")) {
            Some(line) => println!(
                "{line}\n(every copy on this node is checked once per --scrub-period; `scrub --now` checks now)"
            ),
            None => println!("no scrub worker on this node"),
        }
        return Ok(());
    }
    let mut files = Vec::new();
    walk(&a.path, &mut files)?;
    let total: u64 = files.iter().map(|f| f.1).sum();
    let bar = bytes_bar(total);
    let (mut bad, mut repaired, mut checked, mut failed) = (0u64, 0u64, 0u64, Vec::new());
    for (path, size) in &files {
        match get_xattr(path, SCRUB_XATTR) {
            Ok(found) => {
                let field = |k: &str| -> u64 {
                    found.split_whitespace().find_map(|f| f.strip_prefix(k)).and_then(|v| v.parse().ok()).unwrap_or(0)
                };
                checked += field("bytes=");
                let (b, r) = (field("bad_blocks="), field("repaired_blocks="));
                if b > 0 {
                    bar.println(format!("{}: {b} bad blocks, {r} repaired", path.display()));
                }
                bad += b;
                repaired += r;
            }
            Err(e) => failed.push(format!("{}: {e}", path.display())),
        }
        bar.inc(*size);
    }
    bar.finish();
    for f in &failed {
        eprintln!("not checked: {f}");
    }
    println!(
        "{} files, {:.2} GiB of local copies checked: {bad} bad blocks, {repaired} repaired",
        files.len(),
        checked as f64 / (1u64 << 30) as f64
    );
    if !failed.is_empty() || repaired < bad {
        bail!("{} bad blocks not repaired, {} files not checked", bad - repaired, failed.len());
    }
    Ok(())
}

/// `converged status PATH`.
pub fn status_path(p: &Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    on_converged(p)?;
    let tier = get_xattr(p, TIER_XATTR).with_context(|| p.display().to_string())?;
    let layout = get_xattr(p, LAYOUT_XATTR).unwrap_or_default();
    let backfill = match get_xattr(p, BACKFILL_XATTR) {
        Ok(b) => b,
        Err(e) if e.raw_os_error() == Some(libc::ENODATA) => "off (mounted without --object-store)\n".into(),
        Err(e) => bail!("{}: {e}", p.display()),
    };
    let mut text = format!("tier: {tier}");
    if !layout.is_empty() {
        text.push_str("chunks (index version bytes holders):\n");
        for line in layout.lines() {
            text.push_str(&format!("  {line}\n"));
        }
    }
    text.push_str(&format!("backfill (this node): {backfill}"));
    let workers = get_xattr(p, WORKERS_XATTR).unwrap_or_default();
    if !workers.is_empty() {
        text.push_str("workers (this node):\n");
        for line in workers.lines() {
            text.push_str(&format!("  {line}\n"));
        }
    }
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    Ok(())
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// A converged mount point (or any path on one): the daemon serving it is asked.
    pub path: PathBuf,
    /// Time between updates (`1s`, `500ms`).
    #[arg(long, default_value = "1s", value_name = "DURATION", value_parser = crate::config::parse_duration)]
    pub interval: std::time::Duration,
    /// Stop after this many updates [default: until interrupted].
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
}

/// `converged stats PATH`: a live view of the daemon's operations per
/// second and latency percentiles over each interval, by area (FUSE,
/// metadata, peers, object store), and its throughput.
pub fn stats(a: StatsArgs) -> anyhow::Result<()> {
    use crate::latency::{parse, Row};
    on_converged(&a.path)?;
    let read = || -> anyhow::Result<((u64, u64), Vec<Row>)> {
        let text =
            get_xattr(&a.path, STATS_XATTR).with_context(|| format!("read the statistics of {}", a.path.display()))?;
        parse(&text).map_err(|e| anyhow::anyhow!("the daemon's statistics: {e}"))
    };
    // SAFETY: isatty(2) on stdout.
    let live = unsafe { libc::isatty(1) } == 1;
    let interval = a.interval.max(std::time::Duration::from_millis(100));
    let mut before = read()?;
    let mut at = std::time::Instant::now();
    let mut shown = 0;
    while a.count.is_none_or(|n| shown < n) {
        std::thread::sleep(interval);
        let now = read()?;
        let secs = at.elapsed().as_secs_f64().max(1e-3);
        at = std::time::Instant::now();
        let mut out = String::new();
        if live {
            out.push_str("\x1b[2J\x1b[H");
        }
        out.push_str(&format!(
            "converged stats {} (every {:.1}s; latency percentiles in ms)\n",
            a.path.display(),
            interval.as_secs_f64()
        ));
        let mb = |now: u64, then: u64| now.saturating_sub(then) as f64 / secs / 1e6;
        out.push_str(&format!(
            "through the daemon: read {:.1} MB/s, write {:.1} MB/s (passthrough I/O bypasses it)\n",
            mb(now.0 .0, before.0 .0),
            mb(now.0 .1, before.0 .1)
        ));
        out.push_str(&format!(
            "{:<7} {:<14} {:>10} {:>9} {:>9} {:>9} {:>8}\n",
            "area", "operation", "ops/s", "avg", "p50", "p99", "meta/op"
        ));
        let mut rows: Vec<Row> = now
            .1
            .iter()
            .map(|r| r.since(before.1.iter().find(|b| b.area == r.area && b.op == r.op)))
            .filter(|r| r.count() > 0)
            .collect();
        rows.sort_by(|x, y| x.area.cmp(&y.area).then(y.count().cmp(&x.count())));
        let ms = |v: Option<f64>| match v {
            Some(v) if v.is_finite() => format!("{:.3}", v * 1e3),
            Some(_) => ">30000".to_string(),
            None => "-".to_string(),
        };
        for r in &rows {
            let avg = r.sum_ns as f64 / r.count() as f64 / 1e9;
            // Metadata round trips per FUSE operation (etcd requests; 0 on
            // the embedded engine).
            let trips = match r.area {
                crate::latency::Area::Fuse => format!("{:.2}", r.round_trips as f64 / r.count() as f64),
                _ => "-".to_string(),
            };
            out.push_str(&format!(
                "{:<7} {:<14} {:>10.1} {:>9} {:>9} {:>9} {:>8}\n",
                r.area.name(),
                r.op,
                r.count() as f64 / secs,
                ms(Some(avg)),
                ms(r.quantile(0.5)),
                ms(r.quantile(0.99)),
                trips
            ));
        }
        if rows.is_empty() {
            out.push_str("(idle)\n");
        }
        print!("{out}");
        std::io::Write::flush(&mut std::io::stdout())?;
        before = now;
        shown += 1;
    }
    Ok(())
}
