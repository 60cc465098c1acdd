"""sdrt.ops.quant: bit-exact with ggml (through gguf's numpy code and through C goldens).

- dequantize: every block type against `gguf.quants.dequantize` on random valid blocks, and
  against ggml's own `dequantize_row_*` (tests/fixtures/quant_ggml_dequantize.npz);
- quantize: against `gguf.quants.quantize` where gguf has the type, and against ggml's
  `quantize_row_*_ref` for all of them (tests/fixtures/quant_ggml_quantize.npz, made by
  tools/make_quant_goldens.py from ggml-quants.c);
- quantize with an importance vector: against ggml's `ggml_quantize_chunk` with imatrix = ones
  (what stable-diffusion.cpp's convert passes) and a random positive one, rows of 512 and 1024
  (tests/fixtures/quant_ggml_quantize_imatrix.npz);
- get_rows / dequantize_rows / conversions / errors.
"""
from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest

from sdrt import OpError, UnsupportedError
from sdrt.ops import dtypes, quant

gguf = pytest.importorskip("gguf")
from gguf import quants as gq

FIX = pathlib.Path(__file__).parent / "fixtures"
BLOCK_TYPES = [t.name for t in dtypes.QUANT_TYPES]
GGUF_DEQUANT = [n for n in BLOCK_TYPES if n not in ("Q8_1", "Q8_K")]  # gguf has no dequantizer for these two
GGUF_QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
WEIGHTED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
CHUNK_TYPES = WEIGHTED + ["Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]  # the types ggml_quantize_chunk takes
ALL_QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
             "TQ1_0", "TQ2_0", "MXFP4"]


def _ne0(name: str, nblocks: int) -> int:
    return dtypes.get(name).block_size * nblocks


def _gguf_deq(raw, name):
    return gq.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[name])


def _gguf_q(x, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 overflow of huge scales, as in ggml
        return gq.quantize(x, gguf.GGMLQuantizationType[name])


def _same(a, b) -> bool:
    """Bitwise equality of float arrays (also tells -0.0 from 0.0)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# dequantize


def test_every_block_type_is_supported():
    deq = {t.name for t in quant.supported_dequant_types()}
    assert set(BLOCK_TYPES) <= deq
    assert {"F32", "F16", "BF16"} <= deq
    assert set(ALL_QUANT) == {t.name for t in quant.supported_quant_types()}
    from sdrt.ops.quant import _quants
    assert all(_quants.has_dequant(t.id) for t in quant.supported_dequant_types())
    assert all(_quants.has_quant(t.id) for t in quant.supported_quant_types())
    assert not _quants.has_quant(dtypes.IQ2_XXS.id)


@pytest.mark.parametrize("name", GGUF_DEQUANT)
@pytest.mark.parametrize("nrows", [1, 3, 7])
def test_dequantize_matches_gguf(name, nrows):
    nblocks = 2 if dtypes.get(name).block_size == 256 else 5
    raw = quant.random_raw(name, nrows, _ne0(name, nblocks), seed=nrows)
    ours = quant.dequantize(raw, name)
    ref = _gguf_deq(raw, name)
    assert ours.dtype == np.float32 and ours.shape == (nrows, _ne0(name, nblocks))
    assert np.isfinite(ours).all()
    assert _same(ours, ref)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "IQ2_XS", "IQ4_XS"])
def test_dequantize_wide_scales_and_strided_rows(name):
    # scales from fp16-subnormal to large, rows read through a strided view of a wider buffer
    dt = dtypes.get(name)
    raw = quant.random_raw(name, 5, _ne0(name, 3), seed=11, scale_exp=(-24, 12))
    wide = np.zeros((5, raw.shape[1] + 13), np.uint8)
    wide[:, 5:5 + raw.shape[1]] = raw
    view = wide[:, 5:5 + raw.shape[1]]
    assert not view.flags.c_contiguous
    assert _same(quant.dequantize(view, dt), _gguf_deq(raw, name))


@pytest.mark.parametrize("name", [n for n in BLOCK_TYPES if n != "Q8_1"])
def test_dequantize_matches_ggml_c(name):
    g = np.load(FIX / "quant_ggml_dequantize.npz")
    assert _same(quant.dequantize(g[name + "_raw"], name), g[name])


def test_dequantize_q8_1_by_definition():
    raw = quant.random_raw("Q8_1", 3, 96, seed=5)
    b = raw.reshape(3, 3, 36)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    ref = (b[..., 4:].view(np.int8).astype(np.float32) * d).reshape(3, 96)
    assert _same(quant.dequantize(raw, "Q8_1"), ref)


def test_dequantize_nd_and_out():
    raw = quant.random_raw("Q5_K", 6, 512, seed=2)
    ref = quant.dequantize(raw, "Q5_K")
    nd = quant.dequantize(raw.reshape(2, 3, -1), "Q5_K")
    assert nd.shape == (2, 3, 512) and _same(nd.reshape(6, 512), ref)
    out = np.full((6, 512), np.nan, np.float32)
    assert quant.dequantize(raw, dtypes.Q5_K, out=out) is out
    assert _same(out, ref)
    assert quant.dequantize(raw[:0], "Q5_K").shape == (0, 512)


def test_dequantize_float_types():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 40)).astype(np.float32)
    assert _same(quant.dequantize(x.view(np.uint8), "F32"), x)
    h = x.astype(np.float16)
    assert _same(quant.dequantize(h.view(np.uint8), "F16"), h.astype(np.float32))
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert _same(quant.dequantize(bf.view(np.uint8), "BF16"), (bf.astype(np.uint32) << 16).view(np.float32))


def test_parallel_paths_match_single_thread():
    # many rows (row-parallel), a few long rows (rows split into chunks), and many get_rows
    for nrows, ne0 in ((64, 4096), (2, 65536)):
        raw = quant.random_raw("Q4_K", nrows, ne0, seed=nrows)
        par = quant.dequantize(raw, "Q4_K")
        quant.set_num_threads(1)
        try:
            ser = quant.dequantize(raw, "Q4_K")
        finally:
            quant.set_num_threads(0)
        assert _same(par, ser)
        assert _same(par, _gguf_deq(raw, "Q4_K"))
        assert _same(quant.dequantize_rows(raw, "Q4_K", 0, nrows, nthreads=1), par)
        assert _same(quant.dequantize(raw, "Q4_K", nthreads=2), par)
    raw = quant.random_raw("Q8_0", 300, 256, seed=3)
    ids = np.random.default_rng(1).integers(0, 300, 500)
    assert _same(quant.get_rows(raw, "Q8_0", ids), quant.dequantize(raw, "Q8_0")[ids])
    assert _same(quant.get_rows(raw, "Q8_0", ids, nthreads=2), quant.dequantize(raw, "Q8_0")[ids])
    x = np.random.default_rng(2).standard_normal((64, 1024)).astype(np.float32)
    assert np.array_equal(quant.quantize(x, "Q4_K", nthreads=2), quant.quantize(x, "Q4_K", nthreads=1))


# ---------------------------------------------------------------------------------------------
# quantize


def _quant_inputs(ne0: int) -> np.ndarray:
    rng = np.random.default_rng(42)
    x = rng.standard_normal((11, ne0)).astype(np.float32)
    x[1] = 0                                    # all zeros
    x[2] *= 1e-20                               # tiny
    x[3] *= 1e20                                # huge (fp16 scale overflows to inf)
    x[4] *= 1e-6
    x[5] = np.abs(x[5])
    x[6] = -np.abs(x[6]) * 1e4
    x[7] = rng.integers(-4, 5, ne0)             # ties
    x[8] = rng.uniform(-1, 1, ne0)
    x[9, ::2] = 0
    x[10] = 0.25
    return x


@pytest.mark.parametrize("name", GGUF_QUANT)
@pytest.mark.parametrize("nrows", [1, 5, 11])
def test_quantize_matches_gguf(name, nrows):
    x = _quant_inputs(512)[:nrows]
    ours = quant.quantize(x, name)
    assert ours.dtype == np.uint8 and ours.shape == (nrows, dtypes.get(name).row_bytes(512))
    assert np.array_equal(ours, _gguf_q(x, name))


@pytest.mark.parametrize("name", ALL_QUANT)
def test_quantize_matches_ggml_c(name):
    g = np.load(FIX / "quant_ggml_quantize.npz")
    assert np.array_equal(quant.quantize(g["x"], name), g[name])
    # also in one call over rows of a different length (blocks are independent)
    x2 = g["x"].reshape(-1, 1024)
    assert np.array_equal(quant.quantize(x2, name), g[name].reshape(x2.shape[0], -1))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q3_K", "Q2_K"])
def test_quantize_roundtrip_error(name):
    x = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    y = quant.dequantize(quant.quantize(x, name), name)
    tol = {"Q8_0": 0.02, "Q6_K": 0.05, "Q4_K": 0.15, "Q3_K": 0.3, "Q2_K": 0.5}[name]
    assert np.sqrt(np.mean((y - x) ** 2)) < tol


def test_quantize_non_finite_is_safe():
    # ggml's reference makes no promise for inf/NaN input; we only require no crash and the shape
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    x[0, 3], x[1, 100], x[2, :] = np.inf, np.nan, -np.inf
    for name in ALL_QUANT:
        with np.errstate(all="ignore"):
            assert quant.quantize(x, name).shape == (4, dtypes.get(name).row_bytes(256))


# ---------------------------------------------------------------------------------------------
# quantize with an importance vector (ggml_quantize_chunk -> quantize_row_*_impl)


@pytest.mark.parametrize("name", CHUNK_TYPES)
@pytest.mark.parametrize("key", ["ones", "imat", "ones_1024", "imat_1024"])
def test_quantize_imatrix_matches_ggml_c(name, key):
    g = np.load(FIX / "quant_ggml_quantize_imatrix.npz")
    x = g["x"] if not key.endswith("1024") else g["x"].reshape(-1, 1024)
    im = np.ones(x.shape[1], np.float32) if key.startswith("ones") else g["imat"][:x.shape[1]]
    assert np.array_equal(quant.quantize(x, name, im), g[f"{name}@{key}"])
    assert np.array_equal(quant.quantize(x, name, imatrix=im, nthreads=1), g[f"{name}@{key}"])


def test_quantize_imatrix_paths():
    g = np.load(FIX / "quant_ggml_quantize_imatrix.npz")
    r = np.load(FIX / "quant_ggml_quantize.npz")
    x = g["x"]
    assert {t.name for t in quant.weighted_quant_types()} == set(WEIGHTED)
    for name in CHUNK_TYPES:
        assert np.array_equal(quant.quantize(x, name), r[name])            # None: the _ref path
        assert np.array_equal(quant.quantize(x, name, 1.0), g[f"{name}@ones"])  # a scalar is broadcast
        if name in WEIGHTED:  # the fixtures really tell the two paths apart
            assert not np.array_equal(g[f"{name}@ones"], r[name])
    for name in ("Q8_1", "Q8_K"):  # not in ggml_quantize_chunk: only a _ref quantizer, weights ignored
        assert np.array_equal(quant.quantize(x, name, g["imat"][:512]), r[name])
    # a stack of rows, float64, non-contiguous: same bytes
    x3 = np.asfortranarray(x.astype(np.float64)).reshape(3, 6, 512)
    assert np.array_equal(quant.quantize(x3, "Q4_K", np.ones(512)).reshape(18, -1), g["Q4_K@ones"])
    assert quant.quantize(x[:0], "Q4_0", np.ones(512)).shape == (0, 288)


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q3_K", "Q4_K", "Q6_K"])
def test_quantize_imatrix_parallel_and_split_rows(name):
    # long rows are split into chunks across threads: same bytes as one thread; a K-quant row is
    # the concatenation of its halves (its blocks only see their own weights, from the right column)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 16384)).astype(np.float32)
    im = np.exp(rng.uniform(-3, 3, 16384)).astype(np.float32)
    one = quant.quantize(x, name, im, nthreads=1)
    assert np.array_equal(quant.quantize(x, name, im, nthreads=2), one)
    if name.endswith("_K"):
        halves = [quant.quantize(x[:, k:k + 8192], name, im[k:k + 8192], nthreads=1) for k in (0, 8192)]
        assert np.array_equal(np.concatenate(halves, axis=1), one)
    else:  # Q4_0 ... Q5_1 weigh every block by its whole row's mean square
        assert not np.array_equal(quant.quantize(x[:, :8192], name, im[:8192]), one[:, :one.shape[1] // 2])


@pytest.mark.parametrize("name", WEIGHTED)
def test_quantize_imatrix_weights_matter(name):
    # columns with large importance are reproduced more accurately than with uniform weights
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    im = np.where(np.arange(512) % 8 == 0, 100.0, 1.0).astype(np.float32)
    err = lambda w: float(np.mean((quant.dequantize(quant.quantize(x, name, w), name) - x)[:, ::8] ** 2))  # noqa: E731
    assert err(im) < err(np.ones(512, np.float32))


def test_quantize_imatrix_errors_and_non_finite():
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    with pytest.raises(OpError, match=r"Q4_K importance vector .*\(256,\), got shape \(128,\)"):
        quant.quantize(x, "Q4_K", np.ones(128, np.float32))
    with pytest.raises(OpError, match="numbers"):
        quant.quantize(x, "Q4_K", np.array(["a"] * 256))
    x[0, 3], x[1, 100], x[2, :] = np.inf, np.nan, -np.inf
    im = np.ones(256, np.float32)
    im[5], im[6], im[7] = np.nan, 0.0, np.inf
    for name in CHUNK_TYPES:
        with np.errstate(all="ignore"):
            assert quant.quantize(x, name, im).shape == (4, dtypes.get(name).row_bytes(256))


def test_quantize_accepts_other_layouts():
    x = np.random.default_rng(0).standard_normal((3, 64))
    ref = quant.quantize(x.astype(np.float32), "Q8_0")
    assert np.array_equal(quant.quantize(x, "Q8_0"), ref)                  # float64 input
    xt = np.asfortranarray(x.astype(np.float32))
    assert np.array_equal(quant.quantize(xt, "Q8_0"), ref)                 # non-contiguous
    assert quant.quantize(x.reshape(3, 1, 64), "Q8_0").shape == (3, 1, 68)


# ---------------------------------------------------------------------------------------------
# get_rows / dequantize_rows


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K", "IQ3_S", "F16", "BF16", "F32"])
@pytest.mark.parametrize("idtype", [np.int32, np.int64])
def test_get_rows(name, idtype):
    dt = dtypes.get(name)
    if dt.is_quantized:
        raw = quant.random_raw(name, 9, _ne0(name, 2), seed=4)
    else:
        raw = np.random.default_rng(4).standard_normal((9, 64)).astype(np.float32)
        raw = (raw if name == "F32" else raw.astype(np.float16) if name == "F16"
               else (raw.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
    full = quant.dequantize(raw, name)
    ids = np.array([8, 0, 3, 3, 7], idtype)
    assert _same(quant.get_rows(raw, name, ids), full[ids])
    ids2 = ids[:4].reshape(2, 2)
    assert _same(quant.get_rows(raw, name, ids2), full[ids2])
    assert quant.get_rows(raw, name, np.array([], idtype)).shape == (0, full.shape[1])


def test_get_rows_bounds_checked():
    raw = quant.random_raw("Q8_0", 4, 64, seed=1)
    with pytest.raises(OpError, match=r"id 4 .*4 rows"):
        quant.get_rows(raw, "Q8_0", np.array([0, 4], np.int32))
    with pytest.raises(OpError, match=r"id -1"):
        quant.get_rows(raw, "Q8_0", [2, -1])
    with pytest.raises(OpError, match="integers"):
        quant.get_rows(raw, "Q8_0", np.array([0.0, 1.0]))


def test_dequantize_rows_into_tile():
    raw = quant.random_raw("Q4_K", 10, 512, seed=9)
    full = quant.dequantize(raw, "Q4_K")
    assert _same(quant.dequantize_rows(raw, "Q4_K", 3, 8), full[3:8])
    assert quant.dequantize_rows(raw, "Q4_K", 4, 4).shape == (0, 512)
    big = np.zeros((5, 600), np.float32)  # a row-strided tile of a larger buffer
    quant.dequantize_rows(raw, "Q4_K", 5, 10, out=big[:, 40:552])
    assert _same(big[:, 40:552], full[5:10])
    assert not big[:, :40].any() and not big[:, 552:].any()
    with pytest.raises(OpError, match=r"row range \[8, 12\)"):
        quant.dequantize_rows(raw, "Q4_K", 8, 12)


# ---------------------------------------------------------------------------------------------
# element conversions


def test_f16_bf16_to_f32_all_patterns():
    allbits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = quant.f16_to_f32(allbits)
    ref = allbits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    # NaNs stay NaNs with their sign and payload; signalling ones come back quiet (as in ggml)
    assert np.array_equal(got[nan].view(np.uint32), ref[nan].view(np.uint32) | 0x00400000)
    gbf = quant.bf16_to_f32(allbits.reshape(256, 256))
    assert gbf.shape == (256, 256)
    assert np.array_equal(gbf.reshape(-1).view(np.uint32), allbits.astype(np.uint32) << 16)
    big = np.tile(allbits, 8)  # parallel path
    assert np.array_equal(quant.f16_to_f32(big).view(np.uint32), np.tile(got.view(np.uint32), 8))


def test_f32_to_f16_rounds_like_numpy():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.uniform(-9, 6, 5000),
                        [0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65519.99, 6e-8, 2.9e-8, 3e-8]]).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(quant.f32_to_f16(x), ref)
    assert quant.f32_to_f16(np.array([np.nan], np.float32))[0] == 0x7E00


# ---------------------------------------------------------------------------------------------
# errors and integration


def test_errors_name_type_and_shape():
    raw = quant.random_raw("Q4_K", 2, 256, seed=0)
    with pytest.raises(OpError, match=r"Q4_K.*143 bytes.*144-byte"):
        quant.dequantize(raw[:, :143], "Q4_K")
    with pytest.raises(OpError, match=r"Q4_K.*100 elements.*256.*\(3, 100\)"):
        quant.quantize(np.zeros((3, 100), np.float32), "Q4_K")
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        quant.quantize(np.zeros((1, 256), np.float32), "IQ2_XXS")
    with pytest.raises(UnsupportedError, match="I32"):
        quant.dequantize(np.zeros((1, 8), np.uint8), "I32")
    with pytest.raises(OpError, match="unknown dtype"):
        quant.dequantize(raw, "Q9_Z")
    with pytest.raises(OpError, match=r"out must be float32 of shape \(2, 256\)"):
        quant.dequantize(raw, "Q4_K", out=np.empty((2, 128), np.float32))
    with pytest.raises(OpError, match="16-bit"):
        quant.f16_to_f32(np.zeros(3, np.float32))


def test_convert_uses_quant():
    from sdrt.ops import convert

    x = np.random.default_rng(1).standard_normal((2, 3, 256)).astype(np.float32)
    raw = convert.f32_to_raw(x, "Q6_K")
    assert raw.shape == (2, 3, 210)
    y = convert.raw_to_f32(raw, "Q6_K")
    assert _same(y, quant.dequantize(raw, "Q6_K"))
