"""The whole Z-Image pipeline on cuda0 against the CPU: tiny random split files with the real
tensor names (tests/zimage_tiny.py: DiT, Qwen3 LLM, Flux-layout AE), the CLI end to end, PSNR of
the two PNGs (issue 20: the CUDA image within 50 dB of the CPU image). GPU test: `pytest --gpu`."""
import numpy as np
import pytest
from PIL import Image

import zimage_tiny as zt
from sdrt.cli import main as cli

ARGS = ["-p", "a red (fox:1.3) in snow", "-W", "128", "-H", "96", "--steps", "3", "-s", "7"]


def psnr(a, b):
    a, b = (np.asarray(Image.open(p), np.float64) for p in (a, b))
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.mark.parametrize("cfg", ["1", "4"])
def test_zimage_cli_cuda_matches_cpu(cuda, tmp_path, cfg):
    files = zt.args(zt.write(str(tmp_path / "files")))
    outs = {}
    for be in ("cpu", "cuda0"):
        outs[be] = str(tmp_path / f"{be}.png")
        assert cli.main([*files, *ARGS, "--cfg-scale", cfg, "-n", "blurry", "--backend", be, "-o", outs[be]]) == 0
    db = psnr(outs["cpu"], outs["cuda0"])
    print(f"z-image cfg {cfg}: cuda0 vs cpu {db:.2f} dB")
    assert db >= 50.0
