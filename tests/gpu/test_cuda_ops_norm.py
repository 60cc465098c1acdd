"""CUDA softmax and normalizations vs the CPU backend on the same graph (skips without a GPU).

The CPU accumulates statistics in float64, the GPU in float32 trees (means of x - x[0]), so
F32 results agree within a few float32 roundings of the normalized values; F16/BF16 outputs
within one rounding step. Covers masks of every dtype and broadcast form, -inf masks and
fully masked rows, scale, non-contiguous inputs, odd and very long rows, uneven channel
groups, group chunks split over several blocks, and the SD UNet/VAE shapes.
"""
import numpy as np
import pytest
from opcheck import leaf

from sdrt.ops import api as F
from sdrt.ops.graph import Graph

from ._helpers import assert_close_vs_cpu, assert_on_cuda, randn

FLOATS = ["F32", "F16", "BF16"]
TOL = {"F32": (1e-5, 1e-5), "F16": (2e-3, 2e-3), "BF16": (1.6e-2, 1.6e-2)}  # (rtol, atol)


# ---- harness -------------------------------------------------------------------------------
# `cuda` (tests/gpu/conftest.py) is the cuda0 backend; it skips the test without a GPU.
def check(cuda, node, rtol=None, atol=None):
    assert_on_cuda("norm", *Graph(node).nodes)
    r, a = TOL[node.dtype.name]
    return assert_close_vs_cpu(cuda, node, r if rtol is None else rtol, a if atol is None else atol, equal_nan=True)


# ---- softmax -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mdtype", [None] + FLOATS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("noncontig", [False, True])
def test_softmax_mask_dtypes(cuda, rng, dtype, mdtype, noncontig):
    x = leaf(randn(rng, 2, 3, 6, 37, scale=3), dtype, noncontig)
    mask = None if mdtype is None else leaf(randn(rng, 6, 37), mdtype)
    check(cuda, F.softmax(x, mask, scale=0.7))


@pytest.mark.parametrize("mshape", [(1, 9), (5, 9), (8, 9), (2, 1, 5, 9), (2, 3, 8, 9), (1, 3, 1, 9)])
def test_softmax_mask_broadcast(cuda, rng, mshape):
    # m1 == 1 repeats one row, m1 > ne1 uses the first ne1 rows (ggml's padded KQ masks),
    # m2/m3 divide ne2/ne3 and repeat over them
    x = leaf(randn(rng, 4, 3, 5, 9))
    check(cuda, F.softmax(x, leaf(randn(rng, *mshape)), scale=1.3))


def test_softmax_mask_views(cuda, rng):
    # a transposed mask and a mask sliced out of a padded buffer
    x = leaf(randn(rng, 4, 7, 12))
    check(cuda, F.softmax(x, leaf(randn(rng, 7, 12), "F16", noncontig=True)))
    check(cuda, F.softmax(x, leaf(randn(rng, 10, 16)).slice(0, 2, 14).slice(1, 1, 8)))


def test_softmax_minus_inf_and_fully_masked_rows(cuda, rng):
    x = leaf(randn(rng, 2, 6, 11))
    m = np.where(rng.random((6, 11)) < 0.4, -np.inf, 0.0).astype(np.float32)
    m[2] = -np.inf  # a fully masked row: NaN on both backends
    m[4, 1:] = -np.inf  # one survivor: exactly 1
    got = check(cuda, F.softmax(x, leaf(m)))
    assert np.isnan(got[:, 2]).all() and (got[:, 4, 0] == 1.0).all()
    check(cuda, F.softmax(x, leaf(m, "F16")))


@pytest.mark.parametrize("ne0", [1, 2, 31, 77, 1000, 4096, 65536, 100_003])
def test_softmax_row_lengths(cuda, rng, ne0):
    rows = max(1, 200_000 // ne0)
    check(cuda, F.softmax(leaf(randn(rng, rows, ne0, scale=4)), scale=0.125), rtol=1e-5, atol=1e-7)


def test_softmax_sd_attention_shapes(cuda, rng):
    # SD1.5 self-attention scores [4096 keys, 4096 queries, 8 heads] and cross-attention [77, 4096, 8]
    check(cuda, F.softmax(leaf(randn(rng, 8, 4096, 4096, scale=2)), scale=0.125), atol=1e-7)
    check(cuda, F.softmax(leaf(randn(rng, 16, 4096, 77, scale=2), "F16"), scale=0.125))


# ---- layer_norm(_affine), rms_norm, l2_norm ----------------------------------------------------
ROW = {"layer_norm": lambda t: F.layer_norm(t, 1e-5), "rms_norm": lambda t: F.rms_norm(t, 1e-6),
       "l2_norm": lambda t: F.l2_norm(t, 1e-12)}


@pytest.mark.parametrize("noncontig", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(ROW))
def test_row_norms(cuda, rng, name, dtype, noncontig):
    check(cuda, ROW[name](leaf(randn(rng, 2, 3, 5, 24, scale=3, offset=1), dtype, noncontig)))


@pytest.mark.parametrize("shape", [(1,), (7, 1), (3, 33), (2, 1000), (3, 65536), (2, 100_003)])
@pytest.mark.parametrize("name", sorted(ROW))
def test_row_norm_lengths(cuda, rng, name, shape):
    check(cuda, ROW[name](leaf(randn(rng, *shape, scale=2, offset=0.5))))


def test_layer_norm_large_offset(cuda, rng):
    # values around 100 with unit spread: both backends round the mean to float32
    # (ulp(100) = 7.6e-6), everything else must stay at that level
    check(cuda, F.layer_norm(leaf(randn(rng, 64, 4096, offset=100.0))), rtol=1e-4, atol=1e-4)


def test_l2_norm_eps_floor(cuda, rng):
    x = np.zeros((3, 8), np.float32)
    x[1] = 1e-7
    x[2] = randn(rng, 8)
    check(cuda, F.l2_norm(leaf(x), eps=1e-3))


@pytest.mark.parametrize("which", ["wb", "w", "b", "none"])
@pytest.mark.parametrize("wdtype", FLOATS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_layer_norm_affine(cuda, rng, dtype, wdtype, which):
    x = leaf(randn(rng, 3, 4, 40, scale=2, offset=-1), dtype)
    w = leaf(randn(rng, 40), wdtype) if "w" in which else None
    b = leaf(randn(rng, 40), "BF16" if wdtype == "F16" else wdtype) if "b" in which else None
    check(cuda, F.layer_norm_affine(x, w, b, eps=1e-6))


def test_layer_norm_affine_views(cuda, rng):
    # rows of a transposed x; weights as strided views ([9, 1] with element strides 8 and 12 bytes)
    x = leaf(randn(rng, 2, 40, 9), noncontig=True)  # ne [9, 40, 2], element stride 160 bytes
    w = leaf(randn(rng, 9, 2)).transpose().slice(1, 1, 2)
    check(cuda, F.layer_norm_affine(x, w, leaf(randn(rng, 9), "F16")))
    check(cuda, F.layer_norm_affine(x, None, leaf(randn(rng, 9, 3)).transpose().slice(1, 2, 3)))


def test_layer_norm_sd_shape(cuda, rng):
    # SD1.5 transformer block: [320 channels, 4096 tokens, batch 2], affine, eps 1e-5
    x = leaf(randn(rng, 2, 4096, 320, scale=2))
    check(cuda, F.layer_norm_affine(x, leaf(randn(rng, 320)), leaf(randn(rng, 320)), eps=1e-5), atol=2e-5)
    check(cuda, F.layer_norm_affine(leaf(randn(rng, 2, 4096, 320), "F16"), leaf(randn(rng, 320), "F16"),
                                   leaf(randn(rng, 320), "F16"), eps=1e-5))


# ---- group_norm(_affine) -----------------------------------------------------------------------
@pytest.mark.parametrize("C,G", [(8, 4), (10, 4), (10, 8), (6, 1), (5, 5), (32, 32)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_group_norm_groups(cuda, rng, dtype, C, G):
    # C=10, G=4: groups of 3 with a short last one; C=10, G=8: groups of 2, only 5 exist (ggml)
    check(cuda, F.group_norm(leaf(randn(rng, 2, C, 5, 7, scale=2, offset=1), dtype), G, eps=1e-6))


def test_group_norm_3d_2d_and_views(cuda, rng):
    check(cuda, F.group_norm(leaf(randn(rng, 6, 11, 13)), 3))          # ne [13, 11, 6]: N = 1
    check(cuda, F.group_norm(leaf(randn(rng, 4, 9, 16)).permute(1, 0, 2), 4))  # planes not contiguous
    check(cuda, F.group_norm(leaf(randn(rng, 2, 8, 6, 5), noncontig=True), 2))  # W, H swapped
    x = leaf(randn(rng, 2, 12, 6, 9)).slice(2, 1, 5).slice(3, 0, None, 2)      # sliced channels, batch
    check(cuda, F.group_norm(x, 4))
    check(cuda, F.group_norm(leaf(randn(rng, 3, 64, 1, 1)), 32))        # 1x1 planes, many channels


@pytest.mark.parametrize("wshape", ["vec", "ggml4d"])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("wdtype", FLOATS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_group_norm_affine(cuda, rng, dtype, wdtype, silu, wshape):
    C = 12
    shape = (C,) if wshape == "vec" else (1, C, 1, 1)  # ne [C] or sd.cpp's [1, 1, C, 1]
    x = leaf(randn(rng, 2, C, 6, 5, scale=2), dtype)
    w, b = leaf(randn(rng, *shape), wdtype), leaf(randn(rng, *shape), "F32")
    check(cuda, F.group_norm_affine(x, w, b, 4, eps=1e-5, silu=silu))


def test_group_norm_split_chunks(cuda, rng):
    # groups big enough to be split over several blocks, with uneven chunk boundaries
    x = leaf(randn(rng, 1, 8, 50, 70, scale=3, offset=2))
    check(cuda, F.group_norm_silu(x, leaf(randn(rng, 8)), leaf(randn(rng, 8)), 2, eps=1e-6), atol=2e-5)
    check(cuda, F.group_norm(leaf(randn(rng, 2, 6, 97, 89), noncontig=True), 3), atol=2e-5)


def test_group_norm_large_offset(cuda, rng):
    x = leaf(randn(rng, 2, 64, 32, 32, offset=100.0))
    check(cuda, F.group_norm(x, 32, eps=1e-6), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_group_norm_sd_shapes(cuda, rng, dtype):
    # SD1.5 ResBlock GroupNorm32+SiLU on [64, 64, 320, 2]; a VAE decoder one on [256, 256, 128, 1]
    x = leaf(randn(rng, 2, 320, 64, 64, scale=2, offset=0.3), dtype)
    w, b = leaf(randn(rng, 320)), leaf(randn(rng, 320))
    check(cuda, F.group_norm_silu(x, w, b, 32, eps=1e-5), atol=3e-5 if dtype == "F32" else None)
    v = leaf(randn(rng, 1, 128, 256, 256), dtype)
    check(cuda, F.group_norm_affine(v, leaf(randn(rng, 128)), leaf(randn(rng, 128)), 32, eps=1e-6),
          atol=3e-5 if dtype == "F32" else None)
