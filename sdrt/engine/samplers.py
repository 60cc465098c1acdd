"""Samplers: sd.cpp's 21 sampling methods as short functions, k-diffusion style.

Every sampler is ``sample_xxx(denoise, x, sigmas, rng=None, callback=None, **knobs) -> x``:

* ``denoise(x, sigma, step)`` returns the denoised estimate D(x; sigma) as a float32 array, or
  a :class:`Guided` ``(pred, pred_uncond)`` (the CFG++ samplers need the unconditioned one).
  ``step`` is sd.cpp's: ``i + 1`` for the last model call of step i, ``-(i + 1)`` for an earlier
  one (the engine uses it for progress and step caches). To cancel, raise from ``denoise``.
* ``x`` is the noised latent (float32, any shape), ``sigmas`` the schedule (n + 1 values).
* noise comes only from ``rng`` (an :mod:`sdrt.engine.rng` generator), drawn with exactly the
  calls, shapes and order sd.cpp uses, so stochastic samplers reproduce sd-cli's noise.
* ``callback({"i", "x", "sigma", "sigma_next", "denoised"})`` once per step (before the update).
* knobs: ``eta`` (see :func:`resolve_eta` for the per-sampler defaults), ``is_flow`` (a flow
  denoiser: ancestral steps rescale as sd.cpp's ``get_ancestral_step_flow``), ``extra_args``
  (``--extra-sample-args`` pairs: lcm noise_clip_std/noise_scale_start/noise_scale_end,
  euler_ge gamma, lms lms_max_order/lms_shift/lms_divisions).

:data:`SAMPLERS` is the one registry (CLI choices, help, default eta); :func:`sample` dispatches
like sd.cpp's ``sample_k_diffusion``.

The arithmetic is sd.cpp's, step for step: scalar coefficients are C ``float`` with the same
``double`` detours (unqualified ``exp``/``log`` of a float is C's double function in its build,
``std::log``/``logf`` the float one), tensor ops are float32 elementwise in the same order. With
the same denoiser outputs the result is bit-identical to sd-cli's (tests/test_samplers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple
from collections.abc import Callable

import numpy as np

from ..errors import SdrtError, UsageError
from .denoisers import F32, TIMESTEPS, cf
from .rng import STDDefaultRNG
from .schedulers import parse_key_value_args, parse_strict_float, parse_strict_int

__all__ = [
    "SAMPLERS",
    "BrownianTreeNoiseSampler",
    "Guided",
    "Sampler",
    "default_sample_method",
    "default_scheduler",
    "scheduler_for",
    "get_ancestral_step",
    "get_ancestral_step_flow",
    "resolve_eta",
    "sample",
]


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


# ------------------------------------------------------------------------------------ samplers
def sample_euler(denoise, x, sigmas, rng=None, callback=None, **_):
    """Euler (Karras et al. 2022, Algorithm 2 without churn)."""
    x, s = _x(x), _sigmas(sigmas)
    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        d = (x - denoised) / s[i]
        x = x + d * _f(s[i + 1] - s[i])
    return x


def sample_euler_ancestral(denoise, x, sigmas, rng=None, callback=None, eta=1.0, is_flow=False, **_):
    """Euler ancestral; with eta = 0 it is DDIM (``ddim_trailing`` uses it with the simple schedule)."""
    x, s, eta = _x(x), _sigmas(sigmas), F32(eta)
    for i in range(len(s) - 1):
        sigma, sigma_to = s[i], s[i + 1]
        denoised = _den(denoise, x, sigma, i + 1)
        _cb(callback, i, x, sigma, sigma_to, denoised)
        if sigma_to == 0:
            x = denoised.copy()
        elif eta == 0:
            ratio = F32(sigma_to / sigma)
            x = x * ratio + denoised * _f(1.0 - float(ratio))
        else:
            sd, su, alpha = _ancestral(sigma, sigma_to, eta, is_flow)
            ratio = F32(sd / sigma)
            x = x * ratio + denoised * F32(F32(1.0) - ratio)
            if su > 0:
                if is_flow:
                    x = x * alpha
                x = x + _noise(rng, x) * su
    return x


def sample_heun(denoise, x, sigmas, rng=None, callback=None, **_):
    """Heun's method (Karras et al. 2022, Algorithm 2 without churn)."""
    x, s = _x(x), _sigmas(sigmas)
    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], -(i + 1))
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        d = (x - denoised) / s[i]
        dt = F32(s[i + 1] - s[i])
        if s[i + 1] == 0:
            x = x + d * dt
        else:
            x2 = x + d * dt
            denoised2 = _den(denoise, x2, s[i + 1], i + 1)
            d = (d + (x2 - denoised2) / s[i + 1]) / F32(2.0)
            x = x + d * dt
    return x


def sample_dpm2(denoise, x, sigmas, rng=None, callback=None, **_):
    """DPM-Solver-2 (Karras et al. 2022 variant): a midpoint step in log sigma."""
    x, s = _x(x), _sigmas(sigmas)
    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], -(i + 1))
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        d = (x - denoised) / s[i]
        if s[i + 1] == 0:
            x = x + d * F32(s[i + 1] - s[i])
        else:
            sigma_mid = _f(_dexp(0.5 * (_dlog(s[i]) + _dlog(s[i + 1]))))
            dt_1 = F32(sigma_mid - s[i])
            dt_2 = F32(s[i + 1] - s[i])
            x2 = x + d * dt_1
            denoised2 = _den(denoise, x2, sigma_mid, i + 1)
            x = x + ((x2 - denoised2) / sigma_mid) * dt_2
    return x


def sample_dpmpp_2s_ancestral(denoise, x, sigmas, rng=None, callback=None, eta=1.0, is_flow=False, **_):
    """DPM-Solver++(2S) ancestral (Lu et al. 2022); the flow variant for flow denoisers."""
    if is_flow:
        return _sample_dpmpp_2s_ancestral_flow(denoise, x, sigmas, rng, callback, eta)
    x, s = _x(x), _sigmas(sigmas)

    def t_fn(sig):
        return F32(-_dlog(sig))

    def sigma_fn(t):
        return F32(_dexp(-float(t)))

    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], -(i + 1))
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        sd, su = get_ancestral_step(s[i], s[i + 1], eta)
        if sd == 0:
            x = denoised.copy()
        else:
            t, t_next = t_fn(s[i]), t_fn(sd)
            h = F32(t_next - t)
            sm = F32(t + F32(F32(0.5) * h))
            sigma_s = sigma_fn(sm)
            x2 = x * F32(sigma_s / sigma_fn(t)) - denoised * _f(_dexp(float(F32(-h * F32(0.5)))) - 1.0)
            denoised2 = _den(denoise, x2, sigma_s, i + 1)
            x = x * F32(sigma_fn(t_next) / sigma_fn(t)) - denoised2 * _f(_dexp(float(-h)) - 1.0)
        if s[i + 1] > 0:
            x = x + _noise(rng, x) * su
    return x


def _sample_dpmpp_2s_ancestral_flow(denoise, x, sigmas, rng, callback, eta):
    x, s, eta = _x(x), _sigmas(sigmas), F32(eta)
    for i in range(len(s) - 1):
        sigma, sigma_to = s[i], s[i + 1]
        first = (1.0 - float(sigma)) < 1e-6
        denoised = _den(denoise, x, sigma, (1 if first else -1) * (i + 1))
        _cb(callback, i, x, sigma, sigma_to, denoised)
        if sigma_to == 0:
            x = denoised.copy()
            continue
        sd, su, alpha = get_ancestral_step_flow(sigma, sigma_to, eta)
        if first:
            d_i = denoised
        else:
            exp_s = cf.sqrtf(F32(F32(F32(F32(1) - sigma) / sigma) * F32(F32(F32(1) - sd) / sd)))
            sigma_s = F32(F32(1.0) / F32(exp_s + F32(1.0)))
            ratio = F32(sigma_s / sigma)
            u = x * ratio + denoised * F32(F32(1.0) - ratio)
            d_i = _den(denoise, u, sigma_s, i + 1)
        ratio = F32(sd / sigma)
        x = x * ratio + d_i * F32(F32(1.0) - ratio)
        if sigma_to > 0 and eta > 0:
            x = x * alpha + _noise(rng, x) * su
    return x


def sample_dpmpp_2m(denoise, x, sigmas, rng=None, callback=None, **_):
    """DPM-Solver++(2M) (Lu et al. 2022)."""
    x, s = _x(x), _sigmas(sigmas)
    old = x

    def t_fn(sig):
        return F32(-_dlog(sig))

    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        t, t_next = t_fn(s[i]), t_fn(s[i + 1])
        h = F32(t_next - t)
        a = F32(s[i + 1] / s[i])
        b = _f(_dexp(float(-h)) - 1.0)
        if i == 0 or s[i + 1] == 0:
            x = x * a - denoised * b
        else:
            h_last = F32(t - t_fn(s[i - 1]))
            r = F32(h_last / h)
            c = F32(F32(1.0) / F32(F32(2.0) * r))
            denoised_d = denoised * F32(F32(1.0) + c) - old * c
            x = x * a - denoised_d * b
        old = denoised
    return x


def sample_dpmpp_2m_v2(denoise, x, sigmas, rng=None, callback=None, **_):
    """sd.cpp's modified DPM-Solver++(2M): the step ratio from min/max of the last two steps."""
    x, s = _x(x), _sigmas(sigmas)
    old = x

    def t_fn(sig):
        return F32(-_dlog(sig))

    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        t, t_next = t_fn(s[i]), t_fn(s[i + 1])
        h = F32(t_next - t)
        a = F32(s[i + 1] / s[i])
        if i == 0 or s[i + 1] == 0:
            b = _f(_dexp(float(-h)) - 1.0)
            x = x * a - denoised * b
        else:
            h_last = F32(t - t_fn(s[i - 1]))
            h_min, h_max = min(h_last, h), max(h_last, h)
            r = F32(h_max / h_min)
            h_d = F32(F32(h_max + h_min) / F32(2.0))
            b = _f(_dexp(float(-h_d)) - 1.0)
            c = F32(F32(1.0) / F32(F32(2.0) * r))
            denoised_d = denoised * F32(F32(1.0) + c) - old * c
            x = x * a - denoised_d * b
        old = denoised
    return x


def sample_dpmpp_2m_sde(denoise, x, sigmas, rng=None, callback=None, eta=1.0, noise_sampler=None, **_):
    """DPM-Solver++(2M) SDE, midpoint variant (k-diffusion ``sample_dpmpp_2m_sde``)."""
    x, s, eta = _x(x), _sigmas(sigmas), F32(eta)
    old, h_last = None, F32(0.0)
    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        if s[i + 1] == 0:
            x = denoised.copy()
        else:
            t = F32(-cf.logf(s[i]))
            sn = F32(-cf.logf(s[i + 1]))
            h = F32(sn - t)
            eta_h = F32(eta * h)
            a = F32(F32(s[i + 1] / s[i]) * cf.expf(F32(-eta_h)))
            b = F32(-cf.expm1f(F32(F32(-h) - eta_h)))
            x = x * a + denoised * b
            if old is not None:
                r = F32(h_last / h)
                x = x + (denoised - old) * F32(F32(F32(0.5) * b) / r)
            if eta > 0:
                scale = F32(s[i + 1] * cf.sqrtf(F32(-cf.expm1f(F32(F32(-2.0) * eta_h)))))
                nz = noise_sampler(s[i], s[i + 1]) if noise_sampler is not None else _noise(rng, x)
                x = x + nz * scale
            h_last = h
        old = denoised
    return x


# --- Brownian tree (dpm++2m_sde_bt) ----------------------------------------------------------
_M64 = 0xFFFFFFFFFFFFFFFF


def _mix64(v, salt):
    z = (v + salt) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class BrownianTreeNoiseSampler:
    """sd.cpp's seeded Brownian tree: step-count-stable unit-variance increments on [a, b].

    Node noise comes from libstdc++'s minstd_rand0 normals (:class:`STDDefaultRNG`) seeded from
    the tree seed with splitmix-style mixing, bisecting [sigma_min, sigma_max] 24 levels deep."""

    MAX_DEPTH = 24

    def __init__(self, shape, sigma_min, sigma_max, seed):
        self.t_min, self.t_max = float(sigma_min), float(sigma_max)
        self.shape = tuple(shape)
        self.root_seed = _mix64(int(seed) & _M64, 0x9E3779B97F4A7C15)
        r = STDDefaultRNG(_mix64(int(seed) & _M64, 0xBF58476D1CE4E5B9))
        self.w_tmax = r.randn(self.shape) * cf.sqrtf(F32(self.t_max - self.t_min))
        self.cache = {}

    def __call__(self, sigma_a, sigma_b):
        sa, sb = float(sigma_a), float(sigma_b)
        a = self._clamp(min(sa, sb))
        b = self._clamp(max(sa, sb))
        dw = self._w(b) - self._w(a)
        span = F32(max(abs(sb - sa), 1e-12))
        return dw * F32(F32(1.0) / cf.sqrtf(span))

    def _clamp(self, t):
        return min(max(t, self.t_min), self.t_max)

    def _w(self, t):
        if t not in self.cache:
            zero = np.zeros(self.shape, np.float32)
            self.cache[t] = self._bridge(self.t_min, self.t_max, zero, self.w_tmax, t, self.root_seed,
                                         self.MAX_DEPTH)
        return self.cache[t]

    def _bridge(self, a, c, w_a, w_c, t, node_seed, depth):
        while True:
            if depth <= 0 or c - a < 1e-9:
                alpha = F32((t - a) / (c - a)) if c > a else F32(0.5)
                return w_a * F32(F32(1.0) - alpha) + w_c * alpha
            m = 0.5 * (a + c)
            std_dev = math.sqrt((c - m) * (m - a) / (c - a))
            z = STDDefaultRNG(node_seed).randn(self.shape)
            w_m = (w_a + w_c) * F32(0.5) + z * F32(std_dev)
            if t == m:
                return w_m
            if t < m:
                c, w_c, node_seed = m, w_m, _mix64(node_seed, 1)
            else:
                a, w_a, node_seed = m, w_m, _mix64(node_seed, 2)
            depth -= 1


def sample_dpmpp_2m_sde_bt(denoise, x, sigmas, rng=None, callback=None, eta=1.0, **_):
    """DPM-Solver++(2M) SDE with Brownian-tree noise (ComfyUI ``dpmpp_2m_sde_gpu``)."""
    s = np.asarray(sigmas, np.float32).reshape(-1)
    pos = [float(v) for v in s if v > 0]
    if not pos or max(pos) <= min(pos):
        return _x(x)
    if rng is None:
        raise UsageError("dpm++2m_sde_bt draws its tree seed from the rng: pass an rng")
    draw = np.ascontiguousarray(rng.randn(2), dtype=np.float32)
    tree_seed = int(draw.view(np.uint64)[0])  # memcpy of two floats, little-endian
    ns = BrownianTreeNoiseSampler(np.shape(x), min(pos), max(pos), tree_seed)
    return sample_dpmpp_2m_sde(denoise, x, sigmas, rng=None, callback=callback, eta=eta, noise_sampler=ns)


def sample_lcm(denoise, x, sigmas, rng=None, callback=None, is_flow=False, extra_args=None, **_):
    """Latent Consistency Model sampling: jump to the prediction, re-noise to the next sigma."""
    clip_std, ns_start, ns_end = F32(0.0), F32(1.0), F32(1.0)
    start_set = end_set = False
    for key, value in parse_key_value_args(extra_args):
        if key in ("noise_clip_std", "noise_scale_start", "noise_scale_end"):
            p = parse_strict_float(value)
            if p is None:
                continue
            if key == "noise_clip_std":
                clip_std = p
            elif key == "noise_scale_start":
                ns_start, start_set = p, True
            else:
                ns_end, end_set = p, True
    if start_set and not end_set:
        ns_end = ns_start
    x, s = _x(x), _sigmas(sigmas)
    steps = len(s) - 1
    for i in range(steps):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        x = denoised.copy()
        if s[i + 1] > 0:
            if is_flow:
                x = x * F32(F32(1.0) - s[i + 1])
            noise = _noise(rng, x)
            if clip_std > 0 and noise.size > 0:
                flat = noise.reshape(-1).astype(np.float64)
                mean = np.add.accumulate(flat)[-1] / flat.size
                var = np.add.accumulate((flat - mean) * (flat - mean))[-1] / flat.size
                clip = F32(clip_std * F32(math.sqrt(var)))
                noise = np.clip(noise, -clip, clip).astype(np.float32)
            t = F32(F32(i) / F32(steps - 1)) if steps > 1 else F32(0.0)
            scale = F32(ns_start + F32(F32(ns_end - ns_start) * t))
            x = x + noise * F32(s[i + 1] * scale)
    return x


def _ab3(d, h1, h2):
    return ((d * F32(23.0) - h1 * F32(16.0)) + h2 * F32(5.0)) / F32(12.0)


def _ab4(d, h1, h2, h3):
    return (((d * F32(55.0) - h1 * F32(59.0)) + h2 * F32(37.0)) - h3 * F32(9.0)) / F32(24.0)


def sample_ipndm(denoise, x, sigmas, rng=None, callback=None, **_):
    """Improved PNDM (Zhang & Chen 2022): Adams-Bashforth up to 4th order on eps."""
    x, s = _x(x), _sigmas(sigmas)
    hist = []
    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        d = (x - denoised) / s[i]
        order = min(4, i + 1)
        dt = F32(s[i + 1] - s[i])
        if order == 1:
            x = x + d * dt
        elif order == 2:
            x = x + ((d * F32(3.0) - hist[-1]) / F32(2.0)) * dt
        elif order == 3:
            x = x + _ab3(d, hist[-1], hist[-2]) * dt
        else:
            x = x + _ab4(d, hist[-1], hist[-2], hist[-3]) * dt
        if len(hist) == 3:
            hist.pop(0)
        hist.append(d)
    return x


def sample_ipndm_v(denoise, x, sigmas, rng=None, callback=None, **_):
    """iPNDM with variable step sizes in its second-order term."""
    x, s = _x(x), _sigmas(sigmas)
    hist = []
    for i in range(len(s) - 1):
        sigma, t_next = s[i], s[i + 1]
        denoised = _den(denoise, x, sigma, i + 1)
        _cb(callback, i, x, sigma, t_next, denoised)
        d = (x - denoised) / sigma
        order = min(4, i + 1)
        h_n = F32(t_next - sigma)
        h_n_1 = F32(sigma - s[i - 1]) if i > 0 else h_n
        if order == 1:
            x = x + d * h_n
        elif order == 2:
            q = F32(h_n / h_n_1)
            x = x + ((d * F32(F32(2.0) + q) - hist[-1] * q) / F32(2.0)) * h_n
        elif order == 3:
            x = x + _ab3(d, hist[-1], hist[-2]) * h_n
        else:
            x = x + _ab4(d, hist[-1], hist[-2], hist[-3]) * h_n
        if len(hist) == 3:
            hist.pop(0)
        hist.append(d)
    return x


def _phi1(t):
    if abs(t) < F32(1e-6):
        return F32(F32(F32(1.0) + F32(t * F32(0.5))) + F32(F32(t * t) / F32(6.0)))
    return F32(F32(cf.expf(t) - F32(1.0)) / t)


def _phi2(t):
    if abs(t) < F32(1e-6):
        return F32(F32(F32(0.5) + F32(t / F32(6.0))) + F32(F32(t * t) / F32(24.0)))
    return F32(F32(_phi1(t) - F32(1.0)) / t)


def sample_res_multistep(denoise, x, sigmas, rng=None, callback=None, eta=0.0, is_flow=False, **_):
    """RES multistep (Zhang et al. 2023 'refined exponential solver'), 2nd order, ancestral with eta."""
    x, s = _x(x), _sigmas(sigmas)
    old, have_old, old_sd = x, False, F32(0.0)

    def t_fn(sig):
        return F32(-cf.logf(sig))

    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        sf, st = s[i], s[i + 1]
        sd, su, alpha = _ancestral(sf, st, eta, is_flow)
        if sd == 0 or not have_old:
            x = x + ((x - denoised) / sf) * F32(sd - sf)
        else:
            t, t_old, t_next, t_prev = t_fn(sf), t_fn(old_sd), t_fn(sd), t_fn(s[i - 1])
            h = F32(t_next - t)
            c2 = F32(F32(t_prev - t_old) / h)
            p1, p2 = _phi1(F32(-h)), _phi2(F32(-h))
            with np.errstate(all="ignore"):
                b1 = F32(p1 - F32(p2 / c2))
                b2 = F32(p2 / c2)
            if not np.isfinite(b1):
                b1 = F32(0.0)
            if not np.isfinite(b2):
                b2 = F32(0.0)
            x = x * cf.expf(F32(-h)) + (denoised * b1 + old * b2) * h
        if st > 0 and su > 0:
            if is_flow:
                x = x * alpha
            x = x + _noise(rng, x) * su
        old, old_sd, have_old = denoised, sd, True
    return x


def sample_res_2s(denoise, x, sigmas, rng=None, callback=None, eta=0.0, is_flow=False, **_):
    """RES 2s: two-stage exponential integrator (c2 = 0.5), ancestral with eta."""
    c2 = F32(0.5)
    x, s = _x(x), _sigmas(sigmas)
    for i in range(len(s) - 1):
        sf, st = s[i], s[i + 1]
        denoised = _den(denoise, x, sf, -(i + 1))
        _cb(callback, i, x, sf, st, denoised)
        sd, su, alpha = _ancestral(sf, st, eta, is_flow)
        x0 = x
        if sd == 0 or sf == 0:
            x = denoised.copy()
        else:
            t = F32(-cf.logf(sf))
            t_next = F32(-cf.logf(sd))
            h = F32(t_next - t)
            a21 = F32(c2 * _phi1(F32(F32(-h) * c2)))
            p1, p2 = _phi1(F32(-h)), _phi2(F32(-h))
            b2 = F32(p2 / c2)
            b1 = F32(p1 - b2)
            sigma_c2 = cf.expf(F32(-F32(t + F32(h * c2))))
            eps1 = denoised - x0
            x2 = x0 + eps1 * F32(h * a21)
            denoised2 = _den(denoise, x2, sigma_c2, i + 1)
            eps2 = denoised2 - x0
            x = x0 + (eps1 * b1 + eps2 * b2) * h
        if st > 0 and su > 0:
            if is_flow:
                x = x * alpha
            x = x + _noise(rng, x) * su
    return x


def sample_er_sde(denoise, x, sigmas, rng=None, callback=None, eta=1.0, is_flow=False, **_):
    """ER-SDE-Solver-3 (Cui et al. 2023), noise scaled by eta > 0."""
    s_noise = F32(eta)
    s = _sigmas(sigmas)

    def flow_sigma(sig):
        return min(max(sig, F32(1e-6)), F32(F32(1.0) - F32(1e-4)))

    def lam(sig):
        if is_flow:
            sig = flow_sigma(sig)
            return F32(sig / max(F32(F32(1.0) - sig), F32(1e-6)))
        return max(sig, F32(1e-6))

    def alpha_of(sig):
        if is_flow:
            return F32(F32(1.0) - flow_sigma(sig))
        return F32(1.0)

    def scaler(v):
        v = max(v, F32(0.0))
        return F32(v * F32(cf.expf(cf.powf(v, F32(0.3))) + F32(10.0)))

    if is_flow:
        for i in range(len(s) - 1):
            if s[i] > 1:
                s[i] = flow_sigma(s[i])
    lams = [lam(v) for v in s]
    x = _x(x)
    old = old_d = None
    for i in range(len(s) - 1):
        denoised = _den(denoise, x, s[i], i + 1)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        stage = min(3, i + 1)
        if s[i + 1] == 0:
            x = denoised.copy()
        else:
            ls, lt = lams[i], lams[i + 1]
            a_s, a_t = alpha_of(s[i]), alpha_of(s[i + 1])
            sc_s, sc_t = scaler(ls), scaler(lt)
            r_alpha = F32(a_t / a_s) if a_s > 0 else F32(0.0)
            r = F32(sc_t / sc_s) if sc_s > 0 else F32(0.0)
            x = x * F32(r_alpha * r) + denoised * F32(a_t * F32(F32(1.0) - r))
            if stage >= 2 and old is not None:
                dt = F32(lt - ls)
                step = F32(F32(-dt) / F32(200.0))
                acc, acc_u = F32(0.0), F32(0.0)
                for p in range(200):
                    lp = F32(lt + F32(F32(p) * step))
                    sp = scaler(lp)
                    if sp <= 0:
                        continue
                    acc = F32(acc + F32(F32(1.0) / sp))
                    if stage >= 3 and old_d is not None:
                        acc_u = F32(acc_u + F32(F32(lp - ls) / sp))
                acc = F32(acc * step)
                denom_d = F32(ls - lams[i - 1])
                if abs(denom_d) > F32(1e-12):
                    coeff_d = F32(a_t * F32(dt + F32(acc * sc_t)))
                    denoised_d = (denoised - old) / denom_d
                    x = x + denoised_d * coeff_d
                    if stage >= 3 and old_d is not None:
                        denom_u = F32(F32(ls - lams[i - 2]) * F32(0.5))
                        if abs(denom_u) > F32(1e-12):
                            acc_u = F32(acc_u * step)
                            coeff_u = F32(a_t * F32(F32(F32(F32(0.5) * dt) * dt) + F32(acc_u * sc_t)))
                            denoised_u = (denoised_d - old_d) / denom_u
                            x = x + denoised_u * coeff_u
                    old_d = denoised_d
            nss = F32(F32(lt * lt) - F32(F32(F32(ls * ls) * r) * r))
            if s_noise > 0 and nss > 0:
                scale = F32(a_t * cf.sqrtf(max(nss, F32(0.0))))
                x = x + _noise(rng, x) * scale
        old = denoised
    return x


def _tcd_tables():
    bs, be = cf.sqrtf(0.00085), cf.sqrtf(0.0120)
    ac = np.empty(TIMESTEPS, np.float64)
    prev = 1.0
    for i in range(TIMESTEPS):
        base = F32(bs + F32(F32(be - bs) * F32(F32(i) / F32(TIMESTEPS - 1))))
        prev = (1.0 if i == 0 else prev) * (1.0 - math.pow(float(base), 2.0))
        ac[i] = prev
    sig = np.sqrt((1.0 - ac) / ac)
    return ac, sig


_TCD = None


def sample_tcd(denoise, x, sigmas, rng=None, callback=None, eta=0.0, **_):
    """Trajectory Consistency Distillation sampling (Zheng et al. 2024), gamma = eta."""
    global _TCD
    if _TCD is None:
        _TCD = _tcd_tables()
    ac, csig = _TCD
    eta = F32(eta)

    def timestep_of(sig):
        idx = int(np.searchsorted(csig, float(sig), side="left"))
        if idx == 0:
            return 0
        if idx == TIMESTEPS:
            return TIMESTEPS - 1
        return idx if abs(csig[idx] - float(sig)) < abs(csig[idx - 1] - float(sig)) else idx - 1

    x, s = _x(x), _sigmas(sigmas)
    for i in range(len(s) - 1):
        sigma_to = s[i + 1]
        prev_t = timestep_of(sigma_to)
        t_s = int(math.floor(float(F32(F32(F32(1.0) - eta) * F32(prev_t)))))
        sigma = s[i]
        denoised = _den(denoise, x, sigma, i + 1)
        _cb(callback, i, x, sigma, sigma_to, denoised)
        d = (x - denoised) / sigma
        a_prev = F32(F32(1.0) / F32(F32(sigma_to * sigma_to) + F32(1.0)))
        a_s = F32(ac[t_s])
        b_s = F32(F32(1.0) - a_s)
        x = denoised * cf.sqrtf(F32(a_s / a_prev)) + d * cf.sqrtf(F32(b_s / a_prev))
        if eta > 0 and sigma_to > 0:
            c1 = cf.sqrtf(F32(a_prev / a_s))
            c2 = cf.sqrtf(F32(F32(F32(1.0) / a_prev) - F32(F32(1.0) / a_s)))
            x = x * c1 + _noise(rng, x) * c2
    return x


def sample_lms(denoise, x, sigmas, rng=None, callback=None, extra_args=None, **_):
    """Linear multistep (k-diffusion), coefficients by a midpoint Riemann sum, with sd.cpp's
    'history shift' (lms_shift = 1 by default; lms_max_order = 4, lms_divisions = 1000)."""
    divisions, max_order, shift = 1000, 4, 1
    for key, value in parse_key_value_args(extra_args):
        p = parse_strict_int(value) if key in ("lms_max_order", "lms_shift", "lms_divisions") else None
        if p is None:
            continue
        if key == "lms_max_order":
            max_order = max(1, p)
        elif key == "lms_shift":
            shift = max(0, p)
        else:
            divisions = p
    s = _sigmas(sigmas)

    def coeff(order, m, j):
        if not divisions:
            return F32(s[m + 1] - s[m])
        a = s[m]
        dx = F32(F32(s[m + 1] - a) / F32(divisions))
        sj = s[m - j]
        b0 = F32(a + F32(F32(0.5) * dx))
        if divisions < 0:
            return F32(F32(0.0) * dx)
        b = np.arange(divisions, dtype=np.float32) * dx + b0
        prod = np.ones(divisions, np.float32)
        for k in range(order):
            if k == j:
                continue
            tk = s[m - k]
            prod = prod * ((b - tk) / F32(sj - tk))
        total = np.add.accumulate(prod, dtype=np.float32)[-1]
        return F32(total * dx)

    steps = len(s) - 1
    max_order = min(max_order, steps)
    x = _x(x)
    hist = []
    for i in range(steps):
        sigma = s[i]
        denoised = _den(denoise, x, sigma, i + 1)
        _cb(callback, i, x, sigma, s[i + 1], denoised)
        order = min(max_order, i + 1)
        co = [coeff(order, i, c) for c in range(order)]
        d = (x - denoised) / sigma
        x = x + d * co[0]
        if max_order > 1:
            hp1 = len(hist) + 1
            if i:
                hmax = len(hist) - 1
                for c in range(2, order + 1):
                    x = x + hist[min(hmax, hp1 - c + shift)] * co[c - 1]
            if hp1 == max_order:
                hist.pop(0)
            hist.append(d)
    return x


def sample_euler_cfg_pp(denoise, x, sigmas, rng=None, callback=None, **_):
    """Euler CFG++ (Chung et al. 2024): the renoising direction from the unconditioned prediction."""
    x, s = _x(x), _sigmas(sigmas)
    for i in range(len(s) - 1):
        denoised, uncond = _den(denoise, x, s[i], i + 1, need_uncond=True)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        d = (x - uncond) / s[i]
        x = denoised + d * s[i + 1]
    return x


def sample_euler_ancestral_cfg_pp(denoise, x, sigmas, rng=None, callback=None, eta=1.0, **_):
    """Euler ancestral CFG++."""
    x, s = _x(x), _sigmas(sigmas)
    for i in range(len(s) - 1):
        denoised, uncond = _den(denoise, x, s[i], i + 1, need_uncond=True)
        _cb(callback, i, x, s[i], s[i + 1], denoised)
        d = (x - uncond) / s[i]
        sd, su = get_ancestral_step(s[i], s[i + 1], eta)
        x = denoised + d * sd
        if s[i + 1] > 0:
            x = x + _noise(rng, x) * su
    return x


def sample_gradient_estimation(denoise, x, sigmas, rng=None, callback=None, eta=0.0, is_flow=False,
                               extra_args=None, **_):
    """Euler with gradient estimation (Permenter & Yuan 2024), gamma = 2 (``euler_ge``)."""
    gamma = F32(2.0)
    for key, value in parse_key_value_args(extra_args):
        if key == "gamma":
            p = parse_strict_float(value)
            if p is not None:
                gamma = p
    x, s = _x(x), _sigmas(sigmas)
    old_d = None
    for i in range(len(s) - 1):
        sigma, sigma_to = s[i], s[i + 1]
        denoised = _den(denoise, x, sigma, i + 1)
        _cb(callback, i, x, sigma, sigma_to, denoised)
        if sigma_to == 0:
            x = denoised.copy()
            continue
        sd, su, alpha = _ancestral(sigma, sigma_to, eta, is_flow)
        d = (x - denoised) / sigma
        dt = F32(sd - sigma)
        if old_d is not None:
            x = x + (d * gamma + old_d * F32(F32(1.0) - gamma)) * dt
        else:
            x = x + d * dt
        old_d = d
        if su > 0:
            if is_flow:
                x = x * alpha
            x = x + _noise(rng, x) * su
    return x


# ------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Sampler:
    name: str            # the --sampling-method name
    fn: Callable
    label: str           # sd.cpp's display name
    default_eta: float   # resolve_eta's value when --eta is not given
    help: str


SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("euler", sample_euler, "Euler", 0.0, "Euler, first order"),
    Sampler("euler_a", sample_euler_ancestral, "Euler A", 1.0, "Euler ancestral (adds noise each step)"),
    Sampler("heun", sample_heun, "Heun", 0.0, "Heun, second order (2 model calls per step)"),
    Sampler("dpm2", sample_dpm2, "DPM2", 0.0, "DPM-Solver-2, midpoint in log sigma (2 calls/step)"),
    Sampler("dpm++2s_a", sample_dpmpp_2s_ancestral, "DPM++ (2s)", 1.0, "DPM-Solver++(2S) ancestral (2 calls/step)"),
    Sampler("dpm++2m", sample_dpmpp_2m, "DPM++ (2M)", 0.0, "DPM-Solver++(2M), multistep"),
    Sampler("dpm++2mv2", sample_dpmpp_2m_v2, "modified DPM++ (2M)", 0.0, "DPM-Solver++(2M), sd.cpp's variant"),
    Sampler("ipndm", sample_ipndm, "iPNDM", 0.0, "improved PNDM, 4th-order Adams-Bashforth"),
    Sampler("ipndm_v", sample_ipndm_v, "iPNDM_v", 0.0, "iPNDM with variable step sizes"),
    Sampler("lcm", sample_lcm, "LCM", 0.0, "Latent Consistency Model sampling"),
    Sampler("ddim_trailing", sample_euler_ancestral, "DDIM \"trailing\"", 0.0, "DDIM (euler_a with eta 0, simple schedule)"),
    Sampler("tcd", sample_tcd, "TCD", 0.0, "Trajectory Consistency Distillation (gamma = eta)"),
    Sampler("res_multistep", sample_res_multistep, "Res Multistep", 0.0, "RES multistep exponential integrator"),
    Sampler("res_2s", sample_res_2s, "Res 2s", 0.0, "RES 2-stage exponential integrator (2 calls/step)"),
    Sampler("er_sde", sample_er_sde, "ER-SDE", 1.0, "ER-SDE-Solver-3 (stochastic)"),
    Sampler("euler_cfg_pp", sample_euler_cfg_pp, "Euler CFG++", 0.0, "Euler with CFG++ renoising"),
    Sampler("euler_a_cfg_pp", sample_euler_ancestral_cfg_pp, "Euler A CFG++", 1.0, "Euler ancestral with CFG++"),
    Sampler("euler_ge", sample_gradient_estimation, "Euler GE", 0.0, "Euler with gradient estimation (gamma 2)"),
    Sampler("dpm++2m_sde", sample_dpmpp_2m_sde, "DPM++ (2M) SDE", 1.0, "DPM-Solver++(2M) SDE, midpoint"),
    Sampler("dpm++2m_sde_bt", sample_dpmpp_2m_sde_bt, "DPM++ (2M) SDE BT", 1.0, "DPM-Solver++(2M) SDE with Brownian-tree noise"),
    Sampler("lms", sample_lms, "LMS", 0.0, "linear multistep, order 4"),
)}


def _get(name):
    if name not in SAMPLERS:
        raise UsageError(f"unknown sampling method '{name}'; valid: {', '.join(SAMPLERS)}")
    return SAMPLERS[name]


def resolve_eta(eta, method: str, version: str = "") -> float:
    """sd.cpp ``resolve_eta``: None/inf means the family's default eta (8 for HiDream-O1), else
    the sampler's."""
    if eta is None or float(eta) == math.inf:
        if version:
            from ..models.families import family_of
            fam_eta = family_of(version).default_eta
            if fam_eta is not None:
                return fam_eta
        return _get(method).default_eta
    return float(eta)


def default_sample_method(version: str = "sd1") -> str:
    """sd.cpp ``sd_get_default_sample_method``: the family's default (euler_a for the UNets,
    lcm for PiD, euler for the DiTs; sdrt.models.families)."""
    from ..models.families import family_of
    return family_of(version or "sd1").default_sampler


def default_scheduler(method: str, version: str = "sd1", prediction: str = "eps") -> str:
    """sd.cpp ``sd_get_default_scheduler``: exponential for EDM v-prediction, lcm for lcm/tcd,
    simple for ddim_trailing, else the family's default (discrete; flux, flux2, ltx2 ...)."""
    from ..models.families import family_of
    return scheduler_for(method, prediction, family_of(version or "sd1").default_scheduler)


def scheduler_for(method: str, prediction: str, family_default: str) -> str:
    """The default scheduler given the method, prediction and the family's own default."""
    if prediction == "edm_v":
        return "exponential"
    if method in ("lcm", "tcd"):
        return "lcm"
    if method == "ddim_trailing":
        return "simple"
    return family_default


def sample(method: str, denoise, x, sigmas, rng=None, *, eta=None, is_flow=False, extra_args=None,
           callback=None, version: str = ""):
    """Run a sampler by its ``--sampling-method`` name (sd.cpp ``sample_k_diffusion``)."""
    smp = _get(method)
    return smp.fn(denoise, x, sigmas, rng=rng, callback=callback, eta=resolve_eta(eta, method, version),
                  is_flow=bool(is_flow), extra_args=parse_key_value_args(extra_args))
