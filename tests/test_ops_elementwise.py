import math

import numpy as np
import pytest
from scipy.special import erf

from opcheck import check, leaf, values
from sdrt import OpError
from sdrt.ops import api as F

FLOATS = ["F32", "F16", "BF16"]

UNARY = {
    "neg": (F.neg, lambda x: -x),
    "abs": (F.abs, np.abs),
    "sqr": (F.sqr, lambda x: x * x),
    "sqrt": (F.sqrt, np.sqrt),
    "exp": (F.exp, np.exp),
    "log": (F.log, np.log),
    "sin": (F.sin, np.sin),
    "cos": (F.cos, np.cos),
    "step": (F.step, lambda x: (x > 0).astype(np.float32)),
    "relu": (F.relu, lambda x: np.maximum(x, 0)),
    "silu": (F.silu, lambda x: x / (1 + np.exp(-x))),
    "sigmoid": (F.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "tanh": (F.tanh, np.tanh),
    "gelu": (F.gelu, lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2)))),
    "gelu_tanh": (lambda t: F.gelu(t, "tanh"),
                  lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))),
    "gelu_quick": (F.gelu_quick, lambda x: x / (1 + np.exp(-1.702 * x))),
    "leaky_relu": (lambda t: F.leaky_relu(t, 0.2), lambda x: np.where(x > 0, x, 0.2 * x)),
    "clamp": (lambda t: F.clamp(t, -0.5, 0.7), lambda x: np.clip(x, -0.5, 0.7)),
    "scale": (lambda t: F.scale(t, 1.5, 0.25), lambda x: x * 1.5 + 0.25),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("noncontig", [False, True])
def test_unary(rng, name, dtype, noncontig):
    build, ref = UNARY[name]
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    if name in ("sqrt", "log"):
        x = np.abs(x) + 0.1
    t = leaf(x, dtype, noncontig)
    expected = ref(values(t).astype(np.float64))
    check(build(t), expected, dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", [((4, 6, 9), (4, 6, 9)), ((4, 6, 9), (9,)), ((4, 6, 9), (6, 1)),
                                    ((2, 4, 6, 9), (4, 1, 9)), ((1, 6, 1), (3, 1, 5)), ((5, 3), (1,))])
def test_binary_broadcast(rng, op, dtype, shapes):
    a = rng.standard_normal(shapes[0]).astype(np.float32)
    b = rng.standard_normal(shapes[1]).astype(np.float32)
    if op == "div":
        b = np.sign(b) * (np.abs(b) + 0.5)
    ta, tb = leaf(a, dtype), leaf(b, "F32")
    f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[op]
    check(getattr(F, op)(ta, tb), f(values(ta), values(tb)), dtype)


def test_binary_noncontig(rng):
    a = rng.standard_normal((3, 8, 5)).astype(np.float32)
    b = rng.standard_normal((3, 8, 5)).astype(np.float32)
    ta, tb = leaf(a, noncontig=True), leaf(b)
    check(F.mul(ta, tb), a * b)


def test_binary_shape_mismatch_names_op():
    a, b = leaf(np.zeros((3, 4))), leaf(np.zeros((3, 5)))
    with pytest.raises(OpError, match=r"add\(F32\[4, 3\], F32\[5, 3\]\): cannot broadcast dim 0"):
        F.add(a, b)


def test_unsupported_dtype_names_op():
    from sdrt.ops.tensor import Tensor
    t = Tensor.from_numpy(np.zeros(4, np.int32))
    with pytest.raises(OpError, match="silu"):
        F.silu(t)


@pytest.mark.parametrize("src", FLOATS + ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("dst", FLOATS + ["F8_E4M3", "F8_E5M2"])
def test_cast_between_float_types(rng, src, dst):
    from sdrt.ops.convert import f32_to_raw, raw_to_f32
    x = rng.standard_normal((3, 64)).astype(np.float32)
    t = leaf(x, src)
    expected = raw_to_f32(f32_to_raw(values(t), dst), dst)
    check(F.cast(t, dst), expected, dst, rtol=0, atol=0)


def test_cont_of_view(rng):
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    t = leaf(x).permute(2, 0, 1)  # ggml permute: dim0->2, dim1->0, dim2->1
    got = check(F.cont(t), np.ascontiguousarray(t.numpy()), rtol=0, atol=0)
    assert got.flags.c_contiguous


def test_gelu_tanh_special_values():
    """The exp-based gelu_tanh keeps the tanh form's values at the edges."""
    from sdrt.ops.graph import compute
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 100.0, -100.0, -5.0, 1e-30], np.float32)
    got = compute(F.gelu(leaf(x), "tanh"))
    xd = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        want = 0.5 * xd * (1 + np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd**3)))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
