"""sdrt's server against sd-server's documented API (examples/server/api.md; reference §2.11): every
endpoint's paths, fields, defaults, status codes and JSON error bodies, on the tiny random SD1
checkpoint (64x64, 2 steps)."""
import base64
import io
import json
import os
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("multipart")
from starlette.testclient import TestClient  # noqa: E402
from test_server_tiny import server_config, tiny_pipe  # noqa: E402,F401

from sdrt.server.app import create_app  # noqa: E402
from sdrt.server.params import Limits  # noqa: E402


def png_b64(w=64, h=64, mode="RGB", value=None):
    from PIL import Image
    r = np.random.default_rng(1)
    a = r.integers(0, 256, (h, w, 3 if mode == "RGB" else 1), dtype=np.uint8) if value is None else \
        np.full((h, w, 3 if mode == "RGB" else 1), value, np.uint8)
    im = Image.fromarray(a if mode == "RGB" else a[:, :, 0], mode)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def decode(b64):
    from PIL import Image
    return Image.open(io.BytesIO(base64.b64decode(b64)))


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    from test_server_tiny import tiny_sd1_tensors

    from sdrt.io import write_safetensors
    q = tiny_sd1_tensors()["model.diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight"]
    r = np.random.default_rng(0)
    key = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q"
    write_safetensors(str(d / "style.safetensors"), {      # a real LoRA for the tiny checkpoint
        key + ".lora_down.weight": r.standard_normal((4, q.shape[1])).astype(np.float16),
        key + ".lora_up.weight": r.standard_normal((q.shape[0], 4)).astype(np.float16)})
    (d / "sub").mkdir()
    (d / "sub" / "detail.safetensors").write_bytes(b"x")
    (d / "notes.txt").write_bytes(b"x")
    outside = tmp_path_factory.mktemp("outside") / "secret.safetensors"
    outside.write_bytes(b"x")
    os.symlink(outside, d / "escape.safetensors")          # a symlink out of the folder: never listed or used
    return str(d)


@pytest.fixture(scope="module")
def client(tiny_pipe, lora_dir):  # noqa: F811
    app = create_app(tiny_pipe, server_config(tiny_pipe, lora_dir=lora_dir))
    with TestClient(app) as c:
        yield c


def wait_job(client, job_id, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        j = client.get(f"/sdcpp/v1/jobs/{job_id}").json()
        if j["status"] in ("completed", "failed", "cancelled"):
            return j
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def assert_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert isinstance(body["error"], str) and body["error"]
    return body


# ---- OpenAI ---------------------------------------------------------------------------------------

def test_openai_models(client):
    assert client.get("/v1/models").json()["data"] == [{"id": "sd-cpp-local", "object": "model", "owned_by": "local"}]


def test_openai_generations_png_and_formats(client):
    r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"})
    assert r.status_code == 200
    d = r.json()
    assert d["output_format"] == "png" and isinstance(d["created"], int) and len(d["data"]) == 1
    im = decode(d["data"][0]["b64_json"])
    assert im.format == "PNG" and im.size == (64, 64)
    assert "a cat" in im.info["parameters"] and "Steps: 2" in im.info["parameters"]
    for fmt, pil in (("jpeg", "JPEG"), ("webp", "WEBP")):
        d = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "output_format": fmt,
                                                        "output_compression": 150}).json()   # clamped to 100
        assert d["output_format"] == fmt and decode(d["data"][0]["b64_json"]).format == pil


def test_openai_n_and_extra_args(client):
    p = 'a cat <sd_cpp_extra_args>{"sample_params": {"sample_steps": 3}, "seed": 7}</sd_cpp_extra_args>'
    d = client.post("/v1/images/generations", json={"prompt": p, "n": 2, "size": "64x64"}).json()
    assert len(d["data"]) == 2
    params = [decode(x["b64_json"]).info["parameters"] for x in d["data"]]
    assert "Steps: 3" in params[0] and "Seed: 7" in params[0] and "Seed: 8" in params[1]
    assert "sd_cpp_extra_args" not in params[0] and params[0].startswith("a cat")


def test_openai_generation_errors(client):
    assert_error(client.post("/v1/images/generations", json={"size": "64x64"}), 400)          # prompt required
    assert_error(client.post("/v1/images/generations", json={"prompt": "x", "size": "big"}), 400)
    assert_error(client.post("/v1/images/generations", json={"prompt": "x", "size": "8x8"}), 400)
    assert_error(client.post("/v1/images/generations", json={"prompt": "x", "n": 99}), 400)
    assert_error(client.post("/v1/images/generations", json={"prompt": "x", "output_format": "gif"}), 400)
    assert_error(client.post("/v1/images/generations", content=b"{not json"), 400)
    assert_error(client.post("/v1/images/generations", content=b""), 400)
    assert_error(client.post("/v1/images/generations", content=b"[1, 2]"), 400)
    assert_error(client.post("/v1/images/generations", json={"prompt": "x <sd_cpp_extra_args>{bad</sd_cpp_extra_args>"}), 400)
    assert_error(client.post("/v1/images/generations", content=b'{"prompt": "a \\ud800 b"}'), 400)   # lone surrogate
    assert_error(client.post("/sdcpp/v1/img_gen", content=b'{"negative_prompt": "\\udfff"}'), 400)
    b = assert_error(client.post("/sdapi/v1/txt2img", json={"prompt": "x", "clip_skip": 1000}), 400)  # the engine's
    assert b["code"] == "invalid_request" and "clip_skip" in b["error"]                             # UsageError


def test_openai_edits_multipart(client):
    img = base64.b64decode(png_b64())
    mask = base64.b64decode(png_b64(mode="L", value=255))
    r = client.post("/v1/images/edits", data={"prompt": "a dog", "n": "1", "size": "64x64"},
                    files=[("image[]", ("in.png", img, "image/png")), ("mask", ("m.png", mask, "image/png"))])
    assert r.status_code == 200, r.text
    d = r.json()
    assert decode(d["data"][0]["b64_json"]).size == (64, 64) and d["output_format"] == "png"
    r = client.post("/v1/images/edits", data={"prompt": "a dog"}, files=[("image", ("in.png", img, "image/png"))])
    assert r.status_code == 200                                                   # the legacy single field
    assert_error(client.post("/v1/images/edits", data={"prompt": "a dog"},
                             files=[("other", ("x", b"1", "text/plain"))]), 400)     # no image
    assert_error(client.post("/v1/images/edits", data={"prompt": "a"},
                             files=[("image", ("in.png", b"not an image", "image/png"))]), 400)
    assert_error(client.post("/v1/images/edits", data={"prompt": "a", "output_format": "webp"},
                             files=[("image", ("in.png", img, "image/png"))]), 400)   # png or jpeg only
    assert_error(client.post("/v1/images/edits", json={"prompt": "a"}), 415)


# ---- sdapi ----------------------------------------------------------------------------------------

def test_sdapi_txt2img(client):
    body = {"prompt": "a cat", "negative_prompt": "ugly", "width": 64, "height": 64, "steps": 2, "cfg_scale": 5,
            "seed": 3, "batch_size": 2, "sampler_name": "Euler a", "scheduler": "karras"}
    d = client.post("/sdapi/v1/txt2img", json=body).json()
    assert len(d["images"]) == 2 and d["parameters"] == body
    info = json.loads(d["info"])
    assert info["all_seeds"] == [3, 4] and len(info["infotexts"]) == 2
    p = decode(d["images"][0]).info["parameters"]
    assert "Sampler: euler_a" in p and "karras" in p and "Negative prompt: ugly" in p
    d = client.post("/sdapi/v1/txt2img", json={"prompt": "x", "seed": -1, "sampler_name": "DDIM"}).json()
    assert json.loads(d["info"])["seed"] >= 0                                    # -1: random
    assert_error(client.post("/sdapi/v1/txt2img", json={"prompt": "x", "sampler_name": "nope"}), 400)
    assert_error(client.post("/sdapi/v1/txt2img", json={"prompt": "x", "steps": 1000}), 400)
    assert_error(client.post("/sdapi/v1/txt2img", json={"prompt": "x", "width": "wide"}), 400)
    assert_error(client.post("/sdapi/v1/txt2img", json={"prompt": "x", "enable_hr": True}), 422)


def test_sdapi_img2img_and_mask_invert(client):
    body = {"prompt": "a cat", "init_images": ["data:image/png;base64," + png_b64()], "denoising_strength": 5.0,
            "mask": png_b64(mode="L", value=0), "inpainting_mask_invert": 1, "steps": 2}
    d = client.post("/sdapi/v1/img2img", json=body).json()
    assert decode(d["images"][0]).size == (64, 64)
    assert "init_images" not in d["parameters"]
    assert_error(client.post("/sdapi/v1/img2img", json={"prompt": "x"}), 400)
    assert_error(client.post("/sdapi/v1/img2img", json={"prompt": "x", "init_images": ["!!notb64"]}), 400)


def test_sdapi_discovery(client):
    from sdrt.engine.samplers import SAMPLERS
    assert client.get("/sdapi/v1/loras").json() == [{"name": "style", "path": "style.safetensors"},
                                                    {"name": "detail", "path": "sub/detail.safetensors"}]
    ups = client.get("/sdapi/v1/upscalers").json()
    assert [u["name"] for u in ups] == ["None", "Lanczos", "Nearest"]
    assert set(ups[0]) == {"name", "model_name", "model_path", "model_url", "scale"} and ups[0]["scale"] == 4
    assert client.get("/sdapi/v1/latent-upscale-modes").json()[0] == {"name": "Latent"}
    s = client.get("/sdapi/v1/samplers").json()
    assert s[0] == {"name": "default", "aliases": ["default"], "options": {}} and len(s) == len(SAMPLERS) + 1
    assert {"name": "karras", "label": "karras"} in client.get("/sdapi/v1/schedulers").json()
    m = client.get("/sdapi/v1/sd-models").json()
    assert m == [{"title": "tiny-sd1", "model_name": "tiny-sd1", "filename": "tiny-sd1.safetensors", "hash": "",
                  "sha256": "", "config": None}]
    assert client.get("/sdapi/v1/options").json() == {"samples_format": "png", "sd_model_checkpoint": "tiny-sd1"}


def test_lora_applied_and_paths_confined(client):
    r = client.post("/sdcpp/v1/img_gen", json={"prompt": "a cat", "sample_params": {"sample_steps": 1},
                                               "lora": [{"path": "style.safetensors", "multiplier": 0.5}]})
    assert r.status_code == 202, r.text
    assert wait_job(client, r.json()["id"])["status"] == "completed"
    # a file that is not a LoRA (detail.safetensors holds one byte): a warning, generation continues
    r = client.post("/sdcpp/v1/img_gen", json={"prompt": "a cat", "sample_params": {"sample_steps": 1},
                                               "lora": [{"path": "sub/detail"}]})
    assert wait_job(client, r.json()["id"])["status"] == "completed"
    b = assert_error(client.post("/sdcpp/v1/img_gen", json={"lora": [{"path": "style", "is_high_noise": True}]}), 422)
    assert "video models" in b["error"]
    assert_error(client.post("/sdcpp/v1/img_gen", json={"lora": [{"path": "style", "multiplier": "x"}]}), 400)
    for bad in ("../outside/secret.safetensors", "/etc/passwd", "escape.safetensors", "sub/../../x"):
        r = client.post("/sdcpp/v1/img_gen", json={"lora": [{"path": bad}]})
        assert r.status_code in (400, 404), (bad, r.text)
    assert_error(client.post("/sdcpp/v1/img_gen", json={"lora": [{"path": "missing"}]}), 404)
    r = client.post("/sdapi/v1/txt2img", json={"prompt": "x", "steps": 1, "lora": [{"path": "style"}]})
    assert r.status_code == 200, r.text


# ---- sdcpp (native, async) ------------------------------------------------------------------------

def test_capabilities(client):
    c = client.get("/sdcpp/v1/capabilities").json()
    assert c["model"] == {"name": "tiny-sd1.safetensors", "stem": "tiny-sd1", "path": "tiny-sd1.safetensors"}
    assert c["current_mode"] == "img_gen" and c["supported_modes"] == ["img_gen"]
    assert c["defaults"] == c["defaults_by_mode"]["img_gen"] and c["features"] == c["features_by_mode"]["img_gen"]
    d = c["defaults"]
    assert (d["width"], d["height"], d["seed"], d["sample_params"]["sample_steps"]) == (64, 64, 42, 2)
    assert d["sample_params"]["guidance"]["txt_cfg"] == 7.0 and d["sample_params"]["guidance"]["img_cfg"] is None
    assert d["output_format"] == "png" and d["output_compression"] == 100
    assert c["features"]["lora"] is True and c["features"]["cancel_generating"] is True
    assert c["limits"]["max_queue_size"] == 64 and c["limits"]["max_steps"] == 8 and c["limits"]["min_width"] == 64
    assert "euler_a" in c["samplers"] and "normal" in c["schedulers"]
    assert [x["path"] for x in c["loras"]] == ["style.safetensors", "sub/detail.safetensors"]
    assert "Latent (bicubic antialiased)" in [u["name"] for u in c["upscalers"]]


def test_img_gen_job_lifecycle(client):
    body = {"prompt": "a cat", "seed": 5, "batch_count": 2, "output_format": "jpeg", "output_compression": 80,
            "sample_params": {"sample_method": "euler", "sample_steps": 3, "guidance": {"txt_cfg": 4.5}}}
    r = client.post("/sdcpp/v1/img_gen", json=body)
    assert r.status_code == 202
    j = r.json()
    assert j["id"].startswith("job_") and len(j["id"]) >= 24 and j["status"] == "queued" and j["kind"] == "img_gen"
    assert j["poll_url"] == f"/sdcpp/v1/jobs/{j['id']}"
    done = wait_job(client, j["id"])
    assert done["status"] == "completed" and done["error"] is None and done["started"] >= done["created"]
    assert done["result"]["output_format"] == "jpeg" and [i["index"] for i in done["result"]["images"]] == [0, 1]
    assert decode(done["result"]["images"][1]["b64_json"]).format == "JPEG"
    assert done["progress"] == {"step": 3, "steps": 3, "image": 0}
    assert_error(client.post(f"/sdcpp/v1/jobs/{j['id']}/cancel"), 409)          # finished
    assert_error(client.get("/sdcpp/v1/jobs/job_nope"), 404)
    assert_error(client.post("/sdcpp/v1/jobs/job_nope/cancel"), 404)


def test_img_gen_inpaint_and_bad_bodies(client):
    j = client.post("/sdcpp/v1/img_gen", json={"prompt": "x", "init_image": png_b64(), "strength": 0.5,
                                               "mask_image": png_b64(mode="L", value=255)}).json()
    assert wait_job(client, j["id"])["status"] == "completed"
    for body, status in (({"width": 8}, 400), ({"width": 4096}, 400), ({"batch_count": 0}, 400),
                         ({"sample_params": {"sample_steps": 0}}, 400), ({"seed": "one"}, 400),
                         ({"strength": 2.0}, 400), ({"sample_params": {"sample_method": "nope"}}, 400),
                         ({"sample_params": []}, 400), ({"init_image": "%%%"}, 400),
                         ({"init_image": png_b64(), "mask_image": png_b64(32, 32, "L")}, 400),
                         ({"hires": {"enabled": True}}, 422), ({"cache_mode": "easycache"}, 422),
                         ({"ref_images": [png_b64()]}, 422), ({"control_image": png_b64()}, 422)):
        assert_error(client.post("/sdcpp/v1/img_gen", json=body), status)
    assert_error(client.post("/sdcpp/v1/img_gen", content=b""), 400)
    assert_error(client.post("/sdcpp/v1/img_gen", content=b"nul"), 400)
    assert_error(client.post("/sdcpp/v1/vid_gen", json={"prompt": "x"}), 400)


def test_http_errors_are_json(client):
    assert_error(client.get("/nope"), 404)
    assert_error(client.get("/sdcpp/v1/img_gen"), 405)
    assert_error(client.post("/sdcpp/v1/img_gen", content=b"x" * (64 * 1024 * 1024 + 1)), 413)


def test_openapi_matches_routes(client):
    doc = client.get("/openapi.json").json()
    served = {(r.path, m) for r in client.app.routes for m in r.methods if m != "HEAD"}
    documented = {(p, m.upper()) for p, ops in doc["paths"].items() for m in ops}
    served = {(p.replace("{job_id}", "{job_id}"), m) for p, m in served}
    assert served == documented


# ---- progress, cancellation, queue limit, TTL (a runner that waits for the test) ------------------

@pytest.fixture
def gated(tiny_pipe):  # noqa: F811
    """An app whose jobs wait at a gate before generating, so the queue and cancellation are
    tested deterministically; the generation itself is the real one."""
    from sdrt.server.app import make_runner
    real = make_runner(tiny_pipe)
    gate = threading.Event()
    started = threading.Event()

    def runner(job, progress):
        started.set()
        gate.wait(60)

        def slow(step, steps, *a):
            progress(step, steps, *a)
            time.sleep(0.05)
        return real(job, slow)

    cfg = server_config(tiny_pipe, limits=Limits(max_width=128, max_height=128, max_steps=50, max_batch_count=2,
                                                 max_queue_size=3), ttl=1.0)
    with TestClient(create_app(tiny_pipe, cfg, runner=runner)) as c:
        yield c, gate, started
        gate.set()


def test_queue_limit_cancel_and_progress(gated):
    client, gate, started = gated
    ids = [client.post("/sdcpp/v1/img_gen", json={"prompt": "x", "sample_params": {"sample_steps": 30}}).json()["id"]
           for _ in range(3)]
    assert started.wait(10)
    b = assert_error(client.post("/sdcpp/v1/img_gen", json={"prompt": "x"}), 429)
    assert b["error"] == "job queue is full"
    assert_error(client.post("/v1/images/generations", json={"prompt": "x"}), 429)
    assert [client.get(f"/sdcpp/v1/jobs/{i}").json()["queue_position"] for i in ids] == [0, 1, 2]
    # cancel a queued job: at once
    c = client.post(f"/sdcpp/v1/jobs/{ids[2]}/cancel").json()
    assert c["status"] == "cancelled" and c["error"] == {"code": "cancelled", "message": "job cancelled by client"}
    gate.set()
    # progress while generating: step i of n, through sdapi and the job
    t0 = time.time()
    while time.time() - t0 < 30:
        p = client.get("/sdapi/v1/progress").json()
        if p["state"]["sampling_step"] >= 2:
            break
        time.sleep(0.02)
    assert p["state"]["sampling_steps"] == 30 and 0 < p["progress"] < 1 and p["state"]["job"] == ids[0]
    j = client.get(f"/sdcpp/v1/jobs/{ids[0]}").json()
    assert j["status"] == "generating" and j["progress"]["steps"] == 30
    # cancel while generating: reaches the sampler between steps
    assert client.post(f"/sdcpp/v1/jobs/{ids[0]}/cancel").status_code == 200
    j = wait_job(client, ids[0])
    assert j["status"] == "cancelled" and j["progress"]["step"] < 30 and j["result"] is None
    # /sdapi/v1/interrupt stops the next one
    while client.get(f"/sdcpp/v1/jobs/{ids[1]}").json()["status"] != "generating":
        time.sleep(0.02)
    assert client.post("/sdapi/v1/interrupt").json() == {"interrupted": True}
    assert wait_job(client, ids[1])["status"] == "cancelled"
    # finished jobs are kept ttl seconds, then 410
    time.sleep(1.2)
    assert_error(client.get(f"/sdcpp/v1/jobs/{ids[0]}"), 410)
    assert_error(client.post(f"/sdcpp/v1/jobs/{ids[0]}/cancel"), 410)


def test_graceful_shutdown_answers_queued_jobs(tiny_pipe):  # noqa: F811
    from sdrt.server.app import make_runner
    real = make_runner(tiny_pipe)
    gate = threading.Event()

    def runner(job, progress):
        gate.wait(30)
        return real(job, progress)

    app = create_app(tiny_pipe, server_config(tiny_pipe, shutdown_grace=5.0), runner=runner)
    jobs = app.state.server.jobs
    with TestClient(app) as c:
        ids = [c.post("/sdcpp/v1/img_gen", json={"prompt": "x"}).json()["id"] for _ in range(3)]
        threading.Timer(0.5, gate.set).start()
    first = jobs.jobs[ids[0]]
    assert first.status == "completed"                             # the running job finished
    assert [jobs.jobs[i].status for i in ids[1:]] == ["cancelled", "cancelled"]
    assert jobs.jobs[ids[1]].error["code"] == "server_shutdown"
    assert not jobs.thread.is_alive()


# ---- safety ---------------------------------------------------------------------------------------

def test_api_key_and_cors(tiny_pipe):  # noqa: F811
    app = create_app(tiny_pipe, server_config(tiny_pipe, api_key="s3cret"))
    with TestClient(app) as c:
        assert c.get("/").status_code == 200                          # the page is open
        b = assert_error(c.get("/v1/models"), 401)
        assert b["code"] == "unauthorized"
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/openapi.json"), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = c.get("/sdcpp/v1/capabilities", headers={"Authorization": "Bearer s3cret", "Origin": "http://evil.test"})
        assert "access-control-allow-origin" not in r.headers          # CORS off by default
    app = create_app(tiny_pipe, server_config(tiny_pipe, cors_origins=("http://ok.test",)))
    with TestClient(app) as c:
        r = c.get("/v1/models", headers={"Origin": "http://ok.test"})
        assert r.headers["access-control-allow-origin"] == "http://ok.test"
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "http://x.test"}).headers
        pre = c.options("/v1/models", headers={"Origin": "http://ok.test", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200
    app = create_app(tiny_pipe, server_config(tiny_pipe, cors_origins=("*",)))
    with TestClient(app) as c:
        r = c.get("/v1/models", headers={"Origin": "http://x.test", "Cookie": "a=b"})
        assert r.headers.get("access-control-allow-credentials") != "true"    # never wildcard with credentials


def test_nothing_leaks_the_command_line_or_environment(client):
    os.environ["SDRT_TEST_SECRET"] = "leak-canary-123"
    try:
        for path in ("/sdcpp/v1/capabilities", "/sdapi/v1/options", "/sdapi/v1/sd-models", "/v1/models",
                     "/openapi.json", "/sdcpp/v1/queue", "/sdapi/v1/progress"):
            text = client.get(path).text
            assert "leak-canary-123" not in text and "/tmp/" not in text and "pytest" not in text, path
    finally:
        del os.environ["SDRT_TEST_SECRET"]


def test_index_page(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for needle in ('id="prompt"', 'id="negative"', 'id="sampler"', 'id="seed"', 'id="lora"', 'id="init"', 'id="mask"',
                   "<progress", 'id="queue"', "selected LoRA files are applied"):
        assert needle in r.text


def test_serve_html_path(tiny_pipe, tmp_path):  # noqa: F811
    page = tmp_path / "page.html"
    page.write_text("<html>custom</html>")
    with TestClient(create_app(tiny_pipe, server_config(tiny_pipe, html_path=str(page)))) as c:
        assert c.get("/").text == "<html>custom</html>"


# ---- the command line -----------------------------------------------------------------------------

def test_serve_flags_and_cli_defaults(tiny_pipe, tmp_path):  # noqa: F811
    from sdrt.server.main import build_parser, config_from_args
    model = tiny_pipe.model_params.model
    a = build_parser().parse_args(["-m", model])
    assert (a.listen_ip, a.listen_port, a.serve_html_path, a.api_key, a.cors_origin) == ("127.0.0.1", 1234, None,
                                                                                          None, [])
    a = build_parser().parse_args(["-m", model, "-l", "0.0.0.0", "--listen-port", "8080", "-W", "96", "--steps", "3",
                                   "--sampling-method", "dpm++2m", "-s", "9", "--cfg-scale", "4", "--max-steps", "40",
                                   "--lora-model-dir", str(tmp_path), "--cors-origin", "http://a.test"])
    mp, cfg = config_from_args(a)
    assert (a.listen_ip, a.listen_port) == ("0.0.0.0", 8080) and mp.model == model
    d = cfg.defaults                       # the CLI's generation flags are the per-request defaults
    assert (d.width, d.steps, d.sampling_method, d.seed, d.cfg_scale) == (96, 3, "dpm++2m", 9, 4.0)
    assert cfg.limits.max_steps == 40 and cfg.lora_dir == str(tmp_path) and cfg.cors_origins == ("http://a.test",)
    from sdrt.errors import UsageError
    with pytest.raises(UsageError, match="--lora-model-dir"):
        config_from_args(build_parser().parse_args(["-m", model, "--lora-model-dir", str(tmp_path / "no")]))
    for extra in (["-o", "x.png"], ["--compression-quality", "50"], ["-M", "convert"], ["--output-begin-idx", "3"]):
        with pytest.raises(UsageError):                 # CLI-only flags are refused, not ignored
            config_from_args(build_parser().parse_args(["-m", model] + extra))
    from sdrt.cli import main as cli
    assert cli.main(["serve", "-m", str(tmp_path / "missing.safetensors")]) == 2     # `sdrt serve` dispatch


def test_import_sdrt_stays_light():
    import subprocess
    import sys
    code = "import sys, sdrt, sdrt.cli.main; assert not [m for m in ('starlette', 'uvicorn', 'multipart') if m in sys.modules]"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
