#!/usr/bin/env python3
"""How far two engines can agree on a quantized base (issue 16's "Q8_0 at run time >= 40 dB"):
run the sdrt CLI with one float-level change and compare its image with another.

    # the initial noise times (1 + 2^-21), i.e. 4 float32 ulps: sdrt's own sensitivity
    python tools/q8_sensitivity.py --noise-ulps 4 -- -m sdxl.safetensors -p "a lovely cat" \\
        -W 256 -H 256 --steps 4 --cfg-scale 7 --sampling-method euler -s 42 --type q8_0 -t 2 -o pert.png
    # ggml's CPU GELU: f16(gelu(f16(x))) from a 65,536-entry table (GGML_GELU_FP16 and
    # GGML_GELU_QUICK_FP16 in ggml-cpu/vec.h), as sd-cli's CPU build computes gelu and quick_gelu
    python tools/q8_sensitivity.py --ggml-gelu -- <the same CLI arguments> -o ggml.png
    python tools/q8_sensitivity.py --psnr a.png b.png

A diagnostic, not a mode of sdrt: sdrt computes GELU exactly (ggml's CUDA build does too). The
kernels it swaps in are numpy (slow, exact to the table), registered ahead of the CPU ones.
Findings: docs/lora.md, "How close two engines can be on a Q8_0 base".
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def psnr(a: str, b: str) -> float:
    from PIL import Image

    from sdrt.io.images import psnr as psnr_of
    return psnr_of(*(np.asarray(Image.open(f).convert("RGB")) for f in (a, b)), peak=255.0)


def ggml_tables() -> tuple[np.ndarray, np.ndarray]:
    """ggml's f16 tables as float32, indexed by an f16 bit pattern: gelu (tanh form) and quick_gelu
    of every f16 value, computed in float32 (tanhf/expf taken correctly rounded) and rounded to f16."""
    f = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        inner = np.float32(0.79788456080286535587989211986876) * f * (np.float32(1) + np.float32(0.044715) * f * f)
        t = np.tanh(inner.astype(np.float64)).astype(np.float32)
        gelu = (np.float32(0.5) * f * (np.float32(1) + t)).astype(np.float16).astype(np.float32)
        e = np.exp((np.float32(-1.702) * f).astype(np.float64)).astype(np.float32)
        quick = (f * (np.float32(1) / (np.float32(1) + e))).astype(np.float16).astype(np.float32)
    return gelu, quick


def use_ggml_gelu() -> None:
    """Register numpy gelu_tanh / gelu_quick / geglu (tanh) kernels with ggml's tables first."""
    from sdrt.ops.cpu import CPU
    from sdrt.ops.cpu._util import as4d, f32_input, f32_output, store
    from sdrt.ops.registry import Kernel
    gelu_t, quick_t = ggml_tables()

    def gelu(x):   # vec.h ggml_vec_gelu_f32: 0 below -10, x above 10, else the table
        y = gelu_t[x.astype(np.float16).view(np.uint16)]
        return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, y)).astype(np.float32)

    def unary(node, xs, out):
        x = as4d(f32_input(node.src[0], xs[0]))
        o = f32_output(node, out)
        as4d(o)[...] = gelu(x) if node.op == "gelu_tanh" else quick_t[x.astype(np.float16).view(np.uint16)]
        store(node, out, o)

    def geglu(node, xs, out):
        x = as4d(f32_input(node.src[0], xs[0]))
        o = f32_output(node, out)
        h = x.shape[-1] // 2
        as4d(o)[...] = x[..., :h] * gelu(x[..., h:])
        store(node, out, o)

    f32 = lambda n: n.dtype.name == "F32"                                       # noqa: E731
    for op, fn, ok in (("gelu_tanh", unary, f32), ("gelu_quick", unary, f32),
                       ("geglu", geglu, lambda n: f32(n) and n.params["approximate"] == "tanh")):
        CPU._kernels.setdefault(op, []).insert(0, Kernel(op, fn, ok))


def scale_initial_noise(ulps: int) -> None:
    """Every RNG's randn times (1 + ulps * 2^-23): the initial latent noise moves by `ulps` ulps."""
    from sdrt.engine import rng
    make, factor = rng.make_rng, np.float32(1 + ulps * 2.0 ** -23)

    def make_rng(*a, **k):
        r = make(*a, **k)
        randn = r.randn
        r.randn = lambda *aa, **kk: (np.asarray(randn(*aa, **kk)) * factor).astype(np.float32)
        return r
    rng.make_rng = make_rng


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--noise-ulps", type=int, default=0, help="scale the initial noise by (1 + N * 2^-23)")
    ap.add_argument("--ggml-gelu", action="store_true", help="ggml's CPU f16 GELU tables")
    ap.add_argument("--psnr", nargs=2, metavar="PNG", help="only print the PSNR of two images")
    ap.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the sdrt CLI arguments")
    a = ap.parse_args(argv)
    if a.psnr:
        print(f"{psnr(*a.psnr):.2f} dB")
        return 0
    cli = a.cli[1:] if a.cli[:1] == ["--"] else a.cli
    if a.noise_ulps:
        scale_initial_noise(a.noise_ulps)
    if a.ggml_gelu:
        use_ggml_gelu()
    from sdrt.cli.main import run
    return run(cli)


if __name__ == "__main__":
    sys.exit(main())
