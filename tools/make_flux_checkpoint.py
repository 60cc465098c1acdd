"""Write a random-weight Flux.1 checkpoint with the REAL tensor names and shapes (BFL's), full size
or reduced depth, so sd-cli and sdrt load it as they load flux1-dev / flux1-schnell / ae.

    python tools/make_flux_checkpoint.py --variant dev -o /work/e2e/flux1-dev-rand-bf16.safetensors
    python tools/make_flux_checkpoint.py --variant schnell --depth 2 --single-depth 4 -o flux-tiny.safetensors
    python tools/make_flux_checkpoint.py --component vae -o /work/e2e/ae-rand.safetensors
    python tools/make_flux_checkpoint.py --variant schnell --type q8_0 -o /work/e2e/flux1-schnell-rand-q8_0.gguf
    python tools/make_flux_checkpoint.py --component t5xxl --t5-depth 1 --type f16 -o t5xxl-1block.safetensors

--component
  transformer  bare BFL names (`double_blocks.0.img_attn.qkv.weight` ...), as flux1-dev.safetensors
               (sd-cli: --diffusion-model)
  vae          the ae.safetensors layout: `encoder.*` / `decoder.*` (LDM names; 16 latent channels,
               ch 128, mult (1, 2, 4, 4), 2 res blocks, no quant convs; mid attention as 1x1 convs)
               (sd-cli: --vae)
  all          both in one file: `model.diffusion_model.*` and `vae.*` (the ComfyUI single-file
               layout sd.cpp reads; the text encoders come from --clip_l / --t5xxl)
  t5xxl        the T5-XXL v1.1 encoder of t5xxl_fp16.safetensors: `shared.weight`, `encoder.block.N.*`
               (gated-GELU FFN, relative attention bias in block 0), `encoder.final_layer_norm.weight`;
               widths 4096 / 10240 / 64 heads, vocabulary 32128, --t5-depth blocks (24 released;
               fewer loads in sd-cli only with bench/build_sdcli_cpu.sh's depth patch) (sd-cli: --t5xxl)
  (CLIP-L for --clip_l: tools/make_sd_checkpoint.py --component clip_l.)
--variant dev (guidance_in), schnell (none), fill (img_in 384 wide: x + 16 masked + 64 mask
channels), chroma (no time_in/vector_in/guidance_in/modulation weights: the
distilled_guidance_layer approximator, 64 -> 5120 x 5 layers -> 3072; 8.9 B parameters).
--depth / --single-depth: double / single block counts (19 / 38 in the releases; fewer for
Flux-Lite-like or quick test checkpoints: sdrt and sd-cli count blocks from the names).
--type: bf16 (default, as released), f16, f32 -> safetensors; q8_0, q5_0, q5_1, q4_0, q4_1,
q2_K ... q6_K -> GGUF, quantized as `sd-cli -M convert --type` would (sd.cpp's
tensor_should_be_converted keeps biases, norm scales and the img_in/txt_in/time_in/vector_in/
guidance_in/final_layer tensors in --base-type).

Values (deterministic: each tensor from numpy PCG64 seeded with (seed, crc32(name))): matrices
N(0, 1/fan_in), norm weights / QK-norm scales N(1, 0.05^2), biases N(0, 0.02^2). Tensors are
generated, converted and written one at a time (sdrt.io.writer streams; never the whole model in
RAM): a full-size bf16 dev file is 23.8 GB on disk and ~0.6 GB of peak RSS to write.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sdrt.io.writer import TensorPlan, export_type, parse_type, quantize_like_sd_cpp, write_gguf, write_safetensors
from sdrt.models.diffusion.flux import FluxConfig
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.tensor import Tensor

VARIANTS = {"dev": dict(guidance_embed=True), "schnell": dict(guidance_embed=False),
            "fill": dict(guidance_embed=True, in_channels=384),
            "chroma": dict(guidance_embed=False, vec_in_dim=0, is_chroma=True)}


def transformer_layout(variant: str, depth: int = 19, single: int = 38) -> dict[str, tuple]:
    """{BFL name: torch shape} of a Flux.1 transformer (sdrt's FluxConfig.weight_shapes)."""
    cfg = FluxConfig(depth=depth, depth_single_blocks=single, **VARIANTS[variant])
    return cfg.weight_shapes()


def t5xxl_layout(depth: int = 24, d_model=4096, d_ff=10240, vocab=32128, buckets=32, heads=64) -> dict[str, tuple]:
    """{HF name: torch shape} of a T5 v1.1 encoder as t5xxl_fp16.safetensors holds it."""
    s: dict[str, tuple] = {"shared.weight": (vocab, d_model)}
    for i in range(depth):
        b = f"encoder.block.{i}.layer."
        for q in ("q", "k", "v", "o"):
            s[b + f"0.SelfAttention.{q}.weight"] = (d_model, d_model)
        if i == 0:
            s[b + "0.SelfAttention.relative_attention_bias.weight"] = (buckets, heads)
        s[b + "0.layer_norm.weight"] = (d_model,)
        s[b + "1.DenseReluDense.wi_0.weight"] = (d_ff, d_model)
        s[b + "1.DenseReluDense.wi_1.weight"] = (d_ff, d_model)
        s[b + "1.DenseReluDense.wo.weight"] = (d_model, d_ff)
        s[b + "1.layer_norm.weight"] = (d_model,)
    s["encoder.final_layer_norm.weight"] = (d_model,)
    return s


def vae_layout(ch=128, mult=(1, 2, 4, 4), nrb=2, z=16) -> dict[str, tuple]:
    """{LDM name: torch shape} of the Flux AE (ae.safetensors): SD's KL-f8 VAE with 16 latent
    channels and no quant_conv / post_quant_conv."""
    s: dict[str, tuple] = {}

    def conv(n, i, o, k=3):
        s[n + ".weight"], s[n + ".bias"] = (o, i, k, k), (o,)

    def norm(n, c):
        s[n + ".weight"], s[n + ".bias"] = (c,), (c,)

    def res(n, i, o):
        norm(n + ".norm1", i)
        conv(n + ".conv1", i, o)
        norm(n + ".norm2", o)
        conv(n + ".conv2", o, o)
        if i != o:
            conv(n + ".nin_shortcut", i, o, 1)

    def mid(p, c):
        res(p + "mid.block_1", c, c)
        norm(p + "mid.attn_1.norm", c)
        for q in ("q", "k", "v", "proj_out"):
            conv(p + f"mid.attn_1.{q}", c, c, 1)
        res(p + "mid.block_2", c, c)

    L = [ch * m for m in mult]
    conv("encoder.conv_in", 3, L[0])
    cin = L[0]
    for i, c in enumerate(L):
        for j in range(nrb):
            res(f"encoder.down.{i}.block.{j}", cin, c)
            cin = c
        if i != len(L) - 1:
            conv(f"encoder.down.{i}.downsample.conv", c, c)
    mid("encoder.", cin)
    norm("encoder.norm_out", cin)
    conv("encoder.conv_out", cin, 2 * z)
    cin = L[-1]
    conv("decoder.conv_in", z, cin)
    mid("decoder.", cin)
    for i in reversed(range(len(L))):
        for j in range(nrb + 1):
            res(f"decoder.up.{i}.block.{j}", cin, L[i])
            cin = L[i]
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv", cin, cin)
    norm("decoder.norm_out", cin)
    conv("decoder.conv_out", cin, 3)
    return s


_NORM_LEAVES = (".scale",)
_NORM_MARKERS = ("norm",)


def values(name: str, shape: tuple, seed: int) -> np.ndarray:
    """Deterministic float32 values for one tensor (see the module docstring)."""
    g = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(shape) <= 1:
        is_norm = name.endswith(_NORM_LEAVES) or (name.endswith(".weight") and any(m in name for m in _NORM_MARKERS))
        x = g.standard_normal(shape, np.float32) * np.float32(0.05 if is_norm else 0.02)
        return x + np.float32(1.0) if is_norm else x
    fan_in = int(np.prod(shape[1:]))
    return g.standard_normal(shape, np.float32) * np.float32(1.0 / math.sqrt(fan_in))


def plans(table: dict, dst, base, seed: int, key_of=lambda n: n) -> list[TensorPlan]:
    """One TensorPlan per tensor; values keyed by `key_of(name)` so a component written alone has
    the values it has in the combined file."""
    out = []
    for name, shape in table.items():
        ne = tuple(reversed(shape))
        stub = Tensor(base, ne, nb=(0,) * len(ne), storage=np.zeros(8, np.uint8))  # shape/dtype only
        dt = export_type(name, stub, dst) if dst is not None else base

        def produce(n=key_of(name), s=shape, dt=dt):
            x = values(n, s, seed)
            if dt.is_quantized:
                return quantize_like_sd_cpp(np.ascontiguousarray(x).reshape(-1, s[-1]), dt)
            return f32_to_raw(x, dt)

        out.append(TensorPlan(name, dt, ne, produce))
    return out


_PLANS: list[TensorPlan] = []


def _produce(i: int):
    return _PLANS[i].produce()


def in_parallel(ps: list[TensorPlan], jobs: int) -> list[TensorPlan]:
    """The same plans, their values made by `jobs` forked processes a window of tensors ahead of
    the writer (full-size files on a many-core machine: minutes become seconds)."""
    import multiprocessing as mp
    _PLANS[:] = ps
    pool = mp.get_context("fork").Pool(jobs)
    done: dict[int, object] = {}
    window = 2 * jobs

    def fetch(i):
        if i not in done:
            idx = list(range(i, min(i + window, len(ps))))
            done.clear()
            done.update(zip(idx, pool.map(_produce, idx)))
        if i == len(ps) - 1:
            pool.close()
        return done.pop(i)

    return [TensorPlan(p.name, p.dtype, p.ne, lambda i=i: fetch(i)) for i, p in enumerate(ps)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=tuple(VARIANTS), default="dev")
    ap.add_argument("--component", choices=("transformer", "vae", "all", "t5xxl"), default="transformer")
    ap.add_argument("--depth", type=int, default=19, help="double blocks (19 in the releases)")
    ap.add_argument("--single-depth", type=int, default=38, help="single blocks (38 in the releases)")
    ap.add_argument("--t5-depth", type=int, default=24, help="T5-XXL blocks of --component t5xxl (24 released)")
    ap.add_argument("--type", default="bf16", help="bf16, f16, f32 (safetensors) or q8_0, q4_0, q4_K, ... (GGUF)")
    ap.add_argument("--base-type", default="bf16", help="type of the tensors a quantized --type leaves alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="processes generating/quantizing tensors (same bytes)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    dst, base = parse_type(a.type), parse_type(a.base_type)
    if dst is None or base is None or base.is_quantized:
        raise SystemExit(f"--type {a.type!r} / --base-type {a.base_type!r}: unknown or not a float base type")
    if a.depth < 0 or a.single_depth < 0 or a.depth + a.single_depth == 0:
        raise SystemExit("--depth / --single-depth: at least one block")
    tr = transformer_layout(a.variant, a.depth, a.single_depth)
    vae = vae_layout()
    if a.component == "transformer":
        table, key_of = tr, (lambda n: "model.diffusion_model." + n)
    elif a.component == "vae":
        table, key_of = vae, (lambda n: "vae." + n)
    elif a.component == "t5xxl":
        if a.t5_depth < 1:
            raise SystemExit("--t5-depth: at least one block")
        table, key_of = t5xxl_layout(a.t5_depth), (lambda n: "text_encoders.t5xxl.transformer." + n)
    else:
        table = {"model.diffusion_model." + k: v for k, v in tr.items()}
        table.update({"vae." + k: v for k, v in vae.items()})
        key_of = lambda n: n  # noqa: E731
    gguf = dst.is_quantized
    if not gguf and dst.name not in ("F32", "F16", "BF16"):
        raise SystemExit(f"--type {a.type}: safetensors holds f32/f16/bf16; use a GGUF type")
    quant_dst = dst if gguf else None
    ps = plans(table, quant_dst, dst if not gguf else base, a.seed, key_of)
    if a.jobs > 1:
        ps = in_parallel(ps, a.jobs)
    n = sum(int(np.prod(s)) for s in table.values())
    t0, last = time.time(), [0.0]

    def progress(i, total, name):
        if time.time() - last[0] > 5 or i == total:
            last[0] = time.time()
            print(f"  {i}/{total} tensors {name}", file=sys.stderr)

    what = {"t5xxl": f"t5xxl depth={a.t5_depth}", "vae": "flux ae"}.get(
        a.component, f"flux1-{a.variant} depth={a.depth}+{a.single_depth}")
    meta = {"sdrt.random_weights": f"{what} seed={a.seed} (noise, not a trained model)"}
    write = write_gguf if gguf else write_safetensors
    size = write(a.output, ps, metadata=meta, progress=progress)
    kinds = {}
    for p in ps:
        kinds[p.dtype.name] = kinds.get(p.dtype.name, 0) + 1
    print(f"wrote {a.output}: {len(table)} tensors ({kinds}), {n:,} parameters, {size / 2**30:.2f} GiB, "
          f"{time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
