"""Model-file writers (GGUF v3, safetensors) and `convert`, stable-diffusion.cpp's `-M convert`.

Both writers stream: every offset is computed from the tensor plans first, the header is
written, then each tensor is produced (read / converted / quantized), written and dropped, so
peak memory is about one tensor (its float32 copy plus its output bytes). Output goes to a
temporary file in the destination folder that replaces the destination only when everything
was written; a failed or interrupted run leaves no partial output.

GGUF output follows ggml's writer: version 3, alignment 32 (written as general.alignment only
when another value is asked for), tensor data padded to the alignment, and n_dims = ggml_n_dims
(trailing 1 dims dropped, at least 1), so the tensor table equals what sd-cli writes.
sd.cpp's convert writes no key/value metadata at all; `convert` writes
`general.quantization_version` = 2 when a tensor is quantized (llama.cpp's convention) and
keeps the source's own metadata (safetensors `__metadata__` strings, GGUF keys).
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import ModelFileError, OpError, SdrtError, UnsupportedError, UsageError
from ..ops import dtypes
from ..ops.dtypes import DType
from ..ops.tensor import Tensor
from . import gguf_file as G
from .base import ModelFile
from .safetensors import TO_ST_DTYPE

GGUF_VERSION = 3
GGUF_ALIGNMENT = 32

# `--type` values of `sdrt -M convert` (sd.cpp's names; case does not matter)
CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1",
                 "q2_K", "q3_K", "q4_K", "q5_K", "q6_K")


# ---- tensor plans -------------------------------------------------------------------------

@dataclass
class TensorPlan:
    """One tensor to write: its name, dtype and ggml ne, and a function that returns its
    data as raw storage bytes (any contiguous numpy array; exactly nbytes long)."""
    name: str
    dtype: DType
    ne: tuple[int, ...]
    produce: Callable[[], np.ndarray]
    release: Callable[[], None] | None = None  # called once the tensor is written

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n // self.dtype.block_size * self.dtype.type_size


def _plan_of(name: str, t) -> TensorPlan:
    if isinstance(t, TensorPlan):
        return t
    if not isinstance(t, Tensor):
        t = Tensor.from_numpy(np.asarray(t), name=name)
    return TensorPlan(name, t.dtype, t.ne, lambda t=t: t.numpy())


def _plans(tensors) -> list[TensorPlan]:
    if isinstance(tensors, Mapping):
        plans = [_plan_of(k, v) for k, v in tensors.items()]
    else:
        plans = [_plan_of(p.name if isinstance(p, TensorPlan) else p[0],
                          p if isinstance(p, TensorPlan) else p[1]) for p in tensors]
    seen = set()
    for p in plans:
        if not isinstance(p.name, str) or not p.name:
            raise UsageError(f"tensor names must be non-empty strings, got {p.name!r}")
        if p.name in seen:
            raise UsageError(f"tensor {p.name!r} given twice")
        seen.add(p.name)
    return plans


def _raw_bytes(plan: TensorPlan) -> memoryview:
    data = plan.produce()
    arr = np.ascontiguousarray(data)
    if arr.nbytes != plan.nbytes:
        raise ModelFileError(f"tensor {plan.name!r}: produced {arr.nbytes} bytes, "
                             f"{plan.dtype.name} ne={plan.ne} needs {plan.nbytes}")
    return memoryview(arr.reshape(-1).view(np.uint8))


# ---- atomic output ------------------------------------------------------------------------

@contextmanager
def _atomic_output(path: str):
    """A file object on a temp file next to `path` that replaces `path` on success only."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".part", dir=folder)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot create the output file: {e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ModelFileError(f"{path}: writing failed: {e}") from None
        raise


# ---- GGUF ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFValue:
    """A metadata value with an explicit GGUF type (gguf_file.UINT8 ... FLOAT64; for ARRAY give
    `elem_type`). Plain Python / numpy values get a type inferred (see `_infer`)."""
    value: object
    type: int
    elem_type: int | None = None


_NP_TO_GGUF = {np.dtype(k): v for k, v in (("u1", G.UINT8), ("i1", G.INT8), ("<u2", G.UINT16), ("<i2", G.INT16),
                                            ("<u4", G.UINT32), ("<i4", G.INT32), ("<f4", G.FLOAT32),
                                            ("bool", G.BOOL), ("<u8", G.UINT64), ("<i8", G.INT64),
                                            ("<f8", G.FLOAT64))}
_U32_KEYS = {"general.alignment", "general.quantization_version", "general.file_type"}


def _infer_scalar(v) -> int:
    if isinstance(v, (bool, np.bool_)):
        return G.BOOL
    if isinstance(v, np.generic):
        if v.dtype in _NP_TO_GGUF:
            return _NP_TO_GGUF[v.dtype.newbyteorder("<") if v.dtype.byteorder == ">" else v.dtype]
    if isinstance(v, (int, np.integer)):
        v = int(v)
        if 0 <= v < 1 << 32:
            return G.UINT32
        if -(1 << 31) <= v < 0:
            return G.INT32
        return G.UINT64 if v >= 0 else G.INT64
    if isinstance(v, (float, np.floating)):
        return G.FLOAT32
    if isinstance(v, str):
        return G.STRING
    raise UsageError(f"cannot store {type(v).__name__} as GGUF metadata")


def _encode(key: str, v, vtype: int | None = None, elem_type: int | None = None, depth: int = 0) -> tuple[int, bytes]:
    if isinstance(v, GGUFValue):
        return _encode(key, v.value, v.type, v.elem_type, depth)
    if isinstance(v, np.ndarray) and vtype in (None, G.ARRAY):
        dt = v.dtype
        if dt.kind in "US":
            return _encode(key, [str(x) for x in v.tolist()], G.ARRAY, G.STRING, depth)
        et = elem_type if elem_type is not None else _NP_TO_GGUF.get(dt.newbyteorder("<") if dt.byteorder == ">" else dt)
        if et is None or et not in G.SCALAR_NP or v.ndim != 1:
            raise UsageError(f"metadata {key!r}: cannot store a {v.ndim}-d {dt} array")
        arr = np.ascontiguousarray(v.astype(G.SCALAR_NP[et]) if et != G.BOOL else v.astype(np.uint8))
        return G.ARRAY, struct.pack("<IQ", et, arr.size) + arr.tobytes()
    if isinstance(v, (list, tuple)) and vtype in (None, G.ARRAY):
        if depth >= G.MAX_ARRAY_DEPTH:
            raise UsageError(f"metadata {key!r}: an array of arrays (GGUF readers, ggml's included, refuse them)")
        if elem_type is None:
            kinds = set()
            for x in v:
                kinds.add(G.ARRAY if isinstance(x, (list, tuple, np.ndarray)) else _infer_scalar(x))
            if kinds <= {G.UINT32, G.INT32, G.UINT64, G.INT64} and kinds:
                lo, hi = min(int(x) for x in v), max(int(x) for x in v)
                elem_type = (G.UINT32 if lo >= 0 and hi < 1 << 32 else G.INT32 if -(1 << 31) <= lo and hi < 1 << 31
                             else G.INT64)
            elif len(kinds) == 1:
                elem_type = kinds.pop()
            elif not kinds:
                elem_type = G.STRING
            else:
                raise UsageError(f"metadata {key!r}: array mixes element types")
        parts = [struct.pack("<IQ", elem_type, len(v))]
        for x in v:
            parts.append(_encode(key, x, elem_type, None, depth + 1)[1])
        return G.ARRAY, b"".join(parts)
    if vtype is None:
        vtype = G.UINT32 if key in _U32_KEYS and not isinstance(v, (bool, str)) else _infer_scalar(v)
    if vtype == G.STRING:
        if not isinstance(v, str):
            raise UsageError(f"metadata {key!r}: {v!r} is not a string")
        b = v.encode("utf-8", "surrogateescape")
        return G.STRING, struct.pack("<Q", len(b)) + b
    if vtype in G.SCALAR_FMT:
        try:
            return vtype, struct.pack(G.SCALAR_FMT[vtype], v.item() if isinstance(v, np.generic) else v)
        except struct.error as e:
            raise UsageError(f"metadata {key!r}: {v!r} does not fit {G.TYPE_NAMES[vtype]}: {e}") from None
    raise UsageError(f"metadata {key!r}: unknown GGUF type {vtype}")


def _gguf_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _ggml_n_dims(ne) -> tuple[int, ...]:
    ne = list(ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def _pad(n: int, a: int) -> int:
    return -(-n // a) * a


def write_gguf(path, tensors, metadata: Mapping | None = None, alignment: int = GGUF_ALIGNMENT,
               progress: Callable[[int, int, str], None] | None = None) -> int:
    """Write a GGUF v3 file. `tensors`: a mapping name -> Tensor / numpy array / TensorPlan, or
    a sequence of TensorPlan or (name, tensor) pairs, written in that order. `metadata`: key ->
    value (str, int, float, bool, list, 1-d numpy array, GGUFValue). Returns the file size."""
    plans = _plans(tensors)
    if alignment <= 0 or alignment & (alignment - 1) or alignment >= 1 << 32:
        raise UsageError(f"GGUF alignment must be a power of two, got {alignment}")
    meta = dict(metadata or {})
    meta.pop("general.alignment", None)
    if alignment != GGUF_ALIGNMENT:
        meta["general.alignment"] = GGUFValue(alignment, G.UINT32)
    kv = []
    for k, v in meta.items():
        if not isinstance(k, str) or not k:
            raise UsageError(f"GGUF metadata keys must be non-empty strings, got {k!r}")
        t, payload = _encode(k, v)
        kv.append(_gguf_string(k) + struct.pack("<I", t) + payload)
    infos, offsets, off = [], [], 0
    for p in plans:
        ne = _ggml_n_dims(p.ne)
        offsets.append(off)
        infos.append(_gguf_string(p.name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                     + struct.pack("<IQ", p.dtype.id, off))
        off += _pad(p.nbytes, alignment)
    head = _gguf_header(len(plans), len(kv)) + b"".join(kv) + b"".join(infos)
    head += b"\0" * (_pad(len(head), alignment) - len(head))
    total = len(head) + off
    with _atomic_output(path) as f:
        f.write(head)
        for i, p in enumerate(plans):
            if progress:
                progress(i, len(plans), p.name)
            data = _raw_bytes(p)
            f.write(data)
            pad = _pad(p.nbytes, alignment) - p.nbytes
            if pad:
                f.write(b"\0" * pad)
            del data
            if p.release:
                p.release()
        if progress:
            progress(len(plans), len(plans), "")
    return total


def _gguf_header(n_tensors: int, n_kv: int) -> bytes:
    return G.GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, n_tensors, n_kv)


# ---- safetensors --------------------------------------------------------------------------

def write_safetensors(path, tensors, metadata: Mapping[str, str] | None = None,
                      progress: Callable[[int, int, str], None] | None = None) -> int:
    """Write a safetensors file (header padded with spaces to a multiple of 8, tensors
    contiguous in the given order). Only F32 F16 BF16 F8_E4M3 F8_E5M2 I8 I16 I32 I64 F64
    tensors fit; `metadata` must map str -> str. Returns the file size."""
    plans = _plans(tensors)
    header: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise UsageError("safetensors __metadata__ must map strings to strings")
        header["__metadata__"] = dict(metadata)
    off = 0
    for p in plans:
        st = TO_ST_DTYPE.get(p.dtype.name)
        if st is None:
            raise UsageError(f"tensor {p.name!r}: safetensors cannot hold {p.dtype.name}; write a .gguf file instead")
        if p.name == "__metadata__":
            raise UsageError("a tensor cannot be named __metadata__ in safetensors")
        header[p.name] = {"dtype": st, "shape": list(reversed(p.ne)), "data_offsets": [off, off + p.nbytes]}
        off += p.nbytes
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (_pad(len(hb), 8) - len(hb))
    total = 8 + len(hb) + off
    with _atomic_output(path) as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for i, p in enumerate(plans):
            if progress:
                progress(i, len(plans), p.name)
            data = _raw_bytes(p)
            f.write(data)
            del data
            if p.release:
                p.release()
        if progress:
            progress(len(plans), len(plans), "")
    return total


# ---- convert ------------------------------------------------------------------------------

def parse_type(name) -> DType | None:
    """A `--type` value (f32, f16, bf16, q8_0, ..., q6_K; any case) to its DType; None stays None."""
    if name is None or isinstance(name, DType):
        return name
    if not isinstance(name, str) or name.lower() not in {t.lower() for t in CONVERT_TYPES}:
        raise UsageError(f"unknown --type {name!r}; choose one of {', '.join(CONVERT_TYPES)}")
    return dtypes.get(name)


def parse_tensor_type_rules(rules) -> list[tuple[re.Pattern, DType]]:
    """`"regex=type,regex=type"` (sd.cpp's --tensor-type-rules) or a sequence of
    (regex, type) pairs -> compiled rules. The first rule whose regex is found anywhere in a
    tensor's name picks its type (std::regex_search). Unlike sd.cpp, which logs and skips a bad
    item, a bad item is a UsageError."""
    if not rules:
        return []
    if isinstance(rules, str):
        items = []
        for item in rules.split(","):
            if not item:
                continue
            pat, sep, ty = item.rpartition("=")
            if not sep or not pat:
                raise UsageError(f"--tensor-type-rules: {item!r} is not regex=type")
            items.append((pat, ty))
    else:
        items = list(rules)
    out = []
    for pat, ty in items:
        try:
            rx = re.compile(pat)
        except re.error as e:
            raise UsageError(f"--tensor-type-rules: bad regex {pat!r}: {e}") from None
        out.append((rx, parse_type(ty)))
    return out


def tensor_should_be_converted(name: str, ne: Sequence[int], dst: DType | None) -> bool:
    """stable-diffusion.cpp's `ModelLoader::tensor_should_be_converted` (model_loader.cpp @97d2990),
    exactly: a tensor keeps its stored type when its ne[0] is not a multiple of a quantized
    target's block size, or it is a bias / scale, or an embedding / input / output projection
    of the families below."""
    if dst is None:
        return False
    if dst.is_quantized and ne[0] % dst.block_size:
        return False
    if name.endswith((".bias", ".scale", ".weight_scale")):
        return False
    for part in ("img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.",  # Flux
                 "x_embedder.", "t_embedder.", "y_embedder.", "pos_embed", "context_embedder.",  # MMDiT
                 "time_embed.", "label_emb.",  # UNet
                 "embedding"):
        if part in name:
            return False
    return True


def export_type(name: str, t: Tensor, dst: DType | None, rules=(), keep_1d: bool = False) -> DType:
    """The dtype `convert` writes a tensor in: the first matching rule's type, else `dst`;
    then sd.cpp's `tensor_should_be_converted`, else the stored type. sdrt additions: integer
    tensors are never converted, and with `keep_1d` a quantized target is not applied to 1-D
    tensors (norm weights; sd.cpp would quantize e.g. a 320-wide GroupNorm weight to q8_0)."""
    for rx, ty in rules:
        if rx.search(name):
            dst = ty
            break
    if dst is None or dst == t.dtype:
        return t.dtype
    if t.dtype.name in ("I8", "I16", "I32", "I64"):
        return t.dtype
    if keep_1d and dst.is_quantized and all(n == 1 for n in t.ne[1:]):
        return t.dtype
    return dst if tensor_should_be_converted(name, t.ne, dst) else t.dtype


def quantize_like_sd_cpp(x: np.ndarray, dst: DType) -> np.ndarray:
    """float32 rows [..., ne0] -> raw `dst` blocks, as stable-diffusion.cpp's convert_tensor does:
    `ggml_quantize_chunk(dst, x, y, 0, nrows, ne0, imatrix)` with a dummy importance vector of
    ones, which sends Q4_0 ... Q5_1 and Q2_K ... Q6_K through ggml's weighted quantizers
    (quantize_row_*_impl), not the *_ref ones; Q8_0 ignores it. Bit-exact with sd-cli."""
    from ..ops import quant
    return quant.quantize(x, dst, imatrix=np.ones(x.shape[-1], np.float32))


def convert_raw(t: Tensor, dst: DType) -> np.ndarray:
    """A tensor's data in `dst` as raw storage: a zero-copy view when the type is unchanged,
    else widened to float32 (dequantized) and narrowed / quantized row by row (sd.cpp's
    convert_tensor: ggml_fp32_to_fp16_row, or ggml_quantize_chunk with its all-ones
    importance vector: `quantize_like_sd_cpp`)."""
    from ..ops.convert import f32_to_raw, raw_to_f32
    if t.dtype == dst:
        return t.numpy()
    try:
        x = raw_to_f32(t.numpy(), t.dtype)
        if dst.is_quantized:
            return quantize_like_sd_cpp(np.ascontiguousarray(x).reshape(-1, x.shape[-1]), dst)
        return f32_to_raw(x, dst)
    except (ImportError, AttributeError) as e:  # the Cython quant module is not built
        raise UnsupportedError(f"tensor {t.name!r}: converting {t.dtype.name} to {dst.name} needs the quant "
                               f"module sdrt.ops.quant ({e})") from None


_PAGE = mmap.PAGESIZE


def release_pages(t: Tensor) -> None:
    """Drop the resident pages of a memory-mapped tensor (MADV_DONTNEED on its byte range).
    The pages are clean file pages, so a later access just reads them again; this keeps the
    RSS of a streaming pass over a big file at about one tensor."""
    owner = t.owner
    mm = getattr(Tensor.storage.__get__(owner), "_mmap", None)  # np.memmap's mmap object
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = t.offset // _PAGE * _PAGE
    end = min(t.offset + t.span_bytes(), len(mm))
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass


@dataclass
class ConvertSummary:
    """What `convert` wrote."""
    out_path: str
    format: str                      # "gguf" or "safetensors"
    n_tensors: int
    counts: dict[str, int] = field(default_factory=dict)       # output dtype name -> tensors
    bytes_by_type: dict[str, int] = field(default_factory=dict)  # output dtype name -> data bytes
    bytes_in: int = 0                # tensor data bytes read from the source (stored dtypes)
    bytes_out: int = 0               # output file size
    seconds: float = 0.0

    def __str__(self) -> str:
        parts = ", ".join(f"{k}: {v} ({self.bytes_by_type[k] / 2**20:.1f} MiB)" for k, v in sorted(self.counts.items()))
        return (f"wrote {self.out_path} ({self.format}, {self.n_tensors} tensors, {self.bytes_out / 2**20:.1f} MiB "
                f"from {self.bytes_in / 2**20:.1f} MiB, {self.seconds:.1f} s): {parts}")


# stable-diffusion.cpp's `unused_tensors` (model_loader.cpp @97d2990): name prefixes its loader
# drops from every file (schedule buffers, EMA state, position_ids, logit_scale, ...)
UNUSED_TENSORS = (
    "betas", "alphas_cumprod_prev", "sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
    "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
    "cond_stage_model.transformer.text_model.embeddings.position_ids",
    "cond_stage_model.1.model.text_model.embeddings.position_ids",
    "cond_stage_model.transformer.vision_model.embeddings.position_ids",
    "cond_stage_model.model.logit_scale",
    "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
    "conditioner.embedders.0.model.logit_scale", "conditioner.embedders.1.model.logit_scale",
    "model.diffusion_model.time_embedding.cond_proj.weight", "unet.time_embedding.cond_proj.weight",
    "model_ema.decay", "model_ema.num_updates", "model_ema.diffusion_model", "embedding_manager",
    "denoiser.sigmas", "text_encoders.t5xxl.transformer.encoder.embed_tokens.weight", "ztsnr",
    "edm_vpred.sigma_min", "text_encoders.llm.output.weight", "text_encoders.llm.lm_head.",
)


def is_unused_tensor(name: str) -> bool:
    """True for tensors stable-diffusion.cpp's loader ignores (checked before any prefix)."""
    return name.startswith(UNUSED_TENSORS)


def _gather_inputs(in_path, drop_unused: bool = True) -> tuple[dict[str, Tensor], dict]:
    from . import open_model
    if isinstance(in_path, (str, os.PathLike, ModelFile)):
        in_path = [(in_path, "")]
    tensors: dict[str, Tensor] = {}
    meta: dict = {}
    for src, prefix in in_path:
        mf = src if isinstance(src, ModelFile) else open_model(src)
        for name, t in mf.tensors.items():
            if drop_unused and is_unused_tensor(name):
                continue
            full = name if name.startswith(prefix) else prefix + name  # as sd.cpp: never prefix twice
            if full in tensors:
                raise ModelFileError(f"{mf.path}: tensor {full!r} is also in another input")
            tensors[full] = t
        for k, v in mf.metadata.items():
            meta.setdefault(k, v)
    if not tensors:
        raise ModelFileError(f"{in_path[0][0] if in_path else 'convert'}: no tensors to convert")
    return tensors, meta


def convert(in_path, out_path, type=None, tensor_type_rules=None, *, rename: Callable[[str], str] | None = None,
            keep_1d: bool = False, keep_metadata: bool = True, drop_unused: bool = True, sort_names: bool = True,
            progress: Callable[[int, int, str], None] | None = None) -> ConvertSummary:
    """Convert / quantize a model file, as `sd-cli -M convert -m IN -o OUT --type T
    [--tensor-type-rules "regex=type,..."]`.

    in_path: a path (any format `open_model` reads), a ModelFile, or a sequence of
      (path or ModelFile, name prefix) pairs, like sd.cpp's convert_with_components
      (prefixes "text_encoders.clip_l.transformer.", "model.diffusion_model.", "vae.", ...).
    out_path: ends with .safetensors -> safetensors, anything else -> GGUF (as sd.cpp).
    type: one of CONVERT_TYPES, or None to keep every tensor's stored type.
    tensor_type_rules: "regex=type,..." or [(regex, type), ...]; first match wins.
      A name that already starts with its prefix is not prefixed again (as sd.cpp).
    rename: applied to every (prefixed) name, e.g. the canonical-name converter (--convert-name).
    keep_1d: never quantize 1-D tensors (norm weights). Default False: exactly what sd-cli writes.
    keep_metadata: carry the source's metadata over (string values only into safetensors).
    drop_unused: drop what sd.cpp's loader drops (UNUSED_TENSORS: schedule buffers, position_ids ...).
    sort_names: write tensors sorted by name, as sd-cli does (its table is a std::map); else
      in input order. Tensors are converted and written one at a time. Returns a ConvertSummary.
    Raises UsageError for bad arguments, ModelFileError for unreadable input / unwritable output.
    """
    t0 = time.perf_counter()
    out_path = os.fspath(out_path)
    dst = parse_type(type)
    rules = parse_tensor_type_rules(tensor_type_rules)
    to_st = out_path.lower().endswith(".safetensors")
    if to_st:
        for d in [dst] + [r[1] for r in rules]:
            if d is not None and d.is_quantized:
                raise UsageError(f"{out_path}: safetensors cannot hold {d.name} blocks; write a .gguf file instead")
    tensors, src_meta = _gather_inputs(in_path, drop_unused)
    renamed: dict[str, tuple[str, Tensor]] = {}
    for name, t in tensors.items():
        out_name = rename(name) if rename else name
        if not isinstance(out_name, str) or not out_name:
            raise UsageError(f"rename gave {out_name!r} for tensor {name!r}")
        if out_name in renamed:
            raise ModelFileError(f"tensor name {out_name!r} (from {name!r} and {renamed[out_name][0]!r}) occurs "
                                 f"twice after renaming")
        renamed[out_name] = (name, t)
    order = sorted(renamed) if sort_names else list(renamed)
    plans, summary = [], ConvertSummary(out_path, "safetensors" if to_st else "gguf", len(order))
    for out_name in order:
        name, t = renamed[out_name]
        ot = export_type(out_name, t, dst, rules, keep_1d)
        if to_st and ot.name not in TO_ST_DTYPE:
            ot = dst if dst is not None and not dst.is_quantized else dtypes.F32
        plan = TensorPlan(out_name, ot, t.ne, lambda t=t, ot=ot: convert_raw(t, ot), lambda t=t: release_pages(t))
        plans.append(plan)
        summary.counts[ot.name] = summary.counts.get(ot.name, 0) + 1
        summary.bytes_by_type[ot.name] = summary.bytes_by_type.get(ot.name, 0) + plan.nbytes
        summary.bytes_in += t.nbytes
    try:
        if to_st:
            meta = {k: v for k, v in src_meta.items() if isinstance(k, str) and isinstance(v, str)} if keep_metadata else {}
            summary.bytes_out = write_safetensors(out_path, plans, meta, progress)
        else:
            meta = {}
            if keep_metadata:
                for k, v in src_meta.items():
                    if k == "general.alignment":
                        continue
                    try:
                        _encode(k, v)
                    except UsageError:
                        continue
                    meta[k] = v
            if any(p.dtype.is_quantized for p in plans):
                meta["general.quantization_version"] = GGUFValue(2, G.UINT32)
            summary.bytes_out = write_gguf(out_path, plans, meta, progress=progress)
    except SdrtError:
        raise
    except (OpError, ValueError, MemoryError) as e:
        raise ModelFileError(f"{out_path}: conversion failed: {e}") from None
    summary.seconds = time.perf_counter() - t0
    return summary
