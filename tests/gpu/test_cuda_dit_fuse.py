"""The DiT fusions and the BF16/F16 storage of element-wise results (sdrt/gpu/cuda/fuse.py) on a
GPU: every new kernel variant through a graph that uses it, against the CPU backend and against
the same graph unfused (cuda.fuse False, as SDRT_CUDA_FUSE=0) or stored F32 (cuda.store_half
False, as SDRT_CUDA_HALF=0); a small Flux double + single block graph end to end. Which nodes
fuse and which are stored in which dtype is tested without a GPU in tests/test_cuda_fuse.py."""
import numpy as np
import pytest
from opcheck import leaf

from sdrt.ops import api as F
from sdrt.ops.graph import Graph

from ._helpers import assert_within_scale, quant_tensor, randn


def run3(backend, graph_out):
    """Three runs (eager, captured, replayed) of one graph on `backend`: every output, float32."""
    g = Graph(graph_out)
    outs = []
    for _ in range(3):
        r = g.run(backend)
        outs.append({k: np.array(v.numpy(), copy=True).astype(np.float32) for k, v in r.items()})
    return g, outs


def on_off(cuda, monkeypatch, out, switch):
    """(graph, runs with `switch` on, runs with it off): switch "fuse" or "store_half" (read when
    a graph first runs, so each side runs a Graph of its own)."""
    g, on = run3(cuda, out)
    was = getattr(cuda, switch)
    monkeypatch.setattr(cuda, switch, False)
    _, off = run3(cuda, out)
    monkeypatch.setattr(cuda, switch, was)
    return g, on, off


def kernel_names(cuda, g):
    return [fn.__name__ for seg in cuda._states[g].kernels for fn, _ in seg]


def cpu(out):
    return {k: v.numpy().astype(np.float32) for k, v in Graph(out).run("cpu").items()}


def assert_fused_exact(cuda, monkeypatch, out, kernel, tol, what):
    """`kernel` fires in out's graph, bit for bit the unfused kernels, within tol of the CPU."""
    want = cpu(out)["out"]
    g, on, off = on_off(cuda, monkeypatch, out, "fuse")
    assert kernel in kernel_names(cuda, g)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a["out"], b["out"])
        assert_within_scale(a["out"], want, tol, what)


def assert_stored_as_packed(cuda, monkeypatch, out, dtype, kernel, what):
    """`kernel` writes `dtype` for the GEMM of `out`: the product as with the F32 result packed."""
    g, on, off = on_off(cuda, monkeypatch, out, "store_half")
    assert set(cuda._states[g].half.values()) == {dtype} and kernel in kernel_names(cuda, g)
    for a, b in zip(on, off):
        assert_within_scale(a["out"], b["out"], 1e-6, what)


# ---- element-wise producers writing the GEMM's dtype ------------------------------------------
@pytest.mark.parametrize("wdt", ["BF16", "F16"])
@pytest.mark.parametrize("producer", ["gelu", "add", "layer_norm", "concat_rows", "cont", "group_norm", "geglu",
                                      "attention_cont"])
def test_producer_stored_gives_the_packed_bits(cuda, rng, monkeypatch, wdt, producer):
    """A producer writing F16/BF16 for the GEMM (its _to_ kernel) gives the bits the GEMM's own
    pack gave: the product agrees with the F32-stored run to the GEMM's run-to-run level."""
    x = leaf(randn(rng, 2, 40, 96))
    if producer == "gelu":
        h = F.gelu(x, approximate="tanh")                           # unary_gelu_tanh_f32_to_*
    elif producer == "add":
        h = F.add(x, leaf(randn(rng, 1, 1, 96)))                    # binary_add_f32_f32_to_*
    elif producer == "layer_norm":
        h = F.layer_norm(x, 1e-6)                                   # layer_norm_f32_to_*
    elif producer == "concat_rows":                                 # cast4d_f32_* (parts not runs)
        h = F.concat(x, F.silu(leaf(randn(rng, 2, 40, 32))), 0)
    elif producer == "cont":
        h = F.cont(F.silu(x).permute(0, 2, 1, 3))
    elif producer == "group_norm":                                  # group_norm_apply_f32_to_*
        g4 = F.group_norm_affine(leaf(randn(rng, 2, 32, 6, 16)), leaf(randn(rng, 32)), leaf(randn(rng, 32)), 8, 1e-5)
        h = g4.reshape(16 * 6, 32, 2)                               # the GEMM reads its planes as rows
    elif producer == "attention_cont":                              # the flash kernel's BF16/F16 store
        q = leaf(randn(rng, 2, 3, 40, 32), "F16")                   # ne [32, 40, 3, 2]
        h = F.cont(F.attention(q, q, q).permute(0, 2, 1, 3)).reshape(96, 40, 2)
    else:                                                           # geglu_f32_to_*
        h = F.geglu(leaf(randn(rng, 2, 40, 192)), "tanh")
    w = leaf(randn(rng, 64, h.ne[0]) / np.sqrt(h.ne[0]), wdt)
    out = F.mul_mat(w, h)
    g, on, off = on_off(cuda, monkeypatch, out, "store_half")
    st = cuda._states[g].half
    assert st and set(st.values()) == {wdt}, f"{producer}: nothing stored as {wdt}"
    for a, b in zip(on, off):
        assert_within_scale(a["out"], b["out"], 1e-6, f"{producer} stored {wdt} vs packed")


@pytest.mark.parametrize("wdt", ["BF16", "F16"])
def test_geglu_reads_the_products_dtype(cuda, rng, monkeypatch, wdt):
    # ff.net.0 stored in the weights' dtype, the geglu (read in F32) from it: geglu_bf16_to_f32 /
    # geglu_f16_to_f32; one extra rounding, as PyTorch's half-precision feed-forward
    x = leaf(randn(rng, 2, 50, 64))
    y = F.linear(x, leaf(randn(rng, 256, 64) / 8, wdt), leaf(randn(rng, 256) * 0.1, wdt))
    out = F.silu(F.geglu(y, "tanh"))
    want = cpu(out)["out"]
    g, on, off = on_off(cuda, monkeypatch, out, "store_half")
    assert set(cuda._states[g].half.values()) == {wdt}
    for a, b in zip(on, off):
        assert_within_scale(a["out"], want, 2e-2 if wdt == "BF16" else 3e-3, "geglu from half product vs cpu")
        assert_within_scale(a["out"], b["out"], 2e-2 if wdt == "BF16" else 3e-3, "stored vs F32")


@pytest.mark.parametrize("op", ["rope", "rope_ext"])
def test_rope_stored_f16_for_the_attention(cuda, rng, monkeypatch, op):
    D, H, L = 64, 4, 96
    q = leaf(randn(rng, 1, L, H, D))                                # ne [D, H, L, 1]
    if op == "rope":
        from sdrt.models.diffusion.flux import flux_ids, flux_pe
        pe = leaf(flux_pe(flux_ids(16, 24, 0), (16, 24, 24)))
        r = F.rope(q, pe)                                           # rope_pe_f32_to_f16
    else:
        r = F.rope_ext(q, np.arange(L, dtype=np.int32), n_dims=D, mode="neox")   # rope_rotate_f32_to_f16
    a = r.reshape(D, L, H, 1) if op == "rope" else r.permute(0, 2, 1, 3)
    out = F.silu(F.attention(a, a, a))
    want = cpu(out)["out"]
    g, on, off = on_off(cuda, monkeypatch, out, "store_half")
    assert cuda._states[g].half and set(cuda._states[g].half.values()) == {"F16"}
    for x, y in zip(on, off):
        assert_within_scale(x["out"], want, 3e-3, f"{op} stored F16 vs cpu")
        assert_within_scale(x["out"], y["out"], 2e-3, f"{op} stored F16 vs F32")


# ---- the fused DiT chains --------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("vdt", ["F32", "BF16"])
def test_modulation_fused_exact(cuda, rng, monkeypatch, n, vdt):
    """layer_norm -> mul(., 1 + scale) -> add(., shift), [C, 1, N] vectors (views of one
    modulation output, as Flux's chunks): layer_norm_modulated, bit for bit the unfused kernels."""
    from sdrt.models.diffusion.flux_blocks import chunks, modulate
    C = 320
    x = leaf(randn(rng, n, 77, C) * 3 + 1)
    mod = chunks(F.silu(leaf(randn(rng, n, 2 * C), vdt)), 2) if vdt == "F32" else \
        chunks(leaf(randn(rng, n, 2 * C), vdt), 2)
    out = F.silu(modulate(F.layer_norm(x, 1e-6), mod[0], mod[1]))
    assert_fused_exact(cuda, monkeypatch, out, "layer_norm_modulated", 1e-5, "modulation vs cpu")


@pytest.mark.parametrize("wdt", ["BF16", "F16"])
def test_modulation_stored_for_the_gemm(cuda, rng, monkeypatch, wdt):
    from sdrt.models.diffusion.flux_blocks import chunks, modulate
    C = 256
    x = leaf(randn(rng, 2, 100, C))
    mod = chunks(leaf(randn(rng, 2, 2 * C)), 2)
    w = leaf(randn(rng, 128, C) / 16, wdt)
    out = F.mul_mat(w, modulate(F.layer_norm(x, 1e-6), mod[0], mod[1]))     # layer_norm_mod_f32_to_*
    assert_stored_as_packed(cuda, monkeypatch, out, wdt, "layer_norm_modulated", "modulation stored vs packed")


@pytest.mark.parametrize("wdt", ["F32", "BF16"])
def test_rms_norm_scaled_exact(cuda, rng, monkeypatch, wdt):
    """rms_norm(q) * scale over a strided q view (Flux's QK norm): one rms kernel with the scale
    as its weight, bit for bit the unfused pair."""
    t = leaf(randn(rng, 2, 90, 3 * 128))                            # [3C, L, N], C = 2 heads x 64
    q = t.view((64, 2, 90, 2), (4, 4 * 64, t.nb[1], t.nb[2]))
    out = F.silu(F.mul(F.rms_norm(q, 1e-6), leaf(randn(rng, 64), wdt)))
    assert_fused_exact(cuda, monkeypatch, out, "rms_norm_scaled", 1e-5, "rms_norm_scaled vs cpu")


def test_rms_norm_scaled_stored_for_the_join(cuda, rng, monkeypatch):
    """SD3.5's QK norms: rms_norm(q) * w per stream, joined for the attention: the fused rms kernel
    writes the join's F16 (rms_norm_f32_to_f16). Against the run stored F32, within the attention's
    F16 level: with F32 q/k/v the attention takes its F32-view path, which rounds P in another
    order (the H200 showed 2e-3 of the scale), so the join's bits are not compared through it."""
    D, H = 64, 2
    qs = [F.mul(F.rms_norm(leaf(randn(rng, 1, L, H, D)), 1e-6), leaf(randn(rng, D))) for L in (30, 50)]
    a = F.concat(*qs, 2).permute(0, 2, 1, 3)                       # [D, L, H, 1] view of the join
    out = F.silu(F.attention(a, a, a))
    want = cpu(out)["out"]
    g, on, off = on_off(cuda, monkeypatch, out, "store_half")
    assert list(cuda._states[g].half.values()).count("F16") == 3 and "rms_norm_scaled" in kernel_names(cuda, g)
    for x, y in zip(on, off):
        assert_within_scale(x["out"], y["out"], 3e-3, "rms stored F16 vs F32")
        assert_within_scale(x["out"], want, 3e-3, "rms stored F16 vs cpu")


@pytest.mark.parametrize("D", [32, 64, 128, 256])
@pytest.mark.parametrize("wdt", ["F32", "BF16"])
def test_rms_norm_rope_fused(cuda, rng, monkeypatch, D, wdt):
    """rope(rms_norm(q) * scale, pe) over strided q views of one qkv projection, two streams roped
    with their slices of pe and joined (flux_blocks.roped, as Flux's and Qwen-Image's joint
    attention): one rms_norm_rope per stream, against the unfused kernels and the CPU, with the
    rope output stored F16 for the attention and kept F32."""
    from sdrt.models.diffusion.flux import flux_ids, flux_pe
    from sdrt.models.diffusion.flux_blocks import roped
    H, N, lens = 3, 2, (20, 70)
    axes = (D // 4, 3 * D // 8, 3 * D // 8)
    pe = leaf(flux_pe(flux_ids(14, 20, lens[0]), axes))               # 20 + 7 * 10 tokens
    qs = []
    for L in lens:
        t = leaf(randn(rng, N, L, 3 * H * D) * 2)
        q = t.view((D, H, L, N), (4, 4 * D, t.nb[1], t.nb[2]), offset=4 * H * D)   # the k third
        qs.append(F.mul(F.rms_norm(q, 1e-6), leaf(randn(rng, D), wdt)))
    r = roped(qs, pe).reshape(D, sum(lens), H, N)
    for out in (F.silu(r), F.silu(F.attention(r, r, r))):
        want = cpu(out)["out"]
        g, on, off = on_off(cuda, monkeypatch, out, "fuse")
        assert kernel_names(cuda, g).count("rms_norm_rope") == 2
        for a, b in zip(on, off):
            assert_within_scale(a["out"], b["out"], 3e-3 if out.src[0].op == "attention" else 1e-6, "fused vs not")
            assert_within_scale(a["out"], want, 3e-3, "rms_norm_rope vs cpu")


@pytest.mark.parametrize("n", [1, 2])
def test_rms_modulation_fused_exact(cuda, rng, monkeypatch, n):
    """Z-Image's adaLN rms_norm(x) * w * (1 + scale), scale a [C, 1, N] view: rms_norm_modulated,
    bit for bit the three kernels (F32 out); read by a BF16 GEMM it is stored BF16."""
    from sdrt.models.diffusion.flux_blocks import chunks
    C = 320
    x = leaf(randn(rng, n, 77, C) * 3 + 1)
    s = F.scale(chunks(F.silu(leaf(randn(rng, n, 2 * C))), 2)[1], 1.0, 1.0)
    h = F.mul(F.mul(F.rms_norm(x, 1e-6), leaf(randn(rng, C))), s)
    assert_fused_exact(cuda, monkeypatch, F.silu(h), "rms_norm_modulated", 1e-5, "rms modulation vs cpu")
    gemm = F.mul_mat(leaf(randn(rng, 64, C) / 16, "BF16"), h)
    assert_stored_as_packed(cuda, monkeypatch, gemm, "BF16", "rms_norm_modulated", "rms modulation stored vs packed")


@pytest.mark.parametrize("wdt", ["F32", "BF16"])
def test_silu_mul_fused_exact(cuda, rng, monkeypatch, wdt):
    """w2(silu(w1 x) * w3 x), Z-Image's and the Qwen LLMs' feed-forward: silu_mul in the mul's
    slot, bit for bit the silu and mul kernels (the same GEMMs around it)."""
    x = leaf(randn(rng, 2, 70, 64))
    w1, w3 = (leaf(randn(rng, 176, 64) / 8, wdt) for _ in range(2))
    out = F.mul_mat(leaf(randn(rng, 64, 176) / 13, wdt), F.mul(F.silu(F.mul_mat(w1, x)), F.mul_mat(w3, x)))
    assert_fused_exact(cuda, monkeypatch, out, "silu_mul", 2e-2 if wdt == "BF16" else 1e-5, "silu_mul vs cpu")


@pytest.mark.parametrize("D", [64, 128])
def test_rms_norm_rope_staged(cuda, rng, monkeypatch, D):
    """Qwen-Image's form: q = rms_norm(reshape(to_q(x))) * w, the projection dead after the norm,
    so the planner may give its buffer to the rope's output: rms_norm_rope through scratch there
    (which of the two the planner overlaps is its choice; one of them is)."""
    from sdrt.models.diffusion.flux import flux_ids, flux_pe
    from sdrt.models.diffusion.flux_blocks import roped
    H, N, lens = 3, 1, (20, 70)
    pe = leaf(flux_pe(flux_ids(14, 20, lens[0]), (D // 4, 3 * D // 8, 3 * D // 8)))
    qs = []
    for L in lens:
        t = F.mul_mat(leaf(randn(rng, H * D, 48) / 7), leaf(randn(rng, N, L, 48)))
        qs.append(F.mul(F.rms_norm(t.reshape(D, H, L, N), 1e-6), leaf(randn(rng, D))))
    r = roped(qs, pe).reshape(D, sum(lens), H, N)
    out = F.silu(F.attention(r, r, r))
    want = cpu(out)["out"]
    g, on, off = on_off(cuda, monkeypatch, out, "fuse")
    names = kernel_names(cuda, g)
    assert names.count("rms_norm_rope_staged") >= 1
    assert names.count("rms_norm_rope_staged") + names.count("rms_norm_rope") == 2
    for a, b in zip(on, off):
        assert_within_scale(a["out"], b["out"], 3e-3, "staged vs unfused")
        assert_within_scale(a["out"], want, 3e-3, "staged vs cpu")


@pytest.mark.parametrize("n", [1, 2])
def test_gated_residual_fused_exact(cuda, rng, monkeypatch, n):
    C = 192
    x = leaf(randn(rng, n, 50, C))
    y = F.linear(F.silu(x), leaf(randn(rng, C, C) / 14, "BF16"), leaf(randn(rng, C), "BF16"))
    gate = leaf(randn(rng, n, 1, C))
    out = F.silu(F.add(x, F.mul(y, gate)))
    g, on, off = on_off(cuda, monkeypatch, out, "fuse")
    assert "gated_add" in kernel_names(cuda, g)
    want = cpu(out)["out"]
    for a, b in zip(on, off):
        # the unfused run has the bias as a separate add (F32), the fused one in the epilogue:
        # equal to the GEMM's rounding; the gated add itself is exact (test below)
        assert_within_scale(a["out"], b["out"], 1e-5, "gated residual fused vs unfused")
        assert_within_scale(a["out"], want, 2e-2, "gated residual vs cpu")
    # with a plain F32 y (no GEMM), bit for bit (gelu: a silu there would be fused with the mul first)
    y2 = F.gelu(leaf(randn(rng, n, 50, C)))
    out2 = F.silu(F.add(F.mul(gate, y2), x))
    g, on, off = on_off(cuda, monkeypatch, out2, "fuse")
    assert "gated_add" in kernel_names(cuda, g)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a["out"], b["out"])


@pytest.fixture
def gelu_spy(monkeypatch):
    """Records each GELU-bias epilogue attempt: True when cuBLASLt ran it, False for the fallback."""
    import sdrt.gpu.cuda.ops.matmul as G
    calls = []
    real = G._gemm_with_bias

    def record(*a, **k):
        r = real(*a, **k)
        if k.get("gelu"):
            calls.append(r)
        return r
    monkeypatch.setattr(G, "_gemm_with_bias", record)
    return calls


@pytest.mark.parametrize("wdt,tol", [("BF16", 2e-2), ("F16", 3e-3)])
@pytest.mark.parametrize("shape", [(1, 24, 64), (2, 1024, 256)])
def test_fc1_gelu_epilogue(cuda, rng, monkeypatch, gelu_spy, wdt, tol, shape):
    """fc1 + bias + gelu(tanh) as cuBLASLt's GELU-bias epilogue, into fc2: vs the CPU and vs the
    unfused bias GEMM + gelu kernel (cuBLASLt's GELU may differ from ours in the last F32 bits)."""
    n, l, c = shape
    x = leaf(randn(rng, n, l, c))
    h = F.gelu(F.linear(x, leaf(randn(rng, 4 * c, c) / np.sqrt(c), wdt), leaf(randn(rng, 4 * c) * 0.1, wdt)),
               approximate="tanh")
    out = F.linear(h, leaf(randn(rng, c, 4 * c) / np.sqrt(4 * c), wdt), leaf(randn(rng, c) * 0.1, wdt))
    out = F.silu(out)
    want = cpu(out)["out"]
    g, on, off = on_off(cuda, monkeypatch, out, "fuse")
    assert "mul_mat_add_bias_gelu" in kernel_names(cuda, g)
    assert gelu_spy and all(gelu_spy), "cuBLASLt refused the GELU-bias epilogue (the fallback ran)"
    for a, b in zip(on, off):
        assert_within_scale(a["out"], want, tol, "fc1+gelu epilogue vs cpu")
        assert_within_scale(a["out"], b["out"], tol, "fc1+gelu epilogue vs unfused")
    # read by a silu, the gelu stays F32: the epilogue writes F32
    h32 = F.gelu(F.linear(x, leaf(randn(rng, 2 * c, c) / np.sqrt(c), wdt), leaf(randn(rng, 2 * c), wdt)),
                 approximate="tanh")
    out32 = F.silu(h32)
    want32 = cpu(out32)["out"]
    g, on, off = on_off(cuda, monkeypatch, out32, "fuse")
    for a, b in zip(on, off):
        assert_within_scale(a["out"], want32, tol, "F32 gelu epilogue vs cpu")
        assert_within_scale(a["out"], b["out"], 1e-5, "F32 gelu epilogue vs unfused")


def test_fc1_gelu_fallback(cuda, rng, gelu_spy):
    # a block weight: no cuBLASLt epilogue; the bias GEMM into scratch, then the gelu kernel
    # writing the stored dtype (F16, the block weight's GEMM dtype)
    x = leaf(randn(rng, 2, 40, 64))
    h = F.gelu(F.linear(x, quant_tensor("Q8_0", 128, 64), leaf(randn(rng, 128))), approximate="tanh")
    out = F.silu(F.mul_mat(quant_tensor("Q8_0", 64, 128, seed=1), h))
    want = cpu(out)["out"]
    g, runs = run3(cuda, out)
    # (the F32 bias is not exact in the F16 output: no epilogue is even attempted)
    assert "mul_mat_add_bias_gelu" in kernel_names(cuda, g) and not any(gelu_spy)
    for a in runs:
        assert_within_scale(a["out"], want, 3e-3, "fc1+gelu fallback vs cpu")


# ---- a whole Flux double + single block ------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [("BF16", 3e-2), ("F16", 5e-3)])
@pytest.mark.parametrize("n", [1, 2])
def test_flux_blocks_fused_vs_unfused_and_cpu(cuda, monkeypatch, dtype, tol, n):
    from flux_block_graph import flux_blocks_graph
    g0 = flux_blocks_graph(dtype, n=n)
    want = {k: v.numpy().astype(np.float32) for k, v in g0.run("cpu").items()}
    g = flux_blocks_graph(dtype, n=n)
    on = [{k: np.array(v.numpy(), copy=True).astype(np.float32) for k, v in g.run(cuda).items()} for _ in range(3)]
    names = kernel_names(cuda, g)
    for k in ("layer_norm_modulated", "gated_add", "mul_mat_add_bias_gelu", "rms_norm_rope"):
        assert k in names, k
    assert "BF16" in cuda._states[g].half.values() if dtype == "BF16" else \
        set(cuda._states[g].half.values()) == {"F16"}
    monkeypatch.setattr(cuda, "fuse", False)
    g_off = flux_blocks_graph(dtype, n=n)           # the same values, a graph of its own (unfused state)
    off = [{k: np.array(v.numpy(), copy=True).astype(np.float32) for k, v in g_off.run(cuda).items()}
           for _ in range(3)]
    assert "layer_norm_modulated" not in kernel_names(cuda, g_off)
    for a, b in zip(on, off):
        for k in ("x", "img"):
            assert_within_scale(a[k], want[k], tol, f"flux {dtype} fused vs cpu ({k})")
            assert_within_scale(b[k], want[k], tol, f"flux {dtype} unfused vs cpu ({k})")
            assert_within_scale(a[k], b[k], tol, f"flux {dtype} fused vs unfused ({k})")
