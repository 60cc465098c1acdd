"""The whole Flux / Chroma pipeline on cuda0 against the CPU: tiny random checkpoints with the
real tensor names (tests/flux_tiny.py), the CLI end to end, PSNR of the two PNGs (issue 14: the
CUDA image within 50 dB of the CPU image). GPU test: runs with `pytest --gpu`."""
import os

import numpy as np
import pytest
from PIL import Image

import flux_tiny as ft
from sdrt.cli import main as cli

ARGS = ["-p", "a red (fox:1.3) in snow", "-W", "128", "-H", "128", "--steps", "3", "-s", "7"]


def psnr(a, b):
    a, b = (np.asarray(Image.open(p), np.float64) for p in (a, b))
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.mark.parametrize("variant,cfg", [("dev", "1"), ("schnell", "1"), ("chroma", "1"), ("dev", "3.5")])
def test_flux_cli_cuda_matches_cpu(cuda, tmp_path, variant, cfg):
    args = ft.write(str(tmp_path / variant), variant)
    outs = {}
    for be in ("cpu", "cuda0"):
        outs[be] = str(tmp_path / f"{be}.png")
        assert cli.main([*args, *ARGS, "--cfg-scale", cfg, "--backend", be, "-o", outs[be]]) == 0
    db = psnr(outs["cpu"], outs["cuda0"])
    print(f"flux {variant} cfg {cfg}: cuda0 vs cpu {db:.2f} dB")
    assert db >= 50.0
