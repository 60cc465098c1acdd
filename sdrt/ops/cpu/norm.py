"""CPU kernels for softmax and the normalizations (Numba, one pass per statistic).

Inputs of any float dtype are widened to float32 (Numba has no fp16/bf16); statistics are
accumulated in float64 as ggml's ggml_float. Rows (or groups) are spread over threads with
prange.

Softmax and SiLU use `_util.exp32`, a float32 exp that vectorizes (LLVM's libm expf is a scalar
call: 2.4 ns/element here, no SVML; exp32 0.3 ns).
`fmax32` is llvm.maxnum, which LLVM vectorizes as a reduction where Numba's max() does not
(0.05 vs 0.54 ns/element). The kernels' fastmath flags leave out nnan/ninf on purpose: masks
are -inf and the kernels must compare with it.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..norm import group_bounds
from . import CPU
from ._util import as4d, exp32, f32_input, f32_output, store

FM = {"nsz", "arcp", "contract", "afn", "reassoc"}  # 'fast' minus nnan/ninf


@intrinsic
def fmax32(typingctx, a, b):
    """llvm.maxnum.f32: max ignoring NaN, vectorizable as a reduction."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.maxnum.f32")
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32), codegen


# ---- softmax --------------------------------------------------------------------------------
@njit(parallel=True, fastmath=FM, cache=True)
def _softmax4(x, mask, has_mask, scale, out):
    n3, n2, n1, n0 = out.shape
    m3, m2, m1 = mask.shape[0], mask.shape[1], mask.shape[2]
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        rx = x[i3, i2, i1]
        ro = out[i3, i2, i1]
        if has_mask:
            rm = mask[i3 % m3, i2 % m2, i1 if m1 > 1 else 0]
            for i in range(n0):
                ro[i] = rx[i] * scale + rm[i]
        else:
            for i in range(n0):
                ro[i] = rx[i] * scale
        m = np.float32(-np.inf)
        for i in range(n0):
            m = fmax32(m, ro[i])
        s = 0.0
        for i in range(n0):
            e = exp32(ro[i] - m)
            ro[i] = e
            s += e
        inv = np.float32(1.0 / s)  # a row of -inf: s == 0 -> inf -> 0*inf = NaN, as ggml
        for i in range(n0):
            ro[i] *= inv


def _float_node(node):
    return all(s.dtype.name in ("F32", "F16", "BF16") for s in node.src)


@CPU.register("softmax", supports=_float_node)
def _softmax(node, xs, out):
    x = as4d(f32_input(node.src[0], xs[0]))
    o = f32_output(node, out)
    if len(xs) == 2:
        mask = as4d(f32_input(node.src[1], xs[1]))
        if mask.shape[2] > 1:
            mask = mask[:, :, : x.shape[2]]
    else:
        mask = np.zeros((1, 1, 1, 1), np.float32)
    _softmax4(x, mask, len(xs) == 2, np.float32(node.params["scale"]), as4d(o))
    store(node, out, o)


# ---- row norms: 0 layer_norm, 1 rms_norm, 2 l2_norm ------------------------------------------
@njit(parallel=True, fastmath=FM, cache=True)
def _rownorm4(x, out, mode, eps, w, b, has_w, has_b):
    n3, n2, n1, n0 = out.shape
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        rx = x[i3, i2, i1]
        ro = out[i3, i2, i1]
        mean = np.float32(0.0)
        if mode == 0:
            s = 0.0
            for i in range(n0):
                s += rx[i]
            mean = np.float32(s / n0)
        s2 = 0.0
        for i in range(n0):
            v = rx[i] - mean
            s2 += v * v
        if mode == 2:
            sc = np.float32(1.0 / max(math.sqrt(s2), eps))
        else:
            sc = np.float32(1.0 / math.sqrt(s2 / n0 + eps))
        for i in range(n0):
            v = (rx[i] - mean) * sc
            if has_w:
                v *= w[i]
            if has_b:
                v += b[i]
            ro[i] = v


def _rownorm(node, xs, out):
    p = node.params
    x = as4d(f32_input(node.src[0], xs[0]))
    o = f32_output(node, out)
    mode = {"layer_norm": 0, "layer_norm_affine": 0, "rms_norm": 1, "l2_norm": 2}[node.op]
    wb = [np.ascontiguousarray(f32_input(s, a)).reshape(-1) for s, a in zip(node.src[1:], xs[1:])]
    has_w, has_b = p.get("has_w", False), p.get("has_b", False)
    w = wb[0] if has_w else np.zeros(1, np.float32)
    b = wb[-1] if has_b else np.zeros(1, np.float32)
    _rownorm4(x, as4d(o), mode, float(p["eps"]), w, b, has_w, has_b)
    store(node, out, o)


for _op in ("layer_norm", "layer_norm_affine", "rms_norm", "l2_norm"):
    CPU.register(_op, supports=_float_node)(_rownorm)


# ---- group norm -----------------------------------------------------------------------------
@njit(parallel=True, fastmath=FM, cache=True)
def _group_norm4(x, out, bounds, eps, w, b, affine, silu):
    # x, out: (N, C, H, W); one prange task per (sample, group)
    N, _, H, W = x.shape
    G = bounds.shape[0]
    for t in prange(N * G):
        n = t // G
        c0 = bounds[t % G, 0]
        c1 = bounds[t % G, 1]
        cnt = (c1 - c0) * H * W
        s = 0.0
        for c in range(c0, c1):
            for h in range(H):
                rx = x[n, c, h]
                for i in range(W):
                    s += rx[i]
        mean = np.float32(s / cnt)
        s2 = 0.0
        for c in range(c0, c1):
            for h in range(H):
                rx = x[n, c, h]
                for i in range(W):
                    v = rx[i] - mean
                    s2 += v * v
        rstd = np.float32(1.0 / math.sqrt(s2 / cnt + eps))
        for c in range(c0, c1):
            # y = x * a + d folds mean, rstd and the channel's affine into one multiply-add
            a = rstd * w[c] if affine else rstd
            d = b[c] - mean * a if affine else -mean * a
            for h in range(H):
                rx = x[n, c, h]
                ro = out[n, c, h]
                if silu:
                    for i in range(W):
                        v = rx[i] * a + d
                        ro[i] = v / (np.float32(1.0) + exp32(-v))
                else:
                    for i in range(W):
                        ro[i] = rx[i] * a + d


def _group_norm(node, xs, out):
    p = node.params
    x = as4d(f32_input(node.src[0], xs[0]))
    o = f32_output(node, out)
    bounds = np.array(group_bounds(x.shape[1], p["n_groups"]), np.int64)
    affine = node.op == "group_norm_affine"
    if affine:
        w, b = (np.ascontiguousarray(f32_input(s, a)).reshape(-1) for s, a in zip(node.src[1:], xs[1:]))
    else:
        w = b = np.zeros(1, np.float32)
    _group_norm4(x, as4d(o), bounds, float(p["eps"]), w, b, affine, bool(p.get("silu", False)))
    store(node, out, o)


for _op in ("group_norm", "group_norm_affine"):
    CPU.register(_op, supports=_float_node)(_group_norm)
