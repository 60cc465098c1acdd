"""Write a full-size random-weight ControlNet (.safetensors) for SD1.5 or SDXL with sd.cpp's tensor
names and shapes (control.hpp's ControlNetBlock), so sd-cli's `--control-net` and sdrt's load it.

    python tools/make_controlnet_checkpoint.py --arch sd15 -o cn_sd15_rand_f16.safetensors
    python tools/make_controlnet_checkpoint.py --arch sdxl -o cn_sdxl_rand_f16.safetensors [--pth-prefix]

The layout is the UNet's encoder (sdrt's UNet presets "sd1" / "sdxl": time_embed, label_emb for
SDXL, input_blocks, middle_block) plus zero_convs.N.0 (1x1, one per input block), middle_block_out.0
and input_hint_block.{0,...,14} (3 -> 16 -> 16 -> 32 -> 32 -> 96 -> 96 -> 256 -> model_channels).
sd.cpp builds every ControlNet with 1x1-conv proj_in/proj_out (use_linear_projection = false),
so the SDXL one stores them 4-D. `--pth-prefix` writes the names under `control_model.` as the
original .pth files have them. Values as tools/make_sd_checkpoint.py (PCG64 seeded with (seed,
crc32(name)); weights N(0, 1/fan_in), the zero convs too, so every control matters; the hint
convs N(0, HINT_GAIN^2/fan_in), so that the hint reaches conv_in's scale: std 1.3 on a
drawn image, where plain N(0, 1/fan_in) convs leave 0.02 and the control image would barely
change the picture).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import make_sd_checkpoint as mk  # noqa: E402

from sdrt.io.writer import TensorPlan, write_safetensors  # noqa: E402
from sdrt.models.diffusion.unet import UNetConfig  # noqa: E402

HINT = (3, 16, 16, 32, 32, 96, 96, 256)
HINT_GAIN = 2.0     # N(0, 1/fan_in) convs with SiLUs between shrink the hint ~40x over 8 layers
                    # (std 0.02 against conv_in's ~1: the control image would hardly matter)


def layout(arch: str) -> dict[str, tuple]:
    """{sd.cpp name: torch shape} of the ControlNet for the UNet preset of `arch`."""
    return layout_for(UNetConfig.preset({"sd15": "sd1", "sdxl": "sdxl"}[arch]))


def layout_for(cfg: UNetConfig) -> dict[str, tuple]:
    """{sd.cpp name: torch shape} of a ControlNet over the encoder of the UNet layout `cfg`."""
    out = {}
    for name, shape in cfg.weight_shapes().items():
        if not name.startswith(("time_embed.", "label_emb.", "input_blocks.", "middle_block.")):
            continue
        if (".proj_in.weight" in name or ".proj_out.weight" in name) and len(shape) == 2:
            shape = shape + (1, 1)                      # sd.cpp's ControlNet: 1x1 convs
        out[name] = shape
    chans = [cfg.model_channels] + [b[-1][1].ch for _, b in cfg.input_blocks]
    for n, ch in zip([0] + [n for n, _ in cfg.input_blocks], chans):
        out[f"zero_convs.{n}.0.weight"], out[f"zero_convs.{n}.0.bias"] = (ch, ch, 1, 1), (ch,)
    mid = cfg.middle_block[-1][1].ch
    out["middle_block_out.0.weight"], out["middle_block_out.0.bias"] = (mid, mid, 1, 1), (mid,)
    widths = HINT + (cfg.model_channels,)
    for i in range(8):
        out[f"input_hint_block.{2 * i}.weight"] = (widths[i + 1], widths[i], 3, 3)
        out[f"input_hint_block.{2 * i}.bias"] = (widths[i + 1],)
    return out


def plans(table: dict, dtype: str, seed: int) -> list:
    """mk.plans, with the hint convs' weights times HINT_GAIN (see the module docstring)."""
    np_dt = np.float16 if dtype == "f16" else np.float32
    out = []
    for p in mk.plans(table, dtype, seed):
        if "input_hint_block." in p.name and p.name.endswith(".weight"):
            shape = table[p.name]
            p = TensorPlan(p.name, p.dtype, p.ne, lambda n=p.name, s=shape: (
                mk.values(n, s, seed) * np.float32(HINT_GAIN)).astype(np_dt).reshape(-1))
        out.append(p)
    return out


def write(path: str, table: dict, seed: int = 7, dtype: str = "f16") -> int:
    return write_safetensors(path, plans(table, dtype, seed),
                             metadata={"sdrt.random_weights": f"controlnet seed={seed} hint_gain={HINT_GAIN} (noise)"})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=("sd15", "sdxl"), default="sd15")
    ap.add_argument("--dtype", choices=("f16", "f32"), default="f16")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--pth-prefix", action="store_true", help="names under control_model. (the .pth form)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    table = layout(a.arch)
    if a.pth_prefix:
        table = {"control_model." + k: v for k, v in table.items()}
    n = sum(int(np.prod(s)) for s in table.values())
    t0 = time.time()
    size = write(a.output, table, a.seed, a.dtype)
    print(f"wrote {a.output}: {len(table)} tensors, {n:,} parameters, {size / 2**30:.2f} GiB, "
          f"{time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
