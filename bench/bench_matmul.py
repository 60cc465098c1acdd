"""GEMM: sdrt mul_mat with F32/F16/BF16/Q8_0/Q4_0/Q4_K weights vs numpy fp32 matmul, same shape.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_matmul.py [--repeat 5] [--quick]

Per shape (M tokens x K in -> N out), in one run and interleaved so machine noise hits all
columns alike, median of --repeat timings (3x that for the small SD shapes) after one warm-up:
- numpy:  np.matmul(x[M, K], w[N, K].T) on float32 arrays (a fresh output, as the graph makes);
- sdrt:   F.mul_mat(w, x) through Graph(...).run("cpu"): weights stay in their dtype and are
          dequantized/widened tile by tile into BLAS (the weight is never expanded whole).
GFLOP/s count 2*M*N*K; "ratio" is the median over repeats of t_numpy / t_sdrt, each numpy
timing taken right before its sdrt timing (robust to the load drift of a shared machine).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np

from sdrt.ops import api as F
from sdrt.ops import dtypes, quant
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

# name, M, K, N
SHAPES = [
    ("4096x4096x4096", 4096, 4096, 4096),
    ("SD M=4096 K=320 N=1280", 4096, 320, 1280),
    ("SD M=4096 K=1280 N=320", 4096, 1280, 320),
]
WTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K"]


def weight_tensor(w: np.ndarray, name: str) -> Tensor:
    if name in ("F32", "F16", "BF16"):
        return Tensor.from_numpy(f32_to_raw(w, name), dtype=name)
    return Tensor.from_numpy(quant.quantize(w, name), dtype=name)


def timeit(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="SD shapes only (skip 4096^3)")
    ap.add_argument("--types", default=",".join(WTYPES))
    args = ap.parse_args()
    wtypes = args.types.split(",")
    shapes = SHAPES[1:] if args.quick else SHAPES
    rng = np.random.default_rng(0)
    print(f"threads: OMP={os.environ.get('OMP_NUM_THREADS', '-')} "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}; "
          f"median of {args.repeat} (4096^3) or {3 * args.repeat} (SD shapes) after one warm-up\n")
    rows = []
    for label, m, k, n in shapes:
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = (rng.standard_normal((n, k), dtype=np.float32) * 0.05).astype(np.float32)
        tx = Tensor.from_numpy(x)
        # a block type whose block does not divide K cannot hold this weight (sd.cpp keeps
        # such tensors in another type); it is left out of that shape's rows
        graphs = {t: Graph(F.mul_mat(weight_tensor(w, t), tx)) for t in wtypes
                  if k % dtypes.get(t).block_size == 0}
        fns = {"numpy": functools.partial(np.matmul, x, w.T)}
        for t, g in graphs.items():
            fns[t] = functools.partial(g.run, "cpu")
        # correctness guard: quantized results stay close to fp32 (catches a broken kernel)
        ref = np.matmul(x, w.T)  # also the numpy warm-up
        for t, g in graphs.items():
            got = g.run("cpu")["out"].numpy()
            err = float(np.abs(got - ref).max() / np.abs(ref).max())
            if err > 0.1:
                raise SystemExit(f"{label} {t}: relative error {err:.3g} vs fp32 — broken kernel")
        # numpy runs right before each sdrt column, so a ratio compares two neighbouring
        # timings (load on this shared machine drifts within seconds); the SD shapes take
        # ~40 ms, so they get 3x the repeats
        times = {name: [] for name in fns}
        ratios = {name: [] for name in fns}
        for _ in range(args.repeat if m * n * k >= 2**34 else 3 * args.repeat):
            for name in graphs:
                tn = timeit(fns["numpy"])
                ts = timeit(fns[name])
                times["numpy"].append(tn)
                times[name].append(ts)
                ratios[name].append(tn / ts)
        ratios["numpy"] = [1.0]
        flop = 2.0 * m * n * k
        for name in fns:
            g = flop / np.median(times[name]) / 1e9
            r = float(np.median(ratios[name]))
            rows.append((label, name, np.median(times[name]) * 1e3, g, r))
            print(f"{label:24s} {name:6s} {np.median(times[name]) * 1e3:9.1f} ms {g:7.1f} GFLOP/s  "
                  f"ratio {r:5.2f}", flush=True)
        print()
    print("| shape | weights | ms | GFLOP/s | vs numpy fp32 |")
    print("|---|---|---:|---:|---:|")
    for label, name, ms, g, r in rows:
        print(f"| {label} | {'numpy fp32' if name == 'numpy' else name} | {ms:.1f} | {g:.1f} | {r:.2f} |")


if __name__ == "__main__":
    main()
