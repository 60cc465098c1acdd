"""Resampling and layout ops: upscale (ggml_interpolate), pad (ggml_pad_ext, circular, reflect,
replicate), concat, repeat.

Dims are ggml's (ne order, dim 0 innermost): an image batch of numpy shape (N, C, H, W) is
ne (W, H, C, N), so `upscale` and the 2-D pads act on dims 0 (W) and 1 (H).

Everything but bilinear/bicubic resampling only moves elements, so those ops take any non-block
dtype and the CPU kernels copy raw storage (bit exact for F16/BF16/F8/I32).
"""
from __future__ import annotations

import numpy as np

from .cases import Case, In
from .registry import FLOATS, defop, fail, make_node
from .tensor import MAX_DIMS, Tensor

__all__ = [
    "PAD_MODES",
    "UPSCALE_MODES",
    "concat",
    "concat_many",
    "interpolate",
    "pad",
    "repeat",
    "upscale",
]

UPSCALE_MODES = ("nearest", "bilinear", "bicubic")
PAD_MODES = ("constant", "circular", "reflect", "replicate")


def _ne4(ne):
    return tuple(ne) + (1,) * (MAX_DIMS - len(ne))


def _trim(ne, keep):
    """Drop trailing unit dims above `keep` dims (ggml tensors are 4-D; sdrt keeps ndim)."""
    ne = list(ne)
    while len(ne) > max(keep, 1) and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def _raw_src(op, srcs):
    for s in srcs:
        if s.dtype.is_quantized:
            fail(op, srcs, f"needs a non-block dtype, got {s.dtype.name}")


def _np_axis(nd, dim):
    """numpy axis of ggml dim `dim` in an nd-dim array."""
    return nd - 1 - dim


# ---- upscale / interpolate ---------------------------------------------------------------------
def _upscale_infer(srcs, p):
    x, = srcs
    mode = p["mode"]
    if mode not in UPSCALE_MODES:
        fail("upscale", srcs, f"unknown mode {mode!r}; modes: {', '.join(UPSCALE_MODES)}")
    if mode != "nearest" and x.dtype.name not in FLOATS:
        fail("upscale", srcs, f"{mode} needs F32/F16/BF16 input, got {x.dtype.name}")
    _raw_src("upscale", srcs)
    if p["antialias"] and mode != "bilinear":
        fail("upscale", srcs, "antialias is only defined for bilinear (as in ggml)")
    ne = p["ne"]
    if len(ne) != MAX_DIMS or any(int(n) < 1 for n in ne):
        fail("upscale", srcs, f"output ne {tuple(ne)} must be 1 to 4 dims, each >= 1")
    return _trim(ne, x.ndim), x.dtype


def _src_coord(n_in, n_out, align_corners, i):
    """ggml's source coordinate of output index i along one axis (float32 arithmetic):
    (i + off) / sf - off with sf = out/in, off = 0.5; align_corners: off = 0 and
    sf = (out-1)/(in-1)."""
    sf = np.float32(n_out) / np.float32(n_in)
    off = np.float32(0.5)
    if align_corners:
        off = np.float32(0.0)
        if n_out > 1 and n_in > 1:
            sf = np.float32(n_out - 1) / np.float32(n_in - 1)
    return (i.astype(np.float32) + off) / sf - off, sf, off


def _cubic_w(t):
    """Keys cubic convolution weights, A = -0.75 (torch and ggml), for fractional offset t."""
    a = -0.75

    def w1(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def w2(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.stack([w2(t + 1), w1(t), w1(1 - t), w2(2 - t)], -1)


def _upscale_reference(node, xs):
    """ggml_compute_forward_upscale_f32 in numpy: 2-D resampling on dims 0/1, nearest on 2/3."""
    p = node.params
    x = xs[0].astype(np.float64)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)  # (n3, n2, n1, n0)
    o0, o1, o2, o3 = p["ne"]
    n3, n2, n1, n0 = x.shape
    # dims 2, 3: nearest, i / sf in float32
    i3 = (np.arange(o3, dtype=np.float32) / (np.float32(o3) / np.float32(n3))).astype(np.int64)
    i2 = (np.arange(o2, dtype=np.float32) / (np.float32(o2) / np.float32(n2))).astype(np.int64)
    x = x[i3][:, i2]
    mode, ac = p["mode"], p["align_corners"]
    if mode == "nearest":
        j0 = (np.arange(o0, dtype=np.float32) / (np.float32(o0) / np.float32(n0))).astype(np.int64)
        j1 = (np.arange(o1, dtype=np.float32) / (np.float32(o1) / np.float32(n1))).astype(np.int64)
        return x[:, :, j1][:, :, :, j0]
    cx, sx, offx = _src_coord(n0, o0, ac, np.arange(o0))
    cy, sy, offy = _src_coord(n1, o1, ac, np.arange(o1))
    if mode == "bilinear" and p["antialias"]:
        def taps(c, sf, off, n):
            # triangle filter widened to 1/sf when downscaling, centre (i + off) / sf, the
            # window [c - support + off, c + support + off) truncated as ggml (= torch)
            c = (c + off).astype(np.float64)
            support = max(1.0, 1.0 / float(sf))
            k = np.arange(n)
            lo = np.maximum((c - support + off).astype(np.int64), 0)
            hi = np.minimum((c + support + off).astype(np.int64), n)
            w = np.maximum(1.0 - np.abs((k[None, :] - c[:, None] + off) / support), 0.0)
            w = np.where((k[None, :] >= lo[:, None]) & (k[None, :] < hi[:, None]), w, 0.0)
            tot = w.sum(1, keepdims=True)
            return w / np.where(tot > 0, tot, 1.0)
        wy, wx = taps(cy, sy, offy, n1), taps(cx, sx, offx, n0)
        return np.einsum("yh,abhw,xw->abyx", wy, x, wx)
    if mode == "bilinear":
        def lin(c, n):
            f0 = np.floor(c).astype(np.int64)
            j0 = np.clip(f0, 0, n - 1)
            j1 = np.clip(f0 + 1, 0, n - 1)
            d = np.clip(c - j0, 0.0, 1.0).astype(np.float64)
            return j0, j1, d
        y0, y1, dy = lin(cy, n1)
        x0, x1, dx = lin(cx, n0)
        a, b = x[:, :, y0][:, :, :, x0], x[:, :, y0][:, :, :, x1]
        c, d = x[:, :, y1][:, :, :, x0], x[:, :, y1][:, :, :, x1]
        dx, dy = dx[None, None, None, :], dy[None, None, :, None]
        return a * (1 - dx) * (1 - dy) + b * dx * (1 - dy) + c * (1 - dx) * dy + d * dx * dy
    # bicubic: 4x4 taps around floor(c), indices clamped to the border
    fy, fx = np.floor(cy), np.floor(cx)
    wy, wx = _cubic_w((cy - fy).astype(np.float64)), _cubic_w((cx - fx).astype(np.float64))
    ty = np.clip(fy.astype(np.int64)[:, None] + np.arange(-1, 3), 0, n1 - 1)
    tx = np.clip(fx.astype(np.int64)[:, None] + np.arange(-1, 3), 0, n0 - 1)
    g = x[:, :, ty][:, :, :, :, tx]  # (a, b, o1, 4, o0, 4)
    return np.einsum("abyixj,yi,xj->abyx", g, wy, wx)


def _upscale_cases():
    x = In((7, 5, 3, 2))
    return [Case((In((7, 5, 3), t),), build=lambda x: upscale(x, scale_factor=2), label="nearest-x2") for t in FLOATS] + [
        Case((In((7, 5, 3), "I32", lo=-9, hi=9),), build=lambda x: upscale(x, ne=(11, 9)), label="nearest-i32"),
        Case((x,), build=lambda x: upscale(x, ne=(11, 9), mode="bilinear"), label="bilinear"),
        Case((x,), build=lambda x: upscale(x, ne=(11, 9), mode="bilinear", align_corners=True), label="bilinear-ac"),
        Case((In((13, 11, 3)),), build=lambda x: upscale(x, ne=(6, 5), mode="bilinear", antialias=True),
             label="bilinear-antialias-down"),
        Case((x,), build=lambda x: upscale(x, ne=(11, 9), mode="bicubic"), label="bicubic"),
        Case((In((7, 5, 3), "F16"),), build=lambda x: upscale(x, ne=(14, 10, 6), mode="bilinear"), label="bilinear-f16"),
        Case((In((7, 5, 3), view="t"),), build=lambda x: upscale(x, scale_factor=2), label="nearest-view")]


defop("upscale", _upscale_infer, _upscale_reference,
      "resample dims 0/1 (nearest, bilinear, bicubic; align_corners; bilinear antialias), "
      "nearest on dims 2/3 (ggml_interpolate)", cases=_upscale_cases)


def upscale(x: Tensor, ne=None, scale_factor=None, mode: str = "nearest",
            align_corners: bool = False, antialias: bool = False) -> Tensor:
    """ggml_upscale / ggml_interpolate. Give the output size `ne` (1 to 4 dims in ne order; the
    dims not given keep their size) or `scale_factor` (one number or a (sf0, sf1) pair for dims
    0/1; the output is floor(n * sf) as in torch). Coordinates follow ggml (= torch's
    F.interpolate): nearest takes floor(i / sf); bilinear/bicubic use half-pixel centres, or
    (out-1)/(in-1) scaling with align_corners; bicubic is Keys A=-0.75 with border clamping."""
    if not isinstance(x, Tensor):
        raise TypeError(f"upscale: x must be an sdrt Tensor, got {type(x).__name__}")
    src = _ne4(x.ne)
    if (ne is None) == (scale_factor is None):
        fail("upscale", (x,), "give exactly one of ne and scale_factor")
    if ne is not None:
        ne = tuple(int(n) for n in ne)
        if not 1 <= len(ne) <= MAX_DIMS:
            fail("upscale", (x,), f"ne {ne} must have 1 to 4 dims")
        out = ne + src[len(ne):]
    else:
        sf = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)
        if len(sf) != 2 or any(float(s) <= 0 for s in sf):
            fail("upscale", (x,), f"scale_factor {scale_factor!r} must be a positive number or pair")
        out = (int(np.floor(src[0] * float(sf[0]))), int(np.floor(src[1] * float(sf[1])))) + src[2:]
    return make_node("upscale", (x,), ne=tuple(int(n) for n in out), mode=str(mode),
                     align_corners=bool(align_corners), antialias=bool(antialias))


def interpolate(x: Tensor, ne, mode: str = "nearest", align_corners: bool = False,
                antialias: bool = False) -> Tensor:
    """ggml_interpolate(x, ne0..ne3, mode | flags): `upscale` with an explicit size."""
    return upscale(x, ne=ne, mode=mode, align_corners=align_corners, antialias=antialias)


# ---- pad ---------------------------------------------------------------------------------------
def _pad_infer(srcs, p):
    x, = srcs
    _raw_src("pad", srcs)
    mode = p["mode"]
    if mode not in PAD_MODES:
        fail("pad", srcs, f"unknown mode {mode!r}; modes: {', '.join(PAD_MODES)}")
    pads = p["pads"]
    src = _ne4(x.ne)
    for d, (lo, hi) in enumerate(pads):
        if lo < 0 or hi < 0:
            fail("pad", srcs, f"dim {d}: padding ({lo}, {hi}) must be >= 0")
        if mode == "reflect" and (lo >= src[d] or hi >= src[d]):
            fail("pad", srcs, f"reflect: dim {d} padding ({lo}, {hi}) must be smaller than its size {src[d]}")
    ne = tuple(n + lo + hi for n, (lo, hi) in zip(src, pads))
    keep = max(x.ndim, max((d + 1 for d, lh in enumerate(pads) if any(lh)), default=1))
    return _trim(ne, keep), x.dtype


def _pad_reference(node, xs):
    p = node.params
    x = xs[0]
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    width = [tuple(lh) for lh in p["pads"]][::-1]
    mode = p["mode"]
    if mode == "constant":
        return np.pad(x, width, mode="constant", constant_values=p["value"])
    return np.pad(x, width, mode={"circular": "wrap", "reflect": "reflect", "replicate": "edge"}[mode])


def _pad_cases():
    x = In((7, 5, 3))
    return [Case((x,), build=lambda x, m=m: pad(x, [(1, 2), (2, 1)], mode=m), label=m)
            for m in ("constant", "circular", "reflect", "replicate")] + [
        Case((In((7, 5, 3), t),), build=lambda x: pad(x, [(1, 2), (0, 1), (1, 0), (0, 2)], value=0.5), label="4d-value")
        for t in ("F16", "BF16")] + [
        Case((In((7, 5), "I32", lo=-9, hi=9),), build=lambda x: pad(x, [3, 1]), label="right-i32"),
        Case((In((7, 5, 3), view="t"),), build=lambda x: pad(x, [(1, 1), (1, 1)], mode="reflect"), label="view")]


defop("pad", _pad_infer, _pad_reference,
      "pad each of the 4 dims by (left, right): zero/constant (ggml_pad_ext), circular "
      "(ggml_pad_ext_circular), reflect (no edge repeat) or replicate", cases=_pad_cases)


def pad(x: Tensor, pads, mode: str = "constant", value: float = 0.0) -> Tensor:
    """ggml_pad_ext. `pads` lists dims from 0 (W) up: each a (left, right) pair, or an int for a
    right-only pad (ggml_pad). mode 'constant' fills `value` (ggml: 0); 'circular' wraps around
    (ggml_pad_ext_circular, every padded dim); 'reflect' mirrors without repeating the edge
    (torch/ggml_pad_reflect_1d; padding < size); 'replicate' repeats the edge element."""
    pads = list(pads)
    if len(pads) > MAX_DIMS:
        fail("pad", (x,), f"{len(pads)} dims of padding, at most {MAX_DIMS}")
    norm = []
    for q in pads:
        if isinstance(q, (tuple, list)):
            if len(q) != 2:
                fail("pad", (x,), f"padding {q!r} is not a (left, right) pair")
            norm.append((int(q[0]), int(q[1])))
        else:
            norm.append((0, int(q)))
    norm += [(0, 0)] * (MAX_DIMS - len(norm))
    return make_node("pad", (x,), pads=tuple(norm), mode=str(mode), value=float(value))


# ---- concat ------------------------------------------------------------------------------------
def _concat_infer(srcs, p):
    dim = p["dim"]
    if not srcs:
        fail("concat", srcs, "needs at least one tensor")
    if not (isinstance(dim, int) and 0 <= dim < MAX_DIMS):
        fail("concat", srcs, f"dim {dim!r} must be 0..3 (ggml dims, 0 innermost)")
    _raw_src("concat", srcs)
    first = srcs[0]
    ne = list(_ne4(first.ne))
    for s in srcs[1:]:
        if s.dtype != first.dtype:
            fail("concat", srcs, f"dtypes differ: {first.dtype.name} vs {s.dtype.name}")
        o = _ne4(s.ne)
        for d in range(MAX_DIMS):
            if d != dim and o[d] != ne[d]:
                fail("concat", srcs, f"dim {d} differs ({ne[d]} vs {o[d]}); only dim {dim} may")
        ne[dim] += o[dim]
    return _trim(ne, max(max(s.ndim for s in srcs), dim + 1)), first.dtype


def _concat_reference(node, xs):
    xs = [x.reshape((1,) * (4 - x.ndim) + x.shape) for x in xs]
    return np.concatenate(xs, axis=_np_axis(4, node.params["dim"]))


def _concat_cases():
    return [Case((In((4, 3, 2, 2)), In(tuple(5 if i == d else n for i, n in enumerate((4, 3, 2, 2))))), {"dim": d})
            for d in range(4)] + [
        Case((In((6, 3), t), In((6, 2), t), In((6, 4), t)), {"dim": 1}) for t in ("F16", "BF16", "I32")] + [
        Case((In((6, 5), view="t"), In((6, 5), view="s")), {"dim": 0})]


defop("concat", _concat_infer, _concat_reference, "join tensors along one ggml dim (ggml_concat)",
      cases=_concat_cases)


def concat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """ggml_concat(a, b, dim): same dtype, all other dims equal."""
    return make_node("concat", (a, b), dim=dim)


def concat_many(tensors, dim: int) -> Tensor:
    """Concatenate a list along `dim` in one node (sd.cpp's ggml_ext_vec_concat builds a tree
    of pairwise concats; one node copies each element once)."""
    tensors = list(tensors)
    if len(tensors) == 1:
        return tensors[0]
    return make_node("concat", tuple(tensors), dim=dim)


# ---- repeat ------------------------------------------------------------------------------------
def _repeat_infer(srcs, p):
    x, = srcs
    _raw_src("repeat", srcs)
    ne = p["ne"]
    src = _ne4(x.ne)
    if len(ne) != MAX_DIMS or any(n < 1 for n in ne):
        fail("repeat", srcs, f"target ne {tuple(ne)} must be 1 to 4 dims, each >= 1")
    bad = [d for d in range(MAX_DIMS) if ne[d] % src[d]]
    if bad:
        fail("repeat", srcs, f"target ne {_trim(ne, 1)} is not a multiple of {x.ne} in dim {bad[0]}")
    return _trim(ne, p["ndim"]), x.dtype


def _repeat_reference(node, xs):
    x = xs[0]
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    reps = [o // i for o, i in zip(node.params["ne"][::-1], x.shape)]
    return np.tile(x, reps)


def _repeat_cases():
    return [Case((In((3, 2), t),), build=lambda x: repeat(x, (6, 4, 2))) for t in ("F32", "F16", "I32")] + [
        Case((In((1, 5)),), build=lambda x: repeat(x, (7, 5, 1, 2)), label="broadcast"),
        Case((In((3, 2), view="t"),), build=lambda x: repeat(x, (9, 2, 2)), label="view")]


defop("repeat", _repeat_infer, _repeat_reference, "tile to a shape whose dims are multiples (ggml_repeat)",
      cases=_repeat_cases)


def repeat(x: Tensor, ne) -> Tensor:
    """ggml_repeat / ggml_repeat_4d: tile `x` to `ne` (a tuple in ne order, or a Tensor whose
    shape is used, as ggml_repeat(a, b)); every target dim must be a multiple of x's."""
    if isinstance(ne, Tensor):
        ne = ne.ne
    ne = tuple(int(n) for n in ne)
    if not 1 <= len(ne) <= MAX_DIMS:
        fail("repeat", (x,), f"target ne {ne} must have 1 to 4 dims")
    return make_node("repeat", (x,), ne=ne + (1,) * (MAX_DIMS - len(ne)), ndim=max(len(ne), 1))

