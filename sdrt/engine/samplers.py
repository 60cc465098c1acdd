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

The shared pieces live in sdrt.engine.sampler_common, the multistep and exotic samplers in
sdrt.engine.samplers_multistep; :data:`SAMPLERS` here is the one registry (CLI choices, help, default eta); :func:`sample` dispatches
like sd.cpp's ``sample_k_diffusion``.

The arithmetic is sd.cpp's, step for step: scalar coefficients are C ``float`` with the same
``double`` detours (unqualified ``exp``/``log`` of a float is C's double function in its build,
``std::log``/``logf`` the float one), tensor ops are float32 elementwise in the same order. With
the same denoiser outputs the result is bit-identical to sd-cli's (tests/test_samplers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from ..errors import UsageError
from .denoisers import F32, cf
from .rng import STDDefaultRNG
from .sampler_common import (Guided, _ancestral, _cb, _den, _dexp, _dlog, _f, _noise, _sigmas, _x,
                             get_ancestral_step, get_ancestral_step_flow)
from .samplers_multistep import (sample_er_sde, sample_euler_ancestral_cfg_pp, sample_euler_cfg_pp,
                                 sample_gradient_estimation, sample_ipndm, sample_ipndm_v, sample_lms,
                                 sample_res_2s, sample_res_multistep, sample_tcd)
from .schedulers import parse_key_value_args, parse_strict_float

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
