"""CUDA arange, timestep_embedding, rope and rope_ext vs the CPU backend (skips without a GPU).

arange is bit exact. rope_ext's angle table follows ggml's float32 running product on both
backends, so the angles are identical and only sin/cos rounding differs; timestep_embedding's
frequencies come from expf on each side, so its tolerance scales with |t| (the angle's float32
rounding, as against float64 in tests/test_ops_position.py). Inputs include permuted views,
strided positions and pe, every rope mode (normal, neox, mrope, imrope, vision), YaRN, freq
factors, large positions and the Flux/SD3-size shapes.
"""
import numpy as np
import pytest
from opcheck import leaf

from sdrt.ops import api as F
from sdrt.ops.convert import raw_to_f32
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

from ._helpers import assert_close_vs_cpu, assert_on_cuda, randn

FLOATS = ["F32", "F16", "BF16"]
TOL = {"F32": (1e-5, 1e-5), "F16": (2e-3, 2e-3), "BF16": (1.6e-2, 1.6e-2)}  # (rtol, atol)


# ---- harness -------------------------------------------------------------------------------
# `cuda` (tests/gpu/conftest.py) is the cuda0 backend; it skips the test without a GPU.
def check(cuda, node, rtol=None, atol=None):
    assert_on_cuda("position", *Graph(node).nodes)
    r, a = TOL[node.dtype.name]
    return assert_close_vs_cpu(cuda, node, r if rtol is None else rtol, a if atol is None else atol)


def permuted(x: np.ndarray, dtype: str):
    """x numpy (N, L, H, D) as a ggml permute view [D, H, L, N] of a buffer stored (N, H, L, D)."""
    return leaf(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), dtype).permute(0, 2, 1, 3)


# ---- arange ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [(0, 10, 3), (0.5, 2.0, 0.25), (5,), (-3, 3.5, 1.5), (0, 1, 1e-4), (1e6, 1.1e6, 0.1)])
def test_arange_exact(cuda, args):
    check(cuda, F.arange(*args), rtol=0, atol=0)


# ---- timestep_embedding ------------------------------------------------------------------------
@pytest.mark.parametrize("max_period", [10000, 100])
@pytest.mark.parametrize("dim", [1, 2, 7, 8, 33, 320, 1280])
@pytest.mark.parametrize("dtype", FLOATS)
def test_timestep_embedding(cuda, rng, dtype, dim, max_period):
    t = np.concatenate([[0.0, 1.0, 2.5, 999.0, 500.5], rng.uniform(0, 1000, 11)]).astype(np.float32)
    tl = leaf(t, dtype)
    tmax = np.abs(raw_to_f32(tl.numpy(), tl.dtype)).max()
    check(cuda, F.timestep_embedding(tl, dim, max_period), rtol=0, atol=1e-6 + 6e-7 * tmax)


def test_timestep_embedding_strided_t(cuda, rng):
    t = leaf(rng.uniform(0, 1000, 12).astype(np.float32)).slice(0, 1, None, 3)  # 4 values, stride 12 bytes
    check(cuda, F.timestep_embedding(t, 256), rtol=0, atol=1e-6 + 6e-7 * 1000)


# ---- rope (sd.cpp, precomputed pe) -------------------------------------------------------------
def rope_pe_table(rng, L, R):
    ang = rng.uniform(-3, 3, (L, R))
    pe = np.stack([np.cos(ang), -np.sin(ang), np.sin(ang), np.cos(ang)], -1).reshape(L, R, 2, 2)
    return (pe * rng.uniform(0.5, 1.5, (L, R, 2, 2))).astype(np.float32)  # any 2x2, not just rotations


@pytest.mark.parametrize("layout", ["contig", "permuted", "transposed"])
@pytest.mark.parametrize("R", [6, 4, 1])  # full (head 12) and partial rotation
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_pe(cuda, rng, dtype, interleaved, R, layout):
    N, L, H, D = 2, 5, 3, 12
    x = randn(rng, N, L, H, D)
    t = {"contig": lambda: leaf(x, dtype), "permuted": lambda: permuted(x, dtype),
         "transposed": lambda: leaf(x, dtype, noncontig=True)}[layout]()
    check(cuda, F.rope(t, leaf(rope_pe_table(rng, L, R)), interleaved))


def test_rope_pe_strided_table(cuda, rng):
    # pe as a view: every other token of a longer table, and a table stored (R, L, 2, 2) permuted
    N, L, H, D, R = 1, 6, 2, 16, 8
    x = leaf(randn(rng, N, L, H, D))
    check(cuda, F.rope(x, leaf(rope_pe_table(rng, 2 * L, R)).slice(3, 0, None, 2)))
    pe = np.ascontiguousarray(rope_pe_table(rng, L, R).transpose(1, 0, 2, 3))  # ne [2, 2, L, R]
    check(cuda, F.rope(x, leaf(pe).permute(0, 1, 3, 2), interleaved=False))


@pytest.mark.parametrize("D", [2, 16, 128, 512])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_pe_pairs_path(cuda, rng, monkeypatch, dtype, D):
    # the pair-per-thread kernel (rope_pe_pairs): interleaved, every channel rotated, P = D / 2 a
    # power of two from 1 to 256 (1, 4, 32, 128 rows a block), several heads and batches, a
    # ragged last block of rows
    from sdrt.gpu.cuda.ops import position as GP
    taken = []
    real = GP._pairs_path
    monkeypatch.setattr(GP, "_pairs_path", lambda *a: taken.append(real(*a)) or taken[-1])
    N, L, H = 2, 37, 3
    check(cuda, F.rope(leaf(randn(rng, N, L, H, D), dtype), leaf(rope_pe_table(rng, L, D // 2))))
    assert taken and all(taken)


def test_rope_pe_flux_shape(cuda, rng):
    # Flux: head_dim 128, 24 heads, 4096+512 tokens, batch 1, interleaved pairs
    N, L, H, D = 1, 4608, 24, 128
    check(cuda, F.rope(permuted(randn(rng, N, L, H, D), "F32"), leaf(rope_pe_table(rng, L, D // 2))), atol=2e-5)
    check(cuda, F.rope(leaf(randn(rng, N, L, H, D), "BF16"), leaf(rope_pe_table(rng, L, D // 2))))


# ---- rope_ext (ggml) ---------------------------------------------------------------------------
@pytest.mark.parametrize("noncontig", [False, True])
@pytest.mark.parametrize("n_dims,n_offs", [(16, 0), (8, 0), (6, 4), (2, 14)])
@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_ext(cuda, rng, dtype, mode, n_dims, n_offs, noncontig):
    x = randn(rng, 2, 6, 3, 16)
    t = permuted(x, dtype) if noncontig else leaf(x, dtype)
    pos = np.array([0, 1, 2, 5, 9, 17], np.int32)
    check(cuda, F.rope_ext(t, pos, n_dims, mode=mode, n_offs=n_offs))


def test_rope_ext_strided_positions_and_freq_factors(cuda, rng):
    x = leaf(randn(rng, 1, 4, 2, 8))
    pos = Tensor.from_numpy(np.array([3, -1, 0, -1, 7, -1, 11, -1], np.int32)).slice(0, 0, None, 2)
    ff = leaf(np.array([1.0, 0, 2.0, 0, 1e30, 0, 0.5, 0], np.float32)).slice(0, 0, None, 2)  # stride 8 bytes
    check(cuda, F.rope_ext(x, pos, 8, mode="neox", freq_base=500.0, freq_factors=ff))
    check(cuda, F.rope_ext(x, pos, 8, mode="normal", freq_factors=leaf(np.array([1, 2, 3, 4], np.float32))))


def test_rope_ext_yarn(cuda, rng):
    # GPT-OSS in sd.cpp: neox, n_ctx_orig 4096, ext_factor 1, freq_scale 1/32
    x = leaf(randn(rng, 1, 5, 2, 32))
    pos = np.array([0, 1, 2, 10, 30], np.int32)
    check(cuda, F.rope_ext(x, pos, 32, mode="neox", freq_base=150000.0, freq_scale=1 / 32, ext_factor=1.0,
                          attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096))
    check(cuda, F.rope_ext(x, pos, 24, mode="normal", freq_scale=0.25, ext_factor=0.5, attn_factor=0.9,
                          n_ctx_orig=2048, n_offs=4))


def test_rope_ext_large_positions(cuda, rng):
    # Qwen-style head 128, base 1e6, positions up to 30000: the running product matters here
    x = leaf(randn(rng, 1, 4, 2, 128))
    pos = np.array([0, 1, 4000, 30000], np.int32)
    check(cuda, F.rope_ext(x, pos, 128, mode="neox", freq_base=1e6), atol=2e-5)


@pytest.mark.parametrize("mode,n_dims,sections,D", [("mrope", 16, (2, 3, 3, 0), 20), ("imrope", 16, (3, 3, 2, 0), 16),
                                                      ("mrope", 12, (2, 2, 1, 1), 12), ("vision", 8, (4, 4, 0, 0), 16),
                                                      ("vision", 16, (2, 3, 2, 1), 32)])
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_rope_multi(cuda, rng, dtype, mode, n_dims, sections, D):
    x = randn(rng, 2, 5, 3, D)
    pos4 = rng.integers(0, 40, 20).astype(np.int32)
    check(cuda, F.rope_multi(permuted(x, dtype), pos4, n_dims, sections, mode=mode))


def test_rope_ext_llm_shape(cuda, rng):
    # a text encoder's attention: head 128, 28 heads, 512 tokens, batch 2, neox
    x = leaf(randn(rng, 2, 512, 28, 128), "F16")
    check(cuda, F.rope_ext(x, np.arange(512, dtype=np.int32), 128, mode="neox", freq_base=1e6))
