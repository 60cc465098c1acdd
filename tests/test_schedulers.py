"""Schedulers and denoisers against stable-diffusion.cpp's own code and k-diffusion's formulas.

tests/fixtures/sampling_schedulers.npz holds the sigmas sd.cpp's ``Denoiser::get_sigmas`` returns
(compiled from its source by tools/make_sampling_goldens.py) for every scheduler, eps / edm_v /
sd3_flow / flux_flow denoisers, 1-30 steps, the AYS model families, image token counts and extra
args. Ours must match bit for bit (NaN where sd.cpp divides 0 by 0). k-diffusion's
get_sigmas_karras / get_sigmas_exponential and CompVisDenoiser are re-derived in float64 below.
"""

import math
import os

import numpy as np
import pytest

from sdrt.engine import denoisers as D
from sdrt.engine import schedulers as SC
from sdrt.errors import UsageError

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "sampling_schedulers.npz")
G = np.load(FIX)
KEYS = [str(k) for k in G["keys"]]


def _den(pred):
    return {"eps": lambda: D.CompVisDenoiser(), "edm_v": lambda: D.EDMVDenoiser(),
            "sd3_flow": lambda: D.DiscreteFlowDenoiser(3.0), "flux_flow": lambda: D.FluxFlowDenoiser(1.15)}[pred]()


_DENS = {}


def test_every_scheduler_bit_exact_vs_sdcpp():
    bad = []
    for i, key in enumerate(KEYS):
        _, pred, sch, n, ver, seq, _ei = key.split("__")
        den = _DENS.setdefault(pred, _den(pred))
        ref = G["values"][G["offsets"][i]:G["offsets"][i + 1]]
        got = SC.get_sigmas(den, int(n), sch, version=ver, image_seq_len=int(seq), extra_args=str(G["extras"][i]))
        if got.dtype != np.float32 or got.shape != ref.shape or not np.array_equal(got, ref, equal_nan=True):
            bad.append(key)
    assert not bad, f"{len(bad)} of {len(KEYS)} schedules differ from sd.cpp, e.g. {bad[:5]}"
    assert {k.split("__")[2] for k in KEYS} == set(SC.SCHEDULERS)


def test_registry():
    assert list(SC.SCHEDULERS) == ["discrete", "karras", "exponential", "ays", "gits", "sgm_uniform", "simple",
                                   "smoothstep", "kl_optimal", "lcm", "bong_tangent", "ltx2", "logit_normal",
                                   "flux2", "flux", "beta"]
    assert SC.resolve_scheduler_name("normal") == "discrete"
    with pytest.raises(UsageError, match="valid: discrete, karras"):
        SC.get_sigmas(D.CompVisDenoiser(), 4, "nope")
    assert all(s.help for s in SC.SCHEDULERS.values())


def test_denoiser_tables_and_scalings():
    den = D.CompVisDenoiser()
    # SD's schedule: betas linear in sqrt from 0.00085 to 0.012 over 1000 steps
    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2
    ac = np.cumprod(1 - betas)
    np.testing.assert_allclose(den.sigmas, ((1 - ac) / ac) ** 0.5, rtol=5e-5)
    assert abs(float(den.sigma_max()) - 14.6146) < 1e-3 and abs(float(den.sigma_min()) - 0.029168) < 1e-5
    for t in (0.0, 10.5, 500.25, 999.0):
        assert abs(float(den.sigma_to_t(den.t_to_sigma(t))) - t) < 2e-3
    c_skip, c_out, c_in = den.get_scalings(2.0)
    assert (c_skip, c_out) == (1.0, -2.0) and abs(c_in - 1 / math.sqrt(5)) < 1e-7
    v = D.CompVisVDenoiser().get_scalings(2.0)
    np.testing.assert_allclose(v, [1 / 5, -2 / math.sqrt(5), 1 / math.sqrt(5)], rtol=1e-6)
    f = D.DiscreteFlowDenoiser(3.0)
    assert f.get_scalings(0.4) == (1.0, np.float32(-0.4), 1.0)
    x = np.ones(4, np.float32)
    np.testing.assert_allclose(f.noise_scaling(0.25, 2 * x, x), 1.25)
    np.testing.assert_allclose(f.inverse_noise_scaling(0.5, x), 2.0)
    assert float(D.EDMVDenoiser().sigma_max()) == 120.0
    assert D.make_denoiser("v").prediction == "v"
    assert float(D.make_denoiser("flux_flow", flow_shift=1.15).shift) == np.float32(1.15)
    with pytest.raises(UsageError):
        D.make_denoiser("x0")
    with pytest.raises(UsageError):
        D.CompVisDenoiser(alphas_cumprod=np.ones(10))


# ---------------------------------------------------------------- k-diffusion formulas (float64)
def kd_karras(n, smin, smax, rho=7.0):
    ramp = np.linspace(0, 1, n)
    sig = (smax ** (1 / rho) + ramp * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho
    return np.append(sig, 0.0)


def kd_exponential(n, smin, smax):
    return np.append(np.exp(np.linspace(math.log(smax), math.log(smin), n)), 0.0)


def kd_discrete(den, n):
    log_sigmas = np.log(den.sigmas.astype(np.float64))
    t = np.linspace(999, 0, n)
    lo, hi = np.floor(t).astype(int), np.ceil(t).astype(int)
    w = t - lo
    return np.append(np.exp((1 - w) * log_sigmas[lo] + w * log_sigmas[hi]), 0.0)


@pytest.mark.parametrize("n", [2, 5, 20])
def test_vs_kdiffusion(n):
    den = D.CompVisDenoiser()
    smin, smax = float(den.sigma_min()), float(den.sigma_max())
    np.testing.assert_allclose(SC.get_sigmas(den, n, "karras"), kd_karras(n, smin, smax), rtol=2e-5)
    np.testing.assert_allclose(SC.get_sigmas(den, n, "exponential"), kd_exponential(n, smin, smax), rtol=2e-5)
    np.testing.assert_allclose(SC.get_sigmas(den, n, "discrete"), kd_discrete(den, n), rtol=2e-5)


def test_parse_helpers():
    assert SC.parse_key_value_args("a=1, b = 2;c=x, junk") == [("a", "1"), ("b", "2"), ("c", "x")]
    np.testing.assert_array_equal(SC.parse_sigmas("[14.61, 7.8,3.5,0.0]"), np.float32([14.61, 7.8, 3.5, 0.0]))
    with pytest.raises(UsageError, match="--sigmas"):
        SC.parse_sigmas("1.0,abc")
