"""CUDA kernels for softmax and the normalizations (kernels/norm.cu; CPU: sdrt/ops/cpu/norm.py).

Row ops run one block per row, reading the row through its byte strides (any view) and
writing the node's contiguous buffer; group norm runs two launches (per-chunk statistics into
rt.scratch, then merge-and-apply) so a large group is spread over several blocks. Inputs,
weights, biases and masks may each be F32, F16 or BF16; the output has x's dtype, as on the CPU
(layer and group norms also write F16/BF16 from F32, and layer norms F32 from F16, for the F32
results fuse.py stores as F16/BF16). `layer_norm_modulated` is fuse.py's DiT modulation
(layer_norm -> mul -> add) in one kernel, `rms_norm_scaled` its rms_norm -> mul(., weight),
`rms_norm_rope` that followed by the rope of the attention (one warp per row).
Each function only enqueues work on rt.stream.
"""
from __future__ import annotations

from functools import cache

from ....ops.norm import group_bounds
from ..devtensor import SUFFIX as FLOAT
from ..devtensor import DevTensor, kernel_dtypes
from ..table import CUDA

MODULE = "norm"
TYPE_CODE = {"F32": 0, "F16": 1, "BF16": 2}  # load_any() in norm.cu
MAX_GRID_YZ = 65535
GROUP_THREADS = 256
GROUP_TARGET_BLOCKS = 512   # enough blocks to fill an H200 (132 SMs) a few times over
GROUP_MIN_CHUNK = 2048      # elements per block below which splitting a group costs more than it gains


@cache
def _fn(rt, kernel: str, argtypes: str):
    return rt.fn(MODULE, kernel, argtypes)


def row_threads(ne0: int) -> int:
    """Threads of a one-row block: about 8 elements each, a multiple of 32, at most 1024."""
    t = 32
    while t < 1024 and t * 8 < ne0:
        t *= 2
    return t


def _float_srcs(node) -> bool:
    return all(s.dtype.name in FLOAT for s in node.src)


# ---- softmax -----------------------------------------------------------------------------------
@CUDA.register("softmax", supports=_float_srcs)
def _softmax(node, xs, out, rt):
    x = xs[0]
    if len(xs) == 2:
        m = xs[1]
        kernel = f"softmax_{FLOAT[x.dtype.name]}_mask_{FLOAT[m.dtype.name]}"
        mask, mne, mnb = m.ptr, m.ne, m.nb
    else:
        kernel = f"softmax_{FLOAT[x.dtype.name]}"
        mask, mne, mnb = 0, (1, 1, 1, 1), (0, 0, 0, 0)
    _fn(rt, kernel, "PPP" + "q" * 14 + "f")(
        (x.nrows, 1, 1), (row_threads(x.ne[0]), 1, 1), x.ptr, mask, out.ptr, x.ne[0], x.ne[1], x.ne[2],
        *x.nb, mne[1], mne[2], mne[3], *mnb, float(node.params["scale"]))


# ---- layer_norm(_affine), rms_norm, l2_norm ----------------------------------------------------
def _row_norm(node, xs, out, rt):
    p = node.params
    x = xs[0]
    rest = list(xs[1:])
    w = rest.pop(0) if p.get("has_w") else None
    b = rest.pop(0) if p.get("has_b") else None
    mode = "layer_norm" if node.op == "layer_norm_affine" else node.op
    _fn(rt, f"{mode}_{kernel_dtypes(x, out)}", "PPPP" + "q" * 9 + "iif")(
        (x.nrows, 1, 1), (row_threads(x.ne[0]), 1, 1),
        x.ptr, w.ptr if w else 0, b.ptr if b else 0, out.ptr, x.ne[0], x.ne[1], x.ne[2], *x.nb,
        w.nb[0] if w else 0, b.nb[0] if b else 0,
        TYPE_CODE[w.dtype.name] if w else 0, TYPE_CODE[b.dtype.name] if b else 0, float(p["eps"]))


for _op in ("layer_norm", "layer_norm_affine", "rms_norm", "l2_norm"):
    CUDA.register(_op, supports=_float_srcs)(_row_norm)


def rms_norm_scaled(rt, x, w, out, eps: float) -> None:
    """out = rms_norm(x) * w, w a vector of x's ne[0] values (any float dtype, any stride): fuse.py's
    rms_norm -> mul(., w) (the QK norms of the DiT blocks) in one pass; the product rounded
    as the separate mul's (no add follows it, so nothing contracts)."""
    _fn(rt, f"rms_norm_{kernel_dtypes(x, out)}", "PPPP" + "q" * 9 + "iif")(
        (x.nrows, 1, 1), (row_threads(x.ne[0]), 1, 1),
        x.ptr, w.ptr, 0, out.ptr, x.ne[0], x.ne[1], x.ne[2], *x.nb, w.nb[0], 0,
        TYPE_CODE[w.dtype.name], 0, float(eps))


RMS_ROPE_DIMS = (16, 32, 64, 128, 256)   # kernels/norm.cu rms_rope_d<D>_*: one warp per row
RMS_ROPE_WARPS = 8


def takes_rms_rope(x, w, pe, interleaved: bool) -> bool:
    """Whether rms_norm_rope runs rope(mul(rms_norm(x), w), pe) (tensors or nodes): F32 x [D, H, L,
    N] with D a head dim of RMS_ROPE_DIMS, w a float vector of D values, interleaved pairs over all
    of D (pe F32 [2, 2, D/2, L])."""
    D = x.ne[0]
    return (interleaved and D in RMS_ROPE_DIMS and x.dtype.name == "F32" and x.nb[0] == 4
            and w.dtype.name in TYPE_CODE and pe.dtype.name == "F32" and tuple(pe.ne[:3]) == (2, 2, D // 2)
            and pe.ne[3] >= x.ne[2])


def rms_norm_rope(rt, x, w, pe, out, eps: float) -> None:
    """out = rope(rms_norm(x) * w, pe) in one pass (fuse.py: a DiT block's QK RMSNorm and RoPE):
    x an F32 view [D, H, L, N] (takes_rms_rope), out rope's contiguous [D, L, H*N] in F32 or F16;
    each value rounded as the unfused rms_norm_scaled and rope kernels round it."""
    D, H, L, N = x.ne
    rows = H * L * N
    grid = max(1, min(-(-rows // RMS_ROPE_WARPS), 1 << 16))
    _fn(rt, f"rms_rope_d{D}_{kernel_dtypes(x, out)}", "PPPPqqqqqqqiqqqqf")(
        (grid, 1, 1), (32 * RMS_ROPE_WARPS, 1, 1), x.ptr, w.ptr, pe.ptr, out.ptr, H, L, rows, *x.nb[1:],
        w.nb[0], TYPE_CODE[w.dtype.name], *pe.nb, float(eps))


def rms_norm_rope_staged(rt, x, w, pe, out, eps: float) -> None:
    """rms_norm_rope for an `out` whose buffer overlaps x's: into rt.scratch, then copied to out."""
    tmp = rt.scratch(out.nbytes)
    rms_norm_rope(rt, x, w, pe, DevTensor(tmp, out.dtype, out.ne, out.nb, out.tensor), eps)
    rt.dev.dtod_async(out.ptr, tmp, out.nbytes, rt.stream)


def _row_strides(t, x) -> list[int]:
    """t's byte strides over x's dims 1..3: 0 where t broadcasts (size 1)."""
    return [t.nb[k] if t.ne[k] == x.ne[k] else 0 for k in (1, 2, 3)]


def layer_norm_modulated(rt, x, scale, shift, out, eps: float) -> None:
    """out = layer_norm(x) * scale + shift (no affine; each rounded to F32 as the unfused mul and
    add kernels do), scale and shift any F32/F16/BF16 views broadcasting over x [C, ...] with
    C values along dim 0 (a DiT modulation's [C, 1, N] vectors): fuse.py's layer_norm -> mul ->
    add in one pass, written as out's dtype (F32, or F16/BF16 where fuse.py stores it)."""
    _norm_mod(rt, "layer_norm_mod", x, scale, shift, out, eps, _row_strides(scale, x))


def rms_norm_modulated(rt, x, w, scale, out, eps: float) -> None:
    """out = rms_norm(x) * w * scale, w the norm's weight (x's ne[0] values), scale a view
    broadcasting over x's rows ([C, 1, N]: Z-Image's 1 + scale), each product rounded to F32 as
    the unfused kernels: fuse.py's rms_norm -> mul -> mul in one pass, written as out's dtype."""
    _norm_mod(rt, "rms_norm_mod", x, w, scale, out, eps, (0, 0, 0))


def _norm_mod(rt, kernel: str, x, w, b, out, eps: float, w_rows) -> None:
    _fn(rt, f"{kernel}_{kernel_dtypes(x, out)}", "PPPP" + "q" * 9 + "iif" + "q" * 6)(
        (x.nrows, 1, 1), (row_threads(x.ne[0]), 1, 1),
        x.ptr, w.ptr, b.ptr, out.ptr, x.ne[0], x.ne[1], x.ne[2], *x.nb,
        w.nb[0] if w.ne[0] > 1 else 0, b.nb[0] if b.ne[0] > 1 else 0,
        TYPE_CODE[w.dtype.name], TYPE_CODE[b.dtype.name], float(eps), *w_rows, *_row_strides(b, x))


# ---- group_norm(_affine) -----------------------------------------------------------------------
def group_layout(ne, n_groups: int) -> tuple[int, int, int]:
    """(channels per group, groups that exist, chunks per group K) for x ne=[W, H, C, N]."""
    W, H, C, N = ne
    bounds = group_bounds(C, n_groups)
    per, n_real = bounds[0][1] - bounds[0][0], len(bounds)
    WH = W * H
    want = -(-GROUP_TARGET_BLOCKS // (N * n_real))
    k = max(1, min(want, per * WH // GROUP_MIN_CHUNK, WH))
    return per, n_real, k


def _group_ok(node) -> bool:
    if not _float_srcs(node):
        return False
    ne = node.src[0].ne4
    _, n_real, _ = group_layout(ne, node.params["n_groups"])
    return n_real <= MAX_GRID_YZ and ne[3] <= MAX_GRID_YZ


def channel_stride(t, C: int) -> int:
    """Byte step between the C values of a weight/bias stored as ne [C] or [1, 1, C, 1]."""
    return t.nb[0] if t.ne[0] == C else t.nb[2]


def _group_norm(node, xs, out, rt):
    p = node.params
    x = xs[0]
    W, H, C, N = x.ne
    per, n_real, k = group_layout(x.ne, p["n_groups"])
    planes_contiguous = int(H == 1 or x.nb[1] == W * x.nb[0])
    stats = rt.scratch(N * n_real * k * 2 * 4)
    grid, block = (k, n_real, N), (GROUP_THREADS, 1, 1)
    t = FLOAT[x.dtype.name]
    _fn(rt, f"group_norm_stats_{t}", "PP" + "q" * 8 + "i")(
        grid, block, x.ptr, stats, W, W * H, C, per, *x.nb, planes_contiguous)
    if node.op == "group_norm_affine":
        w, b = xs[1], xs[2]
        wb = (w.ptr, b.ptr)
        nbw, nbb = channel_stride(w, C), channel_stride(b, C)
        codes = (TYPE_CODE[w.dtype.name], TYPE_CODE[b.dtype.name])
    else:
        wb, nbw, nbb, codes = (0, 0), 0, 0, (0, 0)
    _fn(rt, f"group_norm_apply_{kernel_dtypes(x, out)}", "PPPPP" + "q" * 8 + "iqqiifi")(
        grid, block, x.ptr, stats, *wb, out.ptr, W, W * H, C, per, *x.nb, planes_contiguous,
        nbw, nbb, *codes, float(p["eps"]), int(p.get("silu", False)))


for _op in ("group_norm", "group_norm_affine"):
    CUDA.register(_op, supports=_group_ok)(_group_norm)
