"""`sdrt.generate(...)`: image generation from Python, the same engine the CLI runs.

    import sdrt
    images = sdrt.generate("a lovely cat", model="v1-5-pruned-emaonly.safetensors",
                           width=512, height=512, steps=20, seed=42)
    images[0].info["parameters"]                    # PIL images carrying the sd-webui infotext
    sdrt.generate("a cat", model=..., save="out_%03d.png")   # also write PNGs with the metadata chunk

Keyword arguments are sd-cli's flags in snake_case: model files and context settings go to
`ModelParams` (model, diffusion_model, vae, taesd, clip_l, clip_g, embd_dir, lora_model_dir,
lora_apply_mode, type,
tensor_type_rules, rng, sampler_rng, prediction, threads; placement: backend, params_backend,
offload_to_cpu, max_vram, disable_prefetch, disable_segmented_compute, auto_fit, clip_on_cpu,
vae_on_cpu — docs/residency.md; control_net, control_net_cpu — docs/controlnet.md; upscale_model,
hires_upscalers_dir — docs/upscale.md), everything else to `GenParams`
(prompt, negative_prompt, width, height, steps, cfg_scale, img_cfg_scale, sampling_method,
scheduler, sigmas, eta, seed, batch_count, clip_skip, init_image, strength, mask_image,
vae_tiling, vae_tile_size, vae_tile_overlap, vae_relative_tile_size, control_image,
control_strength, canny, loras; upscale_repeats, upscale_tile_size, hires, hires_upscaler,
hires_scale, hires_width, hires_height, hires_steps, hires_denoising_strength,
hires_upscale_tile_size — docs/upscale.md). `init_image` / `mask_image` / `control_image` take a
path, a PIL image or a uint8 array. LoRAs: `<lora:name:mult>` in the prompt
(resolved in lora_model_dir, default "."), and/or `loras=[(path, multiplier), ...]` (docs/lora.md).

The loaded `Pipeline` is kept and reused while the model arguments stay the same (weights are
memory-mapped; the graphs of the models are built once per shape). `load_pipeline(...)` gives
you the object itself; `Pipeline.generate(GenParams(...))` returns `GeneratedImage`s.

`output`: "pil" (default: PIL.Image with info["parameters"] and info["seed"]), "numpy" (HxWx3
uint8 arrays), "latent" ([1, 4, h, w] float32 latents before the VAE) or "result" (the
GeneratedImage records). `save=` a path (`%03d` allowed) also writes the files as the CLI does.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import fields

from ..errors import UsageError
from .params import GenParams, ModelParams

__all__ = ["clear_cache", "generate", "load_pipeline"]

_MODEL_KEYS = {f.name for f in fields(ModelParams)}
_GEN_KEYS = {f.name for f in fields(GenParams)}
_cache: dict = {}
_lock = threading.Lock()


def _split(kwargs: dict) -> tuple[dict, dict]:
    model, gen = {}, {}
    for k, v in kwargs.items():
        if k in _MODEL_KEYS:
            model[k] = v
        elif k in _GEN_KEYS:
            gen[k] = v
        else:
            raise UsageError(f"sdrt.generate: unknown argument {k!r}; model arguments: {', '.join(sorted(_MODEL_KEYS))}; "
                             f"generation arguments: {', '.join(sorted(_GEN_KEYS))}")
    return model, gen


def load_pipeline(**model_kwargs):
    """A Pipeline for these model arguments (cached: the same arguments give the same object)."""
    from .pipeline import Pipeline
    bad = set(model_kwargs) - _MODEL_KEYS
    if bad:
        raise UsageError(f"load_pipeline: unknown argument(s) {', '.join(sorted(bad))}; valid: {', '.join(sorted(_MODEL_KEYS))}")
    mp = ModelParams(**model_kwargs)
    key = tuple(sorted((k, repr(v)) for k, v in model_kwargs.items()))
    with _lock:
        pipe = _cache.get(key)
        if pipe is None:
            if mp.threads != -1:
                from ..ops.threads import set_threads
                set_threads(mp.threads)
            _cache.clear()            # one model at a time: the previous one's mappings are dropped
            import sdrt
            if sdrt._blas_spin_late:
                logging.getLogger("sdrt").info(
                    "numpy was imported before sdrt, so OpenBLAS's threads keep spinning after each call "
                    "(about 15%% slower sampling on 2 cores): import sdrt first, or set OPENBLAS_THREAD_TIMEOUT=4")
            pipe = _cache[key] = Pipeline.load(mp)
        return pipe


def clear_cache() -> None:
    """Forget the cached pipeline (its files are unmapped when nothing else holds them)."""
    with _lock:
        _cache.clear()


def generate(prompt: str = "", *, output: str = "pil", save=None, compression_quality: int = 90,
             progress=None, pipeline=None, **kwargs):
    """Generate `batch_count` images; see the module docstring for the arguments."""
    model_kw, gen_kw = _split(kwargs)
    gp = GenParams(prompt=prompt, **gen_kw)
    if output not in ("pil", "numpy", "latent", "result"):
        raise UsageError(f"sdrt.generate: output must be 'pil', 'numpy', 'latent' or 'result', got {output!r}")
    if pipeline is None:
        if not (model_kw.get("model") or model_kw.get("diffusion_model")):
            raise UsageError("sdrt.generate: give model= (a checkpoint) or diffusion_model=")
        pipeline = load_pipeline(**model_kw)
    elif model_kw:
        raise UsageError(f"sdrt.generate: pass either pipeline= or model arguments ({', '.join(model_kw)}), not both")
    results = pipeline.generate(gp, progress=progress, show_progress=progress is None, lora_tags=True)
    if save is not None:
        from ..io.png import output_paths, write_image
        for r, path in zip(results, output_paths(save, len(results))):
            write_image(path, r.image, r.parameters if gp.embed_metadata else None, compression_quality)
    if output == "result":
        return results
    if output == "numpy":
        return [r.image for r in results]
    if output == "latent":
        return [r.latent for r in results]
    try:
        from PIL import Image
    except ImportError:
        raise UsageError("sdrt.generate: output='pil' needs Pillow; use output='numpy'") from None
    out = []
    for r in results:
        im = Image.fromarray(r.image)
        im.info["parameters"] = r.parameters
        im.info["seed"] = r.seed
        out.append(im)
    return out
