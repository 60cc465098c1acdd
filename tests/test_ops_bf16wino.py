"""The bf16 Winograd conv (sdrt/ops/cpu/_bf16wino.h), every code path forced, held bit for bit to
a numpy model of its arithmetic: the F(2x2, 3x3) filter and input transforms in float32 (the same
formulas, the same order of operations), both rounded to bfloat16, vdpbf16ps's float32 chain over
channel pairs per transform entry (test_ops_bf16gemm.model_gemm), the output transform in float32
plus the bias. The model is independent of the kernel's packing, chunking and blocking, which the
tests vary. The portable C path runs on every host, so CI without AVX512_BF16 checks the
arithmetic too; a float64 direct convolution bounds the whole."""
from __future__ import annotations

import numpy as np
import pytest
from opcheck import leaf, run, values
from test_ops_bf16gemm import _conv_np, model_gemm

from sdrt.errors import OpError
from sdrt.ops import api as F, weight_policy
from sdrt.ops.cpu import bf16gemm as bg
from sdrt.ops.cpu import conv_winograd as cw

PATHS = [p for p in bg.PATHS if p in bg.available_paths()]
pytestmark = pytest.mark.skipif(bg._k is None, reason="the bf16 GEMM extension is not built")
f32 = np.float32


@pytest.fixture(autouse=True)
def _no_f32_model(monkeypatch):
    monkeypatch.setattr(weight_policy, "f32_type", False)


def _g4(a, b, e):
    h = f32(0.5)
    return a, h * (a + b + e), h * (a - b + e), e


def model_filters(w):
    """w (OC, C, 3, 3) float32 -> U (16, OC, C) = G g G^T, float32 in the kernel's order."""
    g = [[w[:, :, i, j] for j in range(3)] for i in range(3)]
    q = [_g4(g[0][j], g[1][j], g[2][j]) for j in range(3)]          # q[j][i]: G g, column j
    u = []
    for i in range(4):
        u.extend(_g4(q[0][i], q[1][i], q[2][i]))
    return np.stack(u)


def model_inputs(x, pad):
    """x (N, C, H, W) float32 -> V (16, C, N*th*tw) = B^T d B per 4x4 patch, tiles row-major."""
    n, c, h, wd = x.shape
    th, tw = -(-(h + 2 * pad - 2) // 2), -(-(wd + 2 * pad - 2) // 2)
    xp = np.zeros((n, c, 2 * th + 2, 2 * tw + 2), f32)
    hh, ww = min(h, 2 * th + 2 - pad), min(wd, 2 * tw + 2 - pad)
    xp[:, :, pad:pad + hh, pad:pad + ww] = x[:, :, :hh, :ww]
    d = [[xp[:, :, i:i + 2 * th:2, j:j + 2 * tw:2] for j in range(4)] for i in range(4)]  # d[row][col]
    cols = [(d[0][s] - d[2][s], d[1][s] + d[2][s], d[2][s] - d[1][s], d[1][s] - d[3][s]) for s in range(4)]
    v = []
    for e in range(4):
        c0, c1, c2, c3 = (cols[s][e] for s in range(4))
        v.extend((c0 - c2, c1 + c2, c2 - c1, c1 - c3))
    return np.stack([t.transpose(1, 0, 2, 3).reshape(c, -1) for t in v]), th, tw


def model_conv(x, w, bias, pad, up=0):
    """The kernel's result: x (N, C, H, W), w (OC, C, 3, 3) float32 values, bias or None."""
    if up:
        x = x.repeat(2, axis=2).repeat(2, axis=3)
    n, c, h, wd = x.shape
    oc = w.shape[0]
    U = model_filters(w)
    V, th, tw = model_inputs(x, pad)
    m = [model_gemm(U[k], V[k]) for k in range(16)]
    s0 = [m[j] + m[4 + j] + m[8 + j] for j in range(4)]
    s1 = [m[4 + j] - m[8 + j] - m[12 + j] for j in range(4)]
    bv = (np.zeros(oc, f32) if bias is None else bias.astype(f32))[:, None]
    quad = [[s0[0] + s0[1] + s0[2] + bv, s0[1] - s0[2] - s0[3] + bv],
            [s1[0] + s1[1] + s1[2] + bv, s1[1] - s1[2] - s1[3] + bv]]
    out = np.zeros((oc, n, 2 * th, 2 * tw), f32)
    for dy in range(2):
        for dx in range(2):
            out[:, :, dy::2, dx::2] = quad[dy][dx].reshape(oc, n, th, tw)
    return out.transpose(1, 0, 2, 3)[:, :, :h + 2 * pad - 2, :wd + 2 * pad - 2]


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


CASES = [  # n, c, h, w, oc, pad, up: odd channels (a half-empty pair), OC under a micro-tile, cut
    (2, 41, 13, 11, 7, 1, 0),       # last row/column, several panels, batch across tile rows
    (1, 34, 6, 9, 13, 1, 1),        # read through the nearest 2x upsample
    (1, 32, 10, 12, 40, 0, 0),      # no padding
]


@pytest.mark.parametrize("wdt", ["F16", "BF16"])
@pytest.mark.parametrize("n,c,h,wd,oc,pad,up", CASES)
@pytest.mark.parametrize("small", [False, True])
def test_winograd_bf16_model(rng, monkeypatch, wdt, n, c, h, wd, oc, pad, up, small):
    """Every path equals the numpy model bit for bit, one chunk or one tile row per chunk with
    one micro-tile of output channels per task; within the transforms' bf16 bound of float64."""
    if small:
        monkeypatch.setattr(cw, "BF16_CHUNK_BYTES", 1)
        monkeypatch.setattr(cw, "BF16_MC", 6)
    x = rng.standard_normal((n, c, h, wd)).astype(f32)
    tw = leaf(rng.standard_normal((oc, c, 3, 3)) / np.sqrt(9 * c), wdt)
    w = values(tw).astype(f32)
    raw = np.ascontiguousarray(tw.numpy()).view(np.uint16).reshape(oc, 9 * c)
    bias = (0.1 * rng.standard_normal(oc)).astype(f32)
    want = model_conv(x, w, bias, pad, up)
    xu = x.repeat(2, axis=2).repeat(2, axis=3) if up else x
    ref = _conv_np(xu, w, pad) + bias[None, :, None, None]
    bound = 2.0 ** -8 * (4 + 9 / 4) * 9 * _conv_np(np.abs(xu), np.abs(w), pad) + 1e-6
    for p in PATHS:
        out = np.full(want.shape, np.nan, f32)
        cw.conv_winograd_bf16(x, raw, wdt, bias, out, pad, pad, p, up)
        np.testing.assert_array_equal(_bits(out), _bits(want), err_msg=p)
        assert (np.abs(out - ref) <= bound).all(), p


def test_conv2d_op_takes_it(rng, monkeypatch):
    """conv2d with F16 weights on a bf16 path runs it for any OC (here 3, the VAE's conv_out);
    an upscale + conv2d graph equals the kernel reading through the upsample, bit for bit."""
    calls = []
    real = cw.conv_winograd_bf16
    monkeypatch.setattr(cw, "conv_winograd_bf16", lambda *a: calls.append(a[-1]) or real(*a))
    x = rng.standard_normal((1, 40, 9, 8)).astype(f32)
    tw = leaf(rng.standard_normal((3, 40, 3, 3)) / np.sqrt(360), "F16")
    w = values(tw).astype(f32)
    up = F.conv2d(F.upscale(leaf(x), scale_factor=2, mode="nearest"), tw, padding=1)
    for p in PATHS:
        with bg.using_path(p):
            got = run(up)
        np.testing.assert_array_equal(_bits(got), _bits(model_conv(x, w, None, 1, up=1)))
    assert len(calls) == len(PATHS)
    with bg.using_path("off"):
        exact = run(up)
    assert len(calls) == len(PATHS)  # the exact path never comes here
    np.testing.assert_allclose(exact, _conv_np(x.repeat(2, 2).repeat(2, 3), w, 1), rtol=1e-4, atol=1e-4)


def test_bad_operands(rng):
    x = np.zeros((1, 32, 8, 8), f32)
    w = np.zeros((4, 32 * 9), np.uint16)
    with pytest.raises(OpError, match="does not fit"):
        cw.conv_winograd_bf16(x, w, "F16", None, np.zeros((1, 4, 9, 8), f32), 1, 1, "scalar")
    with pytest.raises(OpError, match="weight"):
        cw.conv_winograd_bf16(x, w[:, :-1], "F16", None, np.zeros((1, 4, 8, 8), f32), 1, 1, "scalar")


def test_vae_upsample_conv_form(rng):
    """The VAE's upsample conv is built literally (upscale + conv2d, so this kernel takes it) only
    for the CPU with the bf16 path on and an F16/BF16 weight; otherwise the float32 fold, which
    the literal bf16 form matches to bf16 precision."""
    from sdrt.models.vae.autoencoder_kl import upsample_conv3x3
    from sdrt.ops.graph import Graph
    x = leaf(rng.standard_normal((1, 40, 6, 6)))   # ne order [W, H, C, N]
    w = leaf(rng.standard_normal((40, 40, 3, 3)) / np.sqrt(360), "F16")
    b = leaf(0.1 * rng.standard_normal(40), "F16")

    def ops(backend, wt=w):
        return {n.op for n in Graph(upsample_conv3x3(x, wt, b, True, backend)).nodes}
    with bg.using_path("off"):
        assert "conv_transpose2d" in ops("cpu")
        folded = run(upsample_conv3x3(x, w, b, True, "cpu"))
    for p in PATHS:
        with bg.using_path(p):
            assert "conv_transpose2d" not in ops("cpu") and "upscale" in ops("cpu")
            assert "conv_transpose2d" in ops("cuda0") and "conv_transpose2d" in ops(None)
            assert "conv_transpose2d" in ops("cpu", leaf(values(w), "F32"))  # F32 weights stay exact
            got = run(upsample_conv3x3(x, w, b, True, "cpu"))
        rel = np.sqrt(((got - folded) ** 2).mean() / (folded ** 2).mean())
        assert 0 < rel < 4e-3, (p, rel)
