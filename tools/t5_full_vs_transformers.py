"""T5-XXL at full size (24 blocks, 4096/10240/64 heads, 4.76 B parameters) in f32: sdrt's encoder on
the CPU against transformers' T5EncoderModel on the same weights and ids (issue 14, done-means 1).
Needs torch + transformers and ~40 GB of RAM (transformers holds the model in f32), so it runs on
the GPU machine's host, not in the test suite.

    python tools/t5_full_vs_transformers.py [--file /tmp/t5xxl-24blk-bf16.safetensors] [--jobs 16]
    python tools/t5_full_vs_transformers.py --blockwise [...]    # ~2 GB of RAM: float64 oracle

--blockwise builds transformers' T5Block one block at a time (weights read from the file, the
block run in float64 and again in float32, then dropped), so the reference costs one block's
memory and float64 can be the oracle: it prints sdrt's error and transformers' own float32
error against float64, telling float32 rounding (growing through the random blocks) apart from a
wrong computation. sdrt runs its exact float32 path (SDRT_BF16GEMM=off, SDRT_QGEMM=off).

The checkpoint (tools/make_flux_checkpoint.py --component t5xxl, random, bf16 as t5xxl_fp16 files
are distributed in half precision) is made when missing. Both sides upcast the bf16 values to f32
exactly and compute in f32; the prompts are tokenized by sdrt's T5 tokenizer (its ids equal HF's,
tests/test_t5_tokenizer*). Prints max-abs and relative errors of the final hidden states per prompt.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS = [
    "a photograph of a red fox in fresh snow",
    "Ein Foto von 3 Katzen auf einem Sofa, 35mm, f/1.8 — ISO 400; “golden hour”",
    " ".join(f"word{i} and the {i}th colour of a long description," for i in range(40)),  # > 256 tokens
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="/tmp/flux/t5xxl-24blk-bf16.safetensors")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--depth", type=int, default=24, help="blocks (fewer: a smoke run)")
    ap.add_argument("--blockwise", action="store_true", help="one transformers block at a time, float64 oracle")
    a = ap.parse_args()
    if a.blockwise:     # before sdrt is imported: its exact float32 kernels
        os.environ["SDRT_BF16GEMM"] = os.environ["SDRT_QGEMM"] = "off"
    if not os.path.exists(a.file):
        os.makedirs(os.path.dirname(a.file), exist_ok=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_flux_checkpoint.py"), "--component", "t5xxl",
                        "--t5-depth", str(a.depth), "--jobs", str(a.jobs), "-o", a.file], check=True, stdout=subprocess.DEVNULL)
    import torch
    from safetensors.torch import load_file
    from transformers import T5Config, T5EncoderModel

    from sdrt.io import open_model
    from sdrt.models.te.t5 import T5Encoder
    from sdrt.models.te.t5_tokenizer import T5Tokenizer

    tok = T5Tokenizer()
    ids = [tok.encode(p, max_length=a.max_tokens)[0] for p in PROMPTS]
    t0 = time.perf_counter()
    enc = T5Encoder(open_model(a.file).tensors, prefix="")
    cfg = T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=a.depth, num_heads=64,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
                   tie_word_embeddings=False)
    if a.blockwise:
        return blockwise(a, enc, ids, cfg)
    with torch.device("meta"):
        ref = T5EncoderModel(cfg)
    sd = {k: v.float() for k, v in load_file(a.file).items()}
    sd["encoder.embed_tokens.weight"] = sd["shared.weight"]
    ref.load_state_dict(sd, strict=True, assign=True)
    ref.eval()
    print(f"loaded both in {time.perf_counter() - t0:.0f} s; torch {torch.__version__}, threads {torch.get_num_threads()}")
    worst = 0.0
    for p, i in zip(PROMPTS, ids):
        t0 = time.perf_counter()
        mine = enc.run(np.asarray(i, np.int64).reshape(1, -1))[0]
        t1 = time.perf_counter()
        with torch.no_grad():
            theirs = ref(input_ids=torch.from_numpy(np.asarray(i, np.int64)).reshape(1, -1)).last_hidden_state[0].numpy()
        t2 = time.perf_counter()
        err = float(np.abs(mine - theirs).max())
        rel = err / float(np.abs(theirs).max())
        worst = max(worst, rel)
        print(f"{len(i):4d} tokens: max-abs {err:.3e} (|ref| max {np.abs(theirs).max():.3f}, rel {rel:.2e}), "
              f"mean-abs {float(np.abs(mine - theirs).mean()):.2e}; sdrt {t1 - t0:.1f} s, transformers {t2 - t1:.1f} s")
    # where the error grows: the final norm of the states after k blocks, both sides (longest prompt)
    i = np.asarray(ids[-1], np.int64).reshape(1, -1)
    with torch.no_grad():
        hs = ref(input_ids=torch.from_numpy(i), output_hidden_states=True).hidden_states
        for k in sorted({1, a.depth // 4, a.depth // 2, a.depth} - {0}):
            part = T5Encoder(open_model(a.file).tensors, prefix="", config=dataclasses.replace(enc.config, layers=k))
            mine = part.run(i)[0]
            theirs = ref.encoder.final_layer_norm(hs[k]).numpy()[0] if k < a.depth else hs[k].numpy()[0]
            print(f"after {k:2d} blocks: max-abs {float(np.abs(mine - theirs).max()):.3e}, "
                  f"|ref| max {float(np.abs(theirs).max()):.3f}")
    print(f"RESULT T5-XXL {a.depth} blocks f32: worst relative max-abs error {worst:.2e}")


def blockwise(a, enc, ids, cfg):
    """sdrt and transformers float32 against transformers float64, the reference built and run
    one block at a time (see the module doc)."""
    import torch
    from safetensors import safe_open
    from transformers.models.t5.modeling_t5 import T5Block, T5LayerNorm
    torch.set_num_threads(a.jobs)
    f = safe_open(a.file, "pt")
    emb = f.get_tensor("shared.weight")
    worst = 0.0
    for i in ids:
        t0 = time.perf_counter()
        mine = enc.run(np.asarray(i, np.int64).reshape(1, -1))[0].astype(np.float64)
        t1 = time.perf_counter()
        tok = torch.from_numpy(np.asarray(i, np.int64))
        x = {torch.float64: emb[tok].double()[None], torch.float32: emb[tok].float()[None]}
        bias = {torch.float64: None, torch.float32: None}
        steps = []
        with torch.no_grad():
            for b in range(a.depth):
                pre = f"encoder.block.{b}."
                sd = {k[len(pre):]: f.get_tensor(k) for k in f.keys() if k.startswith(pre)}
                for dt in (torch.float64, torch.float32):
                    with torch.device("meta"):
                        blk = T5Block(cfg, has_relative_attention_bias=b == 0)
                    blk.load_state_dict({k: v.to(dt) for k, v in sd.items()}, strict=True, assign=True)
                    x[dt], bias[dt], _ = blk(x[dt], position_bias=bias[dt])
                    del blk
                steps.append(float((x[torch.float32].double() - x[torch.float64]).abs().max()))
            out = {}
            for dt in (torch.float64, torch.float32):
                norm = T5LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon).to(dt)
                norm.weight.copy_(f.get_tensor("encoder.final_layer_norm.weight").to(dt))
                out[dt] = norm(x[dt])[0].double().numpy()
        t2 = time.perf_counter()
        ref, hf32 = out[torch.float64], out[torch.float32]
        peak = float(np.abs(ref).max())
        e_sdrt, e_hf = float(np.abs(mine - ref).max()), float(np.abs(hf32 - ref).max())
        worst = max(worst, e_sdrt / peak)
        print(f"{len(i):4d} tokens, |ref| max {peak:.3f}: max-abs vs float64 — sdrt {e_sdrt:.3e} (rel {e_sdrt / peak:.2e}), "
              f"transformers f32 {e_hf:.3e} (rel {e_hf / peak:.2e}); sdrt vs transformers f32 "
              f"{float(np.abs(mine - hf32).max()):.3e}; sdrt {t1 - t0:.1f} s, reference {t2 - t1:.1f} s", flush=True)
        print("      transformers f32 vs f64 after blocks 1..N (unnormed states): "
              + " ".join(f"{e:.1e}" for e in steps), flush=True)
    print(f"RESULT T5-XXL {a.depth} blocks: sdrt f32 vs float64, worst relative max-abs error {worst:.2e}")


if __name__ == "__main__":
    main()
