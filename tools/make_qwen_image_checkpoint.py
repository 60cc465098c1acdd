"""Write random-weight Qwen-Image files with the REAL tensor names, so sd-cli and sdrt load them as they
load the ComfyUI releases (qwen_image_fp8/bf16.safetensors, qwen_2.5_vl_7b.safetensors,
qwen_image_vae.safetensors).

    python tools/make_qwen_image_checkpoint.py --component transformer --depth 1 -o qi-dit.safetensors
    python tools/make_qwen_image_checkpoint.py --component llm --llm-layers 1 --llm-ffn 512 -o qi-llm.safetensors
    python tools/make_qwen_image_checkpoint.py --component vae -o qi-vae.safetensors
    python tools/make_qwen_image_checkpoint.py --tiny --component all -o DIR   # test-size files

--component
  transformer  diffusers / ComfyUI names (`transformer_blocks.N.attn.to_q.weight`, ...), bare (sd-cli:
               --diffusion-model). Width fixed by sd-cli: hidden 3072 (24 heads x 128), text width 3584;
               --depth blocks (60 released; sd-cli and sdrt count them).
  llm          the Qwen2.5-VL-7B text stack (`model.embed_tokens.weight`, `model.layers.N.*` with qkv
               biases, `model.norm.weight`): hidden 3584, 28 heads / 4 kv heads of 128 (fixed in sd-cli),
               vocabulary 152064; --llm-layers and --llm-ffn (sd-cli reads both from the weights).
  llm_vl       llm plus the Qwen2.5-VL vision tower under `visual.` (32 blocks, width 1280, FFN 3420,
               output 3584; Qwen-Image-Edit's image encoder).
  vae          the Wan-2.1 VAE in Wan's names (dim 96, mult (1, 2, 4, 4), 2 res blocks, z 16: sd-cli's).
  all          the three, as DIR/{dit,llm,vae}.safetensors.
--full: the released shapes (Qwen-Image's 60 blocks, 20.4 B parameters; Qwen2.5-VL-7B's 28 layers with
FFN 18944, 7.1 B without the vision tower). --type bf16 (as released: 41 GB + 15 GB at --full) writes
the transformer / LLM tensor by tensor (--jobs N processes make them; the same bytes); the default f16
builds the file in memory (test sizes).
    python tools/make_qwen_image_checkpoint.py --full --type bf16 --jobs 16 --component transformer -o dit.safetensors
--tiny: test sizes (DiT hidden 128 = one head, text width 64, LLM hidden 64 with one 128-wide head
pair, FFN 96, the full vocabulary so the template's special tokens exist; VAE dim 8) for sdrt-only tests.

Values: deterministic per tensor (PCG64 seeded with (seed, crc32(name))): matrices N(0, 1/fan_in),
norm weights / VAE gammas N(1, 0.05^2), biases N(0, 0.02^2); matrices stored f16, vectors f32.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 152064


def transformer_shapes(depth: int, hidden: int = 3072, heads: int = 24, ctx: int = 3584) -> dict:
    from sdrt.models.diffusion.qwen_image import QwenImageConfig
    cfg = QwenImageConfig(hidden_size=hidden, num_heads=heads, num_layers=depth, joint_attention_dim=ctx,
                          axes_dim=(16, 56, 56))
    return cfg.weight_shapes()


def llm_shapes(layers: int, hidden: int = 3584, ffn: int = 18944, heads: int = 28, kv: int = 4, head_dim: int = 128,
               vocab: int = VOCAB) -> dict:
    s = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (hidden,)
        for n, o in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
            s[f"{p}self_attn.{n}_proj.weight"], s[f"{p}self_attn.{n}_proj.bias"] = (o, hidden), (o,)
        s[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (ffn, hidden)
        s[p + "mlp.down_proj.weight"] = (hidden, ffn)
    return s


def vision_shapes(depth: int = 32, hidden: int = 1280, ffn: int = 3420, out: int = 3584, prefix: str = "visual.") -> dict:
    """The Qwen2.5-VL vision tower (HF names under `visual.`, as in qwen_2.5_vl_7b.safetensors)."""
    s = {prefix + "patch_embed.proj.weight": (hidden, 3, 2, 14, 14), prefix + "merger.ln_q.weight": (hidden,),
         prefix + "merger.mlp.0.weight": (4 * hidden, 4 * hidden), prefix + "merger.mlp.0.bias": (4 * hidden,),
         prefix + "merger.mlp.2.weight": (out, 4 * hidden), prefix + "merger.mlp.2.bias": (out,)}
    for i in range(depth):
        p = f"{prefix}blocks.{i}."
        s[p + "norm1.weight"] = s[p + "norm2.weight"] = (hidden,)
        s[p + "attn.qkv.weight"], s[p + "attn.qkv.bias"] = (3 * hidden, hidden), (3 * hidden,)
        s[p + "attn.proj.weight"], s[p + "attn.proj.bias"] = (hidden, hidden), (hidden,)
        for n in ("gate_proj", "up_proj"):
            s[f"{p}mlp.{n}.weight"], s[f"{p}mlp.{n}.bias"] = (ffn, hidden), (ffn,)
        s[p + "mlp.down_proj.weight"], s[p + "mlp.down_proj.bias"] = (hidden, ffn), (hidden,)
    return s


def vae_shapes(dim: int = 96, z: int = 16, mult=(1, 2, 4, 4), nres: int = 2) -> dict:
    s: dict = {}

    def conv(name, o, i, k3=True, k=3):
        s[name + ".weight"] = (o, i, k, k, k) if k3 else (o, i, k, k)
        s[name + ".bias"] = (o,)

    def res(p, i, o):
        s[p + "residual.0.gamma"] = (i, 1, 1, 1)
        conv(p + "residual.2", o, i)
        s[p + "residual.3.gamma"] = (o, 1, 1, 1)
        conv(p + "residual.6", o, o)
        if i != o:
            conv(p + "shortcut", o, i, k=1)

    def middle(p, c):
        res(p + "middle.0.", c, c)
        s[p + "middle.1.norm.gamma"] = (c, 1, 1)
        conv(p + "middle.1.to_qkv", 3 * c, c, False, 1)
        conv(p + "middle.1.proj", c, c, False, 1)
        res(p + "middle.2.", c, c)

    dims = [dim * m for m in (1,) + tuple(mult)]
    conv("encoder.conv1", dims[0], 3)
    k = 0
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(nres):
            res(f"encoder.downsamples.{k}.", a, b)
            a, k = b, k + 1
        if i != len(mult) - 1:
            conv(f"encoder.downsamples.{k}.resample.1", b, b, False)
            if i in (1, 2):        # temporal downsample (False, True, True)
                s[f"encoder.downsamples.{k}.time_conv.weight"] = (b, b, 3, 1, 1)
                s[f"encoder.downsamples.{k}.time_conv.bias"] = (b,)
            k += 1
    middle("encoder.", dims[-1])
    s["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("encoder.head.2", 2 * z, dims[-1])
    conv("conv1", 2 * z, 2 * z, k=1)
    conv("conv2", z, z, k=1)
    ddims = [dim * mult[-1]] + [dim * m for m in mult[::-1]]
    conv("decoder.conv1", ddims[0], z)
    middle("decoder.", ddims[0])
    k = 0
    for i, (a, b) in enumerate(zip(ddims[:-1], ddims[1:])):
        if i > 0:
            a //= 2
        for _ in range(nres + 1):
            res(f"decoder.upsamples.{k}.", a, b)
            a, k = b, k + 1
        if i != len(mult) - 1:
            conv(f"decoder.upsamples.{k}.resample.1", b // 2, b, False)
            if i in (0, 1):        # temporal upsample (True, True, False)
                s[f"decoder.upsamples.{k}.time_conv.weight"] = (2 * b, b, 3, 1, 1)
                s[f"decoder.upsamples.{k}.time_conv.bias"] = (2 * b,)
            k += 1
    s["decoder.head.0.gamma"] = (ddims[-1], 1, 1, 1)
    conv("decoder.head.2", 3, ddims[-1])
    return s


def values(name: str, shape: tuple, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("gamma") or (len(shape) == 1 and "norm" in name):
        return (np.float32(1.0) + g.standard_normal(shape, np.float32) * np.float32(0.05)).astype(np.float32)
    if len(shape) <= 1:
        return g.standard_normal(shape, np.float32) * np.float32(0.02)
    fan_in = int(np.prod(shape[1:]))
    return g.standard_normal(shape, np.float32) * np.float32(1.0 / math.sqrt(fan_in))


def arrays(shapes: dict, seed: int = 0) -> dict:
    """name -> numpy (f16 matrices, f32 vectors and gammas)."""
    out = {}
    for n, s in shapes.items():
        v = values(n, s, seed)
        out[n] = v.astype(np.float16) if v.ndim > 1 and not n.endswith("gamma") else v
    return out


def shapes_of(component: str, tiny: bool, depth: int = 1, llm_layers: int = 1, llm_ffn: int = 512) -> dict:
    if component == "transformer":
        return transformer_shapes(depth, 128, 1, 64) if tiny else transformer_shapes(depth)
    if component == "llm":
        return llm_shapes(llm_layers, 64, 96, 1, 1) if tiny else llm_shapes(llm_layers, ffn=llm_ffn)
    if component == "llm_vl":     # the LLM with its vision tower (Qwen-Image-Edit)
        if tiny:
            return {**llm_shapes(llm_layers, 64, 96, 1, 1), **vision_shapes(2, 80, 96, 64)}
        return {**llm_shapes(llm_layers, ffn=llm_ffn), **vision_shapes()}
    if component == "vae":
        return vae_shapes(8) if tiny else vae_shapes()
    raise ValueError(component)


def save_safetensors(path: str, tensors: dict) -> None:
    """A plain safetensors writer that keeps 5-D shapes (the VAE's conv3d weights, as released;
    sdrt's writer folds to 4 dims)."""
    import json
    header, off = {}, 0
    for n, v in tensors.items():
        header[n] = {"dtype": {"float16": "F16", "float32": "F32"}[v.dtype.name], "shape": list(v.shape),
                     "data_offsets": [off, off + v.nbytes]}
        off += v.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for v in tensors.values():
            f.write(np.ascontiguousarray(v).tobytes())


def write(component: str, path: str, tiny: bool = False, depth: int = 1, llm_layers: int = 1, llm_ffn: int = 512,
          seed: int = 0) -> str:
    save_safetensors(path, arrays(shapes_of(component, tiny, depth, llm_layers, llm_ffn), seed))
    return path


def write_streamed(component: str, path: str, depth: int = 1, llm_layers: int = 1, llm_ffn: int = 512, seed: int = 0,
                   dtype: str = "bf16", jobs: int = 1) -> str:
    """The same values as `write`, every tensor in `dtype` (bf16, as the released files), made and
    written one tensor at a time (jobs > 1: forked processes a window ahead, make_flux_checkpoint's
    in_parallel), so a full-size 20 B transformer needs a few GB of RAM, not 80. A quantized dtype
    (q8_0, q4_K, ...) writes a GGUF as sd-cli's `-M convert --type` does (its rules say which tensors
    stay BF16), the names as in the safetensors file (city96's Qwen-Image GGUFs keep them too)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_flux_checkpoint as mkflux
    from sdrt.io import write_safetensors
    from sdrt.io.writer import TensorPlan, parse_type
    from sdrt.ops.convert import f32_to_raw
    if component not in ("transformer", "llm", "llm_vl"):
        raise SystemExit(f"--type {dtype}: for the transformer and the LLM (the VAE's 5-D convs: f16 via `write`)")
    dt = parse_type(dtype)
    if dt is None:
        raise SystemExit(f"--type {dtype!r}: not a type sdrt writes")
    shapes = shapes_of(component, False, depth, llm_layers, llm_ffn)
    bf16 = parse_type("bf16")

    def make(n, s, t):
        x = values(n, s, seed)
        return mkflux.quantize_like_sd_cpp(x.reshape(-1, s[-1]), t) if t.is_quantized else f32_to_raw(x, t)

    ps = []
    for n, s in shapes.items():
        ne = tuple(reversed(s))
        t = mkflux.export_type(n, mkflux.Tensor(bf16, ne, nb=(0,) * len(ne), storage=np.zeros(8, np.uint8)), dt) \
            if dt.is_quantized else dt
        ps.append(TensorPlan(n, t, ne, lambda n=n, s=s, t=t: make(n, s, t)))
    if jobs > 1:
        ps = mkflux.in_parallel(ps, jobs)
    meta = {"sdrt.random_weights": f"qwen-image {component} depth={depth} llm_layers={llm_layers} seed={seed} "
                                   "(noise, not a trained model)"}
    (mkflux.write_gguf if dt.is_quantized else write_safetensors)(path, ps, metadata=meta)
    return path


FULL = dict(depth=60, llm_layers=28, llm_ffn=18944)    # Qwen-Image (20.4 B) and Qwen2.5-VL-7B's text stack


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--component", choices=("transformer", "llm", "llm_vl", "vae", "all"), default="all")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--llm-layers", type=int, default=1)
    ap.add_argument("--llm-ffn", type=int, default=512)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--full", action="store_true", help="the released shapes: 60 DiT blocks, 28 LLM layers, FFN 18944")
    ap.add_argument("--type", default="f16",
                    help="f16: matrices f16, vectors f32 (in memory); bf16: every tensor BF16, streamed "
                    "(transformer / llm; the VAE stays f16); a quantized type (q8_0, q4_K, ...): a GGUF of the "
                    "transformer / llm, streamed, as sd-cli's -M convert --type writes it")
    ap.add_argument("--jobs", type=int, default=1, help="processes making bf16 tensors (same bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    if a.full:
        if a.tiny:
            raise SystemExit("--full and --tiny: one or the other")
        for k, v in FULL.items():
            setattr(a, k, v)

    def one(c, path):
        if a.type != "f16" and c != "vae":
            return write_streamed(c, path, a.depth, a.llm_layers, a.llm_ffn, a.seed, a.type, a.jobs)
        return write(c, path, a.tiny, a.depth, a.llm_layers, a.llm_ffn, a.seed)

    if a.component == "all":
        os.makedirs(a.output, exist_ok=True)
        for c, f in (("transformer", "dit"), ("llm", "llm"), ("vae", "vae")):
            print(one(c, os.path.join(a.output, f + ".safetensors")))
    else:
        print(one(a.component, a.output))


if __name__ == "__main__":
    main()
