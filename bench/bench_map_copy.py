"""Copying weights out of a file map, as a GPU upload's staging copies do (pageable -> pinned):
from a fresh map (a page fault per fault-around window) against a map whose pages were entered
into the page tables first (MADV_POPULATE_READ, what sdrt.engine.prefetch does ahead for a GPU
component), same run, page cache warm.

    python bench/bench_map_copy.py FILE [--gib 1.5] [--repeat 3]
"""
from __future__ import annotations

import argparse
import mmap
import os
import time

import numpy as np

CHUNK = 256 << 20


def copy_rate(a: np.ndarray, dst: np.ndarray, n: int) -> float:
    t = time.perf_counter()
    for off in range(0, n, CHUNK):
        m = min(CHUNK, n - off)
        np.copyto(dst[:m], a[off:off + m])
    return n / 2**30 / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--gib", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n = min(int(a.gib * 2**30), os.path.getsize(a.file)) // 4096 * 4096
    with open(a.file, "rb") as f:
        while f.read(64 << 20):            # the page cache warm, as in a second run
            pass
        dst = np.ones(CHUNK, np.uint8)
        print("| run | fresh map GiB/s | populate s | populated map GiB/s | ratio |\n|---:|---:|---:|---:|---:|")
        for r in range(a.repeat):
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            fresh = copy_rate(np.frombuffer(m, np.uint8), dst, n)
            m.close()
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            t = time.perf_counter()
            m.madvise(22, 0, n)            # MADV_POPULATE_READ (Linux 5.14)
            pop_s = time.perf_counter() - t
            populated = copy_rate(np.frombuffer(m, np.uint8), dst, n)
            m.close()
            print(f"| {r + 1} | {fresh:.2f} | {pop_s:.3f} | {populated:.2f} | {populated / fresh:.2f}x |")


if __name__ == "__main__":
    main()
