"""safetensors reader: our own header parser, lazy tensors over a read-only memory map.

Format (https://huggingface.co/docs/safetensors): 8-byte little-endian header length N, N
bytes of UTF-8 JSON `{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`, then the byte buffer; offsets are relative to its start.

Validation (every failure is a ModelFileError naming the file, the tensor and the problem;
no other exception escapes):
- N <= 100,000,000 (the reference reader's cap) and 8 + N <= file size;
- the header is UTF-8, one JSON object, no duplicate keys at any level (json.loads keeps the
  last one silently, so we use object_pairs_hook), no NaN/Infinity constants, no numbers
  beyond Python's int-string limit, no nesting deep enough to recurse out;
- `__metadata__` maps strings to strings (as the reference requires);
- per tensor: a known dtype, a shape of non-negative ints (bool is not an int here),
  data_offsets two ints with 0 <= begin <= end <= buffer size, and end - begin equal to
  prod(shape) * bits / 8 in exact (Python) integer arithmetic, so no product can wrap;
- no two tensors' byte ranges overlap (the "many tensors on the same bytes" DoS).
Holes between tensors and trailing bytes are accepted, as stable-diffusion.cpp accepts
them (the reference reader refuses them to rule out polyglot files; sdrt only reads
declared ranges, so they cannot alias tensor data).

Dtypes (sd.cpp's mapping, plus the ones sd.cpp refuses):
- F32 F16 BF16 F8_E4M3 F8_E5M2 I8 I16 I32: zero-copy tensors of that dtype.
- F64 -> F32 and I64 -> I32 (as sd.cpp): ConvertedTensor, converted on first access (a
  copy; I64 values outside int32 raise ModelFileError then).
- BOOL -> I8, zero copy (0/1 keep their value).
- U8, U16, U32, U64, C64, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ: sdrt's tensor table has no
  such type (reading U8 as I8 would change 128..255), so they go to `ModelFile.raw` as
  read-only numpy arrays of their numpy dtype (F8 variants as uint8), e.g. ComfyUI's
  `*.comfy_quant` U8 JSON blobs. F4/F6 (sub-byte) go there as flat uint8 bytes.
- Tensors with a 0 dim go to `raw` as empty arrays (sdrt tensors have dims >= 1).
Shapes: 0-d becomes ne (1,); more than 4 dims are folded by merging the outermost numpy
dims (sd.cpp folds 5-D as numpy (a*b, c, d, e)).
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from ..errors import ModelFileError, OpError
from ..ops.tensor import MAX_DIMS, Tensor
from .base import ConvertedTensor, ModelFile, map_file

MAX_HEADER_SIZE = 100_000_000
MAX_INDEX_SIZE = 100_000_000
MAX_SHAPE_DIMS = 8

# safetensors dtype -> (bits per element, sdrt dtype name or None, numpy dtype for `raw`)
ST_DTYPES: dict[str, tuple[int, str | None, str]] = {
    "F32": (32, "F32", "<f4"), "F16": (16, "F16", "<f2"), "BF16": (16, "BF16", "<u2"),
    "F8_E4M3": (8, "F8_E4M3", "u1"), "F8_E5M2": (8, "F8_E5M2", "u1"),
    "I8": (8, "I8", "i1"), "I16": (16, "I16", "<i2"), "I32": (32, "I32", "<i4"),
    "F64": (64, "F32", "<f8"), "I64": (64, "I32", "<i8"), "BOOL": (8, "I8", "i1"),
    "U8": (8, None, "u1"), "U16": (16, None, "<u2"), "U32": (32, None, "<u4"),
    "U64": (64, None, "<u8"), "C64": (64, None, "<c8"), "F8_E8M0": (8, None, "u1"),
    "F8_E4M3FNUZ": (8, None, "u1"), "F8_E5M2FNUZ": (8, None, "u1"),
    "F4": (4, None, "u1"), "F6_E2M3": (6, None, "u1"), "F6_E3M2": (6, None, "u1"),
}
# sdrt dtype -> safetensors dtype name, for writers
TO_ST_DTYPE = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F8_E4M3": "F8_E4M3", "F8_E5M2": "F8_E5M2",
               "I8": "I8", "I16": "I16", "I32": "I32", "I64": "I64", "F64": "F64"}


class _DuplicateKey(Exception):
    pass


def _no_dups(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def _bad_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


def parse_json_strict(data: bytes, path: str, what: str):
    """UTF-8 JSON with duplicate keys, NaN/Infinity and runaway nesting refused."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path}: {what} is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_dups, parse_constant=_bad_constant)
    except _DuplicateKey as e:
        raise ModelFileError(f"{path}: {what} has the key {str(e.args[0])[:200]!r} twice") from None
    except RecursionError:
        raise ModelFileError(f"{path}: {what} is nested too deeply") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as e:  # JSONDecodeError is a ValueError
        raise ModelFileError(f"{path}: {what} is not valid JSON: {str(e)[:200]}") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fold_shape(shape: list[int]) -> tuple[int, ...]:
    """numpy-order shape -> ggml ne (<= 4 dims; outermost dims merged; 0-d -> (1,))."""
    shape = list(shape) or [1]
    while len(shape) > MAX_DIMS:
        shape = [shape[0] * shape[1]] + shape[2:]
    return tuple(reversed(shape))


def read_safetensors(path) -> ModelFile:
    """Open one .safetensors file lazily. Raises ModelFileError for anything malformed."""
    path = os.fspath(path)
    mm, stamp = map_file(path, "safetensors file")
    file_size = stamp[1]
    if file_size < 8:
        raise ModelFileError(f"{path}: {file_size} bytes, too short for a safetensors file (8-byte header length)")
    (n,) = struct.unpack_from("<Q", mm, 0)
    if n > MAX_HEADER_SIZE:
        raise ModelFileError(f"{path}: header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit "
                             f"(not a safetensors file, or corrupt)")
    if 8 + n > file_size:
        raise ModelFileError(f"{path}: header length {n} runs past the end of the file ({file_size} bytes); "
                             f"truncated download?")
    header = parse_json_strict(mm[8:8 + n].tobytes(), path, "safetensors header")
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + n
    data_len = file_size - data_start
    mf = ModelFile(path=path, format="safetensors", sources=[stamp])

    meta = header.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ModelFileError(f"{path}: __metadata__ must map strings to strings")
        mf.metadata.update(meta)

    ranges = []
    for name, info in header.items():
        begin, end, st_dtype, shape = _check_entry(path, name, info, data_len)
        ranges.append((begin, end, name))
        bits, sd_name, np_dt = ST_DTYPES[st_dtype]
        off = data_start + begin
        if sd_name is None or 0 in shape:
            try:
                if bits % 8:
                    arr = mm[off:data_start + end]
                elif end > begin:
                    arr = np.ndarray(tuple(shape), np.dtype(np_dt), mm, off)
                else:
                    arr = np.empty(tuple(shape), np.dtype(np_dt))
            except (ValueError, OverflowError, MemoryError) as e:
                raise ModelFileError(f"{path}: tensor {name[:200]!r}: shape {str(shape)[:200]}: {e}") from None
            mf.raw[name] = arr
            continue

        ne = _fold_shape(shape)
        try:
            if st_dtype in ("F64", "I64"):
                mf.tensors[name] = ConvertedTensor(sd_name, ne, _converter(path, name, mm, off, shape, st_dtype),
                                                   name=name)
            else:
                mf.tensors[name] = Tensor.from_buffer(mm, sd_name, ne, offset=off, name=name)
        except OpError as e:  # cannot happen after the checks above; keep the contract anyway
            raise ModelFileError(f"{path}: tensor {name!r}: {e}") from None

    ranges.sort()
    prev_end, prev_name = 0, None
    for begin, end, name in ranges:
        if end == begin:
            continue
        if begin < prev_end:
            raise ModelFileError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] overlap tensor "
                                 f"{prev_name!r} (ends at {prev_end})")
        prev_end, prev_name = end, name
    return mf


def _check_entry(path, name, info, data_len):
    where = f"{path}: tensor {name[:200]!r}"
    if not isinstance(info, dict):
        raise ModelFileError(f"{where}: entry is a JSON {type(info).__name__}, not an object")
    st_dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(st_dtype, str):
        raise ModelFileError(f"{where}: missing or non-string dtype")
    if st_dtype not in ST_DTYPES:
        raise ModelFileError(f"{where}: unknown dtype {st_dtype[:40]!r}")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise ModelFileError(f"{where}: shape must be a list of integers, got {str(shape)[:100]}")
    if len(shape) > MAX_SHAPE_DIMS:
        raise ModelFileError(f"{where}: {len(shape)} dims, at most {MAX_SHAPE_DIMS} are supported")
    if any(d < 0 for d in shape):
        raise ModelFileError(f"{where}: negative dimension in shape {str(shape)[:200]}")
    if any(d >= 1 << 63 for d in shape):
        raise ModelFileError(f"{where}: dimension out of range in shape {str(shape)[:200]}")
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
        raise ModelFileError(f"{where}: data_offsets must be [begin, end] integers, got {str(offs)[:100]}")
    begin, end = offs
    if begin < 0:
        raise ModelFileError(f"{where}: data_offsets [{begin}, {end}] negative begin")
    if end < begin:
        raise ModelFileError(f"{where}: data_offsets [{begin}, {end}] end before begin")
    if end > data_len:
        raise ModelFileError(f"{where}: data_offsets [{begin}, {end}] past the end of the data "
                             f"({data_len} bytes); truncated file?")
    n = 1
    for d in shape:
        n *= d  # exact: Python ints never wrap
    bits = ST_DTYPES[st_dtype][0]
    if n * bits % 8:
        raise ModelFileError(f"{where}: {n} {st_dtype} elements do not fill whole bytes")
    if n * bits // 8 != end - begin:
        raise ModelFileError(f"{where}: shape {shape} of {st_dtype} needs {n * bits // 8} bytes, "
                             f"data_offsets [{begin}, {end}] hold {end - begin}")
    return begin, end, st_dtype, shape


def _converter(path, name, mm, off, shape, st_dtype):
    count = 1
    for d in shape:
        count *= d

    def fill():
        try:
            src = np.ndarray((count,), np.dtype("<f8" if st_dtype == "F64" else "<i8"), mm, off)
            if st_dtype == "F64":
                with np.errstate(over="ignore"):
                    return src.astype(np.float32).view(np.uint8)
            lo, hi = (int(src.min()), int(src.max())) if count else (0, 0)
            if lo < -2**31 or hi >= 2**31:
                raise ModelFileError(f"{path}: tensor {name!r}: I64 values [{lo}, {hi}] do not fit the I32 "
                                     f"it is read as")
            return src.astype(np.int32).view(np.uint8)
        except ModelFileError:
            raise
        except (ValueError, TypeError, MemoryError, OSError) as e:
            raise ModelFileError(f"{path}: tensor {name!r}: cannot read {st_dtype} data: {e}") from None
    return fill


def read_json_file(path: str, what: str, limit: int = MAX_INDEX_SIZE):
    """A small JSON file (index, model_index.json, config), size-capped and strictly parsed."""
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise ModelFileError(f"{path}: {what} of {size} bytes is implausibly large")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except ModelFileError:
        raise
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read the {what}: {e}") from None
    return parse_json_strict(data, path, what)


def read_safetensors_index(path) -> ModelFile:
    """Open a sharded set through its `*.safetensors.index.json`.

    Every `weight_map` entry must name a shard inside the index's folder (no absolute paths,
    no `..` or symlink leaving it, no .json shard) and the tensor must exist in that shard; a
    tensor found in two shards is an error (sd.cpp lets the last one win silently)."""
    path = os.fspath(path)
    index = read_json_file(path, "safetensors index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ModelFileError(f"{path}: not a safetensors index (no \"weight_map\" object)")
    wmap = index["weight_map"]
    if not wmap:
        raise ModelFileError(f"{path}: safetensors index lists no tensors")
    folder = os.path.dirname(os.path.abspath(path))
    real_folder = os.path.realpath(folder)
    shard_files: dict[str, str] = {}
    for tname, shard in wmap.items():
        if not isinstance(shard, str) or not shard:
            raise ModelFileError(f"{path}: tensor {tname!r}: shard must be a file name, got {str(shard)[:100]!r}")
        if shard not in shard_files:
            if os.path.isabs(shard) or "\0" in shard:
                raise ModelFileError(f"{path}: tensor {tname!r}: shard path {shard!r} must be relative to the index")
            full = os.path.normpath(os.path.join(folder, shard))
            real = os.path.realpath(full)
            if os.path.commonpath([real_folder, real]) != real_folder or real == real_folder:
                raise ModelFileError(f"{path}: tensor {tname!r}: shard path {shard!r} leaves the model folder")
            if shard.lower().endswith(".json"):
                raise ModelFileError(f"{path}: tensor {tname!r}: shard {shard!r} is not a safetensors file")
            if not os.path.isfile(real):
                raise ModelFileError(f"{path}: tensor {tname!r}: shard {shard!r} is missing")
            shard_files[shard] = full
    mf = ModelFile(path=path, format="safetensors")
    if isinstance(index.get("metadata"), dict):
        mf.metadata["index.metadata"] = index["metadata"]
    owner: dict[str, str] = {}
    shards: dict[str, ModelFile] = {}
    for shard, full in shard_files.items():
        sm = read_safetensors(full)
        shards[shard] = sm
        mf.sources.extend(sm.sources)
        for k, v in sm.metadata.items():
            mf.metadata.setdefault(k, v)
        for table, dst in ((sm.tensors, mf.tensors), (sm.raw, mf.raw)):
            for tname, t in table.items():
                if tname in owner:
                    raise ModelFileError(f"{path}: tensor {tname!r} is in two shards, {owner[tname]!r} and {shard!r}")
                owner[tname] = shard
                dst[tname] = t
    for tname, shard in wmap.items():
        if owner.get(tname) != shard:
            raise ModelFileError(f"{path}: tensor {tname!r} is missing from its declared shard {shard!r}")
    return mf
