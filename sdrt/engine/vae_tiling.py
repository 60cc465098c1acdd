"""VAE tiling as sd.cpp does it (`--vae-tiling`, ggml_extend.hpp process_tiles_2d).

The latent plane (the "small" side: the input of a decode, the output of an encode) is cut
into tiles of `tile_size` latent pixels that overlap by a fraction; each tile goes through `fn`
on its own and the results are blended into the output with smootherstep ramps over the
overlaps. Everything here transcribes sd.cpp:

- `vae_tile_sizes`: VAE::get_tile_sizes — `--vae-tile-size WxH` (default 32), or
  `--vae-relative-tile-size` (a fraction of the latent size if <= 1, a number of tiles if > 1),
  overlap `--vae-tile-overlap` clamped to [0, 0.5]; encode passes encoding_factor 1.30539.
- `calc_tiles`: sd_tiling_calc_tiles — how many tiles and the overlap that makes them fit.
- `tile_layout`: the loop of process_tiles_2d — tile origins, the last tile moved back inside
  the plane (its first `skip` rows/columns already written by its neighbour are not merged).
- `tiled_apply`: split, run, merge (sd_tensor_split_2d / sd_tensor_merge_2d); a written pixel
  accumulates new * smootherstep(fy) * smootherstep(fx), where f ramps from 0 to 1 over the
  overlap at a tile's inner edges (and at every edge on a circular axis).
C's float32 arithmetic is kept where it decides integers (tile sizes, overlaps).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError

__all__ = ["TilingParams", "vae_tile_sizes", "calc_tiles", "tile_layout", "tiled_apply", "smootherstep",
           "ENCODE_TILE_FACTOR", "DEFAULT_TILE_SIZE"]

log = logging.getLogger("sdrt.vae")
DEFAULT_TILE_SIZE = 32
MIN_TILE_SIZE = 4
ENCODE_TILE_FACTOR = 1.30539   # sd.cpp VAE::encode: tiles are larger on the encode side
f32 = np.float32


@dataclass
class TilingParams:
    """sd_tiling_params_t: tile_size_x/y (0 = default 32), target_overlap, rel_size_x/y (0 = off)."""
    tile_size_x: int = 0
    tile_size_y: int = 0
    target_overlap: float = 0.5
    rel_size_x: float = 0.0
    rel_size_y: float = 0.0

    @classmethod
    def parse(cls, tile_size: str | None = None, relative: str | None = None, overlap: float = 0.5) -> TilingParams:
        """From the CLI strings `--vae-tile-size 32x48` / `--vae-relative-tile-size 0.5x2`."""
        p = cls(target_overlap=float(overlap))
        if tile_size:
            p.tile_size_x, p.tile_size_y = _pair(tile_size, int, "--vae-tile-size")
        if relative:
            p.rel_size_x, p.rel_size_y = _pair(relative, float, "--vae-relative-tile-size")
        return p


def _pair(s: str, conv, flag: str):
    parts = str(s).split("x", 1)
    try:
        vals = [conv(p) for p in parts]
    except ValueError:
        raise UsageError(f"{flag}: {s!r} is not [X]x[Y] (e.g. 32x32 or 32)") from None
    return (vals[0], vals[0]) if len(vals) == 1 else tuple(vals)


def vae_tile_sizes(params: TilingParams, latent_x: int, latent_y: int,
                   encoding_factor: float = 1.0) -> tuple[int, int, float]:
    """(tile_size_x, tile_size_y, overlap) in latent pixels, as VAE::get_tile_sizes."""
    overlap = max(min(f32(params.target_overlap), f32(0.5)), f32(0.0))

    def size(requested: int, factor: float, latent: int) -> int:
        t = DEFAULT_TILE_SIZE
        factor = f32(factor)
        if factor > 0:
            if factor > 1.0:
                factor = f32(1) / (factor - factor * overlap + overlap)
            t = int(math.floor(float(f32(latent) * factor) + 0.5))   # std::round, positive
        elif requested >= MIN_TILE_SIZE:
            t = int(requested)
        t = int(f32(t) * f32(encoding_factor))
        return max(min(t, int(latent)), MIN_TILE_SIZE)

    return (size(params.tile_size_x, params.rel_size_x, latent_x),
            size(params.tile_size_y, params.rel_size_y, latent_y), float(overlap))


def calc_tiles(small: int, tile: int, overlap: float, circular: bool = False) -> tuple[int, float]:
    """sd_tiling_calc_tiles: (number of tiles, the overlap factor used) along one axis."""
    ov = int(f32(tile) * f32(overlap))
    non = tile - ov
    if circular:
        n = max(small // non, 1)
        fac = f32(tile - small // n) / f32(tile)
        if n == 1 and fac > 0:
            n, fac = 2, f32(0.5)
        return n, float(fac)
    n = (small - ov) // non
    over = ((n + 1) * non + ov) % small
    if over != non and over <= n * (tile // 2 - ov):
        n += 1
    fac = f32(tile * n - small) / f32(tile * (n - 1)) if n > 1 else f32("nan")
    if n <= 2:
        if small <= tile:
            n, fac = 1, f32(0)
        else:
            n, fac = 2, f32(2 * tile - small) / f32(tile)
    return n, float(fac)


@dataclass(frozen=True)
class Tile:
    x: int      # origin on the small (latent) side
    y: int
    skip_x: int  # columns / rows at the start that a previous tile already covers (not merged)
    skip_y: int


def tile_layout(small_w: int, small_h: int, tile_x: int, tile_y: int, overlap: float,
                circular=(False, False)):
    """(tiles, (tile_w, tile_h), (overlap_x, overlap_y)) on the small side, in sd.cpp's order."""
    nx, fx = calc_tiles(small_w, tile_x, overlap, circular[0])
    ny, fy = calc_tiles(small_h, tile_y, overlap, circular[1])
    ovx, ovy = int(f32(tile_x) * f32(fx)), int(f32(tile_y) * f32(fy))
    stepx, stepy = tile_x - ovx, tile_y - ovy
    tw, th = min(tile_x, small_w), min(tile_y, small_h)
    tiles = []
    y, last_y = 0, False
    while y < small_h and not last_y:
        dy = 0
        if not circular[1] and y + th >= small_h:
            y, dy, last_y = small_h - th, y - (small_h - th), True
        x, last_x = 0, False
        while x < small_w and not last_x:
            dx = 0
            if not circular[0] and x + tw >= small_w:
                x, dx, last_x = small_w - tw, x - (small_w - tw), True
            tiles.append(Tile(x, y, dx, dy))
            x += stepx
        y += stepy
    log.debug("vae tiling: %d x %d tiles of %dx%d, overlap %.3f, %.3f (target %.3f)", nx, ny, tw, th, fx, fy, overlap)
    return tiles, (tw, th), (ovx, ovy)


def smootherstep(t: np.ndarray) -> np.ndarray:
    t = np.asarray(t, np.float32)
    return t * t * t * (t * (f32(6) * t - f32(15)) + f32(10))


def _ramp(n: int, skip: int, ov: int, lo: bool, hi: bool) -> np.ndarray:
    """sd_tensor_merge_2d's per-axis factor min(f0, f1, 1) for positions skip..n-1."""
    i = np.arange(skip, n, dtype=np.float32)
    f = np.ones_like(i)
    if ov > 0:
        if lo:
            f = np.minimum(f, (i - f32(skip)) / f32(ov))
        if hi:
            f = np.minimum(f, (f32(n) - i) / f32(ov))
    return smootherstep(f)


def tiled_apply(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, scale: float, tile_size=DEFAULT_TILE_SIZE,
                overlap: float = 0.5, circular=(False, False), progress: Callable[[int, int], None] | None = None
                ) -> np.ndarray:
    """Run `fn` tile by tile over x [N, C, H, W] and blend, as sd.cpp's process_tiles_2d.

    `scale` is the size ratio output/input: 8 for an SD decode (tiles cut from the latent),
    1/8 (or -8) for an encode (tiles cut from the image so that the latent tiles are
    `tile_size`). `tile_size` (int or (x, y)) and `overlap` are on the latent side, as sd.cpp's
    tile size (see `vae_tile_sizes` for the CLI defaults). fn maps [N, C, h, w] to
    [N, C', h*scale, w*scale]. `progress(done, total)` is called after each tile."""
    x = np.asarray(x, np.float32)
    if x.ndim != 4:
        raise UsageError(f"tiled_apply: x must be [N, C, H, W], got shape {x.shape}")
    if scale < 0:
        scale = -1.0 / scale
    decode = scale >= 1
    f = int(round(scale if decode else 1.0 / scale))
    if f < 1 or abs((f if decode else 1.0 / f) - scale) > 1e-6:
        raise UsageError(f"tiled_apply: scale {scale} must be an integer factor or its inverse")
    tx, ty = (tile_size, tile_size) if np.isscalar(tile_size) else tuple(tile_size)
    if tx < 1 or ty < 1 or not 0 <= overlap <= 0.5:
        raise UsageError(f"tiled_apply: tile size {tile_size} must be positive and overlap {overlap} in [0, 0.5]")
    H, W = x.shape[2:]
    if not decode and (H % f or W % f):
        raise UsageError(f"tiled_apply: encode input {W}x{H} must be a multiple of {f}")
    sw, sh = (W, H) if decode else (W // f, H // f)
    ow, oh = (W * f, H * f) if decode else (sw, sh)
    cx, cy = bool(circular[0]), bool(circular[1])
    tiles, (tw, th), (ovx, ovy) = tile_layout(sw, sh, int(tx), int(ty), overlap, (cx, cy))
    fi = 1 if decode else f      # input pixels per small-side pixel
    fo = f if decode else 1      # output pixels per small-side pixel
    out = None
    blend = ovx > 0 or ovy > 0
    for k, t in enumerate(tiles):
        iy = (np.arange(th * fi) + t.y * fi) % H
        ix = (np.arange(tw * fi) + t.x * fi) % W
        y_t = np.asarray(fn(np.ascontiguousarray(x[:, :, iy[:, None], ix[None, :]])), np.float32)
        if y_t.ndim != 4 or y_t.shape[2:] != (th * fo, tw * fo):
            raise UsageError(f"tiled_apply: fn gave shape {y_t.shape} for a {tw * fi}x{th * fi} tile, "
                             f"expected [N, C, {th * fo}, {tw * fo}]")
        if out is None:
            out = np.zeros(y_t.shape[:2] + (oh, ow), np.float32)
        hh, ww = y_t.shape[2:]
        sx, sy = t.skip_x * fo, t.skip_y * fo
        oy = (np.arange(sy, hh) + t.y * fo) % oh
        ox = (np.arange(sx, ww) + t.x * fo) % ow
        region = (slice(None), slice(None), oy[:, None], ox[None, :])
        if blend:
            ox_ov, oy_ov = ovx * fo, ovy * fo
            wx = _ramp(ww, sx, ox_ov, cx or (t.x > 0), cx or (t.x * fo < ow - ww))
            wy = _ramp(hh, sy, oy_ov, cy or (t.y > 0), cy or (t.y * fo < oh - hh))
            out[region] += (y_t[:, :, sy:, sx:] * wy[:, None]) * wx[None, :]   # sd.cpp's order
        else:
            out[region] = y_t[:, :, sy:, sx:]
        if progress is not None:
            progress(k + 1, len(tiles))
    return out
