"""sdrt against stable-diffusion.cpp's sd-cli on Flux.1-dev, Flux.1-schnell and Chroma (issue 14,
done-means 3): the same random reduced-depth checkpoints, the same flags, f32 on both sides,
PSNR >= 40 dB. Runs only when SDRT_SDCLI names an sd-cli binary (skips otherwise).

The checkpoints have the real tensor names and widths (BFL transformer, ae.safetensors VAE, HF
CLIP-L, T5-XXL v1.1) at reduced depth: 1 double + 1 single Flux block, 1 T5 block. They are made
here by tools/make_flux_checkpoint.py and tools/make_sd_checkpoint.py (deterministic, seed 0; about
4.4 GB in all, ~4 minutes); set SDRT_SDCLI_FLUX_DIR to a folder to keep and reuse them (a file
there is reused only if its random-weights metadata says what this test would write).

A 1-block T5 loads in the sdist's sd-cli only with the depth patch of bench/build_sdcli_cpu.sh
(upstream's block counting; the 0.4.7 sdist fixes T5 at 24 blocks): without it sd-cli fails to
load the T5 file and this test fails at the sd-cli step, saying so.

Each case costs one sd-cli run and one sdrt run at 256x256, 4 steps (a few GB of f32 weights each).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_PSNR = 40.0          # dB, 8-bit RGB: issue 14's bar for sdrt vs sd-cli
PROMPT = "a lovely cat"
# --scheduler explicit: the 0.4.7 sdist's default for Flux is discrete, upstream's (and sdrt's, from the
# spec) is flux; the two differ (schnell: 25.8 dB apart), so the default would compare schedules
COMMON = ["-p", PROMPT, "-W", "256", "-H", "256", "--steps", "4", "--cfg-scale", "1.0",
          "--sampling-method", "euler", "--scheduler", "discrete", "-s", "42", "--type", "f32", "-t", "2"]
VARIANTS = ("dev", "schnell", "chroma")
EXTRA = {"dev": ["--guidance", "3.5"], "schnell": [], "chroma": []}   # 3.5 is both sides' default


def _sdcli() -> str | None:
    exe = os.environ.get("SDRT_SDCLI") or os.environ.get("SDRT_SD_CLI")
    return exe if exe and os.access(exe, os.X_OK) else None


needs_sdcli = pytest.mark.skipif(
    _sdcli() is None, reason="sd-cli comparison: set SDRT_SDCLI=/path/to/sd-cli to run it (no sd-cli binary given)")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _metadata(path: str) -> dict:
    from sdrt.io import open_model
    return open_model(path).metadata or {}


# file name -> (tool, argv, how the "sdrt.random_weights" metadata it writes begins)
FILES = {
    "flux1-dev-d1s1-rand-bf16.safetensors":
        ("make_flux_checkpoint", ["--variant", "dev", "--depth", "1", "--single-depth", "1"],
         "flux1-dev depth=1+1 seed=0"),
    "flux1-schnell-d1s1-rand-bf16.safetensors":
        ("make_flux_checkpoint", ["--variant", "schnell", "--depth", "1", "--single-depth", "1"],
         "flux1-schnell depth=1+1 seed=0"),
    "flux1-chroma-d1s1-rand-bf16.safetensors":
        ("make_flux_checkpoint", ["--variant", "chroma", "--depth", "1", "--single-depth", "1"],
         "flux1-chroma depth=1+1 seed=0"),
    "ae-rand-bf16.safetensors": ("make_flux_checkpoint", ["--component", "vae"], "flux ae seed=0"),
    "t5xxl-1block-rand-f16.safetensors":
        ("make_flux_checkpoint", ["--component", "t5xxl", "--t5-depth", "1", "--type", "f16"], "t5xxl depth=1 seed=0"),
    "clip_l-rand-f16.safetensors": ("make_sd_checkpoint", ["--arch", "sd15", "--component", "clip_l", "--dtype", "f16"],
                                    "sd15 seed=0"),
}


def _fresh(path: str, tag: str) -> bool:
    if not os.path.exists(path):
        return False
    return _metadata(path).get("sdrt.random_weights", "").startswith(tag)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    d = os.environ.get("SDRT_SDCLI_FLUX_DIR") or str(tmp_path_factory.mktemp("flux_vs_sdcli"))
    os.makedirs(d, exist_ok=True)
    for name, (tool, argv, tag) in FILES.items():
        path = os.path.join(d, name)
        if not _fresh(path, tag):
            _tool(tool).main([*argv, "-o", path])
    return d


def command(variant: str, d: str) -> list[str]:
    """The generation flags shared by sd-cli and sdrt for one variant (split component files)."""
    files = ["--diffusion-model", os.path.join(d, f"flux1-{variant}-d1s1-rand-bf16.safetensors"),
             "--vae", os.path.join(d, "ae-rand-bf16.safetensors"),
             "--t5xxl", os.path.join(d, "t5xxl-1block-rand-f16.safetensors")]
    if variant != "chroma":      # Chroma has no CLIP-L (sd.cpp's T5CLIPEmbedder takes T5 only)
        files += ["--clip_l", os.path.join(d, "clip_l-rand-f16.safetensors")]
    return [*files, *COMMON, *EXTRA[variant]]


def read_rgb(path: str) -> np.ndarray:
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@needs_sdcli
@pytest.mark.parametrize("variant", VARIANTS)
def test_flux_matches_sd_cli(variant, ckpt_dir, tmp_path):
    args = command(variant, ckpt_dir)
    ref, ours = str(tmp_path / "sdcli.png"), str(tmp_path / "sdrt.png")
    r = subprocess.run([_sdcli(), *args, "-o", ref], capture_output=True, text=True, timeout=1800)
    log = r.stdout + r.stderr
    assert r.returncode == 0 and os.path.exists(ref), f"sd-cli failed (rc {r.returncode}):\n{log[-3000:]}"
    # sd-cli read the model this test means: the reduced depth, and a T5 it could load
    assert "flux: depth = 1, depth_single_blocks = 1" in log, log[-3000:]
    assert "t5xxl text encoder not found" not in log and "load tensors from model loader failed" not in log, log[-3000:]
    if variant == "chroma":
        assert "Using pruned modulation (Chroma)" in log, log[-3000:]

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    s = subprocess.run([sys.executable, "-m", "sdrt.cli.main", *args, "-o", ours], capture_output=True, text=True,
                       timeout=3600, env=env, cwd=ROOT)
    out = s.stdout + s.stderr
    assert s.returncode == 0 and os.path.exists(ours), f"sdrt failed (rc {s.returncode}):\n{out[-3000:]}"
    p = psnr(read_rgb(ours), read_rgb(ref))
    print(f"flux {variant}: sdrt vs sd-cli (256x256, 4 steps, euler, cfg 1, f32): PSNR {p:.2f} dB")
    assert p >= MIN_PSNR, f"flux {variant}: sdrt vs sd-cli PSNR {p:.2f} dB (need >= {MIN_PSNR})"


def test_t5xxl_layout_is_what_sdrt_reads(tmp_path):
    """make_flux_checkpoint's t5xxl component (the T5 file sd-cli gets above) has the names and shapes
    sdrt's T5 encoder reads, depth and widths counted from the file (narrow widths here)."""
    from sdrt.io import open_model, write_safetensors
    from sdrt.models.te.t5 import T5Encoder
    mk = _tool("make_flux_checkpoint")
    table = mk.t5xxl_layout(depth=3, d_model=128, d_ff=160, vocab=300, heads=2)
    path = str(tmp_path / "t5.safetensors")
    write_safetensors(path, {n: mk.values(n, s, 0) for n, s in table.items()})
    enc = T5Encoder(open_model(path).tensors, "")
    cfg = enc.config
    assert (cfg.layers, cfg.d_model, cfg.d_ff, cfg.heads, cfg.vocab) == (3, 128, 160, 2, 300)
    h = enc.run(np.arange(1, 12, dtype=np.int32))
    assert h.shape == (1, 11, 128) and np.isfinite(h).all()
    assert len(mk.t5xxl_layout(24)) == 24 * 9 + 3    # the released t5xxl_fp16 encoder: 219 tensors
