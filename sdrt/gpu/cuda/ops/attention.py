"""CUDA kernels for attention (op definition: sdrt/ops/attention.py; CPU: sdrt/ops/cpu/attention.py;
device code: kernels/attention.cu).

Paths, chosen per node by `plan()` (and, for flash, by the device):
- "flash" on sm_90 for the head dims of WGMMA_VARIANT (attn_wgmma_* kernels,
  kernels/attention_sm90.cu, built for sm_90a): the same scheme on Hopper's warpgroup MMA with
  FlashAttention-3's in-warpgroup pipelining, K/V tiles in wgmma's 128-byte swizzle layout, the
  same arguments and staging as the mma kernels below.
- "flash" on sm_80+ otherwise (attn_mma_* kernels): FlashAttention-2's scheme on mma.sync tensor-core
  instructions; scores, probabilities and the output accumulator stay in registers, K/V tiles
  go through shared memory in a 2-4 stage cp.async pipeline (MMA_STAGES). F16 q/k/v whose rows are 16-byte
  aligned with D a multiple of 8 are read in place through their strides (q scaled by
  scale*log2(e) in registers); anything else (F32/BF16, odd strides: the UNet hands F32
  views) is first packed by attn_pack_* into contiguous half [batch][head][row][round_up(D, 8)]
  scratch (q pre-scaled there). Head dims are padded in shared memory to a compiled size
  (FLASH_DIMS); MMA_VARIANT picks rows per warp (16*RF) and warps per block (NW) per size.
- "flash" elsewhere, or forced as "wmma" (attn_flash_d<DP>_r<RF>): the portable kernel on the
  wmma API (HIP's rocWMMA has the same), scores through shared memory; q/k/v staged by
  attn_stage_* into padded half buffers. Kept as the fallback and tested on every GPU run.
  Values beyond half's range (|x| > 65504, possible only for F32/BF16 inputs) become inf in
  either flash kernel; such a node needs precision="F32".
- "gemm": S = Q K^T with cuBLAS, a row softmax kernel, O = P V with cuBLAS, over chunks of
  queries so that the scores stay under SCORE_BYTES. With compute "F32" the GEMMs run pedantic
  FP32 (no tensor cores): the full-precision path, taken when the node carries
  `precision="F32"` (ggml's GGML_PREC_F32; build it with
  `make_node("attention", srcs, scale=s, precision="F32")`). With compute "F16" it serves head
  dims above the largest flash tile (the VAE's single 512-wide head), where the GEMMs are large
  enough for cuBLAS to run well. bench/bench_cuda_attention.py uses it as the cuBLAS reference.

Both paths accept every node the CPU kernel accepts (F32/F16/BF16 inputs, any strides, GQA and
batch broadcast, masks of every broadcast form). A kernel function only enqueues work on
rt.stream (CUDA-graph capturable); scratch comes from rt.scratch.
"""
from __future__ import annotations

import math
import os

from ....errors import UnsupportedError
from ....ops.dtypes import BY_NAME
from ....ops.registry import FLOATS
from ..devtensor import SUFFIX as _SUFFIX
from ..devtensor import DevTensor
from .elementwise import cast_or_copy
from ..table import CUDA

MODULE = "attention"
DTYPE_CODE = {"F32": 0, "F16": 1, "BF16": 2}  # kernels/attention.cu DT_*

WARPS = 4                 # warps per flash block (FLASH_WARPS in the .cu)
FLASH_DIMS = (16, 32, 48, 64, 80, 96, 128, 160)  # compiled padded head dims
# rows per warp / 16 for each head dim: the variants compiled are (dp, 1) for every dp and
# (dp, 2) for FLASH_RF2_DIMS; 2 halves the K/V fragment loads per product but needs more registers.
FLASH_RF2_DIMS = (32, 48, 64, 80)
FLASH_RF = {16: 1, 32: 2, 48: 2, 64: 1, 80: 1, 96: 1, 128: 1, 160: 1}
SCORE_BYTES = 32 << 20    # gemm path: scores + probabilities of one query chunk (one size: see conv.COL_BYTES)
FORCE_PATH: str | None = None  # tests/bench: "flash", "wmma", "gemm16" or "gemm32" (default: plan())
USE_WGMMA = os.environ.get("SDRT_CUDA_WGMMA", "1") != "0"   # False: the mma.sync kernels on sm_90 too

# sm_80+ flash kernels attn_mma_d<dp>_r<rf>_w<nw> (kernels/attention.cu MMA_KERNEL lines): the
# default (rf, nw) per padded head dim, every compiled variant (the bench times them all) and the
# K/V pipeline stages per head dim (compiled into the kernels; the shared memory follows)
MMA_VARIANT = {16: (2, 4), 32: (2, 4), 48: (2, 4), 64: (2, 4), 80: (2, 4), 96: (1, 4), 128: (1, 4),
               160: (1, 4)}
MMA_KERNELS = frozenset({(d, r, w) for d, (r, w) in MMA_VARIANT.items()} |
                        {(48, 1, 4), (64, 1, 4), (128, 1, 8)})
MMA_STAGES = {16: 3, 32: 3, 48: 3, 64: 4, 80: 3, 96: 2, 128: 2, 160: 2}
MMA_BK = 64               # keys per tile (MMA_BK in the .cu)
_OFFSET_LIMIT = 1 << 31   # the mma kernel's K/V offsets within a head are 32-bit

# sm_90a flash kernels attn_wgmma_d<dp>_g<warpgroups>_k<keys per tile>_p<pipelined> (kernels/
# attention_sm90.cu WGMMA_KERNEL lines) with their K/V pipeline stages, and the default variant
# per head dim
WGMMA_MODULE = "attention_sm90"
WGMMA_KERNELS = {(64, 2, 128, 1): 3, (64, 2, 64, 0): 3, (64, 3, 128, 0): 2,
                 (128, 2, 64, 1): 4, (128, 3, 64, 1): 3, (128, 2, 64, 0): 3, (128, 3, 64, 0): 2,
                 (128, 1, 64, 0): 2, (128, 2, 128, 0): 2}
WGMMA_VARIANT = {128: (3, 64, 0)}   # head dim 64: the mma kernel is faster (bench_cuda_attention.py)

_BLOCK = 256              # threads of the staging kernel's blocks
_MAX_GRID_X = 1 << 20     # grid-stride kernels: enough blocks to fill any GPU
_MAX_GRID_YZ = 65535


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def flash_dim(D: int, Dv: int) -> int | None:
    """The compiled padded head dim that holds both D and Dv, or None when too large."""
    need = _round_up(max(D, Dv), 16)
    return next((d for d in FLASH_DIMS if d >= need), None)


def wants_f32(node) -> bool:
    return str(node.params.get("precision", "")).upper() == "F32"


def plan(node) -> tuple:
    """("flash", DP, RF), ("wmma", DP, RF) or ("gemm", compute dtype name). "flash" runs the
    mma kernel on sm_80+ and the wmma one (with RF) elsewhere; "wmma" forces the latter."""
    q, v = node.src[0], node.src[2]
    dp = flash_dim(q.ne4[0], v.ne4[0])
    path = FORCE_PATH
    if path is None:
        path = "gemm32" if wants_f32(node) else "flash" if dp is not None else "gemm16"
    if path in ("flash", "wmma"):
        if dp is None:
            raise UnsupportedError(f"attention: head dims D={q.ne4[0]}, Dv={v.ne4[0]} exceed the flash "
                                   f"tiles (at most {FLASH_DIMS[-1]}); use the gemm path")
        return (path, dp, FLASH_RF[dp])
    return ("gemm", "F32" if path == "gemm32" else "F16")


def _supports(node) -> bool:
    return all(s.dtype.name in FLOATS for s in node.src) and node.dtype.name == "F32"


@CUDA.register("attention", supports=_supports)
def attention(node, xs, out, rt) -> None:
    p = plan(node)
    if p[0] == "flash" and tuple(rt.device.capability) >= (8, 0):
        mma_attention(node, xs, out, rt, p[1])
    elif p[0] in ("flash", "wmma"):
        flash_attention(node, xs, out, rt, p[1], p[2])
    else:
        gemm_attention(node, xs, out, rt, p[1])


# ---- shared pieces ------------------------------------------------------------------------

def _scratch(rt, nbytes: int) -> int:
    """A scratch region aligned to 256 bytes (wmma loads need 32, uint4 loads 16)."""
    return _round_up(rt.scratch(nbytes + 256), 256)


def _stage(rt, src, out_dtype: str, dst: int, Dpad: int, Lpad: int, H: int, N: int,
           rh: int, rn: int, scale: float) -> None:
    """src (a strided DevTensor ne [D, L, Hs, Ns]) -> dst[N][H][Lpad][Dpad] in out_dtype,
    times scale, zero padded; head h of batch n reads source head h/rh of batch n/rn."""
    D, L = src.ne[0], src.ne[1]
    total = N * H * Lpad * Dpad
    fn = rt.fn(MODULE, f"attn_stage_{_SUFFIX[src.dtype.name]}_{_SUFFIX[out_dtype]}",
               "PqqqqP" + "i" * 8 + "f")
    grid = (min(_cdiv(total, _BLOCK), _MAX_GRID_X), 1, 1)
    fn(grid, (_BLOCK, 1, 1), src.ptr, *src.nb, dst, D, L, H, N, rh, rn, Dpad, Lpad, float(scale))


def _mask_args(mask) -> tuple:
    """(ptr, dtype code, nb0..nb3, Mq, M2, M3) for the kernels; a null mask when absent."""
    if mask is None:
        return (0, 0, 0, 0, 0, 0, 1, 1, 1)
    return (mask.ptr, DTYPE_CODE[mask.dtype.name], *mask.nb, mask.ne[1], mask.ne[2], mask.ne[3])


def _shapes(xs):
    q, k, v = xs[:3]
    D, Lq, H, N = q.ne
    Lk, Hkv, Nk = k.ne[1], k.ne[2], k.ne[3]
    return D, v.ne[0], Lq, Lk, H, N, H // Hkv, N // Nk


# ---- flash path, sm_80+ ---------------------------------------------------------------------

def mma_smem_bytes(dp: int, rf: int, nw: int) -> int:
    """Dynamic shared memory of attn_mma_d<dp>_r<rf>_w<nw> (mma_smem_halves in the .cu)."""
    ld, st = dp + 8, MMA_STAGES[dp]
    return 2 * max(2 * st * MMA_BK * ld, 2 * (st - 1) * MMA_BK * ld + nw * 16 * rf * ld)


def _direct(t) -> bool:
    """Can the mma kernel read this DevTensor in place (F16, contiguous 16-byte-aligned rows)?"""
    return (t.dtype.name == "F16" and t.nb[0] == 2 and t.ne[0] % 8 == 0 and t.ptr % 16 == 0
            and all(b % 16 == 0 for b in t.nb[1:])
            and (t.ne[1] + MMA_BK) * (t.nb[1] // 2) < _OFFSET_LIMIT)


def _pack(rt, t, scale: float) -> tuple:
    """(ptr, row/head/batch strides in halves, valid columns, packed?) of t as the mma kernel
    reads it: t itself when _direct (scale not applied), else packed into half scratch times
    scale (rows of round_up(D, 8), so its offsets stay 32-bit up to millions of keys)."""
    D, L, Hs, Ns = t.ne
    if _direct(t):
        return t.ptr, t.nb[1] // 2, t.nb[2] // 2, t.nb[3] // 2, D, False
    dpad = _round_up(D, 8)
    dst = _scratch(rt, Ns * Hs * L * dpad * 2)
    fn = rt.fn(MODULE, f"attn_pack_{_SUFFIX[t.dtype.name]}", "PqqqqP" + "i" * 5 + "f")
    grid = (max(1, min(_cdiv(L * dpad // 8, _BLOCK), _MAX_GRID_X)), min(Hs, _MAX_GRID_YZ), min(Ns, _MAX_GRID_YZ))
    fn(grid, (_BLOCK, 1, 1), t.ptr, *t.nb, dst, D, L, Hs, Ns, dpad, float(scale))
    return dst, dpad, L * dpad, Hs * L * dpad, dpad, True


def wgmma_smem_bytes(dp: int, nwg: int, bk: int, pipe: int) -> int:
    """Dynamic shared memory of attn_wgmma_d<dp>_g<nwg>_k<bk>_p<pipe> (wg_smem_bytes in the .cu)."""
    return 2 * (WGMMA_KERNELS[(dp, nwg, bk, pipe)] * 2 * bk * dp + nwg * 64 * dp) + 1024


def _kernel(rt, dp: int, variant=None) -> tuple:
    """(launcher, threads per block, query rows per block, shared bytes) of the flash kernel
    for padded head dim dp on this device: wgmma on sm_90 where compiled, else mma.sync.
    variant: ("wgmma", nwg, bk, pipe) or ("mma", rf, nw) to pick one (the bench times them all)."""
    args = "Pqqq" * 3 + "iif" + "Pi" + "qqqq" + "iii" + "Pqqqi" + "i" * 7
    if variant is None:
        wg = USE_WGMMA and tuple(rt.device.capability) == (9, 0) and dp in WGMMA_VARIANT
        variant = ("wgmma", *WGMMA_VARIANT[dp]) if wg else ("mma", *MMA_VARIANT[dp])
    if variant[0] == "wgmma":
        _, nwg, bk, pipe = variant
        fn = rt.fn(WGMMA_MODULE, f"attn_wgmma_d{dp}_g{nwg}_k{bk}_p{pipe}", args)
        return fn, nwg * 128, nwg * 64, wgmma_smem_bytes(dp, nwg, bk, pipe)
    _, rf, nw = variant
    fn = rt.fn(MODULE, f"attn_mma_d{dp}_r{rf}_w{nw}", args)
    return fn, nw * 32, nw * 16 * rf, mma_smem_bytes(dp, rf, nw)


def mma_attention(node, xs, out, rt, dp: int, out_strides=None, variant=None) -> None:
    """The sm_80+ flash kernels (_kernel picks one). out_strides: (row, head, batch) element
    steps of the output (default: out contiguous [Dv, Lq, H, N]); out may be F32, F16 or BF16."""
    q, k, v = xs[:3]
    mask = xs[3] if len(xs) == 4 else None
    _, Dv, Lq, Lk, H, N, rh, rn = _shapes(xs)
    os1, os2, os3 = out_strides or (Dv, Lq * Dv, H * Lq * Dv)
    fn, threads, bq, shmem = _kernel(rt, dp, variant)
    sl2 = node.params["scale"] * math.log2(math.e)
    qp, qs1, qs2, qs3, dq, staged = _pack(rt, q, sl2)
    kp, ks1, ks2, ks3, _, _ = _pack(rt, k, 1.0)
    vp, vs1, vs2, vs3, dvv, _ = _pack(rt, v, 1.0)
    grid = (_cdiv(Lq, bq), min(H, _MAX_GRID_YZ), min(N, _MAX_GRID_YZ))
    fn(grid, (threads, 1, 1), qp, qs1, qs2, qs3, kp, ks1, ks2, ks3, vp, vs1, vs2, vs3, dq, dvv,
       1.0 if staged else float(sl2), *_mask_args(mask), out.ptr, os1, os2, os3,
       DTYPE_CODE[out.dtype.name], Dv, Lq, Lk, H, N, rh, rn, shmem=shmem)


def attention_into_cont(att, xs, out, rt) -> None:
    """attention node `att` on xs, written as `out`, the contiguous [Dv, H, Lq, N] cont of its
    permute(0, 2, 1, 3) (the heads merged back into channels; F32, or stored F16 / BF16 for the
    GEMM or attention reading it): the mma
    kernel writes it directly through output strides (fuse.py runs this in the cont's slot);
    the other paths write the attention's own layout into scratch and copy."""
    _, Dv, Lq, _, H, N, _, _ = _shapes(xs)
    p = plan(att)
    if p[0] == "flash" and tuple(rt.device.capability) >= (8, 0):
        mma_attention(att, xs, out, rt, p[1], out_strides=(Dv * H, Dv, Dv * H * Lq))
        return
    f32 = BY_NAME["F32"]
    tmp = _scratch(rt, Dv * Lq * H * N * 4)
    attention(att, xs, DevTensor(tmp, f32, (Dv, Lq, H, N), (4, 4 * Dv, 4 * Dv * Lq, 4 * Dv * Lq * H), att), rt)
    view = DevTensor(tmp, f32, (Dv, H, Lq, N), (4, 4 * Dv * Lq, 4 * Dv, 4 * Dv * Lq * H), att)
    cast_or_copy(None, (view,), out, rt)


# ---- flash path, portable (wmma) ------------------------------------------------------------

def flash_attention(node, xs, out, rt, dp: int, rf: int) -> None:
    q, k, v = xs[:3]
    mask = xs[3] if len(xs) == 4 else None
    _, Dv, Lq, Lk, H, N, rh, rn = _shapes(xs)
    Hkv, Nk = H // rh, N // rn
    bq = WARPS * 16 * rf
    Lqp = _round_up(Lq, bq)
    qh = _scratch(rt, N * H * Lqp * dp * 2)
    kh = _scratch(rt, Nk * Hkv * Lk * dp * 2)
    vh = _scratch(rt, Nk * Hkv * Lk * dp * 2)
    scale = node.params["scale"] * math.log2(math.e)
    _stage(rt, q, "F16", qh, dp, Lqp, H, N, 1, 1, scale)
    _stage(rt, k, "F16", kh, dp, Lk, Hkv, Nk, 1, 1, 1.0)
    _stage(rt, v, "F16", vh, dp, Lk, Hkv, Nk, 1, 1, 1.0)
    fn = rt.fn(MODULE, f"attn_flash_d{dp}_r{rf}", "PPPPi" + "qqqq" + "iii" + "P" + "i" * 8)
    grid = (Lqp // bq, min(H, _MAX_GRID_YZ), min(N, _MAX_GRID_YZ))
    fn(grid, (WARPS * 32, 1, 1), qh, kh, vh, *_mask_args(mask), out.ptr, Dv, Lq, Lk, Lqp, H, N, rh, rn)


# ---- gemm path (cuBLAS + row softmax) -----------------------------------------------------

def gemm_attention(node, xs, out, rt, compute: str) -> None:
    """softmax(Q K^T + mask) V with cuBLAS per chunk of queries; compute "F16" (tensor cores,
    F32 accumulation and scores) or "F32" (pedantic FP32 GEMMs, the full-precision path)."""
    q, k, v = xs[:3]
    mask = xs[3] if len(xs) == 4 else None
    D, Dv, Lq, Lk, H, N, rh, rn = _shapes(xs)
    esz = 2 if compute == "F16" else 4
    Dc, Dvc = _round_up(D, 8), _round_up(Dv, 8)  # 16-byte aligned rows for the GEMMs
    B = N * H
    # K/V expanded to one per query head, so both GEMMs are plain strided batches over B
    qc = _scratch(rt, B * Lq * Dc * esz)
    kc = _scratch(rt, B * Lk * Dc * esz)
    vc = _scratch(rt, B * Lk * Dvc * esz)
    _stage(rt, q, compute, qc, Dc, Lq, H, N, 1, 1, node.params["scale"])
    _stage(rt, k, compute, kc, Dc, Lk, H, N, rh, rn, 1.0)
    _stage(rt, v, compute, vc, Dvc, Lk, H, N, rh, rn, 1.0)
    per_row = B * Lk * (4 + (esz if compute == "F16" else 0))  # F32 softmax runs in place
    cq = max(1, min(Lq, SCORE_BYTES // per_row))
    s_buf = _scratch(rt, B * cq * Lk * 4)
    p_buf = _scratch(rt, B * cq * Lk * esz) if compute == "F16" else s_buf
    softmax = rt.fn(MODULE, f"attn_softmax_{_SUFFIX[compute]}", "PPiiiiiPiqqqqiii")
    margs = _mask_args(mask)
    for i0 in range(0, Lq, cq):
        rows = min(cq, Lq - i0)
        # S[b][i][j] = sum_d Q[b][i0+i][d] K[b][j][d]  (column-major: S^T = K^T-op . Q)
        rt.gemm(True, False, Lk, rows, Dc, kc, compute, Dc, qc + i0 * Dc * esz, compute, Dc,
                s_buf, Lk, c_dtype="F32", batch=B, stride_a=Lk * Dc, stride_b=Lq * Dc,
                stride_c=rows * Lk)
        nrows = B * rows
        softmax((min(_cdiv(nrows, 4), _MAX_GRID_X), 1, 1), (128, 1, 1), s_buf, p_buf, B, rows,
                Lk, H, i0, *margs)
        # out[b][i0+i][c] = sum_j P[b][i][j] V[b][j][c]
        rt.gemm(False, False, Dv, rows, Lk, vc, compute, Dvc, p_buf, compute, Lk,
                out.ptr + i0 * Dv * 4, Dv, c_dtype="F32", batch=B, stride_a=Lk * Dvc,
                stride_b=rows * Lk, stride_c=Lq * Dv)
