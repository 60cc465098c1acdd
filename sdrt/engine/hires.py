"""The hires fix as sd-cli 0.4.7 does it (stable-diffusion.cpp's generate_image, second pass).

After the first pass's latents are sampled at the requested size:
1. the target size: `--hires-width/--hires-height` (one of them: a square), else
   round(size * --hires-scale); aligned up to the model's size multiple.
2. steps: `--hires-steps` (0: the first pass's), divided by `--hires-denoising-strength` (sd-webui:
   the total is scaled up so the trim below leaves about --hires-steps steps); sigmas of that many
   steps at the target size from the first pass's scheduler; t_enc = int(total * strength) (at
   most total - 1); the schedule is sigmas[total - t_enc - 1:].
3. per image (seed + b): both RNGs reseeded with the image's seed; the latent upscaled (below);
   fresh noise from the context RNG; sampled again from the upscaled latent with the same
   conditioning, sampler, eta and guidance (an inpaint mask is resized by max-pooling nearest).
Upscalers (`--hires-upscaler`, sd.cpp's names):
- Latent (bilinear), Latent (nearest), Latent (nearest-exact), Latent (antialiased),
  Latent (bicubic), Latent (bicubic antialiased): the diffusion latent resized (sd::ops::interpolate);
- Lanczos, Nearest: the latent decoded to [0, 1], resized, clamped to [0, 1], encoded again;
- a model name: `<--hires-upscalers-dir>/<name>(.gguf|.safetensors|.pt|.pth)`, an ESRGAN run on
  the decoded image (tiles of --hires-upscale-tile-size), resized nearest to the target when
  its scale does not land there, encoded again (not clamped).
`interpolate` is sd::ops::interpolate (tensor.hpp): separable filters with sd.cpp's support,
weights in double, edge indices clamped, normalized only when antialiased (and for Lanczos).
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from ..errors import UnsupportedError, UsageError

__all__ = ["HIRES_UPSCALERS", "MODEL_EXTS", "HiresPlan", "LATENT_MODES", "hires_sigmas", "interpolate",
           "plan_hires", "resolve_hires_upscaler", "run_hires"]

log = logging.getLogger("sdrt")
F32 = np.float32

# sd.cpp's hires_upscaler_to_str; the Latent ones map to (interpolate mode, antialias)
LATENT_MODES = {
    "Latent": ("bilinear", False),
    "Latent (nearest)": ("nearest", False),
    "Latent (nearest-exact)": ("nearest-exact", False),
    "Latent (antialiased)": ("bilinear", True),
    "Latent (bicubic)": ("bicubic", False),
    "Latent (bicubic antialiased)": ("bicubic", True),
}
IMAGE_MODES = {"Lanczos": "lanczos", "Nearest": "nearest"}
HIRES_UPSCALERS = ("None", *LATENT_MODES, *IMAGE_MODES, "Model")
MODEL_EXTS = (".gguf", ".safetensors", ".pt", ".pth")


# ---- sd::ops::interpolate -----------------------------------------------------------------------

def _linear(x):
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _cubic(x, a=-0.75):            # PyTorch's bicubic kernel
    x = np.abs(x)
    return np.where(x <= 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                    np.where(x < 2.0, ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a, 0.0))


def _lanczos(x, r=3.0):
    x = np.abs(x)
    return np.where(x >= r, 0.0, np.sinc(x) * np.sinc(x / r))


_FILTERS = {"bilinear": (_linear, 1.0), "bicubic": (_cubic, 2.0), "lanczos": (_lanczos, 3.0)}


def _filter_matrix(n_in: int, n_out: int, mode: str, antialias: bool) -> np.ndarray:
    """[n_out, n_in] float64: make_interpolate_contributors, accumulated per (clamped) index."""
    fn, support = _FILTERS[mode]
    scale = n_in / n_out
    fs = max(1.0, scale) if antialias else 1.0
    M = np.zeros((n_out, n_in), np.float64)
    for o in range(n_out):
        center = (o + 0.5) * scale - 0.5
        lo, hi = math.ceil(center - support * fs), math.floor(center + support * fs)
        idx = np.arange(lo, hi + 1)
        w = fn((center - idx) / fs)
        keep = w != 0.0
        idx, w = idx[keep], w[keep]
        if (antialias or mode == "lanczos") and abs(w.sum()) > 1e-12:
            w = w / w.sum()
        if len(idx) == 0:
            idx, w = np.array([min(max(math.floor(center + 0.5), 0), n_in - 1)]), np.array([1.0])
        np.add.at(M[o], np.clip(idx, 0, n_in - 1), w)
    return M


def _nearest_index(n_in: int, n_out: int, exact: bool) -> np.ndarray:
    o = np.arange(n_out)
    if not exact:
        return (o * n_in) // n_out
    c = (o + 0.5) * (n_in / n_out) - 0.5
    return np.clip(np.floor(c + 0.5).astype(np.int64), 0, n_in - 1)


def interpolate(x: np.ndarray, height: int, width: int, mode: str = "nearest", antialias: bool = False) -> np.ndarray:
    """x [N, C, H, W] float32 -> [N, C, height, width] as sd::ops::interpolate (no align_corners)."""
    x = np.asarray(x, F32)
    H, W = x.shape[2:]
    if (H, W) == (height, width):
        return x
    if height <= 0 or width <= 0:
        raise UsageError(f"interpolate: output size {width}x{height} must be positive")
    if mode in ("nearest", "nearest-exact"):
        if antialias:
            raise UsageError("interpolate: antialias needs a filter mode (bilinear, bicubic, lanczos)")
        ex = mode == "nearest-exact"
        return np.ascontiguousarray(x[:, :, _nearest_index(H, height, ex)[:, None], _nearest_index(W, width, ex)[None, :]])
    if mode not in _FILTERS:
        raise UsageError(f"interpolate: unknown mode {mode!r}")
    My = _filter_matrix(H, height, mode, antialias)
    Mx = _filter_matrix(W, width, mode, antialias)
    out = np.einsum("oh,nchw,pw->ncop", My, x.astype(np.float64), Mx, optimize=True)
    return out.astype(F32)


# ---- the plan --------------------------------------------------------------------------------------

def resolve_hires_upscaler(name: str | None, upscalers_dir: str | None) -> tuple[str, str | None]:
    """sd-cli's SDGenerationParams::resolve: (upscaler, model path or None); "" is Latent,
    "None" disables (returns ("None", None)), any other name is a model file in the directory."""
    name = name or "Latent"
    if name == "Model":      # sd.cpp's enum name with no model path: resolve_hires turns the fix off
        log.warning("hires model upscaler requires a model path, disabling hires")
        return "None", None
    if name in HIRES_UPSCALERS:
        return name, None
    if not upscalers_dir:
        raise UsageError(f"--hires-upscaler '{name}': not one of {', '.join(HIRES_UPSCALERS[1:-1])}, and "
                         f"--hires-upscalers-dir (where a model of that name would be) is not set")
    if "/" in name or "\\" in name or os.path.isabs(name) or os.path.splitext(name)[1]:
        raise UsageError(f"--hires-upscaler: a model is named without path or extension, got '{name}'")
    for ext in MODEL_EXTS:
        p = os.path.join(upscalers_dir, name + ext)
        if os.path.isfile(p):
            return "Model", os.path.normpath(p)
    raise UsageError(f"--hires-upscaler: can not find hires upscaler {name} in {os.path.normpath(upscalers_dir)} "
                     f"(tried {', '.join(MODEL_EXTS)})")


@dataclass
class HiresPlan:
    upscaler: str            # a key of LATENT_MODES / IMAGE_MODES, or "Model"
    model_path: str | None
    width: int               # the aligned target size
    height: int
    steps: int               # total steps of the hires schedule (before the trim)
    strength: float
    tile_size: int


def plan_hires(gp, width: int, height: int, multiple: int, upscalers_dir: str | None) -> HiresPlan | None:
    """sd.cpp's resolve_hires on the aligned generation size; None when the fix is off."""
    if not gp.hires:
        return None
    upscaler, path = resolve_hires_upscaler(gp.hires_upscaler, upscalers_dir)
    if upscaler == "None":
        return None
    tw, th = int(gp.hires_width), int(gp.hires_height)
    if tw > 0 and th > 0:
        pass
    elif tw > 0:
        th = tw
    elif th > 0:
        tw = th
    else:   # std::round(width * scale): width int, scale float
        tw = int(math.floor(float(F32(width) * F32(gp.hires_scale)) + 0.5))
        th = int(math.floor(float(F32(height) * F32(gp.hires_scale)) + 0.5))
    if tw <= 0 or th <= 0:
        log.warning("hires target size is not positive, disabling hires")
        return None
    aw, ah = -(-tw // multiple) * multiple, -(-th // multiple) * multiple
    if (aw, ah) != (tw, th):
        log.warning("align hires target up %dx%d to %dx%d (multiple=%d)", tw, th, aw, ah, multiple)
    strength = float(min(max(F32(gp.hires_denoising_strength), F32(0.0001)), F32(1.0)))
    return HiresPlan(upscaler, path, aw, ah, max(0, int(gp.hires_steps)), strength, int(gp.hires_upscale_tile_size))


def hires_sigmas(sigmas_of, first_steps: int, plan: HiresPlan) -> tuple[np.ndarray, int]:
    """(the trimmed hires schedule, its total steps). `sigmas_of(n)` gives n steps at the target size."""
    n = plan.steps if plan.steps > 0 else first_steps
    s = F32(plan.strength)
    total = int(F32(n) / s)
    t_enc = int(F32(total) * s)
    if t_enc >= total:
        t_enc = total - 1
    sig = np.asarray(sigmas_of(total), F32)
    return sig[total - t_enc - 1:], total


# ---- the second pass -------------------------------------------------------------------------------

def _upscale_latent(pipe, latent: np.ndarray, plan: HiresPlan, gp, ctx_rng, upscaler) -> np.ndarray:
    f = pipe.family.vae_scale_factor
    h, w = latent.shape[2:]
    if plan.upscaler in LATENT_MODES:
        mode, aa = LATENT_MODES[plan.upscaler]
        th, tw = plan.height // f, plan.width // f
        log.info("hires %s upscale %dx%d -> %dx%d", plan.upscaler, w, h, tw, th)
        return interpolate(latent, th, tw, mode, aa)
    if pipe.uses_tae:
        raise UnsupportedError(f"--hires-upscaler {plan.upscaler}: needs the VAE encoder (not TAESD)")
    img = pipe.decode_first_stage(latent, gp, as_float=True)         # [1, 3, H, W] in [0, 1]
    if plan.upscaler == "Model":
        up = upscaler.upscale_tensor(img)
        up = interpolate(up, plan.height, plan.width, "nearest")
    else:
        log.info("hires %s image upscale %dx%d -> %dx%d", plan.upscaler, img.shape[3], img.shape[2], plan.width,
                 plan.height)
        up = np.clip(interpolate(img, plan.height, plan.width, IMAGE_MODES[plan.upscaler]), F32(0), F32(1))
    return pipe.encode_first_stage(up, ctx_rng, gp)


def run_hires(pipe, results, gp, size, hplan: HiresPlan, plan, guidance, latents, passes, ctx_rng, smp_rng, bar):
    """The second pass over [(seed, latent)]; returns [(seed, hires latent)] and the SamplePlan used."""
    if latents.concat is not None:
        raise UnsupportedError("--hires: inpaint / instruct-pix2pix models (concat latents) are not supported "
                               "by the hires fix (the concat latents are at the first pass's size)")
    from .schedulers import get_sigmas
    log.info("hires fix: upscaling to %dx%d", hplan.width, hplan.height)
    upscaler = None
    if hplan.upscaler == "Model":
        from .upscaler import Upscaler, upscaler_device
        log.info("hires fix: loading model upscaler from '%s'", hplan.model_path)
        upscaler = Upscaler.load(hplan.model_path, hplan.tile_size, upscaler_device(pipe.model_params.backend))
    f = pipe.family.vae_scale_factor
    first_steps = gp.steps if gp.sigmas is None else min(gp.steps, len(gp.sigmas) - 1)
    seq = (hplan.height // f) * (hplan.width // f)
    sig, total = hires_sigmas(lambda n: get_sigmas(pipe.denoiser, n, plan.scheduler, family=pipe.family.name,
                                                   image_seq_len=seq), first_steps, hplan)
    log.info("hires fix: %d steps, denoising_strength=%.2f, sigma_sched_size=%d", total, hplan.strength, len(sig))
    hplan_s = replace(plan, sigmas=sig)
    out, t0 = [], time.time()
    for b, (cur, lat) in enumerate(results):
        ctx_rng.manual_seed(cur)
        if smp_rng is not ctx_rng:
            smp_rng.manual_seed(cur)
        up = _upscale_latent(pipe, lat, hplan, gp, ctx_rng, upscaler)
        mask = None
        if latents.denoise_mask is not None:   # NearestMax: upsampling -> nearest
            mask = interpolate(latents.denoise_mask, up.shape[2], up.shape[3], "nearest")
        hl = replace(latents, init=up, denoise_mask=mask)
        t_b = time.time()
        out.append((cur, pipe.sample_one(cur, ctx_rng, smp_rng, hplan_s, guidance, hl, passes, bar, reseed=False)))
        log.info("hires sampling %d/%d completed, taking %.2fs", b + 1, len(results), time.time() - t_b)
    log.info("hires fix completed, taking %.2fs", time.time() - t0)
    return out, hplan_s
