"""The UNet's blocks (sd.cpp common_block.hpp; LDM openaimodel.py / attention.py).

Each block takes a `Weights` view at its checkpoint prefix (`input_blocks.1.0.`); attribute
names are the checkpoint keys. Shapes in ne order: an image x is [W, H, C, N], a token
sequence [C, L, N], the timestep embedding [E, N].
"""
from __future__ import annotations

from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Conv2d, GroupNorm, LayerNorm, Linear, Weights, linear_lora, multihead_attention


class ResBlock:
    """GN+SiLU -> conv3x3 -> + emb_layers(silu(emb)) -> GN+SiLU -> conv3x3, + skip (1x1 conv when
    the channel count changes). The SiLU of emb is shared by all blocks (computed once)."""

    def __init__(self, w: Weights, groups: int, eps: float):
        self.in_norm = GroupNorm(w.sub("in_layers.0."), groups, eps)
        self.in_conv = Conv2d(w.sub("in_layers.2."), padding=1)
        self.emb = Linear(w.sub("emb_layers.1."))
        self.out_norm = GroupNorm(w.sub("out_layers.0."), groups, eps)
        self.out_conv = Conv2d(w.sub("out_layers.3."), padding=1)
        self.skip = Conv2d(w.sub("skip_connection.")) if "skip_connection.weight" in w else None

    def __call__(self, x: Tensor, emb_silu: Tensor) -> Tensor:
        # x [W, H, C, N], emb_silu [E, N] -> [W, H, OC, N]
        h = self.in_conv(self.in_norm(x, silu=True))              # [W, H, OC, N]
        e = self.emb(emb_silu)                                     # [OC, N]
        h = F.add(h, e.reshape(1, 1, e.ne[0], e.ne4[1]))           # broadcast over W, H
        h = self.out_conv(self.out_norm(h, silu=True))
        return F.add(h, self.skip(x) if self.skip is not None else x)


class CrossAttention:
    """to_q/to_k/to_v (no bias), attention over n_head heads, to_out.0 (with bias)."""

    def __init__(self, w: Weights, n_head: int):
        self.to_q = Linear(w.sub("to_q."), bias=False)
        self.to_k = Linear(w.sub("to_k."), bias=False)
        self.to_v = Linear(w.sub("to_v."), bias=False)
        self.to_out = Linear(w.sub("to_out.0."))
        self.n_head = n_head

    def __call__(self, x: Tensor, context: Tensor) -> Tensor:
        # x [C, L, N], context [Cctx, Lk, N] -> [C, L, N]
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        return self.to_out(multihead_attention(q, k, v, self.n_head))


class FeedForward:
    """GEGLU: ff.net.0.proj -> (a, gate) halves of ne[0] -> a * gelu(gate) -> ff.net.2, the
    middle step one fused op (F.geglu: the values of mul(a, gelu(gate)) bit for bit on the CPU)."""

    def __init__(self, w: Weights, gelu: str):
        self.proj = Linear(w.sub("net.0.proj."))
        self.out = Linear(w.sub("net.2."))
        self.gelu = gelu

    def __call__(self, x: Tensor) -> Tensor:
        h = self.proj(x)                                  # [2*I, L, N]
        return self.out(F.geglu(h, approximate=self.gelu))  # [I, L, N]


class BasicTransformerBlock:
    """x += attn1(norm1(x)); x += attn2(norm2(x), context); x += ff(norm3(x))."""

    def __init__(self, w: Weights, n_head: int, gelu: str):
        self.norm1, self.norm2, self.norm3 = (LayerNorm(w.sub(f"norm{i}.")) for i in (1, 2, 3))
        self.attn1 = CrossAttention(w.sub("attn1."), n_head)
        self.attn2 = CrossAttention(w.sub("attn2."), n_head)
        self.ff = FeedForward(w.sub("ff."), gelu)

    def __call__(self, x: Tensor, context: Tensor) -> Tensor:
        # x [C, L, N], context [Cctx, Lk, N]
        h = self.norm1(x)
        x = F.add(self.attn1(h, h), x)
        x = F.add(self.attn2(self.norm2(x), context), x)
        return F.add(self.ff(self.norm3(x)), x)


def _proj(w: Weights) -> Tensor:
    """proj_in/proj_out weight as a Linear weight ne [in, out]. SD1 stores a 1x1 conv
    ne [1, 1, in, out]: the same bytes, so a zero-copy view (block types cannot have a
    1-wide ne[0] anyway, so any 4-D weight here is a float type)."""
    t = w["weight"]
    return t.view((t.ne[2], t.ne[3]), (t.nb[2], t.nb[3])) if t.ndim == 4 else t


class SpatialTransformer:
    """GroupNorm -> proj_in -> depth x BasicTransformerBlock -> proj_out, + x.

    SD1 has 1x1 convs as proj_in/proj_out, SD2/SDXL linears (`use_linear_in_transformer`); a 1x1
    conv on [W, H, C, N] is the same linear on the token layout [C, W*H, N], so both run as
    linears on tokens (one cont to tokens and one back, as sd.cpp)."""

    def __init__(self, w: Weights, n_head: int, depth: int, groups: int, gelu: str):
        self.norm = GroupNorm(w.sub("norm."), groups, 1e-6)  # LDM Normalize and sd.cpp: eps 1e-6
        self.proj_in_w, self.proj_in_b = _proj(w.sub("proj_in.")), w.get("proj_in.bias")
        self.proj_out_w, self.proj_out_b = _proj(w.sub("proj_out.")), w.get("proj_out.bias")
        self.proj_in_leaf, self.proj_out_leaf = w["proj_in.weight"], w["proj_out.weight"]  # run-time LoRA keys
        self.blocks = [BasicTransformerBlock(w.sub(f"transformer_blocks.{i}."), n_head, gelu) for i in range(depth)]

    def __call__(self, x: Tensor, context: Tensor) -> Tensor:
        Wd, Hd, C, N = x.ne4
        h = self.norm(x)
        h = F.cont(h.permute(1, 2, 0, 3)).reshape(C, Wd * Hd, N)        # [C, W*H, N]
        h = linear_lora(h, self.proj_in_w, self.proj_in_b, self.proj_in_leaf)   # [I, W*H, N]
        for blk in self.blocks:
            h = blk(h, context)
        h = linear_lora(h, self.proj_out_w, self.proj_out_b, self.proj_out_leaf)  # [C, W*H, N]
        h = F.cont(h.permute(1, 0, 2, 3)).reshape(Wd, Hd, C, N)          # [W, H, C, N]
        return F.add(h, x)


class Downsample:
    """`op`: conv 3x3, stride 2, padding 1."""

    def __init__(self, w: Weights):
        self.op = Conv2d(w.sub("op."), stride=2, padding=1)

    def __call__(self, x: Tensor) -> Tensor:
        return self.op(x)  # [W/2, H/2, C, N]


class Upsample:
    """nearest x2, then conv 3x3 padding 1."""

    def __init__(self, w: Weights):
        self.conv = Conv2d(w.sub("conv."), padding=1)

    def __call__(self, x: Tensor) -> Tensor:
        return self.conv(F.upscale(x, scale_factor=2, mode="nearest"))  # [2W, 2H, C, N]
