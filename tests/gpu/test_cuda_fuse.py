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
    import sdrt.gpu.cuda.ops.matmul as G
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


# ---- F32 results stored as F16 (fuse.half_nodes) ---------------------------------------------

def _block(rng, n=2, l=256, c=320, heads=5, ctx=None):
    """A transformer block as the UNet builds it (sdrt/models: layer norms, F16 linears, the
    multi-head attention and its output cont, the geglu feed-forward, residual adds)."""
    from sdrt.models.common import multihead_attention

    def lin(k, m, bias=True):
        w = leaf(randn(rng, m, k) / np.sqrt(k), "F16")
        b = leaf(randn(rng, m) * 0.1, "F16") if bias else None
        return lambda t: F.linear(t, w, b)

    def ln(t):
        return F.layer_norm_affine(t, leaf(1 + 0.1 * randn(rng, c)), leaf(0.1 * randn(rng, c)), 1e-5)
    x = leaf(randn(rng, n, l, c))
    context = x if ctx is None else leaf(randn(rng, n, ctx, c))
    q, k, v, o = lin(c, c, False), lin(c, c, False), lin(c, c, False), lin(c, c)
    h = ln(x)
    x = F.add(o(multihead_attention(q(h), k(h), v(h), heads)), x)
    h = ln(x)
    q2, k2, v2, o2 = lin(c, c, False), lin(c, c, False), lin(c, c, False), lin(c, c)
    x = F.add(o2(multihead_attention(q2(h), k2(context), v2(context), heads)), x)
    ff1, ff2 = lin(c, 8 * c), lin(4 * c, c)
    return F.add(ff2(F.geglu(ff1(ln(x)), "tanh")), x)


@pytest.mark.parametrize("shape", [(2, 256, 320, 5, None), (2, 1024, 640, 10, 77), (1, 64, 80, 2, 9)])
def test_half_storage_block_matches_cpu_and_f32_storage(cuda, rng, monkeypatch, shape):
    out = _block(rng, *shape)
    want = Graph(out).run("cpu")["out"].numpy()
    g = Graph(out)
    g.run(cuda)
    stored = {n.op for n in g.nodes if id(n) in cuda._states[g].half}
    assert stored == {"layer_norm_affine", "mul_mat", "cont", "add", "geglu"}
    on = run3(cuda, out)
    monkeypatch.setattr(cuda, "store_half", False)
    off = run3(cuda, out)
    for a, b in zip(on, off):
        assert_within_scale(a, want, 3e-3, "F16 storage vs cpu")
        assert_within_scale(b, want, 3e-3, "F32 storage vs cpu")
        assert_within_scale(a, b, 2e-3, "F16 vs F32 storage")


@pytest.mark.parametrize("producer", ["layer_norm", "cont", "geglu", "group_norm"])
def test_half_storage_before_a_gemm_gives_the_packed_bits(cuda, rng, monkeypatch, producer):
    # a norm/cont/geglu writing F16 for the GEMM (or the conv's im2col) gives the bits the GEMM's
    # own F32 -> F16 pack gave: the two runs agree to the GEMM's own run-to-run level
    x = leaf(randn(rng, 2, 300, 256))
    if producer == "group_norm":
        x = leaf(randn(rng, 2, 64, 24, 40))  # ne [W, H, C, N]
        h = F.group_norm_affine(x, leaf(randn(rng, 64)), leaf(randn(rng, 64)), 32, 1e-5, silu=True)
        out = F.conv2d(h, leaf(randn(rng, 96, 64, 3, 3) / 24, "F16"), leaf(randn(rng, 96)), padding=1)
    elif producer == "layer_norm":
        h = F.layer_norm_affine(x, leaf(randn(rng, 256)), leaf(randn(rng, 256)), 1e-5)
    elif producer == "cont":
        h = F.cont(F.gelu(x).permute(0, 2, 1, 3))
    else:
        h = F.geglu(F.silu(x), "none")
    if producer != "group_norm":
        out = F.mul_mat(leaf(randn(rng, 96, h.ne[0]) / np.sqrt(h.ne[0]), "F16"), h)
    on = run3(cuda, out)
    monkeypatch.setattr(cuda, "store_half", False)
    off = run3(cuda, out)
    for a, b in zip(on, off):
        assert_within_scale(a, b, 1e-6, f"{producer} stored F16 vs packed")


@pytest.mark.parametrize("xdt", ["F32", "F16"])
def test_conv_epilogue_fused(cuda, rng, monkeypatch, xdt):
    """ESRGAN's conv + leaky_relu and 0.2 * conv + x (the direct 3x3 conv's epilogue) vs the CPU,
    and vs the same graph unfused."""
    x = leaf(randn(rng, 1, 32, 130, 140) * 0.5, xdt)
    h = F.leaky_relu(F.conv2d(x, leaf(randn(rng, 48, 32, 3, 3) / 17, "F16"), leaf(randn(rng, 48)), padding=1), 0.2)
    y = F.add(F.scale(F.conv2d(h, leaf(randn(rng, 32, 48, 3, 3) / 20, "F16"), leaf(randn(rng, 32), "F16"),
                               padding=1), 0.2), F.cast(x, "F32"))
    out = F.silu(y)
    check(cuda, out, 3e-3)
    on = run3(cuda, out)
    monkeypatch.setattr(cuda, "fuse", False)
    for a, c in zip(on, run3(cuda, out)):
        assert_within_scale(a, c, 1e-5, "fused conv epilogue vs unfused")
