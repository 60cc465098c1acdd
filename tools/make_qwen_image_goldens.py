"""Write tests/fixtures/qwen_image_transformer.npz (and qwen_image_vae.npz): diffusers goldens for
sdrt's Qwen-Image transformer and VAE.

    python tools/make_qwen_image_goldens.py [--only transformer|vae]   # needs torch + diffusers (CPU)

Transformer: diffusers QwenImageTransformer2DModel, a tiny random config of the real architecture
(2 blocks, 2 heads x 16 = hidden 32, RoPE axes (4, 6, 6), text width 24, 16 latent channels);
weights stored under their diffusers names (which are also sd.cpp's), f16-rounded values, the torch
model run in float32 on them. Inputs as QwenImagePipeline builds them: latents packed 2x2, the
timestep as sigma in [0, 1] (diffusers multiplies by 1000 inside; sdrt takes 1000 sigma, as sd.cpp),
img_shapes [(1, h/2, w/2)] (+ the reference latents' for edit). diffusers computes its RoPE from
positions it never materializes; this script writes them (`ids`: text at max(h/2, w/2) + i, image
(frame, row, col) with rows/cols centred, references at frame 1, 2, ...) and checks that
sdrt's pe of those ids equals diffusers' freqs, so the test can feed them.

Vision (qwen_vl_vision.npz): transformers' Qwen2.5-VL vision tower, see vision().

Cases: `t2i` x [1, 16, 8, 12], context [1, 7, 24]; `edit` the same weights + a reference latent
[1, 16, 8, 8]; `zc` (zero_cond_t=True) with the reference. Keys `<case>:x|t|context|ref|ids|out`,
`w:<name>` (t2i and edit share), `wz:<name>` (zc), `meta`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
from make_flux_goldens import pack, randomize, unpack  # noqa: E402  (the same random init and latent packing)
FIX = os.path.join(ROOT, "tests", "fixtures")


def diffusers_ids(shapes, txt_len):
    """The positions behind diffusers' QwenEmbedRope(scale_rope=True) freqs: [tokens, 3], text first."""
    rows = []
    for idx, (f, h, w) in enumerate(shapes):
        r = np.concatenate([-np.arange(h - h // 2, 0, -1), np.arange(h // 2)])
        c = np.concatenate([-np.arange(w - w // 2, 0, -1), np.arange(w // 2)])
        g = np.zeros((h, w, 3), np.float32)
        g[..., 0], g[..., 1], g[..., 2] = idx, r[:, None], c[None, :]
        rows.append(g.reshape(-1, 3))
    m = max(max(h // 2, w // 2) for _, h, w in shapes)
    txt = np.repeat((m + np.arange(txt_len, dtype=np.float32))[:, None], 3, axis=1)
    return np.concatenate([txt] + rows).astype(np.float32)


def transformer(out):
    from diffusers import QwenImageTransformer2DModel
    from sdrt.models.diffusion.flux import flux_pe
    cfg = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6))
    g = torch.Generator().manual_seed(2001)
    C, h, w, L, hr, wr = 16, 8, 12, 7, 8, 8
    x = torch.randn(1, C, h, w, generator=g)
    ctx = torch.randn(1, L, 24, generator=g)
    ref = torch.randn(1, C, hr, wr, generator=g)
    sigma = 0.73
    meta = {"config": cfg, "sigma": sigma}
    for case, zc, seed in (("t2i", False, 11), ("edit", False, 11), ("zc", True, 12)):
        torch.manual_seed(0)
        model = QwenImageTransformer2DModel(**cfg, zero_cond_t=zc).eval()
        randomize(model, torch.Generator().manual_seed(seed))
        shapes = [(1, h // 2, w // 2)] + ([(1, hr // 2, wr // 2)] if case != "t2i" else [])
        hs = pack(x)
        if case != "t2i":
            hs = torch.cat([hs, pack(ref)], 1)
        with torch.no_grad():
            o = model(hidden_states=hs, encoder_hidden_states=ctx, timestep=torch.tensor([sigma]),
                      img_shapes=[shapes], return_dict=False)[0]
            vid, txt = model.pos_embed([shapes], max_txt_seq_len=L, device=torch.device("cpu"))
        o = o[:, : (h // 2) * (w // 2)]
        ids = diffusers_ids(shapes, L)
        pe = flux_pe(ids, cfg["axes_dims_rope"])
        ref_f = torch.cat([txt, vid]).numpy()
        err = max(np.abs(pe[:, :, 0, 0] - ref_f.real).max(), np.abs(pe[:, :, 1, 0] - ref_f.imag).max())
        assert err < 1e-4, f"ids do not reproduce diffusers' RoPE ({err})"
        pre = "wz:" if zc else "w:"
        if case != "edit":
            for k, v in model.state_dict().items():
                out[pre + k] = v.half().numpy()
        out[f"{case}:x"], out[f"{case}:context"] = x.numpy(), ctx.numpy()
        out[f"{case}:t"] = np.array([sigma * 1000], np.float32)
        out[f"{case}:ids"] = ids
        out[f"{case}:out"] = unpack(o, h, w).numpy()
        if case != "t2i":
            out[f"{case}:ref"] = ref.numpy()
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)


def vae(out):
    """AutoencoderKLQwenImage scaled down (base_dim 8, dim_mult (1, 2, 4, 4), 2 res blocks, 16 latent
    channels), weights stored under Wan's names (sdrt.models.vae.wan.diffusers_to_wan), f16 values.
    `x` [1, 3, 32, 48] in [-1, 1] -> `mean` (encode's latent_dist.mean, one frame); `z` [1, 16, 4, 6]
    -> `dec` (decode without the final clamp: post_quant_conv + decoder on the frame, as _decode)."""
    from diffusers import QwenImageTransformer2DModel  # noqa: F401 (imported first, the VAE's import chain works here)
    from diffusers import AutoencoderKLQwenImage
    from sdrt.models.vae.wan import diffusers_to_wan
    cfg = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**cfg).eval()
    randomize(vae, torch.Generator().manual_seed(31))
    g = torch.Generator().manual_seed(32)
    x = torch.rand(1, 3, 32, 48, generator=g) * 2 - 1
    z = torch.randn(1, 16, 4, 6, generator=g)
    with torch.no_grad():
        mean = vae.encode(x[:, :, None]).latent_dist.mean[:, :, 0]
        vae.clear_cache()
        dec = vae.decoder(vae.post_quant_conv(z[:, :, None]), feat_cache=vae._feat_map,
                          feat_idx=vae._conv_idx)[:, :, 0]
    sd = vae.state_dict()
    names = diffusers_to_wan(sd.keys(), cfg["num_res_blocks"])
    for k, v in sd.items():
        out["w:" + names[k]] = v.half().numpy()
    out["x"], out["mean"], out["z"], out["dec"] = x.numpy(), mean.numpy(), z.numpy(), dec.numpy()
    out["meta"] = np.frombuffer(json.dumps({"config": cfg}).encode(), np.uint8)


def vision(out):
    """transformers Qwen2_5_VisionTransformerPretrainedModel, small: width 32 (2 heads of 16), 4 blocks
    (full attention in 1 and 3, window attention elsewhere), FFN 48, output 24, patch 14, merge 2,
    window 112 px. `img` [3, 168, 224] (a normalized image: 12 x 16 patches, 6 x 8 merge units, so
    windows of 4 x 4 units are cut at the edges) -> `out` = pooler_output [48, 24]; weights `w:<HF
    name>` (f16 values)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    cfg = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=24, patch_size=14,
               spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
               in_channels=3, hidden_act="silu")
    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**cfg)).eval()
    randomize(model, torch.Generator().manual_seed(41))
    g = torch.Generator().manual_seed(42)
    img = torch.randn(3, 168, 224, generator=g).half().float()     # stored as f16
    gh, gw, m, P, T = 12, 16, 2, 14, 2
    p = img[None].repeat(T, 1, 1, 1).reshape(1, T, 3, gh // m, m, P, gw // m, m, P)
    p = p.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, 3 * T * P * P)   # Qwen2VLImageProcessor's order
    with torch.no_grad():
        o = model(p, grid_thw=torch.tensor([[1, gh, gw]]))
    o = o.pooler_output if hasattr(o, "pooler_output") else o
    for k, v in model.state_dict().items():
        out["w:" + k] = v.half().numpy()
    out["img"], out["out"] = img.half().numpy(), o.numpy()
    out["meta"] = np.frombuffer(json.dumps({"config": cfg}).encode(), np.uint8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("transformer", "vae", "vision"))
    a = ap.parse_args()
    if a.only in (None, "transformer"):
        out = {}
        transformer(out)
        np.savez_compressed(os.path.join(FIX, "qwen_image_transformer.npz"), **out)
    if a.only in (None, "vae"):
        out = {}
        vae(out)
        np.savez_compressed(os.path.join(FIX, "qwen_image_vae.npz"), **out)
    if a.only in (None, "vision"):
        out = {}
        vision(out)
        np.savez_compressed(os.path.join(FIX, "qwen_vl_vision.npz"), **out)


if __name__ == "__main__":
    main()
