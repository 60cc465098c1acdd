"""Vulkan kernels for mul_mat (shaders/matmul.comp; CPU: sdrt/ops/cpu/matmul.py): a tiled
shared-memory GEMM over strided F32/F16/BF16 weights and activations, F32 accumulation and
result, ggml's batch broadcast (w batch i2 // (x ne2 / w ne2)). Declined (CPU): F8 and block
(quantized) weights — dequantizing inside the GEMM is the next step (issue 19)."""
from __future__ import annotations

from ....ops import matmul as _defs  # noqa: F401  (defines the ops registered below)
from ..table import VULKAN
from .elementwise import DTYPE

SHADER = "matmul"
TILE = 64


def _floats(node) -> bool:
    return all(s.dtype.name in DTYPE for s in node.src)


@VULKAN.register("mul_mat", supports=_floats)
def _mul_mat(node, xs, out, rec):
    w, x = xs
    N, M, K = w.ne[1], x.ne[1], x.ne[0]
    offs = rec.bind([w, x, None, out])
    rec.dispatch(SHADER, (DTYPE[w.dtype.name], DTYPE[x.dtype.name], 0, DTYPE[out.dtype.name]),
                 (-(-N // TILE), -(-M // TILE), x.ne[2] * x.ne[3]),
                 u=[N, M, K, x.ne[2], x.ne[2] // w.ne[2], x.ne[3] // w.ne[3], offs[0], offs[1], offs[3],
                    *w.strides(), *x.strides()])
