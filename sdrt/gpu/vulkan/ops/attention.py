"""Vulkan kernel for attention (shaders/attention.comp; CPU: sdrt/ops/cpu/attention.py): fused
softmax(q k^T * scale + mask) v with an online softmax, GQA and batch broadcast of k/v, a
broadcast mask; F32/F16/BF16 inputs read through their strides along dims 1-3 (dim 0 must be
contiguous), head sizes up to 512; F32 result. Anything else runs on the CPU."""
from __future__ import annotations

from ....ops import attention as _defs  # noqa: F401  (defines the op registered below)
from ..table import VULKAN
from .elementwise import DTYPE, groups_for

SHADER = "attention"
MAX_HEAD = 512


def _ok(node) -> bool:
    return (all(s.dtype.name in DTYPE and s.nb[0] == s.dtype.type_size for s in node.src)
            and node.src[0].ne[0] <= MAX_HEAD and node.src[2].ne[0] <= MAX_HEAD)


@VULKAN.register("attention", supports=_ok)
def _attention(node, xs, out, rec):
    q, k, v = xs[:3]
    mask = xs[3] if len(xs) > 3 else None
    D, Lq, H, N = q.ne
    Dv, Lk = v.ne[0], k.ne[1]
    offs = rec.bind([q, k, v, out, mask])
    qs, ks, vs = q.strides(), k.strides(), v.strides()
    if mask is not None:
        ms = mask.strides()
        m_st = (ms[1] if mask.ne[1] != 1 else 0, ms[2], ms[3])
        m_ne = mask.ne[2] | mask.ne[3] << 16
    else:
        m_st, m_ne = (0, 0, 0), 1 | 1 << 16
    spec = (DTYPE[q.dtype.name], DTYPE[k.dtype.name], DTYPE[v.dtype.name], DTYPE[out.dtype.name], 0,
            DTYPE[mask.dtype.name] if mask is not None else 0)
    rec.dispatch(SHADER, spec, groups_for(Lq * H * N, 1),
                 u=[D | Dv << 16, Lq, Lk, H, N, (H // k.ne[2]) | (N // k.ne[3]) << 16, *offs,
                    qs[1], qs[2], qs[3], ks[1], ks[2], ks[3], vs[1], vs[2], vs[3], *m_st, m_ne],
                 f=[node.params["scale"], 1.0 if mask is not None else 0.0])
