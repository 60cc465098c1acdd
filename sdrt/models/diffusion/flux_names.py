"""Diffusers' FluxTransformer2DModel names -> BFL's original names (the canonical Flux layout).

Diffusers splits what BFL fuses and reorders one tensor; the conversion is a plan of parts:
- `img_attn.qkv` / `txt_attn.qkv` = concat(to_q, to_k, to_v) / concat(add_q_proj, add_k_proj,
  add_v_proj) along the output dim (torch axis 0), weight and bias;
- `single_blocks.N.linear1` = concat(to_q, to_k, to_v, proj_mlp);
- `final_layer.adaLN_modulation.1` = norm_out.linear with its two halves swapped: diffusers'
  AdaLayerNormContinuous splits (scale, shift), BFL's LastLayer (shift, scale) — diffusers'
  own single-file loader swaps them (convert_flux_transformer_checkpoint_to_diffusers'
  swap_scale_shift). stable-diffusion.cpp's name map (and sdrt.models.names, which follows it) only
  renames this tensor, which runs the final layer with scale and shift exchanged.
- everything else is a rename (see _BLOCK, _SINGLE, _TOP); Chroma's ChromaTransformer2DModel
  (no per-block modulation, `distilled_guidance_layer` with `layers.N.linear_1/2` and
  `norms.N.weight` -> BFL/Chroma's `in_layer`/`out_layer` and `norms.N.scale`) is covered too.

`diffusers_to_bfl_plan(names)` -> {BFL name: Part(sources, swap_halves)} is pure name logic;
`convert_diffusers_flux(state)` applies it to arrays in torch order (rows on axis 0, so raw
block-quantized rows work too). Unknown names raise ModelFileError naming them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from ...errors import ModelFileError

__all__ = ["Part", "PlanBuilder", "diffusers_to_bfl_plan", "convert_diffusers_flux", "DIFFUSERS_PREFIXES"]

DIFFUSERS_PREFIXES = ("transformer.", "model.diffusion_model.")


class Part(NamedTuple):
    sources: tuple[str, ...]   # diffusers names, concatenated in this order along torch axis 0
    swap_halves: bool = False  # exchange the two halves of axis 0 (scale/shift -> shift/scale)


_TOP = {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}
_BLOCK = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
          "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
          "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
          "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2"}
_BLOCK_NORMS = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale",
                "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
                "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
                "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale"}
_BLOCK_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
_SINGLE_NORMS = {"attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_RE_BLOCK = re.compile(r"(single_transformer_blocks|transformer_blocks)\.(\d+)\.(.+)")
_RE_CHROMA = re.compile(r"distilled_guidance_layer\.(?:(in_proj|out_proj)\.|layers\.(\d+)\.linear_([12])\.|norms\.(\d+)\.weight$)")


def strip_diffusers_prefix(name: str) -> str:
    """The name without its `transformer.` / `model.diffusion_model.` wrapper."""
    for p in DIFFUSERS_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


class PlanBuilder:
    """A conversion plan under construction: `take(target, parts)` maps diffusers names (without
    their wrapper prefix) to one target tensor, each name used once; `pending()` yields the names
    no `take` has used yet, in sorted order. `what` names the model in errors ("diffusers Flux")."""

    def __init__(self, names: Iterable[str], what: str):
        self.by_plain = {strip_diffusers_prefix(n): n for n in names}
        self.what, self.plan, self.used = what, {}, set()

    def take(self, target: str, parts: tuple[str, ...], swap: bool = False) -> None:
        missing = [p for p in parts if p not in self.by_plain]
        if missing:
            raise ModelFileError(f"{self.what}: {target} needs {', '.join(parts)}; missing {', '.join(missing)}")
        self.plan[target] = Part(tuple(self.by_plain[p] for p in parts), swap)
        self.used.update(parts)

    def pending(self):
        for plain in sorted(self.by_plain):
            if plain not in self.used:
                yield plain

    def unknown(self, plain: str, model_class: str) -> ModelFileError:
        return ModelFileError(f"{self.what}: unknown tensor {self.by_plain[plain]!r} (not part of {model_class})")


def diffusers_to_bfl_plan(names: Iterable[str]) -> dict[str, Part]:
    """{BFL name: Part} covering every given diffusers name exactly once (a `transformer.` or
    `model.diffusion_model.` prefix is accepted). Raises ModelFileError for a name it does not
    know or a fused tensor with a part missing."""
    b = PlanBuilder(names, "diffusers Flux")
    take = b.take
    for plain in b.pending():
        leaf = plain.rsplit(".", 1)[-1]
        m = _RE_BLOCK.match(plain)
        if m:
            kind, i, rest = m.group(1), m.group(2), m.group(3)
            src = f"{kind}.{i}."
            dst = f"double_blocks.{i}." if kind == "transformer_blocks" else f"single_blocks.{i}."
            renames, norms, fused = ((_BLOCK, _BLOCK_NORMS, _BLOCK_FUSED) if kind == "transformer_blocks"
                                     else (_SINGLE, _SINGLE_NORMS, _SINGLE_FUSED))
            if rest in norms:
                take(dst + norms[rest], (plain,))
                continue
            base = rest[: -len(leaf) - 1]
            if base in renames:
                take(f"{dst}{renames[base]}.{leaf}", (plain,))
                continue
            hit = next((f for f, parts in fused.items() if base in parts), None)
            if hit is not None:
                take(f"{dst}{hit}.{leaf}", tuple(f"{src}{p}.{leaf}" for p in fused[hit]))
                continue
        elif (c := _RE_CHROMA.match(plain)):
            p = "distilled_guidance_layer."
            if c.group(1):
                bfl = plain
            elif c.group(2):
                bfl = f"{p}layers.{c.group(2)}.{'in_layer' if c.group(3) == '1' else 'out_layer'}.{leaf}"
            else:
                bfl = f"{p}norms.{c.group(4)}.scale"
            take(bfl, (plain,))
            continue
        else:
            base = plain[: -len(leaf) - 1]
            if base in _TOP:
                take(f"{_TOP[base]}.{leaf}", (plain,))
                continue
            if base == "norm_out.linear":
                take(f"final_layer.adaLN_modulation.1.{leaf}", (plain,), swap=True)
                continue
        raise b.unknown(plain, "FluxTransformer2DModel")
    return b.plan


def apply_part(part: Part, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """One BFL tensor from its diffusers sources (torch-order arrays, rows on axis 0)."""
    xs = [np.asarray(arrays[s]) for s in part.sources]
    out = xs[0] if len(xs) == 1 else np.concatenate(xs, axis=0)
    if part.swap_halves:
        n = out.shape[0]
        if n % 2:
            raise ModelFileError(f"diffusers Flux: {part.sources[0]} has {n} rows, cannot swap halves")
        out = np.concatenate([out[n // 2:], out[: n // 2]], axis=0)
    return out


def convert_diffusers_flux(state: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """A diffusers FluxTransformer2DModel state dict (numpy, torch order) -> BFL names under `prefix`."""
    return {prefix + name: apply_part(part, state) for name, part in diffusers_to_bfl_plan(state).items()}
