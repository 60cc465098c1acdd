"""SD3 Medium, SD3.5 Large / Large Turbo and SD3.5 Medium: the family record (docs/adding-a-family.md).

- detection: sd.cpp's get_sd_version marker (order 5): any tensor under
  `model.diffusion_model.joint_blocks.` is SD3 (the MMDiT variant is read from the shapes by
  MMDiTConfig.detect_from_weights); diffusers names (order 23, after the markers): `pos_embed.proj`
  with joint `transformer_blocks` and no Flux single blocks.
- components: `--clip_l`, `--clip_g` (sd.py's records, under `text_encoders.*` in this layout),
  `--t5xxl` (flux.py's record: one registry entry per role), `--diffusion-model`, `--vae`.
- conditioning: sd.cpp's SD3CLIPEmbedder (sdrt.models.sd3_conditioning): context
  [1, 154k, 4096], y [1, 2048].
- sampling: sd.cpp's SD3 defaults: flow prediction (t = sigma * 1000), flow shift 3.0, euler
  over the discrete schedule; skip-layer guidance (`--slg-scale`) through the MMDiT's
  `predict(..., skip_layers=)`.
- diffusers files (`transformer/` folders, diffusers-named singles): sdrt.models.names renames one
  tensor at a time (q/k/v arrive as `qkv.weight`, `qkv.weight.1`, ...); `sd3_model` joins them and
  exchanges the halves of `final_layer.adaLN_modulation.1` and the LAST block's
  `context_block.adaLN_modulation.1` (diffusers' AdaLayerNormContinuous is (scale, shift), SAI's
  (shift, scale)), as sdrt.models.diffusion.mmdit_names.convert_diffusers_sd3 does on arrays.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from . import flux as _flux  # noqa: F401 - registers the clip_l / clip_g (sd.py) and t5xxl components first
from .families import Family, Variant, register_family
from .recognized import marker

__all__ = ["SD3", "detect_sd3", "join_sd3_diffusers", "sd3_conditioner", "sd3_model"]

log = logging.getLogger("sdrt")
DM = "model.diffusion_model."
SD3 = "sd3"
_RULE = marker(5, DM + "joint_blocks.", SD3)


def detect_sd3_diffusers(f):
    """A diffusers SD3Transformer2DModel (names as the loader's prefix map leaves them): the
    patch embedder `pos_embed.proj` with joint `transformer_blocks` (add_q_proj), and no Flux
    single blocks. sd.cpp converts diffusers names before its marker test; this is that case."""
    if f.has(DM + "pos_embed.proj.weight") and f.has(DM + "transformer_blocks.0.attn.add_q_proj.weight") \
            and not f.has(DM + "single_transformer_blocks."):
        return SD3
    return None


def detect_sd3(f):
    """Either rule: the `joint_blocks` marker or diffusers names."""
    return _RULE[1](f) or detect_sd3_diffusers(f)


_CONTEXT_ADALN = re.compile(r"joint_blocks\.(\d+)\.context_block\.adaLN_modulation\.1\.(weight|bias)$")


def _names(rest, version, layout):
    from .names import dit_to_original
    return dit_to_original(rest, "sd3")


def sd3_conditioner(table: Mapping, version: str = SD3, embd_dir=None, *, backend: str = "cpu",
                    source: str = "model", **kw):
    """The registry's conditioner: SD3CLIPEmbedder over whichever of CLIP-L / bigG / T5-XXL the
    loaded files carry (sd.cpp feeds zeros for a missing one and so does sdrt, with a warning).
    The T5 tokenizer is sd.cpp's (as Flux's)."""
    from .sd3_conditioning import PREFIX_SD3_CLIP_G, PREFIX_SD3_CLIP_L, PREFIX_SD3_T5, build_sd3_conditioner
    for prefix, flag in ((PREFIX_SD3_CLIP_L, "--clip_l"), (PREFIX_SD3_CLIP_G, "--clip_g"), (PREFIX_SD3_T5, "--t5xxl")):
        if not any(k.startswith(prefix) for k in table):
            log.warning("SD3: no %s weights in the loaded files (give %s); its part of the conditioning is zeros",
                        prefix.rstrip("."), flag)
    return build_sd3_conditioner(table, version, embd_dir, backend=backend, source=source, t5_style="sdcpp")


def join_sd3_diffusers(tensors: Mapping, prefix: str = DM) -> Mapping:
    """A table converted from diffusers SD3 names -> SAI tensors: split q/k/v parts joined,
    final_layer's and the last context block's adaLN halves exchanged. A table without split
    parts (SAI / sd.cpp names) is returned as is."""
    from .flux import _JoinedLeaf, join_diffusers_parts
    out = join_diffusers_parts(tensors, prefix)    # joins parts; swaps final_layer.adaLN_modulation.1
    if out is tensors:
        return tensors
    hits = [(int(m.group(1)), n) for n in out
            if n.startswith(prefix) and (m := _CONTEXT_ADALN.match(n[len(prefix):]))]
    if hits:
        last = max(i for i, _ in hits)
        for i, n in hits:
            if i == last:
                out[n] = _JoinedLeaf([out[n]], True, n)
    return out


def sd3_model(tensors, prefix: str, source: str):
    from .diffusion.mmdit import MMDiTModel
    model = MMDiTModel(join_sd3_diffusers(tensors, prefix), prefix, source=source)
    log.info("%s", model.config.summary())
    return model


register_family(Family(
    SD3, {SD3: Variant()}, "SD 3.x",
    detect=(_RULE, (23, detect_sd3_diffusers)), text_encoders=("clip_l", "clip_g", "t5xxl"), te_layout="dit",
    convert_diffusion_name=_names,
    diffusers_te_prefixes={"te1.": "text_encoders.clip_l.transformer."},
    conditioner=sd3_conditioner, diffusion_model=sd3_model,
    latent_channels=16, vae_scale_factor=8, size_multiple=16, latent_scale=1.5305, latent_shift=0.0609,
    prediction="flow", flow_shift=3.0, default_sampler="euler", default_scheduler="discrete",
    modes=frozenset({"txt2img", "img2img", "inpaint"})))
