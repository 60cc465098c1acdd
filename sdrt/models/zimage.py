"""Z-Image (Turbo and Base): the family record (docs/adding-a-family.md, docs/z-image.md).

- detection: sd.cpp's marker `model.diffusion_model.cap_embedder.0.weight` (moved here from
  recognized.py); diffusers-named transformers carry it too and are renamed as sd.cpp's
  convert_diffusers_dit_to_original_lumina2 does (all_x_embedder.2-1 -> x_embedder, to_q/k/v ->
  attention.qkv parts joined here, norm_q/k -> q_norm/k_norm, to_out.0 -> out, all_final_layer.2-1
  -> final_layer), for any depth.
- components: `--diffusion-model`, `--llm` (Qwen3-4B; sdrt.models.llm_conditioning), `--vae`
  (Flux's 16-channel ae.safetensors: latent scale 0.3611, shift 0.1159).
- conditioning: sd.cpp's LLMEmbedder for Z-Image: "<|im_start|>user\\n" + prompt +
  "<|im_end|>\\n<|im_start|>assistant\\n", the output of LLM layer 35 (of Qwen3-4B's 36; the
  final-norm output where the file has fewer layers), nothing dropped; attention syntax weights.
- sampling: flow prediction (sd3_flow, x = (1 - sigma) x0 + sigma noise), flow shift 3.0, euler
  over the discrete scheduler (sd.cpp's defaults for DiT models); Turbo wants `--cfg-scale 1`
  and few steps (sd.cpp's docs), which the user gives, as with sd-cli.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import numpy as np

from ..errors import UsageError
from .families import Cond, Family, Variant, register_family
from .llm_conditioning import build_llm_conditioner   # importing it registers the --llm component
from .recognized import Z_IMAGE, marker

__all__ = ["Z_IMAGE", "ZImageDiffusion", "join_zimage_parts", "zimage_conditioner", "zimage_diffusers_name",
           "zimage_model"]

log = logging.getLogger("sdrt")
DM = "model.diffusion_model."
_ATTN = re.compile(r"((?:layers|noise_refiner|context_refiner)\.\d+\.attention\.)(.+)$")
_QKV = {"to_q": "", "to_k": ".1", "to_v": ".2"}


def zimage_diffusers_name(rest: str, version=None, layout=None) -> str:
    """A diffusers ZImageTransformer2DModel name (after the diffusion-model prefix) -> the
    original name; original names pass unchanged. q/k/v become `attention.qkv.weight` parts
    (`.1`, `.2`), joined by join_zimage_parts."""
    for a, b in (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer.")):
        if rest.startswith(a):
            return b + rest[len(a):]
    m = _ATTN.match(rest)
    if not m:
        return rest
    head, tail = m.groups()
    for a, b in (("norm_q.", "q_norm."), ("norm_k.", "k_norm."), ("to_out.0.", "out.")):
        if tail.startswith(a):
            return head + b + tail[len(a):]
    leaf = tail.split(".", 1)
    if leaf[0] in _QKV and len(leaf) == 2:
        return head + "qkv." + leaf[1] + _QKV[leaf[0]]
    return rest




def join_zimage_parts(tensors: Mapping, prefix: str = DM) -> Mapping:
    """q/k/v parts of a converted diffusers file joined into attention.qkv (rows in order, raw
    bytes as stored). A table without parts is returned as is."""
    from .flux import join_split_parts
    return join_split_parts(tensors, prefix, parts_per_tensor=3)


def zimage_conditioner(table: Mapping, version: str = Z_IMAGE, embd_dir=None, *, backend: str = "cpu",
                       source: str = "model", **kw):
    from .te.qwen_tokenizer import ZIMAGE_TEMPLATE
    if embd_dir:
        log.warning("--embd-dir: textual-inversion embeddings are not used by Z-Image (as sd.cpp)")
    return build_llm_conditioner(table, ZIMAGE_TEMPLATE, family="Z-Image", backend=backend, source=source)


class ZImageDiffusion:
    """ZImageModel behind the registry's `.predict(x, t, cond, backend=)`: t = sigma * 1000 (the
    sd3_flow denoiser), cond.context the LLM states; returns sd.cpp's output (the negated velocity,
    which the flow denoiser's c_out = -sigma turns into the denoised latent)."""

    def __init__(self, model):
        self.model = model
        self.config = model.config

    def predict(self, x, t, cond: Cond, backend: str = "cpu") -> np.ndarray:
        if cond.c_concat is not None or cond.ref_latents or cond.guidance is not None:
            raise UsageError("Z-Image: this model takes no concat latents, reference images or distilled guidance")
        if cond.context is None:
            raise UsageError("Z-Image: no text conditioning (context) given")
        return self.model(x, t, cond.context, backend=backend)


def zimage_model(tensors, prefix: str, source: str) -> ZImageDiffusion:
    from .diffusion.zimage import ZImageModel
    model = ZImageModel(join_zimage_parts(tensors, prefix), prefix, source=source)
    log.info("%s", model.config.summary())
    return ZImageDiffusion(model)


register_family(Family(
    "z_image", {Z_IMAGE: Variant()}, "Z-Image",
    detect=(marker(16, DM + "cap_embedder.0.weight", Z_IMAGE),), text_encoders=("llm",), te_layout="dit",
    convert_diffusion_name=zimage_diffusers_name, conditioner=zimage_conditioner, diffusion_model=zimage_model,
    latent_channels=16, vae_scale_factor=8, size_multiple=16, latent_scale=0.3611, latent_shift=0.1159,
    prediction="flow", flow_shift=3.0, default_sampler="euler", default_scheduler="discrete",
    modes=frozenset({"txt2img", "img2img", "inpaint"})))
