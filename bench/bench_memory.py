"""Peak memory of a whole 512x512 SD1.5 txt2img run (issue 5): sdrt's CLI against sd-cli.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_memory.py \\
        [--model /work/e2e/sd15_rand_f16.safetensors] [--size 512] [--steps 1] [--sdcli [PATH]]

Each engine runs as a child process on the same file, prompt and seed; its peak RSS is the
kernel's ru_maxrss for that child (os.wait4), which counts the memory-mapped weight pages it
touched as well as its own allocations — what `/usr/bin/time -v` reports. For sdrt the script
also samples /proc/<pid>/status every 50 ms (VmRSS split into RssFile, the mapped model pages, and
RssAnon, everything allocated) and keeps the largest sample per pipeline stage, the stage being
the last log line seen: start-up, text encoder, sampling, VAE decode. The sampled peaks can miss
a short spike that ru_maxrss catches; the table shows both. --sdcli runs sd-cli the same way
(its peak only). The number of steps does not change the peak (the same graph runs each step).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = "/work/e2e/sd15_rand_f16.safetensors"
SDCLI = "/work/sdcpp/stable_diffusion_cpp_python-0.4.7/vendor/stable-diffusion.cpp/build/bin/sd-cli"
# log line that starts each stage (sd-cli's wording, which sdrt keeps)
STAGES = (("loading", "start-up"), ("generate_image", "text encoder"), ("generating image", "sampling"),
          ("decoding", "VAE decode"), ("save result", "write image"))


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def run(cmd, sample: bool) -> tuple[int, float, dict, str]:
    """(ru_maxrss bytes, seconds, {stage: (rss, anon, file) at that stage's largest RSS sample}, log)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    stage = ["start-up"]
    peaks: dict[str, tuple[int, int, int]] = {}
    lines: list[str] = []

    def reader():
        for line in p.stdout:
            lines.append(line)
            for key, name in STAGES:
                if f"] {key}" in line:
                    stage[0] = name

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    while True:  # wait4, not Popen.poll: the rusage comes only with the reaping call
        pid, status, ru = os.wait4(p.pid, os.WNOHANG if sample else 0)
        if pid:
            break
        s = _status(p.pid)
        if s:
            cur = (s.get("VmRSS", 0), s.get("RssAnon", 0), s.get("RssFile", 0))
            if cur[0] > peaks.get(stage[0], (0, 0, 0))[0]:
                peaks[stage[0]] = cur
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    th.join()
    code = p.returncode
    text = "".join(lines)
    if code:
        raise SystemExit(f"{cmd[0]} failed ({code}):\n{text[-3000:]}")
    return ru.ru_maxrss * 1024, time.perf_counter() - t0, peaks, text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=CKPT)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--sdcli", nargs="?", const=SDCLI, default=None)
    ap.add_argument("--sdrt-flags", default="", help='extra sdrt flags, e.g. "--params-backend disk"')
    a = ap.parse_args()
    out = tempfile.gettempdir()
    common = ["-m", a.model, "-p", "a lovely cat", "-W", str(a.size), "-H", str(a.size), "--steps", str(a.steps),
              "-s", "42"]
    print(f"peak RSS of a {a.size}x{a.size} txt2img run, {a.steps} step(s), {os.path.basename(a.model)}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rss, secs, peaks, text = run([sys.executable, "-m", "sdrt", *common, *a.sdrt_flags.split(),
                                  "-o", os.path.join(out, "bench_memory_sdrt.png")], True)
    m = re.search(r"sampling completed, taking ([0-9.]+)s", text)
    print(f"  sdrt {a.sdrt_flags}: peak RSS {rss / 1e9:.3f} GB ({secs:.0f} s, sampling "
          f"{float(m.group(1)) if m else float('nan'):.1f} s)", flush=True)
    print("\n| sdrt stage | VmRSS GB | of it RssFile (mapped weights) | RssAnon |\n|---|---:|---:|---:|")
    for _, name in STAGES:
        if name in peaks:
            r, an, fi = peaks[name]
            print(f"| {name} | {r / 1e9:.3f} | {fi / 1e9:.3f} | {an / 1e9:.3f} |")
    rows = [("sdrt", rss)]
    if a.sdcli:
        srss, ssecs, _, _ = run([a.sdcli, *common, "-t", str(len(os.sched_getaffinity(0))),
                                 "-o", os.path.join(out, "bench_memory_sdcli.png")], False)
        print(f"\n  sd-cli: peak RSS {srss / 1e9:.3f} GB ({ssecs:.0f} s)", flush=True)
        rows.append(("sd-cli", srss))
    print("\n| engine | peak RSS GB (ru_maxrss) |\n|---|---:|")
    for name, r in rows:
        print(f"| {name} | {r / 1e9:.3f} |")
    if a.sdcli:
        print(f"sdrt / sd-cli: {rss / rows[1][1]:.3f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
