"""The bf16 GEMM (sdrt/ops/cpu/_bf16gemm.h), every code path forced.

References are numpy, independent of the kernel:
- `model_gemm`: vdpbf16ps's arithmetic written out — operands rounded to bfloat16 (here by frexp
  and round-half-even on 8 significant bits, not the kernel's bit trick), then per output the
  float32 chain acc = fma(a[2p+1], b[2p+1], acc); acc = fma(a[2p], b[2p], acc) over k pairs. A
  product of two bf16 values is exact in float64 and the float64 sum rounded once to float32 is
  the correctly rounded fma (no under/overflow at these magnitudes), so the model is exact.
- the float64 product of the unrounded operands, within `error_bound`.
Every path this CPU runs must equal the model bit for bit; the portable C path runs everywhere,
so CI on a CPU without AVX512_BF16 still checks the arithmetic the SIMD path performs, and where
the host has it the SIMD path is also held to the portable one on subnormals, infinities, NaN.
"""
from __future__ import annotations

import numpy as np
import pytest
from opcheck import leaf, run, values

from sdrt.errors import OpError
from sdrt.ops import api as F, weight_policy
from sdrt.ops.cpu import bf16gemm as bg
from sdrt.ops.cpu import conv as cpu_conv
from sdrt.ops.cpu.conv_winograd import winograd_applies

PATHS = [p for p in bg.PATHS if p in bg.available_paths()]
pytestmark = pytest.mark.skipif(bg._k is None, reason="the bf16 GEMM extension is not built")


@pytest.fixture(autouse=True)
def _no_f32_model(monkeypatch):
    """A model loaded with --type f32 earlier in the session turns the kernel off: not here."""
    monkeypatch.setattr(weight_policy, "f32_type", False)


def to_bf16(x):
    """float32 -> bfloat16 values (as float64): 8 significant bits, round half to even;
    float32 subnormals -> signed zero (as the kernel's packing)."""
    x = np.asarray(x, np.float32).astype(np.float64)
    m, e = np.frexp(x)
    r = np.ldexp(np.round(m * 256.0) / 256.0, e)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(0.0, x), r)


def model_gemm(a, b):
    """The kernel's arithmetic in numpy: a [M, K], b [K, N] float32 (see the module docstring)."""
    ab, bb = to_bf16(a), to_bf16(b)
    k = a.shape[1]
    if k % 2:
        ab = np.concatenate([ab, np.zeros((ab.shape[0], 1))], axis=1)
        bb = np.concatenate([bb, np.zeros((1, bb.shape[1]))], axis=0)
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for p in range(ab.shape[1] // 2):
        for j in (2 * p + 1, 2 * p):
            acc = (acc.astype(np.float64) + np.outer(ab[:, j], bb[j])).astype(np.float32)
    return acc


def _data(rng, m, k, n):
    a = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, k)))).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    return a, b


def _gemm(a, at, b, bt, path):
    out = np.full((a.shape[0], b.shape[1]), np.nan, np.float32)
    bg.gemm(a, at, b, bt, out, path, 2)
    return out


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint32)


# M, N, K around the micro-tile (6 x 64), the task tile (96 x 256) and the K block (192)
SHAPES = [(1, 1, 1), (5, 63, 7), (6, 64, 2), (7, 65, 193), (97, 257, 385), (13, 300, 1000)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_model_bit_exact(rng, path, m, n, k):
    a, b = _data(rng, m, k, n)
    got = _gemm(a, "F32", b, "F32", path)
    np.testing.assert_array_equal(_bits(got), _bits(model_gemm(a, b)))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert (np.abs(got - ref) <= bg.error_bound(bg.round_bf16(a), bg.round_bf16(b), a, b)).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("wtype", ["F16", "BF16"])
def test_weight_storage_and_strides(rng, path, wtype):
    """A weight [N, K] in F16/BF16 storage, passed as its transpose view (mul_mat's use), and as
    the left operand with float32 columns (the convolutions' use); strided activations."""
    m, k, n = 11, 130, 70
    a, w = _data(rng, m, k, n)[0], rng.standard_normal((n, k)).astype(np.float32)
    if wtype == "F16":
        raw = w.astype(np.float16).view(np.uint16)
        wv = raw.view(np.float16).astype(np.float32)
    else:
        raw = (bg.round_bf16(w).view(np.uint32) >> 16).astype(np.uint16)
        wv = (raw.astype(np.uint32) << 16).view(np.float32)
    want = model_gemm(a, wv.T)
    np.testing.assert_array_equal(_bits(_gemm(a, "F32", raw.T, wtype, path)), _bits(want))
    wide = np.zeros((m, 2 * k), np.float32)
    wide[:, ::2] = a
    np.testing.assert_array_equal(_bits(_gemm(wide[:, ::2], "F32", raw.T, wtype, path)), _bits(want))
    cols = np.ascontiguousarray(a.T)          # [K, M]: out[N, M] = W @ cols
    np.testing.assert_array_equal(_bits(_gemm(raw, wtype, cols, "F32", path)), _bits(model_gemm(wv, a.T)))


def test_simd_equals_portable_on_special_values(rng):
    """Subnormals (read as zero / flushed), infinities, NaN, overflow: the SIMD path against
    the portable model of the instruction, bit for bit."""
    if "avx512bf16" not in PATHS:
        pytest.skip("this CPU has no AVX512_BF16: the portable path is checked against numpy above")
    m, k, n = 13, 90, 70
    a, b = _data(rng, m, k, n)
    tiny = np.finfo(np.float32).tiny
    a.flat[rng.choice(a.size, 60, replace=False)] = rng.uniform(-1, 1, 60).astype(np.float32) * tiny
    b.flat[rng.choice(b.size, 60, replace=False)] = rng.uniform(-4, 4, 60).astype(np.float32) * tiny
    a[0, :] = 1e-20      # products of 1e-40: subnormal results, flushed
    b[:, 1] = 1e-20
    a[1, 3], a[2, 5], b[7, 9] = np.inf, np.nan, -np.inf
    a[3, :] = 3e38       # overflow to infinity
    b[:, 2] = 3e38
    bits = [_bits(_gemm(a, "F32", b, "F32", p)) for p in ("scalar", "avx512bf16")]
    np.testing.assert_array_equal(bits[0], bits[1])


def test_simd_equals_portable_on_f16_weights(rng):
    """Every float16 bit pattern (subnormals, infinities, NaN) as a weight, both operand roles."""
    if "avx512bf16" not in PATHS:
        pytest.skip("this CPU has no AVX512_BF16: the portable path is checked against numpy above")
    raw = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(512, 128)
    x = rng.standard_normal((7, 128)).astype(np.float32)
    for a, at, b, bt in [(x, "F32", raw.T, "F16"), (raw, "F16", np.ascontiguousarray(x.T), "F32")]:
        bits = [_bits(_gemm(a, at, b, bt, p)) for p in ("scalar", "avx512bf16")]
        np.testing.assert_array_equal(bits[0], bits[1])


def test_round_bf16_matches_independent_rounding(rng):
    x = (rng.standard_normal(100000) * np.exp(rng.uniform(-20, 20, 100000))).astype(np.float32)
    x[:4] = [0.0, -0.0, 1e-40, -1e-40]
    np.testing.assert_array_equal(bg.round_bf16(x).astype(np.float64), to_bf16(x))


def test_selector(monkeypatch):
    monkeypatch.setenv("SDRT_BF16GEMM", "bogus")
    with pytest.raises(OpError, match="SDRT_BF16GEMM"):
        bg.active_path()
    monkeypatch.setenv("SDRT_BF16GEMM", "off")
    assert bg.active_path() is None and bg.path_for("F16") is None
    monkeypatch.setenv("SDRT_BF16GEMM", "auto")
    assert bg.active_path() == ("avx512bf16" if "avx512bf16" in PATHS else None)
    assert bg.path_for("F32") is None and bg.path_for("Q8_0") is None
    with bg.using_path("scalar"):
        assert bg.path_for("BF16") == "scalar"
    for p in bg.PATHS:
        if p not in PATHS:
            with bg.using_path(p), pytest.raises(OpError, match="lacks"):
                bg.active_path()
    with pytest.raises(OpError):
        bg.set_path("fast")
    with bg.using_path("scalar"):           # --type f32 wins over any setting, until another type
        weight_policy.follow_weight_type("f32")
        assert bg.active_path() is None and bg.path_for("F16") is None
        weight_policy.follow_weight_type(None)
        assert bg.active_path() == "scalar"
    with pytest.raises(OpError, match="do not match"):
        bg.gemm(np.zeros((2, 3), np.float32), "F32", np.zeros((4, 2), np.float32), "F32",
                np.zeros((2, 2), np.float32), "scalar", 1)


# ---- through the ops: mul_mat and the convolutions with F16/BF16 weights ----------------------
def _conv_np(x, w, pad):
    """Tap-by-tap sum in float64: x (N, C, H, W), w (OC, C, KH, KW), stride 1."""
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    out = np.zeros((n, oc, oh, ow))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("ncyx,oc->noyx", xp[:, :, i:i + oh, j:j + ow], w[:, :, i, j].astype(np.float64))
    return out


def _op_bound(xv, wv, xf, wf):
    """|op - exact| bound from bg.error_bound on the GEMM the op runs (rows: x, cols: w)."""
    return bg.error_bound(bg.round_bf16(xv), bg.round_bf16(wv), xf, wf)


@pytest.mark.parametrize("wdt", ["F16", "BF16"])
def test_mul_mat_paths(rng, wdt):
    k, n, m = 200, 70, 9
    tw = leaf(rng.standard_normal((n, k)) / 10, wdt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wv = values(tw)
    node = F.mul_mat(tw, leaf(x))
    with bg.using_path("off"):
        exact = run(node)
    np.testing.assert_allclose(exact, x @ wv.T, rtol=1e-5, atol=1e-5)
    got = {}
    for p in PATHS:
        with bg.using_path(p):
            got[p] = run(node)
        np.testing.assert_array_equal(_bits(got[p]), _bits(model_gemm(x, wv.T)))
        assert (np.abs(got[p] - x.astype(np.float64) @ wv.T) <= _op_bound(x, wv.T, x, wv.T)).all()
    assert not np.array_equal(got[PATHS[0]], exact)  # the forced path really ran


def test_f32_weights_stay_exact(rng):
    k, n, m = 64, 33, 5
    tw = leaf(rng.standard_normal((n, k)), "F32")
    x = rng.standard_normal((m, k)).astype(np.float32)
    node = F.mul_mat(tw, leaf(x))
    with bg.using_path("off"):
        exact = run(node)
    for p in PATHS:
        with bg.using_path(p):
            np.testing.assert_array_equal(run(node), exact)


@pytest.mark.parametrize("wdt", ["F16", "BF16"])
@pytest.mark.parametrize("n,c,hw,oc,ksz,pad", [(2, 8, 6, 12, 3, 1),     # merged batch GEMM
                                              (1, 5, 40, 7, 3, 1),     # per item, column chunks
                                              (2, 16, 9, 40, 1, 0),    # pointwise, merged
                                              (1, 40, 34, 36, 3, 1)])  # im2col (Winograd off)
def test_conv2d_paths(rng, monkeypatch, wdt, n, c, hw, oc, ksz, pad):
    monkeypatch.setattr(cpu_conv, "WINOGRAD", False)
    x = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
    tw = leaf(rng.standard_normal((oc, c, ksz, ksz)) / np.sqrt(c * ksz * ksz), wdt)
    wv = values(tw)
    node = F.conv2d(leaf(x), tw, stride=1, padding=pad)
    ref = _conv_np(x, wv, pad)
    # the op's GEMM per output: the K = C*KH*KW window of x against the weight row
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (ksz, ksz), axis=(2, 3))  # n c oh ow kh kw
    cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(-1, c * ksz * ksz)          # (n oh ow, K)
    bound = _op_bound(cols, wv.reshape(oc, -1).T, cols, wv.reshape(oc, -1).T)
    bound = bound.reshape(n, hw + 2 * pad - ksz + 1, -1, oc).transpose(0, 3, 1, 2)
    want = model_gemm(cols, wv.reshape(oc, -1).T).reshape(bound.shape[0], bound.shape[2], bound.shape[3], oc)
    want = want.transpose(0, 3, 1, 2)
    for p in PATHS:
        with bg.using_path(p):
            got = run(node)
        assert (np.abs(got - ref) <= bound).all(), p
        np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("wdt", ["F16", "BF16"])
def test_conv2d_winograd_bf16(rng, wdt):
    """3x3 convs Winograd takes: its 16 products in bf16. The transforms mix up to 16 inputs and 9
    taps, so the bound is the bf16 unit (2^-8) per operand times the transforms' gains (4 for V,
    9/4 for U, 9 for the output) on the tap-by-tap sum of |x||w|; all paths bit-identical."""
    n, c, hw, oc = 2, 40, 18, 36
    assert winograd_applies(c, oc, n, hw, hw)
    x = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
    tw = leaf(rng.standard_normal((oc, c, 3, 3)) / np.sqrt(9 * c), wdt)
    wv = values(tw)
    node = F.conv2d(leaf(x), tw, stride=1, padding=1)
    ref = _conv_np(x, wv, 1)
    bound = 2.0 ** -8 * (4 + 9 / 4) * 9 * _conv_np(np.abs(x), np.abs(wv), 1) + 1e-6
    with bg.using_path("off"):
        exact = run(node)
    got = {}
    for p in PATHS:
        with bg.using_path(p):
            got[p] = run(node)
        assert (np.abs(got[p] - ref) <= bound).all(), p
        rel = np.sqrt(((got[p] - ref) ** 2).mean() / (ref ** 2).mean())
        assert rel < 4e-3, rel
        assert not np.array_equal(got[p], exact)
    for p in PATHS[1:]:
        np.testing.assert_array_equal(_bits(got[p]), _bits(got[PATHS[0]]))


def test_cpu_without_bf16_keeps_exact_path(rng, monkeypatch):
    """A CPU without AVX512_BF16 (simulated): auto picks no kernel (never the slow portable
    model) and F16 weights take the exact widen + BLAS path, bit for bit."""
    k, n, m = 96, 40, 7
    tw = leaf(rng.standard_normal((n, k)), "F16")
    x = rng.standard_normal((m, k)).astype(np.float32)
    node = F.mul_mat(tw, leaf(x))
    with bg.using_path("off"):
        exact = run(node)
    monkeypatch.setattr(bg, "available_paths", lambda: ("scalar",))
    with bg.using_path("auto"):
        assert bg.active_path() is None
        np.testing.assert_array_equal(run(node), exact)
        with pytest.raises(OpError, match="lacks"), bg.using_path("avx512bf16"):
            bg.active_path()


def test_attention_bf16_products(rng):
    """Self-attention with >= BF16_MIN_KEYS keys: both products in bf16 on every forced path
    (bit-identical across paths), close to float64 softmax attention; fewer keys stay exact."""
    from sdrt.ops.cpu import attention as cpu_att
    from sdrt.ops.tensor import Tensor
    n, h, lq, d = 1, 2, 70, 40
    for lk, bf in ((cpu_att.BF16_MIN_KEYS + 44, True), (77, False)):
        q, k, v = (rng.standard_normal((n, h, ll, d)).astype(np.float32) for ll in (lq, lk, lk))
        node = F.attention(Tensor.from_numpy(q), Tensor.from_numpy(k), Tensor.from_numpy(v), scale=1 / np.sqrt(d))
        s = np.einsum("nhqd,nhkd->nhqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("nhqk,nhkd->nhqd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
        with bg.using_path("off"):
            exact = run(node)
        got = {}
        for path in PATHS:
            with bg.using_path(path):
                got[path] = run(node)
            err = got[path].reshape(ref.shape) - ref
            assert np.sqrt((err ** 2).mean() / (ref ** 2).mean()) < (2e-2 if bf else 1e-5), path
            assert np.array_equal(got[path], exact) != bf
        for path in PATHS[1:]:
            np.testing.assert_array_equal(_bits(got[path]), _bits(got[PATHS[0]]))
