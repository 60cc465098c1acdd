"""Golden for the Z-Image transformer (needs torch + diffusers; the tests do not).

    python tools/make_zimage_goldens.py      # tests/fixtures/zimage_transformer.npz

A random diffusers ZImageTransformer2DModel at a small config (width 128 = one head of 128 with
the released RoPE axes (32, 48, 48), 2 main layers, 1 noise + 1 context refiner layer, captions of
64), every parameter (pad tokens and norm weights included) random and rounded to float16 values,
stored under the original / sd.cpp names (all_x_embedder.2-1 -> x_embedder, to_q/k/v joined into
attention.qkv, norm_q/k -> q_norm/k_norm, to_out.0 -> out, all_final_layer.2-1 -> final_layer), and
diffusers' output for two cases (token counts off and on the multiple of 32), negated as sd.cpp's
model returns it. diffusers' q/k RMS norm eps is 1e-5 (sd.cpp: 1e-6): the test runs sdrt with
qk_eps=1e-5 for the exact comparison.
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
CFG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=128, n_layers=2, n_refiner_layers=1,
           n_heads=1, n_kv_heads=1, norm_eps=1e-5, qk_norm=True, cap_feat_dim=64, rope_theta=256.0,
           t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
CASES = {"odd": ((1, 16, 6, 10), 7, 700.0), "even": ((1, 16, 8, 8), 32, 250.0)}


def to_original(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        k = k.replace("all_x_embedder.2-1.", "x_embedder.").replace("all_final_layer.2-1.", "final_layer.")
        k = k.replace("attention.norm_q.", "attention.q_norm.").replace("attention.norm_k.", "attention.k_norm.")
        k = k.replace("attention.to_out.0.", "attention.out.")
        out[k] = v
    for k in [k for k in out if re.search(r"attention\.to_q\.weight$", k)]:
        base = k[:-len("to_q.weight")]
        out[base + "qkv.weight"] = np.concatenate([out.pop(base + f"to_{n}.weight") for n in "qkv"], 0)
    return out


def main():
    import torch
    from diffusers import ZImageTransformer2DModel
    torch.manual_seed(0)
    m = ZImageTransformer2DModel(**CFG).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:      # norms, biases, pad tokens: random around their usual values
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[1]))
            p.copy_(p.to(torch.float16).to(torch.float32))
    out = {}
    for k, v in to_original({k: v.numpy() for k, v in m.state_dict().items()}).items():
        out["w/" + k] = v.astype(np.float16)
    rng = np.random.default_rng(1)
    for name, (shape, L, t) in CASES.items():
        x = rng.standard_normal(shape).astype(np.float32)
        ctx = rng.standard_normal((1, L, CFG["cap_feat_dim"])).astype(np.float32)
        with torch.no_grad():
            r = m([torch.from_numpy(x[0][:, None])], torch.tensor([(1000.0 - t) / 1000.0]),
                  [torch.from_numpy(ctx[0])], return_dict=False)[0]
        y = -r[0][:, 0].numpy()[None]
        out[f"x/{name}"], out[f"ctx/{name}"], out[f"t/{name}"], out[f"out/{name}"] = x, ctx, np.float32(t), y
        print(name, x.shape, ctx.shape, "out", y.shape, float(np.abs(y).max()))
    np.savez_compressed(os.path.join(FIX, "zimage_transformer.npz"), **out)
    print("weights:", len([k for k in out if k.startswith("w/")]), "tensors")


if __name__ == "__main__":
    sys.exit(main())
