"""Image-level regression: the whole CLI (load, detection, conditioner, UNet, sampler, VAE, PNG)
on a tiny random-weight SDXL checkpoint made here, against a stored golden image.

The checkpoint has the real SDXL tensor names (conditioner.embedders.0.transformer.* HF CLIP-L,
conditioner.embedders.1.model.* OpenCLIP-G, model.diffusion_model.* LDM UNet with label_emb,
first_stage_model.* VAE with 3 downsamplings) at toy widths, stored as F16 like the released
files, so `sdrt -m tiny.safetensors` detects it as `sdxl` and runs every stage for real in a few
seconds. Values come from tools/make_sd_checkpoint.py's deterministic generator.

The golden (tests/fixtures/regression_sdxl_tiny.png) was written by this code; regenerate it
only for an intended image change: `SDRT_UPDATE_GOLDEN=1 python -m pytest tests/test_image_regression.py`.
The threshold (MIN_PSNR) is far above what float-order noise costs (the same run with other
thread counts stays above it) and far below what any real change gives (a wrong sigma, a wrong
scale, one perturbed weight: 15-35 dB, see test_a_changed_image_fails).

sd-cli cannot load the tiny model (its layouts are fixed per version), so the comparison with
sd-cli runs on a full-size random SD1.5 checkpoint, only when SDRT_SDCLI names an sd-cli binary.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from sdrt.cli import main as cli
from sdrt.io import write_safetensors
from sdrt.models.diffusion.unet import UNetConfig
from sdrt.ops.threads import get_threads, set_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "fixtures", "regression_sdxl_tiny.png")
MIN_PSNR = 60.0          # dB, 8-bit RGB, peak 255
SDCLI_MIN_PSNR = 40.0    # docs/cli.md's bar for sdrt vs sd-cli on the full-size random checkpoints
ARGS = ["-p", "a lovely cat, (masterpiece:1.2)", "-n", "blurry", "-W", "64", "-H", "64", "--steps", "3",
        "--cfg-scale", "5.0", "--sampling-method", "euler", "-s", "42", "-t", "1"]

_spec = importlib.util.spec_from_file_location("make_sd_checkpoint", os.path.join(ROOT, "tools", "make_sd_checkpoint.py"))
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

CLIP_L, CLIP_G = 64, 128          # widths (heads = width / 64, as the pipeline derives them)
UNET = dict(model_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_levels=(1,),
            transformer_depth=(0, 1), depth_middle=1, use_linear=True, context_dim=CLIP_L + CLIP_G,
            adm_in_channels=CLIP_G + 6 * 256, num_heads=-1, head_dim=64)
VAE_LEVELS, VAE_RES_BLOCKS = (32, 32, 64, 64), 1


def _resnet(p: str, cin: int, cout: int) -> dict:
    t = {p + "norm1.weight": (cin,), p + "norm1.bias": (cin,), p + "conv1.weight": (cout, cin, 3, 3),
         p + "conv1.bias": (cout,), p + "norm2.weight": (cout,), p + "norm2.bias": (cout,),
         p + "conv2.weight": (cout, cout, 3, 3), p + "conv2.bias": (cout,)}
    if cin != cout:
        t.update({p + "nin_shortcut.weight": (cout, cin, 1, 1), p + "nin_shortcut.bias": (cout,)})
    return t


def _mid(p: str, c: int) -> dict:
    t = {**_resnet(p + "block_1.", c, c), **_resnet(p + "block_2.", c, c),
         p + "attn_1.norm.weight": (c,), p + "attn_1.norm.bias": (c,)}
    for k in ("q", "k", "v", "proj_out"):
        t.update({p + f"attn_1.{k}.weight": (c, c, 1, 1), p + f"attn_1.{k}.bias": (c,)})
    return t


def vae_names(levels=VAE_LEVELS, nrb=VAE_RES_BLOCKS, z=4, prefix="first_stage_model.") -> dict:
    """LDM AutoencoderKL names -> numpy shape (the layout of the released SD VAEs, any widths)."""
    e, d = prefix + "encoder.", prefix + "decoder."
    t = {e + "conv_in.weight": (levels[0], 3, 3, 3), e + "conv_in.bias": (levels[0],)}
    cin = levels[0]
    for i, c in enumerate(levels):
        for b in range(nrb):
            t.update(_resnet(f"{e}down.{i}.block.{b}.", cin, c))
            cin = c
        if i != len(levels) - 1:
            t.update({f"{e}down.{i}.downsample.conv.weight": (c, c, 3, 3), f"{e}down.{i}.downsample.conv.bias": (c,)})
    top = levels[-1]
    t.update(_mid(e + "mid.", top))
    t.update({e + "norm_out.weight": (top,), e + "norm_out.bias": (top,), e + "conv_out.weight": (2 * z, top, 3, 3),
              e + "conv_out.bias": (2 * z,), d + "conv_in.weight": (top, z, 3, 3), d + "conv_in.bias": (top,)})
    t.update(_mid(d + "mid.", top))
    cin = top
    for i in reversed(range(len(levels))):
        c = levels[i]
        for b in range(nrb + 1):
            t.update(_resnet(f"{d}up.{i}.block.{b}.", cin, c))
            cin = c
        if i != 0:
            t.update({f"{d}up.{i}.upsample.conv.weight": (c, c, 3, 3), f"{d}up.{i}.upsample.conv.bias": (c,)})
    t.update({d + "norm_out.weight": (levels[0],), d + "norm_out.bias": (levels[0],),
              d + "conv_out.weight": (3, levels[0], 3, 3), d + "conv_out.bias": (3,),
              prefix + "quant_conv.weight": (2 * z, 2 * z, 1, 1), prefix + "quant_conv.bias": (2 * z,),
              prefix + "post_quant_conv.weight": (z, z, 1, 1), prefix + "post_quant_conv.bias": (z,)})
    return t


def tiny_sdxl_names() -> dict:
    t = mk.clip_hf("conditioner.embedders.0.transformer.", CLIP_L, 2)
    t.update(mk.open_clip("conditioner.embedders.1.model.", CLIP_G, 2))
    unet = UNetConfig.from_hparams(**UNET).weight_shapes()
    t.update({"model.diffusion_model." + k: tuple(v) for k, v in unet.items()})
    t.update(vae_names())
    return t


# A random VAE is nearly blind to the latent's scale (every branch starts with a norm and the
# random UNet's latent is large, so the unnormalized residual path dominates): SDXL's scale factor
# 0.13025 -> 0.18215 cost only 51 dB. A wide post_quant_conv bias (std 50) makes the image depend
# on it (then 35 dB), as a trained VAE's does.
WIDE_BIAS = {"first_stage_model.post_quant_conv.bias": 50.0}


def write_tiny_sdxl(path: str, seed: int = 0) -> str:
    arrays = {}
    for name, shape in tiny_sdxl_names().items():
        v = mk.values(name, shape, seed)
        if name in WIDE_BIAS:
            v = v * np.float32(WIDE_BIAS[name] / 0.02)
        arrays[name] = v if v.dtype != np.float32 else v.astype(np.float16)
    write_safetensors(path, arrays)
    return path


def read_rgb(path: str) -> np.ndarray:
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_sdxl(str(tmp_path_factory.mktemp("regression") / "sdxl_tiny.safetensors"))


def _generate(model: str, out: str, extra=()) -> float:
    before = get_threads()
    t0 = time.perf_counter()
    try:
        assert cli.main(["-m", model, *ARGS, *extra, "-o", out]) == 0
    finally:
        set_threads(before)
    return time.perf_counter() - t0


def test_tiny_checkpoint_is_detected_as_sdxl(tiny_model):
    from sdrt.io import open_model
    from sdrt.io.detect import detect_version
    assert detect_version(open_model(tiny_model)) == "sdxl"


def test_cli_image_matches_golden(tiny_model, tmp_path, capsys):
    out = str(tmp_path / "out.png")
    secs = _generate(tiny_model, out)
    img = read_rgb(out)
    assert img.shape == (64, 64, 3)
    if os.environ.get("SDRT_UPDATE_GOLDEN"):
        shutil.copyfile(out, GOLDEN)
        pytest.fail(f"golden rewritten at {GOLDEN} ({secs:.1f} s); commit it and run again without SDRT_UPDATE_GOLDEN")
    assert img.std() > 5, "a flat image: the golden check would be too weak"
    gold = read_rgb(GOLDEN)
    p = psnr(img, gold)
    print(f"tiny SDXL CLI image vs golden: PSNR {p:.2f} dB (generation {secs:.1f} s)")
    assert p >= MIN_PSNR, f"the CLI image changed: PSNR {p:.2f} dB against {GOLDEN} (need >= {MIN_PSNR})"


@pytest.mark.parametrize("change", ["seed", "steps", "one_weight"])
def test_a_changed_image_fails(tiny_model, tmp_path, change):
    """The threshold catches real changes: a different seed, one sampling step more (another
    sigma schedule), and one UNet weight tensor scaled by 1.1 each fall far below MIN_PSNR."""
    model, extra = tiny_model, []
    if change == "seed":
        extra = ["-s", "43"]
    elif change == "steps":
        extra = ["--steps", "4"]
    else:
        from sdrt.io import open_model
        src = open_model(tiny_model)
        arrays = {n: np.array(src[n].numpy()) for n in src.tensors}
        name = "model.diffusion_model.out.2.weight"
        arrays[name] = (arrays[name].astype(np.float32) * 1.1).astype(arrays[name].dtype)
        model = str(tmp_path / "perturbed.safetensors")
        write_safetensors(model, arrays)
    out = str(tmp_path / "changed.png")
    _generate(model, out, extra)
    p = psnr(read_rgb(out), read_rgb(GOLDEN))
    print(f"{change}: PSNR {p:.2f} dB")
    assert p < MIN_PSNR - 10, f"{change}: PSNR {p:.2f} dB, the golden check would not notice this change"


def _sdcli() -> str | None:
    exe = os.environ.get("SDRT_SDCLI") or os.environ.get("SDRT_SD_CLI")
    return exe if exe and os.access(exe, os.X_OK) else None


def test_matches_sd_cli_on_full_size_sd15(tmp_path):
    """sdrt and sd-cli on the same full-size random SD1.5 checkpoint (tools/make_sd_checkpoint.py,
    kept at $SDRT_SDCLI_MODEL when set), same flags, --type f32 on both sides: PSNR >= 40 dB."""
    exe = _sdcli()
    if exe is None:
        pytest.skip("sd-cli comparison: set SDRT_SDCLI=/path/to/sd-cli to run it (no sd-cli binary given)")
    model = os.environ.get("SDRT_SDCLI_MODEL") or str(tmp_path / "sd15_rand_f16.safetensors")
    if not os.path.exists(model):
        mk.main(["--arch", "sd15", "-o", model])
    args = ["-m", model, "-p", "a lovely cat", "-W", "128", "-H", "128", "--steps", "2", "--cfg-scale", "7.0",
            "--sampling-method", "euler", "-s", "42", "--type", "f32", "-t", "2"]
    ref, ours = str(tmp_path / "sdcli.png"), str(tmp_path / "sdrt.png")
    r = subprocess.run([exe, *args, "-o", ref], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and os.path.exists(ref), r.stdout[-2000:] + r.stderr[-2000:]
    before = get_threads()
    try:
        assert cli.main([*args, "-o", ours]) == 0
    finally:
        set_threads(before)
    p = psnr(read_rgb(ours), read_rgb(ref))
    print(f"sdrt vs sd-cli ({os.path.basename(model)}, 128x128, 2 steps): PSNR {p:.2f} dB")
    assert p >= SDCLI_MIN_PSNR, f"sdrt vs sd-cli: PSNR {p:.2f} dB (need >= {SDCLI_MIN_PSNR})"
