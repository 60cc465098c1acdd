"""3x3 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3) (Lavin & Gray, 2015).

Each 2x2 block of outputs (a "tile") is computed from the 4x4 input patch d under it; with g
one 3x3 filter,
    Y = A^T [ (G g G^T) * (B^T d B) ] A          (* element-wise over the 4x4 entries)
so a (channel, tile) pair costs 16 multiplies instead of 36. Over a layer the 16 entries are 16
independent GEMMs U[k] (OC x C) @ V[k] (C x tiles): 2.25x fewer multiply-adds than the im2col
GEMM W (OC x 9C) @ cols (9C x positions), and V holds 4/9 of the im2col columns. The transforms
are additions and halvings (G's 0.5 entries are exact), so results differ from the direct sum
in rounding only: relative differences of a few 1e-7 at SD's shapes.

Per chunk of tile rows of the whole batch (every item's tiles side by side, as conv.py's merged
GEMM does, so small maps still give GEMMs of hundreds of columns):
    U (16, OC_tile, C)   filter transform, from the weight rows widened in sub-tiles
    V (16, C, Pc)        input transform (Numba, parallel over channels)
    M (16, OC_tile, Pc)  = U[k] @ V[k] with numpy's BLAS, k = 0..15, as 16 one-thread tasks
    out                  output transform A^T m A + bias (Numba, parallel over output channels)
V lives in conv's "cols" scratch (at most conv.COL_BYTES), U and M in scratch of at most WINO_BYTES.
conv.py decides where it applies (`winograd_applies`). With F16/BF16 weights and the bf16 GEMM
active (sdrt.ops.cpu.bf16gemm) the whole conv is one C call instead (`conv_winograd_bf16`,
_bf16wino.h): the same transforms in float32, U and V rounded to bf16 straight into the GEMM's
packed layouts, the output transform fused after each block's 16 products, so neither a float32 V
nor M goes through memory (those passes were most of the conv's time at the VAE's 128-256
channels); `winograd_bf16_applies` says where.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...errors import OpError
from ..threads import get_threads, run_tasks
from . import bf16gemm

WINO_BYTES = 16 << 20   # cap of the U tile and of the M chunk (float32 bytes each)
BF16_CHUNK_BYTES = 4 << 20  # bf16 path: cap of one chunk's packed V (stays in the last-level cache)
BF16_MC = 48            # bf16 path: output channels per task (a multiple of 6; its U block stays in L2)
MIN_CHANNELS = 32       # below this C or OC the 16 GEMMs are too thin to win
MIN_TILES = 64          # tiles over the batch (8x8 maps with batch 2: 32 tiles, not worth it)


# Hot loops index flat arrays with uint64 (as conv.py's im2col): a signed index gets Numba's
# negative-index wraparound branch, which stops LLVM vectorizing.
U64 = np.uint64


@njit(inline="always")
def _g4(a, b, e):
    """One row/column of G g G^T: (a, (a+b+e)/2, (a-b+e)/2, e)."""
    h = np.float32(0.5)
    return a, h * (a + b + e), h * (a - b + e), e


@njit(inline="always")
def _put4(A, d, plane, k0, v):
    """A[d + (k0 + i) * plane] = v[i] for i < 4: four of the 16 planes at one position."""
    A[d + U64(k0) * plane] = v[0]
    A[d + U64(k0 + 1) * plane] = v[1]
    A[d + U64(k0 + 2) * plane] = v[2]
    A[d + U64(k0 + 3) * plane] = v[3]


@njit(parallel=True, fastmath=True, cache=True)
def _filter_transform(w, U, ot, C, o0, ld_o):
    """w flat (ot, C, 3, 3) float32 -> U flat (16, ld_o, C): U[k, o0 + o, c] = (G g G^T)[k // 4,
    k % 4] for the filter g = w[o, c]."""
    plane = U64(ld_o * C)
    for o in prange(ot):
        src = U64(o * C * 9)
        dst = U64((o0 + o) * C)
        for c in range(C):
            s = src + U64(c * 9)
            q00, q10, q20, q30 = _g4(w[s], w[s + U64(3)], w[s + U64(6)])  # G g, column by column
            q01, q11, q21, q31 = _g4(w[s + U64(1)], w[s + U64(4)], w[s + U64(7)])
            q02, q12, q22, q32 = _g4(w[s + U64(2)], w[s + U64(5)], w[s + U64(8)])
            d = dst + U64(c)
            _put4(U, d, plane, 0, _g4(q00, q01, q02))                        # (G g) G^T
            _put4(U, d, plane, 4, _g4(q10, q11, q12))
            _put4(U, d, plane, 8, _g4(q20, q21, q22))
            _put4(U, d, plane, 12, _g4(q30, q31, q32))


@njit(inline="always")
def _bt_column(R, t, L1, L2, L3):
    """B^T d for one column: R holds the four input rows L1 apart; entry t of each."""
    return R[t] - R[t + L2], R[t + L1] + R[t + L2], R[t + L2] - R[t + L1], R[t + L1] - R[t + L3]


@njit(parallel=True, fastmath=True, cache=True)
def _input_transform(x, V, N, C, H, W, th, tw, ph, pw, r0, r1, pc):
    """x flat (N, C, H, W); tile rows r in [r0, r1) of the batch (r = n*th + ty) -> V flat
    (16, C, pc) at column (r - r0)*tw + tx. The four input rows under a tile row are first
    copied, zero-padded and split into even and odd padded columns (E, O: tile tx reads
    E[tx], O[tx], E[tx+1], O[tx+1]), so the tile loop is contiguous and branch-free."""
    L = tw + 1
    plane = U64(C * pc)
    for c in prange(C):
        E = np.empty(4 * L, np.float32)
        O = np.empty(4 * L, np.float32)
        for r in range(r0, r1):
            n = r // th
            ty = r - n * th
            for i in range(4):
                iy = 2 * ty - ph + i
                e0 = U64(i * L)
                if iy < 0 or iy >= H:
                    for j in range(L):
                        E[e0 + U64(j)] = 0.0
                        O[e0 + U64(j)] = 0.0
                    continue
                base = ((n * C + c) * H + iy) * W
                for j in range(L):       # padded columns 2j, 2j + 1 read input columns - pw
                    ix = 2 * j - pw
                    E[e0 + U64(j)] = x[U64(base + ix)] if 0 <= ix < W else np.float32(0.0)
                    O[e0 + U64(j)] = x[U64(base + ix + 1)] if 0 <= ix + 1 < W else np.float32(0.0)
            dst = U64(c * pc + (r - r0) * tw)
            L1, L2, L3 = U64(L), U64(2 * L), U64(3 * L)
            for tx in range(tw):
                t = U64(tx)
                # rows of B^T d at the even/odd columns tx and tx + 1
                t1 = t + U64(1)
                ea0, eb0, ec0, ed0 = _bt_column(E, t, L1, L2, L3)
                oa0, ob0, oc0, od0 = _bt_column(O, t, L1, L2, L3)
                ea1, eb1, ec1, ed1 = _bt_column(E, t1, L1, L2, L3)
                oa1, ob1, oc1, od1 = _bt_column(O, t1, L1, L2, L3)
                d = dst + t
                # (B^T d) B along each row: columns (e0, o0, e1, o1) -> (e0 - e1, o0 + e1, e1 - o0, o0 - o1)
                _put4(V, d, plane, 0, (ea0 - ea1, oa0 + ea1, ea1 - oa0, oa0 - oa1))
                _put4(V, d, plane, 4, (eb0 - eb1, ob0 + eb1, eb1 - ob0, ob0 - ob1))
                _put4(V, d, plane, 8, (ec0 - ec1, oc0 + ec1, ec1 - oc0, oc0 - oc1))
                _put4(V, d, plane, 12, (ed0 - ed1, od0 + ed1, ed1 - od0, od0 - od1))


@njit(parallel=True, fastmath=True, cache=True)
def _output_transform(M, out, bias, o0, ot, ld_o, pc, OC, OH, OW, th, tw, r0, r1):
    """M flat (16, ld_o, pc) for output channels [o0, o0 + ot) and tile rows [r0, r1) -> out
    flat (N, OC, OH, OW) = A^T m A + bias; where OH/OW are odd the last row/column is cut."""
    plane = U64(ld_o * pc)
    fw = OW // 2                     # tiles whose two columns both exist
    for o in prange(ot):
        oc = o0 + o
        bv = bias[oc]
        for r in range(r0, r1):
            n = r // th
            ty = r - n * th
            y = 2 * ty
            two = y + 1 < OH
            src = U64(o * pc + (r - r0) * tw)
            row0 = U64(((n * OC + oc) * OH + y) * OW)
            row1 = row0 + U64(OW)
            for tx in range(tw):
                p = src + U64(tx)
                m0, m1, m2, m3 = M[p], M[p + plane], M[p + U64(2) * plane], M[p + U64(3) * plane]
                m4, m5, m6, m7 = (M[p + U64(4) * plane], M[p + U64(5) * plane], M[p + U64(6) * plane],
                                  M[p + U64(7) * plane])
                m8, m9, m10, m11 = (M[p + U64(8) * plane], M[p + U64(9) * plane], M[p + U64(10) * plane],
                                    M[p + U64(11) * plane])
                m12, m13, m14, m15 = (M[p + U64(12) * plane], M[p + U64(13) * plane], M[p + U64(14) * plane],
                                      M[p + U64(15) * plane])
                s00 = m0 + m4 + m8       # A^T m: rows 0 + 1 + 2 and 1 - 2 - 3
                s01 = m1 + m5 + m9
                s02 = m2 + m6 + m10
                s03 = m3 + m7 + m11
                s10 = m4 - m8 - m12
                s11 = m5 - m9 - m13
                s12 = m6 - m10 - m14
                s13 = m7 - m11 - m15
                x = U64(2 * tx)
                out[row0 + x] = s00 + s01 + s02 + bv
                if tx < fw:
                    out[row0 + x + U64(1)] = s01 - s02 - s03 + bv
                if two:
                    out[row1 + x] = s10 + s11 + s12 + bv
                    if tx < fw:
                        out[row1 + x + U64(1)] = s11 - s12 - s13 + bv


def winograd_applies(C: int, OC: int, N: int, OH: int, OW: int) -> bool:
    """Whether conv_winograd pays for a 3x3 stride-1 groups-1 conv of these sizes."""
    return C >= MIN_CHANNELS and OC >= MIN_CHANNELS and N * -(-OH // 2) * -(-OW // 2) >= MIN_TILES


def winograd_bf16_applies(C: int, OC: int, N: int, OH: int, OW: int) -> bool:
    """Whether conv_winograd_bf16 takes a 3x3 stride-1 groups-1 conv with F16/BF16 weights: as
    winograd_applies, but any OC (the output transform is fused, so a thin OC, e.g. the VAE's
    128 -> 3 conv_out, costs no float32 M pass; its rows pad to a 6-row micro-tile)."""
    return C >= MIN_CHANNELS and N * -(-OH // 2) * -(-OW // 2) >= MIN_TILES


def _even_split(n: int, cap: int) -> int:
    parts = -(-n // max(1, min(n, cap)))
    return -(-n // parts)


def conv_winograd(x4: np.ndarray, w, b, out4: np.ndarray, ph: int, pw: int, buffer, col_bytes: int) -> None:
    """out4 (N, OC, OH, OW) = 3x3 conv of x4 (N, C, H, W) (float32, C-contiguous) with weight rows
    `w` (conv.py's _WeightRows, K = 9C) and bias `b` (or None), zero padding (ph, pw), stride 1.
    `buffer(name, n)` gives reusable float32 scratch (conv.py's per-thread buffers); V, in the
    "cols" buffer, stays under `col_bytes` (conv.py's COL_BYTES)."""
    N, C, H, W = x4.shape
    OC, OH, OW = out4.shape[1:]
    path = getattr(w, "bf16", None)  # F16/BF16 weights with the bf16 GEMM on: the one-call C kernel
    if path is not None:
        conv_winograd_bf16(x4, w.rows.view(np.uint16), w.dt.name, b, out4, ph, pw, path)
        return
    th, tw = -(-OH // 2), -(-OW // 2)
    ot = _even_split(OC, WINO_BYTES // (64 * C))                       # U tile: 16*ot*C floats
    rc = _even_split(N * th, min(col_bytes // (64 * C * tw), WINO_BYTES // (64 * ot * tw)))
    pc = rc * tw
    U = buffer("wino_u", 16 * ot * C)
    V = buffer("cols", 16 * C * pc)
    M = buffer("wino_m", 16 * ot * pc)
    Uk, Vk, Mk = U.reshape(16, ot, C), V.reshape(16, C, pc), M.reshape(16, ot, pc)
    bias = b if b is not None else np.zeros(OC, np.float32)
    xf, of = x4.reshape(-1), out4.reshape(-1)

    def filters(t0, t1):
        for s0, s1, rows in w.tiles(t0, t1):
            _filter_transform(rows.reshape(-1), U, s1 - s0, C, s0 - t0, ot)

    one_tile = ot >= OC

    def mm(k):
        np.matmul(ut[k], vt[k], out=mt[k])
    if one_tile:
        filters(0, OC)
    for r0 in range(0, N * th, rc):
        r1 = min(N * th, r0 + rc)
        n_p = (r1 - r0) * tw
        _input_transform(xf, V, N, C, H, W, th, tw, ph, pw, r0, r1, pc)
        for t0 in range(0, OC, ot):
            t1 = min(OC, t0 + ot)
            if not one_tile:
                filters(t0, t1)
            ut, vt, mt = Uk[:, :t1 - t0], Vk[:, :, :n_p], Mk[:, :t1 - t0, :n_p]
            run_tasks(mm, range(16))
            _output_transform(M, of, bias, t0, t1 - t0, ot, pc, OC, OH, OW, th, tw, r0, r1)


def conv_winograd_bf16(x4: np.ndarray, w: np.ndarray, w_type: str, b, out4: np.ndarray, ph: int, pw: int,
                       path: str, up: int = 0) -> None:
    """out4 (N, OC, OH, OW) = 3x3 conv (zero padding (ph, pw), stride 1) of x4 (N, C, H, W) float32
    read through a nearest 2^up upsample, with F16/BF16 weight rows `w` (OC, 9C) as uint16 bits,
    in one call of _bf16wino.h: filter and input transforms rounded to bf16 straight into the
    GEMM's packed layouts, the 16 products and the output transform (+ bias) per block."""
    N, C, H, W = x4.shape
    OC, OH, OW = out4.shape[1:]
    if w.shape != (OC, 9 * C) or w.dtype != np.uint16 or up not in (0, 1):
        raise OpError(f"bf16 Winograd: weight {w.shape} {w.dtype} / up {up} do not fit {x4.shape} -> {out4.shape}")
    if OH != (H << up) + 2 * ph - 2 or OW != (W << up) + 2 * pw - 2:
        raise OpError(f"bf16 Winograd: output {out4.shape} does not fit input {x4.shape} (up {up}, pad {ph}, {pw})")
    for a in (x4, out4):
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise OpError("bf16 Winograd: input and output must be C-contiguous float32")
    if not hasattr(bf16gemm._k, "wino_conv"):
        raise OpError("bf16 Winograd: the sdrt.ops.cpu._bf16 extension was built before this kernel existed; "
                      "rebuild it (pip install -e . or python setup.py build_ext --inplace)")
    bias = None if b is None else np.ascontiguousarray(b, np.float32).reshape(OC)
    bf16gemm._k.wino_conv(x4, up, np.ascontiguousarray(w), bf16gemm._CODES[w_type], bias, out4, ph, pw,
                          BF16_CHUNK_BYTES, BF16_MC, bf16gemm.PATHS[path], get_threads())
