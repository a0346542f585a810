#!/usr/bin/env python3
"""Write a tar of many small files, the shape of an unpacked dataset shard.

    make_tree.py OUT.tar NFILES NDIRS

NFILES regular files of 1-4 KiB (random bytes, a fixed seed) spread evenly
over NDIRS directories, written straight into the archive.
"""
import io
import random
import sys
import tarfile


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    out, nfiles, ndirs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(42)
    with tarfile.open(out, "w") as tar:
        for d in range(ndirs):
            info = tarfile.TarInfo(f"tree/d{d:03}")
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for i in range(nfiles):
            data = rng.randbytes(rng.randint(1024, 4096))
            info = tarfile.TarInfo(f"tree/d{i % ndirs:03}/f{i:06}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
