"""The HTTP server with a Flux model loaded (issue 14): sd-server's native fields that Flux reads
(`sample_params.guidance.distilled_guidance`, `ref_images`, `increase_ref_index`) reach the
pipeline, and the server's image is the one the Python API makes with the same parameters."""
import base64
import io

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("multipart")
from starlette.testclient import TestClient  # noqa: E402

import flux_tiny as ft  # noqa: E402
from test_server_api import png_b64, wait_job  # noqa: E402
from test_server_tiny import server_config  # noqa: E402

from sdrt.server.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def flux_client(tmp_path_factory):
    from sdrt.engine.params import ModelParams
    from sdrt.engine.pipeline import Pipeline
    from sdrt.ops.threads import get_threads, set_threads
    prev = get_threads()
    set_threads(1)
    args = ft.write(str(tmp_path_factory.mktemp("flux_server")), "dev")
    pipe = Pipeline.load(ModelParams(model=args[1]))
    with TestClient(create_app(pipe, server_config(pipe))) as c:
        yield c, pipe
    set_threads(prev)


def image_of(done) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(done["result"]["images"][0]["b64_json"]))))


def generate(client, **body):
    r = client.post("/sdcpp/v1/img_gen", json={"prompt": "a fox", "seed": 3, "cfg_scale": 1, **body})
    assert r.status_code == 202, r.text
    done = wait_job(client, r.json()["id"], timeout=300)
    assert done["status"] == "completed", done
    return image_of(done)


def test_flux_server_image_is_the_api_image_and_reads_distilled_guidance(flux_client):
    from sdrt.engine.params import GenParams
    client, pipe = flux_client
    sp = {"sample_steps": 2, "guidance": {"txt_cfg": 1.0, "distilled_guidance": 2.0}}
    served = generate(client, sample_params=sp)
    gp = GenParams(prompt="a fox", seed=3, width=64, height=64, steps=2, cfg_scale=1.0, guidance=2.0)
    api = pipe.generate(gp, show_progress=False)[0].image
    assert np.array_equal(served, api)
    other = generate(client, sample_params={**sp, "guidance": {"txt_cfg": 1.0, "distilled_guidance": 5.0}})
    assert not np.array_equal(served, other)      # the field reaches the model's guidance embedding


def test_flux_server_takes_reference_images(flux_client):
    client, _ = flux_client
    caps = client.get("/sdcpp/v1/capabilities").json()
    assert caps["features"]["ref_images"] is True
    sp = {"sample_steps": 2, "guidance": {"txt_cfg": 1.0}}
    plain = generate(client, sample_params=sp)
    ref = png_b64(64, 64, value=200)
    edited = generate(client, sample_params=sp, ref_images=[ref])
    assert not np.array_equal(plain, edited)
    both = generate(client, sample_params=sp, ref_images=[ref, png_b64(64, 64, value=20)], increase_ref_index=True)
    assert both.shape == edited.shape
    r = client.post("/sdcpp/v1/img_gen", json={"prompt": "x", "ref_images": [ref] * 9})
    assert r.status_code == 400 and "at most 8" in r.json()["error"]
    r = client.post("/sdcpp/v1/img_gen", json={"prompt": "x", "ref_images": ["%%%"]})
    assert r.status_code == 400 and "ref_images[0]" in r.json()["error"]
