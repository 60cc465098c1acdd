"""Fuzzing the model-file readers and the generation arguments (issue 22).

Default (CI) run: a bounded sample, a few tens of seconds in all:
- in process, 300 mutated safetensors / GGUF files each (only ModelFileError may escape);
- isolated, 40 mutated files per format (safetensors, GGUF, torch zip, legacy torch), each in a
  forked child under RLIMIT_AS with its CPU time and peak RSS checked against the policy;
- the safetensors reader against the `safetensors` package on a mutated corpus: every
  disagreement must be one of the documented, deliberate differences (docs/model-files.md);
- hypothesis: random safetensors headers (same oracle) and random generation arguments
  (validate() either accepts them or raises UsageError, quickly).
Long mode on demand: SDRT_FUZZ_LONG=1 runs 10,000 isolated cases per format (what bench/README.md
reports; `python bench/fuzz_model_files.py --isolated` does the same from the command line).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdrt.errors import ModelFileError, UsageError

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "fuzz_model_files.py")
LONG = os.environ.get("SDRT_FUZZ_LONG", "") not in ("", "0")
FORMATS = ["safetensors", "gguf", "ckpt_zip", "ckpt_legacy"]


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_model_files", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_only_model_file_error_escapes(fuzz, tmp_path, fmt):
    t0 = time.perf_counter()
    r = fuzz.run(fmt, 300, seed=12345, folder=str(tmp_path), crash_dir=str(tmp_path / "crashes"))
    assert r["failures"] == 0, r
    assert r["ModelFileError"] + r["ok"] == 300
    assert r["ModelFileError"] > 100 and r["ok"] > 5  # the mutator both breaks files and leaves some readable
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("fmt", FORMATS)
def test_isolated_cases_stay_within_the_policy(fuzz, tmp_path, fmt):
    """Each case in its own memory-limited child: only ModelFileError, <= 1 s CPU (10 s in the
    short CI sample, where a loaded runner is the norm), peak RSS <= 2 x file + 256 MB."""
    cases = 10_000 if LONG else 40
    r = fuzz.run_isolated(fmt, cases, seed=777, folder=str(tmp_path), crash_dir=str(tmp_path / "crashes"),
                          max_seconds=1.0 if LONG else 10.0)
    assert r["failures"] == 0 and r["died"] == 0 and r["over_rss"] == 0 and r["slow"] == 0, r
    assert r["ModelFileError"] + r["ok"] == cases
    assert r["ok"] >= 1 and r["ModelFileError"] >= cases // 4


# ---- the safetensors package as an oracle -----------------------------------------------------------

def _dup_pairs(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise KeyError("duplicate")
    return dict(pairs)


def explain(data: bytes, sdrt_ok: bool, sdrt_error: str) -> str:
    """Why sdrt and the safetensors package disagree, if it is a documented difference."""
    if "do not fit the I32" in sdrt_error:
        return "I64 read as I32"
    try:
        n = struct.unpack_from("<Q", data)[0]
        header = json.loads(data[8:8 + n], object_pairs_hook=_dup_pairs)
    except KeyError:
        return "duplicate keys"
    except Exception:  # noqa: BLE001
        return "unexplained"
    if not isinstance(header, dict):
        return "unexplained"
    entries = [v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    shapes = [v.get("shape") for v in entries if isinstance(v.get("shape"), list)]
    if any(len(s) > 8 or any(type(d) is int and d >= 1 << 63 for d in s) for s in shapes):
        return "limits"
    if sdrt_ok:
        offs = sorted(tuple(v["data_offsets"]) for v in entries)
        pos = 0
        for b, e in offs:
            if b != pos:
                return "holes"
            pos = e
        if pos != len(data) - 8 - n:
            return "holes"
    return "unexplained"


def _verdicts(fuzz, path, data):
    from safetensors import safe_open

    from sdrt.io.safetensors import read_safetensors
    with open(path, "wb") as f:
        f.write(data)
    err = ""
    try:
        fuzz.touch(read_safetensors(path))
        ours = True
    except ModelFileError as e:
        ours, err = False, str(e)
    try:
        with safe_open(path, "numpy") as f:
            list(f.keys())
            f.metadata()
        theirs = True
    except Exception:  # noqa: BLE001 - the package raises SafetensorError and others
        theirs = False
    return ours, theirs, err


def test_safetensors_decisions_match_the_reference_package(fuzz, tmp_path):
    pytest.importorskip("safetensors")
    seeds = fuzz.make_seeds(str(tmp_path))["safetensors"]
    path = str(tmp_path / "case.safetensors")
    cases = 10_000 if LONG else 600
    agree, reasons = 0, {}
    for i in range(cases):
        rng = random.Random(f"oracle:{i}")
        k = rng.randrange(len(seeds))
        data = fuzz.mutate(seeds[k], "safetensors", rng, None)
        ours, theirs, err = _verdicts(fuzz, path, data)
        if ours == theirs:
            agree += 1
            continue
        why = explain(data, ours, err)
        assert why != "unexplained", (i, ours, theirs, err, data[:400])
        reasons[why] = reasons.get(why, 0) + 1
    assert agree > 0.85 * cases, (agree, reasons)


_DTYPES = ["F32", "F16", "BF16", "I8", "I16", "I32", "I64", "F64", "U8", "BOOL", "F8_E4M3", "X"]


@st.composite
def st_files(draw):
    n = draw(st.integers(0, 4))
    header, pos, body = {}, 0, b""
    for i in range(n):
        dt = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F64": 8, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "X": 1}[dt] * math.prod(shape)
        size += draw(st.sampled_from([0, 0, 0, 1, -1]))
        gap = draw(st.sampled_from([0, 0, 0, 1]))
        begin = pos + gap
        header[draw(st.sampled_from([f"t{i}", "", "é", "a.b"])) + str(i)] = {
            "dtype": dt, "shape": shape, "data_offsets": [begin, begin + max(size, 0)]}
        pos = begin + max(size, 0)
        body = body.ljust(pos, b"\0")
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.sampled_from([{"a": "b"}, {"a": 1}, [], None]))
    body += b"\0" * draw(st.sampled_from([0, 0, 1]))
    hb = json.dumps(header).encode() + b" " * draw(st.integers(0, 3))
    return struct.pack("<Q", len(hb)) + hb + body


@settings(max_examples=60 if not LONG else 2000, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st_files())
def test_hypothesis_safetensors_against_the_reference(fuzz, tmp_path, data):
    pytest.importorskip("safetensors")
    ours, theirs, err = _verdicts(fuzz, str(tmp_path / "h.safetensors"), data)
    if ours != theirs:
        assert explain(data, ours, err) != "unexplained", (ours, theirs, err, data[:300])


# ---- generation arguments -------------------------------------------------------------------------

_NUM = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=150 if not LONG else 3000, deadline=None)
@given(width=st.one_of(st.integers(-3, 20000), st.sampled_from([2**31, 2**63, 100000])),
       height=st.one_of(st.integers(-3, 20000), st.sampled_from([2**31, 100000])),
       steps=st.one_of(st.integers(-2, 20000), st.just(1099511627776)),
       batch=st.integers(-1, 20000), cfg=_NUM, eta=_NUM, strength=_NUM,
       prompt=st.one_of(st.text(max_size=50),
                        st.binary(max_size=50).map(lambda b: b.decode("utf-8", "surrogateescape")),
                        st.sampled_from(["a" * 40000, "(" * 2000 + "x" + ")" * 2000, "x\ud800y", "a\x00b"])))
def test_hypothesis_generation_arguments(width, height, steps, batch, cfg, eta, strength, prompt):
    from sdrt.engine.params import GenParams
    t = time.process_time()
    try:
        gp = GenParams(prompt=prompt, width=width, height=height, steps=steps, batch_count=batch, cfg_scale=cfg,
                       eta=eta, strength=strength).validate()
    except UsageError as e:
        assert "\n" not in str(e)
    else:
        gp.prompt.encode("utf-8")              # always valid text after validate()
        assert 0 < gp.resolved_size()[0] <= 16384 and 0 < gp.steps <= 10_000 and math.isfinite(gp.cfg_scale)
        assert math.isfinite(gp.strength) and not math.isnan(gp.eta)
    assert time.process_time() - t < 1


_FLAGS = ["-W", "-H", "--steps", "--cfg-scale", "--eta", "--strength", "-b", "-p", "-n", "--img-cfg-scale",
          "--guidance", "--sigmas", "--vae-tile-overlap", "--vae-tile-size", "-s", "--clip-skip", "-o"]
_VALUES = ["0", "-1", "1", "64", "16384", "100000", "2147483648", "1099511627776", "nan", "inf", "-inf", "1e309",
           "abc", "", "1,2,nan", "0.5", "x" * 40000, "(" * 2000, "\udcff\udcfe", "a\ud800", "{tmp}/", "{tmp}/o.png",
           "%d.png", "{tmp}/no/such/dir/x.png"]


@settings(max_examples=120 if not LONG else 2000, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.sampled_from(_FLAGS), st.sampled_from(_VALUES)), max_size=5))
def test_hypothesis_command_lines(tmp_path, capsys, pairs):
    """Hostile command lines end in exit 2 (usage) or reach model loading (stubbed here), with one
    line on stderr and no traceback; nothing is loaded before the arguments pass."""
    from sdrt.cli import main as cli
    from sdrt.engine.pipeline import Pipeline
    from sdrt.errors import SdrtError

    class Reached(SdrtError):
        pass

    def load(mp):
        raise Reached("reached model loading")

    model = tmp_path / "model.safetensors"
    model.write_bytes(b"x")
    argv = ["-m", str(model)]
    for flag, value in pairs:
        argv += [flag, value.replace("{tmp}", str(tmp_path))]
    orig = Pipeline.load
    Pipeline.load = staticmethod(load)
    try:
        t = time.process_time()
        rc = cli.main(argv)
        assert time.process_time() - t < 2
    finally:
        Pipeline.load = orig
    err = capsys.readouterr().err
    assert rc in (1, 2), (argv, rc, err)
    assert "Traceback" not in err and err.count("\n") <= 1, err
    if rc == 1:
        assert "reached model loading" in err
