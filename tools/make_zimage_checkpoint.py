"""Random-weight Z-Image checkpoints with the REAL tensor names (sd.cpp / ComfyUI layout), for the
sd-cli comparison (tests/test_zimage_sdcli.py) and the family tests.

    python tools/make_zimage_checkpoint.py -o DIR [--width 256] [--layers 2] [--refiners 1]
        [--llm-hidden 64] [--llm-layers 2] [--vae]
    # full-size Z-Image-Turbo DiT as Q4_K GGUF and the full Qwen3-4B as Q8_0 GGUF (issue 20's CPU bench)
    python tools/make_zimage_checkpoint.py -o /work/cache/zimage_full --full --component dit --type q4_K --jobs 2
    python tools/make_zimage_checkpoint.py -o /work/cache/zimage_full --full --component llm --llm-type q8_0 --jobs 2
    # full-size bf16 (the released files' type; bench/bench_cuda_cli.py)
    python tools/make_zimage_checkpoint.py -o /tmp/cli/zimage --full --type bf16 --vae --jobs 16

Writes DIR/zimage.safetensors (the DiT, `--diffusion-model`: x_embedder, t_embedder, cap_embedder,
pad tokens, noise/context refiner and main layers, final_layer; FFN sized as sd.cpp's FeedForward
rounds it: 256 * ceil(int(8/3 * width) / 256)), DIR/qwen3.safetensors (`--llm`: a Qwen3 decoder,
HF names under `model.`, sd.cpp's fixed 32 query / 8 kv heads of 128, the full 151936-token
vocabulary, width --llm-hidden = the DiT's caption width) and with --vae DIR/ae.safetensors (the
Flux AE layout of tools/make_flux_checkpoint.py). Values: make_flux_checkpoint's deterministic
generator (PCG64 seeded by (seed, crc32(name))); norm weights near 1. float32, or --type f16, or
--type bf16: every tensor BF16 (as the released z_image_turbo_bf16 / qwen_3_4b files), streamed one
tensor at a time with --jobs, into DIR/zimage-bf16.safetensors / DIR/qwen3-bf16.safetensors (the AE
stays float32, as BFL's ae.safetensors).

--full: the released shapes (DiT width 3840, 30 main + 2 noise + 2 context refiner layers, FFN
10240, captions 2560: 6.15 B parameters; Qwen3-4B: 36 layers, width 2560, FFN 9728, 4.02 B).
--type / --llm-type q8_0, q4_K, ... (any sd-cli `-M convert` type) write DIR/zimage-TYPE.gguf /
DIR/qwen3-TYPE.gguf instead, quantized as `sd-cli -M convert --type TYPE` converts the released
bf16 files: sd.cpp's tensor_should_be_converted picks what stays in --base-type (bf16: biases,
x_embedder, t_embedder, final_layer, rows not a multiple of the block, e.g. the 128-wide q/k norms
under Q4_K), and ggml's weighted quantizers with sd.cpp's all-ones importance vector. Tensors are
made, quantized and written one at a time (--jobs processes a window ahead), so memory stays at a
few tensors (make_flux_checkpoint's plans / write_gguf).

sd-cli 0.4.7 fixes the Z-Image DiT at width 3840 with 30 + 2 layers; the reduced files here need
its build patched by bench/patch_sdcli_zimage.py (layers, width, heads, caption width from the
weights). The LLM's depth, width and vocabulary sd-cli reads from the weights as it is.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _mkflux():
    if "make_flux_checkpoint" in sys.modules:  # registered: its --jobs workers pickle its functions by name
        return sys.modules["make_flux_checkpoint"]
    spec = importlib.util.spec_from_file_location("make_flux_checkpoint", os.path.join(ROOT, "tools",
                                                                                     "make_flux_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_flux_checkpoint"] = mod
    spec.loader.exec_module(mod)
    return mod


def sdcpp_ffn(width: int) -> int:
    return 256 * ((int(8.0 / 3.0 * width) + 255) // 256)


def dit_layout(width=256, layers=2, refiners=1, cap_dim=64, ffn=None, latent=16, heads_dim=128) -> dict:
    """{name: torch shape} of a Z-Image DiT (original names, no prefix)."""
    ffn = ffn or sdcpp_ffn(width)
    ad, tm = min(width, 256), min(width, 1024)
    qkv = 3 * width                                       # heads = kv heads = width / 128
    s = {"x_embedder.weight": (width, 4 * latent), "x_embedder.bias": (width,),
         "t_embedder.mlp.0.weight": (tm, 256), "t_embedder.mlp.0.bias": (tm,),
         "t_embedder.mlp.2.weight": (ad, tm), "t_embedder.mlp.2.bias": (ad,),
         "cap_embedder.0.weight": (cap_dim,), "cap_embedder.1.weight": (width, cap_dim),
         "cap_embedder.1.bias": (width,), "cap_pad_token": (width,), "x_pad_token": (width,),
         "final_layer.adaLN_modulation.1.weight": (width, ad), "final_layer.adaLN_modulation.1.bias": (width,),
         "final_layer.linear.weight": (4 * latent, width), "final_layer.linear.bias": (4 * latent,)}

    def block(p, mod):
        s[p + "attention.qkv.weight"] = (qkv, width)
        s[p + "attention.out.weight"] = (width, width)
        s[p + "attention.q_norm.weight"] = s[p + "attention.k_norm.weight"] = (heads_dim,)
        for n in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            s[p + n + ".weight"] = (width,)
        s[p + "feed_forward.w1.weight"] = s[p + "feed_forward.w3.weight"] = (ffn, width)
        s[p + "feed_forward.w2.weight"] = (width, ffn)
        if mod:
            s[p + "adaLN_modulation.0.weight"], s[p + "adaLN_modulation.0.bias"] = (4 * width, ad), (4 * width,)

    for i in range(refiners):
        block(f"noise_refiner.{i}.", True)
        block(f"context_refiner.{i}.", False)
    for i in range(layers):
        block(f"layers.{i}.", True)
    return s


def qwen3_layout(hidden=64, layers=2, ffn=128, vocab=151936, heads=32, kv=8, head_dim=128) -> dict:
    """{HF name: torch shape} of a Qwen3 decoder (`model.` names, no lm_head)."""
    s = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (hidden,)
        s[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        s[p + "self_attn.k_proj.weight"] = s[p + "self_attn.v_proj.weight"] = (kv * head_dim, hidden)
        s[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        s[p + "self_attn.q_norm.weight"] = s[p + "self_attn.k_norm.weight"] = (head_dim,)
        s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (ffn, hidden)
        s[p + "mlp.down_proj.weight"] = (hidden, ffn)
    return s


def value_key(name: str) -> str:
    """The name the values are drawn under (the caption RMS norm's weight gets a norm's values)."""
    return name.replace("cap_embedder.0.weight", "cap_embedder.0.norm.weight")


def write_gguf(path: str, layout: dict, seed: int = 0, dtype: str = "q4_K", base: str = "bf16",
               jobs: int = 1, what: str = "") -> str:
    """The same values as `write`, streamed into a GGUF quantized as sd-cli's `-M convert`."""
    from sdrt.io.writer import parse_type, write_gguf as _write_gguf
    mk = _mkflux()
    dst, base_t = parse_type(dtype), parse_type(base)
    if dst is None or not dst.is_quantized or base_t is None or base_t.is_quantized:
        raise SystemExit(f"--type {dtype!r} / --base-type {base!r}: a quantized type over a float base type")
    ps = mk.plans(layout, dst, base_t, seed, value_key)
    if jobs > 1:
        ps = mk.in_parallel(ps, jobs)
    last = [0.0]

    def progress(i, total, name):
        if time.time() - last[0] > 10:
            last[0] = time.time()
            print(f"  {i}/{total} tensors {name}", file=sys.stderr, flush=True)

    t0 = time.time()
    size = _write_gguf(path, ps, metadata={"sdrt.random_weights": f"{what} seed={seed} (noise, not a trained model)"},
                       progress=progress)
    kinds: dict[str, int] = {}
    for p in ps:
        kinds[p.dtype.name] = kinds.get(p.dtype.name, 0) + 1
    n = sum(int(np.prod(v)) for v in layout.values())
    print(f"wrote {path}: {len(layout)} tensors ({kinds}), {n:,} parameters, {size / 2**30:.2f} GiB, "
          f"{time.time() - t0:.0f} s", file=sys.stderr)
    return path


def write_streamed(path: str, layout: dict, seed: int = 0, dtype: str = "bf16", jobs: int = 1, what: str = "") -> str:
    """The same values as `write`, every tensor in `dtype` (bf16: as the released files), made and
    written one at a time (--jobs processes a window ahead): full-size files in a few GB of RAM."""
    from sdrt.io import write_safetensors
    from sdrt.io.writer import parse_type
    mk = _mkflux()
    ps = mk.plans(layout, None, parse_type(dtype), seed, value_key)
    if jobs > 1:
        ps = mk.in_parallel(ps, jobs)
    t0 = time.time()
    size = write_safetensors(path, ps, metadata={"sdrt.random_weights": f"{what} seed={seed} "
                                                 "(noise, not a trained model)"})
    print(f"wrote {path}: {len(layout)} tensors, {size / 2**30:.2f} GiB, {time.time() - t0:.0f} s", file=sys.stderr)
    return path


def write(path: str, layout: dict, seed: int = 0, dtype: str = "f32") -> str:
    """Deterministic values (norm weights near 1: the caption RMS norm too) as safetensors."""
    from sdrt.io import write_safetensors
    mk = _mkflux()
    arrays = {}
    for n, shape in layout.items():
        v = mk.values(value_key(n), shape, seed)
        arrays[n] = v.astype(np.float16) if dtype == "f16" and v.ndim > 1 else v
    write_safetensors(path, arrays)
    return path


FULL = dict(width=3840, layers=30, refiners=2, llm_hidden=2560, llm_layers=36, llm_ffn=9728)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True, help="directory")
    ap.add_argument("--full", action="store_true", help="the released shapes (Z-Image-Turbo, Qwen3-4B)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--refiners", type=int, default=1)
    ap.add_argument("--llm-hidden", type=int, default=64)
    ap.add_argument("--llm-layers", type=int, default=2)
    ap.add_argument("--llm-ffn", type=int, default=128)
    ap.add_argument("--component", choices=("all", "dit", "llm"), default="all",
                    help="which of the DiT and the LLM to write (all: both)")
    ap.add_argument("--vae", action="store_true", help="also write the Flux AE (ae.safetensors)")
    ap.add_argument("--type", default="f32", help="the DiT's: f32, f16, bf16 (safetensors) or q8_0, q4_K, ... (GGUF)")
    ap.add_argument("--llm-type", default=None, help="the LLM's (default: --type)")
    ap.add_argument("--base-type", default="bf16", help="what a GGUF keeps unquantized tensors in")
    ap.add_argument("--jobs", type=int, default=1, help="processes making bf16 / GGUF tensors (same bytes)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.full:
        for k, v in FULL.items():
            setattr(a, k, v)
    os.makedirs(a.output, exist_ok=True)

    def emit(stem, layout, typ, what):
        if typ in ("f32", "f16"):
            print(write(os.path.join(a.output, stem + ".safetensors"), layout, a.seed, typ))
        elif typ == "bf16":
            print(write_streamed(os.path.join(a.output, stem + "-bf16.safetensors"), layout, a.seed, typ, a.jobs,
                                 what))
        else:
            print(write_gguf(os.path.join(a.output, f"{stem}-{typ}.gguf"), layout, a.seed, typ, a.base_type,
                             a.jobs, what))

    if a.component in ("all", "dit"):
        emit("zimage", dit_layout(a.width, a.layers, a.refiners, a.llm_hidden), a.type,
             f"z-image dit width={a.width} layers={a.layers}+{a.refiners}+{a.refiners}")
    if a.component in ("all", "llm"):
        emit("qwen3", qwen3_layout(a.llm_hidden, a.llm_layers, a.llm_ffn), a.llm_type or a.type,
             f"qwen3 hidden={a.llm_hidden} layers={a.llm_layers}")
    if a.vae:
        print(write(os.path.join(a.output, "ae.safetensors"), _mkflux().vae_layout(), a.seed,
                    a.type if a.type in ("f32", "f16") else "f32"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
