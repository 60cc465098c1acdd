"""Diffusers' SD3Transformer2DModel names -> SAI's original MMDiT names (the canonical layout).

The inverse of diffusers' convert_sd3_transformer_checkpoint_to_diffusers, as a plan of parts:
- `x_block.attn.qkv` = concat(attn.to_q, to_k, to_v); `context_block.attn.qkv` =
  concat(add_q_proj, add_k_proj, add_v_proj); `x_block.attn2.qkv` = concat(attn2.to_q, to_k, to_v)
  (along torch axis 0, weight and bias);
- `final_layer.adaLN_modulation.1` = norm_out.linear, and the LAST block's
  `context_block.adaLN_modulation.1` = its norm1_context.linear, each with its two halves
  swapped: diffusers' AdaLayerNormContinuous splits (scale, shift), SAI's (shift, scale).
  (sdrt.models.names._SD3_TOP / _sd3_block_map only rename these two, so they are not enough.)
- everything else is a rename: pos_embed.pos_embed -> pos_embed, pos_embed.proj -> x_embedder.proj,
  time_text_embed.{timestep,text}_embedder.linear_{1,2} -> {t,y}_embedder.mlp.{0,2},
  norm1(.linear) -> x_block.adaLN_modulation.1, attn.norm_q/k -> x_block.attn.ln_q/k,
  attn.norm_added_q/k -> context_block.attn.ln_q/k, attn.to_out.0 / to_add_out -> x/context
  attn.proj, ff / ff_context -> x/context mlp.fc1/fc2, proj_out -> final_layer.linear.

`diffusers_to_sai_plan(names)` -> {SAI name: Part} is pure name logic; `convert_diffusers_sd3`
applies it to torch-order arrays. Unknown names raise ModelFileError naming them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

from .flux_names import DIFFUSERS_PREFIXES, Part, PlanBuilder, apply_part

__all__ = ["diffusers_to_sai_plan", "convert_diffusers_sd3", "DIFFUSERS_PREFIXES"]

_TOP = {"pos_embed.proj": "x_embedder.proj",
        "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
        "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
        "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
        "context_embedder": "context_embedder", "proj_out": "final_layer.linear"}
_BLOCK = {"norm1.linear": "x_block.adaLN_modulation.1", "norm1_context.linear": "context_block.adaLN_modulation.1",
          "attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
          "attn2.to_out.0": "x_block.attn2.proj",
          "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
          "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2"}
_NORMS = {"attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
          "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
          "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
_FUSED = {"x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
          "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v")}
_RE_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.(.+)\.(weight|bias)$")


def diffusers_to_sai_plan(names: Iterable[str]) -> dict[str, Part]:
    """{SAI name: Part} covering every given diffusers name exactly once (a `transformer.` or
    `model.diffusion_model.` prefix is accepted). Raises ModelFileError for an unknown name or a
    fused tensor with a part missing."""
    b = PlanBuilder(names, "diffusers SD3")
    take = b.take
    last = max((int(m.group(1)) for n in b.by_plain if (m := _RE_BLOCK.match(n))), default=-1)
    for plain in b.pending():
        m = _RE_BLOCK.match(plain)
        if m:
            i, base, leaf = int(m.group(1)), m.group(2), m.group(3)
            src, dst = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
            if base in _BLOCK:
                take(f"{dst}{_BLOCK[base]}.{leaf}", (plain,), swap=base == "norm1_context.linear" and i == last)
                continue
            if base in _NORMS:
                take(f"{dst}{_NORMS[base]}.{leaf}", (plain,))
                continue
            hit = next((f for f, parts in _FUSED.items() if base in parts), None)
            if hit is not None:
                take(f"{dst}{hit}.{leaf}", tuple(f"{src}{p}.{leaf}" for p in _FUSED[hit]))
                continue
        elif plain == "pos_embed.pos_embed":
            take("pos_embed", (plain,))
            continue
        elif "." in plain:
            base, leaf = plain.rsplit(".", 1)
            if base in _TOP:
                take(f"{_TOP[base]}.{leaf}", (plain,))
                continue
            if base == "norm_out.linear":
                take(f"final_layer.adaLN_modulation.1.{leaf}", (plain,), swap=True)
                continue
        raise b.unknown(plain, "SD3Transformer2DModel")
    return b.plan


def convert_diffusers_sd3(state: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """A diffusers SD3Transformer2DModel state dict (numpy, torch order) -> SAI names under `prefix`."""
    return {prefix + name: apply_part(part, state) for name, part in diffusers_to_sai_plan(state).items()}
