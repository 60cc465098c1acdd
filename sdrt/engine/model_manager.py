"""Load the model files of one generation context into a single canonical name table.

sd-cli takes a full checkpoint (`-m`) and/or parts (`--diffusion-model`, `--vae`, `--clip_l`,
`--clip_g`, `--taesd`). As sd.cpp's `StableDiffusionGGML::init`, each part is read under the prefix
its role implies (`model.diffusion_model.`, `vae.`, `cond_stage_model.transformer.` /
`text_encoders.clip_l.transformer.` ...), the model version is detected from the names and shapes,
and every name is converted to the canonical LDM layout (sdrt.models.names). A part given on the
command line replaces the checkpoint's own tensors of that role (sdrt: whole-role replacement,
so a VAE file never mixes with half of the checkpoint's VAE).

Nothing is read here: tensors stay lazy leaves over memory maps. `--type` / `--tensor-type-rules`
wrap the tensors they change in converted leaves that convert (or quantize) on first use, with
sd.cpp's rule of which tensors keep their stored type (sdrt.io.writer.export_type). `--type f32`
leaves float weights as stored: every sdrt kernel widens F16/BF16/F8 weights to F32 exactly and
computes in F32, which is what sd-cli's `--type f32` computes (it differs from sd-cli's default
only because ggml rounds activations to F16 inside F16 matmuls and convolutions).
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

from ..errors import ModelFileError, UsageError
from ..io import open_model
from ..io.base import ConvertedTensor, ModelFile
from ..io.detect import (
    UNKNOWN,
    detect_version,
    dtype_stats,
    prediction_type,
)
from ..models.names import convert_names
from ..models.families import COMMON_ROLES, component, components, family_of
from ..ops.weight_policy import follow_weight_type
from .params import ModelParams

__all__ = ["DM", "TAE", "VAE", "LoadedModels", "load_models"]

log = logging.getLogger("sdrt")

DM = "model.diffusion_model."
VAE = "first_stage_model."
TAE = "tae."


@dataclass
class LoadedModels:
    """The merged, canonically named weights of one context.

    `tensors` maps canonical names to lazy Tensors; `version` is a sdrt.io.detect version
    ('sd1', 'sd1_inpaint', 'sdxl', ...); `prediction` is the `--prediction` name to run with
    ('eps', 'v', ...) or None when the file does not tell (SD 2.x: the pipeline probes the UNet,
    as sd.cpp does); `paths` maps each role to the file it came from."""
    tensors: dict
    version: str
    prediction: str | None
    paths: dict[str, str] = field(default_factory=dict)
    files: dict[str, ModelFile] = field(default_factory=dict)
    wtype: str | None = None

    @property
    def family(self) -> str:
        return family_of(self.version).name

    def has(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.tensors)

    @property
    def has_vae(self) -> bool:
        return self.has(VAE)

    @property
    def has_taesd(self) -> bool:
        return self.has(TAE)

    def check_unchanged(self) -> None:
        for f in self.files.values():
            f.check_unchanged()


def _open(role: str, path: str) -> ModelFile:
    c = component(role)
    if not os.path.exists(path):
        raise ModelFileError(f"{c.flag}: no such file: '{path}'")
    log.info("loading %s from '%s'", c.what, path)
    return open_model(path)


def _strip(names, prefixes) -> dict[str, str]:
    """{name: name without a wrapper prefix every name shares}."""
    names = list(names)
    for p in prefixes:
        if names and all(n.startswith(p) for n in names):
            return {n: n[len(p):] for n in names}
    return {n: n for n in names}


def _drop(table: dict, prefixes) -> None:
    for k in [k for k in table if k.startswith(prefixes)]:
        del table[k]


_FLOAT_TYPES = ("F16", "BF16", "F8_E4M3", "F8_E5M2")


def _fixed_type(name: str, t) -> bool:
    """Whether sd.cpp's model declares this tensor with a fixed type that `--type` /
    `--tensor-type-rules` do not change: it converts the file's copy straight to that type on load
    (model_loader load_tensors), never through the requested one. 1-D tensors are norm weights and
    biases (LayerNorm, GroupNorm, RMSNorm params are F32: ggml_extend.hpp), and the bigG CLIP's
    `text_projection` is an F32 param (clip.hpp CLIPTextModel); sdrt widens float storage to F32
    exactly, so keeping the stored type is sd.cpp's F32. (A q8_0 *file* is another matter: its
    quantized vectors are what it holds.)"""
    return all(n == 1 for n in t.ne[1:]) or name.endswith(("text_projection", "text_projection.weight"))


def _apply_wtype(tensors: dict, wtype: str | None, rules: str | None) -> dict:
    """Wrap the tensors `--type` / `--tensor-type-rules` change in lazily converted leaves (the
    ones sd.cpp converts at load: `export_type`, less its fixed-type params, `_fixed_type`)."""
    if not wtype and not rules:
        return tensors
    from ..io.writer import (
        convert_raw,
        export_type,
        parse_tensor_type_rules,
        parse_type,
    )
    dst = parse_type(wtype) if wtype else None
    compiled = parse_tensor_type_rules(rules) if rules else []
    out = {}
    for name, t in tensors.items():
        ty = t.dtype if _fixed_type(name, t) else export_type(name, t, dst, compiled)
        # sdrt's kernels widen float weights to F32 exactly, so F32 needs no copy of them
        if ty == t.dtype or (ty.name == "F32" and t.dtype.name in _FLOAT_TYPES):
            out[name] = t
            continue
        out[name] = ConvertedTensor(ty, t.ne, lambda t=t, ty=ty: convert_raw(t, ty).reshape(-1).view("uint8"),
                                    name=name)
    return out


def _vectors_to_f32(tensors: dict) -> dict:
    """Quantized 1-D tensors (norm scales: a q8_0/q4_0 file quantizes every row that is a whole
    number of blocks) as lazily dequantized F32 leaves. sd.cpp declares norm weights F32 and
    converts the file's copy on load; sdrt's norm ops take float vectors only."""
    from ..io.writer import convert_raw
    from ..ops import dtypes
    f32 = dtypes.get("F32")
    out = dict(tensors)
    for name, t in tensors.items():
        if t.dtype.is_quantized and len(t.ne) == 1:
            out[name] = ConvertedTensor(f32, t.ne, lambda t=t: convert_raw(t, f32).reshape(-1).view("uint8"),
                                        name=name)
    return out


def _stat_line(stats: dict) -> str:
    return "|".join(f"{k:>8}: {v:<5}" for k, v in sorted(stats.items()))


def _load_controlnet(path: str, files: dict, paths: dict) -> dict:
    """--control-net: its tensors under `control_model.` (sd.cpp strips that prefix of the .pth
    form and reads the rest by its own names). --type does not apply: sd.cpp builds the
    ControlNet's weights from its own defaults, not from the model's type."""
    from ..models.diffusion.controlnet import canonical_controlnet_names
    if not os.path.isfile(path):
        raise ModelFileError(f"--control-net: no such file: '{path}'")
    log.info("loading control net from '%s'", path)
    f = files["control_net"] = open_model(path)
    paths["control_net"] = path
    conv = canonical_controlnet_names(f.tensors)
    if len(conv) < len(f.tensors):
        log.info("control net: %d tensors of '%s' are not the ControlNet's (ignored, as sd.cpp)",
                 len(f.tensors) - len(conv), path)
    return _vectors_to_f32({c: f.tensors[n] for n, c in conv.items()})


def load_models(params: ModelParams) -> LoadedModels:
    """Open every file of `params`, merge them under canonical names, detect version and
    prediction. Raises ModelFileError for a missing/bad file, UsageError for a bad combination."""
    if not (params.model or params.diffusion_model):
        raise UsageError("the following arguments are required: -m/--model or --diffusion-model")
    raw: dict = {}
    files: dict[str, ModelFile] = {}
    paths: dict[str, str] = {}
    roles_given = []
    if params.model:
        f = files["model"] = _open("model", params.model)
        paths["model"] = params.model
        raw.update(f.tensors)
    if params.diffusion_model:
        f = files["diffusion_model"] = _open("diffusion_model", params.diffusion_model)
        paths["diffusion_model"] = params.diffusion_model
        raw_dm = {DM + s: f.tensors[n] for n, s in _strip(f.tensors, COMMON_ROLES["diffusion_model"].strip).items()}
        roles_given.append(("diffusion_model", raw_dm))
    # sd.cpp decides the text-encoder prefixes from what is loaded so far
    pre = dict(raw)
    for _, part in roles_given:
        pre.update(part)
    # (sdrt: a bare UNet with no text encoder yet is still a UNet; sd.cpp calls it unknown and then
    # loads --clip_l under the DiT prefix, so `--diffusion-model unet --clip_l clip` fails there)
    unet = (family_of(detect_version(pre)).te_layout == "unet" or any(k.startswith(DM + "input_blocks.") for k in pre)
            ) if pre else True
    layout = "unet" if unet else "dit"
    for role in (*components(), "vae", "taesd"):
        path = params.path_of(role)
        if not path:
            continue
        f = files[role] = _open(role, path)
        paths[role] = path
        c = component(role)
        roles_given.append((role, {c.prefix_for(layout) + s: f.tensors[n] for n, s in _strip(f.tensors, c.strip).items()}))
    # detect on everything, then convert names with that version
    merged = dict(raw)
    for _, part in roles_given:
        merged.update(part)
    version = detect_version(merged)
    if version == UNKNOWN:
        what = params.model or params.diffusion_model
        raise ModelFileError(f"'{what}': cannot tell which model this is from its tensor names "
                             f"(not an SD 1.x / 2.x / SDXL / ... checkpoint sdrt knows)")
    conv = convert_names(raw, version, what=paths.get("model", "model")) if raw else {}
    tensors = {conv[k]: v for k, v in raw.items()}
    for role, part in roles_given:
        conv = convert_names(part, version, what=paths[role])
        _drop(tensors, component(role).replaces)
        for k, v in part.items():
            tensors[conv[k]] = v
    version2 = detect_version(tensors)
    if version2 != UNKNOWN:
        version = version2
    log.info("Version: %s", version)
    stats = dtype_stats(tensors)
    total = Counter()
    for s in stats.values():
        total.update(s)
    log.info("Weight type stat:                 %s", _stat_line(total))
    for comp, label in (("text_encoders", "Conditioner"), ("diffusion_model", "Diffusion model"), ("vae", "VAE")):
        log.info("%-33s %s", label + " weight type stat:", _stat_line(stats.get(comp, {})))
    if params.prediction:
        prediction = params.prediction
    else:
        pred = prediction_type(files.get("model") or files.get("diffusion_model") or tensors, version)
        prediction = {"flow": "sd3_flow"}.get(pred, pred)
    tensors = _vectors_to_f32(_apply_wtype(tensors, params.type, params.tensor_type_rules))
    follow_weight_type(params.type)  # --type f32 keeps F16 storage: compute stays exact
    if params.control_net:
        tensors.update(_load_controlnet(params.control_net, files, paths))
    return LoadedModels(tensors=tensors, version=version, prediction=prediction, paths=paths, files=files,
                        wtype=params.type)
