"""Qwen-Image (and Qwen-Image-Edit / Edit-2509 / Edit-2511's reference images): the family record
(docs/adding-a-family.md).

- detection: sd.cpp's get_sd_version marker `model.diffusion_model.transformer_blocks.0.img_mod.1.weight`
  (order 11); Qwen-Image-Layered (its `time_text_embed.addition_t_embedding`, order 10) is recognized
  and refused by name.
- components: `--diffusion-model` (diffusers / ComfyUI names, used as they are), `--llm` (the
  Qwen2.5-VL-7B text stack, sdrt.models.llm_conditioning; its vision tower inside it or from
  `--llm_vision`), `--vae` (the Wan-2.1 VAE in Wan's names, as the ComfyUI qwen_image_vae.safetensors).
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
from .families import Component, Cond, Family, Variant, register_component, register_family
from .llm_conditioning import LLM, PREFIX_LLM, build_llm_conditioner  # noqa: F401 (registers --llm)
from .recognized import QWEN_IMAGE, QWEN_IMAGE_LAYERED, marker
from .te.qwen_tokenizer import PromptTemplate

__all__ = ["QWEN_IMAGE", "QWEN_IMAGE_LAYERED", "QWEN_IMAGE_TEMPLATE", "MODEL_ARGS", "QwenImageDiffusion",
           "qwen_image_conditioner", "qwen_image_model", "qwen_image_vae"]

log = logging.getLogger("sdrt")
DM = "model.diffusion_model."
MODEL_ARGS = {"qwen_image_zero_cond_t": False}   # sd-cli --qwen-image-zero-cond-t
PREFIX_VISION = PREFIX_LLM + "visual."
# sd-cli --llm_vision: the vision tower from its own file, loaded under text_encoders.llm.visual.
LLM_VISION = register_component(Component(
    "llm_vision", "--llm_vision", "llm vision",
    "path to the Qwen2.5-VL vision tower (Qwen-Image-Edit) when it is not inside the --llm file",
    strip=(PREFIX_VISION, "visual."), prefix={"dit": PREFIX_VISION}, replaces=(PREFIX_VISION,)))

# sd.cpp LLMEmbedder (Qwen-Image, no reference images): prompt_template_encode_start_idx 34, no
# out_layers (the final-norm output)
QWEN_IMAGE_TEMPLATE = PromptTemplate(
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_end|>\n<|im_start|>assistant\n", 34, 0)


# sd.cpp LLMEmbedder, QwenImageEditPlusPipeline (reference images and a vision tower): this system
# prompt, then "Picture i: <|vision_start|>" + one <|image_pad|> per vision token + "<|vision_end|>"
# per image, the user text, the suffix; 64 states dropped; image i's embeddings spliced in at token
# 64 + 6 (the first) and then each previous index + n + 1 + 6 (sd.cpp's fixed arithmetic)
EDIT_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
               "objects, background), then explain how the user's text instruction should alter or modify the "
               "image. Generate a new image that meets the user's requirements while maintaining consistency with "
               "the original input where appropriate.<|im_end|>\n<|im_start|>user\n")
EDIT_DROP = 64
VISION_MIN_PIXELS, VISION_MAX_PIXELS = 384 * 384, 560 * 560
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def vision_size(width: int, height: int, factor: int = 28) -> tuple[int, int]:
    """sd.cpp's size of a reference image for the vision tower (sides multiples of `factor`,
    area within [384^2, 560^2])."""
    import math
    h_bar = int(round(height / factor) * factor)
    w_bar = int(round(width / factor) * factor)
    if h_bar * w_bar > VISION_MAX_PIXELS:
        beta = math.sqrt(height * width / VISION_MAX_PIXELS)
        h_bar = max(factor, int(math.floor(height / beta / factor)) * factor)
        w_bar = max(factor, int(math.floor(width / beta / factor)) * factor)
    elif h_bar * w_bar < VISION_MIN_PIXELS:
        beta = math.sqrt(VISION_MIN_PIXELS / (height * width))
        h_bar = int(math.ceil(height * beta / factor)) * factor
        w_bar = int(math.ceil(width * beta / factor)) * factor
    return w_bar, h_bar


def clip_preprocess(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """sd.cpp's clip_preprocess: HxWx3 uint8 -> [3, height, width]: nearest resize by the larger
    scale (source index = dst * src / dst), centre crop, CLIP mean/std."""
    a = np.asarray(img, np.float32) / np.float32(255.0)
    H, W = a.shape[:2]
    s = max(np.float32(width) / np.float32(W), np.float32(height) / np.float32(H))
    rw, rh = int(np.float32(s) * np.float32(W)), int(np.float32(s) * np.float32(H))
    iy, ix = (np.arange(rh) * H) // rh, (np.arange(rw) * W) // rw
    r = a[iy[:, None], ix[None, :]]
    y0, x0 = max((rh - height) // 2, 0), max((rw - width) // 2, 0)
    c = np.clip(r[y0:y0 + height, x0:x0 + width], 0.0, 1.0)
    return np.ascontiguousarray(((c - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1), np.float32)


class QwenImageConditioner:
    """sd.cpp's LLMEmbedder for Qwen-Image: the plain template, or with reference images and a
    vision tower in the --llm file (`visual.*`) the Edit-Plus template with vision tokens."""

    def __init__(self, base, vision=None):
        self.base, self.vision = base, vision

    def encode(self, prompt: str, width: int | None = None, height: int | None = None, clip_skip: int = -1, *,
               zero_out_masked: bool = False, ref_images=()) -> Cond:
        if not ref_images or self.vision is None:
            return self.base.encode(prompt, width, height, clip_skip, zero_out_masked=zero_out_masked)
        if not isinstance(prompt, str):
            raise UsageError(f"prompt must be a string, got {type(prompt).__name__}")
        from ..ops.tensor import Tensor
        from .prompt import apply_token_weights
        from .te.qwen_tokenizer import PromptTemplate
        b = self.base
        embeds, text, idx = [], "", EDIT_DROP + 6
        for i, img in enumerate(ref_images):
            w, h = vision_size(img.shape[1], img.shape[0])
            log.debug("resize conditioner ref image %d from %dx%d to %dx%d", i, img.shape[0], img.shape[1], h, w)
            e = self.vision.encode(clip_preprocess(img, w, h), b.backend)            # [n, hidden]
            embeds.append((idx, Tensor.from_numpy(np.ascontiguousarray(e))))
            idx += 1 + e.shape[0] + 6
            text += f"Picture {i + 1}: <|vision_start|>" + "<|image_pad|>" * e.shape[0] + "<|vision_end|>"
        tpl = PromptTemplate(EDIT_SYSTEM + text, QWEN_IMAGE_TEMPLATE.suffix, EDIT_DROP, 0)
        ids, weights = b.tokenizer.encode_template(tpl, prompt)
        h = b.llm.run(np.asarray(ids, np.int32), 0, b.backend, image_embeds=embeds)[0]
        return Cond(apply_token_weights(h, np.asarray(weights, np.float32))[EDIT_DROP:][None])


def qwen_image_conditioner(table: Mapping, version: str, embd_dir=None, *, backend: str = "cpu",
                           source: str = "model", **kw):
    if embd_dir:
        log.warning("--embd-dir: textual-inversion embeddings are not used by Qwen-Image (as sd.cpp)")
    base = build_llm_conditioner(table, QWEN_IMAGE_TEMPLATE, family="Qwen-Image", backend=backend, source=source)
    vision = None
    if any(k.startswith(PREFIX_VISION) for k in table):
        from .te.qwen_vision import QwenVisionEncoder
        vision = QwenVisionEncoder(table, PREFIX_VISION, source=source)
        log.info("Qwen2.5-VL vision tower: %d blocks, width %d", vision.depth, vision.hidden)
    return QwenImageConditioner(base, vision)


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
    detect=(_RULE,), text_encoders=("llm", "llm_vision"), te_layout="dit",
    conditioner=qwen_image_conditioner, diffusion_model=qwen_image_model, vae=qwen_image_vae,
    latent_channels=16, vae_scale_factor=8, size_multiple=16, latent_scale=1.0, latent_shift=0.0,
    ref_image_multiple=32, prediction="flow", flow_shift=3.0, default_sampler="euler", default_scheduler="discrete",
    modes=frozenset({"txt2img", "img2img", "ref_images"})))
register_family(Family(QWEN_IMAGE_LAYERED, {QWEN_IMAGE_LAYERED: Variant()}, "Qwen-Image-Layered",
                       detect=(_RULE_LAYERED,), prediction="flow", flow_shift=3.0, latent_channels=16))
