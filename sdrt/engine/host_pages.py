"""The host side of weights read from a model file's memory map: whether a storage is a read-only
file map, dropping this process's pages of one, and `HostPageRelease`, the residency object of a
component computing on the CPU with `--params-backend disk` (the device side: engine/residency.py)."""
from __future__ import annotations

import mmap

import numpy as np

__all__ = ["HostPageRelease", "read_only_file_map", "release_file_pages"]


def read_only_file_map(storage) -> bool:
    """True for a read-only map of a model file (its bytes never change while it is open)."""
    return isinstance(storage, np.memmap) and getattr(storage, "mode", None) == "r"


def release_file_pages(storage: np.ndarray, start: int, nbytes: int) -> bool:
    """Drop this process's pages of a read-only file map (they are re-read from the page cache or
    the file on the next access). Anything else (RAM arrays, writable maps) is left alone."""
    if not read_only_file_map(storage) or nbytes <= 0:
        return False
    mm = getattr(storage, "_mmap", None)
    if not isinstance(mm, mmap.mmap) or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    base = np.frombuffer(mm, np.uint8).ctypes.data
    lo = storage.ctypes.data + start - base
    hi = lo + nbytes
    page = mmap.PAGESIZE
    lo -= lo % page
    hi = min(-(-hi // page) * page, len(mm))
    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return True


def _leaf_owners(leaves) -> list:
    seen, out = set(), []
    for t in leaves:
        o = t.owner
        if o.op is None and id(o) not in seen:
            seen.add(id(o))
            out.append(o)
    return out


class HostPageRelease:
    """The residency object of a component that computes on the CPU with `--params-backend disk`:
    after each segment, the file pages of its disk weights are dropped (compute reads the map)."""

    def __init__(self):
        self._disk: set[int] = set()
        self._seg: dict[int, list] = {}
        self.released_bytes = 0

    def register(self, tensors, component: str = "", params: str = "disk") -> None:
        if params == "disk":
            for t in (tensors.values() if hasattr(tensors, "values") else tensors):
                self._disk.add(id(t.owner))

    def manages(self, leaf) -> bool:
        return False

    def begin_segment(self, index: int, name, leaves) -> None:
        self._seg[index] = [o for o in _leaf_owners(leaves) if id(o) in self._disk]

    def end_segment(self, index: int) -> None:
        for o in self._seg.pop(index, ()):
            if release_file_pages(o.storage, o.offset, o.span_bytes()):
                self.released_bytes += o.span_bytes()
