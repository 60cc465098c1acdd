"""The CUDA backend's fusion pass (sdrt/gpu/cuda/fuse.py) on planned graphs, without a GPU: which
linear-layer bias adds become one bias-epilogue GEMM, and which must stay separate; which F32
results are stored as F16. The kernels' numbers are checked against the CPU on a GPU
(tests/gpu/test_cuda_fuse.py)."""
import os
from collections import Counter

import numpy as np
import pytest
from opcheck import leaf

from sdrt.gpu.cuda import fuse
from sdrt.gpu.cuda import ops as cuda_ops
from sdrt.gpu.device_backend import import_families, node_addresses
from sdrt.gpu.cuda.table import CUDA
from sdrt.ops import api as F
from sdrt.ops.graph import Graph
from sdrt.ops.registry import make_node


def own(node, xs, out, rt):
    """Stands for a node's own kernel."""


def _addresses(plan):
    """Node addresses laid out as the backend lays them out (outputs apart, arena from 0)."""
    return node_addresses(plan, 0, 1 << 36, [(1 << 40) + i * (1 << 30) for i in range(len(plan.outputs))])


def launches(graph, real=False):
    """fuse.launch_lists over the graph's plan, with stand-in kernels or (real) the CUDA backend's."""
    plan = graph.plan()
    if real:
        import_families(cuda_ops)
    kernels = [[CUDA.find(n).fn if real else own for n in seg.nodes] for seg in plan.segments]
    lists = fuse.launch_lists(graph, plan, kernels, _addresses(plan))
    return [(n, fn, srcs) for seg, lst in zip(plan.segments, lists) for n, (fn, srcs) in zip(seg.nodes, lst)]


def half(graph):
    """The nodes fuse.half_nodes stores as F16, with the CUDA backend's own kernels."""
    import_families(cuda_ops)
    plan = graph.plan()
    ptr = _addresses(plan)
    kernels = [[CUDA.find(n).fn for n in seg.nodes] for seg in plan.segments]
    ids = fuse.half_nodes(graph, plan, fuse.launch_lists(graph, plan, kernels, ptr), ptr)
    return [n for n in graph.nodes if id(n) in ids]


def stored(graph):
    """{id: dtype} of fuse.half_nodes with the CUDA backend's own kernels."""
    import_families(cuda_ops)
    plan = graph.plan()
    ptr = _addresses(plan)
    kernels = [[CUDA.find(n).fn for n in seg.nodes] for seg in plan.segments]
    return fuse.half_nodes(graph, plan, fuse.launch_lists(graph, plan, kernels, ptr), ptr)


def fused(graph):
    return [n for n, fn, _ in launches(graph) if fn is fuse.mul_mat_add_bias]


def rand(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_linear_bias_is_fused():
    x = leaf(rand(2, 64, 32))
    w, b = leaf(rand(48, 32), "F16"), leaf(rand(48), "F16")
    y = F.linear(x, w, b)
    out = F.silu(y)
    lst = launches(Graph(out))
    kinds = [(n.op, fn.__name__) for n, fn, _ in lst]
    assert kinds == [("mul_mat", "_skip"), ("add", "mul_mat_add_bias"), ("silu", "own")]
    n, fn, srcs = lst[1]
    assert srcs[0] is w and srcs[1] is x and srcs[2] is b
    assert lst[0][2] == ()


def test_two_linears_in_a_row_both_fused():
    x = leaf(rand(16, 32))
    h = F.linear(x, leaf(rand(64, 32), "F16"), leaf(rand(64)))
    out = F.gelu(F.linear(F.gelu(h), leaf(rand(32, 64), "F16"), leaf(rand(32), "F16")))
    assert len(fused(Graph(out))) == 2


def test_not_fused():
    x = leaf(rand(16, 32))
    w = leaf(rand(48, 32), "F16")
    # the product is also read elsewhere
    y = F.mul_mat(w, x)
    assert fused(Graph(F.mul(F.silu(F.add(y, leaf(rand(48)))), y))) == []
    # the product is a graph output
    y2 = F.mul_mat(w, x)
    assert fused(Graph({"a": y2, "b": F.silu(F.add(y2, leaf(rand(48))))})) == []
    # the add is the graph output: it has its own buffer, not the product's
    assert fused(Graph(F.add(F.mul_mat(w, x), leaf(rand(48))))) == []
    # not a bias: a full-size operand, a per-column vector; the bias as the first operand
    for other in (leaf(rand(16, 48)), leaf(rand(16, 1))):
        assert fused(Graph(F.silu(F.add(F.mul_mat(w, x), other)))) == []
    assert fused(Graph(F.silu(F.add(leaf(rand(48)), F.mul_mat(w, x))))) == []


def test_bias_then_residual_is_one_slot():
    # a transformer block's x = to_out(attn) + x: the residual on either side of the add
    for left in (False, True):
        x = leaf(rand(16, 32))
        h = F.gelu(x)
        y = F.linear(h, leaf(rand(32, 32), "F16"), leaf(rand(32), "F16"))
        out = F.silu(F.add(x, y) if left else F.add(y, x))
        lst = launches(Graph(out))
        kinds = [(n.op, fn.__name__) for n, fn, _ in lst]
        assert kinds[-4:] == [("mul_mat", "_skip"), ("add", "_skip"), ("add", "mul_mat_add_bias_residual"),
                              ("silu", "own")]
        srcs = lst[-2][2]
        assert srcs[2].ne == (32,) and srcs[3] is x


def test_residual_not_fused():
    x = leaf(rand(16, 32))
    y = F.linear(F.gelu(x), leaf(rand(32, 32), "F16"), leaf(rand(32), "F16"))
    # a broadcast operand, an F16 one, a permuted view, a bias add that is read twice: only the
    # pair fuses
    perm = leaf(rand(32, 16)).permute(1, 0)
    assert perm.ne == (32, 16) and not perm.is_contiguous()
    for g in (Graph(F.silu(F.add(y, leaf(rand(32))))), Graph(F.silu(F.add(y, leaf(rand(16, 32), "F16")))),
              Graph(F.silu(F.add(y, perm))), Graph(F.mul(F.silu(F.add(y, x)), y))):
        names = [fn.__name__ for _, fn, _ in launches(g)]
        assert names.count("mul_mat_add_bias") == 1 and "mul_mat_add_bias_residual" not in names


def test_unet_graph_fuses_every_linear_bias():
    # the tiny SD1 UNet (tests/test_unet.py): per transformer block the two attention out
    # projections and ff.net.2 become bias + residual GEMMs, ff.net.0 (into geglu) a bias GEMM;
    # proj_in/proj_out are 1x1 convs in SD1
    from test_unet import _graph
    g = _graph("sd1")
    names = [fn.__name__ for _, fn, _ in launches(g)]
    blocks = sum(n.op == "geglu" for n in g.nodes)
    assert blocks == 11
    assert names.count("mul_mat_add_bias_residual") == 3 * blocks
    assert names.count("mul_mat_add_bias") >= blocks
    # both attentions of every block write their heads merged back into channels (the cont)
    assert names.count("attention_into_cont") == 2 * blocks



def test_unet_half_storage():
    # per SD1 transformer block: the three layer norms, q/k/v of both attentions (k/v from the
    # context), the attention outputs' conts and the proj_in cont after the group norm, ff.net.0
    # (its bias GEMM, the add node) and the geglu; every group norm (each feeds a conv or the
    # proj_in cont); the time embedding's SiLU, read only by an F16 GEMM (the output conv's SiLU
    # is written over its source, the group norm: not stored, see below); never a graph output,
    # never read by an op that would keep more than F16
    from test_unet import _graph
    g = _graph("sd1")
    hs = half(g)
    blocks = sum(n.op == "geglu" for n in g.nodes)
    norms = sum(n.op == "group_norm_affine" for n in g.nodes)
    assert Counter(n.op for n in hs) == {"mul_mat": 6 * blocks, "cont": 3 * blocks, "layer_norm_affine": 3 * blocks,
                                         "add": blocks, "geglu": blocks, "group_norm_affine": norms, "silu": 1}
    assert set(stored(g).values()) == {"F16"}      # F16 weights: nothing stored as BF16
    ids = {id(n) for n in hs}
    assert not ids & {id(n) for n in g.plan().outputs}
    for n in g.nodes:
        for i, s in enumerate(n.src):
            if id(s.owner) in ids:
                assert (n.op, i) in {("mul_mat", 1), ("attention", 0), ("attention", 1), ("attention", 2),
                                     ("geglu", 0), ("cont", 0), ("conv2d", 0)}, n.op
                if n.op == "cont":
                    assert id(n) in ids


def test_no_half_store_over_a_source():
    # an element-wise result the planner puts over its dying F32 source is not stored as F16:
    # element i's two bytes would overwrite F32 elements other threads have yet to read
    x = leaf(rand(2, 64, 32))
    w16 = leaf(rand(48, 32), "F16")
    s = F.silu(F.layer_norm(x, 1e-5))                      # silu written over the norm's buffer
    g = Graph(F.mul_mat(w16, s))
    plan = g.plan()
    ptr = _addresses(plan)
    ln, si = (n for n in g.nodes if n.op in ("layer_norm", "silu"))
    assert ptr[id(ln)] == ptr[id(si)]                      # the in-place placement this is about
    assert "silu" not in [n.op for n in half(g)]


def test_half_storage_only_where_nothing_is_lost():
    x = leaf(rand(2, 64, 32))
    ln = F.layer_norm_affine(x, leaf(rand(32)), leaf(rand(32)), 1e-5)
    w16, w32 = leaf(rand(48, 32), "F16"), leaf(rand(48, 32))
    # read by an F16 GEMM: stored as F16; also by an add, or by an F32 GEMM: kept F32
    assert [n.op for n in half(Graph(F.silu(F.mul_mat(w16, ln))))] == ["layer_norm_affine"]
    assert half(Graph({"a": F.silu(F.mul_mat(w16, ln)), "b": F.silu(F.add(ln, x))})) == []
    assert half(Graph(F.silu(F.mul_mat(w32, ln)))) == []
    # a GEMM's result read by an add: F32; the graph output itself: F32
    assert [n.op for n in half(Graph(F.mul_mat(w16, ln)))] == ["layer_norm_affine"]
    assert half(Graph(F.silu(F.mul_mat(w32, x)))) == []
    # q/k/v of a full-precision attention stay F32; of a default one, F16
    q = F.mul_mat(w16, x)

    def attn(**kw):
        h = q.reshape(8, 6, 64, 2).permute(0, 2, 1, 3)
        return F.silu(make_node("attention", (h, h, h), scale=0.3, **kw))
    assert [n.op for n in half(Graph(attn()))] == ["mul_mat"]
    assert half(Graph(attn(precision="F32"))) == []
    # a cont stored as F16 only when its reader takes F16: before a GEMM (and then the gelu it
    # moves too), not before a silu
    t = F.cont(F.gelu(x).permute(1, 0, 2, 3))
    assert [n.op for n in half(Graph(F.silu(F.mul_mat(leaf(rand(48, 64), "F16"), t))))] == ["gelu", "cont"]
    assert half(Graph(F.silu(t))) == []


def test_attention_into_cont_only_for_its_own_permute():
    q = leaf(rand(2, 6, 64, 8))  # ne [8, 64, 6, 2]: D, L, H, N
    a = F.attention(q, q, q)
    names = [fn.__name__ for _, fn, _ in launches(Graph(F.silu(F.cont(a.permute(0, 2, 1, 3)))))]
    assert names == ["_skip", "attention_into_cont", "own"]
    # another permute, the attention read twice, or itself the output: the cont stays a copy
    for g in (Graph(F.silu(F.cont(a.permute(1, 0, 2, 3)))),
              Graph(F.add(F.cont(a.permute(0, 2, 1, 3)), F.silu(a).permute(0, 2, 1, 3))),
              Graph({"a": a, "c": F.silu(F.cont(a.permute(0, 2, 1, 3)))})):
        assert "attention_into_cont" not in [fn.__name__ for _, fn, _ in launches(g)]


# ---- the direct 3x3 conv's epilogue (fuse._fuse_conv_epilogue) --------------------------------
def _esrgan_like(big=True):
    """x -> lrelu(conv1(x)) -> 0.2 * conv2(.) + x -> silu: ESRGAN's conv + activation and scaled
    residual (then a node, so that the add is not the graph's output, which has its own buffer)."""
    hw = 128 if big else 8
    x = leaf(rand(1, 8, hw, hw))
    h = F.leaky_relu(F.conv2d(x, leaf(rand(16, 8, 3, 3), "F16"), leaf(rand(16)), padding=1), 0.2)
    return F.silu(F.add(F.scale(F.conv2d(h, leaf(rand(8, 16, 3, 3), "F16"), leaf(rand(8), "F16"), padding=1), 0.2), x))


def test_conv_epilogue_fused_on_large_maps():
    lst = launches(Graph(_esrgan_like()))
    kinds = [(n.op, fn.__name__) for n, fn, _ in lst]
    assert kinds == [("conv2d", "_skip"), ("leaky_relu", "conv3x3_epilogue"),
                     ("conv2d", "_skip"), ("scale", "_skip"), ("add", "conv3x3_epilogue"), ("silu", "own")]
    conv2, residual = lst[2][0], lst[4][2]
    assert lst[4][2][:3] == tuple(conv2.src) and residual[3].owner.op is None   # x, w, b, then the residual x


def test_conv_epilogue_not_fused_on_small_maps_or_other_convs():
    # small maps run im2col + cuBLAS: nothing to fuse into
    assert all(fn is own for _, fn, _ in launches(Graph(_esrgan_like(big=False))))
    # a strided conv, and a conv whose output is read twice, keep their own kernels
    x = leaf(rand(1, 8, 128, 128))
    strided = F.leaky_relu(F.conv2d(x, leaf(rand(8, 8, 3, 3), "F16"), stride=2, padding=1), 0.2)
    assert all(fn is own for _, fn, _ in launches(Graph(strided)))
    c = F.conv2d(x, leaf(rand(8, 8, 3, 3), "F16"), padding=1)
    assert all(fn is own for _, fn, _ in launches(Graph(F.add(F.leaky_relu(c, 0.2), c))))


def test_dense_block_stored_as_f16():
    """An ESRGAN dense block at 128x128: the convs' fused outputs and the growing concats are
    stored F16 (only convs and F16 concats read them); the block's input and the scaled residual
    it reads stay F32."""
    x = leaf(rand(1, 16, 128, 128))
    cat = x
    for k in range(2):
        y = F.leaky_relu(F.conv2d(cat, leaf(rand(8, 16 + 8 * k, 3, 3), "F16"), leaf(rand(8)), padding=1), 0.2)
        cat = F.concat(cat, y, 2)
    out = F.silu(F.add(F.scale(F.conv2d(cat, leaf(rand(16, 32, 3, 3), "F16"), leaf(rand(16)), padding=1), 0.2), x))
    stored = half(Graph(out))
    assert sorted(n.op for n in stored) == ["concat", "concat", "leaky_relu", "leaky_relu"]
    # a batch of two: a source's part of the concat is not one contiguous run; the concat
    # converts it through its strides (cast4d), so it is stored F16 all the same
    x2 = leaf(rand(2, 16, 128, 128))
    y2 = F.leaky_relu(F.conv2d(x2, leaf(rand(8, 16, 3, 3), "F16"), padding=1), 0.2)
    c2 = F.concat(x2, y2, 2)
    assert [n.op for n in half(Graph(F.silu(F.conv2d(c2, leaf(rand(8, 24, 3, 3), "F16"), padding=1))))] == \
        ["leaky_relu", "concat"]


# ---- DiT blocks (Flux double + single): modulation, gated residual, fc1 + gelu; BF16 storage ----
def _by_name(graph):
    return Counter(fn.__name__ for _, fn, _ in launches(graph) if fn is not own)


def test_flux_blocks_fuse_the_dit_chains():
    from flux_block_graph import flux_blocks_graph
    g = flux_blocks_graph("BF16")
    lst = launches(g)
    names = _by_name(g)
    # 2 x 2 modulations in the double block, 1 in the single; 2 x 2 + 1 gated residuals; the two
    # MLPs' fc1 + gelu and the single block's linear1 MLP rows + gelu; every other linear a bias
    # GEMM (qkv x2, proj x2, fc2 x2, the three modulation linears, linear1's q/k/v rows, linear2)
    assert names["layer_norm_modulated"] == 5
    assert names["gated_add"] == 5
    assert names["mul_mat_add_bias_gelu"] == 3
    assert names["mul_mat_add_bias"] == 11
    assert names["attention_into_cont"] == 2
    assert names["rms_norm_rope"] == 6              # the QK norms and their ropes: 2 x 2 + 2
    assert "rms_norm_scaled" not in names
    assert not any(n.op in ("layer_norm", "rms_norm") and fn is own for n, fn, _ in lst)
    for n, fn, srcs in lst:
        if fn.__name__ == "layer_norm_modulated":
            x, s, shift = srcs
            assert n.op == "add" and x.owner.op != "layer_norm" and s.owner.op == "scale"
            assert s.ne4 == (64, 1, 1, 1) and shift.ne4 == (64, 1, 1, 1)
        if fn.__name__ == "gated_add":
            x, y, gate = srcs
            assert y.owner.op == "add" and gate.ne4 == (64, 1, 1, 1) and x.ne4 == n.ne4
        if fn.__name__ == "rms_norm_rope":     # q/k views of qkv (per stream in the double block)
            assert n.op == "rope" and srcs[1].ne == (32,) and srcs[0].owner.op == "add" and srcs[2].ne[:3] == (2, 2, 16)
        if fn.__name__ == "mul_mat_add_bias_gelu":
            assert n.op == "gelu_tanh" and srcs[0].dtype.name == "BF16" and srcs[2].ne == (128,)


def test_flux_blocks_store_gemm_inputs_in_the_gemm_dtype():
    """BF16 weights: every GEMM input the block makes (the modulations' outputs, the MLPs' gelu,
    the single block's concat and the gelu it joins, the modulation linears' silu) is stored BF16;
    the attention's inputs (rope'd q/k per stream, their joins, the joined v) F16, the attention's
    own dtype; the attention outputs' conts in the out-projection's dtype; with F16 weights all of
    them F16. Nothing read in F32 (residual stream, norms' inputs, the qkv projections read by
    rms_norm) is stored."""
    from flux_block_graph import flux_blocks_graph
    for dtype in ("BF16", "F16"):
        g = flux_blocks_graph(dtype)
        st = stored(g)
        got = Counter((n.op, st[id(n)]) for n in g.nodes if id(n) in st)
        want = Counter({("add", dtype): 5, ("gelu_tanh", dtype): 3, ("silu", dtype): 1, ("rope", "F16"): 6})
        # the double block's q, k and v joins, the single's join of attention and MLP
        want.update([("concat", "F16")] * 3 + [("concat", dtype)])
        want[("cont", dtype)] = 2       # the attention outputs, written in the out-projection's dtype
        assert got == want, dtype
        node = {id(n): n for n in g.nodes}
        outputs = {id(n) for n in g.plan().outputs}
        fused = {id(n): fn.__name__ for n, fn, _ in launches(g)}
        for i, d in st.items():
            n = node[i]
            assert i not in outputs
            if n.op == "add":       # the modulations (fused), read by GEMMs only
                assert fused[i] == "layer_norm_modulated"
        for n in g.nodes:
            for k, s in enumerate(n.src):
                if id(s.owner) in st:
                    d = st[id(s.owner)]
                    if n.op == "mul_mat":
                        assert k == 1 and d == n.src[0].dtype.name
                    elif n.op == "attention":
                        assert k < 3 and d == "F16"
                    else:
                        assert n.op in ("concat", "cont") and st.get(id(n)) == d, n.op
                if n.op in ("rms_norm", "layer_norm") or fused[id(n)] == "gated_add":
                    assert id(s.owner) not in st, n.op


def test_bf16_and_f16_readers_disagree_nothing_stored():
    x = leaf(rand(2, 16, 32))
    h = F.gelu(x, approximate="tanh")
    wb, wh = leaf(rand(48, 32), "BF16"), leaf(rand(48, 32), "F16")
    g = Graph({"a": F.silu(F.mul_mat(wb, h)), "b": F.silu(F.mul_mat(wh, h))})
    assert stored(g) == {}
    g = Graph({"a": F.silu(F.mul_mat(wb, h)), "b": F.silu(F.mul_mat(wb, h))})
    assert list(stored(g).values()) == ["BF16"]


def test_rope_stored_f16_only_for_the_attention():
    q = leaf(rand(1, 24, 2, 32))                      # ne [D, H, L, N]
    pe = leaf(rand(24, 16, 2, 2))
    for r in (F.rope(q, pe), F.rope_ext(q, np.arange(24, dtype=np.int32), n_dims=32, mode="neox")):
        att = r.reshape(32, 24, 2, 1) if r.op == "rope" else r.permute(0, 2, 1, 3)
        g = Graph(F.silu(F.attention(att, att, att)))
        st = stored(g)
        assert [(n.op, st[id(n)]) for n in g.nodes if id(n) in st] == [(r.op, "F16")]
        # read by a BF16 GEMM instead: rope writes F16 only, so it stays F32
        g = Graph(F.silu(F.mul_mat(leaf(rand(8, 32), "BF16"), r)))
        assert stored(g) == {}


def test_geglu_takes_only_a_gemm_product_in_half():
    # the geglu stored for an F16 GEMM: its product input is stored F16 (the one extra rounding,
    # as PyTorch's fp16 feed-forward), a silu input is not (nothing rounds it)
    x = leaf(rand(2, 16, 64))
    w2 = leaf(rand(48, 32), "F16")
    via_gemm = F.geglu(F.linear(x, leaf(rand(64, 64), "F16"), leaf(rand(64), "F16")), "tanh")
    assert sorted(n.op for n in half(Graph(F.silu(F.mul_mat(w2, via_gemm))))) == ["add", "geglu"]
    via_silu = F.geglu(F.silu(x), "tanh")
    assert [n.op for n in half(Graph(F.silu(F.mul_mat(w2, via_silu))))] == ["geglu"]


def test_dit_chains_not_fused():
    x = leaf(rand(1, 16, 64))
    s, sh, gate = (leaf(rand(1, 1, 64)) for _ in range(3))
    w, b = leaf(rand(64, 64), "BF16"), leaf(rand(64), "BF16")
    ln = F.layer_norm(x, 1e-6)
    # the norm read twice; the mul read twice; an affine norm; a full-size x broadcast into the mul
    for out in (F.add(F.add(F.mul(ln, s), sh), ln), F.add(F.add(F.mul(ln, s), sh), F.mul(ln, s)),
                F.add(F.mul(F.layer_norm_affine(x, leaf(rand(64)), None, 1e-6), s), sh)):
        assert "layer_norm_modulated" not in _by_name(Graph(F.silu(out)))
    # the gate's product read twice, or an F16 operand: no gated add
    y = F.linear(x, w, b)
    m = F.mul(y, gate)
    assert "gated_add" not in _by_name(Graph(F.silu(F.add(F.add(x, m), m))))
    assert "gated_add" not in _by_name(Graph(F.silu(F.add(x, F.mul(y, leaf(rand(1, 1, 64), "F16"))))))
    assert _by_name(Graph(F.silu(F.add(x, F.mul(y, gate)))))["gated_add"] == 1
    # an rms_norm times a full-size tensor, or read twice: the mul stays its own kernel
    r = F.rms_norm(x, 1e-6)
    assert "rms_norm_scaled" not in _by_name(Graph(F.silu(F.mul(r, leaf(rand(1, 16, 64))))))
    assert "rms_norm_scaled" not in _by_name(Graph(F.add(F.mul(r, leaf(rand(64))), r)))
    assert _by_name(Graph(F.silu(F.mul(F.rms_norm(x, 1e-6), leaf(rand(64), "BF16")))))["rms_norm_scaled"] == 1
    # gelu (erf form) after the bias, or the bias output read twice: no GELU epilogue
    assert "mul_mat_add_bias_gelu" not in _by_name(Graph(F.silu(F.gelu(F.linear(x, w, b)))))
    y2 = F.linear(x, w, b)
    assert "mul_mat_add_bias_gelu" not in _by_name(Graph(F.add(F.gelu(y2, approximate="tanh"), y2)))
    assert _by_name(Graph(F.silu(F.gelu(F.linear(x, w, b), approximate="tanh"))))["mul_mat_add_bias_gelu"] == 1


def test_a_node_takes_part_in_one_fusion():
    """silu(y) * gate + x: the SwiGLU fusion takes the mul first, so the gated residual must leave
    it (it took the mul's sources once, reading the skipped silu's never-written buffer)."""
    x, y, gate = leaf(rand(2, 50, 64)), leaf(rand(2, 50, 64)), leaf(rand(2, 1, 64))
    lst = launches(Graph(F.silu(F.add(x, F.mul(F.silu(y), gate)))), real=True)
    assert [(n.op, fn.__name__) for n, fn, _ in lst] == [("silu", "_skip"), ("mul", "silu_mul"), ("add", "binary"),
                                                         ("silu", "unary")]
    skipped = {id(n) for n, fn, _ in lst if fn is fuse._skip}
    assert not any(id(t.owner) in skipped for _, _, srcs in lst for t in srcs)


def _kernels(plan):
    import_families(cuda_ops)
    return [[CUDA.find(n).fn for n in seg.nodes] for seg in plan.segments]


def assert_layout_sound(graph, plan, half):
    """No two nodes live at once share bytes in `plan` (their extents: half for `half`'s nodes),
    but an element-wise node taking over the buffer of the source it reads last (same offset)."""
    pos = {id(n): i for i, n in enumerate(graph.nodes)}
    last = dict(pos)
    for n in graph.nodes:
        for s in n.src:
            if s.owner.op is not None:
                last[id(s.owner)] = max(last[id(s.owner)], pos[id(n)])
    for offsets in [seg.offsets for seg in plan.segments] + [plan.cross_offsets]:
        spans = [(offsets[id(n)], offsets[id(n)] + (n.nbytes // 2 if id(n) in half else n.nbytes), n)
                 for n in graph.nodes if id(n) in offsets]
        for i, (lo, hi, a) in enumerate(spans):
            for lo2, hi2, b in spans[i + 1:]:
                if not (lo < hi2 and lo2 < hi):
                    continue
                first, second = (a, b) if pos[id(a)] < pos[id(b)] else (b, a)
                if last[id(first)] < pos[id(second)]:
                    continue
                assert (last[id(first)] == pos[id(second)] and offsets[id(first)] == offsets[id(second)]
                        and any(s.owner is first for s in second.src)), f"{first.op} and {second.op} overlap"


def test_layout_sizes_half_stored_nodes_at_half():
    """fuse.layout re-plans with the F16/BF16-stored nodes at half their bytes: a smaller arena
    (Flux blocks, BF16 weights), every node sized half stored half, and a sound layout; the
    decisions are the F32 plan's but for what the new placement allows or forbids."""
    from flux_block_graph import flux_blocks_graph
    g = flux_blocks_graph("BF16")
    plan = g.plan()
    kernels = _kernels(plan)
    lay, lists, half = fuse.layout(g, plan, kernels, True, True)
    assert lay is not plan and lay.arena_bytes < plan.arena_bytes
    _, _, half0 = fuse.layout(g, plan, kernels, True, False)
    assert half0 == {}
    assert_layout_sound(g, lay, half)
    assert_layout_sound(g, plan, {})
    names = Counter(fn.__name__ for lst in lists for fn, _ in lst)
    names0 = Counter(fn.__name__ for lst in fuse.launch_lists(g, plan, kernels, _addresses(plan)) for fn, _ in lst)
    assert names == names0, (names, names0)
    print(f"arena {plan.arena_bytes} -> {lay.arena_bytes}, {len(half)} half-stored")


def _report_tool():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "cuda_fusion_report.py")
    spec = importlib.util.spec_from_file_location("cuda_fusion_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("family", ["flux", "sd3m", "sd35l", "zimage", "qwen", "sd15", "sdxl"])
def test_layouts_sound_on_every_family(family):
    """The planner's layout (every node live at once in bytes of its own) and fuse.layout's, on
    the tiny golden models of each DiT family and the full-size SD1.5 / SDXL UNets' CFG step
    (tools/cuda_fusion_report.py's graphs)."""
    g = _report_tool().FAMILIES[family]("BF16")
    plan = g.plan()
    assert_layout_sound(g, plan, {})
    lay, _, half = fuse.layout(g, plan, _kernels(plan), True, True)
    assert_layout_sound(g, lay, half)
    assert lay.arena_bytes + lay.cross_bytes <= plan.arena_bytes + plan.cross_bytes


def test_layout_unfused_is_the_plan():
    from flux_block_graph import flux_blocks_graph
    g = flux_blocks_graph("BF16")
    plan = g.plan()
    lay, lists, half = fuse.layout(g, plan, _kernels(plan), False, True)
    assert lay is plan and half == {} and all(fn is not fuse._skip for lst in lists for fn, _ in lst)
    lay, _, half = fuse.layout(g, plan, _kernels(plan), True, True, replan=False)   # SDRT_CUDA_HALF_LAYOUT=0
    assert lay is plan and half
