"""CUDA conv1d/conv2d/conv3d/conv_transpose2d (im2col + cuBLAS, and the direct 3x3 conv of large
maps) and pool1d/pool2d vs the CPU
backend on the same graph (skips without a GPU).

Tolerances are relative to the output's largest magnitude: F32 weights run a pedantic F32 GEMM
(1e-4); every other weight runs an F16 GEMM with F32 accumulation on activations narrowed to
F16 (2e-3). Pooling reads and sums in the CPU kernel's order (1e-6). Column chunking is forced
with a tiny COL_BYTES on small shapes, and happens by itself on the VAE's 512x512 map.
"""
import numpy as np
import pytest
from opcheck import leaf
from test_ops_conv import CONV2D_CASES as CPU_CONV2D_CASES

from sdrt.ops import api as F

from ._helpers import assert_on_cuda, assert_within_scale, randn, run_f32

FLOATS = ["F32", "F16", "BF16"]


# ---- harness (the `cuda` fixture is tests/gpu/conftest.py's: the cuda0 backend, or skip) ----
@pytest.fixture
def cols(monkeypatch):
    """Set the CUDA conv column-chunk cap (bytes) for one test."""
    import sdrt.gpu.cuda.ops.conv as G

    def set_cap(nbytes):
        monkeypatch.setattr(G, "COL_BYTES", nbytes)
    return set_cap


def check(cuda, node, tol=None):
    """CUDA vs CPU: max |difference| <= tol * max |cpu output|."""
    assert_on_cuda("conv", node)
    if tol is None:
        tol = 1e-6 if node.op.startswith("pool") else 1e-4 if node.src[1].dtype.name == "F32" else 2e-3
    want, got = run_f32("cpu", node), run_f32(cuda, node)
    assert got.shape == want.shape and node.dtype.name == "F32"
    assert_within_scale(got, want, tol, f"{node.op} {node.ne} {node.params}")


# ---- conv2d: every parameter family (the CPU test's cases, plus three edge shapes) -----------
CONV2D_CASES = {
    **CPU_CONV2D_CASES,
    "circular_wider_than_input": dict(x=(1, 2, 3, 2), w=(2, 2, 3, 3), padding=(3, 4), circular=(True, True)),
    "pointwise_padded": dict(x=(1, 5, 7, 5), w=(3, 5, 1, 1), padding=1),
    "kernel_covers_input": dict(x=(2, 3, 4, 5), w=(2, 3, 4, 5)),
}


@pytest.mark.parametrize("case", sorted(CONV2D_CASES))
@pytest.mark.parametrize("wdtype", ["F32", "F16"])
@pytest.mark.parametrize("bias", [False, True])
def test_conv2d_cases(cuda, rng, case, wdtype, bias):
    c = dict(CONV2D_CASES[case])
    x, w = randn(rng, *c.pop("x")), randn(rng, *c.pop("w"))
    b = leaf(randn(rng, w.shape[0])) if bias else None
    check(cuda, F.conv2d(leaf(x), leaf(w, wdtype), b, **c))


@pytest.mark.parametrize("case", ["stride2", "groups2", "channel_mult_s2", "circular_x", "dilation2"])
@pytest.mark.parametrize("cap", [64, 3000, 40000])
def test_conv2d_chunked_columns(cuda, rng, cols, case, cap):
    # 64 B: one output row per chunk; 3000 B: several rows; 40000 B: whole items, fewer than N
    cols(cap)
    c = dict(CONV2D_CASES[case])
    xs = (3,) + c.pop("x")[1:]
    x, w = randn(rng, *xs), randn(rng, *c.pop("w"))
    for wdtype in ("F32", "F16"):
        check(cuda, F.conv2d(leaf(x), leaf(w, wdtype), leaf(randn(rng, w.shape[0])), **c))


# the 8-columns-a-thread im2col (stride 1 along x, no x dilation or wrap, OW % 8 == 0): zero
# padding wider than the kernel, y stride/dilation/wrap, every input dtype and a transposed view,
# with row chunks of one and several rows
VEC8_CASES = {
    "pad1": dict(x=(2, 3, 6, 16), w=(4, 3, 3, 3), padding=1),
    "pad3_kernel2": dict(x=(1, 2, 5, 11), w=(3, 2, 2, 2), padding=3),
    "1x1": dict(x=(2, 5, 3, 24), w=(4, 5, 1, 1)),
    "y_stride_dilation": dict(x=(1, 3, 9, 16), w=(2, 3, 3, 3), stride=(1, 2), padding=(1, 2), dilation=(1, 2)),
    "circular_y": dict(x=(1, 2, 5, 16), w=(2, 2, 3, 3), padding=1, circular=(False, True)),
    "wide_kernel": dict(x=(1, 2, 4, 14), w=(2, 2, 1, 7)),
}


@pytest.mark.parametrize("case", sorted(VEC8_CASES))
@pytest.mark.parametrize("xdtype", FLOATS + ["transposed"])
@pytest.mark.parametrize("cap", [64, 3000, 1 << 28])
def test_conv2d_vector_columns(cuda, rng, cols, case, xdtype, cap):
    cols(cap)
    c = dict(VEC8_CASES[case])
    x, w = randn(rng, *c.pop("x")), randn(rng, *c.pop("w"))
    tx = leaf(x, noncontig=True) if xdtype == "transposed" else leaf(x, xdtype)
    for wdtype in ("F32", "F16"):
        check(cuda, F.conv2d(tx, leaf(w, wdtype), leaf(randn(rng, w.shape[0])), **c))


@pytest.mark.parametrize("wdtype", FLOATS + ["F8_E4M3"])
@pytest.mark.parametrize("xdtype", FLOATS)
def test_conv2d_dtypes(cuda, rng, wdtype, xdtype):
    tx, tw = leaf(randn(rng, 2, 3, 7, 5), xdtype), leaf(randn(rng, 4, 3, 3, 3), wdtype)
    tb = leaf(randn(rng, 4), "F16" if wdtype == "F8_E4M3" else wdtype)
    check(cuda, F.conv2d(tx, tw, tb, stride=(1, 2), padding=1))
    # 1x1: the F32/F32 contiguous case uses the input as the column matrix, the rest pack it
    check(cuda, F.conv2d(tx, leaf(randn(rng, 4, 3, 1, 1), wdtype), tb))


def test_conv2d_2d_weight_is_1x1(cuda, rng):
    x, w, b = randn(rng, 2, 5, 3, 4), randn(rng, 3, 5), randn(rng, 3)
    check(cuda, F.conv2d(leaf(x), leaf(w), leaf(b)))
    check(cuda, F.conv2d(leaf(x), leaf(w, "F16"), leaf(b)))


def test_conv2d_quantized_weight(cuda, rng):
    """Q8_0 weights (rows of 32 along ne[0]) go through matmul.weight_as to F16."""
    x = randn(rng, 2, 64, 6, 5)
    check(cuda, F.conv2d(leaf(x), leaf(randn(rng, 8, 64), "Q8_0"), leaf(randn(rng, 8))))  # 1x1 [C, OC]
    x = randn(rng, 1, 2, 3, 40)
    check(cuda, F.conv2d(leaf(x), leaf(randn(rng, 2, 2, 1, 32), "Q8_0"), padding=(2, 0)))  # KW = 32


def test_conv2d_noncontiguous_input_and_bias(cuda, rng):
    x, w = randn(rng, 2, 3, 7, 5), randn(rng, 4, 3, 3, 3)
    t = leaf(x, noncontig=True)
    assert not t.is_contiguous()
    check(cuda, F.conv2d(t, leaf(w), padding=1, stride=2))
    check(cuda, F.conv2d(t, leaf(w, "F16"), padding=1))
    check(cuda, F.conv2d(t, leaf(randn(rng, 4, 3, 1, 1)), leaf(randn(rng, 4))))  # 1x1 on a view: packed
    # a channel slice of a bigger tensor, depthwise
    big = leaf(randn(rng, 2, 6, 7, 5))
    check(cuda, F.conv2d(big.slice(2, 1, 6, 2), leaf(randn(rng, 3, 1, 3, 3)), groups=3, padding=1))
    # a permuted view: ne (W, H, C, N) made from a (C, W, H, N) buffer
    p = leaf(randn(rng, 2, 5, 7, 3)).permute(2, 0, 1, 3)
    assert p.ne == (7, 5, 3, 2)
    check(cuda, F.conv2d(p, leaf(w), padding=1))
    # weights as views (decoded to a contiguous copy by weight_as): transposed KW/KH, F32 and F16
    check(cuda, F.conv2d(leaf(x), leaf(randn(rng, 4, 3, 3, 2), noncontig=True), padding=1))
    check(cuda, F.conv2d(leaf(x), leaf(randn(rng, 4, 3, 3, 2), "F16", noncontig=True), padding=1))
    check(cuda, F.conv_transpose2d(leaf(x), leaf(randn(rng, 3, 2, 3, 2), noncontig=True), stride=2))
    # biases as views: every other element of a longer vector, and a 4-D [1, 1, OC, 1] F16 bias
    check(cuda, F.conv2d(leaf(x), leaf(w), leaf(randn(rng, 8)).slice(0, 0, None, 2), padding=1))
    check(cuda, F.conv2d(leaf(x), leaf(w, "F16"), leaf(randn(rng, 1, 4, 1, 1), "F16"), padding=1))


def test_conv2d_3d_input(cuda, rng):
    x, w, b = randn(rng, 3, 9, 7), randn(rng, 4, 3, 3, 3), randn(rng, 4)
    node = F.conv2d(leaf(x), leaf(w), leaf(b), padding=1, stride=(1, 2))
    assert node.ne == (7, 5, 4)
    check(cuda, node)


# ---- the direct 3x3 conv (conv3x3_mma) --------------------------------------------------------
@pytest.fixture
def direct(monkeypatch):
    """Set the map size (pixels) from which 3x3 convs run conv3x3_mma; 0 turns it off."""
    import sdrt.gpu.cuda.ops.conv as G

    def set_min(pixels):
        monkeypatch.setattr(G, "DIRECT_3X3_PIXELS", pixels)
    return set_min


# ragged tiles (maps not multiples of the 8x16 tile), channels not multiples of the 16-channel
# chunk or of the 32 / 64 output-channel blocks, batch > 1
DIRECT_CASES = {
    "tile_exact": (1, 16, 16, 32, 32),
    "ragged_map": (2, 5, 13, 21, 7),
    "one_pixel_row": (1, 20, 1, 40, 33),
    "oc3_rgb_out": (1, 64, 24, 17, 3),
    "oc96_two_blocks": (2, 48, 9, 30, 96),
    "c200_many_chunks": (1, 200, 12, 19, 64),
}


@pytest.mark.parametrize("case", sorted(DIRECT_CASES))
@pytest.mark.parametrize("xdtype", FLOATS + ["transposed"])
@pytest.mark.parametrize("bias", ["none", "F32", "F16_4d", "strided"])
def test_conv3x3_direct(cuda, rng, direct, case, xdtype, bias):
    direct(1)
    N, C, H, W, OC = DIRECT_CASES[case]
    x = leaf(randn(rng, N, C, H, W), noncontig=True) if xdtype == "transposed" else leaf(randn(rng, N, C, H, W), xdtype)
    w = leaf(randn(rng, OC, C, 3, 3) / np.sqrt(9 * C), "F16")
    b = {"none": None, "F32": leaf(randn(rng, OC)), "F16_4d": leaf(randn(rng, 1, OC, 1, 1), "F16"),
         "strided": leaf(randn(rng, 2 * OC)).slice(0, 0, None, 2)}[bias]
    check(cuda, F.conv2d(x, w, b, padding=1))


@pytest.mark.parametrize("case", ["tile_exact", "ragged_map", "oc96_two_blocks", "c200_many_chunks"])
@pytest.mark.parametrize("xdtype", ["F32", "F16"])
@pytest.mark.parametrize("variant", ["mma32", "mma64", "mma64k32", "mma128", "mma128t"])
def test_conv3x3_direct_variants(cuda, rng, direct, monkeypatch, case, xdtype, variant):
    """Every conv3x3_mma variant (block shapes) on ragged maps and channel counts."""
    import sdrt.gpu.cuda.ops.conv as G
    if G.C3_VARIANTS[variant][4] != G.MODULE and tuple(cuda.rt.device.capability) != (9, 0):
        pytest.skip(f"{variant} is built for sm_90 only")
    direct(1)
    monkeypatch.setattr(G, "DIRECT_3X3_VARIANT", variant)
    N, C, H, W, OC = DIRECT_CASES[case]
    w = leaf(randn(rng, OC, C, 3, 3) / np.sqrt(9 * C), "F16")
    check(cuda, F.conv2d(leaf(randn(rng, N, C, H, W), xdtype), w, leaf(randn(rng, OC)), padding=1))


@pytest.mark.parametrize("wdtype", ["F16", "BF16", "F8_E4M3"])
def test_conv3x3_direct_matches_im2col(cuda, rng, direct, wdtype):
    """The direct conv and im2col + cuBLAS see the same F16 operands: they differ only by the
    order of the F32 sums."""
    x = leaf(randn(rng, 2, 64, 40, 48))
    w = leaf(randn(rng, 64, 64, 3, 3) / 24.0, wdtype)
    node = F.conv2d(x, w, leaf(randn(rng, 64)), padding=1)
    direct(1)
    got = run_f32(cuda, node)
    direct(0)
    want = run_f32(cuda, node)
    assert_within_scale(got, want, 2e-5, f"direct vs im2col, {wdtype} weights")


def test_conv3x3_direct_by_default_on_large_maps(cuda, rng):
    import sdrt.gpu.cuda.ops.conv as G
    assert G.DIRECT_3X3_PIXELS and 130 * 130 >= G.DIRECT_3X3_PIXELS
    x = leaf(randn(rng, 1, 64, 130, 130) * 0.5)      # ESRGAN's trunk conv shape, a ragged map
    check(cuda, F.conv2d(x, leaf(randn(rng, 32, 64, 3, 3) / 24.0, "F16"), leaf(randn(rng, 32), "F16"), padding=1))


# ---- conv2d at stable-diffusion shapes -------------------------------------------------------
# (name, N, C, H=W, OC, kernel, stride, padding); F16 weights as the checkpoints ship them
SD_CONVS = [
    ("unet_conv_in", 2, 4, 64, 320, 3, 1, 1),
    ("unet_64_320", 2, 320, 64, 320, 3, 1, 1),
    ("unet_32_640", 2, 640, 32, 640, 3, 1, 1),
    ("unet_16_1280", 2, 1280, 16, 1280, 3, 1, 1),
    ("unet_8_1280", 2, 1280, 8, 1280, 3, 1, 1),
    ("unet_in_320_640", 2, 320, 32, 640, 3, 1, 1),
    ("unet_downsample_64", 2, 320, 64, 320, 3, 2, 1),
    ("unet_downsample_16", 2, 1280, 16, 1280, 3, 2, 1),
    ("unet_skip_1x1", 2, 640, 64, 320, 1, 1, 0),
    ("unet_proj_1x1", 2, 320, 64, 320, 1, 1, 0),
    ("unet_conv_out", 2, 320, 64, 4, 3, 1, 1),
    ("vae_post_quant", 1, 4, 64, 4, 1, 1, 0),
    ("vae_conv_in", 1, 4, 64, 512, 3, 1, 1),
    ("vae_mid_512", 1, 512, 64, 512, 3, 1, 1),
    ("vae_up_256", 1, 256, 256, 256, 3, 1, 1),
    ("vae_up_128_512px", 1, 128, 512, 128, 3, 1, 1),   # 604 MB of F16 columns: chunked by rows
    ("vae_conv_out", 1, 128, 512, 3, 3, 1, 1),
    ("vae_enc_down", 1, 128, 512, 128, 3, 2, 0),
]


@pytest.mark.parametrize("name,N,C,HW,OC,k,s,p", SD_CONVS, ids=[c[0] for c in SD_CONVS])
def test_conv2d_sd_shapes(cuda, rng, name, N, C, HW, OC, k, s, p):
    x = leaf(randn(rng, N, C, HW, HW) * 0.5)
    w = leaf(randn(rng, OC, C, k, k) * (1.0 / np.sqrt(C * k * k)), "F16")
    b = leaf(randn(rng, OC) * 0.1, "F16")
    check(cuda, F.conv2d(x, w, b, stride=s, padding=p))


WINOGRAD_SHAPES = [c for c in SD_CONVS if c[5:] == (3, 1, 1) and c[2] >= 64 and c[4] >= 64]


@pytest.mark.parametrize("m_dtype", ["F32", "F16"])
@pytest.mark.parametrize("name,N,C,HW,OC,k,s,p", WINOGRAD_SHAPES, ids=[c[0] for c in WINOGRAD_SHAPES])
def test_conv2d_sd_shapes_winograd(cuda, rng, monkeypatch, name, N, C, HW, OC, k, s, p, m_dtype):
    """Winograd F(2x2, 3x3) on cuBLAS (tests/test_cuda_conv_host.py runs its kernels on the host)."""
    import sdrt.gpu.cuda.ops.conv as G
    monkeypatch.setattr(G, "WINOGRAD", True)
    monkeypatch.setattr(G, "WINOGRAD_M", m_dtype)
    monkeypatch.setattr(G, "WINOGRAD_MIN_TILES", 0)
    monkeypatch.setattr(G, "DIRECT_3X3_PIXELS", 0)
    x = leaf(randn(rng, N, C, HW, HW) * 0.5)
    node = F.conv2d(x, leaf(randn(rng, OC, C, 3, 3) * (1.0 / np.sqrt(C * 9)), "F16"), leaf(randn(rng, OC) * 0.1, "F16"),
                    padding=1)
    assert G.takes_winograd(node)
    check(cuda, node, 3e-3)


@pytest.mark.parametrize("name,N,C,HW,OC", [("vae_mid_512_f32", 1, 512, 64, 512), ("unet_32_640_f32", 2, 640, 32, 640)])
def test_conv2d_sd_shapes_f32_weights(cuda, rng, name, N, C, HW, OC):
    x = leaf(randn(rng, N, C, HW, HW))
    w = leaf(randn(rng, OC, C, 3, 3) * (1.0 / np.sqrt(C * 9)))
    check(cuda, F.conv2d(x, w, leaf(randn(rng, OC)), padding=1))


# ---- conv_transpose2d ------------------------------------------------------------------------
CONVT_CASES = {
    "p0_stride1": dict(x=(1, 3, 5, 4), w=(3, 2, 3, 3)),
    "stride2_pad1_outpad1": dict(x=(2, 3, 5, 4), w=(3, 4, 3, 3), stride=2, padding=1, output_padding=1),
    "ggml_p0_stride2": dict(x=(1, 2, 4, 5), w=(2, 3, 2, 2), stride=2),
    "xy_differ": dict(x=(1, 2, 5, 3), w=(2, 3, 3, 2), stride=(3, 2), padding=(1, 0), output_padding=(2, 0)),
    "dilation2": dict(x=(1, 2, 4, 4), w=(2, 2, 3, 3), dilation=2, padding=1, stride=2),
    "big_padding": dict(x=(2, 3, 6, 6), w=(3, 2, 5, 5), stride=2, padding=3),
    "kernel4_stride2": dict(x=(2, 8, 8, 8), w=(8, 4, 4, 4), stride=2, padding=1),
}


@pytest.mark.parametrize("case", sorted(CONVT_CASES))
@pytest.mark.parametrize("wdtype", ["F32", "F16"])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose2d(cuda, rng, case, wdtype, bias):
    c = dict(CONVT_CASES[case])
    x, w = randn(rng, *c.pop("x")), randn(rng, *c.pop("w"))
    b = leaf(randn(rng, w.shape[1])) if bias else None
    check(cuda, F.conv_transpose2d(leaf(x), leaf(w, wdtype), b, **c))


@pytest.mark.parametrize("wdtype", FLOATS)
@pytest.mark.parametrize("xdtype", FLOATS)
@pytest.mark.parametrize("cap", [64, 1000, 1 << 28])
def test_conv_transpose2d_dtypes_chunked_noncontig(cuda, rng, cols, wdtype, xdtype, cap):
    cols(cap)  # 64 B: one input row and one batch item per chunk
    tx = leaf(randn(rng, 3, 3, 5, 4), xdtype, noncontig=True)
    tw, tb = leaf(randn(rng, 3, 2, 3, 3), wdtype), leaf(randn(rng, 2), wdtype)
    check(cuda, F.conv_transpose2d(tx, tw, tb, stride=2, padding=1, output_padding=1))
    check(cuda, F.conv_transpose2d(leaf(randn(rng, 3, 3, 5, 4), xdtype), tw, stride=(1, 2), padding=(0, 1)))


def test_conv_transpose2d_upsampler_shape(cuda, rng):
    # a learned 2x upsampler: 4x4 kernel, stride 2, padding 1, 256 channels at 32 -> 64
    x = leaf(randn(rng, 2, 256, 32, 32))
    w = leaf(randn(rng, 256, 128, 4, 4) * (1.0 / 32), "F16")
    check(cuda, F.conv_transpose2d(x, w, leaf(randn(rng, 128)), stride=2, padding=1))


# ---- conv1d / conv3d -------------------------------------------------------------------------
@pytest.mark.parametrize("params", [dict(), dict(stride=2, padding=1), dict(dilation=2, padding=3),
                                    dict(groups=2, padding=1), dict(groups=4, padding=2, stride=3)])
@pytest.mark.parametrize("wdtype", FLOATS)
def test_conv1d(cuda, rng, params, wdtype):
    g = params.get("groups", 1)
    tx, tw = leaf(randn(rng, 2, 4, 11)), leaf(randn(rng, 4, 4 // g, 3), wdtype)
    check(cuda, F.conv1d(tx, tw, leaf(randn(rng, 4)), **params))
    check(cuda, F.conv1d(leaf(randn(rng, 2, 4, 11), noncontig=True), tw, **params))  # transposed view


def test_conv1d_2d_input_and_chunks(cuda, rng, cols):
    check(cuda, F.conv1d(leaf(randn(rng, 3, 10)), leaf(randn(rng, 2, 3, 4)), padding=1))
    cols(64)
    check(cuda, F.conv1d(leaf(randn(rng, 3, 6, 50)), leaf(randn(rng, 4, 6, 5), "F16"), leaf(randn(rng, 4)), padding=2))


@pytest.mark.parametrize("params", [dict(padding=1), dict(stride=(2, 1, 2), padding=(1, 0, 1)),
                                    dict(dilation=(1, 2, 1), padding=(0, 2, 1))])
@pytest.mark.parametrize("wdtype", ["F32", "F16"])
@pytest.mark.parametrize("cap", [4096, 1 << 28])
def test_conv3d(cuda, rng, cols, params, wdtype, cap):
    cols(cap)  # 4096 B: several (od, oy) row chunks
    N, IC, OC = 2, 3, 4
    tx = leaf(randn(rng, N * IC, 5, 6, 7))
    tw = leaf(randn(rng, OC * IC, 3, 3, 2), wdtype)
    check(cuda, F.conv3d(tx, tw, leaf(randn(rng, OC)), ic=IC, **params))


def test_conv3d_default_ic_and_noncontig(cuda, rng):
    check(cuda, F.conv3d(leaf(randn(rng, 2, 3, 4, 5)), leaf(randn(rng, 3 * 2, 2, 2, 2))))
    x = leaf(randn(rng, 6, 5, 7, 6), noncontig=True)  # ne (6, 7, 5, 6), dims 0/1 strided
    check(cuda, F.conv3d(x, leaf(randn(rng, 4 * 3, 3, 3, 3), "F16"), ic=3, padding=1))


# ---- pooling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("params", [dict(kernel=2), dict(kernel=3, stride=2, padding=1),
                                    dict(kernel=(3, 2), stride=(1, 2), padding=(1, 0)), dict(kernel=(1, 4), stride=(3, 1))])
@pytest.mark.parametrize("dtype", FLOATS)
def test_pool2d(cuda, rng, kind, params, dtype):
    check(cuda, F.pool2d(leaf(randn(rng, 2, 3, 7, 5), dtype), kind, **params))
    check(cuda, F.pool2d(leaf(randn(rng, 2, 3, 5, 7), dtype, noncontig=True), kind, **params))


def test_pool2d_sd_and_views(cuda, rng):
    # the UNet's avg-pool downsample variant on a 64x64x320 map, batch 2
    check(cuda, F.pool2d(leaf(randn(rng, 2, 320, 64, 64)), "avg", 2))
    big = leaf(randn(rng, 2, 6, 9, 8))
    check(cuda, F.pool2d(big.slice(2, 1, 6, 2).slice(0, 1, 7), "max", 3, stride=2, padding=1))


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("params", [dict(kernel=2), dict(kernel=3, stride=2, padding=1), dict(kernel=4, stride=1, padding=2)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_pool1d(cuda, rng, kind, params, dtype):
    check(cuda, F.pool1d(leaf(randn(rng, 2, 3, 11), dtype), kind, **params))
    check(cuda, F.pool1d(leaf(randn(rng, 2, 3, 4, 11), dtype).permute(0, 2, 1, 3), kind, **params))  # 4-D view
