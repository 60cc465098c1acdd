"""CUDA kernel functions run on the host, without a GPU: a kernel family's .cu compiled by g++ as
host code (CUDA's headers only for __half / __nv_bfloat16), and an `rt` whose launches call those
functions once with one thread (blockIdx = threadIdx = 0, blockDim = gridDim = 1) and whose GEMMs
are numpy's, with cuBLAS's column-major arguments. "Device" pointers are host addresses.

It runs what a one-thread launch can run: the grid-stride kernels (their loops then walk every
item in order). Kernels that split work by blockIdx/threadIdx, synchronize or use tensor-core PTX
(compiled out on the host) are not covered; the GPU tests cover everything on a GPU.

    lib = build("conv")          # None where g++ or CUDA's headers are missing (tests skip)
    rt = HostRuntime(lib)
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

KERNELS = Path(__file__).resolve().parent.parent / "sdrt" / "gpu" / "cuda" / "kernels"

_PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 blockIdx{0, 0, 0}, threadIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
"""


def cuda_include() -> Path | None:
    """The directory holding cuda_fp16.h (CUDA_HOME, CUDA_ROOT, nvcc's toolkit, /usr/local/cuda)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_ROOT")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    roots.append("/usr/local/cuda")
    for r in filter(None, roots):
        if (Path(r) / "include" / "cuda_fp16.h").exists():
            return Path(r) / "include"
    return None


def build(family: str) -> ctypes.CDLL | None:
    """kernels/<family>.cu as a host shared library (cached by the sources' hash), or None."""
    inc, gxx = cuda_include(), shutil.which("g++")
    if inc is None or gxx is None:
        return None
    sources = sorted(KERNELS.glob("*.cu*"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + _PRELUDE.encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"sdrt_cuda_emu_{family}_{digest}.so"
    if not out.exists():
        src = out.with_suffix(".cpp")
        src.write_text(_PRELUDE + f'#include "{family}.cu"\n')
        tmp = out.with_name(out.name + f".{os.getpid()}")
        r = subprocess.run([gxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-w", f"-I{inc}", f"-I{KERNELS}",
                            str(src), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"host build of {family}.cu failed:\n{r.stderr[-3000:]}")
        tmp.replace(out)
    return ctypes.CDLL(str(out))


_CTYPES = {"P": ctypes.c_void_p, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float}
_NP = {"F32": np.float32, "F16": np.float16}


def host_view(ptr: int, dtype, shape, strides) -> np.ndarray:
    """A numpy view of host memory at `ptr` (strides in elements)."""
    dt = np.dtype(dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
    buf = (ctypes.c_char * max(span * dt.itemsize, 1)).from_address(ptr)
    flat = np.frombuffer(buf, dt)
    return np.lib.stride_tricks.as_strided(flat, shape, [s * dt.itemsize for s in strides])


class HostRuntime:
    """The part of CudaRuntime that the emulated kernel functions use: fn, grid_for, scratch,
    begin_kernel, gemm."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self._keep = lib, []
        self.launches: list[str] = []

    def fn(self, module: str, name: str, argtypes: str):
        f = getattr(self.lib, name)
        f.argtypes, f.restype = [_CTYPES[c] for c in argtypes], None

        def launch(grid, block, *args, shmem=0):
            self.launches.append(name)
            f(*args)
        return launch

    def grid_for(self, n: int, block: int = 256) -> int:
        return 1

    def scratch(self, nbytes: int) -> int:
        buf = np.zeros(int(nbytes) + 256, np.uint8)
        self._keep.append(buf)
        return -(-buf.ctypes.data // 256) * 256

    def begin_kernel(self) -> None:
        pass

    def gemm(self, transa, transb, m, n, k, a, a_dtype, lda, b, b_dtype, ldb, c, ldc, *, alpha=1.0, beta=0.0,
             c_dtype="F32", batch=1, stride_a=0, stride_b=0, stride_c=0, allow_tf32=False):
        """cuBLAS's column-major C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C, in float32."""
        assert not transa and not transb
        ea, eb, ec = (np.dtype(_NP[d]).itemsize for d in (a_dtype, b_dtype, c_dtype))
        for i in range(batch):
            # column-major A[m, k] with lda is the row-major [k][m] array At; C^T = B^T A^T
            At = host_view(a + i * stride_a * ea, _NP[a_dtype], (k, m), (lda, 1)).astype(np.float32)
            Bt = host_view(b + i * stride_b * eb, _NP[b_dtype], (n, k), (ldb, 1)).astype(np.float32)
            Ct = host_view(c + i * stride_c * ec, _NP[c_dtype], (n, m), (ldc, 1))
            prod = alpha * (Bt @ At)
            Ct[...] = (prod + beta * Ct.astype(np.float32)) if beta else prod
