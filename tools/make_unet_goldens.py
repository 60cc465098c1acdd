"""Write tests/fixtures/unet_*.npz: diffusers UNet2DConditionModel goldens for sdrt's UNet.

    python tools/make_unet_goldens.py            # needs torch + diffusers (CPU is enough)

Each fixture is a tiny random config of a real architecture (SD1, SD2, SDXL, SD1 inpaint,
SSD-1B-like SDXL), built with diffusers, its weights renamed to the LDM checkpoint names
(`model.diffusion_model.input_blocks.1.1.proj_in.weight` ...) with sdrt.models.names, and saved as
float16 (real checkpoints are f16; diffusers runs on the same f16-rounded values in float32, so
the comparison is float32 math on both sides). Keys:

- `w:<LDM name>`  the weights (float16, torch shapes)
- `x` [N, C, H, W], `t` [N], `context` [N, L, Cctx], optionally `y` [N, adm] (SDXL: the
  label_emb input, i.e. pooled text embeds ++ the add_time_proj embedding of the 6 size/crop
  ids, built here exactly as diffusers builds it), `c_concat` (inpaint: x = concat(x4, c_concat))
- `out_torch`  diffusers' output as it is (LDM numerics: ResBlock/out GroupNorm eps 1e-5,
  GEGLU with erf GELU)
- `out_sdcpp`  diffusers' output with sd.cpp's numerics patched in (every GroupNorm eps 1e-6,
  GEGLU with the tanh GELU of ggml_gelu) — what sdrt's default numerics must give
- `meta`  json: config, head overrides for the tiny sizes, library versions
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FIX = os.path.join(ROOT, "tests", "fixtures")

from sdrt.models.names import convert_names

N, H, W, L = 2, 16, 16, 7
TIMESTEPS = [999.0, 261.5]

COMMON = {"sample_size": H, "norm_num_groups": 8, "cross_attention_dim": 32, "act_fn": "silu",
              "flip_sin_to_cos": True, "freq_shift": 0, "norm_eps": 1e-5}

CASES = {
    # SD1: 8 heads, 1x1 conv proj_in/proj_out, 3 levels of which the last has no attention
    "sd1": {"config": {"block_out_channels": (16, 32, 32), "layers_per_block": 2,
                            "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                            "attention_head_dim": 8, "in_channels": 4, "out_channels": 4},
                "overrides": {"num_groups": 8}},
    # SD2: linear proj_in/proj_out, fixed head dim (8 here, 64 in the real model)
    "sd2": {"config": {"block_out_channels": (16, 32), "layers_per_block": 1,
                            "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                            "attention_head_dim": (2, 4), "use_linear_projection": True, "in_channels": 4, "out_channels": 4},
                "overrides": {"num_groups": 8, "head_dim": 8}},
    # SDXL: no attention at level 0, 2 transformer blocks at level 1 (and in the middle),
    # label_emb from pooled text + size/crop ids
    "sdxl": {"config": {"block_out_channels": (16, 32), "layers_per_block": 2,
                             "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
                             "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
                             "attention_head_dim": (2, 4), "use_linear_projection": True,
                             "transformer_layers_per_block": (1, 2), "addition_embed_type": "text_time",
                             "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 16 + 6 * 8,
                             "in_channels": 4, "out_channels": 4},
                 "overrides": {"num_groups": 8, "head_dim": 8}, "pooled": 16},
    # SSD-1B / Vega layout: middle block is one ResBlock, output depths differ from input depths
    "ssd1b": {"config": {"block_out_channels": (16, 32), "layers_per_block": 2,
                              "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
                              "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
                              "attention_head_dim": (2, 4), "use_linear_projection": True,
                              "transformer_layers_per_block": (1, 2),
                              "reverse_transformer_layers_per_block": ((2, 1, 3), (1, 1, 1)),
                              "mid_block_type": "UNetMidBlock2D", "addition_embed_type": "text_time",
                              "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 16 + 6 * 8,
                              "in_channels": 4, "out_channels": 4},
                  "overrides": {"num_groups": 8, "head_dim": 8}, "pooled": 16},
    # SD1 inpaint: 9 input channels (noisy latent 4 + mask 1 + masked-image latent 4)
    "inpaint": {"config": {"block_out_channels": (16, 32), "layers_per_block": 1,
                                "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
                                "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
                                "attention_head_dim": 8, "in_channels": 9, "out_channels": 4},
                    "overrides": {"num_groups": 8}, "concat": 5},
}


def randomize(model, g):
    """Default init leaves norms at (1, 0); shake every parameter so each path matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = max(1, int(np.prod(p.shape[1:])))
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
            p.copy_(p.half().float())  # the fixture stores f16: run on the same values


def sdcpp_numerics(model):
    """sd.cpp's GroupNorm32 has eps 1e-6 everywhere; its GEGLU uses ggml_gelu (tanh form)."""
    from diffusers.models.activations import GEGLU
    for m in model.modules():
        if isinstance(m, torch.nn.GroupNorm):
            m.eps = 1e-6
        if isinstance(m, GEGLU):
            m.gelu = lambda gate: torch.nn.functional.gelu(gate, approximate="tanh")


def make(name, spec, seed):
    from diffusers import UNet2DConditionModel
    g = torch.Generator().manual_seed(seed)
    cfg = dict(COMMON, **spec["config"])
    model = UNet2DConditionModel(**cfg).eval()
    randomize(model, g)
    cin = cfg["in_channels"]
    x = torch.randn(N, cin, H, W, generator=g)
    t = torch.tensor(TIMESTEPS, dtype=torch.float32)
    ctx = torch.randn(N, L, cfg["cross_attention_dim"], generator=g)
    kw, extra = {}, {}
    if "pooled" in spec:
        text_embeds = torch.randn(N, spec["pooled"], generator=g)
        time_ids = torch.tensor([[1024.0, 768.0, 0.0, 16.0, 1024.0, 768.0], [512.0, 512.0, 8.0, 0.0, 640.0, 512.0]])
        kw["added_cond_kwargs"] = {"text_embeds": text_embeds, "time_ids": time_ids}
        with torch.no_grad():  # diffusers' get_aug_embed, "text_time" branch
            tproj = model.add_time_proj(time_ids.flatten()).reshape(N, -1)
            extra["y"] = torch.cat([text_embeds, tproj], dim=-1)
    with torch.no_grad():
        out_torch = model(x, t, encoder_hidden_states=ctx, **kw).sample
        sdcpp_numerics(model)
        out_sdcpp = model(x, t, encoder_hidden_states=ctx, **kw).sample
    sd = model.state_dict()
    names = convert_names(["unet." + k for k in sd], "sdxl" if "pooled" in spec else "sd1", what=name)
    arrays = {f"w:{names['unet.' + k]}": v.numpy().astype(np.float16) for k, v in sd.items()}
    arrays.update(x=x.numpy(), t=t.numpy(), context=ctx.numpy(),
                  out_torch=out_torch.numpy(), out_sdcpp=out_sdcpp.numpy())
    if "y" in extra:
        arrays["y"] = extra["y"].numpy()
    if "concat" in spec:
        arrays["c_concat"] = x.numpy()[:, cin - spec["concat"]:]
    import diffusers
    meta = {"case": name, "diffusers_config": {k: v for k, v in cfg.items()}, "sdrt_overrides": spec["overrides"],
                "seed": seed, "torch": torch.__version__, "diffusers": diffusers.__version__,
                "params": int(sum(v.numel() for v in sd.values()))}
    arrays["meta"] = np.array(json.dumps(meta))
    path = os.path.join(FIX, f"unet_{name}.npz")
    np.savez(path, **arrays)
    size = os.path.getsize(path)
    print(f"{path}: {meta['params']} params, {size / 1e6:.2f} MB, |out| max {float(out_torch.abs().max()):.3f}, "
          f"sdcpp-torch max diff {float((out_sdcpp - out_torch).abs().max()):.2e}")
    assert size < 2e6, f"{path} is over 2 MB"


def main():
    for i, (name, spec) in enumerate(CASES.items()):
        make(name, spec, seed=100 + i)


if __name__ == "__main__":
    main()
