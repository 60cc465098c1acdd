"""Full-size SD3.5 Medium (24 joint blocks, MMDiT-X attn2 in 0..12) Q8_0 with CLIP-L, OpenCLIP bigG
and the full 24-block T5-XXL Q8_0 on the CPU: sdrt against sd-cli, same files, same flags, same
seed (issue 15's done-means 4: sdrt's s/step <= sd-cli's / 1.5, same run).

    python bench/bench_sd3_cpu_full.py --steps 3 --results /work/cache/sd3_full/results.jsonl

Files (random weights; bench/README.md has the commands): in --dir (/work/cache/sd3_full)
sd3.5m-q8_0.gguf (tools/make_sd3_checkpoint.py --variant sd3.5-medium --component transformer
--type q8_0), sd3_vae.safetensors (--component vae), clip_g.safetensors (--component clip_g
--type f16); in --te-dir (/work/cache/flux_full, the Flux bench's files, read only)
t5xxl-q8_0.gguf and clip_l.safetensors. Flags: 256x256, CFG 4.5 with a negative prompt (two
model evaluations a step: sdrt batches them, sd-cli runs them one after the other), euler over
discrete (flow shift 3), `-s 42`, `-t 2`, the weights' own types (no --type).

Read from each engine's own log (sdrt prints sd.cpp's lines):
- conditioning: "get_learned_condition completed, taking X s" (CLIP-L + bigG + T5-XXL, prompt and
  negative prompt);
- per step: "sampling completed, taking X s" / steps, and the steps after the first from the
  progress bar (both print sd.cpp's running average a_k since sampling began: the mean of steps
  2..n is (n a_n - a_1) / (n - 1)), which leaves out sdrt's first touch of its lazily mapped
  weights (sd-cli reads them before sampling);
- peak RSS of the whole process (/usr/bin/time -v "Maximum resident set size"), wall time.
Engines: sdcli, sdrt, sdrt-exact (SDRT_QGEMM=off: float32 activations). Each run is one process under /work/heavy.lock (taken per run, or around the whole script with
--no-lock). PSNR of sdrt's image against
sd-cli's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cpu_full import LOCK, ROOT, add_run_args, after_first, record, run, stage, summary_lines  # noqa: E402

PROMPT = ("a lovely cat sitting on a wooden windowsill at golden hour, soft light, detailed fur, "
          "(green eyes:1.2), film grain")
NEGATIVE = "blurry, low quality"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/work/cache/sd3_full")
    ap.add_argument("--te-dir", default="/work/cache/flux_full")
    ap.add_argument("--sdcli", default="/work/sdcli/sd-cli")
    add_run_args(ap, "/work/cache/sd3_full/out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d, te = (lambda f: os.path.join(a.dir, f)), (lambda f: os.path.join(a.te_dir, f))  # noqa: E731
    common = ["-p", PROMPT, "-n", NEGATIVE, "-W", "256", "-H", "256", "--steps", str(a.steps),
              "--cfg-scale", "4.5", "--sampling-method", "euler", "--scheduler", "discrete", "-s", "42", "-t", "2",
              "--diffusion-model", d("sd3.5m-q8_0.gguf"), "--vae", d("sd3_vae.safetensors"),
              "--clip_l", te("clip_l.safetensors"), "--clip_g", d("clip_g.safetensors"),
              "--t5xxl", te("t5xxl-q8_0.gguf")]
    sdrt = [sys.executable, "-m", "sdrt.cli.main"]
    # sdrt-exact: SDRT_QGEMM=off (dequantize + BLAS, float32 activations): how far the int8
    # activations alone move the image, to read the PSNR against sd-cli by
    engines = {"sdcli": ([a.sdcli], {}), "sdrt": (sdrt, {}), "sdrt-exact": (sdrt, {"SDRT_QGEMM": "off"})}
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}, load {os.getloadavg()[0]:.1f}")
    res: dict[str, dict] = {}
    for name in a.engines.split(","):
        img = os.path.join(a.out, f"{name}{a.tag}.png")
        exe, extra = engines[name]
        cmd = [*exe, *common, "-o", img]
        log, rss, wall = run(cmd, dict(os.environ, PYTHONPATH=ROOT, **extra), None if a.no_lock else LOCK)
        with open(os.path.join(a.out, f"{name}{a.tag}.log"), "w") as f:
            f.write(log)
        n = a.steps
        r = {"engine": name, "steps": n, "cond": stage(log, "get_learned_condition"),
             "per_step": stage(log, "sampling") / n, "rss": rss, "wall": wall,
             "after_first": after_first(log, n),
             "decode": stage(log, "decode_first_stage"), "time": time.strftime("%H:%M:%S"),
             "load": os.getloadavg()[0]}
        res[name] = r
        record(a.results, r)
        print(f"{name}: conditioning {r['cond']:.2f} s, per step {r['per_step']:.2f} s (steps 2..{n}: "
              f"{r['after_first']:.2f} s), decode {r['decode']:.2f} s, peak RSS {rss:.2f} GiB, wall {wall:.0f} s",
              flush=True)
    print()
    for line in summary_lines(res, a.steps, "cond", "conditioning", a.out, a.tag, engines):
        print(line)

if __name__ == "__main__":
    main()
