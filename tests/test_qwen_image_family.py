"""The qwen_image family record: detection, the conditioner (sd.cpp's template and the states it
drops), the DiT / VAE builders and a CLI run on tiny random files (tools/make_qwen_image_checkpoint.py
--tiny). Numbers against references: tests/test_qwen_image.py (DiT), tests/test_vae_wan.py (VAE),
tests/test_qwen_llm.py (LLM); against sd-cli: tests/test_qwen_image_sdcli.py."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from sdrt.cli import main as cli
from sdrt.errors import UnsupportedError
from sdrt.models.families import families, family_of, get_family

families()     # register every family in FAMILY_MODULES order before this module imports one of them
from sdrt.models.qwen_image import QWEN_IMAGE, QWEN_IMAGE_LAYERED, QWEN_IMAGE_TEMPLATE, qwen_image_model  # noqa: E402
from sdrt.ops.threads import get_threads, set_threads  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("mkqi", os.path.join(ROOT, "tools", "make_qwen_image_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qi_tiny")
    mk = _tool()
    return {n: mk.write(c, str(d / f"{n}.safetensors"), tiny=True) for c, n in
            (("transformer", "dit"), ("llm", "llm"), ("vae", "vae"))}


@pytest.fixture(autouse=True)
def keep_threads():
    before = get_threads()
    yield
    set_threads(before)


def test_record():
    f = get_family("qwen_image")
    assert family_of(QWEN_IMAGE) is f and f.runnable and f.text_encoders == ("llm", "llm_vision")
    assert (f.prediction, f.flow_shift, f.default_sampler, f.default_scheduler) == ("flow", 3.0, "euler", "discrete")
    assert f.latent_channels == 16 and f.ref_image_multiple == 32 and f.vae is not None
    assert not family_of(QWEN_IMAGE_LAYERED).runnable
    with pytest.raises(UnsupportedError, match="Qwen-Image-Layered"):
        family_of(QWEN_IMAGE_LAYERED).check_runnable(QWEN_IMAGE_LAYERED)


def test_detection():
    from sdrt.io import detect as D
    dm = "model.diffusion_model."
    names = {dm + "transformer_blocks.0.img_mod.1.weight": (18432, 3072), dm + "img_in.weight": (3072, 64)}
    assert D.detect_version(names) == QWEN_IMAGE
    names[dm + "time_text_embed.addition_t_embedding.weight"] = (2, 3072)
    assert D.detect_version(names) == QWEN_IMAGE_LAYERED


def test_template_drops_exactly_its_prefix():
    """sd.cpp drops 34 states: the system prompt and the user turn's opening, which tokenize to 34."""
    from sdrt.models.te.qwen_tokenizer import QwenTokenizer
    tok = QwenTokenizer()
    assert len(tok.encode(QWEN_IMAGE_TEMPLATE.prefix)) == QWEN_IMAGE_TEMPLATE.drop == 34
    assert QWEN_IMAGE_TEMPLATE.out_layer == 0     # the final-norm output of the last layer
    ids, weights = tok.encode_template(QWEN_IMAGE_TEMPLATE, "a (red:1.5) cat")
    suffix = tok.encode(QWEN_IMAGE_TEMPLATE.suffix)
    assert ids[-len(suffix):] == suffix and max(weights) == 1.5 and weights[:34] == [1.0] * 34


def test_zero_cond_t_flag_reaches_the_model():
    from sdrt.ops.tensor import Tensor
    mk = _tool()
    table = {"model.diffusion_model." + k: Tensor.from_numpy(v)
             for k, v in mk.arrays(mk.shapes_of("transformer", True)).items()}
    assert not qwen_image_model(table, "model.diffusion_model.", "dit").config.zero_cond_t
    m = qwen_image_model(table, "model.diffusion_model.", "dit", model_args={"qwen_image_zero_cond_t": True})
    assert m.config.zero_cond_t


def test_cli_txt2img_and_img2img(files, tmp_path):
    base = ["--diffusion-model", files["dit"], "--llm", files["llm"], "--vae", files["vae"], "-p", "a cat",
            "-W", "64", "-H", "48", "--steps", "2", "--cfg-scale", "2", "-t", "1"]
    out = tmp_path / "t2i.png"
    assert cli.main([*base, "-o", str(out)]) == 0
    from test_image_regression import read_rgb
    img = read_rgb(str(out))
    assert img.shape == (48, 64, 3) and img.std() > 0
    out2 = tmp_path / "i2i.png"
    assert cli.main([*base, "-i", str(out), "--strength", "0.5", "-o", str(out2)]) == 0
    assert read_rgb(str(out2)).shape == (48, 64, 3)


def test_missing_llm_is_named(files, tmp_path):
    rc = cli.main(["--diffusion-model", files["dit"], "--vae", files["vae"], "-p", "x", "-W", "32", "-H", "32",
                   "--steps", "1", "-o", str(tmp_path / "x.png")])
    assert rc == 2 and not (tmp_path / "x.png").exists()


def test_llm_image_embeds_splice_exactly():
    """Image embeddings spliced at a token index: given the embedding rows of the tokens they replace,
    the hidden states are the plain run's (sd.cpp's LLM::forward splice)."""
    from sdrt.models.te.qwen_llm import QwenLLM
    from sdrt.ops.tensor import Tensor
    mk = _tool()
    table = {"text_encoders.llm." + k: Tensor.from_numpy(v) for k, v in mk.arrays(mk.shapes_of("llm", True)).items()}
    llm = QwenLLM(table, "text_encoders.llm.")
    ids = np.array([151644, 8948, 198, 100, 200, 300, 151645], np.int32)
    emb = table["text_encoders.llm.model.embed_tokens.weight"].to_f32().reshape(-1, 64)
    plain = llm.run(ids)[0]
    rows = Tensor.from_numpy(np.ascontiguousarray(emb[ids[3:5]]))
    spliced = llm.run(ids, image_embeds=[(3, rows)])[0]
    np.testing.assert_allclose(spliced, plain, rtol=1e-5, atol=1e-5)
    other = llm.run(ids, image_embeds=[(3, Tensor.from_numpy(np.ones((2, 64), np.float32)))])[0]
    assert np.abs(other[3:] - plain[3:]).max() > 1e-3 and np.allclose(other[:3], plain[:3], atol=1e-5)


def test_vision_sizes_like_sdcpp():
    from sdrt.models.qwen_image import clip_preprocess, vision_size
    assert vision_size(1024, 1024) == (560, 560)      # > 560^2: scaled down to the cap, floor to 28
    assert vision_size(100, 80) == (448, 364)         # < 384^2: scaled up, ceil to 28
    assert vision_size(448, 392) == (448, 392)
    x = clip_preprocess(np.full((10, 20, 3), 255, np.uint8), 28, 28)
    assert x.shape == (3, 28, 28) and np.allclose(x[:, 0, 0], (1 - np.array([0.48145466, 0.4578275, 0.40821073]))
                                                      / np.array([0.26862954, 0.26130258, 0.27577711]), atol=1e-5)


def test_cli_edit_with_vision_tower(files, tmp_path):
    """-r with an --llm file holding `visual.*`: the Edit-Plus prompt with vision tokens (it changes
    the conditioning, so the image differs from the same run without the tower)."""
    vl = _tool().write("llm_vl", str(tmp_path / "llm_vl.safetensors"), tiny=True)
    from PIL import Image
    ref = tmp_path / "ref.png"
    Image.fromarray((np.random.RandomState(1).rand(40, 56, 3) * 255).astype(np.uint8)).save(ref)
    base = ["--diffusion-model", files["dit"], "--vae", files["vae"], "-p", "make it red", "-W", "64", "-H", "64",
            "--steps", "2", "--cfg-scale", "2", "-t", "1", "-r", str(ref)]
    a, b = tmp_path / "vl.png", tmp_path / "plain.png"
    assert cli.main([*base, "--llm", vl, "-o", str(a)]) == 0
    assert cli.main([*base, "--llm", files["llm"], "-o", str(b)]) == 0
    from test_image_regression import read_rgb
    assert np.abs(read_rgb(str(a)).astype(int) - read_rgb(str(b)).astype(int)).max() > 0


def test_llm_vision_from_its_own_file(files, tmp_path):
    """--llm_vision: the tower in a separate file (bare names) gives the same image as inside --llm."""
    mk = _tool()
    vl = mk.write("llm_vl", str(tmp_path / "llm_vl.safetensors"), tiny=True)
    vis = {k[len("visual."):]: v for k, v in mk.arrays(mk.shapes_of("llm_vl", True)).items() if k.startswith("visual.")}
    mk.save_safetensors(str(tmp_path / "vision.safetensors"), vis)
    from PIL import Image
    ref = tmp_path / "ref.png"
    Image.fromarray((np.random.RandomState(2).rand(40, 56, 3) * 255).astype(np.uint8)).save(ref)
    base = ["--diffusion-model", files["dit"], "--vae", files["vae"], "-p", "x", "-W", "64", "-H", "64",
            "--steps", "1", "-t", "1", "-r", str(ref)]
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    assert cli.main([*base, "--llm", vl, "-o", str(a)]) == 0
    assert cli.main([*base, "--llm", files["llm"], "--llm_vision", str(tmp_path / "vision.safetensors"), "-o", str(b)]) == 0
    from test_image_regression import read_rgb
    assert np.array_equal(read_rgb(str(a)), read_rgb(str(b)))
