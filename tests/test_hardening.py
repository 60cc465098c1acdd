"""Issue 22: every hostile file and argument it lists gets a clear error (or a correct result),
quickly and within the resource policy (docs/model-files.md, "Limits")."""
from __future__ import annotations

import io
import json
import math
import os
import resource
import struct
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from sdrt.engine import limits
from sdrt.engine.params import GenParams
from sdrt.errors import ModelFileError, UsageError
from sdrt.io import open_model
from sdrt.io import gguf_file as G
from sdrt.io.ckpt import read_ckpt
from sdrt.io.png import encode_png, read_png_text
from sdrt.io.safetensors import read_safetensors

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import fuzz_torch_corpus as TC  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def write(tmp_path, data: bytes, name: str) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def refused(path, match, seconds=5.0, reader=open_model):
    t = time.process_time()
    with pytest.raises(ModelFileError, match=match) as e:
        reader(path)
    assert time.process_time() - t < seconds
    assert "\n" not in str(e.value)
    return str(e.value)


def rss_growth(fn):
    """Peak-RSS growth (bytes) of fn() run in a forked child, so the parent's peak does not hide it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            fn()
        except ModelFileError:
            pass
        os.write(w, str((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024).encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 100)
    os.close(r)
    os.waitpid(pid, 0)
    return int(out)


# ---- torch checkpoints -----------------------------------------------------------------------------

def _deflated_zip(pkl: bytes, storages: dict) -> bytes:
    return TC.torch_zip(pkl, storages, deflate=True)


def test_zip_central_directory_lying_about_compress_size(tmp_path):
    # a deflated storage of 256 MB of zeros (~250 KB compressed) whose central directory claims a
    # compress_size that passes any ratio check: the real bytes are counted while inflating
    n = 64 << 20
    pkl = TC.state_pickle([("w", "FloatStorage", "0", n, 0, (n,), (1,))], legacy=False)
    data = bytearray(_deflated_zip(pkl, {"0": bytes(4 * n)}))
    import zipfile
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo("archive/data/0")
    h = info.header_offset
    start = h + 30 + sum(struct.unpack_from("<HH", data, h + 26))
    lie = len(data) - start                        # every byte to the end of the file: "barely compressed"
    i = data.find(b"PK\x01\x02")
    while i >= 0:
        name_len = struct.unpack_from("<H", data, i + 28)[0]
        if data[i + 46:i + 46 + name_len].endswith(b"data/0"):
            struct.pack_into("<I", data, i + 20, lie)
        i = data.find(b"PK\x01\x02", i + 4)
    p = write(tmp_path, bytes(data), "bomb.ckpt")
    assert len(data) < 1 << 20
    msg = refused(p, "zip bomb")
    assert "inflate" in msg
    assert rss_growth(lambda: read_ckpt(p)) < 256 << 20


def test_deflated_data_pkl_of_16m_empty_sets(tmp_path):
    pkl = b"\x80\x02(" + b"\x8f" * (16 << 20) + b"1" + TC.state_pickle([], legacy=False)[2:]
    p = write(tmp_path, _deflated_zip(pkl, {}), "sets.ckpt")
    assert os.path.getsize(p) < 64 << 10
    refused(p, "zip bomb|budget")
    assert rss_growth(lambda: read_ckpt(p)) < 256 << 20


def test_stored_pickle_of_many_empty_sets_hits_the_memory_budget(tmp_path):
    pkl = b"\x80\x02(" + b"\x8f" * 400_000 + b"1" + TC.state_pickle([], legacy=False)[2:]
    p = write(tmp_path, TC.torch_zip(pkl, {}), "sets.ckpt")
    refused(p, "memory budget")


@pytest.mark.parametrize("size,stride", [((32768, 16384), (0, 0)), ((4, 4), (0, 1)), ((1, 2**62 - 1), (1, 1))])
def test_stride0_and_huge_sizes_are_refused(tmp_path, size, stride):
    pkl = TC.state_pickle([("w", "FloatStorage", "0", 4, 0, size, stride)], legacy=False)
    p = write(tmp_path, TC.torch_zip(pkl, {"0": bytes(16)}), "s.ckpt")
    refused(p, "elements|overflow")
    assert os.path.getsize(p) < 2048


def test_memoised_string_key_set_into_2000_dicts_is_fast(tmp_path):
    s = b"k" * (10 << 20)
    snippet = (b"(" + b"X" + struct.pack("<I", len(s)) + s + b"r" + struct.pack("<I", 99)
               + (b"}j" + struct.pack("<I", 99) + b"Ns") * 2000 + b"1")
    pkl = b"\x80\x02" + snippet + TC.state_pickle([("w", "FloatStorage", "0", 4, 0, (4,), (1,))], legacy=False)[2:]
    p = write(tmp_path, TC.torch_zip(pkl, {"0": bytes(16)}), "memo.ckpt")
    t = time.process_time()
    m = read_ckpt(p)
    assert time.process_time() - t < 3
    assert list(m.tensors) == ["w"]


@pytest.mark.parametrize("legacy", [False, True])
def test_huge_dict_key_is_not_joined_into_tensor_names(tmp_path, legacy):
    entries = [(f"t{i}", "FloatStorage", "0", 4, 0, (1,), (1,)) for i in range(300)]
    pkl = TC.state_pickle(entries, legacy, outer_key="k" * (10 << 20))
    TC._ELEM["0"] = 4
    data = TC.legacy_file(pkl, {"0": bytes(16)}) if legacy else TC.torch_zip(pkl, {"0": bytes(16)})
    p = write(tmp_path, data, "key.ckpt")
    refused(p, "longer than 65535")
    assert rss_growth(lambda: read_ckpt(p)) < 2 * len(data) + (128 << 20)


def test_many_empty_entries_are_bounded(tmp_path):
    entries = [(f"e{i}", "FloatStorage", "0", 4, 0, (0,), (1,)) for i in range(20_000)]
    p = write(tmp_path, TC.torch_zip(TC.state_pickle(entries, False), {"0": bytes(16)}), "empty.ckpt")
    refused(p, "opcodes|budget|tensors")


# ---- safetensors ------------------------------------------------------------------------------------

def _st(header: dict, body=b"") -> bytes:
    hb = json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + body


def test_99mb_header_of_empty_arrays_is_refused_fast(tmp_path):
    n = 99_000_000 // 13
    hb = b"{" + b",".join(b'"%07x":[]' % i for i in range(n)) + b"}"
    p = write(tmp_path, struct.pack("<Q", len(hb)) + hb, "e.safetensors")
    refused(p, "more than", seconds=3)
    assert rss_growth(lambda: read_safetensors(p)) < 400 << 20      # the safetensors package: 1.1 GB


def test_lone_surrogate_names_are_refused(tmp_path):
    hb = b'{"a\\ud800b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    p = write(tmp_path, struct.pack("<Q", len(hb)) + hb + bytes(4), "s.safetensors")
    refused(p, "surrogate")
    hb = b'{"__metadata__":{"k":"\\udfff"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    refused(write(tmp_path, struct.pack("<Q", len(hb)) + hb + bytes(4), "m.safetensors"), "surrogate")
    hb = b'{"a\\ud83d\\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'     # a valid pair: accepted
    m = read_safetensors(write(tmp_path, struct.pack("<Q", len(hb)) + hb + bytes(4), "ok.safetensors"))
    assert list(m.tensors) == ["a\U0001F600"]


# ---- GGUF -------------------------------------------------------------------------------------------

def _gguf(kvs=b"", n_kv=0, infos=b"", n_tensors=0, tail=b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + infos + tail


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def test_gguf_n_dims_zero_refused(tmp_path):
    info = _s(b"t") + struct.pack("<I", 0) + struct.pack("<IQ", 0, 0)
    refused(write(tmp_path, _gguf(infos=info, n_tensors=1, tail=bytes(64)), "z.gguf"), "n_dims 0")


def test_gguf_nested_arrays_refused(tmp_path):
    kv = _s(b"a") + struct.pack("<I", G.ARRAY) + struct.pack("<IQ", G.ARRAY, 1) + struct.pack("<IQ", G.UINT8, 0)
    refused(write(tmp_path, _gguf(kv, 1, tail=bytes(32)), "n.gguf"), "nested arrays are not supported")


@pytest.mark.parametrize("what", ["keys", "tensors", "strings", "arrays"])
def test_gguf_millions_of_empty_entries_are_fast(tmp_path, what):
    n = 2_000_000
    if what == "keys":
        kvs = b"".join(_s(b"%x" % i) + struct.pack("<IB", G.UINT8, 0) for i in range(n))
        data = _gguf(kvs, n)
    elif what == "tensors":
        infos = b"".join(_s(b"%x" % i) + struct.pack("<IQIQ", 1, 0, 0, 0) for i in range(n))
        data = _gguf(infos=infos, n_tensors=n)
    elif what == "strings":
        data = _gguf(_s(b"a") + struct.pack("<IIQ", G.ARRAY, G.STRING, n) + bytes(8 * n), 1)
    else:
        data = _gguf(_s(b"a") + struct.pack("<IIQ", G.ARRAY, G.ARRAY, n) + struct.pack("<IQ", G.UINT8, 0) * n, 1)
    refused(write(tmp_path, data, "m.gguf"), "at most|nested", seconds=2)


def test_gguf_a_large_vocabulary_still_reads(tmp_path):
    n = 300_000
    data = _gguf(_s(b"tok") + struct.pack("<IIQ", G.ARRAY, G.STRING, n) + _s(b"ab") * n, 1) + bytes(32)
    t = time.process_time()
    m = open_model(write(tmp_path, data, "v.gguf"))
    assert time.process_time() - t < 3
    assert len(m.metadata["tok"]) == n and m.metadata["tok"][-1] == "ab"


# ---- non-regular files ------------------------------------------------------------------------------

def test_fifo_model_is_refused_without_blocking(tmp_path):
    fifo = str(tmp_path / "m.safetensors")
    os.mkfifo(fifo)
    code = ("import sys; from sdrt.cli.main import main; "
            f"sys.exit(main(['-m', {fifo!r}, '-o', {str(tmp_path / 'o.png')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 1, r.stderr
    assert "FIFO" in r.stderr and "Traceback" not in r.stderr
    for reader in (open_model, read_ckpt, read_safetensors, G.read_gguf):
        refused(fifo, "FIFO", reader=reader)
    from sdrt.io.images import load_image
    with pytest.raises(UsageError, match="not a regular file"):
        load_image(fifo)


def test_fifo_taesd_is_refused(tmp_path):
    fifo = str(tmp_path / "taesd.safetensors")
    os.mkfifo(fifo)
    refused(fifo, "FIFO")
    with pytest.raises(ModelFileError, match="device"):
        open_model("/dev/zero")


# ---- arguments ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    ({"width": 100000, "height": 100000}, "at most 16384"),
    ({"width": 16384, "height": 16384}, "GiB of working memory"),
    ({"width": 2**31}, "at most 16384"),
    ({"steps": 1099511627776}, "--steps"),
    ({"batch_count": 10**9}, "batch-count"),
    ({"prompt": "a" * (1 << 20)}, "prompt.*bytes"),
    ({"negative_prompt": "é" * 20000}, "negative-prompt"),
    ({"cfg_scale": math.inf}, "--cfg-scale.*finite"),
    ({"cfg_scale": math.nan}, "--cfg-scale"),
    ({"eta": math.nan}, "--eta.*finite"),
    ({"eta": -math.inf}, "--eta"),
    ({"img_cfg_scale": math.nan}, "--img-cfg-scale"),
    ({"strength": math.nan}, "--strength"),
    ({"guidance": math.inf}, "--guidance"),
])
def test_arguments_refused_before_loading(kw, match):
    t = time.process_time()
    with pytest.raises(UsageError, match=match):
        GenParams(**kw).validate()
    assert time.process_time() - t < 1


def test_activation_estimate_is_the_servers_check():
    gp = GenParams(width=2048, height=2048)
    need = limits.activation_bytes(2048, 2048)
    limits.check_request(gp, capacity=need + (64 << 20))
    with pytest.raises(UsageError, match="working memory"):
        limits.check_request(GenParams(width=2048, height=2048), capacity=need // 2)
    # --vae-tiling bounds the decoder's share
    assert limits.activation_bytes(4096, 4096, vae_tiling=True) < limits.activation_bytes(4096, 4096)
    GenParams(width=4096, height=4096, vae_tiling=True).validate()   # sentinels (eta/img_cfg inf) stay allowed


def test_invalid_utf8_and_lone_surrogates_become_replacement_chars():
    argv_prompt = b"a \xff\xfe cat".decode("utf-8", "surrogateescape")     # what Python makes of raw argv
    gp = GenParams(prompt=argv_prompt, negative_prompt="x\ud800y").validate()
    assert gp.prompt == "a \ufffd\ufffd cat" and gp.negative_prompt == "x\ufffdy"
    gp.prompt.encode("utf-8")


def test_cli_invalid_utf8_prompt_runs_and_writes_clean_metadata(tmp_path):
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"x")
    out = tmp_path / "o.png"
    code = ("import sys, os\n"
            "from tests.test_pipeline import make_pipe\n"
            "from sdrt.engine.pipeline import Pipeline\n"
            "def load(mp):\n    p = make_pipe(); p.model_params = mp; return p\n"
            "Pipeline.load = staticmethod(load)\n"
            "from sdrt.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "-m", str(model).encode(), b"-p", b"cat \xff\x00"[:5],
                        b"-W", b"64", b"-H", b"64", b"--steps", b"2", b"-o", str(out).encode()],
                       capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert b"Traceback" not in r.stderr
    assert "cat \ufffd" in read_png_text(out.read_bytes())["parameters"]


@pytest.mark.parametrize("out,match", [("{d}/", "no file name"), ("{d}/sub.png", "is a directory"),
                                       ("{d}/model.safetensors/x.png", "not a folder")])
def test_output_path_checked_at_start(tmp_path, capsys, out, match, monkeypatch):
    from sdrt.cli import main as cli
    from sdrt.engine.pipeline import Pipeline
    loaded = []
    monkeypatch.setattr(Pipeline, "load", staticmethod(lambda mp: loaded.append(mp)))
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"x")
    (tmp_path / "sub.png").mkdir()
    rc = cli.main(["-m", str(model), "-o", out.format(d=tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and re_search(match, err) and not loaded, err
    assert not (tmp_path / ".png").exists()


def re_search(pattern, s):
    import re
    return re.search(pattern, s) is not None


def test_nul_bytes_never_raw_in_png_text():
    png = encode_png(np.zeros((2, 2, 3), np.uint8), "a\x00b \ud800")
    i = png.index(b"tEXt")
    n = struct.unpack(">I", png[i - 4:i])[0]
    body = png[i + 4:i + 4 + n]
    assert body.count(b"\x00") == 1 and body.endswith(b"a\\0b \xef\xbf\xbd")
    assert read_png_text(png)["parameters"] == "a\\0b \ufffd"


# ---- non-finite results ---------------------------------------------------------------------------

def test_nan_latents_stop_the_run_without_warnings(monkeypatch):
    from test_pipeline import make_pipe
    pipe = make_pipe()
    calls = []

    def inf_unet(x, t, context, y=None, c_concat=None):          # what 2,000 nested "(" weights do: inf
        calls.append(1)
        return np.full_like(x, np.inf)
    monkeypatch.setattr(pipe, "_run_model", lambda x, t, passes: [inf_unet(x, t, None) for _ in passes])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # any RuntimeWarning would fail here
        with pytest.raises(limits.NonFiniteResultError, match="non-finite.*black"):
            pipe.generate(GenParams(width=64, height=64, steps=2, prompt="x"), show_progress=False)
    assert calls


def test_all_nan_image_is_an_error_partly_nan_is_a_warning(caplog):
    with pytest.raises(limits.NonFiniteResultError, match="entirely NaN"):
        limits.check_image(np.full((1, 3, 4, 4), np.nan, np.float32))
    img = np.zeros((1, 3, 4, 4), np.float32)
    img[0, 0, 0, 0] = np.nan
    limits.check_image(img)
    assert "non-finite" in caplog.text


def test_cli_nan_run_is_exit_1_with_one_line(tmp_path, capsys, monkeypatch):
    from test_pipeline import make_pipe

    from sdrt.cli import main as cli
    from sdrt.engine.pipeline import Pipeline

    def load(mp):
        p = make_pipe()
        p.model_params = mp
        p._run_model = lambda x, t, passes: [np.full_like(x, np.nan) for _ in passes]
        return p
    monkeypatch.setattr(Pipeline, "load", staticmethod(load))
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"x")
    rc = cli.main(["-m", str(model), "-W", "64", "-H", "64", "--steps", "2", "-o", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert rc == 1 and "non-finite" in err and "RuntimeWarning" not in err
    assert not (tmp_path / "o.png").exists()


def test_zip_inflate_counts_real_bytes_for_honest_deflated_files(tmp_path):
    # a correct deflated checkpoint still reads, with its CRC checked
    pkl = TC.state_pickle([("w", "FloatStorage", "0", 4, 0, (2, 2), (2, 1))], legacy=False)
    vals = np.arange(4, dtype=np.float32)
    p = write(tmp_path, TC.torch_zip(pkl, {"0": vals.tobytes()}, deflate=True), "ok.ckpt")
    np.testing.assert_array_equal(read_ckpt(p)["w"].numpy().reshape(-1), vals)
    bad = bytearray(open(p, "rb").read())
    i = bad.find(b"PK\x01\x02")
    while i >= 0:                                   # flip every CRC in the central directory
        struct.pack_into("<I", bad, i + 16, struct.unpack_from("<I", bad, i + 16)[0] ^ 1)
        i = bad.find(b"PK\x01\x02", i + 4)
    refused(write(tmp_path, bytes(bad), "crc.ckpt"), "CRC|damaged|zip")


def test_2000_nested_parentheses_reach_the_nan_check_without_warnings():
    # the prompt parser's weight becomes 1.1**2000 = inf; sd.cpp's apply_token_weights then makes the
    # context non-finite, the UNet's output follows, and check_latent stops the run (the stub UNet
    # test above covers the pipeline end); no RuntimeWarning reaches stderr under quiet_numerics
    from sdrt.models.prompt import apply_token_weights, parse_prompt_attention

    @limits.quiet_numerics
    def context():
        (text, w), = parse_prompt_attention("(" * 2000 + "x" + ")" * 2000)
        weights = np.ones(77, np.float32)
        weights[1] = w
        return apply_token_weights(np.random.default_rng(0).standard_normal((77, 8)).astype(np.float32), weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = context()
    assert not np.isfinite(ctx).all()
    with pytest.raises(limits.NonFiniteResultError):
        limits.check_latent(ctx * np.float32(0.5), seed=1)
