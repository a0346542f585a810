"""Many processes of random file operations on a few shared names of a mount.

usage: stress.py MOUNTPOINT [--procs 16] [--seconds 60] [--stall 30]
                 [--daemon-pid PID] [--seed N]

What it attacks: the daemon's locking when the same few inodes are opened,
written, closed, unlinked, renamed, linked and listed by many processes at
once, beside unnamed (O_TMPFILE) files linked under those names. Every
close of a writable handle seals the file (a metadata write transaction)
under the inode's state lock and then takes the open-inode map's shard
to drop the inode; an unlink asks that map, from inside its metadata
transaction, whether the inode is still open; a close of an
unlinked file purges it. Those paths take the same three locks (the
metadata store's write slot, a shard of the open-inode map, an inode's
state mutex) in different orders, and a wrong order only shows under this
kind of overlap: many short-lived O_RDWR opens + writes + closes of the
same names while other processes unlink and rename them.

A lock-order bug in the daemon does not make an operation fail, it makes
the processes that touch the mount hang in an uninterruptible FUSE wait. So
the parent process is a watchdog: every worker bumps a shared progress
counter after each operation, and a worker without progress for --stall
seconds is a stall. Then the parent prints which workers are stuck and
where (their kernel stacks), dumps the daemon's threads (gdb if installed,
else the threads' kernel stacks), prints STALL and exits with status 3
without waiting for the stuck workers: they stay stuck until the caller
aborts the FUSE connection.

Errors that races between the workers legitimately produce (ENOENT, EEXIST,
ENOTEMPTY, EISDIR, ENOTDIR, ETXTBSY, ENODATA, EBUSY) are counted; any other
error (EIO above all) is a failure, printed with its operation, and makes
the exit status 1. At the end it prints
`ops=<total> errors_expected=<n> failures=<n>`.

Stdlib only; os.* calls directly, so each call is one system call on the
mount.
"""
import argparse
import ctypes
import errno
import glob
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import traceback

DIRS = 4
NAMES = 32
EXPECTED = {
    errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR,
    errno.ENOTDIR, errno.ETXTBSY, errno.ENODATA, errno.EBUSY,
}
# The mount has no daemon behind it any more: the worker stops.
MOUNT_GONE = {errno.ENOTCONN, errno.ECONNABORTED}
# Failures each worker prints; more are only counted.
PRINTED_FAILURES = 20
AT_FDCWD = -100
RENAME_EXCHANGE = 2
# Open read-write fds a worker keeps across operations, closed later.
HELD_MAX = 4

_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                           ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def say(text):
    """One write(2) per line: workers share the output file."""
    os.write(1, (text + "\n").encode(errors="replace"))


def rename_exchange(a, b):
    """renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)."""
    if _renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b),
                  RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), a, None, b)


AT_SYMLINK_FOLLOW = 0x400
_libc.linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                         ctypes.c_char_p, ctypes.c_int]
_libc.linkat.restype = ctypes.c_int


def link_open_file(fd, dst):
    """linkat(2) of an open file through /proc/self/fd (os.link calls
    link(2), which would link the /proc symlink itself)."""
    src = f"/proc/self/fd/{fd}".encode()
    if _libc.linkat(AT_FDCWD, src, AT_FDCWD, os.fsencode(dst),
                    AT_SYMLINK_FOLLOW) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), dst)


class Worker:
    """One process's loop of random operations on the shared names."""

    def __init__(self, idx, mnt, seed, shared):
        self.idx = idx
        self.mnt = mnt
        self.rng = random.Random(f"{seed}-{idx}")
        self.shared = shared
        self.names = [os.path.join(mnt, f"d{i % DIRS}", f"f{i}")
                      for i in range(NAMES)]
        self.held = []  # (fd, path) kept open across operations
        self.data = os.urandom(1 << 18)

    def name(self):
        return self.rng.choice(self.names)

    def blob(self, most=65536):
        n = self.rng.randint(1, most)
        start = self.rng.randrange(len(self.data) - n + 1)
        return self.data[start:start + n]

    # The operations. Each gets a fresh random name (or two); errors are
    # handled by the caller.

    def op_create_write(self):
        fd = os.open(self.name(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                     0o644)
        try:
            os.write(fd, self.blob())
        finally:
            os.close(fd)

    def op_pwrite(self):
        fd = os.open(self.name(), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, self.blob(), self.rng.randrange(1 << 20))
            sync = self.rng.randrange(3)
            if sync == 1:
                os.fsync(fd)
            elif sync == 2:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def op_append(self):
        fd = os.open(self.name(), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                     0o644)
        try:
            os.write(fd, self.blob(8192))
        finally:
            os.close(fd)

    def op_write_close_burst(self):
        # Short-lived writers on one name, back to back: each close is a
        # release that seals the file while other workers unlink it.
        path = self.name()
        for _ in range(self.rng.randint(2, 6)):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, self.blob(4096), self.rng.randrange(65536))
            finally:
                os.close(fd)

    def op_tmpfile(self):
        # An unnamed file (O_TMPFILE) written, then published under a shared
        # name with linkat (EEXIST when taken), or dropped unlinked; some
        # are kept open, so their last close (a seal, or a purge of one
        # never linked) lands among the others' unlinks and renames.
        d = os.path.join(self.mnt, f"d{self.rng.randrange(DIRS)}")
        fd = os.open(d, os.O_TMPFILE | os.O_RDWR, 0o644)
        keep = False
        try:
            os.pwrite(fd, self.blob(), self.rng.randrange(65536))
            if self.rng.randrange(3) == 0:
                os.fsync(fd)
            if self.rng.randrange(3):
                link_open_file(fd, self.name())
            keep = self.rng.randrange(4) == 0
            if keep:
                self.held.append((fd, d))
                if len(self.held) > HELD_MAX:
                    self.close_held(0)
        finally:
            if not keep:
                os.close(fd)

    def op_read(self):
        fd = os.open(self.name(), os.O_RDONLY)
        try:
            while os.read(fd, 1 << 16):
                pass
        finally:
            os.close(fd)

    def op_unlink(self):
        os.unlink(self.name())

    def op_rename_same_dir(self):
        src = self.name()
        d = os.path.dirname(src)
        dst = self.rng.choice([n for n in self.names
                               if os.path.dirname(n) == d])
        os.rename(src, dst)

    def op_rename_any(self):
        os.rename(self.name(), self.name())

    def op_exchange(self):
        if _renameat2 is not None:
            rename_exchange(self.name(), self.name())

    def op_truncate(self):
        os.truncate(self.name(), self.rng.randrange(1 << 18))

    def op_ftruncate(self):
        fd = os.open(self.name(), os.O_RDWR)
        try:
            os.ftruncate(fd, self.rng.randrange(1 << 18))
        finally:
            os.close(fd)

    def op_link(self):
        os.link(self.name(), self.name())

    def op_scandir(self):
        # readdir + stat of every entry, as `ls -l` or a DataLoader's
        # file listing does, while the entries come and go.
        for d in range(DIRS):
            with os.scandir(os.path.join(self.mnt, f"d{d}")) as it:
                for entry in it:
                    try:
                        entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        self.shared.bump_expected(self.idx)

    def op_xattr(self):
        path = self.name()
        key = f"user.k{self.rng.randrange(4)}"
        what = self.rng.randrange(3)
        if what == 0:
            os.setxattr(path, key, self.blob(256))
        elif what == 1:
            os.getxattr(path, key)
        else:
            os.removexattr(path, key)

    def op_open_close_churn(self):
        path = self.name()
        for _ in range(self.rng.randint(1, 8)):
            os.close(os.open(path, os.O_RDONLY))

    def op_hold(self):
        # Open read-write and keep it; the oldest held fd is closed, so
        # closes land long after other workers unlinked or renamed the name.
        path = self.name()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.held.append((fd, path))
        if len(self.held) > HELD_MAX:
            self.close_held(0)

    def op_write_held(self):
        if self.held:
            fd, _ = self.rng.choice(self.held)
            os.pwrite(fd, self.blob(16384), self.rng.randrange(1 << 18))

    def op_close_held(self):
        if self.held:
            self.close_held(self.rng.randrange(len(self.held)))

    def close_held(self, i):
        fd, _ = self.held.pop(i)
        os.close(fd)

    def fail(self, what, e):
        sh = self.shared
        sh.failures[self.idx] += 1
        n = sh.failures[self.idx]
        if n <= PRINTED_FAILURES:
            say(f"FAIL worker {self.idx} (pid {os.getpid()}) {what}: {e!r}")
        if n == PRINTED_FAILURES:
            say(f"worker {self.idx}: more failures are counted, not printed")

    def run(self, weights):
        ops = sorted(weights)
        w = [weights[o] for o in ops]
        code = {o: i for i, o in enumerate(OPS)}
        sh = self.shared
        while not sh.stop.value:
            op = self.rng.choices(ops, w)[0]
            sh.current[self.idx] = code[op]
            try:
                getattr(self, "op_" + op)()
            except OSError as e:
                if e.errno in EXPECTED:
                    sh.bump_expected(self.idx)
                else:
                    self.fail(op, e)
                    if e.errno in MOUNT_GONE:
                        # The daemon died or the connection was aborted:
                        # every further operation fails the same way.
                        sh.progress[self.idx] += 1
                        return
            sh.progress[self.idx] += 1
        while self.held:
            try:
                self.close_held(0)
            except OSError as e:
                self.fail("close of a held fd", e)
            sh.progress[self.idx] += 1


# Operation -> base weight. Writers closing and unlinkers dominate: that
# overlap is where close, unlink and purge meet.
BASE_WEIGHTS = {
    "create_write": 6, "pwrite": 5, "append": 3, "write_close_burst": 8,
    "read": 3, "unlink": 8, "rename_same_dir": 3, "rename_any": 3,
    "exchange": 2, "truncate": 2, "ftruncate": 2, "link": 3, "scandir": 2,
    "xattr": 3, "open_close_churn": 4, "hold": 4, "write_held": 3,
    "close_held": 3, "tmpfile": 4,
}
OPS = sorted(BASE_WEIGHTS)
# Never left out by a worker's mix: without these nothing contends.
CORE_OPS = {"create_write", "write_close_burst", "unlink", "hold"}


def worker_weights(seed, idx):
    """The seed picks each worker's mix: some operations left out, others
    several times as frequent."""
    rng = random.Random(f"mix-{seed}-{idx}")
    weights = {}
    for op, base in BASE_WEIGHTS.items():
        factor = rng.choice([0, 0.5, 1, 1, 2, 4])
        if op in CORE_OPS:
            factor = max(factor, 1)
        if factor:
            weights[op] = base * factor
    return weights


class Shared:
    """Counters in shared memory, one slot per worker (no locks: each slot
    has one writer)."""

    def __init__(self, procs):
        self.progress = multiprocessing.RawArray("Q", procs)
        self.expected = multiprocessing.RawArray("Q", procs)
        self.failures = multiprocessing.RawArray("Q", procs)
        self.current = multiprocessing.RawArray("i", procs)
        self.stop = multiprocessing.RawValue("i", 0)

    def bump_expected(self, idx):
        self.expected[idx] += 1


def worker_main(idx, mnt, seed, shared, weights):
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        Worker(idx, mnt, seed, shared).run(weights)
    except BaseException:
        shared.failures[idx] += 1
        say(f"FAIL worker {idx} crashed:\n{traceback.format_exc()}")
        os._exit(1)
    os._exit(0)


def read_proc(path):
    try:
        with open(path) as f:
            return f.read().rstrip("\n")
    except OSError as e:
        return f"<{e.strerror}>"


def find_gdb():
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        p = os.path.join(d, "gdb")
        if os.access(p, os.X_OK):
            return p
    return None


def dump_daemon(pid):
    print(f"--- daemon (pid {pid}) threads ---", flush=True)
    gdb = find_gdb()
    if gdb:
        try:
            out = subprocess.run(
                [gdb, "-p", str(pid), "-batch", "-nx",
                 "-ex", "set pagination off",
                 "-ex", "set print frame-arguments none",
                 "-ex", "thread apply all bt"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, timeout=120, text=True,
                errors="replace")
            print(out.stdout, flush=True)
            if out.returncode == 0 and "Thread" in out.stdout:
                return
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"gdb failed: {e!r}", flush=True)
    else:
        print("gdb not installed: kernel stacks of the daemon's threads",
              flush=True)
    for task in sorted(glob.glob(f"/proc/{pid}/task/*"),
                       key=lambda p: int(os.path.basename(p))):
        print(f"thread {os.path.basename(task)} "
              f"{read_proc(task + '/comm')} "
              f"wchan={read_proc(task + '/wchan')}")
        print(read_proc(task + "/stack"))
    sys.stdout.flush()


def report_stall(procs, stuck, shown, shared, start, last_change,
                 daemon_pid):
    now = time.monotonic()
    for i in shown:
        p = procs[i]
        op = OPS[shared.current[i]]
        print(f"worker {i} (pid {p.pid}) no progress for "
              f"{now - last_change[i]:.0f}s after {shared.progress[i]} "
              f"operations, in {op}: wchan="
              f"{read_proc(f'/proc/{p.pid}/wchan')}")
        print(read_proc(f"/proc/{p.pid}/stack"))
    sys.stdout.flush()
    if daemon_pid:
        dump_daemon(daemon_pid)
    # Progress is sampled once a second.
    print(f"STALL: workers {stuck} made no progress; "
          f"ops so far={sum(shared.progress)}, the last one seen "
          f"{max(last_change) - start:.0f}s after the start", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mountpoint")
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--stall", type=float, default=30)
    ap.add_argument("--daemon-pid", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    mnt = args.mountpoint
    for d in range(DIRS):
        os.mkdir(os.path.join(mnt, f"d{d}"))
    for i in range(NAMES):
        path = os.path.join(mnt, f"d{i % DIRS}", f"f{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, os.urandom(4096))
        os.close(fd)

    ctx = multiprocessing.get_context("fork")
    shared = Shared(args.procs)
    procs = []
    print(f"stress: {args.procs} processes, {args.seconds:g}s, "
          f"stall after {args.stall:g}s, seed {args.seed}", flush=True)
    for i in range(args.procs):
        weights = worker_weights(args.seed, i)
        print(f"  worker {i}: " + " ".join(
            f"{op}={w:g}" for op, w in sorted(weights.items())))
        sys.stdout.flush()
        p = ctx.Process(target=worker_main,
                        args=(i, mnt, args.seed, shared, weights))
        p.start()
        procs.append(p)

    start = time.monotonic()
    last_seen = [0] * args.procs
    last_change = [start] * args.procs
    stopping_since = None
    while True:
        time.sleep(1)
        now = time.monotonic()
        if stopping_since is None and now - start >= args.seconds:
            shared.stop.value = 1
            stopping_since = now
        alive = []
        for i, p in enumerate(procs):
            n = shared.progress[i]
            if n != last_seen[i]:
                last_seen[i], last_change[i] = n, now
            if p.exitcode is None:
                alive.append(i)
        stuck = [i for i in alive if now - last_change[i] >= args.stall]
        if stopping_since is not None and now - stopping_since >= args.stall:
            # Told to stop and did not exit: stuck in its last operation.
            stuck = sorted(set(stuck) | set(alive))
        if stuck:
            shared.stop.value = 1
            # Show the others that stopped moving too, not only those that
            # reached the limit first.
            idle = min(args.stall, 5)
            shown = sorted(set(stuck) | {
                i for i in alive if now - last_change[i] >= idle})
            report_stall(procs, stuck, shown, shared, start, last_change,
                         args.daemon_pid)
            # Not joining the stuck workers (nor letting multiprocessing's
            # exit handler join them): they wait on the mount until the
            # caller aborts its FUSE connection.
            os._exit(3)
        if not alive:
            break

    for p in procs:
        p.join()
    ops = sum(shared.progress)
    expected = sum(shared.expected)
    failures = sum(shared.failures)
    for i, p in enumerate(procs):
        if p.exitcode != 0 and shared.failures[i] == 0:
            # Killed by a signal: nothing printed it yet.
            print(f"FAIL worker {i} (pid {p.pid}) exited with status "
                  f"{p.exitcode}", flush=True)
            failures += 1
    print(f"ops={ops} errors_expected={expected} failures={failures}",
          flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
