#!/usr/bin/env python3
"""How long one small durable write takes on a disk, back to back and after a pause.

    sync_latency.py DIR [PAUSE_US] [N]

Writes 4 KiB into a scratch file in DIR and `fdatasync`s it, N times (2,000)
back to back, then N times with PAUSE_US microseconds (500) of sleep before
each, and prints one JSON object: {"back_to_back_us": ..., "paused_us": ...,
"pause_us": ...}, each the mean of one write + fdatasync.

Every metadata commit on etcd ends in such a sync (etcd's write-ahead log),
and so does a peer's copy at close. A sequential client (one process making
files) never sends its next commit back to back: the FUSE requests of a
create come between. Where the sync after a pause costs more than one that
follows another at once (on this project's test host, a VM's virtual disk:
about 160 us against 45-70 us after 500 us asleep), etcd answers such a
client more slowly than its own back-to-back rate says, by about that much.
"""
import json
import os
import sys
import time


def mean_sync(fd, n, pause_s):
    block = b"\x5a" * 4096
    total = 0.0
    for i in range(n):
        if pause_s:
            time.sleep(pause_s)
        t0 = time.perf_counter()
        os.pwrite(fd, block, (i % 256) * 4096)
        os.fdatasync(fd)
        total += time.perf_counter() - t0
    return total / n * 1e6


def main():
    if len(sys.argv) < 2 or len(sys.argv) > 4:
        sys.exit(__doc__)
    d = sys.argv[1]
    try:
        pause_us = int(sys.argv[2]) if len(sys.argv) > 2 else 500
        n = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    except ValueError:
        sys.exit("sync_latency.py: PAUSE_US and N must be integers")
    if pause_us < 0 or n < 1:
        sys.exit("sync_latency.py: PAUSE_US must be >= 0 and N >= 1")
    path = os.path.join(d, ".sync-latency-probe")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, b"\0" * 256 * 4096, 0)
        os.fsync(fd)
        mean_sync(fd, 100, 0)  # warm: the file's blocks allocated and written once
        back = mean_sync(fd, n, 0)
        paused = mean_sync(fd, n, pause_us / 1e6)
    finally:
        os.close(fd)
        os.unlink(path)
    print(json.dumps({"back_to_back_us": round(back), "paused_us": round(paused), "pause_us": pause_us}))


if __name__ == "__main__":
    main()
