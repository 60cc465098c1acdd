"""attention vs a per-head numpy softmax(q k^T * scale + mask) v (loops written here) and vs the
reference backend: dtypes, odd shapes, GQA, masks, ragged tiles (online softmax), strided views."""
import math

import numpy as np
import pytest

from opcheck import check, leaf, run, values
from sdrt import OpError
from sdrt.ops import api as F
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.cpu import attention as cpu_attn
from sdrt.ops.tensor import Tensor

FLOATS = ["F32", "F16", "BF16"]


def attention_np(q, k, v, mask=None, scale=None):
    """q (N, H, Lq, D), k (N', Hkv, Lk, D), v (N', Hkv, Lk, Dv), mask (.., Lq or 1, Lk);
    float64, one head at a time; a fully masked row gives zeros."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    N, H, Lq, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    if mask is not None:
        m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape).astype(np.float64)
    out = np.zeros((N, H, Lq, v.shape[-1]))
    for n in range(N):
        for h in range(H):
            kn, kh = n // (N // k.shape[0]), h // (H // k.shape[1])
            s = q[n, h] @ k[kn, kh].T * scale
            if mask is not None:
                mp = m4[n % m4.shape[0], h % m4.shape[1]]
                s = s + (mp[:Lq] if mp.shape[0] > 1 else mp[:1])
            for i in range(Lq):
                if np.isneginf(s[i]).all():
                    continue
                p = np.exp(s[i] - s[i].max())
                out[n, h, i] = p / p.sum() @ v[kn, kh]
    return out


@pytest.fixture(params=["auto", "ragged"])
def tiles(request, monkeypatch):
    """auto: the kernel's own blocks (one key block here); ragged: 7-query x 16-key tiles, so
    Lq and Lk do not divide and the online softmax rescales across key blocks."""
    if request.param == "ragged":
        monkeypatch.setattr(cpu_attn, "BLOCK_Q", 7)
        monkeypatch.setattr(cpu_attn, "BLOCK_K", 16)
    return request.param


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("dtype", FLOATS)
def test_attention_dtypes(rng, dtype, tiles):
    q, k, v = rand(rng, 2, 3, 19, 16), rand(rng, 2, 3, 45, 16), rand(rng, 2, 3, 45, 16)
    tq, tk, tv = (leaf(a, dtype) for a in (q, k, v))
    node = F.attention(tq, tk, tv)
    assert node.ne == (16, 19, 3, 2) and node.dtype.name == "F32"
    check(node, attention_np(values(tq), values(tk), values(tv)), dtype)


@pytest.mark.parametrize("Lq", [1, 33])
def test_attention_sd_like_odd_shapes(rng, Lq, tiles):
    """Cross attention as in SD1.5's UNet: D=40, 5 heads, 77 text tokens, Dv != D here."""
    q, k, v = rand(rng, 1, 5, Lq, 40), rand(rng, 1, 5, 77, 40), rand(rng, 1, 5, 77, 24)
    check(F.attention(leaf(q), leaf(k), leaf(v)), attention_np(q, k, v))


@pytest.mark.parametrize("Hkv,Nk", [(2, 2), (1, 2), (3, 1)])
def test_attention_gqa_and_batch_broadcast(rng, Hkv, Nk, tiles):
    q = rand(rng, 2, 6, 11, 8)
    k, v = rand(rng, Nk, Hkv, 21, 8), rand(rng, Nk, Hkv, 21, 12)
    check(F.attention(leaf(q), leaf(k), leaf(v), scale=0.3), attention_np(q, k, v, scale=0.3))


@pytest.mark.parametrize("mdtype", FLOATS)
def test_attention_mask_with_inf(rng, mdtype, tiles):
    q, k, v = rand(rng, 2, 3, 13, 8), rand(rng, 2, 3, 37, 8), rand(rng, 2, 3, 37, 8)
    m = rand(rng, 13, 37)
    m[:, 30:] = -np.inf   # padded keys
    m[4, :20] = -np.inf   # row whose first key blocks are all masked (online rescale from -inf)
    m[6] = -np.inf        # fully masked row -> zeros, as ggml_flash_attn_ext
    tm = leaf(m, mdtype)
    got = check(F.attention(leaf(q), leaf(k), leaf(v), tm), attention_np(q, k, v, values(tm)))
    assert np.all(got[:, :, 6] == 0)


@pytest.mark.parametrize("mshape", [(1, 37), (20, 37), (3, 13, 37), (2, 1, 13, 37), (2, 3, 1, 37)])
def test_attention_mask_broadcast(rng, mshape, tiles):
    """per-key mask [Lk, 1], padded rows [Lk, Lq+7], per head [Lk, Lq, H], per batch, both."""
    q, k, v = rand(rng, 2, 3, 13, 8), rand(rng, 2, 3, 37, 8), rand(rng, 2, 3, 37, 8)
    m = rand(rng, *mshape)
    m[..., 5] = -np.inf
    check(F.attention(leaf(q), leaf(k), leaf(v), leaf(m)), attention_np(q, k, v, m))


@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_attention_strided_views(rng, dtype, tiles):
    """q/k/v as sd.cpp holds them, [N, L, H, D] (ne [D, H, L, N]), permuted to [D, L, H, N]."""
    N, L, H, D = 2, 29, 4, 16
    qs, ks, vs = (rand(rng, N, L, H, D) for _ in range(3))
    tq, tk, tv = (Tensor.from_numpy(f32_to_raw(a, dtype), dtype=dtype).permute(0, 2, 1, 3) for a in (qs, ks, vs))
    assert tq.ne == (D, L, H, N) and not tq.is_contiguous()
    qn, kn, vn = (values(t) for t in (tq, tk, tv))
    check(F.attention(tq, tk, tv), attention_np(qn, kn, vn), dtype)
    # the output permutes back to sd.cpp's [N, L, H*D] as a view + cont
    out = F.cont(F.attention(tq, tk, tv).permute(0, 2, 1, 3)).reshape(H * D, L, N)
    np.testing.assert_allclose(run(out), attention_np(qn, kn, vn).transpose(0, 2, 1, 3).reshape(N, L, H * D),
                               rtol=2e-3, atol=2e-3)


def test_attention_2d_inputs(rng):
    q, k, v = rand(rng, 9, 8), rand(rng, 14, 8), rand(rng, 14, 5)
    node = F.attention(leaf(q), leaf(k), leaf(v))
    assert node.ne == (5, 9)
    check(node, attention_np(q[None, None], k[None, None], v[None, None])[0, 0])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_attention_thread_counts(rng, monkeypatch, threads):
    monkeypatch.setattr(cpu_attn, "get_threads", lambda: threads)
    q, k, v = rand(rng, 1, 4, 70, 8), rand(rng, 1, 4, 50, 8), rand(rng, 1, 4, 50, 8)
    check(F.attention(leaf(q), leaf(k), leaf(v)), attention_np(q, k, v), vs_reference=False)


def test_attention_large_scores_are_stable(rng):
    q, k, v = rand(rng, 1, 1, 8, 8) * 40, rand(rng, 1, 1, 300, 8) * 40, rand(rng, 1, 1, 300, 8)
    got = check(F.attention(leaf(q), leaf(k), leaf(v)), attention_np(q, k, v), rtol=1e-4, atol=1e-4)
    assert np.isfinite(got).all()


def test_block_sizes_bound_the_score_tile():
    for Lq, Lk, heads in [(4096, 4096, 8), (4096, 77, 10), (1, 4096, 1), (16384, 16384, 24)]:
        bq, bk = cpu_attn.block_sizes(Lq, Lk, heads, 2)
        assert bq * bk <= cpu_attn.SCORE_ELEMS and bk <= Lk and bq <= Lq


def test_attention_errors_name_op():
    q, k, v = leaf(np.zeros((1, 4, 6, 8))), leaf(np.zeros((1, 4, 5, 8))), leaf(np.zeros((1, 4, 5, 8)))
    with pytest.raises(OpError, match=r"attention\(F32\[8, 6, 4, 1\], F32\[7, 5, 4, 1\], F32\[8, 5, 4, 1\]\): k ne\[0\]=7"):
        F.attention(q, leaf(np.zeros((1, 4, 5, 7))), v)
    with pytest.raises(OpError, match=r"attention.*v ne\[1:\]=\[6, 4, 1\] must equal k ne\[1:\]"):
        F.attention(q, k, leaf(np.zeros((1, 4, 6, 8))))
    with pytest.raises(OpError, match=r"attention.*H=4 must be a multiple of the k/v heads Hkv=3"):
        F.attention(q, leaf(np.zeros((1, 3, 5, 8))), leaf(np.zeros((1, 3, 5, 8))))
    with pytest.raises(OpError, match=r"attention.*mask ne\[0\]=6 must equal Lk=5"):
        F.attention(q, k, v, leaf(np.zeros((6, 6))))
    with pytest.raises(OpError, match=r"attention.*mask ne\[1\]=3 must be 1 or >= Lq=6"):
        F.attention(q, k, v, leaf(np.zeros((3, 5))))
    with pytest.raises(OpError, match=r"attention.*mask ne\[2:\]=\[3, 1\] must divide"):
        F.attention(q, k, v, leaf(np.zeros((3, 6, 5))))
    with pytest.raises(OpError, match="attention.*I32"):
        F.attention(Tensor.from_numpy(np.zeros((1, 4, 6, 8), np.int32)), k, v)
