"""Positional ops: arange, timestep_embedding, and rotary embeddings.

- `rope(x, pe)` is sd.cpp's ggml_ext_rope_apply (Flux, SD3.5, Qwen-Image, Wan ... DiTs): the
  angles come precomputed as a 2x2 matrix per pair and token, and the result is laid out for
  attention ([head_dim, tokens, heads*batch]).
- `rope_ext(x, positions, n_dims, ...)` is ggml_rope_ext / ggml_rope_multi (the LLM text
  encoders): angles from integer positions, ggml's YaRN, freq factors and M-RoPE sections.
"""
from __future__ import annotations

import math

import numpy as np

from .cases import Case, In
from .registry import FLOATS, defop, fail, make_node, require_float
from .tensor import Tensor

__all__ = [
    "ROPE_MODES",
    "arange",
    "rope",
    "rope_cache",
    "rope_ext",
    "rope_multi",
    "timestep_embedding",
]

# ggml's GGML_ROPE_TYPE_* values
ROPE_MODES = {"normal": 0, "neox": 2, "mrope": 8, "vision": 24, "imrope": 40}



# ---- arange ------------------------------------------------------------------------------------
def arange_count(start: float, stop: float, step: float) -> int:
    """ggml: ceilf((stop - start) / step) in float32."""
    f = np.float32
    return int(np.ceil(f(f(stop) - f(start)) / f(step)))


def _arange_infer(srcs, p):
    if p["step"] == 0 or not all(math.isfinite(p[k]) for k in ("start", "stop", "step")):
        fail("arange", srcs, f"start/stop/step must be finite with step != 0, got {p}")
    n = arange_count(p["start"], p["stop"], p["step"])
    if n < 1:
        fail("arange", srcs, f"empty range: start={p['start']}, stop={p['stop']}, step={p['step']}")
    return (n,), "F32"


def _arange_reference(node, xs):
    p = node.params
    return np.float32(p["start"]) + np.float32(p["step"]) * np.arange(node.ne[0], dtype=np.float64)


defop("arange", _arange_infer, _arange_reference, "F32 [n]: start + step*i (ggml_arange)",
      cases=lambda: [Case((), {"start": 0.0, "stop": 10.0, "step": 1.0}),
                     Case((), {"start": 1.5, "stop": -7.0, "step": -0.25})])


def arange(start: float, stop: float | None = None, step: float = 1.0) -> Tensor:
    """ggml_arange: F32 1-D, ceil((stop - start) / step) values start + step*i.
    `arange(n)` counts 0..n-1 as numpy does."""
    if stop is None:
        start, stop = 0.0, start
    return make_node("arange", (), start=float(start), stop=float(stop), step=float(step))


# ---- timestep embedding ------------------------------------------------------------------------
def _tsemb_infer(srcs, p):
    t, = srcs
    require_float("timestep_embedding", srcs, srcs)
    if t.nelements != t.ne[0]:
        fail("timestep_embedding", srcs, f"timesteps must be 1-D [n], got ne={t.ne}")
    if p["dim"] < 1 or p["max_period"] < 1:
        fail("timestep_embedding", srcs, f"dim ({p['dim']}) and max_period ({p['max_period']}) must be >= 1")
    return (p["dim"], t.ne[0]), "F32"


def _tsemb_reference(node, xs):
    dim, mp = node.params["dim"], node.params["max_period"]
    t = xs[0].reshape(-1).astype(np.float64)
    half = dim // 2
    freqs = np.exp(-math.log(mp) * np.arange(half) / half)
    arg = t[:, None] * freqs[None, :]
    out = np.zeros((t.size, dim))
    out[:, :half], out[:, half:2 * half] = np.cos(arg), np.sin(arg)
    return out


defop("timestep_embedding", _tsemb_infer, _tsemb_reference,
      "F32 [dim, n]: cos(t*f_j) then sin(t*f_j), f_j = exp(-ln(max_period) j/half), "
      "0 in the last column of an odd dim (ggml_timestep_embedding)",
      cases=lambda: [Case((In((3,), t, lo=0, hi=1000),), {"dim": d, "max_period": 10000})
                     for t in FLOATS for d in (32, 33)])


def timestep_embedding(t: Tensor, dim: int, max_period: int = 10000) -> Tensor:
    """ggml_timestep_embedding: t [n] -> F32 [dim, n], cos half first then sin half."""
    return make_node("timestep_embedding", (t,), dim=int(dim), max_period=int(max_period))


# ---- rope with precomputed pe (sd.cpp) -------------------------------------------------------
def _rope_infer(srcs, p):
    x, pe = srcs
    require_float("rope", srcs, (x,))
    if pe.dtype.name != "F32":
        fail("rope", srcs, f"pe must be F32, got {pe.dtype.name}")
    D, H, L, N = x.ne4
    P = pe.ne4
    if P[0] != 2 or P[1] != 2 or P[3] != L:
        fail("rope", srcs, f"pe must be [2, 2, rot_dim/2, tokens={L}] ([[cos,-sin],[sin,cos]] per pair), got {pe.ne}")
    if P[2] > D // 2:
        fail("rope", srcs, f"pe rotates {2 * P[2]} channels, head_dim is {D}")
    return (D, L, H * N), x.dtype


def _rope_reference(node, xs):
    x, pe = xs[0], xs[1]
    x = x.reshape((1,) * (4 - x.ndim) + x.shape).astype(np.float64)  # (N, L, H, D)
    pe = pe.reshape((1,) * (4 - pe.ndim) + pe.shape).astype(np.float64)  # (L, R, 2, 2)
    N, L, H, D = x.shape
    R = pe.shape[1]
    y = x.copy()
    if node.params["interleaved"]:
        x0, x1 = x[..., 0:2 * R:2], x[..., 1:2 * R:2]
        i0, i1 = slice(0, 2 * R, 2), slice(1, 2 * R, 2)
    else:
        x0, x1 = x[..., :R], x[..., R:2 * R]
        i0, i1 = slice(0, R), slice(R, 2 * R)
    m = pe[None, :, None]  # (1, L, 1, R, 2, 2)
    y[..., i0] = x0 * m[..., 0, 0] + x1 * m[..., 0, 1]
    y[..., i1] = x0 * m[..., 1, 0] + x1 * m[..., 1, 1]
    # [D, H, L, N] -> [D, L, H*N]: numpy (N, L, H, D) -> (N, H, L, D) -> (N*H, L, D)
    return y.transpose(0, 2, 1, 3).reshape(N * H, L, D)


def _rope_cases():
    return [Case((In((8, 3, 5, 2), t), In((2, 2, 4, 5))), {"interleaved": il}) for t in FLOATS for il in (True, False)] + [
        Case((In((8, 3, 5, 2)), In((2, 2, 2, 5))), {"interleaved": True}, label="partial"),
        Case((In((8, 3, 5, 2), view="p"), In((2, 2, 4, 5))), {"interleaved": False}, label="x-view")]


defop("rope", _rope_infer, _rope_reference,
      "sd.cpp ggml_ext_rope_apply: x [D, H, L, N] by pe [2, 2, R, L] -> [D, L, H*N]", cases=_rope_cases)


def rope(x: Tensor, pe: Tensor, interleaved: bool = True) -> Tensor:
    """sd.cpp's ggml_ext_rope_apply. x [head_dim, heads, tokens, batch]; pe F32
    [2, 2, R, tokens] holding [[cos, -sin], [sin, cos]] per pair and token (numpy shape
    (tokens, R, 2, 2)), shared by heads and batch. Pairs are (2i, 2i+1) when interleaved
    (Flux), else (i, i+R) (half-split); channels from 2R on pass through (partial RoPE).
    out[a] = x_a*pe[.,.,0,0] + x_b*pe[.,.,0,1], out[b] = x_a*pe[.,.,1,0] + x_b*pe[.,.,1,1].
    Returns [head_dim, tokens, heads*batch], the layout sd.cpp's attention takes."""
    return make_node("rope", (x, pe), interleaved=bool(interleaved))


# ---- ggml_rope_ext / ggml_rope_multi -----------------------------------------------------------
def _corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    f = np.float32
    with np.errstate(divide="ignore", invalid="ignore"):
        def dim(n_rot):
            return f(n_dims) * np.log(f(n_ctx_orig) / (f(n_rot) * f(2) * f(math.pi))) / (f(2) * np.log(f(freq_base)))
        start = np.floor(dim(beta_fast))
        end = np.ceil(dim(beta_slow))
    return f(max(0.0, start)), f(min(float(n_dims - 1), end))


def rope_cache(pos: np.ndarray, n_tokens: int, p: dict, freq_factors: np.ndarray | None = None):
    """(cos, sin), each float32 (n_tokens, n_pairs): ggml's rope cache, bit for bit in its
    float32 arithmetic — theta_k is the running product pos * s * s * ... (s =
    freq_base^(-2/n_dims)), not pos * s^k, which matters at large positions; then
    ggml's YaRN mix and attention factor. n_pairs is n_dims/2 (ne0/2 for 'vision')."""
    f = np.float32
    mode, n_dims = p["mode"], p["n_dims"]
    multi = mode in ("mrope", "imrope", "vision")
    vision = mode == "vision"
    n_pairs = n_dims if vision else n_dims // 2
    pos = np.asarray(pos).reshape(-1)
    base = pos.reshape(4, n_tokens).astype(f) if multi else pos[None, :n_tokens].astype(f)
    theta = base.copy()
    ts = np.power(f(p["freq_base"]), f(-2.0) / f(n_dims))
    low, high = _corr_dims(n_dims, p["n_ctx_orig"], p["freq_base"], p["beta_fast"], p["beta_slow"])
    fs, ext, attn = f(p["freq_scale"]), f(p["ext_factor"]), f(p["attn_factor"])
    mscale = attn * (f(1) + f(0.1) * np.log(f(1) / fs)) if ext != 0 else attn
    s0, s1, s2, s3 = p["sections"]
    sect_dims, sec_w = s0 + s1 + s2 + s3, s0 + s1
    sec_e = sec_w + s2
    cos = np.empty((n_tokens, n_pairs), f)
    sin = np.empty((n_tokens, n_pairs), f)
    for k in range(n_pairs):  # per pair, vectorised over tokens
        a = 0
        if multi:
            sector = k % sect_dims
            if vision:  # independent sections: each restarts its running product
                if sector == 0:
                    theta[0] = base[0]
                elif sector == s0:
                    theta[1] = base[1]
                elif sector == sec_w:
                    theta[2] = base[2]
                elif sector == sec_e:
                    theta[3] = base[3]
            if mode == "imrope":
                if sector % 3 == 1 and sector < 3 * s1:
                    a = 1
                elif sector % 3 == 2 and sector < 3 * s2:
                    a = 2
                elif sector % 3 == 0 and sector < 3 * s0:
                    a = 0
                else:
                    a = 3
            else:
                a = 0 if sector < s0 else 1 if sector < sec_w else 2 if sector < sec_w + s2 else 3
        ff = f(1) if freq_factors is None else f(freq_factors[k])
        extrap = theta[a] / ff
        th = fs * extrap
        if ext != 0:
            y = (f(k) - low) / max(f(0.001), high - low)
            mix = (f(1) - min(f(1), max(f(0), y))) * ext
            th = th * (f(1) - mix) + extrap * mix
        cos[:, k] = np.cos(th) * mscale
        sin[:, k] = np.sin(th) * mscale
        theta *= ts
    return cos, sin


def _rope_ext_infer(srcs, p):
    x, pos = srcs[0], srcs[1]
    require_float("rope_ext", srcs, (x,))
    mode, n_dims, n_offs = p["mode"], p["n_dims"], p["n_offs"]
    if mode not in ROPE_MODES:
        fail("rope_ext", srcs, f"unknown mode {mode!r}; modes: {', '.join(ROPE_MODES)}")
    if pos.dtype.name != "I32" or pos.nelements != pos.ne[0]:
        fail("rope_ext", srcs, f"positions must be an I32 vector, got {pos.dtype.name}{list(pos.ne)}")
    ne0, ne2 = x.ne4[0], x.ne4[2]
    multi = mode in ("mrope", "imrope", "vision")
    want = ne2 * 4 if multi else ne2
    if pos.ne[0] != want:
        fail("rope_ext", srcs, f"{want} positions needed ({'4 per token' if multi else 'one per token'}, "
                                f"tokens = ne[2] = {ne2}), got {pos.ne[0]}")
    if n_dims < 2 or n_dims % 2 or n_offs < 0 or n_offs % 2 or n_dims + n_offs > ne0:
        fail("rope_ext", srcs, f"n_dims={n_dims}, n_offs={n_offs}: both even, n_dims >= 2 and n_dims + n_offs <= ne0={ne0}")
    if multi and not any(s > 0 for s in p["sections"]):
        fail("rope_ext", srcs, f"{mode} needs sections, got {p['sections']}")
    if mode == "vision" and (2 * n_dims != ne0 or n_offs):
        fail("rope_ext", srcs, f"vision rotates pairs (i, i+n_dims) over the whole head: n_dims must be ne0/2={ne0 // 2}")
    if len(srcs) > 2:
        ff = srcs[2]
        need = n_dims if mode == "vision" else n_dims // 2
        if ff.dtype.name != "F32" or ff.nelements != ff.ne[0] or ff.ne[0] < need:
            fail("rope_ext", srcs, f"freq_factors must be an F32 vector of >= {need}")
    return x.ne, x.dtype


def _rope_ext_reference(node, xs):
    p = node.params
    x = xs[0].reshape((1,) * (4 - xs[0].ndim) + xs[0].shape).astype(np.float64)  # (N, L, H, D)
    L = x.shape[1]
    ff = xs[2].reshape(-1) if len(xs) > 2 else None
    cos, sin = (c.astype(np.float64)[None, :, None, :] for c in rope_cache(xs[1], L, p, ff))
    n, o = p["n_dims"], p["n_offs"]
    y = x.copy()
    if p["mode"] == "normal":
        a, b = slice(o, o + n, 2), slice(o + 1, o + n, 2)
    elif p["mode"] == "vision":
        a, b = slice(0, n), slice(n, 2 * n)
    else:
        a, b = slice(o, o + n // 2), slice(o + n // 2, o + n)
    y[..., a] = x[..., a] * cos - x[..., b] * sin
    y[..., b] = x[..., a] * sin + x[..., b] * cos
    return y


def _rope_ext_cases():
    pos, pos4 = In((5,), "I32", lo=0, hi=100), In((20,), "I32", lo=0, hi=100)
    x = In((8, 3, 5))
    return [Case((In((8, 3, 5), t), pos), build=lambda x, p, m=m: rope_ext(x, p, 8, mode=m), label=m)
            for t in FLOATS for m in ("normal", "neox")] + [
        Case((In((12, 3, 5)), pos), build=lambda x, p: rope_ext(x, p, 6, n_offs=2, freq_base=500.0), label="partial"),
        Case((x, pos, In((4,), lo=1, hi=2)), build=lambda x, p, f: rope_ext(x, p, 8, mode="neox", freq_factors=f),
             label="freq-factors"),
        Case((x, pos), build=lambda x, p: rope_ext(x, p, 8, ext_factor=1.0, freq_scale=0.25, n_ctx_orig=64),
             label="yarn"),
        Case((x, pos4), build=lambda x, p: rope_multi(x, p, 8, (2, 1, 1, 0)), label="mrope"),
        Case((x, pos4), build=lambda x, p: rope_multi(x, p, 8, (2, 1, 1, 0), mode="imrope"), label="imrope"),
        Case((x, pos4), build=lambda x, p: rope_multi(x, p, 4, (1, 1, 0, 0), mode="vision"), label="vision"),
        Case((In((8, 3, 5), view="s"), pos), build=lambda x, p: rope_ext(x, p, 8), label="x-view")]


defop("rope_ext", _rope_ext_infer, _rope_ext_reference,
      "ggml_rope_ext / ggml_rope_multi: rotate n_dims channels of x [D, H, L, N] by positions", cases=_rope_ext_cases)


def rope_ext(x: Tensor, positions, n_dims: int, mode: str = "normal", freq_base: float = 10000.0,
             freq_scale: float = 1.0, ext_factor: float = 0.0, attn_factor: float = 1.0,
             beta_fast: float = 32.0, beta_slow: float = 1.0, n_ctx_orig: int = 0,
             freq_factors: Tensor | None = None, sections=(0, 0, 0, 0), n_offs: int = 0) -> Tensor:
    """ggml_rope_ext. x [head_dim, heads, tokens, batch]; positions I32 [tokens] (a Tensor or
    array-like; 4*tokens for the M-RoPE modes: t, h, w, e blocks). Rotates channels
    [n_offs, n_offs + n_dims): 'normal' pairs (2i, 2i+1), 'neox' pairs (i, i + n_dims/2); the
    rest pass through. 'mrope'/'imrope'/'vision' are ggml_rope_multi with `sections`."""
    if not isinstance(positions, Tensor):
        positions = Tensor.from_numpy(np.ascontiguousarray(np.asarray(positions, np.int32).reshape(-1)))
    srcs = (x, positions) + ((freq_factors,) if freq_factors is not None else ())
    sections = tuple(int(s) for s in sections) + (0,) * (4 - len(tuple(sections)))
    return make_node("rope_ext", srcs, n_dims=int(n_dims), mode=str(mode), freq_base=float(freq_base),
                     freq_scale=float(freq_scale), ext_factor=float(ext_factor),
                     attn_factor=float(attn_factor), beta_fast=float(beta_fast),
                     beta_slow=float(beta_slow), n_ctx_orig=int(n_ctx_orig), sections=sections[:4],
                     n_offs=int(n_offs))


def rope_multi(x: Tensor, positions, n_dims: int, sections, mode: str = "mrope", **kw) -> Tensor:
    """ggml_rope_multi: M-RoPE ('mrope', Qwen2-VL), interleaved ('imrope', Qwen3-VL) or
    'vision'; positions hold 4 blocks of `tokens` ids (t, h, w, e)."""
    return rope_ext(x, positions, n_dims, mode=mode, sections=sections, **kw)

