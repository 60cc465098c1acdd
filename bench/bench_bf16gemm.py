"""The bf16 GEMM (sdrt/ops/cpu/_bf16gemm.h) on SD1.5's shapes: sdrt's kernel with F16 weights vs
numpy/OpenBLAS float32 (the exact path: weights widened once, outside the timing) and, when
installed, PyTorch's bf16 and fp32 matmul, interleaved in one process (same machine noise).

    python bench/bench_bf16gemm.py [--repeat 5] [--threads 2]

Shapes (M activation rows x K -> N outputs, batch 2 = one CFG step): the UNet's linear layers at
the 64x64 / 32x32 / 16x16 levels and the im2col GEMMs of its 3x3 convs (OC x 9C . 9C x positions).
Best of --repeat; GFLOP/s = 2MNK / time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np  # noqa: E402

from sdrt.ops.cpu import bf16gemm as bg  # noqa: E402
from sdrt.ops.threads import set_threads  # noqa: E402

# (label, M, K, N): x[M, K] . W[N, K]^T
SHAPES = [
    ("proj/attn 64x64 (320)", 8192, 320, 320),
    ("ff1 64x64 (geglu)", 8192, 320, 2560),
    ("ff2 64x64", 8192, 1280, 320),
    ("attn 32x32 (640)", 2048, 640, 640),
    ("ff1 32x32", 2048, 640, 5120),
    ("attn 16x16 (1280)", 512, 1280, 1280),
    ("ff1 16x16", 512, 1280, 10240),
    ("conv3x3 320 64x64 (im2col)", 8192, 2880, 320),
    ("conv3x3 1280 16x16 (im2col)", 512, 11520, 1280),
]


def best(fn, n):
    fn()
    t = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    path = bg.active_path() or "scalar"
    try:
        import torch
        torch.set_num_threads(a.threads)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print(f"{a.threads} threads, sdrt path {path}, load average {os.getloadavg()[0]:.1f}")
    print("| GEMM | M x K -> N | sdrt bf16 GFLOP/s | numpy f32 | torch bf16 | torch fp32 | sdrt / numpy | sdrt / torch bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, m, k, n in SHAPES:
        x = rng.standard_normal((m, k), dtype=np.float32)
        w16 = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float16)
        wf = w16.astype(np.float32)
        out = np.empty((m, n), np.float32)
        gf = 2 * m * n * k / 1e9
        ts = best(lambda: bg.gemm(x, "F32", w16.view(np.uint16).T, "F16", out, path, a.threads), a.repeat)
        tn = best(lambda: np.matmul(x, wf.T, out=out), a.repeat)
        tb = tf = float("nan")
        if torch is not None:
            xt, wt = torch.from_numpy(x), torch.from_numpy(wf)
            xb, wb = xt.bfloat16(), wt.bfloat16()
            with torch.no_grad():
                tb = best(lambda: xb @ wb.T, a.repeat)
                tf = best(lambda: xt @ wt.T, a.repeat)
        print(f"| {label} | {m} x {k} -> {n} | {gf / ts:.0f} | {gf / tn:.0f} | {gf / tb:.0f} | {gf / tf:.0f} "
              f"| {tn / ts:.2f}x | {tb / ts:.2f}x |", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
