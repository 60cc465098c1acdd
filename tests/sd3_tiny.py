"""Tiny random SD3 checkpoints with the REAL tensor names, for the family tests.

The MMDiT from sdrt's MMDiTConfig (tools/make_sd3_checkpoint.py's layout) at reduced depth and
width (hidden 64 = one 64-wide head, SD3.5's RMS QK norm, a 8x8 position grid), the VAE in the
16-channel layout SD3 shares with Flux (no quant convs), CLIP-L (width 64, 2 layers) and bigG
(width 128, 2 heads, 2 layers, text_projection) as HF CLIPTextModel(WithProjection) names, T5 v1.1
(d_model 192 = CLIP-L + bigG widths, one 64-wide head). Values: make_sd3_checkpoint's
deterministic generator (PCG64 seeded by (seed, crc32(name))).

`all+te` single file (as SAI's sd3_medium_incl_clips_t5xxlfp16.safetensors): `model.diffusion_model.*`,
`first_stage_model.*`, `text_encoders.{clip_l,clip_g,t5xxl}.transformer.*`.
"""
from __future__ import annotations

import os

import numpy as np

import flux_tiny as ft
from sdrt.io import write_safetensors
from sdrt.models.diffusion.mmdit import MMDiTConfig

ROOT = ft.ROOT
mk3 = ft._load("make_sd3_checkpoint")
CLIP_L, CLIP_G, T5_D = 64, 128, 192
DEPTH = 3
DIT = dict(hidden_size=64, depth=DEPTH, num_heads=1, mlp_hidden=128, pos_embed_max_size=8, qk_norm="rms",
           context_in_dim=T5_D, adm_in_channels=CLIP_L + CLIP_G)


def dit_names() -> dict:
    return MMDiTConfig(**DIT).weight_shapes()


def clip_g_names() -> dict:
    t = ft.mksd.clip_hf("", CLIP_G, 2, projection=True)
    return t


def t5_names(d: int = T5_D, inner: int = 64, ff: int = 128) -> dict:
    """flux_tiny's one-block T5 v1.1 layout at d_model `d`."""
    t = {}
    for n, shape in ft.t5_names(1, inner, ff).items():
        t[n] = tuple(d if v == ft.T5_D else v for v in shape)
    return t


PARTS = {"diffusion_model": ("model.diffusion_model.", dit_names), "vae": ("first_stage_model.", ft.vae_names),
         "clip_l": ("text_encoders.clip_l.transformer.", lambda: ft.mksd.clip_hf("", CLIP_L, 2)),
         "clip_g": ("text_encoders.clip_g.transformer.", clip_g_names),
         "t5xxl": ("text_encoders.t5xxl.transformer.", t5_names)}


def arrays(seed: int = 0) -> dict:
    out = {}
    for pre, names in PARTS.values():
        for n, shape in names().items():
            v = mk3.values(pre + n, shape, seed)
            if n.endswith("final_layer.linear.weight"):
                v = v * np.float32(4.0)      # a random DiT's velocity is tiny; make the image depend on it
            out[pre + n] = v
    return out


def write(dirname: str, seed: int = 0) -> list[str]:
    """Write the single `all+te` file; returns its CLI args (-m FILE)."""
    os.makedirs(dirname, exist_ok=True)
    path = os.path.join(dirname, "sd3-tiny.safetensors")
    write_safetensors(path, {k: v.astype(np.float16) if v.ndim > 1 else v for k, v in arrays(seed).items()})
    return ["-m", path]
