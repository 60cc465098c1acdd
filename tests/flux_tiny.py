"""Tiny random Flux.1 / Chroma checkpoints with the REAL tensor names, for the family tests.

The DiT comes from sdrt's FluxConfig (tools/make_flux_checkpoint.py's layout) at reduced depth and
width (hidden 128 = one 128-wide head, so the released RoPE axes 16/56/56 apply and nothing needs
an override), the VAE in the ae.safetensors layout (16 latent channels, no quant convs, 3
downsamplings), CLIP-L as HF CLIPTextModel (`text_model.*`, width 64) and T5 v1.1 as HF
T5EncoderModel (`shared.weight`, `encoder.block.N.*`, d_model 32, one 64-wide head). Values:
make_flux_checkpoint's deterministic generator (PCG64 seeded by (seed, crc32(name))).

Files: `single` (one -m file: `model.diffusion_model.*`, `vae.*`, `text_encoders.clip_l.transformer.*`,
`text_encoders.t5xxl.transformer.*`, as sd.cpp/ComfyUI single files), or the split parts
(--diffusion-model with bare BFL names, --vae, --clip_l, --t5xxl).
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np

from sdrt.io import write_safetensors
from sdrt.models.diffusion.flux import FluxConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mkflux = _load("make_flux_checkpoint")
mksd = _load("make_sd_checkpoint")

CLIP_W, T5_D, T5_VOCAB = 64, 32, 32128
DIT = dict(hidden_size=128, num_heads=1, mlp_hidden=256, depth=1, depth_single_blocks=2, context_in_dim=T5_D,
           vec_in_dim=CLIP_W, approx_hidden=32, approx_layers=1)
VARIANTS = {"dev": dict(guidance_embed=True), "schnell": dict(guidance_embed=False),
            "fill": dict(guidance_embed=True, in_channels=384),
            "chroma": dict(guidance_embed=False, vec_in_dim=0, is_chroma=True)}


def dit_names(variant: str) -> dict:
    return FluxConfig(**{**DIT, **VARIANTS[variant]}).weight_shapes()


def vae_names() -> dict:
    return mkflux.vae_layout(ch=32, mult=(1, 1, 1, 1), nrb=1, z=16)


def clip_names() -> dict:
    return mksd.clip_hf("", CLIP_W, 1)


def t5_names(layers: int = 1, inner: int = 64, ff: int = 64) -> dict:
    t = {"shared.weight": (T5_VOCAB, T5_D), "encoder.final_layer_norm.weight": (T5_D,),
         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (32, inner // 64)}
    for i in range(layers):
        p = f"encoder.block.{i}.layer."
        for q in "qkv":
            t[f"{p}0.SelfAttention.{q}.weight"] = (inner, T5_D)
        t[f"{p}0.SelfAttention.o.weight"] = (T5_D, inner)
        t[f"{p}0.layer_norm.weight"] = (T5_D,)
        t[f"{p}1.DenseReluDense.wi_0.weight"] = (ff, T5_D)
        t[f"{p}1.DenseReluDense.wi_1.weight"] = (ff, T5_D)
        t[f"{p}1.DenseReluDense.wo.weight"] = (T5_D, ff)
        t[f"{p}1.layer_norm.weight"] = (T5_D,)
    return t


def _arrays(names: dict, prefix: str, seed: int, key=lambda n: n) -> dict:
    out = {}
    for n, shape in names.items():
        v = mkflux.values(key(n), shape, seed)
        if n.endswith("final_layer.linear.weight"):
            v = v * np.float32(4.0)      # a random DiT's velocity is tiny; make the image depend on it
        out[prefix + n] = v
    return out


PARTS = {"diffusion_model": ("model.diffusion_model.", None), "vae": ("vae.", vae_names),
         "clip_l": ("text_encoders.clip_l.transformer.", clip_names),
         "t5xxl": ("text_encoders.t5xxl.transformer.", t5_names)}


def write(dirname: str, variant: str = "dev", single: bool = True, seed: int = 0, parts=("vae", "clip_l", "t5xxl")):
    """Write the checkpoint(s); returns CLI args (-m FILE, or --diffusion-model/--vae/--clip_l/--t5xxl FILES).
    `parts` are the components written (Chroma gets no CLIP-L)."""
    if variant == "chroma":
        parts = tuple(p for p in parts if p != "clip_l")
    tables = {"diffusion_model": dit_names(variant)}
    for p in parts:
        tables[p] = PARTS[p][1]()
    os.makedirs(dirname, exist_ok=True)
    if single:
        arrays = {}
        for role, names in tables.items():
            pre = PARTS[role][0]
            arrays.update(_arrays(names, pre, seed, key=lambda n, pre=pre: pre + n))
        path = os.path.join(dirname, f"flux-{variant}-tiny.safetensors")
        write_safetensors(path, {k: v.astype(np.float16) if v.ndim > 1 else v for k, v in arrays.items()})
        return ["-m", path]
    args = []
    flags = {"diffusion_model": "--diffusion-model", "vae": "--vae", "clip_l": "--clip_l", "t5xxl": "--t5xxl"}
    for role, names in tables.items():
        pre = PARTS[role][0]
        path = os.path.join(dirname, f"{variant}-{role}.safetensors")
        arrays = _arrays(names, "", seed, key=lambda n, pre=pre: pre + n)
        write_safetensors(path, {k: v.astype(np.float16) if v.ndim > 1 else v for k, v in arrays.items()})
        args += [flags[role], path]
    return args
