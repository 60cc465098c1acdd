"""arange, timestep_embedding, rope (sd.cpp pe form) and rope_ext (ggml): CPU kernels vs
independent numpy expectations, vs the reference backend, and FLUX's PyTorch rope golden."""
import math
import os

import numpy as np
import pytest
from opcheck import check, leaf, values

from sdrt import OpError
from sdrt.ops import api as F
from sdrt.ops.position import rope_cache
from sdrt.ops.tensor import Tensor

FLOATS = ["F32", "F16", "BF16"]
GOLDENS = os.path.join(os.path.dirname(__file__), "fixtures", "layout_goldens.npz")


# ---- arange ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,expected", [((0, 10, 3), [0, 3, 6, 9]), ((0.5, 2.0, 0.25), np.arange(0.5, 2.0, 0.25)),
                                           ((5,), np.arange(5)), ((-3, 3.5, 1.5), np.arange(-3, 3.5, 1.5))])
def test_arange(args, expected):
    n = F.arange(*args)
    assert n.dtype.name == "F32" and n.src == ()
    check(n, np.asarray(expected, np.float32), rtol=0, atol=0)


def test_arange_errors():
    with pytest.raises(OpError, match="arange.*empty range"):
        F.arange(3, 1)
    with pytest.raises(OpError, match="arange.*step != 0"):
        F.arange(0, 1, 0)


# ---- timestep embedding ------------------------------------------------------------------------
def np_timestep_embedding(t, dim, max_period=10000):
    """diffusers get_timestep_embedding(flip_sin_to_cos=True, downscale_freq_shift=0), zero pad."""
    half = dim // 2
    exponent = -math.log(max_period) * np.arange(half, dtype=np.float64) / half
    emb = t.astype(np.float64)[:, None] * np.exp(exponent)[None, :]
    emb = np.concatenate([np.cos(emb), np.sin(emb)], axis=-1)
    if dim % 2:
        emb = np.concatenate([emb, np.zeros((len(t), 1))], axis=-1)
    return emb


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [1, 7, 8, 33])
@pytest.mark.parametrize("max_period", [10000, 100])
def test_timestep_embedding(dtype, dim, max_period):
    t = leaf(np.array([0.0, 1.0, 2.5, 7.0, 9.75], np.float32), dtype)
    n = F.timestep_embedding(t, dim, max_period)
    assert n.ne == (dim, 5) and n.dtype.name == "F32"
    check(n, np_timestep_embedding(values(t), dim, max_period), rtol=1e-5, atol=2e-6)


def test_timestep_embedding_large_t():
    # sd.cpp feeds t in [0, 1000): the angle t*f is float32 as in ggml, so its rounding
    # (|t| * 2^-24) is the accuracy to expect against float64
    t = leaf(np.array([999.0, 500.5, 261.0], np.float32))
    check(F.timestep_embedding(t, 320), np_timestep_embedding(values(t), 320), rtol=0, atol=2e-4)


def test_timestep_embedding_errors():
    with pytest.raises(OpError, match="timestep_embedding.*1-D"):
        F.timestep_embedding(leaf(np.zeros((2, 3), np.float32)), 8)
    with pytest.raises(OpError, match="timestep_embedding.*F32/F16/BF16"):
        F.timestep_embedding(Tensor.from_numpy(np.zeros(3, np.int32)), 8)


# ---- rope with pe (sd.cpp ggml_ext_rope_apply) -------------------------------------------------
def np_rope_pe(x, pe, interleaved):
    """x numpy (N, L, H, D); pe (L, R, 2, 2) -> (N*H, L, D), one pair at a time."""
    N, L, H, D = x.shape
    R = pe.shape[1]
    y = x.astype(np.float64).copy()
    for i in range(R):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + R)
        xa, xb = x[..., a].astype(np.float64), x[..., b].astype(np.float64)
        m = pe[None, :, None, i]  # (1, L, 1, 2, 2)
        y[..., a] = m[..., 0, 0] * xa + m[..., 0, 1] * xb
        y[..., b] = m[..., 1, 0] * xa + m[..., 1, 1] * xb
    return y.transpose(0, 2, 1, 3).reshape(N * H, L, D)


def test_rope_vs_flux_torch():
    if not os.path.exists(GOLDENS):
        pytest.fail(f"{GOLDENS} missing: run tools/make_layout_goldens.py")
    g = np.load(GOLDENS)
    x, pe, y = g["flux_x"], g["flux_pe"], g["flux_y"]  # (B, H, L, D), (B, L, D/2, 2, 2)
    for b in range(x.shape[0]):
        t = leaf(x[b:b + 1].transpose(0, 2, 1, 3))  # ne [D, H, L, 1], a permuted view
        check(F.rope(t, leaf(pe[b])), y[b], atol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("R", [6, 4])  # full (head 12) and partial rotation
@pytest.mark.parametrize("noncontig", [False, True])
def test_rope_pe(rng, dtype, interleaved, R, noncontig):
    N, L, H, D = 2, 5, 3, 12
    x = rng.standard_normal((N, L, H, D)).astype(np.float32)
    ang = rng.uniform(-3, 3, (L, R))
    pe = np.stack([np.cos(ang), -np.sin(ang), np.sin(ang), np.cos(ang)], -1).reshape(L, R, 2, 2)
    pe = (pe * rng.uniform(0.5, 1.5, (L, R, 2, 2))).astype(np.float32)  # any 2x2, not just rotations
    t = leaf(x, dtype, noncontig)
    n = F.rope(t, leaf(pe), interleaved)
    assert n.ne == (D, L, H * N)
    check(n, np_rope_pe(values(t), pe, interleaved), dtype)


def test_rope_pe_errors():
    x = leaf(np.zeros((1, 5, 3, 8), np.float32))
    with pytest.raises(OpError, match=r"rope\(F32\[8, 3, 5, 1\], F32\[2, 2, 4, 4\]\): pe must be"):
        F.rope(x, leaf(np.zeros((4, 4, 2, 2), np.float32)))
    with pytest.raises(OpError, match="rope.*rotates 10 channels, head_dim is 8"):
        F.rope(x, leaf(np.zeros((5, 5, 2, 2), np.float32)))
    with pytest.raises(OpError, match="rope.*pe must be F32"):
        F.rope(x, leaf(np.zeros((5, 4, 2, 2), np.float32), "F16"))


# ---- rope_ext (ggml_rope_ext / ggml_rope_multi) ------------------------------------------------
def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def np_rope_ext(x, pos, n_dims, mode, base=10000.0, n_offs=0, freq_factors=None):
    """HF-style RoPE in float64 (theta_k = pos * base^(-2k/n_dims) / ff_k): GPT-NeoX rotate_half
    on channel block [o, o+n) for 'neox', GPT-J interleaved pairs for 'normal'."""
    x = x.astype(np.float64)
    inv = base ** (-np.arange(0, n_dims, 2) / n_dims)
    if freq_factors is not None:
        inv = inv / freq_factors[: n_dims // 2]
    ang = pos.astype(np.float64)[:, None] * inv[None, :]  # (L, n/2)
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    y = x.copy()
    blk = x[..., n_offs:n_offs + n_dims]
    if mode == "neox":
        c2, s2 = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
        y[..., n_offs:n_offs + n_dims] = blk * c2 + rotate_half(blk) * s2
    else:
        e, o = blk[..., 0::2], blk[..., 1::2]
        y[..., n_offs:n_offs + n_dims:2] = e * cos - o * sin
        y[..., n_offs + 1:n_offs + n_dims:2] = e * sin + o * cos
    return y


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_dims,n_offs", [(16, 0), (8, 0), (6, 4)])
@pytest.mark.parametrize("noncontig", [False, True])
def test_rope_ext(rng, dtype, mode, n_dims, n_offs, noncontig):
    N, L, H, D = 2, 6, 3, 16
    x = rng.standard_normal((N, L, H, D)).astype(np.float32)
    pos = np.array([0, 1, 2, 5, 9, 17], np.int32)
    t = leaf(x, dtype, noncontig)
    n = F.rope_ext(t, pos, n_dims, mode=mode, n_offs=n_offs)
    assert n.ne == (D, H, L, N)
    r, a = {"F32": (1e-5, 2e-5)}.get(dtype, (None, None))
    check(n, np_rope_ext(values(t), pos, n_dims, mode, n_offs=n_offs), dtype, rtol=r, atol=a)


def test_rope_ext_freq_factors_and_base(rng):
    x = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    pos = np.array([3, 0, 7, 11], np.int32)
    ff = np.array([1.0, 2.0, 1e30, 0.5], np.float32)  # 1e30: Gemma's unrotated ("proportional") pairs
    n = F.rope_ext(leaf(x), pos, 8, mode="neox", freq_base=500.0, freq_factors=leaf(ff))
    check(n, np_rope_ext(x, pos, 8, "neox", base=500.0, freq_factors=ff.astype(np.float64)), atol=2e-5)


def test_rope_cache_is_ggml_running_product():
    # ggml builds theta_k as a float32 running product pos*s*s*...; at large positions that
    # differs from pos*s^k by far more than float32 rounding, so the cache must follow ggml
    p = {"mode": "neox", "n_dims": 128, "freq_base": 1e6, "freq_scale": 1.0, "ext_factor": 0.0,
         "attn_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "n_ctx_orig": 0, "sections": (0, 0, 0, 0)}
    pos = np.array([0, 1, 4000, 30000], np.int32)
    cos, sin = rope_cache(pos, 4, p)
    s = np.power(np.float32(1e6), np.float32(-2.0) / np.float32(128))
    theta = pos.astype(np.float32)
    for k in range(64):  # plain float32 loop, ggml_rope_cache_init
        np.testing.assert_allclose(cos[:, k], np.cos(theta), rtol=0, atol=1e-6)
        np.testing.assert_allclose(sin[:, k], np.sin(theta), rtol=0, atol=1e-6)
        theta = (theta * s).astype(np.float32)


def np_yarn(x, pos, n_dims, base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig):
    """YaRN as in jquesnelle/yarn (LlamaYaRNScaledRotaryEmbedding) with ggml's corr dims, neox."""
    def corr_dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
    k = np.arange(n_dims // 2)
    ramp = 1 - np.clip((k - low) / max(0.001, high - low), 0, 1)
    mix = ramp * ext_factor
    extrap = base ** (-2 * k / n_dims)
    inv = freq_scale * extrap * (1 - mix) + extrap * mix
    mscale = attn_factor * (1 + 0.1 * math.log(1 / freq_scale))
    ang = pos.astype(np.float64)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None, :] * mscale
    sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None, :] * mscale
    return x * cos + rotate_half(x) * sin


def test_rope_ext_yarn(rng):
    # GPT-OSS in sd.cpp: neox, n_ctx_orig 4096, ext_factor 1, freq_scale 1/32
    x = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    pos = np.array([0, 1, 2, 10, 30], np.int32)
    kw = {"freq_base": 150000.0, "freq_scale": 1 / 32, "ext_factor": 1.0, "attn_factor": 1.0,
          "beta_fast": 32.0, "beta_slow": 1.0, "n_ctx_orig": 4096}
    n = F.rope_ext(leaf(x), pos, 32, mode="neox", **kw)
    exp = np_yarn(x.astype(np.float64), pos, 32, kw["freq_base"], kw["freq_scale"], kw["ext_factor"],
                  kw["attn_factor"], kw["beta_fast"], kw["beta_slow"], kw["n_ctx_orig"])
    check(n, exp, atol=3e-5)


def np_mrope(x, pos4, n_dims, sections, mode, base=10000.0):
    """M-RoPE from ggml.h's layout notes: pair k belongs to section sector = k % sum(sections);
    mrope: contiguous t|h|w|e blocks, imrope: t,h,w interleaved by sector % 3; 'vision': every
    section restarts its frequency index and pairs are (k, k + n_dims) over the whole head."""
    x = x.astype(np.float64)
    L = x.shape[1]
    pos4 = pos4.reshape(4, L).astype(np.float64)
    s = list(sections)
    starts = np.cumsum([0] + s)
    n_pairs = n_dims if mode == "vision" else n_dims // 2
    ang = np.zeros((L, n_pairs))
    for k in range(n_pairs):
        sec = k % sum(s)
        if mode == "imrope":
            a = next((ax for ax in (1, 2, 0) if sec % 3 == ax and sec < 3 * s[ax]), 3)
        else:
            a = int(np.searchsorted(starts, sec, side="right") - 1)
        kk = sec - starts[a] if mode == "vision" else k
        ang[:, k] = pos4[a] * base ** (-2.0 * kk / n_dims)
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    y = x.copy()
    if mode == "vision":
        a, b = x[..., :n_dims], x[..., n_dims:2 * n_dims]
        y[..., :n_dims], y[..., n_dims:2 * n_dims] = a * cos - b * sin, a * sin + b * cos
    else:
        h = n_dims // 2
        a, b = x[..., :h], x[..., h:n_dims]
        y[..., :h], y[..., h:n_dims] = a * cos - b * sin, a * sin + b * cos
    return y


@pytest.mark.parametrize("mode,n_dims,sections,D", [("mrope", 16, (2, 3, 3, 0), 20), ("imrope", 16, (3, 3, 2, 0), 16),
                                                      ("mrope", 12, (2, 2, 1, 1), 12), ("vision", 8, (4, 4, 0, 0), 16)])
def test_rope_multi(rng, mode, n_dims, sections, D):
    x = rng.standard_normal((2, 5, 3, D)).astype(np.float32)
    pos4 = rng.integers(0, 12, 20).astype(np.int32)
    n = F.rope_multi(leaf(x, noncontig=True), pos4, n_dims, sections, mode=mode)
    check(n, np_mrope(x, pos4, n_dims, sections, mode), atol=2e-5)


def test_rope_ext_errors():
    x = leaf(np.zeros((1, 4, 2, 8), np.float32))
    with pytest.raises(OpError, match=r"rope_ext\(F32\[8, 2, 4, 1\], I32\[3\]\): 4 positions needed"):
        F.rope_ext(x, np.arange(3), 8)
    with pytest.raises(OpError, match="rope_ext.*n_dims=7"):
        F.rope_ext(x, np.arange(4), 7)
    with pytest.raises(OpError, match="rope_ext.*n_dims=8, n_offs=2"):
        F.rope_ext(x, np.arange(4), 8, n_offs=2)
    with pytest.raises(OpError, match="rope_ext.*unknown mode 'yarn'"):
        F.rope_ext(x, np.arange(4), 8, mode="yarn")
    with pytest.raises(OpError, match="rope_ext.*positions must be an I32"):
        F.rope_ext(x, leaf(np.arange(4, dtype=np.float32)), 8)
    with pytest.raises(OpError, match="rope_ext.*mrope needs sections"):
        F.rope_ext(x, np.arange(16), 8, mode="mrope")
    with pytest.raises(OpError, match="rope_ext.*vision rotates"):
        F.rope_multi(x, np.arange(16), 8, (2, 2, 0, 0), mode="vision")
