"""Vulkan kernels for mul_mat (shaders/matmul.comp; CPU: sdrt/ops/cpu/matmul.py): a tiled
shared-memory GEMM over strided F32/F16/BF16 weights and activations, F32 accumulation and
result, ggml's batch broadcast (w batch i2 // (x ne2 / w ne2)). Q8_0 weights are used in place,
dequantized in the tile loader. Declined (CPU): F8 and the other block types (issue 19)."""
from __future__ import annotations

from ....ops import matmul as _defs  # noqa: F401  (defines the ops registered below)
from ..table import VULKAN
from .elementwise import DTYPE

SHADER = "matmul"
TILE = 64


def _supported(node) -> bool:
    w, x = node.src
    if x.dtype.name not in DTYPE:
        return False
    if w.dtype.name == "Q8_0":      # whole rows at 16-bit alignment (a block is 34 bytes)
        return (w.nb[0] == w.dtype.type_size and all(s % 2 == 0 for s in w.nb[1:])
                and (w.offset - w.owner.offset) % 2 == 0)
    return w.dtype.name in DTYPE


@VULKAN.register("mul_mat", supports=_supported)
def _mul_mat(node, xs, out, rec):
    w, x = xs
    N, M, K = w.ne[1], x.ne[1], x.ne[0]
    q8 = w.dtype.name == "Q8_0"
    offs = rec.bind([w, x, None, out], units=[2] if q8 else None)
    w_st = [0] + [s // 2 for s in w.nb[1:]] if q8 else w.strides()
    rec.dispatch(SHADER, (0 if q8 else DTYPE[w.dtype.name], DTYPE[x.dtype.name], 0, DTYPE[out.dtype.name], 0, int(q8)),
                 (-(-N // TILE), -(-M // TILE), x.ne[2] * x.ne[3]),
                 u=[N, M, K, x.ne[2], x.ne[2] // w.ne[2], x.ne[3] // w.ne[3], offs[0], offs[1], offs[3],
                    *w_st, *x.strides()])
