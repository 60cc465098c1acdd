"""The T5 v1.1 encoder (T5-XXL: the text encoder of Flux, SD3 and Chroma), as Hugging Face's
T5EncoderModel and stable-diffusion.cpp's t5.hpp compute it.

    from sdrt.models.te.t5 import T5Encoder, find_t5_prefix
    enc = T5Encoder(table, find_t5_prefix(table))       # config read from the weights
    h = enc.forward(ids, mask)                          # graph node, ne=[d_model, L, N]
    h = enc.run(ids, mask)                              # float32 numpy [N, L, d_model]
    c = enc.encode_chunks(ids, 256)                     # sd.cpp's chunked pass: [1, n*256, d_model]

`ids`: int [L] or [N, L] (numpy), `mask`: optional 0/1 (or bool) of the same shape, 1 = a real
token. A masked key gets -inf in every head's scores (HF's extended attention mask; sd.cpp's
Chroma `--chroma-enable-t5-mask`); queries are never masked, so padded positions still get
hidden states, as in both references.

Weights under `prefix` (HF T5EncoderModel names; sd.cpp's canonical prefix for a standalone
t5xxl file is `text_encoders.t5xxl.transformer.`, a bare T5EncoderModel / diffusers
`text_encoder_2` file has none):
    shared.weight (or encoder.embed_tokens.weight)             ne=[d_model, vocab]
    encoder.block.N.layer.0.layer_norm.weight                  ne=[d_model]
    encoder.block.N.layer.0.SelfAttention.{q,k,v}.weight       ne=[d_model, H*d_kv]
    encoder.block.N.layer.0.SelfAttention.o.weight             ne=[H*d_kv, d_model]
    encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight   ne=[H, 32]
    encoder.block.N.layer.1.layer_norm.weight
    encoder.block.N.layer.1.DenseReluDense.{wi_0,wi_1}.weight  ne=[d_model, d_ff]
    encoder.block.N.layer.1.DenseReluDense.wo.weight           ne=[d_ff, d_model]
    encoder.final_layer_norm.weight
Depth is the number of `encoder.block.N` (reduced-depth files load); width, heads (inner width /
64, as sd.cpp and every T5 v1.1 size), FFN size and vocabulary come from the shapes. Weights
of any type mul_mat / get_rows take (F32, F16, BF16, F8_E4M3, GGUF blocks) are used as stored.

Forward (T5 v1.1): x = shared[ids]; per block x += o(attn(rms(x) * w)), x += wo(gelu_tanh(wi_0 h)
* wi_1 h) with h = rms(x) * w; final rms norm. RMS norm: no mean, eps 1e-6. Attention is not
scaled by 1/sqrt(d_kv) (T5 folds it into the weights); its additive bias is block 0's
relative_attention_bias at bidirectional log buckets (32 buckets, max distance 128), shared by
every block. The FFN's gated product reaches past F16's range on T5-XXL, and a GPU backend
reads an F16 GEMM's input as F16: as sd.cpp does, it is scaled by 1/32 before `wo` and the
result by 32 after (exact powers of two: the F32 CPU result is unchanged).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Linear, Weights, token_ids

__all__ = ["PREFIX_T5XXL", "T5Config", "T5Encoder", "find_t5_prefix", "relative_position_bucket"]

PREFIX_T5XXL = "text_encoders.t5xxl.transformer."   # sd.cpp's canonical prefix for --t5xxl
_Q0 = "encoder.block.0.layer.0.SelfAttention.q.weight"
_RE_BLOCK = re.compile(r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.q\.weight")
_EMBED_KEYS = ("shared.weight", "encoder.embed_tokens.weight")


def find_t5_prefix(table: Mapping[str, Tensor]) -> str:
    """The prefix under which `table` holds a T5 encoder (sd.cpp's canonical one preferred)."""
    if PREFIX_T5XXL + _Q0 in table:
        return PREFIX_T5XXL
    found = sorted(k[:-len(_Q0)] for k in table if k.endswith(_Q0))
    if not found:
        raise ModelFileError(f"no T5 encoder in this file: no tensor ends with {_Q0!r}")
    return found[0]


def relative_position_bucket(rel: np.ndarray, num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """T5's bidirectional bucket of relative positions `rel` = key - query (int array).
    Half the buckets for keys after the query; in each half, exact buckets for distances below
    num_buckets/4, then log-spaced up to max_distance; the log step in float32, as torch and
    sd.cpp compute it."""
    rel = np.asarray(rel, np.int64)
    half = num_buckets // 2
    bucket = np.where(rel > 0, half, 0)
    n = np.abs(rel)
    max_exact = half // 2
    with np.errstate(divide="ignore"):
        ratio = np.log(n.astype(np.float32) / np.float32(max_exact)) / np.float32(np.log(max_distance / max_exact))
        large = max_exact + np.trunc(np.maximum(ratio, 0) * np.float32(half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (bucket + np.where(n < max_exact, n, large)).astype(np.int32)


@dataclass(frozen=True)
class T5Config:
    d_model: int = 4096
    layers: int = 24
    heads: int = 64
    d_kv: int = 64
    d_ff: int = 10240
    vocab: int = 32128
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6

    @classmethod
    def detect_from_weights(cls, tensors: Mapping[str, Tensor] | Weights, prefix: str = PREFIX_T5XXL,
                            source: str = "model", d_kv: int = 64) -> T5Config:
        w = tensors if isinstance(tensors, Weights) else Weights(tensors, prefix, source)
        emb = next((w[k] for k in _EMBED_KEYS if k in w), None)
        if emb is None:
            w[_EMBED_KEYS[0]]                                                  # raises, naming it
        idx = sorted(int(m.group(1)) for k in w.keys() if (m := _RE_BLOCK.fullmatch(k)))
        if not idx:
            raise ModelFileError(f"{w.source}: no encoder.block.N under {w.prefix!r}")
        if idx != list(range(len(idx))):
            missing = sorted(set(range(idx[-1] + 1)) - set(idx))
            raise ModelFileError(f"{w.source}: {w.prefix}encoder.block.{missing[0]} is missing "
                                 f"(blocks 0..{idx[-1]} expected)")
        C, V = emb.ne[0], emb.ne[1]
        q = w.shape(_Q0)
        if q[0] != C:
            raise ModelFileError(f"{w.source}: {w.prefix}{_Q0} takes width {q[0]}, the embedding has {C}")
        if q[1] % d_kv:
            raise ModelFileError(f"{w.source}: {w.prefix}{_Q0} has {q[1]} outputs, not a multiple of d_kv {d_kv}")
        rb = w.shape("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        ff = w.shape("encoder.block.0.layer.1.DenseReluDense.wi_0.weight")
        cfg = cls(d_model=C, layers=len(idx), heads=q[1] // d_kv, d_kv=d_kv, d_ff=ff[1], vocab=V,
                  num_buckets=rb[1] if len(rb) > 1 else 1)
        if rb[0] != cfg.heads:
            raise ModelFileError(f"{w.source}: relative_attention_bias has {rb[0]} heads, q/k/v give "
                                 f"{cfg.heads} ({q[1]} / d_kv {d_kv})")
        return cfg

    @property
    def inner(self) -> int:
        return self.heads * self.d_kv


def _check_shape(w: Weights, key: str, ne: tuple[int, ...]) -> Tensor:
    t = w[key]
    if tuple(t.ne) != ne:
        raise ModelFileError(f"{w.source}: {w.prefix}{key} has shape ne={t.ne}, expected ne={ne}")
    return t


class _RMSNorm:
    """T5LayerNorm: x / sqrt(mean(x^2) + eps) * weight (no mean subtraction, no bias)."""

    def __init__(self, w: Weights, dim: int, eps: float):
        self.weight, self.eps = _check_shape(w, "weight", (dim,)), eps

    def __call__(self, x: Tensor) -> Tensor:
        return F.mul(F.rms_norm(x, self.eps), self.weight)


class _Block:
    def __init__(self, w: Weights, cfg: T5Config):
        C, I = cfg.d_model, cfg.inner
        a, f = w.sub("layer.0."), w.sub("layer.1.")
        self.cfg = cfg
        self.ln_attn = _RMSNorm(a.sub("layer_norm."), C, cfg.eps)
        sa = a.sub("SelfAttention.")
        for n, ne in (("q", (C, I)), ("k", (C, I)), ("v", (C, I)), ("o", (I, C))):
            _check_shape(sa, f"{n}.weight", ne)
        self.q, self.k, self.v, self.o = (Linear(sa.sub(n + "."), bias=False) for n in "qkvo")
        self.ln_ff = _RMSNorm(f.sub("layer_norm."), C, cfg.eps)
        d = f.sub("DenseReluDense.")
        for n, ne in (("wi_0", (C, cfg.d_ff)), ("wi_1", (C, cfg.d_ff)), ("wo", (cfg.d_ff, C))):
            _check_shape(d, f"{n}.weight", ne)
        self.wi_0, self.wi_1, self.wo = (Linear(d.sub(n + "."), bias=False) for n in ("wi_0", "wi_1", "wo"))

    def __call__(self, x: Tensor, bias: Tensor) -> Tensor:
        """x ne=[C, L, N]; bias ne=[Lk, Lq, H, 1 or N] (position bias + key mask)."""
        cfg = self.cfg
        h = self.ln_attn(x)
        L, N = x.ne[1], x.ne4[2]

        def heads(t):  # [H*D, L, N] -> view [D, L, H, N]
            return t.reshape(cfg.d_kv, cfg.heads, L, N).permute(0, 2, 1, 3)

        att = F.attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), mask=bias, scale=1.0)
        att = F.cont(att.permute(0, 2, 1, 3)).reshape(cfg.inner, L, N)       # [D, H, L, N] -> [H*D, L, N]
        x = F.add(x, self.o(att))
        h = self.ln_ff(x)
        h = F.mul(F.gelu(self.wi_0(h), "tanh"), self.wi_1(h))               # HF "gelu_new"
        h = self.wo(F.scale(h, 1.0 / 32))                                    # F16 range, see above
        return F.add(x, F.scale(h, 32.0))


class T5Encoder:
    """T5 v1.1 encoder stack from weights under `prefix`; see the module docstring."""

    def __init__(self, tensors: Mapping[str, Tensor] | Weights, prefix: str = PREFIX_T5XXL,
                 config: T5Config | None = None, source: str = "model"):
        w = tensors if isinstance(tensors, Weights) else Weights(tensors, prefix, source)
        self.prefix = w.prefix
        self.config = cfg = config or T5Config.detect_from_weights(w)
        key = next((k for k in _EMBED_KEYS if k in w), _EMBED_KEYS[0])
        self.embed = _check_shape(w, key, (cfg.d_model, cfg.vocab))
        self.rel_bias = _check_shape(w, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                     (cfg.heads, cfg.num_buckets))
        self.blocks = [_Block(w.sub(f"encoder.block.{i}."), cfg) for i in range(cfg.layers)]
        self.final_norm = _RMSNorm(w.sub("encoder.final_layer_norm."), cfg.d_model, cfg.eps)

    def position_bias(self, L: int) -> Tensor:
        """Block 0's relative attention bias for L tokens, F32 ne=[Lk, Lq, H] (bias[h, q, k])."""
        pos = np.arange(L)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.config.num_buckets,
                                           self.config.max_distance)         # [q, k]
        rows = F.get_rows(self.rel_bias, Tensor.from_numpy(buckets.reshape(-1), name="t5_buckets"))  # [H, Lk*Lq]
        return F.cont(rows.reshape(self.config.heads, L, L).permute(2, 0, 1))

    def forward(self, ids, mask=None, *, cut_prefix: str | None = "t5") -> Tensor:
        """Hidden states after the final norm, F32 ne=[d_model, L, N]."""
        cfg = self.config
        a = token_ids(ids, cfg.vocab, "T5")
        N, L = a.shape
        x = F.get_rows(self.embed, Tensor.from_numpy(a.reshape(-1), name="t5_ids"))
        x = x.reshape(cfg.d_model, L, N)
        bias = self.position_bias(L)                                          # [Lk, Lq, H]
        if mask is not None:
            m = np.asarray(mask)
            m = m.reshape(1, -1) if m.ndim == 1 else m
            if m.shape != (N, L):
                raise UsageError(f"T5 attention mask has shape {np.asarray(mask).shape}, the ids {a.shape}")
            keys = np.where(m.astype(bool), 0.0, -np.inf).astype(np.float32).reshape(N, 1, 1, L)
            bias = F.add(bias.reshape(L, L, cfg.heads, 1), Tensor.from_numpy(keys, name="t5_key_mask"))
        if cut_prefix:
            F.mark_cut(x, f"{cut_prefix}.prelude")
        for i, blk in enumerate(self.blocks):
            x = blk(x, bias)
            if cut_prefix:
                F.mark_cut(x, f"{cut_prefix}.block.{i}")
        return self.final_norm(x)

    def encode_chunks(self, ids, chunk_len: int, mask=None, backend: str = "cpu") -> np.ndarray:
        """sd.cpp's conditioners' T5 pass: `ids` (and `mask`) as T5Tokenizer.pad_chunks makes
        them, a multiple of chunk_len long; each chunk is encoded on its own (one batch here,
        one graph) and the states are joined: float32 [1, n_chunks * chunk_len, d_model].
        Pass `mask` only where sd.cpp does (Chroma with --chroma-enable-t5-mask). Token weights
        (sd.cpp's apply_token_weights, per chunk) are the conditioner's business."""
        a = np.asarray(ids).reshape(-1)
        if chunk_len < 1 or a.size == 0 or a.size % chunk_len:
            raise UsageError(f"{a.size} T5 ids are not whole chunks of {chunk_len}")
        m = None if mask is None else np.asarray(mask).reshape(-1, chunk_len)
        h = self.run(a.reshape(-1, chunk_len), m, backend)
        return h.reshape(1, -1, self.config.d_model)

    def run(self, ids, mask=None, backend: str = "cpu") -> np.ndarray:
        """forward + execute: float32 [N, L, d_model]."""
        r = F.Graph({"hidden": self.forward(ids, mask)}).run(backend)["hidden"].to_f32()
        return r.reshape((-1,) + r.shape[-2:])
