"""GGUF v2/v3 reader: our own bounded parser over a read-only memory map.

Layout: magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv key/value pairs (u64-length
string key, u32 value type, value); n_tensors tensor infos (name, u32 n_dims, u64 ne[n_dims],
u32 ggml type, u64 offset); padding to `general.alignment` (default 32); the data section.
Tensor offsets are relative to the data section. ne is already ggml's order (ne[0] innermost).

The `gguf` package's reader does not validate (its uint64 size products wrap, nested arrays
recurse without bound, reads past EOF come back short), and ggml's own parser has had a chain
of CVEs from exactly these fields. So every field is checked before use, in exact integer
arithmetic, against the bytes that are actually left in the file:
- magic; version 2 or 3 (1 is obsolete; a byte-swapped version means a big-endian file);
- n_kv, n_tensors: each entry needs a minimum number of bytes, so a count can never exceed
  what the remaining bytes can hold;
- n_kv <= 65,536 and n_tensors <= 65,536 (base.MAX_METADATA_ENTRIES / MAX_TENSORS);
- strings: length <= remaining bytes and <= 1 GiB; keys and tensor names non-empty UTF-8,
  <= 65535 bytes, unique; string values are decoded with surrogateescape (lossless);
- values: a known type; arrays: count * minimal element size <= remaining bytes, at most
  1 Mi strings in all string arrays together (base.MAX_ARRAY_STRINGS); arrays of arrays are
  refused, as ggml's gguf.cpp refuses them; numeric arrays come back as read-only numpy views
  (no copy);
- general.alignment: u32, a non-zero power of two;
- tensors: 1 <= n_dims <= 8 (0 is refused: ggml writes at least one dim; more than 4 dims are
  folded into ne[3], as sd.cpp's GGUF fallback
  reader does for Wan files; ggml itself refuses n_dims > 4), every ne >= 1 (a 0 dim makes an
  empty entry in `ModelFile.raw`), a known type with a non-zero block size (removed types 4/5
  are refused), ne[0] a multiple of the block size, offset a multiple of the alignment,
  data_start + offset + nbytes <= file size, and no two tensors' byte ranges overlap.
"""
from __future__ import annotations

import codecs
import os
import struct

import numpy as np

from ..errors import ModelFileError, OpError
from ..ops import dtypes
from ..ops.tensor import MAX_DIMS, Tensor
from .base import MAX_ARRAY_STRINGS, MAX_METADATA_ENTRIES, MAX_NAME_BYTES, MAX_TENSORS, ModelFile, map_file

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_STRING = 1 << 30
MAX_NAME = MAX_NAME_BYTES
MAX_STRING_ARRAY = MAX_ARRAY_STRINGS
MAX_ARRAY_DEPTH = 1               # an array may not hold arrays (ggml: "nested arrays are not supported")
MAX_TENSOR_DIMS = 8

# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
TYPE_NAMES = ["UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
              "UINT64", "INT64", "FLOAT64"]
SCALAR_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
              BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
SCALAR_NP = {UINT8: "u1", INT8: "i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4",
             FLOAT32: "<f4", BOOL: "u1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}
SCALAR_SIZE = {t: struct.calcsize(f) for t, f in SCALAR_FMT.items()}
# smallest encoding of one array element of each type (a string is at least its u64 length,
# an array its u32 type + u64 count)
MIN_SIZE = {**SCALAR_SIZE, STRING: 8, ARRAY: 12}


_U64 = struct.Struct("<Q")


class _Cursor:
    __slots__ = ("arr", "buf", "pos", "end", "path", "strings_left")

    def __init__(self, arr, path):
        # struct and bytes() on a memoryview are much faster than on the numpy memmap
        self.arr, self.buf, self.pos, self.end, self.path = arr, memoryview(arr), 0, arr.nbytes, path
        self.strings_left = MAX_STRING_ARRAY

    def fail(self, msg):
        raise ModelFileError(f"{self.path}: {msg} (at byte {self.pos})")

    def remain(self) -> int:
        return self.end - self.pos

    def take(self, fmt: str, size: int, what: str):
        if self.pos + size > self.end:
            self.fail(f"file ends inside {what}; truncated file?")
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what):
        return self.take("<I", 4, what)

    def u64(self, what):
        return self.take("<Q", 8, what)

    def raw_string(self, what, limit=MAX_STRING) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > limit or n > self.remain():
            self.fail(f"{what} claims {n} bytes, {min(self.remain(), limit)} allowed here")
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def name(self, what) -> str:
        b = self.raw_string(what, MAX_NAME)
        if not b:
            self.fail(f"{what} is empty")
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8: {b[:80]!r}")

    def strings(self, n: int, what: str) -> list[str]:
        """n GGUF strings, decoded straight from the map (one tight loop: vocabularies are long)."""
        buf, pos, end = self.buf, self.pos, self.end
        unpack, decode = _U64.unpack_from, codecs.utf_8_decode
        out = [""] * n
        for i in range(n):
            if pos + 8 > end:
                self.pos = pos
                self.fail(f"file ends inside {what}[{i}]; truncated file?")
            (ln,) = unpack(buf, pos)
            pos += 8
            if ln:
                if ln > end - pos or ln > MAX_STRING:
                    self.pos = pos
                    self.fail(f"{what}[{i}] claims {ln} bytes, {min(end - pos, MAX_STRING)} allowed here")
                out[i] = decode(buf[pos:pos + ln], "surrogateescape", True)[0]
                pos += ln
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in SCALAR_FMT:
            return self.take(SCALAR_FMT[vtype], SCALAR_SIZE[vtype], what)
        if vtype == STRING:
            return self.raw_string(what).decode("utf-8", "surrogateescape")
        if vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self.fail(f"{what}: an array of arrays; nested arrays are not supported (ggml refuses them too)")
            etype = self.u32(f"the element type of {what}")
            if etype > FLOAT64:
                self.fail(f"{what}: unknown array element type {etype}")
            n = self.u64(f"the length of {what}")
            if n * MIN_SIZE[etype] > self.remain():
                self.fail(f"{what}: array of {n} {TYPE_NAMES[etype]} needs at least {n * MIN_SIZE[etype]} bytes, "
                          f"{self.remain()} are left")
            if etype in SCALAR_NP:
                arr = np.ndarray((n,), np.dtype(SCALAR_NP[etype]), self.arr, self.pos)
                self.pos += n * SCALAR_SIZE[etype]
                return arr.view(np.bool_) if etype == BOOL else arr
            if etype == STRING:
                if n > self.strings_left:
                    self.fail(f"{what}: array of {n} strings; at most {MAX_STRING_ARRAY} strings in all arrays "
                              f"of a file are supported")
                self.strings_left -= n
                return self.strings(n, what)
            if depth + 1 >= MAX_ARRAY_DEPTH:
                self.fail(f"{what}: an array of arrays; nested arrays are not supported (ggml refuses them too)")
            return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(n)]
        self.fail(f"{what}: unknown value type {vtype}")


def read_gguf(path) -> ModelFile:
    """Open a GGUF v2/v3 file lazily. Raises ModelFileError for anything malformed."""
    path = os.fspath(path)
    mm, stamp = map_file(path, "GGUF file")
    file_size = stamp[1]
    c = _Cursor(mm, path)
    if file_size < 24:
        raise ModelFileError(f"{path}: {file_size} bytes, too short for a GGUF header")
    if bytes(mm[:4]) != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r})")
    c.pos = 4
    version = c.u32("the version")
    if version == 1:
        raise ModelFileError(f"{path}: GGUF version 1 is no longer supported; re-convert the model")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and struct.unpack("<I", struct.pack(">I", version))[0] in (2, 3):
            raise ModelFileError(f"{path}: big-endian GGUF files are not supported")
        raise ModelFileError(f"{path}: unsupported GGUF version {version} (sdrt reads 2 and 3)")
    n_tensors = c.u64("the tensor count")
    n_kv = c.u64("the key/value count")
    if n_kv * (8 + 1 + 4 + 1) > c.remain():
        c.fail(f"key/value count {n_kv} cannot fit in the {c.remain()} bytes left")
    if n_tensors * (8 + 1 + 4 + 8 + 4 + 8) > c.remain():  # name, n_dims, ne[0], type, offset
        c.fail(f"tensor count {n_tensors} cannot fit in the {c.remain()} bytes left")
    if n_kv > MAX_METADATA_ENTRIES:
        c.fail(f"key/value count {n_kv}, at most {MAX_METADATA_ENTRIES} are supported")
    if n_tensors > MAX_TENSORS:
        c.fail(f"tensor count {n_tensors}, at most {MAX_TENSORS} are supported")

    meta: dict = {}
    for i in range(n_kv):
        key = c.name(f"key #{i}")
        if key in meta:
            c.fail(f"duplicate key {key!r}")
        vtype = c.u32(f"the type of {key!r}")
        if vtype > FLOAT64:
            c.fail(f"key {key!r}: unknown value type {vtype}")
        meta[key] = c.value(vtype, f"value of {key!r}")
        if key == "general.alignment":
            a = meta[key]
            if vtype != UINT32:
                c.fail(f"general.alignment must be UINT32, not {TYPE_NAMES[vtype]}")
            if a == 0 or a & (a - 1):
                c.fail(f"general.alignment {a} is not a power of two")
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)

    infos = []
    seen = set()
    for i in range(n_tensors):
        name = c.name(f"the name of tensor #{i}")
        if name in seen:
            c.fail(f"duplicate tensor name {name!r}")
        seen.add(name)
        where = f"tensor {name[:200]!r}"
        n_dims = c.u32(f"n_dims of {where}")
        if not 1 <= n_dims <= MAX_TENSOR_DIMS:
            c.fail(f"{where}: n_dims {n_dims}, must be 1 to {MAX_TENSOR_DIMS}")
        ne = [c.u64(f"ne[{j}] of {where}") for j in range(n_dims)]
        type_id = c.u32(f"the type of {where}")
        offset = c.u64(f"the offset of {where}")
        infos.append((name, ne, type_id, offset))

    data_start = -(-c.pos // alignment) * alignment
    if data_start > file_size and n_tensors:
        raise ModelFileError(f"{path}: file ends before the data section (needs {data_start} bytes, has {file_size})")
    mf = ModelFile(path=path, format="gguf", metadata=meta, sources=[stamp])
    ranges = []
    for name, ne, type_id, offset in infos:
        where = f"{path}: tensor {name[:200]!r}"
        dt = dtypes.BY_ID.get(type_id)
        if dt is None or dt.block_size == 0 or dt.type_size == 0:
            raise ModelFileError(f"{where}: unknown ggml type id {type_id}")
        if any(n >= 1 << 63 for n in ne):
            raise ModelFileError(f"{where}: dimension {max(ne)} is out of range (negative as int64)")
        count = 1
        for n in ne:
            count *= n
        if count >= 1 << 63:
            raise ModelFileError(f"{where}: ne={ne} has {count} elements, more than int64 can count")
        ne0 = ne[0] if ne else 1
        if ne0 % dt.block_size:
            raise ModelFileError(f"{where}: ne[0]={ne0} is not a multiple of the {dt.name} block size {dt.block_size}")
        nbytes = count // dt.block_size * dt.type_size
        if offset % alignment:
            raise ModelFileError(f"{where}: offset {offset} is not a multiple of the alignment {alignment}")
        if data_start + offset + nbytes > file_size:
            raise ModelFileError(f"{where}: {dt.name} ne={ne} ({nbytes} bytes at data offset {offset}) runs past "
                                 f"the end of the file ({file_size} bytes); truncated file?")
        if count == 0:
            try:
                mf.raw[name] = np.empty(tuple(reversed(ne)), dt.np_storage or np.uint8)
            except (ValueError, OverflowError, MemoryError) as e:
                raise ModelFileError(f"{where}: empty tensor of ne={ne}: {e}") from None
            continue
        ranges.append((offset, offset + nbytes, name))
        ne = list(ne) or [1]
        while len(ne) > MAX_DIMS:
            ne[MAX_DIMS - 1] *= ne.pop(MAX_DIMS)
        try:
            mf.tensors[name] = Tensor.from_buffer(mm, dt, ne, offset=data_start + offset, name=name)
        except OpError as e:
            raise ModelFileError(f"{where}: {e}") from None
    ranges.sort()
    prev_end, prev_name = 0, None
    for begin, end, name in ranges:
        if begin < prev_end:
            raise ModelFileError(f"{path}: tensor {name!r}: data [{begin}, {end}) overlaps tensor {prev_name!r} "
                                 f"(ends at {prev_end})")
        prev_end, prev_name = end, name
    return mf
