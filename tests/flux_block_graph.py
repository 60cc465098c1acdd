"""A small Flux.1 double + single block graph with random weights (real block code,
sdrt/models/diffusion/flux_blocks.py), for the CUDA fusion tests: tests/test_cuda_fuse.py plans it
without a GPU, tests/gpu/test_cuda_dit_fuse.py runs it fused against unfused and the CPU."""
from __future__ import annotations

import numpy as np
from opcheck import leaf

from sdrt.models.common import Weights
from sdrt.models.diffusion.flux import FluxConfig, flux_ids, flux_pe
from sdrt.models.diffusion.flux_blocks import DoubleStreamBlock, SingleStreamBlock
from sdrt.ops import api as F
from sdrt.ops.graph import Graph

C, HEADS, MLP, LT, HW = 64, 2, 128, 8, 4        # hidden, heads (D = 32), mlp width, text tokens, latent side


def flux_blocks_graph(dtype: str = "BF16", seed: int = 0, n: int = 1) -> Graph:
    """vec -> silu; double block on (img [C, HW*HW, n], txt [C, LT, n]); single block on their
    concat (txt first); outputs the single block's tokens and the double block's img stream.
    Weights (and biases, as in Flux's bf16 files) are `dtype`; activations F32."""
    rng = np.random.default_rng(seed)
    cfg = FluxConfig(hidden_size=C, num_heads=HEADS, mlp_hidden=MLP, depth=1, depth_single_blocks=1,
                     context_in_dim=16, vec_in_dim=16)
    table = {}
    for name, shape in cfg.weight_shapes().items():
        if "blocks.0." in name:
            fan_in = shape[1] if len(shape) > 1 else 1
            v = rng.standard_normal(shape).astype(np.float32) / np.sqrt(fan_in)
            table[name] = leaf(v * (1.0 if name.endswith(".weight") or name.endswith("scale") else 0.2), dtype)
    w = Weights(table)
    double = DoubleStreamBlock(w.sub("double_blocks.0."), HEADS)
    single = SingleStreamBlock(w.sub("single_blocks.0."), HEADS, C)
    li = HW * HW
    img = leaf(rng.standard_normal((n, li, C)).astype(np.float32))
    txt = leaf(rng.standard_normal((n, LT, C)).astype(np.float32))
    vec = leaf(rng.standard_normal((n, C)).astype(np.float32))
    pe = leaf(flux_pe(flux_ids(2 * HW, 2 * HW, LT), (8, 12, 12)))      # latent 2*HW: HW*HW patches
    vs = F.silu(vec)
    img2, txt2 = double(img, txt, vs, pe)
    x = single(F.concat(txt2, img2, 1), vs, pe)
    return Graph({"x": x, "img": img2})
