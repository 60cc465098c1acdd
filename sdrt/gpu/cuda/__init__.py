"""The CUDA backend (NVIDIA GPUs through PyCUDA, cuBLAS by ctypes, CUDA graphs); docs/cuda.md.

This package's __init__ imports nothing heavy: `available()` and `devices()` probe the driver
through ctypes and import pycuda only when a driver and a device exist. Importing it registers
the backend ("cuda0", "cuda1", ...) with sdrt.ops.backend, whose `get_backend("cuda0")` makes
it (sdrt.gpu.cuda.backend). Layout: infrastructure here (driver, runtime, cublas, cudagraph,
devtensor, fuse, quant decoding, table, naming), op families in ops/, kernel sources in kernels/.
"""
from __future__ import annotations

import ctypes
import importlib.util

from ...ops.backend import register_backend

_REASON: list = []   # [reason or None], probed once


def unavailable_reason() -> str | None:
    """None when a CUDA device can be used, else why not (never raises)."""
    if not _REASON:
        _REASON.append(_probe())
    return _REASON[0]


def _probe() -> str | None:
    try:
        if importlib.util.find_spec("pycuda") is None:
            return "pycuda is not installed (pip install 'sdrt[cuda]')"
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
        res = lib.cuInit(0)
        if res != 0:
            return f"cuInit failed with CUDA error {res} (no usable GPU or driver)"
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return "no CUDA device found"
        from .driver import pycuda_driver
        pycuda_driver()
    except Exception as e:  # an ImportError of a broken pycuda, an UnsupportedError, ...
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """True when pycuda imports, the driver loads and at least one CUDA device exists."""
    return unavailable_reason() is None


def devices() -> list[tuple[str, str]]:
    """[(name, description)] such as ("cuda0", "NVIDIA H200, 139.8 GiB, sm_90"); [] without CUDA."""
    if not available():
        return []
    from .driver import pycuda_driver
    cuda = pycuda_driver()
    out = []
    for i in range(cuda.Device.count()):
        d = cuda.Device(i)
        major, minor = d.compute_capability()
        out.append((f"cuda{i}", f"{d.name()}, {d.total_memory() / 2**30:.1f} GiB, sm_{major}{minor}"))
    return out


_WARM: dict[int, dict[str, float]] = {}   # device index -> {phase: time.perf_counter() when it ended}
_WARM_THREADS: dict[int, object] = {}     # device index -> its warm-up thread


def warm_up(index: int) -> None:
    """cuInit and device `index`'s primary context made on a daemon thread through ctypes, which
    releases the GIL, so the driver's start-up (~0.3 s) overlaps the caller's imports and file
    reading; pycuda's retain then finds the context made (this retain is kept for the process).
    Its phases' times are in `warm_up_report` (the backend's debug log)."""
    import threading
    import time

    def run():
        from .nvml import before_context
        stamps = _WARM.setdefault(int(index), {"start": time.perf_counter()})
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            ok = lib.cuInit(0) == 0
            stamps["cuInit"] = time.perf_counter()
            if ok and lib.cuDeviceGet(ctypes.byref(dev), int(index)) == 0:
                bus = ctypes.create_string_buffer(32)
                if lib.cuDeviceGetPCIBusId(bus, len(bus), dev) == 0:
                    before_context(bus.value.decode())      # the device's use without our context
                stamps["NVML"] = time.perf_counter()
                lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
                stamps["context"] = time.perf_counter()
        except Exception:   # noqa: BLE001  (an optimisation only: the device's first use reports)
            pass
    t = _WARM_THREADS[int(index)] = threading.Thread(target=run, name="sdrt-cuda-warm-up", daemon=True)
    t.start()


def wait_warm_up(index: int) -> None:
    """Wait for device `index`'s warm-up thread, if one runs, without holding the GIL (pycuda's
    calls that would wait for the driver's start-up inside hold it, stalling every other thread)."""
    t = _WARM_THREADS.get(int(index))
    if t is not None:
        t.join()


def warm_up_report(index: int, asked: float) -> str:
    """'started 600 ms before, cuInit 412 ms, NVML 31 ms, context 58 ms; ready 120 ms after ...' for warm_up(index)'s
    phases against `asked` (the perf_counter time the backend was asked for), or why not."""
    stamps = dict(_WARM.get(int(index), {}))
    if not stamps:
        return "no warm-up thread ran"
    prev = stamps.pop("start")
    parts = [f"started {(asked - prev) * 1e3:.0f} ms before"]
    for phase, t in stamps.items():
        parts.append(f"{phase} {(t - prev) * 1e3:.0f} ms")
        prev = t
    late = (prev - asked) * 1e3
    return ", ".join(parts) + (f"; ready {late:.0f} ms after the backend was asked for"
                                                  if late > 0 else f"; ready {-late:.0f} ms before it was asked for")


def _make(index: int):
    from .backend import get
    return get(index)


def _kernels():
    from ..device_backend import import_families
    from . import ops
    from .table import CUDA
    import_families(ops)
    return CUDA


register_backend("cuda", _make, devices, unavailable_reason=unavailable_reason, kernels=_kernels, warm_up=warm_up)
