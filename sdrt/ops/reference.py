"""The reference backend's kernel table: every op through its plain-numpy definition (slow;
the living definition the other backends are checked against, see graph.check_graph and
tests/test_backend_ops.py)."""
from __future__ import annotations

import numpy as np

from .convert import f32_to_raw, raw_to_f32
from .registry import OPS, Kernel


def _widen(t, x: np.ndarray) -> np.ndarray:
    if t.dtype.is_float or t.dtype.is_quantized:
        return raw_to_f32(x, t.dtype)
    return x


def run_reference(node, xs, out):
    """Kernel function: the op's numpy reference on `xs`, narrowed into `out` (node's dtype).
    A copy of block-type data into its own type (cont, cast) copies the blocks: quantizing the
    dequantized values need not give the same blocks back."""
    if node.op in ("cont", "cast") and node.dtype.is_quantized and node.src[0].dtype == node.dtype:
        out[...] = xs[0]
        return
    vals = [_widen(s, x) for s, x in zip(node.src, xs)]
    r = np.asarray(OPS[node.op].reference(node, vals))
    if r.shape != out.shape[: r.ndim] and r.size == int(np.prod(node.ne)):
        r = r.reshape(node.shape)
    if node.dtype.is_float or node.dtype.is_quantized:
        out[...] = f32_to_raw(np.asarray(r, np.float32).reshape(node.shape), node.dtype).reshape(out.shape)
    else:
        out[...] = r.reshape(out.shape)


class ReferenceTable:
    """A kernel table with the reference kernel for every registered op."""

    backend = name = "reference"

    def find(self, node):
        return Kernel(node.op, run_reference, None) if node.op in OPS else None

    def ops(self) -> list[str]:
        return sorted(OPS)


REFERENCE = ReferenceTable()
