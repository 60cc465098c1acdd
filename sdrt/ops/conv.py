"""Convolutions and pooling: conv1d, conv2d, conv3d, conv_transpose2d, pool1d, pool2d.

Layouts are ggml's (ne low-to-high; numpy order is the reverse):

- conv2d   x ne=[W, H, C, N], w ne=[KW, KH, C/groups, OC] (torch [OC, C/g, KH, KW]) -> F32 [OW, OH, OC, N]
           (a 2-D weight ne=[C, OC] is a 1x1 kernel, as in ggml_ext_conv_2d)
- conv1d   x ne=[L, C, N],    w ne=[K, C/groups, OC]                                -> F32 [OL, OC, N]
- conv3d   x ne=[W, H, D, IC*N], w ne=[KW, KH, KD, IC*OC] (ggml_conv_3d: channels and batch
           share dim 3, batch outer, so index = n*IC + ic; `ic` says how to split it)
                                                                    -> F32 [OW, OH, OD, OC*N]
- conv_transpose2d  x ne=[W, H, C, N], w ne=[KW, KH, OC, C] (torch [C, OC, KH, KW]) -> F32 [OW, OH, OC, N]
- pool2d   x ne=[W, H, ...] -> F32 [OW, OH, ...];  pool1d x ne=[L, ...] -> F32 [OL, ...]

Every per-axis parameter (stride, padding, dilation, kernel, circular) is given in ggml order:
x/W first, then y/H, then z/D (ggml's s0, s1, s2). That is the REVERSE of torch's (H, W) order.
A single int means the same value on every axis.

Output sizes (ggml_calc_conv_output_size / ggml_calc_pool_output_size):
    conv:            (in + 2p - d*(k-1) - 1) // s + 1
    conv_transpose:  (in - 1)*s - 2p + d*(k-1) + output_padding + 1   (torch; p=0, d=1 is
                     ggml_conv_transpose_2d_p0)
    pool:            (in + 2p - k) // s + 1

Pooling follows ggml's CPU kernel: avg sums the in-bounds values and divides by the full kernel
area k0*k1 (padding counts as zeros), max ignores padding (starts at -FLT_MAX).
Circular padding (sd.cpp's circular_x/circular_y) wraps the input by `padding` on that axis
before convolving, as ggml_pad_ext_circular does, instead of padding with zeros.

Weights may be any float type (F32/F16/BF16/F8, widened to F32 once per call) or any block
type (dequantized whole: conv weights are small). Biases have OC elements in any shape. Outputs are F32.
"""
from __future__ import annotations

import numpy as np

from ..errors import OpError
from . import dtypes
from .cases import Case, In
from .registry import FLOATS, defop, fail, make_node

__all__ = ["conv1d", "conv2d", "conv3d", "conv_transpose2d", "pool1d", "pool2d"]

_F32 = dtypes.F32


def _ntuple(v, n, op, what, minimum):
    t = (v,) * n if isinstance(v, (int, np.integer, bool)) else tuple(v)
    if len(t) != n:
        raise OpError(f"{op}: {what} needs {n} values (ggml order x, y, z), got {v!r}")
    t = tuple(int(i) for i in t)
    if any(i < minimum for i in t):
        raise OpError(f"{op}: {what} must be >= {minimum}, got {v!r}")
    return t


def _check_dtypes(op, srcs, nweights=1):
    x = srcs[0]
    if x.dtype.name not in FLOATS:
        fail(op, srcs, f"input must be F32/F16/BF16, got {x.dtype.name}")
    for w in srcs[1:1 + nweights]:
        if not (w.dtype.is_float or w.dtype.is_quantized):
            fail(op, srcs, f"weight must be a float (F32/F16/BF16/F8) or block type, got {w.dtype.name}")
    for b in srcs[1 + nweights:]:
        if b.dtype.name not in FLOATS:
            fail(op, srcs, f"bias must be F32/F16/BF16, got {b.dtype.name}")


def _out_size(op, srcs, axis, n, k, s, p, d):
    o = (n + 2 * p - d * (k - 1) - 1) // s + 1
    if o < 1:
        fail(op, srcs, f"kernel {k} (dilation {d}) does not fit input {n} + padding {p} on axis {axis}")
    return o


def conv2d_weight_ne(w):
    """ne4 of a conv2d weight; a 2-D weight [C, OC] is a 1x1 kernel (as ggml_ext_conv_2d does)."""
    return (1, 1) + w.ne[:2] if w.ndim == 2 else w.ne4


def _check_bias(op, srcs, oc):
    if len(srcs) > 2 and srcs[2].nelements != oc:
        fail(op, srcs, f"bias has {srcs[2].nelements} elements, expected OC={oc}")


# ---- shape rules -----------------------------------------------------------------------------
def _conv_infer(op, nsp):
    """conv1d (nsp=1) / conv2d (nsp=2): x [*S, C, N], w [*K, C/g, OC]."""
    def infer(srcs, params):
        _check_dtypes(op, srcs)
        x, w = srcs[0], srcs[1]
        if x.ndim > nsp + 2:
            fail(op, srcs, f"input has {x.ndim} dims, at most {nsp + 2} ([{'W, H' if nsp == 2 else 'L'}, C, N])")
        if w.ndim > nsp + 2:
            fail(op, srcs, f"weight has {w.ndim} dims, at most {nsp + 2}")
        xe, we = x.ne4, (conv2d_weight_ne(w) if nsp == 2 else w.ne4)
        C, N = xe[nsp], xe[nsp + 1]
        Cg, OC = we[nsp], we[nsp + 1]
        g = params["groups"]
        if g < 1 or C % g or OC % g:
            fail(op, srcs, f"groups={g} must divide C={C} and OC={OC}")
        if Cg != C // g:
            fail(op, srcs, f"weight has {Cg} input channels per group, expected C/groups={C // g}")
        _check_bias(op, srcs, OC)
        out = [_out_size(op, srcs, i, xe[i], we[i], params["stride"][i], params["padding"][i],
                         params["dilation"][i]) for i in range(nsp)]
        ne = out + [OC] + ([N] if x.ndim == nsp + 2 else [])
        return tuple(ne), _F32
    return infer


def _conv3d_infer(srcs, params):
    op = "conv3d"
    _check_dtypes(op, srcs)
    x, w = srcs[0], srcs[1]
    xe, we = x.ne4, w.ne4
    ic = params["ic"] if params["ic"] is not None else xe[3]
    if ic < 1 or xe[3] % ic:
        fail(op, srcs, f"input dim 3 ({xe[3]}) is not a multiple of IC={ic}")
    if we[3] % ic:
        fail(op, srcs, f"weight dim 3 ({we[3]}) is not a multiple of IC={ic} (w ne=[KW, KH, KD, IC*OC])")
    OC = we[3] // ic
    _check_bias(op, srcs, OC)
    N = xe[3] // ic
    out = [_out_size(op, srcs, i, xe[i], we[i], params["stride"][i], params["padding"][i],
                     params["dilation"][i]) for i in range(3)]
    return tuple(out + [OC * N]), _F32


def _convt_infer(srcs, params):
    op = "conv_transpose2d"
    _check_dtypes(op, srcs)
    x, w = srcs[0], srcs[1]
    if x.ndim > 4 or w.ndim > 4:
        fail(op, srcs, "at most 4 dims")
    xe, we = x.ne4, w.ne4
    C, N = xe[2], xe[3]
    OC = we[2]
    if we[3] != C:
        fail(op, srcs, f"weight dim 3 ({we[3]}) must equal input channels C={C} (w ne=[KW, KH, OC, C])")
    _check_bias(op, srcs, OC)
    out = []
    for i in range(2):
        s, p, d, op_ = (params[k][i] for k in ("stride", "padding", "dilation", "output_padding"))
        if op_ >= max(s, d):
            fail(op, srcs, f"output_padding {op_} must be smaller than stride {s} or dilation {d} on axis {i}")
        o = (xe[i] - 1) * s - 2 * p + d * (we[i] - 1) + op_ + 1
        if o < 1:
            fail(op, srcs, f"padding {p} leaves no output on axis {i}")
        out.append(o)
    return tuple(out + [OC] + ([N] if x.ndim == 4 else [])), _F32


def _pool_infer(op, nsp):
    def infer(srcs, params):
        x, = srcs
        if x.dtype.name not in FLOATS:
            fail(op, srcs, f"input must be F32/F16/BF16, got {x.dtype.name}")
        if params["kind"] not in ("avg", "max"):
            fail(op, srcs, f"kind must be 'avg' or 'max', got {params['kind']!r}")
        ne = list(x.ne4[: max(x.ndim, nsp)])
        for i in range(nsp):
            k, s, p = params["kernel"][i], params["stride"][i], params["padding"][i]
            o = (ne[i] + 2 * p - k) // s + 1
            if o < 1:
                fail(op, srcs, f"kernel {k} does not fit input {ne[i]} + padding {p} on axis {i}")
            ne[i] = o
        return tuple(ne), _F32
    return infer


# ---- numpy references (the living definition) ------------------------------------------------
def conv_nd_reference(x, w, b, stride, padding, dilation, groups, circular=None):
    """x (N, C, *S), w (OC, C/g, *K), per-axis params in numpy axis order (outer spatial first).
    Zero padding unless circular[i]; returns (N, OC, *O) float64."""
    nsp = x.ndim - 2
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    pads = [(0, 0), (0, 0)] + [(p, p) for p in padding]
    if circular is not None and any(circular):
        for i, c in enumerate(circular):
            if c:
                pw = [(0, 0)] * x.ndim
                pw[2 + i] = (padding[i], padding[i])
                x = np.pad(x, pw, mode="wrap")
                pads[2 + i] = (0, 0)
    x = np.pad(x, pads)
    win = [d * (k - 1) + 1 for d, k in zip(dilation, w.shape[2:])]
    v = np.lib.stride_tricks.sliding_window_view(x, win, axis=tuple(range(2, 2 + nsp)))
    v = v[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)
          + tuple(slice(None, None, d) for d in dilation)]
    C = x.shape[1]
    OC = w.shape[0]
    cg, og = C // groups, OC // groups
    outs = []
    sp = tuple(range(2 + nsp, 2 + 2 * nsp))
    for g in range(groups):
        vg = v[:, g * cg:(g + 1) * cg]
        wg = w[g * og:(g + 1) * og]
        # (N, cg, *O, *K) x (og, cg, *K) -> (N, *O, og)
        r = np.tensordot(vg, wg, axes=((1,) + sp, (1,) + tuple(range(2, 2 + nsp))))
        outs.append(np.moveaxis(r, -1, 1))
    out = np.concatenate(outs, axis=1)
    if b is not None:
        out = out + np.asarray(b, np.float64).reshape((1, OC) + (1,) * nsp)
    return out


def _rev(t):
    return tuple(t[::-1])


def _conv2d_ref(node, xs):
    p = node.params
    x4 = xs[0].reshape(node.src[0].ne4[::-1])
    w4 = xs[1].reshape(conv2d_weight_ne(node.src[1])[::-1])
    b = xs[2].reshape(-1) if len(xs) > 2 else None
    r = conv_nd_reference(x4, w4, b, _rev(p["stride"]), _rev(p["padding"]), _rev(p["dilation"]),
                          p["groups"], _rev(p["circular"]))
    return r.reshape(node.shape)


def _conv1d_ref(node, xs):
    p = node.params
    xe, we = node.src[0].ne4, node.src[1].ne4
    x3 = xs[0].reshape(xe[2], xe[1], xe[0])
    w3 = xs[1].reshape(we[2], we[1], we[0])
    b = xs[2].reshape(-1) if len(xs) > 2 else None
    r = conv_nd_reference(x3, w3, b, p["stride"], p["padding"], p["dilation"], p["groups"])
    return r.reshape(node.shape)


def _conv3d_ref(node, xs):
    p = node.params
    xe, we = node.src[0].ne4, node.src[1].ne4
    ic = p["ic"] if p["ic"] is not None else xe[3]
    x5 = xs[0].reshape(xe[3] // ic, ic, xe[2], xe[1], xe[0])
    w5 = xs[1].reshape(we[3] // ic, ic, we[2], we[1], we[0])
    b = xs[2].reshape(-1) if len(xs) > 2 else None
    r = conv_nd_reference(x5, w5, b, _rev(p["stride"]), _rev(p["padding"]), _rev(p["dilation"]), 1)
    return r.reshape(node.shape)


def _convt_ref(node, xs):
    """Scatter form: every input pixel adds its weighted kernel footprint to the output."""
    p = node.params
    xe, we = node.src[0].ne4, node.src[1].ne4
    x = np.asarray(xs[0], np.float64).reshape(xe[::-1])           # (N, C, H, W)
    w = np.asarray(xs[1], np.float64).reshape(we[::-1])           # (C, OC, KH, KW)
    (sx, sy), (px, py), (dx, dy) = p["stride"], p["padding"], p["dilation"]
    N, _, H, W = x.shape
    _, OC, KH, KW = w.shape
    OW, OH = node.ne[0], node.ne[1]
    full = np.zeros((N, OC, max((H - 1) * sy + dy * (KH - 1) + 1, py + OH),
                     max((W - 1) * sx + dx * (KW - 1) + 1, px + OW)))
    for ky in range(KH):
        for kx in range(KW):
            full[:, :, ky * dy: ky * dy + (H - 1) * sy + 1: sy, kx * dx: kx * dx + (W - 1) * sx + 1: sx] += \
                np.einsum("nchw,co->nohw", x, w[:, :, ky, kx])
    out = full[:, :, py:py + OH, px:px + OW]
    if len(xs) > 2:
        out = out + np.asarray(xs[2], np.float64).reshape(1, OC, 1, 1)
    return out.reshape(node.shape)


def pool_reference(x, kind, kernel, stride, padding):
    """x (B, *S) with per-axis params in numpy order; ggml semantics (see module doc)."""
    nsp = len(kernel)
    x = np.asarray(x, np.float64)
    fill = 0.0 if kind == "avg" else -np.finfo(np.float32).max
    x = np.pad(x, [(0, 0)] * (x.ndim - nsp) + [(q, q) for q in padding], constant_values=fill)
    ax = tuple(range(x.ndim - nsp, x.ndim))
    v = np.lib.stride_tricks.sliding_window_view(x, kernel, axis=ax)
    v = v[(Ellipsis,) + tuple(slice(None, None, s) for s in stride) + (slice(None),) * nsp]
    wax = tuple(range(v.ndim - nsp, v.ndim))
    return v.sum(axis=wax) / np.prod(kernel) if kind == "avg" else v.max(axis=wax)


def _pool_ref(nsp):
    def ref(node, xs):
        p = node.params
        x = xs[0].reshape(node.src[0].ne4[::-1][-max(node.src[0].ndim, nsp):])
        r = pool_reference(x, p["kind"], _rev(p["kernel"]), _rev(p["stride"]), _rev(p["padding"]))
        return r.reshape(node.shape)
    return ref


def _conv2d_cases():
    x, w, b = In((9, 7, 4, 2)), In((3, 3, 4, 6)), In((6,))
    return [Case((x, w, b), build=lambda x, w, b: conv2d(x, w, b, padding=1)),
            Case((x, w), build=lambda x, w: conv2d(x, w, stride=2, dilation=(2, 1)), label="stride2-dilation"),
            Case((x, In((3, 3, 2, 6))), build=lambda x, w: conv2d(x, w, padding=1, groups=2), label="groups2"),
            Case((x, w, b), build=lambda x, w, b: conv2d(x, w, b, padding=1, circular=(True, False)),
                 label="circular-x"),
            Case((In((5, 4, 32, 1)), In((32, 8))), build=lambda x, w: conv2d(x, w), label="1x1-2d-weight"),
            Case((In((5, 4, 32, 1)), In((32, 8), "Q8_0")), build=lambda x, w: conv2d(x, w), label="1x1-q8_0"),
            Case((In((9, 7, 4, 2), view="s"), w), build=lambda x, w: conv2d(x, w, padding=1), label="x-view")] + [
        Case((In((9, 7, 4, 2), t), In((3, 3, 4, 6), wt), In((6,), t)), build=lambda x, w, b: conv2d(x, w, b, padding=1))
        for t, wt in (("F16", "F16"), ("BF16", "BF16"), ("F32", "F16"), ("F32", "F8_E4M3"))]


def _conv1d_cases():
    return [Case((In((17, 4, 2)), In((3, 4, 5)), In((5,))), build=lambda x, w, b: conv1d(x, w, b, padding=1)),
            Case((In((17, 4, 2)), In((3, 2, 6))), build=lambda x, w: conv1d(x, w, stride=2, dilation=2, groups=2),
                 label="stride2-dilation2-groups2"),
            Case((In((17, 4, 2), "F16"), In((3, 4, 5), "F16")), build=lambda x, w: conv1d(x, w, padding=2))]


def _conv3d_cases():
    return [Case((In((6, 5, 4, 3)), In((3, 3, 3, 6)), In((2,))), build=lambda x, w, b: conv3d(x, w, b, padding=1, ic=3)),
            Case((In((6, 5, 4, 6)), In((3, 3, 2, 6), "F16")), build=lambda x, w: conv3d(x, w, stride=(2, 1, 1), ic=3),
                 label="batch2-stride")]


def _convt_cases():
    return [Case((In((5, 4, 3, 2)), In((3, 3, 4, 3)), In((4,))),
                 build=lambda x, w, b: conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1)),
            Case((In((5, 4, 3)), In((4, 4, 2, 3), "F16")), build=lambda x, w: conv_transpose2d(x, w, stride=2),
                 label="p0-f16-weight")]


def _pool_cases(fn, ne):
    return lambda: [Case((In(ne, t),), build=lambda x, k=kind: fn(x, k)) for t in FLOATS for kind in ("avg", "max")] + [
        Case((In(ne),), build=lambda x: fn(x, "max", kernel=3, stride=2, padding=1), label="k3-s2-p1"),
        Case((In(ne, view="s"),), build=lambda x: fn(x, "avg", kernel=3, stride=1, padding=1), label="view-k3-p1")]


defop("conv2d", _conv_infer("conv2d", 2), _conv2d_ref, "2-D convolution (ggml_conv_2d / ggml_ext_conv_2d_grouped)",
      nmse=5e-4, cases=_conv2d_cases)
defop("conv1d", _conv_infer("conv1d", 1), _conv1d_ref, "1-D convolution (ggml_ext_conv_1d)", nmse=5e-4,
      cases=_conv1d_cases)
defop("conv3d", _conv3d_infer, _conv3d_ref, "3-D convolution (ggml_conv_3d, channels*batch in dim 3)", nmse=5e-4,
      cases=_conv3d_cases)
defop("conv_transpose2d", _convt_infer, _convt_ref, "transposed 2-D convolution (ggml_conv_transpose_2d_p0 + padding)",
      nmse=5e-4, cases=_convt_cases)
defop("pool2d", _pool_infer("pool2d", 2), _pool_ref(2), "2-D avg/max pooling (ggml_pool_2d)",
      cases=_pool_cases(lambda *a, **k: pool2d(*a, **k), (9, 7, 3, 2)))
defop("pool1d", _pool_infer("pool1d", 1), _pool_ref(1), "1-D avg/max pooling (ggml_pool_1d)",
      cases=_pool_cases(lambda *a, **k: pool1d(*a, **k), (17, 3, 2)))


# ---- builders --------------------------------------------------------------------------------
def _srcs(x, w, b):
    return (x, w) if b is None else (x, w, b)


def conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, circular=False):
    """2-D convolution. x ne=[W, H, C, N], w ne=[KW, KH, C/groups, OC]; pairs are (x, y).
    circular=(cx, cy) wraps the input by `padding` on that axis instead of zero padding."""
    op = "conv2d"
    circ = (circular,) * 2 if isinstance(circular, (bool, int, np.bool_)) else tuple(circular)
    if len(circ) != 2:
        raise OpError(f"{op}: circular needs 2 values (x, y), got {circular!r}")
    return make_node(op, _srcs(x, w, b), stride=_ntuple(stride, 2, op, "stride", 1),
                     padding=_ntuple(padding, 2, op, "padding", 0),
                     dilation=_ntuple(dilation, 2, op, "dilation", 1), groups=int(groups),
                     circular=tuple(bool(c) for c in circ))


def conv1d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """1-D convolution. x ne=[L, C, N], w ne=[K, C/groups, OC]."""
    op = "conv1d"
    return make_node(op, _srcs(x, w, b), stride=_ntuple(stride, 1, op, "stride", 1),
                     padding=_ntuple(padding, 1, op, "padding", 0),
                     dilation=_ntuple(dilation, 1, op, "dilation", 1), groups=int(groups))


def conv3d(x, w, b=None, stride=1, padding=0, dilation=1, ic=None):
    """3-D convolution, ggml_conv_3d layout: x ne=[W, H, D, IC*N], w ne=[KW, KH, KD, IC*OC],
    output ne=[OW, OH, OD, OC*N] (batch outer in dim 3). `ic` = input channels; None means
    N=1 (IC = x.ne[3]). Triples are (x, y, z)."""
    op = "conv3d"
    return make_node(op, _srcs(x, w, b), stride=_ntuple(stride, 3, op, "stride", 1),
                     padding=_ntuple(padding, 3, op, "padding", 0),
                     dilation=_ntuple(dilation, 3, op, "dilation", 1),
                     ic=None if ic is None else int(ic))


def conv_transpose2d(x, w, b=None, stride=1, padding=0, output_padding=0, dilation=1):
    """Transposed 2-D convolution. x ne=[W, H, C, N], w ne=[KW, KH, OC, C] (torch [C, OC, KH, KW])."""
    op = "conv_transpose2d"
    return make_node(op, _srcs(x, w, b), stride=_ntuple(stride, 2, op, "stride", 1),
                     padding=_ntuple(padding, 2, op, "padding", 0),
                     output_padding=_ntuple(output_padding, 2, op, "output_padding", 0),
                     dilation=_ntuple(dilation, 2, op, "dilation", 1))


def pool2d(x, kind="avg", kernel=2, stride=None, padding=0):
    """avg/max pooling over ne[0], ne[1] (ggml_pool_2d). stride defaults to the kernel."""
    op = "pool2d"
    k = _ntuple(kernel, 2, op, "kernel", 1)
    return make_node(op, (x,), kind=str(kind), kernel=k,
                     stride=k if stride is None else _ntuple(stride, 2, op, "stride", 1),
                     padding=_ntuple(padding, 2, op, "padding", 0))


def pool1d(x, kind="avg", kernel=2, stride=None, padding=0):
    """avg/max pooling over ne[0] (ggml_pool_1d). stride defaults to the kernel."""
    op = "pool1d"
    k = _ntuple(kernel, 1, op, "kernel", 1)
    return make_node(op, (x,), kind=str(kind), kernel=k,
                     stride=k if stride is None else _ntuple(stride, 1, op, "stride", 1),
                     padding=_ntuple(padding, 1, op, "padding", 0))
