"""Dequantize / quantize throughput of sdrt.ops.quant, and the ratio to gguf's numpy code.

    python bench/bench_quant.py                      # 4096 x 4096 per type, all threads
    python bench/bench_quant.py --rows 1024 --types Q4_K,Q8_0 --threads 1

Dequantize: GB/s of float32 output written and of quantized bytes read (best of --repeat), and
the speed-up over `gguf.quants.dequantize` (one run) where gguf has the type. Quantize: MB/s of
float32 input on a smaller matrix (the k-quant searches are ~100x more work per element), and the
speed-up over `gguf.quants.quantize` where gguf has the type. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
from sdrt.ops import dtypes, quant

try:
    import gguf
    from gguf import quants as gq
except ImportError:  # the ratios are left out
    gguf = None


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--qrows", type=int, default=256, help="rows for the quantize table")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0: OpenMP default")
    ap.add_argument("--types", default="", help="comma-separated subset")
    ap.add_argument("--no-gguf", action="store_true", help="skip the gguf comparison")
    ap.add_argument("--no-quantize", action="store_true")
    a = ap.parse_args()
    quant.set_num_threads(a.threads)
    use_gguf = gguf is not None and not a.no_gguf
    want = {t.strip().upper() for t in a.types.split(",") if t.strip()}
    types = [t for t in dtypes.QUANT_TYPES if not want or t.name in want]
    from sdrt.ops.quant import _quants
    nthr = a.threads or _quants.max_threads()
    print(f"# sdrt.ops.quant, {a.rows} x {a.cols}, {nthr} thread(s), {os.cpu_count()} cpu(s), "
          f"numpy {np.__version__}{', gguf ' + gguf.__version__ if use_gguf and hasattr(gguf, '__version__') else ''}")
    print()
    print("| type | bits/weight | dequant ms | GB/s f32 out | GB/s in | gguf ms | speed-up vs gguf |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    out = np.empty((a.rows, a.cols), np.float32)
    for dt in types:
        raw = quant.random_raw(dt, a.rows, a.cols, seed=0)
        quant.dequantize(raw, dt, out=out)  # warm up
        t = best_time(lambda raw=raw, dt=dt: quant.dequantize(raw, dt, out=out), a.repeat)
        gtxt = rtxt = "-"
        if use_gguf:
            try:
                qt = gguf.GGMLQuantizationType[dt.name]
                tg = best_time(lambda raw=raw, qt=qt: gq.dequantize(raw, qt), 1)
                gtxt, rtxt = f"{tg * 1e3:.0f}", f"{tg / t:.0f}x"
            except (KeyError, NotImplementedError):
                pass
        bpw = dt.type_size * 8 / dt.block_size
        print(f"| {dt.name} | {bpw:.4g} | {t * 1e3:.1f} | {out.nbytes / t / 1e9:.2f} | "
              f"{raw.nbytes / t / 1e9:.2f} | {gtxt} | {rtxt} |", flush=True)

    if a.no_quantize:
        return
    print()
    print(f"# quantize, {a.qrows} x {a.cols} float32")
    print()
    print("| type | quantize ms | MB/s f32 in | gguf ms | speed-up vs gguf |")
    print("|---|---:|---:|---:|---:|")
    x = np.random.default_rng(0).standard_normal((a.qrows, a.cols)).astype(np.float32)
    for dt in quant.supported_quant_types():
        if want and dt.name not in want:
            continue
        quant.quantize(x[:8], dt)
        t = best_time(lambda dt=dt: quant.quantize(x, dt), a.repeat)
        gtxt = rtxt = "-"
        if use_gguf:
            try:
                qt = gguf.GGMLQuantizationType[dt.name]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tg = best_time(lambda qt=qt: gq.quantize(x, qt), 1)
                gtxt, rtxt = f"{tg * 1e3:.0f}", f"{tg / t:.0f}x"
            except (KeyError, NotImplementedError):
                pass
        print(f"| {dt.name} | {t * 1e3:.1f} | {x.nbytes / t / 1e6:.0f} | {gtxt} | {rtxt} |", flush=True)


if __name__ == "__main__":
    main()
