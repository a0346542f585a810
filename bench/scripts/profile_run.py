#!/usr/bin/env python3
"""Run a command and say where its time went: what a converged mount's
daemon counted, and the CPU and context switches of the processes that
served it.

    profile_run.py OUT.json [--stats MNT] [--proc NAME=PATTERN ...] -- CMD [ARG ...]

--stats MNT   a converged mount: its daemon's counters (`user.converged.stats`
              of the mount's root) are read before and after; OUT gets the
              FUSE requests by operation (count, seconds), the metadata round
              trips charged to them, and etcd transactions (count, seconds)
--etcd URL    an etcd client URL (http://HOST:PORT): the requests it served
              meanwhile, from every client, by gRPC method (its /metrics),
              and the revisions before and after CMD (for --writes)
--proc NAME=PATTERN   processes whose command line matches PATTERN (as
              `pgrep -f`), all threads: CPU seconds (user + system) and
              context switches (voluntary and not) while CMD ran, as NAME
              (repeatable: the node's daemon, the other node's, etcd); the
              same by thread name too (`fuser-3` counted as `fuser`), as
              "threads", to say which of a daemon's threads spent it

CMD's own CPU (its children's rusage) is recorded as "cmd". Prints nothing
but errors; OUT is one JSON object:
    {"wall": s, "cpu": {NAME: s}, "switches": {NAME: n},
     "threads": {NAME: {THREAD: [s, n]}},
     "fuse": {op: [count, seconds]}, "trips": n, "etcd_txn": [count, seconds],
     "etcd_served": {method | "watch events": n}, "etcd_revisions": [first, last]}

    profile_run.py --writes OUT.json PREFIX

afterwards adds to OUT "etcd_writes": {"KIND put" | "KIND delete": n}, every
key etcd committed while CMD ran (from every client, background work
included), by record kind: the byte after PREFIX, the volume's key prefix
(`dev/` for `converged dev-cluster`), as metadata/src/schema.rs names them.
It replays etcd's history of those revisions with a watch, after the run,
so that counting them costs the run nothing; a history compacted since
leaves the count out.
"""
import base64
import json
import os
import re
import resource
import subprocess
import sys
import time
import urllib.request


def pids(pattern):
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split() if int(p) != os.getpid()]


def usage(pid_list):
    """CPU seconds (all threads) and context switches of these processes,
    and both by thread name (its digits dropped: `fuser-3` counts as
    `fuser`), as {name: [cpu, switches]}."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu, switches, threads = 0.0, 0, {}
    for pid in pid_list:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/comm") as f:
                    name = f.read().strip().rstrip("0123456789-") or "?"
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                t = threads.setdefault(name, [0.0, 0])
                t[0] += (int(fields[11]) + int(fields[12])) / tick
                with open(f"/proc/{pid}/task/{task}/status") as f:
                    for line in f:
                        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                            switches += int(line.split()[1])
                            t[1] += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return cpu, switches, threads


def stats(mnt):
    """FUSE op -> (count, ns), trips in all, etcd txn (count, ns)."""
    fuse, trips, txn = {}, 0, (0, 0)
    text = os.getxattr(mnt, "user.converged.stats").decode()
    for line in text.splitlines():
        f = line.split()
        if f[0] == "trips":
            trips += int(f[2])
        elif f[0] in ("fuse", "meta") and len(f) > 3:
            entry = (sum(int(c) for c in f[3:]), int(f[2]))
            if f[0] == "fuse":
                fuse[f[1]] = entry
            elif f[1] == "etcd_txn":
                txn = entry
    return fuse, trips, txn


def etcd_served(url):
    """Requests etcd served so far, by gRPC method (Range, Txn, ...), and
    under "watch events" the events it sent to every watcher."""
    served = {}
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            m = re.match(r'grpc_server_handled_total\{.*grpc_method="(\w+)".*\} (\S+)$', line)
            if m:
                served[m.group(1)] = served.get(m.group(1), 0) + int(float(m.group(2)))
            m = re.match(r'etcd_debugging_mvcc_events_total (\S+)$', line)
            if m:
                served["watch events"] = int(float(m.group(1)))
    return served


def etcd_post(url, path, body, timeout=10):
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), method="POST")
    return urllib.request.urlopen(req, timeout=timeout)


def etcd_revision(url):
    """etcd's current revision."""
    with etcd_post(url, "/v3/kv/range", {"key": base64.b64encode(b"\0").decode(), "limit": 1}) as r:
        return int(json.load(r)["header"]["revision"])


def etcd_writes(url, prefix, first, last):
    """Keys etcd committed at revisions first..=last, by record kind and
    put or delete; None when that history is compacted away."""
    every = base64.b64encode(b"\0").decode()
    body = {"create_request": {"key": every, "range_end": every, "start_revision": first}}
    counts, seen = {}, first - 1
    if last < first:
        return counts
    # etcd's gateway streams one JSON object per line.
    with etcd_post(url, "/v3/watch", body, timeout=60) as r:
        for line in r:
            result = json.loads(line).get("result", {})
            if result.get("compact_revision") or result.get("canceled"):
                return None
            for ev in result.get("events", []):
                kv = ev["kv"]
                rev = int(kv["mod_revision"])
                if rev > last:
                    return counts
                key = base64.b64decode(kv["key"])
                kind = chr(key[len(prefix)]) if key.startswith(prefix) and len(key) > len(prefix) else "other"
                what = f"{kind} {'delete' if ev.get('type') == 'DELETE' else 'put'}"
                counts[what] = counts.get(what, 0) + 1
                seen = rev
            if seen >= last:
                return counts
    return counts


def add_writes(out, prefix):
    with open(out) as f:
        result = json.load(f)
    first, last = result["etcd_revisions"]
    writes = etcd_writes(result["etcd_url"], prefix.encode(), first, last)
    if writes is None:
        print(f"profile_run: etcd compacted revisions {first}..{last}: no write count", file=sys.stderr)
        return
    result["etcd_writes"] = writes
    with open(out, "w") as f:
        json.dump(result, f)


def main():
    args = sys.argv[1:]
    if args[:1] == ["--writes"]:
        if len(args) != 3:
            sys.exit(__doc__)
        return add_writes(args[1], args[2])
    if "--" not in args or args.index("--") < 1:
        sys.exit(__doc__)
    cmd = args[args.index("--") + 1:]
    opts, out = args[1:args.index("--")], args[0]
    mnt, etcd, procs = None, None, {}
    while opts:
        o = opts.pop(0)
        if o == "--stats" and opts:
            mnt = opts.pop(0)
        elif o == "--etcd" and opts:
            etcd = opts.pop(0)
        elif o == "--proc" and opts and re.match(r"^[\w.-]+=.+", opts[0]):
            name, pattern = opts.pop(0).split("=", 1)
            procs[name] = pattern
        else:
            sys.exit(f"profile_run: unexpected argument {o!r}\n{__doc__}")
    if not cmd:
        sys.exit(__doc__)
    found = {name: pids(p) for name, p in procs.items()}
    for name, p in found.items():
        if not p:
            sys.exit(f"profile_run: no process matches {procs[name]!r} ({name})")
    before = {name: usage(p) for name, p in found.items()}
    s0 = stats(mnt) if mnt else None
    e0 = etcd_served(etcd) if etcd else None
    r0 = etcd_revision(etcd) if etcd else None
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    rc = subprocess.run(cmd).returncode
    wall = time.monotonic() - t0
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        sys.exit(f"profile_run: {' '.join(cmd)} exited {rc}")
    result = {"wall": wall, "cpu": {}, "switches": {}}
    result["cpu"]["cmd"] = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    result["switches"]["cmd"] = (kids1.ru_nvcsw + kids1.ru_nivcsw) - (kids0.ru_nvcsw + kids0.ru_nivcsw)
    result["threads"] = {}
    for name, p in found.items():
        cpu, sw, threads = usage(p)
        result["cpu"][name] = cpu - before[name][0]
        result["switches"][name] = sw - before[name][1]
        # A thread that ended meanwhile takes its counts with it: its
        # name's figures can read low, even below zero.
        was = before[name][2]
        result["threads"][name] = {
            t: [c - was.get(t, [0, 0])[0], n - was.get(t, [0, 0])[1]]
            for t, (c, n) in threads.items()
            if (c, n) != tuple(was.get(t, [0, 0]))
        }
    if mnt:
        s1 = stats(mnt)
        result["fuse"] = {op: [c - s0[0].get(op, (0, 0))[0], (ns - s0[0].get(op, (0, 0))[1]) / 1e9]
                          for op, (c, ns) in s1[0].items() if c != s0[0].get(op, (0, 0))[0]}
        result["trips"] = s1[1] - s0[1]
        result["etcd_txn"] = [s1[2][0] - s0[2][0], (s1[2][1] - s0[2][1]) / 1e9]
    if etcd:
        result["etcd_url"] = etcd
        result["etcd_revisions"] = [r0 + 1, etcd_revision(etcd)]
        e1 = etcd_served(etcd)
        result["etcd_served"] = {m: n - e0.get(m, 0) for m, n in e1.items() if n != e0.get(m, 0)}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
