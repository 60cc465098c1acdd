"""What every sampler uses (sdrt.engine.samplers has the contract): the Guided result, the
denoise call with its checks, the callback, noise from the injected RNG, sd.cpp's float/double
scalar helpers, and the ancestral step split (k-diffusion's get_ancestral_step, sd.cpp's flow form)."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..errors import SdrtError, UsageError
from .denoisers import F32, cf

class Guided(NamedTuple):
    """A denoise result with the unconditioned prediction too (for euler_cfg_pp/euler_a_cfg_pp)."""

    pred: np.ndarray
    pred_uncond: np.ndarray | None = None


def _den(denoise, x, sigma, step, need_uncond=False):
    out = denoise(x, F32(sigma), step)
    if isinstance(out, Guided) or (isinstance(out, tuple) and len(out) == 2):
        pred, unc = out[0], out[1]
    else:
        pred, unc = out, None
    if pred is None:
        raise SdrtError("the denoiser returned no prediction")
    pred = np.asarray(pred, dtype=np.float32)
    if need_uncond:
        if unc is None:
            raise UsageError("this sampler (CFG++) needs the unconditioned prediction: "
                             "the denoiser must return Guided(pred, pred_uncond)")
        return pred, np.asarray(unc, dtype=np.float32)
    return pred


def _cb(callback, i, x, sigma, sigma_next, denoised):
    if callback is not None:
        callback({"i": i, "x": x, "sigma": F32(sigma), "sigma_next": F32(sigma_next), "denoised": denoised})


def _noise(rng, x):
    if rng is None:
        raise UsageError("this sampler draws noise: pass an rng")
    return rng.randn(x.shape)


def _dlog(v):
    """C's double ``log()`` (log 0 = -inf, log of a negative = nan)."""
    v = float(v)
    if v > 0:
        return math.log(v)
    return -math.inf if v == 0 else math.nan


def _dexp(v):
    """C's double ``exp()`` (overflow gives inf)."""
    try:
        return math.exp(float(v))
    except OverflowError:
        return math.inf


def _f(v):
    return F32(v)


def _sigmas(sigmas):
    s = np.asarray(sigmas, dtype=np.float32).reshape(-1)
    return [F32(v) for v in s]


def _x(x):
    return np.array(x, dtype=np.float32, copy=True)


# ------------------------------------------------------------------------------------ ancestral
def get_ancestral_step(sigma_from, sigma_to, eta=1.0):
    """(sigma_down, sigma_up) of an ancestral step (k-diffusion), float math as sd.cpp."""
    sf, st, eta = F32(sigma_from), F32(sigma_to), F32(eta)
    sigma_up, sigma_down = F32(0.0), st
    if eta <= 0:
        return sigma_down, sigma_up
    sf2, st2 = F32(sf * sf), F32(st * st)
    if sf2 > 0:
        term = F32(F32(st2 * F32(sf2 - st2)) / sf2)
        sigma_up = min(st, F32(eta * cf.sqrtf(max(term, F32(0.0)))))
    sd2 = F32(st2 - F32(sigma_up * sigma_up))
    sigma_down = cf.sqrtf(sd2) if sd2 > 0 else F32(0.0)
    return sigma_down, sigma_up


def get_ancestral_step_flow(sigma_from, sigma_to, eta=1.0):
    """(sigma_down, sigma_up, alpha_scale) for rectified-flow ancestral steps (sd.cpp)."""
    sf, st, eta = F32(sigma_from), F32(sigma_to), F32(eta)
    sigma_down, sigma_up, alpha = st, F32(0.0), F32(1.0)
    if eta <= 0 or sf <= 0 or st <= 0:
        return sigma_down, sigma_up, alpha
    eta = min(eta, F32(1.0))
    ratio = F32(st / sf)
    sigma_down = F32(st * F32(F32(1.0) + F32(F32(ratio - F32(1.0)) * eta)))
    sigma_down = max(F32(0.0), min(st, sigma_down))
    denom = F32(F32(1.0) - sigma_down)
    if denom <= 0:
        return st, sigma_up, alpha
    alpha = F32(F32(F32(1.0) - st) / denom)
    term = F32(F32(sigma_down / st) * alpha)
    term = max(F32(-1.0), min(F32(1.0), term))
    sigma_up = F32(st * cf.sqrtf(max(F32(F32(1.0) - F32(term * term)), F32(0.0))))
    return sigma_down, sigma_up, alpha


def _ancestral(sigma_from, sigma_to, eta, is_flow):
    if is_flow:
        return get_ancestral_step_flow(sigma_from, sigma_to, eta)
    d, u = get_ancestral_step(sigma_from, sigma_to, eta)
    return d, u, F32(1.0)
