"""ESRGAN on cuda0 against the CPU (issue 16): a random x4 RRDBNet with sd.cpp's shapes (64
features, 32 growth channels; 3 blocks to keep it short), whole and in sd.cpp's tiles, and
`-M upscale --backend cuda0` end to end; CUDA within 50 dB of the CPU. GPU test: `pytest --gpu`."""
import os
import sys

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from esrgan_weights import basicsr_state  # noqa: E402

from sdrt.cli import main as cli  # noqa: E402
from sdrt.engine.upscaler import Upscaler  # noqa: E402
from sdrt.io import write_safetensors  # noqa: E402
from sdrt.models.esrgan import RRDBNet  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402


def psnr(a, b, peak):
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(peak * peak / mse)


def _net():
    sd = basicsr_state(11, 64, 32, 3, 4, last_bias=0.5)
    return sd, RRDBNet({k: Tensor.from_numpy(v, name=k) for k, v in sd.items()})


def test_esrgan_cuda_matches_cpu(cuda):
    _, net = _net()
    x = np.random.default_rng(1).random((1, 3, 72, 88), dtype=np.float32)
    for tile in (0, 32):
        cpu = Upscaler(net, tile, "cpu").upscale_tensor(x)
        gpu = Upscaler(net, tile, "cuda0").upscale_tensor(x)
        db = psnr(gpu, cpu, float(cpu.max() - cpu.min()))
        print(f"esrgan tile {tile}: cuda0 vs cpu {db:.2f} dB")
        assert gpu.shape == (1, 3, 288, 352) and db >= 50.0


def test_cli_upscale_cuda_matches_cpu(cuda, tmp_path):
    sd, _ = _net()
    model = str(tmp_path / "x4.safetensors")
    write_safetensors(model, sd)
    src = (np.random.default_rng(2).random((48, 40, 3)) * 255).astype(np.uint8)
    Image.fromarray(src).save(tmp_path / "in.png")
    outs = {}
    for be in ("cpu", "cuda0"):
        outs[be] = str(tmp_path / f"{be}.png")
        assert cli.main(["-M", "upscale", "-i", str(tmp_path / "in.png"), "--upscale-model", model,
                         "--backend", be, "-o", outs[be]]) == 0
    a, b = (np.asarray(Image.open(outs[k]).convert("RGB")) for k in ("cpu", "cuda0"))
    db = psnr(a, b, 255.0)
    print(f"-M upscale: cuda0 vs cpu {db:.2f} dB")
    assert a.shape == (192, 160, 3) and db >= 50.0
