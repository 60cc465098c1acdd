"""The whole Qwen-Image pipeline on cuda0 against the CPU: tiny random files with the real tensor
names (tools/make_qwen_image_checkpoint.py --tiny), the CLI end to end (LLM, DiT with true CFG, Wan
VAE; the -r case adds a VAE encode and reference tokens), PSNR of the two PNGs >= 50 dB (issue 20).
GPU test: runs with `pytest --gpu`."""
import importlib.util
import os

import numpy as np
import pytest
from PIL import Image

from sdrt.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["-p", "a red (fox:1.3) in snow", "-W", "128", "-H", "96", "--steps", "3", "-s", "7", "--cfg-scale", "2.5"]


def psnr(a, b):
    a, b = (np.asarray(Image.open(p), np.float64) for p in (a, b))
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def _files(d):
    spec = importlib.util.spec_from_file_location("mkqi", os.path.join(ROOT, "tools", "make_qwen_image_checkpoint.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    os.makedirs(d, exist_ok=True)
    paths = {n: mk.write(c, os.path.join(d, n + ".safetensors"), tiny=True)
             for c, n in (("transformer", "dit"), ("llm", "llm"), ("vae", "vae"))}
    return ["--diffusion-model", paths["dit"], "--llm", paths["llm"], "--vae", paths["vae"]]


@pytest.mark.parametrize("edit", [False, True])
def test_qwen_image_cli_cuda_matches_cpu(cuda, tmp_path, edit):
    args = _files(str(tmp_path / "files"))
    if edit:
        ref = tmp_path / "ref.png"
        Image.fromarray((np.random.RandomState(0).rand(80, 112, 3) * 255).astype(np.uint8)).save(ref)
        args += ["-r", str(ref)]
    outs = {}
    for be in ("cpu", "cuda0"):
        outs[be] = str(tmp_path / f"{be}.png")
        assert cli.main([*args, *ARGS, "--backend", be, "-o", outs[be]]) == 0
    db = psnr(outs["cpu"], outs["cuda0"])
    print(f"qwen-image{' edit' if edit else ''}: cuda0 vs cpu {db:.2f} dB")
    assert db >= 50.0
