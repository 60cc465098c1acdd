"""The CUDA backend's fused linear bias (sdrt/gpu/cuda/fuse.py, matmul.mul_mat_add_bias: one
cuBLASLt GEMM with the bias in its epilogue) vs the CPU backend, and vs the same graph with
fusion off (SDRT_CUDA_FUSE=0); eager, captured and replayed runs. Skips without a GPU. Which
pairs fuse is tested without a GPU in tests/test_cuda_fuse.py."""
import numpy as np
import pytest
from opcheck import leaf

from sdrt.ops import api as F
from sdrt.ops.graph import Graph

from ._helpers import assert_within_scale, quant_tensor, randn


@pytest.fixture
def spy(monkeypatch):
    """Records what each fused call did: True for one bias-epilogue GEMM, False for the fallback."""
    import sdrt.gpu.cuda.matmul as G
    calls = []
    real = G._gemm_with_bias

    def record(*a, **k):
        calls.append(real(*a, **k))
        return calls[-1]
    monkeypatch.setattr(G, "_gemm_with_bias", record)
    return calls


def run3(backend, out):
    """Three runs of one graph (eager, captured, replayed) on `backend`: their outputs."""
    g = Graph(out)
    return [np.array(g.run(backend)["out"].numpy(), copy=True) for _ in range(3)]


def check(cuda, out, tol):
    want = Graph(out).run("cpu")["out"].numpy()
    for got in run3(cuda, out):
        assert_within_scale(got, want, tol, "linear+bias cuda vs cpu")


@pytest.mark.parametrize("wdt,tol", [("F16", 3e-3), ("BF16", 2e-2)])
@pytest.mark.parametrize("bdt", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("xdt", ["F32", "F16"])
@pytest.mark.parametrize("shape", [(1, 7, 24), (2, 77, 320), (2, 1024, 640)])
def test_linear_bias_fused(cuda, rng, spy, wdt, tol, bdt, xdt, shape):
    n, l, k = shape
    x = leaf(randn(rng, n, l, k), xdt)
    w = leaf(randn(rng, 3 * k, k) / np.sqrt(k), wdt)
    b = leaf(randn(rng, 3 * k), bdt)
    check(cuda, F.silu(F.linear(x, w, b)), tol)
    assert spy and all(spy), "the bias-epilogue GEMM was not used"


def test_linear_bias_fallbacks(cuda, rng, spy):
    # weights that are not one dense F16/BF16 matrix, and activations whose rows are not evenly
    # spaced: the fused slot runs the product and then the add
    x = leaf(randn(rng, 2, 40, 64))
    b = leaf(randn(rng, 96), "F16")
    check(cuda, F.silu(F.linear(x, leaf(randn(rng, 96, 64) / 8), b)), 1e-4)                 # F32 weight
    check(cuda, F.silu(F.linear(x, quant_tensor("Q8_0", 96, 64), b)), 3e-3)                # block weight
    xt = leaf(randn(rng, 40, 2, 64)).permute(0, 2, 1, 3)                                   # uneven rows
    check(cuda, F.silu(F.linear(xt, leaf(randn(rng, 96, 64) / 8, "F16"), b)), 3e-3)
    assert spy and not any(spy)


def test_fusion_off_gives_the_same(cuda, rng, monkeypatch):
    x = leaf(randn(rng, 2, 256, 320))
    w, b = leaf(randn(rng, 1280, 320) / 18, "F16"), leaf(randn(rng, 1280), "F16")
    out = F.gelu(F.linear(x, w, b), "tanh")
    on = run3(cuda, out)
    monkeypatch.setattr(cuda, "fuse", False)
    off = run3(cuda, out)
    for a, c in zip(on, off):
        assert_within_scale(a, c, 1e-4, "fused vs unfused")


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("shape", [(1, 7, 24), (2, 1024, 640)])
def test_linear_bias_residual_fused(cuda, rng, spy, left, shape):
    # x = to_out(h) + x, as a transformer block: the residual read as cuBLASLt's C
    n, l, k = shape
    x = leaf(randn(rng, n, l, k))
    h = F.gelu(x)
    y = F.linear(h, leaf(randn(rng, k, k) / np.sqrt(k), "F16"), leaf(randn(rng, k), "F16"))
    check(cuda, F.silu(F.add(x, y) if left else F.add(y, x)), 3e-3)
    assert spy and all(spy)


def test_noncontiguous_residual_stays_an_add(cuda, rng, spy):
    # a residual that is a permuted view (same shape, not contiguous): the bias GEMM, then the add
    x = leaf(randn(rng, 2, 40, 64))
    r = leaf(randn(rng, 40, 2, 64)).permute(0, 2, 1, 3)
    y = F.linear(F.gelu(x), leaf(randn(rng, 64, 64) / 8, "F16"), leaf(randn(rng, 64), "F16"))
    check(cuda, F.silu(F.add(y, r)), 3e-3)
    assert spy and all(spy)
