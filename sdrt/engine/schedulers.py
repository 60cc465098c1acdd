"""Sigma schedules: sd.cpp's 16 schedulers, bit-exact with its ``runtime/denoiser.hpp``.

Each scheduler is a small function ``(n, ctx) -> float32 array`` that returns ``n + 1`` sigmas
from high to low ending in 0 (``beta`` may return fewer: it drops repeated timesteps, as sd.cpp
does). ``ctx`` (:class:`SchedulerContext`) carries what sd.cpp passes: the denoiser's
``sigma_min``/``sigma_max``/``t_to_sigma``, the model family (AYS), the image token count (the
resolution-dependent flow schedules) and the ``--extra-sample-args`` key=value pairs.

:data:`SCHEDULERS` is the one registry: the CLI takes its choices, aliases and help text from it.
:func:`get_sigmas` is what the engine calls.

Float semantics: sd.cpp computes these in C ``float`` with a few ``double`` steps (unqualified
``pow``/``exp`` on float arguments resolve to the C ``double`` functions in its build); the code
below keeps each step's type, and float transcendentals go through :data:`denoisers.cf` (libm).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np

from ..errors import UsageError
from .denoisers import F32, TIMESTEPS, Denoiser, cf, flux_time_shift

__all__ = [
    "AYS_NOISE_LEVELS",
    "GITS_NOISE_1_20",
    "SCHEDULERS",
    "SCHEDULER_ALIASES",
    "Scheduler",
    "SchedulerContext",
    "get_sigmas",
    "parse_key_value_args",
    "parse_sigmas",
    "parse_strict_bool",
    "parse_strict_float",
    "parse_strict_int",
    "resolve_scheduler_name",
]

def _ERR():  # sd.cpp lets 0/0 become NaN (karras/exponential with n == 1)
    return np.errstate(all="ignore")


# ------------------------------------------------------------------------------------ arg parsing
def parse_key_value_args(text) -> list[tuple[str, str]]:
    """sd.cpp ``parse_key_value_args``: ``"a=1, b=2; c=3"`` -> [("a","1"), ("b","2"), ("c","3")].

    Also accepts a dict or a list of pairs (already parsed)."""
    if text is None:
        return []
    if isinstance(text, dict):
        return [(str(k), str(v)) for k, v in text.items()]
    if not isinstance(text, str):
        return [(str(k), str(v)) for k, v in text]
    pairs = []
    for tok in text.replace(";", ",").split(","):
        tok = tok.strip()
        if not tok:
            continue
        if "=" not in tok:
            continue  # sd.cpp warns "ignoring malformed" and goes on
        k, v = tok.split("=", 1)
        pairs.append((k.strip(), v.strip()))
    return pairs


def parse_strict_float(text):
    """``std::stof`` with nothing but blanks after the number; None when invalid."""
    try:
        v = float(str(text).strip())
    except ValueError:
        return None
    return F32(v) if math.isfinite(v) or str(text).strip().lower().lstrip("+-") in ("inf", "infinity", "nan") else None


def parse_strict_int(text):
    try:
        return int(str(text).strip())
    except ValueError:
        return None


def parse_strict_bool(text):
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    return None


def parse_sigmas(text: str) -> np.ndarray:
    """``--sigmas "14.61,7.8,3.5,0.0"`` (optional [brackets]) -> float32 array, as sd-cli parses it."""
    s = text.strip() if text is not None else ""
    if s.startswith("["):
        s = s[1:]
    if s.endswith("]"):
        s = s[:-1]
    out = []
    for item in s.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(F32(float(item)))
        except ValueError:
            raise UsageError(f"invalid float value '{item}' in --sigmas") from None
    if not out and s:
        raise UsageError(f"could not parse any sigma values from '{text}' (--sigmas)")
    return np.array(out, np.float32)


# ------------------------------------------------------------------------------------ context
@dataclass
class SchedulerContext:
    """What a scheduler may read besides the step count."""

    denoiser: Denoiser
    family: str = "sd1"            # the model family's name (AYS reads its `ays_levels`)
    image_seq_len: int = 0         # latent tokens, for the flux/flux2/ltx2/logit_normal shifts
    extra_args: list = field(default_factory=list)  # parsed --extra-sample-args

    @property
    def sigma_min(self):
        return F32(self.denoiser.sigma_min())

    @property
    def sigma_max(self):
        return F32(self.denoiser.sigma_max())

    def t_to_sigma(self, t):
        return F32(self.denoiser.t_to_sigma(F32(t)))


def _arr(vals):
    return np.array(vals, dtype=np.float32)


# ------------------------------------------------------------------------------------ helpers
def _linear_space(start, end, num):
    """sd.cpp ``linear_space``: cumulative float additions (not numpy.linspace)."""
    start, end = F32(start), F32(end)
    out = [F32(0)] * num
    with _ERR():
        inc = F32((end - start) / F32(num - 1))
    if num > 0:
        out[0] = start
        for i in range(1, num):
            out[i] = F32(out[i - 1] + inc)
    return out


def _linear_interp(new_x, ref_x, ref_y):
    """sd.cpp ``linear_interp`` (NumCpp): float x, double interpolation."""
    new_x = list(new_x)
    if new_x[0] < ref_x[0]:
        new_x[0] = ref_x[0]
    if new_x[-1] > ref_x[-1]:
        new_x[-1] = ref_x[-1]
    out = [0.0] * len(new_x)
    i = j = 0
    while i < len(new_x):
        if ref_x[j] > new_x[i] or new_x[i] > ref_x[j + 1]:
            j += 1
            continue
        perc = float(F32(new_x[i] - ref_x[j])) / float(F32(ref_x[j + 1] - ref_x[j]))
        out[i] = float(ref_y[j]) * (1.0 - perc) + float(ref_y[j + 1]) * perc
        i += 1
    return out


def _log_linear_interpolation(sigma_in, new_len):
    """sd.cpp ``log_linear_interpolation``: stretch a descending sigma list to ``new_len``."""
    s_len = len(sigma_in)
    x_vals = _linear_space(0.0, 1.0, s_len)
    y_vals = [cf.logf(sigma_in[s_len - i - 1]) for i in range(s_len)]
    new_x = _linear_space(0.0, 1.0, new_len)
    new_y = _linear_interp(new_x, x_vals, y_vals)
    return [F32(math.exp(new_y[new_len - i - 1])) for i in range(new_len)]


# ------------------------------------------------------------------------------------ schedulers
def discrete(n, ctx):
    """Uniform in timestep (k-diffusion ``get_sigmas`` of a discrete model; alias ``normal``)."""
    t_max = TIMESTEPS - 1
    if n == 0:
        return _arr([])
    if n == 1:
        return _arr([ctx.t_to_sigma(F32(t_max)), 0.0])
    step = F32(F32(t_max) / F32(n - 1))
    out = [ctx.t_to_sigma(F32(F32(t_max) - F32(step * F32(i)))) for i in range(n)]
    return _arr(out + [0.0])


def karras(n, ctx):
    """Karras et al. (2022) eq. 5, rho = 7, between the model's sigma_min and sigma_max."""
    rho = F32(7.0)
    smin, smax = ctx.sigma_min, ctx.sigma_max
    if smin <= F32(1e-6):
        smin = F32(1e-6)
    inv = float(F32(F32(1.0) / rho))
    min_inv_rho = F32(math.pow(float(smin), inv))
    max_inv_rho = F32(math.pow(float(smax), inv))
    out = []
    with _ERR():
        for i in range(n):
            frac = F32(F32(i) / F32(F32(n) - F32(1.0)))
            base = F32(max_inv_rho + F32(frac * F32(min_inv_rho - max_inv_rho)))
            out.append(F32(math.pow(float(base), float(rho))) if np.isfinite(base) else F32("nan"))
    return _arr(out + [0.0])


def exponential(n, ctx):
    """Uniform in log-sigma between sigma_max and sigma_min (k-diffusion get_sigmas_exponential)."""
    lmin = cf.logf(ctx.sigma_min)
    lmax = cf.logf(ctx.sigma_max)
    with _ERR():
        step = F32(F32(lmax - lmin) / F32(n - 1))
        out = [cf.expf(F32(lmax - F32(step * F32(i)))) for i in range(n)]
    return _arr(out + [0.0])


AYS_NOISE_LEVELS = {
    "sd1": (14.6146412293, 6.4745760956, 3.8636745985, 2.6946151520, 1.8841921177, 1.3943805092,
            0.9642583904, 0.6523686016, 0.3977456272, 0.1515232662, 0.0291671582),
    "sdxl": (14.6146412293, 6.3184485287, 3.7681790315, 2.1811480769, 1.3405244945, 0.8620721141,
             0.5550693289, 0.3798540708, 0.2332364134, 0.1114188177, 0.0291671582),
    "svd": (700.00, 54.5, 15.886, 7.977, 4.248, 1.789, 0.981, 0.403, 0.173, 0.034, 0.002),
}


def ays(n, ctx):
    """Align Your Steps (NVIDIA): fixed 10-step levels for SD1.5 / SDXL / SVD, log-linearly stretched."""
    from ..models.families import get_family
    levels = get_family(ctx.family).ays_levels      # SD 2.x: SD 1.5's (see sdrt.models.sd)
    if levels not in AYS_NOISE_LEVELS:
        raise UsageError(f"the ays scheduler has noise levels for SD1.x, SDXL and SVD only, not '{ctx.family}'")
    inputs = [F32(v) for v in AYS_NOISE_LEVELS[levels]]
    if n + 1 != len(inputs):
        res = _log_linear_interpolation(inputs, n + 1)
    else:
        res = list(inputs)
    res[n] = F32(0.0)
    return _arr(res)


GITS_NOISE_1_20 = (
    (14.61464119, 0.803307, 0.02916753),
    (14.61464119, 1.56271636, 0.52423614, 0.02916753),
    (14.61464119, 2.36326075, 0.92192322, 0.36617002, 0.02916753),
    (14.61464119, 2.84484982, 1.24153244, 0.59516323, 0.25053367, 0.02916753),
    (14.61464119, 5.85520077, 2.05039096, 0.95350921, 0.45573691, 0.17026083, 0.02916753),
    (14.61464119, 5.85520077, 2.45070267, 1.24153244, 0.64427125, 0.29807833, 0.09824532, 0.02916753),
    (14.61464119, 5.85520077, 2.45070267, 1.36964464, 0.803307, 0.45573691, 0.25053367, 0.09824532,
     0.02916753),
    (14.61464119, 5.85520077, 2.84484982, 1.61558151, 0.95350921, 0.59516323, 0.36617002, 0.19894916,
     0.09824532, 0.02916753),
    (14.61464119, 5.85520077, 2.84484982, 1.67050016, 1.08895338, 0.74807048, 0.50118381, 0.32104823,
     0.19894916, 0.09824532, 0.02916753),
    (14.61464119, 5.85520077, 2.95596409, 1.84880662, 1.24153244, 0.83188516, 0.59516323, 0.41087446,
     0.27464288, 0.17026083, 0.09824532, 0.02916753),
    (14.61464119, 5.85520077, 3.07277966, 1.98035145, 1.36964464, 0.95350921, 0.69515091, 0.50118381,
     0.36617002, 0.25053367, 0.17026083, 0.09824532, 0.02916753),
    (14.61464119, 6.77309084, 3.46139455, 2.36326075, 1.56271636, 1.08895338, 0.803307, 0.59516323,
     0.45573691, 0.34370604, 0.25053367, 0.17026083, 0.09824532, 0.02916753),
    (14.61464119, 6.77309084, 3.46139455, 2.45070267, 1.61558151, 1.162866, 0.86115354, 0.64427125,
     0.50118381, 0.38853383, 0.29807833, 0.22545385, 0.17026083, 0.09824532, 0.02916753),
    (14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.12350607, 1.51179266, 1.08895338, 0.83188516,
     0.64427125, 0.50118381, 0.38853383, 0.29807833, 0.22545385, 0.17026083, 0.09824532, 0.02916753),
    (14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.12350607, 1.51179266, 1.08895338, 0.83188516,
     0.64427125, 0.50118381, 0.41087446, 0.32104823, 0.25053367, 0.19894916, 0.13792117, 0.09824532,
     0.02916753),
    (14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.12350607, 1.51179266, 1.08895338, 0.83188516,
     0.64427125, 0.50118381, 0.41087446, 0.34370604, 0.27464288, 0.22545385, 0.17026083, 0.13792117,
     0.09824532, 0.02916753),
    (14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.19988537, 1.61558151, 1.20157266, 0.92192322,
     0.72133851, 0.57119018, 0.45573691, 0.36617002, 0.29807833, 0.25053367, 0.19894916, 0.17026083,
     0.13792117, 0.09824532, 0.02916753),
    (14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.19988537, 1.61558151, 1.24153244, 0.95350921,
     0.74807048, 0.59516323, 0.4783645, 0.38853383, 0.32104823, 0.27464288, 0.22545385, 0.19894916,
     0.17026083, 0.13792117, 0.09824532, 0.02916753),
    (14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.19988537, 1.61558151, 1.24153244, 0.95350921,
     0.74807048, 0.59516323, 0.50118381, 0.41087446, 0.34370604, 0.29807833, 0.25053367, 0.22545385,
     0.19894916, 0.17026083, 0.13792117, 0.09824532, 0.02916753),
)


def gits(n, ctx):
    """GITS (Chen et al. 2024) precomputed SD1.5 schedules at coeff 1.20, the one sd.cpp uses."""
    if ctx.sigma_max <= 0:
        return _arr([])
    if n < 2:
        raise UsageError("the gits scheduler needs at least 2 steps")
    if n <= 20:
        sig = [F32(v) for v in GITS_NOISE_1_20[n - 2]]
    else:
        sig = _log_linear_interpolation([F32(v) for v in GITS_NOISE_1_20[-1]], n + 1)
    sig[n] = F32(0.0)
    return _arr(sig)


def sgm_uniform(n, ctx):
    """Uniform in timestep from 999 to 0 over n+1 points, last replaced by 0 (SGM's schedule)."""
    if n == 0:
        return _arr([0.0])
    ts = _linear_space(F32(TIMESTEPS - 1), F32(0), n + 1)
    return _arr([ctx.t_to_sigma(ts[i]) for i in range(n)] + [0.0])


def simple(n, ctx):
    """ComfyUI 'simple': every (1000/n)-th training sigma from the top."""
    if n == 0:
        return _arr([])
    step_factor = F32(F32(TIMESTEPS) / F32(n))
    out = []
    for i in range(n):
        off = int(F32(F32(i) * step_factor))
        idx = max(TIMESTEPS - 1 - off, 0)
        out.append(ctx.t_to_sigma(F32(idx)))
    return _arr(out + [0.0])


def smoothstep(n, ctx):
    """Timesteps along smoothstep(u) = u^2 (3 - 2u), close to the beta scheduler."""
    t_max = TIMESTEPS - 1
    if n == 0:
        return _arr([])
    if n == 1:
        return _arr([ctx.t_to_sigma(F32(t_max)), 0.0])
    out = []
    for i in range(n):
        u = F32(F32(1.0) - F32(i) / F32(n))
        ss = F32(u * u * F32(F32(3.0) - F32(2.0) * u))
        out.append(ctx.t_to_sigma(cf.roundf(F32(ss * F32(t_max)))))
    return _arr(out + [0.0])


def kl_optimal(n, ctx):
    """KL-optimal (Sabour et al. 2024): uniform in atan(sigma)."""
    if n == 0:
        return _arr([])
    if n == 1:
        return _arr([ctx.sigma_max, 0.0])
    smin, smax = ctx.sigma_min, ctx.sigma_max
    if smin <= F32(1e-6):
        smin = F32(1e-6)
    a_min = cf.atanf(smin)
    a_max = cf.atanf(smax)
    out = []
    for i in range(n):
        t = F32(F32(i) / F32(n - 1))
        angle = F32(F32(t * a_min) + F32(F32(F32(1.0) - t) * a_max))
        out.append(cf.tanf(angle))
    return _arr(out + [0.0])


def lcm(n, ctx):
    """LCM: n of the 50 'original' timesteps (999, 979, ...), as the LCM scheduler picks them."""
    original_steps = 50
    k = TIMESTEPS // original_steps
    out = []
    for i in range(n):
        index = (i * original_steps) // n
        timestep = (original_steps - index) * k - 1
        out.append(ctx.t_to_sigma(F32(timestep)))
    return _arr(out + [0.0])


_KPI = F32(3.14159265358979323846)


def _bong_tangent_sigmas(steps, slope, pivot, start, end):
    if steps <= 0:
        return []
    two_pi = F32(F32(2.0) / _KPI)

    def v(x):
        return F32(F32(F32(two_pi * cf.atanf(F32(-slope * F32(F32(x) - pivot)))) + F32(1.0)) * F32(0.5))

    smax = v(0.0)
    smin = v(F32(steps - 1))
    srange = F32(smax - smin)
    sscale = F32(start - end)
    if abs(srange) < F32(1e-8):
        if steps == 1:
            return [start]
        return [F32(start + F32(F32(end - start) * F32(F32(i) / F32(steps - 1)))) for i in range(steps)]
    inv = F32(F32(1.0) / srange)
    return [F32(F32(F32(F32(v(F32(x)) - smin) * inv) * sscale) + end) for x in range(steps)]


def bong_tangent(n, ctx):
    """RES4LYF's two-stage arctangent schedule (pivot 0.6, slope 0.2)."""
    if n == 0:
        return _arr([])
    start, end = ctx.sigma_max, ctx.sigma_min
    middle = F32(end + F32(F32(start - end) * F32(0.5)))
    p1 = p2 = F32(0.6)
    s1 = s2 = F32(0.2)
    steps = n + 2
    midpoint = int(F32(F32(F32(steps) * p1) + F32(F32(steps) * p2)) * F32(0.5))
    p1_i = int(F32(F32(steps) * p1))
    p2_i = int(F32(F32(steps) * p2))
    slope_scale = F32(F32(steps) / F32(40.0))
    s1 = F32(s1 / slope_scale)
    s2 = F32(s2 / slope_scale)
    stage_2_len = steps - midpoint
    stage_1_len = steps - stage_2_len
    sig1 = _bong_tangent_sigmas(stage_1_len, s1, F32(p1_i), start, middle)
    sig2 = _bong_tangent_sigmas(stage_2_len, s2, F32(p2_i - stage_1_len), middle, end)
    if sig1:
        sig1.pop()
    res = sig1 + sig2
    while len(res) < n + 1:
        res.append(end)
    res = res[:n + 1]
    res[n] = F32(0.0)
    return _arr(res)


# --- beta (double precision, as sd.cpp) -------------------------------------------------------
def _c_double_fn(name, fallback):
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        fn = getattr(lib, name)
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_double]
        return lambda v: fn(float(v))
    except (OSError, AttributeError, TypeError):
        return fallback


_lgamma = _c_double_fn("lgamma", math.lgamma)  # CPython's lgamma is its own, not libm's


def _log_beta(a, b):
    return _lgamma(a) + _lgamma(b) - _lgamma(a + b)


def _incbeta(x, a, b):
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    max_iter, epsilon, tiny = 200, 3.0e-7, 1e-30
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    if abs(d) < tiny:
        d = tiny
    d = 1.0 / d
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        if abs(d) < tiny:
            d = tiny
        c = 1.0 + aa / c
        if abs(c) < tiny:
            c = tiny
        d = 1.0 / d
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        if abs(d) < tiny:
            d = tiny
        c = 1.0 + aa / c
        if abs(c) < tiny:
            c = tiny
        d = 1.0 / d
        de = d * c
        h *= de
        if abs(de - 1.0) < epsilon:
            break
    return math.exp(a * math.log(x) + b * math.log(1.0 - x) - _log_beta(a, b)) / a * h


def _beta_cdf(x, a, b):
    if x == 0.0:
        return 0.0
    if x == 1.0:
        return 1.0
    if x < (a + 1.0) / (a + b + 2.0):
        return _incbeta(x, a, b)
    return 1.0 - _incbeta(1.0 - x, b, a)


def _beta_ppf(u, a, b, max_iter=30):
    x = 0.5
    for _ in range(max_iter):
        f = _beta_cdf(x, a, b) - u
        if abs(f) < 1e-10:
            break
        df = math.exp((a - 1.0) * math.log(x) + (b - 1.0) * math.log(1.0 - x) - _log_beta(a, b))
        x -= f / df
        if x <= 0.0:
            x = 1e-10
        if x >= 1.0:
            x = 1.0 - 1e-10
    return x


def _lround(v):
    return int(math.floor(v + 0.5)) if v >= 0 else -int(math.floor(-v + 0.5))


def beta(n, ctx):
    """Beta-distribution timesteps (Lee et al. 2024), alpha = beta = 0.6; repeated timesteps dropped."""
    a = b = 0.6
    for key, value in ctx.extra_args:
        if key in ("alpha", "beta"):
            p = parse_strict_float(value)
            if p is not None and p > 0.0:
                if key == "alpha":
                    a = float(p)
                else:
                    b = float(p)
    t_max = TIMESTEPS - 1
    if n == 0:
        return _arr([])
    if n == 1:
        return _arr([ctx.t_to_sigma(F32(t_max)), 0.0])
    out, last_t = [], -1
    for i in range(n):
        u = 1.0 - float(i) / float(n)
        t = _lround(_beta_ppf(u, a, b) * t_max)
        if t != last_t:
            out.append(ctx.t_to_sigma(F32(t)))
            last_t = t
    return _arr(out + [0.0])


# --- flow-model schedules (ignore the denoiser) -----------------------------------------------
def flux(n, ctx):
    """Flux: exponential time shift mu linear in image tokens (256 -> 0.5, 4096 -> 1.15)."""
    base_shift, max_shift = F32(0.5), F32(1.15)
    for key, value in ctx.extra_args:
        p = parse_strict_float(value) if key in ("base_shift", "max_shift") else None
        if p is not None:
            if key == "base_shift":
                base_shift = p
            else:
                max_shift = p
    m = F32(F32(max_shift - base_shift) / F32(4096.0 - 256.0))
    b = F32(base_shift - F32(m * F32(256.0)))
    mu = F32(F32(F32(ctx.image_seq_len) * m) + b)
    if n == 0:
        return _arr([1.0])
    out = []
    for i in range(n + 1):
        t = F32(F32(1.0) - F32(i) / F32(n))
        out.append(F32(0.0) if t <= 0 else flux_time_shift(mu, F32(1.0), t))
    out[n] = F32(0.0)
    return _arr(out)


def flux2(n, ctx):
    """Flux.2: empirical mu from image tokens and step count."""
    seq = ctx.image_seq_len
    a1, b1 = F32(8.73809524e-05), F32(1.89833333)
    a2, b2 = F32(0.00016927), F32(0.45666666)
    if seq > 4300:
        mu = F32(F32(a2 * F32(seq)) + b2)
    else:
        m_200 = F32(F32(a2 * F32(seq)) + b2)
        m_10 = F32(F32(a1 * F32(seq)) + b1)
        a = F32(F32(m_200 - m_10) / F32(190.0))
        b = F32(m_200 - F32(F32(200.0) * a))
        mu = F32(F32(a * F32(n)) + b)
    if n == 0:
        return _arr([1.0])
    out = []
    for i in range(n + 1):
        t = F32(F32(1.0) - F32(i) / F32(n))
        if t <= 0:
            out.append(F32(0.0))
        elif t >= 1:
            out.append(F32(1.0))
        else:
            out.append(flux_time_shift(mu, F32(1.0), t))
    out[n] = F32(0.0)
    return _arr(out)


def ltx2(n, ctx):
    """LTX-2: token-count shift with the tail stretched to a terminal sigma of 0.1."""
    token_count = ctx.image_seq_len if ctx.image_seq_len > 0 else 4096
    max_shift, base_shift, stretch, terminal = F32(2.05), F32(0.95), True, F32(0.1)
    for key, value in ctx.extra_args:
        if key in ("max_shift", "base_shift", "terminal"):
            p = parse_strict_float(value)
            if p is not None:
                if key == "max_shift":
                    max_shift = p
                elif key == "base_shift":
                    base_shift = p
                else:
                    terminal = p
        elif key == "stretch":
            p = parse_strict_bool(value)
            if p is not None:
                stretch = p
    if n == 0:
        return _arr([0.0])
    m = F32(F32(max_shift - base_shift) / F32(4096.0 - 1024.0))
    b = F32(base_shift - F32(m * F32(1024.0)))
    sigma_shift = F32(F32(F32(token_count) * m) + b)
    exp_shift = cf.expf(sigma_shift)
    target_terminal = min(max(terminal, F32(0.0)), F32(0.99))
    sig = []
    for i in range(n + 1):
        s = F32(F32(1.0) - F32(i) / F32(n))
        if s != 0:
            s = F32(exp_shift / F32(exp_shift + F32(F32(F32(1.0) / s) - F32(1.0))))
        sig.append(s)
    if stretch and len(sig) > 2:
        one_minus_last = F32(F32(1.0) - sig[n - 1])
        scale = F32(one_minus_last / F32(F32(1.0) - target_terminal))
        if scale > F32(1e-8):
            for i in range(n):
                sig[i] = F32(F32(1.0) - F32(F32(F32(1.0) - sig[i]) / scale))
    sig[n] = F32(0.0)
    return _arr(sig)


def _ndtri(p):
    """Acklam's normal quantile, double, as sd.cpp."""
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    p_low = 0.02425
    p_high = 1.0 - p_low
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
         -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
         3.754408661907416e+00, 1.0)
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
         1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
    bb = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
          6.680131188771972e+01, -1.328068155288572e+01, 1.0)

    def tail(q):
        num = c[0]
        for i in range(1, 6):
            num = num * q + c[i]
        den = d[0]
        for i in range(1, 5):
            den = den * q + d[i]
        return num / den

    if p < p_low:
        return tail(math.sqrt(-2.0 * math.log(p)))
    if p > p_high:
        return -tail(math.sqrt(-2.0 * math.log(1.0 - p)))
    q = p - 0.5
    r = q * q
    num = a[0]
    for i in range(1, 6):
        num = num * r + a[i]
    num *= q
    den = bb[0]
    for i in range(1, 6):
        den = den * r + bb[i]
    return num / den


def logit_normal(n, ctx):
    """Ideogram 4: logit-normal quantiles (mu 0, std 1.75), resolution-aware mean, logSNR clamp."""
    mean, std, lmin, lmax, res_aware = F32(0.0), F32(1.75), F32(-15.0), F32(18.0), True
    for key, value in ctx.extra_args:
        if key in ("mu", "std", "logsnr_min", "logsnr_max"):
            p = parse_strict_float(value)
            if p is not None:
                if key == "mu":
                    mean = p
                elif key == "std":
                    std = p
                elif key == "logsnr_min":
                    lmin = p
                else:
                    lmax = p
        elif key == "resolution_aware":
            p = parse_strict_bool(value)
            if p is not None:
                res_aware = p
    known = (512 * 512) // (16 * 16)
    if ctx.image_seq_len > 0 and res_aware:
        mean = F32(mean + F32(F32(0.5) * cf.logf(F32(F32(ctx.image_seq_len) / F32(known)))))

    def sigmoid(x):
        return F32(F32(1.0) / F32(F32(1.0) + cf.expf(F32(-F32(x)))))

    hi = sigmoid(F32(F32(0.5) * lmax))
    lo = sigmoid(F32(F32(0.5) * lmin))
    out = []
    with _ERR():
        for i in range(n + 1):
            t = F32(F32(i) / F32(n))
            z = F32(-_ndtri(float(t)))
            ts = sigmoid(F32(mean + F32(std * z)))
            if ts > hi:
                ts = hi
            if ts < lo:
                ts = lo
            out.append(ts)
    out[n] = F32(0.0)
    return _arr(out)


# ------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Scheduler:
    name: str
    fn: Callable
    help: str
    flow_only: bool = False   # ignores the denoiser's sigma range (meant for flow models)


SCHEDULERS: dict[str, Scheduler] = {s.name: s for s in (
    Scheduler("discrete", discrete, "uniform in timestep (k-diffusion/sd-webui 'normal')"),
    Scheduler("karras", karras, "Karras et al. rho=7 between sigma_min and sigma_max"),
    Scheduler("exponential", exponential, "uniform in log sigma"),
    Scheduler("ays", ays, "Align Your Steps levels (SD1.x, SDXL, SVD)"),
    Scheduler("gits", gits, "GITS precomputed schedule (coeff 1.20)"),
    Scheduler("sgm_uniform", sgm_uniform, "uniform in timestep over n+1 points, last one dropped"),
    Scheduler("simple", simple, "every (1000/n)-th training sigma (ComfyUI 'simple')"),
    Scheduler("smoothstep", smoothstep, "timesteps along a smoothstep curve"),
    Scheduler("kl_optimal", kl_optimal, "uniform in atan(sigma)"),
    Scheduler("lcm", lcm, "the LCM timesteps (n of 50 original steps)"),
    Scheduler("bong_tangent", bong_tangent, "two-stage arctangent (RES4LYF)"),
    Scheduler("ltx2", ltx2, "LTX-2 token-count shift with stretched tail", flow_only=True),
    Scheduler("logit_normal", logit_normal, "Ideogram 4 logit-normal quantiles", flow_only=True),
    Scheduler("flux2", flux2, "Flux.2 empirical resolution/step shift", flow_only=True),
    Scheduler("flux", flux, "Flux resolution-dependent time shift", flow_only=True),
    Scheduler("beta", beta, "beta(0.6, 0.6) quantile timesteps"),
)}

SCHEDULER_ALIASES = {"normal": "discrete"}


def resolve_scheduler_name(name: str) -> str:
    key = SCHEDULER_ALIASES.get(name, name)
    if key not in SCHEDULERS:
        raise UsageError(f"unknown scheduler '{name}'; valid: {', '.join(SCHEDULERS)} (alias: normal=discrete)")
    return key


def get_sigmas(denoiser: Denoiser, n: int, scheduler: str = "discrete", *, family: str | None = None,
               version: str | None = None, image_seq_len: int = 0, extra_args=None) -> np.ndarray:
    """sd.cpp ``Denoiser::get_sigmas``: n steps of the named schedule (n + 1 sigmas, last 0).
    `family`: the model family's name; or `version`, whose family is taken (default sd1)."""
    if family is None:
        from ..models.families import family_of
        family = family_of(version or "sd1").name
    n = int(n)
    if n < 0:
        raise UsageError(f"the number of steps must be >= 0, got {n}")
    if hasattr(denoiser, "own_sigmas"):  # MiniT2I ignores the scheduler
        return denoiser.own_sigmas(n)
    ctx = SchedulerContext(denoiser, family, int(image_seq_len), parse_key_value_args(extra_args))
    return SCHEDULERS[resolve_scheduler_name(scheduler)].fn(n, ctx)
