"""softmax and the normalizations vs independent numpy formulas (loops over rows/groups written
here, not the op references) and vs the reference backend."""
import numpy as np
import pytest

from opcheck import check, leaf, run, values
from sdrt import OpError
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

FLOATS = ["F32", "F16", "BF16"]


# ---- independent expectations (numpy order, float64) -------------------------------------------
def softmax_np(x, scale=1.0, mask=None):
    """Row by row; mask rows picked with ggml's index rule (i2 % m2, i3 % m3, row i1 or 0)."""
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape).astype(np.float64)
    out = np.empty_like(x4)
    if mask is not None:
        m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape).astype(np.float64)
    for i3, i2, i1 in np.ndindex(*x4.shape[:3]):
        w = x4[i3, i2, i1] * scale
        if mask is not None:
            w = w + m4[i3 % m4.shape[0], i2 % m4.shape[1], i1 if m4.shape[2] > 1 else 0]
        with np.errstate(invalid="ignore"):
            e = np.exp(w - w.max())
            out[i3, i2, i1] = e / e.sum()
    return out.reshape(x.shape)


def layer_norm_np(x, eps):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


def rms_norm_np(x, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)


def l2_norm_np(x, eps):
    x = x.astype(np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def group_norm_np(x, G, eps, w=None, b=None, silu=False):
    """x numpy (N, C, H, W) or (C, H, W); groups of ceil(C/G) channels, the last may be short."""
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape).astype(np.float64)
    N, C = x4.shape[:2]
    per = -(-C // G)
    out = np.empty_like(x4)
    for n in range(N):
        for c0 in range(0, C, per):
            g = x4[n, c0:c0 + per]
            out[n, c0:c0 + per] = (g - g.mean()) / np.sqrt(g.var() + eps)
    if w is not None:
        out = out * w.reshape(1, C, 1, 1) + b.reshape(1, C, 1, 1)
    if silu:
        out = out / (1 + np.exp(-out))
    return out.reshape(x.shape)


# ---- softmax -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("noncontig", [False, True])
def test_softmax_scale(rng, dtype, noncontig):
    x = rng.standard_normal((2, 3, 5, 37)).astype(np.float32) * 3
    t = leaf(x, dtype, noncontig)
    check(F.softmax(t, scale=0.7), softmax_np(values(t), 0.7), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mdtype", ["F32", "F16"])
def test_softmax_mask_with_inf(rng, dtype, mdtype):
    x = rng.standard_normal((3, 6, 77)).astype(np.float32)
    m = rng.standard_normal((6, 77)).astype(np.float32)
    m[:, 70:] = -np.inf       # padded keys
    m[2, :40] = -np.inf
    tx, tm = leaf(x, dtype), leaf(m, mdtype)
    got = check(F.softmax(tx, tm, scale=0.125), softmax_np(values(tx), 0.125, values(tm)), dtype)
    assert np.all(got[..., 70:] == 0)
    np.testing.assert_allclose(got.sum(-1), 1, rtol=1e-2 if dtype == "BF16" else 1e-3)


@pytest.mark.parametrize("mshape", [(1, 16), (5, 16), (9, 16), (1, 4, 5, 16), (2, 1, 5, 16), (2, 4, 9, 16)])
def test_softmax_mask_broadcast(rng, mshape):
    """mask rows: 1 (every row), ne1 (one per row), more than ne1 (padded, first ne1 used);
    mask planes divide ne2/ne3 and repeat."""
    x = rng.standard_normal((2, 4, 5, 16)).astype(np.float32)
    m = rng.standard_normal(mshape).astype(np.float32)
    m[..., 3] = -np.inf
    tx, tm = leaf(x), leaf(m)
    check(F.softmax(tx, tm, scale=2.0), softmax_np(x, 2.0, m))


def test_softmax_fully_masked_row_is_nan_like_ggml(rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    m = np.zeros((3, 8), np.float32)
    m[1] = -np.inf
    got = check(F.softmax(leaf(x), leaf(m)), softmax_np(x, 1.0, m))
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


def test_softmax_odd_rows(rng):
    for shape in [(1,), (7,), (3, 1), (2, 1, 1, 129)]:
        x = rng.standard_normal(shape).astype(np.float32)
        check(F.softmax(leaf(x)), softmax_np(x))


def test_softmax_errors_name_op():
    x = leaf(np.zeros((4, 6, 8), np.float32))
    with pytest.raises(OpError, match=r"softmax\(F32\[8, 6, 4\], F32\[7, 6\]\): mask ne\[0\]=7"):
        F.softmax(x, leaf(np.zeros((6, 7), np.float32)))
    with pytest.raises(OpError, match=r"softmax.*mask ne\[1\]=3 must be 1 or >= x ne\[1\]=6"):
        F.softmax(x, leaf(np.zeros((3, 8), np.float32)))
    with pytest.raises(OpError, match=r"softmax.*mask ne\[2\]=3 must divide x ne\[2\]=4"):
        F.softmax(x, leaf(np.zeros((3, 6, 8), np.float32)))
    with pytest.raises(OpError, match="softmax.*I32"):
        F.softmax(Tensor.from_numpy(np.zeros((2, 3), np.int32)))


# ---- row norms ---------------------------------------------------------------------------------
ROW = {
    "layer_norm": (lambda t: F.layer_norm(t, 1e-5), lambda x: layer_norm_np(x, 1e-5)),
    "rms_norm": (lambda t: F.rms_norm(t, 1e-6), lambda x: rms_norm_np(x, 1e-6)),
    "l2_norm": (lambda t: F.l2_norm(t, 1e-12), lambda x: l2_norm_np(x, 1e-12)),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(ROW))
@pytest.mark.parametrize("noncontig", [False, True])
def test_row_norms(rng, name, dtype, noncontig):
    build, ref = ROW[name]
    x = (rng.standard_normal((2, 3, 4, 45)) * 2 + 0.5).astype(np.float32)
    t = leaf(x, dtype, noncontig)
    check(build(t), ref(values(t)), dtype, atol=5e-5 if dtype == "F32" else None)


@pytest.mark.parametrize("name", sorted(ROW))
@pytest.mark.parametrize("shape", [(1,), (5, 1), (3, 320), (1, 1, 1, 3)])
def test_row_norms_odd_shapes(rng, name, shape):
    build, ref = ROW[name]
    x = rng.standard_normal(shape).astype(np.float32)
    check(build(leaf(x)), ref(x), atol=5e-5)


def test_l2_norm_eps_floor():
    x = np.array([[3e-4, 4e-4], [3.0, 4.0]], np.float32)
    check(F.l2_norm(leaf(x), eps=1e-2), np.array([[0.03, 0.04], [0.6, 0.8]]))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("which", ["wb", "w", "b"])
def test_layer_norm_affine(rng, dtype, which):
    x = rng.standard_normal((3, 7, 40)).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    tx = leaf(x, dtype, noncontig=True)
    tw = leaf(w, dtype) if "w" in which else None
    tb = leaf(b, dtype) if "b" in which else None
    want = layer_norm_np(values(tx), 1e-5)
    if tw is not None:
        want = want * values(tw)
    if tb is not None:
        want = want + values(tb)
    check(F.layer_norm_affine(tx, tw, tb, 1e-5), want, dtype, atol=5e-5 if dtype == "F32" else None)


def test_row_norm_errors_name_op():
    x = leaf(np.zeros((4, 8), np.float32))
    with pytest.raises(OpError, match=r"layer_norm_affine\(F32\[8, 4\], F32\[7\]\): weight/bias must have ne=\[8\]"):
        F.layer_norm_affine(x, leaf(np.zeros(7, np.float32)))
    with pytest.raises(OpError, match="rms_norm.*eps must be >= 0"):
        F.rms_norm(x, -1.0)
    with pytest.raises(OpError, match="l2_norm.*I32"):
        F.l2_norm(Tensor.from_numpy(np.zeros((2, 3), np.int32)))


# ---- group norm --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("C,G", [(8, 4), (10, 4), (6, 6), (5, 1)])
def test_group_norm(rng, dtype, C, G):
    """(10, 4): ggml's ceil split gives groups of 3, 3, 3 and 1 channels."""
    x = (rng.standard_normal((2, C, 5, 7)) * 3 + 1).astype(np.float32)
    t = leaf(x, dtype)
    check(F.group_norm(t, G, 1e-6), group_norm_np(values(t), G, 1e-6), dtype, atol=5e-5 if dtype == "F32" else None)


def test_group_norm_3d_and_noncontig(rng):
    x = rng.standard_normal((12, 6, 9)).astype(np.float32)  # ne [9, 6, 12]: no batch dim
    check(F.group_norm(leaf(x), 3), group_norm_np(x, 3, 1e-6), atol=5e-5)
    t = leaf(x, noncontig=True)  # W and H swapped in storage
    check(F.group_norm(t, 4, 1e-5), group_norm_np(values(t), 4, 1e-5), atol=5e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("wshape", ["flat", "sdcpp"])
def test_group_norm_affine_silu(rng, dtype, silu, wshape):
    C = 12
    x = rng.standard_normal((2, C, 6, 5)).astype(np.float32)
    w = rng.standard_normal(C).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    shape = (C,) if wshape == "flat" else (1, C, 1, 1)  # ne [C] or sd.cpp's [1, 1, C, 1]
    tx, tw, tb = leaf(x, dtype), leaf(w.reshape(shape), "F32"), leaf(b.reshape(shape), "F32")
    build = F.group_norm_silu(tx, tw, tb, 4) if silu else F.group_norm_affine(tx, tw, tb, 4)
    check(build, group_norm_np(values(tx), 4, 1e-6, w, b, silu), dtype, atol=5e-5 if dtype == "F32" else None)


def test_group_norm_sd_shape_matches_unfused(rng):
    """The fused kernel equals group_norm -> mul -> add -> silu built from separate ops."""
    x = rng.standard_normal((1, 64, 8, 8)).astype(np.float32)
    w = rng.standard_normal((1, 64, 1, 1)).astype(np.float32)
    b = rng.standard_normal((1, 64, 1, 1)).astype(np.float32)
    tx, tw, tb = leaf(x), leaf(w), leaf(b)
    fused = run(F.group_norm_silu(tx, tw, tb, 32))
    unfused = run(F.silu(F.add(F.mul(F.group_norm(tx, 32), tw), tb)))
    np.testing.assert_allclose(fused, unfused, rtol=1e-5, atol=1e-5)


def test_group_norm_errors_name_op():
    x = leaf(np.zeros((2, 8, 3, 3), np.float32))
    with pytest.raises(OpError, match=r"group_norm\(F32\[3, 3, 8, 2\]\): n_groups=9 is more than the 8 channels"):
        F.group_norm(x, 9)
    with pytest.raises(OpError, match="group_norm.*n_groups must be >= 1"):
        F.group_norm(x, 0)
    with pytest.raises(OpError, match=r"group_norm_affine.*weight/bias must hold the 8 channels"):
        F.group_norm_affine(x, leaf(np.zeros(6, np.float32)), leaf(np.zeros(8, np.float32)), 4)
