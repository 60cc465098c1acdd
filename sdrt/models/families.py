"""The model-family registry: one `Family` record per family, everything else derived from it.

A family is one unit: the versions it covers and the rule that tells them apart from tensor
names and shapes; the text-encoder components and the CLI flags that feed them; how its
diffusers / original names become sdrt's canonical names; its conditioner and diffusion model;
its latent channels and VAE scale/shift; its prediction type, default sampler and scheduler; and
the modes it runs. The pipeline, the model manager, name conversion, detection and the CLI read
these records and never name a family (docs/adding-a-family.md walks through adding one).

Families are registered by the modules listed in `FAMILY_MODULES` (imported on first lookup):
`sdrt.models.sd` (SD 1.x / 2.x / XL, runnable) and `sdrt.models.recognized` (families sdrt
detects and reports but does not run yet: their records have no diffusion model).

Names: a *version* is what detection returns ("sd1_inpaint", "sdxl_ssd1b"); a *family* groups
versions that share one record ("sd1"). `family_of(version)` maps the first to the second.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import UnsupportedError, UsageError

__all__ = ["Component", "Cond", "Family", "Variant", "ALL_MODES", "COMMON_ROLES", "FAMILY_MODULES", "UNKNOWN",
           "component", "components", "detection_rules", "families", "family_of", "get_family", "register_component",
           "register_family", "runnable_families"]

UNKNOWN = "unknown"
ALL_MODES = frozenset({"txt2img", "img2img", "inpaint", "edit", "ref_images"})
# modules whose import registers families (order = registration order)
FAMILY_MODULES = ["sdrt.models.sd", "sdrt.models.recognized", "sdrt.models.flux", "sdrt.models.sd3",
                  "sdrt.models.zimage", "sdrt.models.qwen_image"]


# ---- what the conditioner hands the diffusion model ----------------------------------------------

@dataclass
class Cond:
    """One conditioning of a diffusion-model call (all arrays float32, batch 1 or N):
    context [N, L, D] (cross-attention / text tokens), y [N, adm] (pooled vector: SDXL's ADM,
    Flux's CLIP-L pooled), c_concat [N, Cc, h, w] (latents joined to x on channels: inpaint,
    pix2pix, Flux Fill), ref_latents (reference-image latents: Kontext, Qwen edit), guidance
    (the distilled-guidance scalar, Flux dev), ref_index_mode (the RoPE index of reference
    tokens: fixed, increase, decrease). A model refuses a field it cannot take."""
    context: np.ndarray | None = None
    y: np.ndarray | None = None
    c_concat: np.ndarray | None = None
    ref_latents: tuple = ()
    guidance: float | None = None
    ref_index_mode: str = "fixed"

    _ARRAYS = ("context", "y", "c_concat")

    def shape_key(self) -> tuple:
        """Equal keys batch into one call."""
        return tuple(None if getattr(self, k) is None else getattr(self, k).shape for k in self._ARRAYS) + (
            tuple(r.shape for r in self.ref_latents), self.guidance, self.ref_index_mode)

    @classmethod
    def batch(cls, conds: list[Cond]) -> Cond:
        """N conditionings of equal shape_key -> one of batch N (arrays joined on axis 0)."""
        first = conds[0]
        kw = {k: None if getattr(first, k) is None else np.concatenate([getattr(c, k) for c in conds], 0)
              for k in cls._ARRAYS}
        refs = tuple(np.concatenate([c.ref_latents[i] for c in conds], 0) for i in range(len(first.ref_latents)))
        return cls(**kw, ref_latents=refs, guidance=first.guidance, ref_index_mode=first.ref_index_mode)


# ---- components: the files a context is built from ----------------------------------------------

@dataclass(frozen=True)
class Component:
    """One role a standalone file can fill (`--clip_l FILE`, `--t5xxl FILE`, ...).

    role: the ModelParams / LoadedModels.paths key ("clip_l"); flag: its CLI flag; what: how the
    load log names it; help: the CLI help; strip: wrapper prefixes a standalone file may carry
    (removed before the canonical prefix is added); prefix: {text-encoder layout: canonical prefix}
    ("unet": SD-style `cond_stage_model.` names, "dit": `text_encoders.` names); replaces: the
    canonical prefixes whose tensors a given file replaces in the merged table."""
    role: str
    flag: str
    what: str
    help: str
    strip: tuple[str, ...]
    prefix: dict
    replaces: tuple[str, ...]

    def prefix_for(self, layout: str) -> str:
        return self.prefix.get(layout) or next(iter(self.prefix.values()))


DM, VAE_PREFIX, TAE_PREFIX = "model.diffusion_model.", "first_stage_model.", "tae."
# the roles every family has (not text encoders); their flags are the CLI's fixed model flags
COMMON_ROLES = {
    "model": Component("model", "-m/--model", "model", "", (), {}, ()),
    "diffusion_model": Component("diffusion_model", "--diffusion-model", "diffusion model", "",
                                 (DM, "model.", "unet.", "diffusion_model."), {"any": DM}, (DM,)),
    "vae": Component("vae", "--vae", "vae", "", (VAE_PREFIX, "vae."), {"any": "vae."}, (VAE_PREFIX,)),
    "taesd": Component("taesd", "--taesd", "tae", "", (TAE_PREFIX,), {"any": TAE_PREFIX}, (TAE_PREFIX,)),
}
_COMPONENTS: dict[str, Component] = {}


def register_component(c: Component) -> Component:
    """Register a text-encoder role (once: two families sharing clip_l share one record)."""
    old = _COMPONENTS.get(c.role)
    if old is not None and old != c:
        raise ValueError(f"component {c.role!r} registered twice with different records")
    _COMPONENTS[c.role] = c
    return c


def components() -> dict[str, Component]:
    """The registered text-encoder roles, in registration order."""
    _load()
    return dict(_COMPONENTS)


def component(role: str) -> Component:
    _load()
    c = COMMON_ROLES.get(role) or _COMPONENTS.get(role)
    if c is None:
        raise UsageError(f"unknown model component {role!r}; known: {', '.join([*COMMON_ROLES, *_COMPONENTS])}")
    return c


# ---- the family record ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """What one version changes within its family.
    concat: None, or `(inpaint | edit)`, the concat-latent kind its diffusion model takes
    (`Family.concat_builders[kind]` makes them); vae_encode: "sample" (moments sampled with the
    context RNG, then scaled) or "mean" (the unscaled mean: sd.cpp's SD 1.x pix2pix case)."""
    concat: str | None = None
    vae_encode: str = "sample"


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring). Only `name` and `versions` are required; a
    record without `diffusion_model` is recognized (detected, reported) but not run."""
    name: str
    versions: dict                                   # version -> Variant
    description: str = ""
    # detection: ((order, rule), ...): rule(facts) -> a version or None; all families' rules are
    # tried in ascending order (sd.cpp's order: marker tensors first, then the shape rules)
    detect: tuple = ()
    # components: text-encoder roles (registered Components) and how this family names them
    text_encoders: tuple[str, ...] = ()
    te_layout: str = "dit"                           # "unet": cond_stage_model.* ; "dit": text_encoders.*
    # names: diffusion-model tensor names (after the `model.diffusion_model.` prefix) -> canonical
    convert_diffusion_name: Callable[[str, str, Any], str] | None = None
    unet_layout: tuple | None = None                 # diffusers UNet layout hint (layers per block, up blocks w/ attn)
    diffusers_te_prefixes: dict = field(default_factory=dict)  # e.g. {"te1.": "text_encoders.clip_l.transformer."}
    # models
    conditioner: Callable | None = None              # (table, version, embd_dir=, backend=) -> .encode(...)
    diffusion_model: Callable | None = None          # (tensors, prefix, source[, model_args]) -> .predict(x, t, Cond, backend=)
    # (tensors, prefix, source) -> .decode/.encode as AutoencoderKL's; None: AutoencoderKL. A VAE with
    # to_diffusion / from_diffusion maps its latents itself (Qwen-Image's per-channel mean/std)
    vae: Callable | None = None
    # latent space
    latent_channels: int = 4
    vae_scale_factor: int = 8                        # pixels per latent
    size_multiple: int = 64                          # request sizes align up to this (VAE x model down factor)
    latent_scale: float | None = None
    latent_shift: float = 0.0
    ref_image_multiple: int = 16                     # -r images resize to sides of this multiple (sd.cpp)
    # sampling
    prediction: str | Callable | None = None         # str, or (table, metadata, version) -> str | None
    probe_prediction: Callable | None = None         # (diffusion_model, version, call) -> prediction
    flow_shift: float | dict | Callable | None = None  # float, {version: shift} or (version, table) -> shift
    default_sampler: str = "euler"
    default_scheduler: str = "discrete"
    default_eta: float | None = None                 # overrides the sampler's default eta (HiDream-O1: 8)
    ays_levels: str | None = None                    # key of the AYS noise levels this family uses
    # conditioning rules and modes
    distilled_guidance: bool = False                 # Cond.guidance carries --guidance (Flux dev)
    zero_empty_negative: bool = False                # an empty negative prompt gives a zero context (SDXL)
    concat_builders: dict = field(default_factory=dict)   # concat kind -> builder (see Variant)
    modes: frozenset = frozenset({"txt2img", "img2img", "inpaint"})

    @property
    def runnable(self) -> bool:
        return self.diffusion_model is not None

    def variant(self, version: str) -> Variant:
        return self.versions.get(version, Variant())

    def supports(self, mode: str) -> bool:
        return mode in self.modes

    def latent_scale_shift(self) -> tuple[float, float]:
        if self.latent_scale is None:
            raise UsageError(f"no VAE latent scale for model family {self.name!r}")
        return self.latent_scale, self.latent_shift

    def prediction_of(self, table, metadata, version: str) -> str | None:
        p = self.prediction
        return p(table, metadata, version) if callable(p) else p

    def flow_shift_of(self, version: str, table=None) -> float | None:
        s = self.flow_shift
        return s.get(version) if isinstance(s, dict) else s(version, table) if callable(s) else s

    def check_runnable(self, version: str) -> None:
        if not self.runnable:
            names = [f.description or f.name for f in runnable_families()]
            ok = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)
            raise UnsupportedError(f"model version '{version}' ({self.description or self.name}) is recognized, but "
                                   f"sdrt does not generate images with it yet (supported: {ok})")


_FAMILIES: dict[str, Family] = {}
_VERSION: dict[str, Family] = {}
_UNKNOWN = Family(UNKNOWN, {UNKNOWN: Variant()}, "an unknown model", prediction=None)
_loaded = False
_REGISTERED_BY: dict[str, str] = {}   # family name -> the module that registered it


def register_family(f: Family) -> Family:
    """Add a family; its versions must be new."""
    if f.name in _FAMILIES:
        raise ValueError(f"family {f.name!r} registered twice")
    for v in f.versions:
        if v in _VERSION:
            raise ValueError(f"version {v!r} of {f.name!r} already belongs to {_VERSION[v].name!r}")
    for role in f.text_encoders:
        if role not in _COMPONENTS:
            raise ValueError(f"family {f.name!r}: text encoder {role!r} is not a registered component")
    _FAMILIES[f.name] = f
    _REGISTERED_BY[f.name] = sys._getframe(1).f_globals.get("__name__", "")
    for v in f.versions:
        _VERSION[v] = f
    return f


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for m in FAMILY_MODULES:
            importlib.import_module(m)


def families() -> list[Family]:
    """Every registered family, in FAMILY_MODULES order (whichever module a caller imported
    first), then registration order."""
    _load()
    rank = {m: i for i, m in enumerate(FAMILY_MODULES)}
    return sorted(_FAMILIES.values(), key=lambda f: rank.get(_REGISTERED_BY[f.name], len(rank)))


def runnable_families() -> list[Family]:
    return [f for f in families() if f.runnable]


def detection_rules() -> list:
    """Every family's detection rules, in the order they are tried."""
    return sorted((r for f in families() for r in f.detect), key=lambda r: r[0])


def get_family(name: str) -> Family:
    """The family named `name` (not a version); the unknown family for an unknown name."""
    _load()
    return _FAMILIES.get(name, _UNKNOWN)


def family_of(version: str | None) -> Family:
    """The family a version belongs to (the unknown family for None / unknown versions)."""
    _load()
    return _VERSION.get(version or UNKNOWN, _UNKNOWN)
