"""Helpers shared by the GPU tests: run a node's graph on a backend, check that CUDA has the
kernels, and compare CUDA's output with the CPU backend's.

The backend comes from the `cuda` fixture (tests/gpu/conftest.py), which skips without a GPU.
"""
import importlib

import numpy as np

from sdrt.ops import quant
from sdrt.ops.convert import f32_to_raw, raw_to_f32
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor


def randn(rng, *shape, scale=1.0, offset=0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


def raw_array(rng, shape, dtype, f8_codes=256) -> np.ndarray:
    """Random raw storage of `dtype`: floats from N(0, 1), ints in [-100, 100), F8 codes below
    f8_codes (0x7B: finite E4M3 and E5M2 values only)."""
    if dtype in ("I8", "I16", "I32", "I64"):
        return rng.integers(-100, 100, shape).astype(f"int{dtype[1:]}")
    if dtype.startswith("F8"):
        return rng.integers(0, f8_codes, shape).astype(np.uint8)
    if dtype == "F64":
        return rng.standard_normal(shape)
    return f32_to_raw(rng.standard_normal(shape).astype(np.float32), dtype)


def quant_tensor(name, rows, k, batch=(), seed=0) -> Tensor:
    """A block-type tensor [*batch, rows, k] (numpy order) of random valid blocks."""
    raw = quant.random_raw(name, int(np.prod(batch, dtype=int)) * rows, k, seed=seed)
    return Tensor.from_numpy(raw.reshape(tuple(batch) + (rows, raw.shape[-1])), dtype=name)


def run_raw(backend, node) -> np.ndarray:
    """The node's output as raw storage (numpy order), a copy."""
    out = Graph(node).run(backend)["out"]
    return np.array(out.numpy(), copy=True)


def run_f32(backend, node) -> np.ndarray:
    """The node's output as float32 (numpy order)."""
    out = Graph(node).run(backend)["out"]
    return raw_to_f32(np.array(out.numpy(), copy=True), out.dtype)


def assert_on_cuda(family, *nodes):
    """Each node has a CUDA kernel (no silent CPU fallback); sdrt.gpu.cuda.ops.<family> registers them."""
    importlib.import_module(f"sdrt.gpu.cuda.ops.{family}")
    from sdrt.gpu.cuda.table import CUDA
    for n in nodes:
        assert CUDA.find(n) is not None, f"no CUDA kernel for {n.op}({[s.dtype.name for s in n.src]})"


def assert_exact_vs_cpu(cuda, node, nan_payloads=True):
    """CUDA's raw output equals the CPU backend's bit for bit. nan_payloads=False: a float NaN
    only has to be a NaN where the CPU's is."""
    want, got = run_raw("cpu", node), run_raw(cuda, node)
    assert got.shape == want.shape and got.dtype == want.dtype
    if not nan_payloads and node.dtype.is_float:
        wf, gf = raw_to_f32(want, node.dtype), raw_to_f32(got, node.dtype)
        nan = np.isnan(wf)
        np.testing.assert_array_equal(np.isnan(gf), nan, err_msg=f"{node.op} NaN positions")
        want, got = want[~nan], got[~nan]
    np.testing.assert_array_equal(got.view(f"u{got.dtype.itemsize}"), want.view(f"u{want.dtype.itemsize}"),
                                  err_msg=f"{node.op} {node.params} cuda vs cpu")


def assert_close_vs_cpu(cuda, node, rtol, atol, equal_nan=False) -> np.ndarray:
    """CUDA's output within rtol/atol of the CPU backend's (numpy's assert_allclose, in float32);
    returns CUDA's."""
    want, got = run_f32("cpu", node), run_f32(cuda, node)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=equal_nan,
                               err_msg=f"{node.op} {node.params} cuda vs cpu")
    return got


def assert_within_scale(got, want, tol, what):
    """max |got - want| <= tol * max |want| (at least 1e-6): the error relative to the output's
    largest magnitude."""
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} * {scale:.3g}"
