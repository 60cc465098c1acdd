"""LoRA / LyCORIS (sdrt.engine.lora): the merge math of every type against plain numpy written
from the formats' definitions (LyCORIS' einsum forms, torch.kron's index rule), key mapping on
the real SD1.5 / SDXL name sets, the prompt syntax, and generation on a tiny checkpoint in both
apply modes and on a Q8_0 base."""
import gzip
import hashlib
import json
import logging
import os
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_tiny import tiny_sd1_tensors, write_tiny_sd1  # noqa: E402

from sdrt.engine import lora as L  # noqa: E402
from sdrt.errors import UsageError  # noqa: E402
from sdrt.io import write_safetensors  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DM = "model.diffusion_model."


def _g(**roles):
    """A group as LoraModel builds it: {role: (key, tensor)}; numpy arrays wrapped as F32 leaves."""
    return {r: (f"k.{r}", Tensor.from_numpy(np.ascontiguousarray(v, np.float32))) for r, v in roles.items()}


def _rand(r, *shape):
    return r.standard_normal(shape).astype(np.float32)


def _kron(a, b):
    """torch.kron's definition: out[i*p + k, j*q + l, ...] = a[i, j, ...] * b[k, l, ...]."""
    a = a.reshape(a.shape + (1,) * (b.ndim - a.ndim))
    out = np.zeros(tuple(x * y for x, y in zip(a.shape, b.shape)), np.float64)
    for idx in np.ndindex(*a.shape[:2]):
        i, j = idx
        out[i * b.shape[0]:(i + 1) * b.shape[0], j * b.shape[1]:(j + 1) * b.shape[1]] = a[i, j] * b
    return out


# ---- merge math ------------------------------------------------------------------------------------

def test_lora_linear_alpha_rank_scale(rng):
    down, up = _rand(rng, 4, 16), _rand(rng, 24, 4)
    d, used = L.weight_delta(_g(lora_down=down, lora_up=up, alpha=np.array([2.0])), 0.7)
    ref = np.einsum("or,ri->oi", up.astype(np.float64), down) * (2.0 / 4) * 0.7
    np.testing.assert_allclose(d, ref, rtol=1e-5, atol=1e-5)
    assert sorted(used) == ["k.alpha", "k.lora_down", "k.lora_up"]
    # `.scale` wins over alpha; no alpha: scale 1
    d2, _ = L.weight_delta(_g(lora_down=down, lora_up=up, alpha=np.array([2.0]), scale=np.array([0.3])), 1.0)
    np.testing.assert_allclose(d2, up @ down * 0.3, rtol=1e-5, atol=1e-5)
    d3, _ = L.weight_delta(_g(lora_down=down, lora_up=up), 1.0)
    np.testing.assert_allclose(d3, up @ down, rtol=1e-5, atol=1e-5)


def test_locon_conv3x3_and_1x1(rng):
    down, up = _rand(rng, 4, 8, 3, 3), _rand(rng, 12, 4, 1, 1)
    d, _ = L.weight_delta(_g(lora_down=down, lora_up=up, alpha=np.array([1.0])), 1.0)
    ref = np.einsum("or,rikl->oikl", up[:, :, 0, 0].astype(np.float64), down) / 4
    assert d.shape == (12, 8, 3, 3)
    np.testing.assert_allclose(d, ref, rtol=1e-5, atol=1e-5)
    d1, _ = L.weight_delta(_g(lora_down=_rand(rng, 4, 8, 1, 1), lora_up=up), 1.0)
    assert d1.shape == (12, 8, 1, 1)


def test_locon_tucker_mid(rng):
    # LyCORIS LoCon with use_tucker: down 1x1 [r, in], mid [r, r, k, k], up 1x1 [out, r];
    # rebuild = einsum("i j k l, j r, i p -> p r k l", mid, down, up^T)
    down, mid, up = _rand(rng, 4, 8, 1, 1), _rand(rng, 4, 4, 3, 3), _rand(rng, 12, 4, 1, 1)
    d, used = L.weight_delta(_g(lora_down=down, lora_mid=mid, lora_up=up, alpha=np.array([2.0])), 1.5)
    ref = np.einsum("ijkl,jr,ip->prkl", mid.astype(np.float64), down[:, :, 0, 0], up[:, :, 0, 0].T) * 0.5 * 1.5
    np.testing.assert_allclose(d, ref, rtol=1e-4, atol=1e-4)
    assert "k.lora_mid" in used


def test_loha_plain_and_tucker(rng):
    w1a, w1b, w2a, w2b = _rand(rng, 12, 4), _rand(rng, 4, 8), _rand(rng, 12, 4), _rand(rng, 4, 8)
    d, used = L.weight_delta(_g(hada_w1_a=w1a, hada_w1_b=w1b, hada_w2_a=w2a, hada_w2_b=w2b, alpha=np.array([2.0])), 0.5)
    ref = (w1a.astype(np.float64) @ w1b) * (w2a @ w2b) * (2.0 / 4) * 0.5
    np.testing.assert_allclose(d, ref, rtol=1e-4, atol=1e-4)
    assert len(used) == 5
    # Tucker (conv): w_a stored [rank, out], w_b [rank, in], t [rank, rank, k, k]
    t1, t2 = _rand(rng, 4, 4, 3, 3), _rand(rng, 4, 4, 3, 3)
    a1, b1, a2, b2 = _rand(rng, 4, 12), _rand(rng, 4, 8), _rand(rng, 4, 12), _rand(rng, 4, 8)
    d, _ = L.weight_delta(_g(hada_w1_a=a1, hada_w1_b=b1, hada_w2_a=a2, hada_w2_b=b2, hada_t1=t1, hada_t2=t2), 1.0)
    rebuild = lambda t, wa, wb: np.einsum("ijkl,jr,ip->prkl", t.astype(np.float64), wb, wa)  # noqa: E731
    np.testing.assert_allclose(d, rebuild(t1, a1, b1) * rebuild(t2, a2, b2), rtol=1e-4, atol=1e-3)


def test_lokr_full_factorized_and_conv(rng):
    w1, w2 = _rand(rng, 3, 2), _rand(rng, 4, 5)
    d, _ = L.weight_delta(_g(lokr_w1=w1, lokr_w2=w2, alpha=np.array([8.0])), 0.5)
    np.testing.assert_allclose(d, _kron(w1, w2) * 0.5, rtol=1e-5, atol=1e-6)   # rank 1: alpha ignored (sd.cpp)
    w2a, w2b = _rand(rng, 4, 2), _rand(rng, 2, 5)
    d, used = L.weight_delta(_g(lokr_w1=w1, lokr_w2_a=w2a, lokr_w2_b=w2b, alpha=np.array([1.0])), 1.0)
    np.testing.assert_allclose(d, _kron(w1, w2a @ w2b) * (1.0 / 2), rtol=1e-5, atol=1e-5)
    assert sorted(used) == ["k.alpha", "k.lokr_w1", "k.lokr_w2_a", "k.lokr_w2_b"]
    w1a, w1b = _rand(rng, 3, 1), _rand(rng, 1, 2)
    w2c = _rand(rng, 4, 5, 3, 3)
    d, _ = L.weight_delta(_g(lokr_w1_a=w1a, lokr_w1_b=w1b, lokr_w2=w2c), 1.0)
    assert d.shape == (12, 10, 3, 3)
    np.testing.assert_allclose(d, _kron(w1a @ w1b, w2c), rtol=1e-5, atol=1e-5)
    # Tucker w2 (lokr_t2): LyCORIS rebuild with w2_a [rank, out], w2_b [rank, in]
    t2, a, b = _rand(rng, 2, 2, 3, 3), _rand(rng, 2, 4), _rand(rng, 2, 5)
    d, _ = L.weight_delta(_g(lokr_w1=w1, lokr_w2_a=a, lokr_w2_b=b, lokr_t2=t2), 1.0)
    w2t = np.einsum("ijkl,jr,ip->prkl", t2.astype(np.float64), b, a)
    np.testing.assert_allclose(d, _kron(w1, w2t), rtol=1e-4, atol=1e-4)


def test_full_diff_and_bias(rng):
    diff = _rand(rng, 6, 5)
    d, used = L.weight_delta(_g(diff=diff), 0.25)
    np.testing.assert_allclose(d, diff * 0.25)
    assert used == ["k.diff"]


def test_incomplete_group_is_no_type(rng):
    assert L.weight_delta(_g(lora_up=_rand(rng, 4, 2)), 1.0) is None
    assert L.weight_delta(_g(dora_scale=_rand(rng, 4, 1)), 1.0) is None     # sd.cpp has no DoRA


# ---- the prompt --------------------------------------------------------------------------------------

def test_extract_loras(tmp_path, caplog):
    (tmp_path / "a.safetensors").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.ckpt").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, "sdrt"):
        p, specs = L.extract_loras("cat <lora:a:0.5>, dog<lora:sub/b:1><lora:a:0.25> <lora:missing:1><lora:a:x>",
                                   str(tmp_path))
    assert p == "cat , dog "
    assert specs == [L.LoraSpec(str(tmp_path / "a.safetensors"), 0.75), L.LoraSpec(str(tmp_path / "sub" / "b.ckpt"), 1.0)]
    assert "can not found lora" in caplog.text and "missing" in caplog.text
    for bad in ("../a", "/etc/passwd", "sub/../../a"):
        with pytest.raises(UsageError, match="inside --lora-model-dir"):
            L.extract_loras(f"<lora:{bad}:1>", str(tmp_path))


def test_lora_hashes_are_a1111_addnet_hashes(tmp_path):
    path = str(tmp_path / "my,lo:ra.safetensors")
    write_safetensors(path, {"x.lora_up.weight": np.ones((2, 2), np.float32)})
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    want = hashlib.sha256(raw[8 + n:]).hexdigest()[:12]
    assert L.lora_hashes([L.LoraSpec(path, 1.0)]) == f"mylora: {want}"


# ---- key mapping on the real name sets ------------------------------------------------------------

def _real_names(arch):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_sd_checkpoint import layout

    from sdrt.io.detect import detect_version
    from sdrt.models.names import convert_names
    table = layout(arch)
    fake = {n: Tensor(np.float32, tuple(reversed(s)) or (1,)) for n, s in table.items() if not n.endswith("position_ids")}
    version = detect_version(fake)
    conv = convert_names(fake, version)
    return {conv[n]: t for n, t in fake.items()}, version


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_every_key_format_maps_onto_the_real_names(tmp_path, arch):
    model, version = _real_names(arch)
    with gzip.open(os.path.join(ROOT, "tests", "fixtures", "ckpt_names_diffusers_ldm.json.gz"), "rt") as f:
        unet = [(d, ldm) for d, _, ldm, shape in json.load(f)[f"{arch}_unet"] if len(shape) >= 2]
    assert all(DM + ldm in model for _, ldm in unet)
    one = np.zeros((1, 1), np.float16)
    formats = {f: {} for f in ("kohya", "lycoris_ldm", "peft", "diffusers", "lokr", "te")}
    for dname, ldm in unet:
        stem = dname[: -len(".weight")]
        formats["kohya"]["lora_unet_" + stem.replace(".", "_") + ".lora_down.weight"] = DM + ldm
        formats["lycoris_ldm"]["lora_unet_" + ldm[:-7].replace(".", "_") + ".hada_w1_a"] = DM + ldm
        formats["peft"]["unet." + stem + ".lora_A.weight"] = DM + ldm
        formats["diffusers"]["unet." + stem + ".lora.up.weight"] = DM + ldm
        formats["lokr"]["lora_unet_" + stem.replace(".", "_") + ".lokr_w1"] = DM + ldm
    tes = [n for n in model if n.startswith("cond_stage_model.") and n.endswith("proj.weight")]
    assert tes
    for n in tes:
        head = ("lora_te_" if arch == "sd15" else "lora_te2_" if n.startswith("cond_stage_model.1.") else "lora_te1_")
        stem = n.split("text_model.", 1)[1][: -len(".weight")]
        # OpenCLIP bigG keeps its fused in_proj: LoRAs name q/k/v (sd.cpp maps them onto in_proj parts)
        for part in (("q_proj", "k_proj", "v_proj") if stem.endswith("in_proj") else (None,)):
            s = stem.replace("in_proj", part) if part else stem
            formats["te"][head + "text_model_" + s.replace(".", "_") + ".lora_up.weight"] = n
    for fmt, keys in formats.items():
        path = tmp_path / f"{fmt}.safetensors"
        write_safetensors(str(path), {k: one for k in keys})
        lm = L.LoraModel.load(L.LoraSpec(str(path), 1.0), model, version)
        assert lm.unmatched == [], fmt
        got = {g[r][0]: t for (t, _), g in lm.groups.items() for r in g}
        assert got == keys, fmt


# ---- generation on a tiny checkpoint -----------------------------------------------------------------

def _kohya(stem):
    return "lora_unet_" + stem.replace(".", "_")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    ckpt = write_tiny_sd1(d / "tiny.safetensors")
    t = tiny_sd1_tensors()
    r = np.random.default_rng(7)
    lo, loha = {}, {}
    for k, v in t.items():
        if not k.startswith(DM) or v.ndim < 2:
            continue
        stem = k[len(DM):-len(".weight")]
        s = v.shape
        if "to_q" in stem or "proj_in" in stem or "in_layers.2" in stem:          # linear, 1x1 conv, 3x3 conv
            lo[_kohya(stem) + ".lora_down.weight"] = (r.standard_normal((4,) + s[1:]) * 0.3).astype(np.float16)
            lo[_kohya(stem) + ".lora_up.weight"] = (r.standard_normal((s[0], 4) + (1, 1) * (len(s) == 4)) * 0.3
                                                    ).reshape((s[0], 4) + ((1, 1) if len(s) == 4 else ())).astype(np.float16)
            lo[_kohya(stem) + ".alpha"] = np.array(2.0, np.float16)
        if "to_k" in stem or "ff.net.2" in stem:                                  # LoHa (merged) and LoKr
            loha[_kohya(stem) + ".hada_w1_a"] = (r.standard_normal((s[0], 2)) * 0.3).astype(np.float32)
            loha[_kohya(stem) + ".hada_w1_b"] = (r.standard_normal((2, s[1])) * 0.3).astype(np.float32)
            loha[_kohya(stem) + ".hada_w2_a"] = (r.standard_normal((s[0], 2)) * 0.3).astype(np.float32)
            loha[_kohya(stem) + ".hada_w2_b"] = (r.standard_normal((2, s[1])) * 0.3).astype(np.float32)
        if "to_v" in stem:
            loha[_kohya(stem) + ".lokr_w1"] = (r.standard_normal((2, 2)) * 0.3).astype(np.float32)
            loha[_kohya(stem) + ".lokr_w2"] = (r.standard_normal((s[0] // 2, s[1] // 2)) * 0.3).astype(np.float32)
    te = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    lo[te + ".lora_down.weight"] = (r.standard_normal((4, 768)) * 0.3).astype(np.float16)
    lo[te + ".lora_up.weight"] = (r.standard_normal((768, 4)) * 0.3).astype(np.float16)
    write_safetensors(str(d / "locon.safetensors"), lo)
    write_safetensors(str(d / "lyco.safetensors"), loha)
    write_safetensors(str(d / "other.safetensors"), {"lora_unet_not_a_layer.lora_down.weight": np.ones((2, 2), np.float16)})
    return {"dir": str(d), "ckpt": ckpt, "n_locon": len(lo), "n_lyco": len(loha)}


def _gen(tiny, prompt, **mp):
    from sdrt.engine.params import GenParams, ModelParams
    from sdrt.engine.pipeline import Pipeline
    pipe = Pipeline.load(ModelParams(model=tiny["ckpt"], lora_model_dir=tiny["dir"], **mp))
    out = pipe.generate(GenParams(prompt=prompt, width=64, height=64, steps=2, sampling_method="euler"),
                        show_progress=False, lora_tags=True)
    return pipe, out[0].image.astype(np.float64)


def _psnr(a, b):
    return 10 * np.log10(255.0 ** 2 / max(np.mean((a - b) ** 2), 1e-12))


def test_immediately_equals_at_runtime(tiny, caplog):
    prompt = "a cat <lora:locon:0.8><lora:lyco:0.5>"
    with caplog.at_level(logging.INFO, "sdrt"):
        pipe, imm = _gen(tiny, prompt, lora_apply_mode="immediately")
    assert f"({tiny['n_locon']} / {tiny['n_locon']}) LoRA tensors have been applied" in caplog.text
    assert f"({tiny['n_lyco']} / {tiny['n_lyco']}) LoRA tensors have been applied" in caplog.text
    # the merged leaf is W + delta (numpy), in W's type
    name = DM + "input_blocks.1.0.in_layers.2.weight"
    w = pipe.models.tensors[name]
    base = tiny_sd1_tensors()[name].astype(np.float32)
    from safetensors.numpy import load_file
    lo = load_file(os.path.join(tiny["dir"], "locon.safetensors"))
    k = _kohya("input_blocks.1.0.in_layers.2")
    up, down = lo[k + ".lora_up.weight"].astype(np.float64), lo[k + ".lora_down.weight"].astype(np.float64)
    ref = base + np.einsum("or,rikl->oikl", up[:, :, 0, 0], down) * (2.0 / 4) * 0.8
    got = L._f32(w)
    assert w.dtype.name == "F16"
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)
    caplog.clear()
    with caplog.at_level(logging.INFO, "sdrt"):
        _, rt = _gen(tiny, prompt, lora_apply_mode="at_runtime")
    assert "apply LoRAs at_runtime" in caplog.text
    _, none = _gen(tiny, "a cat")
    assert _psnr(imm, rt) > 60, _psnr(imm, rt)
    assert _psnr(imm, none) < _psnr(imm, rt) - 15


@pytest.mark.parametrize("merge", ["on", "off"])
def test_runtime_fold_equals_beside(tiny, monkeypatch, merge):
    """at_runtime on float Linears: the delta folded into the weight in the graph (W + up @ down,
    "on") and the low-rank chain beside the GEMM ("off") give the image the merge gives."""
    monkeypatch.setattr(L, "RUNTIME_MERGE", merge)
    prompt = "a cat <lora:locon:0.8><lora:lyco:0.5>"
    _, imm = _gen(tiny, prompt, lora_apply_mode="immediately")
    _, rt = _gen(tiny, prompt, lora_apply_mode="at_runtime")
    assert _psnr(imm, rt) > 60, _psnr(imm, rt)


def test_runtime_fold_graph(monkeypatch):
    """RuntimePath.linear's two graphs against numpy: x @ (W + s·up@down + dense)^T + b."""
    from sdrt.ops import api as F
    from sdrt.ops.tensor import Tensor
    r = np.random.default_rng(3)
    n_in, n_out, rows, rank = 24, 16, 40, 4
    w = (r.standard_normal((n_out, n_in)) * 0.2).astype(np.float16)
    b = r.standard_normal(n_out).astype(np.float32)
    x = r.standard_normal((rows, n_in)).astype(np.float32)
    down, up = r.standard_normal((rank, n_in)), r.standard_normal((n_out, rank))
    kron = (r.standard_normal((n_out, n_in)) * 0.1).astype(np.float32)
    lo = {"lora_unet_a.lora_down.weight": down.astype(np.float32), "lora_unet_a.lora_up.weight": up.astype(np.float32),
          "lora_unet_a.alpha": np.array(2.0, np.float32)}
    p = L.RuntimePath()
    p.dense.append(Tensor.from_numpy(kron))
    group = {k.split(".", 1)[1].split(".")[0]: (k, v) for k, v in lo.items()}
    lm = L.LoraModel("x", 0.5)
    q = L._runtime_path(lm, "model.diffusion_model.a.weight", [(0, group)], (n_out, n_in))
    p.chains, p.merge_factors = q.chains, q.merge_factors
    folded = w.astype(np.float64) + up @ down * (2.0 / rank) * 0.5 + kron
    want = x.astype(np.float64) @ folded.T + b
    wt = Tensor.from_numpy(w)
    for mode in ("on", "off", "auto"):
        monkeypatch.setattr(L, "RUNTIME_MERGE", mode)
        p.fold = None
        y = p.linear(Tensor.from_numpy(x), wt, Tensor.from_numpy(b))
        ops = {n.op for n in F.Graph({"y": y}).nodes}
        fold = p.fold is not None
        weight = y.owner.src[0].owner.src[0]
        assert "mul_mat" in ops and (mode != "on" or (fold and weight is p.fold[1] and weight.is_leaf
                                                       and weight.dtype.name == "F16")), (mode, ops)
        # folded: W + delta in the weight's F16 (the GEMM's weight as a merge would store it)
        ref = x.astype(np.float64) @ folded.astype(np.float16).astype(np.float64).T + b if fold else want
        np.testing.assert_allclose(F.compute(y), ref, rtol=1e-4, atol=1e-4)
    # the fold of a stored weight is built once per path: later graphs read the same leaf
    monkeypatch.setattr(L, "RUNTIME_MERGE", "on")
    first = p.linear(Tensor.from_numpy(x), wt, Tensor.from_numpy(b)).owner.src[0].owner.src[0]
    assert p.linear(Tensor.from_numpy(x), wt, Tensor.from_numpy(b)).owner.src[0].owner.src[0] is first
    # a weight the graph computes (not a stored leaf) is folded inside the graph
    w_node = F.cast(Tensor.from_numpy(w.astype(np.float32)), "F16")
    y = p.linear(Tensor.from_numpy(x), w_node, Tensor.from_numpy(b))
    weight = y.owner.src[0].owner.src[0]
    assert weight.op == "cast" and weight.owner.src[0].op == "add"
    np.testing.assert_allclose(F.compute(y), x.astype(np.float64) @ folded.astype(np.float16).astype(np.float64).T + b,
                               rtol=1e-4, atol=1e-4)


def test_q8_0_base_applies_at_runtime(tiny, caplog):
    from sdrt.models.common import RUNTIME_LORA
    with caplog.at_level(logging.INFO, "sdrt"):
        pipe, q8 = _gen(tiny, "a cat <lora:locon:0.8>", type="q8_0")
    assert "apply LoRAs at_runtime" in caplog.text                      # auto: quantized weights
    w = pipe.models.tensors[DM + "input_blocks.3.1.transformer_blocks.0.attn1.to_q.weight"]
    assert w.dtype.name == "Q8_0" and w in RUNTIME_LORA                    # the weight stays quantized
    _, f16 = _gen(tiny, "a cat <lora:locon:0.8>", lora_apply_mode="immediately")
    _, q8_none = _gen(tiny, "a cat", type="q8_0")
    assert _psnr(q8, f16) > _psnr(q8, q8_none) + 5       # 56 dB vs 47 dB when written


def test_pipeline_takes_tags_only_when_asked(tiny):
    """Pipeline.generate leaves `<lora:>` alone by default (sd-server does not parse them)."""
    from sdrt.engine.params import GenParams, ModelParams
    from sdrt.engine.pipeline import Pipeline
    pipe = Pipeline.load(ModelParams(model=tiny["ckpt"], lora_model_dir=tiny["dir"]))
    pipe.generate(GenParams(prompt="a cat <lora:locon:1>", width=64, height=64, steps=1), show_progress=False)
    assert pipe._loras is None


def test_lora_matching_nothing_warns_and_generation_continues(tiny, caplog):
    with caplog.at_level(logging.WARNING, "sdrt"):
        _, img = _gen(tiny, "a cat <lora:other:1>")
    assert "Only (0 / 1) LoRA tensors have been applied" in caplog.text
    assert "lora_unet_not_a_layer.lora_down.weight" in caplog.text
    _, none = _gen(tiny, "a cat")
    np.testing.assert_array_equal(img, none)


def test_cli_end_to_end(tiny, tmp_path, caplog):
    from sdrt.cli import main as cli
    from sdrt.io.png import read_png_text
    out = str(tmp_path / "out.png")
    with caplog.at_level(logging.INFO, "sdrt"):
        rc = cli.main(["-m", tiny["ckpt"], "-p", "a cat <lora:locon:1>", "--lora-model-dir", tiny["dir"],
                       "-W", "64", "-H", "64", "--steps", "1", "-o", out])
    assert rc == 0
    assert f"({tiny['n_locon']} / {tiny['n_locon']}) LoRA tensors have been applied" in caplog.text
    text = read_png_text(open(out, "rb").read())["parameters"]
    assert text.startswith("a cat <lora:locon:1>\n")
    assert f'Lora hashes: "locon: {L.lora_hashes([L.LoraSpec(os.path.join(tiny["dir"], "locon.safetensors"))]).split(": ")[1]}"' in text


# ---- against diffusers + peft (tests/fixtures/lora_goldens.npz, tools/make_lora_goldens.py) ---------

GOLDENS = os.path.join(ROOT, "tests", "fixtures", "lora_goldens.npz")


def test_kohya_merge_matches_diffusers_fuse_lora(tmp_path, rng):
    """A kohya LoRA on an SD1.5-layout UNet fused by diffusers/peft at 0.7 == sdrt's immediate merge
    under the LDM names sdrt maps the kohya keys to."""
    from sdrt.models.names import convert_tensor_name
    z = np.load(GOLDENS)
    mult = float(z["multiplier"])
    lora = {k[len("kohya/"):]: z[k] for k in z if k.startswith("kohya/")}
    path = str(tmp_path / "k.safetensors")
    write_safetensors(path, {k: (v if v.ndim else v.reshape(1)) for k, v in lora.items()})
    deltas = {convert_tensor_name(DM + k[len("delta/"):], "sd1"): z[k] for k in z if k.startswith("delta/")}
    base = {n: rng.standard_normal(d.shape).astype(np.float32) for n, d in deltas.items()}
    table = {n: Tensor.from_numpy(b, name=n) for n, b in base.items()}
    out, runtime = L.apply_loras(table, [L.LoraSpec(path, mult)], "sd1", "immediately")
    assert not runtime and len(deltas) > 50
    for n, d in deltas.items():
        np.testing.assert_allclose(L._f32(out[n]) - base[n], d, rtol=1e-4, atol=2e-5, err_msg=n)


@pytest.mark.parametrize("kind, mod", [("loha", "lin"), ("loha", "conv"), ("lokr", "lin"), ("lokr", "conv")])
def test_lycoris_delta_matches_peft(kind, mod):
    z = np.load(GOLDENS)
    pre = f"{kind}/{mod}."
    group = _g(**{k[len(pre):]: z[k].reshape(z[k].shape or (1,)) for k in z if k.startswith(pre) and not k.endswith("delta")})
    d, _ = L.weight_delta(group, 1.0)
    want = z[pre + "delta"]
    if kind == "lokr" and "lokr_w2" in group and "lokr_w1" in group:
        # both factors full: LyCORIS and sd.cpp use scale 1 (rank 1); peft still applies alpha/r
        want = want / (6.0 / 4)
    np.testing.assert_allclose(d, want, rtol=1e-4, atol=1e-5)


def test_python_api_loras_argument_equals_the_prompt_tag(tiny):
    import sdrt
    kw = dict(model=tiny["ckpt"], width=64, height=64, steps=1, sampling_method="euler", output="numpy")
    by_tag = sdrt.generate("a cat <lora:locon:0.6>", lora_model_dir=tiny["dir"], **kw)[0]
    by_arg = sdrt.generate("a cat", loras=[(os.path.join(tiny["dir"], "locon.safetensors"), 0.6)], **kw)[0]
    plain = sdrt.generate("a cat", **kw)[0]
    np.testing.assert_array_equal(by_tag, by_arg)
    assert not np.array_equal(by_tag, plain)


def test_delta_shape_without_reading_matches_the_delta(rng):
    """Counting applied/skipped tensors uses shapes only (nothing is read until a weight is used)."""
    groups = [
        _g(lora_down=_rand(rng, 4, 8, 3, 3), lora_up=_rand(rng, 12, 4, 1, 1)),
        _g(lora_down=_rand(rng, 4, 8, 1, 1), lora_mid=_rand(rng, 4, 4, 3, 3), lora_up=_rand(rng, 12, 4, 1, 1)),
        _g(diff=_rand(rng, 6, 5)),
        _g(hada_w1_a=_rand(rng, 12, 4), hada_w1_b=_rand(rng, 4, 8), hada_w2_a=_rand(rng, 12, 4), hada_w2_b=_rand(rng, 4, 8)),
        _g(hada_w1_a=_rand(rng, 4, 12), hada_w1_b=_rand(rng, 4, 8), hada_w2_a=_rand(rng, 4, 12), hada_w2_b=_rand(rng, 4, 8),
           hada_t1=_rand(rng, 4, 4, 3, 3), hada_t2=_rand(rng, 4, 4, 3, 3)),
        _g(lokr_w1_a=_rand(rng, 3, 1), lokr_w1_b=_rand(rng, 1, 2), lokr_w2=_rand(rng, 4, 5, 3, 3)),
        _g(lokr_w1=_rand(rng, 3, 2), lokr_w2_a=_rand(rng, 2, 4), lokr_w2_b=_rand(rng, 2, 5), lokr_t2=_rand(rng, 2, 2, 3, 3)),
    ]
    for g in groups:
        assert L._delta_shape(g, L._kind(g)) == L.weight_delta(g, 1.0)[0].shape


def test_diffusers_sdxl_text_encoder_prefixes():
    from sdrt.models.names import lora_target
    te = "text_model.encoder.layers.0.self_attn.q_proj"
    assert lora_target(f"text_encoder_2.{te}.lora_A.weight", "sdxl") == \
        (f"cond_stage_model.1.transformer.{te}.weight", "lora_down")
    assert lora_target(f"text_encoder.{te}.lora_B.weight", "sdxl") == (f"cond_stage_model.transformer.{te}.weight", "lora_up")
