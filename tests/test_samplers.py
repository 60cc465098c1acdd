"""Samplers against stable-diffusion.cpp's own code (goldens) and k-diffusion's formulas.

tests/fixtures/sampling_samplers.npz comes from tools/make_sampling_goldens.py: sd.cpp's
``sample_k_diffusion`` compiled from its source, run on the toy denoiser below with sd.cpp's RNGs.
Given the same denoiser outputs our samplers must give the same bits, and call the denoiser with
the same (sigma, step) sequence. A second set of checks re-derives the classic samplers from
k-diffusion's equations in float64 (independent of sd.cpp) and compares within tolerance.
"""

import math
import os

import numpy as np
import pytest

from sdrt.engine import samplers as S
from sdrt.engine.rng import make_rng
from sdrt.errors import UsageError

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "sampling_samplers.npz")
G = np.load(FIX)
F32 = np.float32
CASES = sorted({k.split("__")[0] for k in G.files if k.startswith("case")})


def toy(b, c, ka=1.7, kb=0.6, log=None):
    ka, kb = F32(ka), F32(kb)

    def denoise(x, sigma, step):
        sigma = F32(sigma)
        if log is not None:
            log.extend([sigma, F32(step)])
        k1 = F32(ka / F32(F32(sigma * sigma) + ka))
        k2 = F32(kb / F32(F32(sigma * sigma) + kb))
        return S.Guided(x * k1 + b, x * k2 + c)
    return denoise


def test_registry_matches_sdcpp():
    assert list(S.SAMPLERS) == [
        "euler", "euler_a", "heun", "dpm2", "dpm++2s_a", "dpm++2m", "dpm++2mv2", "ipndm", "ipndm_v", "lcm",
        "ddim_trailing", "tcd", "res_multistep", "res_2s", "er_sde", "euler_cfg_pp", "euler_a_cfg_pp",
        "euler_ge", "dpm++2m_sde", "dpm++2m_sde_bt", "lms"]
    eta1 = {k for k, v in S.SAMPLERS.items() if v.default_eta == 1.0}
    assert eta1 == {"euler_a", "dpm++2s_a", "er_sde", "euler_a_cfg_pp", "dpm++2m_sde", "dpm++2m_sde_bt"}
    assert S.resolve_eta(None, "tcd") == 0.0 and S.resolve_eta(0.3, "euler_a") == 0.3
    assert S.resolve_eta(None, "euler", "hidream_o1") == 8.0
    with pytest.raises(UsageError, match="valid: euler, euler_a"):
        S.sample("euler_x", None, np.zeros(1, np.float32), [1.0, 0.0])


def test_defaults_table():
    assert S.default_sample_method("sd1") == "euler_a"
    assert S.default_sample_method("sdxl") == "euler_a"
    assert S.default_sample_method("flux") == "euler"
    assert S.default_sample_method("pid") == "lcm"
    assert S.default_scheduler("euler_a", "sd1") == "discrete"
    assert S.default_scheduler("lcm", "sd1") == "lcm"
    assert S.default_scheduler("tcd", "sdxl") == "lcm"
    assert S.default_scheduler("ddim_trailing", "sd1") == "simple"
    assert S.default_scheduler("euler", "sdxl", "edm_v") == "exponential"
    assert S.default_scheduler("euler", "flux") == "flux"
    assert S.default_scheduler("euler", "flux2") == "flux2"


@pytest.mark.parametrize("case", CASES)
def test_sampler_bit_exact_vs_sdcpp(case):
    method, eta, flow, rk, seed, extra = [str(v) for v in G[case + "__meta"]]
    x0 = G[str(G[case + "__x0"])]
    sig = G[case + "__sigmas"]
    log = []
    rng = make_rng(rk, int(seed))
    out = S.sample(method, toy(G["b"], G["c"], log=log), x0, sig, rng, eta=float(eta),
                   is_flow=flow == "1", extra_args=extra)
    ref = G[case]
    calls = np.array(log, np.float32)
    np.testing.assert_array_equal(calls, G[case + "__calls"], err_msg=f"{method}: denoiser calls differ")
    assert out.dtype == np.float32 and out.shape == x0.shape
    if not np.array_equal(out, ref):
        err = np.max(np.abs(out - ref) / (np.abs(ref) + 1e-6))
        pytest.fail(f"{case} {method} eta={eta} flow={flow} rng={rk} extra={extra!r}: "
                    f"{np.sum(out != ref)} of {out.size} differ, max rel {err:.3g}")


def test_callback_and_shape():
    seen = []
    x = np.ones((1, 2, 3, 3), np.float32)
    sig = np.array([2.0, 1.0, 0.5, 0.0], np.float32)
    out = S.sample("euler", toy(F32(0.1), F32(0.0)), x, sig, callback=seen.append)
    assert out.shape == x.shape and [d["i"] for d in seen] == [0, 1, 2]
    assert set(seen[0]) == {"i", "x", "sigma", "sigma_next", "denoised"}


def test_cfg_pp_needs_uncond():
    with pytest.raises(UsageError, match="unconditioned"):
        S.sample("euler_cfg_pp", lambda x, s, i: x * 0, np.ones(3, np.float32), [1.0, 0.0])


def test_stochastic_needs_rng():
    with pytest.raises(UsageError, match="rng"):
        S.sample("euler_a", lambda x, s, i: x * 0, np.ones(3, np.float32), [1.0, 0.5, 0.0])


# ---------------------------------------------------------------- k-diffusion formulas (float64)
def _kd_model(b, ka=1.7):
    def model(x, sigma):
        return x * (ka / (sigma * sigma + ka)) + b
    return model


def kd_euler(model, x, s):
    for i in range(len(s) - 1):
        d = (x - model(x, s[i])) / s[i]
        x = x + d * (s[i + 1] - s[i])
    return x


def kd_heun(model, x, s):
    for i in range(len(s) - 1):
        d = (x - model(x, s[i])) / s[i]
        dt = s[i + 1] - s[i]
        if s[i + 1] == 0:
            x = x + d * dt
        else:
            x2 = x + d * dt
            d2 = (x2 - model(x2, s[i + 1])) / s[i + 1]
            x = x + (d + d2) / 2 * dt
    return x


def kd_dpm2(model, x, s):
    for i in range(len(s) - 1):
        d = (x - model(x, s[i])) / s[i]
        if s[i + 1] == 0:
            x = x + d * (s[i + 1] - s[i])
        else:
            sm = math.exp((math.log(s[i]) + math.log(s[i + 1])) / 2)
            x2 = x + d * (sm - s[i])
            x = x + (x2 - model(x2, sm)) / sm * (s[i + 1] - s[i])
    return x


def kd_dpmpp_2m(model, x, s):
    old = None
    for i in range(len(s) - 1):
        den = model(x, s[i])
        t, tn = -math.log(s[i]), -math.log(s[i + 1]) if s[i + 1] > 0 else math.inf
        h = tn - t
        if old is None or s[i + 1] == 0:
            x = (s[i + 1] / s[i]) * x - math.expm1(-h) * den
        else:
            r = (t + math.log(s[i - 1])) / h
            dd = (1 + 1 / (2 * r)) * den - (1 / (2 * r)) * old
            x = (s[i + 1] / s[i]) * x - math.expm1(-h) * dd
        old = den
    return x


def kd_euler_ancestral(model, x, s, noise, eta=1.0):
    for i in range(len(s) - 1):
        den = model(x, s[i])
        su = min(s[i + 1], eta * math.sqrt(s[i + 1] ** 2 * (s[i] ** 2 - s[i + 1] ** 2) / s[i] ** 2))
        sd = math.sqrt(s[i + 1] ** 2 - su ** 2)
        x = x + (x - den) / s[i] * (sd - s[i])
        if s[i + 1] > 0:
            x = x + noise(i) * su
    return x


def kd_lms(model, x, s, order=4):
    from scipy import integrate

    def coeff(o, t, i, j):
        def fn(tau):
            prod = 1.0
            for k in range(o):
                if j != k:
                    prod *= (tau - t[i - k]) / (t[i - j] - t[i - k])
            return prod
        return integrate.quad(fn, t[i], t[i + 1], epsrel=1e-6)[0]

    ds = []
    for i in range(len(s) - 1):
        d = (x - model(x, s[i])) / s[i]
        ds.append(d)
        ds = ds[-order:]
        o = min(i + 1, order)
        cs = [coeff(o, s, i, j) for j in range(o)]
        x = x + sum(c * dd for c, dd in zip(cs, reversed(ds)))
    return x


def _case_inputs():
    sig = G["case000__sigmas"]  # discrete, 6 steps, eps
    return G["x_eps"].astype(np.float64), sig.astype(np.float64), sig, G["b"]


@pytest.mark.parametrize("name,ref", [("euler", kd_euler), ("heun", kd_heun), ("dpm2", kd_dpm2),
                                      ("dpm++2m", kd_dpmpp_2m)])
def test_deterministic_vs_kdiffusion(name, ref):
    x64, s64, s32, b = _case_inputs()
    want = ref(_kd_model(b.astype(np.float64)), x64, [float(v) for v in s64])
    got = S.sample(name, toy(b, G["c"]), x64.astype(np.float32), s32)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_euler_ancestral_vs_kdiffusion():
    x64, s64, s32, b = _case_inputs()
    draws = make_rng("cuda", 9)
    noises = [draws.randn(x64.shape).astype(np.float64) for _ in range(len(s32) - 1)]
    want = kd_euler_ancestral(_kd_model(b.astype(np.float64)), x64, [float(v) for v in s64], lambda i: noises[i])
    got = S.sample("euler_a", toy(b, G["c"]), x64.astype(np.float32), s32, make_rng("cuda", 9))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_lms_original_vs_kdiffusion():
    pytest.importorskip("scipy")
    x64, s64, s32, b = _case_inputs()
    want = kd_lms(_kd_model(b.astype(np.float64)), x64, [float(v) for v in s64])
    # lms_shift=0 is k-diffusion's original history; the coefficients by a 1000-point midpoint sum
    got = S.sample("lms", toy(b, G["c"]), x64.astype(np.float32), s32, extra_args="lms_shift=0")
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
