"""sd-cli's `--canny`: stable-diffusion.cpp's canny preprocessor (preprocessing.hpp,
`preprocess_canny(img, 0.08, 0.08, 0.8, 1.0, false)`), reproduced step for step in float32.

Steps as sd.cpp does them, including its quirks (they decide the picture, so they are kept):
1. gray = 0.2989 r + 0.5870 g + 0.1140 b of the [0, 1] image;
2. 5x5 Gaussian (sigma 1.4, normalized by 1/(2 pi sigma^2), not by its sum), zero padding;
3. Sobel kX / kY (3x3, zero padding); G = hypot(iX, iY), scaled by 1/max(G);
   theta = atan2(iY, iX);
4. non-maximum suppression with sd.cpp's angle tests, whose `0 >= angle` / `22.5 >= angle`
   comparisons are reversed: every angle <= 157.5 degrees compares with the pixels above and
   below, larger angles with 1.0 (so only a pixel of value 1 survives there); the 1-pixel
   border is 0;
5. hysteresis: ht = max * high, lt = ht * low; >= ht -> strong (1.0), in [lt, ht] -> weak (0.8),
   lower values stay as they are (not zeroed); a 3-pixel frame (x or y < 3 or > size - 3) is
   zeroed; then one raster pass turns each weak pixel into strong when one of six neighbours
   (right-up, right, up, down, left-up, left: sd.cpp's list) is strong at that moment, else 0;
6. the map (not inverted) is written to every channel as round(v * 255) (uint8).

The loops run in Numba without fastmath, in sd.cpp's order, so each float32 sum rounds as
sd-cli's (its library is built -O3 without -march: no FMA contraction). exp/atan2 are computed
in float64 and rounded to float32, which is what glibc's expf/atan2f return to within their
rounding. tests/test_canny.py compares with sd.cpp's own compiled preprocess_canny.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..ops.numba_target import configure as _configure_numba

_configure_numba()  # the target and -t before this module's kernels compile

__all__ = ["canny", "gaussian_kernel"]

F32 = np.float32
PI = F32(3.14159265358979323846)
# sd-cli's arguments to preprocess_canny (examples/cli/main.cpp)
HIGH, LOW, WEAK, STRONG = F32(0.08), F32(0.08), F32(0.8), F32(1.0)


def gaussian_kernel(size: int = 5, sigma: float = 1.4) -> np.ndarray:
    """sd.cpp's gaussian_kernel_tensor: [size, size] float32, k[y][x] from gx = y - mid, gy = x - mid."""
    s = F32(sigma)
    s2 = F32(s * s)                                     # std::pow(sigma, 2.0f)
    normal = F32(F32(1.0) / F32(F32(F32(2.0) * PI) * s2))
    mid = size // 2
    d = np.arange(size, dtype=F32) - F32(mid)
    gx, gy = d[:, None], d[None, :]
    num = (gx * gx + gy * gy).astype(F32)
    arg = (-(num / F32(F32(2.0) * s2))).astype(F32)
    return (np.exp(arg.astype(np.float64)).astype(F32) * normal).astype(F32)


@njit(cache=True)
def _convolve(img, k, pad):
    """sd.cpp's convolve_tensor on one channel: out[y, x] = sum over in-bounds taps, ky then kx."""
    H, W = img.shape
    kh, kw = k.shape
    out = np.empty((H, W), np.float32)
    for y in range(H):
        for x in range(W):
            s = np.float32(0.0)
            for ky in range(kh):
                iy = y + ky - pad
                if iy < 0 or iy >= H:
                    continue
                for kx in range(kw):
                    ix = x + kx - pad
                    if ix < 0 or ix >= W:
                        continue
                    s = np.float32(s + np.float32(img[iy, ix] * k[ky, kx]))
            out[y, x] = s
    return out


@njit(cache=True)
def _nms(G, D):
    H, W = G.shape
    out = np.zeros((H, W), np.float32)
    c180, pi = np.float32(180.0), np.float32(3.14159265358979323846)
    a0, a22, a67, a112, a157 = (np.float32(0.0), np.float32(22.5), np.float32(67.5), np.float32(112.5),
                                np.float32(157.5))
    for iy in range(1, H - 1):
        for ix in range(1, W - 1):
            angle = np.float32(np.float32(D[iy, ix] * c180) / pi)
            if angle < a0:
                angle = np.float32(angle + c180)
            q = np.float32(1.0)
            r = np.float32(1.0)
            # sd.cpp's conditions, verbatim (G indexed [y, x])
            if (a0 >= angle and angle < a22) or (a157 >= angle and angle <= c180):
                q = G[iy + 1, ix]
                r = G[iy - 1, ix]
            elif a22 >= angle and angle < a67:
                q = G[iy - 1, ix + 1]
                r = G[iy + 1, ix - 1]
            elif a67 >= angle and angle < a112:
                q = G[iy, ix + 1]
                r = G[iy, ix - 1]
            elif a112 >= angle and angle < a157:
                q = G[iy - 1, ix - 1]
                r = G[iy + 1, ix + 1]
            cur = G[iy, ix]
            out[iy, ix] = cur if (cur >= q and cur >= r) else np.float32(0.0)
    return out


@njit(cache=True)
def _hysteresis(img, high, low, weak, strong):
    H, W = img.shape
    mx = np.float32(-np.inf)
    for iy in range(H):
        for ix in range(W):
            if img[iy, ix] > mx:
                mx = img[iy, ix]
    ht = np.float32(mx * high)
    lt = np.float32(ht * low)
    for iy in range(H):
        for ix in range(W):
            v = img[iy, ix]
            if v >= ht:
                img[iy, ix] = strong
            elif v <= ht and v >= lt:
                img[iy, ix] = weak
    for iy in range(H):
        for ix in range(W):
            if not (ix >= 3 and ix <= W - 3 and iy >= 3 and iy <= H - 3):
                img[iy, ix] = np.float32(0.0)
    for iy in range(1, H - 1):
        for ix in range(1, W - 1):
            if img[iy, ix] == weak:
                s = (img[iy - 1, ix + 1] == strong or img[iy, ix + 1] == strong or img[iy - 1, ix] == strong
                     or img[iy + 1, ix] == strong or img[iy - 1, ix - 1] == strong or img[iy, ix - 1] == strong)
                img[iy, ix] = strong if s else np.float32(0.0)
    return img


_KX = np.array([[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]], F32)
_KY = np.array([[1, 2, 1], [0, 0, 0], [-1, -2, -1]], F32)


def edge_map(img: np.ndarray) -> np.ndarray:
    """HxWxC uint8 (C >= 3) -> the float32 HxW map sd.cpp writes back (before uint8)."""
    a = np.asarray(img)
    if a.ndim != 3 or a.shape[2] < 3 or a.dtype != np.uint8:
        from ..errors import UsageError
        raise UsageError(f"--canny: needs an HxWx3 uint8 image, got shape {a.shape} {a.dtype}")
    f = (a[:, :, :3].astype(F32) / F32(255.0)).astype(F32)
    gray = ((F32(0.2989) * f[:, :, 0] + F32(0.5870) * f[:, :, 1]) + F32(0.1140) * f[:, :, 2]).astype(F32)
    gray = _convolve(np.ascontiguousarray(gray), gaussian_kernel(5), 2)
    ix = _convolve(gray, _KX, 1)
    iy = _convolve(gray, _KY, 1)
    G = np.sqrt(ix * ix + iy * iy).astype(F32)              # float32 ops, sqrt correctly rounded
    mx = G.max() if G.size else F32(0)
    if mx != 0 and math.isfinite(mx):
        G = (G * F32(F32(1.0) / mx)).astype(F32)
    theta = np.arctan2(iy.astype(np.float64), ix.astype(np.float64)).astype(F32)
    return _hysteresis(_nms(G, theta), HIGH, LOW, WEAK, STRONG)


def canny(img: np.ndarray) -> np.ndarray:
    """sd-cli's --canny on an HxWx3 uint8 image: the edge map in every channel, HxWx3 uint8."""
    m = edge_map(img)
    u8 = np.where(m <= 0, 0, np.where(m >= 1, 255, (m * F32(255.0) + F32(0.5)).astype(np.int32)))
    u8 = u8.astype(np.uint8)
    return np.ascontiguousarray(np.repeat(u8[:, :, None], 3, 2))
