"""Short run of bench/fuzz_model_files.py: mutated safetensors and GGUF files may only ever
raise sdrt.ModelFileError (the full 10,000-case runs are reported in docs/model-files.md)."""
from __future__ import annotations

import importlib.util
import os
import time

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "fuzz_model_files.py")


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
    assert time.perf_counter() - t0 < 20
