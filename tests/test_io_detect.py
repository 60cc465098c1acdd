"""Version detection from names + shapes only (synthetic tables, no data), dtype stats, prediction type."""
from __future__ import annotations

import gzip
import json
import os
from types import SimpleNamespace

import pytest

from sdrt.io import detect as D
from sdrt.io.detect import default_flow_shift, detect_version, dtype_stats, family, prediction_type
from sdrt.ops import dtypes

with gzip.open(os.path.join(os.path.dirname(__file__), "fixtures", "ckpt_names_diffusers_ldm.json.gz"), "rt") as f:
    TABLES = json.load(f)
DM = "model.diffusion_model."
VAE = {"first_stage_model." + r[2]: tuple(r[3]) for r in TABLES["sd_vae"]}


def unet(key, in_ch=4, drop=(), prefix=DM, diffusers=False):
    col = (0, 1) if diffusers else (2, 3)
    t = {prefix + r[col[0]]: tuple(r[col[1]]) for r in TABLES[key]}
    conv_in = prefix + ("conv_in.weight" if diffusers else "input_blocks.0.0.weight")
    t[conv_in] = (t[conv_in][0], in_ch) + t[conv_in][2:]
    return {k: v for k, v in t.items() if not any(d in k for d in drop)}


CLIP_L = {"cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": (49408, 768)}
OPENCLIP_H = {"cond_stage_model.model.token_embedding.weight": (49408, 1024)}
XL_TE = {"conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight": (49408, 768),
         "conditioner.embedders.1.model.token_embedding.weight": (49408, 1280)}


def sd1(**kw):
    return {**unet("sd15_unet", **kw), **CLIP_L, **VAE}


def sd2(**kw):
    return {**unet("sd15_unet", **kw), **OPENCLIP_H, **VAE}


def sdxl(**kw):
    return {**unet("sdxl_unet", **kw), **XL_TE, **VAE}


def refiner():
    t = unet("sdxl_unet")
    t[DM + "input_blocks.0.0.weight"] = (384, 4, 3, 3)
    return {**t, "conditioner.embedders.0.model.token_embedding.weight": (49408, 1280), **VAE}


def flux(img_in=64, extra=(), ctx=4096, bare=False):
    p = "" if bare else DM
    t = {p + "img_in.weight": (3072, img_in), p + "txt_in.weight": (3072, ctx),
         p + "double_blocks.0.img_attn.qkv.weight": (9216, 3072), p + "single_blocks.0.linear1.weight": (21504, 3072)}
    t.update({p + e: (4,) for e in extra})
    return t


def flux2(layers=48):
    return {DM + "double_stream_modulation_img.lin.weight": (36864, 6144), DM + "double_blocks.0.img_attn.qkv.weight": (1, 1),
            DM + f"single_blocks.{layers - 1}.linear1.weight": (1, 1), DM + "img_in.weight": (6144, 128)}


def wan(cin, cout=5120, img_emb=False):
    t = {DM + "blocks.0.cross_attn.norm_k.weight": (cout,), DM + "patch_embedding.weight": (cout, cin, 1, 2, 2)}
    if img_emb:
        t[DM + "img_emb.proj.0.weight"] = (1280,)
    return t


def qwen(img_in=64, layered=False):
    t = {DM + "transformer_blocks.0.img_mod.1.weight": (18432, 3072), DM + "img_in.weight": (3072, img_in)}
    if layered:
        t[DM + "time_text_embed.addition_t_embedding.weight"] = (2, 3072)
    return t


def one(name, shape=(4,)):
    return {name: shape}


CASES = [
    ("sd1", sd1(), D.SD1),
    ("sd1 inpaint", sd1(in_ch=9), D.SD1_INPAINT),
    ("sd1 pix2pix", sd1(in_ch=8), D.SD1_PIX2PIX),
    ("sd1 tiny (no mid attn)", sd1(drop=("middle_block.1.",)), D.SD1_TINY_UNET),
    ("sdxs-512 (no mid attn, no out 7.1)", sd1(drop=("middle_block.1.", "output_blocks.7.1")), D.SDXS_512_DS),
    ("sd1 diffusers folder names", {**unet("sd15_unet", prefix="unet.", diffusers=True),
                                    "te.text_model.embeddings.token_embedding.weight": (49408, 768)}, D.SD1),
    ("sd2", sd2(), D.SD2),
    ("sd2 inpaint", sd2(in_ch=9), D.SD2_INPAINT),
    ("sdxl", sdxl(), D.SDXL),
    ("sdxl inpaint", sdxl(in_ch=9), D.SDXL_INPAINT),
    ("sdxl pix2pix", sdxl(in_ch=8), D.SDXL_PIX2PIX),
    ("ssd-1b", sdxl(drop=("middle_block.1.",)), D.SDXL_SSD1B),
    ("vega", sdxl(drop=("middle_block.1.", "output_blocks.3.1.transformer_blocks.1")), D.SDXL_VEGA),
    ("sdxl refiner", refiner(), D.SDXL_REFINER),
    ("sdxl diffusers folder names", {**unet("sdxl_unet", prefix="unet.", diffusers=True),
                                     "te.text_model.embeddings.token_embedding.weight": (49408, 768),
                                     "te.1.text_model.embeddings.token_embedding.weight": (49408, 1280)}, D.SDXL),
    ("svd", {**sd2(), **one(DM + "input_blocks.8.0.time_mixer.mix_factor")}, D.SVD),
    ("sd3", one(DM + "joint_blocks.0.x_block.attn.qkv.weight"), D.SD3),
    ("flux", flux(), D.FLUX),
    ("flux bare file", flux(bare=True), D.FLUX),
    ("flux fill", flux(384), D.FLUX_FILL),
    ("flux controls", flux(128), D.FLUX_CONTROLS),
    ("flex.2", flux(196), D.FLEX_2),
    ("chroma", flux(extra=["distilled_guidance_layer.in_proj.weight"]), D.CHROMA),
    ("longcat", flux(ctx=3584), D.LONGCAT),
    ("chroma radiance", one(DM + "nerf_final_layer_conv.conv.weight"), D.CHROMA_RADIANCE),
    ("ovis", {**flux(), **one(DM + "double_blocks.0.img_mlp.gate_proj.weight")}, D.OVIS_IMAGE),
    ("flux2", flux2(48), D.FLUX2),
    ("flux2 klein", flux2(20), D.FLUX2_KLEIN),
    ("wan 2.1 t2v", wan(16), D.WAN2),
    ("wan 2.1 i2v", wan(36, img_emb=True), D.WAN2),
    ("wan 2.2 i2v", wan(36), D.WAN2_2_I2V),
    ("wan 2.2 ti2v", wan(48, 3072), D.WAN2_2_TI2V),
    ("qwen-image", qwen(), D.QWEN_IMAGE),
    ("qwen-image layered", qwen(layered=True), D.QWEN_IMAGE_LAYERED),
    ("mage flow", qwen(128), D.MAGE_FLOW),
    ("z-image", one(DM + "cap_embedder.0.weight"), D.Z_IMAGE),
    ("hunyuan video", one(DM + "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight"), D.HUNYUAN_VIDEO),
    ("anima", one(DM + "net.llm_adapter.blocks.0.cross_attn.q_proj.weight"), D.ANIMA),
    ("ltx-av", one(DM + "adaln_single.emb.timestep_embedder.linear_1.bias"), D.LTXAV),
    ("minimax h3", {**one(DM + "video_patch_proj.weight"), **one(DM + "audio_patch_proj.weight")}, D.MINIMAX_H3),
    ("lingbot", one(DM + "patch_embedder.weight"), D.LINGBOT_VIDEO),
    ("hidream o1", {**one("model.x_embedder.proj1.weight"),
                    **one("model.language_model.layers.0.self_attn.q_proj.weight")}, D.HIDREAM_O1),
    ("lens", {**one(DM + "transformer_blocks.0.attn.norm_added_q.weight"),
              **one(DM + "transformer_blocks.0.img_mlp.w1.weight")}, D.LENS),
    ("minit2i", one(DM + "model.net.img_embedder.proj1.weight"), D.MINIT2I),
    ("boogu", one(DM + "double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight"), D.BOOGU_IMAGE),
    ("ernie", one(DM + "layers.0.adaLN_sa_ln.weight"), D.ERNIE_IMAGE),
    ("pid", one(DM + "net.lq_proj.latent_proj.0.weight"), D.PID),
    ("ideogram4", one(DM + "embed_image_indicator.weight"), D.IDEOGRAM4),
    ("sefi", one(DM + "dual_time_embed.semantic_embedder.linear_1.weight"), D.SEFI_IMAGE),
    ("krea2", one(DM + "txtfusion.projector.weight"), D.KREA2),
    ("nothing known", {"foo.bar": (3,), "model.diffusion_model.baz": (2, 2)}, D.UNKNOWN),
    ("empty", {}, D.UNKNOWN),
]


@pytest.mark.parametrize("label,table,want", CASES, ids=[c[0] for c in CASES])
def test_detect(label, table, want):
    assert detect_version(table) == want


def test_tensor_objects_use_ne():
    t = {k: SimpleNamespace(ne=tuple(reversed(v)) or (1,), dtype=dtypes.F16) for k, v in sd1(in_ch=9).items()}
    assert detect_version(t) == D.SD1_INPAINT
    mf = SimpleNamespace(tensors=t, metadata={})
    assert detect_version(mf) == D.SD1_INPAINT


def test_families_cover_every_version():
    for v in D.VERSIONS:
        assert family(v) != "unknown" or v == D.UNKNOWN
    assert family(D.SDXL_VEGA) == "sdxl" and family(D.CHROMA) == "flux" and D.is_unet(D.SD2_INPAINT)


def test_dtype_stats():
    T = lambda dt: SimpleNamespace(dtype=dt, ne=(1,))   # noqa: E731
    t = {DM + "a.weight": T(dtypes.Q8_0), DM + "b.bias": T(dtypes.F32), "first_stage_model.x": T(dtypes.F16),
         "cond_stage_model.transformer.text_model.y": T(dtypes.F16), "text_encoders.t5xxl.transformer.z": T(dtypes.BF16),
         "alphas_cumprod": T(dtypes.F32), "model_ema.decay": T(dtypes.F32)}
    assert dtype_stats(t) == {"diffusion_model": {"Q8_0": 1, "F32": 1}, "vae": {"F16": 1},
                              "text_encoders": {"F16": 1, "BF16": 1}}


def test_prediction_type():
    assert prediction_type(sd1()) == "eps"
    assert prediction_type(sd2()) is None                 # sd.cpp decides SD2 by running the UNet
    assert prediction_type({**sdxl(), "v_pred": ()}) == "v"
    assert prediction_type({**sdxl(), "edm_vpred.sigma_max": (), "edm_vpred.sigma_min": ()}) == "edm_v"
    assert prediction_type(sdxl()) == "eps"
    mf = SimpleNamespace(tensors=sd2(), metadata={"modelspec.prediction_type": "v"})
    assert prediction_type(mf) == "v"
    mf = SimpleNamespace(tensors=sd2(), metadata={"ss_v_parameterization": "True"})
    assert prediction_type(mf) == "v"
    assert prediction_type(flux()) == "flux_flow"
    assert prediction_type(wan(16)) == "flow" and prediction_type(qwen()) == "flow"
    assert prediction_type(one(DM + "joint_blocks.0.x")) == "flow"
    assert default_flow_shift(D.WAN2) == 5.0 and default_flow_shift(D.SD3) == 3.0
    assert default_flow_shift(D.FLUX, flux()) == 1.0
    assert default_flow_shift(D.FLUX, flux(extra=["guidance_in.in_layer.weight"])) == 1.15
    assert default_flow_shift(D.SD1) is None
