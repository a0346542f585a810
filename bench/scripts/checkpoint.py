#!/usr/bin/env python3
"""The torch.save pattern, timed step by step: write SIZE bytes to
DIR/NAME.tmp in 4 MiB writes, fsync it, rename it to DIR/NAME, fsync DIR.
Prints one JSON object: seconds for write, fsync, rename (with the
directory fsync) and total.

    checkpoint.py DIR SIZE_BYTES [NAME]
"""
import json
import os
import sys
import time


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    d, size = sys.argv[1], int(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) == 4 else "model.pt"
    block = os.urandom(4 << 20)
    tmp, final = os.path.join(d, name + ".tmp"), os.path.join(d, name)
    t0 = time.monotonic()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = size
    while left > 0:
        n = os.write(fd, block[: min(left, len(block))])
        left -= n
    t1 = time.monotonic()
    os.fsync(fd)
    os.close(fd)
    t2 = time.monotonic()
    os.rename(tmp, final)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    t3 = time.monotonic()
    print(json.dumps({"bytes": size, "write": t1 - t0, "fsync": t2 - t1, "rename": t3 - t2, "total": t3 - t0}))


if __name__ == "__main__":
    main()
