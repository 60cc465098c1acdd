"""CPU kernels for mul_mat and get_rows.

mul_mat: every GEMM is numpy's BLAS on float32 2-D blocks. F32 weights go straight to BLAS;
every other weight type (F16, BF16, F8, F64 and all block types) is widened/dequantized a tile
of rows at a time into one reusable float32 scratch, and BLAS multiplies the tile into its
column slice of the output — the whole weight is never expanded. Each tile is shared by all
rows of x that use that weight batch, so the widening cost is amortised over M.

Tile height: every BLAS call re-packs all of x (M*K) for its N_tile columns, an overhead of
about 1/N_tile of the GEMM, so tiles are as tall as TILE_BYTES (32 MiB of float32, the L3
size) allows: 2048 rows at K=4096, the whole weight at SD's K=320..1280.

Quantized weights of the types sdrt.ops.quant.gemm takes (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K) skip
all of this by default: its C kernel quantizes the activations to int8 blocks and multiplies
with integer dot products (AVX512-VNNI / AVX2 / portable C, chosen from CPUID), as ggml does;
`SDRT_QGEMM=off` keeps the exact dequantize + BLAS path below. F16/BF16 weights likewise go to
sdrt.ops.cpu.bf16gemm's kernel (bf16 x bf16 -> float32, vdpbf16ps) where the CPU has
AVX512_BF16; `SDRT_BF16GEMM=off` keeps the exact widen + BLAS path.

The widening kernels are serial Numba loops (the hardware half -> float conversion for F16,
falling back to bit arithmetic and one multiply; a shift for BF16, a 256-entry table for F8):
a tile widens in well under 1% of its GEMM time, and Numba's thread pool was slower for these
memory-bound tiles while BLAS holds the cores. No second thread widens the next tile while BLAS
multiplies this one: overlap could win at most a few percent.

Small GEMMs (up to SMALL_GEMM_ROWS activation rows: CLIP's 77 tokens, cross-attention K/V, the
time embedding; below SMALL_GEMM_MACS of work, so T5-XXL's 256-token GEMMs keep both threads) run
BLAS on one thread: OpenBLAS's second thread has gone to sleep between calls
and waking it costs up to a scheduler quantum. The measurements behind all three choices are in
bench/README.md.
"""
from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from ...errors import OpError
from ..convert import _f8_table
from ..matmul import check_ids
from . import CPU
from ..threads import get_threads, one_blas_thread
from ._util import as4d, f32_input

TILE_BYTES = 32 << 20   # float32 bytes of one dequantized weight tile (kept per thread)
TILE_ROWS: int | None = None  # override the tile height (tests use it to force many tiles)
SMALL_GEMM_ROWS = 256   # GEMMs with at most this many activation rows run BLAS on one thread ...
SMALL_GEMM_MACS = 1 << 30  # ... unless they are this much work (T5-XXL's 256 x 4096 x 4096: 4.3 G)
TINY_GEMM_MACS = 1 << 24   # any GEMM below this runs on one thread (rank-32 LoRA GEMMs: ~0.4 ms)

# F16 bit pattern -> F32 bit pattern, every one of the 65536 halves (exact, NaN payloads kept)
_F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)


@njit(fastmath=True, cache=True)
def _widen_u16_table(raw, out, table):
    for i in range(raw.shape[0]):
        for j in range(raw.shape[1]):
            out[i, j] = table[raw[i, j]]


@intrinsic
def _u32_as_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


def _widen_f16_py(raw, out):
    """F16 bits -> F32 bits, bit-exact with numpy's astype (the table): the magnitude bits
    shifted into F32 position read as a float 2^-112 times the value (F16 subnormals land on F32
    subnormals), so one multiply by 2^112 rebases the exponent; Inf/NaN (exponent 31) get the F32
    all-ones exponent with the payload kept; the sign is OR-ed back. No table gather, so LLVM
    vectorizes it (no fastmath: the multiply must not flush subnormals)."""
    for i in range(raw.shape[0]):
        r = raw[i]
        o = out[i]
        for j in range(r.shape[0]):
            h = np.uint32(r[j])
            m = (h & np.uint32(0x7FFF)) << np.uint32(13)
            b = _f32_as_u32(_u32_as_f32(m) * np.float32(5.192296858534828e33))
            if m >= np.uint32(0x0F800000):
                b = m | np.uint32(0x7F800000)
            o[j] = b | ((h & np.uint32(0x8000)) << np.uint32(16))


_widen_f16 = njit(cache=True)(_widen_f16_py)


@intrinsic
def _f16_bits_to_f32(typingctx, x):
    """uint16 F16 bits -> float32 through LLVM's fpext half -> float: one vcvtph2ps per 16 values
    on x86 (F16C, in every AVX2/AVX-512 CPU), fcvtl on Arm."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@njit(cache=True)
def _widen_f16_hw(raw, out):
    for i in range(raw.shape[0]):
        r = raw[i]
        o = out[i]
        for j in range(r.shape[0]):
            o[j] = _f16_bits_to_f32(r[j])


_F16_HW: bool | None = None  # whether the hardware conversion compiled and checked out


def widen_f16(raw: np.ndarray, out: np.ndarray) -> None:
    """2-D uint16 F16 bits -> float32 `out`. The hardware conversion (one thread, a 59 MB float32
    conv weight: 3.0 vs 4.2 ms CPU time here, 12.8 vs 13.7 ms on a memory-bound Xeon slot)
    equals numpy's astype on every bit pattern except signalling NaNs, which come back
    quiet (as ggml's own F16C conversion gives them); where it does not compile or check out on
    the 65536 patterns, the bit-arithmetic widener runs instead."""
    global _F16_HW
    if _F16_HW is None:
        try:
            h = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
            got = np.empty((256, 256), np.float32)
            _widen_f16_hw(h, got)
            want = h.view(np.float16).astype(np.float32)
            _F16_HW = bool(np.array_equal(got, want, equal_nan=True)
                           and np.array_equal(got[~np.isnan(want)].view(np.uint32), want[~np.isnan(want)].view(np.uint32)))
        except Exception:  # no half type in this LLVM target: keep the portable widener
            _F16_HW = False
    if _F16_HW:
        _widen_f16_hw(raw, out)
    else:
        _widen_f16(raw, out.view(np.uint32))


@njit(fastmath=True, cache=True)
def _widen_bf16(raw, out):
    for i in range(raw.shape[0]):
        for j in range(raw.shape[1]):
            out[i, j] = np.uint32(raw[i, j]) << np.uint32(16)


@njit(fastmath=True, cache=True)
def _widen_u8_table(raw, out, table):
    for i in range(raw.shape[0]):
        for j in range(raw.shape[1]):
            out[i, j] = table[raw[i, j]]


@njit(cache=True)
def _gather_u16(table, ids, out, mode, lut):
    # mode 0: F16 via lut, 1: BF16 by shift; out is the uint32 view of the F32 rows
    for r in range(ids.shape[0]):
        src = table[ids[r]]
        dst = out[r]
        if mode == 0:
            for j in range(src.shape[0]):
                dst[j] = lut[src[j]]
        else:
            for j in range(src.shape[0]):
                dst[j] = np.uint32(src[j]) << np.uint32(16)


@njit(cache=True)
def _gather_u8(table, ids, out, lut):
    for r in range(ids.shape[0]):
        src = table[ids[r]]
        dst = out[r]
        for j in range(src.shape[0]):
            dst[j] = lut[src[j]]


def _quant():
    from .. import quant
    return quant


def _dequant_tile(dt, w2d, r0, r1, tile):
    # One thread: BLAS holds both cores; an OpenMP team here was measured 50-100x slower than
    # the serial loop on a loaded machine (barrier/spin contention with OpenBLAS), one thread
    # dequantizes a 4096x4096 Q8_0/Q4_K weight in ~3 ms (<1% of its GEMM), and even at M=16
    # threads did not help.
    _quant().dequantize_rows(w2d, dt, r0, r1, out=tile, nthreads=1)


def fill_rows(dt, w2d: np.ndarray, r0: int, r1: int, tile: np.ndarray) -> None:
    """Write rows [r0, r1) of weight `w2d` (raw storage of dtype `dt`) into float32 `tile`."""
    name = dt.name
    if dt.is_quantized:
        _dequant_tile(dt, w2d, r0, r1, tile)
    elif name == "F16":
        widen_f16(w2d[r0:r1].view(np.uint16), tile)
    elif name == "BF16":
        _widen_bf16(w2d[r0:r1], tile.view(np.uint32))
    elif name in ("F8_E4M3", "F8_E5M2"):
        _widen_u8_table(w2d[r0:r1], tile, _f8_table(name))
    else:  # F32 that BLAS cannot read in place, F64
        np.copyto(tile, w2d[r0:r1], casting="unsafe")


def tile_rows(n: int, k: int) -> int:
    """Rows per weight tile: about TILE_BYTES of float32, split evenly over the tiles."""
    t = TILE_ROWS or max(256, TILE_BYTES // (4 * k))
    ntiles = -(-n // t)
    t = -(-n // ntiles)
    return t if TILE_ROWS else min(n, (t + 15) // 16 * 16)


_TLS = threading.local()


def _scratch(n: int) -> np.ndarray:
    """A reusable float32 buffer of >= n elements (per thread; a fresh 32 MiB np.empty per
    GEMM would page-fault its way in every call)."""
    buf = getattr(_TLS, "buf", None)
    if buf is None or buf.size < n:
        buf = _TLS.buf = np.empty(n, np.float32)
    return buf[:n]


def _blasable(a: np.ndarray) -> bool:
    """Whether BLAS can read 2-D float32 `a` in place (unit stride along one axis)."""
    s0, s1 = a.strides
    return a.dtype == np.float32 and (s1 == 4 and s0 >= 4 * a.shape[1] or s0 == 4 and s1 >= 4 * a.shape[0])


def _int8_path(dt, k: int, groups) -> str | None:
    """The int8-activation kernel's path for this GEMM (sdrt.ops.quant.gemm), or None."""
    if not dt.is_quantized:
        return None
    from ..quant import gemm as qg
    path = qg.active_path()
    if path is None or not qg.supports(dt, k):
        return None
    if any(xg.strides[1] != 4 or og.strides[1] != 4 for xg, og in groups):
        return None
    return path


def gemm_weight(dt, w2d: np.ndarray, groups) -> None:
    """For each (x2d, o2d) in groups: o2d = x2d @ w^T, w given as raw 2-D storage of dtype dt.
    Quantized weights the integer kernel takes go there (both cores, int8 activations);
    otherwise few activation rows run BLAS on one thread (see the module docstring)."""
    from . import bf16gemm
    bpath = bf16gemm.path_for(dt.name)
    if bpath is not None and w2d.ndim == 2:
        wt = w2d.view(np.uint16).T  # [K, N] view of the [N, K] rows
        for xg, og in groups:
            bf16gemm.gemm(xg, "F32", wt, dt.name, og, bpath, get_threads())
        return
    path = _int8_path(dt, groups[0][0].shape[1], groups)
    if path is not None:
        from ..quant import gemm as qg
        for xg, og in groups:
            qg.qgemm(xg, w2d, dt, og, path, get_threads())
        return
    rows = max(xg.shape[0] for xg, _ in groups)
    macs = rows * w2d.shape[0] * groups[0][0].shape[1]
    if get_threads() > 1 and (rows <= SMALL_GEMM_ROWS and macs < SMALL_GEMM_MACS or macs < TINY_GEMM_MACS):
        with one_blas_thread():
            _gemm_weight(dt, w2d, groups)
    else:
        _gemm_weight(dt, w2d, groups)


def _gemm_weight(dt, w2d: np.ndarray, groups) -> None:
    n = w2d.shape[0]
    if dt.name == "F32" and _blasable(w2d):
        for xg, og in groups:
            np.matmul(xg, w2d.T, out=og)
        return
    k = groups[0][0].shape[1]
    t = tile_rows(n, k)
    scratch = _scratch(t * k).reshape(t, k)
    for r0 in range(0, n, t):
        r1 = min(n, r0 + t)
        tile = scratch[: r1 - r0]
        fill_rows(dt, w2d, r0, r1, tile)
        for xg, og in groups:
            np.matmul(xg, tile.T, out=og[:, r0:r1])


@CPU.register("mul_mat")
def _mul_mat(node, xs, out):
    wt, xt = node.src
    w4 = as4d(xs[0])
    # BLAS wants unit-stride rows; a copy of x is M*K against 2*M*K*N flops
    x4 = np.ascontiguousarray(as4d(f32_input(xt, xs[1])), dtype=np.float32)
    o4 = as4d(out)
    b3, b2, _, k = x4.shape
    w3, w2, n = w4.shape[:3]
    r3, r2 = b3 // w3, b2 // w2
    for j3 in range(w3):
        for j2 in range(w2):
            if w3 == 1 and w2 == 1:  # one weight for every batch: a single tall GEMM
                groups = [(x4.reshape(-1, k), o4.reshape(-1, n))]
            else:
                sl = slice(j2 * r2, (j2 + 1) * r2)
                groups = [(x4[i3, sl].reshape(-1, k), o4[i3, sl].reshape(-1, n))
                          for i3 in range(j3 * r3, (j3 + 1) * r3)]
            gemm_weight(wt.dtype, w4[j3, j2], groups)


@CPU.register("get_rows")
def _get_rows(node, xs, out):
    tt = node.src[0]
    dt = tt.dtype
    t4 = as4d(xs[0])
    ids = xs[1]
    i3 = ids.reshape((1,) * (3 - ids.ndim) + ids.shape)
    o4 = as4d(out)
    check_ids(i3, t4.shape[2])
    for a in range(i3.shape[0]):
        for b in range(i3.shape[1]):
            tab, idv, o = t4[a, b], np.ascontiguousarray(i3[a, b], np.int64), o4[a, b]
            if dt.is_quantized:
                _quant().get_rows(tab, dt, idv, out=o)
            elif dt.name == "F32":
                np.take(tab, idv, axis=0, out=o)
            elif dt.name == "F16":
                _gather_u16(tab.view(np.uint16), idv, o.view(np.uint32), 0, _F16_TABLE)
            elif dt.name == "BF16":
                _gather_u16(tab, idv, o.view(np.uint32), 1, _F16_TABLE)
            elif dt.name in ("F8_E4M3", "F8_E5M2"):
                _gather_u8(tab, idv, o, _f8_table(dt.name))
            elif dt.is_float:
                np.copyto(o, tab[idv], casting="unsafe")
            else:
                raise OpError(f"get_rows: no CPU kernel for a {dt.name} table")
