"""Device buffers and CUDA-event timing shared by the CUDA kernel benchmarks (bench_cuda_*.py), and
the whole-process pieces of the model benches (bench_cuda_flux.py, bench_cuda_dit.py): warm-up +
timed calls, and a child process's peak GPU memory by nvidia-smi."""
from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from sdrt.ops.tensor import Tensor


class CudaDev:
    """The cuda0 backend with the buffers a benchmark uploads or allocates (freed by free_all)."""

    def __init__(self, script: str):
        from sdrt.gpu import cuda
        if not cuda.available():
            sys.exit(f"{script}: no CUDA device ({cuda.unavailable_reason()})")
        from sdrt.gpu.cuda.driver import pycuda_driver
        import sdrt.gpu  # noqa: F401 - registers cuda0
        from sdrt.ops.backend import get_backend
        self.be = get_backend("cuda0")
        self.rt, self.mem, self.cuda = self.be.rt, self.be.memory, pycuda_driver()
        self.ptrs = []

    def put(self, t: Tensor):
        """Upload t's storage; the DevTensor of t in it."""
        from sdrt.gpu.cuda.devtensor import DevTensor
        raw = t.owner.storage
        ptr = self.mem.alloc(raw.nbytes)
        self.ptrs.append(ptr)
        self.mem.upload(ptr, raw)
        return DevTensor.of(t, ptr + t.offset)

    def out(self, t: Tensor):
        """A device buffer for t (an output); its DevTensor."""
        from sdrt.gpu.cuda.devtensor import DevTensor
        ptr = self.mem.alloc(t.nbytes)
        self.ptrs.append(ptr)
        return DevTensor.of(t, ptr)

    def fetch(self, dev, shape) -> np.ndarray:
        """The float32 values of the DevTensor `dev`, as a numpy array of `shape`."""
        host = np.empty(int(np.prod(shape)) * 4, np.uint8)
        self.mem.synchronize()
        self.mem.download(host, dev.ptr)
        return host.view(np.float32).reshape(shape)

    def free_all(self):
        self.mem.synchronize()
        for p in self.ptrs:
            self.mem.free(p)
        self.ptrs.clear()

    def time_ms(self, fn, repeat: int) -> float:
        """Median over 3 runs of the mean time of `repeat` back-to-back calls, by CUDA events."""
        fn()
        self.mem.synchronize()
        runs = []
        for _ in range(3):
            a, b = self.cuda.Event(), self.cuda.Event()
            a.record(self.rt.stream)
            for _ in range(repeat):
                fn()
            b.record(self.rt.stream)
            b.synchronize()
            runs.append(b.time_since(a) / repeat)
        return statistics.median(runs)


def torch_time_ms(fn, repeat: int) -> float:
    """PyTorch's side of a bench: median over 3 runs of the mean time of `repeat` back-to-back
    calls of fn, by torch CUDA events (one call first, to warm up)."""
    import torch
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(repeat):
            fn()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) / repeat)
    return statistics.median(runs)


def time_calls(fn, steps, sync=lambda: None):
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    for _ in range(2):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return dict(step_s=(time.perf_counter() - t0) / steps, first_call_s=first)


class GpuPeak(threading.Thread):
    """Peak of nvidia-smi's memory.used (MiB) while a child runs (0 without nvidia-smi)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    @staticmethod
    def used():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=5).stdout
            return int(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return 0

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.used())
            self.stop.wait(0.1)
