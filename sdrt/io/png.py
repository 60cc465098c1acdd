"""Writing generated images as sd-cli does: PNG with the sd-webui `parameters` text, JPEG and WebP
by extension, `%03d` output sequences, and atomic writes.

* `parameters_text(...)` builds the infotext exactly as sd-cli's `get_image_params`
  (examples/common/common.cpp): the prompt, `Negative prompt: ...`, then `Steps: 20, CFG scale:
  7.000000, Guidance: 3.500000, Eta: inf, Seed: 42, Size: 512x512, Model: x.safetensors, RNG:
  cuda, Sampler: euler_a discrete, [TE: .., ][Unet: .., ][VAE: .., ][Clip skip: n, ]Version: ...,
  SDCPP: {json}` — floats as C's `std::to_string` (`%f`), the JSON as nlohmann's `dump()`
  (sorted keys, no spaces, shortest round-trip floats, inf/nan as null). Only the generator
  differs: `Version: sdrt` and `"generator": {"name": "sdrt", ...}`.
* PNG: our own encoder (zlib, no Pillow), chunks in stb_image_write's order: IHDR, the `tEXt`
  chunk `parameters\\0<text>` (UTF-8 bytes, as stb writes them), IDAT, IEND.
* JPEG (`.jpg .jpeg .jpe`): Pillow; the text goes into a COM segment `parameters\\0<text>\\0` as
  stb's patched writer puts it. WebP: Pillow; the text goes into an XMP packet
  (`<sdcpp:parameters>`, XML-escaped) as sd-cli's muxer does. `quality` is `--compression-quality`.
* `output_paths(pattern, n, begin)` names the files as sd-cli's `save_results`.
* Every write goes to a temporary file in the destination folder and is renamed over the
  destination only when complete (os.replace), so a failed run leaves no half-written image.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import tempfile
import zlib

import numpy as np

from ..errors import SdrtError, UnsupportedError, UsageError

__all__ = [
    "c_float",
    "encode_image",
    "encode_png",
    "image_format",
    "metadata_json",
    "output_paths",
    "parameters_text",
    "read_png_text",
    "write_image",
]

_FMT_SPEC = re.compile(r"(?:[^%]|^)(?:%%)*(%\d{0,3}d)")


# ---- the sd-webui infotext --------------------------------------------------------------------

def c_float(v) -> str:
    """C++ std::to_string(float): printf "%f" of the float widened to double."""
    v = float(np.float32(v))
    if math.isnan(v):
        return "-nan" if math.copysign(1.0, v) < 0 else "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:f}"


def _basename(path) -> str:
    """sd.cpp's sd_basename: after the last '/', else after the last '\\'."""
    p = os.fspath(path) if path else ""
    for sep in ("/", "\\"):
        i = p.rfind(sep)
        if i >= 0:
            return p[i + 1:]
    return p


def _jnum(v):
    """A float as nlohmann stores it (C float widened to double); inf/nan dump as null."""
    f = float(np.float32(v))
    return f if math.isfinite(f) else None


def metadata_json(*, prompt, negative_prompt, seed, width, height, steps, eta, cfg_scale, img_cfg_scale,
                  guidance, method, scheduler, sigmas, clip_skip, strength, rng, sampler_rng, models,
                  vae_tiling=None, generator=("sdrt", "", ""), control_strength=0.9, slg=None,
                  flow_shift=math.inf) -> str:
    """The `SDCPP:` JSON of sd-cli's build_sdcpp_image_metadata_json (img_gen mode). `slg`:
    (scale, layers, start, end) of skip-layer guidance as requested (sd-cli writes its
    parameters whether or not the model uses them; None: sd-cli's defaults); `flow_shift`: the
    request's --flow-shift (inf, the default, is written as null, as nlohmann dumps sd-cli's INFINITY)."""
    scale, layers, start, end = slg if slg is not None else (0.0, [7, 8, 9], 0.01, 0.2)
    sampling = {
        "steps": int(steps), "eta": _jnum(eta), "shifted_timestep": 0, "flow_shift": _jnum(flow_shift),
        "guidance": {"txt_cfg": _jnum(cfg_scale), "img_cfg": _jnum(img_cfg_scale),
                     "distilled_guidance": _jnum(guidance),
                     "slg": {"scale": _jnum(scale), "layers": [int(i) for i in layers], "start": _jnum(start),
                             "end": _jnum(end)}},
        "custom_sigmas": [_jnum(s) for s in (sigmas or [])],
    }
    if method:
        sampling["method"] = method
    if scheduler:
        sampling["scheduler"] = scheduler
    root = {
        "schema": "sdcpp.image.params/v1", "mode": "img_gen",
        "generator": {"name": generator[0], "version": generator[1], "commit": generator[2]},
        "seed": int(seed), "width": int(width), "height": int(height),
        "prompt": {"positive": prompt, "negative": negative_prompt},
        "sampling": sampling,
        "models": {k: _basename(v) for k, v in models.items() if v} or None,
        "clip_skip": int(clip_skip), "strength": _jnum(strength), "control_strength": _jnum(control_strength),
        "auto_resize_ref_image": True, "increase_ref_index": False,
        "rng": rng,
    }
    if sampler_rng:
        root["sampler_rng"] = sampler_rng
    if vae_tiling and vae_tiling.get("enabled"):
        root["vae_tiling"] = {k: (_jnum(v) if isinstance(v, float) else v) for k, v in vae_tiling.items()}
    return json.dumps(root, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def parameters_text(*, prompt, negative_prompt="", steps, cfg_scale, guidance=3.5, eta=math.inf, seed, width,
                    height, model="", rng="cuda", sampler_rng=None, method, scheduler=None, sigmas=None,
                    clip_l="", clip_g="", diffusion_model="", vae="", taesd="", clip_skip=-1,
                    img_cfg_scale=math.inf, strength=0.75, vae_tiling=None, generator=None, lora_hashes=None,
                    control_net="", control_strength=0.9, hires=None, t5xxl="", slg=None, flow_shift=math.inf) -> str:
    """sd-cli's `get_image_params` for one image (seed = the image's own seed); `lora_hashes`
    ("name: hash, ...") adds A1111's `Lora hashes: "..."` field before Version; `slg` and
    `flow_shift` go to the SDCPP JSON (metadata_json)."""
    from .. import __version__
    generator = generator or ("sdrt", __version__, "")
    s = prompt + "\n"
    if negative_prompt:
        s += "Negative prompt: " + negative_prompt + "\n"
    s += f"Steps: {int(steps)}, CFG scale: {c_float(cfg_scale)}, "
    s += f"Guidance: {c_float(guidance)}, Eta: {c_float(eta)}, Seed: {int(seed)}, "
    s += f"Size: {int(width)}x{int(height)}, Model: {_basename(model)}, RNG: {rng}, "
    if sampler_rng:
        s += f"Sampler RNG: {sampler_rng}, "
    s += f"Sampler: {method}"
    if sigmas:
        s += ", Custom Sigmas: [" + ", ".join(f"{float(np.float32(v)):.4f}" for v in sigmas) + "]"
    elif scheduler:
        s += " " + scheduler
    s += ", "
    for te in (clip_l, clip_g, t5xxl):
        if te:
            s += f"TE: {_basename(te)}, "
    if diffusion_model:
        s += f"Unet: {_basename(diffusion_model)}, "
    if vae:
        s += f"VAE: {_basename(vae)}, "
    if clip_skip != -1:
        s += f"Clip skip: {int(clip_skip)}, "
    if hires:   # sd-cli's fields (std::to_string: 6 decimals)
        s += (f"Hires upscale: {hires['upscaler']}, Hires scale: {float(np.float32(hires['scale'])):.6f}, "
              f"Hires resize: {int(hires['width'])}x{int(hires['height'])}, Hires steps: {int(hires['steps'])}, "
              f"Denoising strength: {float(np.float32(hires['strength'])):.6f}, ")
    if lora_hashes:
        s += f'Lora hashes: "{lora_hashes}", '
    s += f"Version: {generator[0]}"
    models = {"model": model, "clip_l": clip_l, "clip_g": clip_g, "t5xxl": t5xxl, "diffusion_model": diffusion_model,
              "vae": vae, "taesd": taesd, "control_net": control_net}
    s += ", SDCPP: " + metadata_json(
        prompt=prompt, negative_prompt=negative_prompt, seed=seed, width=width, height=height, steps=steps, eta=eta,
        cfg_scale=cfg_scale, img_cfg_scale=img_cfg_scale, guidance=guidance, method=method, scheduler=scheduler,
        sigmas=sigmas, clip_skip=clip_skip, strength=strength, rng=rng, sampler_rng=sampler_rng, models=models,
        vae_tiling=vae_tiling, generator=generator, control_strength=control_strength, slg=slg, flow_shift=flow_shift)
    return s


# ---- encoders ---------------------------------------------------------------------------------

def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def _pixels(img) -> np.ndarray:
    a = np.asarray(img)
    if a.dtype != np.uint8:
        raise UsageError(f"image data must be uint8, got {a.dtype}")
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4) or a.shape[0] < 1 or a.shape[1] < 1:
        raise UsageError(f"image must be HxW, HxWx1, HxWx3 or HxWx4, got shape {a.shape}")
    return np.ascontiguousarray(a)


_SURROGATE = re.compile("[\ud800-\udfff]")


def text_bytes(text: str) -> bytes:
    """UTF-8 bytes of metadata text for a tEXt chunk / COM segment: a NUL would end the text early
    (readers stop at it), so it is written as the two characters \\0; surrogates (lone ones from the
    API, escapes of bytes that were not UTF-8) are written as U+FFFD: the chunk is always UTF-8."""
    return _SURROGATE.sub("\ufffd", text.replace("\x00", "\\0")).encode("utf-8")


_DEFLATE_STRIP = 1 << 20    # bytes of filtered rows below which one thread compresses


def deflate(data: bytes, level: int = 6) -> bytes:
    """zlib.compress(data, level), in strips on the -t threads when large (zlib releases the GIL):
    each strip is raw deflate primed with the 32 KiB before it as its dictionary and ended by a
    sync flush on a byte boundary, so the strips join into one deflate stream (as pigz makes it),
    framed with zlib's header and the whole data's Adler-32. Within a few bytes of one stream's size."""
    from ..ops.threads import get_threads, map_threads
    n = len(data)
    k = min(get_threads(), n // _DEFLATE_STRIP)
    if k <= 1:
        return zlib.compress(data, level)
    step, view = -(-n // k), memoryview(data)

    def strip(i):
        end = min(i + step, n)
        c = zlib.compressobj(level, zlib.DEFLATED, -15, zdict=view[max(0, i - 32768):i]) if i else \
            zlib.compressobj(level, zlib.DEFLATED, -15)
        return c.compress(view[i:end]) + c.flush(zlib.Z_FINISH if end == n else zlib.Z_SYNC_FLUSH)
    return b"".join([b"\x78\x9c", *map_threads(strip, range(0, n, step)), struct.pack(">I", zlib.adler32(data))])


def encode_png(img, parameters: str | None = None, level: int = 6) -> bytes:
    """PNG bytes of an HxWxC uint8 array, with the `parameters` tEXt chunk after IHDR (stb order)."""
    a = _pixels(img)
    h, w, c = a.shape
    ctype = {1: 0, 3: 2, 4: 6}[c]
    # filter byte 2 ("up") on every row: one vectorized diff, compresses smooth images well
    rows = a.reshape(h, w * c)
    up = rows.copy()
    up[1:] = rows[1:] - rows[:-1]           # uint8 wrap-around is what the filter means
    raw = np.empty((h, w * c + 1), np.uint8)
    raw[:, 0] = 2
    raw[0, 0] = 0
    raw[0, 1:] = rows[0]
    raw[1:, 1:] = up[1:]
    out = [b"\x89PNG\r\n\x1a\n", _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, ctype, 0, 0, 0))]
    if parameters:
        out.append(_chunk(b"tEXt", b"parameters\x00" + text_bytes(parameters)))
    out.append(_chunk(b"IDAT", deflate(raw.tobytes(), level)))
    out.append(_chunk(b"IEND", b""))
    return b"".join(out)


def read_png_text(data: bytes) -> dict[str, str]:
    """The tEXt chunks of PNG bytes, {keyword: text} (text decoded as UTF-8, as sd-cli writes it)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SdrtError("not a PNG file")
    out, pos = {}, 8
    while pos + 8 <= len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        tag = data[pos + 4: pos + 8]
        body = data[pos + 8: pos + 8 + n]
        if tag == b"tEXt" and b"\x00" in body:
            k, v = body.split(b"\x00", 1)
            out[k.decode("latin-1")] = v.decode("utf-8", "replace")
        if tag == b"IEND":
            break
        pos += 12 + n
    return out


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise UnsupportedError("JPEG and WebP output need Pillow (pip install pillow); "
                               "PNG output needs nothing") from None
    return Image


def _xml_escape(s: str) -> str:
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
            .replace("'", "&apos;"))


def _xmp(parameters: str) -> bytes:
    return ('<?xpacket begin="" id="W5M0MpCehiHzreSzNTczkc9d"?>\n<x:xmpmeta xmlns:x="adobe:ns:meta/">\n'
            '  <rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">\n'
            '    <rdf:Description xmlns:sdcpp="https://github.com/leejet/stable-diffusion.cpp/ns/1.0/">\n'
            f"      <sdcpp:parameters>{_xml_escape(parameters)}</sdcpp:parameters>\n"
            "    </rdf:Description>\n  </rdf:RDF>\n</x:xmpmeta>\n"
            '<?xpacket end="w"?>').encode("utf-8", "surrogateescape")


def image_format(path) -> str:
    """'jpeg', 'png', 'webp' or 'unknown' from the extension (sd-cli's encoded_image_format_from_path)."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    return {".jpg": "jpeg", ".jpeg": "jpeg", ".jpe": "jpeg", ".png": "png", ".webp": "webp"}.get(ext, "unknown")


def encode_image(img, fmt: str, parameters: str | None = None, quality: int = 90) -> bytes:
    """Encoded bytes in 'png', 'jpeg' or 'webp' (`quality` 1-100 for the lossy two)."""
    if fmt == "png":
        return encode_png(img, parameters)
    if fmt not in ("jpeg", "webp"):
        raise UsageError(f"unknown image format {fmt!r}")
    if not 1 <= int(quality) <= 100:
        raise UsageError(f"--compression-quality: must be in [1, 100], got {quality}")
    a = _pixels(img)
    Image = _pil()
    im = Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)
    buf = io.BytesIO()
    if fmt == "jpeg":
        kw = {}
        if parameters:
            kw["comment"] = b"parameters\x00" + text_bytes(parameters)[:65520] + b"\x00"
        im.convert("RGB" if a.shape[2] != 1 else "L").save(buf, "JPEG", quality=int(quality), **kw)
    else:
        kw = {"xmp": _xmp(parameters)} if parameters else {}
        im.save(buf, "WEBP", quality=int(quality), **kw)
    return buf.getvalue()


def _atomic_write(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_image(path, img, parameters: str | None = None, quality: int = 90) -> str:
    """Encode by extension (unknown -> PNG bytes) and write atomically; returns the path."""
    path = os.fspath(path)
    fmt = image_format(path)
    data = encode_image(img, "png" if fmt == "unknown" else fmt, parameters, quality)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        _atomic_write(path, data)
    except OSError as e:
        raise SdrtError(f"cannot write '{path}': {e.strerror or e}") from None
    return path


def _format_idx(pattern: str, idx: int) -> str:
    """sd-cli's format_frame_idx: expand every %d / %0Nd, then '%%' -> '%'."""
    out = pattern
    while True:
        m = _FMT_SPEC.search(out)
        if not m:
            break
        spec = m.group(1)
        out = out[:m.start(1)] + (spec % idx) + out[m.end(1):]
    return out.replace("%%", "%")


def output_paths(output, n: int, begin_idx: int = -1) -> list[str]:
    """The file names sd-cli's save_results writes n images to.

    `out.png` -> out.png (n = 1) or out_0.png, out_1.png ...; `out_%03d.png` -> out_000.png ...;
    an unknown extension gets `.png` appended (`out.bmp` -> `out.bmp.png`)."""
    output = os.fspath(output)
    if not output:
        raise UsageError("-o/--output: the output path is empty")
    begin = 0 if begin_idx < 0 else int(begin_idx)
    root, ext = os.path.splitext(output)
    fmt = image_format(output)
    base = root if ext and (fmt != "unknown" or ext.lower() in (".avi", ".webm")) else output
    if fmt == "unknown":
        ext = ".png"
    if _FMT_SPEC.search(output):
        return [_format_idx(base + ext, begin + i) for i in range(n)]
    if n == 1:
        return [base + ext]
    return [f"{base}_{begin + i}{ext}" for i in range(n)]
