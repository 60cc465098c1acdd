"""AutoencoderKL against diffusers (goldens from tools/make_vae_goldens.py; no torch here)."""
import importlib.util
import json
import os

import numpy as np
import pytest

from sdrt.errors import ModelFileError, UsageError
from sdrt.models.vae.autoencoder_kl import (
    LATENT_SCALE_SHIFT,
    AutoencoderKL,
    AutoencoderKLConfig,
    gaussian_sample,
    latent_scale_shift,
)
from sdrt.ops.tensor import Tensor
from sdrt.ops.threads import get_threads, set_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "vae_kl.npz")
_spec = importlib.util.spec_from_file_location("make_vae_goldens", os.path.join(ROOT, "tools", "make_vae_goldens.py"))
goldens = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goldens)
GROUPS = {"g32": 32, "g8": 8, "noquant": 8}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(FIX))


def table(gold, case, dtype=np.float32, conv_attn=False):
    spec = json.loads(str(gold[f"{case}_spec"]))
    w = goldens.make_weights(spec, int(gold[f"{case}_seed"]))
    out = {}
    for name, v in w.items():
        if conv_attn and ".mid.attn_1." in name and v.ndim == 2:
            v = v.reshape(v.shape + (1, 1))   # the LDM checkpoint layout: 1x1 convs
        out[name] = Tensor.from_numpy(v.astype(dtype), name=name)
    return out


def err(a, b):
    """max abs error scaled by the golden's magnitude (at least 1)."""
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("case,dtype,conv_attn,folded", [
    ("g32", np.float16, True, True), ("g8", np.float32, False, True), ("noquant", np.float32, True, True),
    ("g32", np.float32, False, False)])
def test_decode_encode_match_diffusers(gold, case, dtype, conv_attn, folded):
    vae = AutoencoderKL(table(gold, case, dtype, conv_attn), groups=GROUPS[case], folded_upsample=folded)
    dec = vae.decode(gold[f"{case}_z"])
    assert dec.shape == gold[f"{case}_dec"].shape
    assert err(dec, gold[f"{case}_dec"]) <= 1e-4
    mom = vae.encode(gold[f"{case}_x"])
    assert err(mom, gold[f"{case}_moments"]) <= 1e-4
    assert err(gaussian_sample(mom, gold[f"{case}_noise"]), gold[f"{case}_sample"]) <= 1e-4
    assert np.array_equal(vae.encode_mean(gold[f"{case}_x"]), mom[:, :mom.shape[1] // 2])


def test_config_from_weights(gold):
    cfg = AutoencoderKLConfig.detect_from_weights(table(gold, "g32"))
    assert (cfg.ch, cfg.ch_mult, cfg.num_res_blocks, cfg.z_channels, cfg.embed_dim) == (32, (1, 2), 1, 4, 4)
    assert cfg.use_quant and cfg.double_z and cfg.has_encoder and cfg.has_decoder and cfg.downscale == 2
    nq = AutoencoderKLConfig.detect_from_weights(table(gold, "noquant"))
    assert (nq.level_channels, nq.num_res_blocks, nq.z_channels, nq.use_quant) == ((16, 32), 2, 16, False)


def test_decoder_only_table(gold):
    t = {k: v for k, v in table(gold, "g8").items()
         if ".encoder." not in k and not k.startswith("first_stage_model.quant")}
    vae = AutoencoderKL(t, groups=8)
    assert vae.encoder is None and vae.config.has_decoder
    assert err(vae.decode(gold["g8_z"][:1]), gold["g8_dec"][:1]) <= 1e-4
    with pytest.raises(UsageError, match="no encoder"):
        vae.encode(gold["g8_x"])


def test_other_prefix(gold):
    t = {"vae." + k[len("first_stage_model."):]: v for k, v in table(gold, "g8").items()}
    vae = AutoencoderKL(t, prefix="vae.", groups=8)
    assert err(vae.decode(gold["g8_z"]), gold["g8_dec"]) <= 1e-4


def test_bad_weights_and_inputs(gold):
    t = table(gold, "g32")
    with pytest.raises(ModelFileError, match="decoder.conv_in.weight"):
        AutoencoderKL({}, prefix="first_stage_model.")
    bad = dict(t)
    del bad["first_stage_model.decoder.up.1.block.0.norm2.bias"]
    with pytest.raises(ModelFileError, match="decoder.up.1.block.0.norm2.bias"):
        AutoencoderKL(bad)
    bad = dict(t)
    bad["first_stage_model.decoder.mid.attn_1.q.weight"] = Tensor.from_numpy(np.zeros((64, 32), np.float32))
    with pytest.raises(ModelFileError, match="attn_1.q.weight"):
        AutoencoderKL(bad)
    vae = AutoencoderKL(t)
    with pytest.raises(UsageError, match="channels"):
        vae.decode(np.zeros((1, 3, 8, 8), np.float32))
    with pytest.raises(UsageError, match="multiples of 2"):
        vae.encode(np.zeros((1, 3, 9, 8), np.float32))
    with pytest.raises(UsageError):
        vae.decode(np.zeros((4, 8, 8), np.float32))


def test_gaussian_sample_and_scales():
    m = np.concatenate([np.full((1, 2, 2, 2), 0.5, np.float32), np.full((1, 2, 2, 2), 100.0, np.float32)], 1)
    s = gaussian_sample(m, np.ones((1, 2, 2, 2), np.float32))
    assert np.allclose(s, 0.5 + np.exp(10.0))   # logvar clamped to 20
    with pytest.raises(UsageError):
        gaussian_sample(m, np.ones((1, 4, 2, 2), np.float32))
    assert latent_scale_shift("sd1") == (0.18215, 0.0) and LATENT_SCALE_SHIFT["sdxl"] == (0.13025, 0.0)
    with pytest.raises(UsageError):
        latent_scale_shift("nope")


def test_image_helpers(tmp_path):
    from PIL import Image

    from sdrt.io.images import from_nchw, load_image, psnr, save_image, to_nchw, to_uint8
    v = np.array([-0.5, 0.0, 0.001, 0.5, 0.998, 1.0, 2.0, np.nan], np.float32)
    assert to_uint8(v).tolist() == [0, 0, 0, 128, 254, 255, 255, 0]   # sd.cpp: v*255 + 0.5, clamped
    img = np.random.default_rng(0).uniform(0, 1, (6, 5, 3)).astype(np.float32)
    p = tmp_path / "a.png"
    save_image(p, img, text={"parameters": "a cat"})
    with Image.open(p) as im:
        assert im.text["parameters"] == "a cat" and im.size == (5, 6)
    back = load_image(p)
    assert back.shape == (6, 5, 3) and np.array_equal(back, to_uint8(img) / np.float32(255))
    assert load_image(p, size=(10, 12)).shape == (12, 10, 3)
    assert np.array_equal(from_nchw(to_nchw(back))[0], back) and psnr(back, back) == float("inf")
    save_image(tmp_path / "b.jpg", img, quality=95)
    assert load_image(tmp_path / "b.jpg").shape == (6, 5, 3)
    with pytest.raises(UsageError, match="no such image"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(UsageError, match="cannot read image"):
        load_image(tmp_path / "bad.png")
    with pytest.raises(UsageError, match="extension"):
        save_image(tmp_path / "c.xyz", img)
