"""Full-size Flux.1-schnell (19 double + 38 single blocks) Q8_0 / Q4_0 and the full 24-block
T5-XXL Q8_0 on the CPU: sdrt against sd-cli, same files, same flags, same seed (issue 14's
done-means 5).

    python bench/bench_flux_cpu_full.py --dir /work/cache/flux_full --types q8_0,q4_0 --engines sdcli,sdrt

Files (tools/make_flux_checkpoint.py, see bench/README.md): flux-schnell-{q8_0,q4_0}.gguf,
t5xxl-q8_0.gguf, ae.safetensors, clip_l.safetensors. Flags: 256x256, `--steps 2`, `--cfg-scale 1`,
`-s 42`, `-t 2`, `--scheduler discrete` (that sd-cli build has no `flux` scheduler), a prompt of
exactly 255 T5 pieces (+ `</s>` = one 256-token chunk, Flux's T5 length).

Read from each engine's own log:
- conditioning: "get_learned_condition completed, taking X s" (CLIP-L + the 24-block T5 on 256 tokens);
- per step: "sampling completed, taking X s" / steps (the bench_flux_cpu.py figure), and the second
  step alone from the progress bar (both print sd.cpp's running average: step 2 = 2 a2 - a1), which
  leaves out sdrt's first touch of its lazily mapped weights (sd-cli reads them before sampling);
- peak RSS of the whole process (/usr/bin/time -v), wall time.
Each run is one process under /work/heavy.lock (taken per run), so no holder keeps it for long.
Images go to --out; PSNR of sdrt's image against sd-cli's of the same type (images of earlier
runs in --out included), and of `sdrt-exact` (SDRT_QGEMM=off: dequantize + BLAS) when it ran.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cpu_full import ROOT, bar_averages, psnr_lines, read_image, record, run, stage  # noqa: E402,F401

WORDS = ("a lovely cat sitting on a wooden windowsill at golden hour, soft light through lace curtains, "
         "detailed fur, green eyes, a small clay pot with basil, rain drops on the glass, a quiet street "
         "below with old brick houses, bicycles, a red awning, warm colors, shallow depth of field, film "
         "grain, painted in the style of a nineteenth century oil study").split()


def prompt_of(pieces: int = 255) -> str:
    """The shortest repetition of WORDS that tokenizes (sd.cpp's T5 style and HF's alike) to exactly
    `pieces` pieces."""
    from sdrt.models.te.t5_tokenizer import T5Tokenizer
    sd, hf = T5Tokenizer(style="sdcpp"), T5Tokenizer()
    words: list[str] = []
    i = 0
    while True:
        words.append(WORDS[i % len(WORDS)])
        i += 1
        text = " ".join(words)
        n = len(sd.tokenize(text))
        if n == pieces and len(hf.tokenize(text)) == pieces:
            return text
        if n > pieces:
            raise SystemExit(f"no prefix of the prompt words gives exactly {pieces} T5 pieces")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/work/cache/flux_full")
    ap.add_argument("--sdcli", default="/work/sdcli/sd-cli")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--engines", default="sdcli,sdrt")
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--out", default="/work/cache/flux_full/out")
    ap.add_argument("--results", default=None, help="append each run's figures to this JSON-lines file")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d = lambda f: os.path.join(a.dir, f)  # noqa: E731
    prompt = prompt_of(255)
    common = ["-p", prompt, "-W", "256", "-H", "256", "--cfg-scale", "1", "-s", "42", "-t", "2",
              "--scheduler", "discrete", "--steps", str(a.steps),
              "--vae", d("ae.safetensors"), "--clip_l", d("clip_l.safetensors"), "--t5xxl", d("t5xxl-q8_0.gguf")]
    sdrt = [sys.executable, "-m", "sdrt.cli.main"]
    # sdrt-exact: the dequantize + BLAS path (float32 activations), to tell the int8 activations'
    # share of an image difference from the rest
    engines = {"sdcli": ([a.sdcli], {}), "sdrt": (sdrt, {}), "sdrt-exact": (sdrt, {"SDRT_QGEMM": "off"})}
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}, load {os.getloadavg()[0]:.1f}; prompt: 255 T5 pieces + </s>")
    res: dict[tuple[str, str], dict] = {}
    for typ in a.types.split(","):
        for name in a.engines.split(","):
            img = os.path.join(a.out, f"{name}_{typ}.png")
            exe, extra = engines[name]
            cmd = [*exe, "--diffusion-model", d(f"flux-schnell-{typ}.gguf"), *common, "-o", img]
            log, rss, wall = run(cmd, dict(os.environ, PYTHONPATH=ROOT, **extra))
            with open(os.path.join(a.out, f"{name}_{typ}.log"), "w") as f:
                f.write(log)
            avg = bar_averages(log)
            r = {"engine": name, "type": typ, "cond": stage(log, "get_learned_condition"),
                 "per_step": stage(log, "sampling") / a.steps, "rss": rss, "wall": wall,
                 "step2": (2 * avg[2] - avg[1]) if 1 in avg and 2 in avg else float("nan"),
                 "time": time.strftime("%H:%M:%S")}
            res[(name, typ)] = r
            record(a.results, r)
            print(f"{name} {typ}: conditioning {r['cond']:.2f} s, per step {r['per_step']:.2f} s "
                  f"(step 2: {r['step2']:.2f} s), peak RSS {rss:.2f} GiB, wall {wall:.0f} s", flush=True)
    print()
    print("| engine | type | CLIP-L + T5-XXL 24 blocks, 256 tokens (s) | s/step (2-step mean) | step 2 (s) | peak RSS (GiB) | wall (s) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, typ), r in res.items():
        print(f"| {name} | {typ} | {r['cond']:.2f} | {r['per_step']:.2f} | {r['step2']:.2f} | {r['rss']:.2f} | {r['wall']:.0f} |")
    for typ in a.types.split(","):
        c = res.get(("sdcli", typ))
        for name in ("sdrt", "sdrt-exact"):
            s = res.get((name, typ))
            if s and c:
                print(f"{typ}: sd-cli / {name}: conditioning {c['cond'] / s['cond']:.2f}x, step "
                      f"{c['per_step'] / s['per_step']:.2f}x (step 2: {c['step2'] / s['step2']:.2f}x), "
                      f"RSS {name} / sd-cli {s['rss'] / c['rss']:.2f}")
        # the images of earlier runs in --out count too
        imgs = {n: read_image(os.path.join(a.out, f"{n}_{typ}.png")) for n in ("sdcli", "sdrt", "sdrt-exact")}
        for line in psnr_lines(imgs, (("sdrt", "sdcli"), ("sdrt-exact", "sdcli"), ("sdrt", "sdrt-exact"))):
            print(f"{typ}: {line}")

if __name__ == "__main__":
    main()
