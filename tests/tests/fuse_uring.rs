//! `--fuse-uring`: FUSE over io_uring through a real kernel mount. The mount
//! serves its requests from ring threads when the kernel offers the
//! transport, falls back to /dev/fuse when it does not, ends with its daemon
//! (no request left waiting) without the supervisor, and with it is taken
//! over by the next daemon with every request answered.

mod common;

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

use common::*;

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// The fuse module's `enable_uring`, set for as long as this is held and
/// put back after: the tests here that set it take turns (each is a
/// process of its own under nextest). Other tests' mounts ask for the
/// transport too (the default): those made while it is set run on rings,
/// as the whole suite does on a host that sets it.
struct UringSwitch {
    // Put back before the lock goes (fields drop in this order).
    _set: Sysctl,
    _lock: File,
}

fn uring_switch(on: bool) -> UringSwitch {
    assert!(
        Path::new(ENABLE_URING).exists(),
        "{ENABLE_URING} missing: this kernel has no FUSE over io_uring (Linux 6.14, CONFIG_FUSE_IO_URING)"
    );
    let lock = File::create(std::env::temp_dir().join("converged-test-enable-uring.lock")).unwrap();
    // SAFETY: flock(2) on a descriptor of ours.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0, "flock: errno {}", errno());
    UringSwitch { _set: Sysctl::set(ENABLE_URING, if on { "Y" } else { "N" }), _lock: lock }
}

/// io_uring instances the process `pid` holds.
fn io_urings(pid: i32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy() == "anon_inode:[io_uring]")
        .count()
}

/// io_uring instances of `pid` once it holds `want`, or what it holds
/// after 10 s: the mount command returns when the kernel mount answers,
/// and the ring threads start beside it.
fn wait_for_urings(pid: i32, want: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let n = io_urings(pid);
        if n >= want || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Nanoseconds on CPU of `pid`'s ring threads and of its /dev/fuse
/// readers, read in one pass over its threads.
fn fuse_cpu_ns(pid: i32) -> (u64, u64) {
    let (ring, dev) = threads_ns(pid).into_iter().fold((0, 0), |(r, d), (name, ns)| {
        if name.starts_with("fuser-ring-") {
            (r + ns, d)
        } else if is_dev_reader(&name) {
            (r, d + ns)
        } else {
            (r, d)
        }
    });
    (ring, dev)
}

/// Whether a thread named `name` is one of fuser's /dev/fuse readers
/// (`fuser-N`; the ring threads are `fuser-ring-N`).
fn is_dev_reader(name: &str) -> bool {
    name.strip_prefix("fuser-").is_some_and(|n| n.parse::<u32>().is_ok())
}

/// Waits for the daemon `pid` to end after its unmount, and fails if it
/// did not (gone, or a zombie its new parent has not reaped: ended either way).
fn assert_daemon_ended(pid: i32) {
    wait_gone(pid);
    let state = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(matches!(state.split(' ').nth(2), None | Some("Z")), "the daemon outlived its unmount: {state}");
}

/// Each of `pid`'s threads: its name and its nanoseconds on CPU.
fn threads_ns(pid: i32) -> Vec<(String, u64)> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| {
            let t = t.ok()?.path();
            let name = fs::read_to_string(t.join("comm")).ok()?.trim_end().to_string();
            let ns = fs::read_to_string(t.join("schedstat")).ok()?.split(' ').next()?.parse::<u64>().ok()?;
            Some((name, ns))
        })
        .collect()
}

/// The CPUs the kernel makes a ring queue for.
fn possible_cpus() -> usize {
    let text = fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    text.trim().split(',').map(|p| p.rsplit('-').next().unwrap().parse::<usize>().unwrap()).max().unwrap() + 1
}

/// What a dataset unpack and a checkpoint do, checked by reading back.
fn workload(m: &Mount) {
    let dir = m.path("many");
    fs::create_dir(&dir).unwrap();
    for i in 0..2000 {
        fs::write(dir.join(format!("f{i}")), format!("file {i}")).unwrap();
    }
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 2000);
    for i in (0..2000).step_by(97) {
        assert_eq!(fs::read_to_string(dir.join(format!("f{i}"))).unwrap(), format!("file {i}"));
    }
    // Reads and writes of a mount with --verify-reads go through the daemon:
    // 1 MiB requests and replies in the ring entries' payload buffers.
    let data = pattern(5 << 20, 7);
    let mut f = File::create(m.path("ckpt.tmp")).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs::rename(m.path("ckpt.tmp"), m.path("ckpt")).unwrap();
    drop_caches();
    let mut back = Vec::new();
    File::open(m.path("ckpt")).unwrap().read_to_end(&mut back).unwrap();
    assert!(back == data, "the checkpoint read back differs");
    xattr_round_trip(&m.path("ckpt"));
    for i in 0..2000 {
        fs::remove_file(dir.join(format!("f{i}"))).unwrap();
    }
    fs::remove_dir(&dir).unwrap();
    let err = fs::metadata(&dir).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
}

fn xattr_round_trip(p: &Path) {
    let path = cstr(p);
    let name = c"user.converged-test";
    // SAFETY: setxattr/getxattr with valid pointers and lengths.
    unsafe {
        assert_eq!(libc::setxattr(path.as_ptr(), name.as_ptr(), b"v1".as_ptr().cast(), 2, 0), 0, "errno {}", errno());
        let mut buf = [0u8; 16];
        let n = libc::getxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len());
        assert_eq!(n, 2, "errno {}", errno());
        assert_eq!(&buf[..2], b"v1");
    }
}

#[test]
fn requests_go_through_the_rings_and_the_mount_unmounts() {
    let _switch = uring_switch(true);
    let mut m = Mount::with_args(&["--no-supervisor", "--fuse-uring", "--verify-reads"]);
    let pid = m.daemon_pid();
    let rings = wait_for_urings(pid, possible_cpus());
    assert!(
        rings >= possible_cpus(),
        "the daemon holds {rings} io_uring instances, expected one a queue ({}); log:\n{}",
        possible_cpus(),
        m.log()
    );
    let (ring0, dev0) = fuse_cpu_ns(pid);
    workload(&m);
    // Sixteen writers at once, each in its own directory and in one shared
    // one: every file reads back its own bytes, and each directory lists
    // what was made in it.
    let writers: Vec<_> = (0..16)
        .map(|t| {
            let (own, shared) = (m.path(&format!("w{t}")), m.path("shared"));
            std::thread::spawn(move || {
                fs::create_dir(&own).unwrap();
                let _ = fs::create_dir(&shared);
                for i in 0..150 {
                    let body = pattern(64 + i * 37, (t * 1000 + i) as u64);
                    for dir in [&own, &shared] {
                        let p = dir.join(format!("t{t}-{i}"));
                        fs::write(&p, &body).unwrap();
                        assert!(fs::read(&p).unwrap() == body, "{} read back other bytes", p.display());
                    }
                }
                for i in (0..150).step_by(2) {
                    fs::remove_file(own.join(format!("t{t}-{i}"))).unwrap();
                }
                assert_eq!(fs::read_dir(&own).unwrap().count(), 75);
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    assert_eq!(fs::read_dir(m.path("shared")).unwrap().count(), 16 * 150);
    let (ring1, dev1) = fuse_cpu_ns(pid);
    let (ring, dev) = (ring1 - ring0, dev1 - dev0);
    // The /dev/fuse readers still take the kernel's forgets; everything
    // else is the rings'.
    assert!(ring > dev, "ring threads ran {ring} ns, /dev/fuse readers {dev} ns: the rings did not serve the mount");
    m.umount();
    assert_daemon_ended(pid);
    // What was written is there at the next mount, served the same way.
    m.mount();
    let mut back = Vec::new();
    File::open(m.path("ckpt")).unwrap().read_to_end(&mut back).unwrap();
    assert!(back == pattern(5 << 20, 7), "the checkpoint differs after a remount");
}

#[test]
fn without_the_kernels_offer_the_mount_serves_dev_fuse() {
    let _switch = uring_switch(false);
    let m = Mount::with_args(&["--no-supervisor", "--fuse-uring", "--verify-reads"]);
    workload(&m);
    assert_eq!(io_urings(m.daemon_pid()), 0, "rings started though the kernel did not offer them");
    assert!(
        m.log().contains("FUSE over io_uring is not available"),
        "no word of the fallback in the log:\n{}",
        m.log()
    );
}

#[test]
fn a_daemon_killed_on_rings_ends_the_mount_with_no_caller_left_waiting() {
    let _switch = uring_switch(true);
    let mut m = Mount::with_args(&["--no-supervisor", "--fuse-uring"]);
    let pid = m.daemon_pid();
    assert!(wait_for_urings(pid, possible_cpus()) >= possible_cpus(), "no rings; log:\n{}", m.log());
    fs::write(m.path("a"), b"x").unwrap();
    // Callers busy on the mount while the daemon dies: each must come back
    // with an error (ECONNABORTED for a request in flight, ENOTCONN after),
    // not wait forever.
    let mnt = m.mnt.clone();
    let callers: Vec<_> = (0..4)
        .map(|t| {
            let mnt = mnt.clone();
            std::thread::spawn(move || {
                for i in 0.. {
                    let p = mnt.join(format!("t{t}-{i}"));
                    if let Err(e) = fs::write(&p, b"y").and_then(|_| fs::metadata(&p)) {
                        return e.raw_os_error();
                    }
                }
                unreachable!()
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    // SAFETY: kill(2).
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_gone(pid);
    for c in callers {
        let e = c.join().unwrap();
        assert!(matches!(e, Some(libc::ENOTCONN | libc::ECONNABORTED)), "a caller ended with errno {e:?}");
    }
    assert_eq!(fs::metadata(m.path("a")).unwrap_err().raw_os_error(), Some(libc::ENOTCONN));
    m.crash();
}

/// Waits up to `secs` for `threads` to finish; past that, aborts the
/// connection of the mount at `mnt` (a request no daemon answers would
/// keep them waiting for ever; the abort ends each with ECONNABORTED) and
/// says so.
fn finished_or_aborted<T>(threads: &[std::thread::JoinHandle<T>], mnt: &Path, secs: u64) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while threads.iter().any(|t| !t.is_finished()) {
        if std::time::Instant::now() > deadline {
            abort_connection(connection_of(mnt), mnt);
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    true
}

/// The daemon's pid once the supervisor has started one other than `old`
/// and it holds its rings.
fn next_daemon(m: &Mount, old: i32) -> i32 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(pid) = daemon_pid(&m.data).filter(|&p| p != old) {
            if wait_for_urings(pid, possible_cpus()) >= possible_cpus() {
                return pid;
            }
        }
        assert!(std::time::Instant::now() < deadline, "no new daemon on rings after 30 s; log:\n{}", m.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Under the supervisor, a daemon killed while its rings hold requests is
/// replaced and no caller notices: the next daemon maps the ring memory
/// the supervisor kept, serves again (or commits the finished reply of)
/// what the dead one's entries held, and the requests made meanwhile are
/// fetched from their queues. Sixteen writers, each writing files of its
/// own and reading every one back, through two kills; then every file is
/// read again.
#[test]
fn a_daemon_killed_on_rings_is_replaced_and_every_caller_finishes() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let _switch = uring_switch(true);
    let m = Mount::with_args(&["--fuse-uring", "--restart-limit", "20"]);
    let first = m.daemon_pid();
    assert!(wait_for_urings(first, possible_cpus()) >= possible_cpus(), "no rings; log:\n{}", m.log());
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..16)
        .map(|t| {
            let (mnt, stop) = (m.mnt.clone(), stop.clone());
            std::thread::spawn(move || {
                let dir = mnt.join(format!("w{t}"));
                fs::create_dir(&dir).unwrap_or_else(|e| panic!("writer {t}: mkdir: {e}"));
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let p = dir.join(format!("f{n}"));
                    let data = pattern(64 + (n as usize * 977) % 9000, t * 100_000 + n);
                    fs::write(&p, &data).unwrap_or_else(|e| panic!("writer {t}: write f{n}: {e}"));
                    let back = fs::read(&p).unwrap_or_else(|e| panic!("writer {t}: read f{n}: {e}"));
                    assert!(back == data, "writer {t}: f{n} read back differs");
                    n += 1;
                }
                n
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(400));
    // SAFETY: kill(2).
    unsafe { libc::kill(first, libc::SIGKILL) };
    let second = next_daemon(&m, first);
    std::thread::sleep(std::time::Duration::from_millis(400));
    // The second daemon dies too: what it took over is taken over again.
    // SAFETY: kill(2).
    unsafe { libc::kill(second, libc::SIGKILL) };
    let third = next_daemon(&m, second);
    std::thread::sleep(std::time::Duration::from_millis(400));
    stop.store(true, Ordering::Relaxed);
    assert!(
        finished_or_aborted(&writers, &m.mnt, 60),
        "writers still waiting 60 s after the last takeover: a request was lost; log:\n{}",
        m.log()
    );
    let counts: Vec<u64> = writers.into_iter().map(|w| w.join().expect("a writer failed")).collect();
    assert!(counts.iter().all(|&n| n > 0), "a writer wrote nothing: {counts:?}");
    for (t, &n) in counts.iter().enumerate() {
        let t = t as u64;
        assert_eq!(fs::read_dir(m.path(&format!("w{t}"))).unwrap().count() as u64, n, "writer {t}'s listing");
        for i in 0..n {
            let back = fs::read(m.path(&format!("w{t}/f{i}"))).unwrap();
            assert!(back == pattern(64 + (i as usize * 977) % 9000, t * 100_000 + i), "w{t}/f{i} differs");
        }
    }
    assert_eq!(daemon_pid(&m.data), Some(third), "the third daemon serves");
    assert!(m.log().contains("ring threads"), "no word of the rings in the log:\n{}", m.log());
}

/// A daemon that dies after a change commits and before it answers leaves
/// the request in its ring entry; the next daemon serves it again from the
/// slot as a resend, so each change is answered as done and made once.
#[test]
fn a_change_held_in_a_ring_by_a_daemon_that_died_is_answered_as_done() {
    use std::os::unix::fs::MetadataExt;
    let _switch = uring_switch(true);
    let ops = ["mkdir", "create", "rename", "unlink"];
    let m = Mount::with_env(
        &["--fuse-uring", "--restart-limit", "20"],
        &[("CONVERGED_FAULT_DIE_AFTER_COMMIT", &ops.join(","))],
    );
    assert!(wait_for_urings(m.daemon_pid(), possible_cpus()) >= possible_cpus(), "no rings; log:\n{}", m.log());
    let (mnt, data) = (m.mnt.clone(), m.data.clone());
    let p = move |rel: &str| mnt.join(rel);
    let changes = {
        let p = p.clone();
        std::thread::spawn(move || {
            let log = || fs::read_to_string(data.join("converged.log")).unwrap_or_default();
            let died = |n: usize| {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while log().matches("starting a new one on the live connection").count() < n {
                    assert!(std::time::Instant::now() < deadline, "daemon {n} did not die:\n{}", log());
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            };
            fs::create_dir(p("d")).expect("mkdir");
            died(1);
            let mut f = fs::OpenOptions::new().write(true).create_new(true).open(p("d/f")).expect("create with O_EXCL");
            died(2);
            f.write_all(b"written after the create").unwrap();
            drop(f);
            fs::hard_link(p("d/f"), p("d/h")).unwrap();
            fs::rename(p("d/f"), p("d/g")).expect("rename");
            died(3);
            fs::remove_file(p("d/h")).expect("unlink");
            died(4);
        })
    };
    assert!(
        finished_or_aborted(std::slice::from_ref(&changes), &m.mnt, 120),
        "a change still waits for its answer after 120 s; log:\n{}",
        m.log()
    );
    changes.join().expect("the changes failed");
    assert_eq!(fs::read(p("d/g")).unwrap(), b"written after the create");
    assert_eq!(fs::metadata(p("d/g")).unwrap().nlink(), 1);
    let names: Vec<_> = fs::read_dir(p("d")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["g"]);
    let log = m.log();
    assert_eq!(log.matches("a resent request's change had committed").count(), ops.len(), "log:\n{log}");
    assert!(log.contains("after the earlier daemon"), "not served from a ring slot; log:\n{log}");
}

/// A request made while no daemon serves the rings (the dead one's idle
/// entries cancelled, the next not started) waits on its CPU's queue, which
/// the kernel serves only when a commit on that queue fetches: the next
/// daemon's statfs from each CPU makes one. The supervisor is stopped
/// while the daemon dies, so the requests are surely made in the gap.
#[test]
fn requests_made_between_two_daemons_on_rings_are_answered() {
    let _switch = uring_switch(true);
    let m = Mount::with_args(&["--fuse-uring"]);
    let first = m.daemon_pid();
    assert!(wait_for_urings(first, possible_cpus()) >= possible_cpus(), "no rings; log:\n{}", m.log());
    fs::write(m.path("before"), b"made before the kill").unwrap();
    let supervisor = m.supervisor_pid().expect("a supervisor");
    // SAFETY: kill(2).
    unsafe {
        libc::kill(supervisor, libc::SIGSTOP);
        libc::kill(first, libc::SIGKILL);
    }
    // Dead (a zombie its stopped parent has not reaped), its rings closed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while fs::read_to_string(format!("/proc/{first}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
        assert!(std::time::Instant::now() < deadline, "the daemon did not die");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // From every CPU, so that each queue holds one.
    let callers: Vec<_> = (0..2 * possible_cpus())
        .map(|i| {
            let p = m.path(&format!("made-in-the-gap-{i}"));
            std::thread::spawn(move || {
                let cpu = i % possible_cpus();
                // SAFETY: a zeroed cpu_set_t with one CPU set; sched_setaffinity on this thread.
                unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(cpu, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                }
                fs::write(&p, p.to_string_lossy().as_bytes()).map_err(|e| e.to_string())
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(300));
    // SAFETY: kill(2).
    unsafe { libc::kill(supervisor, libc::SIGCONT) };
    assert!(
        finished_or_aborted(&callers, &m.mnt, 60),
        "requests made between the daemons still wait 60 s on; log:\n{}",
        m.log()
    );
    for (i, c) in callers.into_iter().enumerate() {
        c.join().unwrap().unwrap_or_else(|e| panic!("caller {i}: {e}"));
        let p = m.path(&format!("made-in-the-gap-{i}"));
        assert_eq!(fs::read_to_string(&p).unwrap(), p.to_string_lossy());
    }
    assert_eq!(fs::read(m.path("before")).unwrap(), b"made before the kill");
}

/// A kernel setting, set for as long as this is held and put back after.
struct Sysctl {
    path: &'static str,
    was: String,
}

impl Sysctl {
    fn set(path: &'static str, value: &str) -> Sysctl {
        let was = fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        fs::write(path, value).unwrap_or_else(|e| panic!("write {path}: {e}"));
        Sysctl { path, was }
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        let _ = fs::write(self.path, &self.was);
    }
}

/// The device number of the mount at `mnt`, from the mount table: no
/// stat(2) of the mount, which waits for ever on a connection no daemon
/// serves.
fn connection_of(mnt: &Path) -> u64 {
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = table.lines().find(|l| l.split(' ').nth(4) == Some(&*mnt.to_string_lossy()));
    let dev = line.and_then(|l| l.split(' ').nth(2)).unwrap_or_else(|| panic!("{} is not mounted", mnt.display()));
    let (major, minor) = dev.split_once(':').expect("major:minor");
    libc::makedev(major.parse().unwrap(), minor.parse().unwrap())
}

/// Has the process `cmd` starts refuse `io_uring_setup(2)` with `EPERM`, as
/// a container runtime's default seccomp filter does (and
/// `kernel.io_uring_disabled` host-wide); what it starts in turn, the
/// supervisor and each daemon, inherits the filter.
fn refuse_io_uring_setup(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    /// A = the system call's number (`seccomp_data.nr`); io_uring_setup
    /// gets EPERM, everything else goes through.
    static FILTER: [libc::sock_filter; 4] = [
        libc::sock_filter { code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16, jt: 0, jf: 0, k: 0 },
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_io_uring_setup as u32,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter { code: (libc::BPF_RET | libc::BPF_K) as u16, jt: 0, jf: 0, k: libc::SECCOMP_RET_ALLOW },
    ];
    // SAFETY: the closure runs in the child between fork and exec and makes
    // two system calls (no allocation, no lock) on a filter in static memory.
    unsafe {
        cmd.pre_exec(|| {
            let prog = libc::sock_fprog { len: FILTER.len() as u16, filter: FILTER.as_ptr().cast_mut() };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &prog) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Where the fuse module offers FUSE over io_uring but io_uring is refused
/// to the daemon (a seccomp filter, as a container runtime's default one;
/// `kernel.io_uring_disabled` does the same host-wide), the default mount
/// serves through /dev/fuse, and so does a daemon taking over. Before,
/// INIT promised the kernel rings the daemon then could not make, and
/// every request of the mount waited for them.
#[test]
fn where_io_uring_is_refused_the_default_mount_serves_dev_fuse() {
    let _switch = uring_switch(true);
    let mut m = Mount::unmounted(&["--verify-reads"], &[]);
    m.mount_by(refuse_io_uring_setup);
    let first = m.daemon_pid();
    // 300 files written and read back in a thread, which must finish
    // within 60 s (the connection is aborted otherwise, and the test fails).
    let write_and_read = |tag: &'static str| {
        let mnt = m.mnt.clone();
        let t = std::thread::spawn(move || {
            let dir = mnt.join(tag);
            fs::create_dir(&dir)?;
            for i in 0..300 {
                fs::write(dir.join(format!("f{i}")), format!("{tag} {i}"))?;
            }
            for i in 0..300 {
                let back = fs::read_to_string(dir.join(format!("f{i}")))?;
                if back != format!("{tag} {i}") {
                    return Err(std::io::Error::other(format!("f{i} reads {back:?}")));
                }
            }
            Ok(())
        });
        let finished = finished_or_aborted(std::slice::from_ref(&t), &m.mnt, 60);
        assert!(finished, "{tag}: requests still wait 60 s on; log:\n{}", m.log());
        t.join().unwrap().unwrap_or_else(|e| panic!("{tag}: {e}"));
    };
    write_and_read("before");
    assert!(m.log().contains("FUSE over io_uring not used"), "no word of the refusal in the log:\n{}", m.log());
    assert_eq!(io_urings(first), 0, "the daemon holds rings though io_uring was refused");
    // SAFETY: kill(2).
    unsafe { libc::kill(first, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let next = loop {
        if let Some(pid) = daemon_pid(&m.data).filter(|&p| p != first) {
            break pid;
        }
        assert!(std::time::Instant::now() < deadline, "no new daemon after 30 s; log:\n{}", m.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    write_and_read("after");
    assert_eq!(io_urings(next), 0, "the daemon taking over started rings on a /dev/fuse connection");
    assert_eq!(fs::read_to_string(m.path("before/f7")).unwrap(), "before 7");
}

/// A kernel that offered FUSE over io_uring at INIT and then refuses the
/// rings' registrations (a fault switch has each ring offer an entry too
/// small for the connection; the first refusal turns the transport off for
/// the connection) sends every request through /dev/fuse: every ring
/// thread ends, and the /dev/fuse readers that stood by while the rings
/// were to serve (one reads forgets meanwhile) all serve the mount.
#[test]
fn where_the_kernel_refuses_the_rings_registration_every_dev_fuse_reader_serves() {
    let _switch = uring_switch(true);
    let mut m = Mount::with_env(&["--verify-reads"], &[("CONVERGED_FAULT_RING_REFUSED", "1")]);
    let pid = m.daemon_pid();
    let refused = || m.log().contains("the kernel refused an entry");
    common::cluster::eventually_showing(10, "the log names the refusal", refused, || format!(":\n{}", m.log()));
    let readers = |pid| -> Vec<(String, u64)> {
        let mut r: Vec<_> = threads_ns(pid).into_iter().filter(|(name, _)| is_dev_reader(name)).collect();
        r.sort();
        r
    };
    // Every /dev/fuse reader started (they start beside the mount's return).
    let started = || readers(pid).len() >= 2;
    common::cluster::eventually_showing(10, "a second /dev/fuse reader", started, || format!(": {:?}", readers(pid)));
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before: std::collections::BTreeMap<String, u64> = readers(pid).into_iter().collect();
    // Sixteen writers at once, each file read back, within 60 s (the
    // connection is aborted otherwise, and the test fails).
    let writers: Vec<_> = (0..16)
        .map(|t| {
            let dir = m.path(&format!("w{t}"));
            std::thread::spawn(move || -> std::io::Result<()> {
                fs::create_dir(&dir)?;
                for i in 0..100 {
                    let body = pattern(64 + i * 37, (t * 1000 + i) as u64);
                    fs::write(dir.join(format!("f{i}")), &body)?;
                    if fs::read(dir.join(format!("f{i}")))? != body {
                        return Err(std::io::Error::other(format!("w{t}/f{i} read back other bytes")));
                    }
                }
                Ok(())
            })
        })
        .collect();
    assert!(finished_or_aborted(&writers, &m.mnt, 60), "requests still wait 60 s on; log:\n{}", m.log());
    for w in writers {
        w.join().unwrap().unwrap();
    }
    let after = readers(pid);
    let ran = after.iter().filter(|(name, ns)| before.get(name).is_some_and(|b| ns > b)).count();
    assert!(
        ran >= 2,
        "{ran} of the {} /dev/fuse readers served sixteen writers (before {before:?}, after {after:?})",
        after.len()
    );
    let rings = threads_ns(pid).iter().filter(|(name, _)| name.starts_with("fuser-ring-")).count();
    assert_eq!(rings, 0, "ring threads still run though the kernel refused every entry");
    m.umount();
    assert_daemon_ended(pid);
}
