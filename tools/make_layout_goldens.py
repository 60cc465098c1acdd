"""Write tests/fixtures/layout_goldens.npz: PyTorch outputs the layout/position op tests compare
against (the tests themselves never import torch).

    python tools/make_layout_goldens.py        # needs torch (CPU build is enough)

Cases
- upscale: torch.nn.functional.interpolate on small random NCHW float32 inputs, every mode,
  align_corners both ways, up- and down-scaling, bilinear antialias. Keys `up{i}_x`, `up{i}_y`,
  and `up{i}_args` (json: size, mode, align_corners, antialias).
- rope: FLUX's reference `rope()` / `apply_rope()` (black-forest-labs/flux, src/flux/math.py,
  reproduced below without einops): `flux_x` (B, H, L, D), `flux_pe` (B, L, D/2, 2, 2),
  `flux_y` (B, H, L, D).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.nn.functional as F

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                   "layout_goldens.npz")

UPSCALE_CASES = [
    # (input NCHW, size (H, W), mode, align_corners, antialias)
    ((1, 2, 5, 7), (10, 14), "nearest", None, False),
    ((2, 1, 4, 3), (12, 9), "nearest", None, False),
    ((1, 2, 5, 6), (7, 13), "nearest", None, False),
    ((1, 1, 9, 10), (4, 7), "nearest", None, False),
    ((1, 2, 5, 7), (11, 13), "bilinear", False, False),
    ((1, 2, 5, 7), (11, 13), "bilinear", True, False),
    ((1, 2, 9, 8), (4, 3), "bilinear", False, False),
    ((1, 2, 9, 8), (4, 3), "bilinear", True, False),
    ((1, 2, 5, 7), (11, 13), "bicubic", False, False),
    ((1, 2, 5, 7), (11, 13), "bicubic", True, False),
    ((1, 2, 9, 8), (4, 5), "bicubic", False, False),
    ((1, 2, 9, 8), (4, 5), "bicubic", True, False),
    ((2, 3, 6, 6), (12, 12), "bilinear", False, False),
    ((2, 3, 6, 6), (12, 12), "bicubic", False, False),
    ((1, 2, 9, 8), (4, 3), "bilinear", False, True),
    ((1, 2, 16, 12), (5, 7), "bilinear", False, True),
    ((1, 2, 5, 7), (11, 13), "bilinear", False, True),
    ((1, 1, 1, 5), (3, 9), "bilinear", True, False),
    ((1, 1, 4, 1), (7, 1), "bicubic", False, False),
]


def flux_rope(pos: torch.Tensor, dim: int, theta: int) -> torch.Tensor:
    scale = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    omega = 1.0 / (theta ** scale)
    out = torch.einsum("...n,d->...nd", pos, omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).float()  # "b n d (i j) -> b n d i j"


def flux_apply_rope(xq: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq)


def main():
    g = torch.Generator().manual_seed(0)
    out = {"provenance": np.array(f"torch {torch.__version__}, tools/make_layout_goldens.py")}
    for i, (shape, size, mode, ac, aa) in enumerate(UPSCALE_CASES):
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        kw = {} if ac is None else {"align_corners": ac}
        y = F.interpolate(x, size=size, mode=mode, antialias=aa, **kw)
        out[f"up{i}_x"] = x.numpy()
        out[f"up{i}_y"] = y.numpy()
        out[f"up{i}_args"] = np.array(json.dumps({"size": size, "mode": mode, "align_corners": bool(ac),
                                                  "antialias": aa}))
    # FLUX: pe from 3 position axes (ids), axes_dim (4, 6, 6) -> head_dim 16
    B, H, L, D = 2, 3, 5, 16
    ids = torch.randint(0, 40, (B, L, 3), generator=g).double()
    axes_dim = (4, 6, 6)
    pe = torch.cat([flux_rope(ids[..., i], axes_dim[i], 10000) for i in range(3)], dim=-3)  # (B, L, D/2, 2, 2)
    x = torch.randn((B, H, L, D), generator=g, dtype=torch.float32)
    out["flux_x"] = x.numpy()
    out["flux_pe"] = pe.numpy()
    out["flux_y"] = flux_apply_rope(x, pe.unsqueeze(1)).numpy()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT}: {len(out)} arrays, {os.path.getsize(OUT)} bytes")


if __name__ == "__main__":
    main()
