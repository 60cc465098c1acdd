"""safetensors reader: dtypes, metadata, shapes, sharded index, and every bad-file case."""
from __future__ import annotations

import json
import os
import struct
import time

import numpy as np
import pytest

from sdrt import ModelFileError
from sdrt.io import open_model, read_safetensors, read_safetensors_index
from sdrt.io.base import ConvertedTensor
from sdrt.ops.convert import raw_to_f32


def st_bytes(entries: dict, body: bytes, metadata=None, raw_header: str | None = None, hlen=None) -> bytes:
    """A safetensors file from header entries {name: (dtype, shape, [b, e])} and a body."""
    if raw_header is None:
        h = {} if metadata is None else {"__metadata__": metadata}
        for k, (dt, shape, offs) in entries.items():
            h[k] = {"dtype": dt, "shape": shape, "data_offsets": offs}
        raw_header = json.dumps(h)
    hb = raw_header.encode("utf-8") if isinstance(raw_header, str) else raw_header
    return struct.pack("<Q", len(hb) if hlen is None else hlen) + hb + body


def write(tmp_path, data: bytes, name="m.safetensors") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def test_reads_safetensors_package_files_identically(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    d = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
         "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
         "i8": rng.integers(-128, 127, (7,), dtype=np.int8),
         "i16": rng.integers(-1000, 1000, (2, 2), dtype=np.int16),
         "i32": rng.integers(-10**9, 10**9, (4,), dtype=np.int32),
         "conv": rng.standard_normal((8, 4, 3, 3)).astype(np.float32)}
    p = str(tmp_path / "a.safetensors")
    safetensors_numpy.save_file(d, p, metadata={"format": "pt", "k": "v"})
    mf = read_safetensors(p)
    assert mf.format == "safetensors" and mf.metadata == {"format": "pt", "k": "v"}
    assert set(mf.tensors) == set(d)
    for k, a in d.items():
        t = mf[k]
        assert t.ne == a.shape[::-1]
        assert t.numpy().dtype == a.dtype
        np.testing.assert_array_equal(t.numpy(), a)
        assert not t.numpy().flags.writeable  # a read-only map, not a copy
    # open_model dispatches by content
    assert set(open_model(p).tensors) == set(d)


def test_widened_and_raw_dtypes(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    d = {"f64": np.array([[1.5, -2.25], [1e300, 3.0]]), "i64": np.arange(77, dtype=np.int64)[None],
         "u8": np.arange(250, 256, dtype=np.uint8), "flag": np.array([True, False, True]),
         "u16": np.array([1, 65535], np.uint16), "empty": np.zeros((0, 4), np.float32),
         "scalar": np.array(2.5, np.float32)}
    p = str(tmp_path / "b.safetensors")
    safetensors_numpy.save_file(d, p)
    mf = read_safetensors(p)
    f64 = mf["f64"]
    assert isinstance(f64, ConvertedTensor) and f64.dtype.name == "F32" and not f64.is_loaded
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(f64.numpy(), d["f64"].astype(np.float32))
    assert f64.is_loaded
    i64 = mf["i64"]
    assert i64.dtype.name == "I32" and i64.ne == (77, 1)
    np.testing.assert_array_equal(i64.numpy(), d["i64"].astype(np.int32))
    assert mf["flag"].dtype.name == "I8"
    np.testing.assert_array_equal(mf["flag"].numpy(), [1, 0, 1])
    assert mf["scalar"].ne == (1,) and mf["scalar"].numpy()[0] == 2.5
    # no sdrt dtype / no elements: raw numpy arrays in their own dtype
    assert "u8" not in mf.tensors and mf.raw["u8"].dtype == np.uint8
    np.testing.assert_array_equal(mf.raw["u8"], d["u8"])
    np.testing.assert_array_equal(mf.raw["u16"], d["u16"])
    assert mf.raw["empty"].shape == (0, 4)


def test_i64_out_of_int32_range_is_a_model_file_error(tmp_path):
    body = np.array([1, 1 << 40], np.int64).tobytes()
    p = write(tmp_path, st_bytes({"big": ("I64", [2], [0, 16])}, body))
    mf = read_safetensors(p)
    with pytest.raises(ModelFileError, match="do not fit the I32"):
        mf["big"].numpy()


def test_bf16_f8_and_5d(tmp_path):
    rng = np.random.default_rng(1)
    bf = rng.integers(0, 1 << 16, (3, 4), dtype=np.uint16)
    f8 = rng.integers(0, 256, (5,), dtype=np.uint8)
    f8b = rng.integers(0, 256, (2, 2), dtype=np.uint8)
    w5 = rng.standard_normal((2, 3, 1, 2, 2)).astype(np.float16)
    body = bf.tobytes() + f8.tobytes() + f8b.tobytes() + w5.tobytes()
    o = np.cumsum([0, bf.nbytes, f8.nbytes, f8b.nbytes, w5.nbytes]).tolist()
    p = write(tmp_path, st_bytes({"bf": ("BF16", [3, 4], o[0:2]), "f8": ("F8_E4M3", [5], o[1:3]),
                                  "f8b": ("F8_E5M2", [2, 2], o[2:4]), "w5": ("F16", [2, 3, 1, 2, 2], o[3:5])}, body))
    mf = read_safetensors(p)
    np.testing.assert_array_equal(mf["bf"].numpy(), bf)
    assert mf["bf"].dtype.name == "BF16"
    np.testing.assert_array_equal(raw_to_f32(mf["bf"].numpy(), "BF16"), (bf.astype(np.uint32) << 16).view(np.float32))
    assert mf["f8"].dtype.name == "F8_E4M3" and mf["f8b"].dtype.name == "F8_E5M2"
    np.testing.assert_array_equal(mf["f8"].numpy(), f8)
    # 5-D folds the two outermost numpy dims, as sd.cpp: (2,3,1,2,2) -> (6,1,2,2)
    assert mf["w5"].ne == (2, 2, 1, 6)
    np.testing.assert_array_equal(mf["w5"].numpy().reshape(-1), w5.reshape(-1))


def test_leading_whitespace_and_padding_accepted(tmp_path):
    body = np.arange(4, dtype=np.float32).tobytes()
    hdr = "  " + json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}) + "      "
    mf = read_safetensors(write(tmp_path, st_bytes({}, body, raw_header=hdr)))
    np.testing.assert_array_equal(mf["a"].numpy(), [0, 1, 2, 3])


def test_open_is_lazy_and_detects_truncation(tmp_path):
    body = np.arange(1024, dtype=np.float32).tobytes()
    p = write(tmp_path, st_bytes({"a": ("F32", [1024], [0, 4096])}, body))
    mf = read_safetensors(p)
    mf.check_unchanged()
    with open(p, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ModelFileError, match="changed on disk"):
        mf.check_unchanged()


# ---- bad files: every case raises ModelFileError naming the file (and tensor) --------------

F32_16 = np.arange(4, dtype=np.float32).tobytes()


def _ok_entry(**kw):
    e = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    e.update(kw)
    return e


def _hdr(entries, meta=None):
    h = {} if meta is None else {"__metadata__": meta}
    h.update(entries)
    return json.dumps(h)


BAD = {
    "empty file": (b"", "empty file"),
    "shorter than 8 bytes": (b"\x05\x00\x00", "too short"),
    "header length past EOF": (st_bytes({}, b"", raw_header="{}", hlen=1000), "past the end of the file"),
    "header length absurd": (struct.pack("<Q", (1 << 64) - 1) + b"{}", "exceeds"),
    "header length over 100MB cap": (struct.pack("<Q", 100_000_001) + b"{}", "exceeds"),
    "non-UTF8 header": (st_bytes({}, b"", raw_header=b'{"\xff\xfe": 1}'), "not valid UTF-8"),
    "malformed JSON": (st_bytes({}, b"", raw_header='{"a": {"dtype": '), "not valid JSON"),
    "non-object root": (st_bytes({}, b"", raw_header="[1, 2]"), "not an object"),
    "entry not an object": (st_bytes({}, F32_16, raw_header='{"a": 5}'), "'a': entry is a JSON int"),
    "NaN constant": (st_bytes({}, b"", raw_header='{"a": NaN}'), "not valid JSON"),
    "duplicate keys": (st_bytes({}, F32_16 * 2, raw_header='{"a": %s, "a": %s}' % (
        json.dumps(_ok_entry()), json.dumps(_ok_entry(data_offsets=[16, 32])))), "key 'a' twice"),
    "duplicate nested keys": (st_bytes({}, F32_16, raw_header='{"a": {"dtype": "F32", "dtype": "F16", '
                                                             '"shape": [4], "data_offsets": [0, 16]}}'), "twice"),
    "data_offsets not a list": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=16)})),
                                "'a': data_offsets must be"),
    "data_offsets three ints": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=[0, 8, 16])})),
                                "data_offsets must be"),
    "data_offsets floats": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=[0.0, 16.0])})),
                            "data_offsets must be"),
    "data_offsets bools": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=[False, True])})),
                           "data_offsets must be"),
    "data_offsets strings": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=["0", "16"])})),
                             "data_offsets must be"),
    "end before begin": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=[10, 5])})),
                         r"'a': data_offsets \[10, 5\] end before begin"),
    "negative begin": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=[-16, 0])})),
                       "negative begin"),
    "end past file": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[5], data_offsets=[0, 20])})),
                      "past the end of the data"),
    "size != shape*itemsize": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[3])})),
                               r"needs 12 bytes, data_offsets \[0, 16\] hold 16"),
    "overlapping ranges": (st_bytes({}, F32_16 + F32_16, raw_header=_hdr(
        {"a": _ok_entry(data_offsets=[0, 16]), "b": _ok_entry(shape=[2, 2], data_offsets=[8, 24])})), "overlap"),
    "aliased ranges": (st_bytes({}, F32_16, raw_header=_hdr(
        {"a": _ok_entry(), "b": _ok_entry()})), "overlap"),
    "negative dim": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[-4])})), "negative dimension"),
    "negative dims cancelling": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[-2, -2])})),
                                 "negative dimension"),
    "float dim": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[4.0])})), "list of integers"),
    "shape not a list": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=4)})), "list of integers"),
    "huge dims overflowing int64": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[1 << 62, 1 << 62])})),
                                    "needs"),
    "product wrapping to 4 in uint64": (st_bytes({}, F32_16, raw_header=_hdr(
        {"a": _ok_entry(shape=[(1 << 63) + 1, 4])})), "out of range"),
    "dim 2**64": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[0, 1 << 64])})), "out of range"),
    "too many dims": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(shape=[1] * 9 + [4])})), "dims"),
    "unknown dtype": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(dtype="F17")})), "unknown dtype 'F17'"),
    "dtype not a string": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(dtype=4)})), "dtype"),
    "missing dtype": (st_bytes({}, F32_16, raw_header='{"a": {"shape": [4], "data_offsets": [0, 16]}}'), "dtype"),
    "sub-byte F4 odd count": (st_bytes({}, b"\0", raw_header=_hdr({"a": _ok_entry(dtype="F4", shape=[3],
                                                                                   data_offsets=[0, 1])})),
                              "whole bytes"),
    "__metadata__ not strings": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry()}, meta={"k": 5})),
                                 "__metadata__"),
    "__metadata__ not an object": (st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry()}, meta=[1])),
                                   "__metadata__"),
    "5000-digit offset": (st_bytes({}, F32_16, raw_header='{"a": {"dtype": "F32", "shape": [4], '
                                                          '"data_offsets": [0, 1%s]}}' % ("0" * 5000)),
                          "not valid JSON"),
    "10**5-deep nesting": (st_bytes({}, b"", raw_header='{"a": ' + "[" * 100000 + "]" * 100000 + "}"),
                           "nested too deeply"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_file_raises_model_file_error(tmp_path, case):
    data, match = BAD[case]
    p = write(tmp_path, data)
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=match) as ei:
        read_safetensors(p)
    assert time.perf_counter() - t0 < 0.5
    assert p in str(ei.value)  # names the file
    with pytest.raises(ModelFileError):  # and the facade says the same
        open_model(p)


def test_header_length_that_looks_like_a_pickle(tmp_path):
    """A 0x280-byte header starts the file with 80 02: the bytes of pickle PROTO 2."""
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
    hdr += " " * (0x280 - len(hdr))
    for name in ("m.safetensors", "m.bin"):
        p = write(tmp_path, st_bytes({}, F32_16, raw_header=hdr), name)
        assert open(p, "rb").read(2) == b"\x80\x02"
        np.testing.assert_array_equal(open_model(p)["a"].numpy(), [0, 1, 2, 3])


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        read_safetensors(str(tmp_path / "nope.safetensors"))
    with pytest.raises(ModelFileError, match="no such file"):
        open_model(str(tmp_path / "nope.safetensors"))


def test_holes_and_trailing_bytes_are_accepted(tmp_path):
    # sd.cpp accepts them; only declared ranges are ever read
    body = F32_16 + b"\0" * 8 + F32_16 + b"junk"
    p = write(tmp_path, st_bytes({"a": ("F32", [4], [0, 16]), "b": ("F32", [4], [24, 40])}, body))
    mf = read_safetensors(p)
    np.testing.assert_array_equal(mf["b"].numpy(), [0, 1, 2, 3])


# ---- reliability_anchors.md: safetensors attack list (attacks/README.md) ---------------------

def test_anchor_header_length_u64_max_crashes_early(tmp_path):
    """Proposal 1: an oversized 8-byte N."""
    p = write(tmp_path, struct.pack("<Q", (1 << 64) - 1) + b"{}" + b"\0" * 100)
    with pytest.raises(ModelFileError, match="exceeds"):
        read_safetensors(p)


def test_anchor_many_tensors_on_the_same_bytes_dos(tmp_path):
    """Proposal 4: thousands of tensors declared on one byte range must not be accepted."""
    entries = {f"t{i}": _ok_entry() for i in range(5000)}
    p = write(tmp_path, st_bytes({}, F32_16, raw_header=_hdr(entries)))
    with pytest.raises(ModelFileError, match="overlap"):
        read_safetensors(p)


def test_anchor_offsets_2_62(tmp_path):
    """reliability_anchors §7.3: `[2**62, 2**62]` offsets and shape products that overflow."""
    p = write(tmp_path, st_bytes({}, F32_16, raw_header=_hdr({"a": _ok_entry(data_offsets=[1 << 62, 1 << 62],
                                                                             shape=[0])})))
    with pytest.raises(ModelFileError, match="past the end"):
        read_safetensors(p)


def test_anchor_duplicate_keys_with_different_offsets(tmp_path):
    """json.loads would keep the last duplicate silently (reliability_anchors §2.6)."""
    raw = '{"a": %s, "a": %s}' % (json.dumps(_ok_entry(data_offsets=[0, 16])),
                                  json.dumps(_ok_entry(data_offsets=[16, 32])))
    with pytest.raises(ModelFileError, match="twice"):
        read_safetensors(write(tmp_path, st_bytes({}, F32_16 * 2, raw_header=raw)))


# ---- sharded index -------------------------------------------------------------------------

def _shards(tmp_path, wmap=None, index_extra=None):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "m-00001.safetensors").write_bytes(st_bytes({"a": ("F32", [4], [0, 16])}, F32_16, metadata={"x": "1"}))
    (d / "m-00002.safetensors").write_bytes(st_bytes({"b": ("F32", [2, 2], [0, 16])}, F32_16))
    idx = {"metadata": {"total_size": 32},
           "weight_map": wmap if wmap is not None else {"a": "m-00001.safetensors", "b": "m-00002.safetensors"}}
    if index_extra:
        idx.update(index_extra)
    p = d / "m.safetensors.index.json"
    p.write_text(json.dumps(idx))
    return str(p)


def test_sharded_index(tmp_path):
    p = _shards(tmp_path)
    mf = read_safetensors_index(p)
    assert set(mf.tensors) == {"a", "b"} and mf["b"].ne == (2, 2)
    assert mf.metadata["x"] == "1" and mf.metadata["index.metadata"] == {"total_size": 32}
    assert len(mf.sources) == 2
    assert set(open_model(p).tensors) == {"a", "b"}
    assert set(open_model(os.path.dirname(p)).tensors) == {"a", "b"}  # the folder itself


@pytest.mark.parametrize("wmap,match", [
    ({"a": "m-00001.safetensors", "b": "m-00001.safetensors"}, "'b' is missing from its declared shard"),
    ({"a": "m-00001.safetensors", "c": "m-00002.safetensors"}, "'c' is missing from its declared shard"),
    ({"a": "m-00003.safetensors"}, "shard 'm-00003.safetensors' is missing"),
    ({"a": "/etc/passwd"}, "must be relative"),
    ({"a": "../outside.safetensors"}, "leaves the model folder"),
    ({"a": "sub/../../outside.safetensors"}, "leaves the model folder"),
    ({"a": "m.safetensors.index.json"}, "not a safetensors file"),
    ({"a": 5}, "shard must be a file name"),
    ({}, "lists no tensors"),
], ids=["wrong shard", "absent tensor", "missing shard", "absolute", "dotdot", "nested dotdot", "self reference",
        "non-string", "empty"])
def test_bad_index(tmp_path, wmap, match):
    (tmp_path / "outside.safetensors").write_bytes(st_bytes({"a": ("F32", [4], [0, 16])}, F32_16))
    p = _shards(tmp_path, wmap)
    with pytest.raises(ModelFileError, match=match):
        read_safetensors_index(p)


def test_index_symlink_leaving_folder(tmp_path):
    (tmp_path / "outside.safetensors").write_bytes(st_bytes({"a": ("F32", [4], [0, 16])}, F32_16))
    p = _shards(tmp_path, {"a": "link.safetensors"})
    os.symlink(tmp_path / "outside.safetensors", tmp_path / "model" / "link.safetensors")
    with pytest.raises(ModelFileError, match="leaves the model folder"):
        read_safetensors_index(p)


def test_index_duplicate_across_shards(tmp_path):
    p = _shards(tmp_path)
    d = os.path.dirname(p)
    with open(os.path.join(d, "m-00002.safetensors"), "wb") as f:
        f.write(st_bytes({"a": ("F32", [4], [0, 16]), "b": ("F32", [2, 2], [16, 32])}, F32_16 * 2))
    with pytest.raises(ModelFileError, match="'a' is in two shards"):
        read_safetensors_index(p)


@pytest.mark.parametrize("text,match", [
    ("{", "not valid JSON"), ("[]", "weight_map"), ('{"weight_map": []}', "weight_map"),
    ('{"weight_map": {"a": "x"}, "weight_map": {}}', "twice")])
def test_bad_index_json(tmp_path, text, match):
    p = tmp_path / "x.safetensors.index.json"
    p.write_text(text)
    with pytest.raises(ModelFileError, match=match):
        read_safetensors_index(str(p))


def test_bad_shard_content_is_named(tmp_path):
    p = _shards(tmp_path)
    with open(os.path.join(os.path.dirname(p), "m-00002.safetensors"), "wb") as f:
        f.write(b"garbage!garbage!")
    with pytest.raises(ModelFileError, match="m-00002.safetensors"):
        read_safetensors_index(p)
