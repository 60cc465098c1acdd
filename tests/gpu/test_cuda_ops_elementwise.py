"""CUDA element-wise ops vs the CPU backend on the same graph (skips without a GPU).

Both backends compute in float32 from the same widened inputs and narrow with the same
rounding, so add/sub/mul, neg/abs/sqr/step/relu/clamp, casts and copies must be bit exact;
the transcendental ops (libm vs CUDA's expf/erff/tanhf...) and div (the CPU kernel may use a
reciprocal) agree within float32 rounding, F16/BF16 outputs within one rounding step. Inputs
include transposed, permuted and sliced views, broadcast operands on either side, views of
computed nodes, odd sizes and the SD UNet's shapes.
"""
import numpy as np
import pytest
from opcheck import leaf

from sdrt.ops import api as F
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

from ._helpers import (
    assert_close_vs_cpu,
    assert_exact_vs_cpu,
    assert_on_cuda,
    raw_array,
)

FLOATS = ["F32", "F16", "BF16"]
TOL = {"F32": (1e-5, 1e-6), "F16": (2e-3, 2e-5), "BF16": (1.6e-2, 1e-4)}  # (rtol, atol)


# ---- harness -------------------------------------------------------------------------------
# `cuda` (tests/gpu/conftest.py) is the cuda0 backend; it skips the test without a GPU.
def check_exact(cuda, node):
    """Bit-exact against the CPU backend (raw storage; NaNs only need to be NaN)."""
    assert_on_cuda("elementwise", *Graph(node).nodes)
    assert_exact_vs_cpu(cuda, node, nan_payloads=False)


def check_close(cuda, node, rtol=None, atol=None):
    assert_on_cuda("elementwise", *Graph(node).nodes)
    r, a = TOL[node.dtype.name]
    assert_close_vs_cpu(cuda, node, r if rtol is None else rtol, a if atol is None else atol, equal_nan=True)


def view_of(x: np.ndarray, dtype: str, layout: str) -> Tensor:
    """A leaf holding float32 x (numpy order) as `dtype`, laid out as asked: 'contig'; 'transposed'
    (stored with the last two axes swapped, a ggml transpose view); 'permuted' (stored as
    (a, c, b, d), a permute view); 'sliced' (every other row of a wider buffer, offset 1)."""
    if layout == "contig":
        return leaf(x, dtype)
    if layout == "transposed":
        return leaf(x, dtype, noncontig=True)
    if layout == "permuted":
        t = leaf(np.ascontiguousarray(np.swapaxes(x, 1, 2)), dtype)  # ne (d, b, c, a)
        return t.permute(0, 2, 1, 3)
    assert layout == "sliced"
    big = np.zeros(x.shape[:-2] + (2 * x.shape[-2] + 1, x.shape[-1] + 3), np.float32)
    big[..., 1::2, 2:2 + x.shape[-1]] = x
    t = leaf(big, dtype)
    return t.slice(1, 1, None, 2).slice(0, 2, 2 + x.shape[-1])


LAYOUTS = ["contig", "transposed", "permuted", "sliced"]


# ---- unary -------------------------------------------------------------------------------------
UNARY = {
    "neg": F.neg, "abs": F.abs, "sqr": F.sqr, "sqrt": F.sqrt, "exp": F.exp, "log": F.log, "sin": F.sin,
    "cos": F.cos, "step": F.step, "relu": F.relu, "silu": F.silu, "sigmoid": F.sigmoid, "tanh": F.tanh,
    "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, "tanh"), "gelu_quick": F.gelu_quick,
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2), "clamp": lambda t: F.clamp(t, -0.5, 0.7),
    "scale": lambda t: F.scale(t, 1.5, 0.25),
}
EXACT_UNARY = {"neg", "abs", "sqr", "step", "relu", "clamp"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(cuda, rng, name, dtype, layout):
    x = (rng.standard_normal((2, 3, 5, 7)) * 2).astype(np.float32)
    if name in ("sqrt", "log"):
        x = np.abs(x) + 0.1
    node = UNARY[name](view_of(x, dtype, layout))
    (check_exact if name in EXACT_UNARY else check_close)(cuda, node)


SPECIAL = np.array([0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0,
                    1e30, -1e30, np.inf, -np.inf, np.nan], np.float32)


@pytest.mark.parametrize("name", ["neg", "abs", "sqr", "exp", "step", "relu", "silu", "sigmoid", "tanh", "gelu",
                                  "gelu_tanh", "gelu_quick", "leaky_relu", "scale", "sin", "cos"])
def test_unary_special_values(cuda, name):
    # inf/NaN/huge/tiny inputs: same NaN positions and infinities as the CPU kernels
    node = UNARY[name](leaf(SPECIAL))
    # atol: where the exact result underflows, the CPU's clamped exp leaves ~1e-9 (gelu_tanh(-1e30))
    check_close(cuda, node, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 31, 257, 100_003])
def test_unary_odd_sizes(cuda, rng, n):
    x = rng.standard_normal(n).astype(np.float32)
    check_close(cuda, F.gelu(leaf(x), "tanh"))
    check_exact(cuda, F.relu(leaf(x, "F16")))


# ---- binary ------------------------------------------------------------------------------------
BINARY_SHAPES = [((4, 6, 9), (4, 6, 9)), ((4, 6, 9), (9,)), ((4, 6, 9), (6, 1)), ((2, 4, 6, 9), (4, 1, 9)),
                 ((1, 6, 1), (3, 1, 5)), ((5, 3), (1,)), ((2, 1, 5, 1), (1, 3, 1, 4)), ((7,), (7,))]


def _binary_inputs(rng, op, sa, sb):
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    if op == "div":
        b = np.sign(b) * (np.abs(b) + 0.5)
    return a, b


@pytest.mark.parametrize("shapes", BINARY_SHAPES)
@pytest.mark.parametrize("db", FLOATS)
@pytest.mark.parametrize("da", FLOATS)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcast(cuda, rng, op, da, db, shapes):
    a, b = _binary_inputs(rng, op, *shapes)
    node = getattr(F, op)(leaf(a, da), leaf(b, db))
    (check_close if op == "div" else check_exact)(cuda, node)


@pytest.mark.parametrize("lb", LAYOUTS)
@pytest.mark.parametrize("la", LAYOUTS)
@pytest.mark.parametrize("op", ["add", "mul", "div"])
def test_binary_views(cuda, rng, op, la, lb):
    a, b = _binary_inputs(rng, op, (2, 3, 5, 7), (2, 3, 5, 7))
    node = getattr(F, op)(view_of(a, "F32", la), view_of(b, "F16", lb))
    (check_close if op == "div" else check_exact)(cuda, node)


def test_binary_broadcast_views(cuda, rng):
    # a transposed operand against a broadcast column of a sliced one, and a view of a computed node
    a = view_of(rng.standard_normal((3, 8, 5)).astype(np.float32), "F32", "transposed")
    col = leaf(rng.standard_normal((8, 2)).astype(np.float32)).slice(0, 1, 2)  # ne [1, 8], stride 8 bytes
    s = F.mul(a, col)
    check_exact(cuda, s)
    check_exact(cuda, F.sub(s.permute(1, 0, 2), leaf(rng.standard_normal((3, 1, 8)).astype(np.float32))))


def test_binary_sd_shapes(cuda, rng):
    # bias add over a conv output, a time embedding per channel, GEGLU's half-row views
    x = leaf(rng.standard_normal((2, 320, 64, 64)).astype(np.float32))
    check_exact(cuda, F.add(x, leaf(rng.standard_normal((1, 320, 1, 1)).astype(np.float32))))
    check_exact(cuda, F.add(x, leaf(rng.standard_normal((2, 320, 1, 1)).astype(np.float32))))
    h = leaf(rng.standard_normal((2, 1024, 2560)).astype(np.float32))
    gate = h.slice(0, 1280, 2560)
    check_exact(cuda, F.mul(h.slice(0, 0, 1280), gate))
    check_close(cuda, F.gelu(gate, "tanh"))
    check_exact(cuda, F.add(leaf(rng.standard_normal((2, 4096, 320)).astype(np.float32), "F16"),
                           leaf(rng.standard_normal(320).astype(np.float32))))


# the row walk (merged first dim >= elementwise.ROW_MIN: blockIdx.y over rows, ILP elements a
# thread): rows not a multiple of the block's span, more rows than a grid's y extent, 4-D splits
ROW_SHAPES = [(3, 1000), (2, 5, 257), (70000, 256), (2, 3, 4, 1031)]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_row_walk(cuda, rng, shape):
    a = rng.standard_normal(shape).astype(np.float32)
    bias = rng.standard_normal(shape[-1]).astype(np.float32)
    col = rng.standard_normal(shape[:-1] + (1,)).astype(np.float32)
    check_exact(cuda, F.add(leaf(a), leaf(bias, "F16")))
    check_exact(cuda, F.mul(leaf(a, "F16"), leaf(col)))
    check_exact(cuda, F.sub(leaf(a, "BF16"), leaf(a)))
    wide = leaf(np.concatenate([a, a], axis=-1))
    half = wide.slice(0, shape[-1], 2 * shape[-1])  # a half-row view: rows 2*ne0 apart
    check_close(cuda, F.gelu(half, "tanh"))
    check_exact(cuda, F.cast(half, "F16"))
    check_exact(cuda, F.cont(half))


# ---- geglu ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_geglu(cuda, rng, approximate, dtype, layout):
    check_close(cuda, F.geglu(view_of(rng.standard_normal((2, 3, 5, 14)).astype(np.float32), dtype, layout),
                              approximate=approximate))


def test_geglu_sd_shape(cuda, rng):
    # the UNet's feed-forward: [2*1280, 1024, 2] after the projection, and a half-row slice of it
    h = leaf(rng.standard_normal((2, 1024, 2560)).astype(np.float32))
    check_close(cuda, F.geglu(h, approximate="tanh"))
    check_close(cuda, F.geglu(h.slice(0, 0, 1280), approximate="none"))
    check_close(cuda, F.geglu(leaf(rng.standard_normal((2, 77, 2560)).astype(np.float32), "F16"), "tanh"))


# ---- casts and copies --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("src", FLOATS)
def test_cast_floats(cuda, rng, src, dst, layout):
    x = (rng.standard_normal((3, 4, 6, 5)) * 10).astype(np.float32)
    x.flat[:4] = [np.inf, -np.inf, 65504.0, 1e-8]  # F16's max, a BF16/F16 subnormal
    check_exact(cuda, F.cast(view_of(x, src, layout), dst))


@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("src", ["F8_E4M3", "F8_E5M2"])
def test_cast_f8_every_code(cuda, src, dst):
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    t = Tensor.from_numpy(codes, dtype=src)
    check_exact(cuda, F.cast(t, dst))
    check_exact(cuda, F.cast(t.transpose(), dst))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "I8", "I16", "I32", "I64", "F64", "F8_E4M3"])
def test_cont_every_element_size(cuda, rng, dtype):
    t = Tensor.from_numpy(raw_array(rng, (3, 5, 4, 7), dtype), dtype=dtype)
    check_exact(cuda, F.cont(t.transpose()))
    check_exact(cuda, F.cont(t.permute(2, 0, 3, 1)))
    check_exact(cuda, F.cont(t.slice(1, 1, None, 2)))
    if t.dtype.is_float:  # cast takes float and block types only
        check_exact(cuda, F.cast(t.permute(1, 2, 0, 3), dtype))  # a same-dtype cast is a copy


@pytest.mark.parametrize("blocks", [1, 2])  # Q8_0's single 34-byte block: the byte-copy path
@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_cont_block_rows(cuda, rng, dtype, blocks):
    from sdrt.ops.dtypes import get
    dt = get(dtype)
    rows = rng.integers(0, 256, (4, 6, blocks * dt.type_size)).astype(np.uint8)
    t = Tensor.from_numpy(rows, dtype=dtype)  # ne [blocks*bs, 6, 4]
    check_exact(cuda, F.cont(t.permute(0, 2, 1)))
    check_exact(cuda, F.cont(t.slice(1, 1, 5)))
    check_exact(cuda, F.cast(t.slice(2, 1, None, 2), dtype))


def test_cont_of_computed_view(cuda, rng):
    x = leaf(rng.standard_normal((2, 3, 33, 17)).astype(np.float32), "BF16")
    check_exact(cuda, F.cont(F.silu(x).permute(3, 1, 0, 2)))
