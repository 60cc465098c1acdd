"""T5-XXL Q8_0 encoding and Flux.1-schnell Q8_0/Q4_0 steps on the CPU: sdrt (int8-activation GEMM,
and SDRT_QGEMM=off: the dequantize + BLAS path before it) against sd-cli, in one run.

    python bench/bench_flux_cpu.py --dir /work/e2e/cpuspeed [--sdcli /work/sdcli/sd-cli]

Files (made by tools/make_flux_checkpoint.py / make_sd_checkpoint.py; see bench/README.md): a
full-width T5-XXL at 1 and 4 blocks (Q8_0 GGUF), full-width Flux.1-schnell DiTs with 1+1 (for the
T5 runs) and 2 double + 4 single blocks (Q8_0 and Q4_0 GGUF), the ae VAE and CLIP-L (f16). Both engines get the same files
and flags (256x256, a short prompt: Flux pads T5 to 256 tokens on both), `-t 2`.

What is timed, from each engine's own log (sdrt prints sd.cpp's lines):
- T5: "get_learned_condition completed, taking X s" (CLIP-L + T5 + set-up) with the 4-block T5
  minus the same with the 1-block T5, divided by 3: the time of one full-width T5-XXL block on
  256 tokens, CLIP and every fixed cost cancelled (both runs use the 1+1-block DiT). x24 gives the released encoder's estimate.
- Flux: "sampling completed, taking X s" / steps for the 2+4-block DiT (sdrt's includes its
  first touch of the lazily mapped weights; sd-cli reads them before sampling).
- Peak RSS of the whole process (ru_maxrss through os.wait4).
Each run is its own process; each engine's runs hold `/work/heavy.lock` (taken per engine,
so no holder keeps it for long). Flux runs one step: sd-cli takes ~1 min a step on this model.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str], env: dict) -> tuple[str, float]:
    """(stdout + stderr, peak RSS GB) of one run."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out[-3000:]}")
    return out, ru.ru_maxrss / 2**20


def stage(log: str, what: str) -> float:
    m = re.findall(rf"{what} completed, taking ([0-9.]+)\s*s", log)
    if not m:
        raise SystemExit(f"no '{what} completed' line in:\n{log[-3000:]}")
    return float(m[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/work/e2e/cpuspeed")
    ap.add_argument("--sdcli", default="/work/sdcli/sd-cli")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--engines", default="sdcli,sdrt-before,sdrt")
    ap.add_argument("--before-t5-only", action="store_true", help="sdrt-before: the two T5 runs only")
    ap.add_argument("--warm", action="store_true",
                    help="run each command once untimed first (sdrt reads weights lazily, inside its timed stages)")
    ap.add_argument("--no-lock", action="store_true", help="the caller holds /work/heavy.lock already")
    a = ap.parse_args()
    d = lambda f: os.path.join(a.dir, f)  # noqa: E731
    common = ["-p", "a lovely cat", "-W", "256", "-H", "256", "--cfg-scale", "1", "-s", "42", "-t", "2",
              "--vae", d("ae.safetensors"), "--clip_l", d("clip_l.safetensors")]
    engines = {
        "sdcli": ([a.sdcli], {}),
        "sdrt-before": ([sys.executable, "-m", "sdrt.cli.main"], {"SDRT_QGEMM": "off"}),
        "sdrt": ([sys.executable, "-m", "sdrt.cli.main"], {}),
    }
    with open("/proc/loadavg") as f:
        print(f"# load average at start: {f.read().split()[0]}; {time.strftime('%H:%M:%S')}")
    res = {}
    for name in a.engines.split(","):
        exe, extra = engines[name]
        env = dict(os.environ, PYTHONPATH=ROOT, **extra)
        r = res[name] = {}
        lock = open("/work/heavy.lock", "a")
        if not a.no_lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"# {name}: lock taken at {time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f}", flush=True)
        sets = [("t5xxl-1l-q8_0.gguf", "flux-schnell-1-1-q8_0.gguf", 1, "t5_1"),
                ("t5xxl-4l-q8_0.gguf", "flux-schnell-1-1-q8_0.gguf", 1, "t5_4"),
                ("t5xxl-1l-q8_0.gguf", "flux-schnell-2-4-q8_0.gguf", a.steps, "q8_0"),
                ("t5xxl-1l-q8_0.gguf", "flux-schnell-2-4-q4_0.gguf", a.steps, "q4_0")]
        if name == "sdrt-before" and a.before_t5_only:
            sets = sets[:2]
        for t5, model, steps, key in sets:
            out = os.path.join("/tmp", f"bench_flux_{name}_{key}.png")
            if a.warm:  # an untimed run first: the weights' pages cached for both engines alike
                run([*exe, "--diffusion-model", d(model), "--t5xxl", d(t5), *common, "--steps", "1", "-o", out], env)
            log, rss = run([*exe, "--diffusion-model", d(model), "--t5xxl", d(t5), *common,
                            "--steps", str(steps), "-o", out], env)
            r[key] = {"cond": stage(log, "get_learned_condition"), "sampling": stage(log, "sampling") / steps,
                      "rss": rss}
            print(f"{name} {key}: condition {r[key]['cond']:.2f} s, per step {r[key]['sampling']:.2f} s, "
                  f"peak RSS {rss:.2f} GB", flush=True)
        lock.close()
        r["t5_block"] = (r["t5_4"]["cond"] - r["t5_1"]["cond"]) / 3
    print()
    print("| engine | T5-XXL block, 256 tokens, Q8_0 (s) | x24 (s) | Flux 2+4 blocks Q8_0 s/step | Q4_0 s/step | peak RSS GB (Q8_0 run / Q4_0 run) |")
    print("|---|---:|---:|---:|---:|---:|")
    nan = {"sampling": float("nan"), "rss": float("nan")}
    for name, r in res.items():
        q8, q4 = r.get("q8_0", nan), r.get("q4_0", nan)
        print(f"| {name} | {r['t5_block']:.2f} | {24 * r['t5_block']:.1f} | {q8['sampling']:.2f} | "
              f"{q4['sampling']:.2f} | {q8['rss']:.2f} / {q4['rss']:.2f} |")
    if "sdcli" in res:
        s = res["sdcli"]
        for name, r in res.items():
            if name != "sdcli":
                q8, q4 = r.get("q8_0", nan), r.get("q4_0", nan)
                print(f"sd-cli / {name}: T5 block {s['t5_block'] / r['t5_block']:.2f}x, Flux Q8_0 step "
                      f"{s['q8_0']['sampling'] / q8['sampling']:.2f}x, Q4_0 step {s['q4_0']['sampling'] / q4['sampling']:.2f}x")


if __name__ == "__main__":
    main()
