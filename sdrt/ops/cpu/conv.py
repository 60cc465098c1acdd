"""CPU kernels for convolutions and pooling.

conv1d/conv2d/conv3d share one path: every conv is a 3-D conv over (D, H, W) with unit dims
where the op has none. Per batch item and group, a parallel Numba im2col writes a float32
column buffer cols[C/g*KD*KH*KW, positions] for a chunk of output rows (chunked so the buffer
stays under COL_BYTES), and one BLAS GEMM  W2d[OC/g, K] @ cols  writes straight into the output,
which is already in [N, OC, OD, OH, OW] order (numpy's matmul takes the strided out view
without a copy). 1x1 convs with stride 1 and no padding skip im2col: the input plane is the
column matrix. Depthwise 2-D convs (groups == C, OC a multiple of C) use a direct Numba kernel instead: a
GEMM with one row per group would be all overhead.

Small outputs (<= MERGE_MAX_P positions per item: SD's 8x8..32x32 levels with batch 2 for CFG)
run as ONE GEMM over the whole batch, columns of every item side by side, regrouped into
[N, OC, P] afterwards with the bias added on the way: a GEMM per item re-packs the whole weight
(59 MB of float32 at 1280 channels) for only 64..1024 columns.

Stride-1 convs whose output is as wide as the input (SD's 3x3 padding-1 convs) build each
column row with one contiguous copy (_im2col_same) instead of one per output row (faster at
SD's small levels; bench/README.md has both measurements).

conv_transpose2d is the adjoint: cols = W2d^T[OC*KH*KW, C] @ x[C, rows*W] (one GEMM per chunk
of input rows), then a parallel col2im scatter-adds into the output, one output channel per
thread so no two threads touch the same pixel.

Non-F32 weights are widened (or dequantized) to float32 with mul_mat's row fillers (F16 through
the hardware conversion) in tiles of output channels of at most WEIGHT_TILE_BYTES (32 MiB, as
mul_mat), one GEMM per tile writing its slice of output channels: the widened scratch of
SD1.5's largest conv weight (1280x2560x3x3, 112.5 MiB whole) is 28.1 MiB (4 tiles of 320
channels). Tiles are this tall because every GEMM re-packs all its columns (4 MB tiles were
much slower). The per-item path loops tiles outside items, so a
weight of several tiles widens once per tile and redoes the im2col per tile. F16/BF16
activations are widened whole.

F16/BF16 weights where sdrt.ops.cpu.bf16gemm's kernel is active (AVX512_BF16, SDRT_BF16GEMM) skip
the widening: one bf16 GEMM per call multiplies the raw weight rows by the float32 columns (both
rounded to bf16 as they are packed); the 3x3 convs Winograd takes run as one call of its bf16
Winograd kernel (conv_winograd.conv_winograd_bf16: faster than the bf16 im2col GEMM at every SD
shape timed, bench/README.md).
"""
from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange

from ..conv import conv2d_weight_ne
from . import CPU
from ._util import f32_input
from .conv_winograd import conv_winograd, winograd_applies, winograd_bf16_applies
from . import bf16gemm
from .matmul import fill_rows
from ..threads import get_threads

COL_BYTES = 64 << 20  # cap of the im2col / col2im column buffer
WEIGHT_TILE_BYTES = 32 << 20  # cap of one widened (non-F32) weight tile: mul_mat's TILE_BYTES
MERGE_MAX_P = 1024     # output positions per item up to which a batch runs as one GEMM
WINOGRAD = True        # 3x3 stride-1 convs by F(2x2, 3x3) where it pays (conv_winograd.py)
WINOGRAD_BF16 = True   # ... also when the weight goes through the bf16 GEMM (bench/README.md)
FLT_MAX = float(np.finfo(np.float32).max)
# below this many column elements im2col runs serially: waking a Numba team next to OpenBLAS's
# spinning threads costs more than the copy (as mul_mat measured for its weight tiles)
SERIAL_BELOW = 1 << 20


# ---- Numba kernels ---------------------------------------------------------------------------
@njit(inline="always")
def _valid_range(off, s, n, on):
    """Output positions o in [lo, hi) with 0 <= o*s + off < n (o < on)."""
    lo = 0 if off >= 0 else (-off + s - 1) // s
    hi = (n - 1 - off) // s + 1 if n - 1 - off >= 0 else 0
    hi = min(hi, on)
    lo = min(lo, on)
    hi = max(hi, lo)
    return lo, hi


# Hot loops index flat arrays with uint64: Numba adds a negative-index wraparound branch to
# every signed index, which stops LLVM vectorizing the copies (3-4x slower measured).
def _im2col_py(x, cols, C, D, H, W, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw, OH, OW, r0, r1,
               ld, c0):
    """x flat (C, D, H, W); cols flat [(c, kz, ky, kx), c0 + (r - r0)*OW + ox] (column rows `ld`
    apart) for output rows r = oz*OH + oy in [r0, r1). Parallel over k so each thread streams
    whole column rows."""
    for k in prange(C * KD * KH * KW):
        kx = k % KW
        ky = (k // KW) % KH
        kz = (k // (KW * KH)) % KD
        c = k // (KW * KH * KD)
        off = kx * dw - pw
        lo, hi = _valid_range(off, sw, W, OW)
        for r in range(r0, r1):
            oz = r // OH
            oy = r - oz * OH
            iz = oz * sd + kz * dd - pd
            iy = oy * sh + ky * dh - ph
            base = np.uint64(k * ld + c0 + (r - r0) * OW)
            if iz < 0 or iz >= D or iy < 0 or iy >= H:
                for o in range(OW):
                    cols[base + np.uint64(o)] = 0.0
                continue
            for o in range(lo):
                cols[base + np.uint64(o)] = 0.0
            src = np.uint64(((c * D + iz) * H + iy) * W + lo * sw + off)
            dst = base + np.uint64(lo)
            if sw == 1:
                for o in range(hi - lo):
                    cols[dst + np.uint64(o)] = x[src + np.uint64(o)]
            else:
                for o in range(hi - lo):
                    cols[dst + np.uint64(o)] = x[src + np.uint64(o * sw)]
            for o in range(hi, OW):
                cols[base + np.uint64(o)] = 0.0


_im2col = njit(parallel=True, fastmath=True, cache=True)(_im2col_py)
_im2col_serial = njit(fastmath=True, cache=True)(_im2col_py)


def _im2col_same_py(x, cols, C, H, W, KH, KW, ph, pw, dh, dw, r0, r1, ld, c0):
    """_im2col for 2-D stride-1 convs whose output is as wide as the input (OW == W, 'same'
    padding along x): a column row holds output rows r0..r1 back to back, and so does the input
    plane, so each (c, ky, kx) row is ONE contiguous copy of the valid input rows shifted by the
    tap, then the few columns that wrapped across a row edge (ox + kx*dw - pw outside [0, W)) are
    zeroed, and so are the rows above/below the input. The general kernel makes one copy per
    output row instead. One thread, CPU time: 1280 channels 16x16 0.52 vs 1.21 ms, 8x8 0.25 vs
    0.69 ms; 320 channels 64x64 (47 MB of columns, memory-bound) within noise of it."""
    n = (r1 - r0) * W
    for k in prange(C * KH * KW):
        kx = k % KW
        ky = (k // KW) % KH
        c = k // (KW * KH)
        base = np.uint64(k * ld + c0)
        lo = min(max(r0, ph - ky * dh), r1)          # output rows whose input row exists
        hi = max(min(r1, H + ph - ky * dh), lo)
        for j in range((lo - r0) * W):
            cols[base + np.uint64(j)] = 0.0
        for j in range((hi - r0) * W, n):
            cols[base + np.uint64(j)] = 0.0
        if hi == lo:
            continue
        off = kx * dw - pw
        d0 = base + np.uint64((lo - r0) * W)
        s0 = (c * H + lo + ky * dh - ph) * W + off   # may sit |off| before/after the plane's rows
        a = max(0, -off)
        b = (hi - lo) * W - max(0, off)
        src = np.uint64(s0 + a)
        dst = d0 + np.uint64(a)
        for j in range(b - a):
            cols[dst + np.uint64(j)] = x[src + np.uint64(j)]
        if off != 0:  # the columns that read across a row edge get the zero padding
            z0 = 0 if off < 0 else W - off
            z1 = -off if off < 0 else W
            for rr in range(hi - lo):
                row = d0 + np.uint64(rr * W)
                for o in range(max(z0, 0), min(z1, W)):
                    cols[row + np.uint64(o)] = 0.0


_im2col_same = njit(parallel=True, fastmath=True, cache=True)(_im2col_same_py)
_im2col_same_serial = njit(fastmath=True, cache=True)(_im2col_same_py)


@njit(parallel=True, fastmath=True, cache=True)
def _col2im(cols, out, OC, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, W, r0, r1):
    """out flat (OC, OH, OW) += scatter of cols flat [(oc, ky, kx), (iy - r0)*W + ix] for
    input rows iy in [r0, r1). Parallel over output channels: each thread owns its planes."""
    n = (r1 - r0) * W
    for oc in prange(OC):
        for ky in range(KH):
            for kx in range(KW):
                row = ((oc * KH + ky) * KW + kx) * n
                off = kx * dw - pw
                lo, hi = _valid_range(off, sw, OW, W)
                for iy in range(r0, r1):
                    oy = iy * sh + ky * dh - ph
                    if oy < 0 or oy >= OH:
                        continue
                    src = np.uint64(row + (iy - r0) * W + lo)
                    dst = np.uint64((oc * OH + oy) * OW + lo * sw + off)
                    if sw == 1:
                        for i in range(hi - lo):
                            out[dst + np.uint64(i)] += cols[src + np.uint64(i)]
                    else:
                        for i in range(hi - lo):
                            out[dst + np.uint64(i * sw)] += cols[src + np.uint64(i)]


@njit(parallel=True, fastmath=True, cache=True)
def _depthwise2d(x, w, bias, out, N, C, OC, H, W, KH, KW, OH, OW, sh, sw, ph, pw, dh, dw):
    """x flat (N, C, H, W), w flat (OC, KH, KW), bias (OC,), out flat (N, OC, OH, OW); output
    channel oc reads input channel oc // (OC // C) (groups == C). One output row per task,
    accumulated tap by tap so the inner loop is a contiguous axpy when sw == 1."""
    mult = OC // C
    for t in prange(N * OC * OH):
        oy = t % OH
        oc = (t // OH) % OC
        n = t // (OH * OC)
        c = oc // mult
        dst = np.uint64(t * OW)
        bv = bias[oc]
        for o in range(OW):
            out[dst + np.uint64(o)] = bv
        for ky in range(KH):
            iy = oy * sh + ky * dh - ph
            if iy < 0 or iy >= H:
                continue
            for kx in range(KW):
                wv = w[(oc * KH + ky) * KW + kx]
                off = kx * dw - pw
                lo, hi = _valid_range(off, sw, W, OW)
                src = np.uint64(((n * C + c) * H + iy) * W + lo * sw + off)
                d0 = dst + np.uint64(lo)
                if sw == 1:
                    for o in range(hi - lo):
                        out[d0 + np.uint64(o)] += wv * x[src + np.uint64(o)]
                else:
                    for o in range(hi - lo):
                        out[d0 + np.uint64(o)] += wv * x[src + np.uint64(o * sw)]


@njit(parallel=True, fastmath=True, cache=True)
def _add_bias(out, bias):
    """out (N, OC, P) += bias[oc]."""
    N, OC, P = out.shape
    for t in prange(N * OC):
        oc = t % OC
        row = out[t // OC, oc]
        bv = bias[oc]
        for i in range(P):
            row[i] += bv


def _unmerge_py(tmp, out, bias, has_bias):
    """out (N, OC, P) = tmp (OC, N*P) regrouped per batch item, + bias[oc]."""
    N, OC, P = out.shape
    for t in prange(N * OC):
        n = t // OC
        oc = t - n * OC
        src = tmp[oc]
        dst = out[n, oc]
        bv = bias[oc] if has_bias else np.float32(0.0)
        for i in range(P):
            dst[i] = src[n * P + i] + bv


_unmerge = njit(parallel=True, fastmath=True, cache=True)(_unmerge_py)
_unmerge_serial = njit(fastmath=True, cache=True)(_unmerge_py)


@njit(parallel=True, cache=True)
def _pool2d(x, out, is_max, KH, KW, sh, sw, ph, pw):
    """x (B, H, W), out (B, OH, OW): ggml_pool_2d (avg divides by KH*KW, max starts at -FLT_MAX)."""
    B, H, W = x.shape
    OH, OW = out.shape[1], out.shape[2]
    ka = np.float32(KH * KW)
    for t in prange(B * OH):
        b = t // OH
        oy = t % OH
        for ox in range(OW):
            acc = np.float32(-FLT_MAX) if is_max else np.float32(0.0)
            for ky in range(KH):
                iy = oy * sh + ky - ph
                if iy < 0 or iy >= H:
                    continue
                for kx in range(KW):
                    ix = ox * sw + kx - pw
                    if ix < 0 or ix >= W:
                        continue
                    v = x[b, iy, ix]
                    if is_max:
                        acc = max(acc, v)
                    else:
                        acc += v
            out[b, oy, ox] = acc if is_max else acc / ka


# ---- drivers ---------------------------------------------------------------------------------
_TLS = threading.local()


def _buffer(name: str, n: int) -> np.ndarray:
    """A reusable float32 buffer of n elements, per thread and purpose ("cols", "w" ...): a fresh
    np.empty of tens of MB per call is a fresh mmap, page-faulted (and zeroed by the kernel) in
    on every call — measured ~40% of the F16 widening time of a 59 MB weight."""
    buf = getattr(_TLS, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, np.float32)
        setattr(_TLS, name, buf)
    return buf[:n]


def _f32c(t, x) -> np.ndarray:
    """float32 C-contiguous values of input `x` of tensor `t` (no copy when already so)."""
    return np.ascontiguousarray(f32_input(t, x), dtype=np.float32)


class _WeightRows:
    """A conv weight as OC rows of K values. F32 storage is used in place; every other type
    (F16/BF16/F8, block types) is widened or dequantized by mul_mat's serial row fillers (block
    rows are ne[0] long: q of them per output channel)."""

    def __init__(self, t, raw, oc: int):
        raw = np.ascontiguousarray(raw)
        self.dt, self.oc, self.k = t.dtype, oc, t.nelements // oc
        self.rows = raw.reshape(-1, raw.shape[-1]) if t.dtype.is_quantized else raw.reshape(oc, -1)
        self.q = self.rows.shape[0] // oc
        self.bf16 = bf16gemm.path_for(self.dt.name) if self.rows.ndim == 2 else None

    @property
    def is_f32(self) -> bool:
        return self.dt.name == "F32"

    def fill(self, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
        """Rows [r0, r1) as float32 into `out` ((r1 - r0) * K elements); returns it (r1-r0, K)."""
        out = out[:(r1 - r0) * self.k].reshape(r1 - r0, self.k)
        fill_rows(self.dt, self.rows, r0 * self.q, r1 * self.q, out.reshape((r1 - r0) * self.q, -1))
        return out

    def tiles(self, r0: int, r1: int):
        """(t0, t1, float32 rows [t0, t1)) covering rows [r0, r1): the storage itself in one tile
        for F32, else near-equal tiles of at most WEIGHT_TILE_BYTES widened one after another
        into one reused buffer (so each tile is valid only until the next is drawn)."""
        if self.is_f32:
            yield r0, r1, self.rows[r0:r1]
            return
        rows = _balanced_rows(r1 - r0, WEIGHT_TILE_BYTES // (4 * self.k))
        buf = _buffer("w", rows * self.k)
        for t0 in range(r0, r1, rows):
            t1 = min(r1, t0 + rows)
            yield t0, t1, self.fill(t0, t1, buf)

    def gemm_tiles(self, r0: int, r1: int):
        """As tiles(), but with the bf16 GEMM active the raw rows [r0, r1) in one _Bf16Rows."""
        if self.bf16 is None:
            yield from self.tiles(r0, r1)
        else:
            yield r0, r1, _Bf16Rows(self, r0, r1)

    def full(self) -> np.ndarray:
        """All rows as float32 (OC, K): the storage itself for F32, else a reused buffer."""
        if self.is_f32:
            return self.rows
        return self.fill(0, self.oc, _buffer("w", self.oc * self.k))


class _Bf16Rows:
    """Weight rows [r0, r1) in their F16/BF16 storage, multiplied by bf16gemm."""

    def __init__(self, w: _WeightRows, r0: int, r1: int):
        self.w, self.r0, self.r1 = w, r0, r1

    def matmul(self, cols: np.ndarray, out: np.ndarray) -> None:
        bf16gemm.gemm(self.w.rows[self.r0:self.r1].view(np.uint16), self.w.dt.name, cols, "F32", out,
                      self.w.bf16, get_threads())


def _tile_matmul(wt, cols: np.ndarray, out: np.ndarray) -> None:
    """out = wt @ cols for a float32 tile or a _Bf16Rows."""
    if isinstance(wt, _Bf16Rows):
        wt.matmul(cols, out)
    else:
        np.matmul(wt, cols, out=out)


def _weight(t, raw, shape) -> np.ndarray:
    """float32 C-contiguous weight values in numpy `shape` (widened/dequantized once per call)."""
    return _WeightRows(t, raw, shape[0]).full().reshape(shape)


def _balanced_rows(n: int, cap: int) -> int:
    """Rows per chunk: at most `cap` (>= 1), chunks of near-equal size (no tiny last GEMM)."""
    chunks = -(-n // max(1, min(n, cap)))
    return -(-n // chunks)


def _bias(node, xs, oc):
    return _f32c(node.src[2], xs[2]).reshape(oc) if len(xs) > 2 else None


def _cols(x3, cols, C, D, H, W, kernel, stride, pad, dil, OH, OW, r0, r1, ld, c0):
    """im2col of one item's (C, D, H, W) input for output rows [r0, r1) into cols flat at column
    c0 of rows ld apart; the contiguous-copy kernel where the conv allows it, serial when small."""
    KD, KH, KW = kernel
    big = C * KD * KH * KW * (r1 - r0) * OW >= SERIAL_BELOW
    if D == 1 and KD == 1 and OW == W and stride[1] == 1 and stride[2] == 1 and pad[2] < W:
        f = _im2col_same if big else _im2col_same_serial
        f(x3, cols, C, H, W, KH, KW, pad[1], pad[2], dil[1], dil[2], r0, r1, ld, c0)
    else:
        f = _im2col if big else _im2col_serial
        f(x3, cols, C, D, H, W, KD, KH, KW, stride[0], stride[1], stride[2], pad[0], pad[1], pad[2],
          dil[0], dil[1], dil[2], OH, OW, r0, r1, ld, c0)


def _merged_gemm(w: _WeightRows, cols: np.ndarray, b, out3: np.ndarray) -> None:
    """out3 (N, OC, P) = W (OC, K) @ cols (K, N*P) (+ bias): one GEMM per weight tile for the
    whole batch into a scratch (OC, N*P), regrouped into out3 per item with the bias added on
    the way."""
    N, OC, P = out3.shape
    tmp = _buffer("merged", OC * N * P).reshape(OC, N * P)
    for t0, t1, wt in w.gemm_tiles(0, OC):
        _tile_matmul(wt, cols, tmp[t0:t1])
    unmerge = _unmerge if OC * N * P >= SERIAL_BELOW else _unmerge_serial
    unmerge(tmp, out3, b if b is not None else np.zeros(1, np.float32), b is not None)


def conv_core(x5, w: _WeightRows, kernel, b, out5, stride, pad, dil, groups, col_bytes=None):
    """x5 (N, C, D, H, W) float32 C-contiguous, w the (OC, C/g * KD*KH*KW) weight rows, kernel
    (KD, KH, KW); out5 (N, OC, OD, OH, OW) float32 C-contiguous, overwritten. Per-axis params in
    numpy order (d, h, w); zero padding.

    Small outputs (P = OD*OH*OW <= MERGE_MAX_P per item, groups 1, batch > 1, columns of the
    whole batch within COL_BYTES) run as one GEMM over the batch (_merged_gemm): at 8x8..16x16
    a GEMM per item would re-pack the whole weight for only 64..256 columns. Otherwise one GEMM
    per item and column chunk writes straight into the output."""
    N, C, D, H, W = x5.shape
    OC = w.oc
    KD, KH, KW = kernel
    cg = C // groups
    OD, OH, OW = out5.shape[2:]
    og = OC // groups
    if groups == C and KD == 1 and D == 1:  # depthwise, optionally with a channel multiplier
        bias = b if b is not None else np.zeros(OC, np.float32)
        _depthwise2d(x5.reshape(-1), w.full().reshape(-1), bias, out5.reshape(-1), N, C, OC, H, W, KH, KW,
                     OH, OW, stride[1], stride[2], pad[1], pad[2], dil[1], dil[2])
        return
    col_bytes = col_bytes or COL_BYTES
    if (WINOGRAD and (w.bf16 is None or WINOGRAD_BF16) and groups == 1 and D == 1 and (KD, KH, KW) == (1, 3, 3)
            and tuple(stride) == (1, 1, 1) and tuple(dil) == (1, 1, 1)
            and (winograd_applies if w.bf16 is None else winograd_bf16_applies)(C, OC, N, OH, OW)):
        conv_winograd(x5.reshape(N, C, H, W), w, b, out5.reshape(N, OC, OH, OW), pad[1], pad[2], _buffer, col_bytes)
        return
    K = cg * KD * KH * KW
    P = OD * OH * OW
    out3 = out5.reshape(N, OC, P)
    pointwise = (KD, KH, KW) == (1, 1, 1) and tuple(stride) == (1, 1, 1) and tuple(pad) == (0, 0, 0)
    nrows = OD * OH
    # a 1x1 conv's columns are a copy of x made only to merge: worth it at 8x8..16x16, not at 32x32
    if groups == 1 and N > 1 and P <= (MERGE_MAX_P // 4 if pointwise else MERGE_MAX_P) and K * N * P * 4 <= col_bytes:
        cols = _buffer("cols", K * N * P)
        if pointwise:
            np.copyto(cols.reshape(K, N, P), x5.reshape(N, C, P).transpose(1, 0, 2))
        else:
            for n in range(N):
                _cols(x5[n].reshape(-1), cols, C, D, H, W, kernel, stride, pad, dil, OH, OW, 0, nrows, N * P, n * P)
        _merged_gemm(w, cols.reshape(K, N * P), b, out3)
        return
    if not pointwise:
        rows = _balanced_rows(nrows, col_bytes // (K * OW * 4))
        buf = _buffer("cols", K * rows * OW)
    for g in range(groups):
        # tiles outside items: each tile is widened once (a weight of one tile: as untiled)
        for t0, t1, wt in w.gemm_tiles(g * og, (g + 1) * og):
            for n in range(N):
                xg = x5[n, g * cg:(g + 1) * cg]
                t_out = out3[n, t0:t1]
                if pointwise:
                    _tile_matmul(wt, xg.reshape(cg, P), t_out)
                    continue
                for r0 in range(0, nrows, rows):
                    r1 = min(nrows, r0 + rows)
                    n_cols = (r1 - r0) * OW
                    cols = buf[:K * n_cols].reshape(K, n_cols)
                    _cols(xg.reshape(-1), buf, cg, D, H, W, kernel, stride, pad, dil, OH, OW, r0, r1, n_cols, 0)
                    _tile_matmul(wt, cols, t_out[:, r0 * OW:r1 * OW])
    if b is not None:
        _add_bias(out3, b)


def _float_io(node):
    return node.src[0].dtype.name in ("F32", "F16", "BF16")


@CPU.register("conv2d", supports=_float_io)
def _conv2d(node, xs, out):
    p = node.params
    W, H, C, N = node.src[0].ne4
    KW, KH, cg, OC = conv2d_weight_ne(node.src[1])
    OW, OH = node.ne[0], node.ne[1]
    x = _f32c(node.src[0], xs[0]).reshape(N, C, 1, H, W)
    w = _WeightRows(node.src[1], xs[1], OC)
    (sx, sy), (px, py), (dx, dy) = p["stride"], p["padding"], p["dilation"]
    cx, cy = p["circular"]
    if (cx and px) or (cy and py):
        # sd.cpp pads circularly first (ggml_pad_ext_circular), then convolves unpadded there
        pads = [(0, 0)] * 3 + [(py, py) if cy else (0, 0), (px, px) if cx else (0, 0)]
        x = np.ascontiguousarray(np.pad(x, pads, mode="wrap"))
        px, py = (0 if cx else px), (0 if cy else py)
    conv_core(x, w, (1, KH, KW), _bias(node, xs, OC), out.reshape(N, OC, 1, OH, OW),
              (1, sy, sx), (0, py, px), (1, dy, dx), p["groups"])


@CPU.register("conv1d", supports=_float_io)
def _conv1d(node, xs, out):
    p = node.params
    L, C, N, _ = node.src[0].ne4
    K, cg, OC, _ = node.src[1].ne4
    x = _f32c(node.src[0], xs[0]).reshape(N, C, 1, 1, L)
    w = _WeightRows(node.src[1], xs[1], OC)
    conv_core(x, w, (1, 1, K), _bias(node, xs, OC), out.reshape(N, OC, 1, 1, node.ne[0]),
              (1, 1, p["stride"][0]), (0, 0, p["padding"][0]), (1, 1, p["dilation"][0]), p["groups"])


@CPU.register("conv3d", supports=_float_io)
def _conv3d(node, xs, out):
    p = node.params
    W, H, D, ICN = node.src[0].ne4
    KW, KH, KD, ICOC = node.src[1].ne4
    ic = p["ic"] if p["ic"] is not None else ICN
    N, OC = ICN // ic, ICOC // ic
    x = _f32c(node.src[0], xs[0]).reshape(N, ic, D, H, W)
    w = _WeightRows(node.src[1], xs[1], OC)
    OW, OH, OD = node.ne[:3]
    conv_core(x, w, (KD, KH, KW), _bias(node, xs, OC), out.reshape(N, OC, OD, OH, OW),
              p["stride"][::-1], p["padding"][::-1], p["dilation"][::-1], 1)


@CPU.register("conv_transpose2d", supports=_float_io)
def _conv_transpose2d(node, xs, out):
    p = node.params
    W, H, C, N = node.src[0].ne4
    KW, KH, OC, _ = node.src[1].ne4
    OW, OH = node.ne[0], node.ne[1]
    x = _f32c(node.src[0], xs[0]).reshape(N, C, H * W)
    wt = _weight(node.src[1], xs[1], (C, OC * KH * KW)).T  # BLAS reads it transposed, no copy
    b = _bias(node, xs, OC)
    o = out.reshape(N, OC, OH, OW)
    (sx, sy), (px, py), (dx, dy) = p["stride"], p["padding"], p["dilation"]
    M = OC * KH * KW
    rows = _balanced_rows(H, COL_BYTES // (M * W * 4))
    buf = _buffer("cols", M * rows * W)
    for n in range(N):
        if b is None:
            o[n] = 0.0
        else:
            o[n] = b.reshape(OC, 1, 1)
        for r0 in range(0, H, rows):
            r1 = min(H, r0 + rows)
            cols = buf[:M * (r1 - r0) * W].reshape(M, (r1 - r0) * W)
            np.matmul(wt, x[n, :, r0 * W:r1 * W], out=cols)
            _col2im(buf, o[n].reshape(-1), OC, OH, OW, KH, KW, sy, sx, py, px, dy, dx, W, r0, r1)


def _pool(nsp):
    def kern(node, xs, out):
        p = node.params
        src = node.src[0]
        x = _f32c(src, xs[0])
        if nsp == 2:
            W, H = src.ne4[:2]
            (kx, ky), (sx, sy), (px, py) = p["kernel"], p["stride"], p["padding"]
            OW, OH = node.ne[:2]
        else:
            W, H = src.ne[0], 1
            (kx,), (sx,), (px,) = p["kernel"], p["stride"], p["padding"]
            ky, sy, py, OW, OH = 1, 1, 0, node.ne[0], 1
        _pool2d(x.reshape(-1, H, W), out.reshape(-1, OH, OW), p["kind"] == "max", ky, kx, sy, sx, py, px)
    return kern


CPU.register("pool2d", supports=_float_io)(_pool(2))
CPU.register("pool1d", supports=_float_io)(_pool(1))
