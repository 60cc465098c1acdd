"""A Qwen decoder-only LLM used as a text encoder: Qwen3 (Z-Image's Qwen3-4B; q/k RMS norm, no
qkv bias) and the Qwen2 / Qwen2.5(-VL) text stack (Qwen-Image's Qwen2.5-VL-7B; qkv bias, no q/k
norm), as transformers' Qwen3Model / Qwen2Model and stable-diffusion.cpp's llm.hpp compute them.

    from sdrt.models.te.qwen_llm import QwenLLM, PREFIX_LLM
    llm = QwenLLM(table, PREFIX_LLM)                 # config read from the weights
    h = llm.run(ids, out_layer=35)                   # float32 [N, L, hidden]
    node = llm.forward(ids, out_layer=35)            # graph node ne=[hidden, L, N]

Weights under `prefix` (HF names with their `model.` level, as in a Qwen3-4B safetensors file or
a llama.cpp GGUF after sdrt.models.names' map; sd.cpp's canonical prefix for `--llm` is
`text_encoders.llm.`):
    model.embed_tokens.weight                            ne=[hidden, vocab]
    model.layers.N.input_layernorm.weight                ne=[hidden]
    model.layers.N.self_attn.{q,k,v}_proj.weight (.bias: Qwen2)   ne=[hidden, heads*head_dim | kv*head_dim]
    model.layers.N.self_attn.{q,k}_norm.weight (Qwen3)   ne=[head_dim]
    model.layers.N.self_attn.o_proj.weight               ne=[heads*head_dim, hidden]
    model.layers.N.post_attention_layernorm.weight
    model.layers.N.mlp.{gate,up}_proj.weight             ne=[hidden, intermediate]
    model.layers.N.mlp.down_proj.weight                  ne=[intermediate, hidden]
    model.norm.weight
The variant follows the weights (q_norm present: Qwen3; q_proj.bias present: Qwen2). Depth is the
number of `model.layers.N`; width, vocabulary and FFN size come from the shapes; head_dim is the
q_norm width (Qwen3) or 128 (Qwen2.5, as sd.cpp fixes it; `head_dim=` overrides), heads and kv
heads are q_proj's / k_proj's outputs over head_dim: for the released files exactly sd.cpp's fixed
numbers (Qwen3-4B 32/8, Qwen3 2B 16/8, Qwen2.5-VL-7B 28/4, head_dim 128). lm_head / output
weights are not used. Weights of any type mul_mat / get_rows take (F16, BF16, GGUF blocks) are
used as stored.

Forward (both variants): x = embed[ids]; per layer x += o(attn(rms(x))), x += down(silu(gate(h))
* up(h)) with h = rms(x); RMS norms with weights, eps 1e-6 (Qwen3 and sd.cpp's Qwen2.5-VL).
Attention: q, k (Qwen3: each head RMS-normed over head_dim) rotated by NEOX RoPE (pairs (i,
i + head_dim/2), base 1e6, positions 0..L-1; Qwen2.5-VL's M-RoPE equals it for text, whose three
position ids are equal), causal mask, GQA (query head h reads kv head h // (heads / kv_heads)),
scale 1/sqrt(head_dim).

`out_layer` (1-based, sd.cpp's out_layers): the output of that layer, not normed (Z-Image reads
35 of Qwen3-4B's 36: transformers' hidden_states[-2]); 0, or a layer the model does not have
(reduced-depth files), gives the final-norm output of the last layer, as sd.cpp's TextModel does
when no layer matched.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Linear, Weights, token_ids

__all__ = ["PREFIX_LLM", "QwenLLM", "QwenLLMConfig", "causal_mask"]

PREFIX_LLM = "text_encoders.llm."            # sd.cpp's canonical prefix for --llm
_EMBED = "model.embed_tokens.weight"
_RE_LAYER = re.compile(r"model\.layers\.(\d+)\.")
ROPE_BASE = 1000000.0


@dataclass(frozen=True)
class QwenLLMConfig:
    arch: str = "qwen3"          # "qwen3" (q/k norm) or "qwen2" (qkv bias)
    hidden: int = 2560
    intermediate: int = 9728
    layers: int = 36
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    eps: float = 1e-6
    rope_base: float = ROPE_BASE

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    def summary(self) -> str:
        return (f"{self.arch} LLM: {self.layers} layers, hidden {self.hidden}, {self.heads} heads "
                f"({self.kv_heads} kv) x {self.head_dim}, FFN {self.intermediate}, vocab {self.vocab}")

    def with_(self, **kw) -> QwenLLMConfig:
        return replace(self, **kw)

    @classmethod
    def detect_from_weights(cls, tensors: Mapping[str, Tensor] | Weights, prefix: str = PREFIX_LLM,
                            source: str = "model", head_dim: int | None = None) -> QwenLLMConfig:
        w = tensors if isinstance(tensors, Weights) else Weights(tensors, prefix, source)
        emb = w[_EMBED]
        idx = sorted({int(m.group(1)) for k in w.keys() if (m := _RE_LAYER.match(k))})
        if not idx:
            raise ModelFileError(f"{w.source}: no LLM layers (model.layers.N) under {w.prefix!r}")
        if idx != list(range(len(idx))):
            missing = sorted(set(range(idx[-1] + 1)) - set(idx))
            raise ModelFileError(f"{w.source}: {w.prefix}model.layers.{missing[0]} is missing "
                                 f"(layers 0..{idx[-1]} expected)")
        a = "model.layers.0.self_attn."
        qwen3 = (a + "q_norm.weight") in w
        if qwen3:
            hd = w.shape(a + "q_norm.weight")[0]
        else:
            if (a + "q_proj.bias") not in w:
                raise ModelFileError(f"{w.source}: {w.prefix}{a}: neither q_norm (Qwen3) nor q_proj.bias (Qwen2) "
                                     "— not a Qwen LLM")
            hd = head_dim or 128
        C, V = emb.ne[0], emb.ne[1]
        q, k = w.shape(a + "q_proj.weight"), w.shape(a + "k_proj.weight")
        if q[0] != C or k[0] != C:
            raise ModelFileError(f"{w.source}: {w.prefix}{a}q/k_proj take width {q[0]}/{k[0]}, the embedding has {C}")
        if q[1] % hd or k[1] % hd or (q[1] // hd) % max(k[1] // hd, 1):
            raise ModelFileError(f"{w.source}: {w.prefix}{a}: q_proj {q[1]} / k_proj {k[1]} outputs do not make "
                                 f"whole heads of {hd} with query heads a multiple of kv heads")
        ff = w.shape("model.layers.0.mlp.gate_proj.weight")
        return cls(arch="qwen3" if qwen3 else "qwen2", hidden=C, intermediate=ff[1], layers=len(idx),
                   heads=q[1] // hd, kv_heads=k[1] // hd, head_dim=hd, vocab=V)


def causal_mask(L: int) -> np.ndarray:
    """Additive float32 [L(query), L(key)]: -inf where the key comes after the query."""
    m = np.zeros((L, L), np.float32)
    m[np.triu_indices(L, 1)] = -np.inf
    return m


def _check(w: Weights, key: str, ne: tuple) -> Tensor:
    t = w[key]
    if tuple(t.ne) != tuple(ne):
        raise ModelFileError(f"{w.source}: {w.prefix}{key} has shape ne={t.ne}, expected ne={tuple(ne)}")
    return t


class _Layer:
    def __init__(self, w: Weights, cfg: QwenLLMConfig):
        C, D, H, K, I = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.intermediate
        self.cfg = cfg
        self.ln1 = _check(w, "input_layernorm.weight", (C,))
        self.ln2 = _check(w, "post_attention_layernorm.weight", (C,))
        a = w.sub("self_attn.")
        for n, ne in (("q_proj", (C, H * D)), ("k_proj", (C, K * D)), ("v_proj", (C, K * D)), ("o_proj", (H * D, C))):
            _check(a, f"{n}.weight", ne)
        bias = cfg.qkv_bias
        self.q, self.k, self.v = (Linear(a.sub(n + "."), bias=bias) for n in ("q_proj", "k_proj", "v_proj"))
        self.o = Linear(a.sub("o_proj."), bias=False)
        self.q_norm = _check(a, "q_norm.weight", (D,)) if cfg.qk_norm else None
        self.k_norm = _check(a, "k_norm.weight", (D,)) if cfg.qk_norm else None
        m = w.sub("mlp.")
        for n, ne in (("gate_proj", (C, I)), ("up_proj", (C, I)), ("down_proj", (I, C))):
            _check(m, f"{n}.weight", ne)
        self.gate, self.up, self.down = (Linear(m.sub(n + "."), bias=False) for n in ("gate_proj", "up_proj", "down_proj"))

    def __call__(self, x: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        cfg = self.cfg
        D, L, N = cfg.head_dim, x.ne[1], x.ne4[2]
        h = F.mul(F.rms_norm(x, cfg.eps), self.ln1)
        q = self.q(h).reshape(D, cfg.heads, L, N)
        k = self.k(h).reshape(D, cfg.kv_heads, L, N)
        v = self.v(h).reshape(D, cfg.kv_heads, L, N)
        if cfg.qk_norm:
            q = F.mul(F.rms_norm(q, cfg.eps), self.q_norm)
            k = F.mul(F.rms_norm(k, cfg.eps), self.k_norm)
        q = F.rope_ext(q, pos, D, mode="neox", freq_base=cfg.rope_base)
        k = F.rope_ext(k, pos, D, mode="neox", freq_base=cfg.rope_base)
        att = F.attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), mask=mask)
        att = F.cont(att.permute(0, 2, 1, 3)).reshape(cfg.heads * D, L, N)     # [D, L, H, N] -> [H*D, L, N]
        x = F.add(x, self.o(att))
        h = F.mul(F.rms_norm(x, cfg.eps), self.ln2)
        h = self.down(F.mul(F.silu(self.gate(h)), self.up(h)))
        return F.add(x, h)


class QwenLLM:
    """The Qwen3 / Qwen2 decoder stack from weights under `prefix`; see the module docstring."""

    def __init__(self, tensors: Mapping[str, Tensor] | Weights, prefix: str = PREFIX_LLM,
                 config: QwenLLMConfig | None = None, source: str = "model", head_dim: int | None = None):
        w = tensors if isinstance(tensors, Weights) else Weights(tensors, prefix, source)
        self.prefix, self.source = w.prefix, w.source
        self.config = cfg = config or QwenLLMConfig.detect_from_weights(w, head_dim=head_dim)
        self.embed = _check(w, _EMBED, (cfg.hidden, cfg.vocab))
        self.layers = [_Layer(w.sub(f"model.layers.{i}."), cfg) for i in range(cfg.layers)]
        self.norm = _check(w, "model.norm.weight", (cfg.hidden,))

    def reads_layer(self, out_layer: int) -> int:
        """The layer whose un-normed output `out_layer` gives, or 0 for the final-norm output."""
        return out_layer if 0 < out_layer <= self.config.layers else 0

    def forward(self, ids, out_layer: int = 0, *, cut_prefix: str | None = "llm", image_embeds=()) -> Tensor:
        """Hidden states F32 ne=[hidden, L, N] (see `out_layer` in the module docstring).
        image_embeds: ((token index, Tensor [hidden, n]), ...) spliced over the token embeddings
        from that index on (sd.cpp's LLM::forward for Qwen-Image-Edit's vision tokens; N = 1)."""
        cfg = self.config
        a = token_ids(ids, cfg.vocab, "LLM")
        N, L = a.shape
        x = F.get_rows(self.embed, Tensor.from_numpy(a.reshape(-1), name="llm_ids"))
        x = x.reshape(cfg.hidden, L, N)
        if image_embeds:
            x = _splice(x, image_embeds, L, N)
        pos = Tensor.from_numpy(np.arange(L, dtype=np.int32), name="llm_pos")
        mask = Tensor.from_numpy(causal_mask(L), name="llm_causal_mask")
        stop = self.reads_layer(out_layer)
        if cut_prefix:
            F.mark_cut(x, f"{cut_prefix}.prelude")
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, mask)
            if i + 1 == stop:
                return x
            if cut_prefix:
                F.mark_cut(x, f"{cut_prefix}.layer.{i}")
        return F.mul(F.rms_norm(x, cfg.eps), self.norm)

    def run(self, ids, out_layer: int = 0, backend: str = "cpu", image_embeds=()) -> np.ndarray:
        """forward + execute: float32 [N, L, hidden]."""
        r = F.Graph({"hidden": self.forward(ids, out_layer, image_embeds=image_embeds)}).run(backend)["hidden"].to_f32()
        return r.reshape((-1,) + r.shape[-2:])


def _splice(x: Tensor, image_embeds, L: int, N: int) -> Tensor:
    """x [hidden, L, 1] with rows [i, i + n) replaced by each (i, embed [hidden, n])."""
    if N != 1:
        raise UsageError("LLM: image embeddings need a batch of 1")
    parts, at = [], 0
    for i, e in sorted(image_embeds, key=lambda p: p[0]):
        n = e.ne[1]
        if i < at or i + n > L or e.ne[0] != x.ne[0]:
            raise UsageError(f"LLM: an image embedding of {n} tokens x {e.ne[0]} at token {i} does not fit "
                             f"{L} tokens x {x.ne[0]}")
        if i > at:
            parts.append(x.slice(1, at, i))
        parts.append(F.cast(e, "F32").reshape(x.ne[0], n, 1) if e.dtype.name != "F32" else e.reshape(x.ne[0], n, 1))
        at = i + n
    if at < L:
        parts.append(x.slice(1, at, L))
    return F.concat_many(parts, 1) if len(parts) > 1 else parts[0]
