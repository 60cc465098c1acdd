"""CLIP text encoders of SD1 (OpenAI CLIP-L/14), SD2 (OpenCLIP ViT-H/14) and SDXL (CLIP-L +
OpenCLIP ViT-bigG/14), as stable-diffusion.cpp's clip.hpp builds them.

Weights are read under a prefix with HF CLIP names (the canonical layout; sdrt.models.names turns
OpenCLIP's `model.transformer.resblocks.N.*` into these and keeps its fused `in_proj`):
    SD1, SDXL CLIP-L      cond_stage_model.transformer.text_model.
    SD2 OpenCLIP-H        cond_stage_model.transformer.text_model.
    SDXL OpenCLIP-bigG    cond_stage_model.1.transformer.text_model.
under which: embeddings.token_embedding.weight ne=[C, V], embeddings.position_embedding.weight
ne=[C, 77], encoder.layers.N.{layer_norm1,layer_norm2}.{weight,bias}, encoder.layers.N.self_attn.
{q_proj,k_proj,v_proj,out_proj}.{weight,bias} (or self_attn.in_proj.{weight,bias} ne=[C, 3C], q k v
stacked), encoder.layers.N.mlp.{fc1,fc2}.{weight,bias}, final_layer_norm.{weight,bias} and, for
bigG, text_projection.

Forward (sd.cpp semantics): token + position embeddings; pre-LN transformer layers with a causal
mask; `clip_skip` k > 0 stops after layer n_layer - k (1 = last layer, 2 = penultimate, <= 0 all);
`final_ln` applies final_layer_norm to that output (sd.cpp: on for SD1/SD2, off for SDXL). The
pooled output always runs every layer: final_layer_norm(last hidden)[EOS position] @ projection.

Two places where sd.cpp departs from the reference models, selectable here:
- activation: sd.cpp picks quick_gelu for width 768 and ggml_gelu (the tanh form) for 1024/1280,
  where open_clip uses the exact erf GELU. `act` is "quick_gelu", "gelu_tanh" or "gelu" (erf).
- text_projection: sd.cpp applies the tensor as a Linear weight (torch [out, in]) whatever the
  file, which is right for diffusers/HF files and transposed for original SDXL checkpoints
  (OpenCLIP keeps it as [in, out] and computes x @ P). `projection_layout` "linear" (sd.cpp,
  HF) or "matmul" (OpenCLIP's x @ P).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import LayerNorm, Linear, Weights, multihead_attention
from .spec import TextEncoderSpec

__all__ = ["ACTS", "PREFIX_CLIP_G", "PREFIX_CLIP_L", "CLIPConfig", "CLIPTextModel", "TextEncoderSpec", "causal_mask"]

ACTS = ("quick_gelu", "gelu_tanh", "gelu")
PREFIX_CLIP_L = "cond_stage_model.transformer.text_model."
PREFIX_CLIP_G = "cond_stage_model.1.transformer.text_model."
_RE_LAYER = re.compile(r"encoder\.layers\.(\d+)\.layer_norm1\.weight")


@dataclass(frozen=True)
class CLIPConfig:
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 3072
    vocab: int = 49408
    positions: int = 77
    act: str = "quick_gelu"
    fused_qkv: bool = False          # OpenCLIP's self_attn.in_proj
    projection_dim: int = 0          # 0: no text_projection tensor
    projection_layout: str = "linear"
    eps: float = 1e-5

    @classmethod
    def detect_from_weights(cls, tensors: Mapping[str, Tensor], prefix: str, *, act: str | None = None,
                            heads: int | None = None, projection_layout: str = "linear",
                            source: str = "model") -> CLIPConfig:
        """Config from the shapes under `prefix`. heads default to width/64 (every CLIP text
        model); act defaults to sd.cpp's rule (gelu_tanh for widths 1024/1280, else quick_gelu)."""
        w = Weights(tensors, prefix, source)
        C, V = w.shape("embeddings.token_embedding.weight")[:2]
        pos = w.shape("embeddings.position_embedding.weight")
        if pos[0] != C:
            raise ModelFileError(f"{source}: {prefix}embeddings.position_embedding.weight has width {pos[0]}, "
                                 f"the token embedding {C}")
        idx = sorted(int(m.group(1)) for k in list(w.keys()) if (m := _RE_LAYER.fullmatch(k)))
        if not idx or idx != list(range(len(idx))):
            raise ModelFileError(f"{source}: no encoder.layers.0..N-1 under {prefix!r} (found {idx[:8]})")
        fused = "encoder.layers.0.self_attn.in_proj.weight" in w
        inter = w.shape("encoder.layers.0.mlp.fc1.weight")[1]
        proj = w.get("text_projection")
        if act is None:
            act = "gelu_tanh" if C in (1024, 1280) else "quick_gelu"
        heads = heads or max(1, C // 64)
        pdim = 0
        if proj is not None:
            if proj.ndim != 2 or C not in proj.ne:
                raise ModelFileError(f"{source}: {prefix}text_projection has shape {proj.ne}, expected a "
                                     f"[{C}, P] matrix")
            pdim = proj.ne[1] if projection_layout == "linear" else proj.ne[0]
            if (proj.ne[0] if projection_layout == "linear" else proj.ne[1]) != C:
                raise ModelFileError(f"{source}: {prefix}text_projection ne={proj.ne} does not take width {C} "
                                     f"as a {projection_layout!r} projection")
        cfg = cls(hidden=C, layers=len(idx), heads=heads, intermediate=inter, vocab=V, positions=pos[1],
                  act=act, fused_qkv=fused, projection_dim=pdim, projection_layout=projection_layout)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.act not in ACTS:
            raise UsageError(f"CLIP activation {self.act!r}: choose one of {', '.join(ACTS)}")
        if self.projection_layout not in ("linear", "matmul"):
            raise UsageError(f"text_projection layout {self.projection_layout!r}: 'linear' or 'matmul'")
        if self.hidden % self.heads:
            raise UsageError(f"CLIP width {self.hidden} is not a multiple of {self.heads} heads")

    def with_(self, **kw) -> CLIPConfig:
        return replace(self, **kw)


def causal_mask(L: int) -> Tensor:
    """F32 ne=[L, L]: 0 where key <= query, -inf after (mask[q, k] in numpy order)."""
    m = np.triu(np.full((L, L), -np.inf, np.float32), k=1)
    return Tensor.from_numpy(m, name="causal_mask")


class _Layer:
    """One pre-LN block: x + attn(ln1(x)); x + mlp(ln2(x)). x ne=[C, L, N]."""

    def __init__(self, w: Weights, cfg: CLIPConfig):
        self.cfg = cfg
        self.layer_norm1 = LayerNorm(w.sub("layer_norm1."), cfg.eps)
        self.layer_norm2 = LayerNorm(w.sub("layer_norm2."), cfg.eps)
        a = w.sub("self_attn.")
        if cfg.fused_qkv:
            self.in_proj = Linear(a.sub("in_proj."), bias=True)
            if self.in_proj.out_features != 3 * cfg.hidden:
                raise ModelFileError(f"{w.source}: {a.prefix}in_proj.weight has {self.in_proj.out_features} "
                                     f"outputs, expected 3 x {cfg.hidden}")
        else:
            self.q_proj, self.k_proj, self.v_proj = (Linear(a.sub(n + "."), bias=True) for n in ("q_proj", "k_proj", "v_proj"))
        self.out_proj = Linear(a.sub("out_proj."), bias=True)
        self.fc1, self.fc2 = Linear(w.sub("mlp.fc1."), bias=True), Linear(w.sub("mlp.fc2."), bias=True)

    def __call__(self, x: Tensor, mask: Tensor) -> Tensor:
        C = self.cfg.hidden
        h = self.layer_norm1(x)
        if self.cfg.fused_qkv:
            qkv = self.in_proj(h)                                   # [3C, L, N]
            q, k, v = (qkv.slice(0, i * C, (i + 1) * C) for i in range(3))
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)  # [C, L, N]
        x = F.add(x, self.out_proj(multihead_attention(q, k, v, self.cfg.heads, mask)))
        h = self.fc1(self.layer_norm2(x))                           # [I, L, N]
        act = self.cfg.act
        h = F.gelu_quick(h) if act == "quick_gelu" else F.gelu(h, "tanh" if act == "gelu_tanh" else "none")
        return F.add(x, self.fc2(h))


class CLIPTextModel:
    """HF CLIPTextModel(WithProjection) from canonical weights under `prefix`.

    `forward(ids, ...)` builds the graph: ids int [N, L] (numpy) or an I32 Tensor ne=[L, N];
    returns (hidden ne=[C, L, N], pooled ne=[P, N] or None). `run(...)` also executes it and
    returns numpy arrays in torch order ([N, L, C], [N, P])."""

    def __init__(self, tensors: Mapping[str, Tensor] | Weights, prefix: str = PREFIX_CLIP_L,
                 config: CLIPConfig | None = None, source: str = "model"):
        w = tensors if isinstance(tensors, Weights) else Weights(tensors, prefix, source)
        self.prefix = w.prefix
        self.config = cfg = config or CLIPConfig.detect_from_weights(w.table, w.prefix, source=w.source)
        cfg.check()
        self.token_embedding = w["embeddings.token_embedding.weight"]       # [C, V]
        self.position_embedding = w["embeddings.position_embedding.weight"]  # [C, P]
        self.layers = [_Layer(w.sub(f"encoder.layers.{i}."), cfg) for i in range(cfg.layers)]
        self.final_layer_norm = LayerNorm(w.sub("final_layer_norm."), cfg.eps)
        if self.final_layer_norm.weight is None:
            w["final_layer_norm.weight"]                                      # raises, naming it
        self.text_projection = w.get("text_projection") if cfg.projection_dim else None

    # ---- graph ---------------------------------------------------------------------------
    def embed(self, ids, custom: Tensor | None = None) -> Tensor:
        """Token + position embeddings, ne=[C, L, N]. Ids >= vocab select rows of `custom`
        (F32 ne=[C, n_custom], textual inversion), as sd.cpp's concatenated table does."""
        V = self.config.vocab
        if isinstance(ids, Tensor):
            if custom is not None:
                raise UsageError("custom embeddings need the ids as a numpy array")
            L = ids.ne[0]
            N = ids.ne4[1]
            tok = F.get_rows(self.token_embedding, ids.reshape(L * N) if ids.ndim > 1 else ids)
        else:
            a = np.asarray(ids)
            a = a.reshape(1, -1) if a.ndim == 1 else a
            N, L = a.shape
            n_custom = 0 if custom is None else custom.ne4[1]
            if a.size and (a.min() < 0 or a.max() >= V + n_custom):
                raise UsageError(f"token id {int(a.max()) if a.max() >= V else int(a.min())} is outside the "
                                 f"vocabulary of {V} (+{n_custom} custom embeddings)")
            is_custom = a >= V
            tok = F.get_rows(self.token_embedding,
                             Tensor.from_numpy(np.where(is_custom, 0, a).astype(np.int32).reshape(-1), name="input_ids"))
            if is_custom.any():
                if custom.ne[0] != self.config.hidden:
                    raise UsageError(f"custom embeddings have width {custom.ne[0]}, the model {self.config.hidden}")
                cus = F.get_rows(custom, Tensor.from_numpy(np.where(is_custom, a - V, 0).astype(np.int32).reshape(-1)))
                m = Tensor.from_numpy(is_custom.astype(np.float32).reshape(-1, 1), name="custom_mask")  # ne=[1, L*N]
                keep = Tensor.from_numpy((~is_custom).astype(np.float32).reshape(-1, 1))
                tok = F.add(F.mul(tok, keep), F.mul(cus, m))   # exact rows of either table
        tok = tok.reshape(self.config.hidden, L, N)                          # [C, L*N] -> [C, L, N]
        if L > self.config.positions:
            raise UsageError(f"{L} tokens, the text model has {self.config.positions} positions")
        pos = self.position_embedding
        if L < pos.ne[1]:
            pos = pos.slice(1, 0, L)
        return F.add(tok, pos)

    def forward(self, ids, *, clip_skip: int = -1, final_ln: bool = True, custom: Tensor | None = None,
                eos_index: Sequence[int] | None = None, cut_prefix: str | None = "clip_text"):
        """(hidden ne=[C, L, N], pooled ne=[P, N] or None). `eos_index`: per batch item, the
        position whose final-normed state is pooled (and projected if the model has a
        text_projection); None skips the pooled output."""
        cfg = self.config
        stop = cfg.layers if clip_skip is None or clip_skip <= 0 else cfg.layers - clip_skip + 1
        if stop < 1:
            raise UsageError(f"clip_skip {clip_skip}: the text model has only {cfg.layers} layers")
        x = self.embed(ids, custom)
        L = x.ne[1]
        N = x.ne4[2]
        mask = causal_mask(L)
        last = cfg.layers if eos_index is not None else stop
        hidden = None
        for i in range(last):
            x = self.layers[i](x, mask)
            if cut_prefix:
                F.mark_cut(x, f"{cut_prefix}.layers.{i}")
            if i == stop - 1:
                hidden = x
        if final_ln:
            hidden = self.final_layer_norm(hidden)
        pooled = None
        if eos_index is not None:
            eos = np.asarray(eos_index, np.int64).reshape(-1)
            if eos.size != N or eos.min() < 0 or eos.max() >= L:
                raise UsageError(f"eos_index {eos.tolist()} must give one position in [0, {L}) per batch item ({N})")
            xf = hidden if (final_ln and stop == cfg.layers) else self.final_layer_norm(x)
            flat = xf.reshape(cfg.hidden, L * N) if xf.is_contiguous() else F.cont(xf).reshape(cfg.hidden, L * N)
            rows = Tensor.from_numpy((eos + np.arange(N) * L).astype(np.int32), name="eos_rows")
            pooled = F.get_rows(flat, rows)                                     # [C, N]
            if self.text_projection is not None:
                p = self.text_projection
                if cfg.projection_layout == "matmul":                           # x @ P, P ne=[P, C]
                    p = F.cont(p.transpose())
                pooled = F.linear(pooled, p)                                    # [P, N]
        return hidden, pooled

    def run(self, ids, **kw) -> tuple[np.ndarray, np.ndarray | None]:
        """forward + execute: (hidden [N, L, C] float32, pooled [N, P] or None)."""
        hidden, pooled = self.forward(ids, **kw)
        outs = {"hidden": hidden}
        if pooled is not None:
            outs["pooled"] = pooled
        res = F.Graph(outs).run()
        h = res["hidden"].to_f32()
        return h.reshape((-1,) + h.shape[-2:]), (res["pooled"].to_f32().reshape(-1, pooled.ne[0])
                                                if pooled is not None else None)
