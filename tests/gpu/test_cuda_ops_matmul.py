"""CUDA mul_mat and get_rows vs the CPU backend on the same graph (skips without a GPU).

Tolerances are relative to the output's largest magnitude and follow the path the CUDA kernel
takes (sdrt/gpu/cuda/matmul.py): F32 weights run a pedantic F32 GEMM and block weights with few
columns the fused mmv kernel, both in float (1e-4); F16 and every decoded weight (block types
with many columns, F8) run an F16 GEMM on activations rounded to F16 (3e-3); BF16 weights a BF16
GEMM on activations rounded to BF16 (2e-2). get_rows decodes exactly as the CPU (bit-exact).
"""
import numpy as np
import pytest
from opcheck import leaf

from sdrt.ops import api as F
from sdrt.ops import dtypes
from sdrt.ops.convert import raw_to_f32
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

from ._helpers import assert_on_cuda, assert_within_scale, quant_tensor, randn, run_raw

FLOAT_W = ["F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"]
QUANT_W = [t.name for t in dtypes.QUANT_TYPES]
X_TYPES = ["F32", "F16", "BF16"]


# ---- harness (the `cuda` fixture is tests/gpu/conftest.py's: the cuda0 backend, or skip) ----
def mm_tol(w: Tensor, x: Tensor) -> float:
    """The tolerance of the path mul_mat(w, x) takes on CUDA (see the module docstring)."""
    from sdrt.gpu.cuda.ops import matmul as G
    name = w.dtype.name
    K, M, w2, w3 = w.ne4
    _, N, b2, b3 = x.ne4
    if name == "F32" or (w.dtype.is_quantized and N * (b2 // w2) * (b3 // w3) <= G.MMV_MAX_COLS):
        return 1e-4
    if name == "F16" and x.dtype.name == "F16":
        return 1e-3
    return 2e-2 if name == "BF16" else 3e-3


def check_mm(cuda, node, tol=None):
    assert_on_cuda("matmul", node)
    tol = mm_tol(*node.src) if tol is None else tol
    want = run_raw("cpu", node)
    got = run_raw(cuda, node)
    assert got.shape == want.shape and got.dtype == np.float32
    assert_within_scale(got, want, tol, f"mul_mat w={node.src[0].dtype.name}{node.src[0].ne} "
                                        f"x={node.src[1].dtype.name}{node.src[1].ne}")
    return got


def weight(rng, name, rows, k, batch=(), seed=0) -> Tensor:
    """A weight [*batch, rows, k] (numpy order): random valid blocks for block types."""
    if dtypes.get(name).is_quantized:
        return quant_tensor(name, rows, k, batch, seed)
    return leaf(rng.standard_normal(tuple(batch) + (rows, k)), name)


# ---- mul_mat: every weight type x activation type x column count ------------------------------
@pytest.mark.parametrize("n", [1, 3, 8, 33, 256])
@pytest.mark.parametrize("xdt", X_TYPES)
@pytest.mark.parametrize("wdt", FLOAT_W + QUANT_W)
def test_mul_mat_types_and_columns(cuda, rng, wdt, xdt, n):
    bs = dtypes.get(wdt).block_size
    k = 3 * bs if bs > 1 else 96  # an odd multiple of the block size
    check_mm(cuda, F.mul_mat(weight(rng, wdt, 37, k, seed=n), leaf(randn(rng, n, k), xdt)))


@pytest.mark.parametrize("wdt", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("n", [15, 16, 17])
def test_mul_mat_vec_threshold(cuda, rng, wdt, n):
    # both sides of MMV_MAX_COLS (16) and a K that takes every lane several groups
    k = 4096 + dtypes.get(wdt).block_size
    check_mm(cuda, F.mul_mat(weight(rng, wdt, 70, k), leaf(randn(rng, n, k))))


# ---- batches, broadcasting, views -------------------------------------------------------------
@pytest.mark.parametrize("wdt", ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_1"])
@pytest.mark.parametrize("n", [2, 40])
def test_mul_mat_batch_broadcast(cuda, rng, wdt, n):
    k = dtypes.get(wdt).block_size * 2 if dtypes.get(wdt).is_quantized else 64
    x = randn(rng, 2, 6, n, k)                       # ne = [K, n, 6, 2]
    for wb in [(1, 2), (2, 6), (2, 3), (1, 1), ()]:  # w batches repeat over x's (ggml order)
        check_mm(cuda, F.mul_mat(weight(rng, wdt, 24, k, batch=wb), leaf(x)))
    check_mm(cuda, F.mul_mat(weight(rng, wdt, 24, k, batch=(1, 3)), leaf(x, noncontig=True)))


@pytest.mark.parametrize("wdt", ["F32", "F16", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("xdt", X_TYPES)
def test_mul_mat_activation_views(cuda, rng, wdt, xdt):
    k = 256
    w = weight(rng, wdt, 48, k)
    for n in (3, 40):
        check_mm(cuda, F.mul_mat(w, leaf(randn(rng, n, k), xdt, noncontig=True)))        # transposed
        big = leaf(randn(rng, 2, n, 2 * k), xdt)
        check_mm(cuda, F.mul_mat(w, big.slice(0, k, 2 * k)))                            # row slice
        check_mm(cuda, F.mul_mat(w, leaf(randn(rng, 3, n, k), xdt).permute(0, 2, 1)))     # batch/rows swapped
        check_mm(cuda, F.mul_mat(w, leaf(randn(rng, 2 * n, k), xdt).slice(1, 0, 2 * n, 2)))  # every other row


@pytest.mark.parametrize("wdt", ["F32", "F16", "BF16"])
def test_mul_mat_strided_float_weights(cuda, rng, wdt):
    # weights that are views: a row slice of a fused qkv matrix, a transposed matrix, and the
    # attention pattern mul_mat(k, q) with permuted [D, T, H, B] operands
    qkv = leaf(randn(rng, 3 * 40, 64), wdt)
    check_mm(cuda, F.mul_mat(qkv.slice(1, 40, 80), leaf(randn(rng, 33, 64))))
    check_mm(cuda, F.mul_mat(leaf(randn(rng, 40, 64), wdt, noncontig=True), leaf(randn(rng, 33, 64))))
    k = leaf(randn(rng, 2, 50, 4, 32), wdt).permute(0, 2, 1, 3)   # ne [32, 50, 4, 2] strided
    q = leaf(randn(rng, 2, 30, 4, 32)).permute(0, 2, 1, 3)        # ne [32, 30, 4, 2]
    check_mm(cuda, F.mul_mat(k, q))


@pytest.mark.parametrize("wdt", ["Q8_0", "Q4_K", "F8_E4M3"])
def test_mul_mat_chunked_dequant(cuda, rng, monkeypatch, wdt):
    from sdrt.gpu.cuda.ops import matmul as G
    k = 256
    monkeypatch.setattr(G, "DEQUANT_CHUNK_BYTES", 48 * k * 2)  # 48-row chunks of the F16 weight
    x = randn(rng, 3, 4, 40, k)
    check_mm(cuda, F.mul_mat(weight(rng, wdt, 200, k), leaf(x)))
    check_mm(cuda, F.mul_mat(weight(rng, wdt, 100, k, batch=(1, 2)), leaf(x)))
    check_mm(cuda, F.mul_mat(weight(rng, wdt, 100, k, batch=(3, 2)), leaf(x, noncontig=True)))


def test_mul_mat_sd_shapes(cuda, rng):
    # UNet/DiT-like projections: F16 and Q8_0/Q4_K weights, 1024 tokens x batch 2
    x = leaf(randn(rng, 2, 1024, 640))
    for wdt in ("F16", "Q8_0"):
        check_mm(cuda, F.mul_mat(weight(rng, wdt, 2560, 640), x))
    check_mm(cuda, F.mul_mat(weight(rng, "Q4_K", 2560, 1280), leaf(randn(rng, 2, 256, 1280))))  # K-quants: K % 256 == 0
    check_mm(cuda, F.mul_mat(weight(rng, "Q4_K", 640, 2560), leaf(randn(rng, 2, 77, 2560))))


def test_mul_mat_graph_replay_matches(cuda, rng):
    # the second run of a graph replays a captured CUDA graph: same inputs, same result
    w, xq = weight(rng, "Q4_K", 64, 512), randn(rng, 5, 512)
    holder = np.empty((40, 512), np.float32)
    x = Tensor.from_numpy(holder)
    g = Graph({"mv": F.mul_mat(w, Tensor.from_numpy(xq)), "mm": F.mul_mat(w, x),
               "f": F.mul_mat(weight(rng, "F16", 64, 512), x)})
    outs = []
    for seed in (1, 2, 1):
        holder[...] = np.random.default_rng(seed).standard_normal(holder.shape)
        r = g.run(cuda)
        outs.append({k: np.array(v.numpy(), copy=True) for k, v in r.items()})
        want = Graph(g.outputs).run("cpu")
        for k, v in want.items():
            scale = float(np.abs(v.numpy()).max())
            assert np.abs(outs[-1][k] - v.numpy()).max() <= 3e-3 * scale, k
    for k in outs[0]:
        np.testing.assert_array_equal(outs[0][k], outs[2][k])


# ---- get_rows -------------------------------------------------------------------------------------
def check_rows_exact(cuda, node):
    assert_on_cuda("matmul", node)
    want = run_raw("cpu", node)
    got = run_raw(cuda, node)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"get_rows {node.src[0].dtype.name}")


@pytest.mark.parametrize("tdt", FLOAT_W + QUANT_W)
@pytest.mark.parametrize("idt", [np.int32, np.int64])
def test_get_rows_every_type(cuda, rng, tdt, idt):
    bs = dtypes.get(tdt).block_size
    d = 3 * bs if bs > 1 else 40
    table = weight(rng, tdt, 50, d)
    ids = Tensor.from_numpy(rng.integers(0, 50, size=13).astype(idt))
    check_rows_exact(cuda, F.get_rows(table, ids))


@pytest.mark.parametrize("tdt", ["F32", "F16", "BF16", "Q8_0", "Q4_K", "IQ3_S"])
def test_get_rows_batched_and_views(cuda, rng, tdt):
    d = 256
    table = weight(rng, tdt, 30, d, batch=(2, 3))                          # ne [d, 30, 3, 2]
    ids = Tensor.from_numpy(rng.integers(0, 30, size=(2, 3, 7)).astype(np.int32))
    check_rows_exact(cuda, F.get_rows(table, ids))
    few = Tensor.from_numpy(rng.integers(0, 10, size=(2, 3, 7)).astype(np.int32))
    check_rows_exact(cuda, F.get_rows(table.slice(1, 0, 30, 3), few.slice(0, 0, 7, 2)))  # strided rows, ids
    swapped = Tensor.from_numpy(rng.integers(0, 10, size=(3, 2, 9)).astype(np.int64)).permute(0, 2, 1)
    assert swapped.ne == (9, 3, 2) and not swapped.is_contiguous()
    check_rows_exact(cuda, F.get_rows(table.slice(1, 5, 15), swapped))


def test_get_rows_token_embedding_shape(cuda, rng):
    # a CLIP-like embedding lookup: 49408 x 768 F16 / Q8_0 table, 77 token ids
    ids = Tensor.from_numpy(rng.integers(0, 49408, size=77).astype(np.int32))
    for tdt in ("F16", "Q8_0"):
        check_rows_exact(cuda, F.get_rows(weight(rng, tdt, 49408, 768), ids))


def test_get_rows_out_of_range_id_gives_nan_row(cuda, rng):
    # the CPU op raises; a kernel cannot, so the row is NaN (documented in gpu/cuda/matmul.py)
    table = weight(rng, "Q8_0", 10, 64)
    ids = Tensor.from_numpy(np.array([3, 10, -1, 0], np.int32))
    got = run_raw(cuda, F.get_rows(table, ids))
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
    want = raw_to_f32(table.numpy(), table.dtype)
    np.testing.assert_array_equal(got[[0, 3]], want[[3, 0]])
