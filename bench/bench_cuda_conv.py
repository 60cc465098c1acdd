"""CUDA 3x3 conv (stride 1, padding 1, F16 weights, F32 activations): sdrt's direct conv
(conv3x3_mma) and its im2col + cuBLAS path vs PyTorch's cuDNN fp16 conv, one run (GPU only).

    python bench/bench_cuda_conv.py [--repeat 20] [--no-torch] [--variants]

Per shape, all on the device, timed with CUDA events over --repeat back-to-back calls after a
warm-up (median of 3 such runs): sdrt's conv2d kernel function (bias included), and
sdrt's paths (the direct conv on every shape, also with F16 input and output
as fuse.py's F16 storage gives it, im2col + cuBLAS, and Winograd F(2x2, 3x3) with its GEMMs
writing F32 and F16), and
torch.nn.functional.conv2d in fp16
(channels-first input, cudnn.benchmark on) — the conv a PyTorch fp16 model runs. TFLOP/s count
2*N*OC*9C*H*W. Random values; the times do not depend on them. --variants adds a line per shape
with every conv3x3_mma variant (ops/conv.C3_VARIANTS) on F16 input and output.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _cuda_timing import CudaDev, torch_time_ms  # noqa: E402

from sdrt.ops import api as F  # noqa: E402
from sdrt.ops import dtypes  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402

# name, N, C, H(=W), OC
SHAPES = [
    ("ESRGAN RDB conv1 512x512 64->32", 1, 64, 512, 32),
    ("ESRGAN RDB conv4 512x512 160->32", 1, 160, 512, 32),
    ("ESRGAN RDB conv5 512x512 192->64", 1, 192, 512, 64),
    ("ESRGAN up 2048x2048 64->64", 1, 64, 2048, 64),
    ("ESRGAN conv_last 2048x2048 64->3", 1, 64, 2048, 3),
    ("UNet 64x64x320 (batch 2)", 2, 320, 64, 320),
    ("UNet 32x32x640 (batch 2)", 2, 640, 32, 640),
    ("UNet 16x16x1280 (batch 2)", 2, 1280, 16, 1280),
    ("VAE 64x64x512", 1, 512, 64, 512),
    ("VAE 128x128x512", 1, 512, 128, 512),
    ("VAE 256x256x256", 1, 256, 256, 256),
    ("VAE 256x256 512->512 (upsample conv)", 1, 512, 256, 512),
    ("VAE 256x256 512->256", 1, 512, 256, 256),
    ("VAE 512x512 256->256 (upsample conv)", 1, 256, 512, 256),
    ("VAE 512x512 256->128", 1, 256, 512, 128),
    ("VAE 512x512x128", 1, 128, 512, 128),
    ("VAE 1024x1024x128 (SDXL)", 1, 128, 1024, 128),
    ("VAE conv_out 512x512 128->3", 1, 128, 512, 3),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--variants", action="store_true", help="time every conv3x3_mma variant too")
    args = ap.parse_args()
    import sdrt.gpu.cuda.ops.conv as G  # registers the conv kernels
    from sdrt.gpu.cuda.table import CUDA
    d = CudaDev("bench_cuda_conv")
    rng = np.random.default_rng(0)
    pixels0, max_oc0, wino0 = G.DIRECT_3X3_PIXELS, G.DIRECT_3X3_MAX_OC, (G.WINOGRAD, G.WINOGRAD_M, G.WINOGRAD_MIN_TILES)
    print(f"{'shape':36s} {'direct ms':>9s} {'f16 io ms':>9s} {'im2col ms':>9s} {'wino ms':>9s} {'wino16 ms':>9s} "
          f"{'torch ms':>9s} {'direct TFLOP/s':>14s} {'direct/torch':>12s} {'im2col/torch':>12s} {'wino/torch':>10s}")
    for name, N, C, HW, OC in SHAPES:
        flop = 2.0 * N * OC * 9 * C * HW * HW
        x = Tensor.from_numpy(rng.standard_normal((N, C, HW, HW), np.float32))
        w = Tensor.from_numpy((rng.standard_normal((OC, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float16))
        b = Tensor.from_numpy(rng.standard_normal(OC).astype(np.float16))
        node = F.conv2d(x, w, b, padding=1)
        k = CUDA.find(node)
        xs, out = [d.put(s) for s in node.src], d.out(Tensor(node.dtype, node.ne))

        def call():
            d.rt.begin_kernel()
            k.fn(node, xs, out, d.rt)
        ts = {}
        G.WINOGRAD = False
        for key, pixels in (("direct", 1), ("im2col", 0)):
            G.DIRECT_3X3_PIXELS, G.DIRECT_3X3_MAX_OC = pixels, 1 << 30
            ts[key] = d.time_ms(call, args.repeat)
        G.WINOGRAD, G.DIRECT_3X3_PIXELS, G.WINOGRAD_MIN_TILES = True, 0, 0   # Winograd, M in F32 and F16
        for m in ("F32", "F16"):
            G.WINOGRAD_M = m
            ts["wino" + m] = d.time_ms(call, args.repeat)
        G.WINOGRAD, G.WINOGRAD_M, G.WINOGRAD_MIN_TILES = wino0
        # the direct conv on an F16-stored input writing F16 (fuse.py's half storage)
        G.DIRECT_3X3_PIXELS = 1
        xs16 = [d.put(Tensor.from_numpy(x.numpy().astype(np.float16))), *xs[1:]]
        out16 = d.out(Tensor(dtypes.get("F16"), node.ne))

        def call16():
            d.rt.begin_kernel()
            k.fn(node, xs16, out16, d.rt)
        ts["f16"] = d.time_ms(call16, args.repeat)
        per_variant = {}
        for v in G.C3_VARIANTS if args.variants else ():
            G.DIRECT_3X3_VARIANT = v
            per_variant[v] = d.time_ms(call16, args.repeat)
        G.DIRECT_3X3_VARIANT = None
        G.DIRECT_3X3_PIXELS, G.DIRECT_3X3_MAX_OC = pixels0, max_oc0
        tt = float("nan")
        if not args.no_torch:
            import torch
            torch.backends.cudnn.benchmark = True
            xt = torch.randn(N, C, HW, HW, device="cuda", dtype=torch.half)
            wt = torch.randn(OC, C, 3, 3, device="cuda", dtype=torch.half)
            bt = torch.randn(OC, device="cuda", dtype=torch.half)
            with torch.no_grad():
                tt = torch_time_ms(lambda: torch.nn.functional.conv2d(xt, wt, bt, padding=1), args.repeat)
            del xt, wt, bt
        print(f"{name:36s} {ts['direct']:9.3f} {ts['f16']:9.3f} {ts['im2col']:9.3f} {ts['winoF32']:9.3f} "
              f"{ts['winoF16']:9.3f} {tt:9.3f} {flop / ts['direct'] / 1e9:14.1f} {ts['direct'] / tt:12.2f} "
              f"{ts['im2col'] / tt:12.2f} {min(ts['winoF32'], ts['winoF16']) / tt:10.2f}", flush=True)
        if per_variant:
            print("    f16 io: " + "  ".join(f"{v} {ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s)"
                                           for v, ms in per_variant.items()), flush=True)
        d.free_all()


if __name__ == "__main__":
    main()
