"""The diffusion-transformer step of every DiT family on an NVIDIA GPU (issues 14, 15, 20): sdrt's
model vs diffusers' transformer (PyTorch bf16 eager and torch.compile), full size, SAME weights.

    python bench/bench_cuda_dit.py [--family flux,sd35l,zimage,qwen] [--engines sdrt,torch,compile]
                                   [--size 1024] [--steps 10] [--dir /tmp/dit] [--backend cuda0]
    python bench/bench_cuda_dit.py --backend cpu --depth 1 --size 128 --engines torch,sdrt   # smoke run, no GPU

Families (diffusers class, released config): flux = FluxTransformer2DModel, Flux.1-dev (19 + 38
blocks, guidance embedding; 512 text tokens, diffusers' default for dev); sd35l =
SD3Transformer2DModel, SD3.5 Large (38 blocks of 2432, QK RMS norm, pos_embed 192; 77 + 256 = 333
text tokens as diffusers' pipeline); zimage = ZImageTransformer2DModel, Z-Image-Turbo (30 + 2 + 2
layers of 3840; 256 caption tokens); qwen = QwenImageTransformer2DModel, Qwen-Image (60 blocks of
3072; 256 text tokens). 1024x1024 = a 128x128 latent = 4096 image tokens in each.

Weights, once per family: the first torch child builds diffusers' model on the device (bf16 on the
GPU, f32 on the CPU), fills every parameter from a seeded device generator (randomize: the same
numbers in every child, so the compile child regenerates them instead of reading) and streams the
state dict, diffusers names, BF16, into DIR/<family>.safetensors (sdrt.io.write_safetensors, one
tensor at a time; Qwen-Image is 41 GB: no second host copy). The sdrt child opens that file the
way `--diffusion-model` does (sdrt.engine.model_manager.load_models: name conversion, detection)
and builds the family's model through the registry (`Family.diffusion_model`), so the diffusers
name converters are part of what runs. The file is deleted after the family (--keep keeps it).

Each engine runs in its own child process; the parent polls nvidia-smi every 0.1 s for the child's
peak memory above the idle baseline. A step is one forward at batch 1 (a CFG step is two of them
in both engines); 3 warm-up calls (sdrt: eager, CUDA-graph capture, replay), then --steps timed.
Every child saves its output of the first call (sdrt's convention: [1, 16, h, w], Z-Image negated
as sd.cpp returns it) and the parent reports max|a - b| / max|b| against the torch eager output.
`--backend cpu` runs torch in float32 on the bf16-rounded weights and sdrt on the CPU: a smoke
run (tests/test_bench_cuda_dit.py) whose cross-check is float32-level.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cuda_timing import GpuPeak, time_calls  # noqa: E402
# diffusers' Flux / Qwen-Image cast the timestep (and Flux the guidance) to the model's bf16 and then
# scale by 1000 in bf16: sigma 0.5 (500) and guidance 4 (4000) are exact there, so sdrt, which takes
# them in float32, sees the same values and the cross-check compares like with like
SIGMA, GUIDANCE, SEED = 0.5, 4.0, 1234


@dataclass(frozen=True)
class DitFamily:
    title: str
    cls: str                        # diffusers class name
    config: dict                    # the released transformer/config.json
    depth_keys: tuple               # config keys of the block stacks (--depth / --depth-scale)
    txt: int                        # text tokens
    ctx_dim: int
    pooled: int = 0                 # pooled vector width (0: none)
    guidance: bool = False
    extra: dict = field(default_factory=dict)


FAMILIES = {
    "flux": DitFamily("Flux.1-dev", "FluxTransformer2DModel",
                      dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                           num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                           guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
                      ("num_layers", "num_single_layers"), 512, 4096, pooled=768, guidance=True),
    "sd35l": DitFamily("SD3.5 Large", "SD3Transformer2DModel",
                       dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                            num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
                            dual_attention_layers=()),
                       ("num_layers",), 333, 4096, pooled=2048),
    "zimage": DitFamily("Z-Image-Turbo", "ZImageTransformer2DModel",
                        dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                             n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                             cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
                             axes_lens=[1536, 512, 512]),
                        ("n_layers", "n_refiner_layers"), 256, 2560),
    "qwen": DitFamily("Qwen-Image", "QwenImageTransformer2DModel",
                      dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                           num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                           axes_dims_rope=(16, 56, 56)),
                      ("num_layers",), 256, 3584),
}


def family_config(name: str, a) -> dict:
    fam = FAMILIES[name]
    cfg = dict(fam.config)
    for k in fam.depth_keys:
        if a.depth_of.get(name) is not None:
            cfg[k] = a.depth_of[name]
        elif a.depth_scale != 1.0:
            cfg[k] = max(1, round(cfg[k] * a.depth_scale))
    return cfg


def inputs(name: str, a) -> dict:
    """The numpy inputs both engines get: x [1, 16, lat, lat], sigma, context, pooled, guidance."""
    fam = FAMILIES[name]
    rng = np.random.default_rng(SEED + 1)
    lat = a.size // 8
    return dict(x=rng.standard_normal((1, 16, lat, lat), dtype=np.float32),
                ctx=rng.standard_normal((1, fam.txt, fam.ctx_dim), dtype=np.float32),
                y=rng.standard_normal((1, fam.pooled), dtype=np.float32) if fam.pooled else None)


def qwen_ids(h: int, w: int, txt: int) -> np.ndarray:
    """The positions behind diffusers' QwenEmbedRope(scale_rope=True) for one image of h x w
    patches: text tokens at max(h/2, w/2) + i on every axis, image (0, row, col) centred. sdrt's own
    ids are sd.cpp's (another text spacing), so the cross-check feeds these to both engines."""
    r = np.concatenate([-np.arange(h - h // 2, 0, -1), np.arange(h // 2)])
    c = np.concatenate([-np.arange(w - w // 2, 0, -1), np.arange(w // 2)])
    img = np.zeros((h, w, 3), np.float32)
    img[..., 1], img[..., 2] = r[:, None], c[None, :]
    t = np.repeat((max(h // 2, w // 2) + np.arange(txt, dtype=np.float32))[:, None], 3, axis=1)
    return np.concatenate([t, img.reshape(-1, 3)]).astype(np.float32)


def weights_path(a, name):
    return os.path.join(a.dir, f"{name}.safetensors")


def out_path(a, name, engine):
    return os.path.join(a.dir, f"{name}-{engine}.npy")


# ---- the torch child -----------------------------------------------------------------------------

def randomize(model, device, seed=SEED):
    """Every parameter from one seeded generator on `device`, in name order: matrices and convs
    N(0, 1/fan_in), norm weights 1 + N(0, 0.2), biases and the rest N(0, 0.1) (pad tokens, ...);
    float buffers rounded to bf16 values. The same numbers in every process on the same device."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            if p.ndim >= 2:
                r /= math.sqrt(math.prod(p.shape[1:]))
            elif "norm" in name and name.endswith("weight"):
                r = 1 + 0.2 * r
            else:
                r *= 0.1
            p.copy_(r.to(torch.bfloat16).to(p.dtype))      # bf16 values, also in a float32 model
            del r
        for _, b in model.named_buffers():     # SD3's pos_embed: the file holds it in BF16
            if b.is_floating_point():
                b.copy_(b.to(torch.bfloat16).to(b.dtype))


def build_torch(name, a):
    import diffusers
    import torch
    dev, dt = ("cpu", torch.float32) if a.backend == "cpu" else ("cuda", torch.bfloat16)
    if a.torch_dtype != "auto":
        dt = dict(bf16=torch.bfloat16, f32=torch.float32)[a.torch_dtype]
    before = torch.get_default_dtype()
    torch.set_default_dtype(dt)      # built straight in bf16 on the device: no f32 copy of 20B params
    try:
        with torch.device(dev):
            m = getattr(diffusers, FAMILIES[name].cls)(**family_config(name, a)).eval()
    finally:
        torch.set_default_dtype(before)
    m.requires_grad_(False)
    randomize(m, dev)
    return m, dev, dt


def write_weights(m, path):
    """diffusers' state dict as a BF16 safetensors file, streamed one tensor at a time."""
    import torch
    from sdrt.io import write_safetensors
    from sdrt.io.writer import TensorPlan
    from sdrt.ops import dtypes
    bf16 = dtypes.get("BF16")
    plans = [TensorPlan(k, bf16, tuple(reversed(v.shape)) or (1,),
                        lambda v=v: v.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy())
             for k, v in m.state_dict().items()]
    write_safetensors(path + ".part", plans)
    os.replace(path + ".part", path)


def torch_call(name, m, dev, dt, a):
    """kwargs of one forward and the function that turns its result into sdrt's convention."""
    import torch
    fam, inp = FAMILIES[name], inputs(name, a)
    lat = a.size // 8
    T = lambda v, d=dt: torch.from_numpy(v).to(dev, d)   # noqa: E731
    hw = lat // 2

    def pack(x):        # [N, C, h, w] -> [N, (h/2)(w/2), 4C] (FluxPipeline._pack_latents)
        n, c = x.shape[:2]
        return x.view(n, c, hw, 2, hw, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, hw * hw, c * 4)

    def unpack(o):
        o = o.float()
        return o.view(1, hw, hw, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 16, lat, lat)

    x = T(inp["x"])
    if name == "flux":
        ids = torch.zeros(hw, hw, 3, device=dev)
        ids[..., 1] += torch.arange(hw, device=dev)[:, None]
        ids[..., 2] += torch.arange(hw, device=dev)[None, :]
        kw = dict(hidden_states=pack(x), encoder_hidden_states=T(inp["ctx"]), pooled_projections=T(inp["y"]),
                  timestep=torch.tensor([SIGMA], device=dev), guidance=torch.tensor([GUIDANCE], device=dev),
                  img_ids=ids.reshape(-1, 3),
                  txt_ids=torch.zeros(fam.txt, 3, device=dev), return_dict=False)
        return kw, lambda r: unpack(r[0])
    if name == "sd35l":
        kw = dict(hidden_states=x, encoder_hidden_states=T(inp["ctx"]), pooled_projections=T(inp["y"]),
                  timestep=torch.tensor([SIGMA * 1000], device=dev), return_dict=False)
        return kw, lambda r: r[0].float()
    if name == "zimage":   # diffusers' t runs 0 -> 1 (1 - sigma); sd.cpp's output is the negated velocity
        kw = dict(x=[x[0][:, None]], t=torch.tensor([1.0 - SIGMA], device=dev), cap_feats=[T(inp["ctx"])[0]],
                  return_dict=False)
        return kw, lambda r: -r[0][0][:, 0][None].float()
    kw = dict(hidden_states=pack(x), encoder_hidden_states=T(inp["ctx"]),
              timestep=torch.tensor([SIGMA], device=dev), img_shapes=[[(1, hw, hw)]], return_dict=False)
    return kw, lambda r: unpack(r[0])


def run_torch(name, a, engine):
    import torch
    t0 = time.perf_counter()
    m, dev, dt = build_torch(name, a)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    r = dict(build_s=time.perf_counter() - t0, params=sum(p.numel() for p in m.parameters()))
    path = weights_path(a, name)
    if engine == "make" or (engine == "torch" and a.write and not os.path.exists(path)):
        t0 = time.perf_counter()
        write_weights(m, path)
        r.update(write_s=time.perf_counter() - t0, file_gib=os.path.getsize(path) / 2**30)
        if engine == "make":
            return r
    kw, convert = torch_call(name, m, dev, dt, a)
    f = torch.compile(m) if engine == "compile" else m
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = {}

    @torch.no_grad()
    def step():
        o = f(**kw)
        if "y" not in out:
            out["y"] = convert(o).cpu().numpy()

    r.update(time_calls(step, a.steps, sync))
    np.save(out_path(a, name, engine), out["y"])
    r.update(torch=torch.__version__, finite=bool(np.isfinite(out["y"]).all()))
    if dev == "cuda":
        r["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return r


# ---- the sdrt child ------------------------------------------------------------------------------

def run_sdrt(name, a):
    if a.backend != "cpu":
        import sdrt.gpu  # noqa: F401  (registers cuda0)
    from sdrt.engine.model_manager import DM, load_models
    from sdrt.engine.params import ModelParams
    from sdrt.models.diffusion.flux import flux_pe
    from sdrt.models.families import family_of
    fam, inp, path = FAMILIES[name], inputs(name, a), weights_path(a, name)
    t0 = time.perf_counter()
    models = load_models(ModelParams(diffusion_model=path, type=a.sdrt_type))
    built = family_of(models.version).diffusion_model(models.tensors, DM, path)
    model = getattr(built, "model", built)     # the registry's wrapper, or the model itself (SD3)
    r = dict(version=models.version, summary=getattr(model.config, "summary", lambda: "")())
    x, ctx, y, b = inp["x"], inp["ctx"], inp["y"], a.backend
    t = np.array([SIGMA], np.float32)
    if name == "flux":
        call = lambda: model(x, t, ctx, y, np.array([GUIDANCE], np.float32), backend=b)   # noqa: E731
    elif name == "sd35l":
        call = lambda: model(x, t * 1000, ctx, y, backend=b)   # noqa: E731
    elif name == "zimage":
        call = lambda: model(x, t * 1000, ctx, backend=b)   # noqa: E731
    else:
        hw = a.size // 16
        pe = flux_pe(qwen_ids(hw, hw, fam.txt), model.config.axes_dim)
        call = lambda: model(x, t * 1000, ctx, pe_np=pe, backend=b)   # noqa: E731
    out = {}
    r.update(time_calls(lambda: out.setdefault("y", call()), a.steps))
    r["open_s"] = time.perf_counter() - t0 - r["first_call_s"] - 2 * r["step_s"] - a.steps * r["step_s"]
    np.save(out_path(a, name, "sdrt"), out["y"])
    r["finite"] = bool(np.isfinite(out["y"]).all())
    return r


def child(a):
    name, e = a.family, a.engine
    r = run_sdrt(name, a) if e == "sdrt" else run_torch(name, a, e)
    print("RESULT " + json.dumps(r), flush=True)


# ---- the parent ----------------------------------------------------------------------------------

def rel_err(got, ref):
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def run_child(a, name, engine, argv):
    left = a.deadline - time.monotonic()
    if left < 30:
        print(f"{name} {engine} skipped: {left:.0f} s of --budget left", flush=True)
        return None
    base = GpuPeak.used()
    mon = GpuPeak()
    mon.start()
    t0 = time.perf_counter()
    try:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--family", name, "--engine", engine]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=min(a.child_timeout, left))
        text, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        text, rc = out.decode(errors="replace") if isinstance(out, bytes) else out, "timeout"
    mon.stop.set()
    mon.join()
    line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if rc or not line:
        print(f"{name} {engine} failed ({rc}) after {time.perf_counter() - t0:.0f} s:\n{text[-3000:]}", flush=True)
        return None
    r = json.loads(line[-1][7:])
    r.update(peak_mib=mon.peak - base, wall_s=time.perf_counter() - t0)
    print(f"{name} {engine}: {json.dumps(r)}", flush=True)
    return r


def bench_family(a, name, argv):
    engines = [e for e in ("torch", "sdrt", "compile") if e in a.engines   # torch first: it writes the file
               and (e != "compile" or name in a.compile_for)]
    res = {}
    path = weights_path(a, name)
    if "sdrt" in engines and not os.path.exists(path) and "torch" not in engines:
        if run_child(a, name, "make", argv) is None:
            return res
    for e in engines:
        if e == "sdrt" and not os.path.exists(path):
            print(f"{name} sdrt skipped: no weights file", flush=True)
            continue
        r = run_child(a, name, e, argv)
        if r is not None:
            res[e] = r
    ref = out_path(a, name, "torch")
    for e, r in res.items():
        mine = out_path(a, name, e)
        if e != "torch" and os.path.exists(ref) and os.path.exists(mine):
            r["rel_err"] = rel_err(np.load(mine), np.load(ref))
    for e in ("make", *engines):
        if os.path.exists(out_path(a, name, e)):
            os.remove(out_path(a, name, e))
    if not a.keep and os.path.exists(path):
        os.remove(path)
    return res


def table(a, results):
    lines = [f"\nDiT step, {a.size}x{a.size} (batch 1, one forward), {a.steps} timed steps after 3 warm-up calls, "
             f"backend {a.backend}; peak = nvidia-smi memory.used above idle; "
             "rel err = max|out - torch| / max|torch|\n",
             "| family | engine | s/step | it/s | first call s | peak GPU MiB | rel err vs torch "
             "| sdrt it/s / engine it/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, res in results.items():
        sd = res.get("sdrt", {}).get("step_s")
        for e, r in res.items():
            ratio = f"{r['step_s'] / sd:.2f}" if sd else "-"
            err = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
            lines.append(f"| {FAMILIES[name].title} | {e} | {r['step_s']:.4f} | {1 / r['step_s']:.2f} | "
                         f"{r['first_call_s']:.2f} | {r['peak_mib']} | {err} | {ratio} |")
    return "\n".join(lines)


def parse_depth(text):
    """'2' (every family) or 'flux=2,qwen=1' -> {family: depth}."""
    if not text:
        return {}
    if "=" not in text:
        return {f: int(text) for f in FAMILIES}
    out = {}
    for part in text.split(","):
        k, v = part.split("=")
        if k not in FAMILIES:
            raise SystemExit(f"--depth: unknown family {k!r} (one of {', '.join(FAMILIES)})")
        out[k] = int(v)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=",".join(FAMILIES), help="any of " + ", ".join(FAMILIES))
    ap.add_argument("--engines", default="sdrt,torch,compile")
    ap.add_argument("--compile-for", default=",".join(FAMILIES),
                    help="families whose torch.compile run is made (it costs 1-2 min each on the H200)")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/dit", help="where the weights files and outputs go")
    ap.add_argument("--depth", default="", help="blocks per stack: N for all families or fam=N,... (smoke runs)")
    ap.add_argument("--depth-scale", type=float, default=1.0, help="every stack's released depth times this")
    ap.add_argument("--backend", default="cuda0", help="sdrt's backend (cpu: a smoke run without a GPU)")
    ap.add_argument("--torch-dtype", default="auto", choices=("auto", "bf16", "f32"),
                    help="diffusers' dtype (auto: bf16 on the GPU, f32 on the CPU)")
    ap.add_argument("--sdrt-type", default=None, help="sdrt's weight type (--type; default: the file's BF16)")
    ap.add_argument("--keep", action="store_true", help="keep the weights files")
    ap.add_argument("--no-write", dest="write", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=float, default=600, help="seconds one engine's child may run")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: none); children "
                    "are cut at it and the table is printed with what finished")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.depth_of = parse_depth(a.depth)
    fams = [f for f in a.family.split(",") if f]
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        raise SystemExit(f"--family: unknown {', '.join(bad)} (one of {', '.join(FAMILIES)})")
    if a.size % 16:
        raise SystemExit("--size must be a multiple of 16")
    a.engines = [e for e in a.engines.split(",") if e]
    a.compile_for = [f for f in a.compile_for.split(",") if f]
    if set(a.engines) - {"sdrt", "torch", "compile", "make"}:
        raise SystemExit(f"--engines: one or more of sdrt, torch, compile, not {a.engines}")
    if a.engine:
        return child(a)
    os.makedirs(a.dir, exist_ok=True)
    a.deadline = time.monotonic() + (a.budget or float("inf"))
    argv = ["--size", str(a.size), "--steps", str(a.steps), "--dir", a.dir, "--depth", a.depth,
            "--depth-scale", str(a.depth_scale), "--backend", a.backend, "--torch-dtype", a.torch_dtype] + (
        ["--sdrt-type", a.sdrt_type] if a.sdrt_type else [])
    results = {}
    for name in fams:
        t0 = time.perf_counter()
        results[name] = bench_family(a, name, argv)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    print(table(a, results), flush=True)
    return results


if __name__ == "__main__":
    main()
