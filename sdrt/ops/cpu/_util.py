"""Shared helpers for CPU kernels: 4-D views, float widening/narrowing, a vectorizable exp."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from ..convert import f32_to_raw, raw_to_f32


def as4d(x: np.ndarray) -> np.ndarray:
    """View with leading unit dims so every kernel sees (ne3, ne2, ne1, ne0)."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def f32_input(t, x: np.ndarray) -> np.ndarray:
    """float32 values of input `x` of tensor `t`: the view itself when already F32."""
    return x if t.dtype.name == "F32" else raw_to_f32(x, t.dtype)


def store(node, out: np.ndarray, values: np.ndarray) -> None:
    """Write float32 `values` into `out` in the node's dtype."""
    if node.dtype.name == "F32":
        if values is not out:
            out[...] = values
    else:
        out[...] = f32_to_raw(values, node.dtype).reshape(out.shape)


def f32_output(node, out: np.ndarray) -> np.ndarray:
    """A float32 array to compute into: `out` itself for F32 nodes, a scratch array otherwise."""
    return out if node.dtype.name == "F32" else np.empty(out.shape, np.float32)


def is_f32(*names):
    return lambda node: all(s.dtype.name in names for s in node.src)


@intrinsic
def _bits_as_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(fastmath={"nsz", "arcp", "contract", "afn", "reassoc"}, inline="always")
def exp32(x):
    """exp(x) in float32 arithmetic throughout (Cephes expf: reduction by ln 2, degree-6
    polynomial, |rel err| < 3e-7 on [-87.2, 88.3]): inf from ~88.37 up (expf's own overflow is
    at 88.72), exactly 0 below -87.3 and for NaN.
    Every intermediate stays float32 (np.floor keeps the type; math.floor would give an int64
    and pull the polynomial into float64), so LLVM vectorizes it 16 lanes wide: 0.30 vs 0.72
    ns per element for a math.floor form inside attention's softmax. Call it from kernels
    compiled without nnan/ninf (masks are -inf)."""
    xc = min(max(x, np.float32(-87.3)), np.float32(88.7))
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    v = p * _bits_as_f32((np.int32(n) + np.int32(127)) << np.int32(23))
    return v if x > np.float32(-87.3) else np.float32(0.0)
