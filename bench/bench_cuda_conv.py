"""CUDA 3x3 conv (stride 1, padding 1, F16 weights, F32 activations): sdrt's im2col + cuBLAS path
vs PyTorch's cuDNN fp16 conv, one run (GPU only).

    python bench/bench_cuda_conv.py [--repeat 20] [--no-torch]

Per shape, all on the device, timed with CUDA events over --repeat back-to-back calls after a
warm-up (median of 3 such runs): sdrt's conv2d kernel function (bias included), and
torch.nn.functional.conv2d in fp16
(channels-first input, cudnn.benchmark on) — the conv a PyTorch fp16 model runs. TFLOP/s count
2*N*OC*9C*H*W. Random values; the times do not depend on them.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _cuda_timing import CudaDev, torch_time_ms  # noqa: E402

from sdrt.ops import api as F  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402

# name, N, C, H(=W), OC
SHAPES = [
    ("ESRGAN RDB conv1 512x512 64->32", 1, 64, 512, 32),
    ("ESRGAN RDB conv4 512x512 160->32", 1, 160, 512, 32),
    ("ESRGAN RDB conv5 512x512 192->64", 1, 192, 512, 64),
    ("ESRGAN up 2048x2048 64->64", 1, 64, 2048, 64),
    ("UNet 64x64x320 (batch 2)", 2, 320, 64, 320),
    ("UNet 32x32x640 (batch 2)", 2, 640, 32, 640),
    ("UNet 16x16x1280 (batch 2)", 2, 1280, 16, 1280),
    ("VAE 64x64x512", 1, 512, 64, 512),
    ("VAE 256x256x256", 1, 256, 256, 256),
    ("VAE 512x512x128", 1, 128, 512, 128),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    import sdrt.gpu.cuda.ops.conv  # noqa: F401  registers the conv kernels
    from sdrt.gpu.cuda.table import CUDA
    d = CudaDev("bench_cuda_conv")
    rng = np.random.default_rng(0)
    print(f"{'shape':36s} {'sdrt ms':>9s} {'torch ms':>9s} {'sdrt TFLOP/s':>12s} {'sdrt/torch':>10s}")
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
        ts = d.time_ms(call, args.repeat)
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
        print(f"{name:36s} {ts:9.3f} {tt:9.3f} {flop / ts / 1e9:12.1f} {ts / tt:10.2f}", flush=True)
        d.free_all()


if __name__ == "__main__":
    main()
