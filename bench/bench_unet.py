"""One full-size SD1.5 UNet forward (64x64 latent, batch 2 = one CFG step) with random F16
weights of the real shapes, built in memory: sdrt, and optionally diffusers/PyTorch fp32.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_unet.py [--repeat 3] [--peer [fp32|bf16|both]]
        [--preset sd1|sd2|sdxl] [--size 64] [--f32] [--profile] [--backend cuda0]

Prints seconds per forward (median of --repeat after one warm-up), the planned peak of
intermediate memory, node count, and with --peer the same for diffusers' UNet2DConditionModel
(fp32, SD1.5 config, its own random init; torch threads = this process's CPUs) and the ratio.
--profile prints the time per op kind and the largest (op, shape) entries (SDRT_DEBUG=2 timing
through a logging handler; on a cudaN backend these are per-node GPU event times, eager runs).
DESIGN.md's reference: PyTorch fp32 takes 7.2 s for this step on the 2-core machine.
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np

from sdrt.models.diffusion.unet import PREFIX, UNetConfig, UNetModel
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

CTX = {"sd1": (77, 768), "sd2": (77, 1024), "sdxl": (77, 2048)}


def random_table(cfg: UNetConfig, dtype, seed=0):
    """Random weights of the config's real shapes: N(0, 1/fan_in), norms (1, 0), biases 0."""
    rng = np.random.default_rng(seed)
    table, n = {}, 0
    for name, shape in cfg.weight_shapes().items():
        if name.endswith("bias"):
            a = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            a = np.ones(shape, np.float32)
        else:
            a = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(np.prod(shape[1:])))
        table[PREFIX + name] = Tensor.from_numpy(a.astype(dtype))
        n += a.size
    return table, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--preset", default="sd1", choices=sorted(CTX))
    ap.add_argument("--size", type=int, default=64, help="latent H = W")
    ap.add_argument("--f32", action="store_true", help="F32 weights instead of F16")
    ap.add_argument("--peer", nargs="?", const="fp32", choices=["fp32", "bf16", "both"],
                    help="also time diffusers: fp32 (the default), bf16 (weights and activations in "
                         "bfloat16: PyTorch's fastest CPU setting where the CPU has AVX512_BF16/AMX) or both")
    ap.add_argument("--profile", action="store_true", help="time per op kind")
    ap.add_argument("--backend", default="cpu", help="cpu or cudaN (--profile then gives per-node GPU times)")
    args = ap.parse_args()

    cfg = UNetConfig.preset(args.preset)
    t0 = time.perf_counter()
    table, nparams = random_table(cfg, np.float32 if args.f32 else np.float16)
    model = UNetModel(table, config=cfg)
    print(f"{cfg.summary()}\n{nparams / 1e6:.1f} M params ({'F32' if args.f32 else 'F16'}), "
          f"built in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(1)
    N, S = 2, args.size
    L, C = CTX[args.preset]
    x = rng.standard_normal((N, 4, S, S), dtype=np.float32)
    t = np.array([999.0, 999.0], np.float32)
    ctx = rng.standard_normal((N, L, C), dtype=np.float32)
    y = rng.standard_normal((N, cfg.adm_in_channels), dtype=np.float32) if cfg.adm_in_channels else None

    t0 = time.perf_counter()
    out = model.forward(Tensor.from_numpy(x), Tensor.from_numpy(t), Tensor.from_numpy(ctx),
                        None if y is None else Tensor.from_numpy(y))
    g = F.Graph(out)
    plan = g.plan()
    print(f"graph: {len(g.nodes)} nodes, {len(plan.segments)} segments, planned peak "
          f"{plan.peak_bytes / 2**20:.0f} MiB (naive {plan.naive_bytes / 2**20:.0f} MiB), "
          f"built+planned in {time.perf_counter() - t0:.2f} s")

    if args.profile:
        prof, by_shape = collections.Counter(), collections.Counter()

        class H(logging.Handler):
            def emit(self, rec):
                if not rec.msg.startswith("%-16s"):
                    return
                op, ms = rec.args[0], rec.args[-1]
                prof[op] += ms / 1e3
                by_shape[(op, str(rec.args[2]))] += ms / 1e3
        lg = logging.getLogger("sdrt")  # sdrt.graph (CPU runner) and sdrt.cuda (per-node GPU times)
        lg.addHandler(H())
        lg.setLevel(logging.INFO)
        os.environ["SDRT_DEBUG"] = "2"

    peer = None
    peer16 = None
    if args.peer:  # built now so its runs interleave with sdrt's (same machine noise for both)
        if args.preset != "sd1":
            raise SystemExit("--peer builds the SD1.5 config only")
        import torch
        from diffusers import UNet2DConditionModel
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        unet = UNet2DConditionModel(cross_attention_dim=768).eval()
        xt, tt, ct = torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx)

        def peer():
            with torch.no_grad():
                return unet(xt, tt, encoder_hidden_states=ct).sample

        if args.peer in ("bf16", "both"):
            import copy
            unet16 = copy.deepcopy(unet).to(torch.bfloat16) if args.peer == "both" else unet.to(torch.bfloat16)
            xb, tb, cb = xt.to(torch.bfloat16), tt.to(torch.bfloat16), ct.to(torch.bfloat16)

            def peer16():
                with torch.no_grad():
                    return unet16(xb, tb, encoder_hidden_states=cb).sample
            if args.peer == "bf16":
                peer = None

    ts, tp, tb16 = [], [], []
    for i in range(args.repeat + 1):
        t0 = time.perf_counter()
        o = model(x, t, ctx, y, backend=args.backend)
        dt = time.perf_counter() - t0
        msg = f"  run {i}{' (warm-up)' if not i else ''}: sdrt {dt:.2f} s"
        if i:
            ts.append(dt)
        elif args.profile:  # the profile covers the timed runs only (no compiles, no uploads)
            prof.clear()
            by_shape.clear()
        if peer is not None:
            t0 = time.perf_counter()
            peer()
            dp = time.perf_counter() - t0
            msg += f", torch {dp:.2f} s"
            if i:
                tp.append(dp)
        if peer16 is not None:
            t0 = time.perf_counter()
            peer16()
            db = time.perf_counter() - t0
            msg += f", torch bf16 {db:.2f} s"
            if i:
                tb16.append(db)
        print(msg, flush=True)
    assert np.isfinite(o).all()
    med = statistics.median(ts)
    print(f"sdrt: {med:.2f} s per forward (batch {N}, {S}x{S}), load average {os.getloadavg()[0]:.1f}")
    if peer is not None:
        print(f"torch fp32: {statistics.median(tp):.2f} s per forward; sdrt / torch = "
              f"{statistics.median(a / b for a, b in zip(ts, tp)):.2f} (median of per-run ratios)")
    if tb16:
        print(f"torch bf16: {statistics.median(tb16):.2f} s per forward; sdrt / torch bf16 = "
              f"{statistics.median(a / b for a, b in zip(ts, tb16)):.2f} (median of per-run ratios)")
    if args.profile:
        os.environ["SDRT_DEBUG"] = "0"
        tot = sum(prof.values())
        for op, s in prof.most_common():
            print(f"  {op:20s} {s / args.repeat:7.3f} s  {100 * s / tot:5.1f}%")
        print("  largest (op, output ne):")
        for (op, ne), s in by_shape.most_common(15):
            print(f"  {op:20s} {ne:24s} {s / args.repeat:7.3f} s  {100 * s / tot:5.1f}%")

if __name__ == "__main__":
    main()
