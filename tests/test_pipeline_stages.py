"""The named stages of one request (sdrt.engine.stages + Pipeline.conditions / sample_one /
decode_all), each on its own: size, guidance plan, sample plan, latents and masks, conditioning."""
from __future__ import annotations

import numpy as np
import pytest

from sdrt.engine import stages as S
from sdrt.engine.denoisers import make_denoiser
from sdrt.engine.params import GenParams
from sdrt.errors import UsageError
from sdrt.models.families import get_family
from test_pipeline import make_pipe

F32 = np.float32
SD1, XL = get_family("sd1"), get_family("sdxl")


def test_plan_size_aligns_to_the_family_multiple_and_reads_images():
    s = S.plan_size(GenParams(width=100, height=64, seed=7), SD1)
    assert (s.width, s.height, s.meta_w, s.meta_h, s.seed) == (128, 64, 100, 64, 7) and s.init_img is None
    img = np.zeros((48, 80, 3), np.uint8)
    s = S.plan_size(GenParams(init_image=img, mask_image=np.zeros((48, 80), np.uint8)), SD1)
    assert (s.gp.width, s.gp.height, s.width, s.height) == (80, 48, 128, 64)      # the init image's size
    assert s.init_img.shape == (48, 80, 3) and s.mask_img.shape == (48, 80, 1)
    with pytest.raises(UsageError, match="--mask: the mask is"):
        S.plan_size(GenParams(init_image=img, mask_image=np.zeros((8, 8), np.uint8)), SD1)


def test_plan_guidance():
    g = S.plan_guidance(GenParams(cfg_scale=1.0), SD1.variant("sd1"))
    assert (g.cfg, g.img_cfg, g.use_uncond, g.use_img_cond) == (1, 1, False, False)
    g = S.plan_guidance(GenParams(cfg_scale=7.0, img_cfg_scale=1.5), SD1.variant("sd1"))
    assert (g.img_cfg, g.use_uncond, g.use_img_cond) == (7, True, False)                # follows cfg
    g = S.plan_guidance(GenParams(cfg_scale=1.0, img_cfg_scale=1.5), SD1.variant("sd1_pix2pix"))
    assert (g.img_cfg, g.use_uncond, g.use_img_cond) == (F32(1.5), True, True)          # img-cond needs uncond
    assert isinstance(g.cfg, F32)


def test_plan_sampling_defaults_and_img2img_cut():
    den = make_denoiser("eps")
    p = S.plan_sampling(GenParams(steps=4), SD1, "eps", den, 64, 64, img2img=False)
    assert (p.method, p.scheduler, p.steps, p.t_enc, p.eta) == ("euler_a", "discrete", 4, None, 1.0)
    p = S.plan_sampling(GenParams(steps=4, strength=0.5), SD1, "eps", den, 64, 64, img2img=True)
    assert (p.steps, p.t_enc) == (3, 2)                                              # sd.cpp: t_enc + 1 steps
    p = S.plan_sampling(GenParams(steps=4, sampling_method="lcm"), XL, "eps", den, 64, 64, img2img=False)
    assert p.scheduler == "lcm"
    p = S.plan_sampling(GenParams(sigmas=[3.0, 1.0, 0.0]), SD1, "eps", den, 64, 64, img2img=False)
    assert p.steps == 2 and p.sigmas.dtype == F32


def test_prepare_latents_txt2img_inpaint_and_edit():
    size = S.plan_size(GenParams(width=64, height=64), SD1)
    calls = []

    def encode(img):
        calls.append(img.copy())
        return np.full((1, 4, img.shape[2] // 8, img.shape[3] // 8), len(calls), F32)

    lat = S.prepare_latents(size, SD1, SD1.variant("sd1"), encode)
    assert lat.init.shape == (1, 4, 8, 8) and not lat.init.any() and lat.concat is None and lat.denoise_mask is None
    assert not calls
    init = np.full((64, 64, 3), 255, np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[:8, :8] = 255
    size = S.plan_size(GenParams(width=64, height=64, init_image=init, mask_image=mask), SD1)
    lat = S.prepare_latents(size, SD1, SD1.variant("sd1_inpaint"), encode)
    assert len(calls) == 2 and lat.init[0, 0, 0, 0] == 1                          # init first, then masked image
    assert np.allclose(calls[1][:, :, :8, :8], 0.5) and np.allclose(calls[1][:, :, 8:, 8:], 1.0)
    assert lat.concat.shape == (1, 5, 8, 8) and lat.concat[0, 0, 0, 0] == 1 and lat.concat[0, 1, 0, 0] == 2
    assert not lat.uncond_concat[:, 1:].any()
    assert lat.denoise_mask[0, 0, :2, :2].all() and lat.denoise_mask.sum() == 4         # dilated 3x3
    lat = S.prepare_latents(S.plan_size(GenParams(width=64, height=64), SD1), SD1, SD1.variant("sd1_pix2pix"),
                            encode)
    assert lat.img_cfg_follows_cfg and lat.concat.shape == (1, 4, 8, 8) and not lat.uncond_concat.any()


def test_conditions_stage_builds_the_passes():
    pipe = make_pipe(version="sd1_pix2pix")
    g = S.GuidancePlan(F32(7), F32(1.5), True, True)
    concat = np.ones((1, 4, 8, 8), F32)
    lat = S.Latents(np.zeros((1, 4, 8, 8), F32), concat, np.zeros_like(concat))
    cond, uncond, img_cond = pipe.conditions(GenParams(prompt="a", negative_prompt="b"), 64, 64, g, lat)
    assert cond.c_concat is concat and not uncond.c_concat.any() and img_cond.c_concat is concat
    assert np.array_equal(img_cond.context, uncond.context) and cond.guidance is None
    cond, uncond, img_cond = pipe.conditions(GenParams(prompt="a"), 64, 64, S.GuidancePlan(F32(1), F32(1), False, False),
                                             S.Latents(np.zeros((1, 4, 8, 8), F32)))
    assert uncond is None and img_cond is None and cond.c_concat is None


def test_sample_one_and_decode_all_stages():
    pipe = make_pipe()
    gp = GenParams(prompt="a", width=64, height=64, steps=2)
    size = S.plan_size(gp, SD1)
    plan = S.plan_sampling(gp, SD1, "eps", pipe.denoiser, 64, 64, img2img=False)
    g = S.plan_guidance(gp, SD1.variant("sd1"))
    lat = S.Latents(np.zeros((1, 4, 8, 8), F32))
    passes = pipe.conditions(gp, 64, 64, g, lat)
    from sdrt.engine.rng import make_rng
    rng = make_rng("cuda", 5)
    x0 = pipe.sample_one(5, rng, rng, plan, g, lat, passes, lambda *a: None)
    assert x0.shape == (1, 4, 8, 8) and x0.dtype == F32
    ref = pipe.generate(gp.replace(seed=5), show_progress=False)[0]
    assert np.array_equal(ref.latent, x0)                                             # the stage is the request's
    out = pipe.decode_all([(5, x0)], gp, size, plan, pipe.model_params, S_bar())
    assert np.array_equal(out[0].image, ref.image) and out[0].info["method"] == "euler_a"


def S_bar():
    from sdrt.engine.pipeline import ProgressBar
    return ProgressBar(enabled=False)
