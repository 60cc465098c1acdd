"""The image-generation pipeline: sd.cpp's `generate_image` for SD 1.x / 2.x / SDXL UNets.

One request (GenParams) on one context (a `Pipeline` over loaded weights):

1. size: -W/-H (or the init image's size) aligned up to a multiple of the VAE factor times the
   UNet's down factor (8 x 8 = 64), with a warning, as sd.cpp's GenerationRequest;
2. guidance: `img_cfg_scale` follows `cfg_scale` unless the model is an inpaint / pix2pix UNet;
   an unconditioned pass runs when cfg != 1, an image-conditioned pass when img_cfg != cfg;
3. the sample plan: sampler (euler_a for UNets), scheduler, sigmas (or `--sigmas`), eta;
   img2img keeps the last `int(steps * strength)` + 1 sigmas (sd.cpp's t_enc);
4. latents: zeros (txt2img) or the VAE encoding of the init image, sampled with the context
   RNG seeded with the request seed; the latent mask (the `--mask` image max-pooled to latent
   size); for 9-channel inpaint UNets the concat latent [mask, encoded masked image];
5. conditioning: prompt and negative prompt through the conditioner;
6. per image b (seed + b): reseed both RNGs, draw the noise, sample with CFG (cond, uncond and
   img-cond in one batched UNet call when their shapes agree), blending the denoised estimate
   with the init latent outside the mask after every model call (masked img2img);
7. decode: latent / scale + shift through the VAE (or TAESD), optionally tiled, to uint8 RGB.

The arithmetic mirrors sd.cpp's float32 tensor expressions term by term, so with the same model
outputs the latents match sd-cli's. Log lines and progress bars follow sd-cli's wording.
"""
from __future__ import annotations

import inspect
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..errors import SdrtError, UnsupportedError, UsageError
from .params import GenParams, ModelParams
from .limits import check_image, check_latent, quiet_numerics

__all__ = [
    "Cond",
    "GeneratedImage",
    "Pipeline",
    "ProgressBar",
    "align_size",
    "cfg_combine",
    "decode_to_uint8",
    "fit_image",
    "image_to_tensor",
    "img2img_sigmas",
    "latent_mask_from",
    "load_image",
]

log = logging.getLogger("sdrt")
F32 = np.float32
UNET_DOWN_FACTOR = 8
VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 4
INPAINT_VERSIONS = ("sd1_inpaint", "sd2_inpaint", "sdxl_inpaint")
EDIT_VERSIONS = ("sd1_pix2pix", "sdxl_pix2pix")
SUPPORTED_FAMILIES = ("sd1", "sd2", "sdxl")


@dataclass
class Cond:
    """One conditioning: cross-attention context [1, L, C], ADM vector y [1, adm] (SDXL) or None,
    concat latent [1, Cc, h, w] (inpaint / pix2pix) or None."""
    context: np.ndarray
    y: np.ndarray | None = None
    c_concat: np.ndarray | None = None


@dataclass
class GeneratedImage:
    """One result: `image` HxWx3 uint8 RGB, its `seed`, the sd-webui `parameters` infotext and the
    final latent [1, 4, h, w] (before the VAE)."""
    image: np.ndarray
    seed: int
    parameters: str = ""
    latent: np.ndarray | None = None
    info: dict = field(default_factory=dict)


# ---- small pure pieces (unit-tested) --------------------------------------------------------------

def align_size(width: int, height: int, multiple: int) -> tuple[int, int, bool]:
    """Round both sides up to `multiple` (sd.cpp's align_image_size); returns (w, h, changed)."""
    w = -(-width // multiple) * multiple
    h = -(-height // multiple) * multiple
    return w, h, (w, h) != (width, height)


def image_to_tensor(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """HxWxC uint8 -> [1, C, height, width] float32 in [0, 1], resized by nearest neighbour as
    sd.cpp's sd_image_to_tensor (source index = dst * src_size / dst_size, integer)."""
    a = np.asarray(img)
    if a.ndim == 2:
        a = a[:, :, None]
    t = a.astype(F32) / F32(255.0)
    H, W = t.shape[:2]
    if (W, H) != (width, height):
        iy = (np.arange(height) * H) // height
        ix = (np.arange(width) * W) // width
        t = t[iy[:, None], ix[None, :]]
    return np.ascontiguousarray(t.transpose(2, 0, 1)[None])


def latent_mask_from(mask: np.ndarray, factor: int) -> np.ndarray:
    """[1, 1, H, W] {0, 1} -> [1, 1, H/f, W/f], the max over each f x f window (sd.cpp's
    interpolate NearestMax when downsampling by an integer factor)."""
    n, c, H, W = mask.shape
    if H % factor or W % factor:
        raise UsageError(f"mask size {W}x{H} is not a multiple of the latent factor {factor}")
    return mask.reshape(n, c, H // factor, factor, W // factor, factor).max(axis=(3, 5))


def max_pool3(x: np.ndarray) -> np.ndarray:
    """3x3 max pool, stride 1, padding 1 (padding never wins), on [N, C, H, W]."""
    p = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    H, W = x.shape[2:]
    out = p[:, :, 0:H, 0:W].copy()
    for dy in range(3):
        for dx in range(3):
            np.maximum(out, p[:, :, dy:dy + H, dx:dx + W], out=out)
    return out


def load_image(src, flag: str, channels: int) -> np.ndarray:
    """An image as HxWxC uint8 (C = 3 RGB or 1 gray) from a path, a PIL image or an array.
    A missing or unreadable file is a UsageError naming the flag."""
    if isinstance(src, np.ndarray):
        a = src
        if a.dtype != np.uint8:
            raise UsageError(f"{flag}: image arrays must be uint8, got {a.dtype}")
        if a.ndim == 2:
            a = a[:, :, None]
        if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
            raise UsageError(f"{flag}: image arrays must be HxW, HxWx3 or HxWx4, got shape {a.shape}")
        if channels == 3:
            a = np.repeat(a, 3, 2) if a.shape[2] == 1 else a[:, :, :3]
        else:
            a = a[:, :, :1] if a.shape[2] == 1 else np.round(
                a[:, :, :3].astype(F32) @ np.array([0.299, 0.587, 0.114], F32))[:, :, None].astype(np.uint8)
        return np.ascontiguousarray(a)
    try:
        from PIL import Image
    except ImportError:
        raise UnsupportedError(f"{flag}: reading images needs Pillow (pip install pillow)") from None
    if isinstance(src, Image.Image):
        im = src
    else:
        import os
        path = os.fspath(src)
        if not os.path.isfile(path):
            raise UsageError(f"{flag}: no such image file: '{path}'")
        try:
            im = Image.open(path)
            im.load()
        except Exception as e:  # noqa: BLE001 - any decoder error is the file's fault
            raise UsageError(f"{flag}: cannot read image '{path}': {e}") from None
    a = np.asarray(im.convert("RGB" if channels == 3 else "L"), np.uint8)
    return np.ascontiguousarray(a if a.ndim == 3 else a[:, :, None])


def fit_image(a: np.ndarray, width: int, height: int) -> np.ndarray:
    """sd-cli's load-time fit to -W x -H: centre-crop to the target aspect, then resize (box
    filter; sd-cli uses stb_image_resize's box filter)."""
    H, W = a.shape[:2]
    if (W, H) == (width, height):
        return a
    dst, src = width / height, W / H
    x0 = y0 = 0
    cw, ch = W, H
    if src > dst:
        cw = int(H * dst)
        x0 = (W - cw) // 2
    elif src < dst:
        ch = int(W / dst)
        y0 = (H - ch) // 2
    if (x0, y0) != (0, 0):
        log.info("crop input image from %dx%d to %dx%d", W, H, cw, ch)
    a = a[y0:y0 + ch, x0:x0 + cw]
    log.info("resize input image from %dx%d to %dx%d", cw, ch, width, height)
    from PIL import Image
    im = Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)
    out = np.asarray(im.resize((width, height), Image.BOX), np.uint8)
    return np.ascontiguousarray(out if out.ndim == 3 else out[:, :, None])


def cfg_combine(cond, uncond=None, img_cond=None, cfg_scale=7.0, img_cfg_scale=7.0) -> np.ndarray:
    """sd.cpp's guidance: uncond + img_cfg (img_cond - uncond) + cfg (cond - img_cond) (3-way),
    uncond + cfg (cond - uncond), img_cond + cfg (cond - img_cond), or cond; float32, same order."""
    cfg, icfg = F32(cfg_scale), F32(img_cfg_scale)
    if uncond is not None:
        if img_cond is not None:
            return uncond + icfg * (img_cond - uncond) + cfg * (cond - img_cond)
        return uncond + cfg * (cond - uncond)
    if img_cond is not None:
        return img_cond + cfg * (cond - img_cond)
    return cond


def img2img_sigmas(sigmas: np.ndarray, steps: int, strength: float) -> tuple[np.ndarray, int]:
    """sd.cpp's img2img schedule: t_enc = int(steps * strength) (minus one when it is all of them);
    keep sigmas[steps - t_enc - 1:]. Returns (sigmas, t_enc). strength 1 keeps everything."""
    if strength >= 1.0:
        return sigmas, steps
    t_enc = int(F32(steps) * F32(strength))
    if t_enc == steps:
        t_enc -= 1
    return sigmas[steps - t_enc - 1:], t_enc


def decode_to_uint8(img01: np.ndarray) -> np.ndarray:
    """[1, 3, H, W] float in [0, 1] (values outside are clamped) -> HxWx3 uint8, as sd.cpp's
    preprocessing_float_to_u8: <= 0 -> 0, >= 1 -> 255, else (uint8)(v * 255 + 0.5)."""
    v = np.asarray(img01, F32)[0].transpose(1, 2, 0)
    out = (np.clip(v, 0.0, 1.0) * F32(255.0) + F32(0.5)).astype(np.uint8)
    out[v <= 0] = 0
    out[v >= 1] = 255
    return np.ascontiguousarray(out)


class ProgressBar:
    """sd.cpp's pretty_progress: `  |=====>    | 2/4 - 1.23s/it` on one line of stderr, or a
    callback(step, steps, seconds_per_step) instead."""

    def __init__(self, callback=None, stream=None, enabled=True):
        self.callback, self.stream, self.enabled = callback, stream, enabled

    def __call__(self, step: int, steps: int, per_step: float):
        if self.callback is not None:
            self.callback(step, steps, per_step)
            return
        if not self.enabled or step == 0:
            return
        stream = self.stream or sys.stderr
        width = 50
        pos = int(width * step / max(steps, 1))
        bar = "=" * pos + (">" if pos < width else "") + " " * max(width - pos - 1, 0)
        speed, unit = (1.0 / per_step, "it/s") if 0 < per_step < 1 else (per_step, "s/it")
        end = "\n" if step == steps else ""
        stream.write(f"\r  |{bar}| {step}/{steps} - {speed:.2f}{unit}\033[K{end}")
        stream.flush()


def _tile_bar(bar, t0):
    return lambda k, n: bar(k, n, (time.time() - t0) / max(k, 1))


def _kwargs_of(fn) -> set:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start tick against the boot
    clock, 10 ms resolution), or None where that is not available. The start-up log line uses it."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        import os
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# ---- the pipeline ----------------------------------------------------------------------------------

class Pipeline:
    """A generation context: weights + detected version + components, reused across requests.

    Build it with `Pipeline.load(ModelParams(...))` (from files), or `Pipeline(...)` with your own
    components (tests, other backends):
      unet(x [N,C,h,w], t [N], context [N,L,D], y [N,adm] | None, c_concat [N,Cc,h,w] | None) -> [N,4,h,w]
      vae: .decode(z [1,4,h,w]) -> [1,3,H,W] ~[-1,1]; .encode(img [1,3,H,W] in [-1,1]) -> moments [1,8,h,w]
      tae: .decode(z) -> [1,3,H,W] ~[0,1]; .encode(img in [0,1]) -> latent (used instead of vae)
      conditioner: .encode(prompt, width, height, clip_skip=-1, zero_out_masked=False) -> Cond-like
    """

    def __init__(self, *, version: str, prediction: str | None, unet=None, vae=None, tae=None, conditioner=None,
                 model_params: ModelParams | None = None, models=None, batch_cfg: bool = True):
        from ..io.detect import family
        self.version, self.family = version, family(version)
        if self.family not in SUPPORTED_FAMILIES:
            raise UnsupportedError(f"model version '{version}': sdrt generates images with SD 1.x, SD 2.x and "
                                   f"SDXL UNets only (for now)")
        self.model_params = model_params or ModelParams(model="")
        self.models = models
        self._unet, self._vae, self._tae, self._cond = unet, vae, tae, conditioner
        self.batch_cfg = batch_cfg
        self._prediction = prediction
        self._denoiser = None
        self.executors: dict = {}     # component -> backend its model runs on (absent: cpu); see load()

    # ---- construction from files ----------------------------------------------------------------
    @classmethod
    def load(cls, params: ModelParams) -> Pipeline:
        from .model_manager import load_models
        from .placement import check_devices
        params.validate()
        check_devices(params)
        t0 = time.time()
        models = load_models(params)
        pipe = cls(version=models.version, prediction=models.prediction, model_params=params, models=models)
        from .placement import component_sizes, resolve_placement
        from .residency import bind_components
        placement = resolve_placement(params, component_sizes(models.tensors))
        pipe.executors = bind_components(placement, models.tensors, prefetch=not params.disable_prefetch,
                                         segmented=not params.disable_segmented_compute)
        log.info("loading tensors completed, taking %.2fs (lazy: weights are read on first use)", time.time() - t0)
        return pipe

    @property
    def unet(self):
        if self._unet is None:
            from ..models.diffusion.unet import UNetModel
            from .model_manager import DM
            self._unet = UNetModel(self.models.tensors, DM, source=self.models.paths.get(
                "diffusion_model", self.models.paths.get("model", "model")))
        return self._unet

    @property
    def vae(self):
        if self._vae is None and self._tae is None:
            if self.models is not None and self.models.has_taesd:
                from ..models.vae.tae import TinyAutoencoder
                from .model_manager import TAE
                log.info("using TAE for encoding / decoding")
                self._tae = TinyAutoencoder.from_table(self.models.tensors, TAE, source=self.models.paths["taesd"])
            else:
                from ..models.vae.autoencoder_kl import AutoencoderKL
                from .model_manager import VAE
                if self.models is None or not self.models.has_vae:
                    raise SdrtError("no VAE: the checkpoint has no first_stage_model.* tensors; give --vae or --taesd")
                log.info("using VAE for encoding / decoding")
                self._vae = AutoencoderKL(self.models.tensors, VAE, source=self.models.paths.get(
                    "vae", self.models.paths.get("model", "vae")))
        return self._tae if self._tae is not None else self._vae

    @property
    def uses_tae(self) -> bool:
        self.vae  # noqa: B018 - resolves which one
        return self._tae is not None

    @property
    def conditioner(self):
        if self._cond is None:
            from .conditioning import build_conditioner
            self._cond = build_conditioner(self.models.tensors, self.version, embd_dir=self.model_params.embd_dir,
                                           backend=self.executors.get("te", "cpu"))
        return self._cond

    @property
    def prediction(self) -> str:
        if self._prediction is None:
            self._prediction = self._probe_sd2_prediction()
        return self._prediction

    @property
    def denoiser(self):
        if self._denoiser is None:
            from .denoisers import make_denoiser
            self._denoiser = make_denoiser(self.prediction)
            log.info("running in %s mode", {"eps": "eps-prediction", "v": "v-prediction",
                                            "edm_v": "v-prediction EDM"}.get(self.prediction, self.prediction))
        return self._denoiser

    def _probe_sd2_prediction(self) -> str:
        """sd.cpp's is_using_v_parameterization_for_sd2: one UNet call on constants;
        mean(out - x) < -1 means v-prediction."""
        t0 = time.time()
        x = np.full((1, 4, 8, 8), 0.5, F32)
        ctx = np.full((1, 2, 1024), 0.5, F32)
        cc = np.zeros((1, 5, 8, 8), F32) if self.version in INPAINT_VERSIONS else None
        out = self.unet(x, np.array([999.0], F32), ctx, None, cc, **self._on("diffusion"))
        v = float(np.mean((out - x).astype(F32), dtype=np.float64)) < -1
        log.debug("check is_using_v_parameterization_for_sd2, taking %.2fs", time.time() - t0)
        return "v" if v else "eps"

    # ---- one request ----------------------------------------------------------------------------
    @quiet_numerics
    def generate(self, gp: GenParams, *, progress=None, decode_progress=None, show_progress: bool = True,
                 rng: str | None = None, sampler_rng: str | None = None) -> list[GeneratedImage]:
        """Run one request; returns `batch_count` images. `progress(step, steps, s_per_step)`
        replaces the stderr bar; raising from it cancels the run (the exception propagates).
        `decode_progress(tile, tiles)` reports a tiled VAE decode (default: a bar like sampling's).
        `rng` / `sampler_rng` override the context's --rng / --sampler-rng for this request."""
        from .rng import make_rng
        from .samplers import (
            SAMPLERS,
            default_sample_method,
            default_scheduler,
            resolve_eta,
            sample,
        )
        from .schedulers import SCHEDULER_ALIASES, get_sigmas
        gp.validate()
        t_start = time.time()
        mp = self.model_params
        if rng is not None or sampler_rng is not None:
            from dataclasses import replace
            mp = replace(mp, rng=rng or mp.rng, sampler_rng=sampler_rng if sampler_rng is not None else mp.sampler_rng)
            mp.validate_rngs()
        # images first: a bad path fails before any compute
        init_img = mask_img = None
        if gp.init_image is not None:
            init_img = load_image(gp.init_image, "-i/--init-img", 3)
            if gp.mask_image is not None:
                mask_img = load_image(gp.mask_image, "--mask", 1)
                if mask_img.shape[:2] != init_img.shape[:2]:
                    raise UsageError(f"--mask: the mask is {mask_img.shape[1]}x{mask_img.shape[0]}, the init image "
                                     f"{init_img.shape[1]}x{init_img.shape[0]}; they must be the same size")
            if gp.width > 0 and gp.height > 0:
                init_img = fit_image(init_img, gp.width, gp.height)
                mask_img = None if mask_img is None else fit_image(mask_img, gp.width, gp.height)
            else:
                gp = gp.replace(width=init_img.shape[1], height=init_img.shape[0])
                log.info("set width x height to %d x %d", gp.width, gp.height)
        meta_w, meta_h = gp.resolved_size()
        mult = VAE_SCALE_FACTOR * UNET_DOWN_FACTOR
        width, height, changed = align_size(meta_w, meta_h, mult)
        if changed:
            log.warning("align generation request up %dx%d to %dx%d (multiple=%d)", meta_w, meta_h, width, height,
                        mult)
        seed = gp.resolved_seed()
        log.info("generate_image %dx%d", width, height)
        # guidance (sd.cpp resolve_guidance)
        cfg = F32(gp.cfg_scale)
        icfg = F32(gp.img_cfg_scale) if math.isfinite(gp.img_cfg_scale) else cfg
        if self.version not in INPAINT_VERSIONS + EDIT_VERSIONS:
            icfg = cfg
        use_uncond = cfg != 1
        use_img_cond = icfg != cfg
        use_uncond = use_uncond or use_img_cond
        if cfg < 1:
            log.warning("unconditioned mode, images won't follow the prompt (use cfg-scale=1 for distilled models)"
                        if cfg == 0 else "cfg value out of expected range may produce unexpected results")
        # RNGs: one context RNG, the sampler's own only when --sampler-rng differs
        ctx_rng = make_rng(mp.rng, seed)
        smp_rng = make_rng(mp.sampler_rng, seed) if mp.sampler_rng and mp.sampler_rng != mp.rng else ctx_rng
        # sample plan
        den = self.denoiser
        method = gp.sampling_method or default_sample_method(self.family)
        scheduler = SCHEDULER_ALIASES.get(gp.scheduler, gp.scheduler) or default_scheduler(
            method, self.family, self.prediction)
        if gp.sigmas is not None:
            sigmas = np.asarray(gp.sigmas, F32)
            steps = len(sigmas) - 1
        else:
            steps = gp.steps
            sigmas = get_sigmas(den, steps, scheduler, version=self.family,
                                image_seq_len=(height // VAE_SCALE_FACTOR) * (width // VAE_SCALE_FACTOR))
        eta = resolve_eta(None if not math.isfinite(gp.eta) else gp.eta, method)
        log.info("sampling using %s method", SAMPLERS[method].label)
        # latents
        t_prep = time.time()
        h, w = height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR
        init_t = None
        if init_img is not None:
            log.info("IMG2IMG")
            sigmas, t_enc = img2img_sigmas(sigmas, len(sigmas) - 1, gp.strength)
            if gp.strength < 1.0:
                log.info("target t_enc is %d steps", t_enc)
            init_t = image_to_tensor(init_img, width, height)
        if mask_img is not None:
            mask_t = np.round(image_to_tensor(mask_img, width, height)[:, :1])
        else:
            mask_t = np.ones((1, 1, height, width), F32)
        latent_mask = latent_mask_from(mask_t, VAE_SCALE_FACTOR)
        if init_t is None:
            init_latent = np.zeros((1, LATENT_CHANNELS, h, w), F32)
        else:
            init_latent = self.encode_first_stage(init_t, ctx_rng, gp)
        concat = uncond_concat = None
        if self.version in INPAINT_VERSIONS:
            if init_t is not None:
                masked = (F32(1.0) - mask_t) * (init_t - F32(0.5)) + F32(0.5)
                masked_latent = self.encode_first_stage(masked, ctx_rng, gp)
            else:
                log.warning("inpainting model requires both an init image and a mask image.")
                masked_latent = np.zeros_like(init_latent)
            concat = np.concatenate([latent_mask, masked_latent], axis=1)
            uncond_concat = np.concatenate([latent_mask, np.zeros_like(masked_latent)], axis=1)
        elif self.version in EDIT_VERSIONS:
            # sd.cpp without -r: an empty (black) reference, and img_cfg falls back to cfg (the
            # img-cond pass decided earlier still runs, as in sd.cpp)
            log.warning("This model needs at least one reference image; using an empty reference")
            concat = self.encode_first_stage(np.zeros((1, 3, height, width), F32), ctx_rng, gp)
            uncond_concat = np.zeros_like(concat)
            icfg = cfg
        if init_t is not None:
            log.info("encode_first_stage completed, taking %.2fs", time.time() - t_prep)
        denoise_mask = max_pool3(latent_mask) if self.version in INPAINT_VERSIONS else latent_mask
        if np.all(denoise_mask == 1):
            denoise_mask = None   # all-ones: sd.cpp's blend is an exact no-op
        # conditioning
        t_cond = time.time()
        cond, uncond = self._conditions(gp, width, height, use_uncond)
        cond.c_concat, img_cond = concat, None
        if uncond is not None:
            uncond.c_concat = uncond_concat
            if use_img_cond:
                img_cond = Cond(uncond.context, uncond.y, concat)
        log.info("get_learned_condition completed, taking %.2fs", time.time() - t_cond)
        self.release_weight_pages("te", "vae")
        # sampling, one image per seed
        bar = ProgressBar(progress, enabled=show_progress and log.isEnabledFor(logging.INFO))
        results, t_denoise = [], time.time()
        for b in range(gp.batch_count):
            cur = seed + b
            log.info("generating image: %d/%d - seed %d", b + 1, gp.batch_count, cur)
            t_b = time.time()
            ctx_rng.manual_seed(cur)
            if smp_rng is not ctx_rng:
                smp_rng.manual_seed(cur)
            noise = ctx_rng.randn(init_latent.shape)
            x = den.noise_scaling(sigmas[0], noise, init_latent)
            denoise = self._denoise_fn(den, cond, uncond, img_cond, cfg, icfg, init_latent, denoise_mask,
                                       len(sigmas) - 1, bar)
            if b == 0:  # start-up cost (README "Start-up"): imports, kernel cache, tokenizer, text encoder
                age = process_age()
                log.info("first sampling step after %s (%.2fs CPU)",
                         "?" if age is None else f"{age:.2f}s since process start", time.process_time())
            x0 = sample(method, denoise, x, sigmas, smp_rng, eta=eta, is_flow=den.is_flow)
            x0 = den.inverse_noise_scaling(sigmas[-1], x0)
            check_latent(x0, cur)  # NaN/Inf: stop with a clear error, never a black image
            log.info("sampling completed, taking %.2fs", time.time() - t_b)
            results.append((cur, np.asarray(x0, F32)))
        log.info("generating %d latent images completed, taking %.2fs", len(results), time.time() - t_denoise)
        self.release_weight_pages("diffusion")
        # decode
        log.info("decoding %d latents", len(results))
        t_dec, out = time.time(), []
        for i, (cur, lat) in enumerate(results):
            t_i = time.time()
            dec_progress = decode_progress
            if dec_progress is None and gp.vae_tiling and bar.enabled:
                dec_progress = _tile_bar(bar, time.time())
            img = self.decode_first_stage(lat, gp, dec_progress)
            log.info("latent %d decoded, taking %.2fs", i + 1, time.time() - t_i)
            info = {"width": meta_w, "height": meta_h, "method": method, "scheduler": scheduler, "seed": cur, "eta": eta}
            out.append(GeneratedImage(img, cur, self.parameters_text(gp, cur, meta_w, meta_h, method, scheduler, mp),
                                      lat, info))
        log.info("decode_first_stage completed, taking %.2fs", time.time() - t_dec)
        self.release_weight_pages("vae")
        log.info("generate_image completed in %.2fs", time.time() - t_start)
        return out

    # ---- pieces ---------------------------------------------------------------------------------
    def release_weight_pages(self, *components: str) -> int:
        """Drop this process's pages of the memory-mapped weights of `components` ("te",
        "diffusion", "vae") computing on the CPU, once a request is done with them; returns the
        bytes covered. They are clean file pages, read again from the page cache on next use
        (~0.2 s for SD1.5's 1.7 GB UNet), while keeping the UNet's pages through the VAE decode put
        a 512x512 SD1.5 run ~0.7 GB above sd-cli's peak RSS (bench/bench_memory.py)."""
        if self.models is None:
            return 0
        from ..ops.tensor import Tensor
        from .placement import classify_tensor
        from .residency import release_file_pages
        want = {c for c in components if self.executors.get(c, "cpu") == "cpu"}
        done, total = set(), 0
        for name, t in self.models.tensors.items():
            o = t.owner
            if id(o) in done or classify_tensor(name) not in want:
                continue
            done.add(id(o))
            st = Tensor.storage.__get__(o)   # the raw slot: never fills a lazily converted leaf
            if st is not None and release_file_pages(st, o.offset, o.span_bytes()):
                total += o.span_bytes()
        return total

    def _conditions(self, gp: GenParams, width: int, height: int, use_uncond: bool):
        enc = self.conditioner.encode
        accepts = _kwargs_of(enc)

        def run(text, zero_out):
            kw = {"clip_skip": gp.clip_skip}
            if "zero_out_masked" in accepts:
                kw["zero_out_masked"] = zero_out
            c = enc(text, width, height, **kw)
            return Cond(np.asarray(c.context, F32), None if getattr(c, "y", None) is None else np.asarray(c.y, F32))

        cond = run(gp.prompt, False)
        uncond = None
        if use_uncond:
            zero_out = self.family == "sdxl" and not gp.negative_prompt and self.prediction != "edm_v"
            uncond = run(gp.negative_prompt, zero_out)
        return cond, uncond

    def _denoise_fn(self, den, cond, uncond, img_cond, cfg, icfg, init_latent, denoise_mask, steps, bar):
        """sd.cpp's denoise lambda: scalings, timestep, the UNet passes, CFG, the mask blend."""
        from .samplers import Guided
        passes = [c for c in (cond, uncond, img_cond) if c is not None]
        t0 = time.time()

        def denoise(x, sigma, step):
            c_skip, c_out, c_in = den.get_scalings(sigma)
            t = F32(den.sigma_to_t(sigma))
            noised = (x * c_in).astype(F32)
            outs = self._run_unet(noised, t, passes)
            res = dict(zip([id(c) for c in passes], outs))
            c_o = res[id(cond)]
            u_o = res.get(id(uncond)) if uncond is not None else None
            i_o = res.get(id(img_cond)) if img_cond is not None else None
            guided = cfg_combine(c_o, u_o, i_o, cfg, icfg)
            denoised = guided * c_out + x * c_skip
            pred_uncond = None if u_o is None else u_o * c_out + x * c_skip
            if denoise_mask is not None:
                denoised = denoised * denoise_mask + init_latent * (F32(1.0) - denoise_mask)
            if step > 0 or step == -steps:
                k = abs(step)
                bar(k, steps, (time.time() - t0) / k)
            return Guided(denoised.astype(F32), pred_uncond)

        return denoise

    def _run_unet(self, x: np.ndarray, t, passes: list[Cond]) -> list[np.ndarray]:
        """The UNet outputs for each conditioning; one batched call (N = len(passes)) when the
        contexts, ADM vectors and concat latents have equal shapes, else one call each."""
        unet = self.unet
        tt = np.full((1,), t, F32)

        def shape(c):
            return (c.context.shape, None if c.y is None else c.y.shape,
                    None if c.c_concat is None else c.c_concat.shape)

        if self.batch_cfg and len(passes) > 1 and len({shape(c) for c in passes}) == 1:
            n = len(passes)
            ctx = np.concatenate([c.context for c in passes], 0)
            y = None if passes[0].y is None else np.concatenate([c.y for c in passes], 0)
            cc = None if passes[0].c_concat is None else np.concatenate([c.c_concat for c in passes], 0)
            out = unet(np.concatenate([x] * n, 0), np.repeat(tt, n), ctx, y, cc, **self._on("diffusion"))
            return [np.asarray(out[i:i + 1], F32) for i in range(n)]
        return [np.asarray(unet(x, tt, c.context, c.y, c.c_concat, **self._on("diffusion")), F32) for c in passes]

    def _on(self, component: str) -> dict:
        """backend= for a component's model call (nothing for cpu: custom components need not take it)."""
        be = self.executors.get(component, "cpu")
        return {} if be == "cpu" else {"backend": be}

    def _latent_scale(self):
        from ..models.vae.autoencoder_kl import latent_scale_shift
        s, sh = latent_scale_shift(self.family)
        return F32(s), F32(sh)

    def _tiling(self, gp: GenParams, lat_w: int, lat_h: int, encode: bool):
        from .vae_tiling import ENCODE_TILE_FACTOR, TilingParams, vae_tile_sizes
        p = TilingParams(gp.vae_tile_size[0], gp.vae_tile_size[1], gp.vae_tile_overlap,
                         gp.vae_relative_tile_size[0], gp.vae_relative_tile_size[1])
        tx, ty, ov = vae_tile_sizes(p, lat_w, lat_h, ENCODE_TILE_FACTOR if encode else 1.0)
        log.debug("VAE Tile size: %dx%d", tx, ty)
        return (tx, ty), ov

    def encode_first_stage(self, img01: np.ndarray, rng, gp: GenParams) -> np.ndarray:
        """[1, 3, H, W] in [0, 1] -> diffusion latent (sd.cpp encode_first_stage): VAE moments
        sampled with the context RNG, then (z - shift) * scale; TAE: the latent as is; SD 1.x
        instruct-pix2pix: the mean, unscaled (sd.cpp's VERSION_SD1_PIX2PIX special case)."""
        from ..models.vae.autoencoder_kl import gaussian_sample
        model = self.vae
        tae = self._tae is not None
        x = img01 if tae else (img01 * F32(2.0) - F32(1.0)).astype(F32)
        if gp.vae_tiling:
            size, ov = self._tiling(gp, x.shape[3] // VAE_SCALE_FACTOR, x.shape[2] // VAE_SCALE_FACTOR, True)
            from .vae_tiling import tiled_apply
            out = tiled_apply(partial(model.encode, **self._on("vae")), x, -VAE_SCALE_FACTOR, size, ov)
        else:
            out = model.encode(x, **self._on("vae"))
        out = np.asarray(out, F32)
        if tae:
            return out
        if self.version == "sd1_pix2pix":
            return gaussian_sample(out)
        C = out.shape[1] // 2
        lat = gaussian_sample(out, rng.randn((out.shape[0], C) + out.shape[2:]))
        scale, shift = self._latent_scale()
        return ((lat - shift) * scale).astype(F32)

    def decode_first_stage(self, latent: np.ndarray, gp: GenParams, progress=None) -> np.ndarray:
        """Diffusion latent [1, 4, h, w] -> HxWx3 uint8 (sd.cpp decode_first_stage + tensor_to_sd_image)."""
        model = self.vae
        tae = self._tae is not None
        if tae:
            z = latent
        else:
            scale, shift = self._latent_scale()
            z = (latent / scale + shift).astype(F32)
        if gp.vae_tiling:
            from .vae_tiling import tiled_apply
            size, ov = self._tiling(gp, z.shape[3], z.shape[2], False)
            img = tiled_apply(partial(model.decode, **self._on("vae")), z, VAE_SCALE_FACTOR, size, ov,
                              progress=progress)
        else:
            img = model.decode(z, **self._on("vae"))
        img = np.asarray(img, F32)
        if not tae:
            img = np.clip((img + F32(1.0)) * F32(0.5), F32(0.0), F32(1.0))
        check_image(img)
        return decode_to_uint8(img)

    def parameters_text(self, gp: GenParams, seed: int, width: int, height: int, method: str,
                        scheduler: str | None, mp: ModelParams | None = None) -> str:
        from ..io.png import parameters_text
        mp = mp or self.model_params
        return parameters_text(
            prompt=gp.prompt, negative_prompt=gp.negative_prompt, steps=gp.steps, cfg_scale=gp.cfg_scale,
            guidance=gp.guidance, eta=gp.eta, seed=seed, width=width, height=height, model=mp.model or "",
            rng=mp.rng, sampler_rng=mp.sampler_rng, method=method, scheduler=scheduler, sigmas=gp.sigmas,
            clip_l=mp.clip_l or "", clip_g=mp.clip_g or "", diffusion_model=mp.diffusion_model or "",
            vae=mp.vae or "", taesd=mp.taesd or "", clip_skip=gp.clip_skip, img_cfg_scale=gp.img_cfg_scale,
            strength=gp.strength,
            vae_tiling={"enabled": True, "tile_size_x": int(gp.vae_tile_size[0]), "tile_size_y": int(gp.vae_tile_size[1]),
                            "target_overlap": float(gp.vae_tile_overlap), "rel_size_x": float(gp.vae_relative_tile_size[0]),
                            "rel_size_y": float(gp.vae_relative_tile_size[1])} if gp.vae_tiling else None)
