"""One SD1.5 512x512 sampling step with CFG (issue 5): sdrt vs diffusers/PyTorch fp32, and
optionally stable-diffusion.cpp's sd-cli, in one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_sd15_step.py \\
        [--ckpt /work/e2e/sd15_rand_f16.safetensors] [--repeat 3] [--sdcli PATH]

The step is one UNet forward at a 64x64 latent with batch 2 (cond + uncond, 1.354 TFLOP).
sdrt runs the fp16 checkpoint (a full-size random SD1.5 file from tools/make_sd_checkpoint.py;
without one, random fp16 weights of the real shapes built in memory as bench_unet.py does) in a
child process, so its peak RSS (ru_maxrss: the memory-mapped weights it touched + everything
else) is its own; the parent holds diffusers' UNet2DConditionModel (SD1.5 config, fp32, its own
random init, torch threads = this process's CPUs). After one warm-up call each, the two are
timed in turn --repeat times (same machine noise for both); medians and the median of the
per-repeat ratios are printed. --sdcli runs `sd-cli --steps 1` at 512x512 on the same file once
first and reads its own "sampling completed, taking X s" line (model load, text encoding and VAE
decode are outside that figure); sd-cli's peak RSS covers its whole run (all three models).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

STEP_TFLOP = 1.354
CKPT = "/work/e2e/sd15_rand_f16.safetensors"
SDCLI = "/work/sdcpp/stable_diffusion_cpp_python-0.4.7/vendor/stable-diffusion.cpp/build/bin/sd-cli"


def inputs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 64, 64), dtype=np.float32)
    t = np.array([999.0, 999.0], np.float32)
    ctx = rng.standard_normal((2, 77, 768), dtype=np.float32)
    return x, t, ctx


def worker(ckpt: str) -> None:
    """Child: build the UNet, warm up, then time one forward per 'run' line on stdin."""
    from sdrt.models.diffusion.unet import UNetConfig, UNetModel
    if ckpt and os.path.exists(ckpt):
        from sdrt.io import open_model
        model = UNetModel(open_model(ckpt).tensors)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_unet import random_table
        cfg = UNetConfig.preset("sd1")
        model = UNetModel(random_table(cfg, np.float16)[0], config=cfg)
    x, t, ctx = inputs()
    t0 = time.perf_counter()
    o = model(x, t, ctx)
    print(f"warm {time.perf_counter() - t0:.3f}", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        o = model(x, t, ctx)
        print(f"time {time.perf_counter() - t0:.3f}", flush=True)
    assert np.isfinite(o).all()
    print(f"rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", flush=True)


def sdcli_step(path: str, model: str, threads: int) -> tuple[float, float, int]:
    """(sampling seconds of one step, whole-run seconds, peak RSS bytes) of one sd-cli run."""
    cmd = [path, "-m", model, "-p", "a lovely cat", "-W", "512", "-H", "512", "--steps", "1",
           "-s", "42", "-t", str(threads), "-o", "/tmp/bench_sd15_step_sdcli.png"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    m = re.search(r"sampling completed, taking ([0-9.]+)s", text)
    if p.returncode or not m:
        raise SystemExit(f"sd-cli failed ({p.returncode}):\n{text[-2000:]}")
    return float(m.group(1)), wall, ru.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=CKPT, help="fp16 SD1.5 checkpoint (random weights are fine)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sdcli", nargs="?", const=SDCLI, default=None, help="also time sd-cli --steps 1")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.ckpt)
    threads = len(os.sched_getaffinity(0))
    print(f"SD1.5 512x512 step with CFG (UNet 64x64 latent, batch 2, {STEP_TFLOP} TFLOP), {threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    sd = None
    if a.sdcli:
        ss, wall, rss = sdcli_step(a.sdcli, a.ckpt, threads)
        sd = (ss, rss)
        print(f"sd-cli: sampling {ss:.2f} s (whole run {wall:.1f} s), peak RSS {rss / 1e9:.2f} GB", flush=True)

    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--ckpt", a.ckpt],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask() -> float:
        child.stdin.write("run\n")
        child.stdin.flush()
        return float(child.stdout.readline().split()[1])

    import torch
    from diffusers import UNet2DConditionModel
    torch.set_num_threads(threads)
    unet = UNet2DConditionModel(cross_attention_dim=768).eval()
    x, t, ctx = (torch.from_numpy(v) for v in inputs())

    def peer() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            unet(x, t, encoder_hidden_states=ctx)
        return time.perf_counter() - t0

    warm = child.stdout.readline()  # sdrt's warm-up ran alone: the torch build overlapped it
    print(f"warm-up: sdrt {float(warm.split()[1]):.2f} s, torch {peer():.2f} s", flush=True)
    ts, tp = [], []
    for i in range(a.repeat):
        ts.append(ask())
        tp.append(peer())
        print(f"  run {i + 1}: sdrt {ts[-1]:.2f} s, torch {tp[-1]:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    child.stdin.write("end\n")
    child.stdin.flush()
    rss = int(child.stdout.readline().split()[1])
    child.wait()

    s, p = statistics.median(ts), statistics.median(tp)
    ratio = statistics.median(u / v for u, v in zip(ts, tp))
    print(f"\n| engine | s per step | GFLOP/s | sdrt / engine | peak RSS GB |\n|---|---:|---:|---:|---:|")
    print(f"| sdrt (fp16 weights) | {s:.2f} | {STEP_TFLOP * 1e3 / s:.0f} | 1.00 | {rss / 1e9:.2f} |")
    print(f"| diffusers/PyTorch fp32 | {p:.2f} | {STEP_TFLOP * 1e3 / p:.0f} | {ratio:.2f} | |")
    if sd:
        print(f"| sd-cli (fp16 weights) | {sd[0]:.2f} | {STEP_TFLOP * 1e3 / sd[0]:.0f} | {s / sd[0]:.2f} | {sd[1] / 1e9:.2f} |")
    print(f"load average at the end {os.getloadavg()[0]:.1f}; sdrt / torch is the median of per-repeat ratios")


if __name__ == "__main__":
    main()
