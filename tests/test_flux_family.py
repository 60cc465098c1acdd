"""The Flux family through the registry: detection, components and flags, the conditioner
(sd.cpp's FluxCLIPEmbedder / T5CLIPEmbedder), and whole runs on tiny random checkpoints with the
real tensor names (tests/flux_tiny.py), checked against an independent re-implementation of the
sampling loop (schedule, noise, Euler, guidance, CFG written out here) and a golden image.

The golden (tests/fixtures/regression_flux_tiny.png) was written by this code; regenerate it only
for an intended image change: `SDRT_UPDATE_GOLDEN=1 python -m pytest tests/test_flux_family.py`.
"""
from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest

import flux_tiny as ft
from sdrt.cli import main as cli
from sdrt.engine.params import GenParams, ModelParams
from sdrt.engine.pipeline import Pipeline
from sdrt.engine.rng import make_rng
from sdrt.errors import UnsupportedError, UsageError
from sdrt.io import open_model
from sdrt.io.detect import detect_version
from sdrt.models import families as FM
from sdrt.models.families import get_family
from sdrt.models.prompt import parse_prompt_attention
from sdrt.models.te.t5_tokenizer import EOS_ID, PAD_ID, T5Tokenizer

F32 = np.float32
DM = "model.diffusion_model."
GOLDEN = os.path.join(ft.ROOT, "tests", "fixtures", "regression_flux_tiny.png")
MIN_PSNR = 60.0
ARGS = ["-p", "a red (fox:1.3) in snow", "-W", "64", "-H", "64", "--steps", "3", "-s", "7", "-t", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux")
    return {"dev": ft.write(str(d / "dev"), "dev"), "schnell": ft.write(str(d / "schnell"), "schnell", single=False),
            "chroma": ft.write(str(d / "chroma"), "chroma"), "fill": ft.write(str(d / "fill"), "fill"),
            "dir": str(d)}


pytestmark = pytest.mark.usefixtures("one_thread")


def mp_of(args) -> ModelParams:
    kw = {"-m": "model", "--diffusion-model": "diffusion_model", "--vae": "vae", "--clip_l": "clip_l"}
    d, parts = {}, {}
    for flag, path in zip(args[::2], args[1::2]):
        if flag == "--t5xxl":
            parts["t5xxl"] = path
        else:
            d[kw[flag]] = path
    return ModelParams(**d, parts=parts, rng="cuda")


# ---- registry ---------------------------------------------------------------------------------------

def test_record():
    fam = get_family("flux")
    assert fam.runnable and set(fam.versions) == {"flux", "flux_fill", "chroma"}
    assert (fam.latent_channels, fam.latent_scale_shift(), fam.size_multiple) == (16, (0.3611, 0.1159), 16)
    assert (fam.prediction, fam.default_sampler, fam.default_scheduler) == ("flux_flow", "euler", "flux")
    assert fam.text_encoders == ("clip_l", "t5xxl") and fam.distilled_guidance
    assert fam.variant("flux_fill").concat == "fill" and fam.supports("ref_images")
    assert fam.flow_shift_of("flux", {DM + "guidance_in.in_layer.weight": 0}) == 1.15
    assert fam.flow_shift_of("flux", {DM + "img_in.weight": 0}) == 1.0
    assert FM.component("t5xxl").prefix_for("dit") == "text_encoders.t5xxl.transformer."
    for v in ("chroma_radiance", "ovis_image", "flux_controls", "flex_2", "flux2", "flux2_klein"):
        assert not FM.family_of(v).runnable, v


def _table(variant, **extra):
    t = {DM + k: v for k, v in ft.dit_names(variant).items()}
    t.update(extra)
    return t


@pytest.mark.parametrize("variant,version", [("dev", "flux"), ("schnell", "flux"), ("fill", "flux_fill"),
                                             ("chroma", "chroma")])
def test_detection(variant, version):
    assert detect_version(_table(variant)) == version
    bare = ft.dit_names(variant)                         # a --diffusion-model file: bare BFL names
    assert detect_version(bare) == version


def test_refused_variants_by_name():
    controls = _table("dev")
    controls[DM + "img_in.weight"] = (128, 128)
    assert detect_version(controls) == "flux_controls"
    assert detect_version(_table("chroma", **{DM + "nerf_final_layer_conv.weight": (3, 8)})) == "chroma_radiance"
    assert detect_version(_table("dev", **{DM + "double_stream_modulation_img.lin.weight": (6, 8)})) == "flux2_klein"
    for version, name in (("chroma_radiance", "Chroma Radiance"), ("flux2", "Flux.2"),
                          ("flux_controls", "Flux Controls")):
        with pytest.raises(UnsupportedError, match=f"{version}.*{name}.*recognized"):
            Pipeline(version=version, prediction="flux_flow")


def test_files_detect(files):
    assert detect_version(open_model(files["dev"][1])) == "flux"
    assert detect_version(open_model(files["chroma"][1])) == "chroma"


def test_flags():
    p = cli.build_parser()
    a = p.parse_args(["-m", "x", "--t5xxl", "t5", "--clip_l", "c", "-r", "a.png", "--ref-image", "b.png",
                      "--increase-ref-index", "--flow-shift", "3", "--guidance", "2.5", "--chroma-disable-dit-mask",
                      "--chroma-enable-t5-mask", "--chroma-t5-mask-pad", "4"])
    assert (a.t5xxl, a.clip_l, a.ref_image, a.increase_ref_index, a.flow_shift, a.guidance) == (
        "t5", "c", ["a.png", "b.png"], True, 3.0, 2.5)
    assert (a.chroma_disable_dit_mask, a.chroma_enable_t5_mask, a.chroma_t5_mask_pad) == (True, True, 4)
    d = p.parse_args(["-m", "x"])
    assert (d.ref_image, d.increase_ref_index, math.isinf(d.flow_shift), d.guidance, d.chroma_t5_mask_pad) == (
        [], False, True, 3.5, 1)


# ---- conditioner ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dev_pipe(files):
    return Pipeline.load(mp_of(files["dev"]))


def test_conditioner_flux(dev_pipe):
    """context = T5 over [pieces, </s>, <pad> ...] (256), each token's state times its weight, then
    rescaled to the unweighted mean; y = CLIP-L's final-normed state at the first </s> of chunk 0."""
    cond = dev_pipe.conditioner
    prompt = "a red (fox:1.3) in snow"
    c = cond.encode(prompt)
    assert c.context.shape == (1, 256, ft.T5_D) and c.y.shape == (1, ft.CLIP_W)
    tok = T5Tokenizer(style="sdcpp")
    pieces, weights = [], []
    for text, w in parse_prompt_attention(prompt):
        ids = tok.tokenize(text)
        pieces += ids
        weights += [w] * len(ids)
    ids = np.full(256, PAD_ID, np.int64)
    ids[:len(pieces)] = pieces
    ids[len(pieces)] = EOS_ID
    w = np.ones(256)
    w[:len(weights)] = weights
    assert F32(1.3) in weights
    h = cond.t5.run(ids.reshape(1, -1))[0].astype(np.float64)           # [256, D], unmasked as sd.cpp
    want = h * w[:, None]
    want *= h.mean() / want.mean()
    np.testing.assert_allclose(c.context[0], want, rtol=1e-5, atol=1e-5)
    # pooled: CLIP-L over BOS + tokens + EOS + EOS-padding, final-normed state at the first EOS
    from sdrt.models.prompt import tokenize_weighted
    cids, _ = tokenize_weighted(prompt, cond.clip_tokenizer, None, 77)
    first = cids[:77]
    eos = int(np.flatnonzero(first == cond.clip_tokenizer.eos_id)[0])
    hidden, _ = cond.clip.run(first.reshape(1, -1), final_ln=True)
    np.testing.assert_allclose(c.y[0], hidden[0, eos], rtol=1e-5, atol=1e-5)


def test_conditioner_chroma(files):
    pipe = Pipeline.load(mp_of(files["chroma"]))
    c = pipe.conditioner.encode("a fox")
    n = len(T5Tokenizer(style="sdcpp").tokenize("a fox")) + 1            # + </s>
    assert c.context.shape == (1, 512, ft.T5_D) and c.y.shape == (1, 512)
    assert np.all(c.y[0, :n + 1] == 0) and np.all(np.isneginf(c.y[0, n + 1:]))   # pad 1: one <pad> attended
    mp = mp_of(files["chroma"])
    mp.model_args = {"chroma_use_dit_mask": False, "chroma_use_t5_mask": True, "chroma_t5_mask_pad": 3}
    c2 = Pipeline.load(mp).conditioner.encode("a fox")
    assert c2.y is None                                                    # no DiT mask
    assert np.abs(c2.context[0, :n] - c.context[0, :n]).max() > 1e-4      # T5 itself masked


def test_missing_components(files, tmp_path):
    dev = files["dev"][1]
    with pytest.raises(UsageError, match="--t5xxl"):
        Pipeline.load(ModelParams(model=files["schnell"][1])).conditioner
    schnell = dict(zip(files["schnell"][::2], files["schnell"][1::2]))
    mp = ModelParams(diffusion_model=schnell["--diffusion-model"], parts={"t5xxl": schnell["--t5xxl"]})
    with pytest.raises(UsageError, match="clip_l.safetensors.*--clip_l"):
        Pipeline.load(mp).conditioner
    with pytest.raises(Exception, match="--vae"):
        Pipeline.load(mp).vae
    assert cli.main(["-m", dev, "-r", str(tmp_path / "none.png"), "-p", "x"]) == 2


# ---- the sampling loop, re-implemented ---------------------------------------------------------------

def flux_sigmas(steps: int, h: int, w: int) -> np.ndarray:
    """The `flux` scheduler written out (float64): mu linear in latent pixels (256 -> 0.5,
    4096 -> 1.15), t = 1 - i/n, sigma = e^mu / (e^mu + (1/t - 1)), last 0."""
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (h * w - 256)
    s = []
    for i in range(steps):
        t = 1 - i / steps
        s.append(math.exp(mu) / (math.exp(mu) + (1 / t - 1)))
    return np.array(s + [0.0])


def reference_run(pipe, prompt, negative, steps, cfg, guidance, seed, size=64):
    """Euler on x' = v (flux flow: denoised = x - sigma v), true CFG when cfg != 1, from the
    context RNG's noise; the FluxModel is called directly with the conditioner's outputs."""
    model = pipe.diffusion_model.model
    cond = pipe.conditioner.encode(prompt)
    unc = pipe.conditioner.encode(negative) if cfg != 1 else None
    lat = size // 8
    sig = flux_sigmas(steps, lat, lat)
    x = make_rng("cuda", seed).randn((1, 16, lat, lat)).astype(np.float64) * sig[0]
    g = np.array([guidance], F32) if model.config.guidance_embed else None
    y = (lambda c: None if model.config.is_chroma else c.y)
    m = (lambda c: c.y if model.config.is_chroma else None)
    calls = 0
    for i in range(steps):
        t = np.array([sig[i]], F32)
        v = model(x.astype(F32), t, cond.context, y(cond), g, txt_mask_np=m(cond)).astype(np.float64)
        calls += 1
        if unc is not None:
            vu = model(x.astype(F32), t, unc.context, y(unc), g, txt_mask_np=m(unc)).astype(np.float64)
            v = vu + cfg * (v - vu)
        denoised = x - sig[i] * v
        x = x + (x - denoised) / sig[i] * (sig[i + 1] - sig[i])
    return x, calls


class Counting:
    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def predict(self, x, t, cond, backend="cpu"):
        self.batches.append(x.shape[0])
        assert cond.guidance == 2.5
        return self.inner.predict(x, t, cond, backend)


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_sampling_matches_reimplementation(dev_pipe, cfg):
    counting = Counting(dev_pipe.diffusion_model)
    pipe = Pipeline(version="flux", prediction="flux_flow", diffusion_model=counting, vae=dev_pipe.vae,
                    conditioner=dev_pipe.conditioner, models=dev_pipe.models)
    gp = GenParams(prompt="a red (fox:1.3) in snow", negative_prompt="blurry", width=64, height=64, steps=3,
                   cfg_scale=cfg, guidance=2.5, seed=7)
    out = pipe.generate(gp, show_progress=False)[0]
    # cfg 1: one model call of batch 1 per step; cfg 3: one batched call (cond + uncond) per step
    assert counting.batches == [1 if cfg == 1 else 2] * 3
    want, _ = reference_run(dev_pipe, gp.prompt, gp.negative_prompt, 3, cfg, 2.5, 7)
    got = out.latent
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max(), np.abs(got - want).max()
    assert out.info["method"] == "euler" and out.info["scheduler"] == "flux"


def test_guidance_and_flow_shift_reach_the_model(dev_pipe):
    gp = GenParams(prompt="a fox", width=64, height=64, steps=2, cfg_scale=1.0, seed=3)
    a = dev_pipe.generate(gp, show_progress=False)[0].latent
    b = dev_pipe.generate(gp.replace(guidance=6.0), show_progress=False)[0].latent
    assert np.abs(a - b).max() > 1e-3
    # the flux scheduler ignores the shift (sd.cpp); a discrete schedule uses it
    c = dev_pipe.generate(gp.replace(scheduler="discrete"), show_progress=False)[0].latent
    d = dev_pipe.generate(gp.replace(scheduler="discrete", flow_shift=3.0), show_progress=False)[0].latent
    assert np.abs(c - d).max() > 1e-3
    e = dev_pipe.generate(gp.replace(scheduler="discrete"), show_progress=False)[0].latent
    np.testing.assert_array_equal(c, e)                 # the next request is back to the model's 1.15
    assert dev_pipe.denoiser.shift == F32(1.15)


def test_kontext_reference_latents(dev_pipe, tmp_path):
    from PIL import Image
    ref = tmp_path / "ref.png"
    Image.fromarray((np.random.default_rng(0).random((48, 80, 3)) * 255).astype(np.uint8)).save(ref)
    seen = []

    class Spy:
        def predict(self, x, t, cond, backend="cpu"):
            seen.append((len(cond.ref_latents), [r.shape for r in cond.ref_latents], cond.ref_index_mode))
            return dev_pipe.diffusion_model.predict(x, t, cond, backend)

    pipe = Pipeline(version="flux", prediction="flux_flow", diffusion_model=Spy(), vae=dev_pipe.vae,
                    conditioner=dev_pipe.conditioner, models=dev_pipe.models)
    gp = GenParams(prompt="a fox", width=64, height=64, steps=1, cfg_scale=1.0, seed=3, ref_images=[str(ref)] * 2,
                   increase_ref_index=True)
    plain = pipe.generate(gp.replace(ref_images=[]), show_progress=False)[0].latent
    out = pipe.generate(gp, show_progress=False)[0].latent
    # sd.cpp's resize: area min(1024^2, 64*64), aspect 80:48 -> 80x48 pixels -> 10x6 latents
    assert seen[-1] == (2, [(1, 16, 6, 10)] * 2, "increase")
    assert np.abs(out - plain).max() > 1e-4


def test_fill_runs_with_mask(files, tmp_path):
    from PIL import Image
    pipe = Pipeline.load(mp_of(files["fill"]))
    init, mask = tmp_path / "i.png", tmp_path / "m.png"
    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(init)
    m = np.zeros((64, 64), np.uint8)
    m[16:48, 16:48] = 255
    Image.fromarray(m).save(mask)
    seen = []

    class Spy:
        def predict(self, x, t, cond, backend="cpu"):
            seen.append(cond.c_concat.shape)
            return pipe.diffusion_model.predict(x, t, cond, backend)

    spy = Pipeline(version="flux_fill", prediction="flux_flow", diffusion_model=Spy(), vae=pipe.vae,
                   conditioner=pipe.conditioner, models=pipe.models)
    spy.generate(GenParams(prompt="x", steps=1, cfg_scale=1.0, init_image=str(init), mask_image=str(mask),
                           strength=1.0), show_progress=False)
    assert seen == [(1, 80, 8, 8)]


# ---- the CLI ----------------------------------------------------------------------------------------

def read_rgb(path):
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.float64)


def psnr(a, b):
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_cli_dev_matches_golden(files, tmp_path):
    out = str(tmp_path / "dev.png")
    assert cli.main([*files["dev"], *ARGS, "--cfg-scale", "1", "-o", out]) == 0
    img = read_rgb(out)
    if os.environ.get("SDRT_UPDATE_GOLDEN"):
        shutil.copyfile(out, GOLDEN)
        pytest.fail(f"golden rewritten at {GOLDEN}; commit it and run again without SDRT_UPDATE_GOLDEN")
    assert img.shape == (64, 64, 3) and img.std() > 5
    assert psnr(img, read_rgb(GOLDEN)) >= MIN_PSNR


@pytest.mark.parametrize("variant", ["schnell", "chroma"])
def test_cli_matches_reimplementation(files, tmp_path, variant):
    """The CLI's image (split files for schnell, one -m file for Chroma) against the re-implemented
    loop's latent decoded by the same VAE."""
    out = str(tmp_path / f"{variant}.png")
    assert cli.main([*files[variant], *ARGS, "--cfg-scale", "1", "-o", out]) == 0
    pipe = Pipeline.load(mp_of(files[variant]))
    lat, calls = reference_run(pipe, "a red (fox:1.3) in snow", "", 3, 1.0, 3.5, 7)
    assert calls == 3
    img = pipe.vae.decode((lat / 0.3611 + 0.1159).astype(F32))          # Flux's latent scale / shift
    want = np.clip((np.asarray(img, np.float64)[0].transpose(1, 2, 0) + 1) / 2, 0, 1) * 255
    assert psnr(read_rgb(out), want) >= 45


@pytest.mark.parametrize("change", [["--guidance", "3.0"], ["--scheduler", "simple"]])
def test_a_changed_image_fails_the_golden(files, tmp_path, change):
    """The golden's bar catches a wrong guidance or schedule. (A prompt-weight change moves this
    random tiny DiT's image little, 69 dB: the conditioner's weighting is checked directly above.)"""
    out = str(tmp_path / "x.png")
    assert cli.main([*files["dev"], *ARGS, "--cfg-scale", "1", *change, "-o", out]) == 0
    assert psnr(read_rgb(out), read_rgb(GOLDEN)) < MIN_PSNR - 10


# ---- diffusers-named Flux weights --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_diffusers_file_matches_golden(tmp_path, dtype):
    """A diffusers-named FluxTransformer2DModel file through the loader (names.py splits q/k/v into
    parts) and the family's model builder (parts joined, norm_out's halves swapped) reproduces
    diffusers' output (tests/fixtures/flux_transformer.npz, head width 16: axes given)."""
    from sdrt.engine.model_manager import load_models
    from sdrt.models.diffusion.flux import FluxConfig, FluxModel
    from sdrt.models.flux import join_diffusers_parts
    from test_flux import AXES, diffusers_state, inputs, rel_err
    path = str(tmp_path / "diffusion_pytorch_model.safetensors")
    from sdrt.io import write_safetensors
    write_safetensors(path, {k: np.ascontiguousarray(v) for k, v in diffusers_state("dev").items()})
    models = load_models(ModelParams(diffusion_model=path, type=None if dtype == "f16" else dtype))
    assert models.version == "flux" and DM + "double_blocks.0.img_attn.qkv.weight.1" in models.tensors
    tab = join_diffusers_parts(models.tensors)
    assert not any(k.endswith(".weight.1") for k in tab)
    m = FluxModel(tab, config=FluxConfig.detect_from_weights(tab, axes_dim=AXES))
    args, ref = inputs("dev")
    assert rel_err(m(*args), ref) <= (1e-4 if dtype == "f16" else 2e-2)
    joined = tab[DM + "double_blocks.0.img_attn.qkv.weight"]
    assert not joined.storage.flags.writeable   # a weight to device backends, not a per-run input
    bfl = load_models(ModelParams(diffusion_model=path))
    plain = {k: v for k, v in bfl.tensors.items() if not k.endswith((".1", ".2", ".3"))}
    assert join_diffusers_parts(plain) is plain                # BFL tables pass through untouched


def test_ref_image_size_like_sdcpp():
    """vae_width = sqrt(area * w / h) (integer division first, as sd.cpp's ints), height from the
    aspect, both rounded (C round) to 16; area = min(1024^2, W * H)."""
    from sdrt.engine.stages import ref_image_size
    assert ref_image_size(1000, 700, 1024, 1024) == (1216, 864)     # sqrt(1497965) = 1223.9 -> 76.5 x 16
    assert ref_image_size(2048, 2048, 2048, 2048) == (1024, 1024)   # capped at 1024^2
    assert ref_image_size(80, 48, 64, 64) == (80, 48)
