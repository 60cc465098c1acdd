"""Images identical before and after the CPU speed work (issue 5): PSNR of today's CLI output
against the image saved before it.

    python bench/compare_before_speed.py [--before /work/e2e/before_speed.png] [--model ...]
    python bench/compare_before_speed.py --save     # (re)make the "before" image with this checkout

The "before" image is `sdrt -m <model> -p "a lovely cat" -W 512 -H 512 --steps 4 -s 42 -o
/work/e2e/before_speed.png` (euler_a, cfg 7, the cuda RNG: every default), made at the commit
written next to it in before_speed.commit (main at 653273d, before the issue's kernel changes
landed). This script runs the same command with the current checkout and prints the PSNR over
all pixels and channels (8-bit, peak 255) and the largest pixel difference; the issue asks for
>= 50 dB. Exit status 1 below --min-db.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = "/work/e2e/sd15_rand_f16.safetensors"
BEFORE = "/work/e2e/before_speed.png"
FLAGS = ["-p", "a lovely cat", "-W", "512", "-H", "512", "--steps", "4", "-s", "42"]


def read_png(path: str) -> np.ndarray:
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)


def generate(model: str, out: str) -> float:
    cmd = [sys.executable, "-m", "sdrt", "-m", model, *FLAGS, "-o", out]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, check=False)
    if p.returncode:
        raise SystemExit(f"sdrt failed ({p.returncode}):\n{p.stdout[-3000:]}")
    return time.perf_counter() - t0


def commit() -> str:
    p = subprocess.run(["git", "rev-parse", "HEAD"], stdout=subprocess.PIPE, text=True, cwd=ROOT, check=False)
    return p.stdout.strip() or "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=CKPT)
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--save", action="store_true", help="write --before with this checkout instead of comparing")
    ap.add_argument("--min-db", type=float, default=50.0)
    a = ap.parse_args()
    if a.save:
        secs = generate(a.model, a.before)
        with open(os.path.splitext(a.before)[0] + ".commit", "w") as f:
            f.write(commit() + "\n")
        print(f"wrote {a.before} at {commit()[:7]} ({secs:.0f} s)")
        return 0
    if not os.path.exists(a.before):
        raise SystemExit(f"{a.before} does not exist: make it first with --save at the 'before' commit")
    stamp = os.path.splitext(a.before)[0] + ".commit"
    was = "unknown"
    if os.path.exists(stamp):
        with open(stamp) as f:
            was = f.read().strip()[:7]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "after.png")
        secs = generate(a.model, out)
        before, after = read_png(a.before), read_png(out)
    if before.shape != after.shape:
        raise SystemExit(f"image shapes differ: {before.shape} vs {after.shape}")
    db = psnr(before, after)
    diff = int(np.abs(before.astype(np.int16) - after.astype(np.int16)).max())
    print(f"before ({was}) vs now ({commit()[:7]}): PSNR {db:.2f} dB, max |diff| {diff}/255, "
          f"{np.mean(before != after) * 100:.2f}% of values differ (generation {secs:.0f} s)")
    return 0 if db >= a.min_db else 1


if __name__ == "__main__":
    sys.exit(main())
