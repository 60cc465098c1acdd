"""CUDA attention vs the CPU backend on the same graph (GPU tests skip without a CUDA device; the
tests at the end check the kernel tables against kernels/attention.cu and run everywhere).

Every GPU case runs on each path of sdrt/gpu/cuda/attention.py, forced with FORCE_PATH:
"flash" (on sm_90 the wgmma kernel for head dims 64/128, else on sm_80+ the mma.sync kernel;
F16 inputs read in place, others packed to half),
"wmma" (the portable wmma kernel on staged half q/k/v, F32 online softmax), "gemm16" (cuBLAS F16 GEMMs, F32
scores and softmax) and "gemm32" (pedantic F32 GEMMs: the precision="F32" path). Errors are
measured relative to the output's largest magnitude: 2e-3 for the half paths (a numpy model of
the flash kernel's roundings gives 4e-4 to 1e-3 on unit-variance inputs at D=40..160,
Lk=77..4096), 1e-5 for the F32 path.
"""
import re
from pathlib import Path

import numpy as np
import pytest
from opcheck import leaf

from sdrt.gpu.cuda.ops import attention as GA
from sdrt.ops import api as F
from sdrt.ops.convert import f32_to_raw, raw_to_f32
from sdrt.ops.graph import Graph
from sdrt.ops.registry import make_node
from sdrt.ops.tensor import Tensor

from ._helpers import assert_on_cuda, randn, run_f32

PATHS = ["flash", "wmma", "gemm16", "gemm32"]
TOL = {"flash": 2e-3, "wmma": 2e-3, "gemm16": 2e-3, "gemm32": 1e-5}
HALF_TOL = {"flash": 3e-2, "wmma": 3e-2, "gemm16": 3e-2, "gemm32": 2e-3}
KERNELS = Path(GA.__file__).parent.parent / "kernels"


# ---- harness (the `cuda` fixture is tests/gpu/conftest.py's: the cuda0 backend, or skip) ----
@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setattr(GA, "FORCE_PATH", request.param)
    return request.param


def check(cuda, node, path, tol=None):
    """Run `node` on cuda0 and on the CPU; assert the error relative to the output scale."""
    assert_on_cuda("attention", node)
    got, ref = run_f32(cuda, node), run_f32("cpu", node)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), f"{path}: non-finite output"
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got - ref).max()) / scale
    assert err <= (tol or TOL[path]), f"{path}: max error {err:.2e} of output scale {scale:.3g}"
    return got, ref


# ---- head dims, lengths, dtypes --------------------------------------------------------------
@pytest.mark.parametrize("D", [40, 64, 80, 128, 160])
def test_head_dims(cuda, rng, path, D):
    """SD1.x 40/80/160, SDXL 64, Flux 128; self- and cross-attention lengths."""
    q, k, v = randn(rng, 2, 3, 100, D), randn(rng, 2, 3, 77, D), randn(rng, 2, 3, 77, D)
    check(cuda, F.attention(leaf(q), leaf(k), leaf(v)), path)


@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 77), (77, 1), (100, 77), (77, 100), (1, 4096),
                                   (100, 4096), (4096, 77), (129, 65)])
def test_odd_lengths(cuda, rng, path, Lq, Lk):
    """Lq not a multiple of the query block, Lk not a multiple of the key tile (padded keys
    must be masked out, padded queries never written)."""
    q, k, v = randn(rng, 1, 2, Lq, 40), randn(rng, 1, 2, Lk, 40), randn(rng, 1, 2, Lk, 40)
    check(cuda, F.attention(leaf(q), leaf(k), leaf(v)), path)


@pytest.mark.parametrize("dtype", ["F32", "F16"])
@pytest.mark.parametrize("D,H,N", [(40, 8, 1), (64, 2, 2)])
def test_sd_self_attention_4096(cuda, rng, path, D, H, N, dtype):
    """The SD1.5 / SDXL 64x64-latent self-attention length (64 key tiles, online rescaling);
    F16 inputs are read in place by the mma kernel, F32 ones packed first."""
    q, k, v = (randn(rng, N, H, 4096, D) for _ in range(3))
    check(cuda, F.attention(leaf(q, dtype), leaf(k, dtype), leaf(v, dtype)), path)


@pytest.mark.parametrize("D,Dv", [(40, 24), (24, 72), (8, 8), (112, 100)])
def test_value_dim_differs(cuda, rng, path, D, Dv):
    q, k, v = randn(rng, 1, 2, 33, D), randn(rng, 1, 2, 50, D), randn(rng, 1, 2, 50, Dv)
    check(cuda, F.attention(leaf(q), leaf(k), leaf(v)), path)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_input_dtypes(cuda, rng, path, dtype):
    q, k, v = randn(rng, 2, 3, 19, 64), randn(rng, 2, 3, 45, 64), randn(rng, 2, 3, 45, 64)
    check(cuda, F.attention(leaf(q, dtype), leaf(k, dtype), leaf(v, dtype)), path)


def test_mixed_input_dtypes(cuda, rng, path):
    q, k, v = randn(rng, 1, 2, 10, 16), randn(rng, 1, 2, 9, 16), randn(rng, 1, 2, 9, 16)
    check(cuda, F.attention(leaf(q, "BF16"), leaf(k, "F32"), leaf(v, "F16"), scale=0.4), path)


def test_large_scores_stay_finite(cuda, rng, path):
    """Scores of several hundred: the max subtraction must happen before exp."""
    q, k, v = randn(rng, 1, 1, 8, 8, scale=40), randn(rng, 1, 1, 300, 8, scale=40), randn(rng, 1, 1, 300, 8)
    check(cuda, F.attention(leaf(q), leaf(k), leaf(v)), path, tol=HALF_TOL[path])


# ---- broadcast: GQA, batch, masks --------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["F32", "F16"])
@pytest.mark.parametrize("Hkv,Nk", [(2, 2), (1, 2), (3, 1), (1, 1)])
def test_gqa_and_batch_broadcast(cuda, rng, path, Hkv, Nk, dtype):
    q = randn(rng, 2, 6, 11, 40)
    k, v = randn(rng, Nk, Hkv, 21, 40), randn(rng, Nk, Hkv, 21, 24)
    check(cuda, F.attention(leaf(q, dtype), leaf(k, dtype), leaf(v, dtype), scale=0.3), path)


@pytest.mark.parametrize("mdtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("mshape", [(1, 37), (20, 37), (3, 13, 37), (2, 1, 13, 37), (2, 3, 1, 37)])
def test_mask_broadcast(cuda, rng, path, mshape, mdtype):
    """per-key mask [Lk, 1], padded rows [Lk, Lq+7], per head, per batch, both; -inf keys."""
    q, k, v = randn(rng, 2, 3, 13, 40), randn(rng, 2, 3, 37, 40), randn(rng, 2, 3, 37, 40)
    m = randn(rng, *mshape)
    m[..., 5] = -np.inf
    check(cuda, F.attention(leaf(q), leaf(k), leaf(v), leaf(m, mdtype)), path)


def test_fully_masked_rows_give_zeros(cuda, rng, path):
    q, k, v = randn(rng, 2, 3, 13, 40), randn(rng, 2, 3, 37, 40), randn(rng, 2, 3, 37, 40)
    m = randn(rng, 13, 37)
    m[:, 30:] = -np.inf   # padded keys
    m[4, :20] = -np.inf
    m[6] = -np.inf        # fully masked row
    got, _ = check(cuda, F.attention(leaf(q), leaf(k), leaf(v), leaf(m)), path)
    assert np.all(got[:, :, 6] == 0)


def test_leading_key_tiles_fully_masked(cuda, rng, path):
    """Rows whose first key tiles are all -inf: the running max starts from -inf and the first
    finite tile rescales from nothing (alpha = 0), across several 64-key tiles."""
    q, k, v = randn(rng, 1, 2, 70, 64), randn(rng, 1, 2, 300, 64), randn(rng, 1, 2, 300, 64)
    m = randn(rng, 70, 300)
    m[:, :150] = -np.inf
    m[3] = -np.inf
    m[5, 160:] = -np.inf
    got, _ = check(cuda, F.attention(leaf(q), leaf(k), leaf(v), leaf(m, "F16")), path)
    assert np.all(got[:, :, 3] == 0)


def test_causal_mask_clip_like(cuda, rng, path):
    """CLIP's text encoder: 77 tokens, causal mask, 12 heads of 64."""
    q, k, v = (randn(rng, 2, 12, 77, 64) for _ in range(3))
    m = np.triu(np.full((77, 77), -np.inf, np.float32), 1)
    check(cuda, F.attention(leaf(q), leaf(k), leaf(v), leaf(m)), path)


# ---- strided views ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_permuted_views_as_sdcpp_holds_them(cuda, rng, path, dtype):
    """q/k/v as [N, L, H, D] (ne [D, H, L, N]) permuted to [D, L, H, N]: rows of a head are
    H*D elements apart."""
    N, L, H, D = 2, 29, 4, 40
    tq, tk, tv = (Tensor.from_numpy(f32_to_raw(randn(rng, N, L, H, D), dtype), dtype=dtype).permute(0, 2, 1, 3)
                  for _ in range(3))
    assert tq.ne == (D, L, H, N) and not tq.is_contiguous()
    check(cuda, F.attention(tq, tk, tv), path)


def test_transposed_and_sliced_views(cuda, rng, path):
    """ne[0] not contiguous (nb0 != element size), and a view at a nonzero offset."""
    tq = leaf(randn(rng, 1, 2, 17, 24), "F16", noncontig=True)
    tk = leaf(randn(rng, 1, 2, 30, 24), "BF16", noncontig=True)
    assert tq.nb[0] != 2
    vfull = Tensor.from_numpy(randn(rng, 1, 2, 40, 16))
    tv = vfull.slice(1, 5, 35).slice(0, 4, 12)   # ne [8, 30, 2, 1] at a nonzero offset
    assert tv.ne == (8, 30, 2, 1) and tv.offset > 0
    check(cuda, F.attention(tq, tk, tv), path)


# ---- path selection and plumbing ---------------------------------------------------------------
def test_precision_f32_param_takes_the_f32_path(cuda, rng):
    q, k, v = randn(rng, 1, 2, 33, 40), randn(rng, 1, 2, 77, 40), randn(rng, 1, 2, 77, 40)
    node = make_node("attention", (leaf(q), leaf(k), leaf(v)), scale=0.2, precision="F32")
    assert GA.plan(node) == ("gemm", "F32")
    check(cuda, node, "gemm32")


@pytest.mark.parametrize("D", [256, 512])
def test_head_dims_beyond_flash_use_gemm(cuda, rng, D):
    """The VAE mid-block: one head of 512 (default plan: cuBLAS F16 path)."""
    q, k, v = randn(rng, 1, 1, 300, D), randn(rng, 1, 1, 300, D), randn(rng, 1, 1, 300, D)
    node = F.attention(leaf(q), leaf(k), leaf(v))
    assert GA.plan(node) == ("gemm", "F16")
    check(cuda, node, "gemm16")


def _check_full_and_padded(cuda, rng, dp, path, Lq, dtype="F32"):
    """The kernel of padded head dim dp at its full width and padded (D = dp - 8, where that
    still maps to dp): 200 keys with the last 10 masked out (a ragged, partly masked key tile)."""
    for D in (dp, dp - 8):
        if GA.flash_dim(D, D) != dp:
            continue
        q, k, v = randn(rng, 1, 2, Lq, D), randn(rng, 1, 2, 200, D), randn(rng, 1, 2, 200, D)
        m = randn(rng, 1, 200)
        m[0, 190:] = -np.inf
        check(cuda, F.attention(leaf(q, dtype), leaf(k, dtype), leaf(v, dtype), leaf(m)), path)


@pytest.mark.parametrize("dp,rf", sorted({(d, 1) for d in GA.FLASH_DIMS} | {(d, 2) for d in GA.FLASH_RF2_DIMS}))
def test_every_wmma_variant(cuda, rng, monkeypatch, dp, rf):
    """Each compiled kernel attn_flash_d<dp>_r<rf>, at its full width and padded (D = dp - 8)."""
    monkeypatch.setattr(GA, "FORCE_PATH", "wmma")
    monkeypatch.setitem(GA.FLASH_RF, dp, rf)
    _check_full_and_padded(cuda, rng, dp, "wmma", Lq=150)


@pytest.mark.parametrize("dtype", ["F32", "F16"])
@pytest.mark.parametrize("dp,rf,nw", sorted(GA.MMA_KERNELS))
def test_every_mma_variant(cuda, rng, monkeypatch, dp, rf, nw, dtype):
    """Each compiled kernel attn_mma_d<dp>_r<rf>_w<nw>, at its full width and padded (D = dp - 8),
    on packed (F32) and in-place (F16) inputs; queries beyond one block, a ragged key tile."""
    if cuda.rt.device.capability < (8, 0):
        pytest.skip("mma kernels need sm_80")
    monkeypatch.setattr(GA, "FORCE_PATH", "flash")
    monkeypatch.setattr(GA, "USE_WGMMA", False)
    monkeypatch.setitem(GA.MMA_VARIANT, dp, (rf, nw))
    _check_full_and_padded(cuda, rng, dp, "flash", Lq=300, dtype=dtype)


def _on_sm90(cuda, monkeypatch, dp, nwg, bk, pipe):
    if tuple(cuda.rt.device.capability) != (9, 0):
        pytest.skip("wgmma kernels run on sm_90 only")
    monkeypatch.setattr(GA, "FORCE_PATH", "flash")
    monkeypatch.setitem(GA.WGMMA_VARIANT, dp, (nwg, bk, pipe))


@pytest.mark.parametrize("dtype", ["F32", "F16"])
@pytest.mark.parametrize("dp,nwg,bk,pipe", sorted(GA.WGMMA_KERNELS))
def test_every_wgmma_variant(cuda, rng, monkeypatch, dp, nwg, bk, pipe, dtype):
    """Each compiled kernel attn_wgmma_d<dp>_g<nwg>_k<bk>_p<pipe> (sm_90), as test_every_mma_variant."""
    _on_sm90(cuda, monkeypatch, dp, nwg, bk, pipe)
    _check_full_and_padded(cuda, rng, dp, "flash", Lq=300, dtype=dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_wgmma_long_gqa_broadcast_mask(cuda, rng, monkeypatch, D):
    """A wgmma kernel (the default for D=128) over many key tiles (1000 keys, a ragged last one), two query
    heads per K/V head, one K/V batch for two query batches, a [Lq, Lk] mask per head."""
    _on_sm90(cuda, monkeypatch, D, *GA.WGMMA_VARIANT.get(D, (2, 128, 1)))
    q, k, v = randn(rng, 2, 4, 333, D), randn(rng, 1, 2, 1000, D), randn(rng, 1, 2, 1000, D)
    m = randn(rng, 4, 333, 1000)
    m[:, 5] = -np.inf                        # a fully masked row gives zeros
    got, _ = check(cuda, F.attention(leaf(q, "F16"), leaf(k, "F16"), leaf(v, "F16"), leaf(m, "F16")), "flash")
    assert np.all(got[:, :, 5, :] == 0)


def test_gemm_path_query_chunks(cuda, rng, monkeypatch, path):
    """The gemm path walks queries in chunks bounded by SCORE_BYTES (ragged last chunk)."""
    if path in ("flash", "wmma"):
        pytest.skip("gemm paths only")
    monkeypatch.setattr(GA, "SCORE_BYTES", 2 * 3 * 37 * 6 * 5)   # ~5 query rows per chunk
    q, k, v = randn(rng, 2, 3, 13, 40), randn(rng, 2, 3, 37, 40), randn(rng, 2, 3, 37, 40)
    m = randn(rng, 13, 37)
    m[6] = -np.inf
    got, _ = check(cuda, F.attention(leaf(q), leaf(k), leaf(v), leaf(m, "F16")), path)
    assert np.all(got[:, :, 6] == 0)


@pytest.mark.parametrize("flash", ["flash", "wmma"])
@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_grid_smaller_than_heads_and_batches(cuda, rng, monkeypatch, flash, dtype):
    """Blocks loop over heads/batches beyond gridDim.y/z (the 65535 limit, here forced to 2)."""
    monkeypatch.setattr(GA, "FORCE_PATH", flash)
    monkeypatch.setattr(GA, "_MAX_GRID_YZ", 2)
    q, k, v = randn(rng, 3, 5, 20, 40), randn(rng, 3, 1, 30, 40), randn(rng, 3, 1, 30, 40)
    check(cuda, F.attention(leaf(q, dtype), leaf(k, dtype), leaf(v, dtype), leaf(randn(rng, 5, 20, 30))), flash)


def test_replays_with_new_inputs(cuda, rng, path):
    """The same graph three times with refilled inputs (the backend captures the second run into
    a CUDA graph and replays it: the kernel function must only enqueue work)."""
    qa, ka, va = randn(rng, 1, 4, 64, 40), randn(rng, 1, 4, 77, 40), randn(rng, 1, 4, 77, 40)
    tq, tk, tv = (Tensor.from_numpy(a) for a in (qa, ka, va))
    g = Graph(F.attention(tq, tk, tv))
    for step in range(3):
        qa[...] = randn(rng, *qa.shape)
        va[...] = randn(rng, *va.shape)
        got = raw_to_f32(np.array(g.run(cuda)["out"].numpy(), copy=True), "F32")
        ref = run_f32("cpu", F.attention(Tensor.from_numpy(qa.copy()), Tensor.from_numpy(ka.copy()),
                                         Tensor.from_numpy(va.copy())))
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        assert err <= TOL[path], f"run {step}: error {err:.2e}"


# ---- no GPU needed: tables vs the .cu and the fatbin ------------------------------------------
def _compiled_variants() -> set:
    src = (KERNELS / "attention.cu").read_text()
    return {(int(d), int(r)) for d, r in re.findall(r"^FLASH_KERNEL\((\d+), (\d+)\)", src, re.MULTILINE)}


def _compiled_mma_stages() -> dict:
    """{(dp, rf, nw): stages} of the MMA_KERNEL lines."""
    src = (KERNELS / "attention.cu").read_text()
    found = re.findall(r"^MMA_KERNEL\((\d+), (\d+), (\d+), (\d+)\)", src, re.MULTILINE)
    return {tuple(map(int, m[:3])): int(m[3]) for m in found}


def _compiled_mma() -> set:
    return set(_compiled_mma_stages())


def _compiled_wgmma() -> dict:
    """{(dp, warpgroups, keys per tile, pipelined): stages} of attention_sm90.cu's WGMMA_KERNEL lines."""
    src = (KERNELS / "attention_sm90.cu").read_text()
    found = re.findall(r"^WGMMA_KERNEL\((\d+), (\d+), (\d+), (\d+), (\d)\)", src, re.MULTILINE)
    return {(*map(int, m[:3]), int(m[4])): int(m[3]) for m in found}


def test_flash_tables_match_the_source():
    compiled = _compiled_variants()
    assert {(d, 1) for d in GA.FLASH_DIMS} | {(d, 2) for d in GA.FLASH_RF2_DIMS} == compiled
    assert set(GA.FLASH_RF) == set(GA.FLASH_DIMS)
    assert all((d, r) in compiled for d, r in GA.FLASH_RF.items())
    assert _compiled_mma() == GA.MMA_KERNELS
    assert set(GA.MMA_VARIANT) == set(GA.FLASH_DIMS)
    assert all((d, *rw) in GA.MMA_KERNELS for d, rw in GA.MMA_VARIANT.items())
    # the Python side sizes the shared memory from MMA_STAGES: it must be what was compiled
    assert all(GA.MMA_STAGES[d] == st for (d, _, _), st in _compiled_mma_stages().items())
    assert _compiled_wgmma() == GA.WGMMA_KERNELS
    assert all((d, *v) in GA.WGMMA_KERNELS for d, v in GA.WGMMA_VARIANT.items())


def test_fatbin_has_every_kernel():
    fat = KERNELS / "attention.fatbin"
    if not fat.exists():
        pytest.skip("attention.fatbin not built")
    data = fat.read_bytes()
    names = [f"attn_flash_d{d}_r{r}" for d, r in _compiled_variants()]
    names += [f"attn_mma_d{d}_r{r}_w{w}" for d, r, w in _compiled_mma()]
    names += [f"attn_pack_{a}" for a in ("f32", "f16", "bf16")]
    names += [f"attn_stage_{a}_{b}" for a in ("f32", "f16", "bf16") for b in ("f16", "f32")]
    names += ["attn_softmax_f16", "attn_softmax_f32"]
    missing = [n for n in names if n.encode() not in data]
    assert not missing, f"not in attention.fatbin: {missing}"
    data = (KERNELS / "attention_sm90.fatbin").read_bytes()
    names = [f"attn_wgmma_d{d}_g{g}_k{k}_p{p}" for d, g, k, p in _compiled_wgmma()]
    missing = [n for n in names if n.encode() not in data]
    assert not missing, f"not in attention_sm90.fatbin: {missing}"


@pytest.mark.parametrize("D,Dv,want", [(40, 40, ("flash", 48)), (64, 64, ("flash", 64)), (80, 80, ("flash", 80)),
                                       (128, 128, ("flash", 128)), (160, 160, ("flash", 160)),
                                       (112, 100, ("flash", 128)), (8, 24, ("flash", 32)),
                                       (161, 161, ("gemm", "F16")), (512, 512, ("gemm", "F16"))])
def test_plan_for_model_head_dims(D, Dv, want):
    q, k, v = (Tensor.from_numpy(np.zeros(s, np.float32)) for s in ((1, 2, 5, D), (1, 2, 7, D), (1, 2, 7, Dv)))
    assert GA.plan(F.attention(q, k, v))[:2] == want
    node = make_node("attention", (q, k, v), scale=0.1, precision="F32")
    assert GA.plan(node) == ("gemm", "F32")
