"""Writers and convert: round trips safetensors -> GGUF (each --type) -> read back, files that
the `gguf` and `safetensors` packages load, sd.cpp's keep-in-float rules, atomic output."""
from __future__ import annotations

import os
import sys
import types
import weakref

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.io import open_model, read_gguf, read_safetensors
from sdrt.io import gguf_file as G
from sdrt.io.writer import (CONVERT_TYPES, GGUFValue, TensorPlan, convert, export_type, is_unused_tensor,
                            parse_tensor_type_rules, tensor_should_be_converted, write_gguf, write_safetensors)
from sdrt.ops import dtypes
from sdrt.ops.convert import f32_to_raw, raw_to_f32
from sdrt.ops.tensor import Tensor

gguf = pytest.importorskip("gguf")
st_numpy = pytest.importorskip("safetensors.numpy")

K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
# relative RMS error bound of quantize+dequantize on Gaussian data (measured values are ~half)
MAX_REL_RMSE = {"Q8_0": 0.01, "Q5_0": 0.06, "Q5_1": 0.05, "Q4_0": 0.12, "Q4_1": 0.10,
                "Q6_K": 0.03, "Q5_K": 0.05, "Q4_K": 0.10, "Q3_K": 0.20, "Q2_K": 0.40}


@pytest.fixture
def quant(monkeypatch):
    """sdrt's Cython quant module, or (until it is built) a stand-in on gguf.quants, which
    quantizes the non-K types only."""
    try:
        from sdrt.ops import quant as q
        if hasattr(q, "quantize") and hasattr(q, "dequantize"):
            return q
    except ImportError:
        pass
    shim = types.ModuleType("sdrt.ops.quant")

    def quantize(x, dt, imatrix=None):
        dt = dtypes.get(dt)
        if dt.name in K_TYPES or (imatrix is not None and dt.name != "Q8_0"):
            pytest.skip(f"sdrt.ops.quant is not built and gguf.quants cannot quantize {dt.name} "
                        f"{'with an importance vector' if imatrix is not None else ''}")
        return gguf.quants.quantize(np.ascontiguousarray(x, np.float32), gguf.GGMLQuantizationType[dt.name])

    def dequantize(raw, dt):
        return gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[dtypes.get(dt).name])

    shim.quantize, shim.dequantize = quantize, dequantize
    import sdrt.ops
    monkeypatch.setitem(sys.modules, "sdrt.ops.quant", shim)
    monkeypatch.setattr(sdrt.ops, "quant", shim, raising=False)
    return shim


def _source(tmp_path, int_tensor=True) -> tuple[str, dict]:
    """An SD-like safetensors file: numpy-order arrays by name."""
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    d = {
        "model.diffusion_model.input_blocks.1.1.proj_in.weight": f(256, 512),
        "model.diffusion_model.input_blocks.1.1.proj_in.bias": f(256),
        "model.diffusion_model.input_blocks.1.0.in_layers.2.weight": f(64, 32, 3, 3),
        "model.diffusion_model.input_blocks.1.0.in_layers.0.weight": f(512),  # a norm, 1-D
        "model.diffusion_model.time_embed.0.weight": f(256, 256),
        "model.diffusion_model.out.2.weight": f(4, 256, 1, 1),
        "first_stage_model.decoder.mid.attn_1.q.weight": f(256, 256, 1, 1),
        "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": f(64, 256),
        "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight": f(1024, 256).astype(np.float16),
        "cond_stage_model.transformer.text_model.embeddings.position_ids": np.arange(77, dtype=np.int64)[None],
        "extra.token_ids": np.arange(77, dtype=np.int64)[None],
        "model.diffusion_model.odd.weight": f(8, 200),  # 200 % 32 != 0
        "logit_scale": np.array(4.6, np.float32),
    }
    if not int_tensor:
        del d["extra.token_ids"]
    p = str(tmp_path / "src.safetensors")
    st_numpy.save_file(d, p, metadata={"modelspec.title": "tiny"})
    return p, d


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


@pytest.mark.parametrize("type_name", CONVERT_TYPES)
def test_round_trip_safetensors_to_gguf(tmp_path, quant, type_name):
    src, d = _source(tmp_path)
    out = str(tmp_path / f"out-{type_name}.gguf")
    summary = convert(src, out, type_name)
    dst = dtypes.get(type_name)
    kept = sorted(n for n in d if not is_unused_tensor(n))  # sd.cpp drops position_ids; sorts names
    assert len(kept) == len(d) - 1
    assert summary.format == "gguf" and summary.n_tensors == len(kept) and summary.bytes_out == os.path.getsize(out)
    assert sum(summary.counts.values()) == len(kept)
    mf = read_gguf(out)
    srcmf = read_safetensors(src)
    assert list(mf.tensors) == kept
    assert mf.metadata["modelspec.title"] == "tiny"
    if dst.is_quantized:
        assert mf.metadata["general.quantization_version"] == 2
    for name in kept:
        a = d[name]
        t, s = mf[name], srcmf[name]
        ne = list(s.ne)
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        assert t.ne == tuple(ne)  # ggml_n_dims: trailing 1 dims are not written
        want = export_type(name, s, dst)
        assert t.dtype == want, name
        got = np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)
        if want == s.dtype:  # kept: the stored bytes, untouched (I64 read as I32)
            assert np.array_equal(got, np.ascontiguousarray(s.numpy()).reshape(-1).view(np.uint8)), name
            continue
        x = _f32(a).reshape(-1, a.shape[-1] if a.ndim else 1)
        if want.is_quantized:
            ref = quant.quantize(x, want, imatrix=np.ones(x.shape[-1], np.float32))  # sd.cpp's dummy imatrix
            assert np.array_equal(got, ref.reshape(-1)), name  # exactly what the quant module writes
            y = raw_to_f32(t.numpy(), want).reshape(x.shape)
            rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
            assert rel < MAX_REL_RMSE[want.name], (name, rel)
        else:  # float targets: bit-exact conversion of the source values
            ref = f32_to_raw(x, want)
            assert np.array_equal(got, np.ascontiguousarray(ref).reshape(-1).view(np.uint8)), name
            if want.name == "F32" and a.dtype == np.float32:
                np.testing.assert_array_equal(t.numpy().reshape(a.shape), a)
    # the gguf package loads it: same names, shapes, types, bytes
    r = gguf.GGUFReader(out)
    assert [t.name for t in r.tensors] == list(mf.tensors)
    for rt in r.tensors:
        t = mf[rt.name]
        assert tuple(int(x) for x in rt.shape) == t.ne and int(rt.tensor_type) == t.dtype.id
        assert np.array_equal(np.asarray(rt.data).reshape(-1).view(np.uint8),
                              np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("type_name", ["f32", "f16", "bf16"])
def test_float_round_trip_back_to_safetensors_is_bit_exact(tmp_path, type_name):
    src, d = _source(tmp_path)
    g = str(tmp_path / "a.gguf")
    convert(src, g, type_name)
    back = str(tmp_path / "back.safetensors")
    s = convert(g, back, None)  # keep every stored type
    assert s.format == "safetensors"
    mg, mb = read_gguf(g), read_safetensors(back)
    assert list(mg.tensors) == list(mb.tensors)
    for name in mg.tensors:
        assert mb[name].dtype == mg[name].dtype
        assert np.array_equal(np.ascontiguousarray(mb[name].numpy()).reshape(-1).view(np.uint8),
                              np.ascontiguousarray(mg[name].numpy()).reshape(-1).view(np.uint8))
    if type_name == "f32":  # f32 all the way: the source values exactly
        for name, a in d.items():
            if a.dtype == np.float32 and name in mb:
                np.testing.assert_array_equal(mb[name].numpy().reshape(a.shape), a)
    if type_name != "bf16":  # the safetensors package reads our file (it has no BF16)
        loaded = st_numpy.load_file(back)
        for name in mb.tensors:
            np.testing.assert_array_equal(loaded[name].reshape(-1), mb[name].numpy().reshape(-1))


def test_quantized_gguf_to_safetensors_dequantizes(tmp_path, quant):
    src, d = _source(tmp_path)
    g = str(tmp_path / "q.gguf")
    convert(src, g, "q8_0")
    out = str(tmp_path / "deq.safetensors")
    convert(g, out, "f32")
    mq, mo = read_gguf(g), read_safetensors(out)
    name = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    assert mq[name].dtype.name == "Q8_0" and mo[name].dtype.name == "F32"
    np.testing.assert_array_equal(mo[name].numpy(), raw_to_f32(mq[name].numpy(), "Q8_0"))
    out2 = str(tmp_path / "keep.safetensors")  # type None: blocks cannot stay blocks in safetensors -> F32
    convert(g, out2, None)
    assert read_safetensors(out2)[name].dtype.name == "F32"


def test_export_rules_match_sdcpp():
    q8 = dtypes.Q8_0
    assert tensor_should_be_converted("a.weight", (64, 64), q8)
    assert not tensor_should_be_converted("a.weight", (33, 64), q8)  # ne[0] % 32
    assert tensor_should_be_converted("a.weight", (33, 64), dtypes.F16)
    for name in ("a.bias", "a.scale", "a.weight_scale", "double_blocks.0.img_in.weight", "txt_in.w", "time_in.w",
                 "vector_in.w", "guidance_in.w", "final_layer.linear.weight", "x_embedder.proj.weight",
                 "t_embedder.mlp.0.weight", "y_embedder.w", "pos_embed", "context_embedder.weight",
                 "model.diffusion_model.time_embed.0.weight", "label_emb.0.0.weight",
                 "token_embedding.weight", "position_embedding.weight"):
        assert not tensor_should_be_converted(name, (64, 64), q8), name
    assert not tensor_should_be_converted("a.weight", (64, 64), None)
    t2 = Tensor.from_numpy(np.zeros((4, 64), np.float32))
    t1 = Tensor.from_numpy(np.zeros(64, np.float32))
    ti = Tensor.from_numpy(np.zeros((2, 64), np.int32))
    assert export_type("x.weight", t2, q8) == q8
    assert export_type("norm.weight", t1, q8) == q8  # as sd.cpp (the default)
    assert export_type("norm.weight", t1, q8, keep_1d=True) == dtypes.F32  # opt-in: 1-D stays float
    assert export_type("norm.weight", t1, dtypes.F16) == dtypes.F16
    assert export_type("ids", ti, dtypes.F16) == dtypes.I32
    rules = parse_tensor_type_rules("attn=q4_0,^first_stage=f32, =q8_0")
    assert export_type("blk.attn.weight", t2, dtypes.F16, rules) == dtypes.Q4_0
    assert export_type("first_stage_model.x.weight", t2, dtypes.Q4_0, rules) == dtypes.F32
    assert export_type("first_stage_model.attn.weight", t2, None, rules) == dtypes.Q4_0  # first match wins
    assert export_type("x.bias", t2, None, rules) == dtypes.F32  # rule type still obeys sd.cpp's keep rules


@pytest.mark.parametrize("rules", ["attn", "=q8_0", "x=q9_9", "(=f16", "x=q8_0,y"])
def test_bad_rules(rules):
    with pytest.raises(UsageError):
        parse_tensor_type_rules(rules)


def test_bad_convert_arguments(tmp_path):
    src, _ = _source(tmp_path)
    with pytest.raises(UsageError, match="unknown --type"):
        convert(src, str(tmp_path / "o.gguf"), "q7_0")
    with pytest.raises(UsageError, match="safetensors cannot hold Q8_0"):
        convert(src, str(tmp_path / "o.safetensors"), "q8_0")
    with pytest.raises(ModelFileError, match="no such file"):
        convert(str(tmp_path / "missing.safetensors"), str(tmp_path / "o.gguf"), "f16")
    assert not os.path.exists(tmp_path / "o.gguf")


def test_convert_with_prefixes_and_rename(tmp_path):
    src, d = _source(tmp_path)
    out = str(tmp_path / "o.gguf")
    s = convert([(src, "a."), (src, "b.")], out, "f16", rename=lambda n: n.upper(), drop_unused=False,
                sort_names=False)
    mf = read_gguf(out)
    assert s.n_tensors == 2 * len(d) and len(mf) == 2 * len(d)
    assert list(mf.tensors)[0] == ("A." + next(iter(read_safetensors(src).tensors))).upper()
    with pytest.raises(ModelFileError, match="also in another input"):
        convert([(src, ""), (src, "")], out, "f16")
    # a name that already carries its prefix is not prefixed twice (sd.cpp's rule)
    s = convert([(src, "model.diffusion_model.")], out, None)
    assert "model.diffusion_model.time_embed.0.weight" in read_gguf(out)
    assert "model.diffusion_model.first_stage_model.decoder.mid.attn_1.q.weight" in read_gguf(out)


def test_failed_write_leaves_no_output(tmp_path):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"previous")

    def boom():
        raise RuntimeError("disk on fire")
    plans = [TensorPlan("a", dtypes.F32, (4,), lambda: np.zeros(4, np.float32)), TensorPlan("b", dtypes.F32, (4,), boom)]
    for writer, path in ((write_gguf, out), (write_safetensors, tmp_path / "o.safetensors")):
        with pytest.raises(RuntimeError):
            writer(str(path), plans)
    assert out.read_bytes() == b"previous"
    assert not (tmp_path / "o.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["o.gguf"]  # no temp files left
    with pytest.raises(ModelFileError, match="produced 8 bytes"):
        write_gguf(str(out), [TensorPlan("a", dtypes.F32, (4,), lambda: np.zeros(2, np.float32))])
    assert out.read_bytes() == b"previous"


def test_streaming_holds_one_tensor_at_a_time(tmp_path):
    alive = []

    def make(i):
        def produce():
            assert all(r() is None for r in alive), "the previous tensor's buffer is still alive"
            a = np.full(1024, i, np.float32)
            alive.append(weakref.ref(a))
            return a
        return produce
    plans = [TensorPlan(f"t{i}", dtypes.F32, (1024,), make(i)) for i in range(5)]
    write_gguf(str(tmp_path / "s.gguf"), plans)
    alive.clear()
    write_safetensors(str(tmp_path / "s.safetensors"), plans)
    np.testing.assert_array_equal(read_gguf(str(tmp_path / "s.gguf"))["t3"].numpy(), 3)


def test_gguf_metadata_all_value_types(tmp_path):
    meta = {"u8": GGUFValue(250, G.UINT8), "i8": GGUFValue(-7, G.INT8), "u16": GGUFValue(65000, G.UINT16),
            "i16": GGUFValue(-300, G.INT16), "u32": 4_000_000_000, "i32": -5, "f32": 0.5, "b": False,
            "s": "ünïcode", "u64": 1 << 40, "i64": -(1 << 40), "f64": GGUFValue(0.1, G.FLOAT64),
            "ints": [1, 2, 3], "strs": ["a", "b"], "np": np.array([1.5, 2.5], np.float32),
            "bools": np.array([True, False])}
    p = str(tmp_path / "m.gguf")
    write_gguf(p, {"x": np.zeros(32, np.float32)}, meta, alignment=64)
    m = read_gguf(p).metadata
    assert m["general.alignment"] == 64
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"], m["f32"], m["b"], m["s"]) == \
        (250, -7, 65000, -300, 4_000_000_000, -5, 0.5, False, "ünïcode")
    assert (m["u64"], m["i64"], m["f64"]) == (1 << 40, -(1 << 40), 0.1)
    assert list(m["ints"]) == [1, 2, 3] and m["strs"] == ["a", "b"] and list(m["np"]) == [1.5, 2.5]
    assert list(m["bools"]) == [True, False]
    r = gguf.GGUFReader(p)
    assert r.fields["s"].contents() == "ünïcode" and r.fields["u8"].types == [gguf.GGUFValueType.UINT8]
    assert r.fields["general.alignment"].contents() == 64 and r.tensors[0].name == "x"
    with pytest.raises(UsageError):
        write_gguf(p, {}, {"bad": object()})
    with pytest.raises(UsageError):
        write_gguf(p, {}, {"bad": GGUFValue(300, G.UINT8)})


def test_safetensors_writer_reads_in_safetensors_package(tmp_path):
    d = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64),
         "c": np.ones((2, 2, 2), np.float16), "d": np.array([-1, 2], np.int8)}
    p = str(tmp_path / "w.safetensors")
    write_safetensors(p, d, {"k": "v"})
    loaded = st_numpy.load_file(p)
    for k, a in d.items():
        np.testing.assert_array_equal(loaded[k], a)
    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    assert n % 8 == 0
    with pytest.raises(UsageError, match="cannot hold Q8_0"):
        write_safetensors(p, [TensorPlan("q", dtypes.Q8_0, (32,), lambda: np.zeros(34, np.uint8))])
    with pytest.raises(UsageError, match="strings"):
        write_safetensors(p, d, {"k": 1})
    assert open_model(p).metadata == {"k": "v"}


def _find_sd_cli():
    import glob
    import shutil
    cands = [os.environ.get("SDRT_SDCLI", ""), os.environ.get("SDRT_SD_CLI", ""), shutil.which("sd-cli") or ""]
    here = os.path.dirname(os.path.abspath(__file__))
    cands += glob.glob(os.path.join(here, "..", "..", "sdcpp", "*", "vendor", "stable-diffusion.cpp", "build", "bin",
                                    "sd-cli"))
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


@pytest.mark.parametrize("type_name", CONVERT_TYPES)
def test_matches_sd_cli_convert(tmp_path, quant, type_name):
    """sd-cli -M convert and sdrt's convert (keep_1d=False = sd.cpp's rules exactly) write the same
    tensor table (names, order, ne, types) and the same tensor bytes, for every --type: the float
    conversions, and the block types through ggml_quantize_chunk with sd.cpp's all-ones importance
    vector (ggml's weighted quantize_row_*_impl for Q4_0 ... Q5_1 and Q2_K ... Q6_K)."""
    import subprocess
    sd = _find_sd_cli()
    if sd is None:
        pytest.skip("sd-cli comparison: no sd-cli binary found (set SDRT_SDCLI=/path/to/sd-cli)")
    src, d = _source(tmp_path, int_tensor=False)  # sd-cli aborts converting an I32 tensor to f16/bf16
    ref, ours = str(tmp_path / "ref.gguf"), str(tmp_path / "ours.gguf")
    r = subprocess.run([sd, "-M", "convert", "-m", src, "-o", ref, "--type", type_name], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    convert(src, ours, type_name, keep_1d=False)
    a, b = read_gguf(ref), read_gguf(ours)
    # sd-cli converts tensors on several threads and its table's order follows their timing
    # (seen to differ between runs when the machine is busy); sdrt writes them sorted by name,
    # which is sd-cli's order when its threads finish in turn
    assert sorted(a.tensors) == list(b.tensors)
    dst = dtypes.get(type_name)
    assert any(a[n].dtype == dst for n in a.tensors), f"no tensor of the source became {dst.name}"
    for name in a.tensors:
        assert (a[name].ne, a[name].dtype) == (b[name].ne, b[name].dtype), name
        assert np.array_equal(np.ascontiguousarray(a[name].numpy()).reshape(-1).view(np.uint8),
                              np.ascontiguousarray(b[name].numpy()).reshape(-1).view(np.uint8)), name
