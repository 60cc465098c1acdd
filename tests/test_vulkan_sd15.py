"""Issue 19's "SD1.5 at 256x256 on lavapipe": the full-size random-weight SD1.5 checkpoint
(tools/make_sd_checkpoint.py) through the CLI on vulkan0 and on the CPU, PSNR >= 50 dB; and the
same with --max-vram (weights streamed per segment on Vulkan), which must give vulkan0's image.

Opt-in: lavapipe is slow at full size (one UNet step took ~20 minutes on the shared 2-core machine
at load 8-11, see docs/vulkan.md; expect well over an hour for the three runs there), ~4 GB of
memory: run it on a quiet machine, or under `flock /work/heavy.lock` here.
    SDRT_VULKAN_SD15=1 python -m pytest -q tests/test_vulkan_sd15.py
SDRT_VULKAN_SD15 may name an existing checkpoint file (else one is written to a temporary dir)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_PSNR = 50.0
ARGS = ["-p", "a lovely cat", "-W", "256", "-H", "256", "--steps", "2", "--cfg-scale", "7",
        "--sampling-method", "euler", "-s", "42", "-v"]

pytestmark = [pytest.mark.vulkan,
              pytest.mark.skipif(not os.environ.get("SDRT_VULKAN_SD15"),
                                 reason="full-size SD1.5 on lavapipe is slow: set SDRT_VULKAN_SD15=1 "
                                        "(or a checkpoint path) to run it")]


def _read(path):
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.float64)


def psnr(a, b) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    given = os.environ.get("SDRT_VULKAN_SD15", "")
    if os.path.isfile(given):
        return given
    path = str(tmp_path_factory.mktemp("sd15") / "sd15_rand_f16.safetensors")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_sd_checkpoint.py"), "--arch", "sd15",
                    "-o", path], check=True, capture_output=True, timeout=1800)
    return path


def _generate(checkpoint, out, *extra) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "sdrt.cli.main", "-m", checkpoint, *ARGS, *extra, "-o", out],
                       capture_output=True, text=True, env=env, timeout=3600)
    assert r.returncode == 0 and os.path.exists(out), r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_sd15_256_on_vulkan0_matches_the_cpu(checkpoint, tmp_path):
    from sdrt.ops.backend import unavailable_reason
    why = unavailable_reason("vulkan")
    if why is not None:
        pytest.skip(f"no vulkan device: {why}")
    cpu, vk, streamed = (str(tmp_path / f"{n}.png") for n in ("cpu", "vulkan", "streamed"))
    _generate(checkpoint, cpu, "--backend", "cpu")
    log = _generate(checkpoint, vk, "--backend", "vulkan0")
    assert "run on the CPU (no Vulkan kernel)" not in log, log[-3000:]
    p = psnr(_read(vk), _read(cpu))
    print(f"SD1.5 256x256, 2 steps: vulkan0 vs cpu PSNR {p:.2f} dB")
    assert p >= MIN_PSNR
    # 0.75 GiB: the 1.6 GB UNet does not fit; its weights stream in segment by segment
    log = _generate(checkpoint, streamed, "--backend", "vulkan0", "--max-vram", "0.75")
    assert "residency" in log, log[-3000:]
    q = psnr(_read(streamed), _read(vk))
    print(f"--max-vram 0.75 vs resident on vulkan0: PSNR {q:.2f} dB")
    assert q == float("inf") or q >= 80
