#!/usr/bin/env python3
"""Which CUDA fusions and half-precision stores the backend would use on each DiT family's graph,
without a GPU: fuse.layout (launch_lists and half_nodes, and the re-plan with the half-stored nodes
in half their bytes) over the planned graph of the tiny golden models in tests/fixtures, with the
CUDA kernel table (the same pass the backend runs). `sd15` and `sdxl` are the full-size UNets (a
CFG step: batch 2 at 64x64 / 128x128 latents) on stand-in F16 weights that hold no data; `vae15`
and `vaexl` the SD VAE's decoder of a 64x64 / 128x128 latent (512 / 1024 pixels) alike.

    python tools/cuda_fusion_report.py [--family flux,sd3m,sd35l,zimage,qwen,sd15,sdxl,vae15,vaexl] [--dtype BF16]

Per family: the activation bytes (arena + cross-segment) planned in F32 and as stored, the fused
kernels and how often they fire, the element-wise kernels left unfused, and the nodes stored as
F16/BF16 by op. A family whose modulations or MLP gates show up as
unfused `binary`/`unary` slots is where the next fusion pays (docs/cuda.md, "Fusion and the
element-wise walk").
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tools"))    # make_sd_checkpoint's layouts (also when imported)

from sdrt.gpu.cuda import fuse  # noqa: E402
from sdrt.gpu.cuda import ops as cuda_ops  # noqa: E402
from sdrt.gpu.cuda.table import CUDA  # noqa: E402
from sdrt.gpu.device_backend import import_families  # noqa: E402
from sdrt.ops.graph import Graph  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402

ELEMENTWISE = ("binary", "unary")


def _leaves(*arrays):
    return [None if a is None else Tensor.from_numpy(np.asarray(a, np.float32)) for a in arrays]


def flux_graph(dtype):
    from flux_block_graph import flux_blocks_graph
    return flux_blocks_graph(dtype, n=1)


def mmdit_graph(case, dtype):
    import test_mmdit as tm
    args, _, _ = tm.inputs(case)
    m = tm.MMDiTModel(tm.table(case, None if dtype != "F32" else "F32"))
    return Graph(m.forward(*_leaves(*args), skip_layers=frozenset()))


def zimage_graph(dtype):
    import test_zimage as tz
    gold = dict(np.load(os.path.join(ROOT, "tests", "fixtures", "zimage_transformer.npz")))
    m = tz.ZImageModel(tz.table(gold, dtype))
    return Graph(m.forward(*_leaves(gold["x/even"], gold["t/even"].reshape(1), gold["ctx/even"])))


def qwen_image_graph(dtype):
    import test_qwen_image as tq
    from sdrt.models.diffusion.flux import flux_pe
    z = tq.fixture()
    m = tq.model(dtype=None if dtype != "F32" else "F32")
    pe = Tensor.from_numpy(flux_pe(z["t2i:ids"], tq.AXES))
    return Graph(m.forward(*_leaves(z["t2i:x"], z["t2i:t"], z["t2i:context"]), pe=pe))


def unet_graph(preset, side, ctx):
    """The full-size UNet's CFG step on stand-in F16 weights (matrices with zero strides: no data;
    the biases real, so that the bias fusions see them as they are)."""
    from sdrt.models.diffusion.unet import PREFIX, UNetConfig, UNetModel
    cfg = UNetConfig.preset(preset)
    one = np.zeros(2, np.uint8)
    table = {PREFIX + k: Tensor.from_numpy(np.zeros(s, np.float16)) if len(s) == 1
             else Tensor.from_buffer(one, "F16", s[::-1], nb=(0,) * len(s)) for k, s in cfg.weight_shapes().items()}
    m = UNetModel(table, config=cfg)
    y = _leaves(np.zeros((2, cfg.adm_in_channels))) if cfg.adm_in_channels else [None]
    x, t, c = _leaves(np.zeros((2, 4, side, side)), np.zeros(2), np.zeros((2, 77, ctx)))
    return Graph(m.forward(x, t, c, y=y[0]))


def vae_graph(side):
    """The SD VAE decoder (SD1.5's and SDXL's shapes) of a side x side latent on zero F16 weights
    (84 M parameters: small enough to hold), for the CUDA backend (its upsample form)."""
    from make_sd_checkpoint import layout
    from sdrt.models.vae.autoencoder_kl import AutoencoderKL
    table = {k: Tensor.from_numpy(np.zeros(s, np.float16)) for k, s in layout("sd15", "vae").items()}
    vae = AutoencoderKL(table, prefix="")
    return Graph(vae.decode_graph(_leaves(np.zeros((1, 4, side, side)))[0], backend="cuda0"))


FAMILIES = {
    "flux": flux_graph,
    "sd3m": lambda dt: mmdit_graph("sd3m", dt),
    "sd35l": lambda dt: mmdit_graph("sd35l", dt),
    "zimage": zimage_graph,
    "qwen": qwen_image_graph,
    "sd15": lambda dt: unet_graph("sd1", 64, 768),
    "sdxl": lambda dt: unet_graph("sdxl", 128, 2048),
    "vae15": lambda dt: vae_graph(64),
    "vaexl": lambda dt: vae_graph(128),
}


def report(graph) -> tuple[Counter, Counter, Counter, tuple[int, int]]:
    plan = graph.plan()
    kernels = [[CUDA.find(n).fn for n in seg.nodes] for seg in plan.segments]
    layout, lists, stored = fuse.layout(graph, plan, kernels, True, True)
    # a fused slot runs another function than its node's own kernel (and is not a skipped one)
    fused = Counter(fn.__name__ for ks, lst in zip(kernels, lists) for own, (fn, _) in zip(ks, lst)
                    if fn is not own and fn is not fuse._skip)
    unfused, traffic = Counter(), 0

    def nbytes(t):      # at the dtype its producer stores
        return t.nelements * (2 if id(t.owner) in stored else t.dtype.type_size)

    for seg, lst in zip(layout.segments, lists):
        for n, (fn, srcs) in zip(seg.nodes, lst):
            if fn.__name__ in ELEMENTWISE:
                unfused[n.op] += 1
                traffic += sum(nbytes(t) for t in srcs) + n.nelements * (2 if id(n) in stored else n.dtype.type_size)
    return (fused, unfused, Counter(f"{n.op}->{stored[id(n)]}" for n in graph.nodes if id(n) in stored),
            (plan.arena_bytes + plan.cross_bytes, layout.arena_bytes + layout.cross_bytes), traffic)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=",".join(FAMILIES))
    ap.add_argument("--dtype", default="BF16", help="weights' dtype where the fixture allows (BF16, F16, F32)")
    a = ap.parse_args(argv)
    import_families(cuda_ops)
    for name in a.family.split(","):
        fused, unfused, stored, (f32, laid), traffic = report(FAMILIES[name](a.dtype))
        print(f"{name}: activations {f32 / 2**10:.0f} KiB planned F32, {laid / 2**10:.0f} KiB as stored")
        print("  fused:   " + ", ".join(f"{k} x{v}" for k, v in sorted(fused.items())))
        print("  unfused element-wise: " + ", ".join(f"{k} x{v}" for k, v in sorted(unfused.items()))
              + f" ({traffic / 2**20:.1f} MiB read and written a run)")
        print("  stored:  " + ", ".join(f"{k} x{v}" for k, v in sorted(stored.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
