"""Which model is this? From tensor names and shapes alone, as stable-diffusion.cpp's
`ModelLoader::get_sd_version` tells it; plus per-component dtype statistics and the prediction type.

Input: a ModelFile, or a dict name -> Tensor (shape from `.ne`, ggml order) or name -> shape
(a tuple in numpy/torch order, e.g. (320, 4, 3, 3)); data is never read. Names are the canonical
ones (`model.diffusion_model.`, `first_stage_model.`, `cond_stage_model.`, `conditioner.`,
`text_encoders.`), or a raw diffusers table (`unet.`, `vae.`, `te.`), as sd.cpp accepts both.
A table with none of these prefixes is a bare diffusion model (`--diffusion-model` file): its
names are looked at under `model.diffusion_model.`, as sd.cpp prefixes them.

How: one pass collects the few facts any rule needs (`Facts`); the rules themselves belong to
the families (sdrt.models.families: each record lists its (order, rule) pairs; the modules of
FAMILY_MODULES hold them), tried in sd.cpp's order, first match wins.
Versions are short strings (`sd1`, `sdxl_inpaint`, ...); `family(version)` names their family.
The version constants (`SD1`, `FLUX`, ...) are those modules' and readable here too.
"""
from __future__ import annotations

from collections import Counter
from ..models.facts import DM, Facts, dim, facts

__all__ = ["detect_version", "family", "is_unet", "dtype_stats", "prediction_type", "default_flow_shift",
           "component_of", "Facts", "dim", "facts", "VERSIONS", "UNKNOWN"]

UNKNOWN = "unknown"



def _registry():
    from ..models import families   # the families register their rules; io only reads them
    return families


def __getattr__(name):
    """SD1, SDXL_INPAINT, FLUX ... (the version constants of the family modules) and VERSIONS."""
    if name == "VERSIONS":
        return tuple(v for f in _registry().families() for v in f.versions) + (UNKNOWN,)
    if name.isupper():
        reg = _registry()
        reg.families()
        import sys
        for mod in reg.FAMILY_MODULES:
            if hasattr(sys.modules.get(mod), name):
                return getattr(sys.modules[mod], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family(version: str) -> str:
    """'sd1', 'sd2', 'sdxl', 'sd3', 'flux', 'flux2', 'wan', 'qwen_image', ... or 'unknown'."""
    return _registry().family_of(version).name


def is_unet(version: str) -> bool:
    """Whether the version's family names its text encoders SD-style (`cond_stage_model.`)."""
    return _registry().family_of(version).te_layout == "unet"


# ---- facts: one pass over the names -------------------------------------------------------------



def detect_version(tensors) -> str:
    """The model version (a registered family's version) from names and shapes; 'unknown' if
    no family's rule matches."""
    f = facts(tensors)
    for _, rule in _registry().detection_rules():
        v = rule(f)
        if v is not None:
            return v
    return UNKNOWN


# ---- dtype statistics -----------------------------------------------------------------------------

# never loaded by sd.cpp (training leftovers, buffers recomputed at run time)
UNUSED_PREFIXES = (
    "betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
    "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
    "cond_stage_model.transformer.text_model.embeddings.position_ids",
    "cond_stage_model.1.model.text_model.embeddings.position_ids",
    "cond_stage_model.transformer.vision_model.embeddings.position_ids", "cond_stage_model.model.logit_scale",
    "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
    "conditioner.embedders.0.model.logit_scale", "conditioner.embedders.1.model.logit_scale",
    "model.diffusion_model.time_embedding.cond_proj.weight", "unet.time_embedding.cond_proj.weight",
    "model_ema.decay", "model_ema.num_updates", "model_ema.diffusion_model", "embedding_manager", "denoiser.sigmas",
    "text_encoders.t5xxl.transformer.encoder.embed_tokens.weight", "ztsnr", "edm_vpred.sigma_min",
    "text_encoders.llm.output.weight", "text_encoders.llm.lm_head.")


def component_of(name: str) -> str:
    """'diffusion_model', 'vae', 'text_encoders' or 'other' for a tensor name (sd.cpp's split)."""
    if name.startswith(("model.diffusion_model.", "unet.", "transformer.")):
        return "diffusion_model"
    if name.startswith(("first_stage_model.", "vae.", "tae.")):
        return "vae"
    if any(p in name for p in ("text_encoders", "cond_stage_model", "te.text_model.", "conditioner")) \
            or name.startswith(("te.", "te1.", "te2.", "te3.", "text_encoder")):
        return "text_encoders"
    return "other"


def dtype_stats(tensors) -> dict[str, dict[str, int]]:
    """{component: {dtype name: count}} over the tensors sd.cpp would load (see component_of)."""
    table = getattr(tensors, "tensors", tensors)
    out: dict[str, Counter] = {}
    for name, t in table.items():
        if name.startswith(UNUSED_PREFIXES):
            continue
        dt = getattr(t, "dtype", None)
        out.setdefault(component_of(name), Counter())[getattr(dt, "name", str(dt))] += 1
    return {k: dict(v) for k, v in out.items()}


# ---- prediction type -------------------------------------------------------------------------------

def prediction_type(model_file, version: str | None = None) -> str | None:
    """'eps', 'v', 'edm_v', 'flow' (SD3-style discrete flow), 'flux_flow', 'sefi_flow' or
    'minit2i_flow', as sd.cpp chooses it without a --prediction flag; None when the file does not
    say (SD2.x: sd.cpp then runs the UNet once to tell eps from v — that is the engine's job).
    The family decides (SD: marker tensors, then metadata; see sdrt.models.sd.sd_prediction)."""
    table = getattr(model_file, "tensors", model_file)
    meta = getattr(model_file, "metadata", {}) or {}
    version = version or detect_version(table)
    return _registry().family_of(version).prediction_of(table, meta, version)


def default_flow_shift(version: str, tensors=None) -> float | None:
    """sd.cpp's default flow shift for flow models (the family's; Flux with a guidance embedder
    1.15, without 1.0); None for eps/v models."""
    fam = _registry().family_of(version)
    if fam.prediction_of({}, {}, version) not in ("flow", "flux_flow"):
        return None
    return fam.flow_shift_of(version, tensors)
