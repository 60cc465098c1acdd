"""Scaled-dot-product attention (the op behind sd.cpp's ggml_ext_attention_ext).

Layout (ne order; torch order in brackets):
    q    ne=[D,  Lq, H,   N]   [N, H,   Lq, D]
    k    ne=[D,  Lk, Hkv, N']  [N', Hkv, Lk, D]
    v    ne=[Dv, Lk, Hkv, N']  [N', Hkv, Lk, Dv]
    mask ne=[Lk, Lq or 1, M2, M3] (optional, additive, F32/F16/BF16)
    out  ne=[Dv, Lq, H,   N], F32 (as ggml_flash_attn_ext)

out[n, h] = softmax(q[n, h] k[n', h']^T * scale + mask) v[n', h'], scale defaulting to 1/sqrt(D).
GQA / MQA: H must be a multiple of Hkv and query head h reads kv head h // (H / Hkv); batches
likewise (N a multiple of N', kv batch n // (N / N')) — ggml_flash_attn_ext's broadcast.
The mask broadcasts as ggml's: plane (h % M2, n % M3); a mask with one row (ne[1] == 1, a
per-key padding mask) applies to every query; ne[1] > Lq uses the first Lq rows (GGML_KQ_MASK_PAD).

sd.cpp's models hold q as [N, L, H*D] (ne [H*D, L, N]); `reshape` to ne [D, H, L, N] and
`permute(0, 2, 1, 3)` gives this op's layout as a view, and the same permute of the output gives
[N, L, H, Dv] back (reshape after `cont`). The CPU kernel reads strided views directly.

A query row whose scores are all -inf (fully masked) gives zeros, as ggml_flash_attn_ext does
(the unfused softmax(QK^T)V of ggml_soft_max would give NaN there).
The CPU kernel never materialises the Lq x Lk score matrix: see ops/cpu/attention.py.
"""
from __future__ import annotations

import math

import numpy as np

from .cases import Case, In
from .registry import FLOATS, defop, fail, make_node

__all__ = ["attention"]



def _ne4(ne):
    return tuple(ne) + (1,) * (4 - len(ne))


def _infer(srcs, p):
    for s in srcs:
        if s.dtype.name not in FLOATS:
            fail("attention", srcs, f"needs F32/F16/BF16 inputs, got {s.dtype.name}")
    q, k, v = (_ne4(t.ne) for t in srcs[:3])
    D, Lq, H, N = q
    if k[0] != D:
        fail("attention", srcs, f"k ne[0]={k[0]} must equal the head size D={D} of q")
    if v[1] != k[1] or v[2] != k[2] or v[3] != k[3]:
        fail("attention", srcs, f"v ne[1:]={list(v[1:])} must equal k ne[1:]={list(k[1:])} (Lk, Hkv, N)")
    if H % k[2]:
        fail("attention", srcs, f"q heads H={H} must be a multiple of the k/v heads Hkv={k[2]} (GQA)")
    if N % k[3]:
        fail("attention", srcs, f"q batch N={N} must be a multiple of the k/v batch {k[3]}")
    if len(srcs) == 4:
        m = _ne4(srcs[3].ne)
        if m[0] != k[1]:
            fail("attention", srcs, f"mask ne[0]={m[0]} must equal Lk={k[1]}")
        if m[1] != 1 and m[1] < Lq:
            fail("attention", srcs, f"mask ne[1]={m[1]} must be 1 or >= Lq={Lq}")
        if H % m[2] or N % m[3]:
            fail("attention", srcs, f"mask ne[2:]={list(m[2:])} must divide (H, N)=({H}, {N})")
    if not math.isfinite(p["scale"]):
        fail("attention", srcs, f"scale must be finite, got {p['scale']}")
    return (v[0],) + tuple(srcs[0].ne[1:]), "F32"


def _ref(node, xs):
    """softmax(q k^T * scale + mask) v per (batch, head), with the whole score matrix of one
    (batch, head) at a time (so checking a 4096-token attention needs 134 MB, not GBs)."""
    q, k, v = (x.reshape((1,) * (4 - x.ndim) + x.shape) for x in xs[:3])
    N, H, Lq, _ = q.shape
    rh, rn = H // k.shape[1], N // k.shape[0]
    m = None
    if len(xs) == 4:
        m = xs[3].astype(np.float64)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        m = m[:, :, :Lq] if m.shape[2] != 1 else m
    out = np.empty((N, H, Lq, v.shape[3]))
    for n in range(N):
        for h in range(H):
            s = q[n, h].astype(np.float64) @ k[n // rn, h // rh].astype(np.float64).T * node.params["scale"]
            if m is not None:
                s = s + m[n % m.shape[0], h % m.shape[1]]
            mx = s.max(axis=-1, keepdims=True)
            dead = ~np.isfinite(mx)  # fully masked rows -> 0, as ggml_flash_attn_ext
            e = np.exp(s - np.where(dead, 0.0, mx))
            tot = e.sum(axis=-1, keepdims=True)
            out[n, h] = (e / np.where(tot > 0, tot, 1.0)) @ v[n // rn, h // rh].astype(np.float64)
    return out.reshape(node.shape)


def _cases():
    q, kv, m = In((16, 9, 4, 2)), In((16, 11, 4, 2)), In((11, 9), lo=-2, hi=0)
    return [Case((In((16, 9, 4, 2), t), In((16, 11, 4, 2), t), In((16, 11, 4, 2), t)), {"scale": 0.25})
            for t in FLOATS] + [
        Case((q, kv, kv, m), {"scale": 0.25}, label="mask"),
        Case((q, In((16, 11, 2, 2)), In((16, 11, 2, 2))), {"scale": 0.3}, label="gqa"),
        Case((q, kv, In((8, 11, 4, 2)), In((11, 1), "F16", lo=-2, hi=0)), {"scale": 0.25}, label="dv8-row-mask"),
        Case((In((16, 9, 4, 2), view="p"), In((16, 11, 4, 2), view="p"), In((16, 11, 4, 2), view="p")),
             {"scale": 0.25}, label="permuted-views"),
        Case((In((64, 40, 2, 1), "F16"), In((64, 77, 2, 1), "F16"), In((64, 77, 2, 1), "F16")), {"scale": 0.125},
             label="d64-cross")]


defop("attention", _infer, _ref,
      "softmax(q k^T * scale + mask) v over ne [D, L, H, N] heads, GQA, tiled on CPU", nmse=5e-4, cases=_cases)


def attention(q, k, v, mask=None, scale: float | None = None):
    """Scaled-dot-product attention; q ne=[D, Lq, H, N], k ne=[D, Lk, Hkv, N],
    v ne=[Dv, Lk, Hkv, N], optional additive mask ne=[Lk, Lq]; returns F32 ne=[Dv, Lq, H, N].
    `scale` defaults to 1/sqrt(D)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.ne[0])
    srcs = (q, k, v) if mask is None else (q, k, v, mask)
    return make_node("attention", srcs, scale=float(scale))
