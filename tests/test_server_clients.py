"""Unchanged third-party clients against a live sdrt server (uvicorn on loopback): the official
`openai` Python client (images.generate / images.edit) and the A1111 client `webuiapi`
(txt2img / img2img / discovery). Both are test-only tools: skipped where not installed."""
import base64
import io

import pytest

pytest.importorskip("starlette")
from test_server_api import png_b64  # noqa: E402
from test_server_tiny import live_server, server_config, tiny_pipe  # noqa: E402,F401

from sdrt.server.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def base_url(tiny_pipe):  # noqa: F811
    with live_server(create_app(tiny_pipe, server_config(tiny_pipe, api_key="k-123"))) as url:
        yield url


def test_openai_client(base_url):
    openai = pytest.importorskip("openai")
    from PIL import Image
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k-123", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["sd-cpp-local"]
    r = client.images.generate(model="sd-cpp-local", prompt="a lovely cat", n=2, size="64x64")
    assert len(r.data) == 2
    im = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json)))
    assert im.size == (64, 64) and "a lovely cat" in im.info["parameters"]
    img = io.BytesIO(base64.b64decode(png_b64()))
    img.name = "in.png"
    mask = io.BytesIO(base64.b64decode(png_b64(mode="L", value=255)))
    mask.name = "mask.png"
    e = client.images.edit(image=img, mask=mask, prompt="a dog", size="64x64")
    assert Image.open(io.BytesIO(base64.b64decode(e.data[0].b64_json))).size == (64, 64)
    bad = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError):
        client.images.generate(model="sd-cpp-local", prompt="x", size="8x8")


def test_webuiapi_client(base_url):
    webuiapi = pytest.importorskip("webuiapi")
    from PIL import Image
    host, port = base_url.rsplit("//", 1)[1].split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=2)
    api.session.headers["Authorization"] = "Bearer k-123"
    r = api.txt2img(prompt="a cat", negative_prompt="ugly", seed=11, width=64, height=64, steps=2, cfg_scale=6,
                    batch_size=2)
    assert len(r.images) == 2 and r.images[0].size == (64, 64)
    assert r.info["all_seeds"] == [11, 12] and r.parameters["prompt"] == "a cat"
    init = Image.open(io.BytesIO(base64.b64decode(png_b64())))
    r = api.img2img(images=[init], prompt="a dog", width=64, height=64, steps=2, denoising_strength=0.6, seed=3)
    assert r.image.size == (64, 64) and r.info["seed"] == 3
    assert [m["model_name"] for m in api.get_sd_models()] == ["tiny-sd1"]
    assert "euler_a" in [s["name"] for s in api.get_samplers()]
    assert api.get_progress()["state"]["sampling_steps"] == 0
