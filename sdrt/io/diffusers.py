"""diffusers folders: `model_index.json` + unet/ or transformer/, vae/, text_encoder[_2|_3]/, read as
one table under the canonical names (see names.py), lazily (each component file is memory-mapped by
its own reader).

Per component folder the weights file is, first found: `diffusion_pytorch_model.safetensors` /
`model.safetensors`, their `*.safetensors.index.json` (sharded), the `.fp16` variants of those,
any single `*.safetensors`, then PyTorch `diffusion_pytorch_model.bin` / `pytorch_model.bin`, their
`*.bin.index.json`, the `.fp16.bin` variants. `.bin` files go through the non-executing checkpoint
reader (ckpt.py); a `.bin` index's shard names must be plain files inside the component folder.

Names: each component's names are first prefixed with its folder name (`unet.`, `transformer.`,
`vae.`, `text_encoder.`, `text_encoder_2.`, `text_encoder_3.`: `metadata["source_names"]` maps every
canonical name back to that), then converted:
- unet/ -> `model.diffusion_model.` + LDM names (layout read from the names);
- transformer/ -> `model.diffusion_model.` + the original repo's names where names.py knows the
  family (Flux, SD3: split q/k/v become `qkv.weight`, `qkv.weight.1`, `qkv.weight.2` parts), else
  the diffusers names unchanged;
- vae/ (AutoencoderKL) -> `first_stage_model.` + LDM names; the mid-block attention q/k/v/proj_out
  Linear weights are reshaped (zero copy) to LDM's 1x1 conv shape. Other VAE classes keep their
  diffusers names under `first_stage_model.`;
- text encoders of UNet pipelines -> `cond_stage_model.transformer.` (text_encoder) and
  `cond_stage_model.1.transformer.` (text_encoder_2; a refiner's lone OpenCLIP-G takes slot 0, as
  in its LDM checkpoint). The HF `text_projection.weight` (a Linear, (out, in)) becomes
  `text_model.text_projection` as OpenCLIP stores it, (in, out): a transposed view, zero copy;
- text encoders of other pipelines, by class (model_index.json) or by names: CLIP ->
  `text_encoders.clip_l.transformer.` / `text_encoders.clip_g.transformer.` (by width), T5/UMT5 ->
  `text_encoders.t5xxl.transformer.`, anything else (Qwen, Mistral, Gemma, ...) -> `text_encoders.llm.`.
A missing optional component is skipped; one that is present but unreadable fails the whole folder
(sd.cpp does the same since its loader hardening). Two names landing on one canonical name fail it too.
Also kept: `metadata["pipeline"]` (model_index `_class_name`), `metadata["components"]`, the VAE's
`scaling_factor`/`shift_factor` (`vae.scaling_factor`, ...), `scheduler.prediction_type`.
"""
from __future__ import annotations

import os

from ..errors import ModelFileError
from .base import ModelFile
from .ckpt import read_ckpt
from .detect import UNKNOWN, detect_version, family
from ..models.names import VAE_ATTN_MATRICES, convert_names

__all__ = ["read_diffusers_folder", "COMPONENTS", "find_component_file"]

COMPONENTS = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
MAX_JSON = 100_000_000
_STEMS = ("diffusion_pytorch_model", "model")

# model_index `_class_name` -> a version to convert names with (detect_version refines it after)
_PIPELINE_HINTS = {"StableDiffusion3": "sd3", "Flux2": "flux2", "Flux": "flux", "Chroma": "chroma",
                   "StableDiffusionXL": "sdxl", "StableDiffusion": "sd1", "Wan": "wan2", "QwenImage": "qwen_image",
                   "ZImage": "z_image", "HunyuanVideo": "hunyuan_video", "LTX": "ltxav"}


def find_component_file(folder: str) -> str | None:
    """The weights file of one component folder (see the module doc), or None."""
    cands = []
    for variant in ("", ".fp16"):
        for stem in _STEMS:
            cands += [f"{stem}{variant}.safetensors", f"{stem}.safetensors.index{variant}.json",
                      f"{stem}{variant}.safetensors.index.json"]
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        raise ModelFileError(f"{folder}: cannot list the folder ({e.strerror or e})") from None
    for c in cands:
        if c in names:
            return os.path.join(folder, c)
    st = [n for n in names if n.endswith(".safetensors")]
    if len(st) == 1:
        return os.path.join(folder, st[0])
    for variant in ("", ".fp16"):
        for stem in ("diffusion_pytorch_model", "pytorch_model", "model"):
            for c in (f"{stem}{variant}.bin", f"{stem}.bin.index{variant}.json", f"{stem}{variant}.bin.index.json"):
                if c in names:
                    return os.path.join(folder, c)
    return None


def _read_json(path: str, what: str):
    from .safetensors import read_json_file
    return read_json_file(path, what, MAX_JSON)


def _read_bin_index(path: str) -> ModelFile:
    """`pytorch_model.bin.index.json`: every shard a plain file in this folder, read safely;
    every listed tensor in its shard; no tensor in two shards."""
    index = _read_json(path, "PyTorch shard index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict) or not index["weight_map"]:
        raise ModelFileError(f"{path}: not a shard index (no \"weight_map\" object)")
    folder = os.path.dirname(os.path.abspath(path))
    real_folder = os.path.realpath(folder)
    wmap = index["weight_map"]
    shards: dict[str, list[str]] = {}
    for tname, shard in wmap.items():
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard or shard in (".", "..") \
                or "\0" in shard or "\\" in shard:
            raise ModelFileError(f"{path}: tensor {str(tname)[:200]!r}: shard {str(shard)[:100]!r} must be a plain "
                                 f"file name in the index's folder")
        if shard.lower().endswith(".json"):
            raise ModelFileError(f"{path}: tensor {tname!r}: shard {shard!r} is an index, not a weights file")
        shards.setdefault(shard, []).append(tname)
    mf = ModelFile(path=path, format="ckpt")
    owner: dict[str, str] = {}
    for shard, listed in shards.items():
        full = os.path.join(folder, shard)
        real = os.path.realpath(full)
        if os.path.dirname(real) != real_folder:
            raise ModelFileError(f"{path}: shard {shard!r} links out of the model folder")
        if not os.path.isfile(real):
            raise ModelFileError(f"{path}: shard {shard!r} is missing")
        sm = read_ckpt(full)
        mf.sources.extend(sm.sources)
        for table, dst in ((sm.tensors, mf.tensors), (sm.raw, mf.raw)):
            for tname, t in table.items():
                if tname in owner:
                    raise ModelFileError(f"{path}: tensor {tname!r} is in two shards, {owner[tname]!r} and {shard!r}")
                owner[tname] = shard
                dst[tname] = t
        for tname in listed:
            if tname not in sm.tensors and tname not in sm.raw:
                raise ModelFileError(f"{path}: tensor {tname!r} is missing from its declared shard {shard!r}")
    return mf


def _read_component(path: str) -> ModelFile:
    low = path.lower()
    if low.endswith(".safetensors.index.json") or low.endswith(".safetensors.index.fp16.json"):
        from .safetensors import read_safetensors_index
        return read_safetensors_index(path)
    if low.endswith(".json"):
        return _read_bin_index(path)
    if low.endswith(".safetensors"):
        from .safetensors import read_safetensors
        return read_safetensors(path)
    return read_ckpt(path)


def _te_slot(comp: str, cls: str, tensors: dict, unet: bool, has_te1: bool) -> str:
    """The canonical prefix of one text encoder."""
    if unet:
        if comp == "text_encoder" or (comp == "text_encoder_2" and not has_te1):
            return "cond_stage_model.transformer."
        return "cond_stage_model.1.transformer."
    if "T5" in cls or any(n.startswith("encoder.block.") for n in tensors):
        return "text_encoders.t5xxl.transformer."
    emb = tensors.get("text_model.embeddings.token_embedding.weight")
    if "CLIP" in cls or emb is not None:
        width = emb.ne[0] if emb is not None else 768
        return "text_encoders.clip_g.transformer." if width >= 1280 else "text_encoders.clip_l.transformer."
    return "text_encoders.llm."


def _class_of(index: dict, comp: str) -> str:
    v = index.get(comp)
    return str(v[1]) if isinstance(v, list) and len(v) == 2 and v[1] is not None else ""


def _version_hint(pipeline: str, parts: dict) -> str | None:
    for k, v in _PIPELINE_HINTS.items():
        if pipeline.startswith(k):
            if v == "sd1" and "unet" in parts and "text_encoder_2" in parts:
                return "sdxl"
            return v
    if "unet" in parts:
        u = parts["unet"].tensors
        return "sdxl" if "add_embedding.linear_1.weight" in u or "text_encoder_2" in parts else "sd1"
    if "transformer" in parts:
        v = detect_version({"model.diffusion_model." + k: t for k, t in parts["transformer"].tensors.items()})
        return None if v == UNKNOWN else v
    return None


def read_diffusers_folder(path) -> ModelFile:
    """Read a diffusers pipeline folder as one lazy table with canonical names (module doc)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelFileError(f"{path}: not a folder")
    index = {}
    mi = os.path.join(path, "model_index.json")
    if os.path.isfile(mi):
        index = _read_json(mi, "model_index.json")
        if not isinstance(index, dict):
            raise ModelFileError(f"{mi}: model_index.json is not a JSON object")
    pipeline = str(index.get("_class_name", ""))

    parts: dict[str, ModelFile] = {}
    files: dict[str, str] = {}
    for comp in COMPONENTS:
        folder = os.path.join(path, comp)
        if not os.path.isdir(folder):
            continue
        f = find_component_file(folder)
        if f is None:
            if comp in ("unet", "transformer"):
                raise ModelFileError(f"{folder}: no weights file (diffusion_pytorch_model.safetensors / .bin)")
            continue
        try:
            parts[comp] = _read_component(f)
        except ModelFileError as e:
            raise ModelFileError(f"{path}: component '{comp}' is unreadable: {e}") from None
        files[comp] = f
    if "unet" not in parts and "transformer" not in parts:
        raise ModelFileError(f"{path}: a diffusers folder needs unet/ or transformer/ with weights")

    version = _version_hint(pipeline, parts)
    unet = "unet" in parts
    mf = ModelFile(path=path, format="diffusers")
    source_names: dict[str, str] = {}
    comps_meta = {}
    for comp, part in parts.items():
        cls = _class_of(index, comp)
        if comp in ("unet", "transformer"):
            prefix, raw_prefix = comp + ".", comp + "."
        elif comp == "vae":
            prefix = raw_prefix = "vae."
        else:
            prefix = _te_slot(comp, cls, part.tensors, unet, "text_encoder" in parts)
            raw_prefix = prefix
        names = list(part.tensors) + list(part.raw)
        if comp == "vae" and cls not in ("", "AutoencoderKL"):
            mapping = {n: "first_stage_model." + n for n in names}       # not an LDM-style KL VAE
        else:
            m = convert_names([raw_prefix + n for n in names], version, what=f"{path}/{comp}")
            mapping = {n: m[raw_prefix + n] for n in names}
        for n in names:
            canon = mapping[n]
            t = part.tensors.get(n)
            if t is not None and comp == "vae" and canon.endswith(VAE_ATTN_MATRICES) and len(t.ne) == 2:
                t = t.reshape(1, 1, t.ne[0], t.ne[1])                     # Linear -> 1x1 conv, zero copy
            if t is not None and n == "text_projection.weight" and prefix.startswith("cond_stage_model"):
                canon = prefix + "text_model.text_projection"
                t = t.transpose()                                         # (out, in) -> OpenCLIP's (in, out)
            if canon in source_names:
                raise ModelFileError(f"{path}: '{comp}.{n}' and '{source_names[canon]}' both map to '{canon}'")
            source_names[canon] = f"{comp}.{n}"
            if t is not None:
                t.name = canon
                mf.tensors[canon] = t
            else:
                mf.raw[canon] = part.raw[n]
        mf.sources.extend(part.sources)
        comps_meta[comp] = {"file": files[comp], "format": part.format, "class": cls,
                            "prefix": prefix if comp not in ("unet", "transformer", "vae") else
                            ("first_stage_model." if comp == "vae" else "model.diffusion_model.")}
        for k, v in part.metadata.items():
            mf.metadata.setdefault(f"{comp}.{k}", v)
    mf.metadata.update({"pipeline": pipeline, "components": comps_meta, "source_names": source_names})
    _configs(path, mf.metadata)
    detected = detect_version(mf.tensors)
    mf.metadata["version"] = detected if detected != UNKNOWN else (version or UNKNOWN)
    mf.metadata["family"] = family(mf.metadata["version"])
    return mf


def _configs(path: str, meta: dict) -> None:
    """The few config values the engine needs; a missing or odd config is not an error."""
    for comp, keys in (("vae", ("scaling_factor", "shift_factor", "latent_channels", "force_upcast")),
                       ("scheduler", ("prediction_type", "timestep_spacing", "shift"))):
        name = "scheduler_config.json" if comp == "scheduler" else "config.json"
        p = os.path.join(path, comp, name)
        if not os.path.isfile(p):
            continue
        try:
            cfg = _read_json(p, f"{comp} config")
        except ModelFileError:
            continue
        if isinstance(cfg, dict):
            for k in keys:
                v = cfg.get(k)
                if isinstance(v, (int, float)) or (isinstance(v, str) and len(v) < 64):
                    meta[f"{comp}.{k}"] = v
