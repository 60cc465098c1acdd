"""The Flux.1 transformer's blocks (BFL flux/modules/layers.py; sd.cpp flux.hpp).

Each block takes a `Weights` view at its checkpoint prefix (`double_blocks.3.`); attribute names
are BFL's keys. Shapes in ne order: a token sequence is [C, L, N], the conditioning vector
`vec` [C, N], one head's q/k/v [D, heads, L, N].

Numerics are BFL's (and sd.cpp's): LayerNorms without affine at eps 1e-6, QK RMSNorm at eps
1e-6 times its `scale`, the tanh GELU in the MLPs, modulation `(1 + scale) * x + shift`.
"""
from __future__ import annotations

from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import RUNTIME_LORA, Linear, Weights

EPS = 1e-6


class MLPEmbedder:
    """in_layer -> SiLU -> out_layer (time_in, vector_in, guidance_in)."""

    def __init__(self, w: Weights):
        self.in_layer = Linear(w.sub("in_layer."))
        self.out_layer = Linear(w.sub("out_layer."))

    def __call__(self, x: Tensor) -> Tensor:  # [in, N] -> [C, N]
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNorm:
    """x / rms(x) * scale over ne[0] (BFL's RMSNorm: the weight is called `scale`)."""

    def __init__(self, w: Weights):
        self.scale = w["scale"]

    def __call__(self, x: Tensor) -> Tensor:
        return F.mul(F.rms_norm(x, EPS), self.scale)


def chunks(m: Tensor, n: int) -> list[Tensor]:
    """[n*C, N] (contiguous) -> n views [C, 1, N], ready to broadcast over the tokens of [C, L, N]."""
    C, N = m.ne[0] // n, m.ne4[1]
    es = m.nb[0]
    row = es * m.ne[0]
    return [m.view((C, 1, N), (es, row, row), offset=j * C * es) for j in range(n)]


class Modulation:
    """lin(silu(vec)) split into (shift, scale, gate) x (2 if double else 1)."""

    def __init__(self, w: Weights, n: int):
        self.lin, self.n = Linear(w.sub("lin.")), n

    def __call__(self, vec_silu: Tensor) -> list[Tensor]:
        return chunks(self.lin(vec_silu), self.n)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """(1 + scale) * x + shift; x [C, L, N], shift/scale [C, 1, N]."""
    return F.add(F.mul(x, F.scale(scale, 1.0, 1.0)), shift)


def qkv_heads(t: Tensor, n_head: int, hidden: int, offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Views q, k, v [D, heads, L, N] of a projection [3*hidden (+ more), L, N] (zero copy)."""
    D = hidden // n_head
    es, L, N = t.nb[0], t.ne[1], t.ne4[2]
    nb = (es, es * D, t.nb[1], t.nb[1] * L)
    return tuple(t.view((D, n_head, L, N), nb, offset=(offset + j * hidden) * es) for j in range(3))


def roped(ts, pe: Tensor) -> Tensor:
    """RoPE of the joined tokens of streams ts [D, heads, L_s, N] (in pe's token order) ->
    [D, L, heads*N]: each stream roped with its slice of pe, then joined. Rope is per token, so
    this is rope(concat(ts)); roped first, the QK norm before it and the rope fuse on a GPU
    (cuda/fuse.py) and the join copies the rope's F16 output instead of F32."""
    out, start = [], 0
    for t in ts:
        L = t.ne[2]
        out.append(F.rope(t, pe if len(ts) == 1 else pe.slice(3, start, start + L)))
        start += L
    return F.concat_many(out, 1)


def attention(qs, ks, vs, pe: Tensor, n_head: int, mask: Tensor | None = None) -> Tensor:
    """Joint attention over streams (txt then img): q/k/v per stream [D, heads, L_s, N] -> RoPE on
    q and k over the joined tokens, softmax(q k^T / sqrt(D) + mask) v -> [heads*D, L, N].
    mask: additive per key, [L, 1, 1, N or 1] (Chroma's T5 padding mask)."""
    v = F.concat_many(vs, 2)                                      # [D, heads, L, N]
    D, _, L, N = v.ne4
    q = roped(qs, pe).reshape(D, L, n_head, N)                    # [D, L, heads, N]
    k = roped(ks, pe).reshape(D, L, n_head, N)
    v = v.permute(0, 2, 1, 3)                                     # view [D, L, heads, N]
    out = F.attention(q, k, v, mask=mask)                         # [D, L, heads, N]
    return F.cont(out.permute(0, 2, 1, 3)).reshape(D * n_head, L, N)


class SelfAttention:
    """qkv linear, QK RMSNorm per head, (attention outside), proj."""

    def __init__(self, w: Weights, n_head: int):
        self.qkv = Linear(w.sub("qkv."))
        self.q_norm = RMSNorm(w.sub("norm.query_norm."))
        self.k_norm = RMSNorm(w.sub("norm.key_norm."))
        self.proj = Linear(w.sub("proj."))
        self.n_head = n_head

    def pre_attention(self, x: Tensor):
        hidden = x.ne[0]
        q, k, v = qkv_heads(self.qkv(x), self.n_head, hidden)
        return self.q_norm(q), self.k_norm(k), v


class MLP:
    """`0` -> GELU(tanh) -> `2`."""

    def __init__(self, w: Weights):
        self.fc1, self.fc2 = Linear(w.sub("0.")), Linear(w.sub("2."))

    def __call__(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DoubleStreamBlock:
    """img and txt streams, each modulated and normed, attending jointly (txt tokens first)."""

    def __init__(self, w: Weights, n_head: int):
        own = "img_mod.lin.weight" in w   # Chroma: modulation comes from the approximator
        self.img_mod = Modulation(w.sub("img_mod."), 6) if own else None
        self.txt_mod = Modulation(w.sub("txt_mod."), 6) if own else None
        self.img_attn, self.txt_attn = SelfAttention(w.sub("img_attn."), n_head), SelfAttention(w.sub("txt_attn."), n_head)
        self.img_mlp, self.txt_mlp = MLP(w.sub("img_mlp.")), MLP(w.sub("txt_mlp."))
        self.n_head = n_head

    def __call__(self, img: Tensor, txt: Tensor, vec_silu: Tensor, pe: Tensor, mods=None, mask=None):
        # img [C, Li, N], txt [C, Lt, N], vec_silu [C, N]; mods: Chroma's precomputed (img, txt) chunks
        im = mods[0] if mods else self.img_mod(vec_silu)
        tm = mods[1] if mods else self.txt_mod(vec_silu)
        iq, ik, iv = self.img_attn.pre_attention(modulate(F.layer_norm(img, EPS), im[0], im[1]))
        tq, tk, tv = self.txt_attn.pre_attention(modulate(F.layer_norm(txt, EPS), tm[0], tm[1]))
        attn = attention((tq, iq), (tk, ik), (tv, iv), pe, self.n_head, mask)   # [C, Lt+Li, N]
        Lt, Li = txt.ne[1], img.ne[1]
        img = F.add(img, F.mul(self.img_attn.proj(attn.slice(1, Lt, Lt + Li)), im[2]))
        img = F.add(img, F.mul(self.img_mlp(modulate(F.layer_norm(img, EPS), im[3], im[4])), im[5]))
        txt = F.add(txt, F.mul(self.txt_attn.proj(attn.slice(1, 0, Lt)), tm[2]))
        txt = F.add(txt, F.mul(self.txt_mlp(modulate(F.layer_norm(txt, EPS), tm[3], tm[4])), tm[5]))
        return img, txt


class SingleStreamBlock:
    """One fused linear1 -> (q, k, v, mlp) on the joined tokens, attention and GELU(mlp) joined
    into linear2, gated residual."""

    def __init__(self, w: Weights, n_head: int, hidden: int):
        self.linear1, self.linear2 = Linear(w.sub("linear1.")), Linear(w.sub("linear2."))
        self.q_norm = RMSNorm(w.sub("norm.query_norm."))
        self.k_norm = RMSNorm(w.sub("norm.key_norm."))
        self.modulation = Modulation(w.sub("modulation."), 3) if "modulation.lin.weight" in w else None
        self.n_head, self.hidden = n_head, hidden
        self.mlp_hidden = self.linear1.out_features - 3 * hidden

    def _linear1(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(q, k, v projection [3C, L, N], GELU(mlp) [M, L, N]) of linear1. As two products over
        the weight's row blocks (the values of the one product): the MLP's GELU then follows its
        own bias GEMM, which a GPU runs as one GEMM with a GELU epilogue (cuda/fuse.py) instead of
        writing the MLP half in F32 and reading it back. A run-time LoRA on linear1 keeps the one
        product (its path is built for the whole weight)."""
        C3, lin = 3 * self.hidden, self.linear1
        if RUNTIME_LORA.get(lin.weight) is not None:
            h = lin(x)                                                   # [3C + M, L, N]
            return h.slice(0, 0, C3), F.gelu(h.slice(0, C3), approximate="tanh")
        w, b = lin.weight, lin.bias
        part = lambda lo, hi: F.linear(x, w.slice(1, lo, hi), None if b is None else b.slice(0, lo, hi))  # noqa: E731
        return part(0, C3), F.gelu(part(C3, lin.out_features), approximate="tanh")

    def __call__(self, x: Tensor, vec_silu: Tensor, pe: Tensor, mods=None, mask=None) -> Tensor:
        # x [C, L, N] -> [C, L, N]
        shift, scale, gate = mods if mods else self.modulation(vec_silu)
        qkv, mlp = self._linear1(modulate(F.layer_norm(x, EPS), shift, scale))
        q, k, v = qkv_heads(qkv, self.n_head, self.hidden)
        attn = attention((self.q_norm(q),), (self.k_norm(k),), (v,), pe, self.n_head, mask)  # [C, L, N]
        out = self.linear2(F.concat(attn, mlp, 0))
        return F.add(x, F.mul(out, gate))


class LastLayer:
    """norm_final (no affine) modulated by adaLN_modulation.1(silu(vec)) = (shift, scale), then linear."""

    def __init__(self, w: Weights):
        self.linear = Linear(w.sub("linear."))
        self.ada = Linear(w.sub("adaLN_modulation.1.")) if "adaLN_modulation.1.weight" in w else None

    def __call__(self, x: Tensor, vec_silu: Tensor, mods=None) -> Tensor:
        shift, scale = mods if mods else chunks(self.ada(vec_silu), 2)
        return self.linear(modulate(F.layer_norm(x, EPS), shift, scale))


class ChromaApproximator:
    """Chroma's distilled modulation: in_proj -> n x (x += MLPEmbedder(RMSNorm(x))) -> out_proj."""

    def __init__(self, w: Weights):
        self.in_proj, self.out_proj = Linear(w.sub("in_proj.")), Linear(w.sub("out_proj."))
        n = 0
        while f"layers.{n}.in_layer.weight" in w:
            n += 1
        self.layers = [(RMSNorm(w.sub(f"norms.{i}.")), MLPEmbedder(w.sub(f"layers.{i}."))) for i in range(n)]

    def __call__(self, x: Tensor) -> Tensor:
        x = self.in_proj(x)
        for norm, mlp in self.layers:
            x = F.add(x, mlp(norm(x)))
        return self.out_proj(x)


# ---- patches ---------------------------------------------------------------------------------
def pad_to_patch(x: Tensor, p: int) -> Tensor:
    """Zero-pad W and H (right/bottom) to multiples of p, as sd.cpp's pad_to_patch_size."""
    pw, ph = (-x.ne[0]) % p, (-x.ne[1]) % p
    return F.pad(x, [(0, pw), (0, ph)]) if pw or ph else x


def patchify(x: Tensor, p: int = 2) -> Tensor:
    """[W, H, C, N] (W, H multiples of p) -> tokens [C*p*p, (H/p)*(W/p), N]: BFL's
    "b c (h ph) (w pw) -> b (h w) (c ph pw)", token index h*w_len + w."""
    W, H, C, N = x.ne4
    w, h = W // p, H // p
    if not x.is_contiguous():
        x = F.cont(x)
    t = F.cont(x.reshape(p, w, p, h * C * N).permute(0, 2, 1, 3))     # [pw, ph, w, h*C*N]
    t = F.cont(t.reshape(p * p, w * h, C, N).permute(0, 2, 1, 3))     # [p*p, C, h*w, N]
    return t.reshape(p * p * C, w * h, N)


def unpatchify(t: Tensor, h: int, w: int, p: int = 2) -> Tensor:
    """tokens [C*p*p, h*w, N] -> [w*p, h*p, C, N] (patchify's inverse)."""
    C, N = t.ne[0] // (p * p), t.ne4[2]
    if not t.is_contiguous():
        t = F.cont(t)
    x = F.cont(t.reshape(p * p, C, w * h, N).permute(0, 2, 1, 3))     # [p*p, h*w, C, N]
    x = F.cont(x.reshape(p, p, w, h * C * N).permute(0, 2, 1, 3))     # [pw, w, ph, h*C*N]
    return x.reshape(w * p, h * p, C, N)
