"""SD1.5 512x512 and SDXL 1024x1024 on an NVIDIA GPU (issue 6): sdrt's CUDA backend vs
diffusers/PyTorch eager fp16 vs PyTorch compiled vs stable-diffusion.cpp's sd-cli CUDA build, in one run.

    python bench/bench_cuda_sd.py --arch sd15 [--sdcli PATH] [--engines sdrt,torch,compile,sdcli] [--steps 20]

Each engine runs in its own child process (so one's GPU memory pool never slows another) on
the same machine, one after the other:
* sdrt: the UNet of the random full-size checkpoint (tools/make_sd_checkpoint.py, made first
  when missing) called with backend "cuda0": one CFG step = one forward at batch 2 (cond +
  uncond), timed over --steps calls after 3 warm-up calls (the first call runs eagerly, the
  second captures the CUDA graph, the rest replay it); then the VAE decode of one latent.
* torch: diffusers' UNet2DConditionModel and AutoencoderKL with the same configs, fp16, its own
  random init, the same batch-2 forward, timed the same way with torch.cuda.synchronize().
* compile: the strongest PyTorch a GPU user would pick (the configuration of the shared
  torch_compile_peer.py): the same diffusers UNet in fp16, channels_last, fused QKV projections,
  torch.compile(mode="reduce-overhead", fullgraph=True) = inductor kernels replayed in CUDA graphs;
  timed the same way (its first call, mostly compilation, reported as first_call_s). Its VAE
  decode is the eager one (the issue's VAE bar is PyTorch eager).
* sdcli: `sd-cli --steps N --diffusion-fa` on the same checkpoint; its "sampling completed,
  taking X s" and "decode_first_stage completed, taking Y s" lines (sampling includes its
  per-step overheads, which is what a user sees as it/s).
Prints one table: it/s of the CFG step, VAE decode ms, the peak of each engine's own allocator
(torch.cuda.max_memory_allocated; sdrt's device allocator, weights and graphs: issue 18 done-means
3's "PyTorch eager's allocation") and sdrt's ratio to each peer.
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
from _cuda_timing import time_calls  # noqa: E402

ARCH = {
    "sd15": dict(size=512, ctx=768, adm=0, tflop=1.354),
    "sdxl": dict(size=1024, ctx=2048, adm=2816, tflop=13.5),
}


def inputs(arch):
    a = ARCH[arch]
    rng = np.random.default_rng(1)
    lat = a["size"] // 8
    x = rng.standard_normal((2, 4, lat, lat), dtype=np.float32)
    t = np.array([999.0, 999.0], np.float32)
    ctx = rng.standard_normal((2, 77, a["ctx"]), dtype=np.float32)
    y = rng.standard_normal((2, a["adm"]), dtype=np.float32) if a["adm"] else None
    z = rng.standard_normal((1, 4, lat, lat), dtype=np.float32)
    return x, t, ctx, y, z


def run_sdrt(arch, ckpt, steps):
    import sdrt.gpu  # noqa: F401  (registers cuda0: the models alone do not)
    from sdrt.io import open_model
    from sdrt.ops import api as F
    from sdrt.ops.tensor import Tensor
    from sdrt.models.diffusion.unet import UNetModel
    from sdrt.models.vae.autoencoder_kl import AutoencoderKL
    x, t, ctx, y, z = inputs(arch)
    mf = open_model(ckpt)
    unet = UNetModel(mf.tensors)
    t0 = time.perf_counter()
    unet(x, t, ctx, y, backend="cuda0")
    first = time.perf_counter() - t0
    step = time_calls(lambda: unet(x, t, ctx, y, backend="cuda0"), steps)["step_s"]
    vae = AutoencoderKL(mf.tensors)
    graph = F.Graph({"img": vae.decode_graph(Tensor.from_numpy(z))})  # built once: replayed
    dec = time_calls(lambda: graph.run("cuda0"), 5)["step_s"]
    from sdrt.ops.backend import get_backend
    peak = get_backend("cuda0").memory_stats()["peak"]     # sdrt's allocator: weights + graphs + scratch
    return dict(step_s=step, first_call_s=first, decode_s=dec, peak_alloc_mib=peak / 2**20)


def torch_unet(arch):
    """diffusers' UNet2DConditionModel with the arch's config (random init, on the CPU)."""
    from diffusers import UNet2DConditionModel
    if arch == "sd15":
        unet = UNet2DConditionModel(cross_attention_dim=768)
    else:
        unet = UNet2DConditionModel(
            sample_size=128, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(320, 640, 1280), layers_per_block=2, transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816)
    return unet


def torch_vae():
    """diffusers' AutoencoderKL with the SD VAE's config (random init, on the CPU)."""
    from diffusers import AutoencoderKL
    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4)


def torch_inputs(arch, torch, dev="cuda", dt=None):
    """inputs(arch) as torch tensors: (x, t, ctx, the UNet's added kwargs, z)."""
    x, t, ctx, y, z = (None if v is None else torch.from_numpy(v).to(dev, dt or torch.float16) for v in inputs(arch))
    extra = {} if y is None else {"added_cond_kwargs": {"text_embeds": y[:, :1280], "time_ids": y[:, 1280:1286]}}
    return x, t, ctx, extra, z


def fuse_qkv(unet) -> None:
    """diffusers' fused QKV projections, as the compiled peer uses them (where this diffusers has them)."""
    try:
        unet.fuse_qkv_projections()
    except Exception as e:  # noqa: BLE001  (a peer option; the bench goes on without it)
        print(f"no fused QKV projections: {e}", flush=True)


def run_torch(arch, steps, compiled=False):
    import torch
    dev, dt = "cuda", torch.float16
    unet = torch_unet(arch).to(dev, dt).eval()
    if compiled:
        unet = unet.to(memory_format=torch.channels_last)
        fuse_qkv(unet)
        f = torch.compile(unet, mode="reduce-overhead", fullgraph=True)
    else:
        f = unet
    vae = torch_vae().to(dev, dt).eval()
    x, t, ctx, extra, z = torch_inputs(arch, torch, dev, dt)
    if compiled:
        x = x.to(memory_format=torch.channels_last)

    @torch.no_grad()
    def step():
        f(x, t, encoder_hidden_states=ctx, **extra)

    @torch.no_grad()
    def dec():
        vae.decode(z)

    timed = time_calls(step, steps, torch.cuda.synchronize)    # its first call compiles
    return dict(step_s=timed["step_s"], first_call_s=timed["first_call_s"],
                decode_s=time_calls(dec, 5, torch.cuda.synchronize)["step_s"], torch=torch.__version__,
                peak_alloc_mib=torch.cuda.max_memory_allocated() / 2**20)


def run_sdcli(arch, ckpt, steps, sdcli):
    size = str(ARCH[arch]["size"])
    cmd = [sdcli, "-m", ckpt, "-p", "a lovely cat", "-W", size, "-H", size, "--steps", str(steps),
           "-s", "42", "--diffusion-fa", "-o", f"/tmp/bench_cuda_{arch}_sdcli.png"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    smp = re.search(r"sampling completed, taking ([0-9.]+)s", p.stdout)
    dec = re.search(r"decode_first_stage completed, taking ([0-9.]+)s", p.stdout)
    if p.returncode or not smp:
        raise SystemExit(f"sd-cli failed ({p.returncode}):\n{p.stdout[-3000:]}")
    return dict(step_s=float(smp.group(1)) / steps, decode_s=float(dec.group(1)) if dec else float("nan"))


def child(a):
    if a.engine == "sdrt":
        r = run_sdrt(a.arch, a.ckpt, a.steps)
    elif a.engine in ("torch", "compile"):
        r = run_torch(a.arch, a.steps, compiled=a.engine == "compile")
    else:
        r = run_sdcli(a.arch, a.ckpt, a.steps, a.sdcli)
    print("RESULT " + json.dumps(r), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=tuple(ARCH), default="sd15")
    ap.add_argument("--ckpt", default=None, help="default /tmp/<arch>_rand_f16.safetensors, made when missing")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--engines", default="sdrt,torch,compile,sdcli")
    ap.add_argument("--sdcli", default=None)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.ckpt = a.ckpt or f"/tmp/{a.arch}_rand_f16.safetensors"
    if a.engine:
        return child(a)
    if not os.path.exists(a.ckpt):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_sd_checkpoint.py"), "--arch", a.arch,
                        "-o", a.ckpt], check=True)
        print(f"made {a.ckpt} in {time.perf_counter() - t0:.0f} s", flush=True)
    res = {}
    for eng in a.engines.split(","):
        if eng == "sdcli" and not a.sdcli:
            continue
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--engine", eng, "--arch", a.arch,
                            "--ckpt", a.ckpt, "--steps", str(a.steps), "--sdcli", a.sdcli or ""],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"{eng} failed ({p.returncode}):\n{p.stdout[-4000:]}", flush=True)
            continue
        res[eng] = json.loads(line[-1][7:])
        print(f"{eng}: {res[eng]}", flush=True)
    tf = ARCH[a.arch]["tflop"]
    print(f"\n{a.arch} {ARCH[a.arch]['size']}x{ARCH[a.arch]['size']}, CFG step = batch-2 UNet forward "
          f"({tf} TFLOP), {a.steps} timed steps\n")
    print("| engine | it/s | ms per step | TFLOP/s | VAE decode ms | peak allocated MiB | first call s "
          "| sdrt it/s / engine it/s |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    s = res.get("sdrt", {}).get("step_s")
    for eng, r in res.items():
        ratio = f"{r['step_s'] / s:.2f}" if s else "-"
        peak = f"{r['peak_alloc_mib']:.0f}" if "peak_alloc_mib" in r else "-"     # sd-cli: not reported
        first = f"{r['first_call_s']:.2f}" if "first_call_s" in r else "-"       # compile: compilation
        print(f"| {eng} | {1 / r['step_s']:.2f} | {r['step_s'] * 1e3:.1f} | {tf / r['step_s']:.0f} | "
              f"{r['decode_s'] * 1e3:.0f} | {peak} | {first} | {ratio} |")


if __name__ == "__main__":
    main()
