"""Vulkan kernels for the element-wise ops (shaders/elementwise.comp; CPU: sdrt/ops/cpu/elementwise.py).

Every input is read through its element strides (transposes, permutes, slices, broadcast dims
with stride 0); the output is the node's contiguous buffer. Before a dispatch the host merges
adjacent dims that every operand walks as one (as the CUDA backend does), so the shader's index
walk is short. Dtypes: F32/F16/BF16 for every operand (binary: any pair, the result has the first
operand's dtype); cast among F32/F16/BF16; cont of any 2- or 4-byte type bit for bit. Declined
(CPU): F8 and block types, casts to them.
"""
from __future__ import annotations

from ....ops import elementwise as _defs  # defines the ops registered below
from ....ops.registry import ops_of_kind
from ..table import VULKAN

SHADER = "elementwise"
LOCAL = 256
MAX_GROUPS = 65535
DTYPE = {"F32": 0, "F16": 1, "BF16": 2}          # common.glsl's T<binding> codes
UNARY = {"neg": 0, "abs": 1, "sqr": 2, "sqrt": 3, "exp": 4, "log": 5, "sin": 6, "cos": 7, "step": 8, "relu": 9,
         "leaky_relu": 10, "silu": 11, "sigmoid": 12, "tanh": 13, "gelu": 14, "gelu_tanh": 15, "gelu_quick": 16,
         "clamp": 17, "scale": 18}
COPY, GEGLU_ERF, GEGLU_TANH, RAW32, RAW16 = 19, 20, 21, 22, 23
BINARY = {"add": 100, "sub": 101, "mul": 102, "div": 103}


def groups_for(n: int, per_group: int = LOCAL) -> tuple[int, int, int]:
    """Workgroups covering n items (the shaders stride over what one 2-D grid does not reach)."""
    g = max(1, -(-n // per_group))
    return (min(g, MAX_GROUPS), max(1, min(-(-g // MAX_GROUPS), MAX_GROUPS)), 1)


def operand_strides(x, out_ne) -> list[int]:
    """x's element strides over the output's shape: 0 along the dims x broadcasts."""
    st = x.strides()
    return [st[k] if x.ne[k] == out_ne[k] else 0 for k in range(4)]


def merge_dims(ne, *strides):
    """(3 leading sizes, [4 strides per operand]) walking the same elements with size-1 dims
    dropped and adjacent dims merged where every operand steps through them as one."""
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
    return [d[0] for d in dims[:3]], [[d[1][j] for d in dims] for j in range(len(strides))]


def _floats(node) -> bool:
    return all(s.dtype.name in DTYPE for s in node.src) and node.dtype.name in DTYPE


def walk(rec, op: int, a, out, b=None, params=(0.0, 0.0), a_strides=None, extra: int = 0, types=None) -> None:
    """One strided element-wise dispatch: out[i] = op(a[walk(i)], b[walk(i)])."""
    sa = a_strides if a_strides is not None else operand_strides(a, out.ne)
    ops_ = [sa] + ([operand_strides(b, out.ne)] if b is not None else [])
    ne, st = merge_dims(out.ne, *ops_)
    sb = st[1] if b is not None else [0, 0, 0, 0]
    offs = rec.bind([a, b, None, out])
    t = types or (DTYPE[a.dtype.name], DTYPE[b.dtype.name] if b is not None else 0, 0, DTYPE[out.dtype.name])
    n = out.nelements
    rec.dispatch(SHADER, (*t, op), groups_for(n),
                 u=[n, *ne, offs[0], offs[1], offs[3], *st[0], *sb, extra], f=params)


def _binary(node, xs, out, rec):
    walk(rec, BINARY[node.op], xs[0], out, xs[1])


for _op in ops_of_kind("binary"):
    if _op in BINARY:
        VULKAN.register(_op, supports=_floats)(_binary)


def _unary(node, xs, out, rec):
    walk(rec, UNARY[node.op], xs[0], out, params=_defs.unary_scalars(node))


for _op in ops_of_kind("unary"):
    if _op in UNARY:
        VULKAN.register(_op, supports=_floats)(_unary)


@VULKAN.register("geglu", supports=_floats)
def _geglu(node, xs, out, rec):
    x, = xs
    h = out.ne[0]
    op = GEGLU_TANH if node.params["approximate"] == "tanh" else GEGLU_ERF
    walk(rec, op, x, out, a_strides=x.strides(), extra=h * x.strides()[0])


def _raw_copyable(node) -> bool:
    s = node.src[0]
    return s.dtype == node.dtype and not s.dtype.is_quantized and s.dtype.type_size in (2, 4)


@VULKAN.register("cast", supports=lambda n: _floats(n) or _raw_copyable(n))
@VULKAN.register("cont", supports=lambda n: _floats(n) or _raw_copyable(n))
def _cast_or_copy(node, xs, out, rec):
    x, = xs
    if x.dtype.name in DTYPE and out.dtype.name in DTYPE:
        walk(rec, COPY, x, out)
    else:
        walk(rec, RAW32 if x.dtype.type_size == 4 else RAW16, x, out, types=(0, 0, 0, 0))


# ---- get_rows, concat --------------------------------------------------------------------------
GET_ROWS = 24


@VULKAN.register("get_rows", supports=lambda n: n.src[0].dtype.name in DTYPE)
def _get_rows(node, xs, out, rec):
    table, ids = xs
    words = ids.dtype.type_size // 4          # I64 ids are read as their low 32-bit word
    st = [s // 4 for s in ids.nb]
    offs = rec.bind([table, ids, None, out])
    if words == 2:
        offs[1] = offs[1] * 2
    n = out.nelements
    rec.dispatch(SHADER, (DTYPE[table.dtype.name], 3, 0, DTYPE[out.dtype.name], GET_ROWS), groups_for(n),
                 u=[n, out.ne[0], out.ne[1], out.ne[2], offs[0], offs[1], offs[3], *table.strides(),
                    st[0], st[1], st[2], 0, 0, 0, 0, 0, 0, 0, table.ne[1]])


def _concat_ok(node) -> bool:
    return all(s.dtype == node.dtype for s in node.src) and (
        node.dtype.name in DTYPE or (not node.dtype.is_quantized and node.dtype.type_size in (2, 4)))


@VULKAN.register("concat", supports=_concat_ok)
def _concat(node, xs, out, rec):
    """One strided copy per part into its slice of the output."""
    from .. import backend
    dim = node.params["dim"]
    ost = out.strides()
    at = 0
    for x in xs:
        part = backend.VkTensor(out.ptr + at * out.nb[dim], out.dtype, x.ne, out.nb, out.tensor)
        at += x.ne[dim]
        ne, (sx, so) = merge_dims(x.ne, x.strides(), ost)
        offs = rec.bind([x, None, None, part])
        if x.dtype.name in DTYPE:
            op, t = COPY, (DTYPE[x.dtype.name], 0, 0, DTYPE[out.dtype.name])
        else:
            op, t = (RAW32 if x.dtype.type_size == 4 else RAW16), (0, 0, 0, 0)
        n = x.nelements
        rec.dispatch(SHADER, (*t, op), groups_for(n),
                     u=[n, *ne, offs[0], 0, offs[3], *sx, 0, 0, 0, 0, 0, *so, 1])


# ---- upscale (nearest), pad, repeat, timestep_embedding ---------------------------------------
UPSCALE, PAD, TSEMB = 25, 26, 27
PAD_MODES = {"constant": 0, "circular": 1, "reflect": 2, "replicate": 3}
RAW_CODE = {4: 3, 2: 4}       # common.glsl's raw 32-bit / 16-bit codes


def _gather_types(x, out):
    if x.dtype.name in DTYPE:
        return DTYPE[x.dtype.name], DTYPE[out.dtype.name]
    return RAW_CODE[x.dtype.type_size], 0


def _gatherable(node) -> bool:
    s = node.src[0]
    return s.dtype.name in DTYPE or (not s.dtype.is_quantized and s.dtype.type_size in RAW_CODE)


def _gather(rec, op, x, out, u_extra, f):
    ta, to = _gather_types(x, out)
    offs = rec.bind([x, None, None, out])
    n = out.nelements
    rec.dispatch(SHADER, (ta, 0, 0, to, op), groups_for(n),
                 u=[n, out.ne[0], out.ne[1], out.ne[2], offs[0], 0, offs[3], *x.strides(), *u_extra], f=f)


@VULKAN.register("upscale", supports=lambda n: _gatherable(n) and n.params["mode"] == "nearest")
def _upscale(node, xs, out, rec):
    import numpy as np
    x, = xs
    sf = [float(np.float32(o) / np.float32(s)) for o, s in zip(out.ne, x.ne)]   # float32, as ggml
    _gather(rec, UPSCALE, x, out, [], sf)


RESAMPLE = {"bilinear": 0, "bicubic": 1}


@VULKAN.register("upscale", supports=lambda n: n.params["mode"] in RESAMPLE and n.src[0].dtype.name in DTYPE
                 and n.dtype.name in DTYPE)
def _resample(node, xs, out, rec):
    """bilinear / bicubic (shaders/resample.comp): the scales in float32 as ggml computes them."""
    import numpy as np
    x, = xs
    f = np.float32
    p = node.params
    ac = p["align_corners"]
    sf = [f(o) / f(s) for o, s in zip(out.ne, x.ne)]
    for d in (0, 1):
        if ac and out.ne[d] > 1 and x.ne[d] > 1:
            sf[d] = f(out.ne[d] - 1) / f(x.ne[d] - 1)
    mode = 2 if p["antialias"] else RESAMPLE[p["mode"]]
    offs = rec.bind([x, None, None, out])
    n = out.nelements
    rec.dispatch("resample", (DTYPE[x.dtype.name], 0, 0, DTYPE[out.dtype.name]), groups_for(n),
                 u=[*x.ne, *x.strides(), *out.ne, offs[0], offs[3], n, mode],
                 f=[float(s) for s in sf] + [0.0 if ac else 0.5])


def _pad_like(rec, x, out, lo, mode, value=0.0):
    import numpy as np
    f0 = float(value)
    if x.dtype.name not in DTYPE and x.dtype.type_size == 4:     # an I32 fill value, as bits
        f0 = float(np.array([int(value)], np.int32).view(np.float32)[0])
    _gather(rec, PAD, x, out, [*lo, 0, *x.ne, 0, mode], [f0])


@VULKAN.register("pad", supports=lambda n: _gatherable(n) and (
    n.src[0].dtype.name in DTYPE or n.params["mode"] != "constant" or float(n.params.get("value", 0)) == 0))
def _pad(node, xs, out, rec):
    p = node.params
    lo = [lh[0] for lh in p["pads"]] + [0] * (4 - len(p["pads"]))
    _pad_like(rec, xs[0], out, lo, PAD_MODES[p["mode"]], p.get("value", 0.0))


@VULKAN.register("repeat", supports=_gatherable)
def _repeat(node, xs, out, rec):
    _pad_like(rec, xs[0], out, [0, 0, 0, 0], PAD_MODES["circular"])


@VULKAN.register("timestep_embedding", supports=lambda n: n.src[0].dtype.name in DTYPE)
def _timestep_embedding(node, xs, out, rec):
    import math
    t, = xs
    dim = node.params["dim"]
    offs = rec.bind([t, None, None, out])
    n = out.nelements
    rec.dispatch(SHADER, (DTYPE[t.dtype.name], 0, 0, DTYPE[out.dtype.name], TSEMB), groups_for(n),
                 u=[n, dim, dim // 2, 1, offs[0], 0, offs[3], t.strides()[0]],
                 f=[math.log(node.params["max_period"])])


# ---- pooling, arange ---------------------------------------------------------------------------
POOL, ARANGE = 28, 29


def _pool(node, xs, out, rec):
    from .conv import _pair
    x, = xs
    p = node.params
    k, s, pad = (list(p[key]) + [1 if key != "padding" else 0] * (2 - len(p[key]))
                 for key in ("kernel", "stride", "padding"))
    offs = rec.bind([x, None, None, out])
    n = out.nelements
    rec.dispatch(SHADER, (DTYPE[x.dtype.name], 0, 0, DTYPE[out.dtype.name], POOL), groups_for(n),
                 u=[n, out.ne[0], out.ne[1], out.ne[2], offs[0], 0, offs[3], *x.strides(),
                    _pair(*k), _pair(*s), _pair(*pad), 1 if p["kind"] == "max" else 0, 0, x.ne[0], x.ne[1]])


VULKAN.register("pool2d", supports=_floats)(_pool)
VULKAN.register("pool1d", supports=_floats)(_pool)


@VULKAN.register("arange")
def _arange(node, xs, out, rec):
    import numpy as np
    offs = rec.bind([None, None, None, out])
    n = out.nelements
    p = node.params
    rec.dispatch(SHADER, (0, 0, 0, DTYPE[out.dtype.name], ARANGE), groups_for(n),
                 u=[n, n, 1, 1, 0, 0, offs[3]], f=[float(np.float32(p["start"])), float(np.float32(p["step"]))])
