"""Random RRDBNet weights from a seed, BasicSR ("new") names, numpy only: the ESRGAN goldens
(tools/make_esrgan_goldens.py, run with torch + spandrel) and tests/test_esrgan.py (no torch)
make the same tables from the same seed; the fixture keeps a checksum of each table so a changed
numpy stream is a loud failure, not a wrong comparison."""
from __future__ import annotations

import numpy as np


def basicsr_state(seed: int, nf: int, gc: int, nb: int, scale: int, std: float = 1.0,
                  last_bias: float = 0.0) -> dict[str, np.ndarray]:
    """{name: float32 array} of a random RRDBNet; conv weights N(0, std^2 / fan_in)."""
    rng = np.random.default_rng(seed)
    sd: dict[str, np.ndarray] = {}

    def conv(name, cin, cout, bias=0.0):
        sd[f"{name}.weight"] = (rng.standard_normal((cout, cin, 3, 3)) * std / np.sqrt(cin * 9)).astype(np.float32)
        sd[f"{name}.bias"] = (rng.standard_normal(cout) * 0.05 + bias).astype(np.float32)

    conv("conv_first", 3, nf)
    for i in range(nb):
        for j in (1, 2, 3):
            for k in range(1, 6):
                conv(f"body.{i}.rdb{j}.conv{k}", nf + (k - 1) * gc, gc if k < 5 else nf)
    conv("conv_body", nf, nf)
    if scale >= 2:
        conv("conv_up1", nf, nf)
    if scale == 4:
        conv("conv_up2", nf, nf)
    conv("conv_hr", nf, nf)
    conv("conv_last", nf, 3, last_bias)
    return sd


def checksum(sd: dict[str, np.ndarray]) -> float:
    return float(sum(np.abs(v.astype(np.float64)).sum() for v in sd.values()))
