"""The MMDiT's blocks (SAI's sd3 mmdit.py; sd.cpp mmdit.hpp): SD3 Medium, SD3.5 Large/Medium.

Each block takes a `Weights` view at its checkpoint prefix (`joint_blocks.3.x_block.`);
attribute names are SAI's keys. Shapes in ne order: a token sequence is [C, L, N], the
conditioning vector [C, N], one head's q/k/v [D, heads, L, N].

Numerics are SAI's (and sd.cpp's): LayerNorms without affine at eps 1e-6, optional QK norm per
head (SD3.5: RMSNorm with `ln_q.weight`; "ln": LayerNorm with weight and bias) at eps 1e-6, the
tanh GELU in the MLPs, modulation `(1 + scale) * x + shift`, gated residuals. No RoPE: positions
come from the learned `pos_embed` added after the patch embedding.
"""
from __future__ import annotations

from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Linear, Weights
from .flux_blocks import chunks, modulate, qkv_heads

EPS = 1e-6


def _float(t: Tensor | None) -> Tensor | None:
    """A block-quantized 1-D weight as F32 (sd-cli's convert quantizes 64-wide ln_q weights; sd.cpp
    dequantizes them into its F32 params at load)."""
    return F.cast(t, "F32") if t is not None and t.dtype.is_quantized else t


class QKNorm:
    """Per-head norm of q or k over D: RMSNorm * weight ("rms") or LayerNorm * weight + bias ("ln")."""

    def __init__(self, w: Weights, kind: str):
        self.weight, self.bias = (_float(t) for t in (w["weight"], w.get("bias")))
        self.kind = kind

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "ln":
            return F.layer_norm_affine(x, self.weight, self.bias, EPS)
        return F.mul(F.rms_norm(x, EPS), self.weight)


class SelfAttention:
    """qkv linear (with bias), optional ln_q/ln_k, (attention outside), proj (absent when pre-only)."""

    def __init__(self, w: Weights, n_head: int, qk_norm: str):
        self.qkv = Linear(w.sub("qkv."))
        self.proj = Linear(w.sub("proj.")) if "proj.weight" in w else None
        self.ln_q = QKNorm(w.sub("ln_q."), qk_norm) if qk_norm else None
        self.ln_k = QKNorm(w.sub("ln_k."), qk_norm) if qk_norm else None
        self.n_head = n_head

    def pre_attention(self, x: Tensor):
        q, k, v = qkv_heads(self.qkv(x), self.n_head, x.ne[0])
        if self.ln_q is not None:
            q, k = self.ln_q(q), self.ln_k(k)
        return q, k, v


def attention(qs, ks, vs, n_head: int) -> Tensor:
    """Joint attention over streams (context then x): q/k/v per stream [D, heads, L_s, N] ->
    softmax(q k^T / sqrt(D)) v over the joined tokens -> [heads*D, L, N]."""
    q, k, v = (F.concat_many(t, 2) for t in (qs, ks, vs))          # [D, heads, L, N]
    D, _, L, N = q.ne4
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))             # views [D, L, heads, N]
    out = F.attention(q, k, v)                                       # [D, L, heads, N]
    return F.cont(out.permute(0, 2, 1, 3)).reshape(D * n_head, L, N)


class Mlp:
    """fc1 -> GELU(tanh) -> fc2."""

    def __init__(self, w: Weights):
        self.fc1, self.fc2 = Linear(w.sub("fc1.")), Linear(w.sub("fc2."))

    def __call__(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DismantledBlock:
    """One stream of a joint block: adaLN modulation (6 vectors; 2 when pre-only, the last
    context block; 9 with SD3.5 Medium's second, x-only attention `attn2`), attention parts, MLP."""

    def __init__(self, w: Weights, n_head: int, qk_norm: str):
        self.adaLN = Linear(w.sub("adaLN_modulation.1."))
        self.attn = SelfAttention(w.sub("attn."), n_head, qk_norm)
        self.attn2 = SelfAttention(w.sub("attn2."), n_head, qk_norm) if "attn2.qkv.weight" in w else None
        self.pre_only = "mlp.fc1.weight" not in w
        self.mlp = None if self.pre_only else Mlp(w.sub("mlp."))
        self.n_mods = 2 if self.pre_only else (9 if self.attn2 is not None else 6)

    def pre_attention(self, x: Tensor, c_silu: Tensor):
        """-> (q, k, v), (q2, k2, v2) or None, the modulation vectors."""
        m = chunks(self.adaLN(c_silu), self.n_mods)
        xn = F.layer_norm(x, EPS)
        qkv = self.attn.pre_attention(modulate(xn, m[0], m[1]))
        qkv2 = self.attn2.pre_attention(modulate(xn, m[6], m[7])) if self.attn2 is not None else None
        return qkv, qkv2, m

    def post_attention(self, x: Tensor, attn: Tensor, attn2: Tensor | None, m) -> Tensor:
        x = F.add(x, F.mul(self.attn.proj(attn), m[2]))
        if attn2 is not None:
            x = F.add(x, F.mul(self.attn2.proj(attn2), m[8]))
        return F.add(x, F.mul(self.mlp(modulate(F.layer_norm(x, EPS), m[3], m[4])), m[5]))


class JointBlock:
    """context_block and x_block attending jointly (context tokens first); the x block's attn2
    attends over the x tokens alone. Returns (context or None after a pre-only block, x)."""

    def __init__(self, w: Weights, n_head: int, qk_norm: str):
        self.context_block = DismantledBlock(w.sub("context_block."), n_head, qk_norm)
        self.x_block = DismantledBlock(w.sub("x_block."), n_head, qk_norm)
        self.n_head = n_head

    def __call__(self, context: Tensor, x: Tensor, c_silu: Tensor):
        cqkv, _, cm = self.context_block.pre_attention(context, c_silu)
        xqkv, xqkv2, xm = self.x_block.pre_attention(x, c_silu)
        attn = attention(*zip(cqkv, xqkv), self.n_head)               # [C, Lc + Lx, N]
        Lc, Lx = context.ne[1], x.ne[1]
        attn2 = attention(*([t] for t in xqkv2), self.n_head) if xqkv2 is not None else None
        x = self.x_block.post_attention(x, attn.slice(1, Lc, Lc + Lx), attn2, xm)
        if self.context_block.pre_only:
            return None, x
        return self.context_block.post_attention(context, attn.slice(1, 0, Lc), None, cm), x


class Embedder:
    """mlp.0 -> SiLU -> mlp.2 (t_embedder on the 256-d frequency embedding, y_embedder on the pooled vector)."""

    def __init__(self, w: Weights):
        self.fc1, self.fc2 = Linear(w.sub("mlp.0.")), Linear(w.sub("mlp.2."))

    def __call__(self, x: Tensor) -> Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class FinalLayer:
    """norm_final (no affine) modulated by adaLN_modulation.1(silu(c)) = (shift, scale), then linear."""

    def __init__(self, w: Weights):
        self.linear = Linear(w.sub("linear."))
        self.adaLN = Linear(w.sub("adaLN_modulation.1."))

    def __call__(self, x: Tensor, c_silu: Tensor) -> Tensor:
        shift, scale = chunks(self.adaLN(c_silu), 2)
        return self.linear(modulate(F.layer_norm(x, EPS), shift, scale))
