"""CUDA kernel functions of the families without block-wide cooperation (conv's im2col, transposed
and pooling paths, element-wise, layout, every block type's decoder), run on the host (tests/cuda_emu.py: the .cu compiled by
g++, every thread of each launch in turn, numpy for cuBLAS) against the CPU backend: the kernels'
index arithmetic, views, dtypes and the kernel functions' launches and GEMM arguments are checked
without a GPU. The same cases run on a GPU in tests/gpu/. Skips where g++ or CUDA's headers are
missing."""
import numpy as np
import pytest
from cuda_emu import HostRuntime, available, host_view, on_host
from gpu._helpers import assert_within_scale, randn
from opcheck import leaf, run
from test_ops_conv import CONV2D_CASES, CONVT_CASES

from sdrt.ops import api as F
from sdrt.ops import quant
from sdrt.ops.convert import raw_to_f32
from sdrt.ops.dtypes import QUANT_TYPES
from sdrt.ops.tensor import Tensor

pytestmark = pytest.mark.skipif(not available(), reason="no g++ or CUDA headers (cuda_fp16.h) here")


def host_run(node) -> np.ndarray:
    """`node` (its sources leaves or views of leaves) through its CUDA kernel function on the
    host, as float32 in numpy order."""
    from sdrt.gpu.cuda import ops as cuda_ops
    from sdrt.gpu.cuda.devtensor import DevTensor
    from sdrt.gpu.cuda.table import CUDA
    from sdrt.gpu.device_backend import import_families
    import_families(cuda_ops)
    k = CUDA.find(node)
    assert k is not None, f"no CUDA kernel for {node.op}"
    out = np.zeros(max(node.nbytes, 1), np.uint8)
    k.fn(node, [on_host(s) for s in node.src], DevTensor.of(node, out.ctypes.data), HostRuntime())
    raw = out[:node.nbytes].view({"F32": np.float32, "F16": np.float16}.get(node.dtype.name, np.uint16))
    return raw_to_f32(raw, node.dtype).reshape(node.ne[::-1])


def assert_close(node, tol):
    """The host run within tol of the output's largest magnitude of the CPU backend's."""
    assert_within_scale(host_run(node), run(node), tol, f"{node.op} {node.params}")


@pytest.fixture(autouse=True)
def im2col_path(monkeypatch):
    """Small maps never take the direct conv (tensor-core PTX, not on the host); make sure."""
    import sdrt.gpu.cuda.ops.conv as G
    monkeypatch.setattr(G, "DIRECT_3X3_PIXELS", 0)
    monkeypatch.setattr(G, "WINOGRAD", False)


@pytest.mark.parametrize("case", sorted(CONV2D_CASES))
@pytest.mark.parametrize("wdtype", ["F32", "F16"])
def test_conv2d_im2col(case, wdtype):
    rng = np.random.default_rng(0)
    c = dict(CONV2D_CASES[case])
    x, w = randn(rng, *c.pop("x")), randn(rng, *c.pop("w"))
    node = F.conv2d(leaf(x), leaf(w, wdtype), leaf(randn(rng, w.shape[0])), **c)
    assert_close(node, 1e-5 if wdtype == "F32" else 2e-3)


@pytest.mark.parametrize("cap", [64, 1 << 20])
def test_conv2d_im2col_chunks_views_dtypes(monkeypatch, cap):
    """Column chunks (64 B: a row at a time), a transposed F16 input, a BF16 input."""
    import sdrt.gpu.cuda.ops.conv as G
    monkeypatch.setattr(G, "COL_BYTES", cap)
    rng = np.random.default_rng(1)
    w = leaf(randn(rng, 4, 3, 3, 3), "F16")
    assert_close(F.conv2d(leaf(randn(rng, 2, 3, 6, 9), "F16", noncontig=True), w, leaf(randn(rng, 4)), padding=1), 2e-3)
    assert_close(F.conv2d(leaf(randn(rng, 2, 3, 7, 5), "BF16"), w, None, stride=2, padding=1), 2e-3)


@pytest.mark.parametrize("case", sorted(CONVT_CASES))
def test_conv_transpose2d(case):
    rng = np.random.default_rng(2)
    c = dict(CONVT_CASES[case])
    x, w = randn(rng, *c.pop("x")), randn(rng, *c.pop("w"))
    assert_close(F.conv_transpose2d(leaf(x), leaf(w, "F16"), leaf(randn(rng, w.shape[1])), **c), 2e-3)


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("params", [dict(kernel=2), dict(kernel=3, stride=2, padding=1),
                                    dict(kernel=(3, 2), stride=(1, 2), padding=(1, 0))])
def test_pool2d(kind, params):
    rng = np.random.default_rng(3)
    assert_close(F.pool2d(leaf(randn(rng, 2, 3, 7, 5), "F16", noncontig=True), kind, **params), 1e-6)


@pytest.mark.parametrize("op", ["add", "mul", "sub", "div"])
@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_binary_broadcast_and_views(op, dtype):
    rng = np.random.default_rng(4)
    a = leaf(randn(rng, 2, 3, 5, 7), dtype, noncontig=True)
    b = leaf(randn(rng, 1, 3, 1, 7) + (3.0 if op == "div" else 0.0), dtype)
    assert_close(getattr(F, op)(a, b), 2e-3 if dtype == "F16" else 1e-6)


@pytest.mark.parametrize("op", ["silu", "gelu", "tanh", "relu", "sqr", "exp"])
def test_unary(op):
    rng = np.random.default_rng(5)
    assert_close(getattr(F, op)(leaf(randn(rng, 3, 4, 33), "F16")), 2e-3)


def test_layout_cont_permute_concat():
    rng = np.random.default_rng(6)
    x = leaf(randn(rng, 2, 3, 4, 5))
    assert_close(F.cont(x.permute(1, 2, 0, 3)), 0.0)
    assert_close(F.concat(leaf(randn(rng, 2, 3, 4)), leaf(randn(rng, 2, 5, 4)), 1), 0.0)



@pytest.mark.parametrize("dt", QUANT_TYPES, ids=[t.name for t in QUANT_TYPES])
def test_dequantize_every_block_type(dt):
    """quant.cu's decoders (quant_blocks.cuh, a port of the CPU's): F32 bit for bit as
    sdrt.ops.quant.dequantize, F16 that rounded to nearest even; two rows of two blocks."""
    from sdrt.gpu.cuda.quant import dense_copy
    raw = quant.random_raw(dt.name, 2, 2 * dt.block_size, seed=7)
    want = quant.dequantize(raw, dt)
    dev = on_host(Tensor.from_numpy(raw, dtype=dt.name))
    rt = HostRuntime()          # holds the scratch the copies land in
    for out, expect in (("F32", want), ("F16", want.astype(np.float16))):
        got = host_view(dense_copy(rt, dev, out), expect.dtype, expect.shape, (expect.shape[1], 1))
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), expect.view(f"u{got.itemsize}"),
                                      err_msg=f"{dt.name} -> {out}")


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_pe_table(interleaved):
    """rope with a per-position 2x2 table (Flux-style; any 2x2, not only rotations), on a
    permuted view."""
    rng = np.random.default_rng(8)
    N, L, H, D, R = 2, 5, 3, 12, 6
    x = leaf(np.ascontiguousarray(np.swapaxes(randn(rng, N, L, H, D), 1, 2))).permute(0, 2, 1, 3)
    pe = rng.uniform(-1, 1, (L, R, 2, 2)).astype(np.float32)
    assert_close(F.rope(x, leaf(pe), interleaved), 1e-6)


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_dims,n_offs", [(16, 0), (6, 4)])
def test_rope_ext(mode, n_dims, n_offs):
    rng = np.random.default_rng(9)
    pos = np.array([0, 1, 2, 5, 9, 17], np.int32)
    assert_close(F.rope_ext(leaf(randn(rng, 2, 6, 3, 16), "F16"), pos, n_dims, mode=mode, n_offs=n_offs), 2e-3)


def test_timestep_embedding():
    """Within the float32 rounding of t * freq (t up to 1000: tests/gpu's tolerance)."""
    rng = np.random.default_rng(10)
    assert_close(F.timestep_embedding(leaf(rng.uniform(0, 1000, 3).astype(np.float32)), 64, 10000), 1e-6 + 6e-7 * 1000)
