"""Tiny random Z-Image split files with the real tensor names (tests/test_zimage.py and the GPU
test): the golden DiT of tests/fixtures/zimage_transformer.npz (width 128, captions 64), a Qwen3
of width 64 (2 layers, sd.cpp's fixed 32 query / 8 kv heads of 128; tools/make_zimage_checkpoint.py)
and the small Flux-layout AE of tests/flux_tiny.py."""
from __future__ import annotations

import importlib.util
import os

import numpy as np

import flux_tiny as ft
from sdrt.io import write_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mkz = _tool("make_zimage_checkpoint")


def write(d: str) -> dict:
    """{role: path} of the three files under directory d (written once)."""
    os.makedirs(d, exist_ok=True)
    paths = {r: os.path.join(d, f) for r, f in (("diffusion_model", "dit.safetensors"),
                                                ("llm", "llm.safetensors"), ("vae", "ae.safetensors"))}
    if not os.path.exists(paths["diffusion_model"]):
        g = np.load(os.path.join(FIX, "zimage_transformer.npz"))
        write_safetensors(paths["diffusion_model"], {k[2:]: g[k] for k in g.files if k.startswith("w/")})
    if not os.path.exists(paths["llm"]):
        mkz.write(paths["llm"], mkz.qwen3_layout(64, 2, 128, vocab=151669))
    if not os.path.exists(paths["vae"]):
        write_safetensors(paths["vae"], {n: ft.mkflux.values(n, s, 0) for n, s in ft.vae_names().items()})
    return paths


def args(paths: dict) -> list[str]:
    return ["--diffusion-model", paths["diffusion_model"], "--llm", paths["llm"], "--vae", paths["vae"]]
