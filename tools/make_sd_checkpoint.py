"""Write a full-size random-weight SD1.5 or SDXL checkpoint (.safetensors) with the REAL tensor
names and shapes, so sd-cli and sdrt load it as they load v1-5-pruned-emaonly / sd_xl_base_1.0.

    python tools/make_sd_checkpoint.py --arch sd15 -o /work/e2e/sd15_rand_f16.safetensors
    python tools/make_sd_checkpoint.py --arch sdxl --dtype f32 -o /work/e2e/sdxl_rand_f32.safetensors
    python tools/make_sd_checkpoint.py --arch sd15 --component vae -o /work/e2e/sd15_vae.safetensors
    python tools/make_sd_checkpoint.py --arch sd15 --inpaint -o /work/e2e/sd15_inpaint_rand_f16.safetensors

The output is noise: the weights are random. It exists to try the CLI and to compare sdrt with
sd-cli end to end on the real architectures (bench/e2e_vs_sdcli.py).

Names and shapes:
* UNet and VAE: the LDM (original checkpoint) names of tests/fixtures/ckpt_names_diffusers_ldm.json.gz
  (diffusers 0.42.1 meta-device state dicts converted by sdrt.models.names and checked against diffusers'
  own LDM converters: 686 SD1.5 UNet tensors / 859,520,964 parameters, 1680 SDXL UNet tensors /
  2,567,463,684, 248 VAE tensors / 83,653,863 — the counts of the released files).
* CLIP ViT-L/14 text model in HF layout (cond_stage_model.transformer.text_model.* for SD1.5,
  conditioner.embedders.0.transformer.text_model.* for SDXL), with its int64 position_ids as in the
  released files; SDXL's OpenCLIP ViT-bigG/14 in open_clip layout (conditioner.embedders.1.model.*:
  resblocks with fused in_proj, text_projection, logit_scale).
* `--component` writes one part as a standalone file, named as such files are distributed:
  unet (bare LDM UNet names, for --diffusion-model), vae (encoder./decoder.), clip_l (HF
  text_model.*), clip_g (HF CLIPTextModelWithProjection names, for --clip_g). unet, vae and
  clip_l hold the same values as the full checkpoint of the same --arch/--seed/--inpaint.

Values (deterministic: each tensor from numpy PCG64 seeded with (seed, crc32(name))): weights of
rank >= 2 are N(0, 1/fan_in) (variance-preserving, so activations stay O(1) through every block and
the fp16 range is never approached); norm weights N(1, 0.05^2); biases N(0, 0.02^2); token
embeddings N(0, 0.02^2), position embeddings N(0, 0.01^2) (CLIP's own init); logit_scale ln(100).
Tensors are generated and written one at a time (sdrt.io.write_safetensors streams, atomically).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sdrt.io.writer import TensorPlan, write_safetensors
from sdrt.ops import dtypes

NAMES = os.path.join(ROOT, "tests", "fixtures", "ckpt_names_diffusers_ldm.json.gz")
CLIP_VOCAB, CLIP_CTX = 49408, 77


def clip_hf(prefix, width, layers, heads_unused=None, projection=False):
    """HF CLIPTextModel names -> numpy shape."""
    t = {f"{prefix}text_model.embeddings.token_embedding.weight": (CLIP_VOCAB, width),
         f"{prefix}text_model.embeddings.position_embedding.weight": (CLIP_CTX, width)}
    for i in range(layers):
        p = f"{prefix}text_model.encoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            t[p + f"self_attn.{proj}.weight"] = (width, width)
            t[p + f"self_attn.{proj}.bias"] = (width,)
        for ln in ("layer_norm1", "layer_norm2"):
            t[p + f"{ln}.weight"] = (width,)
            t[p + f"{ln}.bias"] = (width,)
        t[p + "mlp.fc1.weight"] = (4 * width, width)
        t[p + "mlp.fc1.bias"] = (4 * width,)
        t[p + "mlp.fc2.weight"] = (width, 4 * width)
        t[p + "mlp.fc2.bias"] = (width,)
    t[f"{prefix}text_model.final_layer_norm.weight"] = (width,)
    t[f"{prefix}text_model.final_layer_norm.bias"] = (width,)
    if projection:
        t[f"{prefix}text_projection.weight"] = (width, width)
    return t


def open_clip(prefix, width=1280, layers=32):
    """open_clip text tower names (SDXL conditioner.embedders.1.model.*) -> numpy shape."""
    t = {prefix + "positional_embedding": (CLIP_CTX, width), prefix + "token_embedding.weight": (CLIP_VOCAB, width)}
    for i in range(layers):
        p = f"{prefix}transformer.resblocks.{i}."
        t[p + "ln_1.weight"] = (width,)
        t[p + "ln_1.bias"] = (width,)
        t[p + "attn.in_proj_weight"] = (3 * width, width)
        t[p + "attn.in_proj_bias"] = (3 * width,)
        t[p + "attn.out_proj.weight"] = (width, width)
        t[p + "attn.out_proj.bias"] = (width,)
        t[p + "ln_2.weight"] = (width,)
        t[p + "ln_2.bias"] = (width,)
        t[p + "mlp.c_fc.weight"] = (4 * width, width)
        t[p + "mlp.c_fc.bias"] = (4 * width,)
        t[p + "mlp.c_proj.weight"] = (width, 4 * width)
        t[p + "mlp.c_proj.bias"] = (width,)
    t[prefix + "ln_final.weight"] = (width,)
    t[prefix + "ln_final.bias"] = (width,)
    t[prefix + "text_projection"] = (width, width)
    t[prefix + "logit_scale"] = ()
    return t


def _fixture():
    with gzip.open(NAMES, "rt") as f:
        return json.load(f)


def layout(arch: str, component: str = "all", inpaint: bool = False) -> dict[str, tuple]:
    """{name: numpy shape} of the checkpoint (or one standalone component); `inpaint`: the
    9-channel UNet input of the inpainting checkpoints (latent + mask + masked-image latent)."""
    fx = _fixture()
    unet = {ldm: tuple(shape) for _, _, ldm, shape in fx["sd15_unet" if arch == "sd15" else "sdxl_unet"]}
    if inpaint:
        co, _, kh, kw = unet["input_blocks.0.0.weight"]
        unet["input_blocks.0.0.weight"] = (co, 9, kh, kw)
    vae = {ldm: tuple(shape) for _, _, ldm, shape in fx["sd_vae"]}
    if component == "unet":
        return unet
    if component == "vae":
        return vae
    if component == "clip_l":
        return clip_hf("", 768, 12)
    if component == "clip_g":
        if arch != "sdxl":
            raise SystemExit("--component clip_g needs --arch sdxl")
        return {n: tuple(s) for n, s in fx["hf_clip_g"]}
    out = {"model.diffusion_model." + k: v for k, v in unet.items()}
    out.update({"first_stage_model." + k: v for k, v in vae.items()})
    if arch == "sd15":
        out.update(clip_hf("cond_stage_model.transformer.", 768, 12))
        out["cond_stage_model.transformer.text_model.embeddings.position_ids"] = (1, CLIP_CTX)
    else:
        out.update(clip_hf("conditioner.embedders.0.transformer.", 768, 12))
        out["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = (1, CLIP_CTX)
        out.update(open_clip("conditioner.embedders.1.model."))
    return dict(sorted(out.items()))


_NORM_MARKERS = ("norm", "ln_", "layer_norm", "in_layers.0.", "out_layers.0.", "out.0.", "ln_final")


def values(name: str, shape: tuple, seed: int) -> np.ndarray:
    """Deterministic float32 values for one tensor (see the module docstring)."""
    g = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("position_ids"):
        return np.arange(CLIP_CTX, dtype=np.int64).reshape(shape)
    if name.endswith("logit_scale"):
        return np.array(math.log(100.0), np.float32).reshape(shape)
    if "token_embedding" in name:
        return g.standard_normal(shape, np.float32) * np.float32(0.02)
    if "position_embedding" in name or name.endswith("positional_embedding"):
        return g.standard_normal(shape, np.float32) * np.float32(0.01)
    if len(shape) <= 1:
        base = name.rsplit(".", 1)[-1]
        is_norm_weight = base == "weight" and any(m in name for m in _NORM_MARKERS)
        x = g.standard_normal(shape, np.float32) * np.float32(0.05 if is_norm_weight else 0.02)
        return x + np.float32(1.0) if is_norm_weight else x
    fan_in = int(np.prod(shape[1:]))
    return g.standard_normal(shape, np.float32) * np.float32(1.0 / math.sqrt(fan_in))


# a standalone component takes the values its tensors have in the full checkpoint (same seed),
# so `--diffusion-model unet --vae vae --clip_l clip` equals `-m full` (clip_g: own values)
_FULL_PREFIX = {"unet": "model.diffusion_model.", "vae": "first_stage_model.",
                "clip_l": {"sd15": "cond_stage_model.transformer.", "sdxl": "conditioner.embedders.0.transformer."}}


def plans(table: dict, dtype: str, seed: int, key_prefix: str = ""):
    dt = dtypes.get("F16" if dtype == "f16" else "F32")
    out = []
    for name, shape in table.items():
        key = key_prefix + name
        if name.endswith("position_ids"):
            ne = tuple(reversed(shape))
            out.append(TensorPlan(name, dtypes.get("I64"), ne, lambda n=key, s=shape: values(n, s, seed)))
            continue
        ne = tuple(reversed(shape)) if shape else (1,)
        np_dt = np.float16 if dt.name == "F16" else np.float32
        out.append(TensorPlan(name, dt, ne, lambda n=key, s=shape, d=np_dt: values(n, s, seed).astype(d).reshape(-1)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=("sd15", "sdxl"), default="sd15")
    ap.add_argument("--dtype", choices=("f16", "f32"), default="f16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--component", choices=("all", "unet", "vae", "clip_l", "clip_g"), default="all")
    ap.add_argument("--inpaint", action="store_true", help="9-channel UNet input (sd-v1-5-inpainting layout)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    table = layout(a.arch, a.component, a.inpaint)
    n = sum(int(np.prod(s)) if s else 1 for s in table.values())
    t0 = time.time()
    last = [0.0]

    def progress(i, total, name):
        if time.time() - last[0] > 5 or i == total:
            last[0] = time.time()
            print(f"  {i}/{total} tensors {name}", file=sys.stderr)

    kp = _FULL_PREFIX.get(a.component, "")
    kp = kp.get(a.arch, "") if isinstance(kp, dict) else kp
    size = write_safetensors(a.output, plans(table, a.dtype, a.seed, kp),
                             metadata={"sdrt.random_weights": f"{a.arch} seed={a.seed} (noise, not a trained model)"},
                             progress=progress)
    print(f"wrote {a.output}: {len(table)} tensors, {n:,} parameters, {size / 2**30:.2f} GiB, "
          f"{time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
