"""CPU kernels for upscale, pad, concat and repeat.

Data movement copies raw storage viewed as unsigned ints of the element size, so
F16/BF16/F8/I32 move bit-exact and one compiled kernel serves every 4-byte type. Pad (every
mode) and nearest upscale are one gather kernel: each output index along each dim maps to a
source index (or -1 = fill), computed per axis in numpy (tiny vectors); the longest plain run
of dim 0 is copied as a block. Repeat copies whole source rows; concat copies whole blocks
below the concat dim when a source is contiguous.

Bilinear/bicubic/antialiased resampling is separable: per axis a table of K source taps and
weights (ggml's float32 coordinate formulas), then per output row a vertical pass into a
row buffer and a horizontal pass out of it.
"""
from __future__ import annotations

from contextlib import contextmanager

import numba
import numpy as np
from numba import njit, prange

from ..convert import f32_to_raw
from . import CPU
from ._util import as4d, f32_input, f32_output, store

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _raw(x: np.ndarray) -> np.ndarray:
    """The same memory as unsigned ints of the element size (zero copy, any strides)."""
    return x.view(_UINT[x.dtype.itemsize])


SMALL = 1 << 15  # elements below which a kernel runs on the calling thread only


@contextmanager
def threads_for(n_elements: int):
    """Run small kernels on one thread: waking the OpenMP workers costs more than the work
    (measured 2-4 ms per launch on this loaded 2-core machine, 2 us on one thread)."""
    if n_elements >= SMALL:
        yield
        return
    prev = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(prev)


def _non_block(node):
    return not node.dtype.is_quantized and all(not s.dtype.is_quantized for s in node.src)


# ---- gather (pad, repeat, nearest) -------------------------------------------------------------
@njit(inline="always")
def _gather_span(rx, m0, start, stop, f, ro):
    for i in range(start, stop):
        j = m0[i]
        if j >= 0:
            ro[i] = rx[np.uintp(j)]  # unsigned index: no negative-index wraparound code
        else:
            ro[i] = f


@njit(parallel=True, cache=True)
def _gather4(x, m3, m2, m1, m0, lo, hi, off, fill, out):
    # out[i3,i2,i1,i0] = x[m3[i3], m2[i2], m1[i1], m0[i0]], fill where a map is -1;
    # on [lo, hi) dim 0 is known to be the run m0[i] = i - off (a plain row copy)
    n3, n2, n1, n0 = out.shape
    f = fill[0]
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        ro = out[i3, i2, i1]
        j3 = m3[i3]
        j2 = m2[i2]
        j1 = m1[i1]
        if j3 < 0 or j2 < 0 or j1 < 0:
            for i in range(n0):
                ro[i] = f
            continue
        rx = x[j3, j2, j1]
        _gather_span(rx, m0, 0, lo, f, ro)
        # copy through slices so both indices start at 0 (vectorises like memcpy)
        dst = ro[lo:hi]
        src = rx[lo - off:hi - off]
        for i in range(hi - lo):
            dst[i] = src[i]
        _gather_span(rx, m0, hi, n0, f, ro)


def _longest_run(m: np.ndarray):
    """(lo, hi, off): the longest stretch where m[i] == i - off >= 0."""
    n = len(m)
    d = m - np.arange(n)
    ok = m >= 0
    brk = np.flatnonzero((np.diff(d) != 0) | (np.diff(ok.astype(np.int8)) != 0)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [n]))
    lens = np.where(ok[starts], ends - starts, 0)
    k = int(np.argmax(lens))
    if lens[k] == 0:
        return 0, 0, 0
    return int(starts[k]), int(ends[k]), int(-d[starts[k]])


def gather(x: np.ndarray, maps, out: np.ndarray, fill=0) -> None:
    """out = x gathered through per-dim index maps (maps in ne order: m0, m1, m2, m3)."""
    xr, orr = as4d(_raw(x)), as4d(_raw(out))
    m0, m1, m2, m3 = (np.ascontiguousarray(m, np.int64) for m in maps)
    lo, hi, off = _longest_run(m0)
    with threads_for(orr.size):
        _gather4(xr, m3, m2, m1, m0, lo, hi, off, np.array([fill], xr.dtype), orr)


def _pad_map(n: int, lo: int, hi: int, mode: str) -> np.ndarray:
    j = np.arange(n + lo + hi, dtype=np.int64) - lo
    if mode == "constant":
        return np.where((j >= 0) & (j < n), j, -1)
    if mode == "circular":
        return j % n
    if mode == "replicate":
        return np.clip(j, 0, n - 1)
    # reflect without repeating the edge (padding < n, checked at build time)
    j = np.abs(j)
    return np.where(j >= n, 2 * (n - 1) - j, j)


def _nearest_map(n_in: int, n_out: int) -> np.ndarray:
    """ggml: i / sf with sf = (float) out / in, float32, truncated."""
    sf = np.float32(n_out) / np.float32(n_in)
    return np.minimum((np.arange(n_out, dtype=np.float32) / sf).astype(np.int64), n_in - 1)


def _fill_raw(node, value: float):
    if value == 0.0:
        return 0
    dt = node.dtype
    if dt.is_float:
        return f32_to_raw(np.array([value], np.float32), dt).view(_UINT[dt.type_size])[0]
    return np.array([value]).astype(dt.np_storage).view(_UINT[dt.type_size])[0]


@CPU.register("pad", supports=_non_block)
def _pad(node, xs, out):
    p = node.params
    src = node.src[0].ne4
    maps = [_pad_map(n, lo, hi, p["mode"]) for n, (lo, hi) in zip(src, p["pads"])]
    gather(xs[0], maps, out, _fill_raw(node, p["value"]))


@njit(parallel=True, cache=True)
def _repeat4(x, out):
    # out[i3,i2,i1,i0] = x[i3 % s3, i2 % s2, i1 % s1, i0 % s0]: whole source rows copied
    n3, n2, n1, n0 = out.shape
    s3, s2, s1, s0 = x.shape
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        rx = x[i3 % s3, i2 % s2, i1 % s1]
        ro = out[i3, i2, i1]
        if s0 == 1:
            v = rx[0]
            for i in range(n0):
                ro[i] = v
        else:
            for k in range(n0 // s0):
                dst = ro[k * s0:(k + 1) * s0]
                for i in range(s0):
                    dst[i] = rx[i]


@CPU.register("repeat", supports=_non_block)
def _repeat(node, xs, out):
    o = as4d(_raw(out))
    with threads_for(o.size):
        _repeat4(as4d(_raw(xs[0])), o)


# ---- concat ------------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def _concat_into(x, out, dim, start):
    # out[..., start + i (on ggml dim `dim`), ...] = x[..., i, ...]; out is the whole result
    n3, n2, n1, n0 = x.shape
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        rx = x[i3, i2, i1]
        if dim == 0:
            ro = out[i3, i2, i1][start:start + n0]
            for i in range(n0):
                ro[i] = rx[i]
        else:
            if dim == 1:
                ro = out[i3, i2, start + i1]
            elif dim == 2:
                ro = out[i3, start + i2, i1]
            else:
                ro = out[start + i3, i2, i1]
            for i in range(n0):
                ro[i] = rx[i]


@njit(parallel=True, cache=True)
def _concat_blocks(x, out, start):
    # x (outer, n, inner), out (outer, total, inner), both C order: out[o, start + i] = x[o, i]
    outer, n, inner = x.shape
    for r in prange(outer * n):
        o = r // n
        i = r % n
        src = x[o, i]
        dst = out[o, start + i]
        for k in range(inner):
            dst[k] = src[k]


@CPU.register("concat", supports=_non_block)
def _concat(node, xs, out):
    dim = node.params["dim"]
    o = as4d(_raw(out))
    ne = node.ne4
    inner = int(np.prod(ne[:dim]))  # elements below the concat dim: contiguous in out
    outer = int(np.prod(ne[dim + 1:]))
    o3 = o.reshape(outer, ne[dim], inner)
    start = 0
    with threads_for(o.size):
        for s, x in zip(node.src, xs):
            xr = _raw(x)
            if xr.flags.c_contiguous and inner > 1:  # whole blocks below dim, not short rows
                _concat_blocks(xr.reshape(outer, s.ne4[dim], inner), o3, start)
            else:
                _concat_into(as4d(xr), o, dim, start)
            start += s.ne4[dim]


# ---- interpolation -----------------------------------------------------------------------------
@njit(parallel=True, fastmath=True, cache=True)
def _interp(x, m3, m2, idx1, w1, idx0, w0, out):
    # out[i3,i2,i1,i0] = sum_a sum_b w1[i1,a] w0[b,i0] x[m3[i3], m2[i2], idx1[i1,a], idx0[b,i0]]
    # per output row: a vertical pass into tmp (contiguous, vectorised), then one sweep over
    # the row per horizontal tap (dim-0 taps are stored tap-major for unit-stride weights)
    o3, o2, o1, o0 = out.shape
    n0 = x.shape[3]
    k1 = idx1.shape[1]
    k0 = idx0.shape[0]
    rows = o3 * o2 * o1
    blk = 16  # rows per task: one scratch row per task, not per row
    for b_ in prange((rows + blk - 1) // blk):
        tmp = np.empty(n0, np.float32)
        for r in range(b_ * blk, min(rows, b_ * blk + blk)):
            i3 = r // (o2 * o1)
            i2 = (r // o1) % o2
            i1 = r % o1
            plane = x[m3[i3], m2[i2]]
            w = w1[i1, 0]
            row = plane[idx1[i1, 0]]
            for j in range(n0):
                tmp[j] = w * row[j]
            for a in range(1, k1):
                w = w1[i1, a]
                row = plane[idx1[i1, a]]
                for j in range(n0):
                    tmp[j] += w * row[j]
            ro = out[i3, i2, i1]
            wb = w0[0]
            ib = idx0[0]
            for i0 in range(o0):
                ro[i0] = wb[i0] * tmp[np.uintp(ib[i0])]
            for b in range(1, k0):
                wb = w0[b]
                ib = idx0[b]
                for i0 in range(o0):
                    ro[i0] += wb[i0] * tmp[np.uintp(ib[i0])]


def _coord(n_in, n_out, align_corners):
    """ggml's source coordinates (float32) of every output index, with sf and pixel offset."""
    sf = np.float32(n_out) / np.float32(n_in)
    off = np.float32(0.5)
    if align_corners:
        off = np.float32(0.0)
        if n_out > 1 and n_in > 1:
            sf = np.float32(n_out - 1) / np.float32(n_in - 1)
    i = np.arange(n_out, dtype=np.float32)
    return (i + off) / sf - off, sf, off


def axis_taps(n_in: int, n_out: int, mode: str, align_corners: bool, antialias: bool):
    """(idx, w): source indices (n_out, K) and float32 weights (n_out, K) of one axis."""
    c, sf, off = _coord(n_in, n_out, align_corners)
    if mode == "bilinear" and antialias:
        cc = (c + off).astype(np.float32)  # ggml's antialias centre is (i + off) / sf
        support = np.float32(max(1.0, 1.0 / float(sf)))
        inv = np.float32(1.0) / support
        lo = np.maximum((cc - support + off).astype(np.int64), 0)
        hi = np.minimum((cc + support + off).astype(np.int64), n_in)
        k = max(int((hi - lo).max()), 1)
        idx = lo[:, None] + np.arange(k)
        valid = idx < hi[:, None]
        w = np.maximum(np.float32(1.0) - np.abs((idx - cc[:, None] + off) * inv), 0.0).astype(np.float32)
        w = np.where(valid, w, np.float32(0.0))
        tot = w.sum(1, keepdims=True)
        w = w / np.where(tot > 0, tot, np.float32(1.0))
        return np.minimum(idx, n_in - 1), w.astype(np.float32)
    if mode == "bilinear":
        f = np.floor(c).astype(np.int64)
        j0 = np.clip(f, 0, n_in - 1)
        j1 = np.clip(f + 1, 0, n_in - 1)
        d = np.clip(c - j0.astype(np.float32), 0.0, 1.0).astype(np.float32)
        return np.stack([j0, j1], 1), np.stack([1 - d, d], 1).astype(np.float32)
    # bicubic, A = -0.75, taps floor(c)-1 .. floor(c)+2 clamped to the border
    f = np.floor(c)
    t = (c - f).astype(np.float32)
    a = np.float32(-0.75)

    def w1(v):
        return ((a + 2) * v - (a + 3)) * v * v + 1

    def w2(v):
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a
    w = np.stack([w2(t + 1), w1(t), w1(1 - t), w2(2 - t)], 1).astype(np.float32)
    idx = np.clip(f.astype(np.int64)[:, None] + np.arange(-1, 3), 0, n_in - 1)
    return idx, w


@CPU.register("upscale", supports=_non_block)
def _upscale(node, xs, out):
    p = node.params
    n0, n1, n2, n3 = node.src[0].ne4
    o0, o1, o2, o3 = p["ne"]
    if p["mode"] == "nearest":
        maps = [_nearest_map(n, o) for n, o in zip((n0, n1, n2, n3), (o0, o1, o2, o3))]
        gather(xs[0], maps, out)
        return
    x = as4d(f32_input(node.src[0], xs[0]))
    o = f32_output(node, out)
    idx0, w0 = axis_taps(n0, o0, p["mode"], p["align_corners"], p["antialias"])
    idx1, w1 = axis_taps(n1, o1, p["mode"], p["align_corners"], p["antialias"])
    with threads_for(o.size):
        _interp(x, _nearest_map(n3, o3), _nearest_map(n2, o2), idx1, w1,
                np.ascontiguousarray(idx0.T), np.ascontiguousarray(w0.T), as4d(o))
    store(node, out, o)
