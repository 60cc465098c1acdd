"""CUDA kernels for conv1d, conv2d, conv3d, conv_transpose2d, pool1d and pool2d (kernels/conv.cu
+ cuBLAS).

Convolutions: an im2col kernel writes the column matrix of a chunk of batch items and output
rows into rt.scratch, col[n][K][rows*OW] with K = C/g*KD*KH*KW in the weight's row-major
[OC][K] order, and one strided-batched cuBLAS GEMM per chunk computes
    out_n[OC, P] = W[OC, K] . col_n[K, P]
straight into the F32 output, which is already ggml's [OW, OH, (OD,) OC, N] (in column-major
terms C[P, OC] = col[P, K] . W^T, so no transpose is ever materialized). Groups are one more
batched dimension (weight stride og*K). The GEMM runs in F32 (pedantic, as the CPU's F32 BLAS)
when the weight is F32, else in F16 with F32 accumulation: F16 weights are used in place,
BF16/F8/block weights (and weight views) are decoded to F16 by matmul.weight_as, and the
activation is narrowed to F16 while gathering. A 1x1, stride-1, unpadded conv whose input is already contiguous in the GEMM dtype
skips im2col (the input is the column matrix). Columns are chunked over batch items, then
output rows, so the scratch stays under COL_BYTES (the VAE's 512x512x128ch 3x3 conv would need
604 MB of F16 columns at once).
3x3 / stride-1 / pad-1 convs of large maps (ESRGAN, the VAE decoders) skip the column matrix:
conv3x3_direct runs conv.cu's conv3x3_mma, an implicit GEMM reading a haloed input patch per
block from shared memory (its own bias epilogue).
With WINOGRAD on, the other 3x3 / stride-1 / pad-1 convs (the UNets', the VAE decoders' deep
ones) run Winograd F(2x2, 3x3) (conv3x3_winograd: conv.cu's wino_* transforms around 16 batched
cuBLAS GEMMs, 2.25x fewer multiplications than im2col + GEMM). Off by default until a GPU run
has timed it against im2col + cuBLAS (bench_cuda_conv.py) and compared the images.
The bias (OC elements, any view) is added by a small epilogue kernel after the GEMM, the CPU
kernel's order, rather than by beta=1 over a pre-broadcast output: both cost one extra pass
over the output, and the epilogue keeps the GEMM a plain overwrite.

conv_transpose2d is the adjoint: cols[M = OC*KH*KW, rows*W] = W^T[M, C] . x[C, rows*W] per
chunk of input rows (one batched GEMM), then col2im_add gathers each output pixel's entries
(one thread per pixel: no atomics); the output is first set to the bias (or zero).

Pooling is one direct kernel (pool1d = pool2d with a 1-row kernel). Inputs of every op may be
any view (read through byte strides) in F32/F16/BF16; outputs are F32.
"""
from __future__ import annotations

import os

from ....ops.conv import conv2d_weight_ne
from ..devtensor import SUFFIX as _SUFFIX
from .layout import launch_1d
from .matmul import MAX_GRID_Y, weight_as
from ..quant import decodable
from ..table import CUDA

MODULE = "conv"
# cap of one chunk's column matrix (and of a packed transposed-conv input). One size for every
# run, budgeted or not, so that --max-vram / --offload-to-cpu give the very same image (the chunk
# shapes pick cuBLAS's kernels): at 256 MiB SDXL's 1024x1024 VAE decode (2.8 GB of activations)
# did not fit --max-vram 3 beside its weights; at 64 MiB it does (the decode: 154 against 137 ms).
COL_BYTES = 64 << 20
# 3x3 / stride-1 / pad-1 convs with F16 GEMMs, at most DIRECT_3X3_MAX_OC output channels, on maps
# of at least DIRECT_3X3_PIXELS pixels run conv.cu's direct implicit GEMM (conv3x3_mma: no column
# matrix, the bias in its epilogue): ESRGAN's and the VAE decoders' high-resolution convs, 1.8-4.9x
# faster there. Deep convs (UNet, VAE at 64x64x512) stay on im2col + cuBLAS, whose large GEMMs win
# (bench/README.md). DIRECT_3X3_PIXELS = 0 turns it off (tests compare the two).
DIRECT_3X3_PIXELS = 128 * 128
DIRECT_3X3_MAX_OC = 128
_C3_TW = 16   # conv.cu C3_TW
# conv3x3_mma variants: name -> (output channels a block, tile rows, threads, input channels a
# chunk, kernel family): conv.cu's defaults, and conv3x3_sm90.cu's candidates for the deep convs
# (sm_90 only; F32/F16 in with F32 out, F16 in and out) that no choice takes before a GPU run has
# timed them (bench_cuda_conv.py --variants)
C3_VARIANTS = {"mma32": (32, 8, 128, 16, MODULE), "mma64": (64, 8, 128, 16, MODULE),
               "mma64k32": (64, 8, 128, 32, "conv3x3_sm90"), "mma128": (128, 8, 256, 16, "conv3x3_sm90"),
               "mma128t": (128, 16, 256, 16, "conv3x3_sm90")}
# a variant every direct conv runs (benchmarks and tests); None: c3_variant's choice
DIRECT_3X3_VARIANT = None
# Winograd F(2x2, 3x3) for the 3x3 / stride-1 / pad-1 convs the direct path does not take, with
# F16 GEMMs writing WINOGRAD_M (the transformed outputs: F32, or F16 for half the traffic); the
# transformed input and output of one chunk of tiles stay under COL_BYTES
WINOGRAD = os.environ.get("SDRT_CUDA_WINOGRAD", "0") == "1"
WINOGRAD_M = "F16" if os.environ.get("SDRT_CUDA_WINOGRAD_M", "").upper() == "F16" else "F32"
# ... on maps of at least this many 2x2 tiles (batch included): the weights' transform (16/9 of
# their bytes written per call) outweighs the GEMMs' saving on small maps of deep weights
WINOGRAD_MIN_TILES = 1024


_ESIZE = {"F32": 4, "F16": 2}
_BIAS_CODE = {"F32": 1, "F16": 2, "BF16": 3}   # conv.cu c3_bias
_IM2COL_ARGS = "PP" + "q" * 5 + "i" * 20 + "q" * 4
_IM2COL_VEC8_ARGS = "PP" + "q" * 5 + "i" * 17 + "q" * 4
IM2COL_BLOCKS = 16384  # blocks of an im2col launch (a few per SM slot: rows are short)


def _launch(rt, kernel: str, argtypes: str, n: int, *args) -> None:
    launch_1d(rt, MODULE, kernel, argtypes, n, *args)


def _balanced(n: int, cap: int) -> int:
    """Items per chunk: at most `cap` (>= 1), chunks of near-equal size (no tiny last GEMM)."""
    chunks = -(-n // max(1, min(n, cap)))
    return -(-n // chunks)


def _chunks(nbatch: int, nrows: int, row_bytes: int, cap: int) -> tuple[int, int]:
    """(batch items, rows) per chunk so that a chunk's columns fit `cap` bytes: whole batch items
    while they fit, else one item and as many rows as fit (at least one)."""
    item = row_bytes * nrows
    if item * nbatch <= cap:
        return nbatch, nrows
    if item <= cap:
        return _balanced(nbatch, cap // item), nrows
    return 1, _balanced(nrows, cap // max(row_bytes, 1))


def gemm_dtype(w) -> str:
    """The GEMM's input dtype for weight `w`: F32 weights stay F32, everything else runs F16."""
    return "F32" if w.dtype.name == "F32" else "F16"


def weight_ptr(rt, w, dtype: str) -> int:
    """Device address of `w` as a contiguous [OC][K] matrix in `dtype`: the weight itself when
    it already is one, else a decoded copy in rt.scratch (BF16, F8, block types, views)."""
    return weight_as(rt, w, dtype)


def _conv_ok(node) -> bool:
    return node.src[0].dtype.name in _SUFFIX and decodable(node.src[1].dtype) \
        and all(s.dtype.name in _SUFFIX for s in node.src[2:])


def add_bias(rt, out_ptr: int, bias, oc: int, per_channel: int, total: int, add: bool = True) -> None:
    """out (F32 [..][OC][per_channel], `total` elements) = (out if add else 0) + bias[oc]."""
    if total == 0:
        return
    # blockIdx.y: the rows (batch item, channel); blockIdx.x: 1024 elements of a row each
    grid = (-(-per_channel // 1024), min(total // per_channel, MAX_GRID_Y), 1)
    rt.fn(MODULE, f"bias_store_{_SUFFIX[bias.dtype.name]}", "PP" + "q" * 10 + "i")(
        grid, (256, 1, 1), out_ptr, bias.ptr, bias.ne[0], bias.ne[1], bias.ne[2], *bias.nb, oc,
        per_channel, total, int(add))


def im2col(rt, col: int, col_dtype: str, x, strides, dims, kernel, stride, pad, dil, circ, out_hw,
           n0: int, nbatch: int, r0: int, rows: int) -> None:
    """Enqueue col[b][k][p] for batch items n0.. and output rows r0.. (see conv.cu).
    strides: byte strides (n, c, z, y, x); dims (C, D, H, W); kernel/stride/pad/dil (d, h, w);
    circ (y, x); out_hw (OH, OW)."""
    C, D, H, W = dims
    kd, kh, kw = kernel
    OW = out_hw[1]
    col_rows = nbatch * C * kd * kh * kw
    if col_rows * rows * OW == 0:
        return
    # blockIdx.y: column rows, blockIdx.x: output rows, threads: an output row (conv.cu im2col_rows);
    # about IM2COL_BLOCKS blocks in all, each looping over several output rows
    gy = min(col_rows, MAX_GRID_Y)
    suffix = f"{_SUFFIX[x.dtype.name]}_{_SUFFIX[col_dtype]}"
    if stride[2] == 1 and dil[2] == 1 and not circ[1] and OW % 8 == 0:
        # 8 columns a thread, one vector store (conv.cu im2col_vec8)
        groups = rows * OW // 8
        gx = max(1, min(-(-groups // 128), -(-IM2COL_BLOCKS // gy)))
        rt.fn(MODULE, f"im2col_vec8_{suffix}", _IM2COL_VEC8_ARGS)(
            (gx, gy, 1), (128, 1, 1), col, x.ptr, *strides, C, D, H, W, kd, kh, kw, stride[0], stride[1],
            pad[0], pad[1], pad[2], dil[0], dil[1], int(circ[0]), *out_hw, n0, nbatch, r0, rows)
        return
    gx = max(1, min(rows, -(-IM2COL_BLOCKS // gy)))
    threads = 128 if OW >= 96 else max(32, -(-OW // 32) * 32)
    rt.fn(MODULE, f"im2col_{suffix}", _IM2COL_ARGS)(
        (gx, gy, 1), (threads, 1, 1), col, x.ptr, *strides, C, D, H, W, kd, kh, kw, *stride, *pad, *dil,
        int(circ[0]), int(circ[1]), *out_hw, n0, nbatch, r0, rows)


def conv_forward(rt, x, w, bias, out, *, N, strides, dims, OC, kernel, out_dims, stride, pad, dil,
                 groups=1, circ=(False, False)) -> None:
    """out (F32 [N][OC][OD*OH*OW]) = conv(x, w) + bias, every conv op's 3-D form.
    dims (C, D, H, W), kernel/stride/pad/dil/out_dims in (d, h, w) order, strides = x's byte
    strides (n, c, z, y, x), circ = circular (y, x)."""
    C, D, H, W = dims
    KD, KH, KW = kernel
    OD, OH, OW = out_dims
    gdt = gemm_dtype(w)
    esz = _ESIZE[gdt]
    wp = weight_ptr(rt, w, gdt)
    cg, og = C // groups, OC // groups
    K = cg * KD * KH * KW
    P = OD * OH * OW

    def gemms(col: int, col_item: int, n0: int, nb: int, r0: int, npos: int) -> None:
        # col_n[K, npos] (row-major, per batch item `col_item` elements apart) -> out rows r0..
        c = out.ptr + (n0 * OC * P + r0 * OW) * 4
        if groups == 1:
            rt.gemm(False, False, npos, OC, K, col, gdt, npos, wp, gdt, K, c, P, c_dtype="F32",
                    batch=nb, stride_a=col_item, stride_b=0, stride_c=OC * P)
            return
        for b in range(nb):  # groups batched: the weight moves by og*K per group
            rt.gemm(False, False, npos, og, K, col + b * col_item * esz, gdt, npos, wp, gdt, K,
                    c + b * OC * P * 4, P, c_dtype="F32", batch=groups, stride_a=K * npos,
                    stride_b=og * K, stride_c=og * P)

    pointwise = kernel == (1, 1, 1) and stride == (1, 1, 1) and pad == (0, 0, 0)
    if pointwise and x.dtype.name == gdt and x.is_contiguous:
        gemms(x.ptr, C * P, 0, N, 0, P)  # the input is the column matrix
    else:
        nrows = OD * OH
        nb, rows = _chunks(N, nrows, C * KD * KH * KW * OW * esz, COL_BYTES)
        col = rt.scratch(nb * rows * C * KD * KH * KW * OW * esz)
        for n0 in range(0, N, nb):
            nbc = min(nb, N - n0)
            for r0 in range(0, nrows, rows):
                rc = min(rows, nrows - r0)
                im2col(rt, col, gdt, x, strides, dims, kernel, stride, pad, dil, circ, (OH, OW), n0, nbc, r0, rc)
                gemms(col, C * KD * KH * KW * rc * OW, n0, nbc, r0, rc * OW)
    if bias is not None:
        add_bias(rt, out.ptr, bias, OC, P, N * OC * P)


class Epilogue:
    """What conv3x3_direct applies after the bias, in this order (the fused ops' own order, see
    fuse.py): leaky_relu(slope) when `slope` is set, then `* scale + shift`, then `+ residual`
    (an F32 device tensor of the output's shape)."""
    __slots__ = ("slope", "scale", "shift", "residual")

    def __init__(self, slope=None, scale=1.0, shift=0.0, residual=None):
        self.slope, self.scale, self.shift, self.residual = slope, scale, shift, residual


def takes_direct(node) -> bool:
    """Whether conv2d `node` runs conv3x3_direct: a 3x3 / stride-1 / pad-1, undilated, ungrouped,
    zero-padded conv with F16 GEMMs and at most DIRECT_3X3_MAX_OC output channels, of a map of at
    least DIRECT_3X3_PIXELS pixels."""
    x = node.src[0]
    OC = conv2d_weight_ne(node.src[1])[3]
    return bool(DIRECT_3X3_PIXELS) and OC <= DIRECT_3X3_MAX_OC and x.ne[0] * x.ne[1] >= DIRECT_3X3_PIXELS \
        and _is_3x3_same(node)


def _is_3x3_same(node) -> bool:
    """A 3x3 / stride-1 / pad-1, undilated, ungrouped, zero-padded conv2d with F16 GEMMs."""
    p = node.params
    KW, KH, _, _ = conv2d_weight_ne(node.src[1])
    return gemm_dtype(node.src[1]) == "F16" and (KW, KH) == (3, 3) and p["groups"] == 1 \
        and tuple(p["stride"]) == (1, 1) and tuple(p["padding"]) == (1, 1) and tuple(p["dilation"]) == (1, 1) \
        and not any(p["circular"])


def takes_winograd(node) -> bool:
    """Whether conv2d `node` runs conv3x3_winograd (WINOGRAD on, a 3x3-same conv the direct path
    does not take, of at least WINOGRAD_MIN_TILES output tiles)."""
    W, H, _, N = node.src[0].ne4
    return WINOGRAD and N * -(-H // 2) * -(-W // 2) >= WINOGRAD_MIN_TILES and _is_3x3_same(node) \
        and not takes_direct(node)


def conv3x3_winograd(rt, x, w, bias, out) -> None:
    """out (F32 or F16 [N][OC][H][W]) = the 3x3 / stride-1 / pad-1 conv of x (ne [W, H, C, N], any
    view) with F16-decodable weight w, plus bias, by Winograd F(2x2, 3x3) (conv.cu's wino_*): per
    chunk of 2x2 output tiles, the input transform, 16 batched GEMMs M_p[OC][t] = U_p[OC][C] V_p[C][t],
    the output transform with the bias."""
    W, H, C, N = x.ne
    OC = out.ne[2]
    TH, TW = -(-H // 2), -(-W // 2)
    tiles = N * TH * TW
    U = rt.scratch(16 * OC * C * 2)
    _launch(rt, "wino_weights", "PPii", OC * C, U, weight_ptr(rt, w, "F16"), C, OC)
    msize = _ESIZE[WINOGRAD_M]
    nt = _balanced(tiles, COL_BYTES // (16 * (2 * C + msize * OC)))
    V, M = rt.scratch(16 * C * nt * 2), rt.scratch(16 * OC * nt * msize)
    axis = bias_axis(bias, OC)
    bias_args = (bias.ptr, _BIAS_CODE[bias.dtype.name], bias.nb[axis]) if axis is not None else (0, 0, 0)
    for t0 in range(0, tiles, nt):
        n = min(nt, tiles - t0)
        _launch(rt, f"wino_input_{_SUFFIX[x.dtype.name]}", "PP" + "q" * 4 + "i" * 5 + "qq", C * n, V, x.ptr,
                x.nb[3], x.nb[2], x.nb[1], x.nb[0], C, H, W, TH, TW, t0, n)
        rt.gemm(False, False, n, OC, C, V, "F16", n, U, "F16", C, M, n, c_dtype=WINOGRAD_M, batch=16,
                stride_a=C * n, stride_b=OC * C, stride_c=OC * n)
        _launch(rt, f"wino_output_{_SUFFIX[WINOGRAD_M]}_{_SUFFIX[out.dtype.name]}", "PPPiq" + "i" * 5 + "qq",
                OC * n, out.ptr, M, *bias_args, OC, H, W, TH, TW, t0, n)
    if bias is not None and axis is None:
        add_bias(rt, out.ptr, bias, OC, H * W, N * OC * H * W)


def c3_variant(OC: int) -> str:
    """The conv3x3_mma variant for OC output channels."""
    return DIRECT_3X3_VARIANT or ("mma32" if OC <= 32 else "mma64")


def conv3x3_direct(rt, x, w, bias, out, epilogue: Epilogue | None = None) -> None:
    """out (F32 or F16 [N][OC][H][W]) = the 3x3 / stride-1 / pad-1 conv of x (ne [W, H, C, N], any
    view) with F16-decodable weight w, plus bias, then the epilogue: conv.cu's conv3x3_mma, its
    weights first packed into rt.scratch."""
    W, H, C, N = x.ne
    OC = out.ne[2]
    variant = c3_variant(OC)
    bn, th, threads, kc, module = C3_VARIANTS[variant]
    nch, nob = -(-C // kc), -(-OC // bn)
    total = nob * nch * 9 * kc * bn
    packed = rt.scratch(total * 2)
    _launch(rt, "conv3x3_pack_w", "PPiiiiiq", total, packed, weight_ptr(rt, w, "F16"), C, OC, bn, kc, nch, total)
    # a bias of OC elements along one axis (any stride) is added by the kernel's epilogue
    axis = bias_axis(bias, OC)
    e = epilogue or Epilogue()
    tiles = -(-H // th) * -(-W // _C3_TW)
    patch_halves = (th + 2) * (_C3_TW + 2) * (kc + 8)
    smem = 2 * (patch_halves + 9 * kc * (bn + 8)) * 2      # two buffers of patch and weights
    name = f"conv3x3_{variant}_{_SUFFIX[x.dtype.name]}_{_SUFFIX[out.dtype.name]}"
    rt.fn(module, name, "PPPPiq" + "q" * 4 + "i" * 5 + "ifffP")(
        (tiles, nob, N), (threads, 1, 1), out.ptr, x.ptr, packed, bias.ptr if axis is not None else 0,
        _BIAS_CODE[bias.dtype.name] if axis is not None else 0, bias.nb[axis] if axis is not None else 0,
        x.nb[3], x.nb[2], x.nb[1], x.nb[0], C, H, W, OC, nch,
        int(e.slope is not None), e.slope or 0.0, e.scale, e.shift, e.residual.ptr if e.residual is not None else 0,
        shmem=smem)
    if bias is not None and axis is None:      # fuse.py never adds an epilogue to such a conv
        add_bias(rt, out.ptr, bias, OC, H * W, N * OC * H * W)


def bias_axis(bias, oc: int) -> int | None:
    """The axis along which a bias of `oc` elements lies (conv3x3_mma reads it through that
    axis's stride), or None (no bias, or one bias_store has to add)."""
    if bias is None or bias.nelements != oc:
        return None
    return next((i for i, n in enumerate(bias.ne) if n == oc), None)


# ---- convolutions ------------------------------------------------------------------------------
@CUDA.register("conv2d", supports=_conv_ok)
def conv2d(node, xs, out, rt):
    p = node.params
    x, w = xs[0], xs[1]
    W, H, C, N = x.ne
    KW, KH, _, OC = conv2d_weight_ne(node.src[1])
    (sx, sy), (px, py), (dx, dy) = p["stride"], p["padding"], p["dilation"]
    cx, cy = p["circular"]
    if takes_direct(node):
        conv3x3_direct(rt, x, w, xs[2] if len(xs) > 2 else None, out)
        return
    if takes_winograd(node):
        conv3x3_winograd(rt, x, w, xs[2] if len(xs) > 2 else None, out)
        return
    conv_forward(rt, x, w, xs[2] if len(xs) > 2 else None, out, N=N,
                 strides=(x.nb[3], x.nb[2], 0, x.nb[1], x.nb[0]), dims=(C, 1, H, W), OC=OC,
                 kernel=(1, KH, KW), out_dims=(1, out.ne[1], out.ne[0]), stride=(1, sy, sx),
                 pad=(0, py, px), dil=(1, dy, dx), groups=p["groups"], circ=(cy, cx))


@CUDA.register("conv1d", supports=_conv_ok)
def conv1d(node, xs, out, rt):
    p = node.params
    x, w = xs[0], xs[1]
    L, C, N, _ = x.ne
    K, _, OC, _ = w.ne
    conv_forward(rt, x, w, xs[2] if len(xs) > 2 else None, out, N=N,
                 strides=(x.nb[2], x.nb[1], 0, 0, x.nb[0]), dims=(C, 1, 1, L), OC=OC,
                 kernel=(1, 1, K), out_dims=(1, 1, out.ne[0]), stride=(1, 1, p["stride"][0]),
                 pad=(0, 0, p["padding"][0]), dil=(1, 1, p["dilation"][0]), groups=p["groups"])


@CUDA.register("conv3d", supports=_conv_ok)
def conv3d(node, xs, out, rt):
    p = node.params
    x, w = xs[0], xs[1]
    W, H, D, ICN = x.ne
    KW, KH, KD, ICOC = w.ne
    ic = p["ic"] if p["ic"] is not None else ICN
    conv_forward(rt, x, w, xs[2] if len(xs) > 2 else None, out, N=ICN // ic,
                 strides=(ic * x.nb[3], x.nb[3], x.nb[2], x.nb[1], x.nb[0]), dims=(ic, D, H, W),
                 OC=ICOC // ic, kernel=(KD, KH, KW), out_dims=(out.ne[2], out.ne[1], out.ne[0]),
                 stride=tuple(p["stride"][::-1]), pad=tuple(p["padding"][::-1]),
                 dil=tuple(p["dilation"][::-1]))


@CUDA.register("conv_transpose2d", supports=_conv_ok)
def conv_transpose2d(node, xs, out, rt):
    p = node.params
    x, w = xs[0], xs[1]
    bias = xs[2] if len(xs) > 2 else None
    W, H, C, N = x.ne
    KW, KH, OC, _ = w.ne
    OW, OH = out.ne[0], out.ne[1]
    (sx, sy), (px, py), (dx, dy) = p["stride"], p["padding"], p["dilation"]
    gdt = gemm_dtype(w)
    esz = _ESIZE[gdt]
    wp = weight_ptr(rt, w, gdt)
    M, Pin = OC * KH * KW, H * W
    total = N * OC * OH * OW
    if bias is not None:
        add_bias(rt, out.ptr, bias, OC, OH * OW, total, add=False)
    else:
        _launch(rt, "zero_f32", "Pq", total, out.ptr, total)
    packed = x.dtype.name == gdt and x.is_contiguous
    cap = COL_BYTES
    nb, rows = _chunks(N, H, M * W * 4, cap)
    if not packed:  # x as a contiguous [n][C][H*W] matrix in the GEMM dtype
        nb = max(1, min(nb, cap // (C * Pin * esz)))
        xbuf = rt.scratch(nb * C * Pin * esz)
    cols = rt.scratch(nb * M * rows * W * 4)
    for n0 in range(0, N, nb):
        nbc = min(nb, N - n0)
        if packed:
            xp = x.ptr + n0 * C * Pin * esz
        else:
            im2col(rt, xbuf, gdt, x, (x.nb[3], x.nb[2], 0, x.nb[1], x.nb[0]), (C, 1, H, W), (1, 1, 1),
                   (1, 1, 1), (0, 0, 0), (1, 1, 1), (False, False), (H, W), n0, nbc, 0, H)
            xp = xbuf
        for r0 in range(0, H, rows):
            rc = min(rows, H - r0)
            # cols_n[M, rc*W] = W^T[M, C] . x_n[C, rows r0..]; column-major C[rc*W, M] = x . W
            rt.gemm(False, True, rc * W, M, C, xp + r0 * W * esz, gdt, Pin, wp, gdt, M, cols, rc * W,
                    c_dtype="F32", batch=nbc, stride_a=C * Pin, stride_b=0, stride_c=M * rc * W)
            oy0 = max(0, r0 * sy - py)
            oy1 = min(OH, (r0 + rc - 1) * sy + (KH - 1) * dy - py + 1)
            _launch(rt, "col2im_add_f32", "PP" + "i" * 13 + "q" * 6, nbc * OC * max(oy1 - oy0, 0) * OW,
                    out.ptr, cols, OC, OH, OW, H, W, KH, KW, sy, sx, py, px, dy, dx, n0, nbc, r0, rc, oy0, oy1)


# ---- pooling -----------------------------------------------------------------------------------
def _pool_ok(node) -> bool:
    return node.src[0].dtype.name in _SUFFIX


def _pool(rt, x, out, kernel, stride, pad, is_max) -> None:
    """x ne (W, H, B2, B3) -> out (OW, OH, B2, B3); kernel/stride/pad in (x, y) order."""
    W, H, B2, B3 = x.ne
    OW, OH = out.ne[0], out.ne[1]
    _launch(rt, f"pool2d_{_SUFFIX[x.dtype.name]}", "PP" + "q" * 10 + "i" * 7, out.nelements,
            out.ptr, x.ptr, W, H, B2, B3, *x.nb, OW, OH, *kernel, *stride, *pad, int(is_max))


@CUDA.register("pool2d", supports=_pool_ok)
def pool2d(node, xs, out, rt):
    p = node.params
    _pool(rt, xs[0], out, p["kernel"], p["stride"], p["padding"], p["kind"] == "max")


@CUDA.register("pool1d", supports=_pool_ok)
def pool1d(node, xs, out, rt):
    # a 1-row kernel over (L, ne1): ne1..3 pass through
    p = node.params
    _pool(rt, xs[0], out, (p["kernel"][0], 1), (p["stride"][0], 1), (p["padding"][0], 0), p["kind"] == "max")
