"""The Flux VAE (16 latent channels, no quant convs, scale 0.3611 / shift 0.1159) against diffusers
(tools/make_flux_goldens.py --only vae; no torch here), decoded plainly and tiled."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt.engine.vae_tiling import tiled_apply
from sdrt.models.vae.autoencoder_kl import AutoencoderKL, gaussian_sample, latent_scale_shift
from sdrt.ops.tensor import Tensor
from sdrt.ops.threads import get_threads, set_threads

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "flux_vae.npz")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(FIX))


@pytest.fixture(scope="module")
def vae(gold):
    return AutoencoderKL({k[2:]: Tensor.from_numpy(v) for k, v in gold.items() if k.startswith("w:")})


def err(a, b):
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))


def test_config_is_the_flux_vae(vae):
    cfg = vae.config
    assert (cfg.z_channels, cfg.embed_dim, cfg.use_quant, cfg.double_z) == (16, 16, False, True)
    assert cfg.level_channels == (32, 32, 64) and cfg.downscale == 4
    assert vae.quant_conv is None and vae.post_quant_conv is None
    assert latent_scale_shift("flux") == (0.3611, 0.1159)


def test_encode_decode_match_diffusers(gold, vae):
    scale, shift = latent_scale_shift("flux")
    mom = vae.encode(gold["x"])
    assert mom.shape == (1, 32, 8, 8) and err(mom, gold["moments"]) <= 1e-4
    # FluxPipeline's latent: (mode - shift) * scale
    assert err((gaussian_sample(mom) - shift) * scale, gold["latent"]) <= 1e-4
    # and its decode: vae.decode(z / scale + shift)
    dec = vae.decode(gold["z"] / np.float32(scale) + np.float32(shift))
    assert dec.shape == (2, 3, 32, 32) and err(dec, gold["dec"]) <= 1e-4


def test_tiled_decode(gold, vae):
    """--vae-tiling on a 16-channel latent: one tile covering the latent is the plain decode;
    4x4 tiles run tile by tile (3x3 tiles) and give another image (a tile's decode sees only its
    tile; with random weights the difference is large, so only shape and finiteness are checked)."""
    scale, shift = latent_scale_shift("flux")
    z = gold["z"][:1] / np.float32(scale) + np.float32(shift)
    plain = vae.decode(z)
    whole = tiled_apply(vae.decode, z, 4, tile_size=8, overlap=0.5)
    np.testing.assert_allclose(whole, plain, rtol=0, atol=1e-5)
    calls = []
    tiled = tiled_apply(vae.decode, z, 4, tile_size=4, overlap=0.5, progress=lambda d, t: calls.append(t))
    assert tiled.shape == plain.shape and np.isfinite(tiled).all()
    assert len(calls) == 9 and err(tiled, plain) > 1e-3
