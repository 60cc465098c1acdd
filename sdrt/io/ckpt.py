"""PyTorch checkpoints (.ckpt/.pt/.pth/.bin): zip and legacy formats, read without executing them.

A checkpoint is a pickle that names Python callables (`torch._utils._rebuild_tensor_v2`,
`collections.OrderedDict`, ...) and asks the unpickler to call them. We never do: the pickle
runs on our own small virtual machine (`_PickleVM` in pickle_vm.py, pure Python, like sd.cpp's pickle_io.cpp and
torch's weights_only unpickler). GLOBAL/STACK_GLOBAL only push an inert `_Global(module, name)`
marker, and only names in `_GLOBALS` are accepted at all; REDUCE/NEWOBJ look the marker up in our
own table of handlers that build plain records (a tensor reference, a dict, a tuple). Nothing
is ever imported, no attribute of a file-named object is looked up, and any other global, opcode
or call target raises ModelFileError naming it. There is no fallback to an executing loader.

Layouts
- zip (torch >= 1.6): `<prefix>/data.pkl`, `<prefix>/data/<key>` (one per storage), optional
  `byteorder`, `version`, `.format_version`, `.storage_alignment`, `.data/serialization_id`.
  Storages stored uncompressed (as torch writes them) are memory-mapped from the file: zero copy,
  nothing read until used. Deflated ones (a re-zipped file) are inflated into RAM, capped.
- legacy (torch < 1.6, or `_use_new_zipfile_serialization=False`): pickles of the magic number,
  protocol 1001 and sys_info, then the object pickle, then the sorted storage keys; then for each
  key an 8-byte element count and the raw bytes. Also memory-mapped.

The table: a `state_dict` / `model` / `module` wrapper is unwrapped (sd.cpp and A1111 do too),
nested dicts of tensors are flattened with dots (`string_to_param.*`), non-tensor entries
(global_step, epoch, ...) stay out of the table; top-level scalars go to
`metadata["pickle_scalars"]`. Tensors keep their stored dtype. Those sdrt has no dtype for
(uint8, bool, complex, fnuz float8) and empty tensors are listed in `metadata["skipped"]`.
Rank-0 tensors become ne=(1,) as in sd.cpp; 5-D and higher contiguous tensors fold their top
dims into ne[3] (sd.cpp folds Wan's 5-D patch embedding the same way).
"""
from __future__ import annotations

import os
import struct
import zipfile
import zlib

import numpy as np

from ..errors import ModelFileError
from ..ops.tensor import MAX_DIMS, Tensor
from .base import (MAX_INFLATE_RATIO, MAX_NAME_BYTES, MAX_PICKLE_BYTES, MAX_TENSORS, MAX_ZIP_ENTRIES, ConvertedTensor,
                   ModelFile, inflate_budget, map_file, open_regular)

from .pickle_vm import (_GLOBALS, _STORAGES, _TORCH_DTYPES, _WIDE, _Fail, _Global, _int, _need, _Opaque,  # noqa: F401
                        _PickleVM, _Storage, _TensorRef)

__all__ = ["read_ckpt", "is_torch_zip", "is_torch_legacy"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001

MAX_NEST = 8                        # nested dicts flattened into tensor names
MAX_CENTRAL_DIRECTORY = 16 << 20    # zip central directory bytes (zipfile builds a ZipInfo per entry)


# ---- turning the unpickled object into a tensor table ---------------------------------------

def _is_simple(v):
    return type(v) in (int, float, bool, str, type(None)) and (type(v) is not str or len(v) <= 1024)


def _select_state_dict(root, meta):
    _need(isinstance(root, dict), lambda: f"the pickle holds a {type(root).__name__}, not a dict of tensors "
          "(a whole pickled model object cannot be read safely; save its state_dict)")
    scalars = {}
    obj = root
    wrappers = []
    for _ in range(4):
        for k, v in obj.items():
            if type(k) is str and _is_simple(v) and len(scalars) < 256:
                scalars.setdefault(k, v)
        for key in ("state_dict", "model", "module"):
            v = obj.get(key)
            if isinstance(v, dict) and _holds_tensor(v):
                wrappers.append(key)
                obj = v
                break
        else:
            break
    if scalars:
        meta["pickle_scalars"] = scalars
    if wrappers:
        meta["wrapper"] = ".".join(wrappers)
    return obj


def _holds_tensor(d) -> bool:
    todo, seen = [(d, 0)], set()
    while todo:
        cur, depth = todo.pop()
        if id(cur) in seen or depth > MAX_NEST:
            continue
        seen.add(id(cur))
        for v in cur.values():
            if isinstance(v, _TensorRef):
                return True
            if isinstance(v, dict):
                todo.append((v, depth + 1))
    return False


def _flatten(sd) -> tuple[dict, list]:
    """{name: _TensorRef} with nested dicts joined by '.', and [(name, why)] for what is left out."""
    out, skipped = {}, []
    seen = set()
    todo = [("", sd, 0)]
    while todo:
        prefix, d, depth = todo.pop()
        _need(id(d) not in seen, lambda: f"dict '{prefix[:-1]}' appears twice in the checkpoint (shared or recursive)")
        seen.add(id(d))
        for k, v in d.items():
            if type(k) is not str:
                continue
            # checked before joining: one 10 MB key under 300 tensors must not become 3 GB of names
            _need(len(prefix) + len(k) <= MAX_NAME_BYTES, lambda: f"tensor name '{(prefix + k[:80])[:200]}...' is "
                  f"longer than {MAX_NAME_BYTES} characters")
            name = prefix + k
            if isinstance(v, _TensorRef):
                _need(name not in out, lambda: f"duplicate tensor name '{name}'")
                _need(len(out) < MAX_TENSORS, lambda: f"more than {MAX_TENSORS} tensors")
                out[name] = v
            elif isinstance(v, dict):
                _need(depth < MAX_NEST, lambda: f"dicts nested deeper than {MAX_NEST} at '{name}'")
                todo.append((name + ".", v, depth + 1))
            elif isinstance(v, _Opaque):
                skipped.append((name, v.kind))
    return out, skipped


def _fold_dims(ne, nb):
    """Merge the top dims until there are MAX_DIMS (sd.cpp folds 5-D Wan weights the same way)."""
    ne, nb = list(ne), list(nb)
    while len(ne) > MAX_DIMS:
        a, b = len(ne) - 2, len(ne) - 1
        if ne[b] == 1:
            stride = nb[a]
        elif ne[a] == 1:
            stride = nb[b]
        else:
            _need(nb[b] == nb[a] * ne[a], lambda: f"{len(ne)}-D tensor whose strides cannot fold to {MAX_DIMS}-D")
            stride = nb[a]
        ne[a], nb[a] = ne[a] * ne[b], stride
        del ne[b], nb[b]
    return tuple(ne), tuple(nb)


def _make_tensors(refs: dict, buffers: dict, skipped: list, mf: ModelFile) -> None:
    """refs {name: _TensorRef}; buffers {root storage key: uint8 array}. Bounds-checked; fills
    mf.tensors (and mf.raw for dtypes sdrt has no tensor type for, and empty tensors)."""
    for name, r in refs.items():
        sdt, itemsize, npdt = _TORCH_DTYPES[r.dtype]
        numel = 1
        for s in r.size:
            numel *= s
        _need(numel < (1 << 62), lambda: f"tensor '{name}': size {list(r.size)} overflows")
        if numel == 0:
            mf.raw[name] = np.zeros(r.size, np.dtype(npdt))
            continue
        st = r.storage
        # every element needs its own bytes in the file: a stride-0 (expanded) or overlapping view
        # claiming more elements than its storage holds is refused (it would let a 600-byte file
        # make convert write gigabytes)
        _need(numel * itemsize <= st.nbytes,
              lambda: f"tensor '{name}': {list(r.size)} has {numel} elements (strides {list(r.stride)}) and "
                      f"needs {numel * itemsize} bytes, its storage '{st.key}' holds {st.nbytes}")
        span = (sum((n - 1) * s for n, s in zip(r.size, r.stride)) + 1) * itemsize
        start = r.offset * itemsize
        _need(start + span <= st.nbytes,
              lambda: f"tensor '{name}': {list(r.size)} at element offset {r.offset} with strides {list(r.stride)} "
              f"needs {start + span} bytes, its storage '{st.key}' holds {st.nbytes}")
        buf = buffers[st.root.key]
        off = st.byte_offset + start
        if sdt is None or sdt in _WIDE:
            arr = np.ndarray(r.size, np.dtype(npdt), buf, off, tuple(s * itemsize for s in r.stride))
            arr.flags.writeable = False
            if sdt is None:
                mf.raw[name] = arr
                continue
        ne = tuple(reversed(r.size)) or (1,)
        nb = tuple(s * itemsize for s in reversed(r.stride)) or (itemsize,)
        if len(ne) > MAX_DIMS:
            ne, nb = _fold_dims(ne, nb)
        try:
            if sdt in _WIDE:
                mf.tensors[name] = ConvertedTensor(_WIDE[sdt][0], ne, _widen(arr, sdt, mf.path, name), name=name)
            else:
                mf.tensors[name] = Tensor.from_buffer(buf, "I8" if sdt == "BOOL" else sdt, ne, offset=off, nb=nb,
                                                      name=name)
        except Exception as e:  # OpError from the tensor library: report it as a file problem
            raise _Fail(f"tensor '{name}': {e}") from None
    if skipped:
        mf.metadata["skipped"] = dict(skipped)


def _widen(arr, sdt, path, name):
    """The fill of a ConvertedTensor: F64 -> F32, I64 -> I32 (values must fit), contiguous."""
    to = _WIDE[sdt][1]

    def fill():
        if sdt == "I64" and arr.size and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31):
            raise ModelFileError(f"{path}: tensor '{name}': I64 values outside the int32 range")
        with np.errstate(all="ignore"):    # F64 beyond F32's range becomes inf, NaN stays NaN, as a cast does
            return np.ascontiguousarray(arr, dtype=to).reshape(-1).view(np.uint8)
    return fill


def _make_persistent_load(storages: dict, legacy: bool):
    def persistent_load(pid):
        _need(type(pid) is tuple and len(pid) >= 5 and pid[0] == "storage",
              "persistent id is not ('storage', type, key, location, numel)")
        stype, key, _loc, numel = pid[1], pid[2], pid[3], pid[4]
        _need(isinstance(stype, _Global) and _GLOBALS.get((stype.module, stype.name)) == "storage",
              lambda: f"persistent id names storage type {stype!r}")
        _need(type(key) is str and 0 < len(key) <= 64 and "/" not in key and "\\" not in key and ".." not in key,
              "storage key is not a short plain string")
        numel = _int(numel, "storage numel")
        _need(0 <= numel < (1 << 56), lambda: f"storage '{key}' declares {numel} elements")
        dtype = _STORAGES[stype.name]
        itemsize = _TORCH_DTYPES[dtype][1]
        root = storages.get(key)
        if root is None:
            root = storages[key] = _Storage(key, dtype, itemsize, numel)
        else:
            _need(root.itemsize == itemsize and root.numel == numel,
                  lambda: f"storage '{key}' is declared twice with different types or sizes")
        if legacy and len(pid) >= 6 and pid[5] is not None:
            view = pid[5]
            _need(type(view) is tuple and len(view) == 3, "legacy storage view metadata")
            vkey, voff, vsize = view
            voff, vsize = _int(voff, "view offset"), _int(vsize, "view size")
            _need(0 <= voff and 0 <= vsize and voff + vsize <= numel, lambda: f"storage view '{vkey}' outside '{key}'")
            return _Storage(str(vkey), dtype, itemsize, vsize, voff * itemsize, root)
        return root if dtype == root.dtype else _Storage(key, dtype, itemsize, numel, 0, root)
    return persistent_load


def _swap_bytes(buf: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return np.array(buf)
    n = buf.nbytes // itemsize * itemsize
    a = np.frombuffer(buf[:n].tobytes(), np.dtype(f">u{itemsize}")).astype(f"<u{itemsize}")
    return np.concatenate([a.view(np.uint8), np.array(buf[n:])])


# ---- zip format ---------------------------------------------------------------------------------

def is_torch_zip(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"


def is_torch_legacy(head: bytes) -> bool:
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _local_data_offset(mm, info: zipfile.ZipInfo, file_size: int) -> int:
    h = info.header_offset
    _need(0 <= h and h + 30 <= file_size, lambda: f"zip entry '{info.filename}' header outside the file")
    hdr = bytes(mm[h:h + 30])
    _need(hdr[:4] == b"PK\x03\x04", lambda: f"zip entry '{info.filename}': bad local header")
    nlen, elen = struct.unpack("<HH", hdr[26:30])
    _need(h + 30 + nlen <= file_size, lambda: f"zip entry '{info.filename}': name outside the file")
    raw = bytes(mm[h + 30:h + 30 + nlen])
    enc = "utf-8" if info.flag_bits & 0x800 else "cp437"
    _need(raw.decode(enc, "replace") == info.orig_filename,
          lambda: f"zip entry '{info.filename}': local and central names differ")
    start = h + 30 + nlen + elen
    _need(start + info.compress_size <= file_size, lambda: f"zip entry '{info.filename}' runs past the end of the file")
    return start


def _central_directory_size(mm, file_size: int) -> int | None:
    """The central directory size the end record declares (zip64 too), or None when not found
    (zipfile then explains). Checked before zipfile builds a ZipInfo per entry."""
    tail_start = max(0, file_size - (22 + 65535))
    tail = bytes(mm[tail_start:file_size])
    e = tail.rfind(b"PK\x05\x06")
    if e < 0 or e + 22 > len(tail):
        return None
    count, size_cd = struct.unpack_from("<HI", tail, e + 10)
    if (count == 0xFFFF or size_cd == 0xFFFFFFFF) and e >= 20 and tail[e - 20:e - 16] == b"PK\x06\x07":
        off = struct.unpack_from("<Q", tail, e - 20 + 8)[0]
        if off + 56 <= file_size and bytes(mm[off:off + 4]) == b"PK\x06\x06":
            size_cd = struct.unpack_from("<Q", bytes(mm[off + 40:off + 48]))[0]
    return size_cd


class _Inflater:
    """Reads zip entries from their real bytes: stored ones from the map, deflated ones inflated here
    with the compressed bytes actually consumed and the bytes actually produced counted as they come
    (the central directory's compress_size / file_size are claims, never trusted for a budget)."""

    def __init__(self, path, mm, file_size):
        self.mm, self.file_size = mm, file_size
        self.f = open_regular(path, "PyTorch checkpoint")
        self.left = inflate_budget(file_size)     # all deflated storages together

    def close(self):
        self.f.close()

    def read(self, info: zipfile.ZipInfo, want: int, what: str):
        """Exactly `want` bytes (<= the entry's declared size) of an entry; a uint8 array for stored
        entries (a map view), bytes for deflated ones."""
        start = _local_data_offset(self.mm, info, self.file_size)
        if info.compress_type == zipfile.ZIP_STORED:
            _need(info.compress_size == info.file_size, lambda: f"stored entry '{info.filename}' has two sizes")
            _need(want <= info.file_size, lambda: f"{what}: wants {want} bytes, its entry holds {info.file_size}")
            return self.mm[start:start + want]
        if want > self.left:
            raise _Fail(f"{what}: deflated entries would inflate past {inflate_budget(self.file_size)} bytes, "
                        f"more than a {self.file_size}-byte file justifies (a zip bomb?)")
        self.left -= want
        d = zlib.decompressobj(-15)
        out = bytearray()
        pos, used, chunk = start, 0, b""
        fd = self.f.fileno()
        try:
            while len(out) < want and not d.eof:
                if not chunk:
                    n = min(1 << 20, self.file_size - pos)
                    if n <= 0:
                        break
                    chunk = os.pread(fd, n, pos)
                    pos += len(chunk)
                    if not chunk:
                        break
                before = len(chunk)
                out += d.decompress(chunk, want - len(out))
                chunk = d.unconsumed_tail
                used += before - len(chunk)
                if len(out) > MAX_INFLATE_RATIO * used + (1 << 20):
                    raise _Fail(f"zip entry '{info.filename}' inflates more than {MAX_INFLATE_RATIO}x its real "
                                "compressed bytes; refusing a possible zip bomb")
        except zlib.error as e:
            raise _Fail(f"zip entry '{info.filename}' is damaged (zlib: {e})") from None
        except OSError as e:
            raise _Fail(f"zip entry '{info.filename}' cannot be read ({e.strerror or e})") from None
        _need(len(out) == want, lambda: f"{what}: entry '{info.filename}' inflates to {len(out)} bytes, "
              f"{want} are needed")
        if want == info.file_size:
            _need(zlib.crc32(out) == info.CRC, lambda: f"zip entry '{info.filename}' fails its CRC check")
        return out


def _read_zip(path: str, mm, file_size: int, meta: dict):
    size_cd = _central_directory_size(mm, file_size)
    _need(size_cd is None or size_cd <= MAX_CENTRAL_DIRECTORY,
          lambda: f"zip central directory of {size_cd} bytes; at most {MAX_CENTRAL_DIRECTORY} are supported")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError,
            struct.error, NotImplementedError, UnicodeDecodeError) as e:
        raise _Fail(f"not a readable zip archive ({e})") from None
    inf = _Inflater(path, mm, file_size)
    with zf:
        try:
            return _read_zip_entries(zf, inf, meta)
        finally:
            inf.close()


def _read_zip_entries(zf, inf: _Inflater, meta: dict):
    infos = zf.infolist()
    _need(infos, "empty zip archive")
    _need(len(infos) <= MAX_ZIP_ENTRIES, lambda: f"zip archive has {len(infos)} entries, at most {MAX_ZIP_ENTRIES}")
    names = [i.filename for i in infos]
    _need(len(set(names)) == len(names), "zip archive has duplicate entry names")
    for n in names:
        parts = n.replace("\\", "/").split("/")
        _need(not n.startswith(("/", "\\")) and ".." not in parts and ":" not in parts[0],
              lambda: f"zip entry name '{n[:200]}' is absolute or climbs out with '..'")
    prefix = names[0].split("/", 1)[0] + "/" if "/" in names[0] else ""
    pkls = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
    _need(pkls, "zip archive has no data.pkl: not a PyTorch checkpoint")
    _need(len(pkls) == 1, lambda: f"zip archive has {len(pkls)} data.pkl entries")
    _need(pkls[0] == prefix + "data.pkl",
          lambda: f"data.pkl is '{pkls[0]}', not under the archive's first directory '{prefix}'")
    _need(prefix + "constants.pkl" not in names,
          "this is a TorchScript archive (it has constants.pkl), not a state dict; refusing it")
    by_name = {i.filename: i for i in infos}
    for i in infos:
        _need(not i.flag_bits & 0x1, lambda: f"zip entry '{i.filename}' is encrypted")
        _need(i.compress_type in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED),
              lambda: f"zip entry '{i.filename}' uses compression method {i.compress_type}")

    def small(name, cap=64):
        i = by_name.get(prefix + name)
        if i is None:
            return None
        _need(i.file_size <= cap, lambda: f"'{prefix + name}' is {i.file_size} bytes, expected a short record")
        return bytes(inf.read(i, i.file_size, f"'{prefix + name}'"))

    bo = small("byteorder")
    _need(bo in (None, b"little", b"big"), lambda: f"byteorder record is {bo!r}, not 'little' or 'big'")
    big = bo == b"big"
    meta["byteorder"] = "big" if big else "little"
    for rec in ("version", ".format_version", ".storage_alignment"):
        v = small(rec)
        if v is not None:
            meta["torch_" + rec.lstrip(".")] = v.decode("ascii", "replace").strip()

    pinfo = by_name[pkls[0]]
    _need(pinfo.file_size <= MAX_PICKLE_BYTES, lambda: f"data.pkl is {pinfo.file_size} bytes")
    pkl = bytes(inf.read(pinfo, pinfo.file_size, "data.pkl"))

    storages: dict[str, _Storage] = {}
    root, end = _PickleVM(pkl, 0, _make_persistent_load(storages, legacy=False), file_size=inf.file_size).run()
    del pkl
    sd = _select_state_dict(root, meta)
    refs, skipped = _flatten(sd)

    used = {r.storage.root.key for r in refs.values()}
    buffers = {}
    for key in sorted(used):
        st = storages[key]
        i = by_name.get(prefix + "data/" + key)
        _need(i is not None, lambda: f"storage '{key}' has no entry '{prefix}data/{key}' in the archive")
        _need(i.file_size >= st.nbytes,
              lambda: f"storage '{key}' declares {st.nbytes} bytes, its entry holds {i.file_size}")
        buf = inf.read(i, st.nbytes, f"storage '{key}'")
        if not isinstance(buf, np.ndarray):
            buf = np.frombuffer(buf, np.uint8)
        if big:
            buf = _swap_bytes(buf, max(r.itemsize for r in refs.values() if r.storage.root is st))
        buffers[key] = buf
    return refs, buffers, skipped


# ---- legacy format ------------------------------------------------------------------------------

def _read_legacy(path: str, mm, file_size: int, meta: dict):
    data = memoryview(mm)
    none = _make_persistent_load({}, legacy=True)

    def header_pickle(pos, what):
        try:
            return _PickleVM(data, pos, none).run()
        except _Fail as e:
            raise _Fail(f"legacy header ({what}): {e}") from None

    magic, pos = header_pickle(0, "magic number")
    _need(magic == LEGACY_MAGIC, "not a PyTorch checkpoint (legacy magic number missing)")
    proto, pos = header_pickle(pos, "protocol")
    _need(proto == LEGACY_PROTOCOL, lambda: f"legacy protocol {proto!r}, expected {LEGACY_PROTOCOL}")
    sys_info, pos = header_pickle(pos, "sys_info")
    _need(isinstance(sys_info, dict), "legacy sys_info is not a dict")
    little = sys_info.get("little_endian", True)
    _need(type(little) is bool, "legacy sys_info little_endian is not a bool")
    meta["byteorder"] = "little" if little else "big"

    storages: dict[str, _Storage] = {}
    root, pos = _PickleVM(data, pos, _make_persistent_load(storages, legacy=True)).run()
    keys, pos = _PickleVM(data, pos, none).run()
    _need(type(keys) is list and all(type(k) is str for k in keys), "legacy storage key list is not a list of str")
    _need(len(set(keys)) == len(keys), "legacy storage key list has duplicates")

    sd = _select_state_dict(root, meta)
    refs, skipped = _flatten(sd)

    buffers = {}
    order = "<q" if little else ">q"
    for key in keys:
        st = storages.get(key)
        _need(st is not None, lambda: f"legacy storage '{key}' is listed but never used, its element size is unknown")
        _need(pos + 8 <= file_size, lambda: f"legacy storage '{key}' header past the end of the file")
        n = struct.unpack(order, bytes(data[pos:pos + 8]))[0]
        _need(n == st.numel, lambda: f"legacy storage '{key}' holds {n} elements, its pickle declares {st.numel}")
        start = pos + 8
        _need(start + st.nbytes <= file_size,
              lambda: f"legacy storage '{key}' ({st.nbytes} bytes at {start}) runs past the end of the file")
        buf = mm[start:start + st.nbytes]
        if not little:
            buf = _swap_bytes(buf, st.itemsize)
        buffers[key] = buf
        pos = start + st.nbytes
    for r in refs.values():
        _need(r.storage.root.key in buffers, lambda: f"storage '{r.storage.root.key}' has no data in the file")
    return refs, buffers, skipped


# ---- entry point ----------------------------------------------------------------------------------

def read_ckpt(path) -> ModelFile:
    """Read a PyTorch checkpoint (zip or legacy) lazily; see the module doc.

    Raises ModelFileError (naming the file and the problem) for anything not understood,
    including every global or call a plain tensor checkpoint does not need."""
    path = os.fspath(path)
    mf = ModelFile(path=path, format="ckpt")
    try:
        with open_regular(path, "PyTorch checkpoint") as f:
            head = f.read(512)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        if len(head) >= 262 and head[257:262] == b"ustar":
            raise _Fail("a tar-format PyTorch file (torch < 0.4); not supported, re-save it with a newer torch")
        mm, stamp = map_file(path, "PyTorch checkpoint")
        mf.sources.append(stamp)
        if is_torch_zip(head):
            mf.metadata["torch_format"] = "zip"
            refs, buffers, skipped = _read_zip(path, mm, stamp[1], mf.metadata)
        elif is_torch_legacy(head):
            mf.metadata["torch_format"] = "legacy"
            refs, buffers, skipped = _read_legacy(path, mm, stamp[1], mf.metadata)
        else:
            raise _Fail("not a PyTorch checkpoint (neither a zip archive nor a pickle)")
        _make_tensors(refs, buffers, skipped, mf)
    except _Fail as e:
        raise ModelFileError(f"{path}: {e}") from None
    except ModelFileError:
        raise
    except RecursionError:
        raise ModelFileError(f"{path}: malformed checkpoint (nested too deeply)") from None
    except MemoryError:
        raise ModelFileError(f"{path}: malformed checkpoint (asks for more memory than it can use)") from None
    except Exception as e:  # any other parse failure of untrusted bytes is a bad file, never a crash
        raise ModelFileError(f"{path}: malformed checkpoint ({type(e).__name__}: {e})") from None
    return mf
