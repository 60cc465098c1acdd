"""CUDA mul_mat and get_rows vs the CPU backend on the same graph (skips without a GPU).

Tolerances are relative to the output's largest magnitude and follow the path the CUDA kernel
takes (sdrt/gpu/cuda/matmul.py): F32 weights run a pedantic F32 GEMM and block weights with few
columns the fused mmv kernel, both in float (1e-4); F16 and every decoded weight (block types
with many columns, F8) run an F16 GEMM on activations rounded to F16 (3e-3); BF16 weights a BF16
GEMM on activations rounded to BF16 (2e-2). get_rows decodes exactly as the CPU (bit-exact).
"""
import numpy as np
import pytest

from sdrt.ops import api as F
from sdrt.ops import dtypes, quant
from sdrt.ops.convert import f32_to_raw, raw_to_f32
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

FLOAT_W = ["F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"]
QUANT_W = [t.name for t in dtypes.QUANT_TYPES]
X_TYPES = ["F32", "F16", "BF16"]


# ---- harness -------------------------------------------------------------------------------
def cuda_backend():
    """The cuda0 backend, or skip the test when this machine has no usable CUDA device."""
    from sdrt.gpu import cuda
    if not getattr(cuda, "available", lambda: False)():
        pytest.skip("no CUDA device (sdrt.gpu.cuda.available() is False)")
    from sdrt.ops.backend import get_backend
    return get_backend("cuda0")


@pytest.fixture(scope="module")
def gpu():
    return cuda_backend()


def run_raw(backend, node) -> np.ndarray:
    out = Graph(node).run(backend)["out"]
    return np.array(out.numpy(), copy=True)


def assert_on_cuda(node):
    from sdrt.gpu.cuda.table import CUDA
    import sdrt.gpu.cuda.matmul  # noqa: F401  (registers the kernels)
    assert CUDA.find(node) is not None, f"no CUDA kernel for {node.op}({[s.dtype.name for s in node.src]})"


def mm_tol(w: Tensor, x: Tensor) -> float:
    """The tolerance of the path mul_mat(w, x) takes on CUDA (see the module docstring)."""
    from sdrt.gpu.cuda import matmul as G
    name = w.dtype.name
    K, M, w2, w3 = w.ne4
    _, N, b2, b3 = x.ne4
    if name == "F32" or (w.dtype.is_quantized and N * (b2 // w2) * (b3 // w3) <= G.MMV_MAX_COLS):
        return 1e-4
    if name == "F16" and x.dtype.name == "F16":
        return 1e-3
    return 2e-2 if name == "BF16" else 3e-3


def check_mm(gpu, node, tol=None):
    assert_on_cuda(node)
    tol = mm_tol(*node.src) if tol is None else tol
    want = run_raw("cpu", node)
    got = run_raw(gpu, node)
    assert got.shape == want.shape and got.dtype == np.float32
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, (f"mul_mat w={node.src[0].dtype.name}{node.src[0].ne} x={node.src[1].dtype.name}"
                                f"{node.src[1].ne}: max error {err:.3g} > {tol} * {scale:.3g}")
    return got


def leaf(x, dtype="F32", noncontig=False) -> Tensor:
    """A leaf holding float32 `x` (numpy order) stored as `dtype`; noncontig stores it
    transposed and returns the transposed view (same values, strided)."""
    x = np.asarray(x, np.float32)
    if noncontig and x.ndim >= 2:
        return Tensor.from_numpy(f32_to_raw(np.ascontiguousarray(np.swapaxes(x, -1, -2)), dtype),
                                 dtype=dtype).transpose()
    return Tensor.from_numpy(f32_to_raw(x, dtype), dtype=dtype)


def weight(rng, name, rows, k, batch=(), seed=0) -> Tensor:
    """A weight [*batch, rows, k] (numpy order): random valid blocks for block types."""
    if dtypes.get(name).is_quantized:
        raw = quant.random_raw(name, int(np.prod(batch, dtype=int)) * rows, k, seed=seed)
        return Tensor.from_numpy(raw.reshape(tuple(batch) + (rows, raw.shape[-1])), dtype=name)
    return leaf(rng.standard_normal(tuple(batch) + (rows, k)), name)


def rnd(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ---- mul_mat: every weight type x activation type x column count ------------------------------
@pytest.mark.parametrize("n", [1, 3, 8, 33, 256])
@pytest.mark.parametrize("xdt", X_TYPES)
@pytest.mark.parametrize("wdt", FLOAT_W + QUANT_W)
def test_mul_mat_types_and_columns(gpu, rng, wdt, xdt, n):
    bs = dtypes.get(wdt).block_size
    k = 3 * bs if bs > 1 else 96  # an odd multiple of the block size
    check_mm(gpu, F.mul_mat(weight(rng, wdt, 37, k, seed=n), leaf(rnd(rng, n, k), xdt)))


@pytest.mark.parametrize("wdt", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("n", [15, 16, 17])
def test_mul_mat_vec_threshold(gpu, rng, wdt, n):
    # both sides of MMV_MAX_COLS (16) and a K that takes every lane several groups
    k = 4096 + dtypes.get(wdt).block_size
    check_mm(gpu, F.mul_mat(weight(rng, wdt, 70, k), leaf(rnd(rng, n, k))))


# ---- batches, broadcasting, views -------------------------------------------------------------
@pytest.mark.parametrize("wdt", ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_1"])
@pytest.mark.parametrize("n", [2, 40])
def test_mul_mat_batch_broadcast(gpu, rng, wdt, n):
    k = dtypes.get(wdt).block_size * 2 if dtypes.get(wdt).is_quantized else 64
    x = rnd(rng, 2, 6, n, k)                       # ne = [K, n, 6, 2]
    for wb in [(1, 2), (2, 6), (2, 3), (1, 1), ()]:  # w batches repeat over x's (ggml order)
        check_mm(gpu, F.mul_mat(weight(rng, wdt, 24, k, batch=wb), leaf(x)))
    check_mm(gpu, F.mul_mat(weight(rng, wdt, 24, k, batch=(1, 3)), leaf(x, noncontig=True)))


@pytest.mark.parametrize("wdt", ["F32", "F16", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("xdt", X_TYPES)
def test_mul_mat_activation_views(gpu, rng, wdt, xdt):
    k = 256
    w = weight(rng, wdt, 48, k)
    for n in (3, 40):
        check_mm(gpu, F.mul_mat(w, leaf(rnd(rng, n, k), xdt, noncontig=True)))        # transposed
        big = leaf(rnd(rng, 2, n, 2 * k), xdt)
        check_mm(gpu, F.mul_mat(w, big.slice(0, k, 2 * k)))                            # row slice
        check_mm(gpu, F.mul_mat(w, leaf(rnd(rng, 3, n, k), xdt).permute(0, 2, 1)))     # batch/rows swapped
        check_mm(gpu, F.mul_mat(w, leaf(rnd(rng, 2 * n, k), xdt).slice(1, 0, 2 * n, 2)))  # every other row


@pytest.mark.parametrize("wdt", ["F32", "F16", "BF16"])
def test_mul_mat_strided_float_weights(gpu, rng, wdt):
    # weights that are views: a row slice of a fused qkv matrix, a transposed matrix, and the
    # attention pattern mul_mat(k, q) with permuted [D, T, H, B] operands
    qkv = leaf(rnd(rng, 3 * 40, 64), wdt)
    check_mm(gpu, F.mul_mat(qkv.slice(1, 40, 80), leaf(rnd(rng, 33, 64))))
    check_mm(gpu, F.mul_mat(leaf(rnd(rng, 40, 64), wdt, noncontig=True), leaf(rnd(rng, 33, 64))))
    k = leaf(rnd(rng, 2, 50, 4, 32), wdt).permute(0, 2, 1, 3)   # ne [32, 50, 4, 2] strided
    q = leaf(rnd(rng, 2, 30, 4, 32)).permute(0, 2, 1, 3)        # ne [32, 30, 4, 2]
    check_mm(gpu, F.mul_mat(k, q))


@pytest.mark.parametrize("wdt", ["Q8_0", "Q4_K", "F8_E4M3"])
def test_mul_mat_chunked_dequant(gpu, rng, monkeypatch, wdt):
    from sdrt.gpu.cuda import matmul as G
    k = 256
    monkeypatch.setattr(G, "DEQUANT_CHUNK_BYTES", 48 * k * 2)  # 48-row chunks of the F16 weight
    x = rnd(rng, 3, 4, 40, k)
    check_mm(gpu, F.mul_mat(weight(rng, wdt, 200, k), leaf(x)))
    check_mm(gpu, F.mul_mat(weight(rng, wdt, 100, k, batch=(1, 2)), leaf(x)))
    check_mm(gpu, F.mul_mat(weight(rng, wdt, 100, k, batch=(3, 2)), leaf(x, noncontig=True)))


def test_mul_mat_sd_shapes(gpu, rng):
    # UNet/DiT-like projections: F16 and Q8_0/Q4_K weights, 1024 tokens x batch 2
    x = leaf(rnd(rng, 2, 1024, 640))
    for wdt in ("F16", "Q8_0"):
        check_mm(gpu, F.mul_mat(weight(rng, wdt, 2560, 640), x))
    check_mm(gpu, F.mul_mat(weight(rng, "Q4_K", 2560, 1280), leaf(rnd(rng, 2, 256, 1280))))  # K-quants: K % 256 == 0
    check_mm(gpu, F.mul_mat(weight(rng, "Q4_K", 640, 2560), leaf(rnd(rng, 2, 77, 2560))))


def test_mul_mat_graph_replay_matches(gpu, rng):
    # the second run of a graph replays a captured CUDA graph: same inputs, same result
    w, xq = weight(rng, "Q4_K", 64, 512), rnd(rng, 5, 512)
    holder = np.empty((40, 512), np.float32)
    x = Tensor.from_numpy(holder)
    g = Graph({"mv": F.mul_mat(w, Tensor.from_numpy(xq)), "mm": F.mul_mat(w, x),
               "f": F.mul_mat(weight(rng, "F16", 64, 512), x)})
    outs = []
    for seed in (1, 2, 1):
        holder[...] = np.random.default_rng(seed).standard_normal(holder.shape)
        r = g.run(gpu)
        outs.append({k: np.array(v.numpy(), copy=True) for k, v in r.items()})
        want = Graph(g.outputs).run("cpu")
        for k, v in want.items():
            scale = float(np.abs(v.numpy()).max())
            assert np.abs(outs[-1][k] - v.numpy()).max() <= 3e-3 * scale, k
    for k in outs[0]:
        np.testing.assert_array_equal(outs[0][k], outs[2][k])


# ---- get_rows -------------------------------------------------------------------------------------
def check_rows_exact(gpu, node):
    assert_on_cuda(node)
    want = run_raw("cpu", node)
    got = run_raw(gpu, node)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"get_rows {node.src[0].dtype.name}")


@pytest.mark.parametrize("tdt", FLOAT_W + QUANT_W)
@pytest.mark.parametrize("idt", [np.int32, np.int64])
def test_get_rows_every_type(gpu, rng, tdt, idt):
    bs = dtypes.get(tdt).block_size
    d = 3 * bs if bs > 1 else 40
    table = weight(rng, tdt, 50, d)
    ids = Tensor.from_numpy(rng.integers(0, 50, size=13).astype(idt))
    check_rows_exact(gpu, F.get_rows(table, ids))


@pytest.mark.parametrize("tdt", ["F32", "F16", "BF16", "Q8_0", "Q4_K", "IQ3_S"])
def test_get_rows_batched_and_views(gpu, rng, tdt):
    d = 256
    table = weight(rng, tdt, 30, d, batch=(2, 3))                          # ne [d, 30, 3, 2]
    ids = Tensor.from_numpy(rng.integers(0, 30, size=(2, 3, 7)).astype(np.int32))
    check_rows_exact(gpu, F.get_rows(table, ids))
    few = Tensor.from_numpy(rng.integers(0, 10, size=(2, 3, 7)).astype(np.int32))
    check_rows_exact(gpu, F.get_rows(table.slice(1, 0, 30, 3), few.slice(0, 0, 7, 2)))  # strided rows, ids
    swapped = Tensor.from_numpy(rng.integers(0, 10, size=(3, 2, 9)).astype(np.int64)).permute(0, 2, 1)
    assert swapped.ne == (9, 3, 2) and not swapped.is_contiguous()
    check_rows_exact(gpu, F.get_rows(table.slice(1, 5, 15), swapped))


def test_get_rows_token_embedding_shape(gpu, rng):
    # a CLIP-like embedding lookup: 49408 x 768 F16 / Q8_0 table, 77 token ids
    ids = Tensor.from_numpy(rng.integers(0, 49408, size=77).astype(np.int32))
    for tdt in ("F16", "Q8_0"):
        check_rows_exact(gpu, F.get_rows(weight(rng, tdt, 49408, 768), ids))


def test_get_rows_out_of_range_id_gives_nan_row(gpu, rng):
    # the CPU op raises; a kernel cannot, so the row is NaN (documented in gpu/cuda/matmul.py)
    table = weight(rng, "Q8_0", 10, 64)
    ids = Tensor.from_numpy(np.array([3, 10, -1, 0], np.int32))
    got = run_raw(gpu, F.get_rows(table, ids))
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
    want = raw_to_f32(table.numpy(), table.dtype)
    np.testing.assert_array_equal(got[[0, 3]], want[[3, 0]])
