"""The int8-activation quantized GEMM (sdrt/ops/quant/_qgemm.h), every code path forced.

References are numpy, independent of the kernel:
- `model_gemm`: the kernel's arithmetic written out in numpy — activations quantized per
  32-block (`_quantize_x`: ggml's Q8_0 / Q8_1 for the 32-block types, q = rne(x * 127/amax) with
  d = f16(amax/127); float32 d = amax/127 for the K-quants), exact integer block sums (int64), then the float32
  fma chain acc = fma(I, a*d, acc) [+ fma(b, d*sum(q), acc)] in K order (fma emulated in float64
  then rounded: exact for these magnitudes, see below). The weights' (q, a, b) per block come
  from gguf's numpy dequantizer (w = a*q + b solved per block), not from sdrt.
- dequantize-then-matmul in float64, within `error_bound` (the activation rounding).
Every path this CPU runs must equal the portable C path bit for bit (the SIMD paths do the same
float operations on exact integer sums); the portable path runs everywhere, so CI on a CPU
without AVX-512 VNNI still checks the arithmetic the VNNI path performs.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from sdrt.errors import OpError
from sdrt.ops import dtypes, quant
from sdrt.ops.quant import gemm as qg

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"]
PATHS = list(qg.PATHS)


def _weights(name, n, k, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
    raw = quant.quantize(w, name).reshape(n, -1)
    deq = gguf_dequantize(raw, GGMLQuantizationType[name]).astype(np.float32).reshape(n, k)
    return raw, deq


def _quantize_x(x, f16_scale):
    """Per 32-block: ggml's quantize_row_q8_0 / q8_1 for f16_scale (q = rne(x * (127 / amax)),
    d = f16(amax / 127), s = f16(d * sum(q)) with the float d), else sdrt's float32 d = amax / 127,
    q = rne(x * (1 / d)), s = d * sum(q)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    if f16_scale:
        inv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    else:
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int64)
    s = (d * q.sum(axis=2).astype(np.float32)).astype(np.float32)
    if f16_scale:
        with np.errstate(over="ignore"):  # s past f16's range: inf, as in ggml (unused by Q8_0)
            d, s = d.astype(np.float16).astype(np.float32), s.astype(np.float16).astype(np.float32)
    return q, d, s


def model_gemm(x, raw, name):
    """The kernel's arithmetic in numpy (see the module docstring)."""
    dt = dtypes.get(name)
    n = raw.shape[0]
    k = x.shape[1]
    deq = gguf_dequantize(raw, GGMLQuantizationType[name]).astype(np.float32).reshape(n, k // 32, 32)
    # recover (q, a, b) per block: b = 0 for the symmetric types; otherwise the block's offset
    qx, dx, sx = _quantize_x(x, f16_scale=name not in ("Q4_K", "Q5_K"))
    qw, a, b = _block_params(raw, name, n, k)
    np.testing.assert_array_equal((a[..., None] * qw.astype(np.float32) + b[..., None]).astype(np.float32)
                                  if name in ("Q4_1", "Q5_1") else deq, deq)
    ints = np.einsum("mbe,nbe->mnb", qx, qw.astype(np.int64))      # exact block sums
    acc = np.zeros((x.shape[0], n), np.float32)
    for kb in range(k // 32):
        sc = (a[None, :, kb] * dx[:, kb, None]).astype(np.float32)
        acc = (ints[:, :, kb].astype(np.float64) * sc + acc).astype(np.float32)  # one rounding: fma
        if dt.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            acc = (b[None, :, kb].astype(np.float64) * sx[:, kb, None] + acc).astype(np.float32)
    return acc


def _f16(raw_u8):
    return raw_u8.copy().view(np.float16).astype(np.float32)


def _block_params(raw, name, n, k):
    """(q int [n, KB, 32], a [n, KB], b [n, KB]) straight from the block bytes (ggml layouts)."""
    kb = k // 32
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        size = dtypes.get(name).type_size
        blk = raw.reshape(n, kb, size)
        a = _f16(blk[..., 0:2]).reshape(n, kb)
        b = np.zeros_like(a)
        if name == "Q8_0":
            return blk[..., 2:].view(np.int8).astype(np.int64), a, b
        off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
        qs = blk[..., off:off + 16].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if name in ("Q4_1", "Q5_1"):
            b = _f16(blk[..., 2:4]).reshape(n, kb)
        if name in ("Q5_0", "Q5_1"):
            qh = blk[..., off - 4:off].copy().view(np.uint32).astype(np.int64)  # [n, kb, 1]
            q = q | (((qh >> np.arange(32)) & 1) << 4)
        if name in ("Q4_0", "Q5_0"):
            q = q - (8 if name == "Q4_0" else 16)
        return q, a, b
    size = dtypes.get(name).type_size
    blk = raw.reshape(n, k // 256, size)
    d, dmin = _f16(blk[..., 0:2])[..., 0], _f16(blk[..., 2:4])[..., 0]
    s = blk[..., 4:16].astype(np.int64)
    sc = np.empty(s.shape[:-1] + (8,), np.int64)
    mn = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4)
            mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    a = (d[..., None] * sc.astype(np.float32)).astype(np.float32).reshape(n, kb)
    b = (-(dmin[..., None] * mn.astype(np.float32))).astype(np.float32).reshape(n, kb)
    ql = blk[..., 16:144] if name == "Q4_K" else blk[..., 48:176]
    ql = ql.astype(np.int64).reshape(n, k // 256, 4, 32)
    q = np.stack([ql & 15, ql >> 4], axis=3).reshape(n, k // 256, 8, 32)
    if name == "Q5_K":
        qh = blk[..., 16:48].astype(np.int64)  # [n, S, 32]
        q = q + (((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4)
    return q.reshape(n, kb, 32), a, b


def _run(x, raw, name, path, nthreads=2):
    out = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    qg.qgemm(x, raw, dtypes.get(name), out, path, nthreads)
    return out


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m,n", [(1, 1), (5, 33), (9, 64), (3, 70)])
def test_paths_bit_identical_and_match_model(name, m, n):
    k = 512
    raw, deq = _weights(name, n, k, seed=m * 100 + n)
    x = np.random.default_rng(n).standard_normal((m, k)).astype(np.float32)
    x[:, 32:64] = 0.0  # an all-zero activation block: scale 0
    ref_model = model_gemm(x, raw, name)
    ref = x.astype(np.float64) @ deq.T.astype(np.float64)
    bound = qg.error_bound(x, deq, f16_scale=name not in ("Q4_K", "Q5_K"))
    scalar = _run(x, raw, name, "scalar", 1)
    np.testing.assert_allclose(scalar, ref_model, rtol=2e-6, atol=2e-6 * np.abs(ref_model).max())
    assert np.all(np.abs(scalar - ref) <= bound), np.max(np.abs(scalar - ref) / bound)
    for path in qg.available_paths():
        for nt in (1, 2):
            got = _run(x, raw, name, path, nt)
            np.testing.assert_array_equal(got, scalar, err_msg=f"{path} x{nt} threads")


def test_extreme_weight_values():
    # Q8_0 blocks holding -128 and 127 (not made by ggml's quantizer, legal in a file) and
    # activations at +-amax: the AVX2 sign trick and VNNI's u8 offset must stay exact
    n, k = 40, 256
    raw, _ = _weights("Q8_0", n, k, seed=1)
    blk = raw.reshape(n, k // 32, 34)
    blk[:, :, 2:] = np.where(np.random.default_rng(2).random((n, k // 32, 32)) < 0.5, 0x80, 0x7F).astype(np.uint8)
    x = np.where(np.random.default_rng(3).random((6, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    want = model_gemm(x, raw, "Q8_0")
    for path in qg.available_paths():
        np.testing.assert_array_equal(_run(x, raw, "Q8_0", path), want if path == "scalar" else _run(x, raw, "Q8_0", "scalar"))
    np.testing.assert_allclose(_run(x, raw, "Q8_0", "scalar"), want, rtol=1e-6)


def test_strided_rows_and_mul_mat_dispatch(monkeypatch):
    from opcheck import run

    from sdrt.ops import api as F
    from sdrt.ops.tensor import Tensor
    n, k, m = 48, 256, 7
    raw, deq = _weights("Q4_0", n, k, seed=4)
    x = np.random.default_rng(5).standard_normal((m, k)).astype(np.float32)
    tw = Tensor.from_numpy(raw, dtype="Q4_0")
    for path in qg.available_paths():
        monkeypatch.setenv("SDRT_QGEMM", path)
        got = run(F.mul_mat(tw, Tensor.from_numpy(x)))
        np.testing.assert_array_equal(got, _run(x, raw, "Q4_0", "scalar"))
    monkeypatch.setenv("SDRT_QGEMM", "off")
    got = run(F.mul_mat(tw, Tensor.from_numpy(x)))
    np.testing.assert_allclose(got, x.astype(np.float64) @ deq.T, rtol=1e-5, atol=1e-4)
    # a strided output (every other column of a wider array)
    big = np.zeros((m, 2 * n), np.float32)
    xs = np.zeros((m, k + 64), np.float32)
    xs[:, :k] = x
    qg.qgemm(xs[:, :k], raw, dtypes.get("Q4_0"), big[:, :n], "scalar", 2)
    np.testing.assert_array_equal(big[:, :n], _run(x, raw, "Q4_0", "scalar"))


def test_path_choice_errors(monkeypatch):
    monkeypatch.setenv("SDRT_QGEMM", "fastest")
    with pytest.raises(OpError, match="SDRT_QGEMM='fastest'"):
        qg.active_path()
    monkeypatch.setenv("SDRT_QGEMM", "off")
    assert qg.active_path() is None
    monkeypatch.setenv("SDRT_QGEMM", "auto")
    simd = [p for p in qg.available_paths() if p != "scalar"]
    assert qg.active_path() == (simd[0] if simd else None)
    monkeypatch.setattr(qg, "available_paths", lambda: ("scalar",))  # a CPU without AVX2 (or not x86)
    assert qg.active_path() is None
    with pytest.raises(OpError, match="expected one of"):
        qg.set_path("avx9000")
    assert "scalar" in qg.available_paths()
    assert not qg.supports(dtypes.get("Q6_K"), 256) and not qg.supports(dtypes.get("Q8_0"), 48)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1"])
def test_activation_blocks_are_ggml_q8(name):
    # Weight rows that pick one activation element each (unit q, scale 1.0, no offset) make the
    # output the quantized activation itself, d * q, exactly: it must be ggml's quantize_row_q8_0
    # (q = rne(x * (127 / amax)), d = f16(amax / 127), round to nearest even, f16 subnormals
    # kept) for every block, from amaxes whose d is an f16 subnormal up to 1e6 (Q4_1 takes Q8_1's
    # scale the same way; its s term is 0 here: offset 0)
    k = 32
    rng = np.random.default_rng(7)
    # (Q8_1's s = f16(d * sum(q)) overflows past amax ~2047, to inf as in ggml: Q4_1 stops at 100)
    amax = np.array([1e-6, 3e-4, 7.8e-3, 0.01, 0.5, 1.0, 3.0, 100.0] + ([1e6] if name == "Q8_0" else []), np.float32)
    amax = np.concatenate([amax, (10.0 ** rng.uniform(-9, 4 if name == "Q8_0" else 2, 300)).astype(np.float32)])
    x = (rng.uniform(-1, 1, (len(amax), k)) * amax[:, None]).astype(np.float32)
    x[np.arange(len(amax)), rng.integers(0, k, len(amax))] = amax   # the block's amax itself
    x[0, :4] = np.float32(0.5) * amax[0] / np.float32(127) * np.array([1, 3, 5, -7], np.float32)  # ties
    if name == "Q8_0":
        blk = np.zeros((k, 1, 34), np.uint8)
        blk[:, 0, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
        blk[np.arange(k), 0, 2 + np.arange(k)] = 1
    else:  # Q4_1: d = 1, m = 0, nibbles 1 at one position (q j and j + 16 share a byte)
        blk = np.zeros((k, 1, 20), np.uint8)
        blk[:, 0, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
        e = np.arange(k)
        blk[e, 0, 4 + e % 16] = np.where(e < 16, 1, 16).astype(np.uint8)
    raw = blk.reshape(k, -1)
    q, d, _ = _quantize_x(x, f16_scale=True)
    want = (q[:, 0, :].astype(np.float64) * d[:, 0, None]).astype(np.float32)
    assert np.all(d[:2, 0] < np.float32(2.0 ** -14)) and np.all(np.isfinite(want))  # f16 subnormal scales
    for path in qg.available_paths():
        np.testing.assert_array_equal(_run(x, raw, name, path), want, err_msg=path)
