"""CUDA attention: sdrt's flash kernel vs PyTorch SDPA (fp16) vs a cuBLAS QK^T-softmax-PV
reference built from rt.gemm, at SD1.5 / SDXL / Flux / VAE shapes (GPU only).

    python bench/bench_cuda_attention.py [--repeat 20] [--quick] [--f32]

Rows per shape, each timed with CUDA events (median of 3 runs of --repeat back-to-back calls
after a warm-up), ratio = time / torch SDPA time:
- torch sdpa f16:  torch.nn.functional.scaled_dot_product_attention on contiguous fp16
                   [N, H, L, D] (FlashAttention-2 / cuDNN inside torch): the peer;
- mma rR wW f16:   sdrt's attention kernel function on contiguous fp16 q/k/v, the sm_80+ flash
                   kernel (read in place, no staging) in its variant of 16*R rows per warp and
                   W warps per block (* marks the default, MMA_VARIANT);
- wgmma gGkKpP f16: on sm_90, the wgmma kernel with G warpgroups per block, K keys per tile,
                   P = 1 pipelined (S of the next tile with P V of this one) or 0 (one tile at a
                   time) (* marks the default, WGMMA_VARIANT);
- wmma rN f16:     the portable wmma flash kernel (the fallback), default rows per warp;
                   includes its three staging passes;
- flash f32 view:  the default flash path on F32 q/k/v permuted from [N, L, H, D] (what the
                   UNet graph hands it: packed to half first);
- pack f32 view:   those three packing passes alone;
- cublas f16:      the gemm path (S = QK^T, row softmax, O = PV, cuBLAS F16 tensor cores);
- cublas f32:      the same in pedantic FP32 (--f32; the precision="F32" path).
TFLOP/s count 4*N*H*Lq*Lk*D. "err" compares the row's output with torch's (max abs difference
over torch's max abs output). Random unit-normal inputs.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _cuda_timing import CudaDev, torch_time_ms

from sdrt.gpu.cuda.ops import attention as GA
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

# name, N, H, Lq, Lk, D
SHAPES = [
    ("SD1.5 self 64x64", 2, 8, 4096, 4096, 40),
    ("SD1.5 cross 64x64", 2, 8, 4096, 77, 40),
    ("SD1.5 self 32x32", 2, 8, 1024, 1024, 80),
    ("SD1.5 self 16x16", 2, 8, 256, 256, 160),
    ("SDXL self 64x64 (1024px)", 2, 10, 4096, 4096, 64),
    ("SDXL self 32x32 (1024px)", 2, 20, 1024, 1024, 64),
    ("SDXL cross 32x32", 2, 20, 1024, 77, 64),
    ("Flux 1024px (4096+512 tok)", 1, 24, 4608, 4608, 128),
    ("SD3.5 Large 1024px CFG (4096+333 tok)", 2, 38, 4429, 4429, 64),   # head dim 64 at DiT lengths
    ("VAE mid-block 64x64", 1, 1, 4096, 4096, 512),
]
QUICK = {"SD1.5 self 64x64", "SDXL self 64x64 (1024px)", "SDXL self 32x32 (1024px)"}


def torch_sdpa(q, k, v, repeat):
    """(ms, output as float32 numpy [N, H, Lq, D]) or (None, None) without torch/CUDA."""
    try:
        import torch
        import torch.nn.functional as tF
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    tq, tk, tv = (torch.from_numpy(a).cuda() for a in (q, k, v))
    ms = torch_time_ms(lambda: tF.scaled_dot_product_attention(tq, tk, tv), repeat)
    return ms, tF.scaled_dot_product_attention(tq, tk, tv).float().cpu().numpy()


def kernel_call(d: CudaDev, node, force: str | None = None, variant=None):
    """A closure running the attention kernel function as the backend would, with the path
    forced (FORCE_PATH) and, for "flash", the kernel chosen (variant ("mma", rf, nw) or
    ("wgmma", warpgroups, keys per tile)); and the output DevTensor."""
    from sdrt.gpu.cuda.table import CUDA
    k = CUDA.find(node)
    xs = [d.put(s) for s in node.src]
    out = d.out(node)
    dp = GA.flash_dim(node.src[0].ne4[0], node.src[2].ne4[0])

    def call():
        saved = GA.FORCE_PATH, GA.USE_WGMMA, dict(GA.MMA_VARIANT), dict(GA.WGMMA_VARIANT)
        GA.FORCE_PATH = force
        if variant is not None:
            GA.USE_WGMMA = variant[0] == "wgmma"
            (GA.WGMMA_VARIANT if GA.USE_WGMMA else GA.MMA_VARIANT)[dp] = tuple(variant[1:])
        try:
            d.rt.begin_kernel()
            k.fn(node, xs, out, d.rt)
        finally:
            GA.FORCE_PATH, GA.USE_WGMMA = saved[:2]
            for table, was in ((GA.MMA_VARIANT, saved[2]), (GA.WGMMA_VARIANT, saved[3])):
                table.clear()               # a head dim the variant added goes again
                table.update(was)
    return call, xs, out


def bench_shape(d: CudaDev, args, rng, name: str, N: int, H: int, Lq: int, Lk: int, D: int) -> None:
    flop = 4.0 * N * H * Lq * Lk * D
    q16, k16, v16 = (rng.standard_normal((N, H, L, D)).astype(np.float16) for L in (Lq, Lk, Lk))
    base, ref = torch_sdpa(q16, k16, v16, args.repeat)

    def row(path, ms, out=None):
        ratio = f"{ms / base:6.2f}" if base else "     -"
        err = "       -"
        if out is not None and ref is not None:
            got = d.fetch(out, (N, H, Lq, D))
            err = f"{np.abs(got - ref).max() / np.abs(ref).max():8.1e}"
        print(f"{name:28s} {path:16s} {ms:9.4f} {flop / ms / 1e9:8.1f} {ratio} {err}", flush=True)

    if base is not None:
        row("torch sdpa f16", base)
    node16 = F.attention(*(Tensor.from_numpy(a) for a in (q16, k16, v16)))
    dp = GA.flash_dim(D, D)
    if dp is not None:
        sm90 = tuple(d.rt.device.capability) == (9, 0)
        for rf, nw in sorted((r, w) for dd, r, w in GA.MMA_KERNELS if dd == dp):
            call, xs, out = kernel_call(d, node16, "flash", ("mma", rf, nw))
            mark = "*" if GA.MMA_VARIANT[dp] == (rf, nw) and not (sm90 and dp in GA.WGMMA_VARIANT) else " "
            row(f"mma r{rf}w{nw}{mark} f16", d.time_ms(call, args.repeat), out)
        for g, bk, pipe in sorted((g, k, p) for dd, g, k, p in GA.WGMMA_KERNELS if dd == dp and sm90):
            call, xs, out = kernel_call(d, node16, "flash", ("wgmma", g, bk, pipe))
            mark = "*" if GA.WGMMA_VARIANT.get(dp) == (g, bk, pipe) else " "
            row(f"wgmma g{g}k{bk}p{pipe}{mark} f16", d.time_ms(call, args.repeat), out)
        call, xs, out = kernel_call(d, node16, "wmma")
        row(f"wmma r{GA.FLASH_RF[dp]} f16", d.time_ms(call, args.repeat), out)
        # the same inputs in F32, as permuted views of [N, L, H, D] (the UNet's layout)
        views = [Tensor.from_numpy(np.ascontiguousarray(a.astype(np.float32).transpose(0, 2, 1, 3))).permute(0, 2, 1, 3)
                 for a in (q16, k16, v16)]
        call, xs, out = kernel_call(d, F.attention(*views), "flash")
        row("flash f32 view", d.time_ms(call, args.repeat), out)

        def pack_only():
            d.rt.begin_kernel()
            for t in xs[:3]:
                GA._pack(d.rt, t, 1.0)
        row("pack f32 view", d.time_ms(pack_only, args.repeat))
    call, _, out = kernel_call(d, node16, "gemm16")
    row("cublas f16", d.time_ms(call, args.repeat), out)
    if args.f32:
        call, _, out = kernel_call(d, node16, "gemm32")
        row("cublas f32", d.time_ms(call, max(1, args.repeat // 4)), out)
    d.free_all()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="SD1.5 and SDXL self-attention only")
    ap.add_argument("--f32", action="store_true", help="also time the pedantic FP32 gemm path")
    args = ap.parse_args()
    d = CudaDev("bench_cuda_attention")
    rng = np.random.default_rng(0)
    print(f"device: {d.be!r}")
    print(f"{'shape':28s} {'path':16s} {'ms':>9s} {'TFLOP/s':>8s} {'ratio':>6s} {'err':>8s}")
    for name, N, H, Lq, Lk, D in SHAPES:
        if not args.quick or name in QUICK:
            bench_shape(d, args, rng, name, N, H, Lq, Lk, D)


if __name__ == "__main__":
    main()
