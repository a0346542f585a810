"""numpy memmap round trip on a converged mount, as training data loaders use it.

usage: memmap_roundtrip.py DIR write|check
"""
import os
import sys

import numpy as np

path = os.path.join(sys.argv[1], "features.npy")
shape = (1024, 1024)
expected = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape) * 0.5

if sys.argv[2] == "write":
    # Shared writable mapping: writes land in the page cache and reach the file.
    m = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
    m[:] = expected
    m[17, 3] = -1.0
    m.flush()
    del m
    # Update one row in place through a second r+ mapping.
    m = np.load(path, mmap_mode="r+")
    m[1000, :] = 7.0
    m.flush()
    del m
else:
    expected[17, 3] = -1.0
    expected[1000, :] = 7.0
    m = np.load(path, mmap_mode="r")
    assert m.shape == shape and m.dtype == np.float32, (m.shape, m.dtype)
    assert np.array_equal(m, expected), "memmap contents differ"
    print("memmap round trip ok")
