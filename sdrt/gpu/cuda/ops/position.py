"""CUDA kernels for arange, timestep_embedding, rope and rope_ext (kernels/position.cu; CPU:
sdrt/ops/cpu/position.py).

The scalars the CPU computes once in numpy float32 (rope's theta scale, YaRN's corr dims and
attention factor, -ln(max_period)) are computed here the same way and passed as kernel
arguments, so the device arithmetic starts from bit-identical values. rope_ext builds its
(cos, sin) table in rt.scratch and rotates in a second launch. x may be any F32/F16/BF16 view;
outputs are the node's contiguous buffer, in x's dtype or, from F32, F16 (rope results that
fuse.half_nodes stores for the attention reading them). Each function only enqueues work on rt.stream.
"""
from __future__ import annotations

from functools import cache

import numpy as np

from ....ops.position import ROPE_MODES, _corr_dims
from ..devtensor import SUFFIX as FLOAT
from ..devtensor import kernel_dtypes
from ..table import CUDA

MODULE = "position"
BLOCK = 128
MAX_BLOCKS = 1 << 16


@cache
def _fn(rt, kernel: str, argtypes: str):
    return rt.fn(MODULE, kernel, argtypes)


def row_threads(n: int) -> int:
    """Threads for one row of n values: a multiple of 32 covering it, at most 256."""
    return min(256, max(32, (n + 31) // 32 * 32))


def _float_x(node) -> bool:
    return node.src[0].dtype.name in FLOAT


# ---- arange ------------------------------------------------------------------------------------
@CUDA.register("arange")
def _arange(node, xs, out, rt):
    p = node.params
    n = out.nelements
    _fn(rt, "arange_f32", "Pqff")((max(1, min(-(-n // BLOCK), MAX_BLOCKS)), 1, 1), (BLOCK, 1, 1),
                                  out.ptr, n, float(np.float32(p["start"])), float(np.float32(p["step"])))


# ---- timestep_embedding ------------------------------------------------------------------------
@CUDA.register("timestep_embedding", supports=_float_x)
def _timestep_embedding(node, xs, out, rt):
    t, = xs
    dim, max_period = node.params["dim"], node.params["max_period"]
    neg_log = float(-np.log(np.float32(max_period)))  # float32, as the CPU's freqs
    _fn(rt, f"timestep_embedding_{FLOAT[t.dtype.name]}", "PPqiif")(
        (t.ne[0], 1, 1), (row_threads(dim), 1, 1), t.ptr, out.ptr, t.nb[0], dim, dim // 2, neg_log)


# ---- rope (sd.cpp, precomputed pe) -------------------------------------------------------------
def _rope_ok(node) -> bool:
    return _float_x(node) and node.src[1].dtype.name == "F32"


PAIR_THREADS = 256   # kernels/position.cu rope_pe_pairs: a block of whole rows


def _pairs_path(x, pe, interleaved: bool) -> bool:
    """Whether rope_pe_pairs takes this rope: interleaved pairs covering all of D = 2P (P a power
    of two up to 256), x rows contiguous along D and pair-aligned, pe's 2x2 matrices contiguous
    floats on 16-byte boundaries."""
    D, P = x.ne[0], pe.ne[2]
    es = x.dtype.type_size
    return (interleaved and D == 2 * P and P & (P - 1) == 0 and P <= PAIR_THREADS and x.nb[0] == es
            and all(v % (2 * es) == 0 for v in (x.ptr, *x.nb[1:]))
            and pe.nb[0] == 4 and pe.nb[1] == 8 and pe.nb[2] == 16 and pe.ptr % 16 == 0 and pe.nb[3] % 16 == 0)


@CUDA.register("rope", supports=_rope_ok)
def _rope(node, xs, out, rt):
    x, pe = xs
    D, H, L, N = x.ne
    if _pairs_path(x, pe, bool(node.params["interleaved"])):
        rows, P = L * H * N, D // 2
        per = PAIR_THREADS // P
        grid = max(1, min(-(-rows // per), MAX_BLOCKS))
        _fn(rt, f"rope_pe_pairs_{kernel_dtypes(x, out)}", "PPPqqqi" + "q" * 5)(
            (grid, 1, 1), (PAIR_THREADS, 1, 1), x.ptr, pe.ptr, out.ptr, H, L, rows, P, *x.nb[1:], pe.nb[2], pe.nb[3])
        return
    _fn(rt, f"rope_pe_{kernel_dtypes(x, out)}", "PPP" + "q" * 12 + "i")(
        (L * H * N, 1, 1), (row_threads(D), 1, 1), x.ptr, pe.ptr, out.ptr, H, L, D, *x.nb, *pe.nb,
        pe.ne[2], int(node.params["interleaved"]))


# ---- rope_ext (ggml) ---------------------------------------------------------------------------
def _rope_ext_ok(node) -> bool:
    srcs = node.src
    return (_float_x(node) and srcs[1].dtype.name == "I32"
            and (len(srcs) < 3 or srcs[2].dtype.name == "F32"))


def rope_scalars(p: dict) -> tuple[float, float, float, float]:
    """(theta_scale, low, high, mscale) in float32, exactly as position.rope_cache computes them."""
    f = np.float32
    ts = np.power(f(p["freq_base"]), f(-2.0) / f(p["n_dims"]))
    low, high = _corr_dims(p["n_dims"], p["n_ctx_orig"], p["freq_base"], p["beta_fast"], p["beta_slow"])
    fs, ext, attn = f(p["freq_scale"]), f(p["ext_factor"]), f(p["attn_factor"])
    mscale = attn * (f(1) + f(0.1) * np.log(f(1) / fs)) if ext != 0 else attn
    return float(ts), float(low), float(high), float(f(mscale))


@CUDA.register("rope_ext", supports=_rope_ext_ok)
def _rope_ext(node, xs, out, rt):
    p = node.params
    x, pos = xs[0], xs[1]
    ff = xs[2] if len(xs) > 2 else None
    D, H, L, N = x.ne
    mode, n_dims = p["mode"], p["n_dims"]
    pairs = n_dims if mode == "vision" else n_dims // 2
    ts, low, high, mscale = rope_scalars(p)
    table = rt.scratch(2 * L * pairs * 4)  # cos then sin, [L, pairs] each
    _fn(rt, "rope_cache_f32", "PPPqqqiiiiiiffffff")(
        (-(-(L * pairs) // BLOCK), 1, 1), (BLOCK, 1, 1), pos.ptr, ff.ptr if ff else 0, table, L,
        pos.nb[0], ff.nb[0] if ff else 0, pairs, ROPE_MODES[mode], *p["sections"], ts, low, high,
        float(np.float32(p["freq_scale"])), float(np.float32(p["ext_factor"])), mscale)
    kind = {"normal": 0, "vision": 2}.get(mode, 1)
    _fn(rt, f"rope_rotate_{kernel_dtypes(x, out)}", "PPP" + "q" * 7 + "iiii")(
        (H * L * N, 1, 1), (row_threads(D), 1, 1), x.ptr, table, out.ptr, D, H, L, *x.nb,
        n_dims, p["n_offs"], kind, pairs)
