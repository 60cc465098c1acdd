"""The CUDA Winograd F(2x2, 3x3) conv (ops/conv.conv3x3_winograd, conv.cu's wino_* kernels) run on
the host (tests/cuda_emu.py: the .cu compiled by g++, every thread of a launch in turn, numpy's
GEMMs in cuBLAS's arguments)
against the CPU backend: the transforms, tile and chunk indexing, the GEMM's layout and the bias
epilogue, without a GPU; and the direct conv's weight packing (conv3x3_pack_w). The GPU tests
(tests/gpu/test_cuda_ops_conv.py) run the same paths on a GPU. Skips where g++ or CUDA's headers
are missing."""
import numpy as np
import pytest
from cuda_emu import HostRuntime, available, on_host
from gpu._helpers import assert_within_scale as assert_close
from gpu._helpers import randn
from opcheck import leaf
from opcheck import run as cpu

from sdrt.ops import api as F

pytestmark = pytest.mark.skipif(not available(), reason="no g++ or CUDA headers (cuda_fp16.h) here")


def run_host(node, monkeypatch, m_dtype="F32", col_bytes=None, out_dtype="F32"):
    """conv2d `node` through the CUDA kernel function on the host, writing `out_dtype` (fuse.py's
    F16 storage); (output as float32, kernels launched)."""
    import sdrt.gpu.cuda.ops.conv as G
    monkeypatch.setattr(G, "WINOGRAD", True)
    monkeypatch.setattr(G, "WINOGRAD_M", m_dtype)
    monkeypatch.setattr(G, "WINOGRAD_MIN_TILES", 0)
    if col_bytes:
        monkeypatch.setattr(G, "COL_BYTES", col_bytes)
    assert G.takes_winograd(node)
    out = np.zeros(node.nelements, np.float32 if out_dtype == "F32" else np.float16)
    from sdrt.gpu.cuda.devtensor import DevTensor
    rt = HostRuntime()
    o = DevTensor.of(node, out.ctypes.data)
    if out_dtype != "F32":
        o = DevTensor.half_of(node, out.ctypes.data, out_dtype)
    G.conv2d(node, [on_host(s) for s in node.src], o, rt)
    return out.astype(np.float32).reshape(node.ne[::-1]), rt.launches


# (N, C, H, W, OC): ragged maps (odd sizes: half-empty output tiles), one-pixel rows, batches
CASES = {
    "even": (1, 8, 8, 12, 16),
    "odd_map": (2, 5, 7, 9, 6),
    "one_row": (1, 4, 1, 11, 3),
    "one_column": (1, 3, 10, 1, 5),
    "deep": (1, 64, 6, 6, 32),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("xdtype", ["F32", "F16", "BF16"])
def test_winograd_matches_cpu(monkeypatch, case, xdtype):
    rng = np.random.default_rng(0)
    N, C, H, W, OC = CASES[case]
    node = F.conv2d(leaf(randn(rng, N, C, H, W), xdtype), leaf(randn(rng, OC, C, 3, 3) / np.sqrt(9 * C), "F16"),
                    leaf(randn(rng, OC)), padding=1)
    got, launches = run_host(node, monkeypatch)
    assert launches[0] == "wino_weights" and f"wino_input_{xdtype.lower()}" in launches
    # F16 operands (the input narrowed, U and V stored F16) as every F16 conv path has them
    assert_close(got, cpu(node), 2e-3, f"winograd {case} {xdtype}")


@pytest.mark.parametrize("bias", ["none", "F16_4d", "strided"])
def test_winograd_bias_forms_and_views(monkeypatch, bias):
    rng = np.random.default_rng(1)
    OC = 6
    x = leaf(randn(rng, 2, 5, 9, 7), noncontig=True)       # a transposed view
    b = {"none": None, "F16_4d": leaf(randn(rng, 1, OC, 1, 1), "F16"),
         "strided": leaf(randn(rng, 2 * OC)).slice(0, 0, None, 2)}[bias]
    node = F.conv2d(x, leaf(randn(rng, OC, 5, 3, 3) / 7.0, "F16"), b, padding=1)
    got, _ = run_host(node, monkeypatch)
    assert_close(got, cpu(node), 2e-3, f"bias {bias}")


@pytest.mark.parametrize("m_dtype", ["F32", "F16"])
def test_winograd_keeps_the_inputs_f16_range(monkeypatch, m_dtype):
    """Inputs near the F16 limit (the SDXL VAE's large activations): a transformed tile sums up to
    four of them, stored / 4 so that it stays finite wherever the F16-narrowed input is."""
    rng = np.random.default_rng(5)
    x = np.full((1, 2, 6, 8), 20000.0, np.float32) * np.sign(randn(rng, 1, 2, 6, 8))
    w = np.zeros((2, 2, 3, 3), np.float32)
    w[0, 0, 1, 1] = 1.0                                 # identity of channel 0
    w[1] = randn(rng, 2, 3, 3) / 100.0
    node = F.conv2d(leaf(x), leaf(w, "F16"), None, padding=1)
    got, _ = run_host(node, monkeypatch, m_dtype)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[0, 0], x[0, 0])
    assert_close(got, cpu(node), 2e-3, f"large inputs, M {m_dtype}")


def test_winograd_writes_f16_storage(monkeypatch):
    """An F16-stored conv output (fuse.py's half storage) is the F32 one rounded."""
    rng = np.random.default_rng(3)
    node = F.conv2d(leaf(randn(rng, 1, 6, 7, 10), "F16"), leaf(randn(rng, 4, 6, 3, 3) / 7.0, "F16"),
                    leaf(randn(rng, 4)), padding=1)
    f32, _ = run_host(node, monkeypatch)
    f16, launches = run_host(node, monkeypatch, out_dtype="F16")
    assert "wino_output_f32_f16" in launches
    np.testing.assert_array_equal(f16, f32.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("m_dtype", ["F32", "F16"])
def test_winograd_chunks_and_m_dtype(monkeypatch, m_dtype):
    """Chunks of tiles (a cap of a few tiles: the last one short) give the one-chunk result."""
    rng = np.random.default_rng(2)
    N, C, H, W, OC = 2, 6, 9, 11, 5
    node = F.conv2d(leaf(randn(rng, N, C, H, W)), leaf(randn(rng, OC, C, 3, 3) / 7.0, "F16"), leaf(randn(rng, OC)),
                    padding=1)
    whole, launches = run_host(node, monkeypatch, m_dtype)
    out_kernel = f"wino_output_{m_dtype.lower()}_f32"
    assert launches.count(out_kernel) == 1
    per_tile = 16 * (2 * C + (4 if m_dtype == "F32" else 2) * OC)
    chunked, launches = run_host(node, monkeypatch, m_dtype, col_bytes=7 * per_tile)
    assert launches.count(out_kernel) == -(-N * 5 * 6 // 7)
    np.testing.assert_array_equal(chunked, whole)
    assert_close(whole, cpu(node), 2e-3 if m_dtype == "F32" else 4e-3, f"M {m_dtype}")


def test_winograd_only_where_asked(monkeypatch):
    """Off by default; on, it takes 3x3-same F16 convs only (not strided, dilated, grouped, F32)."""
    import sdrt.gpu.cuda.ops.conv as G
    x = leaf(np.zeros((1, 4, 8, 8), np.float32))
    w16, w32 = leaf(np.zeros((4, 4, 3, 3), np.float32), "F16"), leaf(np.zeros((4, 4, 3, 3), np.float32))
    same = F.conv2d(x, w16, None, padding=1)
    monkeypatch.setattr(G, "WINOGRAD", False)
    assert not G.takes_winograd(same)
    monkeypatch.setattr(G, "WINOGRAD", True)
    monkeypatch.setattr(G, "WINOGRAD_MIN_TILES", 16)
    assert G.takes_winograd(same)                       # 8x8: 16 tiles
    monkeypatch.setattr(G, "WINOGRAD_MIN_TILES", 17)
    assert not G.takes_winograd(same)
    monkeypatch.setattr(G, "WINOGRAD_MIN_TILES", 0)
    assert not G.takes_winograd(F.conv2d(x, w32, None, padding=1))
    assert not G.takes_winograd(F.conv2d(x, w16, None, padding=1, stride=2))
    assert not G.takes_winograd(F.conv2d(x, w16, None, padding=2, dilation=2))
    assert not G.takes_winograd(F.conv2d(x, w16, None, padding=0))


@pytest.mark.parametrize("kc", [16, 32])
def test_direct_conv_weight_packing(kc):
    """conv3x3_pack_w's layout packed[ob][ch][tap][k][n] = w[ob*bn + n][(ch*kc + k)*9 + tap],
    zeros past OC and C (what conv3x3_mma reads: ragged channel counts here)."""
    rng = np.random.default_rng(4)
    C, OC, bn = 21, 70, 32
    nch, nob = -(-C // kc), -(-OC // bn)
    w = rng.standard_normal((OC, C, 3, 3)).astype(np.float16)
    total = nob * nch * 9 * kc * bn
    out = np.full(total, np.nan, np.float16)
    HostRuntime().fn("conv", "conv3x3_pack_w", "PPiiiiiq")((2,), (32,), out.ctypes.data, w.ctypes.data,
                                                         C, OC, bn, kc, nch, total)
    want = np.zeros((nob * bn, nch * kc, 9), np.float16)
    want[:OC, :C] = w.reshape(OC, C, 9)
    want = want.reshape(nob, bn, nch, kc, 9).transpose(0, 2, 4, 3, 1)     # [ob][ch][tap][k][n]
    np.testing.assert_array_equal(out, want.reshape(-1))
