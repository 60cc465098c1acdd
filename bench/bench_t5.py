"""Time a T5-XXL encode on the CPU with random weights in a storage type (default Q8_0).

    python bench/bench_t5.py --type Q8_0 --tokens 256 --threads 2 [--layers 24] [--repeat 2]

Weights are made in memory in their storage type (Q8_0: random int8 quants under one f16
scale per block, values ~ N(0, 1/fan_in)); RMS-norm weights and the relative-attention bias
table F32, as sd.cpp keeps them. Prints the time per encode and the peak RSS.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sdrt.models.te.t5 import PREFIX_T5XXL, T5Encoder  # noqa: E402
from sdrt.ops import dtypes  # noqa: E402
from sdrt.ops.convert import f32_to_raw  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402
from sdrt.ops.threads import set_threads  # noqa: E402


def weight(rng, dtype: str, out_f: int, in_f: int, name: str) -> Tensor:
    """A [out_f, in_f] (ne=[in_f, out_f]) weight of std ~ 1/sqrt(in_f) stored as `dtype`."""
    std = 1.0 / np.sqrt(in_f)
    if dtype == "Q8_0":
        nb = in_f // 32
        raw = np.empty((out_f, nb, 34), np.uint8)
        d = np.full((out_f, nb), std / 73.9, np.float16)          # uniform int8 has std ~73.9
        raw[..., 0:2] = d.view(np.uint8).reshape(out_f, nb, 2)
        raw[..., 2:] = rng.integers(0, 256, size=(out_f, nb, 32), dtype=np.uint8)
        return Tensor.from_numpy(raw.reshape(out_f, nb * 34), dtype="Q8_0", name=name)
    rows = []
    for s in range(0, out_f, 1024):                              # bounded float32 temporaries
        x = rng.standard_normal((min(1024, out_f - s), in_f), np.float32) * np.float32(std)
        rows.append(f32_to_raw(x, dtype) if dtype != "F32" else x)
    return Tensor.from_numpy(np.concatenate(rows), dtype=dtype, name=name)


def build(dtype: str, layers: int, d=4096, heads=64, ff=10240, vocab=32128, seed=0) -> dict[str, Tensor]:
    rng = np.random.default_rng(seed)
    p = PREFIX_T5XXL
    ones = Tensor.from_numpy(np.ones(d, np.float32))
    t = {p + "shared.weight": weight(rng, dtype, vocab, d, "shared"),
         p + "encoder.final_layer_norm.weight": ones,
         p + "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
             Tensor.from_numpy(rng.standard_normal((32, heads), np.float32))}
    for i in range(layers):
        b = f"{p}encoder.block.{i}."
        for n in "qkvo":
            t[f"{b}layer.0.SelfAttention.{n}.weight"] = weight(rng, dtype, d, d, n)
        for n, (o, k) in (("wi_0", (ff, d)), ("wi_1", (ff, d)), ("wo", (d, ff))):
            t[f"{b}layer.1.DenseReluDense.{n}.weight"] = weight(rng, dtype, o, k, n)
        t[b + "layer.0.layer_norm.weight"] = t[b + "layer.1.layer_norm.weight"] = ones
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    dtypes.get(a.type)
    set_threads(a.threads)
    t0 = time.perf_counter()
    enc = T5Encoder(build(a.type, a.layers))
    nbytes = sum(t.nbytes for t in {id(v): v for v in [enc.embed] + [w for b in enc.blocks for w in
             (b.q.weight, b.k.weight, b.v.weight, b.o.weight, b.wi_0.weight, b.wi_1.weight, b.wo.weight)]}.values())
    print(f"T5-XXL {a.layers} layers, {a.type}: {nbytes / 2**30:.2f} GiB of weights, built in "
          f"{time.perf_counter() - t0:.1f} s")
    ids = np.random.default_rng(1).integers(3, 32000, a.tokens)
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        h = enc.run(ids)
        times.append(time.perf_counter() - t0)
        print(f"  encode {a.tokens} tokens: {times[-1]:.2f} s  (finite: {bool(np.isfinite(h).all())})")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"best {min(times):.2f} s, median {float(np.median(times)):.2f} s, threads {a.threads}, "
          f"peak RSS {rss:.2f} GiB")


if __name__ == "__main__":
    main()
