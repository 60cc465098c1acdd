"""Every CUDA kernel of one sdrt UNet (or Flux) forward on cuda0, timed by CUPTI (GPU only; needs PyTorch).

    python bench/profile_cuda_kernels.py [--arch sdxl|sd15] [--ckpt FILE] [--rows 45] [--torch]
    python bench/profile_cuda_kernels.py --arch vae15|vaexl [--torch]
    python bench/profile_cuda_kernels.py --arch flux --ckpt FLUX_TRANSFORMER_FILE [--torch]
    python bench/profile_cuda_kernels.py --arch esrgan [--torch]

One CFG step (batch-2 UNet forward at 1024x1024 for SDXL, 512x512 for SD1.5) is run until its
CUDA graph replays, then once more under torch.profiler with CUDA activities: CUPTI traces the
whole process, so sdrt's own kernels (PyCUDA launches, graph replays) and cuBLAS's appear by
name with their GPU time — unlike SDRT_DEBUG=2, whose per-node event times of an eager run
include the gaps while Python launches the next node. Without --ckpt the weights are random
arrays in host memory, registered as weights (resident, as a checkpoint's); --lora RANK applies
bench_lora.py's kohya LoRA of that rank at run time. Flux: the DiT of a transformer file
(tools/make_flux_checkpoint.py, any depth) on bench_cuda_flux.py's 1024x1024 inputs; --torch also
profiles diffusers' FluxTransformer2DModel (bf16, same depth) for the kernel-by-kernel comparison.
ESRGAN: bench_esrgan.py's random RealESRGAN_x4plus-shaped RRDBNet (f16 weights) on a 512x512
image, whole; --torch also profiles the plain-torch RRDBNet in fp16.
sd15/sdxl --torch: also the diffusers UNet of bench_cuda_sd.py's "compile" engine (fp16,
channels_last, fused QKV, torch.compile's inductor kernels: mode "default", the kernels that
"reduce-overhead" replays in its CUDA graphs) and eager, each one forward.
vae15/vaexl: the VAE decode of a 64x64 / 128x128 latent (SD1.5 512x512 / SDXL 1024x1024) through
the random checkpoint's decoder, replayed as bench_cuda_sd.py times it; --torch also diffusers'
AutoencoderKL decode in fp16, eager.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # esrgan_weights
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin
import sdrt.gpu  # noqa: E402,F401  registers cuda0 (models used without the engine do not)

import numpy as np  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=("sdxl", "sd15", "flux", "esrgan", "vae15", "vaexl"), default="sdxl")
    ap.add_argument("--torch", action="store_true", help="profile the PyTorch peer's kernels too")
    ap.add_argument("--ckpt", default=None, help="checkpoint to take the UNet from (default: random weights)")
    ap.add_argument("--rows", type=int, default=45)
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="sd15/sdxl: with bench_lora.py's kohya LoRA of this rank applied at_runtime")
    a = ap.parse_args()
    import torch
    from sdrt.models.diffusion.unet import UNetConfig, UNetModel
    torch.zeros(1, device="cuda")  # torch's context first: the primary context sdrt then shares
    if a.arch == "flux":
        return profile_flux(a, torch)
    if a.arch == "esrgan":
        return profile_esrgan(a, torch)
    if a.arch.startswith("vae"):
        return profile_vae(a, torch)
    cfg = UNetConfig.preset("sdxl" if a.arch == "sdxl" else "sd1")
    if a.ckpt:
        from sdrt.io import open_model
        model = UNetModel(open_model(a.ckpt).tensors)
    else:
        from bench_unet import random_table
        from sdrt.ops.backend import get_backend
        table = random_table(cfg, np.float16)[0]
        get_backend("cuda0").register_weights(table)    # resident, as a checkpoint's weights
        if a.lora:
            import tempfile

            from bench_lora import kohya_lora
            from sdrt.engine.lora import LoraSpec, apply_loras
            from sdrt.models.common import RUNTIME_LORA
            with tempfile.TemporaryDirectory() as d:
                kohya_lora({k: v.ne[::-1] for k, v in table.items()}, a.lora, os.path.join(d, "l.safetensors"))
                _, runtime = apply_loras(table, [LoraSpec(os.path.join(d, "l.safetensors"), 1.0)],
                                         "sd1" if a.arch == "sd15" else "sdxl", "at_runtime")
            for w, p in runtime.items():
                RUNTIME_LORA[w] = p
        model = UNetModel(table, config=cfg)
    from bench_cuda_sd import inputs
    x, t, ctx, y, _ = inputs(a.arch)  # the same CFG-step inputs bench_cuda_sd.py times
    for _ in range(4):  # eager, capture, replays
        model(x, t, ctx, y, backend="cuda0")
    t0 = time.perf_counter()
    model(x, t, ctx, y, backend="cuda0")
    print(f"{a.arch}: replayed forward {1e3 * (time.perf_counter() - t0):.1f} ms (wall, with input/output copies)")
    _print(a, torch, lambda: model(x, t, ctx, y, backend="cuda0"))
    if a.torch:
        del model
        profile_torch_unet(a, torch)


def _print(a, torch, fn, title=None):
    """CUPTI's per-kernel table of one call of fn."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    if title:
        print(title)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=80))


def profile_torch_unet(a, torch):
    from bench_cuda_sd import fuse_qkv, torch_inputs, torch_unet
    x, t, ctx, extra, _ = torch_inputs(a.arch, torch)
    unet = torch_unet(a.arch).to("cuda", torch.float16).eval().to(memory_format=torch.channels_last)
    fuse_qkv(unet)
    x = x.to(memory_format=torch.channels_last)
    for name, f in (("eager", unet), ("compiled", torch.compile(unet, fullgraph=True))):
        with torch.no_grad():
            t0 = time.perf_counter()
            for _ in range(3):
                f(x, t, encoder_hidden_states=ctx, **extra)
            torch.cuda.synchronize()
            print(f"torch {name}: 3 warm-up forwards {time.perf_counter() - t0:.1f} s")
            _print(a, torch, lambda: f(x, t, encoder_hidden_states=ctx, **extra), f"torch {name} (channels_last, fused QKV):")


def profile_vae(a, torch):
    from bench_cuda_sd import inputs
    from sdrt.io import open_model
    from sdrt.models.vae.autoencoder_kl import AutoencoderKL
    from sdrt.ops import api as F
    from sdrt.ops.tensor import Tensor
    arch = "sd15" if a.arch == "vae15" else "sdxl"
    z = inputs(arch)[4]
    vae = AutoencoderKL(open_model(a.ckpt or f"/tmp/{arch}_rand_f16.safetensors").tensors)
    graph = F.Graph({"img": vae.decode_graph(Tensor.from_numpy(z))})
    for _ in range(4):
        graph.run("cuda0")
    t0 = time.perf_counter()
    graph.run("cuda0")
    print(f"{a.arch}: replayed decode {1e3 * (time.perf_counter() - t0):.1f} ms (wall, with the download)")
    _print(a, torch, lambda: graph.run("cuda0"))
    if a.torch:
        from bench_cuda_sd import torch_vae
        tv = torch_vae().to("cuda", torch.float16).eval()
        zt = torch.from_numpy(z).to("cuda", torch.float16)
        with torch.no_grad():
            for _ in range(3):
                tv.decode(zt)
            _print(a, torch, lambda: tv.decode(zt), "torch eager decode:")


def profile_flux(a, torch):
    from types import SimpleNamespace

    from sdrt.io import open_model
    from sdrt.models.diffusion.flux import FluxModel
    import bench_cuda_flux as bf
    model = FluxModel(open_model(a.ckpt).tensors, prefix="")
    args = (*bf.inputs(1024, 512), )
    for _ in range(4):
        model(*args, backend="cuda0")
    t0 = time.perf_counter()
    model(*args, backend="cuda0")
    cfg = model.config
    print(f"flux {cfg.depth}+{cfg.depth_single_blocks} blocks: replayed forward {1e3 * (time.perf_counter() - t0):.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        model(*args, backend="cuda0")
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=80))
    if a.torch:
        del model
        ns = SimpleNamespace(size=1024, txt=512, depth=cfg.depth, single_depth=cfg.depth_single_blocks, steps=3,
                             backend="cuda0")
        print("diffusers:", bf.run_torch(ns, False))
        step = bf.LAST_TORCH_STEP
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            step()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=80))


def profile_esrgan(a, torch):
    from bench_esrgan import torch_rrdbnet
    from esrgan_weights import basicsr_state
    from sdrt.models.esrgan import RRDBNet
    from sdrt.ops.backend import as_weight
    from sdrt.ops.tensor import Tensor
    sd = basicsr_state(0, 64, 32, 23, 4, last_bias=0.5)
    x = np.random.default_rng(0).random((1, 3, 512, 512), dtype=np.float32)
    net = RRDBNet({k: Tensor.from_numpy(as_weight(v.astype(np.float16)), name=k) for k, v in sd.items()})
    for _ in range(3):
        net(x, backend="cuda0")
    t0 = time.perf_counter()
    net(x, backend="cuda0")
    print(f"esrgan f16: replayed forward {1e3 * (time.perf_counter() - t0):.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        net(x, backend="cuda0")
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=80))
    if a.torch:
        torch.backends.cudnn.benchmark = True
        m = torch_rrdbnet(sd, 23).cuda().half()
        xt = torch.from_numpy(x).cuda().half()
        with torch.no_grad():
            for _ in range(3):
                m(xt)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                m(xt)
                torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=80))


if __name__ == "__main__":
    main()
