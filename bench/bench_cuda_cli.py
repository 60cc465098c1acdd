"""The whole CLI of every DiT family on an NVIDIA GPU (issues 15, 20; Flux of issue 14): sdrt's
`python -m sdrt.cli.main --backend cuda0` vs sd-cli's CUDA build (`--diffusion-fa`), the same
full-size random files, prompt, seed, size, steps, cfg and sampler, in one run.

    python bench/bench_cuda_cli.py --sdcli /tmp/sdcli/sd-cli [--family sd35l,zimage,qwen,flux]
        [--engines sdrt,sdcli[,sdrt-vram]] [--dir /tmp/cli] [--size 1024] [--steps N] [--jobs 16]
        [--budget S] [--json out.json]
    # CPU smoke run (tests/test_bench_cuda_cli.py): reduced files, the CPU sd-cli
    python bench/bench_cuda_cli.py --backend cpu --sdcli /work/sdcli/sd-cli --family sd35l \\
        --sd3-variant sd3.5-medium --depth 24 --size 128 --steps 2 --threads 2

Families and what each run gets (sd-cli 0.4.7's defaults for a DiT: euler over `discrete`, flow
shift 3 / Flux's 1.15, passed explicitly to both so neither side picks another default):
  sd35l   SD3.5 Large (8.1 B, tools/make_sd3_checkpoint.py; CLIP-L, bigG, T5-XXL 24 blocks, the
          16-channel VAE), 20 steps, cfg 4.5 (docs/sd3.md), empty negative prompt
  zimage  Z-Image-Turbo (6.15 B, tools/make_zimage_checkpoint.py --full; Qwen3-4B, the Flux AE),
          8 steps, cfg 1
  qwen    Qwen-Image (20.4 B, tools/make_qwen_image_checkpoint.py --full; Qwen2.5-VL-7B's text
          stack, the Wan-2.1 VAE), 20 steps, true CFG 2.5 (sd.cpp's docs/qwen_image.md)
  flux    Flux.1-dev (11.9 B, tools/make_flux_checkpoint.py; CLIP-L, T5-XXL, ae), 20 steps, cfg 1,
          guidance 3.5
  sd15    SD1.5 at 512x512, sdxl SDXL at 1024x1024 (issue 18's whole command): one F16 checkpoint
          (tools/make_sd_checkpoint.py), 20 steps, cfg 7; no reduced form (--depth is ignored)
Files are BF16 (the released type; the VAEs as the makers write them), written into
DIR/<family>-<shape>/ with --jobs processes when missing, and that folder is deleted after the
family unless --keep (the H200's disk is 64 GB: Qwen-Image alone is 41 + 15 GB).
--depth N writes reduced files for a smoke run: N DiT blocks (Flux: N double + N single) and
--te-depth (default N) text-encoder layers (T5 blocks, LLM layers; Qwen's LLM FFN 512). What sd-cli 0.4.7 loads reduced:
its MMDiT's width is 64 x depth with depth >= 24 (so SD3 needs `--sd3-variant sd3.5-medium --depth
24`, or the full sd3.5-large), its T5 has 24 blocks unless built with bench/build_sdcli_cpu.sh's
T5-depth patch, and its Z-Image DiT is fixed at 30 + 2 layers of 3840 unless built with
bench/patch_sdcli_zimage.py; Flux and Qwen-Image count their blocks.

Engines, each its own process, one after the other; the parent polls nvidia-smi every 0.1 s for
its peak memory above the idle baseline ('-' without nvidia-smi):
  sdrt       python -m sdrt.cli.main ... --backend BACKEND
  sdrt-vram  the same with --max-vram GIB (--max-vram, default 8) and --vram-args
  sdcli      SDCLI ... --diffusion-fa (--sdcli-args: sd-cli's fast attention on CUDA; nothing else:
             --vae-tiling / --offload-to-cpu trade speed for memory)
Reported per engine (--runs N: the last of N runs of its command, the first's wall time beside it):
sampling s/step (each log's "sampling completed, taking Xs" / steps), the whole command's wall
time (to the process's end), the time to its "N/N images saved" line (the PNGs written: issue 18's
"process start to PNG written", without the process's teardown), the time from the command's start to its first step's progress line, the stage times both log (loading tensors, get_learned_condition,
decode_first_stage, generate_image), the peak GPU MiB and the PSNR of each sdrt image against
sd-cli's. A markdown table per family; ratio = sd-cli s/step / engine s/step (> 1: faster than sd-cli).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cuda_timing import GpuPeak  # noqa: E402

TOOLS = os.path.join(ROOT, "tools")
PROMPT = "a photograph of a red fox in fresh snow, morning light"
SEED = 42
STAGES = ("loading tensors", "get_learned_condition", "sampling", "decode_first_stage", "generate_image")
STAGE_RE = re.compile(r"(loading tensors|get_learned_condition|sampling|decode_first_stage|generate_image) "
                      r"completed,? (?:taking|in) ([0-9.]+)s")
FAMILIES = {   # title, steps, cfg args
    "sd35l": ("SD3.5 Large", 20, ["--cfg-scale", "4.5"]),
    "zimage": ("Z-Image-Turbo", 8, ["--cfg-scale", "1"]),
    "qwen": ("Qwen-Image", 20, ["--cfg-scale", "2.5"]),
    "flux": ("Flux.1-dev", 20, ["--cfg-scale", "1", "--guidance", "3.5"]),
    "sd15": ("SD1.5", 20, ["--cfg-scale", "7"]),
    "sdxl": ("SDXL", 20, ["--cfg-scale", "7"]),
}
FIRST_STEP_RE = re.compile(r"\|\s*1/\d+ - ")   # the progress bar's first step (sd.cpp's and sdrt's)
SAVED_RE = re.compile(r"\d+/\d+ images saved")  # both log it (and flush) once the last image is written
ENGINES = ("sdrt", "sdrt-vram", "sdcli")


def tool(name, *args):
    return [sys.executable, os.path.join(TOOLS, name), *args]


def family_files(name, a):
    """(folder, {flag: path}, [(path, maker argv)]) of one family: the files sd-cli and sdrt read."""
    n, te, j = a.depth, a.te_depth or a.depth, ["--jobs", str(a.jobs)]
    if name == "sd35l":
        var = a.sd3_variant
        d = os.path.join(a.dir, f"sd35l-{var}-" + (f"d{n}-te{te}" if n else "full"))
        p = {f: os.path.join(d, f[2:] + ".safetensors") for f in ("--diffusion-model", "--vae", "--clip_l",
                                                                   "--clip_g", "--t5xxl")}
        sd3 = ["make_sd3_checkpoint.py", "--variant", var]
        makes = [(p["--diffusion-model"], tool(*sd3, "--component", "transformer", *j,
                                               *(["--depth", str(n)] if n else []))),
                 (p["--vae"], tool(*sd3, "--component", "vae")),
                 (p["--clip_l"], tool(*sd3, "--component", "clip_l")),
                 (p["--clip_g"], tool(*sd3, "--component", "clip_g", *j)),
                 (p["--t5xxl"], tool("make_flux_checkpoint.py", "--component", "t5xxl", "--t5-depth",
                                     str(te or 24), *j))]
    elif name == "zimage":
        d = os.path.join(a.dir, "zimage-" + (f"d{n}-te{te}" if n else "full"))
        p = {"--diffusion-model": os.path.join(d, "zimage-bf16.safetensors"),
             "--llm": os.path.join(d, "qwen3-bf16.safetensors"), "--vae": os.path.join(d, "ae.safetensors")}
        size = ["--layers", str(n), "--llm-layers", str(te)] if n else ["--full"]
        # one maker call writes the three (skipped as a whole when the DiT is there)
        makes = [(p["--diffusion-model"], tool("make_zimage_checkpoint.py", "-o", d + ".part", "--type", "bf16",
                                               "--vae", *size, *j))]
    elif name == "qwen":
        d = os.path.join(a.dir, "qwen-" + (f"d{n}-te{te}" if n else "full"))
        dit = "dit-bf16.safetensors" if a.dit_type == "bf16" else f"dit-{a.dit_type}.gguf"
        p = {"--diffusion-model": os.path.join(d, dit),
             "--llm": os.path.join(d, "llm-bf16.safetensors"), "--vae": os.path.join(d, "vae.safetensors")}
        size = ["--depth", str(n), "--llm-layers", str(te), "--llm-ffn", "512"] if n else ["--full"]
        mk = "make_qwen_image_checkpoint.py"
        makes = [(p["--diffusion-model"], tool(mk, "--component", "transformer", "--type", a.dit_type, *size, *j)),
                 (p["--llm"], tool(mk, "--component", "llm", "--type", "bf16", *size, *j)),
                 (p["--vae"], tool(mk, "--component", "vae"))]
    elif name in ("sd15", "sdxl"):      # one checkpoint (F16, the UNet, VAE and CLIPs); no reduced form
        d = os.path.join(a.dir, f"{name}-full")
        p = {"--model": os.path.join(d, f"{name}-f16.safetensors")}
        makes = [(p["--model"], tool("make_sd_checkpoint.py", "--arch", name))]
    else:
        d = os.path.join(a.dir, "flux-" + (f"d{n}-te{te}" if n else "full"))
        p = {f: os.path.join(d, f[2:] + ".safetensors") for f in ("--diffusion-model", "--vae", "--clip_l", "--t5xxl")}
        mf = "make_flux_checkpoint.py"
        makes = [(p["--diffusion-model"], tool(mf, "--variant", "dev", *j,
                                               *(["--depth", str(n), "--single-depth", str(n)] if n else []))),
                 (p["--vae"], tool(mf, "--component", "vae")),
                 (p["--clip_l"], tool("make_sd_checkpoint.py", "--component", "clip_l")),
                 (p["--t5xxl"], tool(mf, "--component", "t5xxl", "--t5-depth", str(te or 24), *j))]
    return d, p, makes


def make_files(name, a):
    """Writes the family's missing files; False when a maker failed or the budget ran out."""
    d, paths, makes = family_files(name, a)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):      # what a maker cut by a budget left (its temporary files)
        if f.endswith(".part"):
            os.remove(os.path.join(d, f))
    shutil.rmtree(d + ".part", ignore_errors=True)
    for path, argv in makes:
        if os.path.exists(path):
            continue
        left = a.deadline - time.monotonic()
        if left < 30:
            print(f"{name}: {left:.0f} s of --budget left, files not made", flush=True)
            return False
        t0 = time.perf_counter()
        zimage = name == "zimage"    # its maker writes a folder: made aside, moved in
        out = d + ".part" if zimage else path + ".part"
        cmd = argv if zimage else [*argv, "-o", out]
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=None if left == float("inf") else left)
        except subprocess.TimeoutExpired:
            print(f"{name}: making {os.path.basename(path)} cut by --budget", flush=True)
            return False
        if p.returncode:
            print(f"{name}: making {os.path.basename(path)} failed ({p.returncode}):\n{p.stdout[-3000:]}", flush=True)
            return False
        if zimage:
            for f in os.listdir(out):
                os.replace(os.path.join(out, f), os.path.join(d, f))
            os.rmdir(out)
        else:
            os.replace(out, path)
        print(f"{name}: made {os.path.basename(path)} ({os.path.getsize(path) / 2**30:.2f} GiB) "
              f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return True


def size_of(name, a):
    return a.size or (512 if name == "sd15" else 1024)


def run_args(name, a, paths, out):
    steps = a.steps or FAMILIES[name][1]
    files = [x for kv in paths.items() for x in kv]
    size = str(size_of(name, a))
    return [*files, "-p", PROMPT, "-W", size, "-H", size, "--steps", str(steps),
            *FAMILIES[name][2], "--sampling-method", "euler", "--scheduler", "discrete", "-s", str(SEED),
            "-o", out, "-v", *(["-t", str(a.threads)] if a.threads else [])]


def parse_log(text, steps):
    """{stage: seconds} of a run's log, and sampling s/step."""
    st = {}
    for m in STAGE_RE.finditer(text):
        st.setdefault(m.group(1), float(m.group(2)))
    r = dict(stages=st)
    if "sampling" in st:
        r["step_s"] = st["sampling"] / steps
    return r


def run_child(cmd, env, timeout):
    """(output, return code or a reason, wall s, s from start to the first sampling step's progress
    line or None, s from start to the "images saved" line or None): the child's output is read as it
    comes, so the first step and the moment the images are written are timed."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    chunks, first, saved = [], None, None
    while True:
        if time.perf_counter() - t0 > timeout:
            p.kill()
            p.wait()
            return b"".join(chunks).decode(errors="replace"), "timeout (--budget / --child-timeout)", \
                time.perf_counter() - t0, first, saved
        ready, _, _ = select.select([p.stdout], [], [], 0.5)
        if not ready:
            continue
        b = os.read(p.stdout.fileno(), 1 << 16)
        if not b:
            break
        chunks.append(b)
        tail = b"".join(chunks[-2:]).decode(errors="replace")
        if first is None and FIRST_STEP_RE.search(tail):
            first = time.perf_counter() - t0
        if saved is None and SAVED_RE.search(tail):
            saved = time.perf_counter() - t0
    rc = p.wait()
    return b"".join(chunks).decode(errors="replace"), rc, time.perf_counter() - t0, first, saved


def run_engine(name, a, eng, paths):
    """The engine's command --runs times (the first a warm-up of the page cache and the machine):
    the last run's figures, and the first's wall time and first step."""
    folder = os.path.dirname(next(iter(paths.values())))
    out = os.path.join(folder, f"{eng}.png")
    args = run_args(name, a, paths, out)
    if eng == "sdcli":
        cmd = [a.sdcli, *args, *a.sdcli_args.split()]
    else:
        cmd = [sys.executable, "-m", "sdrt.cli.main", *args, "--backend", a.backend, *a.sdrt_args.split()]
        if eng == "sdrt-vram":
            cmd += ["--max-vram", str(a.max_vram), *a.vram_args.split()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(ROOT), os.environ.get("PYTHONPATH", "")]))
    gpu = shutil.which("nvidia-smi") is not None
    runs = []
    for k in range(a.runs):
        left = a.deadline - time.monotonic()
        if left < 30:
            print(f"{name} {eng} run {k + 1} skipped: {left:.0f} s of --budget left", flush=True)
            break
        if os.path.exists(out):
            os.remove(out)
        base = GpuPeak.used() if gpu else 0
        mon = GpuPeak()
        if gpu:
            mon.start()
        text, rc, wall, first, saved = run_child(cmd, env, min(a.child_timeout, left))
        if a.save_logs:
            os.makedirs(a.save_logs, exist_ok=True)
            # one file per family and engine, the runs in turn (the device tool returns few files)
            with open(os.path.join(a.save_logs, f"{name}-{eng}.log"), "w" if k == 0 else "a") as f:
                f.write(f"==== run {k + 1} of {a.runs}, wall {wall:.2f} s\n$ {' '.join(cmd)}\n{text}\n")
        mon.stop.set()
        if gpu:
            mon.join()
        r = parse_log(text, a.steps or FAMILIES[name][1])
        if rc or "step_s" not in r or not os.path.exists(out):
            print(f"{name} {eng} failed ({rc}) after {wall:.0f} s:\n{text[-3000:]}", flush=True)
            break
        r.update(wall_s=wall, first_step_s=first, saved_s=saved, png=out,
                 peak_mib=(mon.peak - base) if gpu else None)
        print(f"{name} {eng} run {k + 1}: {json.dumps(r)}", flush=True)
        runs.append(r)
    if not runs:
        return None
    r = runs[-1]
    r.update(runs=len(runs), first_wall_s=runs[0]["wall_s"], first_run_first_step_s=runs[0]["first_step_s"])
    return r


def psnr(p, q):
    from PIL import Image

    from sdrt.io.images import psnr as psnr_of
    x, y = (np.asarray(Image.open(f).convert("RGB")) for f in (p, q))
    return psnr_of(x, y, peak=255.0) if x.shape == y.shape else None


def bench_family(name, a):
    res = {}
    if not make_files(name, a):
        return res
    d, paths, _ = family_files(name, a)
    for eng in a.engines:
        r = run_engine(name, a, eng, paths)
        if r is not None:
            res[eng] = r
    ref = res.get("sdcli", {}).get("png")
    for eng, r in res.items():
        if eng != "sdcli" and ref:
            r["psnr_vs_sdcli"] = psnr(r["png"], ref)
        if eng == "sdrt-vram" and "sdrt" in res:     # the budgeted run's image against the resident one
            r["psnr_vs_sdrt"] = psnr(r["png"], res["sdrt"]["png"])
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)
    return res


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def table(name, a, res):
    steps = a.steps or FAMILIES[name][1]
    title, _, cfg = FAMILIES[name]
    ref = res.get("sdcli", {}).get("step_s")
    lines = [f"\n{title}{' (reduced: depth %d)' % a.depth if a.depth else ''}, {size_of(name, a)}px, {steps} steps, "
             f"{' '.join(cfg)}, euler/discrete, seed {SEED}, backend {a.backend}; peak = nvidia-smi memory.used "
             "above idle; ratio = sd-cli s/step / engine s/step\n",
             "| engine | s/step | whole command s (first run) | images saved at s | first step at s | load s "
             "| conditioning s | sampling s | decode s | peak GPU MiB | PSNR vs sd-cli dB "
             "| sd-cli s/step / engine s/step | sd-cli wall / engine wall | sd-cli saved / engine saved |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref_wall = res.get("sdcli", {}).get("wall_s")
    ref_saved = res.get("sdcli", {}).get("saved_s")
    for eng, r in res.items():
        st = r["stages"]
        ratio = ref / r["step_s"] if ref and r["step_s"] else None
        wall = f"{r['wall_s']:.1f}" + (f" ({r['first_wall_s']:.1f})" if r["runs"] > 1 else "")
        saved = r.get("saved_s")
        lines.append(f"| {eng} | {r['step_s']:.3f} | {wall} | {fmt(saved)} | {fmt(r['first_step_s'])} | "
                     f"{fmt(st.get('loading tensors'))} | {fmt(st.get('get_learned_condition'))} | "
                     f"{fmt(st.get('sampling'))} | {fmt(st.get('decode_first_stage'))} | {fmt(r['peak_mib'], 'd')} | "
                     f"{fmt(r.get('psnr_vs_sdcli'))} | {fmt(ratio)} | "
                     f"{fmt(ref_wall / r['wall_s'] if ref_wall else None)} | "
                     f"{fmt(ref_saved / saved if ref_saved and saved else None)} |")
    if "psnr_vs_sdrt" in res.get("sdrt-vram", {}):
        lines.append(f"\nsdrt-vram image vs sdrt's: {fmt(res['sdrt-vram']['psnr_vs_sdrt'])} dB (inf: identical)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="sd35l,zimage,qwen,flux", help="any of " + ", ".join(FAMILIES))
    ap.add_argument("--engines", default="sdrt,sdcli", help="any of " + ", ".join(ENGINES))
    ap.add_argument("--sdcli", default="", help="the sd-cli binary (the sdcli engine is left out without it)")
    ap.add_argument("--sdcli-args", default="--diffusion-fa", help="what sd-cli gets besides the common flags")
    ap.add_argument("--backend", default="cuda0", help="sdrt's backend (cpu: a smoke run without a GPU)")
    ap.add_argument("--max-vram", default="8", help="GiB of the sdrt-vram engine's --max-vram")
    ap.add_argument("--dit-type", default="bf16", help="Qwen-Image's DiT file: bf16 (safetensors) or a quantized "
                    "type (a GGUF as sd-cli's -M convert writes it; issue 20: q4_K with --max-vram 12)")
    ap.add_argument("--sdrt-args", default="", help="more flags of both sdrt engines (e.g. --log-level debug: "
                    "the start-up timeline)")
    ap.add_argument("--save-logs", default="", help="a folder for every run's whole log (FAMILY-ENGINE.log, the runs in turn)")
    ap.add_argument("--vram-args", default="", help="more flags of the sdrt-vram engine (issue 18: "
                    "--offload-to-cpu with --max-vram 3 for SDXL)")
    ap.add_argument("--dir", default="/tmp/cli", help="where the files and images go")
    ap.add_argument("--size", type=int, default=0, help="image side (0: SD1.5 512, the others 1024)")
    ap.add_argument("--steps", type=int, default=0, help="sampling steps (0: the family's: 20, Z-Image 8)")
    ap.add_argument("--threads", type=int, default=0, help="-t of both CLIs (0: their default)")
    ap.add_argument("--depth", type=int, default=0, help="reduced files for a smoke run: N blocks / layers (0: full)")
    ap.add_argument("--te-depth", type=int, default=0, help="with --depth: text-encoder layers / T5 blocks "
                    "(0: --depth)")
    ap.add_argument("--sd3-variant", default="sd3.5-large", choices=("sd3.5-large", "sd3.5-medium", "sd3-medium"),
                    help="the sd35l family's shapes (sd3.5-medium --depth 24: the smallest sd-cli loads)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes of the file makers")
    ap.add_argument("--runs", type=int, default=1, help="runs of each engine's command; the last is reported "
                    "(2: after a warm-up run, as issue 18 compares), the first's wall time beside it")
    ap.add_argument("--keep", action="store_true", help="keep each family's files after its runs")
    ap.add_argument("--child-timeout", type=float, default=1800, help="seconds one engine's run may take")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: none); makers and "
                    "runs are cut at it and the tables are printed with what finished")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--make-only", action="store_true", help="write the families' missing files and stop (while "
                    "sd-cli builds; a later run with the same --dir / --depth finds them)")
    a = ap.parse_args(argv)
    fams = [f for f in a.family.split(",") if f]
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        raise SystemExit(f"--family: unknown {', '.join(bad)} (one of {', '.join(FAMILIES)})")
    if a.dit_type != "bf16" and fams != ["qwen"]:
        raise SystemExit(f"--dit-type {a.dit_type}: only for --family qwen")
    a.engines = [e for e in a.engines.split(",") if e]
    if set(a.engines) - set(ENGINES):
        raise SystemExit(f"--engines: one or more of {', '.join(ENGINES)}, not {a.engines}")
    if "sdcli" in a.engines and not (a.sdcli and os.access(a.sdcli, os.X_OK)):
        print(f"sdcli left out: --sdcli {a.sdcli!r} is not an executable", flush=True)
        a.engines.remove("sdcli")
    if a.size % 16:
        raise SystemExit("--size must be a multiple of 16")
    a.dir = os.path.abspath(a.dir)
    os.makedirs(a.dir, exist_ok=True)
    a.deadline = time.monotonic() + (a.budget or float("inf"))
    if a.make_only:
        for name in fams:
            make_files(name, a)
        return {}
    results = {}
    for name in fams:
        t0 = time.perf_counter()
        results[name] = bench_family(name, a)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    for name, res in results.items():
        print(table(name, a, res), flush=True)
    return results


if __name__ == "__main__":
    main()
