"""One SD1.5 512x512 sampling step with CFG with fp16, q8_0 and q4_0 weights (issue 5), sdrt
against itself (quantized / fp16) and against stable-diffusion.cpp's sd-cli on the same files.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_sd15_quant_step.py \\
        [--ckpt /work/e2e/sd15_rand_f16.safetensors] [--types q8_0,q4_0] [--repeat 3] \\
        [--sdcli [PATH]] [--profile]

The quantized files are made from --ckpt by `sdrt -M convert --type T` (next to it, as
<stem minus _f16>_<T>.gguf) when missing; as sd-cli's convert, only tensors whose rows are a
whole number of blocks change type, so the 3x3 convolutions stay F16 and the quantized types
land on the linear / attention / 1x1 projection weights (SD1.5: 440 of 1130 tensors).

The step is one UNet forward at a 64x64 latent with batch 2 (cond + uncond, 1.354 TFLOP). Each
weight type runs in its own child process (weights read through the same loader as the CLI:
sdrt.engine.model_manager.load_models), started and warmed up one after the other; then the
children are asked for one forward each in turn, --repeat rounds, so every type sees the same
machine noise. Printed: the median seconds per type, the median of the per-round ratios to fp16,
each child's peak RSS, and with --profile the time per (op, weight type) of one forward.
--sdcli runs `sd-cli --steps 1 -W 512 -H 512` once per file after the sdrt rounds and reads its
own "sampling completed, taking X s" line (one Euler step: cond + uncond forwards).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sd15_step import CKPT, SDCLI, STEP_TFLOP, sdcli_step  # noqa: E402  (one sd-cli runner)


def quant_path(ckpt: str, ty: str) -> str:
    stem = os.path.splitext(ckpt)[0]
    stem = stem.removesuffix("_f16")
    return f"{stem}_{ty}.gguf"


def ensure_quantized(ckpt: str, ty: str) -> str:
    out = quant_path(ckpt, ty)
    if not os.path.exists(out):
        print(f"converting {ckpt} -> {out} (sdrt -M convert --type {ty})", flush=True)
        subprocess.run([sys.executable, "-m", "sdrt", "-M", "convert", "-m", ckpt, "-o", out, "--type", ty],
                       check=True, cwd=ROOT)
    return out


def inputs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 64, 64), dtype=np.float32)
    t = np.array([999.0, 999.0], np.float32)
    ctx = rng.standard_normal((2, 77, 768), dtype=np.float32)
    return x, t, ctx


def _profiler():
    """Wrap the CPU kernel table so every kernel call adds its time under (op, first source's dtype)."""
    from sdrt.ops.cpu import CPU
    prof = collections.Counter()
    find = CPU.find

    def timed_find(node):
        k = find(node)
        if k is None:
            return None
        key = f"{node.op}[{node.src[0].dtype.name}]" if node.src else node.op
        fn = k.fn

        def run(n, xs, out):
            t0 = time.perf_counter()
            fn(n, xs, out)
            prof[key] += time.perf_counter() - t0
        return dataclasses.replace(k, fn=run)
    CPU.find = timed_find
    return prof


def worker(model_path: str, profile: bool) -> None:
    """Child: load the UNet as the CLI does, warm up, then time one forward per 'run' line."""
    from sdrt.engine.model_manager import DM, load_models
    from sdrt.engine.params import ModelParams
    from sdrt.models.diffusion.unet import UNetModel
    models = load_models(ModelParams(model=model_path))
    model = UNetModel(models.tensors, DM, source=model_path)
    x, t, ctx = inputs()
    t0 = time.perf_counter()
    o = model(x, t, ctx)
    print(f"warm {time.perf_counter() - t0:.3f}", flush=True)
    prof = _profiler() if profile else None
    for line in sys.stdin:
        if line.strip() != "run":
            break
        if prof is not None:
            prof.clear()
        t0 = time.perf_counter()
        o = model(x, t, ctx)
        print(f"time {time.perf_counter() - t0:.3f}", flush=True)
    assert np.isfinite(o).all()
    print(f"rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", flush=True)
    print(f"prof {json.dumps(dict(prof or {}))}", flush=True)


class Child:
    def __init__(self, label: str, path: str, profile: bool):
        self.label, self.path = label, path
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", path]
                                  + (["--profile"] if profile else []),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.times: list[float] = []

    def read(self, tag: str) -> str:
        line = self.p.stdout.readline()
        if not line.startswith(tag + " "):
            raise SystemExit(f"{self.label} worker: expected '{tag}', got {line!r} (exit {self.p.poll()})")
        return line.split(" ", 1)[1]

    def ask(self) -> float:
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        self.times.append(float(self.read("time")))
        return self.times[-1]

    def finish(self) -> tuple[int, dict]:
        self.p.stdin.write("end\n")
        self.p.stdin.flush()
        rss, prof = int(self.read("rss")), json.loads(self.read("prof"))
        self.p.wait()
        return rss, prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=CKPT, help="fp16 SD1.5 checkpoint (random weights are fine)")
    ap.add_argument("--types", default="q8_0,q4_0", help="quantized types to compare with fp16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sdcli", nargs="?", const=SDCLI, default=None, help="also time sd-cli --steps 1 on each file")
    ap.add_argument("--sdcli-f16", action="store_true", help="with --sdcli, time sd-cli on the fp16 file too")
    ap.add_argument("--profile", action="store_true", help="time per (op, weight type) of the last forward")
    ap.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.profile)
    threads = len(os.sched_getaffinity(0))
    files = [("f16", a.ckpt)] + [(ty, ensure_quantized(a.ckpt, ty)) for ty in a.types.split(",") if ty]
    print(f"SD1.5 512x512 step with CFG (UNet 64x64 latent, batch 2, {STEP_TFLOP} TFLOP), {threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    children = []
    for label, path in files:  # warm up one at a time: each warm-up runs alone
        c = Child(label, path, a.profile)
        print(f"  {label}: warm-up {float(c.read('warm')):.2f} s ({os.path.basename(path)})", flush=True)
        children.append(c)
    for i in range(a.repeat):
        msg = ", ".join(f"{c.label} {c.ask():.2f} s" for c in children)
        print(f"  round {i + 1}: {msg} (load {os.getloadavg()[0]:.1f})", flush=True)
    ends = [c.finish() for c in children]

    sd = {}
    if a.sdcli:
        for label, path in files:
            if label == "f16" and not a.sdcli_f16:
                continue
            sd[label] = sdcli_step(a.sdcli, path, threads)
            print(f"  sd-cli {label}: sampling {sd[label][0]:.2f} s (whole run {sd[label][1]:.1f} s), "
                  f"peak RSS {sd[label][2] / 1e9:.2f} GB (load {os.getloadavg()[0]:.1f})", flush=True)

    base = children[0].times
    print("\n| weights | sdrt s per step | GFLOP/s | / sdrt fp16 | sdrt peak RSS GB | sd-cli s | sdrt / sd-cli "
          "| sd-cli peak RSS GB |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for c, (rss, _) in zip(children, ends):
        s = statistics.median(c.times)
        r = statistics.median(u / v for u, v in zip(c.times, base))
        row = f"| {c.label} | {s:.2f} | {STEP_TFLOP * 1e3 / s:.0f} | {r:.2f} | {rss / 1e9:.2f} |"
        if c.label in sd:
            row += f" {sd[c.label][0]:.2f} | {s / sd[c.label][0]:.2f} | {sd[c.label][2] / 1e9:.2f} |"
        else:
            row += " | | |"
        print(row)
    print(f"load average at the end {os.getloadavg()[0]:.1f}; '/ sdrt fp16' is the median of per-round ratios")
    if a.profile:
        keys = sorted({k for _, p in ends for k in p}, key=lambda k: -max(p.get(k, 0) for _, p in ends))
        print("\nper (op, first source type), seconds in the last forward\n| op | "
              + " | ".join(c.label for c in children) + " |\n|---|" + "---:|" * len(children))
        for k in keys:
            vals = [p.get(k, 0.0) for _, p in ends]
            if max(vals) >= 0.05:
                print(f"| {k} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")


if __name__ == "__main__":
    main()
