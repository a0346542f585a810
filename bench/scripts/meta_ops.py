#!/usr/bin/env python3
"""Metadata operation rates in one directory, from P processes at once.

    meta_ops.py [--spread] DIR NFILES PROCS [STATS_PATH]

Phases, each timed from the moment every process is ready to the last one's
end: create (open O_CREAT + close of an empty file), first stat after create
(no cache dropped: what the kernel kept from the create, or a round trip),
cached stat (the same names again), unlink. From one process in one
directory, also a stat of each name 11 s after the cached stat ("late
stat"), once the kernel's attributes (10 s) have expired: the daemon answers,
from its own cache or from the metadata service. Files are named p<j>-<i>, all in
DIR, so processes share one parent directory as an unpacking job does; with
--spread each process works in a directory of its own (DIR/j<j>), as shard
writers do. (The kernel serialises creates and unlinks within one directory
of one mount, so only --spread shows what parallel clients can reach.)

With STATS_PATH (a path on a converged mount), the daemon's own counters
(`user.converged.stats`) are read around each phase, and the metadata round
trips (etcd requests) charged to FUSE operations are printed per file.

Prints one JSON object: {"create": {"ops_s": ..., "trips_per_op": ...}, ...}.
"""
import json
import multiprocessing as mp
import os
import sys
import time

from profile_run import stats as daemon_stats


def trips(stats_path):
    """Metadata round trips charged to FUSE operations so far, in total."""
    if not stats_path:
        return None
    return daemon_stats(stats_path)[1]


def work(phase, d, j, n, procs, ready, go):
    names = [os.path.join(d, f"p{j}-{i}") for i in range(j, n, procs)]
    ready.wait()
    go.wait()
    if phase == "create":
        for p in names:
            os.close(os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
    elif phase in ("first_stat", "cached_stat", "late_stat"):
        for p in names:
            os.stat(p)
    elif phase == "unlink":
        for p in names:
            os.unlink(p)


def run(phase, d, n, procs, stats_path, spread):
    ready, go = mp.Barrier(procs + 1), mp.Barrier(procs + 1)
    dirs = [os.path.join(d, f"j{j}") if spread else d for j in range(procs)]
    ps = [mp.Process(target=work, args=(phase, dirs[j], j, n, procs, ready, go)) for j in range(procs)]
    for p in ps:
        p.start()
    ready.wait()
    before = trips(stats_path)
    t0 = time.monotonic()
    go.wait()
    for p in ps:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"meta_ops: a {phase} process failed (exit {p.exitcode})")
    secs = time.monotonic() - t0
    out = {"ops_s": n / secs, "seconds": secs}
    if stats_path:
        out["trips_per_op"] = (trips(stats_path) - before) / n
    return out


def main():
    args = sys.argv[1:]
    spread = bool(args) and args[0] == "--spread"
    if spread:
        args = args[1:]
    if len(args) not in (3, 4):
        sys.exit(__doc__)
    d, n, procs = args[0], int(args[1]), int(args[2])
    stats_path = args[3] if len(args) == 4 else None
    os.makedirs(d, exist_ok=True)
    for j in range(procs if spread else 0):
        os.makedirs(os.path.join(d, f"j{j}"), exist_ok=True)
    res = {}
    phases = ["create", "first_stat", "cached_stat", "unlink"]
    if procs == 1 and not spread:
        phases.insert(3, "late_stat")
    for phase in phases:
        if phase == "late_stat":
            time.sleep(11)
        res[phase] = run(phase, d, n, procs, stats_path, spread)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
