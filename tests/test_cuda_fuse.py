"""The CUDA backend's fusion pass (sdrt/gpu/cuda/fuse.py) on planned graphs, without a GPU: which
linear-layer bias adds become one bias-epilogue GEMM, and which must stay separate. The fused
kernel's numbers are checked against the CPU on a GPU (tests/gpu/test_cuda_fuse.py)."""
import numpy as np
from opcheck import leaf

from sdrt.gpu.cuda import fuse
from sdrt.ops import api as F
from sdrt.ops.graph import Graph


def own(node, xs, out, rt):
    """Stands for a node's own kernel."""


def launches(graph):
    """fuse.launch_lists over the graph's plan, with addresses laid out as the backend does."""
    plan = graph.plan()
    ptr = {id(n): (1 << 40) + i * (1 << 30) for i, n in enumerate(plan.outputs)}
    for seg in plan.segments:
        for n in seg.nodes:
            if id(n) in seg.offsets:
                ptr[id(n)] = seg.offsets[id(n)]
            elif id(n) in plan.cross_offsets:
                ptr[id(n)] = (1 << 36) + plan.cross_offsets[id(n)]
    kernels = [[own] * len(seg.nodes) for seg in plan.segments]
    lists = fuse.launch_lists(graph, plan, kernels, ptr)
    return [(n, fn, srcs) for seg, lst in zip(plan.segments, lists) for n, (fn, srcs) in zip(seg.nodes, lst)]


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

