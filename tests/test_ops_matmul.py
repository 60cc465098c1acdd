"""mul_mat / linear / get_rows: every weight dtype against numpy, tiling, batch broadcast, errors.

Expected values are independent of sdrt's dequantizer: gguf.quants (numpy) for the block types
it covers, and the two-line ggml definitions of Q8_1 / Q8_K written out here.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from opcheck import check, leaf, run, values

from sdrt import OpError
from sdrt.ops import api as F
from sdrt.ops import dtypes, quant
from sdrt.ops.cpu import matmul as cpu_mm
from sdrt.ops.tensor import Tensor

FLOAT_W = ["F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F64"]
QUANT_W = [t.name for t in dtypes.QUANT_TYPES]
RTOL = 1e-4


def np_dequant(raw: np.ndarray, name: str) -> np.ndarray:
    """Reference dequantization of raw rows [n, row_bytes] -> float32 [n, ne0]."""
    dt = dtypes.get(name)
    if name == "Q8_1":  # block: half d, half s, int8 qs[32]; x = d * q
        b = raw.reshape(raw.shape[0], -1, dt.type_size)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        return (d * b[..., 4:].view(np.int8)).reshape(raw.shape[0], -1)
    if name == "Q8_K":  # block: float d, int8 qs[256], int16 bsums[16]; x = d * q
        b = raw.reshape(raw.shape[0], -1, dt.type_size)
        d = b[..., 0:4].copy().view(np.float32)
        return (d * b[..., 4:260].view(np.int8)).reshape(raw.shape[0], -1)
    return gguf_dequantize(raw, GGMLQuantizationType[name]).astype(np.float32)


def quant_leaf(name, nrows, k, seed=0, batch=()):
    raw = quant.random_raw(name, int(np.prod(batch, dtype=int)) * nrows, k, seed=seed)
    raw = raw.reshape(tuple(batch) + (nrows, raw.shape[-1]))
    return Tensor.from_numpy(raw, dtype=name), np_dequant(raw.reshape(-1, raw.shape[-1]), name).reshape(
        tuple(batch) + (nrows, k))


def expect_mm(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """numpy order: w (..., N, K), x (..., M, K) -> (..., M, N), w batches repeated as ggml."""
    w4 = w.reshape((1,) * (4 - w.ndim) + w.shape).astype(np.float64)
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape).astype(np.float64)
    w4 = np.repeat(np.repeat(w4, x4.shape[0] // w4.shape[0], 0), x4.shape[1] // w4.shape[1], 1)
    r = x4 @ np.swapaxes(w4, -1, -2)
    return r.reshape(r.shape[4 - max(w.ndim, x.ndim, 2):])


def check_mm(node, expected, rtol=RTOL):
    atol = rtol * max(1.0, float(np.abs(expected).max()))
    return check(node, expected, rtol=rtol, atol=atol)


@pytest.fixture
def small_tiles(monkeypatch):
    # the dequantize-tile + BLAS path (the int8-activation kernel has its own tests,
    # tests/test_ops_qgemm.py)
    monkeypatch.setattr(cpu_mm, "TILE_ROWS", 8)
    monkeypatch.setenv("SDRT_QGEMM", "off")


# ---- mul_mat: weight dtypes -------------------------------------------------------------------
@pytest.mark.parametrize("wdt", FLOAT_W)
@pytest.mark.parametrize("m", [1, 7])
def test_mul_mat_float_weights(rng, small_tiles, wdt, m):
    k, n = 48, 37
    tw = leaf(rng.standard_normal((n, k)), wdt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = check_mm(F.mul_mat(tw, leaf(x)), expect_mm(values(tw), x))
    assert got.shape == (m, n)


@pytest.mark.parametrize("wdt", QUANT_W)
def test_mul_mat_quant_weights(rng, small_tiles, wdt):
    bs = dtypes.get(wdt).block_size
    k, n, m = 2 * bs if bs == 32 else 256, 19, 5
    tw, wv = quant_leaf(wdt, n, k, seed=3)
    x = rng.standard_normal((m, k)).astype(np.float32)
    check_mm(F.mul_mat(tw, leaf(x)), expect_mm(wv, x))


@pytest.mark.parametrize("wdt", ["Q4_K", "Q8_0", "F16"])
def test_mul_mat_byte_sized_tiles(rng, monkeypatch, wdt):
    # the default tile rule (no row override) with a tiny byte budget: the 256-row floor,
    # split evenly into 3 tiles (208, 208, 184)
    k, n, m = 256, 600, 3
    monkeypatch.setattr(cpu_mm, "TILE_BYTES", 1024)
    monkeypatch.setenv("SDRT_QGEMM", "off")
    assert cpu_mm.tile_rows(n, k) == 208
    if wdt == "F16":
        tw = leaf(rng.standard_normal((n, k)), wdt)
        wv = values(tw)
    else:
        tw, wv = quant_leaf(wdt, n, k, seed=5)
    x = rng.standard_normal((m, k)).astype(np.float32)
    check_mm(F.mul_mat(tw, leaf(x)), expect_mm(wv, x))


def test_tile_rows_balanced(monkeypatch):
    assert cpu_mm.tile_rows(4096, 4096) == 2048
    assert cpu_mm.tile_rows(1280, 320) == 1280
    assert cpu_mm.tile_rows(5000, 4096) == 1680  # three even tiles, not 2048 + 2048 + 904
    assert cpu_mm.tile_rows(4096, 65536) == 256  # never fewer rows than 256
    assert cpu_mm.tile_rows(7, 64) == 7
    monkeypatch.setattr(cpu_mm, "TILE_ROWS", 5)
    assert cpu_mm.tile_rows(37, 64) == 5


@pytest.mark.parametrize("n,m", [(1, 1), (1, 9), (13, 1), (33, 3)])
def test_mul_mat_odd_shapes(rng, small_tiles, n, m):
    k = 64
    tw, wv = quant_leaf("Q8_0", n, k, seed=n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    check_mm(F.mul_mat(tw, leaf(x)), expect_mm(wv, x))
    wf = rng.standard_normal((n, k)).astype(np.float32)
    check_mm(F.mul_mat(leaf(wf), leaf(x)), expect_mm(wf, x))


@pytest.mark.parametrize("xdt", ["F16", "BF16"])
def test_mul_mat_half_x(rng, xdt):
    w = rng.standard_normal((11, 32)).astype(np.float32)
    tx = leaf(rng.standard_normal((2, 6, 32)), xdt)
    check_mm(F.mul_mat(leaf(w), tx), expect_mm(w, values(tx)))


# ---- batches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("wdt", ["F32", "F16", "Q4_0"])
@pytest.mark.parametrize("wb,xb", [((), (3,)), ((), (2, 3)), ((3,), (3,)), ((2,), (6,)),
                                   ((1, 2), (3, 4)), ((2, 1), (2, 3)), ((2, 3), (4, 6))])
def test_mul_mat_batch_broadcast(rng, small_tiles, wdt, wb, xb):
    k, n, m = 32, 10, 4
    if wdt == "Q4_0":
        tw, wv = quant_leaf(wdt, n, k, seed=7, batch=wb)
    else:
        tw = leaf(rng.standard_normal(tuple(wb) + (n, k)), wdt)
        wv = values(tw)
    x = rng.standard_normal(tuple(xb) + (m, k)).astype(np.float32)
    got = check_mm(F.mul_mat(tw, leaf(x)), expect_mm(wv, x))
    assert got.shape == tuple(xb) + (m, n)


def test_mul_mat_batch_is_repeat_not_tile(rng):
    # ggml: x batch i uses w batch i // (b2 / w2) -> x batches 0,1 use w0 and 2,3 use w1
    w = rng.standard_normal((2, 3, 8)).astype(np.float32)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    got = run(F.mul_mat(leaf(w), leaf(x)))
    for i in range(4):
        np.testing.assert_allclose(got[i], x[i] @ w[i // 2].T, rtol=1e-5, atol=1e-5)


# ---- non-contiguous inputs ------------------------------------------------------------------
@pytest.mark.parametrize("wdt", ["F32", "BF16", "Q5_K"])
def test_mul_mat_noncontig_x(rng, small_tiles, wdt):
    k, n, m = 256, 9, 6
    if wdt == "Q5_K":
        tw, wv = quant_leaf(wdt, n, k, seed=2)
    else:
        tw = leaf(rng.standard_normal((n, k)), wdt)
        wv = values(tw)
    x = rng.standard_normal((2, m, k)).astype(np.float32)
    tx = leaf(x, noncontig=True)  # a transposed view: ne[0] is not the unit-stride dim
    assert not tx.is_contiguous()
    check_mm(F.mul_mat(tw, tx), expect_mm(wv, x))


def test_mul_mat_noncontig_f32_weights(rng, small_tiles):
    w = rng.standard_normal((12, 40)).astype(np.float32)
    x = rng.standard_normal((3, 20)).astype(np.float32)
    tw = leaf(w).slice(0, 0, None, 2)  # every other column: no unit stride, BLAS cannot read it
    check_mm(F.mul_mat(tw, leaf(x)), x @ w[:, ::2].T)
    tw2 = leaf(w, noncontig=True)  # transposed storage: BLAS reads it in place
    assert not tw2.is_contiguous()
    xx = rng.standard_normal((3, 40)).astype(np.float32)
    check_mm(F.mul_mat(tw2, leaf(xx)), xx @ w.T)


# ---- linear ---------------------------------------------------------------------------------
def test_linear_bias(rng):
    w = rng.standard_normal((16, 24)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    check_mm(F.linear(leaf(x), leaf(w), leaf(b)), x @ w.T + b)
    check_mm(F.linear(leaf(x), leaf(w)), x @ w.T)


# ---- errors ---------------------------------------------------------------------------------
def test_mul_mat_errors():
    w, x = leaf(np.zeros((4, 8))), leaf(np.zeros((3, 6)))
    with pytest.raises(OpError, match=r"mul_mat\(F32\[8, 4\], F32\[6, 3\]\): inner dims differ"):
        F.mul_mat(w, x)
    with pytest.raises(OpError, match=r"mul_mat.*batch dim 2: x has 3, not a multiple of w's 2"):
        F.mul_mat(leaf(np.zeros((2, 4, 8))), leaf(np.zeros((3, 5, 8))))
    with pytest.raises(OpError, match=r"mul_mat.*I32 cannot be a weight"):
        F.mul_mat(Tensor.from_numpy(np.zeros((4, 8), np.int32)), leaf(np.zeros((3, 8))))
    tq, _ = quant_leaf("Q8_0", 4, 32)
    with pytest.raises(OpError, match=r"mul_mat.*x must be F32/F16/BF16, got Q8_0"):
        F.mul_mat(leaf(np.zeros((4, 32))), tq)


# ---- BLAS threads for small GEMMs -----------------------------------------------------------
@pytest.mark.parametrize("wdt", ["F32", "F16"])
def test_small_row_gemm_one_blas_thread(rng, monkeypatch, wdt):
    """At most SMALL_GEMM_ROWS rows: BLAS runs on one thread (restored after) with the same
    result as the pooled path taken when the threshold is lowered below the row count."""
    from sdrt.ops.threads import blas_controller
    monkeypatch.setattr(cpu_mm, "get_threads", lambda: 2)
    k, n, m = 64, 40, 77
    tw = leaf(rng.standard_normal((n, k)), wdt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    seen = []
    real_matmul = np.matmul

    def spy(*a, **kw):  # the BLAS pool size while mul_mat's GEMM runs
        seen.append(min(i["num_threads"] for i in blas_controller().select(user_api="blas").info()))
        return real_matmul(*a, **kw)

    monkeypatch.setattr(cpu_mm.np, "matmul", spy)
    monkeypatch.setattr(cpu_mm, "TINY_GEMM_MACS", 0)       # the row rule alone (tiny GEMMs: below)
    with blas_controller().limit(limits=2, user_api="blas"):
        monkeypatch.setattr(cpu_mm, "SMALL_GEMM_ROWS", 256)
        small = run(F.mul_mat(tw, leaf(x)))
        small_seen, seen[:] = seen[:], []
        monkeypatch.setattr(cpu_mm, "SMALL_GEMM_MACS", m * n * k)  # as much work as a T5 GEMM
        heavy = run(F.mul_mat(tw, leaf(x)))
        heavy_seen, seen[:] = seen[:], []
        monkeypatch.setattr(cpu_mm, "SMALL_GEMM_MACS", 1 << 30)
        monkeypatch.setattr(cpu_mm, "SMALL_GEMM_ROWS", m - 1)
        big = run(F.mul_mat(tw, leaf(x)))
        big_seen, seen[:] = seen[:], []
        monkeypatch.setattr(cpu_mm, "TINY_GEMM_MACS", m * n * k + 1)   # many rows, little work: one thread
        tiny = run(F.mul_mat(tw, leaf(x)))
        tiny_seen = seen[:]
        after = blas_controller().select(user_api="blas").info()[0]["num_threads"]
    monkeypatch.undo()
    assert small_seen and set(small_seen) == {1}
    assert tiny_seen and set(tiny_seen) == {1}
    np.testing.assert_array_equal(tiny, big)
    seen = big_seen
    assert seen and set(seen) == {2} and after == 2
    assert heavy_seen and set(heavy_seen) == {2}
    np.testing.assert_array_equal(heavy, big)
    np.testing.assert_allclose(small, big, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(small, expect_mm(values(tw), x), rtol=RTOL, atol=RTOL * 10)


# ---- get_rows -------------------------------------------------------------------------------
@pytest.mark.parametrize("tdt", FLOAT_W + QUANT_W)
def test_get_rows_dtypes(rng, tdt):
    v = 11
    if tdt in QUANT_W:
        tt, tv = quant_leaf(tdt, v, dtypes.get(tdt).block_size, seed=4)
    else:
        tt = leaf(rng.standard_normal((v, 20)), tdt)
        tv = values(tt)
    ids = np.array([3, 0, 10, 3, 7], np.int32)
    check(F.get_rows(tt, Tensor.from_numpy(ids)), tv[ids], rtol=0, atol=0)


@pytest.mark.parametrize("iddt", [np.int32, np.int64])
def test_get_rows_batched(rng, iddt):
    table = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)  # ne [8, 6, 3, 2]
    ids = rng.integers(0, 6, size=(2, 3, 4)).astype(iddt)        # ne [4, 3, 2]
    exp = np.stack([np.stack([table[a, b][ids[a, b]] for b in range(3)]) for a in range(2)])
    got = check(F.get_rows(leaf(table, "F16"), Tensor.from_numpy(ids)),
                values(leaf(table, "F16"))[np.arange(2)[:, None, None], np.arange(3)[None, :, None], ids])
    assert got.shape == exp.shape == (2, 3, 4, 8)
    tq, tv = quant_leaf("Q4_1", 6, 64, seed=1, batch=(3,))
    ids3 = rng.integers(0, 6, size=(3, 5)).astype(iddt)
    check(F.get_rows(tq, Tensor.from_numpy(ids3)), np.stack([tv[b][ids3[b]] for b in range(3)]), rtol=0, atol=0)


@pytest.mark.parametrize("tdt", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("bad", [12, -1])
def test_get_rows_out_of_range(rng, tdt, bad):
    tt = leaf(rng.standard_normal((12, 32)), "F32") if tdt != "Q8_0" else quant_leaf("Q8_0", 12, 32)[0]
    if tdt == "F16":
        tt = leaf(rng.standard_normal((12, 32)), "F16")
    node = F.get_rows(tt, Tensor.from_numpy(np.array([1, bad, 2], np.int32)))
    for be in ("cpu", "reference"):
        with pytest.raises(OpError, match=rf"get_rows: .*id {bad}\b.*out of range"):
            run(node, be)


def test_get_rows_errors():
    t = leaf(np.zeros((5, 8)))
    with pytest.raises(OpError, match=r"get_rows.*ids must be I32 or I64, got F32"):
        F.get_rows(t, leaf(np.zeros(3)))
    with pytest.raises(OpError, match=r"get_rows.*batch dims differ"):
        F.get_rows(leaf(np.zeros((2, 5, 8))), Tensor.from_numpy(np.zeros((3, 4), np.int32)))


def test_f16_widener_bit_exact():
    """The arithmetic F16 -> F32 widener matches numpy's astype on all 65536 bit patterns
    (subnormals, +-0, inf, NaN payloads)."""
    from sdrt.ops.cpu.matmul import _widen_f16
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    out = np.empty((256, 256), np.uint32)
    _widen_f16(h, out)
    want = h.view(np.float16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("hw", [True, False])
def test_widen_f16_all_patterns(monkeypatch, hw):
    """widen_f16 (hardware half -> float, or the bit-arithmetic fallback) gives numpy's value for
    all 65536 patterns; the hardware path returns signalling NaNs quiet, the fallback bit-exact."""
    from sdrt.ops.cpu import matmul as mm
    if hw:
        mm.widen_f16(np.zeros((1, 1), np.uint16), np.empty((1, 1), np.float32))  # decides _F16_HW
        if not mm._F16_HW:
            pytest.skip("no hardware half conversion in this LLVM target")
    else:
        monkeypatch.setattr(mm, "_F16_HW", False)
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    out = np.empty((256, 256), np.float32)
    mm.widen_f16(h, out)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(out[nan]).all()
    if not hw:
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_openmp_wait_policy_default():
    """sdrt.ops sets libgomp's wait policy to PASSIVE unless the user chose one (spinning OpenMP
    workers cost ~8 ms per parallel region next to BLAS on a loaded machine)."""
    import os
    import subprocess
    import sys
    code = "import os, sdrt.ops; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "ACTIVE"
