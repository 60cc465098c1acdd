"""sdrt vs sd-cli on Flux.1 dev / schnell and Chroma random-weight checkpoints that sd-cli can load:
the DiT at full width with reduced depth (sd-cli counts double/single blocks from the names), the
full ae VAE and CLIP-L (fixed architectures in sd-cli), and a T5-XXL at full width with
$SDRT_SDCLI_T5_LAYERS blocks (default 1: needs an sd-cli that counts `encoder.block.N`, as upstream
stable-diffusion.cpp does; the 0.4.7 sdist's T5 is fixed at 24 layers, ~19 GB in f32: set 24 for it).

Opt-in: runs only when SDRT_SDCLI names an sd-cli binary. Both sides get the same split files and
flags, `--type f32`, 256x256, 4 steps, `--cfg-scale 1`; the bar is issue 14's: PSNR >= 40 dB.
The files are written once per session under $SDRT_SDCLI_FLUX_DIR (default: a temp dir).
"""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import flux_tiny as ft
from sdrt.cli import main as cli
from sdrt.io import write_safetensors
from sdrt.models.diffusion.flux import FluxConfig
from sdrt.ops.threads import get_threads, set_threads
from test_image_regression import psnr, read_rgb

MIN_PSNR = 40.0
# --scheduler discrete on both sides: the sd-cli built here (/work/sdcli, 2026-12) predates sd.cpp's
# `flux` scheduler and samples Flux on `discrete` (t_to_sigma with the flux time shift); sdrt's
# default is the `flux` scheduler, as upstream sd.cpp now picks (docs/flux.md)
ARGS = ["-p", "a lovely cat, (masterpiece:1.2)", "-W", "256", "-H", "256", "--steps", "4", "--cfg-scale", "1",
        "--scheduler", "discrete", "-s", "42", "--type", "f32", "-t", "2"]


def _sdcli() -> str | None:
    exe = os.environ.get("SDRT_SDCLI") or os.environ.get("SDRT_SD_CLI")
    return exe if exe and os.access(exe, os.X_OK) else None


def run_sdrt(args: list) -> None:
    """sdrt's CLI in this process on `args`, which must succeed; the thread count its `-t` sets is
    put back after."""
    before = get_threads()
    try:
        assert cli.main(args) == 0
    finally:
        set_threads(before)


def _write(path: str, names: dict, seed: int = 0, key=lambda n: n) -> str:
    if not os.path.exists(path):
        arrays = {}
        for n, shape in names.items():
            v = ft.mkflux.values(key(n), shape, seed)
            arrays[n] = v.astype(np.float16) if v.ndim > 1 else v
        write_safetensors(path, arrays)
    return path


def t5_full(layers: int) -> dict:
    t = {"shared.weight": (ft.T5_VOCAB, 4096), "encoder.final_layer_norm.weight": (4096,),
         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (32, 64)}
    for i in range(layers):
        p = f"encoder.block.{i}.layer."
        for q in "qkvo":
            t[f"{p}0.SelfAttention.{q}.weight"] = (4096, 4096)
        t[f"{p}0.layer_norm.weight"] = (4096,)
        for w in ("wi_0", "wi_1"):
            t[f"{p}1.DenseReluDense.{w}.weight"] = (10240, 4096)
        t[f"{p}1.DenseReluDense.wo.weight"] = (4096, 10240)
        t[f"{p}1.layer_norm.weight"] = (4096,)
    return t


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    if _sdcli() is None:
        pytest.skip("sd-cli comparison: set SDRT_SDCLI=/path/to/sd-cli to run it (no sd-cli binary given)")
    d = os.environ.get("SDRT_SDCLI_FLUX_DIR") or str(tmp_path_factory.mktemp("flux_sdcli"))
    os.makedirs(d, exist_ok=True)
    layers = int(os.environ.get("SDRT_SDCLI_T5_LAYERS", "1"))
    out = {"vae": _write(os.path.join(d, "ae.safetensors"), ft.mkflux.vae_layout()),
           "clip_l": _write(os.path.join(d, "clip_l.safetensors"), ft.mksd.clip_hf("", 768, 12)),
           "t5xxl": _write(os.path.join(d, f"t5xxl_{layers}l.safetensors"), t5_full(layers))}
    for variant in ("dev", "schnell", "chroma"):
        names = FluxConfig(depth=1, depth_single_blocks=2, **ft.VARIANTS[variant]).weight_shapes()
        out[variant] = _write(os.path.join(d, f"flux-{variant}-1-2.safetensors"), names)
    return out


@pytest.mark.parametrize("variant", ["dev", "schnell", "chroma"])
def test_matches_sd_cli(parts, tmp_path, variant):
    files = ["--diffusion-model", parts[variant], "--vae", parts["vae"], "--t5xxl", parts["t5xxl"]]
    if variant != "chroma":
        files += ["--clip_l", parts["clip_l"]]
    ref, ours = str(tmp_path / "sdcli.png"), str(tmp_path / "sdrt.png")
    r = subprocess.run([_sdcli(), *files, *ARGS, "-o", ref], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0 and os.path.exists(ref), r.stdout[-3000:] + r.stderr[-3000:]
    run_sdrt([*files, *ARGS, "-o", ours])
    p = psnr(read_rgb(ours), read_rgb(ref))
    print(f"sdrt vs sd-cli, Flux {variant} (1+2 blocks, 256x256, 4 steps, f32): PSNR {p:.2f} dB")
    assert p >= MIN_PSNR, f"sdrt vs sd-cli ({variant}): PSNR {p:.2f} dB (need >= {MIN_PSNR})"


def test_convert_round_trip_with_sd_cli(parts, tmp_path):
    """`-M convert` on a Flux DiT (issue 14: sdrt writes Flux GGUFs sd-cli reads, and reads sd-cli's):
    sd-cli's and sdrt's Q8_0 conversions of the same file hold the same tensors (names, ne, types,
    bytes: sd.cpp's rules keep img_in/txt_in/time_in/vector_in/guidance_in/final_layer and 1-D
    tensors as they are); sd-cli generates from sdrt's file and sdrt from sd-cli's, same image."""
    from sdrt.io import read_gguf
    src = parts["dev"]
    ref, ours = str(tmp_path / "sdcli_q8.gguf"), str(tmp_path / "sdrt_q8.gguf")
    r = subprocess.run([_sdcli(), "-M", "convert", "-m", src, "-o", ref, "--type", "q8_0"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert cli.main(["-M", "convert", "-m", src, "-o", ours, "--type", "q8_0"]) == 0
    a, b = read_gguf(ref), read_gguf(ours)
    assert sorted(a.tensors) == sorted(b.tensors)
    kinds = {}
    for name in a.tensors:
        assert (a[name].ne, a[name].dtype) == (b[name].ne, b[name].dtype), name
        assert np.array_equal(np.ascontiguousarray(a[name].numpy()).reshape(-1).view(np.uint8),
                              np.ascontiguousarray(b[name].numpy()).reshape(-1).view(np.uint8)), name
        kinds[a[name].dtype.name] = kinds.get(a[name].dtype.name, 0) + 1
    assert kinds.get("Q8_0", 0) > 0, kinds
    files = ["--vae", parts["vae"], "--t5xxl", parts["t5xxl"], "--clip_l", parts["clip_l"]]
    img_ref, img_ours = str(tmp_path / "sdcli.png"), str(tmp_path / "sdrt.png")
    r = subprocess.run([_sdcli(), "--diffusion-model", ours, *files, *ARGS, "-o", img_ref], capture_output=True,
                       text=True, timeout=3600)
    assert r.returncode == 0 and os.path.exists(img_ref), r.stdout[-3000:] + r.stderr[-3000:]
    run_sdrt(["--diffusion-model", ref, *files, *ARGS, "-o", img_ours])
    p = psnr(read_rgb(img_ours), read_rgb(img_ref))
    print(f"Flux dev Q8_0 (1+2 blocks) tensors {kinds}: sd-cli on sdrt's GGUF vs sdrt on sd-cli's: PSNR {p:.2f} dB")
    assert p >= MIN_PSNR


@pytest.mark.parametrize("mode", ["immediately", "at_runtime"])
def test_lora_matches_sd_cli(parts, tmp_path, mode):
    """Flux LoRAs (issue 16 on Flux): a diffusers/PEFT file on the split q/k/v of double block 0's
    image attention and a kohya file on BFL names (img_mlp.0, single block 0's linear2), on the
    dev DiT; both engines log how many tensors they applied, and the images agree."""
    rng = np.random.default_rng(5)
    H, M, r = 3072, 12288, 4

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.15).astype(np.float32)
    d = tmp_path / "loras"
    os.makedirs(d)
    peft = {}
    for q in ("to_q", "to_k", "to_v"):
        peft[f"transformer.transformer_blocks.0.attn.{q}.lora_A.weight"] = rand(r, H)
        peft[f"transformer.transformer_blocks.0.attn.{q}.lora_B.weight"] = rand(H, r)
    kohya = {}
    for name, n_in, n_out in (("double_blocks_0_img_mlp_0", H, M), ("single_blocks_0_linear2", H + M, H)):
        kohya[f"lora_unet_{name}.lora_down.weight"] = rand(r, n_in)
        kohya[f"lora_unet_{name}.lora_up.weight"] = rand(n_out, r)
        kohya[f"lora_unet_{name}.alpha"] = np.array(2.0, np.float32)
    write_safetensors(str(d / "flux_peft.safetensors"), peft)
    write_safetensors(str(d / "flux_kohya.safetensors"), kohya)
    files = ["--diffusion-model", parts["dev"], "--vae", parts["vae"], "--t5xxl", parts["t5xxl"],
             "--clip_l", parts["clip_l"], "--lora-model-dir", str(d), "--lora-apply-mode", mode]
    args = [a if a != "a lovely cat, (masterpiece:1.2)" else a + " <lora:flux_peft:0.8><lora:flux_kohya:0.6>"
            for a in ARGS]
    ref, ours = str(tmp_path / "sdcli.png"), str(tmp_path / "sdrt.png")
    r_ = subprocess.run([_sdcli(), *files, *args, "-o", ref], capture_output=True, text=True, timeout=3600)
    assert r_.returncode == 0 and os.path.exists(ref), r_.stdout[-3000:] + r_.stderr[-3000:]
    applied = [ln for ln in (r_.stdout + r_.stderr).splitlines() if "LoRA tensors" in ln]
    run_sdrt([*files, *args, "-o", ours])
    p = psnr(read_rgb(ours), read_rgb(ref))
    moved = ""
    if mode == "immediately":               # the LoRAs change the image (sdrt without them)
        plain = str(tmp_path / "plain.png")
        run_sdrt([*files, *ARGS, "-o", plain])
        m = psnr(read_rgb(ours), read_rgb(plain))
        moved = f"; LoRA image vs no-LoRA {m:.2f} dB"
        assert m < 30, m
    print(f"\nsdrt vs sd-cli, Flux dev LoRAs {mode}: PSNR {p:.2f} dB{moved}; sd-cli applied: "
          + " | ".join(a.split("LoRA tensors")[0].split("]")[-1].strip() for a in applied))
    assert any("(6 / 6)" in a for a in applied if "peft" in a) and any("(6 / 6)" in a for a in applied if "kohya" in a), applied
    assert p >= MIN_PSNR, f"sdrt vs sd-cli (Flux LoRAs, {mode}): PSNR {p:.2f} dB (need >= {MIN_PSNR})"
