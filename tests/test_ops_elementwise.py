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


# ---- geglu ------------------------------------------------------------------------------------
GELU_REF = {"none": lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2))),
            "tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))}


def _geglu_inputs(rng, dtype):
    """(name, tensor) pairs: contiguous inputs of several shapes and views of every kind the
    kernel distinguishes (unit-stride rows with a row stride, non-unit inner stride, permuted)."""
    def x(*shape):
        return (3 * rng.standard_normal(shape)).astype(np.float32)
    big = leaf(x(3, 4, 5, 20), dtype)
    yield "4d", leaf(x(2, 3, 5, 14), dtype)
    yield "2d", leaf(x(7, 64), dtype)
    yield "1d", leaf(x(6), dtype)
    yield "h=1", leaf(x(3, 2), dtype)
    yield "wide", leaf(x(3, 2 * 1280), dtype)
    yield "transposed", leaf(x(3, 5, 8), dtype, noncontig=True)         # inner stride != 1 element
    yield "permuted", leaf(x(4, 6, 5), dtype).permute(2, 0, 1)           # ne[0] comes from dim 1
    yield "sliced dim0", big.slice(0, 3, 15)                             # rows 20 apart, 12 read
    yield "sliced dim1 step 2", big.slice(1, 1, 5, 2)
    yield "sliced dims 2, 3", big.slice(2, 1, 3).slice(3, 1)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_geglu(rng, dtype, approximate):
    """x[:h] * gelu(x[h:]) over ne[0] = 2h, against float64 numpy (and the op's reference)."""
    for name, t in _geglu_inputs(rng, dtype):
        v = values(t).astype(np.float64)
        h = v.shape[-1] // 2
        node = F.geglu(t, approximate)
        assert node.ne == (t.ne[0] // 2,) + t.ne[1:] and node.dtype == t.dtype, name
        check(node, v[..., :h] * GELU_REF[approximate](v[..., h:]), dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_geglu_bit_identical_to_unfused(rng, dtype, approximate):
    """The fused op gives the slice/gelu/mul graph's values bit for bit: for F32 the same float32
    gelu kernels' code and one float32 product; for F16/BF16 gelu(gate) rounded to the dtype
    (as the unfused gelu node stores it), the float32 product, rounded once more on store."""
    from opcheck import run
    for name, t in _geglu_inputs(rng, dtype):
        h = t.ne[0] // 2
        want = run(F.mul(t.slice(0, 0, h), F.gelu(t.slice(0, h), approximate)))
        got = run(F.geglu(t, approximate))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, np.abs(got - want).max())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_geglu_special_values(dtype, approximate):
    """inf / NaN / signed zeros / large values / F16 subnormals in either half, every pair: the
    unfused graph's values bit for bit, NaN where it has NaN (e.g. 0 * gelu_tanh(-inf)) and F16
    products past 65504 stored as inf."""
    from opcheck import run
    s = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 100.0, -100.0, -5.0, 1e-30, 3e-5, 6e4, -6e4], np.float32)
    a, g = np.meshgrid(s, s)
    t = leaf(np.concatenate([a.reshape(-1, 1), g.reshape(-1, 1)], axis=1).reshape(len(s), len(s), 2), dtype)
    with np.errstate(all="ignore"):
        want = run(F.mul(t.slice(0, 0, 1), F.gelu(t.slice(0, 1), approximate)))
        got = run(F.geglu(t, approximate))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_geglu_half_rounds_gelu_before_the_product(rng, dtype):
    """What the F16/BF16 bit identity means: round(a * round(gelu(gate))), float32 product, round
    to the dtype (F16: numpy's astype, BF16: f32_to_raw's nearest even); it differs from the
    one-rounding round(a * gelu(gate)) often enough to tell them apart."""
    from sdrt.ops.graph import compute
    from sdrt.ops.convert import f32_to_raw, raw_to_f32
    t = leaf(rng.uniform(-3, 3, (512, 2)).astype(np.float32), dtype)
    a, g = (values(t)[:, i].astype(np.float64) for i in (0, 1))
    rnd = lambda v: raw_to_f32(f32_to_raw(np.float32(v), dtype), dtype)  # noqa: E731
    gelu = rnd(GELU_REF["none"](g)).astype(np.float32)
    got = compute(F.geglu(t, "none"))[:, 0]
    assert np.array_equal(got, rnd(np.float32(a) * gelu))
    assert (got != rnd(a * GELU_REF["none"](g))).sum() > 5


def test_geglu_errors_name_the_op():
    with pytest.raises(OpError, match=r"geglu\(F32\[5, 3\]\): ne\[0\]=5 must be even"):
        F.geglu(leaf(np.zeros((3, 5))))
    with pytest.raises(OpError, match=r"geglu\(F32\[4\]\): approximate must be 'tanh' or 'none', got 'erf'"):
        F.geglu(leaf(np.zeros(4)), approximate="erf")
    from sdrt.ops.tensor import Tensor
    with pytest.raises(OpError, match=r"geglu\(I32\[4\]\): needs F32/F16/BF16"):
        F.geglu(Tensor.from_numpy(np.zeros(4, np.int32)))
