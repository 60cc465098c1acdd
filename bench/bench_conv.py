"""conv2d 3x3 (padding 1) at Stable Diffusion shapes: sdrt vs numpy im2col, and vs numpy's pure
GEMM of the same shape (the floor: an im2col conv can at best match the GEMM it feeds).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_conv.py [--repeat 5] [--quick]

Per shape, in one run and interleaved (so machine noise hits all three alike), median of
--repeat timings after one warm-up:
- sdrt:       F.conv2d(x, w, b, padding=1) through Graph(...).run("cpu") (F32 weights; the
              F16 column widens F16 weights inside the op, as SD checkpoints store them) —
              Winograd F(2x2, 3x3) where it applies (sdrt/ops/cpu/conv_winograd.py), im2col
              + GEMM elsewhere;
- sdrt im2col: the same F16 op with Winograd switched off (conv.WINOGRAD = False);
- numpy:      sliding_window_view im2col copy + np.matmul per batch item + bias;
- GEMM:       np.matmul(W2d[OC, 9C], cols[9C, OH*OW]) per batch item on ready columns.
GFLOP/s count 2*OC*9C*OH*OW*N multiply-adds for every column (the direct sum's: Winograd does
2.25x fewer, so its "GFLOP/s" can pass the GEMM's).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np

from sdrt.ops import api as F
import sdrt.ops.cpu.conv as cpu_conv
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

# name, N, C, H(=W), OC
SHAPES = [
    ("UNet 64x64x320", 2, 320, 64, 320),
    ("UNet 32x32x640", 2, 640, 32, 640),
    ("UNet 16x16x1280", 2, 1280, 16, 1280),
    ("UNet 8x8x1280", 2, 1280, 8, 1280),
    ("VAE 256x256x128", 1, 128, 256, 128),
    ("VAE 64x64x512", 1, 512, 64, 512),
    ("VAE 512x512x128", 1, 128, 512, 128),
]
UNET_STEP_TFLOP = 1.354  # DESIGN.md: SD1.5 512x512, one sampling step with CFG (2 UNet forwards)


def numpy_im2col_conv(x, w2, b):
    N, C, H, W = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    v = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # (N, C, H, W, 3, 3)
    out = np.empty((N, w2.shape[0], H * W), np.float32)
    for n in range(N):
        cols = v[n].transpose(0, 3, 4, 1, 2).reshape(C * 9, H * W)
        np.matmul(w2, cols, out=out[n])
    out += b[None, :, None]
    return out.reshape(N, -1, H, W)


def gemm_only(w2, cols, N, out):
    for n in range(N):
        np.matmul(w2, cols, out=out[n])


def timeit(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="first shape only, 2 repeats (smoke test)")
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    reps = 2 if args.quick else args.repeat
    rng = np.random.default_rng(0)
    print(f"conv2d 3x3 pad 1, median of {reps}; GFLOP/s (higher is better)")
    hdr = (f"{'shape':18} {'N':>2} {'GFLOP':>6} | {'sdrt F32':>8} {'sdrt F16':>8} {'im2col':>7} {'numpy':>7} {'GEMM':>7}"
           f" | {'F16/im2col':>10} {'sdrt/numpy':>10} {'sdrt/GEMM':>9}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for name, N, C, H, OC in shapes:
        x = rng.standard_normal((N, C, H, H), dtype=np.float32)
        w = (rng.standard_normal((OC, C, 3, 3), dtype=np.float32) / np.sqrt(9 * C)).astype(np.float32)
        b = rng.standard_normal(OC, dtype=np.float32)
        tx, tw, tb = Tensor.from_numpy(x), Tensor.from_numpy(w), Tensor.from_numpy(b)
        tw16 = Tensor.from_numpy(w.astype(np.float16))
        g32 = Graph(F.conv2d(tx, tw, tb, padding=1))
        g16 = Graph(F.conv2d(tx, tw16, tb, padding=1))
        w2 = w.reshape(OC, -1)
        cols = rng.standard_normal((9 * C, H * H), dtype=np.float32)
        gout = np.empty((N, OC, H * H), np.float32)
        flop = 2.0 * OC * 9 * C * H * H * N
        # warm-up (Numba compile / cache load) and a correctness check against numpy
        got = g32.run("cpu")["out"].numpy()
        ref = numpy_im2col_conv(x, w2, b)
        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
        assert err < 1e-4, f"{name}: sdrt conv2d differs from numpy im2col (rel err {err:.2e})"
        g16.run("cpu")
        def im2col(g=g16):
            cpu_conv.WINOGRAD = False
            try:
                g.run("cpu")
            finally:
                cpu_conv.WINOGRAD = True
        im2col()
        ts = {"s32": [], "s16": [], "i2c": [], "np": [], "gemm": []}
        fns = {"s32": lambda g=g32: g.run("cpu"), "s16": lambda g=g16: g.run("cpu"), "i2c": im2col,
               "np": lambda a=(x, w2, b): numpy_im2col_conv(*a),
               "gemm": lambda a=(w2, cols, N, gout): gemm_only(*a)}
        for _ in range(reps):
            for k, fn in fns.items():
                ts[k].append(timeit(fn))
        gf = {k: flop / np.median(v) / 1e9 for k, v in ts.items()}
        rows.append((name, N, flop, gf))
        print(f"{name:18} {N:>2} {flop / 1e9:6.1f} | {gf['s32']:8.1f} {gf['s16']:8.1f} {gf['i2c']:7.1f} {gf['np']:7.1f} "
              f"{gf['gemm']:7.1f} | {gf['s16'] / gf['i2c']:9.2f}x {gf['s32'] / gf['np']:9.2f}x {gf['s32'] / gf['gemm']:8.0%}")
    tot = sum(r[2] for r in rows)
    agg = {k: tot / sum(r[2] / r[3][k] for r in rows) for k in ("s32", "s16", "i2c", "np", "gemm")}
    print(f"{'all (time-weighted)':18} {'':>2} {tot / 1e9:6.1f} | {agg['s32']:8.1f} {agg['s16']:8.1f} {agg['i2c']:7.1f} "
          f"{agg['np']:7.1f} {agg['gemm']:7.1f} | {agg['s16'] / agg['i2c']:9.2f}x {agg['s32'] / agg['np']:9.2f}x "
          f"{agg['s32'] / agg['gemm']:8.0%}")
    print(f"SD1.5 UNet step ({UNET_STEP_TFLOP} TFLOP) at these rates: sdrt F16 {UNET_STEP_TFLOP * 1e3 / agg['s16']:.1f} s, "
          f"numpy GEMM {UNET_STEP_TFLOP * 1e3 / agg['gemm']:.1f} s; DESIGN.md floor 5.6 s at 240 GFLOP/s")


if __name__ == "__main__":
    main()
