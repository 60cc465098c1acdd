"""TAESD / TAE against diffusers AutoencoderTiny and taesd.py (goldens from tools/make_vae_goldens.py),
and TAEF2's real weights (../shared) against PyTorch."""
import importlib.util
import json
import os

import numpy as np
import pytest

from sdrt.errors import ModelFileError, UsageError
from sdrt.models.vae.tae import TinyAutoencoder, patchify, unpatchify
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
_spec = importlib.util.spec_from_file_location("make_vae_goldens", os.path.join(ROOT, "tools", "make_vae_goldens.py"))
goldens = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goldens)
PSNR_TORCH = 37.29   # DESIGN.md point 4 / issue 4: PyTorch's score


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(os.path.join(FIX, "vae_tae.npz")))


def weights(gold, key, dtype=np.float32, rename=lambda k: k):
    w = goldens.make_weights(json.loads(str(gold[f"{key}_spec"])), int(gold[f"{key}_seed"]))
    return {rename(k): Tensor.from_numpy(v.astype(dtype), name=k) for k, v in w.items()}


def err(a, b):
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))


def _taesd_py_name(k):
    """diffusers `decoder.layers.N.x` -> taesd.py decoder file `N+1.x` (Clamp is its layer 0)."""
    side, _, rest = k.partition(".layers.")
    i, _, tail = rest.partition(".")
    return f"{int(i) + 1}.{tail}" if side == "decoder" else rest


def test_diffusers_layout(gold, one_thread):
    tae = TinyAutoencoder.from_table(weights(gold, "tiny", np.float16))
    cfg = tae.config
    assert (cfg.z_channels, cfg.channels, cfg.midblock_gn, cfg.decoder_offset) == (4, 8, False, 0)
    assert err(tae.encode(gold["tiny_x"]), gold["tiny_lat"]) <= 1e-4
    assert err(tae.decode(gold["tiny_z"]), gold["tiny_dec"]) <= 1e-4
    literal = TinyAutoencoder(decoder=weights(gold, "tiny"), decoder_prefix="decoder.layers.", folded_upsample=False)
    assert err(literal.decode(gold["tiny_z"]), gold["tiny_dec"]) <= 1e-4


def test_prefixed_and_taesd_py_layouts(gold, one_thread):
    t = weights(gold, "tiny")
    tae = TinyAutoencoder.from_table({"tae." + k: v for k, v in t.items()}, prefix="tae.")
    assert err(tae.decode(gold["tiny_z"]), gold["tiny_dec"]) <= 1e-4
    dec = {_taesd_py_name(k): v for k, v in t.items() if k.startswith("decoder.")}
    enc = {_taesd_py_name(k): v for k, v in t.items() if k.startswith("encoder.")}
    d = TinyAutoencoder.from_table(dec)
    assert d.config.decoder_offset == 1 and d.encoder is None
    assert err(d.decode(gold["tiny_z"]), gold["tiny_dec"]) <= 1e-4
    e = TinyAutoencoder.from_table(enc)
    assert e.decoder is None and err(e.encode(gold["tiny_x"]), gold["tiny_lat"]) <= 1e-4
    with pytest.raises(UsageError, match="no decoder"):
        e.decode(gold["tiny_z"])


def test_taef2_shaped(gold, one_thread):
    tae = TinyAutoencoder(decoder=weights(gold, "f2_dec"), encoder=weights(gold, "f2_enc"))
    assert tae.config.midblock_gn and tae.config.latent_channels == 128
    lat = tae.encode(gold["f2_x"])
    assert err(lat, gold["f2_lat"]) <= 1e-4
    zp = tae.encode(gold["f2_x"], patchified=True)
    assert err(zp, gold["f2_zp"]) <= 1e-4
    assert err(tae.decode(gold["f2_lat"]), gold["f2_dec"]) <= 1e-4
    assert err(tae.decode(gold["f2_zp"]), gold["f2_dec"]) <= 1e-4   # unpatchified first
    with pytest.raises(UsageError, match="channels"):
        tae.decode(np.zeros((1, 16, 4, 4), np.float32))


def test_patchify_roundtrip():
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 8)).astype(np.float32)
    p = F.compute(patchify(Tensor.from_numpy(x)))
    ref = x.reshape(2, 3, 3, 2, 4, 2).transpose(0, 1, 3, 5, 2, 4).reshape(2, 12, 3, 4)
    assert np.array_equal(p, ref)
    assert np.array_equal(F.compute(unpatchify(Tensor.from_numpy(p))), x)


def test_bad_tables(gold, one_thread):
    with pytest.raises(ModelFileError, match="not a TAESD"):
        TinyAutoencoder.from_table({"foo.weight": Tensor.from_numpy(np.zeros(3, np.float32))})
    t = weights(gold, "tiny")
    del t["decoder.layers.7.conv.2.weight"]
    with pytest.raises(ModelFileError, match="decoder.layers.7.conv.2.weight"):
        TinyAutoencoder.from_table(t)
    with pytest.raises(UsageError):
        TinyAutoencoder()


@pytest.fixture(scope="module")
def taef2_real():
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    paths = [os.path.join(shared, "models", f"taef2_{s}.pth") for s in ("encoder", "decoder")]
    img = os.path.join(shared, "images", "cat_1024.png")
    if not all(os.path.isfile(p) for p in paths + [img]):
        pytest.skip(f"TAEF2 weights / cat_1024.png not found under {shared}")
    from sdrt.io import open_model
    from sdrt.io.images import load_image, to_nchw
    enc, dec = (open_model(p).tensors for p in paths)
    tae = TinyAutoencoder(decoder=dec, encoder=enc)
    x = to_nchw(load_image(img, size=(512, 512), resample="lanczos"))
    z = tae.encode(x)
    return tae, x, z, tae.decode(z)


def test_taef2_real_weights_psnr(taef2_real):
    """Encode + decode of the 512x512 cat scores PyTorch's 37.29 dB (DESIGN.md point 4)."""
    from sdrt.io.images import psnr
    tae, x, z, y = taef2_real
    ref = np.load(os.path.join(FIX, "vae_taef2_real.npz"))
    assert tae.config.z_channels == 32 and tae.config.midblock_gn and tae.config.decoder_offset == 1
    score = psnr(np.clip(y, 0, 1), x)
    assert abs(score - PSNR_TORCH) <= 0.05, score
    assert abs(score - float(ref["psnr"])) <= 0.005, (score, float(ref["psnr"]))
    assert np.abs(z - ref["latent"]).max() <= 1e-3 * np.abs(ref["latent"]).max()
    assert np.abs(y[:, :, 192:320, 192:320] - ref["crop"]).max() <= 1e-4
