"""CPU kernels for convolutions and pooling.

conv1d/conv2d/conv3d share one path: every conv is a 3-D conv over (D, H, W) with unit dims
where the op has none. Per batch item and group, a parallel Numba im2col writes a float32
column buffer cols[C/g*KD*KH*KW, positions] for a chunk of output rows (chunked so the buffer
stays under COL_BYTES), and one BLAS GEMM  W2d[OC/g, K] @ cols  writes straight into the output,
which is already in [N, OC, OD, OH, OW] order (numpy's matmul takes the strided out view
without a copy). 1x1 convs with stride 1 and no padding skip im2col: the input plane is the
column matrix. Depthwise 2-D convs (groups == C, OC a multiple of C) use a direct Numba kernel instead: a
GEMM with one row per group would be all overhead.

conv_transpose2d is the adjoint: cols = W2d^T[OC*KH*KW, C] @ x[C, rows*W] (one GEMM per chunk
of input rows), then a parallel col2im scatter-adds into the output, one output channel per
thread so no two threads touch the same pixel.

Weights are widened (or dequantized) to float32 once per call with mul_mat's row fillers;
F16/BF16 activations are widened too.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange

from ..conv import conv2d_weight_ne
from . import CPU
from ._util import f32_input
from .matmul import fill_rows

COL_BYTES = 64 << 20  # cap of the im2col / col2im column buffer
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
def _im2col_py(x, cols, C, D, H, W, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw, OH, OW, r0, r1):
    """x flat (C, D, H, W); cols flat [(c, kz, ky, kx), (r - r0)*OW + ox] for output rows
    r = oz*OH + oy in [r0, r1). Parallel over k so each thread streams whole column rows."""
    n = (r1 - r0) * OW
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
            base = np.uint64(k * n + (r - r0) * OW)
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


def _scratch(n: int) -> np.ndarray:
    """A reusable float32 column buffer of >= n elements, per thread: a fresh np.empty of
    tens of MB per call would page-fault (and the kernel zero) its way in every time."""
    buf = getattr(_TLS, "buf", None)
    if buf is None or buf.size < n:
        buf = _TLS.buf = np.empty(n, np.float32)
    return buf


def _wscratch(n: int) -> np.ndarray:
    """A reusable float32 buffer for one widened weight, per thread (the largest SD1.5 conv
    weight is 59 MB of float32: a fresh np.empty is a fresh mmap, page-faulted in on every
    call — measured ~40% of the widening time)."""
    buf = getattr(_TLS, "wbuf", None)
    if buf is None or buf.size < n:
        buf = _TLS.wbuf = np.empty(n, np.float32)
    return buf[:n]


def _f32c(t, x) -> np.ndarray:
    """float32 C-contiguous values of input `x` of tensor `t` (no copy when already so)."""
    return np.ascontiguousarray(f32_input(t, x), dtype=np.float32)


def _weight(t, raw, shape) -> np.ndarray:
    """float32 C-contiguous weight values in numpy `shape`, widened or dequantized once per
    call with mul_mat's serial row fillers into a reused per-thread buffer."""
    if t.dtype.name == "F32":
        return np.ascontiguousarray(raw).reshape(shape)
    raw = np.ascontiguousarray(raw)
    rows = raw.reshape(-1, raw.shape[-1]) if t.dtype.is_quantized else raw.reshape(shape[0], -1)
    w = _wscratch(int(np.prod(shape))).reshape(rows.shape[0], -1)
    fill_rows(t.dtype, rows, 0, rows.shape[0], w)
    return w.reshape(shape)


def _balanced_rows(n: int, cap: int) -> int:
    """Rows per chunk: at most `cap` (>= 1), chunks of near-equal size (no tiny last GEMM)."""
    chunks = -(-n // max(1, min(n, cap)))
    return -(-n // chunks)


def _bias(node, xs, oc):
    return _f32c(node.src[2], xs[2]).reshape(oc) if len(xs) > 2 else None


def conv_core(x5, w5, b, out5, stride, pad, dil, groups, col_bytes=None):
    """x5 (N, C, D, H, W), w5 (OC, C/g, KD, KH, KW) float32 C-contiguous; out5 (N, OC, OD, OH, OW)
    float32 C-contiguous, overwritten. Per-axis params in numpy order (d, h, w); zero padding."""
    N, C, D, H, W = x5.shape
    OC, cg = w5.shape[:2]
    KD, KH, KW = w5.shape[2:]
    OD, OH, OW = out5.shape[2:]
    og = OC // groups
    if groups == C and KD == 1 and D == 1:  # depthwise, optionally with a channel multiplier
        bias = b if b is not None else np.zeros(OC, np.float32)
        _depthwise2d(x5.reshape(-1), w5.reshape(-1), bias, out5.reshape(-1), N, C, OC, H, W, KH, KW,
                     OH, OW, stride[1], stride[2], pad[1], pad[2], dil[1], dil[2])
        return
    K = cg * KD * KH * KW
    w2 = w5.reshape(OC, K)
    P = OD * OH * OW
    out3 = out5.reshape(N, OC, P)
    pointwise = (KD, KH, KW) == (1, 1, 1) and tuple(stride) == (1, 1, 1) and tuple(pad) == (0, 0, 0)
    nrows = OD * OH
    if not pointwise:
        rows = _balanced_rows(nrows, (col_bytes or COL_BYTES) // (K * OW * 4))
        buf = _scratch(K * rows * OW)
    for n in range(N):
        for g in range(groups):
            wg = w2[g * og:(g + 1) * og]
            xg = x5[n, g * cg:(g + 1) * cg]
            og_out = out3[n, g * og:(g + 1) * og]
            if pointwise:
                np.matmul(wg, xg.reshape(cg, P), out=og_out)
                continue
            for r0 in range(0, nrows, rows):
                r1 = min(nrows, r0 + rows)
                cols = buf[:K * (r1 - r0) * OW].reshape(K, (r1 - r0) * OW)
                im2col = _im2col if K * (r1 - r0) * OW >= SERIAL_BELOW else _im2col_serial
                im2col(xg.reshape(-1), buf, cg, D, H, W, KD, KH, KW, stride[0], stride[1], stride[2], pad[0], pad[1], pad[2],
                        dil[0], dil[1], dil[2], OH, OW, r0, r1)
                np.matmul(wg, cols, out=og_out[:, r0 * OW:r1 * OW])
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
    w = _weight(node.src[1], xs[1], (OC, cg, 1, KH, KW))
    (sx, sy), (px, py), (dx, dy) = p["stride"], p["padding"], p["dilation"]
    cx, cy = p["circular"]
    if (cx and px) or (cy and py):
        # sd.cpp pads circularly first (ggml_pad_ext_circular), then convolves unpadded there
        pads = [(0, 0)] * 3 + [(py, py) if cy else (0, 0), (px, px) if cx else (0, 0)]
        x = np.ascontiguousarray(np.pad(x, pads, mode="wrap"))
        px, py = (0 if cx else px), (0 if cy else py)
    conv_core(x, w, _bias(node, xs, OC), out.reshape(N, OC, 1, OH, OW),
              (1, sy, sx), (0, py, px), (1, dy, dx), p["groups"])


@CPU.register("conv1d", supports=_float_io)
def _conv1d(node, xs, out):
    p = node.params
    L, C, N, _ = node.src[0].ne4
    K, cg, OC, _ = node.src[1].ne4
    x = _f32c(node.src[0], xs[0]).reshape(N, C, 1, 1, L)
    w = _weight(node.src[1], xs[1], (OC, cg, 1, 1, K))
    conv_core(x, w, _bias(node, xs, OC), out.reshape(N, OC, 1, 1, node.ne[0]),
              (1, 1, p["stride"][0]), (0, 0, p["padding"][0]), (1, 1, p["dilation"][0]), p["groups"])


@CPU.register("conv3d", supports=_float_io)
def _conv3d(node, xs, out):
    p = node.params
    W, H, D, ICN = node.src[0].ne4
    KW, KH, KD, ICOC = node.src[1].ne4
    ic = p["ic"] if p["ic"] is not None else ICN
    N, OC = ICN // ic, ICOC // ic
    x = _f32c(node.src[0], xs[0]).reshape(N, ic, D, H, W)
    w = _weight(node.src[1], xs[1], (OC, ic, KD, KH, KW))
    OW, OH, OD = node.ne[:3]
    conv_core(x, w, _bias(node, xs, OC), out.reshape(N, OC, OD, OH, OW),
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
    buf = _scratch(M * rows * W)
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
