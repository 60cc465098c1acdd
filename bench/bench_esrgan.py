"""ESRGAN x4 of a 512x512 image on an NVIDIA GPU (issue 16, done-means 5): sdrt (cuda0) against
PyTorch eager (CUDA, fp16 and fp32), the same RRDBNet (RealESRGAN_x4plus's shape: 23 blocks,
64 features, 32 growth channels; random weights), in one run.

    python bench/bench_esrgan.py [--size 512] [--blocks 23] [--runs 3] [--engines sdrt,torch]

* sdrt: sdrt.engine.upscaler.Upscaler on cuda0, the whole image at once (tile 0) and in sd-cli's
  default 128-pixel tiles; weights f32 and f16 (as a .pth of RealESRGAN holds f32, converted
  files f16); timed over --runs calls after one warm-up call, wall clock around the call (input
  upload and output download included, as a user sees it).
* torch: a plain-torch RRDBNet (BasicSR's architecture, written below: spandrel is not needed)
  with the same weights, eager, fp32 and fp16 (model and input .half()), torch.cuda.synchronize()
  around each call, --runs calls after one warm-up; the input upload and output download are
  included too.
Prints one table: seconds per image and sdrt's time over each PyTorch variant (< 1: sdrt faster).
Also checks that sdrt's f32 output is within 40 dB of torch's fp32 output.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def torch_rrdbnet(sd: dict, nb: int):
    """BasicSR's RRDBNet in plain torch, loaded with the BasicSR-named state dict `sd`."""
    import torch
    from torch import nn

    class RDB(nn.Module):
        def __init__(self, nf=64, gc=32):
            super().__init__()
            for k in range(1, 6):
                setattr(self, f"conv{k}", nn.Conv2d(nf + (k - 1) * gc, gc if k < 5 else nf, 3, 1, 1))
            self.lrelu = nn.LeakyReLU(0.2, inplace=True)

        def forward(self, x):
            x1 = self.lrelu(self.conv1(x))
            x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
            x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
            x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
            return self.conv5(torch.cat((x, x1, x2, x3, x4), 1)) * 0.2 + x

    class RRDB(nn.Module):
        def __init__(self, nf, gc):
            super().__init__()
            self.rdb1, self.rdb2, self.rdb3 = RDB(nf, gc), RDB(nf, gc), RDB(nf, gc)

        def forward(self, x):
            return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x

    class Net(nn.Module):
        def __init__(self, nf=64, gc=32):
            super().__init__()
            self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
            self.body = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
            self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
            self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
            self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
            self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
            self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
            self.lrelu = nn.LeakyReLU(0.2, inplace=True)

        def forward(self, x):
            feat = self.conv_first(x)
            feat = feat + self.conv_body(self.body(feat))
            up = nn.functional.interpolate
            feat = self.lrelu(self.conv_up1(up(feat, scale_factor=2, mode="nearest")))
            feat = self.lrelu(self.conv_up2(up(feat, scale_factor=2, mode="nearest")))
            return self.conv_last(self.lrelu(self.conv_hr(feat)))

    net = Net()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    return net.eval()


def time_calls(fn, runs: int) -> tuple[float, object]:
    out = fn()                 # warm-up (kernel loads, graph capture, cudnn autotune)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=23)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", default="sdrt,torch")
    args = ap.parse_args()
    from esrgan_weights import basicsr_state
    sd = basicsr_state(0, 64, 32, args.blocks, 4, last_bias=0.5)
    x = np.random.default_rng(0).random((1, 3, args.size, args.size), dtype=np.float32)
    engines = args.engines.split(",")
    rows, outs = {}, {}
    if "sdrt" in engines:
        import sdrt.gpu  # noqa: F401 - registers cuda0
        from sdrt.engine.upscaler import Upscaler
        from sdrt.gpu import cuda
        from sdrt.models.esrgan import RRDBNet
        from sdrt.ops.backend import as_weight
        from sdrt.ops.tensor import Tensor
        if not cuda.available():
            sys.exit(f"bench_esrgan: no CUDA device ({cuda.unavailable_reason()})")
        for wt in ("f32", "f16"):
            dt = np.float32 if wt == "f32" else np.float16
            # read-only, as Upscaler.load's converted weights (a GPU backend keeps them resident)
            net = RRDBNet({k: Tensor.from_numpy(as_weight(v.astype(dt)), name=k) for k, v in sd.items()})
            for tile in (0, 128):
                up = Upscaler(net, tile, "cuda0")
                t, y = time_calls(lambda: up.upscale_tensor(x), args.runs)
                rows[f"sdrt {wt} weights, tile {tile or 'none'}"] = t
                outs[f"sdrt {wt} {tile}"] = y
                print(f"sdrt {wt} tile {tile}: {t:.3f} s", flush=True)
            del net
    if "torch" in engines:
        import torch
        net = torch_rrdbnet(sd, args.blocks).cuda()
        torch.backends.cudnn.benchmark = True
        for prec in ("fp32", "fp16"):
            m = net.half() if prec == "fp16" else net.float()

            def call(m=m, prec=prec):
                with torch.no_grad():
                    xt = torch.from_numpy(x).cuda()
                    y = m(xt.half() if prec == "fp16" else xt)
                    torch.cuda.synchronize()
                    return y.float().cpu().numpy()
            t, y = time_calls(call, args.runs)
            rows[f"torch eager {prec}"] = t
            outs[f"torch {prec}"] = y
            print(f"torch {prec}: {t:.3f} s", flush=True)
    print(f"\nESRGAN x4, {args.size}x{args.size} -> {4 * args.size}x{4 * args.size}, {args.blocks} blocks")
    torch_rows = {k: v for k, v in rows.items() if k.startswith("torch")}
    print(f"{'engine':34s} {'s/image':>8s}  " + "  ".join(f"vs {k[12:]:>5s}" for k in torch_rows))
    for k, v in rows.items():
        ratios = "  ".join(f"{v / tv:8.2f}" for tv in torch_rows.values()) if k.startswith("sdrt") else ""
        print(f"{k:34s} {v:8.3f}  {ratios}")
    if "sdrt f32 0" in outs and "torch fp32" in outs:
        a, b = outs["sdrt f32 0"], outs["torch fp32"]
        mse = float(np.mean((a.astype(np.float64) - b) ** 2))
        peak = float(b.max() - b.min())
        print(f"sdrt f32 vs torch fp32: {10 * np.log10(peak * peak / max(mse, 1e-30)):.1f} dB")


if __name__ == "__main__":
    main()
