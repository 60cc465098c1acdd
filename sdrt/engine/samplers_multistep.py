"""The multistep and exotic samplers of sd.cpp: iPNDM (and its variable-step form), RES
multistep / 2s, ER-SDE, TCD, LMS, the CFG++ Euler pair and gradient estimation. Same contract
and arithmetic as sdrt.engine.samplers, which registers them."""
from __future__ import annotations

import math

import numpy as np

from .denoisers import F32, TIMESTEPS, cf
from .sampler_common import _ancestral, _cb, _den, _noise, _sigmas, _x, get_ancestral_step
from .schedulers import parse_key_value_args, parse_strict_float, parse_strict_int

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
