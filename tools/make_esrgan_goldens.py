"""ESRGAN goldens (tests/test_esrgan.py) from spandrel's RRDBNet, the test-time oracle.

    pip install spandrel   # oracle only; sdrt never imports it
    python tools/make_esrgan_goldens.py

Writes tests/fixtures/esrgan_goldens.npz (small: the weights are not stored, the test makes them
again from the seeds with tests/esrgan_weights.py; a checksum per table catches a changed stream):
- module cases: small random RRDBNets (8 features; spandrel fixes 32 growth channels) in both
  checkpoint layouts and every scale (x4, x2, x1). BasicSR-named ("new") tables are loaded
  through spandrel's ESRGANArch, which converts them to its own "old" layout (the name mapping is
  spandrel's, not sdrt's); for the "old" cases spandrel's converted state_dict is what the test
  loads (stored: the old <-> new name pairs). Stored: input [1, 3, 9, 11] in [0, 1], spandrel's output.
- `cat`: an x4 RRDBNet (2 blocks, 32 features, random weights, conv_last bias 0.5 so the image is
  mid-grey rather than clamped) and spandrel's output for /work/shared/images/cat_1024.png
  box-downscaled to 128x128, as uint8 (sd.cpp's rounding); the test reads the cat itself.
Also tests/fixtures/esrgan_params_ema.pth: a tiny RealESRGAN-style pickle ({"params_ema", "params"}).
spandrel's package __init__ imports every architecture (some need torchvision, which has no CPU
wheel matching the CPU torch here): the ESRGAN architecture module is loaded on its own.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAT = os.path.join(os.path.dirname(ROOT), "shared", "images", "cat_1024.png")


NF, GC = 8, 32            # spandrel fixes 32 growth channels
CASES = [("x4_new", 4, "new", 1), ("x2_new", 2, "new", 1), ("x1_new", 1, "new", 1),
         ("x4_old", 4, "old", 2), ("x2_old", 2, "old", 1), ("x1_old", 1, "old", 1)]   # seed = index
CAT_SEED, CAT_NET, CAT_SIZE = 100, (32, 32, 2, 4), 128      # (nf, gc, nb, scale)
CAT_STD, CAT_LAST_BIAS = 1.0, 0.5
PTH_SEED = 200


def spandrel_esrgan():
    spec = importlib.util.find_spec("spandrel")
    if spec is None:
        sys.exit("pip install spandrel (the oracle)")
    if "spandrel" not in sys.modules:
        pkg = types.ModuleType("spandrel")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["spandrel"] = pkg
    from spandrel.architectures.ESRGAN import ESRGANArch
    return ESRGANArch()


def run(model, x: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(x)).float().numpy()


def main():
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from esrgan_weights import basicsr_state, checksum
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "esrgan_goldens.npz"))
    args = ap.parse_args()
    arch = spandrel_esrgan()
    rng = np.random.default_rng(16)
    out = {}
    for seed, (name, scale, layout, nb) in enumerate(CASES):
        sd = basicsr_state(seed, NF, GC, nb, scale)
        out[f"{name}/checksum"] = np.float64(checksum(sd))
        desc = arch.load({k: torch.from_numpy(v) for k, v in sd.items()})
        assert desc.scale == scale, (name, desc.scale)
        model = desc.model.eval()
        if layout == "old":   # spandrel's own layout, as an old ESRGAN file holds it
            old = {k: v.numpy() for k, v in model.state_dict().items()}
            assert "model.0.weight" in old
            pairs = [(ko, kn) for ko, vo in old.items() for kn, vn in sd.items()
                     if vo.shape == vn.shape and np.array_equal(vo, vn)]
            assert len(pairs) == len(sd) == len(old), (len(pairs), len(sd), len(old))
            out[f"{name}/old_names"] = np.array([p[0] for p in pairs])
            out[f"{name}/new_names"] = np.array([p[1] for p in pairs])
        x = rng.random((1, 3, 9, 11), dtype=np.float32)
        out[f"{name}/x"] = x
        out[f"{name}/y"] = run(model, x)
        print(name, "scale", scale, "out", out[f"{name}/y"].shape, "range",
              float(out[f"{name}/y"].min()), float(out[f"{name}/y"].max()))
    # the cat: 128x128 box-downscaled, x4
    from PIL import Image
    sd = basicsr_state(CAT_SEED, *CAT_NET, std=CAT_STD, last_bias=CAT_LAST_BIAS)
    out["cat/checksum"] = np.float64(checksum(sd))
    model = arch.load({k: torch.from_numpy(v) for k, v in sd.items()}).model.eval()
    img = np.asarray(Image.open(CAT).convert("RGB").resize((CAT_SIZE, CAT_SIZE), Image.BOX), np.float32) / 255.0
    x = np.ascontiguousarray(img.transpose(2, 0, 1)[None])
    y = run(model, x)[0].transpose(1, 2, 0)
    out["cat/x_sum"] = np.float64(x.astype(np.float64).sum())      # the test checks it reads the same input
    out["cat/y"] = np.where(y <= 0, 0, np.where(y >= 1, 255, y * 255 + 0.5)).astype(np.uint8)  # sd.cpp's rounding
    print("cat out", y.shape, float(y.min()), float(y.max()), float(y.mean()), float(y.std()),
          "clamped", float(((y < 0) | (y > 1)).mean()))
    # a RealESRGAN-style .pth: {"params_ema": ..., "params": ...} (tiny: 4 features, 4 growth channels);
    # "params" holds other values so the test sees that params_ema is the one read
    ema, raw = basicsr_state(PTH_SEED, 4, 4, 1, 4), basicsr_state(PTH_SEED + 1, 4, 4, 1, 4)
    torch.save({"params_ema": {k: torch.from_numpy(v) for k, v in ema.items()},
                "params": {k: torch.from_numpy(v) for k, v in raw.items()}},
               os.path.join(os.path.dirname(args.out), "esrgan_params_ema.pth"))
    np.savez_compressed(args.out, **out)
    print("wrote", args.out, os.path.getsize(args.out), "bytes")


if __name__ == "__main__":
    main()
