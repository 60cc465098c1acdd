"""CUDA kernel functions run on the host, without a GPU: a kernel family's .cu compiled by g++ as
host code (CUDA's headers only for __half / __nv_bfloat16), and an `rt` whose launches run every
thread of the grid in turn (blockIdx / threadIdx set before each call) and whose GEMMs are
numpy's, with cuBLAS's column-major arguments. "Device" pointers are host addresses.

Threads run one after another, so a kernel that needs its block's threads at once (shared memory
with __syncthreads, warp shuffles, tensor-core PTX, compiled out on the host) cannot run here:
a launch that reaches __syncthreads raises NotEmulable. The families without any (conv, elementwise,
layout, position, quant, runtime) run whole; the GPU tests cover everything on a GPU.

    rt = HostRuntime()           # families built on first use (cached by the sources' hash)
    available()                  # False where g++ or CUDA's headers are missing (tests skip)
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
// the device's IEEE round-to-nearest operations (built with -ffp-contract=off: no fused multiply-adds)
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
#define __expf(x) expf(x)  // the device's fast exp, exact here (the tests' tolerances cover both)
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 blockIdx{0, 0, 0}, threadIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
static int emu_not_emulable = 0;
static inline void __syncthreads() { emu_not_emulable = 1; }
extern "C" void emu_set(unsigned bx, unsigned by, unsigned bz, unsigned tx, unsigned ty, unsigned tz,
                        unsigned gx, unsigned gy, unsigned gz, unsigned dx, unsigned dy, unsigned dz) {
    blockIdx = {bx, by, bz}; threadIdx = {tx, ty, tz}; gridDim = {gx, gy, gz}; blockDim = {dx, dy, dz};
}
extern "C" int emu_failed() { int f = emu_not_emulable; emu_not_emulable = 0; return f; }
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
        r = subprocess.run([gxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-w", f"-I{inc}", f"-I{KERNELS}",
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


def on_host(t):
    """The DevTensor of tensor `t` (a leaf or a view of one) at its host storage."""
    from sdrt.gpu.cuda.devtensor import DevTensor
    return DevTensor.of(t, t.owner.storage.ctypes.data + t.offset)


class NotEmulable(RuntimeError):
    """The kernel needs its block's threads at once (__syncthreads)."""


def available() -> bool:
    return cuda_include() is not None and shutil.which("g++") is not None


class HostRuntime:
    """The part of CudaRuntime that kernel functions use: fn, grid_for, scratch, begin_kernel,
    copy, cast, gemm."""

    def __init__(self):
        self.libs: dict[str, ctypes.CDLL] = {}
        self._keep = []
        self.launches: list[str] = []

    def _lib(self, module: str) -> ctypes.CDLL:
        if module not in self.libs:
            lib = build(module)
            if lib is None:
                raise NotEmulable("no g++ or CUDA headers here")
            lib.emu_set.argtypes = [ctypes.c_uint] * 12
            self.libs[module] = lib
        return self.libs[module]

    def fn(self, module: str, name: str, argtypes: str):
        lib = self._lib(module)
        f = getattr(lib, name)
        f.argtypes, f.restype = [_CTYPES[c] for c in argtypes], None

        def launch(grid, block, *args, shmem=0):
            self.launches.append(name)
            g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
            for bz in range(g[2]):
                for by in range(g[1]):
                    for bx in range(g[0]):
                        for tz in range(b[2]):
                            for ty in range(b[1]):
                                for tx in range(b[0]):
                                    lib.emu_set(bx, by, bz, tx, ty, tz, *g, *b)
                                    f(*args)
                        if lib.emu_failed():
                            raise NotEmulable(f"{module}.{name} synchronizes its block's threads")
        return launch

    def grid_for(self, n: int, block: int = 256) -> int:
        return max(1, min(-(-int(n) // block), 3))   # a few blocks: grid-stride loops wrap

    def scratch(self, nbytes: int) -> int:
        buf = np.zeros(int(nbytes) + 256, np.uint8)
        self._keep.append(buf)
        return -(-buf.ctypes.data // 256) * 256

    def begin_kernel(self) -> None:
        pass

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def cast(self, dst: int, dst_dtype: str, src: int, src_dtype: str, n: int) -> None:
        from sdrt.gpu.cuda.runtime import CudaRuntime
        CudaRuntime.cast(self, dst, dst_dtype, src, src_dtype, n)

    def gemm(self, transa, transb, m, n, k, a, a_dtype, lda, b, b_dtype, ldb, c, ldc, *, alpha=1.0, beta=0.0,
             c_dtype="F32", batch=1, stride_a=0, stride_b=0, stride_c=0, allow_tf32=False):
        """cuBLAS's column-major C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C, in float32 (with the
        leading-dimension checks cuBLAS makes)."""
        assert min(m, n, k) >= 0 and batch >= 1, (m, n, k, batch)
        assert lda >= max(1, k if transa else m) and ldb >= max(1, n if transb else k) and ldc >= max(1, m), \
            f"cuBLAS would refuse: m={m} n={n} k={k} lda={lda} ldb={ldb} ldc={ldc} transa={transa} transb={transb}"
        ea, eb, ec = (np.dtype(_NP[d]).itemsize for d in (a_dtype, b_dtype, c_dtype))
        for i in range(batch):
            # column-major X[r, c] with leading dimension ld is the row-major [c][r] array X^T
            A = host_view(a + i * stride_a * ea, _NP[a_dtype], (m, k) if transa else (k, m), (lda, 1))
            B = host_view(b + i * stride_b * eb, _NP[b_dtype], (k, n) if transb else (n, k), (ldb, 1))
            At = (A.T if transa else A).astype(np.float32)        # op(A)^T: [k][m]
            Bt = (B.T if transb else B).astype(np.float32)        # op(B)^T: [n][k]
            Ct = host_view(c + i * stride_c * ec, _NP[c_dtype], (n, m), (ldc, 1))
            prod = alpha * (Bt @ At)
            Ct[...] = (prod + beta * Ct.astype(np.float32)) if beta else prod
