"""Prompt attention parsing, weighted chunking and the SD1/SD2/SDXL conditioner.

Goldens (tools/make_clip_goldens.py): stable-diffusion.cpp's own parse_prompt_attention and
FrozenCLIPEmbedderWithCustomWords::tokenize through a C++ harness (clip_tokenizer.npz); the
conditioner end to end against transformers' CLIP models plus a torch re-implementation of
sd.cpp's weighting / mean restore / SDXL vector, on tiny configs (clip_cond_*.npz)."""
import json
import os

import numpy as np
import pytest
from test_te_clip import spec_arrays, spec_table

from sdrt import ModelFileError, UnsupportedError, UsageError
from sdrt.engine.conditioning import build_conditioner
from sdrt.models.prompt import (
    apply_token_weights,
    parse_prompt_attention,
    tokenize_weighted,
)
from sdrt.io import write_safetensors
from sdrt.models.te.tokenizer import CLIPTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
TOL = 1e-4
f32 = np.float32


@pytest.fixture(scope="module")
def tokgold():
    return json.loads(str(np.load(os.path.join(FIX, "clip_tokenizer.npz"))["data"]))


# ---- parse_prompt_attention -----------------------------------------------------------------------
def test_parse_matches_stable_diffusion_cpp(tokgold):
    prompts = tokgold["prompts"] + tokgold["parse_prompts"]
    assert len(prompts) == len(tokgold["sdcpp_parse"])
    for p, exp in zip(prompts, tokgold["sdcpp_parse"]):
        got = parse_prompt_attention(p)
        assert [s for s, _ in got] == [s for s, _ in exp], p
        assert [f32(w) for _, w in got] == [f32(w) for _, w in exp], p      # bit-exact float32


def test_parse_documented_examples():
    # sd.cpp's util.cpp comment (sd-webui's examples); weights as float32 products
    assert parse_prompt_attention("normal text") == [("normal text", 1.0)]
    assert parse_prompt_attention("an (important) word") == [("an ", 1.0), ("important", float(f32(1.1))),
                                                              (" word", 1.0)]
    assert parse_prompt_attention("(unbalanced") == [("unbalanced", float(f32(1.1)))]
    assert parse_prompt_attention("(unnecessary)(parens)") == [("unnecessaryparens", float(f32(1.1)))]
    got = parse_prompt_attention("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).")
    assert [s for s, _ in got] == ["a ", "house", " ", "on", " a ", "hill", ", sun, ", "sky", "."]
    np.testing.assert_allclose([w for _, w in got], [1.0, 1.573, 1.1, 1.0, 1.1, 0.55, 1.1, 1.4641, 1.1], rtol=1e-6)
    # the comment says "\(literal\]" -> "(literal]"; sd.cpp's code unescapes only "\(" (we follow the code)
    assert parse_prompt_attention("\\(literal\\]") == [("(literal\\]", 1.0)]
    assert parse_prompt_attention("[x]") == [("x", float(f32(1) / f32(1.1)))]
    assert parse_prompt_attention("a BREAK b") == [("a ", 1.0), ("BREAK", -1.0), (" b", 1.0)]
    assert parse_prompt_attention("") == [("", 1.0)]


def test_parse_bad_weight_is_a_usage_error():
    with pytest.raises(UsageError, match="not a number"):
        parse_prompt_attention("(cat:.)")


# ---- tokenize_weighted ----------------------------------------------------------------------------------
def test_chunks_match_stable_diffusion_cpp(tokgold):
    prompts = tokgold["prompts"] + tokgold["parse_prompts"]
    for ver, pad in (("sd1", 49407), ("sd2", 0)):
        tok = CLIPTokenizer(pad)
        for p, exp in zip(prompts, tokgold[f"sdcpp_{ver}"]):
            ids, w = tokenize_weighted(p, tok)
            assert ids.tolist() == exp["ids"], (ver, p)
            np.testing.assert_array_equal(w, np.array(exp["weights"], np.float32), err_msg=p)


def test_chunk_boundaries():
    tok = CLIPTokenizer()
    for n, chunks in ((0, 1), (75, 1), (76, 2), (150, 2), (151, 3)):
        ids, w = tokenize_weighted("a " * n, tok)
        assert ids.size == 77 * chunks and w.size == ids.size, n
        c = ids.reshape(chunks, 77)
        assert (c[:, 0] == 49406).all() and (c == 320).sum() == n


def test_apply_token_weights_restores_the_mean(rng):
    h = rng.standard_normal((77, 16)).astype(np.float32) + 0.3
    w = np.ones(77, np.float32)
    w[3:6] = 1.5
    out = apply_token_weights(h, w)
    assert out.dtype == np.float32
    assert abs(float(out.mean(dtype=np.float64)) - float(h.mean(dtype=np.float64))) < 1e-6
    ratio = out / h
    np.testing.assert_allclose(ratio[3:6] / ratio[0], 1.5, rtol=1e-5)
    np.testing.assert_array_equal(apply_token_weights(h, np.ones(77, np.float32)), h * (f32(h.mean(dtype=np.float64)) / f32(h.mean(dtype=np.float64))))


# ---- the conditioner end to end ----------------------------------------------------------------------------
def _conditioner(fam, tmp_path):
    d = np.load(os.path.join(FIX, f"clip_cond_{fam}.npz"))
    emb_dir = tmp_path / "embd"
    emb_dir.mkdir()
    name = str(d["emb_file"])
    if name.endswith(".pt"):
        (emb_dir / name).write_bytes(d["emb_pt_bytes"].tobytes())
    else:
        write_safetensors(str(emb_dir / name), spec_arrays(d, "emb"))
    (emb_dir / "notes.txt").write_text("not an embedding")
    return d, build_conditioner(spec_table(d, "w"), fam, str(emb_dir), heads=2)


@pytest.mark.parametrize("fam", ["sd1", "sd2", "sdxl"])
def test_conditioner_matches_torch_reference(fam, tmp_path):
    d, cond = _conditioner(fam, tmp_path)
    prompts = dict(zip(d["prompt_names"].tolist(), d["prompts"].tolist()))
    keys = sorted({k[:-len("_context")] for k in d.files if k.endswith("_context") and "_skip" in k})
    assert len(keys) >= 5
    for key in keys:
        name, skip = key.rsplit("_skip", 1)
        c = cond.encode(prompts[name], width=768, height=1024, clip_skip=int(skip))
        assert c.ids.tolist() == d[f"{key}_ids"].tolist(), key           # sd.cpp's tokens
        np.testing.assert_array_equal(c.weights, d[f"{key}_weights"])
        exp = d[f"{key}_context"]
        assert c.context.shape == exp.shape and c.context.dtype == np.float32, key
        assert np.abs(c.context - exp).max() <= TOL, (key, np.abs(c.context - exp).max())
        if fam == "sdxl":
            assert c.y.shape == d[f"{key}_y"].shape == (1, 96 + 6 * 256)
            assert np.abs(c.y - d[f"{key}_y"]).max() <= TOL, key
        else:
            assert c.y is None
    if fam == "sdxl":
        pos, neg = cond.encode_pair(prompts["basic"], "", width=768, height=1024)
        assert np.abs(pos.context - d["basic_skip-1_context"]).max() <= TOL
        np.testing.assert_array_equal(neg.context, d["uncond_context"])
        assert np.abs(neg.y - d["uncond_y"]).max() <= TOL
        _, neg = cond.encode_pair(prompts["basic"], "ugly", width=768, height=1024)
        assert np.abs(neg.context).max() > 0


@pytest.mark.parametrize("fam", ["sd1", "sdxl"])
def test_encode_many_is_encode_per_prompt(fam, tmp_path):
    """One graph for several prompts (a long one of several chunks, a zeroed one, a short one)
    gives each prompt what encode gives it alone: chunks are independent batch items."""
    d, cond = _conditioner(fam, tmp_path)
    prompts = dict(zip(d["prompt_names"].tolist(), d["prompts"].tolist()))
    long = max(prompts.values(), key=lambda p: cond.tokenize(p)[0].size)
    assert cond.tokenize(long)[0].size > 77
    reqs = [(long, False), ("", True), ("a red cat", False)]
    many = cond.encode_many(reqs, width=768, height=1024)
    for (p, zero), got in zip(reqs, many):
        one = cond.encode(p, 768, 1024, zero_out_masked=zero)
        assert got.context.shape == one.context.shape and got.ids.tolist() == one.ids.tolist()
        np.testing.assert_allclose(got.context, one.context, rtol=1e-5, atol=1e-6)
        assert (got.y is None) == (one.y is None) == (fam != "sdxl")
        if got.y is not None:
            np.testing.assert_allclose(got.y, one.y, rtol=1e-5, atol=1e-6)
    assert not many[1].context.any()


def test_context_widths_and_defaults(tmp_path):
    _, cond = _conditioner("sdxl", tmp_path)
    assert cond.context_dim == 64 + 96 and cond.default_clip_skip == 2
    with pytest.raises(UsageError, match="image size"):
        cond.encode("a cat")
    c = cond.encode("a cat", orig_size=(512, 512), target_size=(1024, 768), crop=(8, 0))
    assert c.context.shape == (1, 77, 160)
    np.testing.assert_array_equal(c.y[0, :96], cond.encode("a cat", 1, 1).y[0, :96])   # pooled: size-free


def test_embedding_without_the_needed_width_stays_text(tmp_path, caplog):
    d = np.load(os.path.join(FIX, "clip_cond_sd1.npz"))
    emb_dir = tmp_path / "e"
    emb_dir.mkdir()
    write_safetensors(str(emb_dir / "myemb.safetensors"), {"emb_params": np.zeros((2, 32), np.float32)})
    cond = build_conditioner(spec_table(d, "w"), "sd1", str(emb_dir), heads=2)
    ids, _ = cond.tokenize("a myemb style")
    assert ids[:6].tolist() == [49406, 320] + CLIPTokenizer().encode("myemb style") + [49407]
    assert "no tensor 64 wide" in caplog.text


def test_build_errors(tmp_path):
    d = np.load(os.path.join(FIX, "clip_cond_sd1.npz"))
    table = spec_table(d, "w")
    with pytest.raises(UnsupportedError, match="wan"):
        build_conditioner(table, "wan2")
    with pytest.raises(UsageError, match="--t5xxl"):          # Flux's conditioner names the missing file
        build_conditioner(table, "flux")
    with pytest.raises(ModelFileError, match="cond_stage_model.1.transformer"):
        build_conditioner(table, "sdxl", heads=2)
    with pytest.raises(UsageError, match="embd-dir"):
        build_conditioner(table, "sd1", str(tmp_path / "missing"), heads=2)
    with pytest.raises(UsageError, match="gelu"):
        build_conditioner(table, "sd1", gelu="fast")
