"""Full-size Flux.1-dev on an NVIDIA GPU (issue 14): sdrt's CUDA backend vs diffusers'
FluxTransformer2DModel (PyTorch bf16, eager and torch.compile) vs sd-cli's CUDA build, in one run.

    python bench/bench_cuda_flux.py --dir /tmp/flux [--engines sdrt,sdrt-q8_0,sdrt-q4_K,torch,compile,cli,cli-vram8,sdcli]
                                    [--sdcli PATH] [--steps 20] [--size 1024] [--jobs 16]

Random full-size checkpoints are written into --dir first when missing (tools/make_flux_checkpoint.py
with --jobs processes): flux1-dev bf16 (23.8 GB), ae, clip_l, t5xxl (bf16, --t5-depth blocks of full
width), and the Q8_0 / Q4_K GGUFs of flux1-dev, each made just before its engine runs.
Each engine runs in its own child process, one after the other; the parent polls nvidia-smi every
0.1 s and reports each child's peak device memory above the idle baseline.
* sdrt[-TYPE]: FluxModel on cuda0, the transformer file of that type; one step = one forward at
  batch 1 (cfg 1), img 4096 tokens (1024²) + txt --txt tokens (512, diffusers' default for dev);
  3 warm-up calls (eager, capture, replay), then --steps timed calls.
* torch / compile: diffusers FluxTransformer2DModel (dev config, guidance embedding), bf16, its own
  random init, same shapes; compile = torch.compile(m) (inductor's default mode: max-autotune takes
  many minutes on a 12B model).
* cli / cli-vram8: sdrt's whole CLI (`python -m sdrt.cli.main`, --backend cuda0, cfg 1, guidance 3.5,
  T5 at 256 tokens as sd.cpp) and the same under `--max-vram 8`; wall time, its log's sampling time;
  the two PNGs compared (PSNR).
* sdcli: `sd-cli --diffusion-fa` with the same files and arguments; its "sampling completed" line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cuda_timing import GpuPeak, time_calls  # noqa: E402
MAKE = os.path.join(ROOT, "tools", "make_flux_checkpoint.py")
LAST_TORCH_STEP = None   # bench/profile_cuda_kernels.py profiles the step run_torch timed
PROMPT = "a photograph of a red fox in fresh snow, morning light"


def files(d, t5_depth):
    return dict(bf16=f"{d}/flux1-dev-bf16.safetensors", q8_0=f"{d}/flux1-dev-q8_0.gguf",
                q4_K=f"{d}/flux1-dev-q4_K.gguf", vae=f"{d}/ae.safetensors", clip_l=f"{d}/clip_l.safetensors",
                t5xxl=f"{d}/t5xxl-{t5_depth}blk-bf16.safetensors")


def make(path, args):
    if os.path.exists(path):
        return
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args, "-o", path + ".part"], check=True, stdout=subprocess.DEVNULL)
    os.replace(path + ".part", path)
    print(f"made {os.path.basename(path)} ({os.path.getsize(path) / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s",
          flush=True)


def inputs(size, txt):
    rng = np.random.default_rng(1)
    lat = size // 8
    return (rng.standard_normal((1, 16, lat, lat), dtype=np.float32), np.array([0.9], np.float32),
            rng.standard_normal((1, txt, 4096), dtype=np.float32), rng.standard_normal((1, 768), dtype=np.float32),
            np.array([3.5], np.float32))


def run_sdrt(a, path):
    import sdrt.gpu  # noqa: F401  (registers cuda0)
    from sdrt.io import open_model
    from sdrt.models.diffusion.flux import FluxModel
    x, t, ctx, y, g = inputs(a.size, a.txt)
    t0 = time.perf_counter()
    model = FluxModel(open_model(path).tensors, prefix="")
    out = {}
    r = time_calls(lambda: out.setdefault("y", model(x, t, ctx, y, g, backend=a.backend)), a.steps)
    r["open_s"] = time.perf_counter() - t0 - r["first_call_s"]
    r["finite"] = bool(np.isfinite(out["y"]).all())
    return r


def run_torch(a, compiled):
    import torch
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    dev, bf = ("cpu", torch.float32) if a.backend == "cpu" else ("cuda", torch.bfloat16)
    with torch.device(dev):
        m = FluxTransformer2DModel(num_layers=a.depth, num_single_layers=a.single_depth,
                                   guidance_embeds=True).to(bf).eval()
    x, t, ctx, y, g = inputs(a.size, a.txt)
    lat = a.size // 8
    hs = torch.from_numpy(x).to(dev, bf).reshape(1, 16, lat // 2, 2, lat // 2, 2).permute(0, 2, 4, 1, 3, 5) \
        .reshape(1, (lat // 2) ** 2, 64)
    ids = torch.zeros(lat // 2, lat // 2, 3, device=dev)
    ids[..., 1] += torch.arange(lat // 2, device=dev)[:, None]
    ids[..., 2] += torch.arange(lat // 2, device=dev)[None, :]
    kw = dict(hidden_states=hs, encoder_hidden_states=torch.from_numpy(ctx).to(dev, bf),
              pooled_projections=torch.from_numpy(y).to(dev, bf), timestep=torch.from_numpy(t).to(dev, bf),
              guidance=torch.from_numpy(g).to(dev, torch.float32), img_ids=ids.reshape(-1, 3),
              txt_ids=torch.zeros(a.txt, 3, device=dev), return_dict=False)
    f = torch.compile(m) if compiled else m

    @torch.no_grad()
    def step():
        f(**kw)

    global LAST_TORCH_STEP
    LAST_TORCH_STEP = step
    r = time_calls(step, a.steps, torch.cuda.synchronize if dev == "cuda" else lambda: None)
    r.update(torch=torch.__version__, peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0)
    return r


def cli_args(a, fs, out):
    return ["--diffusion-model", fs["bf16"], "--vae", fs["vae"], "--clip_l", fs["clip_l"], "--t5xxl", fs["t5xxl"],
            "-p", PROMPT, "-W", str(a.size), "-H", str(a.size), "--steps", str(a.steps), "--cfg-scale", "1",
            "--guidance", "3.5", "-s", "42", "-o", out, "-v"]


def run_cli(a, fs, extra, tag):
    out = f"{a.dir}/sdrt_{tag}.png"
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "sdrt.cli.main", *cli_args(a, fs, out), "--backend", a.backend, *extra],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    smp = re.search(r"sampling completed, taking ([0-9.]+)s", p.stdout)
    if p.returncode or not smp:
        raise SystemExit(f"sdrt cli failed ({p.returncode}):\n{p.stdout[-4000:]}")
    return dict(step_s=float(smp.group(1)) / a.steps, wall_s=wall, png=out,
                log=[ln for ln in p.stdout.splitlines() if "segment" in ln or "peak" in ln][-4:])


def run_sdcli(a, fs):
    out = f"{a.dir}/sdcli.png"
    t0 = time.perf_counter()
    p = subprocess.run([a.sdcli, *cli_args(a, fs, out), "--diffusion-fa"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    smp = re.search(r"sampling completed, taking ([0-9.]+)s", p.stdout)
    if p.returncode or not smp:
        raise SystemExit(f"sd-cli failed ({p.returncode}):\n{p.stdout[-4000:]}")
    return dict(step_s=float(smp.group(1)) / a.steps, wall_s=wall, png=out)


def child(a):
    fs = files(a.dir, a.t5_depth)
    e = a.engine
    if e.startswith("sdrt"):
        r = run_sdrt(a, fs[e.split("-", 1)[1] if "-" in e else "bf16"])
    elif e in ("torch", "compile"):
        r = run_torch(a, e == "compile")
    elif e == "cli":
        r = run_cli(a, fs, [], "resident")
    elif e == "cli-vram8":
        r = run_cli(a, fs, ["--max-vram", "8"], "vram8")
    else:
        r = run_sdcli(a, fs)
    print("RESULT " + json.dumps(r), flush=True)


def psnr(p, q):
    from PIL import Image
    x, y = (np.asarray(Image.open(f), np.float64) for f in (p, q))
    mse = float(np.mean((x - y) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/flux")
    ap.add_argument("--engines", default="sdrt,sdrt-q8_0,sdrt-q4_K,torch,compile,cli,cli-vram8,sdcli")
    ap.add_argument("--sdcli", default="")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--txt", type=int, default=512, help="text tokens of the DiT step benches")
    ap.add_argument("--t5-depth", type=int, default=24, help="T5-XXL blocks of the CLI runs (24: the released model)")
    ap.add_argument("--keep", action="store_true", help="keep the quantized files after their runs")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--depth", type=int, default=19, help="double blocks (fewer: a quick smoke run)")
    ap.add_argument("--single-depth", type=int, default=38)
    ap.add_argument("--backend", default="cuda0", help="sdrt's backend (cpu: a smoke run without a GPU)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        return child(a)
    os.makedirs(a.dir, exist_ok=True)
    fs = files(a.dir, a.t5_depth)
    engines = [e for e in a.engines.split(",") if e and (e != "sdcli" or a.sdcli)]
    small = ["--depth", str(a.depth), "--single-depth", str(a.single_depth)]
    jobs = ["--jobs", str(a.jobs)]
    make(fs["bf16"], [MAKE, "--variant", "dev", *small, *jobs])
    if any(e.startswith("cli") or e == "sdcli" for e in engines):
        make(fs["vae"], [MAKE, "--component", "vae"])
        make(fs["t5xxl"], [MAKE, "--component", "t5xxl", "--t5-depth", str(a.t5_depth), *jobs])
        make(fs["clip_l"], [os.path.join(ROOT, "tools", "make_sd_checkpoint.py"), "--component", "clip_l"])
    res = {}
    for eng in engines:
        quant = eng.split("-", 1)[1] if eng.startswith("sdrt-") else None
        if quant:  # made just before its run and removed after (disk: 23.8 + 12.7 + 6.8 GB otherwise)
            make(fs[quant], [MAKE, "--variant", "dev", "--type", quant, *small, *jobs])
        base = GpuPeak.used()
        mon = GpuPeak()
        mon.start()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--engine", eng, "--dir", a.dir,
                            "--steps", str(a.steps), "--size", str(a.size), "--txt", str(a.txt),
                            "--t5-depth", str(a.t5_depth), "--sdcli", a.sdcli, "--depth", str(a.depth),
                            "--single-depth", str(a.single_depth), "--backend", a.backend],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        mon.stop.set()
        mon.join()
        if quant and not a.keep:
            os.remove(fs[quant])
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"{eng} failed ({p.returncode}):\n{p.stdout[-4000:]}", flush=True)
            continue
        res[eng] = json.loads(line[-1][7:])
        res[eng]["peak_mib"] = mon.peak - base
        print(f"{eng}: {res[eng]}", flush=True)
    print(f"\nFlux.1-dev {a.size}x{a.size}, cfg 1, {a.steps} timed steps; DiT benches: {a.txt} text tokens; "
          "cli/sdcli: 256 (sd.cpp's Flux T5 length)\n")
    print("| engine | s/it | it/s | peak GPU MiB (nvidia-smi) | whole command s | sdrt bf16 it/s / engine it/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for eng, r in res.items():
        ref = res.get("cli" if eng.startswith("cli") or eng == "sdcli" else "sdrt", {}).get("step_s")
        ratio = f"{r['step_s'] / ref:.2f}" if ref else "-"
        wall = f"{r['wall_s']:.1f}" if "wall_s" in r else "-"
        print(f"| {eng} | {r['step_s']:.3f} | {1 / r['step_s']:.2f} | {r['peak_mib']} | {wall} | {ratio} |")
    for other in ("cli-vram8", "sdcli"):
        if "cli" in res and other in res:
            print(f"PSNR sdrt cli (resident) vs {other}: {psnr(res['cli']['png'], res[other]['png']):.2f} dB")


if __name__ == "__main__":
    main()
