"""Quantized GEMM before/after in one run: mul_mat's int8-activation kernel (sdrt.ops.quant.gemm)
against the dequantize-tile + BLAS path it replaced (SDRT_QGEMM=off) and numpy's float32 matmul.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_qgemm.py --repeat 3

Shapes: 4096^3, T5-XXL's GEMMs on a 256-token prompt (M=256: q/k/v/o 4096x4096, wi 4096->10240,
wo 10240->4096) and Flux's at 256x256 (M=512 tokens: 3072->3072, 3072->12288, 12288->3072).
Each repeat times numpy, "before" and every available int8 path back to back (interleaved), and
the median over repeats is printed; the threads are sdrt's (-t, default all cores). "before" runs
exactly as gemm_weight did: BLAS on one thread up to SMALL_GEMM_ROWS rows, else all threads.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from sdrt.ops import dtypes, quant  # noqa: E402
from sdrt.ops.cpu import matmul as cpu_mm  # noqa: E402
from sdrt.ops.quant import gemm as qg  # noqa: E402
from sdrt.ops.threads import get_threads, set_threads  # noqa: E402

SHAPES = [("4096^3", 4096, 4096, 4096),
          ("T5 attn M=256", 256, 4096, 4096), ("T5 wi M=256", 256, 10240, 4096), ("T5 wo M=256", 256, 4096, 10240),
          ("Flux qkv-like M=512", 512, 3072, 3072), ("Flux mlp0 M=512", 512, 12288, 3072), ("Flux mlp2 M=512", 512, 3072, 12288)]


def cpu_flags() -> str:
    want = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
    try:
        flags = set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":")[1].split())
        model = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("model name")).split(":")[1].strip()
    except (OSError, StopIteration):
        return "unknown CPU"
    return f"{model}; " + " ".join(f for f in want if f in flags)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K")
    ap.add_argument("--shapes", default="", help="comma-separated subset of the shape labels' first words")
    a = ap.parse_args()
    set_threads(a.threads)
    paths = qg.available_paths()
    print(f"# {cpu_flags()}")
    print(f"# {get_threads()} threads, int8 paths here: {', '.join(paths)}; load average {os.getloadavg()[0]:.1f}")
    print()
    cols = ["before (dequant+BLAS)"] + [f"int8 {p}" for p in paths if p != "scalar"]
    print("| shape | type | numpy f32 GFLOP/s | " + " | ".join(f"{c} GFLOP/s" for c in cols) + " | after / before |")
    print("|---|---|---:|" + "---:|" * len(cols) + "---:|")
    rng = np.random.default_rng(0)
    want = {s.strip() for s in a.shapes.split(",") if s.strip()}
    for label, m, n, k in SHAPES:
        if want and label.split()[0] not in want:
            continue
        x = rng.standard_normal((m, k), np.float32)
        wf = rng.standard_normal((n, k), np.float32) / np.float32(np.sqrt(k))
        out = np.empty((m, n), np.float32)
        for tname in a.types.split(","):
            dt = dtypes.get(tname)
            if k % dt.block_size:
                continue
            raw = quant.quantize(wf, dt).reshape(n, -1)
            runs = {"numpy": lambda: np.matmul(x, wf.T, out=out)}

            def before():  # gemm_weight as it was: no int8 kernel, no SMALL_GEMM_MACS exception
                keep, cpu_mm.SMALL_GEMM_MACS = cpu_mm.SMALL_GEMM_MACS, float("inf")
                try:
                    with qg.using_path("off"):
                        cpu_mm.gemm_weight(dt, raw, [(x, out)])
                finally:
                    cpu_mm.SMALL_GEMM_MACS = keep
            runs[cols[0]] = before
            for p in paths:
                if p != "scalar":
                    runs[f"int8 {p}"] = (lambda p=p: qg.qgemm(x, raw, dt, out, p, get_threads()))
            for fn in runs.values():
                fn()  # warm-up
            times = {kk: [] for kk in runs}
            for _ in range(a.repeat):
                for kk, fn in runs.items():
                    times[kk].append(timed(fn))
            gf = {kk: 2 * m * n * k / np.median(v) / 1e9 for kk, v in times.items()}
            best_after = max(gf[c] for c in cols[1:]) if len(cols) > 1 else float("nan")
            print(f"| {label} {m}x{n}x{k} | {tname} | {gf['numpy']:.0f} | " + " | ".join(f"{gf[c]:.0f}" for c in cols)
                  + f" | {best_after / gf[cols[0]]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
