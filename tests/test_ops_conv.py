"""Convolutions and pooling vs independent numpy expectations (tap-by-tap sums over strided
slices, which the op references — sliding windows + tensordot — do not use) and vs the
reference backend."""
import numpy as np
import pytest
from opcheck import check, leaf, run, values

from sdrt import OpError
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

FLOATS = ["F32", "F16", "BF16"]


# ---- independent expectations (numpy order; per-axis params in ggml order x, y, z) ------------
def conv_np(x, w, b=None, stride=None, padding=None, dilation=None, groups=1, circular=None):
    """Direct sum over kernel taps. x (N, C, *S), w (OC, C/g, *K); params given ggml-style
    (innermost axis first), like the builders."""
    nsp = x.ndim - 2

    def rev(t, default):
        t = default if t is None else t
        return (t,) * nsp if isinstance(t, (int, bool)) else tuple(t)[::-1]
    s, p, d = rev(stride, 1), rev(padding, 0), rev(dilation, 1)
    circ = rev(circular, False)
    x = x.astype(np.float64)
    for i in range(nsp):
        pw = [(0, 0)] * x.ndim
        pw[2 + i] = (p[i], p[i])
        x = np.pad(x, pw, mode="wrap" if circ[i] else "constant")
    N = x.shape[0]
    OC, cg = w.shape[:2]
    K = w.shape[2:]
    O = [(x.shape[2 + i] - d[i] * (K[i] - 1) - 1) // s[i] + 1 for i in range(nsp)]
    og = OC // groups
    out = np.zeros((N, OC, *O))
    for tap in np.ndindex(*K):
        sl = tuple(slice(t * di, t * di + si * (o - 1) + 1, si) for t, di, si, o in zip(tap, d, s, O))
        for g in range(groups):
            patch = x[(slice(None), slice(g * cg, (g + 1) * cg)) + sl]
            wt = w[(slice(g * og, (g + 1) * og), slice(None)) + tap].astype(np.float64)
            out[:, g * og:(g + 1) * og] += np.tensordot(wt, patch, axes=([1], [1])).swapaxes(0, 1)
    if b is not None:
        out += np.asarray(b, np.float64).reshape((1, OC) + (1,) * nsp)
    return out


def conv_transpose_np(x, w, b, stride, padding, output_padding, dilation):
    """Transposed conv as a plain conv of the zero-stuffed input with the flipped, channel-
    swapped kernel. x (N, C, H, W), w (C, OC, KH, KW); params ggml order (x, y)."""
    (sx, sy), (px, py), (ox, oy), (dx, dy) = stride, padding, output_padding, dilation
    N, C, H, W = x.shape
    KH, KW = w.shape[2:]
    st = np.zeros((N, C, (H - 1) * sy + 1, (W - 1) * sx + 1))
    st[:, :, ::sy, ::sx] = x
    ey, ex = dy * (KH - 1) - py, dx * (KW - 1) - px
    assert ey >= 0 and ex >= 0, "test params must keep the equivalent padding non-negative"
    st = np.pad(st, ((0, 0), (0, 0), (ey, ey + oy), (ex, ex + ox)))
    wf = np.ascontiguousarray(w[:, :, ::-1, ::-1].swapaxes(0, 1))
    return conv_np(st, wf, b, dilation=(dx, dy))


def pool_np(x, kind, kernel, stride, padding):
    """ggml pooling tap by tap: avg sums in-bounds values / full kernel area; max over in-bounds."""
    nsp = len(kernel)
    k, s, p = kernel[::-1], stride[::-1], padding[::-1]
    lead = x.ndim - nsp
    fill = 0.0 if kind == "avg" else -np.inf
    xp = np.pad(x.astype(np.float64), [(0, 0)] * lead + [(q, q) for q in p], constant_values=fill)
    O = [(xp.shape[lead + i] - k[i]) // s[i] + 1 for i in range(nsp)]
    acc = np.full(x.shape[:lead] + tuple(O), fill)
    for tap in np.ndindex(*k):
        v = xp[(Ellipsis,) + tuple(slice(t, t + si * (o - 1) + 1, si) for t, si, o in zip(tap, s, O))]
        acc = acc + v if kind == "avg" else np.maximum(acc, v)
    return acc / np.prod(k) if kind == "avg" else acc


def rnd(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ---- conv2d ----------------------------------------------------------------------------------
CONV2D_CASES = {
    "basic_3x3_pad1": dict(x=(1, 4, 6, 6), w=(5, 4, 3, 3), padding=1),
    "stride2": dict(x=(2, 3, 7, 5), w=(3, 3, 3, 3), stride=2, padding=1),
    "stride_xy_differ": dict(x=(1, 2, 7, 9), w=(3, 2, 3, 2), stride=(2, 1), padding=(0, 2)),
    "dilation2": dict(x=(1, 3, 9, 8), w=(4, 3, 3, 3), dilation=2, padding=2),
    "dilation_xy_differ": dict(x=(1, 2, 9, 8), w=(2, 2, 3, 3), dilation=(1, 2), padding=(1, 0)),
    "groups2": dict(x=(2, 4, 7, 5), w=(6, 2, 3, 3), groups=2, padding=1),
    "depthwise": dict(x=(2, 4, 7, 5), w=(4, 1, 3, 3), groups=4, padding=1),
    "depthwise_s2_d2": dict(x=(1, 3, 9, 8), w=(3, 1, 3, 3), groups=3, stride=(2, 1), padding=(2, 1), dilation=2),
    "channel_mult": dict(x=(1, 2, 5, 6), w=(4, 1, 3, 3), groups=2, padding=1),
    "channel_mult_s2": dict(x=(2, 3, 7, 5), w=(6, 1, 3, 2), groups=3, padding=(0, 1), stride=2),
    "circular_both": dict(x=(1, 2, 7, 5), w=(3, 2, 3, 3), padding=1, circular=(True, True)),
    "circular_x": dict(x=(2, 2, 7, 5), w=(3, 2, 3, 3), padding=(2, 1), circular=(True, False)),
    "circular_y": dict(x=(1, 2, 7, 5), w=(3, 2, 3, 3), padding=1, stride=2, circular=(False, True)),
    "pointwise": dict(x=(2, 5, 7, 5), w=(3, 5, 1, 1)),
    "pointwise_s2": dict(x=(1, 5, 7, 5), w=(3, 5, 1, 1), stride=2),
    "odd_kernel_7x5": dict(x=(1, 2, 7, 5), w=(3, 2, 5, 3), padding=(1, 2)),
    "no_pad_valid": dict(x=(2, 3, 7, 5), w=(3, 3, 3, 3)),
}


@pytest.mark.parametrize("case", sorted(CONV2D_CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_conv2d_cases(rng, case, bias):
    c = dict(CONV2D_CASES[case])
    x, w = rnd(rng, *c.pop("x")), rnd(rng, *c.pop("w"))
    b = rnd(rng, w.shape[0]) if bias else None
    node = F.conv2d(leaf(x), leaf(w), None if b is None else leaf(b), **c)
    check(node, conv_np(x, w, b, **c), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wdtype", FLOATS + ["F8_E4M3"])
@pytest.mark.parametrize("xdtype", ["F32", "F16"])
def test_conv2d_dtypes(rng, wdtype, xdtype, monkeypatch):
    import sdrt.ops.cpu.conv as K
    monkeypatch.setattr(K, "SERIAL_BELOW", 0)  # the parallel im2col (test sizes are small)
    tx, tw = leaf(rnd(rng, 2, 3, 7, 5), xdtype), leaf(rnd(rng, 4, 3, 3, 3), wdtype)
    tb = leaf(rnd(rng, 4), "F16" if wdtype == "F8_E4M3" else wdtype)
    node = F.conv2d(tx, tw, tb, stride=(1, 2), padding=1)
    assert node.dtype.name == "F32" and node.ne == (5, 4, 4, 2)
    check(node, conv_np(values(tx), values(tw), values(tb), stride=(1, 2), padding=1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["one_gemm", "one_gemm_parallel", "per_item"])
@pytest.mark.parametrize("wdtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("case", ["basic_3x3_pad1", "stride2", "pointwise", "no_pad_valid"])
def test_conv2d_batch_paths(rng, monkeypatch, path, wdtype, case):
    """A batch runs as one GEMM over all items (small outputs) or as one GEMM per item: the same
    convolution, serial or parallel regrouping, widened weights or not."""
    import sdrt.ops.cpu.conv as K
    monkeypatch.setattr(K, "MERGE_MAX_P", 0 if path == "per_item" else 1 << 30)
    monkeypatch.setattr(K, "SERIAL_BELOW", 0 if path == "one_gemm_parallel" else 1 << 62)
    c = {k: v for k, v in CONV2D_CASES[case].items() if k not in ("x", "w")}
    ksz = CONV2D_CASES[case]["w"][2:]
    tx, tw, tb = leaf(rnd(rng, 3, 4, 7, 6)), leaf(rnd(rng, 5, 4, *ksz), wdtype), leaf(rnd(rng, 5))
    for b in (None, tb):
        node = F.conv2d(tx, tw, b, **c)
        check(node, conv_np(values(tx), values(tw), None if b is None else values(b), **c), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["one_gemm", "per_item"])
@pytest.mark.parametrize("wdtype", ["F16", "BF16"])
@pytest.mark.parametrize("case", ["basic_3x3_pad1", "stride2", "pointwise", "groups2"])
def test_conv2d_weight_tiles(rng, monkeypatch, path, wdtype, case):
    """A widened weight is split into output-channel tiles of at most WEIGHT_TILE_BYTES, one
    GEMM per tile: several uneven tiles (7 channels, 2-3 per tile) give the untiled result, and
    the widened scratch never grows past the tile cap."""
    import sdrt.ops.cpu.conv as K
    monkeypatch.setattr(K, "MERGE_MAX_P", 0 if path == "per_item" else 1 << 30)
    monkeypatch.setattr(K, "COL_BYTES", 1 << 26 if path == "one_gemm" else 4 * 4 * 9 * 6 * 2)
    c = {k: v for k, v in CONV2D_CASES[case].items() if k not in ("x", "w")} if case != "groups2" else {"padding": 1}
    groups = c.pop("groups", 2 if case == "groups2" else 1)
    ksz = (3, 3) if case == "groups2" else CONV2D_CASES[case]["w"][2:]
    tx, tb = leaf(rnd(rng, 3, 4, 7, 6)), leaf(rnd(rng, 14 if groups == 2 else 7))
    tw = leaf(rnd(rng, 14 if groups == 2 else 7, 4 // groups, *ksz), wdtype)
    node = F.conv2d(tx, tw, tb, groups=groups, **c)
    row_bytes = 4 * (4 // groups) * ksz[0] * ksz[1]
    monkeypatch.setattr(K, "WEIGHT_TILE_BYTES", 1 << 62)
    whole = run(node)
    monkeypatch.setattr(K._TLS, "w", None, raising=False)
    monkeypatch.setattr(K, "WEIGHT_TILE_BYTES", 3 * row_bytes)
    tiled = run(node)
    np.testing.assert_allclose(tiled, whole, rtol=1e-6, atol=1e-6)
    assert K._TLS.w.size * 4 <= 3 * row_bytes
    np.testing.assert_allclose(tiled, conv_np(values(tx), values(tw), values(tb), groups=groups, **c),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wdtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("shape,padding", [((2, 5, 9, 7), 1), ((1, 3, 8, 8), 0), ((3, 4, 5, 10), 2),
                                           ((2, 6, 7, 7), (1, 0)), ((1, 2, 4, 3), (0, 2))])
@pytest.mark.parametrize("tiny_chunks", [False, True])
def test_conv2d_winograd(rng, monkeypatch, wdtype, shape, padding, tiny_chunks):
    """3x3 stride-1 convs through F(2x2, 3x3) (conv_winograd.py): odd and even sizes (cut last
    tile row/column), every padding, bias or none, widened weights; with tiny scratch caps the
    batch's tile rows come in many chunks and the filters in several output-channel tiles. It
    must run (counted) and agree with the direct sum as the im2col path does."""
    import sdrt.ops.cpu.conv as K
    import sdrt.ops.cpu.conv_winograd as WG
    calls = []
    monkeypatch.setattr(WG, "MIN_CHANNELS", 1)
    monkeypatch.setattr(WG, "MIN_TILES", 1)
    monkeypatch.setattr(K, "conv_winograd", lambda *a: calls.append(1) or WG.conv_winograd(*a))
    if tiny_chunks:  # 3 output channels per U tile, 1 tile row per chunk
        monkeypatch.setattr(WG, "WINO_BYTES", 64 * shape[1] * 3)
        monkeypatch.setattr(K, "COL_BYTES", 64 * shape[1] * 8)
    N, C, H, W = shape
    tx, tw, tb = leaf(rnd(rng, N, C, H, W)), leaf(rnd(rng, 7, C, 3, 3), wdtype), leaf(rnd(rng, 7))
    for b in (None, tb):
        node = F.conv2d(tx, tw, b, padding=padding)
        want = conv_np(values(tx), values(tw), None if b is None else values(b), padding=padding)
        np.testing.assert_allclose(run(node), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2


def test_conv2d_winograd_where_it_pays():
    """Winograd runs for SD's 32x32-and-larger 3x3 convs with batch 2, not for thin channel
    counts or maps of a few tiles (8x8 with batch 2: 32 tiles)."""
    from sdrt.ops.cpu.conv_winograd import winograd_applies
    assert winograd_applies(320, 320, 2, 64, 64) and winograd_applies(128, 128, 1, 512, 512)
    assert not winograd_applies(4, 320, 2, 64, 64) and not winograd_applies(320, 4, 2, 64, 64)
    assert not winograd_applies(1280, 1280, 2, 8, 8)


def test_conv2d_2d_weight_is_1x1(rng):
    x, w, b = rnd(rng, 2, 5, 3, 4), rnd(rng, 3, 5), rnd(rng, 3)
    node = F.conv2d(leaf(x), leaf(w), leaf(b))  # ne=[C, OC], numpy (OC, C)
    assert node.ne == (4, 3, 3, 2)
    check(node, conv_np(x, w[:, :, None, None], b), rtol=1e-4, atol=1e-4)


def test_conv2d_matches_scipy_correlate(rng):
    from scipy.signal import correlate
    x, w = rnd(rng, 1, 3, 7, 5), rnd(rng, 2, 3, 3, 3)
    exp = np.stack([correlate(x[0].astype(np.float64), w[o].astype(np.float64), mode="valid")[0]
                    for o in range(2)])[None]
    check(F.conv2d(leaf(x), leaf(w)), exp, rtol=1e-4, atol=1e-4)


def test_conv2d_noncontiguous_input(rng):
    x, w = rnd(rng, 2, 3, 7, 5), rnd(rng, 4, 3, 3, 3)
    t = leaf(x, noncontig=True)
    assert not t.is_contiguous()
    check(F.conv2d(t, leaf(w), padding=1, stride=2), conv_np(x, w, padding=1, stride=2), rtol=1e-4, atol=1e-4)
    # a channel slice of a bigger tensor, and a depthwise conv of it
    big = rnd(rng, 2, 6, 7, 5)
    tv = leaf(big).slice(2, 1, 6, 2)  # channels 1, 3, 5
    wd = rnd(rng, 3, 1, 3, 3)
    check(F.conv2d(tv, leaf(wd), groups=3, padding=1), conv_np(big[:, 1::2], wd, groups=3, padding=1),
          rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("parallel", [False, True])
def test_conv2d_3d_input_and_chunked_columns(rng, monkeypatch, parallel):
    import sdrt.ops.cpu.conv as K
    monkeypatch.setattr(K, "COL_BYTES", 64)  # one output row per im2col chunk
    monkeypatch.setattr(K, "SERIAL_BELOW", 0 if parallel else 1 << 62)
    x, w, b = rnd(rng, 3, 9, 7), rnd(rng, 4, 3, 3, 3), rnd(rng, 4)
    node = F.conv2d(leaf(x), leaf(w), leaf(b), padding=1, stride=(1, 2))
    assert node.ne == (7, 5, 4)
    check(node, conv_np(x[None], w, b, padding=1, stride=(1, 2))[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("params", [dict(padding=1), dict(padding=(2, 1), dilation=(2, 1)),
                                    dict(padding=(1, 1), dilation=(1, 3)), dict(padding=(2, 0), kernel=(5, 2))])
def test_conv2d_same_width_rows_chunked(rng, monkeypatch, parallel, params):
    """Stride-1 convs whose output is as wide as the input copy each column row in one piece
    (zeroing the taps that cross a row edge); here one to a few output rows per chunk."""
    import sdrt.ops.cpu.conv as K
    monkeypatch.setattr(K, "SERIAL_BELOW", 0 if parallel else 1 << 62)
    params = dict(params)
    kw, kh = params.pop("kernel", (3, 3))
    x, w, b = rnd(rng, 1, 3, 6, 5), rnd(rng, 4, 3, kh, kw), rnd(rng, 4)
    for col_bytes in (64, 4 * 3 * kh * kw * 5 * 2, 1 << 26):
        monkeypatch.setattr(K, "COL_BYTES", col_bytes)
        check(F.conv2d(leaf(x), leaf(w), leaf(b), **params), conv_np(x, w, b, **params), rtol=1e-4, atol=1e-4)


def test_conv2d_quantized_weight(rng):
    """A Q8_0 weight (K=32 along ne[0]) is dequantized whole; blocks built by hand here."""
    from sdrt.ops import quant
    if not hasattr(quant, "dequantize"):
        pytest.skip("sdrt.ops.quant.dequantize not built yet")
    OC, C, KW = 2, 2, 32
    q = rng.integers(-127, 128, size=(OC, C, 1, KW), dtype=np.int8)
    d = (rng.random((OC, C, 1, 1)) * 0.02 + 0.001).astype(np.float16)
    blocks = np.concatenate([d.view(np.uint8).reshape(OC, C, 1, 2), q.view(np.uint8)], axis=-1)
    tw = Tensor.from_numpy(blocks, dtype="Q8_0")
    assert tw.ne == (KW, 1, C, OC)
    wf = d.astype(np.float32) * q.astype(np.float32)
    x = rnd(rng, 1, C, 3, 40)
    check(F.conv2d(leaf(x), tw, padding=(2, 0)), conv_np(x, wf, padding=(2, 0)), rtol=1e-4, atol=1e-4)


# ---- conv_transpose2d ------------------------------------------------------------------------
CONVT_CASES = {
    "p0_stride1": dict(x=(1, 3, 5, 4), w=(3, 2, 3, 3)),
    "stride2_pad1_outpad1": dict(x=(2, 3, 5, 4), w=(3, 4, 3, 3), stride=2, padding=1, output_padding=1),
    "ggml_p0_stride2": dict(x=(1, 2, 4, 5), w=(2, 3, 2, 2), stride=2),
    "xy_differ": dict(x=(1, 2, 5, 3), w=(2, 3, 3, 2), stride=(3, 2), padding=(1, 0), output_padding=(2, 0)),
    "dilation2": dict(x=(1, 2, 4, 4), w=(2, 2, 3, 3), dilation=2, padding=1, stride=2),
}


@pytest.mark.parametrize("case", sorted(CONVT_CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose2d(rng, case, bias):
    c = dict(CONVT_CASES[case])
    x, w = rnd(rng, *c.pop("x")), rnd(rng, *c.pop("w"))
    b = rnd(rng, w.shape[1]) if bias else None
    full = {**dict(stride=1, padding=0, output_padding=0, dilation=1), **c}
    pair = {k: (v, v) if isinstance(v, int) else v for k, v in full.items()}
    node = F.conv_transpose2d(leaf(x), leaf(w), None if b is None else leaf(b), **c)
    check(node, conv_transpose_np(x, w, b, **pair), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wdtype", ["F16", "BF16"])
def test_conv_transpose2d_dtypes_chunked_noncontig(rng, wdtype, monkeypatch):
    import sdrt.ops.cpu.conv as K
    monkeypatch.setattr(K, "COL_BYTES", 64)
    x = rnd(rng, 2, 3, 5, 4)
    tx, tw = leaf(x, noncontig=True), leaf(rnd(rng, 3, 2, 3, 3), wdtype)
    node = F.conv_transpose2d(tx, tw, stride=2, padding=1)
    check(node, conv_transpose_np(x, values(tw), None, (2, 2), (1, 1), (0, 0), (1, 1)), rtol=1e-4, atol=1e-4)


# ---- conv1d / conv3d -------------------------------------------------------------------------
@pytest.mark.parametrize("params", [dict(), dict(stride=2, padding=1), dict(dilation=2, padding=3),
                                    dict(groups=2, padding=1), dict(groups=4, padding=2, stride=3)])
@pytest.mark.parametrize("wdtype", FLOATS)
def test_conv1d(rng, params, wdtype):
    g = params.get("groups", 1)
    tx, tw = leaf(rnd(rng, 2, 4, 11)), leaf(rnd(rng, 4, 4 // g, 3), wdtype)
    tb = leaf(rnd(rng, 4))
    node = F.conv1d(tx, tw, tb, **params)
    check(node, conv_np(values(tx), values(tw), values(tb), **params), rtol=1e-4, atol=1e-4)


def test_conv1d_2d_input(rng):
    x, w = rnd(rng, 3, 10), rnd(rng, 2, 3, 4)
    node = F.conv1d(leaf(x), leaf(w), padding=1)
    assert node.ne == (9, 2)
    check(node, conv_np(x[None], w, padding=1)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("params", [dict(padding=1), dict(stride=(2, 1, 2), padding=(1, 0, 1)),
                                    dict(dilation=(1, 2, 1), padding=(0, 2, 1))])
def test_conv3d(rng, params, monkeypatch):
    import sdrt.ops.cpu.conv as K
    monkeypatch.setattr(K, "COL_BYTES", 4096)  # several (od, oy) row chunks
    N, IC, OC = 2, 3, 4
    x = rnd(rng, N, IC, 5, 6, 7)
    w = rnd(rng, OC, IC, 3, 3, 2)
    b = rnd(rng, OC)
    tx = leaf(x.reshape(N * IC, 5, 6, 7))
    tw = leaf(w.reshape(OC * IC, 3, 3, 2), "F16")
    node = F.conv3d(tx, tw, leaf(b), ic=IC, **params)
    exp = conv_np(x, values(tw).reshape(w.shape), b, **params)
    assert node.ne == exp.shape[2:][::-1] + (N * OC,)
    check(node, exp.reshape((N * OC,) + exp.shape[2:]), rtol=1e-4, atol=1e-4)


def test_conv3d_default_ic_is_one_batch(rng):
    x, w = rnd(rng, 2, 3, 4, 5), rnd(rng, 3 * 2, 2, 2, 2)
    node = F.conv3d(leaf(x), leaf(w))
    exp = conv_np(x[None], w.reshape(3, 2, 2, 2, 2))
    check(node, exp[0], rtol=1e-4, atol=1e-4)


# ---- pooling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("params", [dict(kernel=2), dict(kernel=3, stride=2, padding=1),
                                    dict(kernel=(3, 2), stride=(1, 2), padding=(1, 0))])
@pytest.mark.parametrize("dtype", FLOATS)
def test_pool2d(rng, kind, params, dtype):
    t = leaf(rnd(rng, 2, 3, 7, 5), dtype)
    node = F.pool2d(t, kind, **params)
    k = params["kernel"]
    k = (k, k) if isinstance(k, int) else k
    s = params.get("stride", k)
    s = (s, s) if isinstance(s, int) else s
    p = params.get("padding", 0)
    p = (p, p) if isinstance(p, int) else p
    check(node, pool_np(values(t), kind, k, s, p), rtol=1e-5, atol=1e-5)


def test_pool2d_noncontiguous(rng):
    x = rnd(rng, 2, 3, 6, 5)
    check(F.pool2d(leaf(x, noncontig=True), "max", 2), pool_np(x, "max", (2, 2), (2, 2), (0, 0)))


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("params", [dict(kernel=2), dict(kernel=3, stride=2, padding=1)])
def test_pool1d(rng, kind, params):
    x = rnd(rng, 2, 3, 11)
    node = F.pool1d(leaf(x), kind, **params)
    k = params["kernel"]
    check(node, pool_np(x, kind, (k,), (params.get("stride", k),), (params.get("padding", 0),)))


# ---- errors ----------------------------------------------------------------------------------
def test_errors_name_the_op(rng):
    x = leaf(rnd(rng, 1, 4, 6, 6))
    with pytest.raises(OpError, match=r"conv2d\(F32\[6, 6, 4, 1\], F32\[3, 3, 3, 5\]\): weight has 3 input channels"):
        F.conv2d(x, leaf(rnd(rng, 5, 3, 3, 3)))
    with pytest.raises(OpError, match=r"conv2d.*groups=3 must divide C=4"):
        F.conv2d(x, leaf(rnd(rng, 6, 1, 3, 3)), groups=3)
    with pytest.raises(OpError, match=r"conv2d.*kernel 7 .* does not fit input 6"):
        F.conv2d(x, leaf(rnd(rng, 5, 4, 7, 7)))
    with pytest.raises(OpError, match=r"conv2d.*bias has 4 elements, expected OC=5"):
        F.conv2d(x, leaf(rnd(rng, 5, 4, 3, 3)), leaf(rnd(rng, 4)))
    with pytest.raises(OpError, match=r"conv2d: stride must be >= 1"):
        F.conv2d(x, leaf(rnd(rng, 5, 4, 3, 3)), stride=0)
    with pytest.raises(OpError, match=r"conv2d: padding needs 2 values"):
        F.conv2d(x, leaf(rnd(rng, 5, 4, 3, 3)), padding=(1, 1, 1))
    with pytest.raises(OpError, match=r"conv2d\(I32.*input must be F32/F16/BF16"):
        F.conv2d(Tensor.from_numpy(np.zeros((1, 4, 6, 6), np.int32)), leaf(rnd(rng, 5, 4, 3, 3)))
    with pytest.raises(OpError, match=r"conv2d: circular needs 2 values"):
        F.conv2d(x, leaf(rnd(rng, 5, 4, 3, 3)), circular=(True,))
    with pytest.raises(OpError, match=r"conv2d.*weight must be a float .* got I32"):
        F.conv2d(x, Tensor.from_numpy(np.zeros((5, 4, 3, 3), np.int32)))
    with pytest.raises(OpError, match=r"conv1d.*input has 4 dims"):
        F.conv1d(x, leaf(rnd(rng, 2, 4, 3)))
    with pytest.raises(OpError, match=r"conv3d.*not a multiple of IC=3"):
        F.conv3d(x, leaf(rnd(rng, 6, 3, 3, 3)), ic=3)
    with pytest.raises(OpError, match=r"conv_transpose2d.*must equal input channels C=4"):
        F.conv_transpose2d(x, leaf(rnd(rng, 3, 2, 3, 3)))
    with pytest.raises(OpError, match=r"conv_transpose2d.*output_padding 2 must be smaller"):
        F.conv_transpose2d(x, leaf(rnd(rng, 4, 2, 3, 3)), stride=2, output_padding=2)
    with pytest.raises(OpError, match=r"pool2d.*kind must be 'avg' or 'max'"):
        F.pool2d(x, "sum")
    with pytest.raises(OpError, match=r"pool2d.*kernel 8 does not fit input 6"):
        F.pool2d(x, "max", 8)
