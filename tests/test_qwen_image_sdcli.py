"""sdrt vs sd-cli on Qwen-Image random-weight files that sd-cli loads (tools/make_qwen_image_checkpoint.py):
the DiT at full width (hidden 3072, text width 3584: fixed in sd-cli) with 1 block (sd-cli counts them),
the Qwen2.5-VL text stack at full width (hidden 3584, 28/4 heads, the full vocabulary) with 1 layer and
a 512-wide FFN (sd-cli reads both from the weights), and the full Wan-2.1 VAE.

Opt-in: runs only when SDRT_SDCLI names an sd-cli binary. Both sides get the same files and flags,
`--type f32`, 256x256, 4 steps, true CFG 2.5 (the negative prompt's pass too); bar: PSNR >= 40 dB.
Files are written once under $SDRT_SDCLI_QWEN_DIR (default: a temp dir; ~2.2 GB). Run it under
`flock /work/heavy.lock` on shared machines (each side peaks near 6 GB).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from test_flux_sdcli import run_sdrt
from test_image_regression import psnr, read_rgb

MIN_PSNR = 40.0
ARGS = ["-p", "a lovely cat, (masterpiece:1.2)", "-W", "256", "-H", "256", "--steps", "4", "--cfg-scale", "2.5",
        "-s", "42", "--type", "f32", "-t", "2"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("mkqi", os.path.join(ROOT, "tools", "make_qwen_image_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sdcli() -> str | None:
    exe = os.environ.get("SDRT_SDCLI") or os.environ.get("SDRT_SD_CLI")
    return exe if exe and os.access(exe, os.X_OK) else None


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    if _sdcli() is None:
        pytest.skip("sd-cli comparison: set SDRT_SDCLI=/path/to/sd-cli to run it (no sd-cli binary given)")
    d = os.environ.get("SDRT_SDCLI_QWEN_DIR") or str(tmp_path_factory.mktemp("qwen_image_sdcli"))
    os.makedirs(d, exist_ok=True)
    mk = _tool()
    out = {}
    for comp, name in (("transformer", "dit"), ("llm", "llm"), ("vae", "vae")):
        path = os.path.join(d, name + ".safetensors")
        if not os.path.exists(path):
            mk.write(comp, path, depth=1, llm_layers=1, llm_ffn=512)
        out[name] = path
    out["vision"] = os.path.join(d, "vision.safetensors")       # written by the vision test when it runs
    out["mk"] = mk
    return out


def _compare(parts, tmp_path, extra, what):
    files = ["--diffusion-model", parts["dit"], "--llm", parts["llm"], "--vae", parts["vae"]]
    ref, ours = str(tmp_path / "sdcli.png"), str(tmp_path / "sdrt.png")
    r = subprocess.run([_sdcli(), *files, *ARGS, *extra, "-o", ref], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0 and os.path.exists(ref), r.stdout[-3000:] + r.stderr[-3000:]
    run_sdrt([*files, *ARGS, *extra, "-o", ours])
    p = psnr(read_rgb(ours), read_rgb(ref))
    print(f"sdrt vs sd-cli, {what} (1 block, 256x256, 4 steps, f32): PSNR {p:.2f} dB")
    assert p >= MIN_PSNR, f"sdrt vs sd-cli ({what}): PSNR {p:.2f} dB (need >= {MIN_PSNR})"


def test_txt2img_matches_sd_cli(parts, tmp_path):
    _compare(parts, tmp_path, [], "Qwen-Image txt2img")


def test_edit_with_reference_image_matches_sd_cli(parts, tmp_path):
    """Qwen-Image-Edit's reference latents (-r): the image resized as sd.cpp (the generation's area, sides
    a multiple of 32), VAE-encoded, normalized and appended to the DiT's image tokens (index 1). The
    LLM file has no vision tower, so sd-cli (like sdrt) encodes the plain prompt."""
    ref = os.path.join(os.path.dirname(ROOT), "shared", "images", "cat_1024.png")
    if not os.path.exists(ref):
        ref = "/work/shared/images/cat_1024.png"
    _compare(parts, tmp_path, ["-r", ref], "Qwen-Image-Edit (-r)")


def test_edit_with_vision_tower_matches_sd_cli(parts, tmp_path):
    """Qwen-Image-Edit with the Qwen2.5-VL vision tower from --llm_vision (full size: sd-cli fixes its
    32 blocks of width 1280; 1.35 GB): the Edit-Plus prompt with the reference image's vision tokens."""
    mk = parts["mk"]
    if not os.path.exists(parts["vision"]):
        shapes = {k[len("visual."):]: v for k, v in mk.vision_shapes().items()}
        mk.save_safetensors(parts["vision"], mk.arrays(shapes))
    _compare(parts, tmp_path, ["--llm_vision", parts["vision"], "-r", "/work/shared/images/cat_1024.png"],
             "Qwen-Image-Edit (-r, vision tower)")
