"""Read-ahead of memory-mapped weights: the file ranges a request will touch are handed to the
kernel (posix_fadvise WILLNEED, large sequential reads into the page cache) by a background
thread, in the order the pipeline uses them (text encoders, diffusion model, VAE).

Why: sdrt maps weight files and reads them lazily, page fault by page fault. On a cold page cache
that reads a 12 GB Flux file at ~190 MB/s here (the fault readahead window), inside the first
sampling step, where sd-cli reads the file up front at the disk's ~600 MB/s. The thread keeps
the lazy mapping (nothing is copied into the process: the pages go to the page cache, not to
this process's RSS) and overlaps the reads with the text encoders' compute.

A component computing on a GPU that keeps its weights is copied out of the map in one sweep when
uploaded (pageable -> pinned staging): its pages are instead entered into this process's page
tables ahead (madvise MADV_POPULATE_READ, Linux 5.14; reads what the page cache lacks), so that
the staging copies do not fault page by page (bench/bench_map_copy.py measures the difference).

A component is read ahead only while the bytes asked for so far fit in the memory the kernel
reports available at the start, less a margin: read-ahead that evicts the pages in use would
cost more than it saves. `SDRT_PREFETCH=0` turns it off.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

import numpy as np

from ..ops.threads import mem_available

log = logging.getLogger("sdrt")

CHUNK = 64 * 2**20
MARGIN = 2 * 2**30
MADV_POPULATE_READ = 22
# token embedding tables of the text encoders (CLIP, T5, the Qwen LLMs; HF and llama.cpp names):
# a prompt reads a few hundred rows of them by lookup, so reading a whole one ahead (Qwen3-4B's is
# 0.4 GB in Q8_0, first in its file) only delays the layers the encoder needs next
ROW_LOOKUP_TABLES = ("embed_tokens.weight", "token_embedding.weight", "shared.weight", "token_embd.weight")


def read_by_rows(name: str) -> bool:
    """Whether `name` is a token embedding table (left to page faults, not read ahead)."""
    return name.endswith(ROW_LOOKUP_TABLES)


def _mapped_paths() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's file maps (/proc/self/maps)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    lo, hi = (int(v, 16) for v in parts[0].split("-"))
                    out.append((lo, hi, int(parts[2], 16), parts[5].rstrip("\n")))
    except OSError:
        pass
    return out


def _mapped_spans(tensors) -> list[tuple[int, int]]:
    """(address, bytes) of the read-only mapped owners of `tensors`, each owner once."""
    from ..ops.tensor import Tensor
    out, seen = [], set()
    for t in tensors:
        o = t.owner
        if id(o) in seen:
            continue
        seen.add(id(o))
        st = Tensor.storage.__get__(o)          # the raw slot: never fills a lazily converted leaf
        if isinstance(st, np.memmap) and getattr(st, "mode", None) == "r" and o.span_bytes() > 0:
            out.append((st.ctypes.data + o.offset, o.span_bytes()))
    return out


def _merged(spans) -> list[tuple[int, int]]:
    """(lo, hi) ranges sorted, those closer than CHUNK/16 merged."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + CHUNK // 16:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def file_ranges(tensors) -> list[tuple[str, int, int]]:
    """(path, start, end) file byte ranges of the read-only mapped owners of `tensors`,
    in file order, adjacent ranges merged."""
    spans: dict[str, list[tuple[int, int]]] = {}
    maps = None
    for addr, size in _mapped_spans(tensors):
        maps = _mapped_paths() if maps is None else maps
        hit = next(((lo, off, path) for lo, hi, off, path in maps if lo <= addr < hi), None)
        if hit is not None:
            start = addr - hit[0] + hit[1]
            spans.setdefault(hit[2], []).append((start, start + size))
    return [(path, lo, hi) for path, rs in spans.items() for lo, hi in _merged(rs)]


def address_ranges(tensors) -> list[tuple[int, int]]:
    """(start, end) page-aligned address ranges of the read-only mapped owners of `tensors`, in
    address order, adjacent ranges merged."""
    page = mmap.PAGESIZE
    return _merged((addr // page * page, -(-(addr + size) // page) * page) for addr, size in _mapped_spans(tensors))


def _populate(ranges: list[tuple[int, int]], stop: threading.Event) -> bool:
    """Enter the pages of `ranges` into this process's page tables; False where the kernel
    cannot (no MADV_POPULATE_READ before Linux 5.14)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    for lo, hi in ranges:
        for a in range(lo, hi, CHUNK):
            if stop.is_set():
                return True
            if madvise(a, min(CHUNK, hi - a), MADV_POPULATE_READ) != 0:
                log.debug("read-ahead: no MADV_POPULATE_READ here (%s)", os.strerror(ctypes.get_errno()))
                return False
    return True


def _read_ahead(groups: list[tuple[str, list]], budget: int, stop: threading.Event, populate=()) -> None:
    """Each group's file ranges (path, lo, hi) into the page cache, or, for the components named in
    `populate`, its address ranges (lo, hi) into the page tables, in order, within `budget` bytes."""
    asked, can_populate = 0, True
    for name, ranges in groups:
        size = sum(r[-1] - r[-2] for r in ranges)
        if asked + size > budget:
            log.debug("read-ahead: %s (%.1f GB) left to page faults: %.1f GB available", name, size / 2**30,
                      budget / 2**30)
            return
        asked += size
        if name in populate:                      # address ranges: a component uploaded to a GPU
            can_populate = can_populate and _populate(ranges, stop)
            continue
        for path, lo, hi in ranges:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                for a in range(lo, hi, CHUNK):
                    if stop.is_set():
                        return
                    os.posix_fadvise(fd, a, min(CHUNK, hi - a), os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def start_read_ahead(groups: list[tuple[str, list]], populate=()) -> threading.Event | None:
    """Read ahead `groups` ([(component name, tensors)], in the order of use) on a daemon
    thread, the components named in `populate` into the page tables, the others into the page
    cache; returns an Event that stops it, or None when nothing is read ahead."""
    if os.environ.get("SDRT_PREFETCH", "1").strip() in ("0", "off", "no") or not hasattr(os, "posix_fadvise"):
        return None
    avail = mem_available()
    if avail is None:
        return None
    ranged = [(name, address_ranges(ts) if name in populate else file_ranges(ts)) for name, ts in groups]
    ranged = [(n, r) for n, r in ranged if r]
    if not ranged:
        return None
    stop = threading.Event()
    threading.Thread(target=_read_ahead, args=(ranged, avail - MARGIN, stop, populate), name="sdrt-read-ahead",
                     daemon=True).start()
    return stop
