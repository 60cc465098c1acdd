"""Requests of the three API families -> one `Request` (a GenParams over the server's defaults plus
the output encoding), with sd-server's field names and every limit checked before any work.

Every problem is a `BadRequest` (-> 400 with a JSON error naming the field). Images arrive as
base64 or data URLs (JSON) or as uploaded files (multipart) and are decoded here, with the pixel
limit checked from the header before the pixels are decompressed."""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..engine.params import GenParams
from ..errors import SdrtError

__all__ = ["BadRequest", "Limits", "Request", "extract_extra_args", "from_native", "from_openai", "from_sdapi",
           "webui_sampler"]


class BadRequest(SdrtError):
    """A request the server refuses (400), or with `status` another 4xx."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Limits:
    """sd-server's limits (64..4096 pixels a side, 8 images, 64 queued jobs) plus sdrt's own
    (steps, reference images, pixels of an uploaded image, request body bytes), all reported by /sdcpp/v1/capabilities."""
    min_width: int = 64
    max_width: int = 4096
    min_height: int = 64
    max_height: int = 4096
    max_batch_count: int = 8
    max_queue_size: int = 64
    max_steps: int = 150
    max_ref_images: int = 8
    max_image_pixels: int = 4096 * 4096
    max_body_bytes: int = 64 * 1024 * 1024

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Request:
    gen: GenParams
    output_format: str = "png"
    output_compression: int = 100
    echo: dict = field(default_factory=dict)     # sdapi's `parameters`


OUTPUT_FORMATS = ("png", "jpeg", "webp")
EXTRA_RE = re.compile(r"<sd_cpp_extra_args>(.*?)</sd_cpp_extra_args>", re.S)

# WebUI sampler names (lower case, as A1111 lists them) -> sdrt's (= sd.cpp's) names
WEBUI_SAMPLERS = {
    "euler a": "euler_a", "k_euler_a": "euler_a", "euler": "euler", "k_euler": "euler", "heun": "heun",
    "k_heun": "heun", "dpm2": "dpm2", "k_dpm_2": "dpm2", "dpm++ 2s a": "dpm++2s_a", "k_dpmpp_2s_a": "dpm++2s_a",
    "dpm++ 2m": "dpm++2m", "k_dpmpp_2m": "dpm++2m", "dpm++ 2m sde": "dpm++2m_sde", "k_dpmpp_2m_sde": "dpm++2m_sde",
    "dpm++ 2m sde gpu": "dpm++2m_sde_bt", "ipndm": "ipndm", "ipndm_v": "ipndm_v", "lcm": "lcm",
    "ddim": "ddim_trailing", "tcd": "tcd", "lms": "lms", "k_lms": "lms", "euler cfg++": "euler_cfg_pp",
    "euler a cfg++": "euler_a_cfg_pp", "res multistep": "res_multistep", "res 2s": "res_2s", "er sde": "er_sde",
}


def webui_sampler(name: str) -> str | None:
    """A WebUI sampler name -> sdrt's; None for "default" / empty (the model's default)."""
    from ..engine.samplers import SAMPLERS
    n = name.strip().lower()
    if n in ("", "default"):
        return None
    if n in SAMPLERS:
        return n
    if n in WEBUI_SAMPLERS:
        return WEBUI_SAMPLERS[n]
    raise BadRequest(f"sampler_name: unknown sampler '{name}'; valid: default, {', '.join(SAMPLERS)}, "
                     f"or a WebUI name ({', '.join(sorted(WEBUI_SAMPLERS))})")


# ---- typed field access ---------------------------------------------------------------------------

def _get(d: dict, key: str, kind, default, where: str = ""):
    if key not in d or d[key] is None:
        return default
    v = d[key]
    name = where + key
    if kind is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        raise BadRequest(f"{name}: expected a boolean, got {type(v).__name__}")
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise BadRequest(f"{name}: expected an integer, got {json.dumps(v)[:40]}")
        v = int(v)
        if abs(v) > 2**63 - 1:
            raise BadRequest(f"{name}: out of range")
        return v
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise BadRequest(f"{name}: expected a finite number, got {json.dumps(v)[:40]}")
        return float(v)
    if kind is str:
        if not isinstance(v, str):
            raise BadRequest(f"{name}: expected a string, got {type(v).__name__}")
        return _utf8(v, name)
    if kind is dict:
        if not isinstance(v, dict):
            raise BadRequest(f"{name}: expected an object, got {type(v).__name__}")
        return v
    if kind is list:
        if not isinstance(v, list):
            raise BadRequest(f"{name}: expected an array, got {type(v).__name__}")
        return v
    raise AssertionError(kind)


def _utf8(v: str, name: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no UTF-8 consumer (the tokenizer) can take."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name}: not valid Unicode (a lone surrogate)") from None
    return v


def parse_json_object(body: bytes) -> dict:
    if not body:
        raise BadRequest("empty body")
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid json: {e}", code="invalid_json") from None
    if not isinstance(d, dict):
        raise BadRequest("body must be an object")
    return d


# ---- images -------------------------------------------------------------------------------------

def decode_image(data, field_name: str, limits: Limits, channels: int = 3) -> np.ndarray:
    """base64 / data URL string or raw bytes -> HxWx3 (or HxW for channels=1) uint8."""
    if isinstance(data, str):
        s = data.strip()
        if s.startswith("data:"):
            head, _, s = s.partition(",")
            if ";base64" not in head:
                raise BadRequest(f"{field_name}: only base64 data URLs are accepted")
        try:
            raw = base64.b64decode(s, validate=False)
        except (binascii.Error, ValueError):
            raise BadRequest(f"{field_name}: not valid base64") from None
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    else:
        raise BadRequest(f"{field_name}: expected a base64 string")
    if not raw:
        raise BadRequest(f"{field_name}: empty image")
    from PIL import Image
    try:
        im = Image.open(io.BytesIO(raw))
        w, h = im.size
        if w * h > limits.max_image_pixels or w > 4 * limits.max_width or h > 4 * limits.max_height:
            raise BadRequest(f"{field_name}: image is {w}x{h}; the limit is {limits.max_image_pixels} pixels",
                             status=413, code="image_too_large")
        im.load()
        im = im.convert("L" if channels == 1 else "RGB")
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is the client's bad image
        raise BadRequest(f"{field_name}: not a readable image ({type(e).__name__})") from None
    return np.asarray(im, dtype=np.uint8)


# ---- the shared native schema -------------------------------------------------------------------

def extract_extra_args(prompt: str) -> tuple[str, dict | None]:
    """`<sd_cpp_extra_args>{json}</sd_cpp_extra_args>` removed from the prompt, parsed."""
    m = EXTRA_RE.search(prompt)
    if m is None:
        return prompt, None
    try:
        extra = json.loads(m.group(1))
    except ValueError as e:
        raise BadRequest(f"sd_cpp_extra_args: invalid json: {e}") from None
    if not isinstance(extra, dict):
        raise BadRequest("sd_cpp_extra_args: must be a JSON object")
    return (prompt[:m.start()] + prompt[m.end():]).strip(), extra


def _loras(d: dict, loras: dict) -> list | None:
    """sd-server's `lora[{path, multiplier, is_high_noise}]` as GenParams.loras (None: no field);
    paths resolve inside the configured LoRA folder only."""
    from ..engine.lora import LoraSpec
    if d.get("lora") is None:
        return None
    out = []
    for i, entry in enumerate(_get(d, "lora", list, [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise BadRequest(f"lora[{i}]: expected an object with a string path")
        path = resolve_in_dir(loras.get("dir"), entry["path"], f"lora[{i}].path", loras.get("exts", ()))
        if _get(entry, "is_high_noise", bool, False, f"lora[{i}]."):
            raise BadRequest(f"lora[{i}].is_high_noise: high-noise LoRAs are for video models, which sdrt does not run",
                             status=422, code="unsupported_feature")
        out.append(LoraSpec(path, _get(entry, "multiplier", float, 1.0, f"lora[{i}].")))
    return out


def _unsupported(d: dict, limits: Limits, loras: dict) -> None:
    """Fields sd-server takes that sdrt cannot honour yet: refused by name, never silently dropped."""
    for key in ("ip_adapter_image",):
        if d.get(key):
            raise BadRequest(f"{key}: not supported yet by sdrt", status=422, code="unsupported_feature")
    hires = _get(d, "hires", dict, {})
    if _get(hires, "enabled", bool, False, "hires."):
        raise BadRequest("hires: the highres fix is not supported yet by sdrt", status=422, code="unsupported_feature")
    mode = _get(d, "cache_mode", str, "disabled")
    if mode not in ("", "disabled"):
        raise BadRequest(f"cache_mode: '{mode}' is not supported yet by sdrt (only disabled)", status=422,
                         code="unsupported_feature")


def apply_native(gp: GenParams, d: dict, limits: Limits, loras: dict) -> GenParams:
    """sd-server's from_json_str: the native fields over `gp` (unknown fields are ignored, as there)."""
    _unsupported(d, limits, loras)
    kw = {}
    specs = _loras(d, loras)
    if specs is not None:
        kw["loras"] = specs
    for key, kind, attr in (("prompt", str, "prompt"), ("negative_prompt", str, "negative_prompt"),
                            ("clip_skip", int, "clip_skip"), ("width", int, "width"), ("height", int, "height"),
                            ("strength", float, "strength"), ("seed", int, "seed"),
                            ("batch_count", int, "batch_count"), ("embed_image_metadata", bool, "embed_metadata")):
        v = _get(d, key, kind, None)
        if v is not None:
            kw[attr] = v
    sp = _get(d, "sample_params", dict, {})
    for key, kind, attr in (("scheduler", str, "scheduler"), ("sample_method", str, "sampling_method"),
                            ("sample_steps", int, "steps"), ("eta", float, "eta"), ("flow_shift", float, "flow_shift")):
        v = _get(sp, key, kind, None, "sample_params.")
        if v is not None:
            kw[attr] = None if kind is str and v in ("", "default") else v
    sig = _get(sp, "custom_sigmas", list, [], "sample_params.")
    if sig:
        if len(sig) > limits.max_steps + 1 or not all(isinstance(s, (int, float)) and not isinstance(s, bool)
                                                      and math.isfinite(s) for s in sig):
            raise BadRequest(f"sample_params.custom_sigmas: at most {limits.max_steps + 1} finite numbers")
        kw["sigmas"] = [float(s) for s in sig]
    g = _get(sp, "guidance", dict, {}, "sample_params.")
    for key, attr in (("txt_cfg", "cfg_scale"), ("img_cfg", "img_cfg_scale"), ("distilled_guidance", "guidance")):
        v = _get(g, key, float, None, "sample_params.guidance.")
        if v is not None:
            kw[attr] = v
    slg = _get(g, "slg", dict, {}, "sample_params.guidance.")     # skip-layer guidance (SD3), as sd-server
    for key, attr in (("scale", "slg_scale"), ("layer_start", "skip_layer_start"), ("layer_end", "skip_layer_end")):
        v = _get(slg, key, float, None, "sample_params.guidance.slg.")
        if v is not None:
            kw[attr] = v
    layers = _get(slg, "layers", list, None, "sample_params.guidance.slg.")
    if layers is not None:
        if len(layers) > 256 or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise BadRequest("sample_params.guidance.slg.layers: expected a list of layer indices")
        kw["skip_layers"] = list(layers)
    vt = _get(d, "vae_tiling_params", dict, {})
    if vt:
        kw["vae_tiling"] = _get(vt, "enabled", bool, gp.vae_tiling, "vae_tiling_params.")
        tx = _get(vt, "tile_size_x", int, gp.vae_tile_size[0], "vae_tiling_params.")
        ty = _get(vt, "tile_size_y", int, gp.vae_tile_size[1], "vae_tiling_params.")
        kw["vae_tile_size"] = (tx, ty)
        kw["vae_tile_overlap"] = _get(vt, "target_overlap", float, gp.vae_tile_overlap, "vae_tiling_params.")
        kw["vae_relative_tile_size"] = (_get(vt, "rel_size_x", float, gp.vae_relative_tile_size[0], "vae_tiling_params."),
                                        _get(vt, "rel_size_y", float, gp.vae_relative_tile_size[1], "vae_tiling_params."))
    for key, attr, ch in (("init_image", "init_image", 3), ("mask_image", "mask_image", 1),
                          ("control_image", "control_image", 3)):   # the app answers 422 without a ControlNet
        v = d.get(key)
        if v:
            kw[attr] = decode_image(v, key, limits, ch)
    v = _get(d, "control_strength", float, None)
    if v is not None:
        kw["control_strength"] = v
    refs = _get(d, "ref_images", list, [])
    if len(refs) > limits.max_ref_images:
        raise BadRequest(f"ref_images: at most {limits.max_ref_images} images, got {len(refs)}")
    if refs:   # the loaded family must take them: the app answers 422 otherwise
        kw["ref_images"] = [decode_image(v, f"ref_images[{i}]", limits, 3) for i, v in enumerate(refs)]
    v = _get(d, "increase_ref_index", bool, None)
    if v is not None:
        kw["increase_ref_index"] = v
    return gp.replace(**kw)


def check(gp: GenParams, limits: Limits) -> GenParams:
    """The limits, then GenParams.validate (its UsageError becomes a 400 naming the field)."""
    w, h = gp.resolved_size()
    if gp.init_image is not None and (gp.width <= 0 or gp.height <= 0):
        h, w = gp.init_image.shape[:2]
    if not (limits.min_width <= w <= limits.max_width):
        raise BadRequest(f"width: must be in [{limits.min_width}, {limits.max_width}], got {w}")
    if not (limits.min_height <= h <= limits.max_height):
        raise BadRequest(f"height: must be in [{limits.min_height}, {limits.max_height}], got {h}")
    if not (1 <= gp.batch_count <= limits.max_batch_count):
        raise BadRequest(f"batch_count: must be in [1, {limits.max_batch_count}], got {gp.batch_count}")
    if gp.sigmas is None and not (1 <= gp.steps <= limits.max_steps):
        raise BadRequest(f"steps: must be in [1, {limits.max_steps}], got {gp.steps}")
    if abs(gp.seed) > 2**63 - 1:
        raise BadRequest("seed: out of range")
    if gp.mask_image is not None and gp.init_image is not None and gp.mask_image.shape[:2] != gp.init_image.shape[:2]:
        raise BadRequest("mask_image: must have the init image's size")
    try:
        return gp.validate()
    except SdrtError as e:
        raise BadRequest(str(e)) from None


def output_options(d: dict, formats=OUTPUT_FORMATS, default_compression: int = 100) -> tuple[str, int]:
    fmt = _get(d, "output_format", str, "png").lower()
    if fmt == "jpg":
        fmt = "jpeg"
    if fmt not in formats:
        raise BadRequest(f"output_format: must be one of {', '.join(formats)}, got '{fmt}'")
    comp = _get(d, "output_compression", int, default_compression)
    return fmt, min(100, max(0, comp))


def from_native(d: dict, defaults: GenParams, limits: Limits, loras: dict) -> Request:
    fmt, comp = output_options(d)
    gp = check(apply_native(defaults.replace(), d, limits, loras), limits)
    return Request(gp, fmt, comp)


def _prompt_with_extra(gp: GenParams, prompt: str, limits: Limits, loras: dict) -> GenParams:
    prompt, extra = extract_extra_args(prompt)
    gp = gp.replace(prompt=prompt)
    if extra:
        gp = apply_native(gp, extra, limits, loras)
    return gp


def parse_size(size: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*", size)
    if not m:
        raise BadRequest(f"size: expected WIDTHxHEIGHT, got '{size[:40]}'")
    return int(m.group(1)), int(m.group(2))


def from_openai(fields: dict, defaults: GenParams, limits: Limits, loras: dict, *, edit: bool = False,
                images=(), mask=None) -> Request:
    """`fields`: the JSON body (generations) or the multipart form's text fields (edits)."""
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: required")
    prompt = _utf8(prompt, "prompt")
    fmt, comp = output_options(fields, ("png", "jpeg") if edit else OUTPUT_FORMATS)
    gp = defaults.replace()
    n = _get(fields, "n", int, 1)
    gp = gp.replace(batch_count=n)
    size = fields.get("size")
    if size not in (None, "", "auto"):
        if not isinstance(size, str):
            raise BadRequest("size: expected a string WIDTHxHEIGHT")
        w, h = parse_size(size)
        gp = gp.replace(width=w, height=h)
    gp = _prompt_with_extra(gp, prompt, limits, loras)
    if edit:
        if not images:
            raise BadRequest("image: required (image[] or image)")
        gp = gp.replace(init_image=decode_image(images[0], "image", limits, 3))
        if mask is not None:
            m = decode_image(mask, "mask", limits, 1)
            gp = gp.replace(mask_image=m)
    return Request(check(gp, limits), fmt, comp)


def from_sdapi(d: dict, defaults: GenParams, limits: Limits, loras: dict, *, img2img: bool = False) -> Request:
    prompt = _get(d, "prompt", str, "")
    gp = defaults.replace(negative_prompt=_get(d, "negative_prompt", str, defaults.negative_prompt))
    for key, kind, attr in (("width", int, "width"), ("height", int, "height"), ("steps", int, "steps"),
                            ("cfg_scale", float, "cfg_scale"), ("seed", int, "seed"),
                            ("batch_size", int, "batch_count"), ("clip_skip", int, "clip_skip")):
        v = _get(d, key, kind, None)
        if v is not None:
            gp = gp.replace(**{attr: v})
    sampler = _get(d, "sampler_name", str, None)
    if sampler is not None:
        gp = gp.replace(sampling_method=webui_sampler(sampler))
    sched = _get(d, "scheduler", str, None)
    if sched is not None:
        gp = gp.replace(scheduler=None if sched.lower() in ("", "automatic", "default") else sched.lower())
    if _get(d, "enable_hr", bool, False) and not img2img:
        raise BadRequest("enable_hr: the highres fix is not supported yet by sdrt", status=422,
                         code="unsupported_feature")
    if _get(d, "extra_images", list, []):
        raise BadRequest("extra_images: reference images are not supported yet by sdrt", status=422,
                         code="unsupported_feature")
    specs = _loras(d, loras)
    if specs is not None:
        gp = gp.replace(loras=specs)
    if img2img:
        inits = _get(d, "init_images", list, [])
        if not inits:
            raise BadRequest("init_images: required for img2img")
        init = decode_image(inits[0], "init_images[0]", limits, 3)
        gp = gp.replace(init_image=init, strength=min(1.0, max(0.0, _get(d, "denoising_strength", float, 0.75))))
        if d.get("mask"):
            m = decode_image(_get(d, "mask", str, ""), "mask", limits, 1)
            if _get(d, "inpainting_mask_invert", bool, False):
                m = 255 - m
            gp = gp.replace(mask_image=m)
    gp = _prompt_with_extra(gp, prompt, limits, loras)
    echo = {k: v for k, v in d.items() if k not in ("init_images", "mask", "extra_images")}
    return Request(check(gp, limits), "png", 100, echo)


# ---- files inside their folders -----------------------------------------------------------------

def resolve_in_dir(root: str | None, rel: str, what: str, exts=()) -> str:
    """`root`/`rel` if it names a file inside `root` after resolving symlinks and `..`, else 400."""
    if not root:
        raise BadRequest(f"{what}: no folder is configured for it (start the server with --lora-model-dir)")
    if not rel or "\x00" in rel or os.path.isabs(rel) or len(rel) > 1024:
        raise BadRequest(f"{what}: must be a relative path inside the configured folder")
    base = os.path.realpath(root)
    cands = [rel] + [rel + e for e in exts if not rel.endswith(e)]
    for c in cands:
        full = os.path.realpath(os.path.join(base, c))
        if os.path.commonpath([base, full]) != base:
            raise BadRequest(f"{what}: resolves outside the configured folder")
        if os.path.isfile(full):
            return full
    raise BadRequest(f"{what}: no such file in the configured folder: '{rel[:200]}'", status=404, code="not_found")


def list_dir_files(root: str | None, exts, recursive: bool) -> list[tuple[str, str, str]]:
    """(stem, relative path, absolute path) of the files under `root` with these extensions that
    stay inside it (symlinks pointing out are skipped)."""
    if not root or not os.path.isdir(root):
        return []
    base = os.path.realpath(root)
    out = []
    walker = os.walk(base) if recursive else [(base, [], os.listdir(base))]
    for d, _, files in walker:
        for f in sorted(files):
            full = os.path.join(d, f)
            if not f.lower().endswith(tuple(exts)):
                continue
            real = os.path.realpath(full)
            if os.path.commonpath([base, real]) != base or not os.path.isfile(real):
                continue
            rel = os.path.relpath(full, base)
            out.append((os.path.splitext(f)[0], rel, real))
    return sorted(out, key=lambda t: t[1])
