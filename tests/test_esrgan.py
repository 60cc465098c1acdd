"""ESRGAN (issue 16, done-means 3): sdrt's RRDBNet against spandrel's (goldens made by
tools/make_esrgan_goldens.py; the weights come from tests/esrgan_weights.py with the seeds there),
checkpoint forms and scale detection as sd.cpp's, tiling, `-M upscale` and `--upscale-model`."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from esrgan_weights import basicsr_state, checksum  # noqa: E402

from sdrt.engine.stages import decode_to_uint8  # noqa: E402
from sdrt.engine.upscaler import Upscaler  # noqa: E402
from sdrt.errors import ModelFileError, UsageError  # noqa: E402
from sdrt.io import write_safetensors  # noqa: E402
from sdrt.models.esrgan import RRDBNet, detect_esrgan  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "esrgan_goldens.npz")
CAT = os.path.join(os.path.dirname(ROOT), "shared", "images", "cat_1024.png")
# tools/make_esrgan_goldens.py's cases: (name, scale, layout, num_block); seed = index
NF, GC = 8, 32
CASES = [("x4_new", 4, "new", 1), ("x2_new", 2, "new", 1), ("x1_new", 1, "new", 1),
         ("x4_old", 4, "old", 2), ("x2_old", 2, "old", 1), ("x1_old", 1, "old", 1)]
CAT_SEED, CAT_NET, CAT_SIZE, CAT_STD, CAT_LAST_BIAS = 100, (32, 32, 2, 4), 128, 1.0, 0.5


def psnr(a, b, peak=1.0):
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(peak * peak / mse)


@pytest.fixture(scope="module")
def goldens():
    return np.load(FIX)


def case_table(z, seed, name, scale, layout, nb) -> dict:
    sd = basicsr_state(seed, NF, GC, nb, scale)
    assert checksum(sd) == pytest.approx(float(z[f"{name}/checksum"]), rel=1e-12), \
        "numpy's random stream changed: run tools/make_esrgan_goldens.py again"
    if layout == "old":
        m = dict(zip(z[f"{name}/new_names"].tolist(), z[f"{name}/old_names"].tolist()))
        sd = {m[k]: v for k, v in sd.items()}
    return sd


def tensors(sd: dict) -> dict:
    return {k: Tensor.from_numpy(np.ascontiguousarray(v), name=k) for k, v in sd.items()}


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_rrdbnet_matches_spandrel(goldens, i):
    name, scale, layout, nb = CASES[i]
    sd = case_table(goldens, i, name, scale, layout, nb)
    net = RRDBNet(tensors(sd), source=name)
    assert (net.scale, net.config.num_block, net.config.old_names) == (scale, nb, layout == "old")
    y = net(goldens[f"{name}/x"])
    ref = goldens[f"{name}/y"]
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, atol=2e-5, rtol=1e-4)


def test_detection_as_sd_cpp():
    # BasicSR names: the scale from conv_up1/conv_up2; a params_ema wrapper looked through
    new = [f"params_ema.{k}" for k in basicsr_state(0, 8, 32, 3, 4)] + ["params.conv_first.weight"]
    assert detect_esrgan(new) == ("params_ema.", False, 4, 3)
    assert detect_esrgan(basicsr_state(0, 8, 32, 1, 2))[1:] == (False, 2, 1)
    # old names: the highest model.N decides (<= 4: x1, <= 7: x2, else x4); blocks from model.1.sub.N.RDB
    old = ["model.0.weight", "model.1.sub.0.RDB1.conv1.0.weight", "model.1.sub.5.RDB3.conv5.0.weight",
           "model.1.sub.6.weight", "model.3.weight", "model.6.weight", "model.8.weight", "model.10.weight"]
    assert detect_esrgan(old) == ("", True, 4, 6)
    assert detect_esrgan(old[:5] + ["model.5.weight", "model.7.weight"])[2] == 2
    assert detect_esrgan(old[:4] + ["model.2.weight", "model.4.weight"])[2] == 1


def test_realesrgan_pth_params_ema():
    """A RealESRGAN .pth ({"params_ema": ..., "params": ...}, torch.save's zip pickle): params_ema is read."""
    path = os.path.join(ROOT, "tests", "fixtures", "esrgan_params_ema.pth")
    sd = basicsr_state(200, 4, 4, 1, 4)
    x = np.random.default_rng(0).random((1, 3, 6, 5), dtype=np.float32)
    up = Upscaler.load(path, wtype="f32")
    assert up.scale == 4
    np.testing.assert_array_equal(up.upscale_tensor(x), RRDBNet(tensors(sd))(x))
    # the default: sd-cli's F16 conv weights (biases F32)
    up16 = Upscaler.load(path)
    sd16 = {k: v.astype(np.float16) if v.ndim == 4 else v for k, v in sd.items()}
    np.testing.assert_array_equal(up16.upscale_tensor(x), RRDBNet(tensors(sd16))(x))


def test_bad_files(tmp_path):
    with pytest.raises(ModelFileError, match="not an ESRGAN"):
        RRDBNet(tensors({"conv.weight": np.zeros((4, 3, 3, 3), np.float32)}))
    sd = basicsr_state(0, 8, 32, 1, 4)
    del sd["conv_hr.bias"]
    with pytest.raises(ModelFileError, match="conv_hr.bias"):
        RRDBNet(tensors(sd))
    sd = basicsr_state(0, 8, 32, 1, 4)
    sd["conv_up1.weight"] = np.zeros((8, 9, 3, 3), np.float32)
    with pytest.raises(ModelFileError, match="conv_up1.weight has shape"):
        RRDBNet(tensors(sd))
    with pytest.raises(UsageError, match="no such file"):
        Upscaler.load(str(tmp_path / "missing.pth"))


def test_tiled_equals_untiled(goldens):
    """--upscale-tile-size: 96x80 input in 32-pixel tiles (4 x 3 tiles, overlap 0.25, smootherstep
    blend) = whole within 50 dB (the tiles' borders see less context: not bit-equal, as in sd.cpp)."""
    sd = basicsr_state(3, NF, GC, 1, 4)
    net = RRDBNet(tensors(sd))
    x = np.random.default_rng(5).random((1, 3, 80, 96), dtype=np.float32)
    whole = Upscaler(net, tile_size=0).upscale_tensor(x)
    tiled = Upscaler(net, tile_size=32).upscale_tensor(x)
    assert whole.shape == tiled.shape == (1, 3, 320, 384)
    p = psnr(tiled, whole, peak=float(whole.max() - whole.min()))
    print(f"tiled vs untiled: {p:.1f} dB")
    assert p >= 50.0
    # the tile size the image fits in runs it whole (sd.cpp's condition)
    np.testing.assert_array_equal(Upscaler(net, tile_size=96).upscale_tensor(x), whole)


def test_cat_x4_matches_pytorch(goldens):
    """cat_1024.png box-downscaled to 128x128, x4 with a random 2-block net: >= 40 dB from spandrel's
    uint8 image (the tiled default, 128-pixel tiles, runs it whole; 64-pixel tiles too)."""
    if not os.path.isfile(CAT):
        pytest.skip(f"ESRGAN cat test: {CAT} is absent (the shared images folder beside the repo)")
    from PIL import Image
    img = np.asarray(Image.open(CAT).convert("RGB").resize((CAT_SIZE, CAT_SIZE), Image.BOX), np.uint8)
    x = img.astype(np.float32) / np.float32(255)
    assert x.astype(np.float64).sum() == pytest.approx(float(goldens["cat/x_sum"]), rel=1e-9), \
        "the downscaled cat differs from the goldens' (Pillow changed?): run tools/make_esrgan_goldens.py"
    sd = basicsr_state(CAT_SEED, *CAT_NET, std=CAT_STD, last_bias=CAT_LAST_BIAS)
    assert checksum(sd) == pytest.approx(float(goldens["cat/checksum"]), rel=1e-12)
    up = Upscaler(RRDBNet(tensors(sd)), tile_size=128)
    ours = up.upscale(img)
    ref = goldens["cat/y"]
    p = psnr(ours, ref, peak=255.0)
    print(f"cat x4 vs PyTorch: {p:.2f} dB")
    assert ours.shape == (512, 512, 3) and p >= 40.0
    up.tile_size = 64
    p_tiled = psnr(up.upscale(img), ref, peak=255.0)
    print(f"cat x4 tiled (64) vs PyTorch: {p_tiled:.2f} dB")
    assert p_tiled >= 40.0


def test_cli_upscale_mode(tmp_path):
    """-M upscale -i in.png --upscale-model x.safetensors --upscale-repeats 2 -o out.png (x2 model: 4x)."""
    from PIL import Image

    from sdrt.cli.main import main
    sd = basicsr_state(1, NF, GC, 1, 2)
    model = str(tmp_path / "x2.safetensors")
    write_safetensors(model, sd)
    src = (np.random.default_rng(2).random((10, 12, 3)) * 255).astype(np.uint8)
    Image.fromarray(src).save(tmp_path / "in.png")
    out = str(tmp_path / "out.png")
    rc = main(["-M", "upscale", "-i", str(tmp_path / "in.png"), "--upscale-model", model, "--upscale-repeats", "2",
               "--upscale-tile-size", "8", "-o", out])
    assert rc == 0
    got = np.asarray(Image.open(out).convert("RGB"))
    net = RRDBNet(tensors({k: v.astype(np.float16) if v.ndim == 4 else v for k, v in sd.items()}))  # sd-cli's F16
    up = Upscaler(net, tile_size=8)
    want = up.upscale(up.upscale(src))
    assert got.shape == (40, 48, 3)
    np.testing.assert_array_equal(got, want)
    assert main(["-M", "upscale", "-i", str(tmp_path / "in.png"), "-o", out]) == 2      # no model: a usage error


def test_upscale_uint8_rounding():
    """upscale() converts as tensor_to_sd_image (clamp, v * 255 + 0.5 truncated)."""
    class Ident:
        scale = 1
        config = None

        def __call__(self, x, backend="cpu"):
            return x * np.float32(1.5) - np.float32(0.25)
    img = np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5
    x = img.astype(np.float32)[None].transpose(0, 3, 1, 2) / np.float32(255)
    np.testing.assert_array_equal(Upscaler(Ident()).upscale(img),
                                  decode_to_uint8(x * np.float32(1.5) - np.float32(0.25)))
