"""T5 v1.1 encoder (sdrt.models.te.t5) against transformers' T5EncoderModel on a small config.

Golden: tools/make_t5_goldens.py encoder -> tests/fixtures/t5_encoder.npz (weights whose values
are float16-exact, hidden states of HF in float32, HF's position buckets). Max-abs errors are
printed (pytest -s)."""
import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.te.t5 import PREFIX_T5XXL, T5Config, T5Encoder, find_t5_prefix, relative_position_bucket
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
CASES = ("len1", "len7", "len77", "len300", "batch_mask")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(os.path.join(FIX, "t5_encoder.npz")))


def weights(gold, dtype="F32", prefix=""):
    """{prefix + HF name: Tensor} with 2-D weights stored as `dtype` (norms stay F32, as sd.cpp
    keeps them; the embedding and the bias table follow `dtype` too, except that a block type
    needs rows of whole 32-blocks: the 2-head bias table here stays F32)."""
    out = {}
    for k, v in gold.items():
        if not k.startswith("w/"):
            continue
        name, x = k[2:], v.astype(np.float32)
        if x.ndim == 2 and dtype != "F32" and not (dtype.startswith("Q") and x.shape[-1] % 32):
            out[prefix + name] = Tensor.from_numpy(f32_to_raw(x, dtype), dtype=dtype, name=name)
        else:
            out[prefix + name] = Tensor.from_numpy(x, name=name)
    return out


def run_case(enc, gold, name):
    return enc.run(gold[f"ids/{name}"], gold.get(f"mask/{name}"))


def test_buckets_match_hf(gold):
    rel = np.arange(-2048, 2049)
    assert np.array_equal(relative_position_bucket(rel), gold["buckets"])


def test_config_from_weights(gold):
    cfg = T5Config.detect_from_weights(weights(gold), "")
    assert cfg == T5Config(d_model=128, layers=2, heads=2, d_kv=64, d_ff=160, vocab=256)


@pytest.mark.parametrize("name", CASES)
def test_f32_matches_transformers(gold, name):
    enc = T5Encoder(weights(gold), "")
    h, ref = run_case(enc, gold, name), gold[f"hidden/{name}"]
    assert h.shape == ref.shape
    err = float(np.abs(h - ref).max())
    print(f"T5 f32 {name}: max-abs {err:.2e} (|ref| max {np.abs(ref).max():.2f})")
    assert err < 2e-4


@pytest.mark.parametrize("dtype,tol", [("F16", 1e-5), ("BF16", 0.04), ("Q8_0", 0.1), ("F8_E4M3", 0.5)])
def test_stored_types(gold, dtype, tol):
    """Weights stored as `dtype` run through mul_mat/get_rows as stored: against sdrt in F32 on
    the same (dequantized) values, tight; against HF's F32 golden, a relative RMS error within
    the rounding's reach. This random model's unscaled attention is peaky and amplifies weight
    rounding ~15x (rel-rms: BF16 ~2%, Q8_0 ~5%, F8 ~30%, in proportion to each type's rounding
    error), so the HF bounds are loose; max-abs is printed, not bounded."""
    table = weights(gold, dtype)
    enc = T5Encoder(table, "")
    assert enc.blocks[0].q.weight.dtype.name == dtype
    deq = T5Encoder({k: Tensor.from_numpy(t.to_f32(), name=k) for k, t in table.items()}, "")
    from sdrt.ops.quant import gemm as qgemm
    for name in ("len77", "batch_mask"):
        with qgemm.using_path("off"):  # exact: dequantized weights, float32 activations
            h = run_case(enc, gold, name)
        same = float(np.abs(h - run_case(deq, gold, name)).max())
        ref = gold[f"hidden/{name}"]
        err = float(np.abs(h - ref).max())
        rel = float(np.sqrt(np.mean((h - ref) ** 2) / np.mean(ref ** 2)))
        print(f"T5 {dtype} {name}: vs HF f32 max-abs {err:.2e}, rel-rms {rel:.2e}; "
              f"vs sdrt f32 on the same values max-abs {same:.2e}")
        assert same < 2e-4
        assert rel < tol
        if dtype == "Q8_0":  # the default int8-activation kernel (as ggml): activations rounded too
            h8 = run_case(enc, gold, name)
            rel8 = float(np.sqrt(np.mean((h8 - ref) ** 2) / np.mean(ref ** 2)))
            print(f"T5 Q8_0 int8 activations {name}: rel-rms {rel8:.2e}")
            assert rel8 < tol


def test_sdcpp_prefix_and_embed_tokens_name(gold):
    table = weights(gold, prefix=PREFIX_T5XXL)
    assert find_t5_prefix(table) == PREFIX_T5XXL
    h = T5Encoder(table).run(gold["ids/len7"])
    np.testing.assert_allclose(h, gold["hidden/len7"], atol=2e-4)
    t2 = weights(gold, prefix="te.")
    t2["te.encoder.embed_tokens.weight"] = t2.pop("te.shared.weight")
    assert find_t5_prefix(t2) == "te."
    np.testing.assert_allclose(T5Encoder(t2, "te.").run(gold["ids/len7"]), gold["hidden/len7"], atol=2e-4)


def test_mask_batch_equals_single_items(gold):
    """Each batch item with its mask equals that item alone cut to its real tokens, for the real
    positions (masked keys take no part)."""
    enc = T5Encoder(weights(gold), "")
    ids, mask = gold["ids/batch_mask"], gold["mask/batch_mask"]
    h = enc.run(ids, mask)
    for b in range(2):
        n = int(mask[b].sum())
        alone = enc.run(ids[b, :n])
        np.testing.assert_allclose(h[b, :n], alone[0], atol=2e-5)
    unmasked = enc.run(ids, np.ones_like(mask))
    assert np.abs(unmasked - h).max() > 1e-2               # the mask changes something


def test_errors_name_the_problem(gold):
    t = weights(gold)
    with pytest.raises(UsageError, match="vocabulary"):
        T5Encoder(t, "").forward(np.array([[0, 256]]))
    with pytest.raises(UsageError, match="mask"):
        T5Encoder(t, "").forward(np.array([1, 2, 3]), mask=np.ones(4))
    with pytest.raises(UsageError):
        T5Encoder(t, "").forward(np.array([], np.int32))
    bad = dict(t)
    del bad["encoder.block.1.layer.1.DenseReluDense.wo.weight"]
    with pytest.raises(ModelFileError, match="block.1.layer.1.DenseReluDense.wo.weight"):
        T5Encoder(bad, "")
    bad = {k: v for k, v in t.items() if not k.startswith("encoder.block.0.")}
    with pytest.raises(ModelFileError, match="encoder.block.0"):
        T5Encoder(bad, "")
    bad = dict(t)
    bad["encoder.block.1.layer.0.SelfAttention.k.weight"] = Tensor.from_numpy(np.zeros((64, 128), np.float32))
    with pytest.raises(ModelFileError, match="SelfAttention.k.weight"):
        T5Encoder(bad, "")
    with pytest.raises(ModelFileError, match="no T5 encoder"):
        find_t5_prefix({"x.weight": t["shared.weight"]})


def test_encode_chunks_equals_chunk_by_chunk(gold):
    """sd.cpp encodes each padded chunk on its own and joins them; one batched graph does the same."""
    from sdrt.models.te.t5_tokenizer import T5Tokenizer
    enc = T5Encoder(weights(gold), "")
    pieces = gold["ids/len77"][0, :30] % 250 + 3
    ids, _, mask = T5Tokenizer.pad_chunks(pieces, 16)
    assert len(ids) == 32
    got = enc.encode_chunks(ids, 16)
    want = np.concatenate([enc.run(ids[:16]), enc.run(ids[16:])], axis=1)
    np.testing.assert_allclose(got, want, atol=2e-5)
    got_m = enc.encode_chunks(ids, 16, mask)
    want_m = np.concatenate([enc.run(ids[:16], mask[:16]), enc.run(ids[16:], mask[16:])], axis=1)
    np.testing.assert_allclose(got_m, want_m, atol=2e-5)
    with pytest.raises(UsageError, match="chunks"):
        enc.encode_chunks(ids[:20], 16)
