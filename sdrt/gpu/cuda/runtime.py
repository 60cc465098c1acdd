"""CudaRuntime: what a CUDA kernel function gets as `rt` (see docs/cuda.md), and DeviceMemory,
the backend's `be.memory` for the residency manager.

A kernel function only enqueues work on `rt.stream`: launches through `rt.fn(...)` Launchers,
GEMMs through `rt.gemm`, casts/fills/copies through `rt.cast`/`rt.fill`/`rt.copy`, temporary
device memory through `rt.scratch`. That is what lets the backend capture a whole graph's
launches into one CUDA graph.
"""
from __future__ import annotations

import logging
import time

from ...errors import OpError, UnsupportedError
from ...ops.threads import mem_available
from .cublas import Cublas
from .devtensor import SUFFIX as _SUFFIX
from .driver import CudaDevice, CudaDriverError, PinnedPool, StagingRing, pycuda_driver

log = logging.getLogger("sdrt.cuda")

DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
_ARGCHARS = set("Piqf")
BLOCK = 256
DEFAULT_SHARED = 48 * 1024


class ScratchOverflow(CudaDriverError):
    """rt.scratch needed more than its buffer while capturing (the backend reruns eagerly)."""


class Launcher:
    """One prepared kernel: `launcher(grid, block, *args, shmem=0)` enqueues it on rt.stream.
    grid/block are 1- to 3-tuples; args follow the argtypes string (P: device pointer as int,
    i: int32, q: int64, f: float32)."""

    __slots__ = ("name", "_func", "_fmt", "_rt", "_pack", "_shmem_ok")

    def __init__(self, rt: "CudaRuntime", func, argtypes: str, name: str):
        from pycuda._pvt_struct import pack
        self.name, self._func, self._fmt, self._rt, self._pack = name, func, argtypes, rt, pack
        self._shmem_ok = DEFAULT_SHARED

    def __call__(self, grid, block, *args, shmem: int = 0):
        if shmem > self._shmem_ok:
            self._allow_shared(shmem)
        try:
            buf = self._pack(self._fmt, *args)
        except Exception as e:  # struct.error, TypeError, OverflowError
            raise OpError(f"kernel {self.name}: arguments {args!r} do not match {self._fmt!r} ({e})") from e
        try:
            self._func._launch_kernel(tuple(grid), tuple(block), buf, shmem, self._rt.stream)
        except pycuda_driver().Error as e:
            raise CudaDriverError(f"kernel {self.name} grid={tuple(grid)} block={tuple(block)} "
                                  f"shmem={shmem}: {e}") from e

    def _allow_shared(self, shmem: int) -> None:
        info = self._rt.device
        if shmem > info.max_shared_per_block_optin:
            raise UnsupportedError(f"kernel {self.name}: {shmem} bytes of shared memory, {info.name} "
                                   f"allows {info.max_shared_per_block_optin}")
        cuda = pycuda_driver()
        self._func.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shmem)
        self._shmem_ok = shmem


class _Scratch:
    """A bump allocator over one device buffer, reset before each kernel function. The buffer
    grows (by at least 1/8) when a request does not fit, never while capturing; a replaced
    buffer stays alive until the kernel function that outgrew it returns, so every pointer handed
    out during one call stays valid."""

    ALIGN = 256

    def __init__(self, device: CudaDevice):
        self.device = device
        self.ptr, self.capacity, self.top = 0, 0, 0
        self.retired: list[int] = []

    def reset(self) -> None:
        self.top = 0
        if self.retired:
            for p in self.retired:   # stream order makes the reuse of these blocks safe
                self.device.allocator.free(p)
            self.retired.clear()

    def take(self, nbytes: int) -> int:
        n = -(-max(int(nbytes), 1) // self.ALIGN) * self.ALIGN
        if self.top + n > self.capacity:
            if self.device.capturing:
                raise ScratchOverflow(f"rt.scratch({nbytes}) during capture: {self.capacity - self.top} "
                                      f"of {self.capacity} bytes left")
            # what this call has taken so far, +1/8 (not doubled: the buffer is held for every
            # graph and counts against --max-vram; it only grows during the first, eager runs)
            new = -(-max(self.top + n, self.capacity + self.capacity // 8) // (1 << 20)) << 20
            if self.ptr:
                self.retired.append(self.ptr)
            self.ptr, self.capacity, self.top = self.device.allocator.alloc(new), new, 0
        p = self.ptr + self.top
        self.top += n
        return p


class CudaRuntime:
    """The `rt` of kernel functions; one per device."""

    def __init__(self, device: CudaDevice):
        self.dev = device
        self.device = device.info
        self.stream = device.compute
        self.memory = DeviceMemory(device)
        self._launchers: dict[tuple[str, str, str], Launcher] = {}
        self._scratch = _Scratch(device)
        self._cublas: Cublas | None = None

    # -- kernels -------------------------------------------------------------------------------
    def fn(self, module: str, kernel: str, argtypes: str) -> Launcher:
        key = (module, kernel, argtypes)
        launcher = self._launchers.get(key)
        if launcher is None:
            bad = set(argtypes) - _ARGCHARS
            if bad:
                raise OpError(f"rt.fn({module}.{kernel}): argtypes {argtypes!r} has {sorted(bad)}; use P, i, q, f")
            mod = self.dev.load_module(module)
            try:
                func = mod.get_function(kernel)
            except pycuda_driver().Error as e:
                raise UnsupportedError(f"CUDA kernel {kernel!r} is not in kernels/{module}.fatbin ({e})") from e
            launcher = self._launchers[key] = Launcher(self, func, argtypes, f"{module}.{kernel}")
        return launcher

    def grid_for(self, n: int, block: int = BLOCK) -> int:
        """Blocks for a grid-stride loop over n items: enough to fill the GPU, no more."""
        return max(1, min(-(-int(n) // block), self.device.sm_count * 32))

    # -- memory --------------------------------------------------------------------------------
    def scratch(self, nbytes: int) -> int:
        """A device region valid until the calling kernel function returns (256-B aligned)."""
        return self._scratch.take(nbytes)

    @property
    def scratch_capacity(self) -> int:
        return self._scratch.capacity

    def begin_kernel(self) -> None:
        """Called by the backend before each kernel function."""
        self._scratch.reset()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device-to-device copy on rt.stream."""
        if nbytes:
            self.dev.dtod_async(dst, src, nbytes, self.stream)

    def memset(self, dst: int, byte: int, nbytes: int) -> None:
        if nbytes:
            self.dev.memset_async(dst, byte, nbytes, self.stream)

    # -- casts, fills, GEMM ---------------------------------------------------------------------
    def cast(self, dst: int, dst_dtype: str, src: int, src_dtype: str, n: int) -> None:
        """Contiguous elementwise cast of n elements among F32/F16/BF16 (rounding as the CPU)."""
        for d in (dst_dtype, src_dtype):
            if d not in DTYPE_SIZES:
                raise UnsupportedError(f"rt.cast: {src_dtype} -> {dst_dtype}; casts are among F32/F16/BF16")
        if n <= 0:
            return
        if dst_dtype == src_dtype:
            self.copy(dst, src, n * DTYPE_SIZES[src_dtype])
            return
        k = self.fn("runtime", f"cast_{_SUFFIX[src_dtype]}_{_SUFFIX[dst_dtype]}", "PPq")
        k((self.grid_for(n),), (BLOCK,), dst, src, n)

    def fill(self, dst: int, dtype: str, value: float, n: int) -> None:
        """Set n contiguous F32/F16/BF16 elements to `value`."""
        if dtype not in DTYPE_SIZES:
            raise UnsupportedError(f"rt.fill: {dtype}; fills are for F32/F16/BF16")
        if n > 0:
            self.fn("runtime", f"fill_{_SUFFIX[dtype]}", "Pfq")((self.grid_for(n),), (BLOCK,), dst, float(value), n)

    def gemm_bias(self, transa: bool, transb: bool, m: int, n: int, k: int, a: int, a_dtype: str, lda: int,
                  b: int, b_dtype: str, ldb: int, c: int, ldc: int, bias: int, *, c_dtype: str = "F32",
                  residual: int | None = None, gelu: bool = False) -> None:
        """One GEMM with cuBLASLt's bias epilogue on rt.stream: column-major C[m,n] = op(A) op(B)
        + bias[m] (F32 bias) [+ the matrix at `residual`, laid out as C] [then GELU, tanh form].
        Raises UnsupportedError when cuBLASLt has no algorithm for it."""
        self.cublas.gemm_bias(self.stream, transa, transb, m, n, k, a, a_dtype, lda, b, b_dtype, ldb, c, ldc,
                              bias, c_dtype=c_dtype, residual=residual, gelu=gelu)

    def gemm_first_use(self) -> tuple[int, float, float]:
        """(new GEMM shapes, host seconds in cuBLASLt heuristics, host seconds of their first
        calls) so far (Cublas's counters; zeros before cuBLAS is loaded)."""
        c = self._cublas
        return (c.new_shapes, c.heuristic_s, c.first_call_s) if c is not None else (0, 0.0, 0.0)

    @property
    def cublas(self) -> Cublas:
        if self._cublas is None:
            t0 = time.perf_counter()
            self._cublas = Cublas(self.dev)
            log.debug("cuda%d: cuBLAS %d loaded, handle and workspace made in %.1f ms (device use %.0f MiB)",
                      self.dev.index, self._cublas.version, (time.perf_counter() - t0) * 1e3, self.dev.used_mib())
        return self._cublas

    def gemm(self, transa: bool, transb: bool, m: int, n: int, k: int, a: int, a_dtype: str, lda: int,
             b: int, b_dtype: str, ldb: int, c: int, ldc: int, *, alpha: float = 1.0, beta: float = 0.0,
             c_dtype: str = "F32", batch: int = 1, stride_a: int = 0, stride_b: int = 0, stride_c: int = 0,
             allow_tf32: bool = False) -> None:
        """cuBLAS GEMM in column-major terms on rt.stream (see cublas.py for the types).
        Row-major C[M,N] = A[M,K] B[K,N] is gemm(False, False, N, M, K, B, ldb=N, A, lda=K, C, ldc=N)."""
        self.cublas.gemm(self.stream, transa, transb, m, n, k, a, a_dtype, lda, b, b_dtype, ldb, c, ldc,
                         alpha=alpha, beta=beta, c_dtype=c_dtype, batch=batch, stride_a=stride_a,
                         stride_b=stride_b, stride_c=stride_c, allow_tf32=allow_tf32)


class DeviceMemory:
    """The device-memory object of the residency contract (`be.memory`): allocation from the
    caching allocator, uploads on the compute or copy stream (through pinned staging, or
    directly from a pinned pool), events."""

    def __init__(self, device: CudaDevice):
        self.device = device
        self.name = f"cuda{device.index}"
        self._rings: dict[str, StagingRing] = {}

    def mem_get_info(self) -> tuple[int, int]:
        return self.device.mem_get_info()

    def alloc(self, nbytes: int) -> int:
        self.device.activate()
        return self.device.allocator.alloc(nbytes)

    def free(self, ptr: int) -> None:
        self.device.activate()
        self.device.allocator.free(ptr)

    def _ring(self, stream: str, ring: str | None = None) -> StagingRing:
        key = ring or stream
        r = self._rings.get(key)
        if r is None:
            r = self._rings[key] = StagingRing(self.device, self.device.stream(stream))
        return r

    def pinned_pool(self) -> PinnedPool:
        """A pool of pinned host copies (the residency manager's, for --offload-to-cpu) holding at
        most half of the RAM available now; `upload_pinned` sends its copies."""
        self.device.activate()
        return PinnedPool(self.device, (mem_available() or 0) // 2)

    def upload(self, ptr: int, host_u8, stream: str = "compute", ring: str | None = None):
        """Host bytes -> device at ptr, enqueued on `stream`; returns an event that passes when
        the copy is done. The host array may change as soon as this returns. `ring` names a
        staging ring of its own (another thread's uploads; default: the stream's)."""
        self.device.activate()
        return self._ring(stream, ring).upload(ptr, host_u8)

    def staging_times(self) -> tuple[float, float]:
        """Seconds the host has spent, over every upload so far, copying into the pinned staging
        chunks and waiting for a chunk's DMA to end (for the upload log lines)."""
        return (sum(r.copy_s for r in self._rings.values()), sum(r.wait_s for r in self._rings.values()))

    def upload_pinned(self, ptr: int, pinned_u8, stream: str = "compute"):
        """upload() of a pinned_pool copy: one DMA, enqueued without waiting."""
        self.device.activate()
        self.device.htod_async(ptr, pinned_u8.ctypes.data, pinned_u8.nbytes, self.device.stream(stream))
        return self.device.event(stream)

    def download(self, host_u8, ptr: int, stream: str = "compute") -> None:
        """Device bytes at ptr -> host array (synchronous, after the stream's queued work)."""
        self.device.activate()
        self._ring(stream).download(host_u8, ptr)

    def record(self, stream: str = "compute"):
        self.device.activate()
        return self.device.event(stream)

    def wait(self, event, stream: str = "compute") -> None:
        """Make `stream` wait (on the device) until `event` has passed."""
        self.device.stream(stream).wait_for_event(event)

    def synchronize(self) -> None:
        self.device.synchronize()

    def stats(self) -> dict:
        return self.device.allocator.stats()

    def outside_bytes(self) -> int:
        """Device bytes the process holds outside the allocator (CudaDevice.outside_bytes)."""
        return self.device.outside_bytes()

    def empty_cache(self) -> None:
        self.device.activate()
        self.device.allocator.empty_cache()
