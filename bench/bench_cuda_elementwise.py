"""sdrt's memory-bound CUDA kernels at SDXL's shapes vs PyTorch's for the same op, by bandwidth.

    python bench/bench_cuda_elementwise.py [--repeat 50]

Each sdrt kernel is called through the backend's kernel table on device buffers, `repeat` calls
captured into one CUDA graph and replayed (so no Python launch cost is timed), CUDA-event
medians. PyTorch runs the same op on the same shapes, F32 like sdrt's activations, eagerly (its
kernels here are longer than its launch cost). GB/s counts the bytes each op must read and write
once; the H200 copies at about 4.3 TB/s (KINDS.md).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sdrt  # noqa: E402,F401  before numpy (sdrt/__init__.py sets OpenBLAS's thread spin)

import numpy as np  # noqa: E402
from _cuda_timing import CudaDev, torch_time_ms  # noqa: E402

from sdrt.ops import api as F  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402


def leaf(shape, dtype="F32", seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    t = Tensor.from_numpy(x)
    return t if dtype == "F32" else F.Graph(F.cast(t, dtype)).run("cpu")["out"]


def cases():
    """(name, sdrt node, torch fn of the numpy inputs, bytes moved)."""
    a, b = leaf((2048, 1280)), leaf((2048, 1280), seed=1)
    bias = leaf((10240,), "F16")
    h = leaf((2048, 10240))
    hw = leaf((2, 320, 128, 128))
    att = leaf((2, 10, 4096, 64))  # [D, L, H, N] in ggml order: the attention output
    mb = 2**20

    def t(x):
        import torch
        return torch.from_numpy(np.asarray(x.numpy(), np.float32)).cuda()

    def geglu_torch(x):
        import torch.nn.functional as tF
        return x[:, :5120] * tF.gelu(x[:, 5120:], approximate="tanh")

    def gn(x):
        import torch.nn.functional as tF
        return tF.group_norm(x, 32, eps=1e-6)

    def ln(x):
        import torch.nn.functional as tF
        return tF.layer_norm(x, (1280,), eps=1e-5)

    return [
        ("add 2048x1280 (residual, flat)", F.add(a, b), lambda: (t(a), t(b)), lambda x, y: x + y, 3 * 10 * mb),
        ("add 2048x10240 + bias[10240] F16 (rows)", F.add(h, bias), lambda: (t(h), t(bias).half()),
         lambda x, y: x + y, 2 * 80 * mb),
        ("geglu tanh 2048x10240 -> 2048x5120", F.geglu(h, approximate="tanh"), lambda: (t(h),),
         geglu_torch, 120 * mb),
        ("gelu_tanh on a half-row view", F.gelu(h.slice(0, 5120), "tanh"), lambda: (t(h)[:, 5120:],),
         lambda x: __import__("torch").nn.functional.gelu(x, approximate="tanh"), 80 * mb),
        ("cast F32->F16 2048x1280", F.cast(a, "F16"), lambda: (t(a),), lambda x: x.half(), 15 * mb),
        ("layer_norm 2048x1280", F.layer_norm(a), lambda: (t(a),), ln, 20 * mb),
        ("group_norm 32 of 2x320x128x128", F.group_norm(hw, 32), lambda: (t(hw),), gn, 80 * mb),
        ("silu 2x320x128x128", F.silu(hw), lambda: (t(hw),),
         lambda x: __import__("torch").nn.functional.silu(x), 80 * mb),
        ("cont of the attention output permute", F.cont(att.permute(0, 2, 1, 3)), lambda: (t(att),),
         lambda x: x.permute(0, 2, 1, 3).contiguous(), 40 * mb),
    ]


def time_sdrt(dev, node, repeat):
    from sdrt.gpu.cuda import cudagraph
    from sdrt.gpu.cuda.table import CUDA
    fn = CUDA.find(node).fn
    xs = [dev.put(s) for s in node.src]
    out = dev.out(node)

    def one():
        dev.rt.begin_kernel()
        fn(node, xs, out, dev.rt)
    one()  # sizes rt.scratch
    dev.mem.synchronize()
    g = cudagraph.capture(dev.be.device, dev.rt.stream, lambda: [one() for _ in range(repeat)])
    ms = dev.time_ms(lambda: g.launch(dev.rt.stream), 1) / repeat
    g.destroy()
    dev.free_all()
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=50)
    a = ap.parse_args()
    try:
        import torch
        torch.zeros(1, device="cuda")  # torch's context first: the primary context sdrt then shares
    except Exception:  # noqa: BLE001  (no torch: sdrt's column only)
        torch = None
    dev = CudaDev("bench_cuda_elementwise.py")
    print("| op (SDXL shape, F32) | MB moved | sdrt us | sdrt GB/s | torch us | torch GB/s | sdrt / torch time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, node, make, fn, nbytes in cases():
        us = time_sdrt(dev, node, a.repeat) * 1e3
        args = make() if torch is not None else None
        tus = torch_time_ms(lambda: fn(*args), a.repeat) * 1e3 if torch is not None else float("nan")
        print(f"| {name} | {nbytes / 2**20:.0f} | {us:.1f} | {nbytes / us / 1e3:.0f} | {tus:.1f} | "
              f"{nbytes / tus / 1e3:.0f} | {us / tus:.2f} |", flush=True)


if __name__ == "__main__":
    main()
