"""Shared helpers for CPU kernels: 4-D views and float widening/narrowing."""
from __future__ import annotations

import numpy as np

from ..convert import f32_to_raw, raw_to_f32


def as4d(x: np.ndarray) -> np.ndarray:
    """View with leading unit dims so every kernel sees (ne3, ne2, ne1, ne0)."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def f32_input(t, x: np.ndarray) -> np.ndarray:
    """float32 values of input `x` of tensor `t`: the view itself when already F32."""
    return x if t.dtype.name == "F32" else raw_to_f32(x, t.dtype)


def store(node, out: np.ndarray, values: np.ndarray) -> None:
    """Write float32 `values` into `out` in the node's dtype."""
    if node.dtype.name == "F32":
        if values is not out:
            out[...] = values
    else:
        out[...] = f32_to_raw(values, node.dtype).reshape(out.shape)


def f32_output(node, out: np.ndarray) -> np.ndarray:
    """A float32 array to compute into: `out` itself for F32 nodes, a scratch array otherwise."""
    return out if node.dtype.name == "F32" else np.empty(out.shape, np.float32)


def is_f32(*names):
    return lambda node: all(s.dtype.name in names for s in node.src)
