"""LoRA and LyCORIS adapters (sd.cpp's lora.hpp): read the file, map its keys, apply.

A LoRA file is opened with `sdrt.io.open_model` (the checkpoint safety rules) and every key is
mapped with `sdrt.models.names.lora_target` to (canonical model weight, role). The tensors of one
target form a group of one type, tried in sd.cpp's order: LoRA/LoCon (`lora_up`/`lora_down`,
optional Tucker `lora_mid`, `.scale` or `.alpha`/rank), raw `.diff`, LoHa (`hada_*`), LoKr
(`lokr_*`). Its weight delta, in torch layout ([out, in, kh, kw]):
  LoRA   up @ down (or up x mid x down)              * scale * multiplier
  diff   diff                                          * multiplier
  LoHa   (w1_a @ w1_b) * (w2_a @ w2_b) (Tucker t1/t2)  * alpha/rank * multiplier
  LoKr   kron(w1, w2), w1 = w1_a @ w1_b, w2 likewise   * alpha/rank (1 when rank is 1) * multiplier
`.dora_scale` is not applied (sd.cpp has no DoRA: the key is reported unused).

Apply modes (`--lora-apply-mode`): `immediately` wraps each target in a lazily converted leaf that
holds W + delta in W's type (quantized weights are requantized, as sd.cpp's merge graph does);
`at_runtime` leaves W as it is and registers, for the Linear / Conv2d that reads it, a path added
to its output: the low-rank chain x -> down [-> mid] -> up for LoRA, a dense delta GEMM for LoKr
(sdrt: LoKr is not materialized in W either); a Linear with a float W may instead add the delta
to W inside the graph when that costs less for its activation rows (RuntimePath.linear); raw diffs and LoHa patch the weight as sd.cpp's
runtime patch_weight does. `auto` = at_runtime when any weight is quantized or params live
elsewhere than compute (sd.cpp), else immediately.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelFileError, UsageError
from ..ops.backend import as_weight

__all__ = ["LORA_EXTS", "APPLY_MODES", "LoraSpec", "LoraModel", "extract_loras", "resolve_lora",
           "weight_delta", "apply_loras", "lora_hashes"]

log = logging.getLogger("sdrt")

LORA_EXTS = (".gguf", ".safetensors", ".pt", ".ckpt")   # sd-cli's try order
APPLY_MODES = ("auto", "immediately", "at_runtime")
_RE_TAG = re.compile(r"<lora:([^:>]+):([^>]+)>")
_F32 = np.float32

@dataclass(frozen=True)
class LoraSpec:
    """One LoRA to apply: its file and multiplier (sd.cpp's sd_lora_t)."""
    path: str
    multiplier: float = 1.0


# ---- the prompt syntax -------------------------------------------------------------------------

def resolve_lora(name: str, lora_dir: str) -> str | None:
    """`<lora:name:...>` -> the file inside `lora_dir` (name as given, else name + .gguf /
    .safetensors / .pt / .ckpt, sd-cli's order); None when none exists. sdrt resolves inside the
    directory only: an absolute name or one with a '..' part is a UsageError."""
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or re.match(r"^[A-Za-z]:", name):
        raise UsageError(f"<lora:{name}:...>: LoRA names are resolved inside --lora-model-dir; "
                         f"absolute paths and '..' are not allowed")
    base = os.path.join(lora_dir, name)
    for p in (base, *(base + e for e in LORA_EXTS)):
        if os.path.isfile(p):
            return os.path.normpath(p)
    return None


def extract_loras(prompt: str, lora_dir: str | None = ".") -> tuple[str, list[LoraSpec]]:
    """Strip every `<lora:name:multiplier>` from the prompt (sd-cli's extract_and_remove_lora):
    multipliers of one file add up; a tag whose multiplier does not parse, or whose file does not
    exist (a warning), is removed and ignored. Returns (prompt, specs in first-seen order)."""
    if lora_dir is None:
        return prompt, []
    found: dict[str, float] = {}
    for m in _RE_TAG.finditer(prompt):
        name, raw = m.group(1), m.group(2)
        try:
            mul = float(raw.strip())
        except ValueError:
            continue
        if name.startswith("|high_noise|"):
            log.warning("<lora:%s:...>: high-noise LoRAs are for video models, which sdrt does not run; ignored", name)
            continue
        path = resolve_lora(name, lora_dir)
        if path is None:
            log.warning("can not found lora %s", os.path.normpath(os.path.join(lora_dir, name)))
            continue
        found[path] = found.get(path, 0.0) + mul
    return _RE_TAG.sub("", prompt), [LoraSpec(p, m) for p, m in found.items()]


# ---- reading a LoRA file -----------------------------------------------------------------------

def _f32(t) -> np.ndarray:
    """A tensor (or raw scalar array) as float32 in torch layout."""
    if isinstance(t, np.ndarray):
        return np.asarray(t, _F32)
    if t.dtype.name == "F16":       # the hardware conversion: numpy's astype is ~16x slower here
        from ..ops.cpu.matmul import widen_f16
        raw = np.ascontiguousarray(t.numpy()).view(np.uint16)
        out = np.empty(raw.shape, _F32)
        widen_f16(raw.reshape(1, -1), out.reshape(1, -1))
        return out.reshape(t.ne[::-1])
    from ..ops.convert import raw_to_f32
    return np.asarray(raw_to_f32(t.numpy(), t.dtype), _F32).reshape(t.ne[::-1])


@dataclass
class LoraModel:
    """One LoRA file, its keys grouped by the model weight they modify.

    `groups[(target, index)]` = {role: (key, tensor)} (index > 0: a split part, '.weight.1');
    `unmatched`: keys that name no LoRA tensor or no weight of the model."""
    path: str
    multiplier: float
    groups: dict = field(default_factory=dict)
    keys: list = field(default_factory=list)
    unmatched: list = field(default_factory=list)
    applied: set = field(default_factory=set)
    skipped: set = field(default_factory=set)

    @classmethod
    def load(cls, spec: LoraSpec, model_tensors: dict, version: str | None) -> "LoraModel":
        from ..io import open_model
        from ..models.names import lora_target
        log.info("loading LoRA from '%s'", spec.path)
        f = open_model(spec.path)
        lm = cls(spec.path, float(spec.multiplier))
        entries = {**{k: v for k, v in f.raw.items() if v.size == 1}, **f.tensors}
        in_proj = any(".self_attn.in_proj.weight" in n for n in model_tensors)
        for key, t in entries.items():
            lm.keys.append(key)
            hit = lora_target(key, version)
            if hit is None:
                lm.unmatched.append(key)
                continue
            target, role = hit
            target, index = _split_index(target)
            if in_proj and target not in model_tensors:
                target, index = _to_in_proj(target, index)
            if target not in model_tensors:
                lm.unmatched.append(key)
                continue
            lm.groups.setdefault((target, index), {})[role] = (key, t)
        return lm

    def stat(self) -> None:
        """sd.cpp's LoraModel::stat: the applied count, and the keys that matched nothing."""
        total = len(self.keys)
        compatible = total - len(self.skipped)
        unused = [k for k in self.keys if k not in self.applied and k not in self.skipped]
        if unused:
            shown = ", ".join(unused[:10]) + (f" ... and {len(unused) - 10} more" if len(unused) > 10 else "")
            log.warning("unused lora tensors (%d) in '%s': %s", len(unused), self.path, shown)
            log.warning("Only (%d / %d) LoRA tensors have been applied, lora_file_path = %s",
                        len(self.applied), compatible, self.path)
        else:
            log.info("(%d / %d) LoRA tensors have been applied, lora_file_path = %s",
                     len(self.applied), compatible, self.path)
        if self.skipped:
            log.warning("(%d / %d) incompatible LoRA tensors have been skipped, lora_file_path = %s",
                        len(self.skipped), total, self.path)


def _split_index(target: str) -> tuple[str, int]:
    m = re.match(r"(.+\.(?:weight|bias))\.(\d+)$", target)
    return (m.group(1), int(m.group(2))) if m else (target, 0)


def _to_in_proj(target: str, index: int) -> tuple[str, int]:
    """q/k/v projections onto a fused open_clip `in_proj` (sd.cpp's preprocess_lora_tensors)."""
    for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
        for leaf in ("weight", "bias"):
            suffix = f"self_attn.{part}.{leaf}"
            if target.endswith(suffix):
                return target[: -len(suffix)] + f"self_attn.in_proj.{leaf}", i
    return target, index


# ---- the delta of one group ----------------------------------------------------------------------

def _kind(group: dict) -> str | None:
    """The group's type, tried in sd.cpp's order (LoRA, raw diff, LoHa, LoKr); None: incomplete."""
    has = group.__contains__
    if has("lora_up") and has("lora_down"):
        return "lora"
    if has("diff") or has("diff_b"):
        return "diff"
    if all(map(has, ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))):
        return "loha"
    if (has("lokr_w1") or (has("lokr_w1_a") and has("lokr_w1_b"))) and \
            (has("lokr_w2") or (has("lokr_w2_a") and has("lokr_w2_b"))):
        return "lokr"
    return None


def _scalar(group: dict, role: str) -> float | None:
    return float(_f32(group[role][1]).reshape(-1)[0]) if role in group else None


def _merge(down: np.ndarray, up: np.ndarray, mid: np.ndarray | None = None) -> np.ndarray:
    """up @ down (flattened past dim 1), or the Tucker form up x mid x down: [out, in(, kh, kw)]."""
    up2 = up.reshape(up.shape[0], -1)
    if mid is None:
        return (up2 @ down.reshape(down.shape[0], -1)).reshape((up.shape[0],) + down.shape[1:])
    d2 = down.reshape(down.shape[0], -1)                          # [r1, in]
    core = np.tensordot(up2, mid, axes=([1], [0]))                # [out, r1, kh, kw]
    return np.einsum("orhw,ri->oihw", core, d2, optimize=True)


def _lora_scale(group: dict, rank: int) -> float:
    s = _scalar(group, "scale")
    if s is not None:
        return s
    a = _scalar(group, "alpha")
    return a / rank if a is not None else 1.0


def lora_factors(group: dict) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, float]:
    """(down, mid, up, scale) of a LoRA/LoCon group, float32 torch layout (scale excludes the multiplier)."""
    down, up = _f32(group["lora_down"][1]), _f32(group["lora_up"][1])
    mid = _f32(group["lora_mid"][1]) if "lora_mid" in group else None
    return down, mid, up, _lora_scale(group, down.shape[0])


def weight_delta(group: dict, multiplier: float) -> tuple[np.ndarray, list[str]] | None:
    """(delta in torch layout, the keys it used) of one group, or None when its tensors form no type."""
    kind = _kind(group)
    if kind is None:
        return None
    if kind == "lora":
        down, mid, up, scale = lora_factors(group)
        # the scale goes on the small factor, not on the [out, in] product
        return _merge(down, up * _F32(scale * multiplier), mid), _used(group, kind)
    if kind == "diff":
        role = "diff" if "diff" in group else "diff_b"
        return _f32(group[role][1]) * _F32(multiplier), _used(group, kind)
    if kind == "loha":
        def half(a, b, t):
            wa, wb = _f32(group[a][1]), _f32(group[b][1])
            if t in group:     # Tucker: w_a is stored [rank, out]
                return _merge(wb, wa.T.copy(), _f32(group[t][1]))
            return _merge(wb, wa)
        rank = _f32(group["hada_w1_b"][1]).shape[0]
        a = _scalar(group, "alpha")
        scale = a / rank if a is not None else 1.0
        d = half("hada_w1_a", "hada_w1_b", "hada_t1") * half("hada_w2_a", "hada_w2_b", "hada_t2")
        return d * _F32(scale * multiplier), _used(group, kind)
    # LoKr
    rank = 1
    if "lokr_w1" in group:
        w1 = _f32(group["lokr_w1"][1])
    else:
        w1a, w1b = _f32(group["lokr_w1_a"][1]), _f32(group["lokr_w1_b"][1])
        rank = w1b.shape[0]
        w1 = w1a @ w1b.reshape(rank, -1)
    if "lokr_w2" in group:
        w2 = _f32(group["lokr_w2"][1])
    else:
        w2a, w2b = _f32(group["lokr_w2_a"][1]), _f32(group["lokr_w2_b"][1])
        rank = w2b.shape[0]
        w2 = _merge(w2b, w2a.T.copy(), _f32(group["lokr_t2"][1])) if "lokr_t2" in group else _merge(w2b, w2a)
    a = _scalar(group, "alpha")
    scale = a / rank if (a is not None and rank != 1) else 1.0
    w1 = w1.reshape(w1.shape + (1,) * (w2.ndim - w1.ndim))
    return np.kron(w1, w2).astype(_F32) * _F32(scale * multiplier), _used(group, kind)


def _keys(group: dict, roles) -> list[str]:
    return [group[r][0] for r in roles if r in group]


def _fit(delta: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray | None:
    """The delta in the weight's shape: same element count (reshaped), or a 2-D delta with fewer
    rows zero-padded (sd.cpp's "pad for"); None when incompatible."""
    if delta.size < int(np.prod(shape)) and delta.ndim == 2 and len(shape) == 2 and delta.shape[1] == shape[1]:
        log.warning("pad for %s", name)
        delta = np.concatenate([delta, np.zeros((shape[0] - delta.shape[0], shape[1]), _F32)])
    if delta.size != int(np.prod(shape)):
        log.warning("skip incompatible LoRA tensor |%s|: model shape = %s, LoRA shape = %s",
                    name, list(shape), list(delta.shape))
        return None
    return delta.reshape(shape)


# ---- applying ------------------------------------------------------------------------------------

def _patched(t, deltas, runtime: bool = False):
    """A lazily converted leaf: t + sum(delta()) in t's type (quantized types requantized, as
    sd.cpp's merge graph); at run time a quantized weight becomes F32 (sd.cpp's patch_weight adds
    the diff to the weight cast to F32 in the layer's graph)."""
    from ..io.base import ConvertedTensor
    from ..io.writer import quantize_like_sd_cpp
    from ..ops import dtypes
    from ..ops.convert import f32_to_raw
    from .lora_merge import merge_into
    dst = dtypes.get("F32") if runtime and t.dtype.is_quantized else t.dtype

    if dst is t.dtype and _fused_ok(dst.name):
        def fill_fused():
            lowrank, dense = [], None
            for d in deltas:
                f = d.factors() if isinstance(d, (_Delta, _Factors)) else None
                if f is not None:
                    lowrank.append(f)
                else:
                    x = d().reshape(t.ne[-1], -1)
                    dense = x if dense is None else dense + x
            return as_weight(merge_into(t.numpy().reshape(-1).view(np.uint8), dst.name,
                                        (t.ne[-1], t.nelements // t.ne[-1]), lowrank, dense))
        return ConvertedTensor(dst, t.ne, fill_fused, name=t.name)

    def fill():
        w = deltas[0]()
        for d in deltas[1:]:
            w += d()
        w += _f32(t)
        if dst.is_quantized:
            out = quantize_like_sd_cpp(np.ascontiguousarray(w).reshape(-1, w.shape[-1]), t.dtype).reshape(-1).view("uint8")
        else:
            out = np.ascontiguousarray(f32_to_raw(w, dst)).reshape(-1).view("uint8")
        return as_weight(out)
    return ConvertedTensor(dst, t.ne, fill, name=t.name)


def _fused_ok(name: str) -> bool:
    from .lora_merge import supported
    return supported(name)


def _grouped(lm: LoraModel) -> dict:
    """{target: [(index, group)]} in index order."""
    out: dict = {}
    for (target, index), group in sorted(lm.groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(target, []).append((index, group))
    return out


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, np.ndarray) else tuple(t.ne[::-1])


_USED = {"lora": ("lora_up", "lora_down", "lora_mid"),
         "diff": ("diff",),
         "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "alpha"),
         "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "alpha")}


def _used(group: dict, kind: str) -> list[str]:
    roles = _USED[kind]
    if kind == "lora":
        roles += ("scale",) if "scale" in group else ("alpha",)
    if kind == "diff" and "diff" not in group:
        roles = ("diff_b",)
    return _keys(group, roles)


def _delta_shape(group: dict, kind: str) -> tuple[int, ...]:
    """The shape weight_delta gives, from the tensors' shapes alone (nothing is read)."""
    sh = {r: _shape(t) for r, (_, t) in group.items()}

    def merged(down, up, mid=None, up_t=False):
        out = sh[up][1] if up_t else sh[up][0]
        return (out, sh[down][1]) + (sh[mid][2:] if mid in sh else sh[down][2:])
    if kind == "lora":
        return merged("lora_down", "lora_up", "lora_mid")
    if kind == "diff":
        return sh["diff" if "diff" in sh else "diff_b"]
    if kind == "loha":
        return merged("hada_w1_b", "hada_w1_a", "hada_t1", up_t="hada_t1" in sh)
    w1 = sh["lokr_w1"] if "lokr_w1" in sh else (sh["lokr_w1_a"][0], int(np.prod(sh["lokr_w1_b"][1:])))
    w2 = sh["lokr_w2"] if "lokr_w2" in sh else merged("lokr_w2_b", "lokr_w2_a", "lokr_t2", up_t="lokr_t2" in sh)
    w1 = w1 + (1,) * (len(w2) - len(w1))
    return tuple(a * b for a, b in zip(w1, w2))


def _fits(dshape: tuple, shape: tuple, name: str) -> bool:
    n, m = int(np.prod(dshape)), int(np.prod(shape))
    if n < m and len(dshape) == 2 and len(shape) == 2 and dshape[1] == shape[1]:
        return True
    if n != m:
        log.warning("skip incompatible LoRA tensor |%s|: model shape = %s, LoRA shape = %s",
                    name, list(shape), list(dshape))
        return False
    return True


def _plan_delta(lm: LoraModel, target: str, parts, shape):
    """Check one target's groups against the weight's shape (marking their keys applied or
    skipped) and return a function computing the delta in the weight's shape, or None. Split
    parts ('.weight.1', ...) are concatenated on the output dim, as sd.cpp does; when a part is
    missing (a LoRA of q and v only), each part goes to its own rows: q, k, v of the weight's
    input width each, then the rest (a single block's MLP), where sd.cpp stops at the gap."""
    shapes, used, groups, indices = [], [], [], []
    for index, group in parts:
        kind = _kind(group)
        if kind is None:
            break
        shapes.append(_delta_shape(group, kind))
        used += _used(group, kind)
        groups.append(group)
        indices.append(index)
    if not shapes:
        return None
    offsets = None
    if indices != list(range(len(indices))):
        n_in, rows = int(np.prod(shape[1:])), [s[0] for s in shapes]
        offsets = [i * n_in for i in indices]
        if len(shape) != 2 or any(int(np.prod(s[1:])) != n_in for s in shapes) \
                or any(r != n_in for r in rows[:-1]) or offsets[-1] + rows[-1] > shape[0]:
            log.warning("skip incompatible LoRA tensor |%s|: parts %s of %s rows into model shape %s",
                        target, indices, rows, list(shape))
            lm.skipped.update(k for _, g in parts for k, _ in g.values())
            return None
        dshape = tuple(shape)
    else:
        dshape = shapes[0] if len(shapes) == 1 else (sum(s[0] for s in shapes), int(np.prod(shapes[0][1:])))
        if not _fits(dshape, shape, target):
            lm.skipped.update(k for _, g in parts for k, _ in g.values())
            return None
    lm.applied.update(used)
    return _Delta(groups, lm.multiplier, shape, target, dshape, offsets)


class _Delta:
    """One target's delta from one file: called, the float32 delta in the weight's shape;
    `factors()`, (up [out, r] with the scale and multiplier folded in, down [r, in]) when it is
    one plain LoRA/LoCon group of the weight's shape (the fused merge never forms it), else None.
    `offsets`: the first row of each split part where parts are missing (else None: concatenated)."""
    __slots__ = ("groups", "mult", "shape", "target", "dshape", "offsets")

    def __init__(self, groups, mult, shape, target, dshape, offsets=None):
        self.groups, self.mult, self.shape, self.target, self.dshape = groups, mult, shape, target, dshape
        self.offsets = offsets

    def __call__(self) -> np.ndarray:
        ds = [weight_delta(g, self.mult)[0] for g in self.groups]
        if self.offsets is not None:
            d = np.zeros((self.shape[0], int(np.prod(self.shape[1:]))), _F32)
            for off, x in zip(self.offsets, ds):
                d[off:off + x.shape[0]] = x.reshape(x.shape[0], -1)
            return d.reshape(self.shape)
        d = ds[0] if len(ds) == 1 else np.concatenate([x.reshape(x.shape[0], -1) for x in ds])
        return _fit(d, self.shape, self.target)

    def factors(self):
        if len(self.groups) != 1 or self.offsets is not None or _kind(self.groups[0]) != "lora" or "lora_mid" in self.groups[0] \
                or self.dshape[0] != self.shape[0] or int(np.prod(self.dshape)) != int(np.prod(self.shape)):
            return None
        down, _, up, scale = lora_factors(self.groups[0])
        return up.reshape(up.shape[0], -1) * _F32(scale * self.mult), down.reshape(down.shape[0], -1)


def choose_mode(mode: str, tensors: dict, offloaded: bool = False) -> str:
    """sd.cpp's LORA_APPLY_AUTO: at_runtime when any weight is quantized or params are offloaded."""
    if mode not in APPLY_MODES:
        raise UsageError(f"--lora-apply-mode: invalid mode '{mode}'; valid: {', '.join(APPLY_MODES)}")
    if mode != "auto":
        return mode
    quantized = any(t.dtype.is_quantized for t in tensors.values())
    return "at_runtime" if quantized or offloaded else "immediately"


def apply_loras(tensors: dict, specs, version: str | None, mode: str = "auto",
                offloaded: bool = False, loaded: list | None = None) -> tuple[dict, dict]:
    """Apply LoRAs to a canonical weight table. Returns (new table, runtime registrations): the
    table has patched leaves for merged targets; the registrations are {weight leaf: RuntimePath}
    for the model's Linear/Conv2d hooks (sdrt.models.common). A file that does not open is
    skipped with a warning; `loaded` (a list) receives the specs that opened."""
    mode = choose_mode(mode, tensors, offloaded)
    log.info("apply LoRAs %s", mode)
    out = dict(tensors)
    merges: dict[str, list] = {}
    runtime: dict = {}
    for spec in specs:
        try:
            lm = LoraModel.load(spec, tensors, version)
        except ModelFileError as e:
            log.warning("LoRA '%s' not applied: %s", spec.path, e)
            continue
        if loaded is not None:
            loaded.append(spec)
        for target, parts in _grouped(lm).items():
            shape = tuple(tensors[target].ne[::-1])
            kinds = {_kind(g) for _, g in parts}
            if mode == "at_runtime" and kinds <= {"lora", "lokr"} and _hookable(target):
                path = _runtime_path(lm, target, parts, shape)
                if path is not None:
                    acc = runtime.setdefault(target, RuntimePath())
                    acc.chains += path.chains
                    acc.dense += path.dense
                    acc.merge_factors += path.merge_factors
                continue
            d = _plan_delta(lm, target, parts, shape)
            if d is not None:
                merges.setdefault(target, []).append(d)
        lm.stat()
    for target, ds in merges.items():
        out[target] = _patched(tensors[target], ds, runtime=mode == "at_runtime")
    # keyed by the leaf the model will read (a patched one where a diff/LoHa also hit the weight)
    return out, {out[target]: path for target, path in runtime.items()}


class LoraState:
    """The LoRAs a pipeline's weight table carries now; `set` swaps them (sd.cpp re-applies when
    the prompt's LoRAs change between generations). Keeps the unpatched table to start over from."""

    def __init__(self, table: dict):
        self.table = table            # the pipeline's live table, edited in place
        self.base = dict(table)
        self.key: tuple = ()
        self.specs: list = []
        self.runtime: dict = {}

    def set(self, specs, version: str | None, mode: str, offloaded: bool = False) -> bool:
        """Apply `specs`; returns True when the table changed (models built from it are stale)."""
        from ..models.common import RUNTIME_LORA
        key = tuple((s.path, float(s.multiplier)) for s in specs)
        if key == self.key:
            return False
        for w in self.runtime:
            RUNTIME_LORA.pop(w, None)
        loaded: list = []
        table, runtime = apply_loras(self.base, specs, version, mode, offloaded, loaded) if specs else \
            (dict(self.base), {})
        self.table.clear()
        self.table.update(table)
        for w, path in runtime.items():
            RUNTIME_LORA[w] = path
        self.key, self.specs, self.runtime = key, loaded, runtime     # specs: the files that loaded
        return True


def as_specs(items) -> list[LoraSpec]:
    """GenParams.loras entries (LoraSpec, (path, multiplier) or a path) as LoraSpec."""
    out = []
    for it in items or ():
        if isinstance(it, LoraSpec):
            out.append(it)
        elif isinstance(it, (str, os.PathLike)):
            out.append(LoraSpec(os.fspath(it), 1.0))
        else:
            path, mul = it
            out.append(LoraSpec(os.fspath(path), float(mul)))
    for s in out:
        if not os.path.isfile(s.path):
            raise UsageError(f"LoRA: no such file: '{s.path}'")
    return out


# weights the model graphs read through Linear / Conv2d / the spatial transformer's proj_in/out
_HOOKED = re.compile(r"^(model\.diffusion_model\.|cond_stage_model\.|text_encoders\.)")


def _hookable(target: str) -> bool:
    return bool(_HOOKED.match(target)) and target.endswith(".weight") and "text_projection" not in target \
        and "embedding" not in target


# at_runtime on a float (F16/BF16/F32) Linear weight, the LoRA delta is added to a copy of the
# weight (W + B·A) instead of running x -> down -> up beside the GEMM: once per LoRA set for a
# stored weight; for a weight the graph computes, in the graph when that costs less for the
# activation rows at hand ("auto") or always ("on"). "off" never folds (tests and
# `bench_lora.py step --runtime-merge` compare them).
RUNTIME_MERGE = "auto"
# cost model, in multiply-adds: a pass over an F32 element (read-add-write, widen) ~ this many
_PASS_MACS = 40
_HALF = ("F16", "BF16")   # folded weights are cast back to these


class RuntimePath:
    """The LoRA of one weight at run time: low-rank chains (down, mid, up, scale) and dense
    deltas (LoKr), built into the graph by the model's Linear / Conv2d hook. For a Linear with a
    float weight, `linear` folds the delta into a copy of the weight, once per LoRA set (inside
    the graph, where the weight is computed, when that costs less than the chains); otherwise the chains run beside the layer's GEMM and are added to
    its output. The scale is folded into `up` at load (sdrt; sd.cpp scales the chain's output)."""
    __slots__ = ("chains", "dense", "merge_factors", "fold")

    def __init__(self):
        self.fold = None         # (w, the folded leaf) once `linear` has folded
        self.chains: list = []   # (down, mid, up, scale) sdrt Tensors, torch layouts as stored
        self.dense: list = []    # delta Tensors in the weight's ne
        self.merge_factors: list = []   # (down^T ne [r, in], up ne [r, out], r) of the mid-less chains

    def output(self, x, conv: dict | None):
        from ..ops import api as F
        acc = None
        for down, mid, up, scale in self.chains:
            if conv is None:
                h = F.linear(x, _as2d(down))
                if mid is not None:
                    h = F.linear(h, _as2d(mid))
                h = F.linear(h, _as2d(up))
            else:
                first = dict(conv) if mid is None else {}
                h = F.conv2d(x, _as4d(down), None, **first)
                if mid is not None:
                    h = F.conv2d(h, _as4d(mid), None, **conv)
                h = F.conv2d(h, _as4d(up), None)
            if scale != 1.0:
                h = F.scale(h, scale)
            acc = h if acc is None else F.add(acc, h)
        for d in self.dense:
            h = F.linear(x, _as2d(d)) if conv is None else F.conv2d(x, d, None, **conv)
            acc = h if acc is None else F.add(acc, h)
        return acc

    def linear(self, x, w, b=None):
        """F.linear(x, w, b) with this LoRA; w is the 2-D weight the layer multiplies by."""
        from ..ops import api as F
        if self._foldable(w):
            if w.is_leaf and w.is_contiguous():     # a stored weight: folded once per LoRA set
                return F.linear(x, self._folded(w), b)
            if self._fold_cheaper(x, w):            # a computed one: folded in the graph, per call
                delta = None
                for down_t, up, _ in self.merge_factors:
                    h = F.mul_mat(down_t, up)                  # ne [in, out] = (up @ down) in torch
                    delta = h if delta is None else F.add(delta, h)
                for d in self.dense:
                    dd = d.reshape(w.ne)
                    delta = dd if delta is None else F.add(delta, dd)
                folded = F.add(delta, w)                        # F32: W widened, plus the delta
                if w.dtype.name in _HALF:
                    # back to the weight's 16-bit type: a GPU then runs the GEMM on tensor cores (an
                    # F32 weight there is a pedantic F32 GEMM: an H200 SD1.5 step +96 % against +25 %)
                    folded = F.cast(folded, w.dtype.name)
                return F.linear(x, folded, b)
        return F.add(F.linear(x, w, b), self.output(x, None))

    def _folded(self, w):
        """w + the delta as a leaf of w's type, built on first use and kept while this path is
        registered (a LoRA set): later steps run the base GEMM alone, the stored weight stays
        as it is (a new LoRA set drops it with this path)."""
        if self.fold is None or self.fold[0] is not w:
            deltas = [_Factors(up.numpy(), down_t.numpy().T) for down_t, up, _ in self.merge_factors]
            deltas += [d.numpy for d in self.dense]
            self.fold = (w, _patched(w, deltas))
        return self.fold[1]

    def _foldable(self, w) -> bool:
        return RUNTIME_MERGE != "off" and not w.dtype.is_quantized and w.dtype.is_float and w.ndim == 2 \
            and len(self.merge_factors) == len(self.chains) and bool(self.chains or self.dense)

    def _fold_cheaper(self, x, w) -> bool:
        """Whether folding in the graph costs less than the chains beside the GEMM, per call."""
        if RUNTIME_MERGE == "on":
            return True
        n_in, n_out = w.ne
        rows = x.nelements // x.ne[0]
        r = sum(f[2] for f in self.merge_factors)
        beside = rows * (r * (n_in + n_out) + n_in * n_out * len(self.dense) + _PASS_MACS * n_out)
        passes = 1 + len(self.dense) + len(self.merge_factors) + (w.dtype.name in _HALF)
        folded = n_in * n_out * (r + _PASS_MACS * passes)
        return folded < beside


class _Factors:
    """A low-rank delta as `_Delta.factors()` gives it: up [out, r] (scaled) and down [r, in]."""
    __slots__ = ("up", "down")

    def __init__(self, up, down):
        self.up, self.down = up, down

    def __call__(self) -> np.ndarray:
        return self.up @ self.down

    def factors(self):
        return self.up, self.down


def _as2d(t):
    return t if t.ndim == 2 else t.reshape(t.ne[0] * t.ne[1] * t.ne[2], t.ne[3])


def _as4d(t):
    return t if t.ndim == 4 else t.reshape(1, 1, t.ne[0], t.ne[1])


def _runtime_path(lm: LoraModel, target: str, parts, shape) -> RuntimePath | None:
    from ..io.base import ConvertedTensor
    from ..ops import dtypes
    from ..ops.tensor import Tensor
    group = parts[0][1]
    p = RuntimePath()
    if len(parts) != 1 or parts[0][0] != 0 or _kind(group) == "lokr":   # split parts, LoKr: one dense delta
        d = _plan_delta(lm, target, parts, shape)
        if d is None:
            return None
        p.dense.append(ConvertedTensor(dtypes.get("F32"), shape[::-1], lambda: _weight_bytes(d()),
                                       name=target + ".lora_delta"))
        return p
    down, mid, up, scale = lora_factors(group)
    kernel = mid.shape[2:] if mid is not None else down.shape[2:]
    in_flat = down.shape[1] * int(np.prod(kernel))
    if up.shape[0] != shape[0] or in_flat != int(np.prod(shape[1:])):
        log.warning("skip incompatible LoRA tensor |%s|: model shape = %s, LoRA out %d, in %d",
                    target, list(shape), up.shape[0], in_flat)
        lm.skipped.update(k for k, _ in group.values())
        return None
    lm.applied.update(_keys(group, ["lora_up", "lora_down", "lora_mid", "scale" if "scale" in group else "alpha"]))
    up = up * _F32(scale * lm.multiplier)
    p.chains.append(tuple(Tensor.from_numpy(_read_only(a), name=target + ".lora") if a is not None else None
                          for a in (down, mid, up)) + (1.0,))
    if mid is None and len(shape) >= 2:      # what RuntimePath.linear may fold into the weight
        r = down.shape[0]
        p.merge_factors.append((Tensor.from_numpy(_read_only(down.reshape(r, -1).T), name=target + ".lora"),
                                Tensor.from_numpy(_read_only(up.reshape(up.shape[0], r)), name=target + ".lora"), r))
    return p


def _read_only(a: np.ndarray) -> np.ndarray:
    """Factors as contiguous float32 weights (`as_weight`: device backends keep them resident)."""
    return as_weight(np.ascontiguousarray(a, _F32))


def _weight_bytes(a: np.ndarray) -> np.ndarray:
    return _read_only(a).reshape(-1).view(np.uint8)


# ---- the infotext ----------------------------------------------------------------------------------

def lora_hashes(specs) -> str:
    """A1111's `Lora hashes` value: "name: hash, ...", the hash its image sites read: the first
    12 hex digits of the sha256 of the file, of a .safetensors file without its header (A1111's
    `addnet_hash_safetensors`)."""
    import hashlib
    import struct
    items = []
    for s in specs:
        h = hashlib.sha256()
        with open(s.path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if s.path.lower().endswith(".safetensors") and 8 + n <= os.fstat(f.fileno()).st_size:
                f.seek(8 + n)
            else:
                f.seek(0)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        name = os.path.splitext(os.path.basename(s.path))[0].replace(":", "").replace(",", "")
        items.append(f"{name}: {h.hexdigest()[:12]}")
    return ", ".join(items)
