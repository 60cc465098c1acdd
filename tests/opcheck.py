"""Harness shared by the op tests: build a node from numpy inputs, run it on the CPU backend,
and compare with an independent numpy expectation and with the op's reference backend."""
from __future__ import annotations

import numpy as np

from sdrt.ops.convert import f32_to_raw, raw_to_f32
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

TOL = {"F32": (1e-5, 1e-5), "F16": (2e-3, 2e-3), "BF16": (1.6e-2, 1.6e-2)}


def leaf(x: np.ndarray, dtype="F32", noncontig=False) -> Tensor:
    """A leaf tensor holding float32 `x` stored as `dtype`; noncontig stores it transposed
    and returns a view with the same logical values but non-contiguous strides."""
    x = np.asarray(x, np.float32)
    if noncontig and x.ndim >= 2:
        stored = np.ascontiguousarray(np.swapaxes(x, -1, -2))
        t = Tensor.from_numpy(f32_to_raw(stored, dtype), dtype=dtype)
        return t.transpose()
    return Tensor.from_numpy(f32_to_raw(x, dtype), dtype=dtype)


def values(t: Tensor) -> np.ndarray:
    """What a leaf holds, as float32 (the input the op really sees after rounding)."""
    return raw_to_f32(t.numpy(), t.dtype)


def run(node: Tensor, backend="cpu") -> np.ndarray:
    out = Graph(node).run(backend)["out"]
    return raw_to_f32(out.numpy(), out.dtype)


def check(node: Tensor, expected: np.ndarray, dtype="F32", rtol=None, atol=None, vs_reference=True):
    r, a = TOL.get(dtype, TOL["F32"])
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    got = run(node)
    assert got.shape == tuple(np.shape(expected)), (got.shape, np.shape(expected))
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"{node.op} cpu vs numpy")
    if vs_reference:
        ref = run(node, "reference")
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol, err_msg=f"{node.op} cpu vs reference")
    return got
