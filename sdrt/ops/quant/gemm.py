"""Quantized GEMM with int8 activations (the Cython/C kernel of `_qgemm.h`), chosen at run time.

`mul_mat` on the CPU multiplies Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K weights this way by
default, as ggml's CPU backend does: the activations are quantized to 8-bit blocks of 32 and
every block product is an exact integer sum, scaled in float32. For Q8_0, Q4_0, Q5_0 (ggml's
vec_dot_type Q8_0) and Q4_1, Q5_1 (Q8_1) the blocks are exactly ggml's quantize_row_q8_0 / q8_1
on x86: qx = round-half-even(x * (127 / amax)), the scale dx = amax / 127 stored as f16 (and
Q8_1's dx * sum(qx) as f16), so sdrt computes the products sd-cli's CPU backend computes, up to
the order of the float sums. The K-quants keep a float32 dx per 32 (ggml's Q8_K has one per 256).
The error against dequantize-then-matmul is the activation rounding alone: per element
|x - dx*qx| <= dx/2 (+ 127 * |dx - f16(dx)| with the f16 scale), so for one output
    |y - y_ref| <= sum over blocks of (that) * sum(|w|) (+ float32 summation error)
— `error_bound` computes it.

Code paths, picked from CPUID (through gcc's __builtin_cpu_supports, which also checks that the
OS saves the AVX-512 state): "avx512vnni" (vpdpbusd on 512-bit vectors, 4 rows x 32 columns a
step), "avx2" (vpmaddubsw + vpmaddwd, 1 row x 32 columns) and "scalar" (portable C). All three do
the same float operations in the same order on exact integer sums, so their results are
bit-identical; the scalar path is the reference model the tests hold the SIMD paths to.

`SDRT_QGEMM` (environment) or `set_path()` picks one: "auto" (the default: the fastest SIMD path
the CPU has; where it has neither, dequantize + BLAS), "avx512vnni", "avx2", "scalar", or "off" (dequantize tiles to float32 and multiply with
BLAS: exact float32 products of the dequantized weights, the path before this kernel).
"""
from __future__ import annotations


import numpy as np

from ...errors import OpError
from ..dtypes import DType
from ..kernel_choice import KernelChoice
from . import _q

PATHS = {"scalar": 0, "avx2": 1, "avx512vnni": 2}
_BEST_FIRST = ("avx512vnni", "avx2", "scalar")

_CHOICE = KernelChoice("SDRT_QGEMM", "quantized GEMM", PATHS)
set_path, using_path = _CHOICE.set, _CHOICE.using


def available_paths() -> tuple[str, ...]:
    """The code paths this CPU runs, fastest first."""
    if _q is None:
        return ()
    return tuple(p for p in _BEST_FIRST if _q.qgemm_path_available(PATHS[p]))


def active_path() -> str | None:
    """The path mul_mat uses now, or None for dequantize + BLAS."""
    return _CHOICE.pick(available_paths())


def supports(dt: DType, k: int) -> bool:
    """Whether weights of `dt` with rows of `k` elements go through the integer kernel."""
    return _q is not None and _q.qgemm_supported(dt.id) and k % 32 == 0 and k % dt.block_size == 0


def qgemm(x: np.ndarray, w: np.ndarray, dt: DType, out: np.ndarray, path: str, nthreads: int) -> None:
    """out[M, N] = x[M, K] @ dequant(w)^T, w raw [N, row_bytes]; x, out float32 with unit-stride rows."""
    if x.dtype != np.float32 or out.dtype != np.float32 or x.strides[1] != 4 or out.strides[1] != 4:
        raise OpError("qgemm: x and out must be float32 with contiguous rows")
    if out.shape != (x.shape[0], w.shape[0]) or w.shape[1] * dt.block_size != x.shape[1] * dt.type_size:
        raise OpError(f"qgemm: shapes x{x.shape} w{w.shape} out{out.shape} do not match for {dt.name}")
    _q.qgemm_into(x, w, dt.id, out, PATHS[path], max(1, int(nthreads)))


def error_bound(x: np.ndarray, w_deq: np.ndarray, f16_scale: bool = True) -> np.ndarray:
    """[M, N] bound on |qgemm - x @ w_deq^T| from the activation rounding (see the docstring),
    in float64, plus float32 summation slack. f16_scale: the block scale is stored as f16 (the
    Q8_0 / Q8_1 activations of the 32-block types), which adds 127 * |d - f16(d)| per element,
    |d - f16(d)| <= max(d * 2^-11, 2^-25)."""
    m, k = x.shape
    xb = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32)
    d = xb.max(axis=2) / 127.0                                # [M, KB]
    half = d / 2.0
    if f16_scale:
        half = half + 127.0 * np.maximum(d * 2.0 ** -11, 2.0 ** -25)
    wabs = np.abs(w_deq.astype(np.float64)).reshape(w_deq.shape[0], k // 32, 32).sum(axis=2)  # [N, KB]
    slack = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w_deq.astype(np.float64)).T)
    return half @ wabs.T * (1 + 1e-4) + slack
