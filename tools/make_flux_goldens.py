"""Write tests/fixtures/flux_transformer.npz and flux_vae.npz: diffusers goldens for sdrt's Flux
transformer and the 16-channel Flux VAE.

    python tools/make_flux_goldens.py [--only transformer|vae]   # needs torch + diffusers (CPU)

Each case is a tiny random config of the real architecture (2 double + 2 single blocks, hidden
32 = 2 heads x 16, RoPE axes (4, 6, 6) summing to the head width, 16 latent channels), built with
diffusers; its weights are stored under their DIFFUSERS names (float16 values; the torch model
runs on the same f16-rounded values in float32), so the test also checks sdrt's diffusers -> BFL
conversion (sdrt.models.diffusion.flux_names). Inputs are built as diffusers' pipelines build
them: latents packed 2x2 (FluxPipeline._pack_latents), img_ids (0, row, col), txt_ids zeros,
the timestep passed as sigma in [0, 1] (the pipeline's t / 1000; the transformer multiplies by
1000 inside, as BFL's time_factor), guidance as the guidance scale (also x1000 inside).

Cases (keys `<case>:...`):
- `dev`      guidance_embeds=True; x [2, 16, 6, 8], t, context [2, 5, 32], y [2, 24], guidance.
- `schnell`  guidance_embeds=False.
- `kontext`  the dev weights (stored once, under dev) with a reference latent [2, 16, 4, 6]:
             FluxKontextPipeline's way — ref tokens appended to the image tokens with ids
             (1, row, col), the output cut to the image tokens.
- `fill`     in_channels 384: x + c_concat [2, 80, 6, 8] (16 masked-image + 64 mask channels),
             packed and joined on features as FluxFillPipeline does.
- `chroma`   diffusers ChromaTransformer2DModel (same blocks, no per-block modulation: an
             approximator of 2 layers, hidden 48, maps [emb16(1000 t), emb16(0), emb32(1000 j)] to
             the 3*2 + 12*2 + 2 = 32 modulation vectors), T5 context only (no y, no guidance),
             with a text mask: `mask` [2, 5] (1 keep, 0 drop; batch 1 drops its last 2 tokens) as
             ChromaPipeline passes it (extended with ones over the image tokens).
Each case: `w:<diffusers name>` (not for kontext), `x`, `t`, `context`, [`y`], [`guidance`],
[`ref`], [`c_concat`], [`mask`], `out` = diffusers' output unpacked to [N, 16, h, w]; `meta` json.

flux_vae.npz: diffusers AutoencoderKL in the Flux VAE's shape, scaled down (block_out_channels
(32, 32, 64) instead of (128, 256, 512, 512), 1 res block per level instead of 2, 32 GroupNorm groups,
16 latent channels, no quant_conv/post_quant_conv, scaling 0.3611, shift 0.1159). Weights
`w:<LDM name>` (first_stage_model.*, converted with sdrt.models.names.diffusers_vae_to_ldm, mid
attention kept as [C, C] linears), f16 values. `x` [1, 3, 32, 32] in [-1, 1]; `moments` =
encoder(x) (mean ++ logvar: no quant_conv); `latent` = FluxPipeline's (mode - shift) * scale;
`z` [2, 16, 8, 8] a diffusion-space latent and `dec` = vae.decode(z / scale + shift) as
FluxPipeline decodes; `meta`.
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
BASE = dict(patch_size=1, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6))
CASES = {"dev": (dict(in_channels=64, guidance_embeds=True), 301),
         "schnell": (dict(in_channels=64, guidance_embeds=False), 302),
         "fill": (dict(in_channels=384, out_channels=64, guidance_embeds=True), 303)}


def randomize(model, g):
    """Default init leaves norms at 1; shake every parameter so each path matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
            p.copy_(p.half().float())


def pack(x):
    """FluxPipeline._pack_latents: [N, C, h, w] -> [N, (h/2)(w/2), C*4]."""
    n, c, h, w = x.shape
    return x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, (h // 2) * (w // 2), c * 4)


def unpack(x, h, w):
    n, _, d = x.shape
    c = d // 4
    return x.view(n, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)


def image_ids(h, w, index=0):
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


def make_transformer():
    from diffusers import FluxTransformer2DModel
    import diffusers
    arrays, meta = {}, {"torch": torch.__version__, "diffusers": diffusers.__version__, "cases": {}}
    models = {}
    for name, (cfg, seed) in CASES.items():
        g = torch.Generator().manual_seed(seed)
        model = FluxTransformer2DModel(**BASE, **cfg).eval()
        randomize(model, g)
        models[name] = model
        x = torch.randn(N, C, H, W, generator=g)
        t = torch.tensor([1.0, 0.35])
        ctx = torch.randn(N, L, BASE["joint_attention_dim"], generator=g)
        y = torch.randn(N, BASE["pooled_projection_dim"], generator=g)
        gd = torch.tensor([3.5, 1.25]) if cfg["guidance_embeds"] else None
        hidden = pack(x)
        case = {"x": x, "t": t, "context": ctx, "y": y}
        if gd is not None:
            case["guidance"] = gd
        if name == "fill":
            cc = torch.randn(N, C + 64, H, W, generator=g)
            case["c_concat"] = cc
            hidden = torch.cat([hidden, pack(cc[:, :C]), pack(cc[:, C:])], dim=2)
        with torch.no_grad():
            out = model(hidden, ctx, y, t, img_ids=image_ids(H, W), txt_ids=torch.zeros(L, 3), guidance=gd).sample
        case["out"] = unpack(out, H, W)
        for k, v in model.state_dict().items():
            arrays[f"{name}:w:{k}"] = v.numpy().astype(np.float16)
        for k, v in case.items():
            arrays[f"{name}:{k}"] = v.numpy().astype(np.float32)
        meta["cases"][name] = {"config": {**BASE, **cfg}, "seed": seed}

    # Kontext: the dev model, one reference latent appended as tokens with index 1
    g = torch.Generator().manual_seed(304)
    model = models["dev"]
    x = torch.randn(N, C, H, W, generator=g)
    ref = torch.randn(N, C, 4, 6, generator=g)
    t, gd = torch.tensor([0.8, 0.5]), torch.tensor([2.5, 2.5])
    ctx = torch.randn(N, L, BASE["joint_attention_dim"], generator=g)
    y = torch.randn(N, BASE["pooled_projection_dim"], generator=g)
    hidden = torch.cat([pack(x), pack(ref)], dim=1)
    ids = torch.cat([image_ids(H, W), image_ids(4, 6, index=1)])
    with torch.no_grad():
        out = model(hidden, ctx, y, t, img_ids=ids, txt_ids=torch.zeros(L, 3), guidance=gd).sample
    out = unpack(out[:, : (H // 2) * (W // 2)], H, W)
    for k, v in {"x": x, "ref": ref, "t": t, "guidance": gd, "context": ctx, "y": y, "out": out}.items():
        arrays[f"kontext:{k}"] = v.numpy().astype(np.float32)
    meta["cases"]["kontext"] = {"weights": "dev", "seed": 304}

    # Chroma
    from diffusers import ChromaTransformer2DModel
    g = torch.Generator().manual_seed(305)
    ccfg = {k: v for k, v in BASE.items() if k != "pooled_projection_dim"}
    ccfg.update(in_channels=64, approximator_num_channels=64, approximator_hidden_dim=48, approximator_layers=2)
    model = ChromaTransformer2DModel(**ccfg).eval()
    randomize(model, g)
    x = torch.randn(N, C, H, W, generator=g)
    t = torch.tensor([0.9, 0.3])
    ctx = torch.randn(N, L, BASE["joint_attention_dim"], generator=g)
    mask = torch.ones(N, L, dtype=torch.bool)
    mask[1, L - 2:] = False
    full = torch.cat([mask, torch.ones(N, (H // 2) * (W // 2), dtype=torch.bool)], dim=1)
    with torch.no_grad():
        out = model(pack(x), ctx, t, img_ids=image_ids(H, W), txt_ids=torch.zeros(L, 3), attention_mask=full).sample
    assert torch.isfinite(out).all()
    for k, v in model.state_dict().items():
        arrays[f"chroma:w:{k}"] = v.numpy().astype(np.float16)
    for k, v in {"x": x, "t": t, "context": ctx, "mask": mask.float(), "out": unpack(out, H, W)}.items():
        arrays[f"chroma:{k}"] = v.numpy().astype(np.float32)
    meta["cases"]["chroma"] = {"config": ccfg, "seed": 305}

    arrays["meta"] = np.array(json.dumps(meta))
    path = os.path.join(FIX, "flux_transformer.npz")
    np.savez_compressed(path, **arrays)
    size = os.path.getsize(path)
    print(f"{path}: {size / 1e6:.2f} MB")
    assert size < 3e6


VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 32, 64), layers_per_block=1,
           down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
           norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
           scaling_factor=0.3611, shift_factor=0.1159)


def make_vae():
    from diffusers import AutoencoderKL
    import diffusers
    from sdrt.models.names import diffusers_vae_to_ldm
    g = torch.Generator().manual_seed(310)
    vae = AutoencoderKL(**VAE).eval()
    randomize(vae, g)
    x = torch.rand(1, 3, 32, 32, generator=g) * 2 - 1
    z = torch.randn(2, 16, 8, 8, generator=g)
    sf, sh = vae.config.scaling_factor, vae.config.shift_factor
    with torch.no_grad():
        moments = vae.encoder(x)                           # no quant_conv: the distribution's parameters
        latent = (vae.encode(x).latent_dist.mode() - sh) * sf
        dec = vae.decode(z / sf + sh).sample
    arrays = {"w:first_stage_model." + diffusers_vae_to_ldm(k, len(VAE["block_out_channels"])): v.numpy().astype(np.float16)
              for k, v in vae.state_dict().items()}
    arrays.update(x=x.numpy(), moments=moments.numpy(), latent=latent.numpy(), z=z.numpy(), dec=dec.numpy())
    arrays["meta"] = np.array(json.dumps({"config": VAE, "seed": 310, "torch": torch.__version__,
                                          "diffusers": diffusers.__version__}))
    path = os.path.join(FIX, "flux_vae.npz")
    np.savez_compressed(path, **arrays)
    size = os.path.getsize(path)
    print(f"{path}: {size / 1e6:.2f} MB, {sum(v.numel() for v in vae.state_dict().values())} params")
    assert size < 3e6


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("transformer", "vae"))
    a = ap.parse_args()
    if a.only in (None, "transformer"):
        make_transformer()
    if a.only in (None, "vae"):
        make_vae()


if __name__ == "__main__":
    main()
