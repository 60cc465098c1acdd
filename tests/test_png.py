"""sdrt.io.png: sd-cli's infotext, our PNG encoder, JPEG/WebP metadata, output names, atomic writes."""
import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from sdrt.errors import SdrtError, UsageError
from sdrt.io import png as P

# What sd-cli (stable-diffusion-cpp-python 0.4.7's vendored sd.cpp) wrote into the PNG of
#   sd-cli -m sd15_rand_f16.safetensors -p "a lovely cat" -W 256 -H 256 --steps 4
#          --sampling-method euler_a --rng cuda -s 42 --type f32
SDCLI_TEXT = (
    'a lovely cat\nSteps: 4, CFG scale: 7.000000, Guidance: 3.500000, Eta: inf, Seed: 42, Size: 256x256, '
    'Model: sd15_rand_f16.safetensors, RNG: cuda, Sampler: euler_a discrete, Version: stable-diffusion.cpp, '
    'SDCPP: {"auto_resize_ref_image":true,"clip_skip":-1,"control_strength":0.8999999761581421,"generator":'
    '{"commit":"unknown","name":"stable-diffusion.cpp","version":"unknown"},"height":256,"increase_ref_index":false,'
    '"mode":"img_gen","models":{"model":"sd15_rand_f16.safetensors"},"prompt":{"negative":"","positive":'
    '"a lovely cat"},"rng":"cuda","sampling":{"custom_sigmas":[],"eta":null,"flow_shift":null,"guidance":'
    '{"distilled_guidance":3.5,"img_cfg":null,"slg":{"end":0.20000000298023224,"layers":[7,8,9],"scale":0.0,'
    '"start":0.009999999776482582},"txt_cfg":7.0},"method":"euler_a","scheduler":"discrete","shifted_timestep":0,'
    '"steps":4},"schema":"sdcpp.image.params/v1","seed":42,"strength":0.75,"width":256}')


def _sd15_text(**kw):
    args = {'prompt': "a lovely cat", 'steps': 4, 'cfg_scale': 7.0, 'seed': 42, 'width': 256, 'height': 256,
                'model': "/work/e2e/sd15_rand_f16.safetensors", 'method': "euler_a", 'scheduler': "discrete",
                'generator': ("stable-diffusion.cpp", "unknown", "unknown")}
    args.update(kw)
    return P.parameters_text(**args)


def test_parameters_text_equals_sd_cli():
    assert _sd15_text() == SDCLI_TEXT


def test_parameters_text_sdrt_generator_only_differs():
    ours = _sd15_text(generator=None)
    assert ours.startswith(SDCLI_TEXT.split("Version:")[0] + "Version: sdrt, SDCPP: ")
    js = json.loads(ours.split("SDCPP: ", 1)[1])
    ref = json.loads(SDCLI_TEXT.split("SDCPP: ", 1)[1])
    assert js["generator"]["name"] == "sdrt"
    js.pop("generator"), ref.pop("generator")
    assert js == ref


def test_parameters_text_optional_parts():
    s = _sd15_text(negative_prompt="blurry", sampler_rng="cpu", clip_skip=2, vae="/a/b/vae.safetensors",
                   diffusion_model="x\\unet.gguf", clip_l="clip_l.safetensors", eta=0.5, cfg_scale=1.5)
    head = s.split(", SDCPP: ")[0]
    assert head == ("a lovely cat\nNegative prompt: blurry\nSteps: 4, CFG scale: 1.500000, Guidance: 3.500000, "
                    "Eta: 0.500000, Seed: 42, Size: 256x256, Model: sd15_rand_f16.safetensors, RNG: cuda, "
                    "Sampler RNG: cpu, Sampler: euler_a discrete, TE: clip_l.safetensors, Unet: unet.gguf, "
                    "VAE: vae.safetensors, Clip skip: 2, Version: stable-diffusion.cpp")
    js = json.loads(s.split("SDCPP: ", 1)[1])
    assert js["sampler_rng"] == "cpu" and js["clip_skip"] == 2
    assert js["models"] == {"model": "sd15_rand_f16.safetensors", "clip_l": "clip_l.safetensors",
                            "diffusion_model": "unet.gguf", "vae": "vae.safetensors"}
    assert js["sampling"]["eta"] == 0.5


def test_parameters_text_custom_sigmas_and_tiling():
    s = _sd15_text(sigmas=[14.61, 7.8, 3.5, 0.0],
                   vae_tiling={'enabled': True, 'tile_size_x': 32, 'tile_size_y': 32, 'target_overlap': 0.5,
                                   'rel_size_x': 0.0, 'rel_size_y': 0.0})
    assert "Sampler: euler_a, Custom Sigmas: [14.6100, 7.8000, 3.5000, 0.0000], Version" in s
    js = json.loads(s.split("SDCPP: ", 1)[1])
    assert js["sampling"]["custom_sigmas"][0] == float(np.float32(14.61))
    assert js["vae_tiling"] == {"enabled": True, "tile_size_x": 32, "tile_size_y": 32, "target_overlap": 0.5,
                                "rel_size_x": 0.0, "rel_size_y": 0.0}


def test_c_float():
    assert P.c_float(7) == "7.000000"
    assert P.c_float(0.1) == "0.100000"
    assert P.c_float(float("inf")) == "inf" and P.c_float(float("-inf")) == "-inf"
    assert P.c_float(1e10) == "10000000000.000000"


def test_metadata_json_escaping_and_unicode():
    s = _sd15_text(prompt='a "cat"\t\\ \u00e9\u732b\x01')
    js = s.split("SDCPP: ", 1)[1]
    assert '"positive":"a \\"cat\\"\\t\\\\ \u00e9\u732b\\u0001"' in js   # nlohmann: raw UTF-8, \u00xx lowercase
    assert json.loads(js)["prompt"]["positive"] == 'a "cat"\t\\ \u00e9\u732b\x01'


def _decode_png(data):
    """Minimal PNG reader for our encoder's output (8-bit, filter types 0 and 2)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack_from(">I", data, pos + 8 + n)
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF
        chunks.append((tag, body))
        pos += 12 + n
    w, h, _depth, ctype = struct.unpack(">IIBB", chunks[0][1][:10])
    c = {0: 1, 2: 3, 6: 4}[ctype]
    raw = np.frombuffer(zlib.decompress(b"".join(b for t, b in chunks if t == b"IDAT")), np.uint8).reshape(h, w * c + 1)
    rows = np.zeros((h, w * c), np.uint8)
    for y in range(h):
        f, r = raw[y, 0], raw[y, 1:]
        rows[y] = r if f == 0 else (r + (rows[y - 1] if y else 0)).astype(np.uint8)
    return [t for t, _ in chunks], rows.reshape(h, w, c), chunks


@pytest.mark.parametrize("c", [1, 3, 4])
def test_encode_png_roundtrip(c):
    img = np.random.default_rng(c).integers(0, 256, (7, 5, c), dtype=np.uint8)
    tags, back, chunks = _decode_png(P.encode_png(img, "hello\nworld \u732b"))
    assert tags == [b"IHDR", b"tEXt", b"IDAT", b"IEND"]     # stb_image_write's order
    assert np.array_equal(back, img)
    assert chunks[1][1] == b"parameters\x00hello\nworld \xe7\x8c\xab"
    assert P.read_png_text(P.encode_png(img, "x")) == {"parameters": "x"}
    assert _decode_png(P.encode_png(img))[0] == [b"IHDR", b"IDAT", b"IEND"]


def test_encode_png_rejects_bad_arrays():
    with pytest.raises(UsageError):
        P.encode_png(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(UsageError):
        P.encode_png(np.zeros((4, 4, 2), np.uint8))


def test_pillow_reads_our_png(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    img = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    path = P.write_image(tmp_path / "a.png", img, "meta text")
    with Image.open(path) as im:
        assert np.array_equal(np.asarray(im), img)
        assert im.info["parameters"] == "meta text"


def test_jpeg_comment_and_webp_xmp(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    img = np.full((16, 16, 3), 128, np.uint8)
    j = P.write_image(tmp_path / "a.jpg", img, "p <x> & 'y'", quality=80)
    data = Path(j).read_bytes()
    assert data[:2] == b"\xff\xd8" and b"\xff\xfe" in data
    assert b"parameters\x00p <x> & 'y'\x00" in data             # stb's COM segment layout
    with Image.open(j) as im:
        assert im.format == "JPEG"
    w = P.write_image(tmp_path / "a.webp", img, "p <x> & 'y'", quality=50)
    data = Path(w).read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    assert b"<sdcpp:parameters>p &lt;x&gt; &amp; &apos;y&apos;</sdcpp:parameters>" in data
    with pytest.raises(UsageError):
        P.encode_image(img, "jpeg", None, quality=0)


def test_unknown_extension_is_png_bytes(tmp_path):
    p = P.write_image(tmp_path / "out.bin", np.zeros((2, 2, 3), np.uint8))
    assert Path(p).read_bytes()[:4] == b"\x89PNG"


def test_output_paths():
    assert P.output_paths("output.png", 1) == ["output.png"]
    assert P.output_paths("out/x.png", 3) == ["out/x_0.png", "out/x_1.png", "out/x_2.png"]
    assert P.output_paths("x.jpg", 2, 5) == ["x_5.jpg", "x_6.jpg"]
    assert P.output_paths("img_%03d.png", 3) == ["img_000.png", "img_001.png", "img_002.png"]
    assert P.output_paths("img_%d.webp", 2, 7) == ["img_7.webp", "img_8.webp"]
    assert P.output_paths("a_%%_%02d", 1) == ["a_%_00.png"]            # %% -> %, unknown ext -> .png
    assert P.output_paths("x.bmp", 1) == ["x.bmp.png"]                  # sd-cli appends .png
    assert P.output_paths("noext", 2) == ["noext_0.png", "noext_1.png"]
    with pytest.raises(UsageError):
        P.output_paths("", 1)


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "o.png"
    target.write_bytes(b"old")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(SdrtError, match="cannot write"):
        P.write_image(target, np.zeros((2, 2, 3), np.uint8))
    assert target.read_bytes() == b"old"                                   # untouched
    assert sorted(os.listdir(tmp_path)) == ["o.png"]                       # no temp file left


def test_atomic_write_interrupted_encoder(tmp_path, monkeypatch):
    def bad(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(P.zlib, "compress", bad)
    with pytest.raises(KeyboardInterrupt):
        P.write_image(tmp_path / "o.png", np.zeros((2, 2, 3), np.uint8))
    assert os.listdir(tmp_path) == []


def test_write_creates_folders(tmp_path):
    p = P.write_image(tmp_path / "a" / "b" / "c.png", np.zeros((1, 1, 3), np.uint8))
    assert os.path.isfile(p)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [0, 100, (1 << 20) - 1, 3 * (1 << 20) + 17])
def test_deflate_in_strips_is_one_zlib_stream(threads, n):
    """png.deflate over several threads: one valid zlib stream (strips joined by sync flushes,
    each primed with the bytes before it) that inflates to the data, about zlib.compress's size."""
    from sdrt.io.png import deflate
    from sdrt.ops.threads import get_threads, set_threads
    data = np.random.default_rng(n).integers(0, 6, n, dtype=np.uint8).tobytes()
    before = get_threads()
    try:
        set_threads(threads)
        z = deflate(data)
    finally:
        set_threads(before)
    assert zlib.decompress(z) == data
    assert len(z) <= len(zlib.compress(data, 6)) * 1.01 + 64


def test_large_png_written_in_strips_decodes():
    from sdrt.io.png import encode_png
    from sdrt.ops.threads import get_threads, set_threads
    img = np.random.default_rng(1).integers(0, 256, (700, 640, 3), dtype=np.uint8)
    img[:, :320] //= 16                                   # something to compress
    before = get_threads()
    try:
        set_threads(4)
        b = encode_png(img, "a cat")
    finally:
        set_threads(before)
    from PIL import Image
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(b)).convert("RGB")), img)
