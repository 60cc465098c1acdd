"""The CUDA driver layer: device, primary context, streams, events, a caching device allocator,
pinned host staging and kernel modules.

pycuda is imported here, lazily (the first `CudaDevice`), so `import sdrt` never needs libcuda.
PyCUDA gives the context, streams, events, modules and launches; raw memory (device blocks,
pinned host buffers) and copies go through the driver API by ctypes, so a block is a plain int
address with no Python object whose destructor must run in a particular thread or context.

Threads: pycuda keeps a context stack per thread and aborts the process if a thread ends with a
context still pushed. `CudaDevice.activate()` pushes the device's primary context (one pycuda
Context object for all threads) in the calling thread once; the push is undone at thread end (a
thread-local finaliser) and, for the main thread, at interpreter exit.

Kernel modules: `load_module(name)` loads `kernels/<name>.fatbin` (built ahead by
tools/build_cuda_kernels.py, see there). When the fatbin is missing, stale against
manifest.json or has no code for this GPU and nvcc is on PATH, the .cu is compiled for this GPU
into a user cache (development only; a shipped package never needs nvcc).
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_ulonglong, c_void_p
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import DeviceOutOfMemoryError, SdrtError, UnsupportedError
from ...ops.threads import copy_into
from . import nvml

log = logging.getLogger("sdrt.cuda")

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
MANIFEST = KERNELS_DIR / "manifest.json"
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")   # SASS shipped in every fatbin
PTX_ARCH = "compute_90"                         # plus PTX the driver JITs on newer GPUs
# families built for one arch only (SASS, no PTX): Hopper's wgmma is sm_90a's; the direct conv's
# candidate block shapes are timed on Hopper GPUs
FAMILY_ARCHS = {"attention_sm90": (("sm_90a",), None), "conv3x3_sm90": (("sm_90",), None)}
NVCC_FLAGS = ("-O3", "-std=c++17")


class CudaDriverError(SdrtError):
    """A CUDA driver call failed (the message names the call and CUDA's error name)."""


# ---- the driver API through ctypes ----------------------------------------------------------
_SIGNATURES = {
    "cuInit": (c_uint,),
    "cuDeviceGetCount": (POINTER(c_int),),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuMemAlloc_v2": (POINTER(c_uint64), c_size_t),
    "cuMemFree_v2": (c_uint64,),
    "cuMemGetInfo_v2": (POINTER(c_size_t), POINTER(c_size_t)),
    "cuMemHostAlloc": (POINTER(c_void_p), c_size_t, c_uint),
    "cuMemFreeHost": (c_void_p,),
    "cuMemcpyHtoDAsync_v2": (c_uint64, c_void_p, c_size_t, c_void_p),
    "cuMemcpyDtoHAsync_v2": (c_void_p, c_uint64, c_size_t, c_void_p),
    "cuMemcpyDtoDAsync_v2": (c_uint64, c_uint64, c_size_t, c_void_p),
    "cuMemsetD8Async": (c_uint64, ctypes.c_ubyte, c_size_t, c_void_p),
    "cuStreamBeginCapture_v2": (c_void_p, c_int),
    "cuStreamEndCapture": (c_void_p, POINTER(c_void_p)),
    "cuStreamIsCapturing": (c_void_p, POINTER(c_int)),
    "cuGraphInstantiateWithFlags": (POINTER(c_void_p), c_void_p, c_ulonglong),
    "cuGraphLaunch": (c_void_p, c_void_p),
    "cuGraphExecDestroy": (c_void_p,),
    "cuGraphDestroy": (c_void_p,),
    "cuGraphGetNodes": (c_void_p, POINTER(c_void_p), POINTER(c_size_t)),
}
CUDA_ERROR_OUT_OF_MEMORY = 2
_LIBCUDA = None


# CUDA 11.2's stream-ordered pool: bound where the driver has it (CudaDevice.alloc_on_stream)
_OPTIONAL_SIGNATURES = {
    "cuMemAllocAsync": (POINTER(c_uint64), c_size_t, c_void_p),
    "cuMemFreeAsync": (c_uint64, c_void_p),
}


def bind_signatures(lib, signatures: dict) -> None:
    """Give each function `name` of the ctypes library its argtypes; every one returns a C int
    (a CUresult or cublasStatus_t)."""
    for name, args in signatures.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, c_int


def libcuda():
    """libcuda.so.1 with the signatures above (OSError when there is no driver)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        bind_signatures(lib, _SIGNATURES)
        bind_signatures(lib, {k: v for k, v in _OPTIONAL_SIGNATURES.items() if hasattr(lib, k)})
        _LIBCUDA = lib
    return _LIBCUDA


def error_name(code: int) -> str:
    s = c_char_p()
    if libcuda().cuGetErrorName(code, ctypes.byref(s)) == 0 and s.value:
        return s.value.decode()
    return f"CUDA error {code}"


def check(code: int, what: str) -> None:
    if code != 0:
        raise CudaDriverError(f"{what}: {error_name(code)} ({code})")


_PYCUDA = None


def pycuda_driver():
    """`pycuda.driver`, initialised (UnsupportedError saying why when it cannot be)."""
    global _PYCUDA
    if _PYCUDA is None:
        try:
            import pycuda.driver as cuda
        except ImportError as e:
            raise UnsupportedError(f"CUDA backend: pycuda cannot be imported ({e}); "
                                   "install it with `pip install sdrt[cuda]`") from e
        try:
            cuda.init()
        except cuda.Error as e:
            raise UnsupportedError(f"CUDA backend: cuInit failed ({e})") from e
        _PYCUDA = cuda
    return _PYCUDA


# ---- per-thread context binding ---------------------------------------------------------------
class _ThreadBinding:
    """The primary contexts this thread pushed on pycuda's stack; popped when the thread ends."""

    def __init__(self):
        self.pushed: list = []
        self.current: CudaDevice | None = None

    def release(self):
        while self.pushed:
            self.pushed.pop()
            try:
                _PYCUDA.Context.pop()
            except Exception:  # the driver may already be shut down at exit
                pass
        self.current = None

    def __del__(self):
        self.release()


_tls = threading.local()
_MAIN_BINDING: _ThreadBinding | None = None


def _binding() -> _ThreadBinding:
    b = getattr(_tls, "binding", None)
    if b is None:
        global _MAIN_BINDING
        b = _tls.binding = _ThreadBinding()
        if threading.current_thread() is threading.main_thread():
            _MAIN_BINDING = b
    return b


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    capability: tuple[int, int]     # compute capability (major, minor)
    sm_count: int
    total_memory: int               # bytes
    max_shared_per_block: int       # default dynamic+static limit (48 KiB)
    max_shared_per_block_optin: int  # what a kernel may opt into (227 KiB on sm_90)

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        return f"{self.name}, {self.total_memory / 2**30:.1f} GiB, {self.arch}"


class CudaDevice:
    """One GPU: its primary context, a compute and a copy stream, memory and kernel modules."""

    def __init__(self, index: int = 0):
        from . import wait_warm_up
        wait_warm_up(index)
        cuda = pycuda_driver()
        count = cuda.Device.count()
        if not 0 <= index < count:
            raise UnsupportedError(f"cuda{index}: no such device ({count} CUDA device(s) found)")
        self.index = index
        self._dev = cuda.Device(index)
        a = cuda.device_attribute
        self.info = DeviceInfo(
            index, self._dev.name(), tuple(self._dev.compute_capability()),
            self._dev.get_attribute(a.MULTIPROCESSOR_COUNT), self._dev.total_memory(),
            self._dev.get_attribute(a.MAX_SHARED_MEMORY_PER_BLOCK),
            self._dev.get_attribute(a.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
        self.lib = libcuda()
        self._modules: dict[str, object] = {}
        self._deferred: list = []
        self._deferred_lock = threading.Lock()
        self.capturing = False
        # the device's use before this process's context (the warm-up thread read it first)
        self._bus = self._dev.pci_bus_id()
        self._used_before = nvml.before_context(self._bus)
        # one pycuda Context object pushed by every thread: pycuda objects (streams, modules,
        # events) made in one thread can then be freed in another without "out-of-thread" errors
        self._ctx = self._dev.retain_primary_context()
        self.activate()
        free, total = self.mem_get_info()
        self._used_at_start = total - free      # outside_bytes' fallback without NVML
        # non-blocking streams: nothing on the legacy default stream can join a capture
        self.compute = cuda.Stream(flags=1)
        self.copy = cuda.Stream(flags=1)
        self.allocator = CachingAllocator(self)
        _DEVICES.append(self)

    def __repr__(self):
        return f"CudaDevice(cuda{self.index}: {self.info.describe()})"

    # -- context ----------------------------------------------------------------------------
    def activate(self) -> None:
        """Make this device's primary context current in the calling thread (cheap when it is)."""
        b = _binding()
        if b.current is not self:
            b.release()  # another device was current here: back to an empty stack first
            self._ctx.push()
            b.pushed.append(self._ctx)
            b.current = self
        if self._deferred:
            self.run_deferred()

    def defer(self, fn) -> None:
        """Run `fn()` later in a thread where this context is current (for finalisers, which may
        run in any thread)."""
        with self._deferred_lock:
            self._deferred.append(fn)

    def run_deferred(self) -> None:
        with self._deferred_lock:
            todo, self._deferred = self._deferred, []
        for fn in todo:
            try:
                fn()
            except Exception as e:  # a failed clean-up must not break the caller's work
                log.warning("cuda%d: deferred clean-up failed: %s", self.index, e)

    def stream(self, which: str = "compute"):
        if which == "compute":
            return self.compute
        if which == "copy":
            return self.copy
        raise ValueError(f"stream must be 'compute' or 'copy', got {which!r}")

    def event(self, stream="compute"):
        """An event recorded now on `stream` (no timing)."""
        cuda = _PYCUDA
        s = self.stream(stream) if isinstance(stream, str) else stream
        return cuda.Event(cuda.event_flags.DISABLE_TIMING).record(s)

    def synchronize(self) -> None:
        self.activate()
        self.compute.synchronize()
        self.copy.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        self.activate()
        free, total = c_size_t(), c_size_t()
        check(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def outside_bytes(self) -> int:
        """Device bytes this process holds outside its allocator: its context, cuBLAS's and the
        kernel modules' memory (what the device's use grew by since before the context, by NVML,
        less the allocator's blocks; another process's growth counts too, which only makes a budget
        stricter). Without NVML, the growth since the context was made (the context not counted)."""
        st = self.allocator.stats()
        now = nvml.used_bytes(self._bus) if self._used_before is not None else None
        if now is not None:
            grown = now - self._used_before
        else:
            free, total = self.mem_get_info()
            grown = total - free - self._used_at_start
        return max(0, grown - st["in_use"] - st["cached"])

    def used_mib(self) -> float:
        """MiB in use on the device (every process's, the driver's contexts too): for debug logs."""
        free, total = self.mem_get_info()
        return (total - free) / 2**20

    # -- copies (raw addresses; `stream` is a pycuda Stream) -----------------------------------
    def htod_async(self, dst: int, src_host_ptr: int, nbytes: int, stream) -> None:
        check(self.lib.cuMemcpyHtoDAsync_v2(dst, src_host_ptr, nbytes, stream.handle), "cuMemcpyHtoDAsync")

    def dtoh_async(self, dst_host_ptr: int, src: int, nbytes: int, stream) -> None:
        check(self.lib.cuMemcpyDtoHAsync_v2(dst_host_ptr, src, nbytes, stream.handle), "cuMemcpyDtoHAsync")

    def dtod_async(self, dst: int, src: int, nbytes: int, stream) -> None:
        check(self.lib.cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream.handle), "cuMemcpyDtoDAsync")

    def memset_async(self, dst: int, byte: int, nbytes: int, stream) -> None:
        check(self.lib.cuMemsetD8Async(dst, byte, nbytes, stream.handle), "cuMemsetD8Async")

    # -- one-off blocks that must not stay in the allocator's cache ---------------------------
    def alloc_on_stream(self, nbytes: int, stream) -> int | None:
        """A block from the driver's stream-ordered pool (cuMemAllocAsync on `stream`); after
        free_on_stream, the stream's next synchronisation gives it back to the driver (the default
        pool keeps nothing). None where the driver has no such pool or refuses."""
        f = getattr(self.lib, "cuMemAllocAsync", None)
        p = c_uint64()
        if f is None or f(ctypes.byref(p), nbytes, stream.handle) != 0:
            return None
        return p.value

    def free_on_stream(self, ptr: int, stream) -> None:
        check(self.lib.cuMemFreeAsync(ptr, stream.handle), "cuMemFreeAsync")

    # -- kernel modules ------------------------------------------------------------------------
    def load_module(self, name: str):
        """The pycuda Module of kernels/<name>.fatbin (cached per device)."""
        mod = self._modules.get(name)
        if mod is None:
            self.activate()
            t0 = time.perf_counter()
            mod = self._modules[name] = _load_module(self, name)
            log.debug("cuda%d: kernels/%s.fatbin loaded in %.1f ms (device use %.0f MiB)", self.index, name,
                      (time.perf_counter() - t0) * 1e3, self.used_mib())
        return mod

    def close(self) -> None:
        """Finish queued work and give memory back (at exit, or by tests)."""
        try:
            self.activate()
            self.synchronize()
            self.run_deferred()
            self.allocator.empty_cache()
        except Exception as e:
            log.debug("cuda%d: close: %s", self.index, e)


_DEVICES: list[CudaDevice] = []


@atexit.register
def _shutdown():
    for d in _DEVICES:
        d.close()
    if _MAIN_BINDING is not None:
        _MAIN_BINDING.release()


# ---- caching device allocator ------------------------------------------------------------------
class CachingAllocator:
    """Device memory in size classes kept on free lists after `free`, so a graph's arenas and
    scratch buffers come back without cuMemAlloc/cuMemFree (each of which synchronises the device).

    A size rounds up to 512 B, then to 1/8 of its power of two (≤ 12.5 % waste). A freed block
    records an event on the compute stream; when it is handed out again before that event has
    passed, the copy stream waits on it, so a prefetch on the copy stream never overwrites memory
    that queued compute work still reads. Compute-stream reuse is ordered by the stream itself.
    Thread-safe: a weight upload ahead (CudaBackend.upload_ahead) allocates beside a run.
    """

    def __init__(self, device: CudaDevice):
        self.device = device
        self._lock = threading.RLock()
        self._free: dict[int, list[tuple[int, object]]] = {}  # class size -> [(ptr, event)]
        self._live: dict[int, int] = {}                        # ptr -> class size
        self.in_use = 0
        self.peak = 0
        self.cached = 0
        self.allocations = 0   # cuMemAlloc calls (cache misses)

    @staticmethod
    def round_size(nbytes: int) -> int:
        if nbytes <= 512:
            return 512
        g = max(512, 1 << (nbytes.bit_length() - 4))
        return (nbytes + g - 1) // g * g

    @staticmethod
    def fit_size(nbytes: int) -> int:
        """A long-lived block's size: 512-B aligned, no size class (a weight is freed rarely and
        comes back at its own size; a class adds up to 1/8, hundreds of MiB over a DiT's weights)."""
        return max(512, -(-nbytes // 512) * 512)

    def alloc(self, nbytes: int, fit: bool = False) -> int:
        """A device block of at least nbytes; `fit`: sized for a long-lived block (fit_size)."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = self.fit_size(nbytes) if fit else self.round_size(nbytes)
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                ptr, ev = bucket.pop()
                self.cached -= size
                if ev is not None and not ev.query():
                    self.device.copy.wait_for_event(ev)
            else:
                ptr = self._cu_alloc(nbytes, size)
            self._live[ptr] = size
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
            return ptr

    def _cu_alloc(self, nbytes: int, size: int) -> int:
        dev = self.device
        if dev.capturing:
            raise CudaDriverError(f"cuda{dev.index}: device allocation of {nbytes} bytes during graph capture")
        dev.activate()
        p = c_uint64()
        res = dev.lib.cuMemAlloc_v2(ctypes.byref(p), size)
        if res == CUDA_ERROR_OUT_OF_MEMORY and self.cached:
            self.empty_cache()
            res = dev.lib.cuMemAlloc_v2(ctypes.byref(p), size)
        if res == CUDA_ERROR_OUT_OF_MEMORY:
            free, total = dev.mem_get_info()
            raise DeviceOutOfMemoryError(
                f"cuda{dev.index}: out of memory allocating {nbytes / 2**20:.1f} MiB; "
                f"{free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB, sdrt holds "
                f"{self.in_use / 2**20:.0f} MiB in use (peak {self.peak / 2**20:.0f} MiB)")
        check(res, f"cuMemAlloc({size})")
        self.allocations += 1
        return p.value

    def free(self, ptr: int) -> None:
        with self._lock:
            size = self._live.pop(ptr, None)
            if size is None:
                raise ValueError(f"cuda{self.device.index}: free of {ptr:#x}, which this allocator did not hand out")
            self.in_use -= size
            ev = None if self.device.capturing else self.device.event("compute")
            self._free.setdefault(size, []).append((ptr, ev))
            self.cached += size

    def empty_cache(self) -> None:
        """Give every cached (free) block back to the driver."""
        with self._lock:
            if not self.cached:
                return
            dev = self.device
            dev.activate()
            for bucket in self._free.values():
                for ptr, _ in bucket:
                    check(dev.lib.cuMemFree_v2(ptr), "cuMemFree")
            self._free.clear()
            self.cached = 0

    def stats(self) -> dict:
        return {"in_use": self.in_use, "peak": self.peak, "cached": self.cached,
                "blocks": len(self._live), "allocations": self.allocations}

    def reset_peak(self) -> None:
        self.peak = self.in_use


# ---- pinned host memory ------------------------------------------------------------------------
class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc), seen as a 1-D uint8 numpy array `.array`."""

    def __init__(self, device: CudaDevice, nbytes: int):
        device.activate()
        p = c_void_p()
        check(device.lib.cuMemHostAlloc(ctypes.byref(p), max(1, nbytes), 1), f"cuMemHostAlloc({nbytes})")
        self.device, self.ptr, self.nbytes = device, p.value, nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * max(1, nbytes)).from_address(self.ptr))[:nbytes]

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr, self.array = self.ptr, 0, None
            lib = self.device.lib
            self.device.defer(lambda: check(lib.cuMemFreeHost(ptr), "cuMemFreeHost"))

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class PinnedPool:
    """Pinned host copies of weights uploaded again and again (--offload-to-cpu, through the
    residency manager's): slabs of SLAB bytes from cuMemHostAlloc, handed out front to back and
    kept while the pool lives (freed with it), at most `limit` bytes in all."""

    SLAB = 256 << 20
    ALIGN = 256

    def __init__(self, device: CudaDevice, limit: int):
        self.device, self.limit = device, int(limit)
        self.slabs: list[PinnedBuffer] = []
        self.used = 0                   # bytes handed out, alignment included
        self._top = 0                   # next free byte of the last slab

    def copy(self, host_u8: np.ndarray) -> np.ndarray | None:
        """A pinned copy of `host_u8` (1-D uint8), or None when it would pass the limit."""
        n = host_u8.nbytes
        room = -(-n // self.ALIGN) * self.ALIGN
        if self.used + room > self.limit:
            return None
        if not self.slabs or self._top + room > self.slabs[-1].nbytes:
            try:
                slab = PinnedBuffer(self.device, max(room, min(self.SLAB, self.limit - self.used)))
            except CudaDriverError as e:    # the driver would pin no more: the rest stays pageable
                log.info("cuda%d: pinned host pool stops at %.1f MB (%s)", self.device.index, self.used / 2**20, e)
                self.limit = self.used
                return None
            self.slabs.append(slab)
            self._top = 0
        dst = self.slabs[-1].array[self._top:self._top + n]
        self._top += room
        self.used += room
        copy_into(dst, host_u8.reshape(-1).view(np.uint8))
        return dst


class StagingRing:
    """Two pinned chunks per stream for copies of pageable host data: the next chunk is filled
    (by ops.threads.copy_into's threads) while the previous one is in flight (host -> pinned ->
    device)."""

    CHUNK = 32 << 20
    copy_s = wait_s = 0.0       # host seconds copying into the chunks / waiting for a chunk's DMA

    def __init__(self, device: CudaDevice, stream):
        self.device, self.stream = device, stream
        self.bufs = [PinnedBuffer(device, self.CHUNK) for _ in range(2)]
        self.events: list = [None, None]
        self.turn = 0

    def upload(self, dst: int, host_u8: np.ndarray):
        """Enqueue host -> device; returns the event of the last chunk. `host_u8` may be reused
        once this returns (its bytes are already in pinned memory)."""
        n = host_u8.nbytes
        src = host_u8.reshape(-1).view(np.uint8)
        ev = None
        clock = time.perf_counter
        for start in range(0, n, self.CHUNK):
            m = min(self.CHUNK, n - start)
            k, self.turn = self.turn, self.turn ^ 1
            t0 = clock()
            if self.events[k] is not None:
                self.events[k].synchronize()
            t1 = clock()
            copy_into(self.bufs[k].array, src[start:start + m])
            self.wait_s += t1 - t0
            self.copy_s += clock() - t1
            self.device.htod_async(dst + start, self.bufs[k].ptr, m, self.stream)
            ev = self.events[k] = self.device.event(self.stream)
        return ev if ev is not None else self.device.event(self.stream)

    def download(self, host_u8: np.ndarray, src: int) -> None:
        """Device -> host, synchronous."""
        n = host_u8.nbytes
        dst = host_u8.reshape(-1).view(np.uint8)
        for start in range(0, n, self.CHUNK):
            m = min(self.CHUNK, n - start)
            k, self.turn = self.turn, self.turn ^ 1
            if self.events[k] is not None:
                self.events[k].synchronize()
            self.device.dtoh_async(self.bufs[k].ptr, src + start, m, self.stream)
            self.device.event(self.stream).synchronize()
            dst[start:start + m] = self.bufs[k].array[:m]
            self.events[k] = None


# ---- kernel modules ------------------------------------------------------------------------------
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def source_digest(cu: Path) -> str:
    """sha256 over a .cu source and, recursively, the local ("...") headers it includes."""
    h, seen, todo = hashlib.sha256(), set(), [cu]
    while todo:
        p = todo.pop(0)
        if p in seen or not p.exists():
            continue
        seen.add(p)
        data = p.read_bytes()
        h.update(p.name.encode() + b"\0" + data + b"\0")
        todo += [p.parent / m for m in _INCLUDE.findall(data.decode("utf-8", "replace"))]
    return h.hexdigest()


def read_manifest() -> dict:
    try:
        return json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return {}


def find_nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def family_archs(family: str) -> tuple[tuple[str, ...], str | None]:
    """(SASS archs, PTX arch or None) that kernel family `family` ships."""
    return FAMILY_ARCHS.get(family, (ARCHS, PTX_ARCH))


def gencode_flags(archs, ptx_arch: str | None) -> list[str]:
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a[3:]},code={a}"]
    if ptx_arch:
        flags += ["-gencode", f"arch={ptx_arch},code={ptx_arch}"]
    return flags


def compile_fatbin(nvcc: str, cu: Path, out: Path, archs, ptx_arch: str | None = PTX_ARCH) -> None:
    """nvcc `cu` into the fatbin `out` (atomically); CudaDriverError with nvcc's output on failure."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [nvcc, "-fatbin", *NVCC_FLAGS, *gencode_flags(archs, ptx_arch), "-I", str(cu.parent),
           "-o", str(tmp), str(cu)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CudaDriverError(f"nvcc failed for {cu.name}:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    tmp.replace(out)


def _dev_cache_dir() -> Path:
    d = os.environ.get("SDRT_CUDA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sdrt", "cuda")
    return Path(d)


def _load_module(device: CudaDevice, name: str):
    cuda = _PYCUDA
    cu, fat = KERNELS_DIR / f"{name}.cu", KERNELS_DIR / f"{name}.fatbin"
    entry = read_manifest().get(name)
    why = None
    if not fat.exists():
        why = f"{fat.name} is missing"
    elif cu.exists() and (entry is None or entry.get("sha256") != source_digest(cu)):
        why = f"{fat.name} is stale ({cu.name} changed since it was built)"
    else:
        try:
            return cuda.module_from_buffer(fat.read_bytes())
        except cuda.Error as e:
            why = f"{fat.name} does not load on {device.info.arch} ({e})"
    nvcc = find_nvcc()
    if nvcc is None or not cu.exists():
        if fat.exists():
            log.warning("cuda: %s and no nvcc to rebuild it; using it as it is", why)
            try:
                return cuda.module_from_buffer(fat.read_bytes())
            except cuda.Error as e:
                raise UnsupportedError(f"CUDA kernels {name!r}: {fat.name} does not load on "
                                       f"{device.info.describe()} ({e})") from e
        raise UnsupportedError(f"CUDA kernels {name!r}: {why}, and no nvcc to build {cu.name}")
    arch = device.info.arch
    own = family_archs(name)[0]
    if own != ARCHS:   # an arch-specific family: its own arch for this GPU, or none
        arch = next((a for a in own if a.rstrip("a") == arch), None)
        if arch is None:
            raise UnsupportedError(f"CUDA kernels {name!r} exist for {', '.join(own)} only, "
                                   f"not {device.info.describe()}")
    out = _dev_cache_dir() / f"{name}-{source_digest(cu)[:16]}-{arch}.fatbin"
    if not out.exists():
        log.warning("cuda: %s; compiling %s for %s with nvcc (development only: run "
                    "tools/build_cuda_kernels.py to ship it)", why, cu.name, arch)
        out.parent.mkdir(parents=True, exist_ok=True)
        compile_fatbin(nvcc, cu, out, (arch,), None)
    return cuda.module_from_buffer(out.read_bytes())
