"""Write a random-weight SD3 / SD3.5 checkpoint with the REAL tensor names and shapes (SAI's single
files), full size or reduced depth, so sd-cli and sdrt load it as they load sd3.5_large.safetensors.

    python tools/make_sd3_checkpoint.py --variant sd3.5-large -o /work/e2e/sd3.5_large-rand-bf16.safetensors
    python tools/make_sd3_checkpoint.py --variant sd3.5-medium --component all+te -o sd3.5m-incl-te.safetensors
    python tools/make_sd3_checkpoint.py --variant sd3.5-large --depth 4 -o sd3.5l-d4.safetensors
    python tools/make_sd3_checkpoint.py --variant sd3.5-medium --type q8_0 -o sd3.5m-rand-q8_0.gguf
    python tools/make_sd3_checkpoint.py --component t5xxl -o t5xxl-rand.safetensors
    python tools/make_sd3_checkpoint.py --variant sd3.5-large --component transformer --jobs 16 -o sd3.5l.safetensors

--variant (the released shapes; sdrt detects them from the weights):
  sd3-medium    hidden 1536, 24 joint blocks, no QK norm, pos_embed 192x192
  sd3.5-large   hidden 2432, 38 blocks, QK RMSNorm (ln_q/ln_k), pos_embed 192x192 (also Large Turbo)
  sd3.5-medium  hidden 1536, 24 blocks, QK RMSNorm, attn2 (MMDiT-X) in blocks 0..12, pos_embed 384x384
--depth N keeps the variant's widths and writes N joint blocks (SD3.5 Medium: attn2 in blocks
< min(13, N)); the last block's context half is pre-only, as in the releases. sd-cli's MMDiT takes
at least 24 blocks (its depth starts at 24), so reduced depths are for sdrt.
--component
  transformer  bare SAI names (`joint_blocks.0.x_block.attn.qkv.weight` ...) (sd-cli --diffusion-model)
  vae          bare LDM names (`encoder.*` / `decoder.*`): the 16-channel SD3 VAE (as Flux's AE:
               ch 128, mult (1, 2, 4, 4), 2 res blocks, no quant convs)
  all          `model.diffusion_model.*` + `first_stage_model.*` (as sd3.5_large.safetensors)
  all+te       also the text encoders as SAI's "incl_clips_t5xxl" files carry them:
               `text_encoders.clip_l.transformer.text_model.*` (+ text_projection),
               `text_encoders.clip_g.transformer.text_model.*` (+ text_projection) and
               `text_encoders.t5xxl.transformer.{shared, encoder.*}` (HF names)
  clip_l, clip_g, t5xxl   one text encoder alone, bare HF names (sd-cli --clip_l / --clip_g / --t5xxl)
--type: bf16 (default, as released), f16, f32 -> safetensors; q8_0, q4_0, ... q6_K -> GGUF, as
`sd-cli -M convert --type` would (x_embedder/t_embedder/y_embedder/pos_embed/context_embedder/
final_layer, biases and norms stay in --base-type).

Values: as tools/make_flux_checkpoint.py (numpy PCG64 seeded with (seed, crc32(full name)); matrices
N(0, 1/fan_in), norm weights incl. ln_q/ln_k N(1, 0.05^2), biases N(0, 0.02^2)), except pos_embed
N(0, 0.2^2) (the released one is a sin-cos table of O(1) values). A component written alone has
the values it has in the combined file. Tensors are produced and written one at a time (--jobs N:
made by N forked processes a window ahead of the writer, as make_flux_checkpoint; the same bytes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import make_flux_checkpoint as flux_ckpt  # noqa: E402  (vae_layout, values)
from make_sd_checkpoint import clip_hf  # noqa: E402

from sdrt.io.writer import (TensorPlan, export_type, parse_type, quantize_like_sd_cpp,  # noqa: E402
                             write_gguf, write_safetensors)
from sdrt.ops.convert import f32_to_raw  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402
from sdrt.models.diffusion.mmdit import MMDiTConfig  # noqa: E402

VARIANTS = {"sd3-medium": dict(hidden_size=1536, depth=24, num_heads=24, mlp_hidden=6144, pos_embed_max_size=192),
            "sd3.5-large": dict(hidden_size=2432, depth=38, num_heads=38, mlp_hidden=9728, pos_embed_max_size=192,
                                qk_norm="rms"),
            "sd3.5-medium": dict(hidden_size=1536, depth=24, num_heads=24, mlp_hidden=6144, pos_embed_max_size=384,
                                 qk_norm="rms", dual_attention_layers=tuple(range(13)))}
TE_PREFIX = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
             "t5xxl": "text_encoders.t5xxl.transformer."}


def transformer_config(variant: str, depth: int | None = None) -> MMDiTConfig:
    kw = dict(VARIANTS[variant])
    if depth is not None:
        kw["depth"] = depth
        if kw.get("dual_attention_layers"):
            kw["dual_attention_layers"] = tuple(range(min(13, depth)))
    return MMDiTConfig(**kw)


def t5xxl_layout(d_model=4096, layers=24, heads=64, d_kv=64, d_ff=10240, vocab=32128) -> dict[str, tuple]:
    """{HF T5EncoderModel name: torch shape} of T5 v1.1 XXL's encoder (what SD3 files carry)."""
    s = {"shared.weight": (vocab, d_model)}
    for i in range(layers):
        b = f"encoder.block.{i}.layer."
        for q in ("q", "k", "v"):
            s[f"{b}0.SelfAttention.{q}.weight"] = (heads * d_kv, d_model)
        s[f"{b}0.SelfAttention.o.weight"] = (d_model, heads * d_kv)
        if i == 0:
            s[f"{b}0.SelfAttention.relative_attention_bias.weight"] = (32, heads)
        s[f"{b}0.layer_norm.weight"] = (d_model,)
        s[f"{b}1.DenseReluDense.wi_0.weight"] = (d_ff, d_model)
        s[f"{b}1.DenseReluDense.wi_1.weight"] = (d_ff, d_model)
        s[f"{b}1.DenseReluDense.wo.weight"] = (d_model, d_ff)
        s[f"{b}1.layer_norm.weight"] = (d_model,)
    s["encoder.final_layer_norm.weight"] = (d_model,)
    return s


def te_layout(which: str) -> dict[str, tuple]:
    if which == "clip_l":
        return clip_hf("", 768, 12, projection=True)
    if which == "clip_g":
        return clip_hf("", 1280, 32, projection=True)
    return t5xxl_layout()


def values(name: str, shape: tuple, seed: int) -> np.ndarray:
    """make_flux_checkpoint's values, with ln_q/ln_k as norm weights and pos_embed O(0.2)."""
    if name.endswith(("ln_q.weight", "ln_k.weight")):
        return flux_ckpt.values(name[: -len(".weight")] + ".norm.scale", shape, seed)
    if name.endswith("pos_embed"):
        g = np.random.default_rng([seed, 0x5D3])
        return g.standard_normal(shape, np.float32) * np.float32(0.2)
    return flux_ckpt.values(name, shape, seed)


def plans(table: dict, dst, base, seed: int, key_of) -> list[TensorPlan]:
    """One TensorPlan per tensor, produced on demand (as make_flux_checkpoint.plans, with these values)."""
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


def build_table(component: str, variant: str, depth: int | None):
    """{name in the file: torch shape} and key_of(name) -> the full (combined-file) name the values use."""
    dm, vae = "model.diffusion_model.", "first_stage_model."
    if component == "transformer":
        return transformer_config(variant, depth).weight_shapes(), (lambda n: dm + n)
    if component == "vae":
        return flux_ckpt.vae_layout(), (lambda n: vae + n)
    if component in TE_PREFIX:
        return te_layout(component), (lambda n, p=TE_PREFIX[component]: p + n)
    table = {dm + k: v for k, v in transformer_config(variant, depth).weight_shapes().items()}
    table.update({vae + k: v for k, v in flux_ckpt.vae_layout().items()})
    if component == "all+te":
        for which, p in TE_PREFIX.items():
            table.update({p + k: v for k, v in te_layout(which).items()})
    return table, (lambda n: n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=tuple(VARIANTS), default="sd3.5-large")
    ap.add_argument("--component", choices=("transformer", "vae", "all", "all+te", "clip_l", "clip_g", "t5xxl"),
                    default="all")
    ap.add_argument("--depth", type=int, default=None, help="joint blocks (24 / 38 in the releases)")
    ap.add_argument("--type", default="bf16", help="bf16, f16, f32 (safetensors) or q8_0, q4_0, q4_K, ... (GGUF)")
    ap.add_argument("--base-type", default="bf16", help="type of the tensors a quantized --type leaves alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="processes generating/quantizing tensors (same bytes)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    dst, base = parse_type(a.type), parse_type(a.base_type)
    if dst is None or base is None or base.is_quantized:
        raise SystemExit(f"--type {a.type!r} / --base-type {a.base_type!r}: unknown or not a float base type")
    if a.depth is not None and a.depth < 1:
        raise SystemExit("--depth: at least one joint block")
    gguf = dst.is_quantized
    if not gguf and dst.name not in ("F32", "F16", "BF16"):
        raise SystemExit(f"--type {a.type}: safetensors holds f32/f16/bf16; use a GGUF type")
    table, key_of = build_table(a.component, a.variant, a.depth)
    ps = plans(table, dst if gguf else None, base if gguf else dst, a.seed, key_of)
    if a.jobs > 1:
        ps = flux_ckpt.in_parallel(ps, a.jobs)
    n = sum(int(np.prod(s)) for s in table.values())
    t0, last = time.time(), [0.0]

    def progress(i, total, name):
        if time.time() - last[0] > 5 or i == total:
            last[0] = time.time()
            print(f"  {i}/{total} tensors {name}", file=sys.stderr)

    depth = a.depth if a.depth is not None else VARIANTS[a.variant]["depth"]
    meta = {"sdrt.random_weights": f"{a.variant} depth={depth} component={a.component} seed={a.seed} "
                                   "(noise, not a trained model)"}
    size = (write_gguf if gguf else write_safetensors)(a.output, ps, metadata=meta, progress=progress)
    kinds: dict = {}
    for p in ps:
        kinds[p.dtype.name] = kinds.get(p.dtype.name, 0) + 1
    print(f"wrote {a.output}: {len(table)} tensors ({kinds}), {n:,} parameters, {size / 2**30:.2f} GiB, "
          f"{time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
