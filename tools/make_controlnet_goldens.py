"""Write tests/fixtures/controlnet_*.npz: diffusers ControlNetModel (+ UNet2DConditionModel with
its residuals) goldens for sdrt's ControlNet and the UNet's control inputs.

    python tools/make_controlnet_goldens.py     # needs torch + diffusers (CPU is enough)

Each case is a tiny random config of a real architecture (SD1: 8 heads, 1x1-conv projections;
SDXL: label_emb, linear projections, 2 transformer blocks), built with diffusers; the weights are
renamed to sd.cpp's / the original ControlNet's names (`control_model.input_hint_block.0.weight`,
`control_model.zero_convs.3.0.weight` ...; the UNet's to `model.diffusion_model.*`) and stored as
float16, diffusers running on the same f16-rounded values in float32. Keys:

- `cn:<name>` / `unet:<name>`  the weights (float16, torch shapes)
- `x` [N, C, h, w], `t` [N], `context` [N, L, Cctx], `hint` [1, 3, 8h, 8w] in [0, 1], `y` (SDXL)
- `controls_<numerics>_<i>`  diffusers' ControlNet outputs (down residuals, then the mid one) at
  conditioning_scale 1
- `out_<numerics>`  the UNet's output with those residuals times STRENGTH added
- numerics `torch` (diffusers as it is) and `sdcpp` (GroupNorm eps 1e-6, tanh GELU: sd.cpp's)
- `meta`  json: configs, strength, versions
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
FIX = os.path.join(ROOT, "tests", "fixtures")

from make_unet_goldens import randomize, sdcpp_numerics  # noqa: E402

from sdrt.models.names import convert_names  # noqa: E402

N, H, W, L = 2, 8, 8, 7
TIMESTEPS = [999.0, 261.5]
STRENGTH = 0.9
COMMON = {"norm_num_groups": 8, "cross_attention_dim": 32, "act_fn": "silu", "flip_sin_to_cos": True,
          "freq_shift": 0, "norm_eps": 1e-5, "in_channels": 4}
HINT = (8, 8, 16, 16)     # conditioning_embedding_out_channels: 8 convs, as sd.cpp's input_hint_block

CASES = {
    "sd1": {"down": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            "up": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            "config": {"block_out_channels": (16, 32, 32), "layers_per_block": 2, "attention_head_dim": 8},
            "overrides": {"num_groups": 8}},
    "sdxl": {"down": ("DownBlock2D", "CrossAttnDownBlock2D"), "up": ("CrossAttnUpBlock2D", "UpBlock2D"),
             "config": {"block_out_channels": (16, 32), "layers_per_block": 2, "attention_head_dim": (2, 4),
                        "use_linear_projection": True, "transformer_layers_per_block": (1, 2),
                        "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
                        "projection_class_embeddings_input_dim": 16 + 6 * 8},
             "overrides": {"num_groups": 8, "head_dim": 8}, "pooled": 16},
}


def ldm_controlnet_names(keys, version) -> dict[str, str]:
    """{diffusers ControlNetModel name: sd.cpp name under control_model.}."""
    out, rest = {}, []
    for k in keys:
        if k.startswith("controlnet_cond_embedding."):
            sub = k[len("controlnet_cond_embedding."):]
            if sub.startswith("conv_in."):
                out[k] = "input_hint_block.0." + sub[len("conv_in."):]
            elif sub.startswith("conv_out."):
                out[k] = "input_hint_block.14." + sub[len("conv_out."):]
            else:                                     # blocks.i -> input_hint_block.2 (i + 1)
                i, tail = sub[len("blocks."):].split(".", 1)
                out[k] = f"input_hint_block.{2 * (int(i) + 1)}.{tail}"
        elif k.startswith("controlnet_down_blocks."):
            i, tail = k[len("controlnet_down_blocks."):].split(".", 1)
            out[k] = f"zero_convs.{i}.0.{tail}"
        elif k.startswith("controlnet_mid_block."):
            out[k] = "middle_block_out.0." + k[len("controlnet_mid_block."):]
        else:
            rest.append(k)
    conv = convert_names(["unet." + k for k in rest], version, what="controlnet")
    for k in rest:
        c = conv["unet." + k]
        assert c.startswith("model.diffusion_model."), (k, c)
        out[k] = c[len("model.diffusion_model."):]
    return {k: "control_model." + v for k, v in out.items()}


def make(name, spec, seed):
    from diffusers import ControlNetModel, UNet2DConditionModel
    g = torch.Generator().manual_seed(seed)
    cfg = dict(COMMON, **spec["config"])
    cn = ControlNetModel(**cfg, down_block_types=spec["down"], conditioning_embedding_out_channels=HINT).eval()
    unet = UNet2DConditionModel(**cfg, sample_size=H, out_channels=4, down_block_types=spec["down"],
                                up_block_types=spec["up"]).eval()
    randomize(cn, g)
    randomize(unet, g)      # (the zero convs too: 0 in a fresh ControlNet, random here so each one matters)
    x = torch.randn(N, 4, H, W, generator=g)
    t = torch.tensor(TIMESTEPS, dtype=torch.float32)
    ctx = torch.randn(N, L, cfg["cross_attention_dim"], generator=g)
    hint = torch.rand(1, 3, 8 * H, 8 * W, generator=g)
    kw, arrays = {}, {}
    if "pooled" in spec:
        text_embeds = torch.randn(N, spec["pooled"], generator=g)
        time_ids = torch.tensor([[1024.0, 768.0, 0.0, 16.0, 1024.0, 768.0], [512.0, 512.0, 8.0, 0.0, 640.0, 512.0]])
        kw["added_cond_kwargs"] = {"text_embeds": text_embeds, "time_ids": time_ids}
        with torch.no_grad():
            tproj = unet.add_time_proj(time_ids.flatten()).reshape(N, -1)
            arrays["y"] = torch.cat([text_embeds, tproj], dim=-1).numpy()
    for numerics in ("torch", "sdcpp"):
        if numerics == "sdcpp":
            sdcpp_numerics(cn)
            sdcpp_numerics(unet)
        with torch.no_grad():
            down, mid = cn(x, t, encoder_hidden_states=ctx, controlnet_cond=hint.expand(N, -1, -1, -1),
                           conditioning_scale=1.0, return_dict=False, **kw)
            out = unet(x, t, encoder_hidden_states=ctx, down_block_additional_residuals=[d * STRENGTH for d in down],
                       mid_block_additional_residual=mid * STRENGTH, **kw).sample
        for i, c in enumerate(list(down) + [mid]):
            arrays[f"controls_{numerics}_{i}"] = c.numpy()
        arrays[f"out_{numerics}"] = out.numpy()
    version = "sdxl" if "pooled" in spec else "sd1"
    cn_sd, un_sd = cn.state_dict(), unet.state_dict()
    cn_names = ldm_controlnet_names(list(cn_sd), version)
    un_names = convert_names(["unet." + k for k in un_sd], version, what=name)
    arrays.update({f"cn:{cn_names[k]}": v.numpy().astype(np.float16) for k, v in cn_sd.items()})
    arrays.update({f"unet:{un_names['unet.' + k]}": v.numpy().astype(np.float16) for k, v in un_sd.items()})
    arrays.update(x=x.numpy(), t=t.numpy(), context=ctx.numpy(), hint=hint.numpy())
    import diffusers
    meta = {"case": name, "config": cfg, "down": spec["down"], "up": spec["up"], "hint": HINT,
            "sdrt_overrides": spec["overrides"], "strength": STRENGTH, "seed": seed, "torch": torch.__version__,
            "diffusers": diffusers.__version__, "controls": len(down) + 1}
    arrays["meta"] = np.array(json.dumps(meta))
    path = os.path.join(FIX, f"controlnet_{name}.npz")
    np.savez_compressed(path, **arrays)
    size = os.path.getsize(path)
    print(f"{path}: {size / 1e6:.2f} MB, {len(down) + 1} controls, |mid| max {float(mid.abs().max()):.3f}, "
          f"|out| max {float(out.abs().max()):.3f}")
    assert size < 2e6, f"{path} is over 2 MB"


def main():
    for i, (name, spec) in enumerate(CASES.items()):
        make(name, spec, seed=300 + i)


if __name__ == "__main__":
    main()
