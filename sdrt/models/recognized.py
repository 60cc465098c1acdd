"""Families sdrt recognizes but does not run yet: detection (sd.cpp's `get_sd_version`), the
prediction type and flow shift sd.cpp gives them, their sampling defaults and, where known, the
VAE latent scale. Their records have no diffusion model, so the pipeline refuses them by name.
Making one runnable moves its entry into its own module with its model files
(docs/adding-a-family.md).

Detection order: sd.cpp's early returns on marker tensors come first (orders 0-22, in its order,
first match wins), then the shape rules: Wan 100, SDXL 110 (sd.py), Flux 120 (flux.py, with the
Chroma Radiance and Ovis-Image markers; SD3's marker 5 is in sd3.py, Z-Image's 16 in zimage.py), Flux.2 130, SD 1.x / 2.x 140 (sd.py).
"""
from __future__ import annotations

from .facts import Facts, dim
from .names import convert_unet_name, dit_to_original
from .families import Family, Variant, register_family

DM = "model.diffusion_model."

SVD = "svd"
WAN2, WAN2_2_I2V, WAN2_2_TI2V = "wan2", "wan2.2_i2v", "wan2.2_ti2v"
FLUX2, FLUX2_KLEIN = "flux2", "flux2_klein"
QWEN_IMAGE, QWEN_IMAGE_LAYERED = "qwen_image", "qwen_image_layered"
(LINGBOT_VIDEO, HUNYUAN_VIDEO, ANIMA, LTXAV, MINIMAX_H3, HIDREAM_O1, Z_IMAGE, BOOGU_IMAGE, OVIS_IMAGE,
 ERNIE_IMAGE, LENS, MINIT2I, LONGCAT, PID, IDEOGRAM4, SEFI_IMAGE, KREA2, MAGE_FLOW) = (
    "lingbot_video", "hunyuan_video", "anima", "ltxav", "minimax_h3", "hidream_o1", "z_image", "boogu_image",
    "ovis_image", "ernie_image", "lens", "minit2i", "longcat", "pid", "ideogram4", "sefi_image", "krea2",
    "mage_flow")


def marker(order: int, name: str, version: str, extra=None):
    """A detection rule: `version` when some tensor name contains `name` (and `extra(facts)`)."""
    return order, lambda f: version if f.has(name) and (extra is None or extra(f)) else None


# ---- shape rules -------------------------------------------------------------------------------------

def _wan(f: Facts):
    if not f.has(DM + "blocks.0.cross_attn.norm_k.weight"):
        return None
    ch = dim(f.ne(DM + "patch_embedding.weight"), 3)
    img_emb = f.has(DM + "img_emb")
    if ch == 184320 and not img_emb:          # 5120 x 36 input channels
        return WAN2_2_I2V
    if ch == 147456 and not img_emb:          # 3072 x 48
        return WAN2_2_TI2V
    return WAN2


def _flux2_of(f: Facts):
    if f.has(DM + "double_stream_modulation_img.lin.weight"):
        return FLUX2 if f.has("single_blocks.47.linear1.weight") else FLUX2_KLEIN
    return None


def _flux_shift(version, table):
    """1.15 with a guidance embedder (Flux dev), else 1.0 (schnell)."""
    table = getattr(table, "tensors", table) or {}
    return 1.15 if any(n.startswith(DM + "guidance_in.in_layer.weight") for n in table) else 1.0


def _flux_names(rest, version, layout):
    return dit_to_original(rest, "flux")


def _one(name, description, detect=(), prediction=None, flow_shift=None, **kw):
    return register_family(Family(name, {name: Variant()}, description, detect=detect, prediction=prediction,
                                  flow_shift=flow_shift, **kw))


_IMG_IN = DM + "img_in.weight"
_one(PID, "PiD", (marker(0, DM + "net.lq_proj.latent_proj.0.weight", PID),), "flow", 1.5, default_sampler="lcm")
_one(IDEOGRAM4, "Ideogram 4", (marker(1, "embed_image_indicator.weight", IDEOGRAM4),), "flow", 1.0,
     default_scheduler="logit_normal")
_one(KREA2, "Krea 2", (marker(2, DM + "txtfusion.projector.weight", KREA2),
                       marker(3, DM + "text_fusion.projector.weight", KREA2)), "flux_flow", 1.15)
_one(HIDREAM_O1, "HiDream-O1", (marker(6, "model.x_embedder.proj1.weight", HIDREAM_O1,
                                       lambda f: "model.language_model.layers.0.self_attn.q_proj.weight" in f.names),),
     "flow", 3.0, default_eta=8.0)
_one(LENS, "Lens", (marker(7, DM + "transformer_blocks.0.attn.norm_added_q.weight", LENS,
                           lambda f: DM + "transformer_blocks.0.img_mlp.w1.weight" in f.names),), "flux_flow", 1.83)
_one(MINIT2I, "MiniT2I", (marker(8, "net.img_embedder.proj1.weight", MINIT2I),), "minit2i_flow")
_one(MAGE_FLOW, "Mage Flow", (marker(9, DM + "transformer_blocks.0.img_mod.1.weight", MAGE_FLOW,
                                     lambda f: dim(f.ne(_IMG_IN), 0) == 128),), "flow", 6.0)
# Qwen-Image (orders 10, 11): sdrt.models.qwen_image
_one(HUNYUAN_VIDEO, "HunyuanVideo", (marker(12, DM + "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight",
                                            HUNYUAN_VIDEO),), "flow", 7.0)
_one(ANIMA, "Anima", (marker(13, "llm_adapter.blocks.0.cross_attn.q_proj.weight", ANIMA),), "flow", 3.0)
_one(SEFI_IMAGE, "SeFi-Image", (marker(14, "dual_time_embed.semantic_embedder.linear_1.weight", SEFI_IMAGE),),
     "sefi_flow", convert_diffusion_name=_flux_names)
_one(BOOGU_IMAGE, "Boogu-Image", (marker(17, "double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight",
                                         BOOGU_IMAGE),), "flow", 3.16)
_one(ERNIE_IMAGE, "ERNIE-Image", (marker(18, DM + "layers.0.adaLN_sa_ln.weight", ERNIE_IMAGE),), "flow", 4.0)
_one(LTXAV, "LTX-AV", (marker(19, DM + "adaln_single.emb.timestep_embedder.linear_1.bias", LTXAV),), "flux_flow",
     2.37, default_scheduler="ltx2")
_one(MINIMAX_H3, "MiniMax-H3", (marker(20, DM + "video_patch_proj.weight", MINIMAX_H3,
                                       lambda f: DM + "audio_patch_proj.weight" in f.names),), "flow", 12.0)
_one(LINGBOT_VIDEO, "LingBot-Video", (marker(21, DM + "patch_embedder.weight", LINGBOT_VIDEO),), "flow", 3.0)
_one(SVD, "SVD", (marker(22, DM + "input_blocks.8.0.time_mixer.mix_factor", SVD),), "eps",
     default_sampler="euler_a", ays_levels="svd",
     convert_diffusion_name=convert_unet_name)
register_family(Family(
    "wan", {WAN2: Variant(), WAN2_2_I2V: Variant(), WAN2_2_TI2V: Variant()}, "Wan", detect=((100, _wan),),
    prediction="flow", flow_shift=5.0))
register_family(Family(
    "flux2", {FLUX2: Variant(), FLUX2_KLEIN: Variant()}, "Flux.2", detect=((130, _flux2_of),),
    prediction="flux_flow", flow_shift=_flux_shift, default_scheduler="flux2", convert_diffusion_name=_flux_names))
_one(LONGCAT, "LongCat", (), "flux_flow", 3.0, convert_diffusion_name=_flux_names)
