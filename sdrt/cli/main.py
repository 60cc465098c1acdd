"""`sdrt`: sd-cli's command line. Flags keep sd-cli's names, defaults and meanings; a flag
sdrt does not support yet is refused by name (argparse: "unrecognized arguments").

Modes: img_gen (default; every runnable model family), upscale (ESRGAN, docs/upscale.md) and convert. The sampler, scheduler, RNG and
prediction choices and their help come from the engine's registries; the text-encoder flags
(--clip_l, --clip_g, ...) from the model-family registry (sdrt.models.families)."""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

from .. import __version__
from ..errors import SdrtError, UsageError

log = logging.getLogger("sdrt")

MODES = ("img_gen", "vid_gen", "upscale", "convert", "metadata")
IMPLEMENTED_MODES = ("img_gen", "upscale", "convert")
LOG_LEVELS = {"debug": logging.DEBUG, "verbose": 15, "info": logging.INFO, "warn": logging.WARNING,
              "error": logging.ERROR}
CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "q2_K", "q3_K", "q4_K",
                 "q5_K", "q6_K")

# sd-cli flags sdrt does not implement yet: refused with a message that says so. A model-file
# flag leaves this list by itself when a family registers its component (sdrt.models.families).
_SDCLI_FLAGS = (
    "--t5xxl", "--llm", "--llm_vision", "--qwen2vl", "--qwen2vl_vision", "--clip_vision", "--high-noise-diffusion-model",
    "--uncond-diffusion-model", "--embeddings-connectors", "--audio-vae", "--ip-adapter",
    "--motion-module", "--photo-maker", "--pulid-weights",
    "--vae-format", "--model-args", "--split-mode",
    "--rpc-servers", "--eager-load",
    "--mmap", "--fa", "--diffusion-fa",
    "--diffusion-conv-direct", "--vae-conv-direct", "--force-sdxl-vae-conv-scale",
    "--prompt-file", "--negative-prompt-file", "--end-img", "--control-video", "--ip-adapter-image",
    "--ref-video", "--ref-audio", "--ref-image-args", "--disable-auto-resize-ref-image", "--video-frames", "--fps",
    "--qwen-image-layers", "--guidance",
    "--timestep-shift",
    "--high-noise-steps", "--moe-boundary", "--extra-sample-args", "--preview", "--preview-path",
    "--preview-interval", "--taesd-preview-only", "--preview-noisy", "--convert-name", "--color",
    "--imat-out", "--imat-in", "--image", "--metadata-format", "--metadata-raw", "--metadata-brief",
    "--metadata-all", "--cache-mode", "--cache-option",
    "--scm-mask", "--scm-policy", "--circular", "--circularx", "--circulary",
    "--pm-id-images-dir", "--pm-id-embed-path", "--pm-style-strength", "--vace-strength")


def _skip_layers(text: str) -> list[int]:
    """`--skip-layers`: sd-cli's "[7,8,9]" (brackets optional; "[]": none)."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    try:
        return [int(v) for v in body.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like [7,8,9], got '{text}'") from None


def _component_flags() -> dict:
    """{role: Component} of the text encoders the registered families take (--clip_l, ...)."""
    from ..models.families import components
    return components()


def _family_flags() -> set:
    """Generation flags that exist once a runnable family uses them (--guidance: distilled guidance)."""
    from ..models.families import runnable_families
    return {"--guidance"} if any(f.distilled_guidance for f in runnable_families()) else set()


def _sdcli_only() -> tuple:
    taken = {c.flag for c in _component_flags().values()} | _family_flags()
    return tuple(f for f in _SDCLI_FLAGS if f not in taken)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # never a traceback: one line naming the flag (the CLI adds "sdrt: error:")
        if message.startswith("unrecognized arguments:"):
            only = _sdcli_only()
            known = [a for a in message.split(":", 1)[1].split() if a.split("=")[0] in only]
            if known:
                message += f" ({', '.join(known)}: sd-cli flag{'s' if len(known) > 1 else ''} sdrt does not support yet)"
        raise UsageError(message)


def _registries():
    from ..engine.denoisers import PREDICTIONS
    from ..engine.rng import RNGS
    from ..engine.samplers import SAMPLERS
    from ..engine.schedulers import SCHEDULER_ALIASES, SCHEDULERS
    return SAMPLERS, SCHEDULERS, SCHEDULER_ALIASES, RNGS, PREDICTIONS


def _float(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{s}'") from None


def build_parser() -> argparse.ArgumentParser:
    SAMPLERS, SCHEDULERS, ALIASES, RNGS, PREDICTIONS = _registries()
    p = _Parser(prog="sdrt", description="stable-diffusion.cpp's sd-cli, rebuilt in Python.",
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"sdrt {__version__}")
    p.add_argument("-M", "--mode", default="img_gen", choices=MODES, help="run mode (default: img_gen)")
    p.add_argument("-t", "--threads", type=int, default=-1,
                   help="threads for the CPU kernels and BLAS (-1: all CPUs this process may use)")
    p.add_argument("--list-devices", action="store_true", help="print the compute devices, name<TAB>description")
    p.add_argument("--log-level", choices=tuple(LOG_LEVELS), default="info", help="logging level (default info)")
    p.add_argument("-v", "--verbose", dest="log_level", action="store_const", const="verbose",
                   help="same as --log-level verbose")

    m = p.add_argument_group("model files")
    m.add_argument("-m", "--model", help="path to the full model (safetensors, gguf, ckpt) or diffusers folder")
    m.add_argument("--diffusion-model", help="path to a standalone diffusion model (UNet)")
    m.add_argument("--vae", help="path to a standalone VAE (replaces the model's)")
    m.add_argument("--taesd", "--tae", dest="taesd", help="path to TAESD: decode (and encode) with the tiny autoencoder (low quality)")
    for c in _component_flags().values():     # --clip_l, --clip_g, ...: from the family registry
        m.add_argument(c.flag, dest=c.role, help=c.help)
    m.add_argument("--control-net", help="path to control net model (docs/controlnet.md)")
    m.add_argument("--embd-dir", help="textual-inversion embeddings directory")
    m.add_argument("--lora-model-dir", default=None,
                   help="LoRA directory: <lora:name:multiplier> in the prompt loads name(.safetensors|.ckpt|...) "
                        "from it (default: the current directory)")
    m.add_argument("--lora-apply-mode", choices=("auto", "immediately", "at_runtime"), default="auto",
                   help="immediately: merge LoRAs into the weights; at_runtime: add them beside each layer "
                        "(quantized weights stay as stored); auto (default): at_runtime when any weight is "
                        "quantized or offloaded, else immediately")
    m.add_argument("--type", choices=CONVERT_TYPES, metavar="TYPE",
                   help="weight type: " + ", ".join(CONVERT_TYPES) + " (default: keep the file's types)")
    m.add_argument("--tensor-type-rules", default="",
                   help='per-tensor weight types, "regex=type,..." e.g. "^vae\\.=f16,model\\.=q8_0"')
    m.add_argument("--rng", choices=tuple(RNGS), default="cuda",
                   help="RNG: " + "; ".join(f"{k}: {v[1]}" for k, v in RNGS.items()) + " (default: cuda)")
    m.add_argument("--sampler-rng", choices=tuple(RNGS), default=None,
                   help="RNG for the sampler's noise (default: same as --rng)")
    m.add_argument("--prediction", choices=tuple(PREDICTIONS), default=None, metavar="PRED",
                   help="prediction type override: " + "; ".join(f"{k}: {v[1]}" for k, v in PREDICTIONS.items())
                   + " (default: from the weights)")

    d = p.add_argument_group("placement and memory (docs/residency.md)")
    d.add_argument("--backend", default=None,
                   help='where graphs run: a device for every module ("cuda0", "cpu") or per module '
                        '("diffusion=cuda0,te=cpu,vae=cuda0"); default: auto-fit')
    d.add_argument("--params-backend", default=None,
                   help='where weights live: cpu (RAM, streamed to the GPU), disk (read from the model file '
                        'when needed), or the compute device; same syntax as --backend (default: the compute device)')
    d.add_argument("--offload-to-cpu", action="store_true",
                   help="keep weights in RAM and stream them to the GPU (same as prepending *=cpu to --params-backend)")
    d.add_argument("--max-vram", default=None, metavar="GIB",
                   help="GPU memory budget for weights and activations in GiB, or per device (cuda0=6,cuda1=4); "
                        "0: live free memory (default), negative: keep that much free")
    d.add_argument("--disable-prefetch", action="store_true",
                   help="load the next segment's weights when it starts instead of during the current one")
    d.add_argument("--disable-segmented-compute", action="store_true",
                   help="never stream a graph's weights segment by segment: fail if they do not fit at once")
    d.add_argument("--auto-fit", choices=("on", "off"), default="on",
                   help="choose --backend/--params-backend from free memory when neither is given (default: on)")
    d.add_argument("--clip-on-cpu", action="store_true", help="deprecated: same as --backend te=cpu")
    d.add_argument("--vae-on-cpu", action="store_true", help="deprecated: same as --backend vae=cpu")
    d.add_argument("--control-net-cpu", action="store_true", help="keep controlnet in cpu (for low vram)")

    g = p.add_argument_group("generation")
    g.add_argument("-p", "--prompt", default="", help="the prompt to render")
    g.add_argument("-n", "--negative-prompt", default="", help='the negative prompt (default: "")')
    g.add_argument("-W", "--width", type=int, default=-1, help="image width in pixels (default: 512, or the init image's)")
    g.add_argument("-H", "--height", type=int, default=-1, help="image height in pixels (default: 512, or the init image's)")
    g.add_argument("--steps", type=int, default=20, help="number of sample steps (default: 20)")
    g.add_argument("--cfg-scale", type=_float, default=7.0, help="unconditional guidance scale (default: 7.0)")
    if "--guidance" in _family_flags():
        g.add_argument("--guidance", type=_float, default=3.5, help="distilled guidance scale (default: 3.5)")
    g.add_argument("--flow-shift", type=_float, default=math.inf,
                   help="shift value for flow-matching models (default: the model's: Flux dev 1.15, schnell 1.0, SD3 3.0)")
    g.add_argument("--slg-scale", type=_float, default=0.0,
                   help="skip layer guidance (SLG) scale, only for DiT models (SD3): 0 means disabled, "
                        "a value of 2.5 is nice for sd3.5 medium (default: 0)")
    g.add_argument("--skip-layers", type=_skip_layers, default=[7, 8, 9],
                   help="layers to skip for SLG steps (default: [7,8,9])")
    g.add_argument("--skip-layer-start", type=_float, default=0.01, help="SLG enabling point (default: 0.01)")
    g.add_argument("--skip-layer-end", type=_float, default=0.2, help="SLG disabling point (default: 0.2)")
    g.add_argument("--img-cfg-scale", type=_float, default=math.inf,
                   help="image guidance scale for inpaint or instruct-pix2pix models (default: same as --cfg-scale)")
    g.add_argument("--sampling-method", choices=tuple(SAMPLERS), default=None, metavar="METHOD",
                   help="sampling method, one of [" + ", ".join(SAMPLERS) + "] (default: euler_a for UNets)")
    g.add_argument("--scheduler", choices=tuple(SCHEDULERS) + tuple(ALIASES), default=None, metavar="SCHEDULER",
                   help="denoiser sigma scheduler, one of [" + ", ".join(list(SCHEDULERS) + list(ALIASES))
                   + "] (default: discrete; lcm for lcm/tcd, simple for ddim_trailing)")
    g.add_argument("--sigmas", default=None, help='custom sigma values for the sampler, comma-separated (e.g. "14.61,7.8,3.5,0.0")')
    g.add_argument("--eta", type=_float, default=math.inf,
                   help="noise multiplier (default: 1 for " + ", ".join(k for k, s in SAMPLERS.items() if s.default_eta == 1)
                   + "; 0 otherwise)")
    g.add_argument("-s", "--seed", type=int, default=42, help="RNG seed (default: 42, use random seed for < 0)")
    g.add_argument("-b", "--batch-count", type=int, default=1, help="number of images, seeds seed, seed+1, ... (default: 1)")
    g.add_argument("--clip-skip", type=int, default=-1,
                   help="ignore last layers of CLIP network; 1 ignores none, 2 ignores one layer (default: -1: "
                        "1 for SD1.x, 2 for SD2.x/SDXL)")
    g.add_argument("-i", "--init-img", help="path to the init image (img2img)")
    g.add_argument("--strength", type=_float, default=0.75, help="strength for noising/unnoising (default: 0.75)")
    g.add_argument("--mask", help="path to the mask image (white = repaint; needs -i)")
    g.add_argument("--control-image", help="path to control image, control net")
    g.add_argument("--control-strength", type=_float, default=0.9,
                   help="strength to apply Control Net (default: 0.9); 1.0 corresponds to full destruction of "
                        "information in init image")
    g.add_argument("--canny", action="store_true", help="apply canny preprocessor (edge detection)")
    g.add_argument("-r", "--ref-image", action="append", default=[], metavar="PATH",
                   help="reference image for Flux Kontext (repeatable)")
    g.add_argument("--increase-ref-index", action="store_true",
                   help="automatically increase the indices of reference images based on the order they are listed "
                        "(starting with 1)")
    g.add_argument("--chroma-disable-dit-mask", action="store_true", help="disable dit mask for chroma")
    g.add_argument("--chroma-enable-t5-mask", action="store_true", help="enable t5 mask for chroma")
    g.add_argument("--chroma-t5-mask-pad", type=int, default=1, help="t5 mask pad size of chroma (default: 1)")
    g.add_argument("--qwen-image-zero-cond-t", action="store_true",
                   help="enable zero_cond_t for qwen image (Qwen-Image-Edit-2511)")
    g.add_argument("--vae-tiling", action="store_true", help="process vae in tiles to reduce memory usage")
    g.add_argument("--vae-tile-size", default=None, help="tile size for vae tiling, format [X]x[Y] (default: 32x32)")
    g.add_argument("--vae-tile-overlap", type=_float, default=0.5,
                   help="tile overlap for vae tiling, in fraction of tile size (default: 0.5)")
    g.add_argument("--vae-relative-tile-size", default=None,
                   help="relative tile size for vae tiling, format [X]x[Y], in fraction of image size if < 1, in "
                        "number of tiles per dim if >= 1 (overrides --vae-tile-size)")

    u = p.add_argument_group("upscaling and hires fix (docs/upscale.md)")
    u.add_argument("--upscale-model", help="ESRGAN model (RRDBNet: RealESRGAN_x4plus, 4x-UltraSharp, ...); -M upscale "
                                           "upscales -i, img_gen upscales each generated image")
    u.add_argument("--upscale-repeats", type=int, default=1, help="run the ESRGAN upscaler this many times (default: 1)")
    u.add_argument("--upscale-tile-size", type=int, default=128, help="tile size for ESRGAN upscaling (default: 128)")
    u.add_argument("--hires", action="store_true", help="enable the highres fix (a second pass at a larger size)")
    u.add_argument("--hires-upscaler", default="Latent",
                   help="highres fix upscaler, Lanczos, Nearest, Latent, Latent (nearest), Latent (nearest-exact), "
                        "Latent (antialiased), Latent (bicubic), Latent (bicubic antialiased), or a model name "
                        "under --hires-upscalers-dir (default: Latent)")
    u.add_argument("--hires-upscalers-dir", default=None, help="highres fix upscaler model directory")
    u.add_argument("--hires-scale", type=_float, default=2.0,
                   help="highres fix scale when target size is not set (default: 2.0)")
    u.add_argument("--hires-width", type=int, default=0, help="highres fix target width, 0 to use --hires-scale (default: 0)")
    u.add_argument("--hires-height", type=int, default=0,
                   help="highres fix target height, 0 to use --hires-scale (default: 0)")
    u.add_argument("--hires-steps", type=int, default=0, help="highres fix second pass sample steps, 0 to reuse --steps "
                                                              "(default: 0)")
    u.add_argument("--hires-denoising-strength", type=_float, default=0.7,
                   help="highres fix second pass denoising strength (default: 0.7)")
    u.add_argument("--hires-upscale-tile-size", type=int, default=128,
                   help="highres fix upscaler tile size, for model-backed upscalers (default: 128)")

    o = p.add_argument_group("output")
    o.add_argument("-o", "--output", help="output path (default ./output.png; output.gguf in convert mode); "
                                          "printf-style %%d / %%03d for numbered sequences; .png, .jpg, .webp")
    o.add_argument("--output-begin-idx", type=int, default=-1,
                   help="first index of an output image sequence (default: 0)")
    o.add_argument("--disable-image-metadata", action="store_true",
                   help="do not embed generation metadata in image files")
    o.add_argument("--compression-quality", type=int, default=90, help="JPEG/WebP quality, 1-100 (default: 90)")
    return p


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (tests and embedding apps swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


class _SinceStart(logging.Formatter):
    """--log-level debug: each line with the seconds since the process started (a start-up timeline)."""

    def __init__(self):
        super().__init__("[%(levelname)-7s] %(since_start)s %(message)s")
        from ..engine.pipeline import process_age
        age = process_age()
        self.start = time.time() - (age or 0.0)

    def format(self, record):
        record.since_start = f"{record.created - self.start:7.3f}s"
        return super().format(record)


def _setup_logging(level: str):
    logging.addLevelName(15, "VERBOSE")
    root = logging.getLogger()
    root.setLevel(LOG_LEVELS[level])
    h = next((h for h in root.handlers if isinstance(h, _StderrHandler)), None)
    if h is None:
        h = _StderrHandler()
        root.addHandler(h)
    h.setFormatter(_SinceStart() if LOG_LEVELS[level] <= logging.DEBUG else logging.Formatter("[%(levelname)-7s] %(message)s"))


def list_devices() -> list[tuple[str, str]]:
    """Every usable compute device (sdrt.ops.backend's registry), the CPU first."""
    from ..ops.backend import list_devices as registered_devices
    return registered_devices()


def _flag_value(argv: list, names: tuple) -> str | None:
    """The value of the last of flags `names` in argv ("--flag v" or "--flag=v"), or None."""
    value = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(n + "=") and n.startswith("--"):
                value = a[len(n) + 1:]
    return value


def _early_warm_up(argv: list) -> None:
    """An image command starts its GPU driver (ops.backend.warm_up) before the parser is built,
    whose imports take a good part of the start-up: from a quick look at argv for the mode and
    --backend; anything else (help, convert, a device list) starts nothing."""
    if any(a in ("-h", "--help", "--version", "--list-devices") for a in argv):
        return
    if (_flag_value(argv, ("-M", "--mode")) or "img_gen") != "img_gen":
        return
    from .. import engine  # noqa: F401  (registers the device backends; light)
    from ..ops.backend import warm_up
    warm_up(_flag_value(argv, ("--backend",)))


def run(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _early_warm_up(argv)
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    log.debug("flags parsed")      # the start-up timeline's first mark (--log-level debug)
    if args.list_devices:
        for name, desc in list_devices():
            print(f"{name}\t{desc}")
        return 0
    from ..ops.threads import set_threads
    set_threads(args.threads)
    if args.mode not in IMPLEMENTED_MODES:
        raise UsageError(f"mode {args.mode!r} is not implemented yet in sdrt {__version__} "
                         f"(implemented: {', '.join(IMPLEMENTED_MODES)})")
    if args.mode == "convert":
        return _convert(args)
    if args.mode == "upscale":
        return _upscale(args)
    return _img_gen(args)


def _upscale(args) -> int:
    """-M upscale: -i through --upscale-model --upscale-repeats times (sd-cli's UPSCALE mode)."""
    import os

    from ..engine.stages import fit_image, load_image
    from ..engine.upscaler import Upscaler, upscaler_device
    from ..io.png import output_paths, parameters_text, write_image
    if not args.upscale_model:
        raise UsageError("upscale mode needs an upscaler model (--upscale-model)")
    if not args.init_img:
        raise UsageError("upscale mode needs an init image (--init-img)")
    if not os.path.isfile(args.init_img):
        raise UsageError(f"-i/--init-img: no such image file: '{args.init_img}'")
    if args.upscale_repeats < 1 or args.upscale_tile_size < 1:
        raise UsageError("--upscale-repeats and --upscale-tile-size must be at least 1")
    path = output_paths(args.output or "output.png", 1, args.output_begin_idx)[0]
    from ..engine.limits import check_output_paths
    check_output_paths([path])
    from ..engine.params import ModelParams
    ModelParams(model="-", backend=args.backend).validate_placement()
    img = load_image(args.init_img, "-i/--init-img", 3)
    if args.width > 0 and args.height > 0:
        img = fit_image(img, args.width, args.height)
    up = Upscaler.load(args.upscale_model, args.upscale_tile_size, upscaler_device(args.backend))
    for _ in range(args.upscale_repeats):
        img = up.upscale(img)
    params = None
    if not args.disable_image_metadata:    # sd-cli writes its usual infotext (no sampler ran: NONE)
        h, w = (args.height, args.width) if args.width > 0 and args.height > 0 else load_image(
            args.init_img, "-i/--init-img", 3).shape[:2]
        params = parameters_text(prompt=args.prompt, negative_prompt=args.negative_prompt, steps=args.steps,
                                 cfg_scale=args.cfg_scale, eta=args.eta, seed=args.seed, width=w, height=h,
                                 model=args.model or "", rng=args.rng, sampler_rng=args.sampler_rng, method="NONE")
    write_image(path, img, params, args.compression_quality)
    log.info("save result image 0 to '%s' (success)", path)
    return 0


def _convert(args) -> int:
    if not args.model:
        raise UsageError("convert: -m/--model is required")
    from ..io.writer import convert
    out = args.output or "output.gguf"
    summary = convert(args.model, out, args.type, tensor_type_rules=args.tensor_type_rules or None)
    log.info("converted %s -> %s: %s", args.model, out, summary)
    return 0


def params_from_args(args):
    """(ModelParams, GenParams) from parsed img_gen arguments (validated)."""
    from ..engine.params import (
        GenParams,
        ModelParams,
        parse_rel_tile_size,
        parse_tile_size,
    )
    from ..engine.schedulers import parse_sigmas
    from dataclasses import fields
    own = {f.name for f in fields(ModelParams)}
    roles = {r: getattr(args, r) for r in _component_flags()}
    mp = ModelParams(model=args.model, diffusion_model=args.diffusion_model, vae=args.vae, taesd=args.taesd,
                     **{r: p for r, p in roles.items() if r in own},
                     parts={r: p for r, p in roles.items() if r not in own and p},
                     embd_dir=args.embd_dir, lora_model_dir=args.lora_model_dir or ".",
                     lora_apply_mode=args.lora_apply_mode, type=args.type,
                     model_args={"chroma_use_dit_mask": not args.chroma_disable_dit_mask,
                                 "chroma_use_t5_mask": args.chroma_enable_t5_mask,
                                 "chroma_t5_mask_pad": args.chroma_t5_mask_pad,
                                 "qwen_image_zero_cond_t": args.qwen_image_zero_cond_t},
                     tensor_type_rules=args.tensor_type_rules or None, rng=args.rng, sampler_rng=args.sampler_rng,
                     prediction=args.prediction, threads=args.threads, backend=args.backend,
                     params_backend=args.params_backend, offload_to_cpu=args.offload_to_cpu, max_vram=args.max_vram,
                     disable_prefetch=args.disable_prefetch, disable_segmented_compute=args.disable_segmented_compute,
                     auto_fit=args.auto_fit == "on", clip_on_cpu=args.clip_on_cpu, vae_on_cpu=args.vae_on_cpu,
                     control_net=args.control_net, control_net_cpu=args.control_net_cpu,
                     upscale_model=args.upscale_model, hires_upscalers_dir=args.hires_upscalers_dir)
    sigmas = None
    if args.sigmas is not None:
        try:
            sigmas = [float(v) for v in parse_sigmas(args.sigmas)]
        except SdrtError as e:
            raise UsageError(f"--sigmas: {e}") from None
    gp = GenParams(prompt=args.prompt, negative_prompt=args.negative_prompt, width=args.width, height=args.height,
                   steps=args.steps, cfg_scale=args.cfg_scale, img_cfg_scale=args.img_cfg_scale,
                   **({"guidance": args.guidance} if hasattr(args, "guidance") else {}),
                   sampling_method=args.sampling_method, scheduler=args.scheduler, sigmas=sigmas, eta=args.eta,
                   seed=args.seed, batch_count=args.batch_count, clip_skip=args.clip_skip, init_image=args.init_img,
                   strength=args.strength, mask_image=args.mask, vae_tiling=args.vae_tiling,
                   vae_tile_size=parse_tile_size(args.vae_tile_size) if args.vae_tile_size else (0, 0),
                   vae_tile_overlap=args.vae_tile_overlap,
                   vae_relative_tile_size=(parse_rel_tile_size(args.vae_relative_tile_size)
                                           if args.vae_relative_tile_size else (0.0, 0.0)),
                   ref_images=list(args.ref_image), increase_ref_index=args.increase_ref_index,
                   flow_shift=args.flow_shift, slg_scale=args.slg_scale, skip_layers=list(args.skip_layers),
                   skip_layer_start=args.skip_layer_start, skip_layer_end=args.skip_layer_end,
                   control_image=args.control_image, control_strength=args.control_strength, canny=args.canny,
                   embed_metadata=not args.disable_image_metadata, upscale_repeats=args.upscale_repeats,
                   upscale_tile_size=args.upscale_tile_size, hires=args.hires, hires_upscaler=args.hires_upscaler,
                   hires_scale=args.hires_scale, hires_width=args.hires_width, hires_height=args.hires_height,
                   hires_steps=args.hires_steps, hires_denoising_strength=args.hires_denoising_strength,
                   hires_upscale_tile_size=args.hires_upscale_tile_size)
    if not 1 <= args.compression_quality <= 100:
        raise UsageError(f"--compression-quality: must be in [1, 100], got {args.compression_quality}")
    return mp.validate(), gp.validate()


def _img_gen(args) -> int:
    import os

    from ..ops.backend import warm_up
    warm_up(args.backend)             # (started already by _early_warm_up unless argv hid the spec)
    from ..io.png import output_paths, write_image
    mp, gp = params_from_args(args)
    for flag, path in (("-i/--init-img", gp.init_image), ("--mask", gp.mask_image), ("--control-image", gp.control_image),
                       *(("-r/--ref-image", r) for r in gp.ref_images)):
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag}: no such image file: '{path}'")
    paths = output_paths(args.output or "output.png", gp.batch_count, args.output_begin_idx)
    from ..engine.limits import check_output_paths  # a real, writable file name before any loading
    check_output_paths(paths)
    from ..engine.pipeline import Pipeline
    pipe = Pipeline.load(mp)
    pipe.one_shot = True           # one request: each stage's GPU memory goes when it ends
    results = pipe.generate(gp, lora_tags=True)
    ok = 0
    for i, (r, path) in enumerate(zip(results, paths)):
        try:
            write_image(path, r.image, r.parameters if gp.embed_metadata else None, args.compression_quality)
            ok += 1
            log.info("save result image %d to '%s' (success)", i, path)
        except SdrtError as e:
            log.error("save result image %d to '%s' (failure): %s", i, path, e)
    log.info("%d/%d images saved", ok, len(results))
    return 0 if ok == len(results) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # `sdrt serve ...`: the HTTP server (sdrt.server, the `server` extra)
        from ..server.main import main as serve_main
        return serve_main(argv[1:])
    try:
        return run(argv)
    except SdrtError as e:
        from ..engine.limits import printable  # argv bytes that were not UTF-8 may be in the message
        print(f"sdrt: error: {printable(e)}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print("sdrt: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    """The `sdrt` command (and `python -m sdrt`): main(), then the process ends without the
    interpreter's teardown. Every output is written and closed by then; the teardown (Numba's and
    LLVM's finalizers, a GPU context, every module's objects) took 0.2-0.4 s of each command here.
    An error that escapes main() takes the normal way out, with its traceback; so does a run under
    a profiler or tracer (cProfile, coverage), which writes its results at the normal exit."""
    rc = main()
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(rc)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe: nothing left to say
            pass
    os._exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    console()
