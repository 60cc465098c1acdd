"""Qwen-Image (and Qwen-Image-Edit / Edit-2509 / Edit-2511's reference images): the family record
(docs/adding-a-family.md).

- detection: sd.cpp's get_sd_version marker `model.diffusion_model.transformer_blocks.0.img_mod.1.weight`
  (order 11); Qwen-Image-Layered (its `time_text_embed.addition_t_embedding`, order 10) is recognized
  and refused by name.
- components: `--diffusion-model` (diffusers / ComfyUI names, used as they are), `--llm` (the
  Qwen2.5-VL-7B text stack, sdrt.models.llm_conditioning), `--vae` (the Wan-2.1 VAE, Wan names or a
  diffusers folder's).
- conditioning: sd.cpp's LLMEmbedder for Qwen-Image: the prompt inside Qwen-Image's system/user
  chat template, the final-norm output of the last LLM layer, the template's first 34 states
  dropped (QWEN_IMAGE_TEMPLATE).
- the DiT: sdrt.models.diffusion.qwen_image (depth from the weights; `--qwen-image-zero-cond-t`
  or a `__index_timestep_zero__` tensor turns on Edit-2511's zero_cond_t).
- latents: 16 channels, the Wan VAE's per-channel mean/std (sdrt.models.vae.wan), reference
  images resized to multiples of 32 (sd.cpp's factor for Qwen-Image).
- sampling: flow prediction (t = 1000 sigma), flow shift 3, euler + discrete (sd.cpp's defaults
  for DiT families); true CFG (no distilled guidance).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from ..errors import UsageError
from .families import Cond, Family, Variant, register_family
from .llm_conditioning import LLM, PREFIX_LLM, build_llm_conditioner  # noqa: F401 (registers --llm)
from .recognized import QWEN_IMAGE, QWEN_IMAGE_LAYERED, marker
from .te.qwen_tokenizer import PromptTemplate

__all__ = ["QWEN_IMAGE", "QWEN_IMAGE_LAYERED", "QWEN_IMAGE_TEMPLATE", "MODEL_ARGS", "QwenImageDiffusion",
           "qwen_image_conditioner", "qwen_image_model", "qwen_image_vae"]

log = logging.getLogger("sdrt")
DM = "model.diffusion_model."
MODEL_ARGS = {"qwen_image_zero_cond_t": False}   # sd-cli --qwen-image-zero-cond-t

# sd.cpp LLMEmbedder (Qwen-Image, no reference images): prompt_template_encode_start_idx 34, no
# out_layers (the final-norm output)
QWEN_IMAGE_TEMPLATE = PromptTemplate(
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_end|>\n<|im_start|>assistant\n", 34, 0)


def qwen_image_conditioner(table: Mapping, version: str, embd_dir=None, *, backend: str = "cpu",
                           source: str = "model", **kw):
    if embd_dir:
        log.warning("--embd-dir: textual-inversion embeddings are not used by Qwen-Image (as sd.cpp)")
    return build_llm_conditioner(table, QWEN_IMAGE_TEMPLATE, family="Qwen-Image", backend=backend, source=source)


class QwenImageDiffusion:
    """QwenImageModel behind the registry's `.predict(x, t, cond, backend=)`: t is sd.cpp's model
    timestep (1000 sigma); Cond.ref_latents are the reference images' latents (Edit)."""

    def __init__(self, model):
        self.model = model
        self.config = model.config

    def predict(self, x, t, cond: Cond, backend: str = "cpu") -> np.ndarray:
        if cond.y is not None or cond.c_concat is not None or cond.guidance is not None:
            raise UsageError("Qwen-Image takes no pooled vector, concat latents or distilled guidance")
        inc = getattr(cond, "ref_index_mode", "fixed") == "increase"
        return self.model(x, t, cond.context, list(cond.ref_latents), inc, backend=backend)


def qwen_image_model(tensors, prefix: str, source: str, model_args=None) -> QwenImageDiffusion:
    from .diffusion.qwen_image import QwenImageConfig, QwenImageModel
    cfg = QwenImageConfig.detect_from_weights(tensors, prefix, source)
    if (model_args or {}).get("qwen_image_zero_cond_t") and not cfg.zero_cond_t:
        import dataclasses
        cfg = dataclasses.replace(cfg, zero_cond_t=True)
    model = QwenImageModel(tensors, prefix, cfg, source=source)
    log.info("%s", cfg.summary())
    return QwenImageDiffusion(model)


def qwen_image_vae(tensors, prefix: str, source: str):
    from .vae.wan import WanVAE
    return WanVAE(tensors, prefix, source=source)


_RULE_LAYERED = marker(10, DM + "transformer_blocks.0.img_mod.1.weight", QWEN_IMAGE_LAYERED,
                       lambda f: DM + "time_text_embed.addition_t_embedding.weight" in f.names)
_RULE = marker(11, DM + "transformer_blocks.0.img_mod.1.weight", QWEN_IMAGE)

register_family(Family(
    "qwen_image", {QWEN_IMAGE: Variant()}, "Qwen-Image",
    detect=(_RULE,), text_encoders=("llm",), te_layout="dit",
    conditioner=qwen_image_conditioner, diffusion_model=qwen_image_model, vae=qwen_image_vae,
    latent_channels=16, vae_scale_factor=8, size_multiple=16, latent_scale=1.0, latent_shift=0.0,
    ref_image_multiple=32, prediction="flow", flow_shift=3.0, default_sampler="euler", default_scheduler="discrete",
    modes=frozenset({"txt2img", "img2img", "ref_images"})))
register_family(Family(QWEN_IMAGE_LAYERED, {QWEN_IMAGE_LAYERED: Variant()}, "Qwen-Image-Layered",
                       detect=(_RULE_LAYERED,), prediction="flow", flow_shift=3.0, latent_channels=16))
