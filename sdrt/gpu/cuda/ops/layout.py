"""CUDA kernels for upscale, pad, concat and repeat (kernels/layout.cu).

Sources are read through their byte strides, so every view works; outputs are the node's
contiguous buffer. Data movement copies raw storage by element size (u8/u16/u32/u64: every
non-block dtype, bit exact, as the CPU kernels do); bilinear/bicubic resampling reads
F32/F16/BF16 and writes the input's dtype. Each function only enqueues launches on rt.stream.
"""
from __future__ import annotations

import numpy as np

from ....ops.convert import f32_to_raw
from ..devtensor import SUFFIX as _FLOAT
from ..table import CUDA
from .elementwise import cast_into

MODULE = "layout"
BLOCK = 256
_RAW = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
_PAD_MODES = {"constant": 0, "circular": 1, "reflect": 2, "replicate": 3}
_INTERP_MODES = {"bilinear": 1, "bicubic": 2}


def launch_1d(rt, module: str, kernel: str, argtypes: str, n: int, *args) -> None:
    """Enqueue a grid-stride `kernel` of kernels/<module>.cu over n items (none when n == 0)."""
    if n > 0:
        rt.fn(module, kernel, argtypes)((rt.grid_for(n, BLOCK),), (BLOCK,), *args)


def launch(rt, kernel: str, argtypes: str, n: int, *args) -> None:
    launch_1d(rt, MODULE, kernel, argtypes, n, *args)


def _raw_suffix(t) -> str:
    return _RAW[t.dtype.type_size]


def _non_block(node) -> bool:
    return not node.dtype.is_quantized and all(not s.dtype.is_quantized for s in node.src) \
        and all(s.dtype.type_size in _RAW for s in node.src)


def fill_bits(dtype, value: float) -> int:
    """The raw storage bits of `value` in `dtype`, as a signed int64 kernel argument."""
    if value == 0.0:
        return 0
    if dtype.is_float:
        raw = f32_to_raw(np.array([value], np.float32), dtype)
    else:
        raw = np.array([value]).astype(dtype.np_storage)
    u = int(raw.view(f"u{dtype.type_size}")[0])
    return u - (1 << 64) if u >= 1 << 63 else u


# ---- pad ---------------------------------------------------------------------------------------
@CUDA.register("pad", supports=_non_block)
def pad(node, xs, out, rt):
    x, = xs
    p = node.params
    lo = [lh[0] for lh in p["pads"]]
    launch(rt, f"pad_{_raw_suffix(x)}", "PP" + "q" * 16 + "iq", out.nelements,
           out.ptr, x.ptr, *x.ne, *x.nb, *out.ne, *lo, _PAD_MODES[p["mode"]], fill_bits(node.dtype, p["value"]))


# ---- repeat ------------------------------------------------------------------------------------
@CUDA.register("repeat", supports=_non_block)
def repeat(node, xs, out, rt):
    x, = xs
    launch(rt, f"repeat_{_raw_suffix(x)}", "PP" + "q" * 12, out.nelements,
           out.ptr, x.ptr, *x.ne, *x.nb, *out.ne)


# ---- concat ------------------------------------------------------------------------------------
def copy4d(rt, dst: int, dst_nb, src: int, src_nb, ne, elem_size: int) -> None:
    """Enqueue dst[i] = src[i] over the 4-D shape `ne`, both through byte strides."""
    n = int(ne[0]) * int(ne[1]) * int(ne[2]) * int(ne[3])
    launch(rt, f"copy4d_{_RAW[elem_size]}", "PqqqqPqqqqqqqq", n, dst, *dst_nb, src, *src_nb, *ne)


def parts_are_runs(ne, dim: int) -> bool:
    """Whether each source's part of a concat along `dim` into shape `ne` is one contiguous run
    (no dim above `dim` wider than 1)."""
    return all(n == 1 for n in ne[dim + 1:])


def cast4d(rt, dst: int, dst_nb, src, dst_dtype) -> None:
    """Enqueue dst[i] = src[i] converted to float `dst_dtype` over src's shape (DevTensor src,
    float), dst through byte strides `dst_nb`."""
    launch(rt, f"cast4d_{_FLOAT[src.dtype.name]}_{_FLOAT[dst_dtype.name]}", "PqqqqPqqqqqqqq", src.nelements,
           dst, *dst_nb, src.ptr, *src.nb, *src.ne)


@CUDA.register("concat", supports=_non_block)
def concat(node, xs, out, rt):
    # a contiguous source whose part is one run is one device memcpy; an F16/BF16-stored concat
    # (fuse.half_nodes) converts its F32 sources
    dim = node.params["dim"]
    runs = parts_are_runs(out.ne, dim)
    start = 0
    for x in xs:
        dst = out.ptr + start * out.nb[dim]
        if x.dtype != out.dtype and runs:
            cast_into(rt, x, dst, out.dtype)
        elif x.dtype != out.dtype:
            cast4d(rt, dst, out.nb, x, out.dtype)
        elif runs and x.is_contiguous:
            rt.copy(dst, x.ptr, x.nbytes)
        else:
            copy4d(rt, dst, out.nb, x.ptr, x.nb, x.ne, x.dtype.type_size)
        start += x.ne[dim]


# ---- upscale -----------------------------------------------------------------------------------
def _upscale_ok(node) -> bool:
    if not _non_block(node):
        return False
    return node.params["mode"] == "nearest" or node.src[0].dtype.name in _FLOAT


@CUDA.register("upscale", supports=_upscale_ok)
def upscale(node, xs, out, rt):
    x, = xs
    p = node.params
    if p["mode"] == "nearest":
        launch(rt, f"upscale_nearest_{_raw_suffix(x)}", "PP" + "q" * 12, out.nelements,
               out.ptr, x.ptr, *x.ne, *x.nb, *out.ne)
        return
    launch(rt, f"upscale_interp_{_FLOAT[x.dtype.name]}", "PP" + "q" * 12 + "iii", out.nelements,
           out.ptr, x.ptr, *x.ne, *x.nb, *out.ne, _INTERP_MODES[p["mode"]],
           int(p["align_corners"]), int(p["antialias"]))
