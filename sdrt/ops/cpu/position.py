"""CPU kernels for arange, timestep_embedding, rope (sd.cpp pe form) and rope_ext (ggml).

The per-token angle tables of rope_ext are small (tokens x n_dims/2) and come from
`position.rope_cache` (ggml's float32 arithmetic); the kernels here rotate the rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..position import rope_cache
from . import CPU
from ._util import as4d, f32_input, f32_output, store
from .layout import threads_for


def _float_x(node):
    return node.src[0].dtype.name in ("F32", "F16", "BF16")


# ---- arange ------------------------------------------------------------------------------------
@njit(cache=True)
def _arange(start, step, out):  # serial: a parallel launch costs more than any real size
    for i in range(out.shape[0]):
        out[i] = start + step * np.float32(i)


@CPU.register("arange")
def _arange_kernel(node, xs, out):
    p = node.params
    _arange(np.float32(p["start"]), np.float32(p["step"]), out)


# ---- timestep embedding ------------------------------------------------------------------------
@njit(parallel=True, fastmath=True, cache=True)
def _tsemb(t, freqs, out):
    n, dim = out.shape
    half = freqs.shape[0]
    for i in prange(n):
        ts = t[i]
        ro = out[i]
        for j in range(half):
            arg = ts * freqs[j]
            ro[j] = math.cos(arg)
            ro[j + half] = math.sin(arg)
        for j in range(2 * half, dim):
            ro[j] = 0.0


@CPU.register("timestep_embedding", supports=_float_x)
def _tsemb_kernel(node, xs, out):
    dim, mp = node.params["dim"], node.params["max_period"]
    half = dim // 2
    f = np.float32
    # ggml: expf(-logf(max_period) * j / half), all float32
    freqs = np.exp(-np.log(f(mp)) * np.arange(half, dtype=f) / f(max(half, 1))).astype(f)
    t = np.ascontiguousarray(f32_input(node.src[0], xs[0]).reshape(-1))
    with threads_for(out.size):
        _tsemb(t, freqs, out)


# ---- rope (sd.cpp, precomputed pe) -------------------------------------------------------------
def flat_rows(x: np.ndarray):
    """(flat, strides): x's memory as a 1-D array starting at x[0,0,0,0] and the element
    strides of dims 0..2, with unit stride along the last dim (x is copied when it has not).
    Kernels index flat[base + i] so LLVM sees unit-stride rows even for strided views."""
    it = x.itemsize
    if x.strides[-1] != it or any(st < 0 or st % it for st in x.strides):
        x = np.ascontiguousarray(x)
    span = 1 + sum((n - 1) * st // it for n, st in zip(x.shape, x.strides))
    flat = np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(it,))
    return flat, np.array([st // it for st in x.strides[:3]], np.int64)


@njit(parallel=True, fastmath=True, cache=True)
def _rope_pe(xf, xs, H, pe, out, interleaved):
    # x [D, H, L, N] as flat memory + element strides xs (n, l, h); pe (L, R, 2, 2) C order;
    # out (H*N, L, D). One task per token: its pe row stays in L1 across the heads.
    HN, L, D = out.shape
    R = pe.shape[1]
    for r in prange((HN // H) * L):
        n = r // L
        l_ = r % L
        p = pe[l_]
        for h in range(H):
            base = np.uintp(n * xs[0] + l_ * xs[1] + h * xs[2])
            ro = out[n * H + h, l_]
            for i in range(2 * R, D):
                ro[i] = xf[base + np.uintp(i)]
            if interleaved:
                for i in range(R):
                    a = xf[base + np.uintp(2 * i)]
                    b = xf[base + np.uintp(2 * i + 1)]
                    ro[np.uintp(2 * i)] = a * p[i, 0, 0] + b * p[i, 0, 1]
                    ro[np.uintp(2 * i + 1)] = a * p[i, 1, 0] + b * p[i, 1, 1]
            else:
                for i in range(R):
                    a = xf[base + np.uintp(i)]
                    b = xf[base + np.uintp(i + R)]
                    ro[i] = a * p[i, 0, 0] + b * p[i, 0, 1]
                    ro[np.uintp(i + R)] = a * p[i, 1, 0] + b * p[i, 1, 1]


@CPU.register("rope", supports=_float_x)
def _rope_kernel(node, xs, out):
    x = as4d(f32_input(node.src[0], xs[0]))
    xf, st = flat_rows(x)
    o = f32_output(node, out)  # (H*N, L, D)
    pe = np.ascontiguousarray(as4d(xs[1]))
    with threads_for(o.size):
        _rope_pe(xf, st, x.shape[2], pe, o, node.params["interleaved"])
    store(node, out, o)


# ---- rope_ext (ggml) ---------------------------------------------------------------------------
@njit(parallel=True, fastmath=True, cache=True)
def _rope_rows(xf, xs, shape, cos, sin, out, n_dims, n_offs, kind):
    # x (N, L, H, D) as flat memory + element strides; out (N, L, H, D); cos/sin (L, pairs).
    # kind 0: pairs (o+2k, o+2k+1); 1: (o+k, o+k+n/2); 2 (vision): (k, k+n) over the head
    N, L, H, D = shape[0], shape[1], shape[2], shape[3]
    o = n_offs
    hf = n_dims // 2
    for r in prange(N * L):
        n = r // L
        l_ = r % L
        c = cos[l_]
        s = sin[l_]
        for h in range(H):
            base = np.uintp(n * xs[0] + l_ * xs[1] + h * xs[2])
            ro = out[n, l_, h]
            if kind == 2:
                for k in range(n_dims):
                    a = xf[base + np.uintp(k)]
                    b = xf[base + np.uintp(k + n_dims)]
                    ro[k] = a * c[k] - b * s[k]
                    ro[np.uintp(k + n_dims)] = a * s[k] + b * c[k]
                continue
            for i in range(o):
                ro[i] = xf[base + np.uintp(i)]
            for i in range(o + n_dims, D):
                ro[i] = xf[base + np.uintp(i)]
            if kind == 0:
                for k in range(hf):
                    a = xf[base + np.uintp(o + 2 * k)]
                    b = xf[base + np.uintp(o + 2 * k + 1)]
                    ro[np.uintp(o + 2 * k)] = a * c[k] - b * s[k]
                    ro[np.uintp(o + 2 * k + 1)] = a * s[k] + b * c[k]
            else:
                for k in range(hf):
                    a = xf[base + np.uintp(o + k)]
                    b = xf[base + np.uintp(o + k + hf)]
                    ro[np.uintp(o + k)] = a * c[k] - b * s[k]
                    ro[np.uintp(o + k + hf)] = a * s[k] + b * c[k]


@CPU.register("rope_ext", supports=_float_x)
def _rope_ext_kernel(node, xs, out):
    p = node.params
    x = as4d(f32_input(node.src[0], xs[0]))
    ff = xs[2].reshape(-1) if len(xs) > 2 else None
    cos, sin = rope_cache(xs[1], x.shape[1], p, ff)
    kind = {"normal": 0, "vision": 2}.get(p["mode"], 1)
    o = f32_output(node, out)
    xf, st = flat_rows(x)
    with threads_for(o.size):
        _rope_rows(xf, st, np.array(x.shape, np.int64), cos, sin, as4d(o), p["n_dims"], p["n_offs"], kind)
    store(node, out, o)
