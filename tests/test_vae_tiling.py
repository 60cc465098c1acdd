"""VAE tiling: the tile layout and blend against a literal (loop by loop) transcription of sd.cpp's
process_tiles_2d / sd_tensor_merge_2d, and tiled vs untiled decodes."""
import importlib.util
import json
import os

import numpy as np
import pytest

from sdrt.engine.vae_tiling import (
    ENCODE_TILE_FACTOR,
    TilingParams,
    calc_tiles,
    tile_layout,
    tiled_apply,
    vae_tile_sizes,
)
from sdrt.errors import UsageError
from sdrt.ops.threads import get_threads, set_threads

f32 = np.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- an independent transcription of ggml_extend.hpp (loops kept as in C) --------------------
def ref_calc_tiles(small, tile, overlap, circular):
    ov = int(f32(tile) * f32(overlap))
    non = tile - ov
    if circular:
        n = small // non
        if n < 1:
            n = 1
        fac = f32(tile - small // n) / f32(tile)
        if n == 1 and fac > 0:
            n += 1
            fac = f32(0.5)
        return n, fac
    n = (small - ov) // non
    over = ((n + 1) * non + ov) % small
    if over != non and over <= n * (tile // 2 - ov):
        n += 1
    fac = f32(tile * n - small) / f32(tile * (n - 1)) if n != 1 else f32(0)
    if n <= 2:
        if small <= tile:
            n, fac = 1, f32(0)
        else:
            n, fac = 2, f32(2 * tile - small) / f32(tile)
    return n, fac


def smoother(x):
    x = f32(x)
    assert 0 <= x <= 1
    return x * x * x * (x * (f32(6) * x - f32(15)) + f32(10))


def ref_merge(inp, out, x, y, ovx, ovy, cx, cy, xs, ys):
    _, _, h, w = inp.shape
    _, _, H, W = out.shape
    for iy in range(ys, h):
        for ix in range(xs, w):
            ox, oy = (x + ix) % W, (y + iy) % H
            nv = inp[:, :, iy, ix]
            if ovx > 0 or ovy > 0:
                xf0 = f32(ix - xs) / f32(ovx) if (cx or (ovx > 0 and x > 0)) else f32(1)
                xf1 = f32(w - ix) / f32(ovx) if (cx or (ovx > 0 and x < W - w)) else f32(1)
                yf0 = f32(iy - ys) / f32(ovy) if (cy or (ovy > 0 and y > 0)) else f32(1)
                yf1 = f32(h - iy) / f32(ovy) if (cy or (ovy > 0 and y < H - h)) else f32(1)
                xf, yf = min(min(xf0, xf1), f32(1)), min(min(yf0, yf1), f32(1))
                out[:, :, oy, ox] = out[:, :, oy, ox] + nv * smoother(yf) * smoother(xf)
            else:
                out[:, :, oy, ox] = nv


def ref_process(inp, out_w, out_h, scale, tsx, tsy, overlap, cx, cy, fn):
    in_h, in_w = inp.shape[2:]
    decode = out_w > in_w
    sw, sh = (in_w, in_h) if decode else (out_w, out_h)
    _, fx = ref_calc_tiles(sw, tsx, overlap, cx)
    _, fy = ref_calc_tiles(sh, tsy, overlap, cy)
    ovx, ovy = int(f32(tsx) * fx), int(f32(tsy) * fy)
    nonx, nony = tsx - ovx, tsy - ovy
    tw, th = min(tsx, sw), min(tsy, sh)
    itw, ith = (tw, th) if decode else (tw * scale, th * scale)
    out = None
    y, last_y, last_x, count = 0, False, False, 0
    while y < sh and not last_y:
        dy = 0
        if not cy and y + th >= sh:
            oy = y
            y = sh - th
            dy = (oy - y) * (scale if decode else 1)
            last_y = True
        x = 0
        while x < sw and not last_x:
            dx = 0
            if not cx and x + tw >= sw:
                ox = x
                x = sw - tw
                dx = (ox - x) * (scale if decode else 1)
                last_x = True
            xin, yin = (x, y) if decode else (scale * x, scale * y)
            xo, yo = (x * scale, y * scale) if decode else (x, y)
            ovxo, ovyo = (ovx * scale, ovy * scale) if decode else (ovx, ovy)
            tile = np.empty(inp.shape[:2] + (ith, itw), f32)   # sd_tensor_split_2d
            for iy in range(ith):
                for ix in range(itw):
                    tile[:, :, iy, ix] = inp[:, :, (iy + yin) % in_h, (ix + xin) % in_w]
            t_out = fn(tile)
            if out is None:
                out = np.zeros(t_out.shape[:2] + (out_h, out_w), f32)
            ref_merge(t_out, out, xo, yo, ovxo, ovyo, cx, cy, dx, dy)
            count += 1
            x += nonx
        last_x = False
        y += nony
    return out, count


def run_ref(x, scale, tile, overlap, circular=(False, False), fn=None):
    decode = scale >= 1
    f = int(scale if decode else round(1 / scale))
    H, W = x.shape[2:]
    ow, oh = (W * f, H * f) if decode else (W // f, H // f)
    return ref_process(x, ow, oh, f, tile[0], tile[1], overlap, circular[0], circular[1], fn)


def tile_fn(scale):
    """A per-tile map whose output depends on the whole tile (so wrong blending shows)."""
    def fn(t):
        if scale >= 1:
            up = t.repeat(scale, axis=2).repeat(scale, axis=3)
        else:
            f = int(round(1 / scale))
            n, c, h, w = t.shape
            up = t.reshape(n, c, h // f, f, w // f, f).mean(axis=(3, 5))
        return (up[:, :3] * f32(1.5) + t.mean(dtype=np.float32)).astype(f32)
    return fn


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("small,tile,ov,circ", [(64, 32, 0.5, False), (100, 32, 0.5, False), (33, 32, 0.5, False),
                                                 (32, 32, 0.5, False), (20, 32, 0.5, False), (97, 41, 0.5, False),
                                                 (70, 16, 0.25, False), (64, 16, 0.0, False), (50, 12, 0.3, True),
                                                 (64, 32, 0.5, True), (20, 32, 0.5, True)])
def test_calc_tiles_matches_transcription(small, tile, ov, circ):
    n, fac = calc_tiles(small, tile, ov, circ)
    rn, rfac = ref_calc_tiles(small, tile, ov, circ)
    assert (n, f32(fac)) == (rn, rfac)


def test_known_layouts():
    assert calc_tiles(64, 32, 0.5) == (3, 0.5)     # 64x64 latent (512 px): 3x3 tiles of 32, overlap 16
    tiles, size, ov = tile_layout(64, 64, 32, 32, 0.5)
    assert len(tiles) == 9 and size == (32, 32) and ov == (16, 16)
    assert [(t.x, t.y) for t in tiles[:3]] == [(0, 0), (16, 0), (32, 0)]
    assert calc_tiles(20, 32, 0.5) == (1, 0.0)
    tiles, size, ov = tile_layout(100, 20, 32, 32, 0.5)
    assert size == (32, 20) and {t.y for t in tiles} == {0} and ov == (15, 0)
    assert [t.x for t in tiles] == [0, 17, 34, 51, 68]
    tiles, _, ov = tile_layout(90, 90, 41, 41, 0.5)
    assert [(t.x, t.skip_x) for t in tiles[:3]] == [(0, 0), (25, 0), (49, 1)]   # last moved back by 1


@pytest.mark.parametrize("shape,scale,tile,ov,circ", [
    ((1, 4, 12, 20), 8, (8, 8), 0.5, (False, False)),
    ((2, 4, 10, 9), 4, (6, 4), 0.3, (False, False)),
    ((1, 4, 13, 11), 2, (5, 7), 0.5, (True, False)),
    ((1, 4, 12, 12), 2, (6, 6), 0.5, (True, True)),
    ((1, 4, 9, 9), 2, (4, 4), 0.0, (False, False)),
    ((1, 3, 48, 40), 1 / 4, (5, 4), 0.5, (False, False)),
])
def test_tiled_apply_matches_transcription(shape, scale, tile, ov, circ):
    x = np.random.default_rng(3).standard_normal(shape).astype(f32)
    fn = tile_fn(scale)
    got = tiled_apply(fn, x, scale, tile, ov, circ)
    ref, count = run_ref(x, scale, tile, ov, circ, fn)
    assert got.shape == ref.shape and count > 1
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [8, 1 / 8])
def test_pointwise_fn_tiles_seamlessly(scale):
    """The smootherstep weights sum to 1 where tiles overlap: a per-pixel map tiles exactly."""
    x = np.random.default_rng(4).standard_normal((1, 4, 40, 56) if scale > 1 else (1, 3, 320, 448)).astype(f32)

    def fn(t):
        if scale > 1:
            return np.tanh(t[:, :3]).repeat(8, axis=2).repeat(8, axis=3)
        n, c, h, w = t.shape
        return np.tanh(t).reshape(n, c, h // 8, 8, w // 8, 8).mean(axis=(3, 5))
    np.testing.assert_allclose(tiled_apply(fn, x, scale, 16, 0.5), fn(x), rtol=0, atol=2e-6)


def test_tiled_vae_decode_close_to_untiled():
    """A tiny AutoencoderKL (the diffusers golden config `g8`) decoded in tiles. GroupNorm
    statistics and the mid attention see one tile only (as in sd.cpp), so with random weights
    tiles differ from the whole plane: one tile covering the plane is exact, overlapping tiles
    are close and closer than hard seams."""
    from sdrt.models.vae.autoencoder_kl import AutoencoderKL
    from sdrt.ops.tensor import Tensor
    spec = importlib.util.spec_from_file_location("mvg", os.path.join(ROOT, "tools", "make_vae_goldens.py"))
    mvg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mvg)
    g = np.load(os.path.join(ROOT, "tests", "fixtures", "vae_kl.npz"))
    w = mvg.make_weights(json.loads(str(g["g8_spec"])), int(g["g8_seed"]))
    vae = AutoencoderKL({k: Tensor.from_numpy(v) for k, v in w.items()}, groups=8)
    z = np.random.default_rng(5).standard_normal((1, 4, 24, 24)).astype(f32)
    full = vae.decode(z)
    np.testing.assert_allclose(tiled_apply(vae.decode, z, 2, 32, 0.5), full, rtol=0, atol=1e-6)
    blended = tiled_apply(vae.decode, z, 2, 16, 0.5)     # 2x2 tiles of 16, overlap 8
    seams = tiled_apply(vae.decode, z, 2, 12, 0.0)       # 2x2 tiles of 12, no blending
    assert blended.shape == full.shape
    e_blend, e_seam = (float(np.abs(t - full).mean() / np.abs(full).mean()) for t in (blended, seams))
    assert e_blend < 0.2 and e_blend < 0.5 * e_seam, (e_blend, e_seam)   # measured 0.098, 0.40
    assert np.corrcoef(blended.ravel(), full.ravel())[0, 1] > 0.98       # measured 0.995


def test_vae_tile_sizes():
    assert vae_tile_sizes(TilingParams(), 64, 64) == (32, 32, 0.5)
    assert vae_tile_sizes(TilingParams(), 64, 20) == (32, 20, 0.5)
    assert vae_tile_sizes(TilingParams(), 64, 64, ENCODE_TILE_FACTOR)[:2] == (41, 41)
    assert vae_tile_sizes(TilingParams.parse("48x24"), 128, 128)[:2] == (48, 24)
    assert vae_tile_sizes(TilingParams.parse("2x3"), 128, 128)[:2] == (32, 32)    # < 4: the default
    assert vae_tile_sizes(TilingParams.parse(relative="0.5"), 100, 64)[:2] == (50, 32)
    # 2 tiles per dim with overlap 0.5: factor 1 / (2 - 1 + 0.5) -> round(96 / 1.5)
    assert vae_tile_sizes(TilingParams.parse(relative="2x3", overlap=0.5), 96, 96)[:2] == (64, 48)
    assert vae_tile_sizes(TilingParams(target_overlap=0.9), 64, 64)[2] == 0.5
    with pytest.raises(UsageError, match="vae-tile-size"):
        TilingParams.parse("axb")


def test_bad_arguments():
    x = np.zeros((1, 4, 8, 8), f32)
    with pytest.raises(UsageError):
        tiled_apply(lambda t: t, x[0], 8)
    with pytest.raises(UsageError):
        tiled_apply(lambda t: t, x, 3.5)
    with pytest.raises(UsageError, match="fn gave shape"):
        tiled_apply(lambda t: t, x, 8, 4)
