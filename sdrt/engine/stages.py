"""The stages of one generation request, as small records and pure functions (each unit-tested):

1. `plan_size`: the images (a bad path fails before any compute), -W/-H or the init image's size
   aligned up to the family's size multiple (8 x 8 = 64 for the UNets), the seed;
2. `plan_guidance`: cfg, img_cfg and which passes run (uncond when cfg != 1, img-cond when
   img_cfg != cfg; img_cfg follows cfg unless the variant takes concat latents);
3. `plan_sampling`: sampler (the family's default), scheduler, sigmas (or `--sigmas`), eta;
   img2img keeps the last `int(steps * strength)` + 1 sigmas (sd.cpp's t_enc);
4. `prepare_latents`: zeros (txt2img) or the encoded init image, the latent mask, the variant's
   concat latents (inpaint, instruct-pix2pix), the denoise mask;
then the Pipeline runs 5. conditioning, 6. sampling per seed and 7. decoding (pipeline.py).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import UnsupportedError, UsageError
from .params import GenParams

__all__ = ["GuidancePlan", "Latents", "SamplePlan", "SizePlan", "align_size", "cfg_combine", "decode_to_uint8",
           "fit_image", "image_to_tensor", "img2img_sigmas", "latent_mask_from", "load_image", "max_pool3",
           "plan_guidance", "plan_sampling", "plan_size", "prepare_latents", "ref_image_size"]

log = logging.getLogger("sdrt")
F32 = np.float32


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


def ref_image_size(ref_w: int, ref_h: int, width: int, height: int, max_pixels: int = 1024 * 1024,
                   multiple: int = 16) -> tuple[int, int]:
    """sd.cpp's resize of a reference image before the VAE (resize_before_vae): the generation's
    area (at most max_pixels), the reference's aspect, each side rounded to a multiple of
    `multiple` (16; Qwen-Image 32)."""
    m = multiple
    area = min(max_pixels, width * height)
    vw = math.sqrt(area * ref_w // ref_h)          # sd.cpp divides integers before the sqrt
    vh = vw * ref_h / ref_w
    return max(m, math.floor(vw / m + 0.5) * m), max(m, math.floor(vh / m + 0.5) * m)   # C round()


def decode_to_uint8(img01: np.ndarray) -> np.ndarray:
    """[1, 3, H, W] float in [0, 1] (values outside are clamped) -> HxWx3 uint8, as sd.cpp's
    preprocessing_float_to_u8: <= 0 -> 0, >= 1 -> 255, else (uint8)(v * 255 + 0.5)."""
    v = np.asarray(img01, F32)[0].transpose(1, 2, 0)
    out = (np.clip(v, 0.0, 1.0) * F32(255.0) + F32(0.5)).astype(np.uint8)
    out[v <= 0] = 0
    out[v >= 1] = 255
    return np.ascontiguousarray(out)


# ---- the stages --------------------------------------------------------------------------------------

@dataclass
class SizePlan:
    """Stage 1. `gp` with width/height filled from the init image when unset; `width`/`height`
    the aligned generation size, `meta_w`/`meta_h` the requested one (for the infotext)."""
    gp: GenParams
    width: int
    height: int
    meta_w: int
    meta_h: int
    seed: int
    init_img: np.ndarray | None = None
    mask_img: np.ndarray | None = None


def plan_size(gp: GenParams, family) -> SizePlan:
    """Read the init / mask images and fix the generation size (sd.cpp's GenerationRequest)."""
    init_img = mask_img = None
    if gp.init_image is not None:
        if not family.supports("img2img"):
            raise UnsupportedError(f"-i/--init-img: {family.description or family.name} models do not take an init image")
        init_img = load_image(gp.init_image, "-i/--init-img", 3)
        if gp.mask_image is not None:
            if not family.supports("inpaint"):
                raise UnsupportedError(f"--mask: {family.description or family.name} models do not inpaint")
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
    mult = family.size_multiple
    width, height, changed = align_size(meta_w, meta_h, mult)
    if changed:
        log.warning("align generation request up %dx%d to %dx%d (multiple=%d)", meta_w, meta_h, width, height, mult)
    return SizePlan(gp, width, height, meta_w, meta_h, gp.resolved_seed(), init_img, mask_img)


@dataclass
class GuidancePlan:
    """Stage 2. The scales (float32) and the passes each model call runs."""
    cfg: np.float32
    img_cfg: np.float32
    use_uncond: bool
    use_img_cond: bool
    slg_scale: np.float32 = np.float32(0.0)   # skip-layer guidance (sd.cpp's slg); 0 or no layers: off
    skip_layers: tuple = ()
    slg_start: float = 0.01
    slg_end: float = 0.2

    def slg_active(self, step: int, n_sigmas: int) -> bool:
        """sd.cpp's is_skiplayer_step: step (1-based; negative for a sampler's extra calls) with
        int(start * n_sigmas) < step < int(end * n_sigmas), products in float32 as sd.cpp's."""
        if not self.skip_layers or self.slg_scale == 0:
            return False
        n = np.float32(n_sigmas)
        return int(np.float32(self.slg_start) * n) < step < int(np.float32(self.slg_end) * n)


def plan_guidance(gp: GenParams, variant) -> GuidancePlan:
    """sd.cpp's resolve_guidance: img_cfg follows cfg unless the variant takes concat latents
    (inpaint / instruct-pix2pix); an unconditioned pass when cfg != 1, an image-conditioned one
    when img_cfg != cfg (which needs the unconditioned one too)."""
    cfg = F32(gp.cfg_scale)
    icfg = F32(gp.img_cfg_scale) if math.isfinite(gp.img_cfg_scale) else cfg
    if variant.concat is None:
        icfg = cfg
    use_img_cond = bool(icfg != cfg)
    use_uncond = bool(cfg != 1) or use_img_cond
    if cfg < 1:
        log.warning("unconditioned mode, images won't follow the prompt (use cfg-scale=1 for distilled models)"
                    if cfg == 0 else "cfg value out of expected range may produce unexpected results")
    return GuidancePlan(cfg, icfg, use_uncond, use_img_cond, F32(gp.slg_scale), tuple(int(i) for i in gp.skip_layers),
                        float(gp.skip_layer_start), float(gp.skip_layer_end))


@dataclass
class SamplePlan:
    """Stage 3. `sigmas` already cut for img2img; `t_enc` the img2img step count (None: txt2img)."""
    method: str
    scheduler: str | None
    sigmas: np.ndarray
    eta: float
    t_enc: int | None = None

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1


def plan_sampling(gp: GenParams, family, prediction: str, denoiser, width: int, height: int,
                  img2img: bool) -> SamplePlan:
    """Sampler, scheduler, sigmas and eta (sd.cpp's defaults come from the family)."""
    from .samplers import SAMPLERS, resolve_eta, scheduler_for
    from .schedulers import SCHEDULER_ALIASES, get_sigmas
    method = gp.sampling_method or family.default_sampler
    scheduler = SCHEDULER_ALIASES.get(gp.scheduler, gp.scheduler) or scheduler_for(method, prediction,
                                                                                    family.default_scheduler)
    if gp.sigmas is not None:
        sigmas = np.asarray(gp.sigmas, F32)
    else:
        f = family.vae_scale_factor
        sigmas = get_sigmas(denoiser, gp.steps, scheduler, family=family.name,
                            image_seq_len=(height // f) * (width // f))
    if math.isfinite(gp.eta) or family.default_eta is None:
        eta = resolve_eta(None if not math.isfinite(gp.eta) else gp.eta, method)
    else:
        eta = family.default_eta
    log.info("sampling using %s method", SAMPLERS[method].label)
    t_enc = None
    if img2img:
        log.info("IMG2IMG")
        sigmas, t_enc = img2img_sigmas(sigmas, len(sigmas) - 1, gp.strength)
        if gp.strength < 1.0:
            log.info("target t_enc is %d steps", t_enc)
    return SamplePlan(method, scheduler, sigmas, eta, t_enc)


@dataclass
class Latents:
    """Stage 4. `init` [1, C, h, w] (zeros for txt2img); `concat` / `uncond_concat` the variant's
    concat latents (None without); `denoise_mask` [1, 1, h, w] or None (all ones: no blend);
    `img_cfg_follows_cfg`: the variant had no reference image (sd.cpp then guides with cfg)."""
    init: np.ndarray
    concat: np.ndarray | None = None
    uncond_concat: np.ndarray | None = None
    denoise_mask: np.ndarray | None = None
    img_cfg_follows_cfg: bool = False
    ref_latents: list = field(default_factory=list)   # -r/--ref-image latents (Flux Kontext)
    ref_pixels: list = field(default_factory=list)    # the -r images as loaded (HxWx3 uint8), for conditioners


def prepare_latents(size: SizePlan, family, variant, encode) -> Latents:
    """The init latent, masks and concat latents; `encode(img01 [1, 3, H, W]) -> latent` is the
    VAE encode (it draws from the context RNG: the call order is sd.cpp's)."""
    width, height, f = size.width, size.height, family.vae_scale_factor
    init_t = None if size.init_img is None else image_to_tensor(size.init_img, width, height)
    if size.mask_img is not None:
        mask_t = np.round(image_to_tensor(size.mask_img, width, height)[:, :1])
    else:
        mask_t = np.ones((1, 1, height, width), F32)
    latent_mask = latent_mask_from(mask_t, f)
    if init_t is None:
        init = np.zeros((1, family.latent_channels, height // f, width // f), F32)
    else:
        init = encode(init_t)
    out = Latents(init)
    dilate = False
    if variant.concat is not None:
        c = family.concat_builders[variant.concat](encode, init_t, mask_t, latent_mask, init, width, height)
        out.concat, out.uncond_concat, out.img_cfg_follows_cfg = c.cond, c.uncond, c.img_cfg_follows_cfg
        dilate = c.dilate_mask
    denoise_mask = max_pool3(latent_mask) if dilate else latent_mask
    out.denoise_mask = None if np.all(denoise_mask == 1) else denoise_mask  # all ones: sd.cpp's blend is a no-op
    return out
