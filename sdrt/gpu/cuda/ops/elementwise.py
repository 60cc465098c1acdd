"""CUDA kernels for the element-wise ops (kernels/elementwise.cu; CPU: sdrt/ops/cpu/elementwise.py).

Every input is read through its byte strides (permute/transpose/slice views, broadcast dims
with stride 0), the output is the node's contiguous buffer. Before a launch the host merges
adjacent dims that every operand walks through as one, so contiguous and bias-style operands
index without division on the device. Each function only enqueues one launch on rt.stream.

Dtypes: binary ops take any F32/F16/BF16 pair (the result has the first operand's dtype),
unary ops F32/F16/BF16; an F32 result may be written as F16 or BF16 (the `_to_` kernels, for the
results fuse.half_nodes stores so); `cont` copies any dtype bit for bit (block types row by row); `cast`
converts among F32/F16/BF16 and widens F8_E4M3/F8_E5M2 to them. geglu, cont and cast go by the
device tensors' dtypes, which differ from the node's for the F32 results fuse.half_nodes stores
as F16/BF16 (a cont into or out of one is a cast). Declined (CPU only): casts
to or from block types other than a same-type copy (dequantizing is the matmul family's, and
quantizing is not done on the GPU), casts to F8 or F64.
"""
from __future__ import annotations

from functools import cache

from ....ops import elementwise as _defs  # defines the ops registered below
from ....ops.registry import ops_of_kind
from ..devtensor import SUFFIX as FLOAT
from ..devtensor import DevTensor
from ..devtensor import kernel_dtypes
from ..naming import kernel_name
from ..table import CUDA

MODULE = "elementwise"
BLOCK = 256
MAX_BLOCKS = 1 << 16  # grid-stride loops cover the rest
MAX_GRID_Y = 65535
ROW_MIN = 256  # elementwise.cu: merged rows at least this long take the row walk,
ILP = 4        # which gives each thread ILP elements
CAST_SOURCES = {**FLOAT, "F8_E4M3": "f8_e4m3", "F8_E5M2": "f8_e5m2"}
RAW = {1: "b8", 2: "b16", 4: "b32", 8: "b64"}
STRIDED = "PPqqqq" + "q" * 4  # x, out, n, ne0, ne1, ne2, 4 strides of x


@cache
def _fn(rt, kernel: str, argtypes: str):
    return rt.fn(MODULE, kernel, argtypes)


def grid_1d(n: int):
    return (max(1, min((n + BLOCK - 1) // BLOCK, MAX_BLOCKS)), 1, 1), (BLOCK, 1, 1)


def grid_for(ne0: int, n: int):
    """The launch shape for a walk over n elements whose merged first dim is ne0 (the kernel
    picks its path by the same rule): rows on blockIdx.y, else 1-D; ILP elements a thread."""
    if ROW_MIN <= ne0 < n:
        return (-(-ne0 // (BLOCK * ILP)), min(n // ne0, MAX_GRID_Y), 1), (BLOCK, 1, 1)
    return grid_1d(-(-n // ILP))


def operand_strides(x, out_ne) -> list[int]:
    """x's byte strides over the output's shape: 0 along the dims x broadcasts (size 1)."""
    return [x.nb[k] if x.ne[k] == out_ne[k] else 0 for k in range(4)]


def merge_dims(ne, *strides):
    """(ne3, [strides3 per operand]) walking the same elements in the same order with size-1
    dims dropped and adjacent dims merged where every operand steps through them as one
    (stride[k+1] == stride[k] * ne[k]). Returns ne as 3 leading sizes (the 4th is implied by
    the element count) and 4 strides per operand, padded with size 1 / stride 0."""
    dims: list[tuple[int, list[int]]] = []
    for k in range(4):
        if ne[k] == 1:
            continue
        st = [s[k] for s in strides]
        if dims and all(st[j] == dims[-1][1][j] * dims[-1][0] for j in range(len(strides))):
            dims[-1] = (dims[-1][0] * ne[k], dims[-1][1])
        else:
            dims.append((ne[k], st))
    while len(dims) < 4:
        dims.append((1, [0] * len(strides)))
    merged_ne = [d[0] for d in dims[:3]]
    return merged_ne, [[d[1][j] for d in dims] for j in range(len(strides))]


def _launch_strided(rt, kernel: str, x, out, *extra, extra_types: str = "") -> None:
    ne, (sx,) = merge_dims(out.ne, operand_strides(x, out.ne))
    n = out.nelements
    grid, block = grid_for(ne[0], n)
    _fn(rt, kernel, STRIDED + extra_types)(grid, block, x.ptr, out.ptr, n, *ne, *sx, *extra)


# ---- binary ------------------------------------------------------------------------------------
def _float_srcs(node) -> bool:
    return all(s.dtype.name in FLOAT for s in node.src)


def binary(node, xs, out, rt):
    a, b = xs
    ne, (sa, sb) = merge_dims(out.ne, operand_strides(a, out.ne), operand_strides(b, out.ne))
    n = out.nelements
    grid, block = grid_for(ne[0], n)
    kernel = kernel_name(node.op, (a.dtype, b.dtype), out.dtype)
    _fn(rt, kernel, "PPPqqqq" + "q" * 8)(grid, block, a.ptr, b.ptr, out.ptr, n, *ne, *sa, *sb)


def gated_add(rt, x, y, g, out) -> None:
    """out = x + y * g, every operand F32 through its strides (g typically a broadcast vector):
    fuse.py's add(x, mul(y, g)) of a DiT block's gated residual, rounded as the two kernels."""
    ne, (sx, sy, sg) = merge_dims(out.ne, *(operand_strides(t, out.ne) for t in (x, y, g)))
    n = out.nelements
    grid, block = grid_for(ne[0], n)
    _fn(rt, "gated_add_f32", "PPPPqqqq" + "q" * 12)(grid, block, x.ptr, y.ptr, g.ptr, out.ptr, n, *ne, *sx, *sy, *sg)


def silu_mul(rt, a, b, out) -> None:
    """out = silu(a) * b, a and b F32 through their strides, out F32 or the F16/BF16 fuse.py stores
    it as: fuse.py's mul(silu(a), b) of a SwiGLU feed-forward, rounded as the two kernels."""
    ne, (sa, sb) = merge_dims(out.ne, *(operand_strides(t, out.ne) for t in (a, b)))
    n = out.nelements
    grid, block = grid_for(ne[0], n)
    _fn(rt, f"silu_mul_{kernel_dtypes(a, out)}", "PPPqqqq" + "q" * 8)(grid, block, a.ptr, b.ptr, out.ptr, n, *ne,
                                                                      *sa, *sb)


for _op in ops_of_kind("binary"):
    CUDA.register(_op, supports=_float_srcs)(binary)


# ---- unary -------------------------------------------------------------------------------------
def unary(node, xs, out, rt):
    x, = xs
    _launch_strided(rt, kernel_name(node.op, (x.dtype,), out.dtype), x, out, *_defs.unary_scalars(node),
                    extra_types="ff")


for _op in ops_of_kind("unary"):
    CUDA.register(_op, supports=_float_srcs)(unary)


# ---- geglu -------------------------------------------------------------------------------------
@CUDA.register("geglu", supports=_float_srcs)
def _geglu(node, xs, out, rt):
    x, = xs
    h = out.ne[0]
    # x's own strides (its ne0 is 2h, so operand_strides would call dim 0 a broadcast)
    ne, (sx,) = merge_dims(out.ne, list(x.nb))
    gelu = "tanh" if node.params["approximate"] == "tanh" else "erf"
    grid, block = grid_for(ne[0], out.nelements)
    _fn(rt, f"geglu_{gelu}_{kernel_dtypes(x, out)}", STRIDED + "q")(
        grid, block, x.ptr, out.ptr, out.nelements, *ne, *sx, h * x.nb[0])


# ---- cont / cast -------------------------------------------------------------------------------
def _copyable(node) -> bool:
    """Same-dtype copy: any element size the raw kernels have, or whole rows of a block type."""
    src = node.src[0]
    if src.dtype != node.dtype:
        return False
    if src.dtype.is_quantized:
        return src.nb[0] == src.dtype.type_size
    return src.dtype.type_size in RAW


def _copy(x, out, rt) -> None:
    if not x.dtype.is_quantized:
        _launch_strided(rt, f"copy_{RAW[x.dtype.type_size]}", x, out)
        return
    # block rows are contiguous bytes; copy them in 4-byte words when everything is aligned
    row_bytes = x.dtype.row_bytes(x.ne[0])
    words = row_bytes % 4 == 0 and x.ptr % 4 == 0 and out.ptr % 4 == 0 and all(s % 4 == 0 for s in x.nb[1:])
    unit = 4 if words else 1
    nrows = x.nrows
    threads = min(BLOCK, max(32, (row_bytes // unit + 31) // 32 * 32))
    _fn(rt, f"copy_rows_{'u32' if words else 'u8'}", "PPqqqqqqq")(
        (max(1, min(nrows, MAX_BLOCKS)), 1, 1), (threads, 1, 1),
        x.ptr, out.ptr, row_bytes // unit, nrows, x.ne[1], x.ne[2], x.nb[1], x.nb[2], x.nb[3])


def _castable(node) -> bool:
    return _copyable(node) or (node.src[0].dtype.name in CAST_SOURCES and node.dtype.name in FLOAT)


def cast_into(rt, x, dst: int, dst_dtype) -> None:
    """Convert x (any view, float) into the contiguous x.ne buffer at `dst` of float `dst_dtype`."""
    out = DevTensor(dst, dst_dtype, x.ne, (0, 0, 0, 0), x.tensor)   # strides unused: written in order
    _launch_strided(rt, f"cast_{CAST_SOURCES[x.dtype.name]}_{FLOAT[dst_dtype.name]}", x, out)


@CUDA.register("cast", supports=_castable)
@CUDA.register("cont", supports=_copyable)
def cast_or_copy(node, xs, out, rt):
    # by the device tensors' dtypes, which differ from the node's where fuse.py stores an F32
    # result as F16 (a cont of one, or into one, is then a cast)
    x, = xs
    if x.dtype == out.dtype:
        _copy(x, out, rt)
    else:
        _launch_strided(rt, f"cast_{CAST_SOURCES[x.dtype.name]}_{FLOAT[out.dtype.name]}", x, out)
