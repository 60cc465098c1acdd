"""What the full-size CPU benches against sd-cli share (bench_flux_cpu_full.py, bench_sd3_cpu_full.py,
bench_zimage_cpu_full.py): one run of an engine under /usr/bin/time -v and the heavy lock, sd.cpp's
log lines read back (sdrt prints the same ones), the JSON-lines record and the image PSNRs.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

LOCK = "/work/heavy.lock"


def add_run_args(ap, out: str) -> None:
    """The arguments every full-size CPU bench takes: steps, engines, where images and logs go,
    a tag for repeated runs, a results file, and --no-lock."""
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--engines", default="sdcli,sdrt")
    ap.add_argument("--out", default=out)
    ap.add_argument("--tag", default="", help="suffix of the image/log names (several runs of one engine)")
    ap.add_argument("--results", default=None, help="append each run's figures to this JSON-lines file")
    ap.add_argument("--no-lock", action="store_true",
                    help="the caller holds /work/heavy.lock (both engines in one hold: `flock /work/heavy.lock python ...`)")


def run(cmd: list[str], env: dict, lock_path: str | None = LOCK) -> tuple[str, float, float]:
    """(stdout + stderr, peak RSS GiB, wall s) of one run under /usr/bin/time -v and the heavy lock
    (lock_path None: the caller holds it)."""
    with open(lock_path or os.devnull, "a") as lock:
        if lock_path:
            fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"#   lock taken {time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f}: {' '.join(cmd)}",
              flush=True)
        t0 = time.time()
        p = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=env, text=True)
        wall = time.time() - t0
    out = p.stdout
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out[-3000:]}")
    kb = re.findall(r"Maximum resident set size \(kbytes\): (\d+)", out)
    return out, int(kb[-1]) / 2**20, wall


def disk_read_gib(log: str) -> float:
    """GiB the run read from the disk (/usr/bin/time -v "File system inputs", 512-byte blocks):
    tells a run on a cold page cache from one on a warm one."""
    n = re.findall(r"File system inputs: (\d+)", log)
    return int(n[-1]) * 512 / 2**30 if n else float("nan")


def evict(paths) -> None:
    """Drop the page-cache pages of these files (posix_fadvise DONTNEED: only pages no process
    maps, and only these files, so other people's cached files stay), for a cold-cache run."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def stage(log: str, what: str) -> float:
    """Seconds of sd.cpp's "<what> completed, taking X s" line (the last one)."""
    m = re.findall(rf"{what} completed, taking ([0-9.]+)\s*(m?s)", log)
    if not m:
        raise SystemExit(f"no '{what} completed' line in:\n{log[-3000:]}")
    v, unit = m[-1]
    return float(v) / (1000.0 if unit == "ms" else 1.0)


def bar_averages(log: str) -> dict[int, float]:
    """step -> running average s/step from the progress bar (`| k/n - X s/it` or `X it/s`)."""
    res = {}
    for k, v, unit in re.findall(r"\|\s*(\d+)/\d+ - ([0-9.]+)(s/it|it/s)", log):
        res[int(k)] = float(v) if unit == "s/it" else 1.0 / float(v)
    return res


def after_first(log: str, n: int) -> float:
    """Mean s/step of steps 2..n: the bar prints the running average a_k since sampling began, so
    it is (n a_n - a_1) / (n - 1). Leaves out sdrt's first touch of its lazily mapped weights
    (sd-cli reads them before sampling)."""
    avg = bar_averages(log)
    return (n * avg[n] - avg[1]) / (n - 1) if n > 1 and 1 in avg and n in avg else float("nan")


def record(path: str | None, r: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(r) + "\n")


def read_image(path: str):
    """An image as float64 RGB in [0, 1], or None when that run has not written it."""
    from PIL import Image
    return np.asarray(Image.open(path).convert("RGB"), np.float64) / 255 if os.path.exists(path) else None


def psnr_lines(images: dict, pairs) -> list[str]:
    """"PSNR x vs y" for each pair whose two images exist."""
    from sdrt.io.images import psnr
    out = []
    for x, y in pairs:
        a, b = images.get(x), images.get(y)
        if a is not None and b is not None:
            out.append(f"PSNR {x} vs {y}: {psnr(a, b):.2f} dB (image std {a.std():.3f} / {b.std():.3f})")
    return out


def summary_lines(res: dict, steps: int, stage: str, title: str, out: str, tag: str, engines) -> list[str]:
    """The markdown table of each engine's run (`stage`: the result key of the text-encoder stage,
    `title` its column name), sd-cli's times over sdrt's, and the PSNRs between the engines'
    images `out/<engine><tag>.png` (earlier runs' too)."""
    lines = [f"| engine | {title} (s) | s/step ({steps}-step mean) | s/step (steps 2..{steps}) | decode (s) "
             "| peak RSS (GiB) | wall (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r[stage]:.2f} | {r['per_step']:.2f} | {r['after_first']:.2f} | {r['decode']:.2f} | "
                     f"{r['rss']:.2f} | {r['wall']:.0f} |")
    s, c = res.get("sdrt"), res.get("sdcli")
    if s and c:
        lines.append(f"sd-cli / sdrt: {title} {c[stage] / s[stage]:.2f}x, step {c['per_step'] / s['per_step']:.2f}x "
                     f"(steps 2..{steps}: {c['after_first'] / s['after_first']:.2f}x), RSS sdrt / sd-cli "
                     f"{s['rss'] / c['rss']:.2f}")
    imgs = {n: read_image(os.path.join(out, f"{n}{tag}.png")) for n in engines}
    return lines + psnr_lines(imgs, (("sdrt", "sdcli"), ("sdrt-exact", "sdcli"), ("sdrt", "sdrt-exact")))
