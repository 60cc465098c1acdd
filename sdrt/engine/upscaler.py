"""ESRGAN upscaling as sd.cpp's UpscalerGGML (upscaler.cpp): `-M upscale`, `--upscale-model` after
a generation, and the hires fix's model upscalers.

The image goes in as [1, 3, H, W] floats in [0, 1] (sd_image_to_tensor: value / 255). When
`tile_size` > 0 and the image is wider or taller than it, it is cut into tiles of `tile_size`
input pixels overlapping by a target 0.25 and blended with smootherstep ramps
(process_tiles_2d, sdrt.engine.vae_tiling) so memory stays bounded; else it runs whole. The
float result is not clamped (the hires fix encodes it as is); `upscale()` turns it into uint8
the way tensor_to_sd_image does. The conv weights are converted to F16 at load, as sd-cli does
(its upscaler's weight type is fixed to F16); the graph runs on the upscaler's device
(`--backend upscaler=cuda0`, or the default device).
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ..errors import UsageError
from ..ops.backend import as_weight
from .stages import decode_to_uint8, image_to_tensor

__all__ = ["DEFAULT_TILE_SIZE", "TILE_OVERLAP", "Upscaler", "upscaler_device"]

log = logging.getLogger("sdrt")
DEFAULT_TILE_SIZE = 128      # sd-cli's --upscale-tile-size / --hires-upscale-tile-size default
TILE_OVERLAP = 0.25          # UpscalerGGML::upscale_tensor's target overlap
WEIGHT_TYPE = "f16"          # UpscalerGGML's model_data_type: sd-cli runs ESRGAN with F16 conv weights


def upscaler_device(backend_spec: str | None) -> str:
    """Where the upscaler computes: `--backend`'s entry for `upscaler` (aliases esrgan, hires),
    else its default (`*`), else the first GPU, else cpu."""
    from .placement import gpu_devices, parse_assignments
    spec = parse_assignments(backend_spec, "--backend")
    d = spec.get("upscaler", spec.get("*", "auto"))
    if d in ("auto", "gpu"):
        gpus = gpu_devices()
        if not gpus and d == "gpu":
            from ..errors import UnsupportedError
            raise UnsupportedError("--backend: 'gpu' asks for a GPU, and this machine has none sdrt can use")
        return gpus[0].name if gpus else "cpu"
    return d


class Upscaler:
    """`Upscaler.load(path, tile_size=128, backend="cpu")`; `upscale(img uint8 HxWx3)` -> uint8,
    `upscale_tensor(x [1, 3, H, W] float)` -> float [1, 3, sH, sW]."""

    def __init__(self, net, tile_size: int = DEFAULT_TILE_SIZE, backend: str = "cpu", source: str = "esrgan"):
        self.net, self.tile_size, self.backend, self.source = net, int(tile_size), backend, source
        self.scale = net.scale

    @classmethod
    def load(cls, path: str, tile_size: int = DEFAULT_TILE_SIZE, backend: str = "cpu",
             wtype: str | None = WEIGHT_TYPE) -> Upscaler:
        """`wtype` "f16" (sd.cpp's UpscalerGGML: the conv weights become F16 whatever the file
        holds; biases stay F32), "f32", or None: as stored."""
        import os

        from ..io import open_model
        from ..models.esrgan import RRDBNet
        from ..ops.tensor import Tensor
        if not os.path.isfile(path):
            raise UsageError(f"--upscale-model: no such file: '{path}'")
        tensors = open_model(path).tensors
        if wtype is not None:
            if wtype not in ("f16", "f32"):
                raise UsageError(f"upscaler weight type: 'f16', 'f32' or None, got {wtype!r}")
            dt = np.float16 if wtype == "f16" else np.float32
            tensors = {k: Tensor.from_numpy(as_weight(t.to_f32().astype(dt)), name=k) if len(t.ne) == 4 else t
                       for k, t in tensors.items()}
            log.info("Upscaler weight type: %s", wtype)
        log.info("loading esrgan from '%s'", path)
        net = RRDBNet(tensors, source=path)
        log.info("esrgan model loaded with scale=%d, num_block=%d", net.scale, net.config.num_block)
        return cls(net, tile_size, backend, path)

    def _run(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self.net(x, backend=self.backend), np.float32)

    def upscale_tensor(self, x: np.ndarray, progress=None) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if x.ndim != 4 or x.shape[1] != 3:
            raise UsageError(f"upscale: image tensor must be [N, 3, H, W], got shape {x.shape}")
        H, W = x.shape[2:]
        t = self.tile_size
        if t <= 0 or (W <= t and H <= t):
            return self._run(x)
        from .vae_tiling import tiled_apply
        return tiled_apply(self._run, x, self.scale, t, TILE_OVERLAP, progress=progress)

    def upscale(self, img: np.ndarray, progress=None) -> np.ndarray:
        a = np.asarray(img)
        h, w = a.shape[:2]
        log.info("upscaling from (%d x %d) to (%d x %d)", w, h, w * self.scale, h * self.scale)
        t0 = time.time()
        out = decode_to_uint8(self.upscale_tensor(image_to_tensor(a[:, :, :3], w, h), progress))
        log.info("input_image_tensor upscaled, taking %.2fs", time.time() - t0)
        return out
