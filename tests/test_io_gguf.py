"""GGUF reader: every block type and value type, differential against the `gguf` package, the
handcrafted corruption matrix of ggml's tests/test-gguf.cpp, and the GGUF CVE chain of
reliability_anchors.md §3.1 as named regression tests."""
from __future__ import annotations

import random
import struct
import time

import numpy as np
import pytest

from sdrt import ModelFileError
from sdrt.io import gguf_file as G
from sdrt.io import open_model, read_gguf
from sdrt.io.writer import GGUFValue, TensorPlan, write_gguf
from sdrt.ops import dtypes

gguf = pytest.importorskip("gguf")


def _nbytes(dt, ne):
    n = 1
    for d in ne:
        n *= d
    return n // dt.block_size * dt.type_size


def _rand_ne(rng, dt, ndims=None):
    ndims = ndims or rng.randint(1, 4)
    return tuple([dt.block_size * rng.randint(1, 3)] + [rng.randint(1, 3) for _ in range(ndims - 1)])


# ---- a tiny independent GGUF builder (for corrupt files) -----------------------------------

def s(b) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def tinfo(name, ne, type_id, offset) -> bytes:
    return s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d % (1 << 64)) for d in ne) + \
        struct.pack("<IQ", type_id, offset % (1 << 64))


def gguf_bytes(kvs=(), infos=(), data=b"", n_kv=None, n_tensors=None, version=3, magic=b"GGUF", align=32,
               pad=True) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    if pad:
        head += b"\0" * (-len(head) % align)
    return head + data


def write(tmp_path, data: bytes, name="m.gguf") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


# ---- reading valid files -------------------------------------------------------------------

def test_every_dtype_table_type_round_trips_bytes(tmp_path):
    rng = random.Random(0)
    nrng = np.random.default_rng(0)
    plans, want = [], {}
    for dt in dtypes.BY_ID.values():
        ne = _rand_ne(rng, dt)
        raw = nrng.integers(0, 256, _nbytes(dt, ne), dtype=np.uint8)
        want[dt.name] = (ne, raw)
        plans.append(TensorPlan(f"t.{dt.name}", dt, ne, lambda raw=raw: raw))
    p = str(tmp_path / "all.gguf")
    write_gguf(p, plans)
    mf = read_gguf(p)
    assert mf.format == "gguf" and len(mf) == len(plans)
    for name, (ne, raw) in want.items():
        t = mf[f"t.{name}"]
        assert t.dtype.name == name
        assert t.ne == G_ne(ne)
        assert np.array_equal(np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8), raw)
    # and the gguf package reads the same bytes for every type it knows (not sd.cpp's F8 ids 43/44;
    # not Q8_1, whose block gguf-py sizes at 40 bytes while ggml's block_q8_1 has 36)
    known = {int(t) for t in gguf.GGMLQuantizationType} - {dtypes.Q8_1.id}
    p = str(tmp_path / "known.gguf")
    write_gguf(p, [pl for pl in plans if pl.dtype.id in known])
    r = gguf.GGUFReader(p)
    assert len(r.tensors) == len([pl for pl in plans if pl.dtype.id in known])
    for rt in r.tensors:
        dt = dtypes.BY_ID[int(rt.tensor_type)]
        ne, raw = want[dt.name]
        assert rt.name == f"t.{dt.name}"
        assert [int(x) for x in rt.shape] == list(G_ne(ne))
        assert np.array_equal(np.asarray(rt.data).reshape(-1).view(np.uint8), raw)


def G_ne(ne):
    """ggml_n_dims: trailing 1 dims are not written."""
    ne = list(ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def test_reads_gguf_package_files_identically(tmp_path):
    p = str(tmp_path / "g.gguf")
    w = gguf.GGUFWriter(p, "sdxl")
    w.add_uint8("u8", 200)
    w.add_int8("i8", -100)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -30000)
    w.add_uint32("u32", 4_000_000_000)
    w.add_int32("i32", -2_000_000_000)
    w.add_float32("f32", 1.25)
    w.add_bool("b", True)
    w.add_string("str", "héllo")
    w.add_uint64("u64", 1 << 60)
    w.add_int64("i64", -(1 << 60))
    w.add_float64("f64", 0.1)
    w.add_array("ints", [1, 2, 3])
    w.add_array("floats", [0.5, 1.5])
    w.add_array("strs", ["a", "", "ccc"])
    w.add_array("bools", [True, False])
    rng = np.random.default_rng(2)
    arrays = {"f32": rng.standard_normal((3, 64)).astype(np.float32),
              "f16": rng.standard_normal((2, 5, 32)).astype(np.float16),
              "i32": rng.integers(0, 100, (7,), dtype=np.int32)}
    for k, a in arrays.items():
        w.add_tensor(k, a)
    q = {}
    for qt in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        q[qt] = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType[qt])
        w.add_tensor(qt, q[qt], raw_dtype=gguf.GGMLQuantizationType[qt])
    for qt in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        dt = dtypes.get(qt)
        q[qt] = rng.integers(0, 256, (3, dt.type_size), dtype=np.uint8)
        w.add_tensor(qt, q[qt], raw_dtype=gguf.GGMLQuantizationType[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    mf = read_gguf(p)
    m = mf.metadata
    assert m["general.architecture"] == "sdxl"
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"]) == (200, -100, 60000, -30000, 4_000_000_000,
                                                                            -2_000_000_000)
    assert m["f32"] == 1.25 and m["b"] is True and m["str"] == "héllo"
    assert (m["u64"], m["i64"], m["f64"]) == (1 << 60, -(1 << 60), 0.1)
    assert list(m["ints"]) == [1, 2, 3] and list(m["floats"]) == [0.5, 1.5] and m["strs"] == ["a", "", "ccc"]
    assert list(m["bools"]) == [True, False]
    for k, a in arrays.items():
        assert mf[k].ne == a.shape[::-1]
        np.testing.assert_array_equal(mf[k].numpy(), a)
    for qt, raw in q.items():
        assert mf[qt].dtype.name == qt
        np.testing.assert_array_equal(mf[qt].numpy(), raw)
    # differential: the gguf package's own reader agrees on names, shapes, types and bytes
    r = gguf.GGUFReader(p)
    assert [t.name for t in r.tensors] == list(mf.tensors)
    for t in r.tensors:
        assert tuple(int(x) for x in t.shape) == mf[t.name].ne
        assert int(t.tensor_type) == mf[t.name].dtype.id
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8),
                              np.ascontiguousarray(mf[t.name].numpy()).reshape(-1).view(np.uint8))
    assert open_model(p).format == "gguf"


def test_custom_alignment_and_five_dims(tmp_path):
    a = np.arange(2 * 3 * 1 * 2 * 2, dtype=np.float32)
    infos = [tinfo("w5", [2, 2, 1, 3, 2], 0, 0), tinfo("b", [4], 0, 128)]
    data = a.tobytes() + b"\0" * (128 - a.nbytes) + np.ones(4, np.float32).tobytes()
    p = write(tmp_path, gguf_bytes([kv("general.alignment", G.UINT32, struct.pack("<I", 64))], infos, data, align=64))
    mf = read_gguf(p)
    assert mf["w5"].ne == (2, 2, 1, 6)  # dims beyond 4 fold into ne[3], as sd.cpp's GGUF fallback reader
    np.testing.assert_array_equal(mf["w5"].numpy().reshape(-1), a)
    np.testing.assert_array_equal(mf["b"].numpy(), 1)


def test_invalid_utf8_string_value_is_kept_losslessly(tmp_path):
    p = write(tmp_path, gguf_bytes([kv("k", G.STRING, s(b"a\xff\xfeb"))]))
    v = read_gguf(p).metadata["k"]
    assert v.encode("utf-8", "surrogateescape") == b"a\xff\xfeb"


# ---- ggml tests/test-gguf.cpp handcrafted matrix (ported; 20 seeds) ------------------------

HFT = ["HEADER_BAD_MAGIC", "HEADER_BAD_VERSION_0", "HEADER_BAD_VERSION_1", "HEADER_BAD_VERSION_FUTURE",
       "HEADER_BAD_N_KV", "HEADER_BAD_N_TENSORS", "HEADER_EMPTY",
       "KV_BAD_KEY_SIZE", "KV_BAD_TYPE", "KV_DUPLICATE_KEY", "KV_BAD_ALIGN", "KV_SUCCESS",
       "TENSORS_BAD_NAME_SIZE", "TENSORS_BAD_N_DIMS", "TENSORS_BAD_SHAPE", "TENSORS_NE_TOO_BIG",
       "TENSORS_NBYTES_TOO_BIG", "TENSORS_BAD_TYPE", "TENSORS_BAD_OFFSET", "TENSORS_DUPLICATE_NAME",
       "TENSORS_BAD_ALIGN", "TENSORS_INCONSISTENT_ALIGN", "TENSORS_SUCCESS", "TENSORS_CUSTOM_ALIGN",
       "DATA_NOT_ENOUGH_DATA", "DATA_BAD_ALIGN", "DATA_INCONSISTENT_ALIGN", "DATA_MEM_SIZE_OVERFLOW",
       "DATA_SUCCESS", "DATA_CUSTOM_ALIGN"]
SUCCESS = {"HEADER_EMPTY", "KV_SUCCESS", "TENSORS_SUCCESS", "TENSORS_CUSTOM_ALIGN", "DATA_SUCCESS",
           "DATA_CUSTOM_ALIGN"}


def handcrafted(seed: int, hft: str):
    """Port of get_handcrafted_file. Differences: sdrt maps the data section, so the TENSORS_*
    cases carry their data too; BAD_NAME_SIZE uses a name over sdrt's 65535-byte limit (sd.cpp
    needs names longer than ggml's 64); BAD_N_DIMS uses 9 (sdrt folds 5..8 dims like sd.cpp);
    fewer, smaller random tensors; DATA_NOT_ENOUGH_DATA cuts one byte off the last tensor's data
    (ggml also wants the final padding, sdrt reads only declared ranges). Returns (bytes, expected kvs, expected tensors)."""
    rng = random.Random(seed)
    alignment = 32
    out = bytearray(b"FUGG" if hft == "HEADER_BAD_MAGIC" else b"GGUF")
    version = {"HEADER_BAD_VERSION_0": 0, "HEADER_BAD_VERSION_1": 1, "HEADER_BAD_VERSION_FUTURE": 4}.get(hft, 3)
    out += struct.pack("<I", version)
    has_kv = not hft.startswith("HEADER")
    has_tensors = hft.startswith(("TENSORS", "DATA"))
    tensors = []
    if has_tensors:
        for _ in range(12):
            dt = rng.choice(list(dtypes.BY_ID.values()))
            nd = rng.randint(1, 4)
            ne = [dt.block_size * rng.randint(1, 4)] + [rng.randint(1, 3) for _ in range(nd - 1)]
            tensors.append((dt, G_ne(ne)))
    if hft == "DATA_MEM_SIZE_OVERFLOW":
        tensors = [(dtypes.I8, (0x7FFFFFFFFFFFFFC0,)), (dtypes.I8, (0x7FFFFFFFFFFFFFC0,))]
    out += struct.pack("<Q", (1 << 64) - 1 if hft == "HEADER_BAD_N_TENSORS" else len(tensors))
    kv_types = []
    if has_kv:
        for _ in range(30):
            t = rng.randrange(13)
            if t == G.ARRAY:
                ta = rng.randrange(13)
                if ta == G.ARRAY:
                    continue
                kv_types.append((t, ta))
            else:
                kv_types.append((t, None))
    custom_align = hft in ("KV_BAD_ALIGN", "TENSORS_BAD_ALIGN", "TENSORS_CUSTOM_ALIGN", "DATA_BAD_ALIGN",
                           "DATA_CUSTOM_ALIGN")
    n_kv = len(kv_types) + custom_align
    out += struct.pack("<Q", (1 << 64) - 1 if hft == "HEADER_BAD_N_KV" else n_kv)
    expected_kv = {}
    if not has_kv:
        out += b"\0" * (-len(out) % alignment)
        return bytes(out), expected_kv, {}
    for i, (t, ta) in enumerate(kv_types):
        if hft == "KV_BAD_TYPE":
            t, ta = 13, 13
        key = f"my_key_{i // 2 if hft == 'KV_DUPLICATE_KEY' else i}"
        out += struct.pack("<Q", (1 << 64) - 1 if hft == "KV_BAD_KEY_SIZE" else len(key)) + key.encode()
        out += struct.pack("<I", t)
        data = bytes(rng.randrange(256) | (1 if G.STRING in (t, ta) else 0) for _ in range(64))
        if t == G.STRING:
            n = rng.randrange(64)
            out += struct.pack("<Q", n) + data[:n]
            expected_kv[key] = data[:n]
        elif t == G.ARRAY:
            out += struct.pack("<I", ta)
            if ta == G.STRING:
                nstr = rng.randrange(17)
                out += struct.pack("<Q", nstr)
                strs = []
                for j in range(nstr):
                    n = rng.randrange(5)
                    out += struct.pack("<Q", n) + data[4 * j:4 * j + n]
                    strs.append(data[4 * j:4 * j + n])
                expected_kv[key] = strs
            else:
                ts = G.SCALAR_SIZE[ta]
                n = rng.randrange(64) // ts
                out += struct.pack("<Q", n) + data[:n * ts]
                expected_kv[key] = (ta, data[:n * ts])
        elif t == 13:
            out += data[:1]
        else:
            out += data[:G.SCALAR_SIZE[t]]
            expected_kv[key] = (t, data[:G.SCALAR_SIZE[t]])
    if custom_align:
        alignment = 1 if hft in SUCCESS else 13
        out += s("general.alignment") + struct.pack("<II", G.UINT32, alignment)
    if not has_tensors:
        out += b"\0" * (-len(out) % alignment)
        return bytes(out), expected_kv, {}
    write_align = 1 if hft in ("TENSORS_INCONSISTENT_ALIGN", "DATA_INCONSISTENT_ALIGN") else alignment
    offset = 0
    expected_t = {}
    for i, (dt, ne) in enumerate(tensors):
        type_id = dtypes.I64.id if hft == "TENSORS_NBYTES_TOO_BIG" else dt.id
        name = "my_tensor" if hft == "TENSORS_DUPLICATE_NAME" else f"my_tensor_{i}"
        if hft == "TENSORS_BAD_NAME_SIZE":
            name += "_" + "x" * 70000
        ne_w = list(ne)
        if hft in ("TENSORS_NE_TOO_BIG", "TENSORS_NBYTES_TOO_BIG") and len(ne_w) < 2:
            ne_w.append(1)
        if hft == "TENSORS_BAD_SHAPE":
            ne_w = [(1 << 64) - 1] * len(ne_w)
        elif hft == "TENSORS_NE_TOO_BIG":
            ne_w = [4 * (2**31 - 1)] * len(ne_w)
        elif hft == "TENSORS_NBYTES_TOO_BIG":
            big = int(1.01 * ((2**64 - 1) // 8) ** (1 / len(ne_w))) + 1
            ne_w = [big] * len(ne_w)
        n_dims = 9 if hft == "TENSORS_BAD_N_DIMS" else len(ne_w)
        out += s(name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", d) for d in ne_w)
        if hft == "TENSORS_BAD_N_DIMS":
            out += b"".join(struct.pack("<Q", 1) for _ in range(n_dims - len(ne_w)))
        out += struct.pack("<I", 1000 if hft == "TENSORS_BAD_TYPE" else type_id)
        out += struct.pack("<Q", (1 << 64) - 1 if hft == "TENSORS_BAD_OFFSET" else offset)
        nb = _nbytes(dt, ne)
        expected_t[name] = (dt, ne, offset)
        offset += -(-nb // write_align) * write_align
    out += b"\0" * (-len(out) % alignment)
    nbytes = offset
    if hft == "DATA_NOT_ENOUGH_DATA":  # sdrt does not need the last tensor's padding: cut into its data
        nbytes = expected_t[name][2] + _nbytes(dt, ne) - 1
    if hft == "DATA_MEM_SIZE_OVERFLOW":
        nbytes = 32
    out += bytes(i % 256 for i in range(nbytes))
    return bytes(out), expected_kv, expected_t


@pytest.mark.parametrize("hft", HFT)
def test_handcrafted_matrix(tmp_path, hft):
    for seed in range(20):
        data, ekv, et = handcrafted(seed, hft)
        p = write(tmp_path, data)
        if hft in ("TENSORS_INCONSISTENT_ALIGN", "DATA_INCONSISTENT_ALIGN") and all(off % 32 == 0 for _, _, off in
                                                                                    et.values()):
            continue  # every size happened to be a multiple of 32: the file is consistent after all
        t0 = time.perf_counter()
        if hft not in SUCCESS:
            with pytest.raises(ModelFileError) as ei:
                read_gguf(p)
            assert p in str(ei.value)
            assert time.perf_counter() - t0 < 0.25, hft
            continue
        mf = read_gguf(p)
        for key, want in ekv.items():
            got = mf.metadata[key]
            if isinstance(want, bytes):
                assert got.encode("utf-8", "surrogateescape") == want
            elif isinstance(want, list):
                assert [x.encode("utf-8", "surrogateescape") for x in got] == want
            else:
                t, raw = want
                if isinstance(got, np.ndarray):
                    if t == G.BOOL:
                        assert list(got) == [bool(b) for b in raw]
                    else:
                        assert got.tobytes() == raw
                elif t == G.BOOL:
                    assert got == bool(raw[0])
                else:
                    assert struct.pack(G.SCALAR_FMT[t], got) == raw or (t in (G.FLOAT32, G.FLOAT64) and got != got)
        assert list(mf.tensors) + list(mf.raw) == list(et) or set(mf.tensors) | set(mf.raw) == set(et)
        align = mf.metadata.get("general.alignment", 32)
        data_start = len(data) - (sum(-(-_nbytes(dt, ne) // align) * align for dt, ne, _ in et.values()))
        for name, (dt, ne, off) in et.items():
            t = mf[name]
            assert t.dtype == dt and t.ne == ne
            raw = np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)
            assert np.array_equal(raw, (np.arange(off, off + raw.size) % 256).astype(np.uint8))
            assert t.offset == data_start + off


# ---- reliability_anchors.md §3: the GGUF CVE chain, one regression test each ---------------

def _assert_fast_error(tmp_path, data, match):
    p = write(tmp_path, data)
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=match):
        read_gguf(p)
    assert time.perf_counter() - t0 < 0.1
    with pytest.raises(ModelFileError):
        open_model(p)


def test_cve_2024_23605_n_kv_u64_max_in_64_byte_file(tmp_path):
    data = gguf_bytes(n_kv=(1 << 64) - 1, pad=False).ljust(64, b"\0")
    _assert_fast_error(tmp_path, data, "key/value count .* cannot fit")


def test_cve_2024_21836_n_tensors_u64_max(tmp_path):
    data = gguf_bytes(n_tensors=(1 << 64) - 1, pad=False).ljust(64, b"\0")
    _assert_fast_error(tmp_path, data, "tensor count .* cannot fit")


def test_cve_2024_23496_string_length_2_63(tmp_path):
    data = gguf_bytes([struct.pack("<Q", 1 << 63) + b"key"], n_kv=1)
    _assert_fast_error(tmp_path, data, "claims 9223372036854775808 bytes")
    data = gguf_bytes([kv("k", G.STRING, struct.pack("<Q", 1 << 63) + b"abc")])
    _assert_fast_error(tmp_path, data, "claims")


def test_cve_2024_21825_array_count_2_63(tmp_path):
    for et in (G.UINT8, G.STRING, G.ARRAY, G.FLOAT64):
        data = gguf_bytes([kv("arr", G.ARRAY, struct.pack("<IQ", et, 1 << 63))])
        _assert_fast_error(tmp_path, data, "array of 9223372036854775808")


def test_cve_2024_21802_ne_product_wraps(tmp_path):
    # 32 * (2**59 + 1) = 2**64 + 32: a uint64 product wraps to 32 elements (gguf-py's np.prod does)
    data = gguf_bytes(infos=[tinfo("t", [32, (1 << 59) + 1], 0, 0)], data=b"\0" * 128)
    _assert_fast_error(tmp_path, data, "more than int64 can count")
    data = gguf_bytes(infos=[tinfo("t", [(1 << 64) - 1], 0, 0)], data=b"\0" * 128)
    _assert_fast_error(tmp_path, data, "out of range")


def test_cve_2025_53630_size_accumulation_wraps(tmp_path):
    # ggml's DATA_MEM_SIZE_OVERFLOW: two tensors whose padded sizes sum past 2**64
    infos = [tinfo("a", [0x7FFFFFFFFFFFFFC0], dtypes.I8.id, 0), tinfo("b", [0x7FFFFFFFFFFFFFC0], dtypes.I8.id,
                                                                     0x7FFFFFFFFFFFFFC0)]
    _assert_fast_error(tmp_path, gguf_bytes(infos=infos, data=b"\0" * 32), "runs past the end")


def test_cve_2026_33298_nbytes_overflow(tmp_path):
    # F32 ne=2**62: nbytes = 2**64 wraps to 0 in size_t; Q4_0 with a product near 2**63
    _assert_fast_error(tmp_path, gguf_bytes(infos=[tinfo("t", [1 << 62], 0, 0)], data=b"\0" * 32), "runs past")
    _assert_fast_error(tmp_path, gguf_bytes(infos=[tinfo("t", [(1 << 62) - 32 + 32, 1], dtypes.Q4_0.id, 0)],
                                            data=b"\0" * 32), "runs past")


def test_ggml_pad_wrap(tmp_path):
    # GGML_PAD(SIZE_MAX-3, 32) == 0: an offset / size next to 2**64 must not wrap to a small one
    _assert_fast_error(tmp_path, gguf_bytes(infos=[tinfo("t", [8], 0, (1 << 64) - 32)], data=b"\0" * 32),
                       "runs past")
    _assert_fast_error(tmp_path, gguf_bytes(infos=[tinfo("t", [(1 << 63) - 4], dtypes.I8.id, 0)], data=b"\0" * 32),
                       "runs past")


@pytest.mark.parametrize("type_id", [4, 5, 31, 32, 33, 36, 40, 41, 45, 1 << 31, (1 << 32) - 1])
def test_removed_and_unknown_types(tmp_path, type_id):
    _assert_fast_error(tmp_path, gguf_bytes(infos=[tinfo("t", [32], type_id, 0)], data=b"\0" * 64),
                       f"unknown ggml type id {type_id}")


def test_ne0_not_multiple_of_block(tmp_path):
    _assert_fast_error(tmp_path, gguf_bytes(infos=[tinfo("t", [33, 2], dtypes.Q8_0.id, 0)], data=b"\0" * 128),
                       "not a multiple of the Q8_0 block size 32")


def test_nested_arrays_too_deep(tmp_path):
    # gguf-py recurses here and dies with RecursionError (01data-ai/gguf_py_f001_nested_array_recursion)
    depth = 100000
    payload = struct.pack("<IQ", G.ARRAY, 1) * depth + struct.pack("<IQ", G.UINT8, 0)
    _assert_fast_error(tmp_path, gguf_bytes([kv("deep", G.ARRAY, payload)]), "nested arrays are not supported")


def test_one_byte_short(tmp_path):
    data = gguf_bytes(infos=[tinfo("t", [8], 0, 0)], data=b"\0" * 32)
    _assert_fast_error(tmp_path, data[:-1], "runs past the end")


def test_truncated_everywhere(tmp_path):
    p = str(tmp_path / "ok.gguf")
    write_gguf(p, {"a": np.ones((2, 32), np.float32), "b": np.zeros(3, np.int32)},
               {"name": "x", "arr": ["a", "b"], "n": 5})
    full = open(p, "rb").read()
    for cut in list(range(0, len(full) - 20, 7)) + [len(full) - 21]:  # the last 20 bytes are padding
        with pytest.raises(ModelFileError):
            read_gguf(write(tmp_path, full[:cut], "cut.gguf"))


@pytest.mark.parametrize("case,data,match", [
    ("empty", b"", "empty file"),
    ("short", b"GGUF\x03\x00", "too short"),
    ("big-endian", b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    ("duplicate key", gguf_bytes([kv("k", G.UINT8, b"\1"), kv("k", G.UINT8, b"\2")]), "duplicate key 'k'"),
    ("empty key", gguf_bytes([kv("", G.UINT8, b"\1")]), "is empty"),
    ("non-utf8 key", gguf_bytes([kv(b"\xff", G.UINT8, b"\1")]), "not valid UTF-8"),
    ("alignment not u32", gguf_bytes([kv("general.alignment", G.UINT64, struct.pack("<Q", 32))]), "must be UINT32"),
    ("alignment 0", gguf_bytes([kv("general.alignment", G.UINT32, struct.pack("<I", 0))]), "not a power of two"),
    ("unknown value type", gguf_bytes([kv("k", 13, b"\0" * 8)]), "unknown value type 13"),
    ("unknown array type", gguf_bytes([kv("k", G.ARRAY, struct.pack("<IQ", 99, 1))]), "unknown array element"),
    ("duplicate tensor", gguf_bytes(infos=[tinfo("t", [8], 0, 0), tinfo("t", [8], 0, 32)], data=b"\0" * 64),
     "duplicate tensor name 't'"),
    ("unaligned offset", gguf_bytes(infos=[tinfo("t", [8], 0, 4)], data=b"\0" * 64), "not a multiple of the align"),
    ("overlap", gguf_bytes(infos=[tinfo("a", [16], 0, 0), tinfo("b", [8], 0, 32)], data=b"\0" * 64), "overlaps"),
    ("too many dims", gguf_bytes(infos=[tinfo("t", [1] * 9, 0, 0)], data=b"\0" * 32), "n_dims 9"),
])
def test_bad_gguf(tmp_path, case, data, match):
    _assert_fast_error(tmp_path, data, match)
