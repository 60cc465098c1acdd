"""Device buffers and CUDA-event timing shared by the CUDA kernel benchmarks (bench_cuda_*.py)."""
from __future__ import annotations

import statistics
import sys

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
