"""Fuzz the model-file readers (safetensors, GGUF, torch zip, legacy torch pickle): only
sdrt.ModelFileError may ever escape, and every case stays within the resource policy.

Seeded random mutator (reproducible: case i of format f uses random.Random(f"{seed}:{f}:{i}")).
Each case takes a small valid seed file (written by sdrt's writers, the `gguf` package and the
`safetensors` package when installed), applies 1-3 mutations, writes it to a temp file, opens
it with the reader, then reads every tensor's bytes (Tensor.numpy(), which also runs the
F64/I64 conversions) and every raw entry. A case is "ok" (the file opened and all data read),
"error" (ModelFileError) or a failure (any other exception: printed, saved under --crash-dir,
and the exit status is 1).

Mutations:
- byte flips / random bytes (mostly inside the header, where the structure is);
- truncation at a random point; insertion / deletion / duplication of a random chunk;
- GGUF field edits: every count, length, type, n_dims, ne and offset field of the seed (found
  by a trusted walk of it) set to an interesting value (0, 1, 2**31, 2**32-1, 2**63, 2**64-1,
  the file size +-1, the old value +-1, random);
- safetensors: the 8-byte header length set to an interesting value; JSON edits of a
  tensor's dtype / shape / data_offsets / __metadata__ (negative, huge, 5000-digit, float,
  string, null, nested, bool values, wrong lengths), duplicated keys, deep nesting, with the
  header length fixed up or not.

Checkpoints (formats ckpt_zip, ckpt_legacy): seeds and mutators of bench/fuzz_torch_corpus.py (pickle
snippets that cost memory, lying zip central directories, crafted tensor layouts).

Isolated mode (`--isolated`, what the long run and the CI sample use): every case runs in a fresh
forked child under RLIMIT_AS (the parent's address space + 2 x file size + 256 MB), RLIMIT_CPU
10 s and a 300 s wall-clock alarm; the parent records the child's CPU time (user + system, from
wait4: wall time on a shared machine measures the neighbours; the wall maximum is reported too) and peak RSS (wait4's ru_maxrss less the parent's resident set at the fork, which the child
starts with). A case fails when anything but
ModelFileError escapes, when the child dies (signal, hang), when it takes more than --max-seconds,
or when its peak RSS exceeds 2 x file size + 256 MB.

usage: python bench/fuzz_model_files.py [--cases 10000] [--seed 0] [--formats safetensors gguf ckpt_zip ckpt_legacy]
                                        [--isolated] [--max-seconds 1]
Long mode on demand: SDRT_FUZZ_LONG=1 python -m pytest tests/test_fuzz_files.py (10,000 per format).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sdrt.errors import ModelFileError  # noqa: E402
from sdrt.io.ckpt import read_ckpt  # noqa: E402
from sdrt.io.gguf_file import read_gguf  # noqa: E402
from sdrt.io.safetensors import read_safetensors  # noqa: E402
from sdrt.io.writer import GGUFValue, TensorPlan, write_gguf, write_safetensors  # noqa: E402
from sdrt.io import gguf_file as G  # noqa: E402
from sdrt.ops import dtypes  # noqa: E402

import fuzz_torch_corpus as TC  # noqa: E402

READERS = {"safetensors": read_safetensors, "gguf": read_gguf, "ckpt_zip": read_ckpt, "ckpt_legacy": read_ckpt}


# ---- seeds --------------------------------------------------------------------------------

def _raw_plan(name, dt, ne, rng):
    dt = dtypes.get(dt)
    n = 1
    for d in ne:
        n *= d
    nbytes = n // dt.block_size * dt.type_size
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return TensorPlan(name, dt, tuple(ne), lambda: data)


def make_seeds(folder: str) -> dict[str, list[bytes]]:
    rng = np.random.default_rng(1234)
    seeds: dict[str, list[bytes]] = {"safetensors": [], "gguf": [], "ckpt_zip": TC.make_seeds("ckpt_zip"),
                                      "ckpt_legacy": TC.make_seeds("ckpt_legacy")}
    p = os.path.join(folder, "seed.safetensors")
    plans = [
        TensorPlan("w.f32", dtypes.F32, (8, 4), lambda: rng.standard_normal(32).astype(np.float32)),
        _raw_plan("w.f16", "F16", (16, 2), rng), _raw_plan("w.bf16", "BF16", (4, 2, 2), rng),
        _raw_plan("w.f8", "F8_E4M3", (6,), rng), _raw_plan("w.f8b", "F8_E5M2", (2, 3), rng),
        TensorPlan("ids", dtypes.I64, (5, 1), lambda: np.arange(5, dtype=np.int64)),
        TensorPlan("d64", dtypes.F64, (3,), lambda: np.array([1.5, -2.0, 1e300])),
        _raw_plan("i8", "I8", (7,), rng), _raw_plan("i16", "I16", (3, 2), rng),
        _raw_plan("i32", "I32", (2, 2, 2, 2), rng),
    ]
    write_safetensors(p, plans, {"format": "pt", "note": "seed"})
    data = open(p, "rb").read()
    # add U8 / BOOL / empty / 5-D entries by editing the header
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    end = len(body)
    extra = {"u8.comfy_quant": ("U8", [5], b'{"a":'), "flag": ("BOOL", [2], b"\x01\x00"),
             "empty": ("F32", [0, 3], b""), "conv3d": ("F16", [1, 2, 1, 1, 2], bytes(8)),
             "scalar": ("F32", [], struct.pack("<f", 2.5))}
    for k, (dt, shape, raw) in extra.items():
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [end, end + len(raw)]}
        body += raw
        end += len(raw)
    hb = json.dumps(header).encode()
    seeds["safetensors"].append(struct.pack("<Q", len(hb)) + hb + body)
    try:
        from safetensors.numpy import save
        seeds["safetensors"].append(save({"a": np.ones((3, 5), np.float32), "b": np.arange(4, dtype=np.int64),
                                          "c": np.zeros((2, 2), np.float16)}, metadata={"k": "v"}))
    except ImportError:
        pass

    p = os.path.join(folder, "seed.gguf")
    meta = {"general.name": "seed", "u8": GGUFValue(7, G.UINT8), "i8": GGUFValue(-3, G.INT8),
            "u16": GGUFValue(9, G.UINT16), "i16": GGUFValue(-9, G.INT16), "u32": 1, "i32": -5,
            "f32": 1.5, "b": True, "u64": GGUFValue(1 << 40, G.UINT64), "i64": GGUFValue(-(1 << 40), G.INT64),
            "f64": GGUFValue(2.5, G.FLOAT64), "arr": [1, 2, 3], "sarr": ["x", "yy", ""],
            "farr": np.array([0.5, 1.5], np.float32)}
    plans = [TensorPlan("t.f32", dtypes.F32, (4, 3), lambda: rng.standard_normal(12).astype(np.float32)),
             _raw_plan("t.q8", "Q8_0", (32, 2), rng), _raw_plan("t.q4k", "Q4_K", (256,), rng),
             _raw_plan("t.f16", "F16", (2, 2, 2, 2), rng), _raw_plan("t.i32", "I32", (3,), rng),
             _raw_plan("t.bf16", "BF16", (5, 1, 2), rng)]
    write_gguf(p, plans, meta)
    seeds["gguf"].append(open(p, "rb").read())
    write_gguf(p, plans[:3], {"general.alignment": GGUFValue(64, G.UINT32), "s": "z"}, alignment=64)
    seeds["gguf"].append(open(p, "rb").read())
    try:
        import gguf
        w = gguf.GGUFWriter(p, "sd")
        w.add_string("general.name", "gg")
        w.add_array("tok", ["a", "b"])
        w.add_tensor("x", np.ones((2, 32), np.float32))
        w.add_tensor("q", gguf.quants.quantize(np.ones((2, 32), np.float32), gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        seeds["gguf"].append(open(p, "rb").read())
    except ImportError:
        pass
    return seeds


# ---- GGUF field map (trusted walk of a valid seed) ----------------------------------------

def gguf_fields(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """(offset, size) of every integer field that steers parsing, and the end of the header."""
    fields = [(4, 4), (8, 8), (16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string():
        nonlocal pos
        fields.append((pos, 8))
        n = struct.unpack_from("<Q", data, pos)[0]
        pos += 8 + n

    def value(t):
        nonlocal pos
        if t == G.STRING:
            string()
        elif t == G.ARRAY:
            fields.append((pos, 4))
            et = struct.unpack_from("<I", data, pos)[0]
            fields.append((pos + 4, 8))
            n = struct.unpack_from("<Q", data, pos + 4)[0]
            pos += 12
            for _ in range(n):
                value(et)
        else:
            if t in (G.UINT32, G.UINT64):
                fields.append((pos, G.SCALAR_SIZE[t]))  # general.alignment and friends
            pos += G.SCALAR_SIZE[t]

    for _ in range(n_kv):
        string()
        fields.append((pos, 4))
        t = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        value(t)
    for _ in range(n_tensors):
        string()
        fields.append((pos, 4))
        nd = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        for _ in range(nd):
            fields.append((pos, 8))
            pos += 8
        fields.append((pos, 4))
        fields.append((pos + 4, 8))
        pos += 12
    return fields, pos


def _interesting(rng: random.Random, old: int, size: int, file_size: int) -> int:
    bits = size * 8
    vals = [0, 1, 2, 3, 4, 5, 7, 8, 13, 31, 32, 33, 63, 64, 255, 256, 4096, 1 << 15, (1 << 31) - 1, 1 << 31,
            (1 << 32) - 1, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, (1 << 64) - 2, (1 << 64) - 32,
            file_size, file_size - 1, file_size + 1, old + 1, old - 1, old * 2, old + 32, old - 32, old ^ (1 << 63),
            rng.getrandbits(bits), rng.getrandbits(16)]
    return rng.choice(vals) % (1 << bits)


_JSON_EVIL = [-1, -(1 << 63), 1 << 62, 1 << 64, (1 << 64) - 1, 10 ** 5000, 0, 1, 1.5, "12", None, True, [], [1],
              [1, 2, 3], [[1, 2]], {}, {"a": 1}, "F32", "BF16", "U8", "I64", "F64", "F8_E4M3", "Q4_0", "", "\ud800"]


def _mutate_st_json(data: bytes, rng: random.Random) -> bytes:
    try:
        return _mutate_st_json1(data, rng)
    except Exception:  # noqa: BLE001 - a seed already mangled by an earlier mutation
        return data


def _mutate_st_json1(data: bytes, rng: random.Random) -> bytes:
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    if not isinstance(header, dict):
        return data
    body = data[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    op = rng.randrange(7)
    if op == 0 and names:  # a field of a tensor
        k = rng.choice(names)
        f = rng.choice(["dtype", "shape", "data_offsets"])
        header[k][f] = rng.choice(_JSON_EVIL)
    elif op == 1 and names:  # one element of shape / offsets
        k = rng.choice(names)
        f = rng.choice(["shape", "data_offsets"])
        lst = header[k][f]
        if isinstance(lst, list) and lst:
            lst[rng.randrange(len(lst))] = rng.choice(_JSON_EVIL)
        else:
            header[k][f] = [rng.choice(_JSON_EVIL)]
    elif op == 2 and len(names) >= 2:  # overlap / alias two tensors
        a, b = rng.sample(names, 2)
        header[a]["data_offsets"] = list(header[b]["data_offsets"])
        if rng.random() < 0.5:
            header[a]["shape"], header[a]["dtype"] = header[b]["shape"], header[b]["dtype"]
    elif op == 3:  # metadata
        header["__metadata__"] = rng.choice([{"a": rng.choice(_JSON_EVIL)}, rng.choice(_JSON_EVIL), {"x": "y"}])
    elif op == 4 and names:  # remove a key / whole entry
        k = rng.choice(names)
        if rng.random() < 0.5:
            del header[k]
        else:
            header[k].pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
    elif op == 5:  # raw text tricks: duplicate key, deep nesting, garbage
        hb = json.dumps(header)
        trick = rng.randrange(4)
        if trick == 0 and names:
            k = rng.choice(names)
            hb = hb[:-1] + ", " + json.dumps(k) + ": " + json.dumps(header[k]) + "}"
        elif trick == 1:
            depth = rng.choice([100, 5000, 100000])
            hb = hb[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
        elif trick == 2:
            hb = hb.replace("}", "", 1)
        else:
            hb = hb[:-1] + ', "nan": NaN}'
        hb = hb.encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(hb)) + hb + body
    else:  # shift every offset
        d = rng.choice([-1, 1, 8, -8, 1 << 40])
        for k in names:
            o = header[k].get("data_offsets")
            if isinstance(o, list) and len(o) == 2 and all(isinstance(x, int) for x in o):
                header[k]["data_offsets"] = [o[0] + d, o[1] + d]
    try:
        hb = json.dumps(header).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError, OverflowError):
        return data
    ln = len(hb) if rng.random() < 0.9 else rng.choice([len(hb) + 1, len(hb) - 1, n])
    return struct.pack("<Q", ln % (1 << 64)) + hb + body


def mutate(data: bytes, fmt: str, rng: random.Random, gfields) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if not buf:
            break
        size = len(buf)
        if fmt.startswith("ckpt"):
            m = TC.mutate_ckpt(bytes(buf), fmt, rng)
            if m is not None:
                buf = bytearray(m)
                continue
            head_end = size
        elif fmt == "gguf":
            fields, head_end = gfields
        else:
            head_end = min(size, 8 + struct.unpack_from("<Q", buf)[0]) if size >= 8 else size
        op = rng.randrange(10)
        if op <= 2:  # byte flips, mostly in the header
            hi = head_end if rng.random() < 0.85 else size
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(max(1, min(hi, size)))
                buf[i] = rng.randrange(256) if rng.random() < 0.5 else buf[i] ^ (1 << rng.randrange(8))
        elif op == 3:  # truncation
            del buf[rng.randrange(size):]
        elif op == 4:  # insert / delete / duplicate a chunk
            i = rng.randrange(size)
            k = rng.randint(1, 64)
            r = rng.randrange(3)
            if r == 0:
                buf[i:i] = bytes(rng.randrange(256) for _ in range(k))
            elif r == 1:
                del buf[i:i + k]
            else:
                buf[i:i] = buf[i:i + k]
        elif fmt == "gguf" and op <= 8 and fields:  # field edit
            off, sz = rng.choice(fields)
            if off + sz <= len(buf):
                old = int.from_bytes(buf[off:off + sz], "little")
                buf[off:off + sz] = _interesting(rng, old, sz, size).to_bytes(sz, "little")
        elif fmt == "safetensors" and op <= 6:
            buf = bytearray(_mutate_st_json(bytes(buf), rng)) if size >= 8 else buf
        elif fmt == "safetensors" and op <= 8 and size >= 8:  # header length field
            old = struct.unpack_from("<Q", buf)[0]
            buf[:8] = _interesting(rng, old, 8, size).to_bytes(8, "little")
        else:  # append garbage
            buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
    return bytes(buf)


# ---- run ----------------------------------------------------------------------------------

def touch(mf) -> int:
    n = 0
    for t in mf.tensors.values():
        a = t.numpy()
        n += int(np.ascontiguousarray(a).reshape(-1).view(np.uint8).sum(dtype=np.uint64))
    for a in mf.raw.values():
        n += int(np.ascontiguousarray(a).reshape(-1).view(np.uint8).sum(dtype=np.uint64))
    return n


def run(fmt: str, cases: int, seed: int = 0, folder: str | None = None, crash_dir: str | None = None,
        verbose: bool = False) -> dict:
    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="sdrt-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    seeds = make_seeds(folder)[fmt]
    gfields = [gguf_fields(s) for s in seeds] if fmt == "gguf" else [None] * len(seeds)
    reader = READERS[fmt]
    path = os.path.join(folder, f"case.{fmt}")
    res = {"format": fmt, "cases": cases, "ModelFileError": 0, "ok": 0, "failures": 0, "seconds": 0.0,
           "max_case_ms": 0.0, "unchanged": 0}
    t0 = time.perf_counter()
    for i in range(cases):
        rng = random.Random(f"{seed}:{fmt}:{i}")
        k = rng.randrange(len(seeds))
        data = mutate(seeds[k], fmt, rng, gfields[k])
        res["unchanged"] += data == seeds[k]
        with open(path, "wb") as f:
            f.write(data)
        tc = time.perf_counter()
        try:
            touch(reader(path))
            res["ok"] += 1
        except ModelFileError:
            res["ModelFileError"] += 1
        except BaseException as e:  # noqa: BLE001 - this is what we hunt
            if isinstance(e, KeyboardInterrupt):
                raise
            res["failures"] += 1
            if verbose or res["failures"] <= 5:
                print(f"FAIL {fmt} case {i}: {type(e).__name__}: {e}", file=sys.stderr)
                traceback.print_exc(limit=4)
            if crash_dir:
                os.makedirs(crash_dir, exist_ok=True)
                with open(os.path.join(crash_dir, f"{fmt}-{seed}-{i}.bin"), "wb") as f:
                    f.write(data)
        res["max_case_ms"] = max(res["max_case_ms"], (time.perf_counter() - tc) * 1000)
    res["seconds"] = time.perf_counter() - t0
    if own:
        for n in os.listdir(folder):
            os.unlink(os.path.join(folder, n))
        os.rmdir(folder)
    return res


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(reader, path: str, limit: int, wfd: int) -> None:
    """Run one case in a forked child; report (outcome, seconds, message) through wfd; never return."""
    import resource
    import signal
    try:
        signal.alarm(300)                 # a blocked child (wall clock) is killed and counted, not waited for
        resource.setrlimit(resource.RLIMIT_CPU, (10, 11))   # a spinning one gets SIGXCPU after 10 s of CPU
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        t = time.perf_counter()
        try:
            touch(reader(path))
            outcome, msg = "ok", ""
        except ModelFileError as e:
            outcome, msg = "ModelFileError", str(e)[:300]
        except BaseException as e:  # noqa: BLE001 - what we hunt
            outcome, msg = "failure", f"{type(e).__name__}: {e}"[:300]
        os.write(wfd, json.dumps([outcome, time.perf_counter() - t, msg]).encode())
    finally:
        os._exit(0)


def run_isolated(fmt: str, cases: int, seed: int = 0, folder: str | None = None, crash_dir: str | None = None,
                 max_seconds: float = 1.0, verbose: bool = False, start: int = 0) -> dict:
    """Cases start..start+cases-1, each in a forked child under a memory limit, timed, RSS measured."""
    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="sdrt-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    seeds = make_seeds(folder)[fmt]
    gfields = [gguf_fields(sd) for sd in seeds] if fmt == "gguf" else [None] * len(seeds)
    reader = READERS[fmt]
    for sd in seeds:                      # warm up (imports, compiled kernels) in the parent, once
        p = os.path.join(folder, f"warm.{fmt}")
        with open(p, "wb") as f:
            f.write(sd)
        try:
            touch(reader(p))
        except ModelFileError:
            pass
    path = os.path.join(folder, f"case.{fmt}")
    res = {"format": fmt, "cases": cases, "ModelFileError": 0, "ok": 0, "failures": 0, "slow": 0, "over_rss": 0,
           "died": 0, "seconds": 0.0, "max_case_s": 0.0, "max_rss_mb": 0.0, "max_file_kb": 0.0,
           "max_rss_over_bound_mb": -1e9}
    base_vm = _vm_size()
    # a forked child starts with the parent's resident pages (a pytest run's hundreds of MB):
    # the bound is on what the case adds to them
    base_rss = _rss_bytes()
    t0 = time.perf_counter()
    for i in range(start, start + cases):
        rng = random.Random(f"{seed}:{fmt}:{i}")
        k = rng.randrange(len(seeds))
        data = mutate(seeds[k], fmt, rng, gfields[k])
        with open(path, "wb") as f:
            f.write(data)
        bound = 2 * len(data) + (256 << 20)
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(reader, path, base_vm + bound, wfd)
        os.close(wfd)
        chunks = []
        while True:
            b = os.read(rfd, 65536)
            if not b:
                break
            chunks.append(b)
        os.close(rfd)
        _, status, ru = os.wait4(pid, 0)
        rss = max(ru.ru_maxrss * 1024 - base_rss, 0)
        cpu = ru.ru_utime + ru.ru_stime    # the criterion: wall time on a shared 2-core box measures the neighbours
        try:
            outcome, wall, msg = json.loads(b"".join(chunks))
        except ValueError:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else "-"
            outcome, wall, msg = "died", 0.0, f"child status {status} (signal {sig})"
        secs = cpu
        res["max_wall_s"] = max(res.get("max_wall_s", 0.0), wall)
        bad = outcome in ("failure", "died") or secs > max_seconds or rss > bound
        if outcome == "ModelFileError" and ("memory" in msg and "budget" not in msg):
            bad = True                    # a MemoryError turned into ModelFileError: the limit, not the policy, held
        res[outcome if outcome in ("ok", "ModelFileError") else "died" if outcome == "died" else "failures"] += 1
        res["slow"] += secs > max_seconds
        res["over_rss"] += rss > bound
        res["max_case_s"] = max(res["max_case_s"], secs)
        res["max_rss_mb"] = max(res["max_rss_mb"], rss / 2**20)
        res["max_file_kb"] = max(res["max_file_kb"], len(data) / 1024)
        res["max_rss_over_bound_mb"] = max(res["max_rss_over_bound_mb"], (rss - bound) / 2**20)
        if bad:
            if outcome == "ModelFileError":
                res["failures"] += 1
            if verbose or res["failures"] + res["died"] + res["slow"] <= 5:
                print(f"BAD {fmt} case {i}: {outcome} {secs:.2f}s CPU ({wall:.2f}s wall) rss {rss / 2**20:.0f} MB "
                      f"(bound {bound / 2**20:.0f} MB): {msg}", file=sys.stderr)
            if crash_dir:
                os.makedirs(crash_dir, exist_ok=True)
                with open(os.path.join(crash_dir, f"{fmt}-{seed}-{i}.bin"), "wb") as f:
                    f.write(data)
    res["seconds"] = time.perf_counter() - t0
    if own:
        for n in os.listdir(folder):
            os.unlink(os.path.join(folder, n))
        os.rmdir(folder)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs="+", default=list(READERS), choices=list(READERS))
    ap.add_argument("--crash-dir", default=None)
    ap.add_argument("--isolated", action="store_true", help="one forked child per case, memory-limited, RSS measured")
    ap.add_argument("--max-seconds", type=float, default=1.0)
    args = ap.parse_args(argv)
    bad = 0
    print(f"{'format':<12} {'cases':>7} {'ModelFileError':>15} {'ok':>7} {'failures':>9} {'seconds':>8} "
          f"{'max CPU s':>10} {'max wall s':>10} {'max RSS MB':>10} {'slow':>5} {'over RSS':>8} {'died':>5}",
          flush=True)
    for fmt in args.formats:
        if args.isolated:
            r = run_isolated(fmt, args.cases, args.seed, crash_dir=args.crash_dir, max_seconds=args.max_seconds)
        else:
            r = run(fmt, args.cases, args.seed, crash_dir=args.crash_dir)
            r.update(max_case_s=r["max_case_ms"] / 1000, max_rss_mb=float("nan"), slow=0, over_rss=0, died=0)
        bad += r["failures"] + r["died"] + r["slow"] + r["over_rss"]
        print(f"{fmt:<12} {r['cases']:>7} {r['ModelFileError']:>15} {r['ok']:>7} {r['failures']:>9} "
              f"{r['seconds']:>8.1f} {r['max_case_s']:>10.3f} {r.get('max_wall_s', float('nan')):>10.3f} "
              f"{r['max_rss_mb']:>10.0f} {r['slow']:>5} "
              f"{r['over_rss']:>8} {r['died']:>5}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
