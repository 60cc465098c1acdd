"""SimulatedDevice: the residency manager's device-memory contract on the host, for tests and
for trying budgets without a GPU (sdrt/engine/residency.py describes the contract)."""
from __future__ import annotations

import logging

import numpy as np

from ..errors import DeviceOutOfMemoryError
from .residency import ALIGN, _mb

__all__ = ["SimulatedDevice"]

log = logging.getLogger("sdrt")


class SimulatedDevice:
    """The device-memory contract on the host: a byte budget, a first-fit allocator, two streams
    as an event log. With `store=True` uploads copy into `mem`, and `view(ptr, n)` reads them back
    (tests run CPU kernels on these bytes). `used_elsewhere` bytes are taken by "other processes".
    With `caching=True` it behaves as the CUDA backend's CachingAllocator: sizes round to its
    classes, a freed block stays held in a per-class cache (reused by an allocation of its class,
    returned by `empty_cache()` or when an allocation would not fit otherwise); `peak_held` is
    the peak of what the device sees held (in use + cached), `peak_used` of what is in use. With
    `pinned_limit` it offers a pinned host pool of that many bytes (`pinned_pool`, as the CUDA
    backend's; its uploads are logged as "upload_pinned"); with `outside` it reports that many
    bytes held by the process outside its allocator (`outside_bytes`, as a CUDA context's)."""
    BASE = 1 << 20          # device addresses start here: 0 is never a valid pointer

    def __init__(self, total_bytes: int, name: str = "sim0", *, store: bool = True, used_elsewhere: int = 0,
                 caching: bool = False, base: int | None = None, pinned_limit: int | None = None,
                 outside: int | None = None):
        self.name, self.total, self.used_elsewhere = name, int(total_bytes), int(used_elsewhere)
        if base is not None:       # several devices in one process: disjoint address ranges
            self.BASE = int(base)
        self.mem = np.zeros(self.total, np.uint8) if store else None
        self.holes: list[tuple[int, int]] = [(0, self.total)]      # sorted free (offset, size)
        self.allocs: dict[int, int] = {}                           # ptr -> size
        self.caching = caching
        self.cache: dict[int, list[int]] = {}                      # size class -> freed ptrs
        self.cached = 0
        self.events: list[tuple] = []
        self.peak_used = 0
        self.peak_held = 0
        self._next_event = 0
        if pinned_limit is not None:
            self.pinned_pool = lambda: _HostPool(pinned_limit)
        if outside is not None:
            self.outside_bytes = lambda: outside

    @property
    def used(self) -> int:
        return sum(self.allocs.values())

    @staticmethod
    def round_size(nbytes: int) -> int:
        """The CUDA CachingAllocator's size classes: 512 B, then 1/8 of the power of two."""
        if nbytes <= 512:
            return 512
        g = max(512, 1 << (nbytes.bit_length() - 4))
        return (nbytes + g - 1) // g * g

    def mem_get_info(self) -> tuple[int, int]:
        return max(self.total - self.used - self.cached - self.used_elsewhere, 0), self.total

    def stats(self) -> dict:
        return {"in_use": self.used, "cached": self.cached}

    def _taken(self, ptr: int, nbytes: int) -> int:
        self.allocs[ptr] = nbytes
        used = self.used
        self.peak_used = max(self.peak_used, used)
        self.peak_held = max(self.peak_held, used + self.cached)
        self.events.append(("alloc", ptr, nbytes))
        return ptr

    def alloc(self, nbytes: int) -> int:
        nbytes = -(-int(nbytes) // ALIGN) * ALIGN
        if self.caching:
            nbytes = self.round_size(nbytes)
            bucket = self.cache.get(nbytes)
            if bucket:
                self.cached -= nbytes
                return self._taken(bucket.pop(), nbytes)
        for retry in (False, True):
            if self.used + self.cached + self.used_elsewhere + nbytes <= self.total:
                for i, (off, size) in enumerate(self.holes):
                    if size >= nbytes:
                        self.holes[i:i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                        return self._taken(self.BASE + off, nbytes)
            if retry or not self.cached:
                break
            self.empty_cache()          # as the CUDA allocator does when the driver is out of memory
        free, _ = self.mem_get_info()
        raise DeviceOutOfMemoryError(f"{self.name}: cannot allocate {_mb(nbytes)}: {_mb(free)} free of "
                                     f"{_mb(self.total)}")

    def free(self, ptr: int) -> None:
        size = self.allocs.pop(ptr)
        self.events.append(("free", ptr, size))
        if self.caching:
            self.cache.setdefault(size, []).append(ptr)
            self.cached += size
        else:
            self._release(ptr, size)

    def empty_cache(self) -> None:
        """Give every cached block back (the device's free memory grows)."""
        for size, ptrs in self.cache.items():
            for p in ptrs:
                self._release(p, size)
                self.events.append(("release", p, size))
        self.cache.clear()
        self.cached = 0

    def _release(self, ptr: int, size: int) -> None:
        self.holes.append((ptr - self.BASE, size))
        self.holes.sort()
        merged: list[tuple[int, int]] = []
        for o, n in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.holes = merged

    def _check_inside(self, ptr: int, nbytes: int) -> None:
        for p, n in self.allocs.items():
            if p <= ptr and ptr + nbytes <= p + n:
                return
        raise AssertionError(f"{self.name}: {nbytes} bytes at {ptr:#x} are not inside one allocation")

    def _event(self) -> int:
        self._next_event += 1
        return self._next_event

    def upload(self, ptr: int, host_u8: np.ndarray, stream: str = "compute") -> int:
        n = int(host_u8.nbytes)
        self._check_inside(ptr, n)
        if self.mem is not None:
            self.mem[ptr - self.BASE:ptr - self.BASE + n] = np.asarray(host_u8).reshape(-1).view(np.uint8)
        ev = self._event()
        self.events.append(("upload", stream, ptr, n, ev))
        return ev

    def upload_pinned(self, ptr: int, pinned_u8: np.ndarray, stream: str = "compute") -> int:
        ev = self.upload(ptr, pinned_u8, stream)
        self.events[-1] = ("upload_pinned",) + self.events[-1][1:]
        return ev

    def record(self, stream: str = "compute") -> int:
        ev = self._event()
        self.events.append(("record", stream, ev))
        return ev

    def wait(self, event, stream: str = "compute") -> None:
        self.events.append(("wait", stream, event))

    def synchronize(self) -> None:
        self.events.append(("sync",))

    def mark(self, label: str) -> None:
        """A test's own marker in the event log (e.g. where a segment's compute ends)."""
        self.events.append(("mark", label))

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        return self.mem[ptr - self.BASE:ptr - self.BASE + nbytes]


class _HostPool:
    """A pinned pool's contract on plain host arrays: copies until `limit` bytes are handed out."""

    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0

    def copy(self, host_u8: np.ndarray) -> np.ndarray | None:
        if self.used + host_u8.nbytes > self.limit:
            return None
        self.used += host_u8.nbytes
        return np.array(host_u8, np.uint8).reshape(-1)
