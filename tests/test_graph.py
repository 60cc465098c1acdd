import numpy as np
import pytest

from sdrt import OpError, UnsupportedError
from sdrt.ops import api as F
from sdrt.ops.graph import Graph, mark_cut
from sdrt.ops.tensor import Tensor


def chain(rng, n=12, size=(8, 16, 32)):
    x = Tensor.from_numpy(rng.standard_normal(size).astype(np.float32), name="x")
    h, ref = x, x.numpy().astype(np.float64)
    for i in range(n):
        h = F.add(F.silu(h), x) if i % 2 else F.scale(h, 0.5, 0.1)
        ref = (ref / (1 + np.exp(-ref)) + x.numpy()) if i % 2 else ref * 0.5 + 0.1
    return x, h, ref


def test_buffer_reuse_keeps_results(rng):
    x, h, ref = chain(rng)
    g = Graph(h)
    plan = g.plan()
    assert plan.peak_bytes < plan.naive_bytes / 3  # 12 nodes, at most ~3 alive at once
    out = g.run()["out"]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_liveness_extends_through_views(rng):
    x = Tensor.from_numpy(rng.standard_normal((4, 6)).astype(np.float32))
    a = F.scale(x, 2.0)
    at = a.transpose()                  # a view of a computed node
    b = F.scale(x, 3.0)                 # may not overwrite a: a's view is still used below
    c = F.add(F.cont(at), F.cont(b.transpose()))
    got = Graph(c).run()["out"].numpy()
    np.testing.assert_allclose(got, (2 * x.numpy() + 3 * x.numpy()).T, rtol=1e-6)


def test_elementwise_ops_run_in_place_when_their_input_dies(rng):
    """silu/scale/add take their input's slot when nothing reads it later; a node whose input
    is read again, or that reads it through another view as well, gets its own."""
    x = Tensor.from_numpy(rng.standard_normal((8, 8, 5)).astype(np.float32))
    a = F.scale(x, 2.0)          # computed: the chain below may reuse its buffer
    b = F.silu(a)                # a dies here: in place
    c = F.add(b, F.scale(x, -1.0, 0.25))  # b dies here: in place over b (= a's slot)
    d = F.scale(c, 3.0)          # c is read again below: NOT in place
    e = F.add(d, c)              # d and c die here: in place over one of them
    t = F.add(e, e.permute(0, 2, 1))  # e also read through a transposed view: not over e
    g = Graph({"out": F.scale(t, 1.0)})
    seg = g.plan().segments[0].offsets
    assert seg[id(b.owner)] == seg[id(a.owner)] and seg[id(c.owner)] == seg[id(b.owner)]
    assert seg[id(d.owner)] != seg[id(c.owner)]
    assert seg[id(e.owner)] in (seg[id(c.owner)], seg[id(d.owner)])
    assert seg[id(t.owner)] != seg[id(e.owner)]
    xv = x.numpy().astype(np.float64)
    bv = 2 * xv / (1 + np.exp(-2 * xv))
    ev = 4 * (bv - xv + 0.25)
    np.testing.assert_allclose(g.run()["out"].numpy(), ev + ev.transpose(1, 0, 2), rtol=1e-5, atol=1e-5)


def test_named_outputs_and_view_output(rng):
    x = Tensor.from_numpy(rng.standard_normal((3, 5)).astype(np.float32))
    y = F.exp(x)
    out = Graph({"y": y, "yt": y.transpose(), "x": x}).run()
    np.testing.assert_allclose(out["y"].numpy(), np.exp(x.numpy()), rtol=1e-6)
    np.testing.assert_allclose(out["yt"].numpy(), np.exp(x.numpy()).T, rtol=1e-6)
    assert np.shares_memory(out["x"].numpy(), x.numpy())


def test_cut_points_split_segments(rng):
    x = Tensor.from_numpy(rng.standard_normal((64, 64)).astype(np.float32))
    h = x
    for blk in range(3):
        for _ in range(4):
            h = F.silu(F.scale(h, 0.9))
        mark_cut(h, f"blocks.{blk}")
    h = F.add(h, x)
    g = Graph(h)
    plan = g.plan()
    assert [s.name for s in plan.segments] == ["blocks.0", "blocks.1", "blocks.2", None]
    assert [len(s.nodes) for s in plan.segments] == [8, 8, 8, 1]
    seen = []
    out = g.run(on_segment=lambda k, name, nodes: seen.append((k, name, len(nodes))))["out"].numpy()
    assert seen == [(0, "blocks.0", 8), (1, "blocks.1", 8), (2, "blocks.2", 8), (3, None, 1)]
    ref = x.numpy().astype(np.float64)
    for _ in range(12):
        ref = ref * 0.9
        ref = ref / (1 + np.exp(-ref))
    np.testing.assert_allclose(out, ref + x.numpy(), rtol=1e-5, atol=1e-6)
    # every segment arena is small, and a cut output is freed once the next segment used it:
    # x and at most two block outputs are alive across segments at any time
    assert plan.arena_bytes <= 2 * 64 * 64 * 4 + 256
    assert plan.cross_bytes <= 2 * 64 * 64 * 4 + 256
    assert plan.peak_bytes < plan.naive_bytes / 4


def test_input_without_data_is_an_error():
    t = Tensor("F32", (4,))
    with pytest.raises(OpError, match="has no data"):
        Graph(F.exp(t))


def test_missing_kernel_is_unsupported():
    q = Tensor.from_numpy(np.zeros((1, 34), np.uint8), dtype="Q8_0")
    node = F.cont(q)
    node.op = "no_such_op"
    with pytest.raises(UnsupportedError, match="no kernel for no_such_op"):
        Graph(node).run()


def test_reference_backend_matches_cpu(rng):
    x, h, ref = chain(rng, n=6, size=(5, 7))
    np.testing.assert_allclose(F.compute(h, "reference"), F.compute(h), rtol=1e-5, atol=1e-6)


def test_check_graph_names_first_bad_node(rng):
    from sdrt.ops.cpu import CPU
    from sdrt.ops.graph import NodeMismatch, check_graph
    x, h, _ = chain(rng, n=4, size=(5, 7))
    assert check_graph(h) == 6
    # sabotage the CPU silu kernel: the check must name silu, not a later node
    saved = CPU._kernels["silu"]
    CPU._kernels["silu"] = [type(saved[0])("silu", lambda n, xs, out: out.fill(0), None)]
    try:
        with pytest.raises(NodeMismatch, match="node silu"):
            check_graph(h)
    finally:
        CPU._kernels["silu"] = saved


class _DeviceLike:
    """A backend that runs whole graphs itself (as a device backend does): CPU kernels, with
    silu's results corrupted when `broken`; it has no kernel lookup the check could use."""
    name, memory = "dev0", None

    def __init__(self, broken):
        self.broken = broken

    def find(self, node):
        from sdrt.ops.cpu import CPU
        return CPU.find(node)

    def run_graph(self, graph, plan, on_segment=None, residency=None):
        from sdrt.ops.graph import run_on_host
        out = run_on_host(graph, plan, self, on_segment, residency)
        if self.broken and any(n.op == "silu" for n in graph.nodes):
            out["out"].numpy()[...] += 1
        return out


def test_check_graph_on_a_graph_running_backend(rng):
    from sdrt.ops.graph import NodeMismatch, check_graph
    x, h, _ = chain(rng, n=4, size=(5, 7))
    assert check_graph(h, _DeviceLike(False)) == 6
    with pytest.raises(NodeMismatch, match=r"node silu \(#2 of 6\).*dev0 differs from the reference"):
        check_graph(h, _DeviceLike(True))


def test_sdrt_check_env_checks_every_graph_run(rng, monkeypatch):
    from sdrt.ops.cpu import CPU
    from sdrt.ops.graph import NodeMismatch
    x, h, _ = chain(rng, n=6, size=(5, 7))
    want = Graph(h).run()["out"].to_f32()
    monkeypatch.setenv("SDRT_CHECK", "1")
    np.testing.assert_array_equal(Graph(h).run()["out"].to_f32(), want)   # same kernels, node by node
    saved = CPU._kernels["silu"]
    CPU._kernels["silu"] = [type(saved[0])("silu", lambda n, xs, out: out.fill(0), None)]
    try:
        with pytest.raises(NodeMismatch, match="node silu"):
            Graph(h).run()
        monkeypatch.setenv("SDRT_CHECK", "0")
        Graph(h).run()          # unchecked: the broken kernel goes unnoticed
    finally:
        CPU._kernels["silu"] = saved
