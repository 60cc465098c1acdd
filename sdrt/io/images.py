"""Image files <-> float arrays (Pillow, imported only when an image is read or written).

Arrays are [H, W, C] float32 in [0, 1] (what sd.cpp's sd_image_t holds, divided by 255);
`to_nchw` / `from_nchw` turn them into the [N, C, H, W] batches the models take. Conversion to
8 bits follows sd.cpp (preprocessing_float_to_u8): clamp to [0, 1], then value * 255 + 0.5
truncated, in float32.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import UsageError

__all__ = ["load_image", "save_image", "to_uint8", "to_nchw", "from_nchw", "psnr", "RESAMPLE"]

RESAMPLE = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")
_SAVE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".bmp": "BMP"}


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        raise UsageError("reading or writing images needs Pillow: python -m pip install pillow") from None
    return Image


def load_image(path, size: tuple[int, int] | None = None, resample: str = "lanczos", mode: str = "RGB") -> np.ndarray:
    """Read PNG/JPEG/WebP/... -> float32 [H, W, C] in [0, 1] (C = 3 for RGB, 1 for L, 4 for RGBA).
    `size=(width, height)` resizes the 8-bit image with Pillow's filter `resample` first."""
    Image = _pil()
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO or device would block in open()
        raise UsageError(f"{path}: not a regular file, not an image")
    try:
        with Image.open(path) as im:
            im = im.convert(mode)
            if size is not None:
                w, h = (int(v) for v in size)
                if w < 1 or h < 1:
                    raise UsageError(f"{path}: resize target {w}x{h} must be positive")
                if resample not in RESAMPLE:
                    raise UsageError(f"unknown resample filter {resample!r}; choices: {', '.join(RESAMPLE)}")
                im = im.resize((w, h), getattr(Image.Resampling, resample.upper()))
            a = np.asarray(im, dtype=np.uint8)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such image file") from None
    except UsageError:
        raise
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's UnidentifiedImageError is an OSError
        raise UsageError(f"{path}: cannot read image: {e}") from None
    if a.ndim == 2:
        a = a[:, :, None]
    return a.astype(np.float32) / np.float32(255)


def to_uint8(img: np.ndarray) -> np.ndarray:
    """float [0, 1] -> uint8 as sd.cpp: 0 at or below 0, 255 at or above 1, else v*255 + 0.5 truncated."""
    v = np.nan_to_num(np.asarray(img, np.float32), nan=0.0)
    out = (v * np.float32(255) + np.float32(0.5)).astype(np.int64)
    return np.where(v <= 0, 0, np.where(v >= 1, 255, out)).astype(np.uint8)


def save_image(path, img: np.ndarray, text: dict[str, str] | None = None, quality: int = 90) -> None:
    """Write [H, W, C] (float [0, 1] or uint8) by extension (.png/.jpg/.jpeg/.webp/.bmp).
    `text` becomes PNG tEXt chunks (e.g. {"parameters": infotext}); `quality` is for JPEG/WebP."""
    Image = _pil()
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    fmt = _SAVE_FORMATS.get(ext)
    if fmt is None:
        raise UsageError(f"{path}: unknown image extension {ext!r}; use one of {', '.join(_SAVE_FORMATS)}")
    a = np.asarray(img)
    a = a if a.dtype == np.uint8 else to_uint8(a)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (3, 4)):
        raise UsageError(f"{path}: image must be [H, W], [H, W, 1], [H, W, 3] or [H, W, 4], got {a.shape}")
    im = Image.fromarray(np.ascontiguousarray(a))
    kw = {}
    if fmt == "PNG" and text:
        from PIL.PngImagePlugin import PngInfo
        info = PngInfo()
        for k, v in text.items():
            info.add_text(str(k), str(v))
        kw["pnginfo"] = info
    elif fmt in ("JPEG", "WEBP"):
        kw["quality"] = int(quality)
        if fmt == "JPEG" and im.mode == "RGBA":
            im = im.convert("RGB")
    try:
        im.save(path, fmt, **kw)
    except OSError as e:
        raise UsageError(f"{path}: cannot write image: {e}") from None


def to_nchw(img: np.ndarray) -> np.ndarray:
    """[H, W, C] (or a list of them) -> [N, C, H, W] float32."""
    a = np.asarray(img, np.float32)
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4:
        raise UsageError(f"image must be [H, W, C] or [N, H, W, C], got shape {a.shape}")
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2))


def from_nchw(x: np.ndarray) -> np.ndarray:
    """[N, C, H, W] -> [N, H, W, C] float32 ([C, H, W] -> [H, W, C])."""
    a = np.asarray(x, np.float32)
    if a.ndim == 3:
        return np.ascontiguousarray(a.transpose(1, 2, 0))
    if a.ndim != 4:
        raise UsageError(f"expected [N, C, H, W], got shape {a.shape}")
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 1.0) -> float:
    """10 log10(peak^2 / MSE) over all elements, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise UsageError(f"psnr: shapes differ: {a.shape} vs {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(peak * peak / mse)
