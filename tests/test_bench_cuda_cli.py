"""The smoke run of bench/bench_cuda_cli.py (the whole-CLI comparison of every DiT family with
sd-cli): reduced random files, 128x128, 2 steps, sdrt on the CPU and the CPU sd-cli; the bench
must write its files, run both engines, parse their logs and print a table whose images agree.

Opt-in: runs only when SDRT_SDCLI names an sd-cli binary (as the other sd-cli comparisons).
Z-Image's reduced DiT loads only in an sd-cli built with bench/patch_sdcli_zimage.py: set
SDRT_SDCLI_ZIMAGE to that binary (else SDRT_SDCLI is tried and the case skips when it cannot load
the file). Shapes (what sd-cli 0.4.7 accepts reduced): SD3 = sd3.5-medium at 24 blocks (sd-cli's
MMDiT is 64 x depth wide with depth >= 24) with a 1-block T5-XXL (the T5-depth patch of
bench/build_sdcli_cpu.sh); Flux 1 + 1 blocks; Qwen-Image 1 block, a 1-layer LLM; Z-Image 1 + 1
layers of width 256 with a 1-layer Qwen3 of width 64. Files are kept under $SDRT_SDCLI_CLI_DIR
(default: a temp dir). The bar is a sanity one (PSNR >= 30 dB): BF16 files, sd-cli's CPU matmuls
round activations to BF16, and --diffusion-fa (the flag the GPU runs use) computes attention in F16.
Run it under `flock /work/heavy.lock` (SD3's 2.5 B-parameter DiT: ~5 GB per side).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "bench_cuda_cli.py")
MIN_PSNR = 30.0
CASES = {"sd35l": ["--sd3-variant", "sd3.5-medium", "--depth", "24", "--te-depth", "1"],
         "flux": ["--depth", "1", "--te-depth", "1"],
         "qwen": ["--depth", "1", "--te-depth", "1"],
         "zimage": ["--depth", "1", "--te-depth", "1"]}
# engine | s/step | wall | load, conditioning, sampling, decode | peak ('-' on the CPU) | PSNR | ratio
ROW = re.compile(r"^\| (sdrt|sdcli) \| ([0-9.]+) \| ([0-9.]+) \|(?: [-0-9.]+ \|){4} - \| ([-0-9.inf]+) \| "
                 r"([-0-9.]+) \|$")


def _exe(var):
    exe = os.environ.get(var)
    return exe if exe and os.access(exe, os.X_OK) else None


@pytest.mark.parametrize("family", list(CASES))
def test_smoke_run(family, tmp_path):
    sdcli = _exe("SDRT_SDCLI") or _exe("SDRT_SD_CLI")
    if sdcli is None:
        pytest.skip("sd-cli comparison: set SDRT_SDCLI=/path/to/sd-cli to run it (no sd-cli binary given)")
    if family == "zimage":
        sdcli = _exe("SDRT_SDCLI_ZIMAGE") or sdcli
    d = os.environ.get("SDRT_SDCLI_CLI_DIR") or str(tmp_path / "files")
    js = str(tmp_path / "cli.json")
    cmd = [sys.executable, BENCH, "--family", family, "--backend", "cpu", "--sdcli", sdcli, "--size", "128",
           "--steps", "2", "--threads", "2", "--jobs", "2", "--dir", d, "--json", js, *CASES[family]]
    if os.environ.get("SDRT_SDCLI_CLI_DIR"):
        cmd.append("--keep")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.load(open(js))[family]
    if family == "zimage" and "sdcli" not in res and "sdcli failed" in p.stdout:
        pytest.skip("Z-Image smoke: this sd-cli cannot load a reduced Z-Image DiT (needs bench/patch_sdcli_zimage.py;"
                    " set SDRT_SDCLI_ZIMAGE)")
    assert set(res) == {"sdrt", "sdcli"}, p.stdout[-4000:]
    rows = {m.group(1): m for m in (ROW.match(ln) for ln in p.stdout.splitlines()) if m}
    assert set(rows) == {"sdrt", "sdcli"}, p.stdout[-2000:]
    for eng, r in res.items():
        assert r["step_s"] > 0 and r["wall_s"] > r["stages"]["sampling"], r
        assert {"get_learned_condition", "sampling", "decode_first_stage"} <= set(r["stages"]), r
        assert float(rows[eng].group(2)) == pytest.approx(r["step_s"], abs=1e-3)
        assert r["peak_mib"] is None          # no nvidia-smi on the CPU machine: the table's '-'
    assert float(rows["sdcli"].group(5)) == pytest.approx(1.0, abs=0.01)
    ratio = res["sdcli"]["step_s"] / res["sdrt"]["step_s"]
    assert float(rows["sdrt"].group(5)) == pytest.approx(ratio, abs=0.01)
    print(f"bench_cuda_cli smoke, {family}: sdrt {res['sdrt']['step_s']:.2f} s/step, sd-cli "
          f"{res['sdcli']['step_s']:.2f} s/step, PSNR {res['sdrt']['psnr_vs_sdcli']:.2f} dB")
    assert res["sdrt"]["psnr_vs_sdcli"] >= MIN_PSNR, p.stdout[-3000:]
