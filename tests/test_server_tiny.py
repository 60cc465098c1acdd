"""A tiny random-weight SD1.x checkpoint with the real tensor names (UNet 32 channels, a 1-layer
768-wide CLIP, a 32/64/96-channel VAE) that `Pipeline.load` detects as sd1 and generates from at
64x64 in well under a second: the model behind the server tests."""
import gzip
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = os.path.join(ROOT, "tests", "fixtures", "ckpt_names_diffusers_ldm.json.gz")
VAE_SCALE = {128: 32, 256: 64, 512: 96}      # the SD VAE's channel widths, shrunk (GroupNorm(32) still divides)


def tiny_sd1_tensors(seed: int = 0) -> dict:
    from sdrt.models.diffusion.unet import UNetConfig
    cfg = UNetConfig.from_hparams(model_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_levels=(1,),
                                  context_dim=768, num_heads=2)
    shapes = {"model.diffusion_model." + k: tuple(s) for k, s in cfg.weight_shapes().items()}
    with gzip.open(NAMES, "rt") as f:
        vae = {ldm: tuple(VAE_SCALE.get(d, d) for d in shape) for _, _, ldm, shape in json.load(f)["sd_vae"]}
    shapes.update({"first_stage_model." + k: s for k, s in vae.items()})
    p, W = "cond_stage_model.transformer.text_model.", 768
    shapes.update({p + "embeddings.token_embedding.weight": (49408, W), p + "embeddings.position_embedding.weight": (77, W),
                   p + "final_layer_norm.weight": (W,), p + "final_layer_norm.bias": (W,)})
    for n, s in (("self_attn.q_proj", (W, W)), ("self_attn.k_proj", (W, W)), ("self_attn.v_proj", (W, W)),
                 ("self_attn.out_proj", (W, W)), ("mlp.fc1", (4 * W, W)), ("mlp.fc2", (W, 4 * W))):
        shapes[f"{p}encoder.layers.0.{n}.weight"], shapes[f"{p}encoder.layers.0.{n}.bias"] = s, (s[0],)
    for n in ("layer_norm1", "layer_norm2"):
        shapes[f"{p}encoder.layers.0.{n}.weight"] = shapes[f"{p}encoder.layers.0.{n}.bias"] = (W,)
    r = np.random.default_rng(seed)
    out = {}
    for k, s in sorted(shapes.items()):
        fan_in = int(np.prod(s[1:])) if len(s) > 1 else 1
        if len(s) == 1:
            v = (1.0 if k.endswith("weight") and "norm" in k else 0.0) + 0.02 * r.standard_normal(s)
        else:
            v = r.standard_normal(s, dtype=np.float32) / np.sqrt(fan_in)
        out[k] = np.asarray(v, np.float16)
    return out


def write_tiny_sd1(path) -> str:
    from sdrt.io import write_safetensors
    write_safetensors(str(path), tiny_sd1_tensors())
    return str(path)


def test_tiny_checkpoint_generates(tmp_path):
    from sdrt.engine.params import GenParams, ModelParams
    from sdrt.engine.pipeline import Pipeline
    pipe = Pipeline.load(ModelParams(model=write_tiny_sd1(tmp_path / "tiny.safetensors")))
    assert pipe.version == "sd1"
    r = pipe.generate(GenParams(prompt="a cat", width=64, height=64, steps=2), show_progress=False)
    assert r[0].image.shape == (64, 64, 3) and r[0].image.std() > 0


# ---- shared by tests/test_server_*.py ------------------------------------------------------------

import contextlib  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("starlette")


@pytest.fixture(scope="session")
def tiny_pipe(tmp_path_factory):
    """The tiny checkpoint, loaded once and warmed (kernels compiled), on one thread: tiny tensors
    on 2 oversubscribed cores run faster single-threaded."""
    from sdrt.engine.params import GenParams, ModelParams
    from sdrt.engine.pipeline import Pipeline
    from sdrt.ops.threads import get_threads, set_threads
    prev = get_threads()
    set_threads(1)
    path = write_tiny_sd1(tmp_path_factory.mktemp("server") / "tiny-sd1.safetensors")
    pipe = Pipeline.load(ModelParams(model=path))
    pipe.generate(GenParams(prompt="warm up", width=64, height=64, steps=1), show_progress=False)
    yield pipe
    set_threads(prev)


def server_config(pipe, **kw):
    from sdrt.engine.params import GenParams
    from sdrt.server.app import ServerConfig
    from sdrt.server.params import Limits
    limits = kw.pop("limits", None) or Limits(max_width=128, max_height=128, max_steps=8, max_batch_count=2)
    defaults = kw.pop("defaults", None) or GenParams(width=64, height=64, steps=2, seed=42)
    return ServerConfig(defaults=defaults, model_path=pipe.model_params.model, limits=limits, **kw)


@contextlib.contextmanager
def live_server(app):
    """uvicorn on 127.0.0.1, an ephemeral port, in a thread; yields the base URL."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5,
                                           timeout_graceful_shutdown=10))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(30)
        sock.close()
