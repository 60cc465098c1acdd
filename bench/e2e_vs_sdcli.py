"""End to end against stable-diffusion.cpp's sd-cli: same checkpoint, prompt, seed, sampler, RNG.

    python bench/e2e_vs_sdcli.py --model /work/e2e/sd15_rand_f16.safetensors \\
        --sdcli /path/to/sd-cli --size 256x256 --steps 4 \\
        --samplers euler,euler_a,dpm++2m --rngs cuda,cpu --out /work/e2e/cmp

For every sampler x RNG it runs `sd-cli ... --type f32` and `sdrt ...` (the CLI, in a subprocess,
`--type f32` too) with identical flags, then prints the PSNR between the two PNGs (8-bit, peak
255, over all pixels and channels) and both wall times (sd.cpp's own "generate_image completed in"
line and the whole process), and whether the two PNGs' sd-webui infotexts agree apart from the
generator. `--make sd15|sdxl` first writes the random-weight checkpoint with
tools/make_sd_checkpoint.py when --model does not exist. `--api` runs sdrt in this process through
sdrt.load_pipeline / Pipeline.generate instead (one load for all runs; the time is then the
generation only). `--markdown` prints the table for docs/cli.md.

Compare in f32 on both sides: sd-cli with the file's f16 weights rounds activations to f16 inside
ggml's f16 matmuls (about 31 dB against its own --type f32 output on SD1.5 at 256x256).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEFAULT_SDCLI = "/work/sdcpp/stable_diffusion_cpp_python-0.4.7/vendor/stable-diffusion.cpp/build/bin/sd-cli"
_DONE = re.compile(r"generate_image completed in ([0-9.]+)s")
_SAMPLING = re.compile(r"sampling completed, taking ([0-9.]+)s")
_DECODE = re.compile(r"decode_first_stage completed, taking ([0-9.]+)s")


def read_png(path) -> np.ndarray:
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.uint8)


def same_infotext(ref_png, our_png) -> bool:
    """sd-cli's `parameters` text and ours agree except for the generator (Version:, "generator")."""
    import json

    from sdrt.io.png import read_png_text
    with open(ref_png, "rb") as f:
        a = read_png_text(f.read()).get("parameters", "")
    with open(our_png, "rb") as f:
        b = read_png_text(f.read()).get("parameters", "")
    if ", SDCPP: " not in a or ", SDCPP: " not in b:
        return a == b
    (ha, ja), (hb, jb) = a.split(", SDCPP: ", 1), b.split(", SDCPP: ", 1)
    ja, jb = json.loads(ja), json.loads(jb)
    ja.pop("generator", None), jb.pop("generator", None)
    return ha.replace("Version: stable-diffusion.cpp", "Version: sdrt") == hb and ja == jb


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise SystemExit(f"image shapes differ: {a.shape} vs {b.shape}")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)


def _times(log: str) -> tuple[float, float, float]:
    def last(rx):
        m = rx.findall(log)
        return float(m[-1]) if m else float("nan")
    return last(_DONE), sum(float(v) for v in _SAMPLING.findall(log)) or float("nan"), last(_DECODE)


def run(cmd, log_path, env=None) -> tuple[float, str]:
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, check=False)
    dt = time.time() - t0
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n" + p.stdout)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({p.returncode}), see {log_path}:\n{p.stdout[-2000:]}")
    return dt, p.stdout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--make", choices=("sd15", "sdxl"), help="write the random checkpoint first if missing")
    ap.add_argument("--sdcli", default=DEFAULT_SDCLI)
    ap.add_argument("--size", default="256x256", help="WxH")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samplers", default="euler,euler_a,dpm++2m")
    ap.add_argument("--rngs", default="cuda,cpu")
    ap.add_argument("--prompt", default="a lovely cat")
    ap.add_argument("--negative", default="")
    ap.add_argument("--cfg-scale", default="7.0")
    ap.add_argument("--seed", default="42")
    ap.add_argument("--threads", default=str(os.cpu_count() or 2))
    ap.add_argument("--extra", default="", help="more flags for both sides, e.g. '-i init.png --strength 0.6'")
    ap.add_argument("--out", default="/work/e2e/cmp")
    ap.add_argument("--api", action="store_true", help="run sdrt in-process, one pipeline for all runs")
    ap.add_argument("--skip-sdcli", action="store_true", help="reuse sd-cli PNGs already in --out")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if not os.path.exists(a.model):
        if not a.make:
            raise SystemExit(f"{a.model} does not exist (use --make sd15|sdxl to write it)")
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_sd_checkpoint.py"), "--arch", a.make,
                        "-o", a.model], check=True)
    w, h = a.size.split("x")
    tag = os.path.splitext(os.path.basename(a.model))[0]
    rows = []
    for rng in a.rngs.split(","):
        for smp in a.samplers.split(","):
            name = f"{tag}_{w}x{h}_{a.steps}_{smp}_{rng}".replace("+", "p")
            common = ["-m", a.model, "-p", a.prompt, "-n", a.negative, "-W", w, "-H", h, "--steps", str(a.steps),
                      "--sampling-method", smp, "--rng", rng, "-s", a.seed, "--cfg-scale", a.cfg_scale, "--type", "f32",
                      "-t", a.threads] + a.extra.split()
            ref, out = os.path.join(a.out, name + "_sdcli.png"), os.path.join(a.out, name + "_sdrt.png")
            if a.skip_sdcli and os.path.exists(ref):
                with open(os.path.join(a.out, name + "_sdcli.log")) as f:
                    t_ref, log_ref = float("nan"), f.read()
            else:
                t_ref, log_ref = run([a.sdcli] + common + ["-o", ref], os.path.join(a.out, name + "_sdcli.log"))
            if a.api:
                t_ours, log_ours = _run_api(a, common, out)
            else:
                env = dict(os.environ)
                env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
                t_ours, log_ours = run([sys.executable, "-m", "sdrt"] + common + ["-o", out],
                                       os.path.join(a.out, name + "_sdrt.log"), env)
            p = psnr(read_png(ref), read_png(out))
            meta = "same" if same_infotext(ref, out) else "DIFFERENT"
            gr, sr, dr = _times(log_ref)
            go, so, do = _times(log_ours)
            rows.append((smp, rng, p, gr, so, sr, do, dr, go, t_ref, t_ours))
            print(f"{smp:>10} {rng:>5}  PSNR {p:6.2f} dB  infotext {meta}   sampling sdrt {so:7.2f}s / sd-cli {sr:7.2f}s   "
                  f"decode {do:6.2f}s / {dr:6.2f}s   generate {go:7.2f}s / {gr:7.2f}s   process {t_ours:7.1f}s / "
                  f"{t_ref:7.1f}s", flush=True)
    if a.markdown:
        print(f"\n{tag}, {w}x{h}, {a.steps} steps, cfg {a.cfg_scale}, seed {a.seed}, --type f32, {a.threads} threads\n")
        print("| sampler | rng | PSNR (dB) | sampling sdrt / sd-cli (s) | decode sdrt / sd-cli (s) | whole run sdrt / sd-cli (s) |")
        print("|---|---|---|---|---|---|")
        for smp, rng, p, gr, so, sr, do, dr, go, tr, to in rows:
            print(f"| {smp} | {rng} | {p:.2f} | {so:.1f} / {sr:.1f} | {do:.1f} / {dr:.1f} | {to:.1f} / {tr:.1f} |")
    worst = min(r[2] for r in rows)
    print(f"worst PSNR {worst:.2f} dB ({'PASS' if worst >= 40 else 'FAIL'} at 40 dB)")
    return 0 if worst >= 40 else 1


def _run_api(a, argv, out):
    """sdrt in-process: parse the same flags with sdrt's own parser, reuse the pipeline."""
    import io
    import logging

    from sdrt.cli.main import build_parser, params_from_args
    from sdrt.engine.generate import load_pipeline
    from sdrt.io.png import write_image
    args = build_parser().parse_args(argv + ["-o", out])
    mp, gp = params_from_args(args)
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    logging.getLogger("sdrt").addHandler(h)
    logging.getLogger("sdrt").setLevel(logging.INFO)
    try:
        t0 = time.time()
        pipe = load_pipeline(**{k: getattr(mp, k) for k in ("model", "type", "threads")})
        r = pipe.generate(gp, show_progress=False, rng=mp.rng, sampler_rng=mp.sampler_rng)[0]
        write_image(out, r.image, r.parameters)
        return time.time() - t0, buf.getvalue()
    finally:
        logging.getLogger("sdrt").removeHandler(h)


if __name__ == "__main__":
    sys.exit(main())
