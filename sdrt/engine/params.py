"""Generation parameters: sd-cli's names, defaults and checks, in two dataclasses.

`ModelParams` is sd-cli's context (which files, weight type, RNGs, prediction): what a
`Pipeline` is built from. `GenParams` is one request (prompt, size, sampler, seed, img2img,
inpaint, VAE tiling, output). Field names follow sd-cli's long flags (`--cfg-scale` ->
`cfg_scale`); defaults are sd-cli's (examples/common/common.h, `sd_sample_params_init`):
unset values are `None` / `inf` exactly where sd-cli keeps a sentinel (`img_cfg_scale` inf
follows `cfg_scale`, `eta` inf is the sampler's default, width/height -1 mean 512 or the init
image's size).

`validate()` raises `UsageError` naming the flag and the valid values, as the CLI reports them.
Nothing here imports numba or the model code (validate() reads the family registry, which is
light, when called): `import sdrt` stays light.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field, fields, replace

from ..errors import UsageError

__all__ = ["DEFAULT_SIZE", "GenParams", "ModelParams", "parse_rel_tile_size", "parse_tile_size"]

DEFAULT_SIZE = 512


_PATH_FIELDS = ("model", "diffusion_model", "vae", "taesd", "clip_l", "clip_g")


@dataclass
class ModelParams:
    """Which weights and how to run them (sd-cli's SDContextParams)."""
    model: str | None = None             # -m/--model: a full checkpoint
    diffusion_model: str | None = None   # --diffusion-model: a standalone UNet/DiT
    vae: str | None = None               # --vae: overrides the checkpoint's VAE
    taesd: str | None = None             # --taesd: decode with TAESD instead of the VAE
    clip_l: str | None = None            # --clip_l
    clip_g: str | None = None            # --clip_g
    parts: dict = field(default_factory=dict)  # other text-encoder roles a family registers: {"t5xxl": path}
    embd_dir: str | None = None          # --embd-dir: textual-inversion embeddings
    lora_model_dir: str = "."            # --lora-model-dir: where <lora:name:mult> names resolve
    lora_apply_mode: str = "auto"        # --lora-apply-mode: auto | immediately | at_runtime
    model_args: dict = field(default_factory=dict)  # sd.cpp's model args: {"chroma_use_dit_mask": False, ...}
    type: str | None = None              # --type: weight type override (f32, f16, q8_0 ...)
    tensor_type_rules: str | None = None  # --tensor-type-rules
    rng: str = "cuda"                    # --rng
    sampler_rng: str | None = None       # --sampler-rng (None: same as --rng)
    prediction: str | None = None        # --prediction (None: from the weights)
    threads: int = -1                    # -t/--threads
    # placement and residency (sdrt.engine.placement / residency; sd-cli's syntax)
    backend: str | None = None           # --backend: "cuda0", or "diffusion=cuda0,te=cpu,vae=cuda0"
    params_backend: str | None = None    # --params-backend: where weights live: cpu, disk, cudaN (same syntax)
    offload_to_cpu: bool = False         # --offload-to-cpu: weights in RAM, streamed to the device
    max_vram: str | float | None = None  # --max-vram: GiB (0: live free memory, < 0: keep that much free), or "cuda0=6"
    disable_prefetch: bool = False       # --disable-prefetch
    disable_segmented_compute: bool = False  # --disable-segmented-compute
    auto_fit: bool = True                # --auto-fit on|off (off by itself with any placement above)
    clip_on_cpu: bool = False            # --clip-on-cpu (deprecated: te=cpu)
    vae_on_cpu: bool = False             # --vae-on-cpu (deprecated: vae=cpu)
    control_net: str | None = None       # --control-net: a ControlNet file (sd.cpp's names; docs/controlnet.md)
    control_net_cpu: bool = False        # --control-net-cpu: the ControlNet computes on the CPU
    upscale_model: str | None = None     # --upscale-model: ESRGAN run on each generated image (docs/upscale.md)
    hires_upscalers_dir: str | None = None  # --hires-upscalers-dir: where --hires-upscaler model names resolve

    def path_of(self, role: str) -> str | None:
        """The file given for a component role ("vae", "clip_l", "t5xxl", ...), or None."""
        if role in self.parts:
            return self.parts[role]
        return getattr(self, role, None) if role in _PATH_FIELDS else None

    def validate(self) -> ModelParams:
        if not (self.model or self.diffusion_model):
            raise UsageError("the following arguments are required: -m/--model or --diffusion-model")
        from ..models.families import COMMON_ROLES, component, components
        for role in self.parts:
            component(role)     # an unknown role is a UsageError naming the known ones
        for role in (*COMMON_ROLES, *components()):
            path = self.path_of(role)
            if path and not os.path.exists(path):
                raise UsageError(f"{component(role).flag}: no such file: '{path}'")
        if self.control_net and not os.path.isfile(self.control_net):
            raise UsageError(f"--control-net: no such file: '{self.control_net}'")
        if self.upscale_model and not os.path.isfile(self.upscale_model):
            raise UsageError(f"--upscale-model: no such file: '{self.upscale_model}'")
        if self.hires_upscalers_dir and not os.path.isdir(self.hires_upscalers_dir):
            raise UsageError(f"--hires-upscalers-dir: not a directory: '{self.hires_upscalers_dir}'")
        if self.embd_dir and not os.path.isdir(self.embd_dir):
            raise UsageError(f"--embd-dir: not a directory: '{self.embd_dir}'")
        if self.lora_apply_mode not in ("auto", "immediately", "at_runtime"):
            raise UsageError(f"--lora-apply-mode: invalid mode '{self.lora_apply_mode}'; "
                             f"valid: auto, immediately, at_runtime")
        self.validate_rngs()
        self.validate_placement()
        if self.prediction is not None:
            from .denoisers import PREDICTIONS
            if self.prediction not in PREDICTIONS:
                raise UsageError(f"--prediction: invalid prediction type '{self.prediction}'; "
                                 f"valid: {', '.join(PREDICTIONS)}")
        if self.type is not None:
            from ..io.writer import CONVERT_TYPES
            if self.type.lower() not in {t.lower() for t in CONVERT_TYPES}:
                raise UsageError(f"--type: invalid weight type '{self.type}'; valid: {', '.join(CONVERT_TYPES)}")
        return self

    def validate_placement(self) -> None:
        """The syntax of --backend, --params-backend and --max-vram (devices are resolved when the
        pipeline loads: a missing GPU is an UnsupportedError there)."""
        from .placement import parse_assignments, parse_max_vram
        parse_assignments(self.backend, "--backend")
        parse_assignments(self.params_backend, "--params-backend", allow_disk=True)
        parse_max_vram(self.max_vram)

    def validate_rngs(self) -> None:
        from .rng import RNGS
        for flag, name in (("--rng", self.rng), ("--sampler-rng", self.sampler_rng)):
            if name is not None and name not in RNGS:
                raise UsageError(f"{flag}: invalid RNG '{name}'; valid: {', '.join(RNGS)}")


@dataclass
class GenParams:
    """One image-generation request (sd-cli's SDGenerationParams, img_gen fields)."""
    prompt: str = ""
    negative_prompt: str = ""
    width: int = -1                      # -W; -1: the init image's width, else 512
    height: int = -1                     # -H
    steps: int = 20                      # --steps
    cfg_scale: float = 7.0               # --cfg-scale
    img_cfg_scale: float = math.inf      # --img-cfg-scale; inf: same as --cfg-scale
    guidance: float = 3.5                # --guidance: distilled guidance (families with distilled_guidance; metadata)
    sampling_method: str | None = None   # --sampling-method; None: the model's default (euler_a for UNets)
    scheduler: str | None = None         # --scheduler; None: the sampler's default
    sigmas: list[float] | None = None    # --sigmas: custom schedule (overrides steps/scheduler)
    eta: float = math.inf                # --eta; inf: the sampler's default
    seed: int = 42                       # -s/--seed; < 0: random
    batch_count: int = 1                 # -b/--batch-count: images seed, seed+1, ...
    clip_skip: int = -1                  # --clip-skip; <= 0: the model's default
    init_image: object = None            # -i/--init-img: path, PIL image or HxWx3 uint8 array
    strength: float = 0.75               # --strength (img2img)
    mask_image: object = None            # --mask: path, PIL image or HxW uint8 array (255 = repaint)
    vae_tiling: bool = False             # --vae-tiling
    vae_tile_size: tuple[int, int] = (0, 0)          # --vae-tile-size XxY (0: the decoder's default)
    vae_tile_overlap: float = 0.5                    # --vae-tile-overlap
    vae_relative_tile_size: tuple[float, float] = (0.0, 0.0)  # --vae-relative-tile-size
    ref_images: list = field(default_factory=list)  # -r/--ref-image (repeatable): paths, PIL images or arrays
    increase_ref_index: bool = False     # --increase-ref-index: reference RoPE index 1, 2, ... (else all 1)
    flow_shift: float = math.inf         # --flow-shift; inf: the model's default
    slg_scale: float = 0.0               # --slg-scale: skip-layer guidance (DiT families); 0: off
    skip_layers: list = field(default_factory=lambda: [7, 8, 9])   # --skip-layers
    skip_layer_start: float = 0.01       # --skip-layer-start
    skip_layer_end: float = 0.2          # --skip-layer-end
    embed_metadata: bool = True          # not --disable-image-metadata
    control_image: object = None         # --control-image: path, PIL image or HxWx3 uint8 array (ControlNet hint)
    control_strength: float = 0.9        # --control-strength
    canny: bool = False                  # --canny: sd.cpp's canny edge map of the control image is the hint
    loras: list = field(default_factory=list)  # LoRAs besides the prompt's <lora:...> tags: LoraSpec or (path, multiplier)
    upscale_repeats: int = 1             # --upscale-repeats: ESRGAN passes with --upscale-model
    upscale_tile_size: int = 128         # --upscale-tile-size: ESRGAN tile size (input pixels)
    hires: bool = False                  # --hires: the hires fix (a second pass at a larger size; docs/upscale.md)
    hires_upscaler: str = "Latent"       # --hires-upscaler: Latent (...), Lanczos, Nearest or a model name
    hires_scale: float = 2.0             # --hires-scale (when no --hires-width/--hires-height)
    hires_width: int = 0                 # --hires-width (0: from --hires-scale)
    hires_height: int = 0                # --hires-height
    hires_steps: int = 0                 # --hires-steps (0: the first pass's)
    hires_denoising_strength: float = 0.7  # --hires-denoising-strength, in (0, 1]
    hires_upscale_tile_size: int = 128   # --hires-upscale-tile-size: model upscaler tiles
    extra: dict = field(default_factory=dict)  # free-form, recorded nowhere

    # ---- resolution, as sd-cli does it --------------------------------------------------
    def resolved_size(self) -> tuple[int, int]:
        """(width, height) before alignment: -1 means 512 (sd-cli's get_resolved_width)."""
        return (self.width if self.width > 0 else DEFAULT_SIZE, self.height if self.height > 0 else DEFAULT_SIZE)

    def resolved_seed(self) -> int:
        """sd-cli: a seed < 0 becomes `rand()` after `srand(time)`: any non-negative int."""
        if self.seed >= 0:
            return int(self.seed)
        return random.Random(time.time_ns()).randrange(0, 2**31 - 1)

    def validate(self) -> GenParams:
        """sd-cli's SDGenerationParams::validate plus the checks sd-cli leaves to a crash."""
        from .samplers import SAMPLERS
        from .schedulers import SCHEDULER_ALIASES, SCHEDULERS
        for flag, v in (("-W/--width", self.width), ("-H/--height", self.height)):
            if v == 0 or v < -1:
                raise UsageError(f"{flag}: must be a positive number of pixels, got {v}")
        if self.batch_count <= 0:
            raise UsageError(f"-b/--batch-count: must be greater than 0, got {self.batch_count}")
        if self.sigmas is None and self.steps <= 0:
            raise UsageError(f"--steps: must be greater than 0, got {self.steps}")
        if not (0.0 <= self.strength <= 1.0):
            raise UsageError(f"--strength: must be in [0.0, 1.0], got {self.strength}")
        if not (self.cfg_scale >= 0.0):
            raise UsageError(f"--cfg-scale: must be >= 0, got {self.cfg_scale}")
        if self.sampling_method is not None and self.sampling_method not in SAMPLERS:
            raise UsageError(f"--sampling-method: invalid sampling method '{self.sampling_method}'; "
                             f"valid: {', '.join(SAMPLERS)}")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS and self.scheduler not in SCHEDULER_ALIASES:
            raise UsageError(f"--scheduler: invalid scheduler '{self.scheduler}'; "
                             f"valid: {', '.join(list(SCHEDULERS) + list(SCHEDULER_ALIASES))}")
        if self.sigmas is not None and (len(self.sigmas) < 2 or not all(math.isfinite(s) for s in self.sigmas)):
            raise UsageError("--sigmas: need at least two finite values (e.g. \"14.61,7.8,3.5,0.0\")")
        tx, ty = self.vae_tile_size
        if tx < 0 or ty < 0:
            raise UsageError(f"--vae-tile-size: must be non-negative, got {tx}x{ty}")
        if not (0.0 <= self.vae_tile_overlap < 1.0):
            raise UsageError(f"--vae-tile-overlap: must be in [0, 1), got {self.vae_tile_overlap}")
        rx, ry = self.vae_relative_tile_size
        if rx < 0 or ry < 0:
            raise UsageError(f"--vae-relative-tile-size: must be non-negative, got {rx}x{ry}")
        if math.isnan(self.flow_shift) or self.flow_shift == -math.inf:
            raise UsageError(f"--flow-shift: must be a number, got {self.flow_shift}")
        for flag, v in (("--slg-scale", self.slg_scale), ("--skip-layer-start", self.skip_layer_start),
                        ("--skip-layer-end", self.skip_layer_end)):
            if not math.isfinite(v):
                raise UsageError(f"{flag}: must be a finite number, got {v}")
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.skip_layers):
            raise UsageError(f"--skip-layers: must be non-negative layer indices, got {self.skip_layers}")
        if not math.isfinite(self.control_strength):
            raise UsageError(f"--control-strength: must be a finite number, got {self.control_strength}")
        if self.mask_image is not None and self.init_image is None:
            raise UsageError("--mask: needs an init image (-i/--init-img) to repaint")
        if self.upscale_repeats < 1:
            raise UsageError(f"--upscale-repeats: must be at least 1, got {self.upscale_repeats}")
        if self.upscale_tile_size < 1:
            raise UsageError(f"--upscale-tile-size: must be positive, got {self.upscale_tile_size}")
        if self.hires:
            if self.hires_width < 0 or self.hires_height < 0:
                raise UsageError(f"--hires-width/--hires-height: must be >= 0, got {self.hires_width}x{self.hires_height}")
            if not (self.hires_scale > 0) and self.hires_width <= 0 and self.hires_height <= 0:
                raise UsageError(f"--hires-scale: must be positive when no target size is set, got {self.hires_scale}")
            if self.hires_steps < 0:
                raise UsageError(f"--hires-steps: must be >= 0, got {self.hires_steps}")
            if not (0.0 < self.hires_denoising_strength <= 1.0):
                raise UsageError(f"--hires-denoising-strength: must be in (0.0, 1.0], got {self.hires_denoising_strength}")
            if self.hires_upscale_tile_size < 1:
                raise UsageError(f"--hires-upscale-tile-size: must be positive, got {self.hires_upscale_tile_size}")
        from .limits import check_request  # sizes, steps, prompts, non-finite numbers (docs: "Limits")
        check_request(self)
        return self

    def hires_metadata(self) -> dict | None:
        """The infotext's hires fields (sd-cli's get_image_params: the flags as given), or None."""
        if not self.hires or (self.hires_upscaler or "Latent") == "None":
            return None
        return {"upscaler": self.hires_upscaler or "Latent", "scale": self.hires_scale, "width": self.hires_width,
                "height": self.hires_height, "steps": self.hires_steps, "strength": self.hires_denoising_strength}

    def replace(self, **kw) -> GenParams:
        return replace(self, **kw)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def parse_tile_size(s: str) -> tuple[int, int]:
    """`--vae-tile-size`: "N" or "XxY" (sd-cli's on_tile_size_arg)."""
    try:
        if "x" in s:
            a, b = s.split("x", 1)
            return int(a), int(b)
        return int(s), int(s)
    except ValueError:
        raise UsageError(f"--vae-tile-size: expected N or XxY, got '{s}'") from None


def parse_rel_tile_size(s: str) -> tuple[float, float]:
    """`--vae-relative-tile-size`: "F" or "XxY" (fractions of the image if < 1, tile counts if >= 1)."""
    try:
        if "x" in s:
            a, b = s.split("x", 1)
            return float(a), float(b)
        return float(s), float(s)
    except ValueError:
        raise UsageError(f"--vae-relative-tile-size: expected F or XxY, got '{s}'") from None
