"""Qwen-Image / Wan-2.1 VAE on one frame against diffusers AutoencoderKLQwenImage goldens
(tools/make_qwen_image_goldens.py --only vae), the diffusers -> Wan names and the latent mean/std.
No torch here."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.vae.wan import LATENTS_MEAN, LATENTS_STD, PREFIX, WanVAE, diffusers_to_wan
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen_image_vae.npz")
_cache: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def fixture():
    if "z" not in _cache:
        z = np.load(FIX)
        _cache["z"] = {k: z[k] for k in z.files}
    return _cache["z"]


def _fold(v):
    """5-D conv weights fold their top dims, as the loaders (and sd.cpp) do."""
    return v.reshape((-1,) + v.shape[2:]) if v.ndim == 5 else v


def table(drop=(), f32=False):
    return {PREFIX + k[2:]: Tensor.from_numpy(np.ascontiguousarray(_fold(v.astype(np.float32) if f32 else v)))
            for k, v in fixture().items() if k.startswith("w:") and k[2:] not in drop}


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_decode_matches_diffusers():
    z = fixture()
    out = WanVAE(table()).decode(z["z"])
    assert out.shape == z["dec"].shape == (1, 3, 32, 48)
    assert rel_err(out, z["dec"]) <= 1e-4, rel_err(out, z["dec"])


def test_encode_matches_diffusers():
    z = fixture()
    vae = WanVAE(table(f32=True))
    out = vae.encode(z["x"])
    assert out.shape == z["mean"].shape == (1, 16, 4, 6)
    assert rel_err(out, z["mean"]) <= 1e-4, rel_err(out, z["mean"])
    assert vae.scale_factor == 8


def test_latent_normalisation_round_trip():
    lat = np.random.RandomState(0).randn(1, 16, 2, 3).astype(np.float32)
    d = WanVAE.to_diffusion(lat)
    np.testing.assert_allclose(d[0, :, 0, 0], (lat[0, :, 0, 0] - LATENTS_MEAN) / LATENTS_STD, rtol=1e-6)
    np.testing.assert_allclose(WanVAE.from_diffusion(d), lat, atol=1e-5)


def test_diffusers_names():
    m = diffusers_to_wan(["decoder.up_blocks.1.resnets.2.conv_shortcut.weight", "decoder.up_blocks.2.upsamplers.0.resample.1.bias",
                          "encoder.mid_block.resnets.1.norm2.gamma", "encoder.mid_block.attentions.0.to_qkv.weight",
                          "encoder.down_blocks.5.time_conv.weight", "quant_conv.bias", "post_quant_conv.weight",
                          "decoder.norm_out.gamma", "encoder.conv_in.bias", "decoder.conv_out.weight"])
    assert list(m.values()) == ["decoder.upsamples.6.shortcut.weight", "decoder.upsamples.11.resample.1.bias",
                                "encoder.middle.2.residual.3.gamma", "encoder.middle.1.to_qkv.weight",
                                "encoder.downsamples.5.time_conv.weight", "conv1.bias", "conv2.weight",
                                "decoder.head.0.gamma", "encoder.conv1.bias", "decoder.head.2.weight"]


def test_errors():
    z = fixture()
    with pytest.raises(ModelFileError, match="decoder"):
        WanVAE({})
    enc = [k[2:] for k in fixture() if k.startswith("w:encoder.")]
    dec_only = WanVAE(table(drop=enc))
    assert dec_only.decode(z["z"]).shape == (1, 3, 32, 48)
    with pytest.raises(UsageError, match="no encoder"):
        dec_only.encode(z["x"])
    vae = WanVAE(table())
    with pytest.raises(UsageError, match="channels"):
        vae.decode(z["z"][:, :8])
    with pytest.raises(UsageError, match="multiple of 8"):
        vae.encode(z["x"][:, :, :30])
