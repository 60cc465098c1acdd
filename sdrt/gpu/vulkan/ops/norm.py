"""Vulkan kernels for softmax and the norms (shaders/norm.comp; CPU: sdrt/ops/cpu/norm.py):
softmax with scale and a broadcast mask, layer_norm(_affine), rms_norm, l2_norm and
group_norm(_affine, with the fused SiLU). Inputs read through their strides, any F32/F16/BF16 mix;
the output is contiguous. One workgroup per row (per group and batch for group norms)."""
from __future__ import annotations

from ....ops import norm as _defs  # noqa: F401  (defines the ops registered below)
from ....ops.norm import group_bounds
from ..table import VULKAN
from .elementwise import DTYPE, groups_for

SHADER = "norm"
OPS = {"softmax": 0, "layer_norm": 1, "layer_norm_affine": 1, "rms_norm": 2, "l2_norm": 3,
       "group_norm": 4, "group_norm_affine": 4}


def _floats(node) -> bool:
    return all(s.dtype.name in DTYPE for s in node.src) and node.dtype.name in DTYPE


def _run(rec, node, x, out, one=None, two=None, flags=0, mask_st=(0, 0, 0, 0), mask_ne=(1, 1),
         w_st=0, b_st=0, per=0, groups=0, items=None, f0=0.0):
    offs = rec.bind([x, one, two, out])
    t = (DTYPE[x.dtype.name], DTYPE[one.dtype.name] if one is not None else 0,
         DTYPE[two.dtype.name] if two is not None else 0, DTYPE[out.dtype.name])
    rec.dispatch(SHADER, (*t, OPS[node.op]), groups_for(items, 1),
                 u=[*x.ne, offs[0], offs[1], offs[2], offs[3], *x.strides(), *mask_st, *mask_ne, w_st, b_st,
                    flags, per, groups, items], f=[f0])


@VULKAN.register("softmax", supports=_floats)
def _softmax(node, xs, out, rec):
    x = xs[0]
    if len(xs) == 2:
        m = xs[1]
        st = m.strides()
        mask_st = (st[0], st[1] if m.ne[1] != 1 else 0, st[2], st[3])
        _run(rec, node, x, out, m, flags=8, mask_st=mask_st, mask_ne=(m.ne[2], m.ne[3]), items=x.nrows,
             f0=node.params["scale"])
    else:
        _run(rec, node, x, out, items=x.nrows, f0=node.params["scale"])


def _vector_stride(t) -> int:
    """Element stride along the one dim of a weight/bias vector that holds its values."""
    for k in range(4):
        if t.ne[k] != 1:
            return t.strides()[k]
    return 1


@VULKAN.register("layer_norm", supports=_floats)
@VULKAN.register("rms_norm", supports=_floats)
@VULKAN.register("l2_norm", supports=_floats)
@VULKAN.register("layer_norm_affine", supports=_floats)
def _row_norm(node, xs, out, rec):
    x, rest = xs[0], list(xs[1:])
    p = node.params
    w = rest.pop(0) if p.get("has_w") else None
    b = rest.pop(0) if p.get("has_b") else None
    flags = (1 if w is not None else 0) | (2 if b is not None else 0)
    _run(rec, node, x, out, w, b, flags=flags, w_st=_vector_stride(w) if w is not None else 0,
         b_st=_vector_stride(b) if b is not None else 0, items=x.nrows, f0=p["eps"])


@VULKAN.register("group_norm", supports=_floats)
@VULKAN.register("group_norm_affine", supports=_floats)
def _group_norm(node, xs, out, rec):
    x = xs[0]
    p = node.params
    bounds = group_bounds(x.ne[2], p["n_groups"])
    per = bounds[0][1] - bounds[0][0]
    G = len(bounds)
    if node.op == "group_norm_affine":
        w, b = xs[1], xs[2]
        _run(rec, node, x, out, w, b, flags=3 | (4 if p["silu"] else 0), w_st=_vector_stride(w),
             b_st=_vector_stride(b), per=per, groups=G, items=G * x.ne[3], f0=p["eps"])
    else:
        _run(rec, node, x, out, per=per, groups=G, items=G * x.ne[3], f0=p["eps"])
