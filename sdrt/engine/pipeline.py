"""The image-generation pipeline: sd.cpp's `generate_image`, for every runnable model family.

One request (GenParams) on one context (a `Pipeline` over loaded weights) runs in named stages
(sdrt.engine.stages has the records and the pure ones):
1. size, 2. guidance plan, 3. sample plan, 4. latents and masks (stages.py);
5. conditioning: prompt and negative prompt through the family's conditioner, into `Cond`
   records with the concat latents (and distilled guidance where the family has it);
6. sampling per seed (seed + b): reseed both RNGs, draw the noise, sample with CFG (cond, uncond
   and img-cond in one batched model call when their shapes agree), blending the denoised
   estimate with the init latent outside the mask after every model call (masked img2img);
7. decoding: latent / scale + shift through the VAE (or TAESD), optionally tiled, to uint8 RGB.

Everything family-specific (latent channels, size multiple, VAE scale, sampler defaults, concat
latents, the diffusion model and conditioner) comes from the family's record
(sdrt.models.families); this file names no family. The arithmetic mirrors sd.cpp's float32
tensor expressions term by term, so with the same model outputs the latents match sd-cli's.
Log lines and progress bars follow sd-cli's wording.
"""
from __future__ import annotations

import inspect
import logging
import math
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from ..errors import SdrtError, UnsupportedError
from ..models.families import Cond, Family, family_of
from .limits import check_image, check_latent, quiet_numerics
from .params import GenParams, ModelParams
from .stage_weights import StageWeights
from .stages import (  # noqa: F401 - the pure pieces are part of this module's API
    GuidancePlan,
    Latents,
    SamplePlan,
    SizePlan,
    align_size,
    cfg_combine,
    decode_to_uint8,
    fit_image,
    image_to_tensor,
    img2img_sigmas,
    latent_mask_from,
    load_image,
    max_pool3,
    plan_guidance,
    plan_sampling,
    plan_size,
    prepare_latents,
)

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


@dataclass
class GeneratedImage:
    """One result: `image` HxWx3 uint8 RGB, its `seed`, the sd-webui `parameters` infotext and the
    final latent [1, C, h, w] (before the VAE)."""
    image: np.ndarray
    seed: int
    parameters: str = ""
    latent: np.ndarray | None = None
    info: dict = field(default_factory=dict)


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

class Pipeline(StageWeights):
    """A generation context: weights + detected version + components, reused across requests.

    Build it with `Pipeline.load(ModelParams(...))` (from files), or `Pipeline(...)` with your own
    components (tests, other backends):
      diffusion_model: .predict(x [N,C,h,w], t [N], cond: Cond, backend=) -> [N,C,h,w]; or a plain
          callable (x, t, context, y, c_concat) -> out (`unet=` is the same argument's old name)
      vae: .decode(z [1,C,h,w]) -> [1,3,H,W] ~[-1,1]; .encode(img [1,3,H,W] in [-1,1]) -> moments [1,2C,h,w]
      tae: .decode(z) -> [1,3,H,W] ~[0,1]; .encode(img in [0,1]) -> latent (used instead of vae)
      conditioner: .encode(prompt, width, height, clip_skip=-1, zero_out_masked=False) -> Cond-like
      controlnet: .hint(img [1,3,H,W] in [0,1]) -> guided hint; (x, hint, t, context, y) -> controls
          (sdrt.models.diffusion.controlnet; the diffusion model's predict then takes controls=)
    `version` is a detected version ("sd1_inpaint"); `family` its Family record.
    """

    def __init__(self, *, version: str, prediction: str | None, diffusion_model=None, unet=None, vae=None, tae=None,
                 conditioner=None, model_params: ModelParams | None = None, models=None, batch_cfg: bool = True,
                 controlnet=None):
        self.version = version
        self.family: Family = family_of(version)
        self.family.check_runnable(version)
        self.variant = self.family.variant(version)
        self.model_params = model_params or ModelParams(model="")
        self.models = models
        self._unet = diffusion_model if diffusion_model is not None else unet   # the diffusion model slot
        self._vae, self._tae, self._cond = vae, tae, conditioner
        self._controlnet = controlnet  # a ControlNetModel (--control-net); built from the table when None
        self.batch_cfg = batch_cfg
        self._prediction = prediction
        self._denoiser = None
        self.executors: dict = {}     # component -> backend its model runs on (absent: cpu); see load()
        self._loras = None            # sdrt.engine.lora.LoraState once a generation asks for LoRAs
        self._upscaler = None         # ((path, tile size), Upscaler) of --upscale-model, kept across requests
        # one request and done (the CLI): each stage's GPU weights and buffers are freed when the
        # stage ends (release_device_stage), so the process peak is the largest stage, not the sum
        self.one_shot = False

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
    def diffusion_model(self):
        if self._unet is None:
            from .model_manager import DM
            build = self.family.diffusion_model
            kw = {"model_args": self.model_params.model_args} if "model_args" in _kwargs_of(build) else {}
            self._unet = build(self.models.tensors, DM, self.models.paths.get(
                "diffusion_model", self.models.paths.get("model", "model")), **kw)
        return self._unet

    unet = diffusion_model   # the old name (tests and tools reach the UNet through it)

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
                build = self.family.vae or (lambda t, p, source: AutoencoderKL(t, p, source=source))
                self._vae = build(self.models.tensors, VAE, source=self.models.paths.get(
                    "vae", self.models.paths.get("model", "vae")))
        return self._tae if self._tae is not None else self._vae

    @property
    def uses_tae(self) -> bool:
        self.vae  # noqa: B018 - resolves which one
        return self._tae is not None

    @property
    def conditioner(self):
        if self._cond is None:
            from .conditioning import open_tensors
            takes_args = "model_args" in _kwargs_of(self.family.conditioner)
            kw = {"model_args": self.model_params.model_args} if takes_args else {}
            self._cond = self.family.conditioner(self.models.tensors, self.version, self.model_params.embd_dir,
                                                 backend=self.executors.get("te", "cpu"), open_file=open_tensors, **kw)
        return self._cond

    @property
    def controlnet(self):
        """The --control-net model (None without one)."""
        if self._controlnet is None and self.models is not None and "control_net" in self.models.paths:
            from ..models.diffusion.controlnet import PREFIX, ControlNetModel
            self._controlnet = ControlNetModel(self.models.tensors, PREFIX, source=self.models.paths["control_net"])
        return self._controlnet

    @property
    def prediction(self) -> str:
        if self._prediction is None:
            if self.family.probe_prediction is None:
                raise SdrtError(f"model version '{self.version}': the prediction type is unknown; give --prediction")
            t0 = time.time()
            self._prediction = self.family.probe_prediction(self.diffusion_model, self.version, self._predict)
            log.debug("check is_using_v_parameterization_for_sd2, taking %.2fs", time.time() - t0)
        return self._prediction

    @property
    def denoiser(self):
        if self._denoiser is None:
            from .denoisers import make_denoiser
            shift = self.family.flow_shift_of(self.version, self.models.tensors if self.models else None)
            self._denoiser = make_denoiser(self.prediction, flow_shift=shift)
            log.info("running in %s mode", {"eps": "eps-prediction", "v": "v-prediction",
                                            "edm_v": "v-prediction EDM"}.get(self.prediction, self.prediction))
        return self._denoiser

    # ---- one request ----------------------------------------------------------------------------
    @quiet_numerics
    def generate(self, gp: GenParams, *, progress=None, decode_progress=None, show_progress: bool = True,
                 rng: str | None = None, sampler_rng: str | None = None, lora_tags: bool = False
                 ) -> list[GeneratedImage]:
        """Run one request; returns `batch_count` images. `progress(step, steps, s_per_step)`
        replaces the stderr bar; raising from it cancels the run (the exception propagates).
        `decode_progress(tile, tiles)` reports a tiled VAE decode (default: a bar like sampling's).
        `rng` / `sampler_rng` override the context's --rng / --sampler-rng for this request.
        `lora_tags`: take `<lora:name:mult>` from the prompt (sd-cli and sdrt.generate do; sd-server
        does not: its requests list LoRAs in fields, gp.loras)."""
        gp.validate()
        t_start = time.time()
        mp = self.model_params
        cond_prompt = self.apply_loras(gp, lora_tags)
        read_ahead = self.read_ahead_weights("te", "diffusion", "controlnet", "vae")
        try:
            return self._generate(gp, mp, cond_prompt, t_start, progress, decode_progress, show_progress,
                                  rng, sampler_rng)
        finally:
            if read_ahead is not None:
                read_ahead.set()

    def _generate(self, gp, mp, cond_prompt, t_start, progress, decode_progress, show_progress, rng,
                  sampler_rng) -> list[GeneratedImage]:
        from .rng import make_rng
        if rng is not None or sampler_rng is not None:
            mp = replace(mp, rng=rng or mp.rng, sampler_rng=sampler_rng if sampler_rng is not None else mp.sampler_rng)
            mp.validate_rngs()
        size = plan_size(gp, self.family)                                   # 1. size (images read first)
        gp = size.gp
        log.info("generate_image %dx%d", size.width, size.height)
        self.name_device_runs(f"{self.version} {size.width}x{size.height}")    # e.g. "sdxl 1024x1024"
        from .hires import plan_hires, run_hires
        hires = plan_hires(gp, size.width, size.height, self.family.size_multiple, mp.hires_upscalers_dir)
        guidance = plan_guidance(gp, self.variant)                          # 2. guidance
        if guidance.slg_scale != 0 and guidance.skip_layers and \
                "skip_layers" not in _kwargs_of(getattr(self.diffusion_model, "predict", None)):
            raise UnsupportedError(f"--slg-scale: skip-layer guidance needs a DiT whose layers can be skipped "
                                   f"(SD3); {self.family.description} has none (use --slg-scale 0)")
        self._set_flow_shift(gp.flow_shift)
        # RNGs: one context RNG, the sampler's own only when --sampler-rng differs
        ctx_rng = make_rng(mp.rng, size.seed)
        smp_rng = make_rng(mp.sampler_rng, size.seed) if mp.sampler_rng and mp.sampler_rng != mp.rng else ctx_rng
        plan = plan_sampling(gp, self.family, self.prediction, self.denoiser, size.width, size.height,
                             size.init_img is not None)                     # 3. sample plan
        t_prep = time.time()
        latents = prepare_latents(size, self.family, self.variant,         # 4. latents and masks
                                  lambda img: self.encode_first_stage(img, ctx_rng, gp))
        if size.init_img is not None:
            log.info("encode_first_stage completed, taking %.2fs", time.time() - t_prep)
        if latents.img_cfg_follows_cfg:
            guidance = replace(guidance, img_cfg=guidance.cfg)
        latents.ref_latents = self.encode_ref_images(gp, size, ctx_rng, latents.ref_pixels)
        control = self.control_hint(gp, size)
        t_cond = time.time()
        self.upload_weights_ahead(("diffusion", "controlnet"), beside=("te",))
        passes = self.conditions(replace(gp, prompt=cond_prompt), size.width, size.height, guidance,
                                 latents)                                   # 5. conditioning
        log.info("get_learned_condition completed, taking %.2fs", time.time() - t_cond)
        self.release_weight_pages("te", "vae")
        self.release_device_stage("te")
        self.upload_device_weights("diffusion", "controlnet")
        bar = ProgressBar(progress, enabled=show_progress and log.isEnabledFor(logging.INFO))
        results, t_denoise = [], time.time()
        for b in range(gp.batch_count):                                     # 6. sampling, one image per seed
            cur = size.seed + b
            log.info("generating image: %d/%d - seed %d", b + 1, gp.batch_count, cur)
            t_b = time.time()
            results.append((cur, self.sample_one(cur, ctx_rng, smp_rng, plan, guidance, latents, passes, bar,
                                                 first=b == 0, control=control)))
            log.info("sampling completed, taking %.2fs", time.time() - t_b)
        log.info("generating %d latent images completed, taking %.2fs", len(results), time.time() - t_denoise)
        if hires is not None:                                               # 6b. hires fix (second pass)
            results, _ = run_hires(self, results, gp, size, hires, plan, guidance, latents, passes, ctx_rng,
                                   smp_rng, bar)
        self.release_weight_pages("diffusion", "controlnet")
        self.release_device_stage("diffusion", "controlnet")
        out = self.decode_all(results, gp, size, plan, mp, bar, decode_progress)   # 7. decode
        if mp.upscale_model and gp.upscale_repeats > 0:                     # 8. ESRGAN (sd-cli's --upscale-model)
            self.upscale_results(out, mp.upscale_model, gp.upscale_repeats, gp.upscale_tile_size)
        log.info("generate_image completed in %.2fs", time.time() - t_start)
        return out

    def upscale_results(self, results: list[GeneratedImage], path: str, repeats: int, tile_size: int) -> None:
        """Each image through the ESRGAN model `repeats` times, in place (sd-cli, after generate_image)."""
        from .upscaler import Upscaler, upscaler_device
        key = (path, int(tile_size))
        if self._upscaler is None or self._upscaler[0] != key:
            self._upscaler = (key, Upscaler.load(path, tile_size, upscaler_device(self.model_params.backend)))
        up = self._upscaler[1]
        for r in results:
            for _ in range(repeats):
                r.image = up.upscale(r.image)

    def apply_loras(self, gp: GenParams, lora_tags: bool = True) -> str:
        """gp.loras and (lora_tags) the prompt's `<lora:name:mult>` tags, resolved in
        --lora-model-dir, applied to the weights (sdrt.engine.lora); returns the prompt to encode
        (without the tags)."""
        from .lora import LoraState, as_specs, extract_loras
        mp = self.model_params
        prompt, specs = extract_loras(gp.prompt, mp.lora_model_dir) if lora_tags else (gp.prompt, [])
        merged: dict = {}
        for s in as_specs(gp.loras) + specs:
            merged[s.path] = merged.get(s.path, 0.0) + s.multiplier
        if self.models is None:
            if merged:
                log.warning("LoRAs need a pipeline loaded from files (Pipeline.load); not applied")
            return prompt
        if self._loras is None:
            if not merged:
                return prompt
            self._loras = LoraState(self.models.tensors)
        from .lora import LoraSpec
        offloaded = bool(mp.offload_to_cpu or mp.params_backend)
        if self._loras.set([LoraSpec(p, m) for p, m in merged.items()], self.version, mp.lora_apply_mode, offloaded):
            self._unet = self._cond = self._vae = self._tae = None     # rebuilt from the new table
        return prompt

    # ---- stages 5-7 -------------------------------------------------------------------------------
    def conditions(self, gp: GenParams, width: int, height: int, guidance: GuidancePlan,
                   latents: Latents) -> tuple[Cond, Cond | None, Cond | None]:
        """Stage 5: (cond, uncond, img_cond) for the model calls: the prompt's and the negative
        prompt's conditioning with the concat latents; img_cond is uncond's text with the
        conditional concat latents. An empty negative prompt gives a zero context where the
        family says so (SDXL; not with EDM v-prediction, as sd.cpp)."""
        enc = self.conditioner.encode
        accepts = _kwargs_of(enc)
        dg = gp.guidance if self.family.distilled_guidance else None
        refs = dict(ref_latents=tuple(latents.ref_latents),
                    ref_index_mode="increase" if gp.increase_ref_index else "fixed")

        def wrap(c, concat):
            return Cond(np.asarray(c.context, F32), None if getattr(c, "y", None) is None else np.asarray(c.y, F32),
                        concat, guidance=dg, **refs)

        def run(text, zero_out, concat):
            kw = {"clip_skip": gp.clip_skip}
            if "zero_out_masked" in accepts:
                kw["zero_out_masked"] = zero_out
            if "ref_images" in accepts and latents.ref_pixels:      # Qwen-Image-Edit's vision tokens
                kw["ref_images"] = latents.ref_pixels
            return wrap(enc(text, width, height, **kw), concat)

        if not guidance.use_uncond:
            return run(gp.prompt, False, latents.concat), None, None
        zero_out = self.family.zero_empty_negative and not gp.negative_prompt and self.prediction != "edm_v"
        if hasattr(self.conditioner, "encode_many"):        # both prompts through one text-encoder graph
            c, u = self.conditioner.encode_many([(gp.prompt, False), (gp.negative_prompt, zero_out)], width, height,
                                                clip_skip=gp.clip_skip)
            cond, uncond = wrap(c, latents.concat), wrap(u, latents.uncond_concat)
        else:
            cond = run(gp.prompt, False, latents.concat)
            uncond = run(gp.negative_prompt, zero_out, latents.uncond_concat)
        img_cond = Cond(uncond.context, uncond.y, latents.concat, guidance=dg, **refs) if guidance.use_img_cond else None
        return cond, uncond, img_cond

    def sample_one(self, seed: int, ctx_rng, smp_rng, plan: SamplePlan, guidance: GuidancePlan, latents: Latents,
                   passes, bar, first: bool = False, control: tuple | None = None,
                   reseed: bool = True) -> np.ndarray:
        """Stage 6, one image: reseed (unless the caller did: the hires fix), draw the noise, sample;
        returns the final latent. control: (guided hint, strength) of the ControlNet (control_hint),
        or None."""
        from .samplers import sample
        den = self.denoiser
        if reseed:
            ctx_rng.manual_seed(seed)
            if smp_rng is not ctx_rng:
                smp_rng.manual_seed(seed)
        noise = ctx_rng.randn(latents.init.shape)
        x = den.noise_scaling(plan.sigmas[0], noise, latents.init)
        denoise = self._denoise_fn(den, *passes, guidance.cfg, guidance.img_cfg, latents.init, latents.denoise_mask,
                                   plan.steps, bar, slg=guidance, n_sigmas=len(plan.sigmas), control=control)
        if first:  # start-up cost (README "Start-up"): imports, kernel cache, tokenizer, text encoder
            age = process_age()
            log.info("first sampling step after %s (%.2fs CPU)",
                     "?" if age is None else f"{age:.2f}s since process start", time.process_time())
        x0 = sample(plan.method, denoise, x, plan.sigmas, smp_rng, eta=plan.eta, is_flow=den.is_flow)
        x0 = np.asarray(den.inverse_noise_scaling(plan.sigmas[-1], x0), F32)
        check_latent(x0, seed)  # NaN/Inf: stop with a clear error, never a black image
        return x0

    def decode_all(self, results, gp: GenParams, size: SizePlan, plan: SamplePlan, mp: ModelParams, bar,
                   decode_progress=None) -> list[GeneratedImage]:
        """Stage 7: each (seed, latent) through the VAE into a GeneratedImage with its infotext."""
        log.info("decoding %d latents", len(results))
        t_dec, out = time.time(), []
        for i, (cur, lat) in enumerate(results):
            t_i = time.time()
            dec_progress = decode_progress
            if dec_progress is None and gp.vae_tiling and bar.enabled:
                dec_progress = _tile_bar(bar, time.time())
            img = self.decode_first_stage(lat, gp, dec_progress)
            log.info("latent %d decoded, taking %.2fs", i + 1, time.time() - t_i)
            info = {"width": size.meta_w, "height": size.meta_h, "method": plan.method, "scheduler": plan.scheduler,
                    "seed": cur, "eta": plan.eta}
            out.append(GeneratedImage(img, cur, self.parameters_text(gp, cur, size.meta_w, size.meta_h, plan.method,
                                                                     plan.scheduler, mp), lat, info))
        log.info("decode_first_stage completed, taking %.2fs", time.time() - t_dec)
        self.release_weight_pages("vae")
        return out

    # ---- pieces ---------------------------------------------------------------------------------
    def _set_flow_shift(self, shift: float) -> None:
        """--flow-shift for this request (inf: the family's default), on flow denoisers (sd.cpp's set_flow_shift)."""
        den = self.denoiser
        if hasattr(den, "set_shift"):
            if not math.isfinite(shift):
                shift = self.family.flow_shift_of(self.version, self.models.tensors if self.models else None)
            if shift is not None:
                den.set_shift(shift)

    def encode_ref_images(self, gp: GenParams, size, rng, pixels: list | None = None) -> list:
        """-r/--ref-image: each image resized as sd.cpp (the generation's area, at most 1024x1024,
        the reference's aspect, sides a multiple of 16) and encoded by the VAE (Flux Kontext)."""
        if not gp.ref_images:
            return []
        if not self.family.supports("ref_images"):
            raise UnsupportedError(f"-r/--ref-image: {self.family.description or self.family.name} models do not "
                                   "take reference images")
        from .stages import image_to_tensor, load_image, ref_image_size
        out = []
        for i, src in enumerate(gp.ref_images):
            img = load_image(src, "-r/--ref-image", 3)
            if pixels is not None:
                pixels.append(img)
            vw, vh = ref_image_size(img.shape[1], img.shape[0], size.width, size.height,
                                    multiple=self.family.ref_image_multiple)
            log.debug("resize vae ref image %d from %dx%d to %dx%d", i, img.shape[1], img.shape[0], vw, vh)
            out.append(self.encode_first_stage(image_to_tensor(img, vw, vh), rng, gp))
        log.info("EDIT mode: %d reference image%s", len(out), "s" if len(out) > 1 else "")
        return out

    def _denoise_fn(self, den, cond, uncond, img_cond, cfg, icfg, init_latent, denoise_mask, steps, bar,
                    slg: GuidancePlan | None = None, n_sigmas: int = 0, control: tuple | None = None):
        """sd.cpp's denoise lambda: scalings, timestep, the ControlNet, the model passes, CFG,
        skip-layer guidance (on the model output, before c_out), the mask blend."""
        from .samplers import Guided
        passes = [c for c in (cond, uncond, img_cond) if c is not None]
        t0 = time.time()
        calls = [0]

        def denoise(x, sigma, step):
            c_skip, c_out, c_in = den.get_scalings(sigma)
            t = F32(den.sigma_to_t(sigma))
            noised = (x * c_in).astype(F32)
            if control is None:
                outs = self._run_model(noised, t, passes)
            else:
                controls = self._step_controls(noised, t, cond, uncond, img_cond, control[0])
                outs = self._run_model(noised, t, passes, controls, control[1])
            calls[0] += 1
            if calls[0] == 1:   # start-up cost including the model's first graph build (pipelines, kernels)
                age = process_age()
                log.info("first model evaluation done after %s (%.2fs in it)",
                         "?" if age is None else f"{age:.2f}s since process start", time.time() - t0)
            res = dict(zip([id(c) for c in passes], outs))
            c_o = res[id(cond)]
            u_o = res.get(id(uncond)) if uncond is not None else None
            i_o = res.get(id(img_cond)) if img_cond is not None else None
            guided = cfg_combine(c_o, u_o, i_o, cfg, icfg)
            if slg is not None and slg.slg_active(step, n_sigmas):
                log.debug("Skipping layers at step %d", step)
                skipped = np.asarray(self._predict(noised, np.full((1,), t, F32), cond,
                                                   skip_layers=slg.skip_layers), F32)
                guided = guided + (c_o - skipped) * slg.slg_scale
            denoised = guided * c_out + x * c_skip
            pred_uncond = None if u_o is None else u_o * c_out + x * c_skip
            if denoise_mask is not None:
                denoised = denoised * denoise_mask + init_latent * (F32(1.0) - denoise_mask)
            if step > 0 or step == -steps:
                k = abs(step)
                bar(k, steps, (time.time() - t0) / k)
            return Guided(denoised.astype(F32), pred_uncond)

        return denoise

    def _run_model(self, x: np.ndarray, t, passes: list[Cond], controls: dict | None = None,
                   control_strength: float = 0.0) -> list[np.ndarray]:
        """The diffusion model's outputs for each conditioning; one batched call (N = len(passes))
        when all their arrays have equal shapes, else one call each. controls: {id(pass): the
        ControlNet's outputs for it} (_step_controls)."""
        tt = np.full((1,), t, F32)

        def kw(cs):
            return {} if controls is None else {"controls": cs, "control_strength": control_strength}

        if self.batch_cfg and len(passes) > 1 and len({c.shape_key() for c in passes}) == 1:
            n = len(passes)
            cs = None if controls is None else [np.concatenate([controls[id(c)][i] for c in passes], 0)
                                                for i in range(len(controls[id(passes[0])]))]
            out = self._predict(np.concatenate([x] * n, 0), np.repeat(tt, n), Cond.batch(passes), **kw(cs))
            return [np.asarray(out[i:i + 1], F32) for i in range(n)]
        return [np.asarray(self._predict(x, tt, c, **kw(None if controls is None else controls[id(c)])), F32)
                for c in passes]

    def _step_controls(self, x: np.ndarray, t, cond: Cond, uncond: Cond | None, img_cond: Cond | None,
                       guided_hint: np.ndarray) -> dict:
        """sd.cpp's compute_sample_controls: the ControlNet on the step's model input with cond's
        text (and y), and again with uncond's; the img_cond pass takes the last ones computed
        (uncond's), as sd.cpp's shared `controls` vector. cond and uncond run as one batch of 2
        when their shapes agree (same values as two calls)."""
        net, on = self.controlnet, self._on("controlnet")
        tt = np.full((1,), t, F32)
        conds = [c for c in (cond, uncond) if c is not None]
        if self.batch_cfg and len(conds) == 2 and cond.shape_key() == uncond.shape_key():
            both = Cond.batch(conds)
            outs = net(np.concatenate([x, x], 0), guided_hint, np.repeat(tt, 2), both.context, both.y, **on)
            res = [[o[i:i + 1] for o in outs] for i in range(2)]
        else:
            res = [net(x, guided_hint, tt, c.context, c.y, **on) for c in conds]
        out = {id(cond): res[0]}
        if uncond is not None:
            out[id(uncond)] = res[1]
        if img_cond is not None:
            out[id(img_cond)] = res[-1]
        return out

    def _check_controlnet_fits(self, net) -> None:
        """A ControlNet made for another base model (SD1.5's on SDXL, ...) is named before sampling
        (sd.cpp builds the ControlNet from the base model's version, so its load fails instead)."""
        ucfg, ccfg = getattr(self.diffusion_model, "config", None), net.config
        if ucfg is None:
            return
        got = (ccfg.model_channels, ccfg.context_dim, ccfg.adm_in_channels, len(ccfg.input_blocks))
        want = (ucfg.model_channels, ucfg.context_dim, ucfg.adm_in_channels, len(ucfg.input_blocks))
        if got != want:
            from ..errors import ModelFileError
            raise ModelFileError(f"--control-net {net.source}: a ControlNet for another model (channels, context, "
                                 f"adm, input blocks = {got}; this {self.version} UNet has {want})")

    def control_hint(self, gp: GenParams, size) -> tuple | None:
        """--control-image as sd-cli: read as RGB, fitted to the request's size (centre crop + box
        resize, as the init image), --canny's edge map (sdrt.engine.canny), nearest-resized to the
        aligned size, [0, 1]; then the ControlNet's input_hint_block once (sd.cpp caches this guided
        hint too). Returns (guided hint, strength), or None when there is no ControlNet or image."""
        if gp.control_image is None:
            if self.controlnet is not None:
                log.warning("--control-net given without --control-image: the ControlNet is not used")
            return None
        img = load_image(gp.control_image, "--control-image", 3)
        img = fit_image(img, *gp.resolved_size())
        if gp.canny:
            from .canny import canny
            img = canny(img)
        net = self.controlnet
        if net is None:
            log.warning("--control-image given without --control-net: not used")
            return None
        if "controls" not in _kwargs_of(getattr(self.diffusion_model, "predict", None)):
            raise UnsupportedError(f"--control-net: {self.family.description or self.family.name} models take no "
                                   "ControlNet (sd.cpp's ControlNet is for the SD 1.x / 2.x / XL UNet)")
        self._check_controlnet_fits(net)
        t0 = time.time()
        hint = net.hint(image_to_tensor(img, size.width, size.height), **self._on("controlnet"))
        log.info("control image %dx%d%s, hint computed in %.2fs", size.width, size.height,
                 " (canny)" if gp.canny else "", time.time() - t0)
        return hint, float(gp.control_strength)

    def _predict(self, x: np.ndarray, t: np.ndarray, cond: Cond, **kw) -> np.ndarray:
        """One diffusion-model call where the model lives (a plain callable takes the UNet's
        positional (x, t, context, y, c_concat)); kw: skip_layers for skip-layer guidance."""
        model = self.diffusion_model
        if hasattr(model, "predict"):
            return model.predict(x, t, cond, **self._on("diffusion"), **kw)
        return model(x, t, cond.context, cond.y, cond.c_concat, **self._on("diffusion"))

    def _on(self, component: str) -> dict:
        """backend= for a component's model call (nothing for cpu: custom components need not take it)."""
        be = self.executors.get(component, "cpu")
        return {} if be == "cpu" else {"backend": be}

    def _latent_scale(self):
        s, sh = self.family.latent_scale_shift()
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
        sampled with the context RNG, then (z - shift) * scale; TAE: the latent as is; a variant
        with vae_encode "mean" (SD 1.x instruct-pix2pix, sd.cpp's special case): the mean, unscaled."""
        from ..models.vae.autoencoder_kl import gaussian_sample
        model = self.vae
        tae = self._tae is not None
        f = self.family.vae_scale_factor
        x = img01 if tae else (img01 * F32(2.0) - F32(1.0)).astype(F32)
        if gp.vae_tiling:
            size, ov = self._tiling(gp, x.shape[3] // f, x.shape[2] // f, True)
            from .vae_tiling import tiled_apply
            out = tiled_apply(partial(model.encode, **self._on("vae")), x, -f, size, ov)
        else:
            out = model.encode(x, **self._on("vae"))
        out = np.asarray(out, F32)
        if tae:
            return out
        if hasattr(model, "to_diffusion"):      # the VAE maps its own latents (its encode gives the mean)
            return model.to_diffusion(out)
        if self.variant.vae_encode == "mean":
            return gaussian_sample(out)
        C = out.shape[1] // 2
        lat = gaussian_sample(out, rng.randn((out.shape[0], C) + out.shape[2:]))
        scale, shift = self._latent_scale()
        return ((lat - shift) * scale).astype(F32)

    def decode_first_stage(self, latent: np.ndarray, gp: GenParams, progress=None, as_float: bool = False) -> np.ndarray:
        """Diffusion latent [1, C, h, w] -> HxWx3 uint8 (sd.cpp decode_first_stage + tensor_to_sd_image),
        or with `as_float` the [1, 3, H, W] float32 image in [0, 1] before the uint8 conversion."""
        model = self.vae
        tae = self._tae is not None
        if tae:
            z = latent
        elif hasattr(model, "from_diffusion"):
            z = model.from_diffusion(latent)
        else:
            scale, shift = self._latent_scale()
            z = (latent / scale + shift).astype(F32)
        if gp.vae_tiling:
            from .vae_tiling import tiled_apply
            size, ov = self._tiling(gp, z.shape[3], z.shape[2], False)
            img = tiled_apply(partial(model.decode, **self._on("vae")), z, self.family.vae_scale_factor, size, ov,
                              progress=progress)
        else:
            img = model.decode(z, **self._on("vae"))
        img = np.asarray(img, F32)
        if not tae:
            img = np.clip((img + F32(1.0)) * F32(0.5), F32(0.0), F32(1.0))
        check_image(img)
        return img if as_float else decode_to_uint8(img)

    def _lora_hashes(self) -> str | None:
        if self._loras is None or not self._loras.specs:
            return None
        from .lora import lora_hashes
        return lora_hashes(self._loras.specs)

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
            strength=gp.strength, lora_hashes=self._lora_hashes(), control_net=mp.control_net or "",
            control_strength=gp.control_strength, hires=gp.hires_metadata(), t5xxl=mp.path_of("t5xxl") or "",
            slg=(gp.slg_scale, gp.skip_layers, gp.skip_layer_start, gp.skip_layer_end), flow_shift=gp.flow_shift,
            vae_tiling={"enabled": True, "tile_size_x": int(gp.vae_tile_size[0]), "tile_size_y": int(gp.vae_tile_size[1]),
                            "target_overlap": float(gp.vae_tile_overlap), "rel_size_x": float(gp.vae_relative_tile_size[0]),
                            "rel_size_y": float(gp.vae_relative_tile_size[1])} if gp.vae_tiling else None)
