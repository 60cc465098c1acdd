"""Limits on a generation request, checked before anything is loaded (docs/model-files.md, "Limits").

sd-cli checks almost nothing here: `-W 100000 -H 100000` or `--steps 2**40` end in an allocation
failure or a run that never finishes. sdrt refuses such requests up front with a `UsageError`
naming the flag, the value and the limit. The same functions serve the CLI (through
`GenParams.validate()`), the Python API and the HTTP server (which passes the memory of the
backend it will run on as `capacity`).

- width/height: 1..MAX_SIDE pixels each;
- width x height (and batch): the estimated peak memory of one image (`activation_bytes`: the
  UNet's activations at latent size, the VAE decoder's at full size, or per tile with
  --vae-tiling) plus the decoded images the batch keeps must fit `capacity` (default: the
  host's physical memory);
- steps <= MAX_STEPS, batch_count <= MAX_BATCH;
- prompt and negative prompt <= MAX_PROMPT_BYTES bytes of UTF-8 (CLIP's BPE makes at most one
  token per byte, so this also bounds the tokens, and the 77-token chunks the text encoder runs);
- cfg_scale, strength, guidance, vae_tile_overlap finite; img_cfg_scale and eta finite or +inf
  (their "unset" sentinel); NaN never;
- output paths (`check_output_paths`, from the CLI before loading): a real file name, its first
  existing folder writable, not a directory or a non-regular file;
- text: invalid UTF-8 from the command line (Python keeps it as surrogate escapes) and lone
  surrogates from the API become U+FFFD, as sd-cli's byte strings show them.

After sampling, `check_latent` stops a run whose latent holds NaN/Inf (it would decode to a
black image reported as success); `check_image` refuses an all-NaN decoded image and warns on a
partly NaN one. `quiet_numerics` keeps numpy's RuntimeWarnings off stderr during a generation
(the checks above report the problem once, clearly).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import stat
import warnings

from ..errors import SdrtError, UsageError

__all__ = ["MAX_SIDE", "MAX_STEPS", "MAX_BATCH", "MAX_PROMPT_BYTES", "NonFiniteResultError", "activation_bytes",
           "capacity_bytes", "check_request", "check_output_paths", "check_latent", "check_image", "clean_text",
           "printable", "quiet_numerics"]

log = logging.getLogger("sdrt")

MAX_SIDE = 16384                 # pixels per side (sd.cpp's server advertises 64..4096)
MAX_STEPS = 10_000
MAX_BATCH = 10_000
MAX_PROMPT_BYTES = 32_768        # UTF-8 bytes per prompt; >= the token count
_GiB = 1 << 30
_SURROGATE = re.compile("[\ud800-\udfff]")


class NonFiniteResultError(SdrtError):
    """A generation produced NaN/Inf values (the image would be black or garbage)."""


def activation_bytes(width: int, height: int, vae_tiling: bool = False, tile: int = 512) -> int:
    """Estimated peak working memory (bytes) of generating one width x height image.

    The UNet runs at 1/8 size with cond+uncond in one pass: ~320-1280 channels of float32, about
    15 KiB per latent pixel with its live temporaries. The VAE decoder runs at full size: 128-512
    channels, ~2 KiB per output pixel (per tile pixel with --vae-tiling). Plus 256 MiB fixed."""
    lat = -(-width // 8) * -(-height // 8)
    unet = 2 * lat * 15 * 1024
    pixels = min(width, tile) * min(height, tile) if vae_tiling else width * height
    vae = pixels * 2048
    return max(unet, vae) + (256 << 20)


def capacity_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The host's physical memory (MemTotal), or 1 TiB when it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 40


def _finite(flag: str, v, allow_inf: bool = False) -> None:
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{flag}: must be a number, got {v!r}") from None
    if math.isnan(x) or (math.isinf(x) and not (allow_inf and x > 0)):
        raise UsageError(f"{flag}: must be a finite number, got {v}")


def clean_text(s, flag: str) -> str:
    """Valid text for a prompt: command-line bytes that were not UTF-8 (surrogate escapes) and lone
    surrogates become U+FFFD; too long a prompt is a UsageError."""
    if not isinstance(s, str):
        raise UsageError(f"{flag}: must be a string, got {type(s).__name__}")
    try:
        b = s.encode("utf-8")
    except UnicodeEncodeError:
        try:   # argv bytes that were not UTF-8: back to bytes, each bad sequence one U+FFFD
            s = s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        except UnicodeEncodeError:
            s = _SURROGATE.sub("\ufffd", s)
        b = s.encode("utf-8")
    if len(b) > MAX_PROMPT_BYTES:
        raise UsageError(f"{flag}: {len(b)} bytes, at most {MAX_PROMPT_BYTES} are supported")
    return s


def printable(text) -> str:
    """Text safe for any stream: surrogates (bytes of argv that were not UTF-8, lone surrogates from
    the API) become backslash escapes instead of a UnicodeEncodeError while reporting an error."""
    text = str(text)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def check_request(gp, capacity: int | None = None) -> None:
    """Check a GenParams against the limits above (UsageError naming the flag). Cleans the prompt
    texts in place (see clean_text)."""
    gp.prompt = clean_text(gp.prompt, "-p/--prompt")
    gp.negative_prompt = clean_text(gp.negative_prompt, "-n/--negative-prompt")
    for flag, v in (("-W/--width", gp.width), ("-H/--height", gp.height), ("--steps", gp.steps),
                    ("-b/--batch-count", gp.batch_count)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise UsageError(f"{flag}: must be an integer, got {v!r}")
    for flag, v in (("-W/--width", gp.width), ("-H/--height", gp.height)):
        if v > MAX_SIDE:
            raise UsageError(f"{flag}: {v} pixels, at most {MAX_SIDE} are supported")
    if gp.sigmas is None and gp.steps > MAX_STEPS:
        raise UsageError(f"--steps: {gp.steps}, at most {MAX_STEPS} are supported")
    if gp.sigmas is not None and len(gp.sigmas) > MAX_STEPS + 1:
        raise UsageError(f"--sigmas: {len(gp.sigmas)} values, at most {MAX_STEPS + 1} are supported")
    if gp.batch_count > MAX_BATCH:
        raise UsageError(f"-b/--batch-count: {gp.batch_count}, at most {MAX_BATCH} are supported")
    _finite("--cfg-scale", gp.cfg_scale)
    _finite("--img-cfg-scale", gp.img_cfg_scale, allow_inf=True)
    _finite("--guidance", gp.guidance)
    _finite("--eta", gp.eta, allow_inf=True)
    _finite("--strength", gp.strength)
    _finite("--vae-tile-overlap", gp.vae_tile_overlap)
    w, h = gp.resolved_size()
    cap = capacity if capacity is not None else capacity_bytes()
    tile = max(max(gp.vae_tile_size or (0, 0)), 512)
    need = activation_bytes(w, h, gp.vae_tiling, tile) + gp.batch_count * w * h * 3
    if need > cap:
        raise UsageError(f"-W/-H: {w}x{h} (batch {gp.batch_count}) needs about {need / _GiB:.1f} GiB of working "
                         f"memory, the backend has {cap / _GiB:.1f} GiB; use a smaller size"
                         f"{'' if gp.vae_tiling else ' or --vae-tiling'}")


def check_output_paths(paths) -> None:
    """Every output path is a real file name in a writable folder, checked before any model is
    loaded (`-o dir/` must not become `dir/.png`, an unwritable -o must not cost a generation)."""
    for p in paths:
        p = os.fspath(p)
        folder, base = os.path.split(p)
        if not base or base.lower() in (".png", ".jpg", ".jpeg", ".webp", ".avi", ".webm"):
            example = os.path.join(folder, "out.png")
            raise UsageError(f"-o/--output: '{p}' has no file name (give one, e.g. '{example}')")
        folder = folder or "."
        existing = folder                  # the image writer creates missing folders: check the first that exists
        while not os.path.lexists(existing):
            parent = os.path.dirname(existing.rstrip(os.sep)) or "."
            if parent == existing:
                break
            existing = parent
        if not os.path.isdir(existing):
            raise UsageError(f"-o/--output: '{existing}' is not a folder, cannot hold '{p}'")
        if os.path.lexists(p):
            try:
                st = os.stat(p)
            except OSError as e:
                raise UsageError(f"-o/--output: '{p}': {e.strerror}") from None
            if stat.S_ISDIR(st.st_mode):
                raise UsageError(f"-o/--output: '{p}' is a directory; give a file name")
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"-o/--output: '{p}' is not a regular file")
            if not os.access(p, os.W_OK):
                raise UsageError(f"-o/--output: '{p}' is not writable")
        elif not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"-o/--output: folder '{existing}' is not writable")


def check_latent(x, seed: int) -> None:
    """Stop a run whose sampled latent holds NaN/Inf (sd.cpp would decode it to a black image)."""
    import numpy as np
    x = np.asarray(x)
    bad = x.size - int(np.count_nonzero(np.isfinite(x)))
    if bad:
        raise NonFiniteResultError(
            f"sampling produced {bad} non-finite values (NaN/Inf) of {x.size} in the latent of seed {seed}; "
            "the image would be black. Check --cfg-scale, --eta, prompt weights like ((((x)))) and the model")


def check_image(img, what: str = "decoded image") -> None:
    """An all-NaN decoded image is an error; a partly NaN one is a loud warning (sd.cpp warns)."""
    import numpy as np
    img = np.asarray(img)
    finite = int(np.count_nonzero(np.isfinite(img)))
    if finite == 0:
        raise NonFiniteResultError(f"the {what} is entirely NaN/Inf (the VAE overflowed?); nothing was saved")
    if finite < img.size:
        log.warning("the %s has %d non-finite values (NaN/Inf); they are written as black", what, img.size - finite)


def quiet_numerics(fn):
    """Decorator: run fn with numpy floating-point warnings off (check_latent/check_image report
    the result once, clearly, instead of RuntimeWarning lines on stderr). np.errstate is per thread;
    warnings.catch_warnings is process-wide (a threaded server should install the filter once)."""
    @functools.wraps(fn)
    def run(*a, **kw):
        import numpy as np
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return fn(*a, **kw)
    return run
