"""Qwen3 / Qwen2 LLM text encoder (sdrt.models.te.qwen_llm) against transformers' Qwen3Model and
Qwen2Model on small configs.

Golden: tools/make_qwen_goldens.py llm -> tests/fixtures/qwen_llm.npz (weights with float16-exact
values under sd.cpp's `model.` names, HF's hidden_states in float32: the embeddings, each layer's
output, the final-norm output; 3 layers, GQA 4:2, head_dim 32; Qwen3 hidden 96 so heads x
head_dim != hidden). No torch here."""
import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.te.qwen_llm import PREFIX_LLM, QwenLLM, QwenLLMConfig, causal_mask
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
ARCHS = ("qwen3", "qwen2")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(os.path.join(FIX, "qwen_llm.npz")))


def weights(gold, arch, dtype="F32", prefix=PREFIX_LLM):
    out = {}
    for k, v in gold.items():
        if not k.startswith(arch + "/"):
            continue
        name, x = prefix + k.split("/", 1)[1], v.astype(np.float32)
        if x.ndim == 2 and dtype != "F32" and not (dtype.startswith("Q") and x.shape[-1] % 32):
            out[name] = Tensor.from_numpy(f32_to_raw(x, dtype), dtype=dtype, name=name)
        else:
            out[name] = Tensor.from_numpy(x, name=name)
    return out


def model(gold, arch, dtype="F32", **kw):
    return QwenLLM(weights(gold, arch, dtype), head_dim=32 if arch == "qwen2" else None, **kw)


def test_config_from_weights(gold):
    assert QwenLLMConfig.detect_from_weights(weights(gold, "qwen3")) == QwenLLMConfig(
        "qwen3", hidden=96, intermediate=160, layers=3, heads=4, kv_heads=2, head_dim=32, vocab=512)
    c2 = QwenLLMConfig.detect_from_weights(weights(gold, "qwen2"), head_dim=32)
    assert (c2.arch, c2.hidden, c2.heads, c2.kv_heads, c2.qkv_bias, c2.qk_norm) == ("qwen2", 128, 4, 2, True, False)
    # sd.cpp fixes Qwen2.5's head_dim at 128: k_proj's 64 outputs are no whole head then
    with pytest.raises(ModelFileError, match="whole heads of 128"):
        QwenLLMConfig.detect_from_weights(weights(gold, "qwen2"))


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_matches_transformers(gold, arch):
    """out_layer n (1-based) = HF hidden_states[n]; 0 or past the depth = the final-norm output."""
    m = model(gold, arch)
    hs = gold[f"{arch}_hidden"]
    for out_layer, want in ((1, hs[1]), (2, hs[2]), (0, hs[-1]), (35, hs[-1])):
        h = m.run(gold["ids"], out_layer)
        err = float(np.abs(h - want).max())
        print(f"{arch} out_layer {out_layer}: max-abs {err:.2e} (|ref| max {np.abs(want).max():.2f})")
        assert h.shape == want.shape and err < 5e-5
    assert m.reads_layer(3) == 3 and m.reads_layer(4) == 0 and m.reads_layer(35) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_and_batch(gold, arch):
    """Causal: a prefix's states do not depend on later tokens; batch items equal single runs."""
    m = model(gold, arch)
    ids = gold["ids"]
    full = m.run(ids, 2)
    np.testing.assert_allclose(m.run(ids[1, :7], 2)[0], full[1, :7], atol=2e-5)
    np.testing.assert_allclose(m.run(ids[0], 2)[0], full[0], atol=2e-5)
    assert causal_mask(3).tolist() == [[0, -np.inf, -np.inf], [0, 0, -np.inf], [0, 0, 0]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,tol", [("F16", 1e-4), ("BF16", 0.03), ("Q8_0", 0.03)])
def test_stored_types(gold, arch, dtype, tol, monkeypatch):
    """Weights stored as `dtype` run through mul_mat / get_rows as stored (not widened): against
    sdrt F32 on the same dequantized values, tight (Q8_0 with the dequantizing GEMM: the default
    int8-activation kernel's rounding is tests/test_ops_qgemm.py's business); against HF's F32
    output, within the rounding."""
    monkeypatch.setenv("SDRT_QGEMM", "off")
    table = weights(gold, arch, dtype)
    m = QwenLLM(table, head_dim=32 if arch == "qwen2" else None)
    assert m.layers[0].q.weight.dtype.name == dtype and m.embed.dtype.name == dtype
    deq = QwenLLM({k: Tensor.from_numpy(t.to_f32(), name=k) for k, t in table.items()},
                  head_dim=32 if arch == "qwen2" else None)
    h = m.run(gold["ids"], 0)
    same = float(np.abs(h - deq.run(gold["ids"], 0)).max())
    ref = gold[f"{arch}_hidden"][-1]
    rel = float(np.sqrt(np.mean((h - ref) ** 2) / np.mean(ref ** 2)))
    print(f"{arch} {dtype}: rel-rms vs HF {rel:.2e}; vs sdrt f32 same values {same:.2e}")
    assert same < 1e-4 and rel < tol


def test_bad_weights_and_ids(gold):
    t = weights(gold, "qwen3")
    del t[PREFIX_LLM + "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelFileError, match="layers.1.mlp.up_proj.weight"):
        QwenLLM(t)
    t = weights(gold, "qwen3")
    for k in [k for k in t if ".layers.1." in k]:
        del t[k]
    with pytest.raises(ModelFileError, match="layers.1 is missing"):
        QwenLLM(t)
    t = {k: v for k, v in weights(gold, "qwen2").items() if "q_proj.bias" not in k}
    with pytest.raises(ModelFileError, match="not a Qwen LLM"):
        QwenLLM(t)
    with pytest.raises(ModelFileError, match="no LLM layers"):
        QwenLLM({PREFIX_LLM + "model.embed_tokens.weight": Tensor.from_numpy(np.zeros((4, 8), np.float32))})
    m = model(gold, "qwen3")
    with pytest.raises(UsageError, match="outside the vocabulary"):
        m.run([1, 2, 600])
    with pytest.raises(UsageError, match="non-empty int"):
        m.run(np.zeros(0, np.int32))
