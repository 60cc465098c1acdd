"""upscale, pad, concat, repeat: CPU kernels vs independent numpy expectations (written from
torch's / ggml's documented formulas), vs the reference backend, and vs PyTorch goldens
(tests/fixtures/layout_goldens.npz, made by tools/make_layout_goldens.py)."""
import json
import os

import numpy as np
import pytest
from opcheck import check, leaf, run, values

from sdrt import OpError
from sdrt.ops import api as F
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.tensor import Tensor

FLOATS = ["F32", "F16", "BF16"]
GOLDENS = os.path.join(os.path.dirname(__file__), "fixtures", "layout_goldens.npz")


# ---- independent numpy resampling (torch's formulas: scale = in/out, or (in-1)/(out-1)) ---------
A = -0.75  # torch's cubic convolution coefficient


def c1(x):  # cubic convolution weight for |x| <= 1
    return ((A + 2) * x - (A + 3)) * x * x + 1


def c2(x):  # for 1 < |x| < 2
    return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A


def _axis_weights(n_in, n_out, mode, align_corners):
    """Dense (n_out, n_in) interpolation matrix of one axis, float64."""
    M = np.zeros((n_out, n_in))
    if align_corners:
        scale = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        scale = n_in / n_out
    for i in range(n_out):
        if mode == "bilinear":
            src = scale * i if align_corners else max(scale * (i + 0.5) - 0.5, 0.0)
            i0 = int(np.floor(src))
            i1 = min(i0 + 1, n_in - 1)
            lam = src - i0
            M[i, i0] += 1 - lam
            M[i, i1] += lam
        else:  # bicubic, A = -0.75, unclamped source coordinate, clamped taps
            src = scale * i if align_corners else scale * (i + 0.5) - 0.5
            i0 = int(np.floor(src))
            t = src - i0
            for k, w in zip(range(-1, 3), (c2(t + 1), c1(t), c1(1 - t), c2(2 - t))):
                M[i, min(max(i0 + k, 0), n_in - 1)] += w
    return M


def np_resize(x, H, W, mode, align_corners=False):
    """x numpy (..., h, w) -> (..., H, W)."""
    h, w = x.shape[-2:]
    if mode == "nearest":  # ggml: floor(i / sf), sf = out/in in float32
        iy = (np.arange(H, dtype=np.float32) / (np.float32(H) / np.float32(h))).astype(int)
        ix = (np.arange(W, dtype=np.float32) / (np.float32(W) / np.float32(w))).astype(int)
        return x[..., iy, :][..., ix]
    My = _axis_weights(h, H, mode, align_corners)
    Mx = _axis_weights(w, W, mode, align_corners)
    return np.einsum("Yy,...yx,Xx->...YX", My, x.astype(np.float64), Mx)


def _goldens():
    if not os.path.exists(GOLDENS):
        return []
    g = np.load(GOLDENS)
    return [i for i in range(100) if f"up{i}_x" in g]


@pytest.mark.parametrize("case", _goldens())
def test_upscale_vs_torch(case):
    g = np.load(GOLDENS)
    a = json.loads(str(g[f"up{case}_args"]))
    x, y = g[f"up{case}_x"], g[f"up{case}_y"]
    H, W = a["size"]
    node = F.upscale(Tensor.from_numpy(x), ne=(W, H), mode=a["mode"], align_corners=a["align_corners"],
                     antialias=a["antialias"])
    check(node, y, atol=1e-5)


def test_goldens_present():
    assert len(_goldens()) >= 15, f"{GOLDENS} missing: run tools/make_layout_goldens.py"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode,ac", [("nearest", False), ("bilinear", False), ("bilinear", True),
                                     ("bicubic", False), ("bicubic", True)])
@pytest.mark.parametrize("size", [(11, 13), (3, 4)])
@pytest.mark.parametrize("noncontig", [False, True])
def test_upscale_modes(rng, dtype, mode, ac, size, noncontig):
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    t = leaf(x, dtype, noncontig)
    H, W = size
    expected = np_resize(values(t), H, W, mode, ac)
    check(F.upscale(t, ne=(W, H), mode=mode, align_corners=ac), expected, dtype)


def test_upscale_scale_factor_and_high_dims(rng):
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    t = leaf(x)
    n = F.upscale(t, scale_factor=2)
    assert n.ne == (10, 8, 3, 2)
    check(n, x.repeat(2, axis=2).repeat(2, axis=3), rtol=0, atol=0)
    # dims 2/3 resample by nearest in every mode (ggml_interpolate)
    n = F.upscale(t, ne=(5, 4, 6, 2), mode="bilinear")
    check(n, x.repeat(2, axis=1))
    n = F.upscale(t, scale_factor=(1.5, 0.5), mode="bilinear")
    assert n.ne == (7, 2, 3, 2)
    check(n, np_resize(x, 2, 7, "bilinear"))


@pytest.mark.parametrize("dtype", ["I32", "F8_E4M3"])
def test_upscale_nearest_raw_bit_exact(rng, dtype):
    if dtype == "I32":
        x = rng.integers(-1000, 1000, (3, 4, 5)).astype(np.int32)
        t = Tensor.from_numpy(x)
    else:
        x = rng.integers(0, 255, (3, 4, 5)).astype(np.uint8)
        t = Tensor.from_numpy(x, dtype="F8_E4M3")
    out = F.upscale(t, ne=(10, 12))
    from sdrt.ops.graph import Graph
    got = Graph(out).run("cpu")["out"].numpy()
    np.testing.assert_array_equal(got, x.repeat(3, axis=1).repeat(2, axis=2))


def test_upscale_errors():
    t = leaf(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(OpError, match=r"upscale\(F32\[4, 3, 2\]\): unknown mode 'area'"):
        F.upscale(t, ne=(8, 6), mode="area")
    with pytest.raises(OpError, match="upscale.*antialias"):
        F.upscale(t, ne=(8, 6), mode="bicubic", antialias=True)
    with pytest.raises(OpError, match="upscale.*exactly one"):
        F.upscale(t, ne=(8, 6), scale_factor=2)
    with pytest.raises(OpError, match="upscale.*>= 1"):
        F.upscale(t, ne=(0, 6))
    ti = Tensor.from_numpy(np.zeros((3, 4), np.int32))
    with pytest.raises(OpError, match="upscale.*bilinear needs F32/F16/BF16"):
        F.upscale(ti, ne=(8, 6), mode="bilinear")


# ---- pad ---------------------------------------------------------------------------------------
def np_pad_expected(x, pads, mode, value=0.0):
    """Index arithmetic per axis (numpy order x; pads in ne order)."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    pads = list(pads) + [(0, 0)] * (4 - len(pads))
    out = x
    for d, (lo, hi) in enumerate(pads):
        ax = 3 - d
        n = out.shape[ax]
        j = np.arange(-lo, n + hi)
        if mode == "constant":
            shape = list(out.shape)
            shape[ax] = n + lo + hi
            new = np.full(shape, value, out.dtype)
            sl = [slice(None)] * 4
            sl[ax] = slice(lo, lo + n)
            new[tuple(sl)] = out
            out = new
            continue
        if mode == "circular":
            idx = np.mod(j, n)
        elif mode == "replicate":
            idx = np.clip(j, 0, n - 1)
        else:
            idx = np.where(j < 0, -j, np.where(j >= n, 2 * n - 2 - j, j))
        out = np.take(out, idx, axis=ax)
    return out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["constant", "circular", "reflect", "replicate"])
@pytest.mark.parametrize("noncontig", [False, True])
def test_pad_modes(rng, dtype, mode, noncontig):
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    t = leaf(x, dtype, noncontig)
    pads = [(1, 2), (3, 0), (0, 2), (1, 0)]
    got = check(F.pad(t, pads, mode=mode), np_pad_expected(values(t), pads, mode), dtype, rtol=0, atol=0)
    assert got.shape == (3, 5, 8, 10)


def test_pad_ggml_forms(rng):
    x = rng.standard_normal((5, 7)).astype(np.float32)
    t = leaf(x)
    n = F.pad(t, [2, 0, 1])  # ints: right-only (ggml_pad), adds a dim
    assert n.ne == (9, 5, 2)
    check(n, np_pad_expected(x, [(0, 2), (0, 0), (0, 1)], "constant")[0], rtol=0, atol=0)
    n = F.pad(t, [(1, 1)], value=-3.5)
    check(n, np_pad_expected(x, [(1, 1)], "constant", -3.5)[0, 0], rtol=0, atol=0)
    # circular padding larger than the dim wraps more than once
    n = F.pad(t, [(9, 8), (2, 6)], mode="circular")
    check(n, np_pad_expected(x, [(9, 8), (2, 6)], "circular")[0, 0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["I32", "F8_E5M2", "BF16"])
def test_pad_raw_bit_exact(rng, dtype):
    if dtype == "I32":
        raw = rng.integers(-9, 9, (3, 4, 5)).astype(np.int32)
        t = Tensor.from_numpy(raw)
    elif dtype == "BF16":
        raw = f32_to_raw(rng.standard_normal((3, 4, 5)).astype(np.float32), "BF16")
        t = Tensor.from_numpy(raw, dtype="BF16")
    else:
        raw = rng.integers(0, 120, (3, 4, 5)).astype(np.uint8)
        t = Tensor.from_numpy(raw, dtype="F8_E5M2")
    from sdrt.ops.graph import Graph
    for mode in ("constant", "reflect"):
        got = Graph(F.pad(t, [(1, 2), (2, 1)], mode=mode)).run("cpu")["out"].numpy()
        np.testing.assert_array_equal(got, np_pad_expected(raw, [(1, 2), (2, 1)], mode)[0])


def test_pad_errors():
    t = leaf(np.zeros((3, 4), np.float32))
    with pytest.raises(OpError, match=r"pad\(F32\[4, 3\]\): unknown mode 'mirror'"):
        F.pad(t, [(1, 1)], mode="mirror")
    with pytest.raises(OpError, match=r"pad.*dim 0: padding \(-1, 1\)"):
        F.pad(t, [(-1, 1)])
    with pytest.raises(OpError, match="pad.*reflect: dim 1 padding"):
        F.pad(t, [(1, 1), (3, 0)], mode="reflect")
    with pytest.raises(OpError, match="pad.*5 dims"):
        F.pad(t, [1, 1, 1, 1, 1])
    q = Tensor.from_numpy(np.zeros((2, 34), np.uint8), dtype="Q8_0")
    with pytest.raises(OpError, match="pad.*non-block dtype"):
        F.pad(q, [(0, 0), (1, 1)])


# ---- concat ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
@pytest.mark.parametrize("noncontig", [False, True])
def test_concat(rng, dtype, dim, noncontig):
    sa = [2, 3, 5, 7]
    sb = list(sa)
    sb[3 - dim] = 4 if dim else 3
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    ta, tb = leaf(a, dtype, noncontig), leaf(b, dtype)
    expected = np.concatenate([values(ta), values(tb)], axis=3 - dim)
    check(F.concat(ta, tb, dim), expected, dtype, rtol=0, atol=0)


def test_concat_many_and_ndims(rng):
    xs = [rng.standard_normal((3, n, 5)).astype(np.float32) for n in (1, 4, 2)]
    ts = [leaf(xs[0]), leaf(xs[1], noncontig=True), leaf(xs[2])]
    check(F.concat_many(ts, 1), np.concatenate(xs, axis=1), rtol=0, atol=0)
    assert F.concat_many(ts[:1], 1) is ts[0]
    # 2-D tensors stacked on a new dim 2
    a, b = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(2))
    n = F.concat(leaf(a), leaf(b), 2)
    assert n.ne == (6, 4, 2)
    check(n, np.stack([a, b]), rtol=0, atol=0)


def test_concat_errors():
    a, b = leaf(np.zeros((3, 4), np.float32)), leaf(np.zeros((3, 5), np.float32))
    with pytest.raises(OpError, match=r"concat\(F32\[4, 3\], F32\[5, 3\]\): dim 0 differs \(4 vs 5\)"):
        F.concat(a, b, 1)
    with pytest.raises(OpError, match="concat.*dtypes differ"):
        F.concat(a, leaf(np.zeros((3, 4), np.float32), "F16"), 0)
    for bad in (4, -1, 1.0):
        with pytest.raises(OpError, match="concat.*must be 0..3"):
            F.concat(a, a, bad)


# ---- repeat ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("src,ne", [((3,), (6, 4)), ((1, 5), (5, 3, 2)), ((2, 1, 3), (6, 4, 2, 3)),
                                    ((3, 1, 5), (5, 1, 3))])
def test_repeat(rng, dtype, src, ne):
    x = rng.standard_normal(src).astype(np.float32)  # numpy order
    t = leaf(x, dtype, noncontig=len(src) > 1)
    v = values(t)
    v4 = v.reshape((1,) * (4 - v.ndim) + v.shape)
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    reps = [o // i for o, i in zip(ne4[::-1], v4.shape)]
    expected = np.tile(v4, reps).reshape(tuple(ne)[::-1])
    check(F.repeat(t, ne), expected, dtype, rtol=0, atol=0)


def test_repeat_like_tensor_and_errors(rng):
    x = rng.standard_normal((1, 3)).astype(np.float32)
    t = leaf(x)
    like = leaf(np.zeros((4, 6), np.float32))
    check(F.repeat(t, like), np.tile(x, (4, 2)), rtol=0, atol=0)
    with pytest.raises(OpError, match=r"repeat\(F32\[3, 1\]\): target ne \(4, 2\) is not a multiple of \(3, 1\) in dim 0"):
        F.repeat(t, (4, 2))


def test_repeat_raw_i32(rng):
    x = rng.integers(0, 100, (2, 3)).astype(np.int32)
    out = run(F.repeat(Tensor.from_numpy(x), (6, 4)))
    np.testing.assert_array_equal(out, np.tile(x, (2, 2)).astype(np.float32))
