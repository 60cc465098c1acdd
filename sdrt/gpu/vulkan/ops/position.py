"""Vulkan kernels for rope and rope_ext (shaders/position.comp; CPU: sdrt/ops/cpu/position.py,
CUDA: sdrt/gpu/cuda/ops/position.py). arange and timestep_embedding are in elementwise.py.

x may be any F32/F16/BF16 view (read through its strides); the output is the node's contiguous
buffer. rope_ext's float32 scalars (theta scale, YaRN's corr dims, attention factor) come from
the CUDA backend's `rope_scalars`, computed in numpy float32 as the CPU's table is, and each
invocation replays the CPU's running product for its pair (no scratch table).
"""
from __future__ import annotations

from ....ops import position as _defs  # noqa: F401  (defines the ops registered below)
from ....ops.position import ROPE_MODES, _corr_dims
from ..table import VULKAN
from .elementwise import DTYPE, groups_for

SHADER = "position"


def rope_scalars(p: dict) -> tuple[float, float, float, float]:
    """(theta_scale, low, high, mscale) in float32, exactly as position.rope_cache computes them."""
    import numpy as np
    f = np.float32
    ts = np.power(f(p["freq_base"]), f(-2.0) / f(p["n_dims"]))
    low, high = _corr_dims(p["n_dims"], p["n_ctx_orig"], p["freq_base"], p["beta_fast"], p["beta_slow"])
    fs, ext, attn = f(p["freq_scale"]), f(p["ext_factor"]), f(p["attn_factor"])
    mscale = attn * (f(1) + f(0.1) * np.log(f(1) / fs)) if ext != 0 else attn
    return float(ts), float(low), float(high), float(f(mscale))


def _rope_ok(node) -> bool:
    return node.src[0].dtype.name in DTYPE and node.src[1].dtype.name == "F32"


@VULKAN.register("rope", supports=_rope_ok)
def _rope(node, xs, out, rec):
    x, pe = xs
    offs = rec.bind([x, pe, None, out])
    n = out.nelements
    rec.dispatch(SHADER, (DTYPE[x.dtype.name], 0, 0, DTYPE[out.dtype.name], 0), groups_for(n),
                 u=[*x.ne, *x.strides(), *pe.strides(), pe.ne[2], int(node.params["interleaved"]),
                    offs[0], offs[1], offs[3], n])


def _rope_ext_ok(node) -> bool:
    s = node.src
    return (s[0].dtype.name in DTYPE and s[1].dtype.name == "I32"
            and (len(s) < 3 or s[2].dtype.name == "F32"))


@VULKAN.register("rope_ext", supports=_rope_ext_ok)
def _rope_ext(node, xs, out, rec):
    p = node.params
    x, pos = xs[0], xs[1]
    ff = xs[2] if len(xs) > 2 else None
    mode, n_dims = p["mode"], p["n_dims"]
    pairs = n_dims if mode == "vision" else n_dims // 2
    ts, low, high, mscale = rope_scalars(p)
    import numpy as np
    offs = rec.bind([x, pos, ff, out])
    kind = {"normal": 0, "vision": 2}.get(mode, 1)
    rec.dispatch(SHADER, (DTYPE[x.dtype.name], 0, 0, DTYPE[out.dtype.name], 1), groups_for(out.nelements),
                 u=[*x.ne, *x.strides(), pos.strides()[0], ff.strides()[0] if ff is not None else 0,
                    offs[0], offs[1], offs[2], offs[3], n_dims, p["n_offs"], kind, pairs, ROPE_MODES[mode],
                    int(ff is not None), *p["sections"]],
                 f=[ts, low, high, float(np.float32(p["freq_scale"])), float(np.float32(p["ext_factor"])), mscale])
