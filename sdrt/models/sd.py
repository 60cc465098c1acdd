"""The Stable Diffusion UNet families: SD 1.x, SD 2.x, SDXL (one registry entry each).

Each entry says how to tell its versions apart from tensor names and shapes (sd.cpp's
`get_sd_version` rules for the UNets), which text encoders feed it (`--clip_l`, `--clip_g`),
how its names convert (diffusers UNet -> LDM), its CLIP conditioner, the UNet, the VAE's latent
scale, how its prediction type is found (marker tensors, metadata, or SD 2.x's one-call probe),
its sampling defaults, and the inpaint / instruct-pix2pix concat latents of its variants.
"""
from __future__ import annotations

import logging
from functools import partial

import numpy as np

from ..errors import UnsupportedError
from .facts import Facts, dim
from .families import Component, Cond, Family, Variant, register_component, register_family
from .te.spec import TextEncoderSpec

__all__ = ["SD1", "SD1_INPAINT", "SD1_PIX2PIX", "SD1_TINY_UNET", "SD2", "SD2_INPAINT", "SD2_TINY_UNET", "SDXL",
           "SDXL_INPAINT", "SDXL_PIX2PIX", "SDXL_REFINER", "SDXL_SSD1B", "SDXL_VEGA", "SDXS_09", "SDXS_512_DS",
           "ConcatLatents", "edit_concat", "inpaint_concat"]

log = logging.getLogger("sdrt")
F32 = np.float32
DM = "model.diffusion_model."

SD1, SD1_INPAINT, SD1_PIX2PIX, SD1_TINY_UNET = "sd1", "sd1_inpaint", "sd1_pix2pix", "sd1_tiny_unet"
SD2, SD2_INPAINT, SD2_TINY_UNET = "sd2", "sd2_inpaint", "sd2_tiny_unet"
SDXS_512_DS, SDXS_09 = "sdxs_512_ds", "sdxs_09"
SDXL, SDXL_INPAINT, SDXL_PIX2PIX = "sdxl", "sdxl_inpaint", "sdxl_pix2pix"
SDXL_VEGA, SDXL_SSD1B, SDXL_REFINER = "sdxl_vega", "sdxl_ssd1b", "sdxl_refiner"

TE_L = "cond_stage_model.transformer."      # CLIP-L (SD1/SDXL) or OpenCLIP-H (SD2)
TE_G = "cond_stage_model.1.transformer."    # OpenCLIP-bigG (SDXL)
PREFIX_CLIP_L, PREFIX_CLIP_G = TE_L + "text_model.", TE_G + "text_model."   # = sdrt.models.te.clip's

CLIP_L = register_component(Component(
    "clip_l", "--clip_l", "clip_l", "path to the CLIP-L text encoder",
    strip=(TE_L, "text_encoders.clip_l.transformer."),
    prefix={"unet": TE_L, "dit": "text_encoders.clip_l.transformer."},
    replaces=(TE_L, "text_encoders.clip_l.")))
CLIP_G = register_component(Component(
    "clip_g", "--clip_g", "clip_g", "path to the OpenCLIP-bigG text encoder (SDXL, SD3)",
    strip=(TE_G, "text_encoders.clip_g.transformer."),
    prefix={"unet": TE_G, "dit": "text_encoders.clip_g.transformer."},
    replaces=(TE_G, "cond_stage_model.1.", "text_encoders.clip_g.")))


# ---- detection (sd.cpp's get_sd_version, the UNet branches) -----------------------------------------

def _unet_layout(f: Facts):
    unet = f.has(DM + "input_blocks.") or f.has("\nunet.down_blocks.")
    multi = f.has("conditioner.embedders.1") or f.has("cond_stage_model.1") or f.has("te.1")
    return unet, multi


def _concat_kind(f: Facts):
    c = dim(f.input_block, 2)
    return "inpaint" if c == 9 else "pix2pix" if c == 8 else None


def _has_mid1(f: Facts) -> bool:
    return f.has(DM + "middle_block.1.") or f.has("\nunet.mid_block.resnets.1.")


def detect_sdxl(f: Facts):
    unet, multi = _unet_layout(f)
    if not unet:
        return None
    if not multi:
        refiner = f.has(DM + "label_emb.0.0.weight") and (
            dim(f.token_embedding, 0) == 1280 or dim(f.input_block, 3) == 384)
        return SDXL_REFINER if refiner else None
    kind = _concat_kind(f)
    if kind:
        return SDXL_INPAINT if kind == "inpaint" else SDXL_PIX2PIX
    if not _has_mid1(f):
        has_311 = (f.has(DM + "output_blocks.3.1.transformer_blocks.1")
                   or f.has("\nunet.up_blocks.1.attentions.0.transformer_blocks.1"))
        return SDXL_SSD1B if has_311 else SDXL_VEGA
    return SDXL


def detect_sd1(f: Facts):
    if dim(f.token_embedding, 0) != 768:
        return None
    kind = _concat_kind(f)
    if kind:
        return SD1_INPAINT if kind == "inpaint" else SD1_PIX2PIX
    if not _has_mid1(f):
        has_71 = f.has(DM + "output_blocks.7.1") or f.has("\nunet.up_blocks.2.attentions.1")
        return SD1_TINY_UNET if has_71 else SDXS_512_DS
    return SD1


def detect_sd2(f: Facts):
    if dim(f.token_embedding, 0) != 1024:
        return None
    if _concat_kind(f) == "inpaint":
        return SD2_INPAINT
    if not _has_mid1(f):
        k = f.ne(DM + "output_blocks.7.1.transformer_blocks.0.attn1.to_k.weight")
        return SDXS_09 if dim(k, 0) == 1024 else SD2_TINY_UNET
    return SD2


# ---- prediction ----------------------------------------------------------------------------------------

def _truthy(v) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "v", "v_prediction", "v-prediction")


def sd_prediction(table, meta, version, *, unknown=None):
    """The marker tensors (`edm_vpred.sigma_max`: CosXL, `v_pred`), metadata
    (`modelspec.prediction_type`, kohya's `ss_v_parameterization`), else `unknown`."""
    if "edm_vpred.sigma_max" in table:
        return "edm_v"
    if "v_pred" in table:
        return "v"
    spec = str(meta.get("modelspec.prediction_type", meta.get("scheduler.prediction_type", ""))).strip().lower()
    if spec:
        return "v" if spec in ("v", "v_prediction", "v-prediction") else "eps" if spec in ("epsilon", "eps") else None
    if "ss_v_parameterization" in meta:
        return "v" if _truthy(meta["ss_v_parameterization"]) else "eps"
    return unknown


def probe_sd2_prediction(model, version: str, call) -> str:
    """sd.cpp's is_using_v_parameterization_for_sd2: one UNet call on constants;
    mean(out - x) < -1 means v-prediction. `call(x, t, cond)` runs the model where it lives."""
    x = np.full((1, 4, 8, 8), 0.5, F32)
    ctx = np.full((1, 2, 1024), 0.5, F32)
    cc = np.zeros((1, 5, 8, 8), F32) if version == SD2_INPAINT else None
    out = call(x, np.array([999.0], F32), Cond(ctx, None, cc))
    return "v" if float(np.mean((out - x).astype(F32), dtype=np.float64)) < -1 else "eps"


# ---- names, models ------------------------------------------------------------------------------------

def convert_unet_name(rest: str, version: str, layout) -> str:
    from .names import convert_unet_name as conv
    return conv(rest, version, layout)


def unet_model(tensors, prefix: str, source: str):
    from .diffusion.unet import UNetModel
    return UNetModel(tensors, prefix, source=source)


def clip_conditioner(table, version, embd_dir=None, *, specs, pad_id, default_clip_skip, **kw):
    """The CLIP conditioner (sdrt.models.conditioning implements prompt weighting and textual
    inversion; this entry only says which encoders and how)."""
    if version == SDXL_REFINER:
        raise UnsupportedError("the SDXL refiner (OpenCLIP-G only, aesthetic-score vector) is not supported, "
                               "as in sd.cpp")
    from .conditioning import build_clip_conditioner
    return build_clip_conditioner(table, version, specs, pad_id=pad_id, default_clip_skip=default_clip_skip,
                                  embd_dir=embd_dir, **kw)


# ---- concat latents: inpaint and instruct-pix2pix UNets -------------------------------------------------

class ConcatLatents:
    """What a variant joins to x: `cond` / `uncond` [1, Cc, h, w]; `img_cfg_follows_cfg`: the
    image guidance falls back to cfg (sd.cpp without a reference image); `dilate_mask`: the
    denoise mask is max-pooled 3x3 (inpaint models)."""

    def __init__(self, cond, uncond, img_cfg_follows_cfg=False, dilate_mask=False):
        self.cond, self.uncond = cond, uncond
        self.img_cfg_follows_cfg, self.dilate_mask = img_cfg_follows_cfg, dilate_mask


def inpaint_concat(encode, init_t, mask_t, latent_mask, init_latent, width, height) -> ConcatLatents:
    """[latent mask, encoded masked image] (zeros without an init image; uncond: zero image latent)."""
    if init_t is not None:
        masked = (F32(1.0) - mask_t) * (init_t - F32(0.5)) + F32(0.5)
        masked_latent = encode(masked)
    else:
        log.warning("inpainting model requires both an init image and a mask image.")
        masked_latent = np.zeros_like(init_latent)
    return ConcatLatents(np.concatenate([latent_mask, masked_latent], axis=1),
                         np.concatenate([latent_mask, np.zeros_like(masked_latent)], axis=1), dilate_mask=True)


def edit_concat(encode, init_t, mask_t, latent_mask, init_latent, width, height) -> ConcatLatents:
    """sd.cpp without -r: an empty (black) reference, and img_cfg falls back to cfg (the img-cond
    pass decided earlier still runs, as in sd.cpp)."""
    log.warning("This model needs at least one reference image; using an empty reference")
    c = encode(np.zeros((1, 3, height, width), F32))
    return ConcatLatents(c, np.zeros_like(c), img_cfg_follows_cfg=True)


_CONCAT = {"inpaint": inpaint_concat, "edit": edit_concat}
_MODES = frozenset({"txt2img", "img2img", "inpaint", "edit"})
_UNET = dict(te_layout="unet", convert_diffusion_name=convert_unet_name, diffusion_model=unet_model,
             latent_channels=4, vae_scale_factor=8, size_multiple=64, default_sampler="euler_a",
             default_scheduler="discrete", concat_builders=_CONCAT, modes=_MODES)

register_family(Family(
    "sd1", {SD1: Variant(), SD1_INPAINT: Variant("inpaint"), SD1_PIX2PIX: Variant("edit", vae_encode="mean"),
            SD1_TINY_UNET: Variant(), SDXS_512_DS: Variant()},
    "SD 1.x", detect=((140, detect_sd1),), text_encoders=("clip_l",), unet_layout=(2, (1, 2, 3)),
    conditioner=partial(clip_conditioner, specs=(TextEncoderSpec(PREFIX_CLIP_L, "quick_gelu", True),),
                        pad_id=None, default_clip_skip=1),
    latent_scale=0.18215, prediction=partial(sd_prediction, unknown="eps"), ays_levels="sd1", **_UNET))

register_family(Family(
    "sd2", {SD2: Variant(), SD2_INPAINT: Variant("inpaint"), SD2_TINY_UNET: Variant(), SDXS_09: Variant()},
    "SD 2.x", detect=((141, detect_sd2),), text_encoders=("clip_l",), unet_layout=(2, (1, 2, 3)),
    conditioner=partial(clip_conditioner, specs=(TextEncoderSpec(PREFIX_CLIP_L, "gelu_tanh", True),),
                        pad_id=0, default_clip_skip=2),
    # sd.cpp has no AYS levels for SD 2.x (it warns, then means to fall through to SD 1.5's)
    latent_scale=0.18215, prediction=sd_prediction, probe_prediction=probe_sd2_prediction, ays_levels="sd1",
    **_UNET))

register_family(Family(
    "sdxl", {SDXL: Variant(), SDXL_INPAINT: Variant("inpaint"), SDXL_PIX2PIX: Variant("edit"),
             SDXL_VEGA: Variant(), SDXL_SSD1B: Variant(), SDXL_REFINER: Variant()},
    "SDXL", detect=((110, detect_sdxl),), text_encoders=("clip_l", "clip_g"), unet_layout=(2, (0, 1)),
    conditioner=partial(clip_conditioner, specs=(
        TextEncoderSpec(PREFIX_CLIP_L, "quick_gelu", False),
        TextEncoderSpec(PREFIX_CLIP_G, "gelu_tanh", False, pooled=True, zero_after_eos=True)),
        pad_id=None, default_clip_skip=2),
    latent_scale=0.13025, prediction=partial(sd_prediction, unknown="eps"), ays_levels="sdxl",
    zero_empty_negative=True, **_UNET))
