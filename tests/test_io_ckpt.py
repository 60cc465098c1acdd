"""PyTorch checkpoint reader: real torch files (fixtures from tools/make_ckpt_fixtures.py), and
hostile ones built here by hand. No torch needed."""
from __future__ import annotations

import builtins
import io
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import pytest

from sdrt.errors import ModelFileError
from sdrt.io.ckpt import read_ckpt

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
EXP = np.load(os.path.join(FIX, "ckpt_expected.npz"))
SEEDS = ["ckpt_zip.ckpt", "ckpt_legacy.pt", "ckpt_wrapped.ckpt", "ckpt_wrapped_legacy.ckpt", "ckpt_embedding.pt"]


# ---- real torch files ------------------------------------------------------------------------------

@pytest.mark.parametrize("fname", SEEDS)
def test_fixture_values(fname):
    m = read_ckpt(os.path.join(FIX, fname))
    assert m.format == "ckpt"
    keys = [k for k in EXP.files if k.startswith(fname + "::")]
    assert keys
    assert sorted(m.tensors) == sorted(k.split("::", 1)[1] for k in keys)
    for k in keys:
        name = k.split("::", 1)[1]
        want = EXP[k]
        got = m[name].to_f32()
        if name != "five_d":
            assert m[name].shape == (want.shape or (1,)), name
        np.testing.assert_array_equal(got.reshape(-1), want.reshape(-1).astype(np.float32), err_msg=name)


@pytest.mark.parametrize("fname", ["ckpt_zip.ckpt", "ckpt_legacy.pt"])
def test_dtypes_views_and_skips(fname):
    m = read_ckpt(os.path.join(FIX, fname))
    t = m.tensors
    assert {n: t[n].dtype.name for n in ["model.diffusion_model.input_blocks.0.0.weight",
                                         "model.diffusion_model.input_blocks.0.0.bias",
                                         "first_stage_model.decoder.conv_in.weight", "dtype.f64", "dtype.i64",
                                         "dtype.i32", "dtype.i8", "dtype.f8_e4m3", "dtype.f8_e5m2"]} == {
        "model.diffusion_model.input_blocks.0.0.weight": "F32", "model.diffusion_model.input_blocks.0.0.bias": "F16",
        "first_stage_model.decoder.conv_in.weight": "BF16", "dtype.f64": "F32", "dtype.i64": "I32",
        "dtype.i32": "I32", "dtype.i8": "I8", "dtype.f8_e4m3": "F8_E4M3", "dtype.f8_e5m2": "F8_E5M2"}
    # views keep torch's strides (ne order, bytes) and share one storage, zero copy
    assert t["view.transposed"].ne == (4, 6) and t["view.transposed"].nb == (24, 4)
    assert t["view.offset_slice"].offset - t["view.shared_base"].offset == 8 * 4
    assert t["view.every_other"].nb == (8, 24)
    assert t["view.transposed"].storage is not None and t["view.shared_base"].storage.base is not None
    assert t["scalar.rank0"].ne == (1,)
    assert t["five_d"].ne == (2, 2, 1, 6)                 # torch (3,2,1,2,2): top dims folded
    assert t["dtype.bool"].dtype.name == "I8"
    assert set(m.raw) == {"dtype.u8", "empty"} and m.raw["empty"].shape == (0, 3)
    np.testing.assert_array_equal(m.raw["dtype.u8"], [0, 200, 255])
    assert m.sources and m.sources[0][0].endswith(fname)
    assert m.metadata["torch_format"] == ("zip" if fname.endswith(".ckpt") else "legacy")


def test_storages_are_memory_mapped():
    m = read_ckpt(os.path.join(FIX, "ckpt_zip.ckpt"))
    base = m["model.diffusion_model.input_blocks.0.0.weight"].storage
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)


def test_wrappers_and_metadata():
    for f in ["ckpt_wrapped.ckpt", "ckpt_wrapped_legacy.ckpt"]:
        m = read_ckpt(os.path.join(FIX, f))
        assert m.metadata["wrapper"] == "state_dict"
        assert m.metadata["pickle_scalars"]["global_step"] == 470000
        assert "global_step" not in m.tensors and "epoch" not in m.tensors
        assert m["cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"].ne == (768, 10)
    e = read_ckpt(os.path.join(FIX, "ckpt_embedding.pt"))
    assert list(e.tensors) == ["string_to_param.*"] and e["string_to_param.*"].ne == (768, 2)


# ---- building hostile files ----------------------------------------------------------------------

def torch_zip(pkl: bytes, entries=None, prefix="archive/", compress=None, extra=None) -> bytes:
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
            z.writestr(prefix + "data.pkl", pkl)
            z.writestr(prefix + "byteorder", b"little")
            for k, v in (entries or {}).items():
                z.writestr(prefix + k, v, compress_type=compress or zipfile.ZIP_STORED)
            for k, v in (extra or {}).items():
                z.writestr(k, v)
            z.writestr(prefix + "version", b"3\n")
    return out.getvalue()


def legacy(pkl: bytes, keys=(), storages=b"", little=True) -> bytes:
    head = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": little,
                          "type_sizes": {"short": 2, "int": 4, "long": 8}}, protocol=2)
    return head + pkl + pickle.dumps(list(keys), protocol=2) + storages


def write(tmp_path, data, name="x.ckpt"):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def G(module, name):                       # protocol-2 GLOBAL
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def U(s):                                  # BINUNICODE
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def tensor_pkl(key="0", numel=4, offset=0, size=(2, 2), stride=(2, 1), storage="FloatStorage", pid_extra=b""):
    """A protocol-2 pickle of {'w': _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())}."""
    tup = lambda xs: b"(" + b"".join(b"J" + struct.pack("<i", x) for x in xs) + b"t"   # noqa: E731
    pid = b"(" + U("storage") + G("torch", storage) + U(key) + U("cpu") + b"J" + struct.pack("<i", numel) + pid_extra + b"tQ"
    return (b"\x80\x02}(" + U("w") + G("torch._utils", "_rebuild_tensor_v2") + b"(" + pid
            + b"J" + struct.pack("<i", offset) + tup(size) + tup(stride) + b"\x89" + G("collections", "OrderedDict")
            + b")RtRu.")


CANARY = "/tmp/sdrt_pwned_canary"


class Boom:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


WATCHED = {"os", "subprocess", "posix", "nt", "marshal", "types", "pip", "ensurepip", "timeit", "runpy",
           "importlib", "torch", "pytorch_lightning", "webbrowser", "shutil", "socket", "ctypes", "code", "pty"}


class SideEffects(list):
    """While active (only around read_ckpt): records os.system/subprocess/exec calls and imports
    of modules a gadget would need. The list stays empty when nothing ran."""

    def __enter__(self):
        self.saved = []
        for mod, name in [(os, "system"), (os, "popen"), (os, "execv"), (subprocess, "Popen"), (subprocess, "run")]:
            self.saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, lambda *a, _n=f"{mod.__name__}.{name}", **k: self.append(_n))
        real_import = builtins.__import__
        self.saved.append((builtins, "__import__", real_import))

        def spy(name, *a, **k):
            if name.split(".")[0] in WATCHED and name != "os.path":   # numpy.memmap imports os.path
                self.append("import " + name)
            return real_import(name, *a, **k)
        builtins.__import__ = spy
        return self

    def __exit__(self, *exc):
        for mod, name, v in reversed(self.saved):
            setattr(mod, name, v)


@pytest.fixture
def no_side_effects():
    if os.path.exists(CANARY):
        os.remove(CANARY)
    fx = SideEffects()
    global WATCH
    WATCH = fx
    yield fx
    WATCH = None
    assert not os.path.exists(CANARY), "a pickle ran a command"


WATCH = None


def read(path):
    if WATCH is None:
        return read_ckpt(path)
    with WATCH:
        return read_ckpt(path)


def refused(path, *words):
    with pytest.raises(ModelFileError) as e:
        read(path)
    msg = str(e.value)
    assert path in msg
    for w in words:
        assert w in msg, msg
    return msg


# ---- code execution: never ----------------------------------------------------------------------

GADGETS = [
    (os.system, ("touch " + CANARY,)),
    (eval, ("__import__('os').system('touch %s')" % CANARY,)),
    (exec, ("import os; os.system('touch %s')" % CANARY,)),
    (subprocess.Popen, (["touch", CANARY],)),
    (getattr, (Boom(__import__, "os"), "system")),
    (__import__, ("os",)),
    (compile, ("1", "x", "eval")),
    (open, (CANARY, "w")),
]


@pytest.mark.parametrize("proto", [0, 1, 2, 4, 5])
@pytest.mark.parametrize("i", range(len(GADGETS)))
def test_reduce_gadgets_in_zip_and_legacy(tmp_path, no_side_effects, proto, i):
    fn, args = GADGETS[i]
    payload = pickle.dumps({"w": Boom(fn, *args)}, protocol=proto)
    for data in (torch_zip(payload), legacy(payload)):
        p = write(tmp_path, data)
        msg = refused(p)
        assert "refusing" in msg or "not allowed" in msg
    assert no_side_effects == []


EVIL_GLOBALS = [("os", "system"), ("posix", "system"), ("nt", "system"), ("builtins", "eval"),
                ("builtins", "exec"), ("__builtin__", "eval"), ("builtins", "getattr"), ("builtins", "__import__"),
                ("subprocess", "Popen"), ("subprocess", "check_output"), ("marshal", "loads"),
                ("types", "FunctionType"), ("types", "CodeType"), ("pip", "main"), ("ensurepip", "_run_pip"),
                ("timeit", "timeit"), ("runpy", "_run_code"), ("importlib", "import_module"),
                ("operator", "attrgetter"), ("functools", "partial"), ("copyreg", "_reconstructor"),
                ("torch", "load"), ("torch.jit", "load"), ("torch.serialization", "load"),
                ("torch._utils", "_rebuild_qtensor"), ("torch._utils", "_rebuild_device_tensor_from_numpy"),
                ("numpy", "load"), ("numpy.testing._private.utils", "runstring"), ("pickle", "loads"),
                ("_pickle", "loads"), ("code", "InteractiveInterpreter"), ("pty", "spawn"),
                ("webbrowser", "open"), ("shutil", "rmtree"), ("collections", "namedtuple")]


@pytest.mark.parametrize("module,name", EVIL_GLOBALS)
def test_globals_refused_by_name(tmp_path, no_side_effects, module, name):
    # GLOBAL + REDUCE, as a plain payload, and hidden as the value of a real-looking state dict
    body = G(module, name) + b"(" + U("touch " + CANARY) + b"tR"
    for pkl in (b"\x80\x02" + body + b".", b"\x80\x02}(" + U("w") + body + b"u."):
        for data in (torch_zip(pkl), legacy(pkl)):
            refused(write(tmp_path, data), f"{module}.{name}")
    assert no_side_effects == []


def test_stack_global_and_memo_tricks(tmp_path, no_side_effects):
    su = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()   # noqa: E731  SHORT_BINUNICODE
    cases = [
        b"\x80\x04" + su("os") + su("system") + b"\x93" + su("touch x") + b"\x85R.",              # STACK_GLOBAL
        b"\x80\x04" + su("os") + b"\x94" + su("system") + b"\x94h\x00h\x01\x93" + su("x") + b"\x85R.",  # via memo
        b"\x80\x04K\x01K\x02\x93.",                                                                   # non-str names
        b"\x80\x04" + su("builtins") + b")\x93.",                                                     # tuple as name
        b"\x80\x04" + su("torch") + su("FloatStorage") + b"\x93)R.",                                 # marker called
        b"\x80\x02" + U("os") + b"(" + U("x") + b"tR.",                                                # str called
        b"\x80\x02}(" + U("a") + b"}tR.",                                                             # dict called
        b"\x80\x02(" + U("touch x") + b"ios\nsystem\n.",                                              # INST
        b"\x80\x02(" + G("os", "system") + U("x") + b"o.",                                            # OBJ
        b"\x80\x02\x82\x01" + b")R.",                                                                  # EXT1
        b"\x80\x02}(" + U("k") + b"\x88ub.",                                                          # BUILD on dict
        b"\x80\x02P" + b"x\n.",                                                                       # text PERSID
        b"\x80\x02(" + U("storage") + U("os.system") + U("0") + U("cpu") + b"K\x01tQ.",             # bad pid type
        b"\x80\x02" + G("collections", "OrderedDict") + b"(" + U("x") + b"t\x81.",                   # NEWOBJ args
        b"\x80\x02" + G("torch._tensor", "_rebuild_from_type_v2") + b"(" + G("torch._utils", "_rebuild_tensor_v2")
        + G("collections", "OrderedDict") + b")}tR.",                                                 # bad type
        b"\x80\x02" + G("_codecs", "encode") + b"(" + U("x") + U("rot13") + b"tR.",                  # codec
        b"\x80\x02" + G("numpy", "dtype") + b"(" + U("O8") + b"\x89\x88tR.",                          # object dtype
        b"\x80\x02}(" + U("w") + G("torch._utils", "_rebuild_tensor") + b"(" + U("/etc/passwd") + b"K\x00K\x01\x85K\x01\x85tRu.",
        b"\x80\x02}(" + U("w") + G("torch._utils", "_rebuild_parameter") + b"(" + G("os", "system") + b"tRu.",
        b"\x80\x02h\x05.",                                                                              # memo miss
        b"\x80\x02\x8b\xff\xff\xff\x7f.",                                                              # LONG4 2 GiB
        b"\x80\x02\x8e" + struct.pack("<Q", 1 << 62) + b".",                                           # BINBYTES8
        b"\x80\x02X\xff\xff\xff\xff.",                                                                 # BINUNICODE 4 GiB
        b"\x80\x02]]a.",                                                                                # two objects
        b"\x80\x02(.",                                                                                  # open mark
        b"\x80\x02",                                                                                    # no STOP
    ]
    for pkl in cases:
        for data in (torch_zip(pkl), legacy(pkl)):
            refused(write(tmp_path, data))
    # BUILD state on an OrderedDict (torch's `_metadata`) is stored, never applied as attributes
    pkl = b"\x80\x02" + G("collections", "OrderedDict") + b")R}(" + U("__setstate__") + U("x") + b"ub."
    assert len(read(write(tmp_path, torch_zip(pkl)))) == 0
    assert no_side_effects == []


def test_nested_pickle_is_just_bytes(tmp_path, no_side_effects):
    inner = pickle.dumps(Boom(os.system, "touch " + CANARY), protocol=2)
    # bytes holding a pickle are data; without pickle.loads (refused) they can never run
    pkl = b"\x80\x03}(" + U("blob") + b"B" + struct.pack("<I", len(inner)) + inner + b"u."
    p = write(tmp_path, torch_zip(pkl))
    m = read(p)
    assert len(m) == 0
    pkl2 = b"\x80\x02" + G("pickle", "loads") + b"(C" + bytes([len(inner)]) + inner + b"tR."
    refused(write(tmp_path, torch_zip(pkl2)), "pickle.loads")
    assert no_side_effects == []


def test_deep_nesting_is_bounded(tmp_path):
    deep_list = b"\x80\x02" + b"]" * 200000 + b"a" * 199999 + b"."
    deep_tuple_key = b"\x80\x02}" + b"K\x01" + b"\x85" * 100000 + b"K\x02s."
    deep_dicts = b"\x80\x02}" + (U("a") + b"}") * 50 + b"s" * 50 + b"."
    for pkl in (deep_list, deep_tuple_key, deep_dicts):
        with pytest.raises(ModelFileError):
            read_ckpt(write(tmp_path, torch_zip(pkl)))
    # a dict that holds itself, directly or under a wrapper: refused, and it terminates
    cyc = b"\x80\x02}q\x00" + U("w") + b"h\x00s."
    cyc2 = b"\x80\x02}(" + U("state_dict") + b"}q\x01" + U("x") + b"h\x01su."
    for pkl in (cyc, cyc2):
        with pytest.raises(ModelFileError, match="twice"):
            read_ckpt(write(tmp_path, torch_zip(pkl)))


# ---- structure of the zip / legacy containers ------------------------------------------------------

DATA = np.arange(4, dtype=np.float32).tobytes()


def test_handmade_tensor_reads(tmp_path):
    m = read_ckpt(write(tmp_path, torch_zip(tensor_pkl(), {"data/0": DATA})))
    np.testing.assert_array_equal(m["w"].to_f32(), [[0, 1], [2, 3]])
    m = read_ckpt(write(tmp_path, legacy(tensor_pkl(pid_extra=b"N"), ["0"], struct.pack("<q", 4) + DATA)))
    np.testing.assert_array_equal(m["w"].to_f32(), [[0, 1], [2, 3]])


@pytest.mark.parametrize("kw,entries,words", [
    (dict(), {}, ["no entry"]),                                           # data/<key> missing
    (dict(), {"data/0": DATA[:12]}, ["declares 16 bytes"]),              # storage shorter than numel
    (dict(offset=1), {"data/0": DATA}, ["needs 20 bytes"]),               # offset + numel past storage
    (dict(offset=-1), {"data/0": DATA}, ["negative storage_offset"]),
    (dict(size=(-2, 2)), {"data/0": DATA}, ["dims/strides"]),
    (dict(stride=(2, -1)), {"data/0": DATA}, ["dims/strides"]),
    (dict(size=(1 << 30, 1 << 30), stride=(1, 1)), {"data/0": DATA}, ["needs"]),
    (dict(size=(2, 2, 2)), {"data/0": DATA}, ["differ in length"]),
    (dict(numel=1 << 30), {"data/0": DATA}, ["declares"]),                 # huge declared storage
    (dict(numel=-5), {"data/0": DATA}, ["declares"]),
    (dict(key="../../etc/passwd"), {"data/0": DATA}, ["storage key"]),
    (dict(storage="QInt8Storage"), {"data/0": DATA}, ["QInt8Storage"]),
])
def test_bad_tensor_layouts(tmp_path, kw, entries, words):
    refused(write(tmp_path, torch_zip(tensor_pkl(**kw), entries)), *words)


def test_zip_structure_refusals(tmp_path):
    good = tensor_pkl()
    refused(write(tmp_path, torch_zip(good, {"data/0": DATA}, extra={"other/data.pkl": good})), "data.pkl entries")
    refused(write(tmp_path, torch_zip(good, {"data/0": DATA}, extra={"archive/constants.pkl": b""})), "TorchScript")
    refused(write(tmp_path, torch_zip(good, {"data/0": DATA}, extra={"archive/../../x": b""})), "..")
    refused(write(tmp_path, torch_zip(good, {"data/0": DATA}, extra={"/etc/x": b""})), "absolute")
    refused(write(tmp_path, torch_zip(good, {"data/0": DATA}, extra={"archive/data/0": DATA})), "duplicate")
    # data.pkl under another prefix than the first entry (torch itself would not find it)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("first/version", b"3\n")
        z.writestr("second/data.pkl", good)
        z.writestr("second/data/0", DATA)
    refused(write(tmp_path, out.getvalue()), "first directory")
    # byteorder garbage
    data = torch_zip(good, {"data/0": DATA}).replace(b"little", b"middle")
    refused(write(tmp_path, data))
    # encrypted flag bit set in the central directory of data/0
    data = bytearray(torch_zip(good, {"data/0": DATA}))
    cd = data.rfind(b"PK\x01\x02", 0, data.rfind(b"archive/data/0") + 1)
    data[cd + 8] |= 1
    refused(write(tmp_path, bytes(data)), "encrypted")
    refused(write(tmp_path, b"PK\x03\x04" + b"\x00" * 100), "zip")
    refused(write(tmp_path, b"hello world, not a checkpoint"), "not a PyTorch checkpoint")
    refused(write(tmp_path, b""), "empty")
    tar = bytearray(600)
    tar[257:262] = b"ustar"
    refused(write(tmp_path, bytes(tar)), "tar")


def test_deflated_storage_and_zip_bomb(tmp_path):
    m = read_ckpt(write(tmp_path, torch_zip(tensor_pkl(), {"data/0": DATA}, compress=zipfile.ZIP_DEFLATED)))
    np.testing.assert_array_equal(m["w"].to_f32(), [[0, 1], [2, 3]])
    n = 16 << 20   # 64 MiB of zeros deflate ~1000:1
    bomb = torch_zip(tensor_pkl(numel=n, size=(n,), stride=(1,)), {"data/0": bytes(4 * n)}, compress=zipfile.ZIP_DEFLATED)
    assert len(bomb) < 1 << 20
    refused(write(tmp_path, bomb), "zip bomb")


def test_big_endian_zip_is_byteswapped(tmp_path):
    data = torch_zip(tensor_pkl(), {"data/0": np.arange(4, dtype=">f4").tobytes()}).replace(b"little", b"big\x00\x00\x00")
    # 'big' with NUL padding is not 'big': rebuild properly instead
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", tensor_pkl())
        z.writestr("archive/byteorder", b"big")
        z.writestr("archive/data/0", np.arange(4, dtype=">f4").tobytes())
    refused(write(tmp_path, data), "byteorder")
    m = read_ckpt(write(tmp_path, out.getvalue()))
    np.testing.assert_array_equal(m["w"].to_f32(), [[0, 1], [2, 3]])


def test_legacy_structure_refusals(tmp_path):
    pkl = tensor_pkl(pid_extra=b"N")
    ok = legacy(pkl, ["0"], struct.pack("<q", 4) + DATA)
    assert len(read_ckpt(write(tmp_path, ok))) == 1
    refused(write(tmp_path, legacy(pkl, ["0"], struct.pack("<q", 5) + DATA)), "holds 5 elements")
    refused(write(tmp_path, legacy(pkl, ["0"], struct.pack("<q", 4) + DATA[:10])), "past the end")
    refused(write(tmp_path, legacy(pkl, ["1"], struct.pack("<q", 4) + DATA)), "never used")
    refused(write(tmp_path, legacy(pkl, [], b"")), "no data")
    refused(write(tmp_path, pickle.dumps(123, protocol=2) + ok[15:]), "magic")
    big = legacy(pkl, ["0"], struct.pack(">q", 4) + np.arange(4, dtype=">f4").tobytes(), little=False)
    np.testing.assert_array_equal(read_ckpt(write(tmp_path, big))["w"].to_f32(), [[0, 1], [2, 3]])


@pytest.mark.parametrize("fname", SEEDS)
def test_every_truncation_is_a_clean_error(tmp_path, fname):
    data = open(os.path.join(FIX, fname), "rb").read()
    cuts = sorted(set(list(range(0, len(data), max(1, len(data) // 60))) + [len(data) - 1, 1, 2, 30]))
    for cut in cuts:
        p = write(tmp_path, data[:cut])
        try:
            m = read_ckpt(p)
        except ModelFileError as e:
            assert p in str(e)
        else:   # a legacy file cut inside a storage nobody reads can still load; data must be sound
            for t in m.tensors.values():
                t.to_f32()


def test_i64_outside_int32_fails_on_use(tmp_path):
    big = np.array([1 << 40, 1, 2, 3], np.int64).tobytes()
    m = read_ckpt(write(tmp_path, torch_zip(tensor_pkl(storage="LongStorage"), {"data/0": big})))
    assert m["w"].dtype.name == "I32"
    with pytest.raises(ModelFileError, match="int32"):
        m["w"].to_f32()


def test_missing_file():
    with pytest.raises(ModelFileError, match="no such file|cannot read"):
        read_ckpt("/nonexistent/model.ckpt")


def test_short_fuzz():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import fuzz_ckpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = fuzz_ckpt.run(cases=300, seed=7)
    assert res["failures"] == [] and res["side_effects"] == []
    assert res["counts"].get("ModelFileError", 0) > 100
