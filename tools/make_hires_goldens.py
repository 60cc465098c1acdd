"""Resize goldens for the hires fix's upscalers (tests/test_hires.py) from torch.nn.functional.interpolate,
which sd.cpp's sd::ops::interpolate follows for bilinear / bicubic (a = -0.75, align_corners False,
antialias normalizing the widened filter), nearest and nearest-exact.

    python tools/make_hires_goldens.py

Writes tests/fixtures/hires_interp.npz: x [1, 4, 9, 11] and, per (mode, antialias, size),
torch's output for an upscale (to 18x22 and 16x27) and a downscale (to 6x7)."""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [(18, 22), (16, 27), (6, 7)]
MODES = [("bilinear", False), ("bilinear", True), ("bicubic", False), ("bicubic", True), ("nearest", False),
         ("nearest-exact", False)]


def main():
    x = np.random.default_rng(3).standard_normal((1, 4, 9, 11)).astype(np.float32)
    out = {"x": x}
    t = torch.from_numpy(x).double()
    for mode, aa in MODES:
        for h, w in SIZES:
            kw = {"align_corners": False, "antialias": aa} if mode in ("bilinear", "bicubic") else {}
            y = F.interpolate(t, size=(h, w), mode=mode, **kw).float().numpy()
            out[f"{mode}/{int(aa)}/{h}x{w}"] = y
    path = os.path.join(ROOT, "tests", "fixtures", "hires_interp.npz")
    np.savez_compressed(path, **out)
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
