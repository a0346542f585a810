//! Shared helpers for the integration tests: start a real converged mount
//! through the kernel, find the built binaries, small syscall wrappers.
#![allow(dead_code)]

pub mod azure;
pub mod client;
pub mod cluster;
#[path = "../../../metadata/tests/etcd_cluster/mod.rs"]
pub mod etcd_cluster;
pub mod proxy;
pub mod s3;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A built binary of this workspace (`cargo build --workspace` first).
/// `CONVERGED_BIN_DIR` points the tests at binaries built elsewhere (for
/// example an older build, to see a new test fail on it).
pub fn bin(name: &str) -> PathBuf {
    let dir = match std::env::var_os("CONVERGED_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        // target/<profile>/deps/<test> -> target/<profile>/<name>
        None => {
            let exe = std::env::current_exe().expect("current exe");
            exe.parent().and_then(Path::parent).expect("target dir").to_path_buf()
        }
    };
    let p = dir.join(name);
    assert!(p.exists(), "{} is missing: run `cargo build --workspace` before the tests", p.display());
    p
}

/// mount(8) looks for helpers in /sbin. Point them at this build unless an
/// installed helper (outside a cargo target dir) is already there.
pub fn install_helpers() {
    let helper = bin("mount-converged");
    for name in ["/sbin/mount.converged", "/sbin/mount.fuse.converged"] {
        let current = std::fs::read_link(name).ok();
        if current.as_deref() == Some(helper.as_path()) {
            continue;
        }
        // A link into a cargo build (debug or release) is a test's; anything else was installed.
        let built =
            current.is_some_and(|c| c.components().any(|p| p.as_os_str() == "debug" || p.as_os_str() == "release"));
        if Path::new(name).exists() && !built {
            continue;
        }
        let _ = std::fs::remove_file(name);
        std::os::unix::fs::symlink(&helper, name).unwrap();
    }
}

pub fn converged() -> Command {
    Command::new(bin("converged"))
}

/// Abort the FUSE connection of the mount whose device is `dev`: every
/// request waiting on the daemon fails with ENOTCONN, so no process stays
/// stuck on the mount. Falls back to a forced unmount, which aborts it too.
pub fn abort_connection(dev: u64, mnt: &Path) -> String {
    let conns = Path::new("/sys/fs/fuse/connections");
    // The directory is named after the kernel's encoding of the device number.
    let conn = conns.join(((libc::major(dev) << 20) | libc::minor(dev)).to_string());
    if !conn.exists() {
        // fusectl is not mounted everywhere by default.
        let (none, fusectl, target) = (CString::new("none").unwrap(), CString::new("fusectl").unwrap(), cstr(conns));
        // SAFETY: mount(2) with valid C strings and no data.
        unsafe { libc::mount(none.as_ptr(), target.as_ptr(), fusectl.as_ptr(), 0, std::ptr::null()) };
    }
    match std::fs::write(conn.join("abort"), "1") {
        Ok(()) => format!("aborted FUSE connection {}", conn.display()),
        Err(e) => {
            // SAFETY: umount2 with a valid path; MNT_FORCE on FUSE aborts the connection.
            unsafe { libc::umount2(cstr(mnt).as_ptr(), libc::MNT_FORCE) };
            format!("could not write {}/abort ({e}): forced an unmount instead", conn.display())
        }
    }
}

/// A mounted converged filesystem in fresh temporary directories, unmounted on drop.
pub struct Mount {
    pub root: tempfile::TempDir,
    pub data: PathBuf,
    pub mnt: PathBuf,
    pub extra: Vec<String>,
    /// Set in the mount command's environment (fault switches).
    pub env: Vec<(String, String)>,
    mounted: bool,
}

impl Mount {
    pub fn new() -> Self {
        Self::with_args(&[])
    }

    pub fn with_args(extra: &[&str]) -> Self {
        Self::with_env(extra, &[])
    }

    /// Mounted with `extra` arguments and `env` in the daemon's environment.
    pub fn with_env(extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut m = Self::unmounted(extra, env);
        m.mount();
        m
    }

    /// Fresh directories for a mount with `extra` arguments and `env`, not
    /// mounted yet: [`Mount::mount`] or [`Mount::mount_by`] next.
    pub fn unmounted(extra: &[&str], env: &[(&str, &str)]) -> Self {
        let root = tempfile::Builder::new().prefix("converged-test").tempdir().expect("tempdir");
        let data = root.path().join("data");
        let mnt = root.path().join("mnt");
        std::fs::create_dir(&data).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        // The data dir is on the host's disk, whose fill is not the test's: a
        // host over the default 90 % would make the evictor drop the copies a
        // test is counting. Tests about eviction set their own watermarks, on
        // a disk of their own (object_tier's SmallDisk).
        if extra.iter().any(|a| a == "--object-store") && !extra.iter().any(|a| a == "--evict-high") {
            extra.extend(["--evict-high", "99", "--evict-low", "98"].map(String::from));
        }
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Mount { root, data, mnt, extra, env, mounted: false }
    }

    /// Mount (again) over the same data dir.
    pub fn mount(&mut self) {
        self.mount_by(|_| {});
    }

    /// Mount with the `converged mount` command as `adjust` leaves it (a
    /// restriction the mount and its daemons inherit, say).
    pub fn mount_by(&mut self, adjust: impl FnOnce(&mut Command)) {
        let mut cmd = converged();
        adjust(&mut cmd);
        let out = cmd
            .arg("mount")
            .arg(&self.mnt)
            .arg("--data-dir")
            .arg(&self.data)
            .args(&self.extra)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("run converged mount");
        assert!(
            out.status.success(),
            "converged mount failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.mounted = true;
    }

    pub fn umount(&mut self) {
        let out = converged().arg("umount").arg(&self.mnt).output().expect("run converged umount");
        assert!(out.status.success(), "umount failed: {}", String::from_utf8_lossy(&out.stderr));
        self.mounted = false;
    }

    /// umount(2) straight away, with no process started first as `converged
    /// umount` is; then wait, as it does, until the daemon let go of the
    /// data dir (its last sync done), and for its supervisor to end.
    pub fn umount_at_once(&mut self) {
        use std::os::fd::AsRawFd;
        let supervisor = self.supervisor_pid();
        let mnt = cstr(&self.mnt);
        // SAFETY: umount2 with a valid path.
        assert_eq!(unsafe { libc::umount2(mnt.as_ptr(), 0) }, 0, "umount: errno {}", errno());
        self.mounted = false;
        let lock = std::fs::File::open(self.data.join("converged.lock")).expect("the data dir's lock file");
        // SAFETY: flock(2) on a descriptor of ours; waits for the daemon's lock.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0, "flock: errno {}", errno());
        drop(lock);
        if let Some(pid) = supervisor {
            wait_gone(pid);
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// The daemon's pid, from the data-dir lock file.
    pub fn daemon_pid(&self) -> i32 {
        daemon_pid(&self.data).expect("a daemon holds the data dir")
    }

    /// The pid of the mount's supervisor (see fs/src/supervise.rs).
    pub fn supervisor_pid(&self) -> Option<i32> {
        supervisor_pid(&self.data)
    }

    /// The node dies: SIGKILL the supervisor, then the daemon, and detach
    /// the dead mount.
    pub fn crash(&mut self) {
        kill_node(&self.data);
        lazy_umount(&self.mnt);
        self.mounted = false;
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.join("converged.log")).unwrap_or_default()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            take_down(&self.mnt);
        }
    }
}

/// Unmount `mnt` as a user would (`converged umount`), or detach it when
/// that fails: what a test leaves mounted must not outlive it.
pub fn take_down(mnt: &Path) {
    let out = converged().arg("umount").arg(mnt).output();
    if !out.map(|o| o.status.success()).unwrap_or(false) {
        lazy_umount(mnt);
    }
}

/// The pid of the daemon holding `data` (its lock file), if one wrote it.
pub fn daemon_pid(data: &Path) -> Option<i32> {
    std::fs::read_to_string(data.join("converged.lock")).ok()?.trim().parse().ok()
}

/// The supervisor's pid from its file in the data dir, if it runs.
pub fn supervisor_pid(data: &Path) -> Option<i32> {
    std::fs::read_to_string(data.join("converged.supervisor")).ok()?.trim().parse().ok()
}

/// A whole node dies (a power cut, a kernel panic): its supervisor first,
/// which would otherwise start a new daemon on the live connection, then
/// its daemon.
pub fn kill_node(data: &Path) {
    if let Some(pid) = supervisor_pid(data) {
        // SAFETY: kill(2).
        unsafe { libc::kill(pid, libc::SIGKILL) };
        wait_gone(pid);
    }
    if let Some(pid) = daemon_pid(data).filter(|p| *p > 0) {
        // SAFETY: kill(2).
        unsafe { libc::kill(pid, libc::SIGKILL) };
        wait_gone(pid);
    }
}

pub fn lazy_umount(p: &Path) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: umount2 with a valid path.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

pub fn wait_gone(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
        // Reap it if it is our child; otherwise just wait.
        std::thread::sleep(Duration::from_millis(20));
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            if stat.split(' ').nth(2) == Some("Z") {
                break;
            }
        }
    }
}

pub fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// The errno of the last failed libc call.
pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

pub fn drop_caches() {
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The text a Prometheus endpoint at `addr` serves at `/metrics`.
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The value of sample `name` (no labels) in a scrape.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))?.split(' ').nth(1)?.parse().ok()
}

/// A `struct file_handle` with room for the handle (name_to_handle_at).
#[repr(C)]
pub struct FileHandleBuf {
    bytes: u32,
    kind: i32,
    f: [u8; 128],
}

impl FileHandleBuf {
    pub fn of(p: &Path) -> Self {
        let mut h = FileHandleBuf { bytes: 128, kind: 0, f: [0; 128] };
        let mut mount_id = 0;
        let c = cstr(p);
        // SAFETY: a buffer laid out as struct file_handle with 128 bytes of room.
        let rc = unsafe {
            libc::name_to_handle_at(libc::AT_FDCWD, c.as_ptr(), &mut h as *mut Self as *mut _, &mut mount_id, 0)
        };
        assert_eq!(rc, 0, "name_to_handle_at {}: {}", p.display(), std::io::Error::last_os_error());
        h
    }

    /// open_by_handle_at on the mount at `root`: the file, or the errno.
    pub fn open(&mut self, root: &Path, flags: i32) -> Result<std::fs::File, i32> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let root = std::fs::File::open(root).unwrap();
        // SAFETY: the handle buffer filled by name_to_handle_at.
        let fd = unsafe { libc::open_by_handle_at(root.as_raw_fd(), self as *mut Self as *mut _, flags) };
        if fd < 0 {
            return Err(errno());
        }
        // SAFETY: a descriptor we just opened and own.
        Ok(unsafe { std::fs::File::from_raw_fd(fd) })
    }
}

/// copy_file_range of `len` bytes from `from` at `off_in` to `to` (created
/// if missing) at `off_out`, called again for what is left as cp does; the
/// bytes copied (fewer at the source's end).
pub fn copy_range(from: &Path, off_in: i64, to: &Path, off_out: i64, len: usize) -> usize {
    use std::os::fd::AsRawFd;
    let src = std::fs::File::open(from).unwrap();
    let dst = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(to).unwrap();
    let (mut oi, mut oo, mut total) = (off_in, off_out, 0usize);
    while total < len {
        // SAFETY: two open descriptors and offsets we own.
        let n = unsafe { libc::copy_file_range(src.as_raw_fd(), &mut oi, dst.as_raw_fd(), &mut oo, len - total, 0) };
        assert!(n >= 0, "copy_file_range: {}", std::io::Error::last_os_error());
        if n == 0 {
            break;
        }
        total += n as usize;
    }
    total
}

/// open(2) with O_TMPFILE in `dir`; the file or the errno.
pub fn open_tmpfile(dir: &std::path::Path, extra: i32) -> Result<std::fs::File, i32> {
    use std::os::fd::FromRawFd;
    // SAFETY: open(2) on a NUL-terminated path.
    let fd = unsafe { libc::open(cstr(dir).as_ptr(), libc::O_TMPFILE | libc::O_RDWR | extra, 0o640) };
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: a descriptor just opened, owned by nobody else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// linkat(2) of an open file through /proc/self/fd: how a file built
/// unnamed with O_TMPFILE is published whole under a name.
pub fn link_open_file(f: &std::fs::File, to: &std::path::Path) -> Result<(), i32> {
    let from = cstr(std::path::Path::new(&format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(f))));
    // SAFETY: linkat(2) on NUL-terminated paths.
    let r = unsafe {
        libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, cstr(to).as_ptr(), libc::AT_SYMLINK_FOLLOW)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}
