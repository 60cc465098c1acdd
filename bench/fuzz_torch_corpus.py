"""Seeds and mutators for PyTorch checkpoints (torch zip and legacy pickle), for fuzz_model_files.py
(bench/fuzz_ckpt.py is the older in-process checkpoint fuzzer with its gadget mutations).

Seeds: the real torch files under tests/fixtures (written by torch itself, tools/make_ckpt_fixtures.py),
a deflated re-zip of each zip one, and checkpoints built here from a pickle writer (`state_pickle`).

Mutations (1-3 per case), besides the generic byte flips / truncation / chunk edits:
- pickle bytes: the data.pkl of a zip (then re-zipped, stored or deflated) or the object pickle of
  a legacy file: byte flips, opcode snippets inserted after PROTO that keep the stack balanced but
  cost memory or time (up to 1M EMPTY_SETs; a memoised string key set into many dicts; huge memo
  indexes), truncation;
- zip structure: every central-directory compress_size / file_size / local-header offset set to an
  interesting value (the "lying compress_size" zip bomb), entries recompressed with deflate;
- state dicts built from scratch with interesting tensor layouts: stride 0, size (1, 2**62-1),
  offsets past the storage, numel lies, dims > 8, long and deeply nested keys, a 1 MB key shared by
  hundreds of tensors, many empty entries.
"""
from __future__ import annotations

import io
import os
import pickle
import random
import struct
import zipfile

_FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
LEGACY_HEAD = (pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
               + pickle.dumps({"protocol_version": 1001, "little_endian": True,
                               "type_sizes": {"short": 2, "int": 4, "long": 8}}, protocol=2))
_STORAGE_SIZE = {"FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8, "ByteStorage": 1,
                 "DoubleStorage": 8, "IntStorage": 4}


def _g(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    n = (v.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)


def _tup(xs) -> bytes:
    return b"(" + b"".join(_int(x) for x in xs) + b"t"


def state_pickle(entries, legacy: bool, outer_key: str | None = None) -> bytes:
    """A protocol-2 pickle of an OrderedDict {name: _rebuild_tensor_v2(storage, offset, size, stride)},
    or of {outer_key: that dict} (nested dicts are flattened into 'outer_key.name').
    entries: (name, storage_type, key, numel, offset, size, stride)."""
    out = [b"\x80\x02"] + ([b"}", _u(outer_key)] if outer_key is not None else [])
    out += [_g("collections", "OrderedDict"), b")R"]
    for name, stype, key, numel, offset, size, stride in entries:
        pid = b"(" + _u("storage") + _g("torch", stype) + _u(key) + _u("cpu") + _int(numel) + (b"N" if legacy else b"")
        out += [_u(name), _g("torch._utils", "_rebuild_tensor_v2"), b"(", pid, b"tQ", _int(offset), _tup(size),
                _tup(stride), b"\x89", _g("collections", "OrderedDict"), b")RtRs"]
    out.append(b"s." if outer_key is not None else b".")
    return b"".join(out)


def torch_zip(pkl: bytes, storages: dict, deflate: bool = False, prefix: str = "archive/") -> bytes:
    buf = io.BytesIO()
    comp = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w", comp) as z:
        z.writestr(prefix + "data.pkl", pkl)
        z.writestr(prefix + "byteorder", b"little")
        for k, v in storages.items():
            z.writestr(prefix + "data/" + k, v)
        z.writestr(prefix + "version", b"3\n")
    return buf.getvalue()


def legacy_file(pkl: bytes, storages: dict) -> bytes:
    keys = sorted(storages)
    body = b"".join(struct.pack("<q", len(storages[k]) // _ELEM.get(k, 4)) + storages[k] for k in keys)
    return LEGACY_HEAD + pkl + pickle.dumps(keys, protocol=2) + body


_ELEM: dict[str, int] = {}     # storage key -> element size, for legacy_file's element counts


def unzip(data: bytes):
    """(data.pkl, {name: bytes}, prefix) of a zip, or None."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = z.namelist()
            pk = [n for n in names if n.endswith("data.pkl")]
            if len(pk) != 1:
                return None
            prefix = pk[0][:-len("data.pkl")]
            return z.read(pk[0]), {n[len(prefix):]: z.read(n) for n in names if n != pk[0]}, prefix
    except Exception:  # noqa: BLE001 - a mangled seed
        return None


def rezip(pkl: bytes, others: dict, prefix: str, deflate: bool) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as z:
        z.writestr(prefix + "data.pkl", pkl)
        for k, v in others.items():
            z.writestr(prefix + k, v)
    return buf.getvalue()


def make_seeds(fmt: str) -> list[bytes]:
    seeds = []
    if fmt == "ckpt_zip":
        for f in ("ckpt_zip.ckpt", "ckpt_wrapped.ckpt"):
            p = os.path.join(_FIX, f)
            if os.path.exists(p):
                d = open(p, "rb").read()
                seeds.append(d)
                u = unzip(d)
                if u:
                    seeds.append(rezip(u[0], u[1], u[2], deflate=True))
        seeds.append(torch_zip(state_pickle([("a.w", "FloatStorage", "0", 6, 0, (2, 3), (3, 1)),
                                             ("a.b", "HalfStorage", "1", 4, 1, (3,), (1,))], legacy=False),
                               {"0": bytes(24), "1": bytes(8)}))
    else:
        for f in ("ckpt_legacy.pt", "ckpt_wrapped_legacy.ckpt"):
            p = os.path.join(_FIX, f)
            if os.path.exists(p):
                seeds.append(open(p, "rb").read())
        _ELEM.update({"0": 4, "1": 2})
        seeds.append(legacy_file(state_pickle([("a.w", "FloatStorage", "0", 6, 0, (2, 3), (3, 1)),
                                               ("a.b", "HalfStorage", "1", 4, 1, (3,), (1,))], legacy=True),
                                 {"0": bytes(24), "1": bytes(8)}))
    return seeds


# ---- mutators ----------------------------------------------------------------------------------

_BIG = [0, 1, 2, 3, 7, 255, 256, 4096, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 62) - 1,
        1 << 62, (1 << 63) - 1, 1 << 63, -1, -(1 << 63)]


def _snippet(rng: random.Random) -> bytes:
    """Stack-neutral opcodes (inserted right after PROTO) that cost memory or time."""
    k = rng.choice([10, 1000, 100_000, 1_000_000])
    kind = rng.randrange(4)
    if kind == 0:      # MARK, k EMPTY_SETs, POP_MARK
        return b"(" + b"\x8f" * k + b"1"
    if kind == 1:      # a memoised string key set into many dicts
        s = b"k" * rng.choice([10, 1 << 16, 1 << 20])
        n = rng.choice([10, 2000])
        return (b"(" + b"X" + struct.pack("<I", len(s)) + s + b"r" + struct.pack("<I", 4_000_000)
                + (b"}j" + struct.pack("<I", 4_000_000) + b"Ns") * n + b"1")
    if kind == 2:      # huge memo indexes
        return b"(" + b"".join(b"Nr" + struct.pack("<I", rng.getrandbits(32)) for _ in range(min(k, 10000))) + b"1"
    return b"(" + b"]" * k + b"1"     # k empty lists


def mutate_pickle(pkl: bytes, rng: random.Random) -> bytes:
    b = bytearray(pkl)
    op = rng.randrange(4)
    if op == 0 and len(b) > 2:
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(2, len(b))
            b[i] = rng.randrange(256) if rng.random() < 0.5 else b[i] ^ (1 << rng.randrange(8))
    elif op == 1:
        b[2:2] = _snippet(rng)
    elif op == 2 and b:
        del b[rng.randrange(len(b)):]
    else:  # replace an int operand: find a K/J/M opcode and put a LONG1 there
        idx = [i for i in range(2, len(b) - 1) if b[i] in (0x4B, 0x4A, 0x4D)]
        if idx:
            i = rng.choice(idx)
            width = {0x4B: 1, 0x4A: 4, 0x4D: 2}[b[i]]
            b[i:i + 1 + width] = _int(rng.choice(_BIG))
    return bytes(b)


def crafted(rng: random.Random, legacy: bool) -> bytes:
    """A state dict built from scratch with an interesting layout (the kinds issue 22 lists)."""
    kind = rng.randrange(7)
    stype = rng.choice(list(_STORAGE_SIZE))
    es = _STORAGE_SIZE[stype]
    numel = rng.choice([0, 1, 4, 16])
    data = {"0": bytes(numel * es)}
    _ELEM["0"] = es
    size, stride, offset, name = (2, 2), (2, 1), 0, "w"
    entries, outer = None, None
    if kind == 0:                                 # stride 0 / overlap
        size, stride = rng.choice([((32768, 16384), (0, 0)), ((4, 4), (0, 1)), ((2, 2), (1, 1)), ((1,), (0,))])
    elif kind == 1:                               # huge sizes
        size = rng.choice([(1, (1 << 62) - 1), (1 << 31, 1 << 31), ((1 << 63) - 1,), (0, 1 << 62), ()])
        stride = tuple(1 for _ in size)
    elif kind == 2:                               # offsets and numel lies
        offset = rng.choice(_BIG[:12])
        numel = rng.choice(_BIG[:15])
    elif kind == 3:                               # many dims
        n = rng.choice([5, 8, 9, 64])
        size, stride = (1,) * n, (1,) * n
    elif kind == 4:                               # a long dict key joined into many tensor names
        outer = "k" * rng.choice([100, 70_000, 1 << 20, 10 << 20])
        entries = [(f"t{i}", stype, "0", numel, 0, (min(numel, 1),), (1,)) for i in range(rng.choice([1, 300]))]
    elif kind == 5:                               # many empty entries
        entries = [(f"e{i}", stype, "0", numel, 0, (0,), (1,)) for i in range(rng.choice([10, 10_000, 20_000]))]
    else:                                         # odd names
        name = rng.choice(["", "\ud800", "a\x00b", "a" * 65536, "é" * 100])
    if entries is None:
        entries = [(name, stype, "0", numel, offset, size, stride)]
    try:
        pkl = state_pickle(entries, legacy, outer)
    except (OverflowError, ValueError):
        pkl = state_pickle([("w", stype, "0", numel, 0, (1,), (1,))], legacy)
    if legacy:
        return legacy_file(pkl, data)
    return torch_zip(pkl, data, deflate=rng.random() < 0.5)


def lie_central_directory(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    cds = [i for i in range(len(b) - 46) if b[i:i + 4] == b"PK\x01\x02"]
    if not cds:
        return data
    i = rng.choice(cds)
    off = rng.choice([20, 24, 42])       # compress_size, file_size, local header offset
    old = struct.unpack_from("<I", b, i + off)[0]
    new = rng.choice([0, 1, old + 1, old - 1, old * 2, old // 2, 1 << 31, (1 << 32) - 1, len(b), rng.getrandbits(32)])
    struct.pack_into("<I", b, i + off, new % (1 << 32))
    return bytes(b)


def mutate_ckpt(data: bytes, fmt: str, rng: random.Random) -> bytes | None:
    """One checkpoint-specific mutation, or None to let the caller apply a generic one."""
    op = rng.randrange(10)
    if op <= 1:
        return crafted(rng, legacy=fmt == "ckpt_legacy")
    if fmt == "ckpt_zip":
        if op <= 4:
            u = unzip(data)
            if u:
                return rezip(mutate_pickle(u[0], rng), u[1], u[2], deflate=rng.random() < 0.5)
        if op <= 6:
            return lie_central_directory(data, rng)
        return None
    if op <= 5:   # legacy: the object pickle (and what follows) right after the fixed header pickles
        h = len(LEGACY_HEAD)
        if data[:h] == LEGACY_HEAD:
            return data[:h] + mutate_pickle(data[h:], rng)
    return None
