"""--control-net / --control-image / --control-strength / --canny / --control-net-cpu through the
CLI and sdrt.generate on the tiny random SDXL checkpoint of tests/test_image_regression.py with a
tiny random ControlNet over its encoder (tools/make_controlnet_checkpoint.py's layout_for)."""
from __future__ import annotations

import importlib.util
import logging
import os

import numpy as np
import pytest
from PIL import Image

from test_controlnet_sdcli import control_image
from test_image_regression import ARGS, UNET, psnr, read_rgb, write_tiny_sdxl

import sdrt
from sdrt.cli import main as cli
from sdrt.models.diffusion.unet import UNetConfig
from sdrt.ops.threads import get_threads, set_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("make_controlnet_checkpoint",
                                               os.path.join(ROOT, "tools", "make_controlnet_checkpoint.py"))
mcn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mcn)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("controlnet")
    model = write_tiny_sdxl(str(d / "sdxl_tiny.safetensors"))
    cn = str(d / "cn_tiny.safetensors")
    mcn.write(cn, mcn.layout_for(UNetConfig.from_hparams(**UNET)))
    pth = str(d / "cn_tiny_pth.safetensors")          # the .pth naming: control_model.*
    from sdrt.io import open_model, write_safetensors
    write_safetensors(pth, {"control_model." + k: np.array(t.numpy()) for k, t in open_model(cn).tensors.items()})
    img = str(d / "control.png")
    Image.fromarray(control_image(64)).save(img)
    return {"dir": d, "model": model, "cn": cn, "pth": pth, "image": img}


def run(files, name, *extra):
    out = str(files["dir"] / f"{name}.png")
    before = get_threads()
    try:
        assert cli.main(["-m", files["model"], *ARGS, *extra, "-o", out]) == 0
    finally:
        set_threads(before)
    return read_rgb(out)


def test_controlnet_cli(files, caplog):
    plain = run(files, "plain")
    cn = ["--control-net", files["cn"], "--control-image", files["image"]]
    with_cn = run(files, "cn", *cn)
    assert psnr(with_cn, plain) < 30, "the ControlNet does not change the image"
    # strength 0 adds 0 * control: the same image as without a ControlNet
    assert psnr(run(files, "cn0", *cn, "--control-strength", "0"), plain) == float("inf")
    # a weaker control moves the image less
    half = run(files, "cn_half", *cn, "--control-strength", "0.3")
    assert psnr(half, plain) > psnr(with_cn, plain)
    # --canny changes the hint (14.7 dB here); the .pth names (control_model.*) load to the same weights
    assert psnr(run(files, "canny", *cn, "--canny"), with_cn) < 30
    same = run(files, "pth", "--control-net", files["pth"], "--control-image", files["image"])
    assert psnr(same, with_cn) == float("inf")
    # a control image without a ControlNet is read (and canny'd) but unused, as sd-cli
    with caplog.at_level(logging.WARNING, logger="sdrt"):
        assert psnr(run(files, "img_only", "--control-image", files["image"], "--canny"), plain) == float("inf")
    assert "without --control-net" in caplog.text
    # --control-net-cpu on a CPU run: the same image
    assert psnr(run(files, "cn_cpu", *cn, "--control-net-cpu"), with_cn) == float("inf")


def test_controlnet_python_api(files):
    img = control_image(64)
    out = sdrt.generate("a lovely cat, (masterpiece:1.2)", model=files["model"], negative_prompt="blurry",
                        width=64, height=64, steps=3, cfg_scale=5.0, sampling_method="euler", seed=42,
                        control_net=files["cn"], control_image=img, output="numpy")[0]
    ref = read_rgb(str(files["dir"] / "cn.png"))
    assert psnr(out.astype(np.float64), ref) >= 60   # (not bit-equal: the CLI runs with -t 1, the API with all threads)


def test_controlnet_errors(files, capsys):
    assert cli.main(["-m", files["model"], *ARGS, "--control-net", str(files["dir"] / "missing.safetensors"),
                     "--control-image", files["image"], "-o", str(files["dir"] / "x.png")]) == 2
    assert cli.main(["-m", files["model"], *ARGS, "--control-net", files["cn"], "--control-image",
                     str(files["dir"] / "nope.png"), "-o", str(files["dir"] / "x.png")]) == 2
    # a ControlNet for another base model (SD1-style layout on this SDXL UNet): named, exit 1
    other = str(files["dir"] / "cn_other.safetensors")
    mcn.write(other, mcn.layout_for(UNetConfig.from_hparams(model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
                                                            attention_levels=(1,), context_dim=64)))
    assert cli.main(["-m", files["model"], *ARGS, "--control-net", other, "--control-image", files["image"],
                     "-o", str(files["dir"] / "x.png")]) == 1
    assert "a ControlNet for another model" in capsys.readouterr().err
    # a UNet checkpoint given as the ControlNet: named as not a ControlNet
    assert cli.main(["-m", files["model"], *ARGS, "--control-net", files["model"], "--control-image", files["image"],
                     "-o", str(files["dir"] / "x.png")]) == 1
    assert "not a ControlNet" in capsys.readouterr().err


def test_controlnet_through_the_server(files):
    """sd-server's `control_image` / `control_strength` on a server started with a ControlNet: the
    image is the Python API's with the same parameters; capabilities say so."""
    pytest.importorskip("starlette")
    import base64
    import io

    from starlette.testclient import TestClient
    from test_server_api import wait_job
    from test_server_tiny import server_config

    from sdrt.engine.params import GenParams, ModelParams
    from sdrt.engine.pipeline import Pipeline
    from sdrt.server.app import create_app
    pipe = Pipeline.load(ModelParams(model=files["model"], control_net=files["cn"]))
    buf = io.BytesIO()
    Image.fromarray(control_image(64)).save(buf, "PNG")
    hint = base64.b64encode(buf.getvalue()).decode()
    with TestClient(create_app(pipe, server_config(pipe))) as client:
        assert client.get("/sdcpp/v1/capabilities").json()["features"]["control_image"] is True
        r = client.post("/sdcpp/v1/img_gen", json={
            "prompt": "a cat", "seed": 9, "control_image": hint, "control_strength": 0.5,
            "sample_params": {"sample_method": "euler", "sample_steps": 2, "guidance": {"txt_cfg": 5.0}}})
        assert r.status_code == 202, r.text
        done = wait_job(client, r.json()["id"], timeout=300)
    assert done["status"] == "completed", done
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(done["result"]["images"][0]["b64_json"]))))
    gp = GenParams(prompt="a cat", seed=9, width=64, height=64, steps=2, cfg_scale=5.0, sampling_method="euler",
                   control_image=control_image(64), control_strength=0.5)
    np.testing.assert_array_equal(served, pipe.generate(gp, show_progress=False)[0].image)
