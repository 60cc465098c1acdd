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
import re
import struct

import numpy as np

from ..errors import ModelFileError, OpError
from ..ops.tensor import MAX_DIMS, Tensor
from .base import (MAX_HEADER_BYTES, MAX_METADATA_ENTRIES, MAX_NAME_BYTES, MAX_TENSORS, ConvertedTensor, ModelFile,
                   check_regular_file, map_file, open_regular)

MAX_HEADER_SIZE = MAX_HEADER_BYTES
MAX_INDEX_SIZE = 100_000_000
# Cheap upper bounds, counted on the raw header bytes before json.loads builds anything: every tensor
# entry needs one '{' and two '[' and four ':'. A header beyond them (e.g. millions of `"k":[]`) is
# refused in milliseconds instead of costing gigabytes of Python objects.
MAX_HEADER_CONTAINERS = 3 * MAX_TENSORS + MAX_METADATA_ENTRIES
MAX_HEADER_COLONS = 4 * MAX_TENSORS + 4 * MAX_METADATA_ENTRIES
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
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
    d = dict(pairs)              # C speed; only on a size mismatch do we look for the culprit
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def _has_lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


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


class _Obj(list):
    """A JSON object of the safetensors header as its (key, value) pairs. json's C scanner builds it
    without running Python code (a Python object_pairs_hook costs more than the parse itself on
    headers of many tensors); `_as_dict` turns the ones we use into dicts, refusing duplicate keys."""
    __slots__ = ()


def _json_kind(v) -> str:
    return ("object" if type(v) is _Obj else "array" if type(v) is list else "string" if type(v) is str
            else "null" if v is None else type(v).__name__)


def _as_dict(path, what, obj) -> dict:
    d = dict(obj)
    if len(d) != len(obj):
        seen = set()
        for k, _ in obj:
            if k in seen:
                raise ModelFileError(f"{path}: {what} has the key {k[:200]!r} twice")
            seen.add(k)
    return d


def _parse_header(data: bytes, path: str):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path}: safetensors header is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_Obj, parse_constant=_bad_constant)
    except RecursionError:
        raise ModelFileError(f"{path}: safetensors header is nested too deeply") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as e:  # JSONDecodeError is a ValueError
        raise ModelFileError(f"{path}: safetensors header is not valid JSON: {str(e)[:200]}") from None


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
    hb = mm[8:8 + n].tobytes()
    containers, colons = hb.count(b"{") + hb.count(b"["), hb.count(b":")
    if containers > MAX_HEADER_CONTAINERS or colons > MAX_HEADER_COLONS:
        raise ModelFileError(f"{path}: safetensors header has {containers} '{{'/'[' and {colons} ':' characters, "
                             f"more than {MAX_TENSORS} tensors and {MAX_METADATA_ENTRIES} metadata entries can need")
    header = _parse_header(hb, path)
    if type(header) is not _Obj:
        raise ModelFileError(f"{path}: safetensors header is a JSON {_json_kind(header)}, not an object")
    if len(header) > MAX_TENSORS + 1:
        raise ModelFileError(f"{path}: {len(header) - 1} tensors, at most {MAX_TENSORS} are supported")
    # JSON \ud800-style escapes decode to lone surrogates, which are not text (the reference reader and
    # every writer refuse them); only look for them when the raw bytes hold such an escape
    check_text = _SURROGATE_ESCAPE.search(hb) is not None
    del hb
    header = _as_dict(path, "safetensors header", header)
    data_start = 8 + n
    data_len = file_size - data_start
    mf = ModelFile(path=path, format="safetensors", sources=[stamp])

    meta = header.pop("__metadata__", None)
    if meta is not None:
        if type(meta) is not _Obj:
            raise ModelFileError(f"{path}: __metadata__ must map strings to strings, not a JSON {_json_kind(meta)}")
        meta = _as_dict(path, "__metadata__", meta)
        if not all(type(v) is str for v in meta.values()):
            raise ModelFileError(f"{path}: __metadata__ must map strings to strings")
        if len(meta) > MAX_METADATA_ENTRIES:
            raise ModelFileError(f"{path}: __metadata__ has {len(meta)} entries, at most {MAX_METADATA_ENTRIES}")
        if check_text and any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in meta.items()):
            raise ModelFileError(f"{path}: __metadata__ holds a lone UTF-16 surrogate escape (not text)")
        mf.metadata.update(meta)

    ranges = []
    for name, info in header.items():
        if len(name) > MAX_NAME_BYTES // 4 and len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise ModelFileError(f"{path}: tensor name {name[:100]!r}... is longer than {MAX_NAME_BYTES} bytes")
        if check_text and _has_lone_surrogate(name):
            raise ModelFileError(f"{path}: tensor name {name[:200]!r} holds a lone UTF-16 surrogate escape (not text)")
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
    if type(info) is not _Obj:
        raise ModelFileError(f"{path}: tensor {name[:200]!r}: entry is a JSON {_json_kind(info)}, not an object")
    info = _as_dict(path, f"tensor {name[:200]!r}", info)
    st_dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(st_dtype) is str and st_dtype in ST_DTYPES and type(shape) is list and len(shape) <= MAX_SHAPE_DIMS \
            and all(type(d) is int and 0 <= d < 1 << 63 for d in shape) and type(offs) is list and len(offs) == 2 \
            and type(offs[0]) is int and type(offs[1]) is int and 0 <= offs[0] <= offs[1] <= data_len:
        begin, end = offs          # the common case: one cheap test; the size check below still runs
    else:
        begin, end = _entry_error(path, name, st_dtype, shape, offs, data_len)
    n = 1
    for d in shape:
        n *= d  # exact: Python ints never wrap
    bits = ST_DTYPES[st_dtype][0]
    if n * bits % 8:
        raise ModelFileError(f"{path}: tensor {name[:200]!r}: {n} {st_dtype} elements do not fill whole bytes")
    if n * bits // 8 != end - begin:
        raise ModelFileError(f"{path}: tensor {name[:200]!r}: shape {shape} of {st_dtype} needs {n * bits // 8} "
                             f"bytes, data_offsets [{begin}, {end}] hold {end - begin}")
    return begin, end, st_dtype, shape


def _entry_error(path, name, st_dtype, shape, offs, data_len):
    """Say what is wrong with an entry that failed the fast test (raises), or return its offsets."""
    where = f"{path}: tensor {name[:200]!r}"
    if not isinstance(st_dtype, str):
        raise ModelFileError(f"{where}: missing or non-string dtype")
    if st_dtype not in ST_DTYPES:
        raise ModelFileError(f"{where}: unknown dtype {st_dtype[:40]!r}")
    if type(shape) is not list or not all(_is_int(d) for d in shape):
        raise ModelFileError(f"{where}: shape must be a list of integers, got {str(shape)[:100]}")
    if len(shape) > MAX_SHAPE_DIMS:
        raise ModelFileError(f"{where}: {len(shape)} dims, at most {MAX_SHAPE_DIMS} are supported")
    if any(d < 0 for d in shape):
        raise ModelFileError(f"{where}: negative dimension in shape {str(shape)[:200]}")
    if any(d >= 1 << 63 for d in shape):
        raise ModelFileError(f"{where}: dimension out of range in shape {str(shape)[:200]}")
    if type(offs) is not list or len(offs) != 2 or not all(_is_int(o) for o in offs):
        raise ModelFileError(f"{where}: data_offsets must be [begin, end] integers, got {str(offs)[:100]}")
    begin, end = offs
    if begin < 0:
        raise ModelFileError(f"{where}: data_offsets [{begin}, {end}] negative begin")
    if end < begin:
        raise ModelFileError(f"{where}: data_offsets [{begin}, {end}] end before begin")
    if end > data_len:
        raise ModelFileError(f"{where}: data_offsets [{begin}, {end}] past the end of the data "
                             f"({data_len} bytes); truncated file?")
    return begin, end


def _converter(path, name, mm, off, shape, st_dtype):
    count = 1
    for d in shape:
        count *= d

    def fill():
        try:
            src = np.ndarray((count,), np.dtype("<f8" if st_dtype == "F64" else "<i8"), mm, off)
            if st_dtype == "F64":
                with np.errstate(all="ignore"):
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
        size = check_regular_file(path, what).st_size
        if size > limit:
            raise ModelFileError(f"{path}: {what} of {size} bytes is implausibly large")
        with open_regular(path, what) as f:
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
