"""Layer split over several simulated devices (issue 21, done-means 1): the segment plan, the
residency of each device, and a split run equal to the unsplit one, with every weight read from
the memory of the device the split put it on."""
import numpy as np
import pytest

from sdrt.engine.layer_split import COMPUTE_HEADROOM, SplitResidency, split_segments
from sdrt.engine.residency import ResidencyManager
from sdrt.engine.simulated_device import SimulatedDevice
from sdrt.errors import DeviceOutOfMemoryError
from sdrt.ops.registry import Kernel
from sdrt.ops.tensor import Tensor
from test_residency import GiB, U, chain

pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_plan_fills_devices_in_order():
    assert split_segments([3, 3, 3, 3], [6, 6]) == [0, 0, 1, 1]
    assert split_segments([3, 3, 3, 3], [7, 100]) == [0, 0, 1, 1]
    assert split_segments([1, 5, 1], [5, 5, 5]) == [0, 1, 2]         # 1+5 > 5: the 5 moves on
    assert split_segments([2, 2], [10, 10]) == [0, 0]                # fits the first: one device used
    assert split_segments([0, 4, 0, 4, 0], [4, 4]) == [0, 0, 0, 1, 1]  # weightless segments ride along
    with pytest.raises(DeviceOutOfMemoryError, match="segment 'big' needs"):
        split_segments([1, 9], [8, 8], ["a", "big"])
    with pytest.raises(DeviceOutOfMemoryError, match="do not fit 2 devices"):
        split_segments([4, 4, 4], [4, 4])


class SplitReadingCPU:
    """The CPU kernels reading each managed weight from the bytes of the simulated device whose
    address range holds device_ptr(leaf) (each device has its own base)."""
    name = "split-cpu"

    def __init__(self, sims, res):
        from sdrt.ops.cpu import CPU
        self.cpu, self.sims, self.res, self.reads = CPU, sims, res, {s.name: 0 for s in sims}

    def find(self, node):
        k = self.cpu.find(node)
        if k is None:
            return None

        def fn(n, xs, out):
            xs = [self.device_view(s) if s.owner.op is None and self.res.manages(s) else x
                  for s, x in zip(n.src, xs)]
            k.fn(n, xs, out)
        return Kernel(node.op, fn, None)

    def device_view(self, leaf):
        ptr = self.res.device_ptr(leaf)
        sim = next(s for s in self.sims if s.BASE <= ptr < s.BASE + s.total)
        self.reads[sim.name] += 1
        return Tensor(leaf.dtype, leaf.ne, leaf.nb, storage=sim.mem, offset=ptr - sim.BASE).numpy()


def run_split(graph, res, backend):
    plan = graph._plan
    res.begin_graph(plan)
    cur = []

    def on_segment(k, name, nodes):
        if cur:
            res.end_segment(cur[-1])
        res.begin_segment(k, name, [s for n in nodes for s in n.src if s.owner.op is None])
        cur.append(k)

    out = graph.run(backend, on_segment=on_segment)
    res.end_segment(cur[-1])
    return out["out"].to_f32()


def two_devices(budget_units=10, total_units=64):
    sims = [SimulatedDevice(total_units * U, f"sim{i}", base=(1 + i) << 40) for i in range(2)]
    mgrs = [ResidencyManager(s, max_vram=budget_units * U / GiB) for s in sims]
    return sims, mgrs


def test_split_run_equals_the_unsplit_run_and_each_device_holds_its_segments(caplog):
    graph, ws, _ = chain([2, 2, 2, 2, 2, 2], seed=3)       # six segments of 2 units of weights
    ref = graph.run("cpu")["out"].to_f32()
    sims, mgrs = two_devices(budget_units=10)              # 10 - 3.2 units of activations: 3 segments each
    res = SplitResidency(mgrs)
    for comp_ws in (ws,):
        res.register(comp_ws, "diffusion")
    be = SplitReadingCPU(sims, res)
    with caplog.at_level("INFO", logger="sdrt"):
        out = run_split(graph, res, be)
    np.testing.assert_array_equal(out, ref)
    assert res.split_of(graph._plan) == [0, 0, 0, 1, 1, 1, 1]     # + the final, weightless segment
    assert "layer split over sim0&sim1: sim0 segments 0-2" in caplog.text
    on = {w.name: res.device_of(w) for w in ws}
    assert on == {**{w.name: "sim0" for w in ws[:3]}, **{w.name: "sim1" for w in ws[3:]}}
    assert be.reads == {"sim0": 3, "sim1": 3}
    # each device stayed in its budget and staged only its own weights
    for s, m in zip(sims, mgrs):
        assert s.peak_used <= 10 * U and m.peak_bytes <= 10 * U
    up = [sum(e[3] if len(e) > 3 else 0 for e in s.events if e[0] == "upload") for s in sims]
    assert all(u > 0 for u in up)
    # one activation (x + w_2, N floats) crosses from sim0 to sim1
    assert res.peer_bytes == U
    # a second run: everything resident where it was, nothing uploaded, same output
    before = [len([e for e in s.events if e[0] == "upload"]) for s in sims]
    np.testing.assert_array_equal(run_split(graph, res, be), ref)
    assert [len([e for e in s.events if e[0] == "upload"]) for s in sims] == before


def test_a_model_larger_than_one_budget_runs_split_without_streaming():
    """The issue's case: 12 units of weights, 10 units of budget per device: one device alone would
    stream segment by segment on every run; split over two, each keeps its part resident."""
    graph, ws, _ = chain([2, 2, 2, 2, 2, 2], seed=5)
    ref = graph.run("cpu")["out"].to_f32()
    one = SimulatedDevice(64 * U, "solo", base=1 << 40)
    mgr = ResidencyManager(one, max_vram=10 * U / GiB)
    mgr.register(ws, "diffusion")
    from test_residency import DeviceReadingCPU, run_segments
    for _ in range(2):
        np.testing.assert_array_equal(run_segments(graph, mgr, DeviceReadingCPU(one, mgr)), ref)
    assert mgr.stats.uploaded > 0                          # streamed again on the second run
    sims, mgrs = two_devices(budget_units=10)
    res = SplitResidency(mgrs)
    res.register(ws, "diffusion")
    be = SplitReadingCPU(sims, res)
    for _ in range(2):
        np.testing.assert_array_equal(run_split(graph, res, be), ref)
    assert all(m.stats.uploaded == 0 for m in mgrs)        # the second run uploaded nothing


def test_capacity_defaults_and_refusals():
    sims = [SimulatedDevice(4 * GiB, f"sim{i}", store=False, base=(1 + i) << 40) for i in range(2)]
    res = SplitResidency([ResidencyManager(s) for s in sims])
    assert res.capacities() == [4 * GiB - COMPUTE_HEADROOM] * 2        # free minus sd.cpp's 2 GiB
    assert all(not m.prefetch for m in res.managers)
    with pytest.raises(ValueError, match="at least two"):
        SplitResidency(res.managers[:1])
    graph, ws, _ = chain([2, 2, 2], seed=1)
    sims, mgrs = two_devices(budget_units=5)
    res = SplitResidency(mgrs)
    res.register(ws, "diffusion")
    with pytest.raises(DeviceOutOfMemoryError, match="do not fit 2 devices"):
        res.begin_graph(graph._plan)
