#!/usr/bin/env python3
"""Checkpoint saves under daemon kills.

    kill_loop.py DIR SECONDS [DATA_DIR KILL_EVERY]

Saves a 64 MiB checkpoint in DIR over and over for SECONDS, as training code
does (write DIR/ckpt.tmp, fsync, rename to DIR/ckpt, fsync DIR). With
DATA_DIR (a converged mount's data dir), the daemon serving DIR is killed
with SIGKILL every KILL_EVERY seconds, and the time from each kill until a
new daemon holds the data dir is measured.

Prints one JSON object: saves, mean seconds per save, errors the saving
loop met, and (with kills) each kill's replacement time in seconds.
"""
import json
import os
import signal
import sys
import threading
import time

CKPT = 64 << 20


def main():
    d, seconds = sys.argv[1], float(sys.argv[2])
    data = sys.argv[3] if len(sys.argv) > 3 else None
    every = float(sys.argv[4]) if len(sys.argv) > 4 else 3.0
    os.makedirs(d, exist_ok=True)
    block = os.urandom(1 << 20) * (CKPT >> 20)
    stop = threading.Event()
    saves, errors = [], []

    def save_loop():
        while not stop.is_set():
            t = time.monotonic()
            try:
                with open(os.path.join(d, "ckpt.tmp"), "wb") as f:
                    f.write(block)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(os.path.join(d, "ckpt.tmp"), os.path.join(d, "ckpt"))
                fd = os.open(d, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                saves.append(time.monotonic() - t)
            except OSError as e:
                errors.append(repr(e))
                time.sleep(0.1)

    def daemon():
        with open(os.path.join(data, "converged.lock")) as f:
            return int(f.read().strip())

    writer = threading.Thread(target=save_loop)
    writer.start()
    replaced = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(every, max(0.0, end - time.monotonic())))
        if data is None or time.monotonic() >= end:
            continue
        old = daemon()
        os.kill(old, signal.SIGKILL)
        t = time.monotonic()
        while True:
            try:
                pid = daemon()
                if pid != old and os.path.exists(f"/proc/{pid}"):
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() - t > 20:
                errors.append("no new daemon within 20 s")
                break
            time.sleep(0.002)
        replaced.append(round(time.monotonic() - t, 4))
    stop.set()
    writer.join()
    out = {"saves": len(saves), "mean_s": sum(saves) / max(1, len(saves)), "errors": errors[:5], "n_errors": len(errors)}
    if data is not None:
        out["replaced_s"] = replaced
    print(json.dumps(out))


if __name__ == "__main__":
    main()
