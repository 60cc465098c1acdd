"""Normalizations and softmax, with ggml's semantics (ne order: dim 0 is the innermost).

- `softmax(x, mask, scale)`: ggml_soft_max_ext: softmax over dim 0 of `x*scale + mask`, F32
  accumulation. The mask (F32/F16/BF16) has ne=[ne0, m1, m2, m3]: m1 >= ne1 uses its first ne1
  rows (ggml pads masks, GGML_KQ_MASK_PAD); m1 == 1 broadcasts one row to every row (an sdrt
  extension); m2/m3 divide ne2/ne3 and repeat (row i2 reads mask plane i2 % m2, as ggml).
  A row that is entirely -inf gives NaN, as ggml's CPU soft_max (and torch.softmax) do.
- `layer_norm(x, eps)`: ggml_norm, (x - mean) / sqrt(var + eps) over dim 0, no affine;
  `layer_norm_affine(x, w, b, eps)` fuses `* w + b` (w, b ne=[ne0], either may be None).
- `rms_norm(x, eps)`: ggml_rms_norm, x / sqrt(mean(x^2) + eps).
- `l2_norm(x, eps)`: ggml_l2_norm, x / max(||x||_2, eps).
- `group_norm(x, n_groups, eps)`: ggml_group_norm: x ne=[W, H, C, N]; dim 2 is split into
  groups of ceil(C / n_groups) channels (the last group may be smaller, as in ggml); each
  group of each sample normalizes its W*H*channels values. No affine.
- `group_norm_affine(x, w, b, n_groups, eps, silu=False)`: the fused GroupNorm(+SiLU) of SD's
  UNet/VAE blocks: group_norm, then `* w[c] + b[c]` per channel (w, b have C elements:
  ne [C] or sd.cpp's [1, 1, C, 1]), then optionally SiLU. `group_norm_silu` is the silu=True form.

Every op keeps the input's dtype; statistics are accumulated in float64, as ggml's ggml_float.
"""
from __future__ import annotations

import numpy as np

from .cases import Case, In, floats
from .registry import defop, fail, make_node, require_float

__all__ = ["softmax", "layer_norm", "layer_norm_affine", "rms_norm", "l2_norm", "group_norm",
           "group_norm_affine", "group_norm_silu"]




def _ne4(ne):
    return tuple(ne) + (1,) * (4 - len(ne))


def _eps(op, srcs, p):
    eps = p["eps"]
    if not eps >= 0.0:  # also rejects NaN
        fail(op, srcs, f"eps must be >= 0, got {eps}")


# ---- softmax --------------------------------------------------------------------------------
def _softmax_infer(srcs, p):
    require_float("softmax", srcs)
    x = srcs[0]
    if len(srcs) == 2:
        m = srcs[1]
        xn, mn = _ne4(x.ne), _ne4(m.ne)
        if mn[0] != xn[0]:
            fail("softmax", srcs, f"mask ne[0]={mn[0]} must equal x ne[0]={xn[0]}")
        if mn[1] != 1 and mn[1] < xn[1]:
            fail("softmax", srcs, f"mask ne[1]={mn[1]} must be 1 or >= x ne[1]={xn[1]}")
        for d in (2, 3):
            if xn[d] % mn[d]:
                fail("softmax", srcs, f"mask ne[{d}]={mn[d]} must divide x ne[{d}]={xn[d]}")
    return x.ne, x.dtype


def mask_rows(mask: np.ndarray, shape4) -> np.ndarray:
    """The (broadcast) mask rows that meet x of numpy shape4 (n3, n2, n1, n0)."""
    n3, n2, n1 = shape4[:3]
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    m = m[:, :, :n1] if m.shape[2] != 1 else m
    return np.tile(m, (n3 // m.shape[0], n2 // m.shape[1], 1, 1))


def _softmax_ref(node, xs):
    x = xs[0].astype(np.float64)
    shape4 = (1,) * (4 - x.ndim) + x.shape
    w = x.reshape(shape4) * node.params["scale"]
    if len(xs) == 2:
        w = w + mask_rows(xs[1].astype(np.float64), shape4)
    mx = w.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(w - mx)
        return (e / e.sum(axis=-1, keepdims=True)).reshape(x.shape)


def _softmax_cases():
    m = dict(lo=-2.0, hi=0.0)
    return floats(lambda t: Case((In((37, 5, 3), t, lo=-3, hi=3),), {"scale": 1.0})) + [
        Case((In((19, 6, 2)), In((19, 6), **m)), {"scale": 0.5}),
        Case((In((19, 6, 2)), In((19, 8, 2), "F16", **m)), {"scale": 0.5}, label="mask-padded"),
        Case((In((19, 6, 4)), In((19, 1, 2), "BF16", **m)), {"scale": 2.0}, label="mask-row"),
        Case((In((19, 6, 2), view="s"),), {"scale": 1.0}), Case((In((700, 3), lo=-5, hi=5),), {"scale": 1.0})]


defop("softmax", _softmax_infer, _softmax_ref, "ggml_soft_max_ext: softmax(x*scale + mask) over dim 0",
      cases=_softmax_cases)


def softmax(x, mask=None, scale: float = 1.0):
    """softmax over ne[0] of x*scale + mask (ggml_soft_max_ext, max_bias 0)."""
    srcs = (x,) if mask is None else (x, mask)
    return make_node("softmax", srcs, scale=float(scale))


# ---- row norms ------------------------------------------------------------------------------
def _row_infer(op):
    def infer(srcs, p):
        require_float(op, srcs)
        _eps(op, srcs, p)
        x = srcs[0]
        if op == "layer_norm_affine":
            k = 1
            for flag in ("has_w", "has_b"):
                if p[flag]:
                    t = srcs[k]
                    k += 1
                    if t.nelements != x.ne[0] or t.ne[0] != x.ne[0]:
                        fail(op, srcs, f"weight/bias must have ne=[{x.ne[0]}] (x ne[0]), got {list(t.ne)}")
        return x.ne, x.dtype
    return infer


def _layer_norm_np(x, eps):
    x = x.astype(np.float64)
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)


def _layer_norm_affine_ref(node, xs):
    p = node.params
    y = _layer_norm_np(xs[0], p["eps"])
    k = 1
    if p["has_w"]:
        y = y * xs[k].reshape(-1)
        k += 1
    if p["has_b"]:
        y = y + xs[k].reshape(-1)
    return y


def _rms_norm_ref(node, xs):
    x = xs[0].astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + node.params["eps"])


def _l2_norm_ref(node, xs):
    x = xs[0].astype(np.float64)
    return x / np.maximum(np.sqrt((x * x).sum(axis=-1, keepdims=True)), node.params["eps"])


def _row_cases(eps):
    return lambda: floats(lambda t: Case((In((65, 4, 3), t, lo=-2, hi=3),), {"eps": eps})) + [
        Case((In((9, 7), view="t"),), {"eps": eps}), Case((In((1030, 3), view="s"),), {"eps": eps})]


def _layer_norm_affine_cases():
    x = In((65, 4, 3), lo=-2, hi=3)
    return [Case((x, In((65,)), In((65,))), {"eps": 1e-5, "has_w": True, "has_b": True}),
            Case((x, In((65,))), {"eps": 1e-5, "has_w": True, "has_b": False}),
            Case((x, In((65,))), {"eps": 1e-5, "has_w": False, "has_b": True})] + floats(
        lambda t: Case((In((40, 6), t), In((40,), t), In((40,), t)), {"eps": 1e-6, "has_w": True, "has_b": True}))


defop("layer_norm", _row_infer("layer_norm"), lambda node, xs: _layer_norm_np(xs[0], node.params["eps"]),
      "ggml_norm: (x - mean) / sqrt(var + eps) over dim 0", cases=_row_cases(1e-5))
defop("layer_norm_affine", _row_infer("layer_norm_affine"), _layer_norm_affine_ref,
      "ggml_norm then * w + b (w, b ne=[ne0], each optional)", cases=_layer_norm_affine_cases)
defop("rms_norm", _row_infer("rms_norm"), _rms_norm_ref, "ggml_rms_norm: x / sqrt(mean(x^2) + eps)",
      cases=_row_cases(1e-6))
defop("l2_norm", _row_infer("l2_norm"), _l2_norm_ref, "ggml_l2_norm: x / max(||x||, eps)", cases=_row_cases(1e-12))


def layer_norm(x, eps: float = 1e-5):
    return make_node("layer_norm", (x,), eps=float(eps))


def layer_norm_affine(x, w=None, b=None, eps: float = 1e-5):
    """layer_norm(x) * w + b in one kernel (sd.cpp's ggml_ext_layer_norm); w/b may be None."""
    srcs = (x,) + tuple(t for t in (w, b) if t is not None)
    return make_node("layer_norm_affine", srcs, eps=float(eps), has_w=w is not None, has_b=b is not None)


def rms_norm(x, eps: float = 1e-6):
    return make_node("rms_norm", (x,), eps=float(eps))


def l2_norm(x, eps: float = 1e-12):
    return make_node("l2_norm", (x,), eps=float(eps))


# ---- group norm -----------------------------------------------------------------------------
def group_bounds(C: int, n_groups: int):
    """[(c0, c1)] channel ranges of ggml_group_norm's groups (ceil split, last may be short)."""
    per = (C + n_groups - 1) // n_groups
    return [(g * per, min(C, (g + 1) * per)) for g in range(n_groups) if g * per < C]


def _group_infer(op):
    def infer(srcs, p):
        require_float(op, srcs)
        _eps(op, srcs, p)
        x = srcs[0]
        G = p["n_groups"]
        C = _ne4(x.ne)[2]
        if G < 1:
            fail(op, srcs, f"n_groups must be >= 1, got {G}")
        if G > C:
            fail(op, srcs, f"n_groups={G} is more than the {C} channels of dim 2")
        if op == "group_norm_affine":
            for t in srcs[1:]:
                tn = _ne4(t.ne)
                if t.nelements != C or tn[2] != C and tn[0] != C:
                    fail(op, srcs, f"weight/bias must hold the {C} channels (ne [{C}] or [1, 1, {C}, 1]), got {list(t.ne)}")
        return x.ne, x.dtype
    return infer


def _group_norm_np(x, G, eps):
    x = x.astype(np.float64)
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    out = np.empty_like(x4)
    for c0, c1 in group_bounds(x4.shape[1], G):
        g = x4[:, c0:c1]
        c = g - g.mean(axis=(1, 2, 3), keepdims=True)
        out[:, c0:c1] = c / np.sqrt((c * c).mean(axis=(1, 2, 3), keepdims=True) + eps)
    return out.reshape(x.shape)


def _group_norm_affine_ref(node, xs):
    p = node.params
    y = _group_norm_np(xs[0], p["n_groups"], p["eps"])
    y4 = y.reshape((1,) * (4 - y.ndim) + y.shape)
    C = y4.shape[1]
    y4 = y4 * xs[1].reshape(1, C, 1, 1) + xs[2].reshape(1, C, 1, 1)
    if p["silu"]:
        y4 = y4 / (1 + np.exp(-y4))
    return y4.reshape(y.shape)


def _group_norm_cases():
    return floats(lambda t: Case((In((5, 4, 8, 2), t, lo=-2, hi=3),), {"n_groups": 4, "eps": 1e-6})) + [
        Case((In((5, 4, 6, 2)),), {"n_groups": 4, "eps": 1e-6}, label="uneven-groups"),
        Case((In((5, 4, 8, 2), view="s"),), {"n_groups": 2, "eps": 1e-5})]


def _group_norm_affine_cases():
    return [Case((In((5, 4, 8, 2), t), In((8,), t), In((8,), t)), {"n_groups": 4, "eps": 1e-6, "silu": silu})
            for t in ("F32", "F16", "BF16") for silu in (False, True)] + [
        Case((In((7, 3, 6)), In((1, 1, 6, 1)), In((1, 1, 6, 1))), {"n_groups": 3, "eps": 1e-5, "silu": True},
             label="sdcpp-weights")]


defop("group_norm", _group_infer("group_norm"),
      lambda node, xs: _group_norm_np(xs[0], node.params["n_groups"], node.params["eps"]),
      "ggml_group_norm over groups of dim 2 (each normalizes W*H*C/G values)", cases=_group_norm_cases)
defop("group_norm_affine", _group_infer("group_norm_affine"), _group_norm_affine_ref,
      "group_norm then * w[c] + b[c], optionally SiLU (fused)", cases=_group_norm_affine_cases)


def group_norm(x, n_groups: int = 32, eps: float = 1e-6):
    return make_node("group_norm", (x,), n_groups=int(n_groups), eps=float(eps))


def group_norm_affine(x, w, b, n_groups: int = 32, eps: float = 1e-6, silu: bool = False):
    """group_norm(x) * w + b (+ SiLU) in one pass: sd.cpp's ggml_ext_group_norm [+ silu]."""
    return make_node("group_norm_affine", (x, w, b), n_groups=int(n_groups), eps=float(eps), silu=bool(silu))


def group_norm_silu(x, w, b, n_groups: int = 32, eps: float = 1e-6):
    """SiLU(group_norm(x) * w + b): the norm+activation pair of every SD ResBlock."""
    return group_norm_affine(x, w, b, n_groups, eps, silu=True)
