"""CUDA upscale, pad, concat, repeat vs the CPU backend on the same graph (skips without a GPU).

Data movement must be bit exact for every non-block dtype (raw storage compared); resampling
within float32 rounding (F16/BF16 outputs within one rounding step of their dtype). Inputs
include non-contiguous views: transposes, permutes, strided slices, and views of computed nodes.
"""
import numpy as np
import pytest

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
RAW_TYPES = ["F32", "F16", "BF16", "I32", "I8", "I16", "F8_E4M3", "F64"]
TOL = {"F32": 1e-5, "F16": 2e-3, "BF16": 1.6e-2}


# ---- harness (the `cuda` fixture is tests/gpu/conftest.py's: the cuda0 backend, or skip) ----
def check_exact(cuda, node):
    """Bit-exact against the CPU backend (raw storage)."""
    assert_on_cuda("layout", *Graph(node).nodes)
    assert_exact_vs_cpu(cuda, node)


def check_close(cuda, node, tol=None):
    assert_on_cuda("layout", *Graph(node).nodes)
    tol = TOL[node.dtype.name] if tol is None else tol
    assert_close_vs_cpu(cuda, node, tol, tol)


def raw_leaf(rng, shape, dtype, noncontig=False) -> Tensor:
    """A leaf of logical numpy `shape`; noncontig stores it transposed and returns the
    transposed view (same logical values, non-contiguous strides)."""
    raw = raw_array(rng, shape, dtype, f8_codes=0x7B)  # finite F8 values
    if noncontig and len(shape) >= 2:
        return Tensor.from_numpy(np.ascontiguousarray(np.swapaxes(raw, -1, -2)), dtype=dtype).transpose()
    return Tensor.from_numpy(raw, dtype=dtype)


def views(rng, dtype):
    """Non-contiguous views of one logical (2, 3, 5, 7) tensor (numpy order)."""
    base = raw_leaf(rng, (3, 2, 7, 5), dtype)                   # ne (5, 7, 2, 3)
    yield "permute", base.permute(1, 0, 3, 2)                   # ne (7, 5, 3, 2)
    big = raw_leaf(rng, (2, 6, 5, 9), dtype)
    yield "strided_slice", big.slice(2, 1, 6, 2).slice(0, 1, 8)  # ne (7, 5, 3, 2), nb gaps
    yield "transpose", raw_leaf(rng, (2, 3, 5, 7), dtype, noncontig=True)


# ---- pad ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["constant", "circular", "reflect", "replicate"])
@pytest.mark.parametrize("dtype", RAW_TYPES)
def test_pad_modes_dtypes(cuda, rng, mode, dtype):
    t = raw_leaf(rng, (2, 3, 5, 7), dtype)
    check_exact(cuda, F.pad(t, [(1, 2), (3, 0), (0, 2), (1, 0)], mode=mode))


@pytest.mark.parametrize("mode", ["constant", "circular", "reflect", "replicate"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_pad_noncontiguous(cuda, rng, mode, dtype):
    for _, t in views(rng, dtype):
        check_exact(cuda, F.pad(t, [(2, 1), (0, 3), (1, 1), (0, 1)], mode=mode))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "I32", "F8_E5M2"])
def test_pad_fill_value_and_forms(cuda, rng, dtype):
    t = raw_leaf(rng, (5, 7), dtype)
    check_exact(cuda, F.pad(t, [(1, 1), (2, 0)], value=-3.5 if dtype != "I32" else -3))
    check_exact(cuda, F.pad(t, [2, 0, 1]))  # ggml_pad: right-only, adds a dim
    check_exact(cuda, F.pad(t, [(9, 8), (2, 6)], mode="circular"))  # wraps more than once
    check_exact(cuda, F.pad(t, [(6, 6), (4, 4)], mode="reflect"))    # the largest reflect pads


def test_pad_sd_shapes(cuda, rng):
    # sd.cpp pads a latent for tiling / patchifying: (64, 64, 4, 2) and a 320-ch feature map
    check_exact(cuda, F.pad(raw_leaf(rng, (2, 4, 64, 64), "F32"), [(0, 3), (0, 3)]))
    check_exact(cuda, F.pad(raw_leaf(rng, (2, 320, 64, 64), "F16"), [(1, 1), (1, 1)], mode="circular"))


# ---- repeat ------------------------------------------------------------------------------------
REPEAT_CASES = [((3,), (6, 4)), ((1, 5), (5, 3, 2)), ((2, 1, 3), (6, 4, 2, 3)), ((3, 1, 5), (5, 1, 3)),
                ((2, 3, 1, 4), (8, 3, 6, 2))]


@pytest.mark.parametrize("src,ne", REPEAT_CASES)
@pytest.mark.parametrize("dtype", RAW_TYPES)
def test_repeat(cuda, rng, src, ne, dtype):
    check_exact(cuda, F.repeat(raw_leaf(rng, src, dtype, noncontig=len(src) > 1), ne))


@pytest.mark.parametrize("dtype", FLOATS)
def test_repeat_noncontiguous_and_sd_bias(cuda, rng, dtype):
    for _, t in views(rng, dtype):
        check_exact(cuda, F.repeat(t, (14, 5, 6, 4)))
    # a per-channel vector broadcast over a 64x64 map, as sd.cpp's ggml_repeat of a bias
    check_exact(cuda, F.repeat(raw_leaf(rng, (320, 1, 1), dtype), (64, 64, 320, 2)))


# ---- concat ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", RAW_TYPES)
def test_concat_dims_dtypes(cuda, rng, dim, dtype):
    sa = [2, 3, 5, 7]
    sb = list(sa)
    sb[3 - dim] = 4 if dim else 3
    check_exact(cuda, F.concat(raw_leaf(rng, sa, dtype), raw_leaf(rng, sb, dtype), dim))


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", FLOATS)
def test_concat_noncontiguous(cuda, rng, dim, dtype):
    vs = [t for _, t in views(rng, dtype)]  # all ne (7, 5, 3, 2)
    check_exact(cuda, F.concat(vs[0], vs[1], dim))
    check_exact(cuda, F.concat_many(vs, dim))
    contig = raw_leaf(rng, (2, 3, 5, 7), dtype)
    check_exact(cuda, F.concat(contig, vs[2], dim))


def test_concat_many_and_new_dim(cuda, rng):
    xs = [raw_leaf(rng, (3, n, 5), "F32", noncontig=n == 4) for n in (1, 4, 2)]
    check_exact(cuda, F.concat_many(xs, 1))
    a, b = raw_leaf(rng, (4, 6), "F16"), raw_leaf(rng, (4, 6), "F16")
    n = F.concat(a, b, 2)  # 2-D tensors stacked on a new dim 2
    assert n.ne == (6, 4, 2)
    check_exact(cuda, n)


@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_concat_sd_skip_connections(cuda, rng, dtype):
    # the UNet decoder joins the upsampled map and the skip on channels (ggml dim 2)
    for hw, c1, c2 in ((64, 320, 320), (32, 640, 320), (16, 1280, 640), (8, 1280, 1280)):
        a, b = raw_leaf(rng, (2, c1, hw, hw), dtype), raw_leaf(rng, (2, c2, hw, hw), dtype)
        check_exact(cuda, F.concat(a, b, 2))


# ---- upscale -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", RAW_TYPES)
def test_upscale_nearest_dtypes(cuda, rng, dtype):
    t = raw_leaf(rng, (2, 3, 5, 7), dtype)
    check_exact(cuda, F.upscale(t, scale_factor=2))
    check_exact(cuda, F.upscale(t, ne=(11, 13, 4, 3)))  # odd ratios, dims 2/3 too
    check_exact(cuda, F.upscale(t, ne=(3, 2)))          # downscale


@pytest.mark.parametrize("dtype", FLOATS)
def test_upscale_nearest_noncontiguous_and_sd(cuda, rng, dtype):
    for _, t in views(rng, dtype):
        check_exact(cuda, F.upscale(t, ne=(15, 9)))
    # the UNet's Upsample (nearest x2) at 32 -> 64 with 1280 channels, batch 2
    check_exact(cuda, F.upscale(raw_leaf(rng, (2, 1280, 32, 32), dtype), scale_factor=2))


@pytest.mark.parametrize("mode,ac", [("bilinear", False), ("bilinear", True), ("bicubic", False), ("bicubic", True)])
@pytest.mark.parametrize("size", [(11, 13), (3, 4), (5, 7), (1, 1), (10, 2)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_upscale_interp(cuda, rng, mode, ac, size, dtype):
    t = raw_leaf(rng, (2, 3, 5, 7), dtype)
    H, W = size
    check_close(cuda, F.upscale(t, ne=(W, H), mode=mode, align_corners=ac))


@pytest.mark.parametrize("mode,ac", [("bilinear", False), ("bicubic", True)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_upscale_interp_noncontiguous(cuda, rng, mode, ac, dtype):
    for _, t in views(rng, dtype):
        check_close(cuda, F.upscale(t, ne=(13, 4), mode=mode, align_corners=ac))


@pytest.mark.parametrize("size", [(3, 2), (13, 4), (2, 17), (40, 30), (7, 5), (1, 1)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_upscale_bilinear_antialias(cuda, rng, size, dtype):
    t = raw_leaf(rng, (2, 3, 17, 23), dtype)
    W, H = size
    check_close(cuda, F.upscale(t, ne=(W, H), mode="bilinear", antialias=True))
    check_close(cuda, F.upscale(t, ne=(W, H), mode="bilinear", antialias=True, align_corners=True))


def test_upscale_interp_high_dims_and_scale_factor(cuda, rng):
    t = raw_leaf(rng, (2, 3, 4, 5), "F32")
    check_close(cuda, F.upscale(t, ne=(5, 4, 6, 2), mode="bilinear"))  # dims 2/3: nearest
    check_close(cuda, F.upscale(t, ne=(9, 7, 2, 5), mode="bicubic"))
    check_close(cuda, F.upscale(t, scale_factor=(1.5, 0.5), mode="bilinear"))
    # a VAE-sized bilinear x2 (hires fix latent upscale): 4 x 64 x 64 -> 128 x 128
    check_close(cuda, F.upscale(raw_leaf(rng, (1, 4, 64, 64), "F32"), scale_factor=2, mode="bilinear"))
    check_close(cuda, F.upscale(raw_leaf(rng, (1, 4, 64, 64), "F32"), ne=(96, 80), mode="bicubic"))


# ---- layout ops chained on device (views of computed nodes) ------------------------------------
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "I32"])
def test_chain_of_views_of_computed_nodes(cuda, rng, dtype):
    a, b = raw_leaf(rng, (2, 3, 5, 7), dtype), raw_leaf(rng, (2, 3, 5, 4), dtype)
    c = F.concat(a, b, 0)                                  # ne (11, 5, 3, 2)
    p = F.pad(c.permute(2, 0, 3, 1), [(1, 1), (0, 2)], mode="replicate")  # a permuted view
    r = F.repeat(p.slice(1, 1, None, 2), (14, 4, 11, 6))      # ne (7, 2, 11, 3) tiled
    up = F.upscale(r.transpose(), scale_factor=2)
    check_exact(cuda, up)
