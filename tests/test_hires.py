"""The hires fix's pieces (sdrt.engine.hires): the latent / image resize against torch's
interpolate (goldens: tools/make_hires_goldens.py), the target size, steps and sigma trim as
sd-cli 0.4.7 computes them, the upscaler names; the whole second pass against sd-cli is
tests/test_hires_sdcli.py (opt-in)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt.engine.hires import HiresPlan, hires_sigmas, interpolate, plan_hires, resolve_hires_upscaler
from sdrt.engine.params import GenParams
from sdrt.errors import UsageError

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hires_interp.npz")


@pytest.fixture(scope="module")
def gold():
    return np.load(FIX)


@pytest.mark.parametrize("key", [f"{m}/{a}/{s}" for m, a in (("bilinear", 0), ("bilinear", 1), ("bicubic", 0),
                                                              ("bicubic", 1), ("nearest", 0), ("nearest-exact", 0))
                                 for s in ("18x22", "16x27", "6x7")])
def test_interpolate_matches_torch(gold, key):
    mode, aa, size = key.split("/")
    h, w = (int(v) for v in size.split("x"))
    got = interpolate(gold["x"], h, w, mode, bool(int(aa)))
    want = gold[key]
    if mode == "bicubic" and aa == "1":
        # torch's antialiased bicubic is PIL's (a = -0.5); sd.cpp keeps a = -0.75. Upscaling, the
        # antialiased filter is the plain one (weights already sum to 1): torch's plain bicubic
        if size == "6x7":
            pytest.skip("antialiased bicubic downscale: no torch oracle (PIL's a = -0.5, sd.cpp's -0.75)")
        want = gold[f"bicubic/0/{size}"]
    if aa == "1" and size == "6x7":
        # antialiased downscale: torch drops the taps past the edge and renormalizes, sd.cpp clamps
        # them onto the edge pixel (then normalizes): they agree where the window stays inside
        e = 1 if mode == "bilinear" else 2
        got, want = got[:, :, e:-e, e:-e], want[:, :, e:-e, e:-e]
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_lanczos_normalized_and_exact_on_identity():
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    assert interpolate(x, 8, 8, "lanczos") is x or np.array_equal(interpolate(x, 8, 8, "lanczos"), x)
    c = np.full((1, 1, 5, 7), 0.3, np.float32)      # weights sum to 1: a constant stays constant
    np.testing.assert_allclose(interpolate(c, 13, 11, "lanczos"), 0.3, atol=1e-6)
    with pytest.raises(UsageError):
        interpolate(x, 4, 4, "nearest", antialias=True)


def _gp(**kw):
    return GenParams(hires=True, **kw)


def test_plan_hires_sizes():
    p = plan_hires(_gp(), 512, 768, 8, None)
    assert (p.upscaler, p.width, p.height, p.steps, p.strength) == ("Latent", 1024, 1536, 0, pytest.approx(0.7))
    assert (plan_hires(_gp(hires_width=640), 512, 512, 8, None).height) == 640      # one side: a square
    p = plan_hires(_gp(hires_scale=1.3), 100, 60, 8, None)                            # round, then align up
    assert (p.width, p.height) == (136, 80)
    assert plan_hires(GenParams(), 512, 512, 8, None) is None
    assert plan_hires(_gp(hires_upscaler="None"), 512, 512, 8, None) is None


def test_hires_steps_and_sigmas():
    sig = lambda n: np.linspace(14.6, 0, n + 1)      # noqa: E731
    plan = HiresPlan("Latent", None, 256, 256, 2, 0.5, 128)
    s, total = hires_sigmas(sig, 20, plan)            # int(2 / 0.5) = 4 steps, t_enc 2: sigmas[1:]
    assert total == 4 and np.allclose(s, sig(4)[1:])
    plan.steps, plan.strength = 0, 0.7                # 0: the first pass's 20 -> int(20 / 0.7) = 28, t_enc 19
    s, total = hires_sigmas(sig, 20, plan)            # sigmas[28 - 19 - 1:]: t_enc + 1 steps, as img2img's
    assert total == 28 and len(s) == 21
    plan.strength = 1.0                               # all steps: t_enc capped at total - 1
    s, total = hires_sigmas(sig, 5, plan)
    assert total == 5 and len(s) == 6


def test_upscaler_names(tmp_path):
    assert resolve_hires_upscaler("", None) == ("Latent", None)
    assert resolve_hires_upscaler("Latent (bicubic antialiased)", None) == ("Latent (bicubic antialiased)", None)
    assert resolve_hires_upscaler("Lanczos", None) == ("Lanczos", None)
    assert resolve_hires_upscaler("Model", None) == ("None", None)      # sd.cpp: no model path, fix off
    (tmp_path / "4x-Ultra.pth").write_bytes(b"x")
    kind, path = resolve_hires_upscaler("4x-Ultra", str(tmp_path))
    assert kind == "Model" and path.endswith("4x-Ultra.pth")
    for bad in ("4x-Ultra.pth", "../4x-Ultra", "missing"):
        with pytest.raises(UsageError):
            resolve_hires_upscaler(bad, str(tmp_path))
    with pytest.raises(UsageError, match="--hires-upscalers-dir"):
        resolve_hires_upscaler("4x-Ultra", None)


def test_validation():
    for kw in ({"hires_denoising_strength": 0.0}, {"hires_steps": -1}, {"hires_width": -5},
               {"hires_scale": 0.0}, {"hires_upscale_tile_size": 0}):
        with pytest.raises(UsageError):
            _gp(**kw).validate()
    with pytest.raises(UsageError, match="--upscale-repeats"):
        GenParams(upscale_repeats=0).validate()


def test_infotext_fields():
    from sdrt.io.png import parameters_text
    s = parameters_text(prompt="p", steps=2, cfg_scale=7, seed=1, width=128, height=128, method="euler",
                        hires=_gp(hires_steps=3).hires_metadata())
    assert ("Hires upscale: Latent, Hires scale: 2.000000, Hires resize: 0x0, Hires steps: 3, "
            "Denoising strength: 0.700000, ") in s


@pytest.mark.parametrize("upscaler", ["Latent", "Lanczos"])
def test_second_pass_written_out(upscaler):
    """The pipeline's hires pass against the same computation written out (stub UNet / VAE of
    tests/test_pipeline.py): reseed, upscale (Lanczos: decode, resize, clamp, encode drawing from
    the RNG), fresh noise, the trimmed schedule at the target size, the first pass's conditioning."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_pipeline import StubCond, StubUNet, _reference_txt2img, gen, make_pipe

    from sdrt.engine.denoisers import make_denoiser
    from sdrt.engine.rng import make_rng
    from sdrt.engine.samplers import Guided, sample
    from sdrt.engine.schedulers import get_sigmas
    from sdrt.models.vae.autoencoder_kl import gaussian_sample
    F32 = np.float32
    pipe = make_pipe()
    r = gen(pipe, sampling_method="euler", hires=True, hires_upscaler=upscaler, hires_steps=2,
            hires_denoising_strength=0.5)[0]
    first = _reference_txt2img(42, "euler")
    den = make_denoiser("eps")
    rng = make_rng("cuda", 42)
    if upscaler == "Latent":
        up = interpolate(first, 16, 16, "bilinear")
    else:
        from test_pipeline import StubVAE
        vae = StubVAE()
        img = np.clip((vae.decode((first / F32(0.18215)).astype(F32)) + F32(1)) * F32(0.5), F32(0), F32(1))
        img = np.clip(interpolate(img, 128, 128, "lanczos"), F32(0), F32(1))
        mom = vae.encode((img * F32(2) - F32(1)).astype(F32))
        up = (gaussian_sample(mom, rng.randn((1, 4, 16, 16))) * F32(0.18215)).astype(F32)
    sig = get_sigmas(den, 4, "discrete")[1:]          # int(2 / 0.5) = 4 steps, t_enc 2
    noise = rng.randn((1, 4, 16, 16))
    x = den.noise_scaling(sig[0], noise, up)
    unet, cond = StubUNet(), StubCond()
    c, u = cond.encode("a cat", 64, 64), cond.encode("", 64, 64)

    def denoise(x, sigma, step):
        cs, co, ci = den.get_scalings(sigma)
        t = np.array([den.sigma_to_t(sigma)], F32)
        oc, ou = unet(x * ci, t, c.context), unet(x * ci, t, u.context)
        return Guided((ou + F32(7.0) * (oc - ou)) * co + x * cs, ou * co + x * cs)

    ref = den.inverse_noise_scaling(sig[-1], sample("euler", denoise, x, sig, rng))
    assert r.latent.shape == (1, 4, 16, 16) and r.image.shape == (128, 128, 3)
    np.testing.assert_allclose(r.latent, ref, rtol=1e-5, atol=1e-5)
    assert "Hires upscale: " + upscaler in r.parameters
