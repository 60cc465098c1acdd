"""bench/bench_cuda_dit.py's smoke mode: each DiT family at full width, 1-2 blocks per stack, on
the CPU — diffusers' transformer (float32 on bf16-valued random weights) against sdrt's model built
through the loader and the family registry from the same weights file (diffusers names), so the
diffusers-name converters and the bench's input/output conventions (packing, timestep scales,
Z-Image's negation, Qwen-Image's RoPE positions) are checked. Needs torch + diffusers (skipped
without them; the default CI has neither). ~0.5 min per family on two cores."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_cuda_dit as bench  # noqa: E402

DEPTH = {"flux": 1, "sd35l": 2, "zimage": 1, "qwen": 1}   # sd35l: a plain block and the context_pre_only last


@pytest.mark.parametrize("family", list(bench.FAMILIES))
def test_smoke_cross_check(family, tmp_path, monkeypatch):
    if not hasattr(diffusers, bench.FAMILIES[family].cls):
        pytest.skip(f"diffusers {diffusers.__version__} has no {bench.FAMILIES[family].cls}")
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = bench.main(["--backend", "cpu", "--family", family, "--depth", f"{family}={DEPTH[family]}",
                      "--size", "64", "--steps", "1", "--engines", "torch,sdrt", "--sdrt-type", "f32",
                      "--dir", str(tmp_path)])[family]
    assert set(res) == {"torch", "sdrt"}, res
    assert res["torch"]["finite"] and res["sdrt"]["finite"]
    assert res["sdrt"]["rel_err"] <= 1e-4, res["sdrt"]
    assert not os.path.exists(tmp_path / f"{family}.safetensors")      # the weights file is removed
