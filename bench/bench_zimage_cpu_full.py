"""Full-size Z-Image-Turbo (30 main + 2 noise + 2 context refiner layers, width 3840) Q4_K with the
full Qwen3-4B (36 layers) Q8_0 on the CPU: sdrt against sd-cli, same files, same flags, same seed
(issue 20's done-means 4: sdrt's s/step <= sd-cli's / 1.5 and peak RSS <= sd-cli's; the Qwen3-4B
encode of a 256-token prompt <= sd-cli's time).

    python bench/bench_zimage_cpu_full.py --engines sdcli,sdrt --results /work/cache/zimage_full/results.jsonl

Files (random weights, tools/make_zimage_checkpoint.py --full; bench/README.md has the commands) in
--dir (/work/cache/zimage_full): zimage-q4_K.gguf, qwen3-q8_0.gguf, ae.safetensors (the Flux AE:
Z-Image's VAE). sd-cli must be the build patched by bench/patch_sdcli_zimage.py (--sdcli,
/work/sdcli_zimage/out/sd-cli; with released shapes it behaves as the unpatched one). Flags: 256x256,
`--steps 3 --cfg-scale 1` (Turbo: one model call a step), euler over discrete (flow shift 3),
`-s 42`, `-t 2`, the weights' own types; a prompt of 248 Qwen pieces, which sd.cpp's Z-Image
template (`<|im_start|>user\\n` ... `<|im_end|>\\n<|im_start|>assistant\\n`, 8 more) makes the 256
tokens the LLM runs on (and the DiT's caption: 256, already a multiple of 32).

Read from each engine's own log (sdrt prints sd.cpp's lines; _cpu_full.py):
- encode: "get_learned_condition completed" (the 36-layer Qwen3-4B on 256 tokens; the VAE and DiT
  are not involved);
- per step: "sampling completed" / steps, and steps 2..n from the progress bar;
- peak RSS of the whole process (/usr/bin/time -v), wall time, GiB read from the disk.
--cold drops the files' pages from the page cache before each engine (posix_fadvise DONTNEED).
Engines: sdcli, sdrt, sdrt-exact (SDRT_QGEMM=off: dequantize + BLAS, float32 activations).
Each run is one process under /work/heavy.lock (taken per run, or around the whole script with
--no-lock). PSNR of the images against each other.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cpu_full import (LOCK, ROOT, add_run_args, after_first, disk_read_gib, evict, record, run, stage,  # noqa: E402
                       summary_lines)

WORDS = ("a lovely cat sitting on a wooden windowsill at golden hour, soft light through lace curtains, "
         "detailed fur, green eyes, a small clay pot with basil, rain drops on the glass, a quiet street "
         "below with old brick houses, bicycles, a red awning, warm colors, shallow depth of field, film "
         "grain, painted in the style of a nineteenth century oil study").split()


def prompt_of(tokens: int = 256) -> str:
    """The shortest repetition of WORDS whose Z-Image template encoding (sd.cpp's LLMEmbedder: the
    template parts and the prompt tokenized apart) is exactly `tokens` long."""
    from sdrt.models.te.qwen_tokenizer import ZIMAGE_TEMPLATE, QwenTokenizer
    tok = QwenTokenizer()
    words: list[str] = []
    while True:
        words.append(WORDS[len(words) % len(WORDS)])
        text = " ".join(words)
        n = len(tok.encode_template(ZIMAGE_TEMPLATE, text)[0])
        if n == tokens:
            return text
        if n > tokens:
            raise SystemExit(f"no prefix of the prompt words gives exactly {tokens} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/work/cache/zimage_full")
    ap.add_argument("--sdcli", default="/work/sdcli_zimage/out/sd-cli")
    ap.add_argument("--dit", default="zimage-q4_K.gguf")
    ap.add_argument("--llm", default="qwen3-q8_0.gguf")
    add_run_args(ap, "/work/cache/zimage_full/out")
    ap.add_argument("--cold", action="store_true",
                    help="drop the three files' pages from the page cache before each engine (a cold start: "
                         "sd-cli reads them before its timed stages, sdrt inside them)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d = lambda f: os.path.join(a.dir, f)  # noqa: E731
    common = ["-p", prompt_of(256), "-W", "256", "-H", "256", "--steps", str(a.steps), "--cfg-scale", "1",
              "--sampling-method", "euler", "--scheduler", "discrete", "-s", "42", "-t", "2",
              "--diffusion-model", d(a.dit), "--llm", d(a.llm), "--vae", d("ae.safetensors")]
    sdrt = [sys.executable, "-m", "sdrt.cli.main"]
    engines = {"sdcli": ([a.sdcli], {}), "sdrt": (sdrt, {}), "sdrt-exact": (sdrt, {"SDRT_QGEMM": "off"})}
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}, load {os.getloadavg()[0]:.1f}; prompt: 248 pieces + the "
          f"8-token template = 256 LLM tokens")
    res: dict[str, dict] = {}
    for name in a.engines.split(","):
        img = os.path.join(a.out, f"{name}{a.tag}.png")
        exe, extra = engines[name]
        if a.cold:
            evict([d(a.dit), d(a.llm), d("ae.safetensors")])
        log, rss, wall = run([*exe, *common, "-o", img], dict(os.environ, PYTHONPATH=ROOT, **extra),
                             None if a.no_lock else LOCK)
        with open(os.path.join(a.out, f"{name}{a.tag}.log"), "w") as f:
            f.write(log)
        n = a.steps
        r = {"engine": name, "steps": n, "encode": stage(log, "get_learned_condition"),
             "per_step": stage(log, "sampling") / n, "after_first": after_first(log, n),
             "decode": stage(log, "decode_first_stage"), "rss": rss, "wall": wall,
             "time": time.strftime("%H:%M:%S"), "load": os.getloadavg()[0], "tag": a.tag,
             "disk_read": disk_read_gib(log), "cold": a.cold}
        res[name] = r
        record(a.results, r)
        print(f"{name}: encode {r['encode']:.2f} s, per step {r['per_step']:.2f} s (steps 2..{n}: "
              f"{r['after_first']:.2f} s), decode {r['decode']:.2f} s, peak RSS {rss:.2f} GiB, wall {wall:.0f} s, "
              f"read from disk {r['disk_read']:.2f} GiB",
              flush=True)
    print()
    for line in summary_lines(res, a.steps, "encode", "Qwen3-4B encode, 256 tokens", a.out, a.tag, engines):
        print(line)


if __name__ == "__main__":
    main()
