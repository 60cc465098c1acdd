"""Write tests/fixtures/sd3_mmdit.npz: diffusers goldens for sdrt's SD3 / SD3.5 MMDiT.

    python tools/make_sd3_goldens.py        # needs torch + diffusers (CPU)

Each case is a small random config of diffusers' SD3Transformer2DModel (the real architecture,
fewer and narrower blocks); its weights are stored under their DIFFUSERS names (float16 values;
the torch model runs on the same f16-rounded values in float32), so the test also checks sdrt's
diffusers -> SAI conversion (sdrt.models.diffusion.mmdit_names). pos_embed (a sin-cos buffer in
diffusers, a parameter in SAI's files) is replaced by random values so its centre crop is tested.
The timestep is passed as SD3's pipeline passes it: sigma * 1000.

Cases (keys `<case>:...`):
- `sd3m`    SD3 Medium-like: no QK norm, heads of 64 (hidden 128 = 2 x 64; sdrt's default head
            width when there is no ln_q), 2 joint blocks, pos_embed 8 x 8.
- `sd35l`   SD3.5 Large-like: qk_norm="rms_norm", hidden 32 = 2 x 16, 3 blocks, pos_embed 8 x 8.
- `sd35m`   SD3.5 Medium-like (MMDiT-X): as sd35l with dual_attention_layers=(0, 1), pos_embed 10 x 10.
- `sd35l_skip` the sd35l weights with skip_layers=[1] (skip-layer guidance's forward).
Each: `w:<diffusers name>` (not for *_skip), `x` [2, 16, 6, 8], `t` [2], `context` [2, 5, 32],
`y` [2, 24], [`skip`], `out` [2, 16, 6, 8]; `meta` json.
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

N, C, H, W, L = 2, 16, 6, 8, 5
BASE = dict(patch_size=2, in_channels=16, out_channels=16, joint_attention_dim=32, pooled_projection_dim=24)
CASES = {"sd3m": (dict(num_layers=2, attention_head_dim=64, num_attention_heads=2, caption_projection_dim=128,
                       sample_size=8, pos_embed_max_size=8), 401),
         "sd35l": (dict(num_layers=3, attention_head_dim=16, num_attention_heads=2, caption_projection_dim=32,
                        sample_size=8, pos_embed_max_size=8, qk_norm="rms_norm"), 402),
         "sd35m": (dict(num_layers=3, attention_head_dim=16, num_attention_heads=2, caption_projection_dim=32,
                        sample_size=10, pos_embed_max_size=10, qk_norm="rms_norm", dual_attention_layers=(0, 1)), 403)}


def randomize(model, g):
    """Default init leaves norms at 1 and zeroes some linears; shake every parameter so each path matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel() if p.ndim > 1 else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
            p.copy_(p.half().float())
        pe = model.pos_embed.pos_embed
        pe.copy_((0.5 * torch.randn(pe.shape, generator=g)).half().float())


def main():
    from diffusers import SD3Transformer2DModel
    import diffusers
    arrays, meta = {}, {"torch": torch.__version__, "diffusers": diffusers.__version__, "cases": {}}
    models = {}
    for name, (cfg, seed) in CASES.items():
        g = torch.Generator().manual_seed(seed)
        model = SD3Transformer2DModel(**BASE, **cfg).eval()
        randomize(model, g)
        models[name] = model
        x = torch.randn(N, C, H, W, generator=g)
        t = torch.tensor([1000.0, 350.0])
        ctx = torch.randn(N, L, BASE["joint_attention_dim"], generator=g)
        y = torch.randn(N, BASE["pooled_projection_dim"], generator=g)
        with torch.no_grad():
            out = model(x, ctx, y, t).sample
        assert torch.isfinite(out).all()
        for k, v in model.state_dict().items():
            arrays[f"{name}:w:{k}"] = v.numpy().astype(np.float16)
        for k, v in {"x": x, "t": t, "context": ctx, "y": y, "out": out}.items():
            arrays[f"{name}:{k}"] = v.numpy().astype(np.float32)
        meta["cases"][name] = {"config": {**BASE, **cfg}, "seed": seed}

    g = torch.Generator().manual_seed(404)
    x = torch.randn(N, C, H, W, generator=g)
    t = torch.tensor([600.0, 600.0])
    ctx = torch.randn(N, L, BASE["joint_attention_dim"], generator=g)
    y = torch.randn(N, BASE["pooled_projection_dim"], generator=g)
    with torch.no_grad():
        out = models["sd35l"](x, ctx, y, t, skip_layers=[1]).sample
    for k, v in {"x": x, "t": t, "context": ctx, "y": y, "out": out, "skip": torch.tensor([1.0])}.items():
        arrays[f"sd35l_skip:{k}"] = v.numpy().astype(np.float32)
    meta["cases"]["sd35l_skip"] = {"weights": "sd35l", "skip_layers": [1], "seed": 404}

    arrays["meta"] = np.array(json.dumps(meta))
    path = os.path.join(FIX, "sd3_mmdit.npz")
    np.savez_compressed(path, **arrays)
    size = os.path.getsize(path)
    print(f"{path}: {size / 1e6:.2f} MB")
    assert size < 3e6


if __name__ == "__main__":
    main()
