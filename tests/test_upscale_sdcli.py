"""`-M upscale` against sd-cli (issue 16): a random RRDBNet with RealESRGAN_x4plus's layer shapes
(4 blocks instead of 23 to keep it short) in a .safetensors with BasicSR names, and one with the
"old" ESRGAN names (x2), run by sd-cli and by `python -m sdrt.cli.main` on the cat (box-downscaled)
whole and in tiles (--upscale-tile-size 48: sd.cpp's overlap and blending), and twice
(--upscale-repeats 2); each pair >= 40 dB. sd-cli runs the upscaler with F16 conv weights and F16
im2col activations, sdrt with F16 weights and F32 activations: they are close, not equal.

Opt-in: runs only when SDRT_SDCLI names an sd-cli binary (about a minute per sd-cli image on 2
CPU cores); SDRT_SDCLI_UPSCALE_OUT keeps the images and logs; needs ../shared/images/cat_1024.png.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from esrgan_weights import basicsr_state  # noqa: E402
from test_image_regression import psnr, read_rgb  # noqa: E402

from sdrt.io import write_safetensors  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAT = os.path.join(os.path.dirname(ROOT), "shared", "images", "cat_1024.png")
MIN_PSNR = 40.0


def _old_names(sd: dict, nb: int) -> dict:
    """BasicSR names -> the old ESRGAN layout (x2: model.3 up1, model.5 hr, model.7 last)."""
    m = {"conv_first": "model.0", "conv_body": f"model.1.sub.{nb}", "conv_up1": "model.3", "conv_hr": "model.5",
         "conv_last": "model.7"}
    out = {}
    for k, v in sd.items():
        mod, kind = k.rsplit(".", 1)
        if mod.startswith("body."):
            _, i, rdb, conv = mod.split(".")
            out[f"model.1.sub.{i}.RDB{rdb[3:]}.{conv}.0.{kind}"] = v
        else:
            out[f"{m[mod]}.{kind}"] = v
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    exe = os.environ.get("SDRT_SDCLI")
    if not exe or not os.access(exe, os.X_OK):
        pytest.skip("-M upscale vs sd-cli: set SDRT_SDCLI=/path/to/sd-cli to run it")
    if not os.path.isfile(CAT):
        pytest.skip(f"-M upscale vs sd-cli: {CAT} is absent")
    work = os.environ.get("SDRT_SDCLI_UPSCALE_OUT") or str(tmp_path_factory.mktemp("upscale_sdcli"))
    os.makedirs(work, exist_ok=True)
    write_safetensors(os.path.join(work, "x4.safetensors"), basicsr_state(21, 64, 32, 4, 4, last_bias=0.5))
    write_safetensors(os.path.join(work, "x2_old.safetensors"),
                      _old_names(basicsr_state(22, 64, 32, 2, 2, last_bias=0.5), 2))
    cat = Image.open(CAT).convert("RGB")
    cat.resize((96, 96), Image.BOX).save(os.path.join(work, "cat96.png"))
    cat.resize((120, 88), Image.BOX).save(os.path.join(work, "cat120x88.png"))
    return {"exe": exe, "work": work}


CASES = {
    "x4_whole": ["--upscale-model", "x4.safetensors", "-i", "cat96.png"],
    "x4_tiled": ["--upscale-model", "x4.safetensors", "-i", "cat120x88.png", "--upscale-tile-size", "48"],
    "x2_old_repeats": ["--upscale-model", "x2_old.safetensors", "-i", "cat96.png", "--upscale-repeats", "2"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_upscale_matches_sd_cli(env, case):
    outs = {}
    for engine in ("sdcli", "sdrt"):
        out = f"{case}_{engine}.png"
        args = ["-M", "upscale", *CASES[case], "-o", out, "-t", "2"]
        cmd = [env["exe"], *args] if engine == "sdcli" else [sys.executable, "-m", "sdrt.cli.main", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=env["work"],
                           env={**os.environ, "PYTHONPATH": ROOT})
        with open(os.path.join(env["work"], f"{case}_{engine}.log"), "w") as f:
            f.write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        assert r.returncode == 0, f"{engine}: {(r.stdout + r.stderr)[-2000:]}"
        outs[engine] = read_rgb(os.path.join(env["work"], out))
    p = psnr(outs["sdrt"], outs["sdcli"])
    print(f"\n-M upscale {case}: {outs['sdrt'].shape[1]}x{outs['sdrt'].shape[0]}, sdrt vs sd-cli {p:.2f} dB")
    assert outs["sdrt"].shape == outs["sdcli"].shape
    assert p >= MIN_PSNR
    assert float(np.std(outs["sdrt"])) > 10      # a picture, not a flat clamp
