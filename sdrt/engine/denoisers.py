"""Denoiser parametrizations: how a network's output becomes a denoised estimate.

A denoiser owns what k-diffusion's ``external.py`` owns and what stable-diffusion.cpp keeps in
``runtime/denoiser.hpp`` (``CompVisDenoiser``, ``CompVisVDenoiser``, ``EDMVDenoiser``,
``DiscreteFlowDenoiser``, ``FluxFlowDenoiser``, ``MiniT2IFlowDenoiser``):

* the sigma <-> model-timestep maps (``sigma_to_t`` / ``t_to_sigma``), for the discrete SD
  noise schedule by interpolation in log-sigma over its 1000 training timesteps;
* ``sigma_min`` / ``sigma_max``, which the schedulers read;
* the scalings ``(c_skip, c_out, c_in)``: the engine feeds ``x * c_in`` to the network and takes
  ``denoised = x * c_skip + out * c_out``;
* ``noise_scaling`` (the first latent from noise and an init latent) and its inverse.

Samplers never see any of this: they only call ``denoise(x, sigma, step)``.

Float semantics follow sd.cpp exactly: its scalars are C ``float`` and its tensors float32, so
every scalar here is a ``numpy.float32`` computed with the same single/double steps as the C++
source, and the float transcendentals (``std::log(float)``, ``expf``, ``powf`` ...) call the C
math library of this platform through :data:`cf` (the same glibc ``logf`` sd-cli calls). That is
why schedules match sd.cpp bit for bit instead of to the last ulp.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np

from ..errors import UsageError

__all__ = [
    "F32",
    "PREDICTIONS",
    "TIMESTEPS",
    "CompVisDenoiser",
    "CompVisVDenoiser",
    "Denoiser",
    "DiscreteFlowDenoiser",
    "EDMVDenoiser",
    "FluxFlowDenoiser",
    "MiniT2IFlowDenoiser",
    "calculate_alphas_cumprod",
    "cf",
    "flux_time_shift",
    "make_denoiser",
    "time_snr_shift",
]

TIMESTEPS = 1000
F32 = np.float32


# ----------------------------------------------------------------------------------------------
# C float math: the libm that sd-cli links (glibc on Linux). numpy's float32 ufuncs use their own
# SIMD approximations and differ from glibc in the last ulp for ~1-15% of inputs; double math
# rounded to float differs in ~0.1%. Scalars only (schedules, sampler coefficients).
# ----------------------------------------------------------------------------------------------
class _CFloatMath:
    """Scalar C ``float`` functions: ``cf.logf(x)`` == ``logf((float)x)`` as a numpy.float32."""

    _UNARY = ("logf", "expf", "sqrtf", "sinf", "cosf", "tanf", "atanf", "floorf", "ceilf",
              "roundf", "expm1f", "log1pf")
    _BINARY = ("powf",)

    def __init__(self):
        lib = None
        for name in (ctypes.util.find_library("m"), "libm.so.6", "libm.dylib", "ucrtbase", "msvcrt"):
            if not name:
                continue
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        self.native = lib is not None
        for fname in self._UNARY + self._BINARY:
            fn = getattr(lib, fname, None) if lib is not None else None
            if fn is not None:
                fn.restype = ctypes.c_float
                fn.argtypes = [ctypes.c_float] * (2 if fname in self._BINARY else 1)
                setattr(self, fname, self._wrap(fn))
            else:  # fallback: double math rounded to float (differs from libm in rare last-ulp cases)
                setattr(self, fname, self._fallback(fname))

    @staticmethod
    def _wrap(fn):
        def call(*args):
            return F32(fn(*(float(F32(a)) for a in args)))
        return call

    @staticmethod
    def _fallback(fname):
        base = {"logf": math.log, "expf": math.exp, "sqrtf": math.sqrt, "sinf": math.sin,
                "cosf": math.cos, "tanf": math.tan, "atanf": math.atan, "floorf": math.floor,
                "ceilf": math.ceil, "expm1f": math.expm1, "log1pf": math.log1p,
                "powf": math.pow, "roundf": lambda v: math.copysign(math.floor(abs(v) + 0.5), v)}[fname]

        def call(*args):
            return F32(base(*(float(F32(a)) for a in args)))
        return call


cf = _CFloatMath()


def time_snr_shift(alpha, t):
    """sd.cpp ``time_snr_shift`` (SD3 flow shift), float math."""
    alpha, t = F32(alpha), F32(t)
    if alpha == F32(1.0):
        return t
    return F32(alpha * t / (F32(1) + (alpha - F32(1)) * t))


def flux_time_shift(mu, sigma, t):
    """sd.cpp ``flux_time_shift``: ``expf(mu) / (expf(mu) + powf(1/t - 1, sigma))``."""
    e = cf.expf(mu)
    return F32(e / (e + cf.powf(F32(1) / F32(t) - F32(1), sigma)))


def calculate_alphas_cumprod(linear_start=0.00085, linear_end=0.0120, timesteps=TIMESTEPS):
    """The SD noise schedule (betas linear in sqrt), float32 exactly as sd.cpp computes it."""
    ls = cf.sqrtf(linear_start)
    le = cf.sqrtf(linear_end)
    amount = F32(le - ls)
    out = np.empty(timesteps, np.float32)
    product = F32(1.0)
    denom = F32(timesteps - 1)
    for i in range(timesteps):
        beta = F32(ls + amount * (F32(i) / denom))
        product = F32(product * (F32(1.0) - cf.powf(beta, 2.0)))
        out[i] = product
    return out


class Denoiser:
    """Interface; subclasses mirror sd.cpp's denoiser structs."""

    prediction = "?"
    is_flow = False

    def sigma_min(self) -> np.float32:
        raise NotImplementedError

    def sigma_max(self) -> np.float32:
        raise NotImplementedError

    def sigma_to_t(self, sigma) -> np.float32:
        raise NotImplementedError

    def t_to_sigma(self, t) -> np.float32:
        raise NotImplementedError

    def get_scalings(self, sigma):
        """(c_skip, c_out, c_in) as float32 scalars."""
        raise NotImplementedError

    def noise_scaling(self, sigma, noise, latent):
        return (latent + noise * F32(sigma)).astype(np.float32, copy=False)

    def inverse_noise_scaling(self, sigma, latent):
        return latent

    def noise_level_to_sigma(self, noise_level):
        nl = F32(noise_level)
        return F32(nl / (F32(1.0) - nl))

    def denoised_from_output(self, x, out, sigma):
        """``x * c_skip + out * c_out`` as sd.cpp's denoise callback forms it."""
        c_skip, c_out, _ = self.get_scalings(sigma)
        return (x * c_skip + out * c_out).astype(np.float32, copy=False)

    def __repr__(self):
        return f"{type(self).__name__}()"


class CompVisDenoiser(Denoiser):
    """eps-prediction over the discrete 1000-step SD schedule (k-diffusion ``CompVisDenoiser``)."""

    prediction = "eps"
    sigma_data = F32(1.0)

    def __init__(self, alphas_cumprod=None):
        if alphas_cumprod is None:
            ac = calculate_alphas_cumprod()
        else:
            ac = np.asarray(alphas_cumprod, np.float32).reshape(-1)
            if ac.size != TIMESTEPS or not np.all(np.isfinite(ac)) or np.any(ac <= 0) or np.any(ac > 1):
                raise UsageError(
                    f"alphas_cumprod must hold {TIMESTEPS} finite values in (0, 1]; got {ac.size} values")
        # sigmas[i] = std::sqrt((1 - ac) / ac) in float, log_sigmas = std::log(float)
        sig = np.sqrt(((np.float32(1) - ac) / ac).astype(np.float32)).astype(np.float32)
        self.sigmas = sig
        self.log_sigmas = np.array([cf.logf(s) for s in sig], np.float32)

    def sigma_min(self):
        return F32(self.sigmas[0])

    def sigma_max(self):
        return F32(self.sigmas[TIMESTEPS - 1])

    def sigma_to_t(self, sigma):
        log_sigma = cf.logf(sigma)
        dists = (log_sigma - self.log_sigmas).astype(np.float32)
        low_idx = int(np.count_nonzero(dists >= 0))
        low_idx = min(max(low_idx - 1, 0), TIMESTEPS - 2)
        high_idx = low_idx + 1
        low = self.log_sigmas[low_idx]
        high = self.log_sigmas[high_idx]
        w = F32((low - log_sigma) / (low - high))
        w = max(F32(0.0), min(F32(1.0), w))
        return F32((F32(1.0) - w) * F32(low_idx) + w * F32(high_idx))

    def t_to_sigma(self, t):
        t = F32(t)
        low_idx = int(cf.floorf(t))
        high_idx = int(cf.ceilf(t))
        w = F32(t - F32(low_idx))
        log_sigma = F32((F32(1.0) - w) * self.log_sigmas[low_idx] + w * self.log_sigmas[high_idx])
        return cf.expf(log_sigma)

    def get_scalings(self, sigma):
        s = F32(sigma)
        c_in = F32(F32(1.0) / cf.sqrtf(s * s + self.sigma_data * self.sigma_data))
        return F32(1.0), F32(-s), c_in


class CompVisVDenoiser(CompVisDenoiser):
    """v-prediction (SD 2.x 768-v, v-pred SDXL) over the discrete SD schedule."""

    prediction = "v"

    def get_scalings(self, sigma):
        s, sd = F32(sigma), self.sigma_data
        r = F32(s * s + sd * sd)
        c_skip = F32(sd * sd / r)
        c_out = F32(-s * sd / cf.sqrtf(r))
        c_in = F32(F32(1.0) / cf.sqrtf(r))
        return c_skip, c_out, c_in


class EDMVDenoiser(CompVisVDenoiser):
    """EDM v-prediction (CosXL): continuous sigma, t = 0.25 * log(sigma)."""

    prediction = "edm_v"

    def __init__(self, min_sigma=0.002, max_sigma=120.0):
        super().__init__()
        self.min_sigma = F32(min_sigma)
        self.max_sigma = F32(max_sigma)

    def t_to_sigma(self, t):
        return cf.expf(F32(F32(t) * F32(4)) / F32(TIMESTEPS))

    def sigma_to_t(self, sigma):
        return F32(F32(0.25) * cf.logf(sigma))

    def sigma_min(self):
        return self.min_sigma

    def sigma_max(self):
        return self.max_sigma


class DiscreteFlowDenoiser(Denoiser):
    """Rectified flow with SD3's shift (``sd3_flow``): x_sigma = (1 - sigma) x0 + sigma noise."""

    prediction = "sd3_flow"
    is_flow = True

    def __init__(self, shift=3.0):
        self.shift = F32(shift)

    def set_shift(self, shift):
        self.shift = F32(shift)

    def sigma_min(self):
        return self.t_to_sigma(0)

    def sigma_max(self):
        return self.t_to_sigma(TIMESTEPS - 1)

    def sigma_to_t(self, sigma):
        return F32(F32(sigma) * F32(1000.0))

    def t_to_sigma(self, t):
        t = F32(F32(t) + F32(1))
        return time_snr_shift(self.shift, F32(t / F32(1000.0)))

    def get_scalings(self, sigma):
        return F32(1.0), F32(-F32(sigma)), F32(1.0)

    def noise_scaling(self, sigma, noise, latent):
        s = F32(sigma)
        return (latent * (F32(1.0) - s) + noise * s).astype(np.float32, copy=False)

    def inverse_noise_scaling(self, sigma, latent):
        return (latent * F32(F32(1.0) / (F32(1.0) - F32(sigma)))).astype(np.float32, copy=False)

    def noise_level_to_sigma(self, noise_level):
        return F32(noise_level)


class FluxFlowDenoiser(DiscreteFlowDenoiser):
    """Flux-style flow (``flux_flow``): t = sigma, exponential time shift ``mu = shift``."""

    prediction = "flux_flow"

    def __init__(self, shift=1.0):
        super().__init__(shift)

    def sigma_to_t(self, sigma):
        return F32(sigma)

    def t_to_sigma(self, t):
        t = F32(F32(t) + F32(1))
        return flux_time_shift(self.shift, F32(1.0), F32(t / F32(TIMESTEPS)))


class MiniT2IFlowDenoiser(Denoiser):
    """MiniT2I: the network predicts x0 directly; sigma = 1 - t runs linearly 1 -> 0."""

    prediction = "minit2i_flow"
    is_flow = False  # sd.cpp: not a DiscreteFlowDenoiser, so samplers take the non-flow branches

    def sigma_min(self):
        return F32(0.0)

    def sigma_max(self):
        return F32(1.0)

    def sigma_to_t(self, sigma):
        return F32(F32(1.0) - F32(sigma))

    def t_to_sigma(self, t):
        return F32(F32(1.0) - F32(t))

    def get_scalings(self, sigma):
        return F32(0.0), F32(1.0), F32(1.0)

    def noise_scaling(self, sigma, noise, latent):
        return (noise * F32(2.0)).astype(np.float32, copy=False)

    def noise_level_to_sigma(self, noise_level):
        return F32(1.0)

    def own_sigmas(self, n):
        """MiniT2I ignores the scheduler: uniform 1 -> 0."""
        out = [F32(F32(1.0) - F32(i) / F32(n)) for i in range(n)] + [F32(0.0)]
        return np.array(out, np.float32)


# name -> (class, help); names as sd-cli's --prediction takes them
PREDICTIONS = {
    "eps": (CompVisDenoiser, "epsilon prediction (SD 1.x, SD 2.x base, SDXL)"),
    "v": (CompVisVDenoiser, "v-prediction (SD 2.x 768-v, v-pred SDXL)"),
    "edm_v": (EDMVDenoiser, "EDM v-prediction (CosXL)"),
    "sd3_flow": (DiscreteFlowDenoiser, "rectified flow with SD3 time shift (SD3, Wan, Qwen-Image ...)"),
    "flux_flow": (FluxFlowDenoiser, "rectified flow with Flux exponential time shift (Flux, Flux.2 ...)"),
    "minit2i_flow": (MiniT2IFlowDenoiser, "MiniT2I x0-prediction flow"),
}


def make_denoiser(prediction: str, *, alphas_cumprod=None, flow_shift=None) -> Denoiser:
    """Build the denoiser for a ``--prediction`` name (``sefi_flow`` is not supported yet)."""
    if prediction not in PREDICTIONS:
        raise UsageError(f"unknown prediction type '{prediction}'; valid: {', '.join(PREDICTIONS)}")
    cls = PREDICTIONS[prediction][0]
    if issubclass(cls, CompVisDenoiser):
        den = cls() if cls is EDMVDenoiser else cls(alphas_cumprod)
        return den
    if issubclass(cls, DiscreteFlowDenoiser):
        den = cls()
        if flow_shift is not None and math.isfinite(flow_shift):
            den.set_shift(flow_shift)
        return den
    return cls()
