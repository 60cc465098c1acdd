"""LoRA on the diffusion transformers (issue 16: "every family sdrt runs ... Flux/SD3 as they
land"). Flux: diffusers/PEFT names on the split q/k/v and proj_mlp parts of BFL's fused weights,
and kohya names on BFL weights; SD3: PEFT names on the split q/k/v of SAI's fused qkv, the
output projection and the MLP. Merged against numpy written from the formats' definitions; the
tiny random image with the LoRAs at run time equals the merged one, and both are moved by them."""
import logging
import os

import flux_tiny as ft
import numpy as np
import pytest
import sd3_tiny as st

from sdrt.engine.lora import LoraSpec, apply_loras
from sdrt.engine.params import GenParams, ModelParams
from sdrt.engine.pipeline import Pipeline
from sdrt.io import write_safetensors
from sdrt.ops.tensor import Tensor

RANK, H, MLP = 4, ft.DIT["hidden_size"], ft.DIT["mlp_hidden"]
DM = "model.diffusion_model."


def _rand(rng, *shape, scale=0.3):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def peft_lora(rng) -> dict:
    """diffusers/PEFT names (what diffusers' Flux pipelines save): q/k/v of the first double
    block's image and text attention and the second single block's q and proj_mlp, each a
    part of one fused BFL weight; no alpha (scale 1)."""
    t = {}
    for name, n_in, n_out in [("transformer_blocks.0.attn.to_q", H, H), ("transformer_blocks.0.attn.to_k", H, H),
                              ("transformer_blocks.0.attn.to_v", H, H), ("transformer_blocks.0.attn.add_v_proj", H, H),
                              ("single_transformer_blocks.1.attn.to_q", H, H),
                              ("single_transformer_blocks.1.proj_mlp", H, MLP)]:
        t[f"transformer.{name}.lora_A.weight"] = _rand(rng, RANK, n_in)
        t[f"transformer.{name}.lora_B.weight"] = _rand(rng, n_out, RANK)
    return t


def kohya_lora(rng) -> dict:
    """kohya names on BFL weights (`lora_unet_double_blocks_0_img_mlp_0`), with alpha 2 (scale
    alpha / rank)."""
    t = {}
    for name, n_in, n_out in [("double_blocks_0_img_mlp_0", H, MLP), ("double_blocks_0_txt_attn_proj", H, H),
                              ("single_blocks_0_linear2", H + MLP, H)]:
        t[f"lora_unet_{name}.lora_down.weight"] = _rand(rng, RANK, n_in)
        t[f"lora_unet_{name}.lora_up.weight"] = _rand(rng, n_out, RANK)
        t[f"lora_unet_{name}.alpha"] = np.array(2.0, np.float32)
    return t


def expected(base: dict, peft: dict, kohya: dict, m_peft: float, m_kohya: float) -> dict:
    """The merged BFL weights, by hand: a split part adds up @ down to its rows of the fused
    weight (q, k, v, then proj_mlp for a single block's linear1)."""
    out = {k: v.copy() for k, v in base.items()}

    def add(target, rows, up, down, s):
        out[DM + target][rows] += s * (up @ down)

    p = "transformer."
    for part, rows in (("to_q", slice(0, H)), ("to_k", slice(H, 2 * H)), ("to_v", slice(2 * H, 3 * H))):
        add("double_blocks.0.img_attn.qkv.weight", rows, peft[f"{p}transformer_blocks.0.attn.{part}.lora_B.weight"],
            peft[f"{p}transformer_blocks.0.attn.{part}.lora_A.weight"], m_peft)
    add("double_blocks.0.txt_attn.qkv.weight", slice(2 * H, 3 * H),
        peft[f"{p}transformer_blocks.0.attn.add_v_proj.lora_B.weight"],
        peft[f"{p}transformer_blocks.0.attn.add_v_proj.lora_A.weight"], m_peft)
    add("single_blocks.1.linear1.weight", slice(0, H), peft[f"{p}single_transformer_blocks.1.attn.to_q.lora_B.weight"],
        peft[f"{p}single_transformer_blocks.1.attn.to_q.lora_A.weight"], m_peft)
    add("single_blocks.1.linear1.weight", slice(3 * H, 3 * H + MLP),
        peft[f"{p}single_transformer_blocks.1.proj_mlp.lora_B.weight"],
        peft[f"{p}single_transformer_blocks.1.proj_mlp.lora_A.weight"], m_peft)
    for name, target in (("double_blocks_0_img_mlp_0", "double_blocks.0.img_mlp.0.weight"),
                         ("double_blocks_0_txt_attn_proj", "double_blocks.0.txt_attn.proj.weight"),
                         ("single_blocks_0_linear2", "single_blocks.0.linear2.weight")):
        add(target, slice(None), kohya[f"lora_unet_{name}.lora_up.weight"], kohya[f"lora_unet_{name}.lora_down.weight"],
            m_kohya * 2.0 / RANK)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux_lora")
    rng = np.random.default_rng(11)
    peft, kohya = peft_lora(rng), kohya_lora(rng)
    loras = d / "loras"
    os.makedirs(loras)
    write_safetensors(str(loras / "flux_peft.safetensors"), peft)
    write_safetensors(str(loras / "flux_kohya.safetensors"), kohya)
    return {"args": ft.write(str(d / "dev"), "dev"), "loras": str(loras), "peft": peft, "kohya": kohya}


def test_merge_against_numpy(tiny):
    base = ft._arrays(ft.dit_names("dev"), DM, 0)
    table = {k: Tensor.from_numpy(v, name=k) for k, v in base.items()}
    specs = [LoraSpec(os.path.join(tiny["loras"], "flux_peft.safetensors"), 0.8),
             LoraSpec(os.path.join(tiny["loras"], "flux_kohya.safetensors"), 0.6)]
    merged, runtime = apply_loras(table, specs, "flux", "immediately")
    assert runtime == {}
    want = expected(base, tiny["peft"], tiny["kohya"], 0.8, 0.6)
    changed = [k for k in base if not np.array_equal(want[k], base[k])]
    assert len(changed) == 6
    for k in base:
        got = merged[k].to_f32().reshape(base[k].shape)
        np.testing.assert_allclose(got, want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def _image(tiny, mode, prompt, cfg_scale=1.0):
    args = dict(zip(tiny["args"][::2], tiny["args"][1::2]))
    pipe = Pipeline.load(ModelParams(model=args["-m"], lora_model_dir=tiny["loras"], lora_apply_mode=mode))
    out = pipe.generate(GenParams(prompt=prompt, width=64, height=64, steps=2, sampling_method="euler",
                                  cfg_scale=cfg_scale), show_progress=False, lora_tags=True)
    return out[0].image.astype(np.float64)


def _psnr(a, b):
    return 10 * np.log10(255.0 ** 2 / max(np.mean((a - b) ** 2), 1e-12))


def test_at_runtime_equals_immediately(tiny, caplog):
    prompt = "a fox <lora:flux_peft:0.8><lora:flux_kohya:0.6>"
    with caplog.at_level(logging.INFO, "sdrt"):
        merged = _image(tiny, "immediately", prompt)
        runtime = _image(tiny, "at_runtime", prompt)
    plain = _image(tiny, "immediately", "a fox")
    assert "(12 / 12) LoRA tensors" in caplog.text and "(9 / 9) LoRA tensors" in caplog.text, caplog.text[-2000:]
    moved, same = _psnr(merged, plain), _psnr(merged, runtime)
    print(f"\nFlux LoRAs: merged vs no-LoRA {moved:.2f} dB, at_runtime vs merged {same:.2f} dB")
    assert moved < 45, moved                 # the LoRAs move the image
    assert same > 55, same


# ---- SD3 ------------------------------------------------------------------------------------------
SH, SMLP = st.DIT["hidden_size"], st.DIT["mlp_hidden"]


def sd3_lora(rng) -> dict:
    """PEFT names of diffusers' SD3 LoRAs: q, k, v of block 0's image attention (x_block qkv
    parts), k alone of its context attention (`add_k_proj`: part 1 only), the output projection
    and the MLP's first layer."""
    t = {}
    for name, n_in, n_out in [("to_q", SH, SH), ("to_k", SH, SH), ("to_v", SH, SH), ("add_k_proj", SH, SH),
                              ("to_out.0", SH, SH)]:
        t[f"transformer.transformer_blocks.0.attn.{name}.lora_A.weight"] = _rand(rng, RANK, n_in)
        t[f"transformer.transformer_blocks.0.attn.{name}.lora_B.weight"] = _rand(rng, n_out, RANK)
    t["transformer.transformer_blocks.0.ff.net.0.proj.lora_A.weight"] = _rand(rng, RANK, SH)
    t["transformer.transformer_blocks.0.ff.net.0.proj.lora_B.weight"] = _rand(rng, SMLP, RANK)
    return t


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    d = tmp_path_factory.mktemp("sd3_lora")
    lora = sd3_lora(np.random.default_rng(12))
    os.makedirs(d / "loras")
    write_safetensors(str(d / "loras" / "sd3_peft.safetensors"), lora)
    return {"args": st.write(str(d / "m")), "loras": str(d / "loras"), "lora": lora}


def test_sd3_merge_against_numpy(sd3):
    base = {k: v for k, v in st.arrays().items() if k.startswith(DM)}
    table = {k: Tensor.from_numpy(v, name=k) for k, v in base.items()}
    merged, _ = apply_loras(table, [LoraSpec(os.path.join(sd3["loras"], "sd3_peft.safetensors"), 0.7)], "sd3",
                            "immediately")
    lo, pre = sd3["lora"], "transformer.transformer_blocks.0."
    want = {k: v.copy() for k, v in base.items()}

    def add(target, rows, name):
        want[DM + target][rows] += 0.7 * (lo[pre + name + ".lora_B.weight"] @ lo[pre + name + ".lora_A.weight"])

    for i, q in enumerate(("to_q", "to_k", "to_v")):
        add("joint_blocks.0.x_block.attn.qkv.weight", slice(i * SH, (i + 1) * SH), "attn." + q)
    add("joint_blocks.0.context_block.attn.qkv.weight", slice(SH, 2 * SH), "attn.add_k_proj")
    add("joint_blocks.0.x_block.attn.proj.weight", slice(None), "attn.to_out.0")
    add("joint_blocks.0.x_block.mlp.fc1.weight", slice(None), "ff.net.0.proj")
    assert sum(not np.array_equal(want[k], base[k]) for k in base) == 4
    for k in base:
        np.testing.assert_allclose(merged[k].to_f32().reshape(base[k].shape), want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_sd3_at_runtime_equals_immediately(sd3, caplog):
    prompt = "a fox <lora:sd3_peft:0.7>"
    with caplog.at_level(logging.INFO, "sdrt"):
        merged = _image(sd3, "immediately", prompt, 4.0)
        runtime = _image(sd3, "at_runtime", prompt, 4.0)
    plain = _image(sd3, "immediately", "a fox", 4.0)
    assert caplog.text.count("(12 / 12) LoRA tensors") == 2, caplog.text[-2000:]
    moved, same = _psnr(merged, plain), _psnr(merged, runtime)
    print(f"\nSD3 LoRA: merged vs no-LoRA {moved:.2f} dB, at_runtime vs merged {same:.2f} dB")
    assert moved < 45, moved
    assert same > 50, same
