"""CUDA GEMM: sdrt mul_mat with Q8_0/Q4_K/Q4_0 weights vs F16 cuBLAS on the same shape (GPU only).

    python bench/bench_cuda_matmul.py [--repeat 20] [--types Q8_0,Q4_K,Q4_0] [--quick]

Per shape (weight M x K, N activation columns), all on the device, timed with CUDA events over
--repeat back-to-back calls after a warm-up (median of 3 such runs):
- f16 cublas: rt.gemm on an F16 weight and F16 activations, F32 out (the peer; the issue's target
  is <= 1.5x its time for Q8_0 and Q4_K);
- <type> x16:  sdrt's CUDA mul_mat kernel function on a <type> weight and F16 activations (what it
  runs: mmv for N <= 16, else dequantize to F16 in scratch + the same cuBLAS GEMM);
- <type> x32:  the same with F32 activations (adds their cast to F16);
- dequant:     the dequantize-to-F16 pass alone (the part of x16 that the F16 GEMM does not have).
TFLOP/s count 2*M*N*K; "ratio" is time / f16-cublas time. Random weights (random_raw blocks),
random activations; the numbers do not depend on the values.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _cuda_timing import CudaDev

from sdrt.ops import api as F
from sdrt.ops import quant
from sdrt.ops.tensor import Tensor

# name, M (weight rows = out features), K (in features), N (activation columns = tokens)
SHAPES = [
    ("issue: 3072x3072, N=8192", 3072, 3072, 8192),
    ("issue: 1280->5120, N=4096", 5120, 1280, 4096),
    ("SDXL attn 1280x1280, 2x1024 tok", 1280, 1280, 2048),
    ("SDXL ff 1280->10240, 2x1024 tok", 10240, 1280, 2048),
    ("SDXL ff 5120->1280, 2x1024 tok", 1280, 5120, 2048),
    ("SDXL 640x640, 2x4096 tok", 640, 640, 8192),
    ("Flux qkv 3072->9216, 4096 tok", 9216, 3072, 4096),
    ("Flux mlp 3072->12288, 4096 tok", 12288, 3072, 4096),
    ("Flux mlp 12288->3072, 4096 tok", 3072, 12288, 4096),
    ("Flux mod 3072->18432, N=1", 18432, 3072, 1),
    ("Flux mod 3072->18432, N=2", 18432, 3072, 2),
    ("text enc 4096x4096, N=8", 4096, 4096, 8),
]
QUICK = {"issue: 3072x3072, N=8192", "issue: 1280->5120, N=4096", "Flux mod 3072->18432, N=1"}


def kernel_call(d: CudaDev, node):
    """A closure that runs the CUDA kernel function of `node` (as the backend does)."""
    import sdrt.gpu.cuda.ops.matmul  # noqa: F401
    from sdrt.gpu.cuda.table import CUDA
    k = CUDA.find(node)
    xs = [d.put(s) for s in node.src]
    out = d.out(Tensor(node.dtype, node.ne))

    def call():
        d.rt.begin_kernel()
        k.fn(node, xs, out, d.rt)
    return call, xs


def f16_tensor(rng, shape) -> Tensor:
    return Tensor.from_numpy(rng.standard_normal(shape).astype(np.float16))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--types", default="Q8_0,Q4_K,Q4_0")
    ap.add_argument("--quick", action="store_true", help="the issue's two shapes and one mat-vec only")
    args = ap.parse_args()
    d = CudaDev("bench_cuda_matmul")
    rng = np.random.default_rng(0)
    print(f"device: {d.be!r}")
    print(f"{'shape':34s} {'path':14s} {'ms':>9s} {'TFLOP/s':>8s} {'ratio':>6s}")
    for name, M, K, N in SHAPES:
        if args.quick and name not in QUICK:
            continue
        flop = 2.0 * M * N * K
        xh, x32 = f16_tensor(rng, (N, K)), Tensor.from_numpy(rng.standard_normal((N, K)).astype(np.float32))
        wh = f16_tensor(rng, (M, K))
        dw, dx, c = d.put(wh), d.put(xh), d.out(F.mul_mat(wh, xh))

        def cublas():
            d.rt.gemm(True, False, M, N, K, dw.ptr, "F16", K, dx.ptr, "F16", K, c.ptr, M, c_dtype="F32")
        t16 = d.time_ms(cublas, args.repeat)

        def row(path, ms):
            print(f"{name:34s} {path:14s} {ms:9.4f} {flop / ms / 1e9:8.1f} {ms / t16:6.2f}", flush=True)
        row("f16 cublas", t16)
        for wt in args.types.split(","):
            w = Tensor.from_numpy(quant.random_raw(wt, M, K, seed=1), dtype=wt)
            call16, xs = kernel_call(d, F.mul_mat(w, xh))
            row(f"{wt} x16", d.time_ms(call16, args.repeat))
            call32, _ = kernel_call(d, F.mul_mat(w, x32))
            row(f"{wt} x32", d.time_ms(call32, args.repeat))
            from sdrt.gpu.cuda.quant import weight_as
            wdev = xs[0]

            def dequant():
                d.rt.begin_kernel()
                weight_as(d.rt, wdev, "F16")
            row(f"{wt} dequant", d.time_ms(dequant, args.repeat))
        d.free_all()


if __name__ == "__main__":
    main()
