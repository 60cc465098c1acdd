"""sdrt vs sd-cli on a random-weight Z-Image checkpoint (issue 20: PSNR >= 40 dB, f32, 256x256,
4 steps).

The files (tools/make_zimage_checkpoint.py, written once per session under $SDRT_SDCLI_ZIMAGE_DIR,
default a temp dir): the DiT at width 256 (2 heads of 128) with 2 main + 1 noise + 1 context
refiner layers, a Qwen3 LLM of width 64 with 2 layers (sd.cpp's fixed 32/8 heads of 128, the full
vocabulary; sd.cpp reads layer 35, which it does not have, so both take the final-norm output), the
full Flux AE. sd-cli 0.4.7 fixes the Z-Image DiT at 30 + 2 layers of width 3840: this needs an
sd-cli built with bench/patch_sdcli_zimage.py (layers, width, heads and caption width from the
weights; bench/build_sdcli_cpu.sh applies it). With an unpatched sd-cli, sd-cli fails to load the
DiT and the test says so.

Opt-in: runs only when SDRT_SDCLI names an sd-cli binary. Both sides get the same files and
flags: `--type f32`, 256x256, 4 steps, seed 42; Turbo-style cfg 1 and a cfg 4 case with a
negative prompt (the empty-template uncond pass). Heavy (the f32 AE): run under
`flock /work/heavy.lock` on shared machines.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from test_flux_sdcli import run_sdrt
from test_image_regression import psnr, read_rgb

MIN_PSNR = 40.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["-p", "a lovely cat, (masterpiece:1.2)", "-W", "256", "-H", "256", "--steps", "4", "-s", "42",
        "--type", "f32", "-t", "2"]
CASES = {"cfg1": ["--cfg-scale", "1"], "cfg4": ["--cfg-scale", "4", "-n", "blurry, lowres"]}


def _sdcli() -> str | None:
    exe = os.environ.get("SDRT_SDCLI") or os.environ.get("SDRT_SD_CLI")
    return exe if exe and os.access(exe, os.X_OK) else None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if _sdcli() is None:
        pytest.skip("sd-cli comparison: set SDRT_SDCLI=/path/to/sd-cli to run it (no sd-cli binary given)")
    d = os.environ.get("SDRT_SDCLI_ZIMAGE_DIR") or str(tmp_path_factory.mktemp("zimage_sdcli"))
    spec = importlib.util.spec_from_file_location("mkz", os.path.join(ROOT, "tools", "make_zimage_checkpoint.py"))
    mkz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mkz)
    if not all(os.path.exists(os.path.join(d, f)) for f in ("zimage.safetensors", "qwen3.safetensors",
                                                             "ae.safetensors")):
        mkz.main(["-o", d, "--vae"])
    return ["--diffusion-model", os.path.join(d, "zimage.safetensors"), "--llm", os.path.join(d, "qwen3.safetensors"),
            "--vae", os.path.join(d, "ae.safetensors")]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_sd_cli(files, tmp_path, case):
    ref, ours = str(tmp_path / "sdcli.png"), str(tmp_path / "sdrt.png")
    r = subprocess.run([_sdcli(), *files, *ARGS, *CASES[case], "-o", ref], capture_output=True, text=True,
                       timeout=3600)
    assert r.returncode == 0 and os.path.exists(ref), (
        "sd-cli failed (an sd-cli without bench/patch_sdcli_zimage.py cannot load a reduced Z-Image DiT):\n"
        + r.stdout[-3000:] + r.stderr[-3000:])
    run_sdrt([*files, *ARGS, *CASES[case], "-o", ours])
    p = psnr(read_rgb(ours), read_rgb(ref))
    print(f"sdrt vs sd-cli, Z-Image {case} (2+1+1 layers, width 256, 256x256, 4 steps, f32): PSNR {p:.2f} dB")
    assert p >= MIN_PSNR, f"sdrt vs sd-cli ({case}): PSNR {p:.2f} dB (need >= {MIN_PSNR})"
