"""Vulkan kernels for conv2d (shaders/conv.comp; CPU: sdrt/ops/cpu/conv.py): an implicit GEMM
(im2col inside the tile loader, no column buffer) over strided F32/F16/BF16 inputs and
weights, with stride, padding (zero or circular), dilation, groups and a fused bias; F32 result.
conv_transpose2d is the same shader in gather form (the SD VAE decoder's folded upsample convs).
conv1d is conv2d with H = 1; conv3d is a direct shader (conv3d.comp). Declined (CPU): F8 and block
weights."""
from __future__ import annotations

from ....ops import conv as _defs  # noqa: F401  (defines the ops registered below)
from ..table import VULKAN
from .elementwise import DTYPE, groups_for
from .norm import _vector_stride

SHADER = "conv"
TILE = 64


def _floats(node) -> bool:
    return all(s.dtype.name in DTYPE for s in node.src)


def _pair(a, b) -> int:
    if not (0 <= a < 1 << 16 and 0 <= b < 1 << 16):
        raise ValueError(f"conv2d parameter pair ({a}, {b}) out of range")
    return a | b << 16


@VULKAN.register("conv2d", supports=_floats)
def _conv2d(node, xs, out, rec):
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    p = node.params
    G = p["groups"]
    if w.tensor.ndim == 2:                     # [C, OC]: a 1x1 kernel
        KW = KH = 1
        ws = w.strides()
        w_st = [0, 0, ws[0], ws[1]]
        Cg, OC = w.ne[0], w.ne[1]
    else:
        KW, KH, Cg, OC = w.ne
        w_st = w.strides()
    OW, OH = out.ne[0], out.ne[1]
    N = out.ne[3]
    OCg = OC // G
    flags = G | (int(p["circular"][0]) << 16) | (int(p["circular"][1]) << 17) | ((b is not None) << 18)
    offs = rec.bind([w, x, b, out])
    t = (DTYPE[w.dtype.name], DTYPE[x.dtype.name], DTYPE[b.dtype.name] if b is not None else 0, DTYPE[out.dtype.name])
    rec.dispatch(SHADER, t, (-(-OCg // TILE), -(-(OW * OH) // TILE), G * N),
                 u=[OW, OH, OCg, Cg, x.ne[0], x.ne[1], _pair(KW, KH), _pair(*p["stride"]), _pair(*p["padding"]),
                    _pair(*p["dilation"]), flags, *offs[:4], *w_st, *x.strides(),
                    _vector_stride(b) if b is not None else 0])


@VULKAN.register("conv_transpose2d", supports=_floats)
def _conv_transpose2d(node, xs, out, rec):
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    p = node.params
    KW, KH, OC, C = w.ne
    ws = w.strides()
    OW, OH, N = out.ne[0], out.ne[1], out.ne[3]
    flags = 1 | ((b is not None) << 18) | (1 << 19)
    offs = rec.bind([w, x, b, out])
    t = (DTYPE[w.dtype.name], DTYPE[x.dtype.name], DTYPE[b.dtype.name] if b is not None else 0, DTYPE[out.dtype.name])
    rec.dispatch(SHADER, t, (-(-OC // TILE), -(-(OW * OH) // TILE), N),
                 u=[OW, OH, OC, C, x.ne[0], x.ne[1], _pair(KW, KH), _pair(*p["stride"]), _pair(*p["padding"]),
                    _pair(*p["dilation"]), flags, *offs[:4], ws[0], ws[1], ws[3], ws[2], *x.strides(),
                    _vector_stride(b) if b is not None else 0])


@VULKAN.register("conv1d", supports=_floats)
def _conv1d(node, xs, out, rec):
    """conv2d's shader with H = KH = 1: x [L, C, N], w [K, C/g, OC] -> out [OL, OC, N]."""
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    p = node.params
    G = p["groups"]
    K, Cg, OC = w.ne[0], w.ne[1], w.ne[2]
    xs_, ws_ = x.strides(), w.strides()
    OL, N = out.ne[0], out.ne[2]
    OCg = OC // G
    flags = G | ((b is not None) << 18)
    offs = rec.bind([w, x, b, out])
    t = (DTYPE[w.dtype.name], DTYPE[x.dtype.name], DTYPE[b.dtype.name] if b is not None else 0, DTYPE[out.dtype.name])
    rec.dispatch(SHADER, t, (-(-OCg // TILE), -(-OL // TILE), G * N),
                 u=[OL, 1, OCg, Cg, x.ne[0], 1, _pair(K, 1), _pair(p["stride"][0], 1), _pair(p["padding"][0], 0),
                    _pair(p["dilation"][0], 1), flags, *offs[:4], ws_[0], 0, ws_[1], ws_[2],
                    xs_[0], 0, xs_[1], xs_[2], _vector_stride(b) if b is not None else 0])


# ---- conv3d (shaders/conv3d.comp, direct form) -------------------------------------------------
def _conv3d_ok(node) -> bool:
    p = node.params
    x = node.src[0].ne4
    small = all(0 < v < 256 for k in ("stride", "dilation") for v in p[k]) and all(0 <= v < 256 for v in p["padding"])
    kernel = all(k < 256 for k in node.src[1].ne4[:3])
    return _floats(node) and small and kernel and x[0] < 1 << 16 and x[1] < 1 << 16 and \
        node.ne[0] < 1 << 16 and node.ne[1] < 1 << 16


@VULKAN.register("conv3d", supports=_conv3d_ok)
def _conv3d(node, xs, out, rec):
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    p = node.params
    ic = p["ic"] if p["ic"] is not None else x.ne[3]
    OW, OH, OD, _ = out.ne
    OC = w.ne[3] // ic
    offs = rec.bind([x, w, b, out])
    axes = [p["stride"][a] | p["padding"][a] << 8 | p["dilation"][a] << 16 | w.ne[a] << 24 for a in range(3)]
    n = out.nelements
    rec.dispatch("conv3d", (DTYPE[x.dtype.name], DTYPE[w.dtype.name], DTYPE[b.dtype.name] if b is not None else 0,
                            DTYPE[out.dtype.name]), groups_for(n),
                 u=[OW | OH << 16, OD, OC, x.ne[0] | x.ne[1] << 16, x.ne[2], ic, *x.strides(), *w.strides(),
                    _vector_stride(b) if b is not None else 0, int(b is not None), *offs[:4], n, *axes])
