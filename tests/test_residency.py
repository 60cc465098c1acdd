"""Residency manager on a simulated device (no GPU): LRU eviction, pinning, prefetch ordering,
segment streaming of a real tiny UNet under a small budget (outputs equal to the plain CPU run,
with every weight read from the simulated device's bytes), --max-vram arithmetic, disk params
(file pages dropped after staging), errors for impossible budgets; one budget per device shared
by a text encoder, a UNet and a VAE on a simulated GPU that keeps graphs' arenas and caches freed
blocks as the CUDA backend does; the CUDA backend's graph-memory methods on a stand-in device."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from sdrt.engine.placement import resolve_budget
from sdrt.engine.host_pages import HostPageRelease, release_file_pages
from sdrt.engine.residency import ResidencyManager
from sdrt.engine.simulated_device import SimulatedDevice
from sdrt.errors import DeviceOutOfMemoryError, UsageError
from sdrt.ops import api as F
from sdrt.ops.registry import Kernel
from sdrt.ops.tensor import Tensor

GiB = 2**30
U = 64 * 1024            # one weight unit: 64 KiB (16384 float32)
N = U // 4


pytestmark = pytest.mark.usefixtures("one_thread")


def weight(units: float, seed: int, name: str = "") -> Tensor:
    rng = np.random.default_rng(seed)
    return Tensor.from_numpy(rng.standard_normal(int(units * N)).astype(np.float32), name=name or f"w{seed}")


def chain(units: list[int], seed: int = 0, width: int = 1):
    """x -> cut(x + w_i[:N]) for each weight: one segment per weight (a view of a bigger one);
    x has `width` rows of N (each intermediate is width * U bytes)."""
    x = Tensor.from_numpy(np.linspace(-1, 1, N * width, dtype=np.float32).reshape(width, N), name="x")
    ws = [weight(u, seed + i) for i, u in enumerate(units)]
    h = x
    for i, w in enumerate(ws):
        h = F.mark_cut(F.add(h, w.slice(0, 0, N)), f"l{i}")
    g = F.Graph({"out": F.scale(h, 1.0)})
    g._plan = g.plan()
    return g, ws, x


def mib(n):
    return n / 2**20


def manager(sim, budget_bytes=None, **kw):
    return ResidencyManager(sim, max_vram=None if budget_bytes is None else budget_bytes / GiB, **kw)


class DeviceReadingCPU:
    """The CPU kernels, reading every managed weight from the simulated device's bytes at
    device_ptr(leaf), as the CUDA backend does with DevTensor.of(leaf, ptr)."""
    name = "sim-cpu"

    def __init__(self, sim, mgr):
        from sdrt.ops.cpu import CPU
        self.cpu, self.sim, self.mgr = CPU, sim, mgr

    def find(self, node):
        k = self.cpu.find(node)
        if k is None:
            return None

        def fn(n, xs, out):
            xs = [self.device_view(s) if s.owner.op is None and self.mgr.manages(s) else x
                  for s, x in zip(n.src, xs)]
            k.fn(n, xs, out)
        return Kernel(node.op, fn, None)

    def device_view(self, leaf):
        off = self.mgr.device_ptr(leaf) - self.sim.BASE
        return Tensor(leaf.dtype, leaf.ne, leaf.nb, storage=self.sim.mem, offset=off).numpy()


def run_segments(graph, mgr, backend, sim=None):
    """Graph.run with the manager driven from the on_segment hook (one graph run)."""
    plan = graph._plan
    mgr.begin_graph(plan)
    cur = []

    def on_segment(k, name, nodes):
        if cur:
            if sim is not None:
                sim.mark(f"end {cur[-1]}")
            mgr.end_segment(cur[-1])
        mgr.begin_segment(k, name, [s for n in nodes for s in n.src if s.owner.op is None])
        cur.append(k)

    out = graph.run(backend, on_segment=on_segment)
    if sim is not None:
        sim.mark(f"end {cur[-1]}")
    mgr.end_segment(cur[-1])
    return out["out"].to_f32()


def uploads(sim, stream=None):
    return [e for e in sim.events if e[0] == "upload" and (stream is None or e[1] == stream)]


# ---- eviction and pinning -------------------------------------------------------------------------

def test_lru_eviction_order():
    sim = SimulatedDevice(3 * U)
    mgr = manager(sim)
    a, b, c, d = (weight(1, i) for i in range(4))
    for comp, w in zip("abcd", (a, b, c, d)):
        mgr.register([w], comp)
    for k, w in enumerate((a, b, c, a)):       # a is used again: b is now the least recent
        mgr.begin_segment(k, None, [w])
        mgr.end_segment(k)
    assert len(uploads(sim)) == 3                # the second use of a uploads nothing
    mgr.begin_segment(4, None, [d])
    assert not mgr.is_resident(b) and all(mgr.is_resident(w) for w in (a, c, d))
    mgr.end_segment(4)
    mgr.begin_segment(5, None, [b])              # now c is the least recent
    assert not mgr.is_resident(c) and all(mgr.is_resident(w) for w in (a, b, d))
    np.testing.assert_array_equal(sim.view(mgr.device_ptr(b), U), b.storage[:U])


def test_pinned_block_is_never_evicted():
    sim = SimulatedDevice(3 * U)
    mgr = manager(sim)
    a, b, c, d = (weight(1, i) for i in range(4))
    mgr.register([a, b, c, d], "diffusion")
    mgr.begin_segment(0, None, [a])              # a stays pinned: its segment never ends here
    for k, w in ((1, b), (2, c)):
        mgr.begin_segment(k, None, [w])
        mgr.end_segment(k)
    mgr.begin_segment(3, None, [d])              # a is the oldest, but pinned: b goes
    assert mgr.is_resident(a) and not mgr.is_resident(b)
    # everything pinned: nothing can make room, and the error names the sizes
    mgr.begin_segment(4, None, [c])
    with pytest.raises(DeviceOutOfMemoryError, match=r"cannot make room for 0\.1 MB.*0\.2 MB pinned"):
        mgr.begin_segment(5, None, [b])
    mgr.end_segment(0)
    mgr.begin_segment(5, None, [b])
    assert not mgr.is_resident(a)


def test_make_room_evicts_unpinned_weights_for_the_backend():
    sim = SimulatedDevice(4 * U)
    mgr = manager(sim)
    a, b, c = (weight(1, i) for i in range(3))
    mgr.register([a, b, c], "diffusion")
    for k, w in enumerate((a, b, c)):
        mgr.begin_segment(k, None, [w])
    mgr.end_segment(0)
    mgr.end_segment(1)                     # c stays pinned
    assert mgr.make_room(U + 1) == 2 * U and mgr.resident_bytes == U and mgr.is_resident(c)
    assert mgr.make_room(U) == 0


def test_blocks_pack_up_to_block_bytes_and_views_read_the_right_bytes():
    sim = SimulatedDevice(16 * U)
    mgr = manager(sim, block_bytes=2 * U)
    ws = [weight(1, i) for i in range(5)]
    mgr.register(ws, "te")
    mgr.begin_segment(0, None, [w.slice(0, 100, 200) for w in ws])
    allocs = [e for e in sim.events if e[0] == "alloc"]
    assert [e[2] for e in allocs] == [2 * U, 2 * U, U]
    for w in ws:
        v = w.slice(0, 100, 200)
        got = sim.view(mgr.device_ptr(v), 100 * 4).view(np.float32)
        np.testing.assert_array_equal(got, w.numpy()[100:200])


def test_a_view_beyond_its_weight_widens_the_staged_range():
    buf = np.arange(4 * N, dtype=np.float32)
    w = Tensor.from_buffer(buf, "F32", (N,), name="w")                # owns the first quarter
    wide = w.view((2 * N,), offset=N * 4)                              # reads the 2nd and 3rd quarters
    sim = SimulatedDevice(16 * U)
    mgr = manager(sim)
    mgr.register([w], "te")
    mgr.begin_segment(0, None, [w])
    with pytest.raises(UsageError, match="reaches outside the bytes staged for it while they are in use"):
        mgr.begin_segment(1, None, [wide])
    mgr.end_segment(0)
    mgr.begin_segment(1, None, [wide])
    np.testing.assert_array_equal(sim.view(mgr.device_ptr(wide), 2 * U).view(np.float32), buf[N:3 * N])
    np.testing.assert_array_equal(sim.view(mgr.device_ptr(w), U).view(np.float32), buf[:N])


def test_weights_kept_on_device_are_never_evicted():
    sim = SimulatedDevice(3 * U)
    mgr = manager(sim)
    kept, a, b, c = (weight(1, i) for i in range(4))
    mgr.register([kept], "vae", params="sim0")
    mgr.register([a, b, c], "diffusion", params="cpu")
    for k, w in enumerate((kept, a, b, c)):
        mgr.begin_segment(k, None, [w])
        mgr.end_segment(k)
    assert mgr.is_resident(kept) and not mgr.is_resident(a)
    with pytest.raises(UsageError, match="params backend 'cuda1'"):
        mgr.register([weight(1, 9)], "te", params="cuda1")


# ---- plans: fit, streaming, prefetch --------------------------------------------------------------

def test_everything_fits_stays_resident_across_runs():
    g, ws, _ = chain([1, 2, 1, 3])
    act = g._plan.arena_bytes + g._plan.cross_bytes + g._plan.output_bytes
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim, act + 8 * U)
    mgr.register(ws, "diffusion")
    ref = g.run("cpu")["out"].to_f32()
    be = DeviceReadingCPU(sim, mgr)
    for run in range(3):
        assert mgr.begin_graph(g._plan) == (run > 0)
        out = run_segments(g, mgr, be)
        np.testing.assert_array_equal(out, ref)
        assert mgr.stats.uploaded == (7 * U if run == 0 else 0)
    assert mgr.evictions == 0 and mgr.peak_bytes <= act + 8 * U


def test_prefetch_issues_next_segment_on_copy_stream_before_current_ends():
    g, ws, _ = chain([1, 1, 1, 1])
    act = g._plan.arena_bytes + g._plan.cross_bytes + g._plan.output_bytes
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim, act + 2 * U)          # two weights at a time: must stream
    mgr.register(ws, "diffusion")
    ref = g.run("cpu")["out"].to_f32()
    for run in range(2):
        sim.events.clear()
        np.testing.assert_array_equal(run_segments(g, mgr, DeviceReadingCPU(sim, mgr), sim), ref)
        ev = sim.events
        marks = {e[1]: i for i, e in enumerate(ev) if e[0] == "mark"}
        copies = [(i, e) for i, e in enumerate(ev) if e[0] == "upload" and e[1] == "copy"]
        assert len(copies) == 3                              # segments 1, 2, 3 prefetched
        for k, (i, up) in enumerate(copies):
            # issued while segment k runs (after its begin, before its end mark) ...
            assert (marks.get(f"end {k - 1}", -1)) < i < marks[f"end {k}"]
            # ... into memory the compute stream is done with ...
            rec = [j for j, e in enumerate(ev[:i]) if e[0] == "record"]
            assert rec and ev[rec[-1] + 1][:2] == ("wait", "copy")
            # ... and the compute stream waits for it before segment k + 1
            w = [j for j, e in enumerate(ev) if e[0] == "wait" and e[1] == "compute" and e[2] == up[4]]
            assert w and marks[f"end {k}"] < w[0] < marks[f"end {k + 1}"]
        assert sim.peak_used <= 2 * U
    # --disable-prefetch: the same streaming, all on the compute stream
    sim2 = SimulatedDevice(64 * U)
    mgr2 = manager(sim2, act + 2 * U, prefetch=False)
    mgr2.register(ws, "diffusion")
    np.testing.assert_array_equal(run_segments(g, mgr2, DeviceReadingCPU(sim2, mgr2), sim2), ref)
    assert uploads(sim2, "copy") == [] and len(uploads(sim2, "compute")) == 4


def test_streaming_evicts_the_block_needed_last():
    """Cyclic sweeps: with room for 3 of 4 weights, a run reloads one or two of them, not all four
    (LRU would evict exactly the next one every time: 4 uploads per run)."""
    g, ws, _ = chain([1, 1, 1, 1])
    act = g._plan.arena_bytes + g._plan.cross_bytes + g._plan.output_bytes
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim, act + 3 * U, prefetch=False)
    mgr.register(ws, "diffusion")
    be = DeviceReadingCPU(sim, mgr)
    ref = g.run("cpu")["out"].to_f32()
    later = []
    for run in range(4):
        np.testing.assert_array_equal(run_segments(g, mgr, be), ref)
        if run:
            later.append(mgr.stats.uploaded // U)
    assert later == [1, 1, 2]            # Belady on a 4-cycle with 3 slots: 4 misses in 3 sweeps


def tiny_unet():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_unet import load, model
    m = model("sd1")
    table, a, _ = load("sd1")
    leaves = [Tensor.from_numpy(np.ascontiguousarray(a[k], dtype=np.float32)) for k in ("x", "t", "context")]
    x = leaves[0]
    g = F.Graph({"out": m.forward(x, leaves[1], leaves[2])})
    g._plan = g.plan()
    return g, table


def test_unet_streams_under_a_small_budget_with_identical_output():
    g, table = tiny_unet()
    plan = g._plan
    act = plan.arena_bytes + plan.cross_bytes + plan.output_bytes
    sim = SimulatedDevice(act + 8 * 2**20)
    probe = manager(sim)
    probe.register(table, "diffusion")
    info = probe._plan_info(plan)
    seg_bytes = [info.weight_bytes(k) for k in range(len(plan.segments))]
    total, largest = sum(seg_bytes), max(seg_bytes)
    assert len(plan.segments) > 10 and total > 3 * largest
    budget = act + max(largest + 4096, total // 3)      # about a third of the weights at a time
    ref = g.run("cpu")["out"].to_f32()
    for prefetch in (True, False):
        sim = SimulatedDevice(act + 8 * 2**20)
        mgr = manager(sim, budget, prefetch=prefetch)
        mgr.register(table, "diffusion")
        be = DeviceReadingCPU(sim, mgr)
        for run in range(2):
            out = run_segments(g, mgr, be)
            np.testing.assert_array_equal(out, ref)
            assert mgr.stats.uploaded > 0 and mgr.stats.evicted > 0        # it streamed
            assert sim.peak_used <= budget - act
        assert mgr.peak_bytes <= budget
    # an ample budget: second run uploads nothing
    sim = SimulatedDevice(act + 8 * 2**20)
    mgr = manager(sim, act + total + 2**20)
    mgr.register(table, "diffusion")
    be = DeviceReadingCPU(sim, mgr)
    run_segments(g, mgr, be)
    np.testing.assert_array_equal(run_segments(g, mgr, be), ref)
    assert mgr.stats.uploaded == 0


def test_segment_split_is_logged(caplog):
    g, ws, _ = chain([1, 2])
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim)
    mgr.register(ws, "diffusion")
    with caplog.at_level("INFO", logger="sdrt"):
        run_segments(g, mgr, DeviceReadingCPU(sim, mgr))
    text = caplog.text
    assert "diffusion graph, 3 segments, weights 0.2 MB" in text
    assert "segment weights (MB): l0 0.1, l1 0.1, final 0.0" in text
    assert "run 1 uploaded 0.2 MB in 2 blocks" in text and "peak" in text


# ---- budgets ----------------------------------------------------------------------------------------

def test_max_vram_arithmetic():
    assert resolve_budget(6, 10 * GiB) == 6 * GiB                 # positive: that budget
    assert resolve_budget(0, 10 * GiB) is None                    # 0: live free memory
    assert resolve_budget(None, 10 * GiB) is None
    assert resolve_budget(-1, 10 * GiB) == 9 * GiB                # negative: keep that much free
    assert resolve_budget(-1.5, 1 * GiB) == 0
    sim = SimulatedDevice(8 * U, used_elsewhere=2 * U)
    mgr = manager(sim, budget_bytes=None)
    assert mgr.budget is None
    neg = ResidencyManager(sim, max_vram=-(2 * U) / GiB)         # 6U free now, keep 2U: budget 4U
    assert neg.budget == 4 * U
    with pytest.raises(DeviceOutOfMemoryError, match="keeps .* GiB free, but only 0.4 MB is free"):
        ResidencyManager(sim, max_vram=-1)


def test_a_positive_budget_counts_what_the_process_holds_outside_the_allocator(caplog):
    """--max-vram N (positive) caps the process's whole device use: the CUDA context and libraries
    (memory.outside_bytes) come off sdrt's share; a negative budget (free memory once the context is
    made) does not take them off again; when they alone reach the budget, the error says so."""
    sim = SimulatedDevice(256 * U, outside=20 * U)
    mgr = manager(sim, 64 * U)
    assert (mgr.limit, mgr.outside, mgr.budget) == (64 * U, 20 * U, 44 * U)
    g, ws, _ = chain([16, 16, 16])
    mgr.register(ws, "diffusion")
    with caplog.at_level("INFO", logger="sdrt"):
        out = run_segments(g, mgr, DeviceReadingCPU(sim, mgr))
    np.testing.assert_allclose(out, g.run("cpu")["out"].to_f32())
    assert mgr.stats.held_peak <= 44 * U
    assert f"--max-vram budget {mib(44 * U):.1f} MB ({mib(64 * U):.1f} MB less {mib(20 * U):.1f} MB" in caplog.text
    fresh = SimulatedDevice(256 * U, outside=20 * U)
    assert ResidencyManager(fresh, max_vram=-(100 * U) / GiB).budget == 156 * U
    with pytest.raises(DeviceOutOfMemoryError, match="context and libraries already hold"):
        manager(SimulatedDevice(256 * U, outside=64 * U), 64 * U)


def test_live_free_memory_budget_follows_other_users():
    sim = SimulatedDevice(5 * U, used_elsewhere=U)
    mgr = ResidencyManager(sim, max_vram=0)
    ws = [weight(1, i) for i in range(5)]
    mgr.register(ws, "diffusion")
    for k, w in enumerate(ws[:4]):
        mgr.begin_segment(k, None, [w])
        mgr.end_segment(k)
    assert all(mgr.is_resident(w) for w in ws[:4])
    sim.used_elsewhere = 2 * U                                    # someone else took more
    mgr.begin_segment(4, None, [ws[4]])
    assert sum(mgr.is_resident(w) for w in ws) == 3 and mgr.is_resident(ws[4])
    assert not mgr.is_resident(ws[0]) and not mgr.is_resident(ws[1])  # the two least recent


def test_positive_budget_caps_below_free_memory():
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim, 2 * U)
    ws = [weight(1, i) for i in range(3)]
    mgr.register(ws, "te")
    for k, w in enumerate(ws):
        mgr.begin_segment(k, None, [w])
        mgr.end_segment(k)
    assert sum(mgr.is_resident(w) for w in ws) == 2 and sim.peak_used == 2 * U


def test_impossible_budgets_raise_with_sizes():
    g, ws, _ = chain([1, 4, 1])
    plan = g._plan
    act = plan.arena_bytes + plan.cross_bytes + plan.output_bytes
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim, act + 3 * U)
    mgr.register(ws, "diffusion")
    with pytest.raises(DeviceOutOfMemoryError, match=r"largest segment 'l1' needs 0\.2 MB of weights \+ .* of "
                                                     r"activations, over the --max-vram budget"):
        mgr.begin_graph(plan)
    g, ws, _ = chain([1, 1, 1])
    plan = g._plan
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim, act + 2 * U, segmented=False)
    mgr.register(ws, "diffusion")
    with pytest.raises(DeviceOutOfMemoryError, match=r"weights need 0\.2 MB at once \(--disable-segmented-compute\)"):
        mgr.begin_graph(plan)
    mgr = manager(SimulatedDevice(64 * U), act + 2 * U)            # segmented: the same budget works
    mgr.register(ws, "diffusion")
    mgr.begin_graph(plan)


def test_disabled_segmentation_pins_the_whole_graph():
    g, ws, _ = chain([1, 1, 1])
    sim = SimulatedDevice(3 * U)                                   # live memory: exactly the weights
    mgr = ResidencyManager(sim, max_vram=0, segmented=False)
    mgr.register(ws, "diffusion")
    ref = g.run("cpu")["out"].to_f32()
    np.testing.assert_array_equal(run_segments(g, mgr, DeviceReadingCPU(sim, mgr), sim), ref)
    ev = sim.events
    end0 = ev.index(("mark", "end 0"))
    assert [e[3] for e in uploads(sim)] == [U] * 3 and all(ev.index(u) < end0 for u in uploads(sim))
    assert uploads(sim, "copy") == [] and not any(e[0] == "free" for e in ev)
    sim2 = SimulatedDevice(2 * U)                                  # live memory too small: clear error
    mgr2 = ResidencyManager(sim2, max_vram=0, segmented=False)
    mgr2.register(ws, "diffusion")
    with pytest.raises(DeviceOutOfMemoryError, match=r"cannot make room for 0\.2 MB of weights.*0\.1 MB free of 0\.1 MB; "
                                                     r"with --disable-segmented-compute all 0\.2 MB"):
        run_segments(g, mgr2, DeviceReadingCPU(sim2, mgr2))


# ---- disk params ------------------------------------------------------------------------------------

def _rss_of_mapping(storage) -> int:
    """Resident bytes of the process mapping that holds `storage` (Linux /proc/self/smaps)."""
    addr = storage.ctypes.data
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    return rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_disk_params_drop_file_pages_cpu_params_keep_them(tmp_path):
    from sdrt.io.base import map_file
    data = {}
    maps = {}
    for kind in ("disk", "cpu"):
        p = tmp_path / f"{kind}.bin"
        data[kind] = np.random.default_rng(len(kind)).integers(0, 255, 32 * U, dtype=np.uint8)
        p.write_bytes(data[kind].tobytes())
        maps[kind] = map_file(str(p))[0]
    sim = SimulatedDevice(64 * U)
    mgr = manager(sim)
    leaves = {}
    for kind, mm in maps.items():
        leaves[kind] = [Tensor.from_buffer(mm, "F32", (4 * N,), offset=i * 4 * U, name=f"{kind}{i}")
                        for i in range(8)]
        mgr.register(leaves[kind], "diffusion", params=kind)
    assert _rss_of_mapping(maps["disk"]) == 0                       # registering reads nothing
    mgr.begin_segment(0, None, leaves["disk"] + leaves["cpu"])
    for kind in maps:
        for i, t in enumerate(leaves[kind]):
            np.testing.assert_array_equal(sim.view(mgr.device_ptr(t), 4 * U), data[kind][i * 4 * U:(i + 1) * 4 * U])
    assert _rss_of_mapping(maps["disk"]) < U                        # dropped right after staging
    assert _rss_of_mapping(maps["cpu"]) >= 32 * U - 4096            # host copy kept
    # CPU compute with disk params: pages are dropped after each segment
    host = HostPageRelease()
    host.register(leaves["cpu"][:4], "te", params="disk")
    host.begin_segment(0, None, leaves["cpu"])
    for i, t in enumerate(leaves["cpu"]):                          # the CPU kernels read the map
        np.testing.assert_array_equal(t.numpy().view(np.uint8), data["cpu"][i * 4 * U:(i + 1) * 4 * U])
    host.end_segment(0)
    assert host.released_bytes == 16 * U
    # (at least the released half is gone: the kernel may unmap a whole large folio, which is
    # still correct: pages fault back in from the page cache)
    assert _rss_of_mapping(maps["cpu"]) <= 16 * U + 4096
    # RAM arrays are never touched
    ram = np.ones(U, np.uint8)
    assert not release_file_pages(ram, 0, U) and ram.sum() == U


def test_cpu_params_from_a_file_are_uploaded_from_pinned_copies(tmp_path):
    """--offload-to-cpu on a device with a pinned pool: a `cpu` weight read from the file map is
    copied into the pool on its first upload (its file pages dropped) and every upload after
    that, re-staged after an eviction, comes from the copy; `disk` weights and RAM weights never
    go there; a full pool leaves the rest on the plain path; the bytes are the same."""
    from sdrt.io.base import map_file
    p = tmp_path / "w.bin"
    data = np.random.default_rng(5).integers(0, 255, 16 * U, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    mm = map_file(str(p))[0]
    cpu = [Tensor.from_buffer(mm, "F32", (4 * N,), offset=i * 4 * U, name=f"c{i}") for i in range(2)]
    disk = [Tensor.from_buffer(mm, "F32", (4 * N,), offset=(2 + i) * 4 * U, name=f"d{i}") for i in range(2)]
    ram = weight(4, 9, "ram")
    sim = SimulatedDevice(64 * U, pinned_limit=6 * U)         # room for one of the two cpu weights
    mgr = manager(sim, block_bytes=4 * U)
    mgr.register(cpu + [ram], "diffusion", params="cpu")
    mgr.register(disk, "diffusion", params="disk")
    everything = cpu + disk + [ram]
    for run in range(2):
        sim.events.clear()
        mgr.begin_segment(0, None, everything)
        for i, t in enumerate(cpu + disk):
            np.testing.assert_array_equal(sim.view(mgr.device_ptr(t), 4 * U), data[i * 4 * U:(i + 1) * 4 * U])
        np.testing.assert_array_equal(sim.view(mgr.device_ptr(ram), 4 * U), ram.numpy().view(np.uint8))
        mgr.end_segment(0)
        kinds = sorted(e[0] for e in sim.events if e[0].startswith("upload"))
        assert kinds == ["upload"] * 4 + ["upload_pinned"], run   # c0 pinned; c1 (pool full), d0, d1, ram not
        assert mgr.stats.pinned == 4 * U                       # (no begin_graph: not reset) copied once
        assert mgr._entries[id(cpu[0].owner)].pinned is not None
        assert mgr._entries[id(cpu[1].owner)].pinned is None
        mgr.release_all()                                      # evicted: staged again from the copy
    assert _rss_of_mapping(mm) < 8 * U                         # c0's pages dropped, d0/d1's too


# ---- one budget per device: te + unet + vae on a GPU that keeps arenas and caches freed blocks -----

class SimGpu:
    """The CUDA backend's device-memory behaviour on a SimulatedDevice (the kernels are the CPU
    ones, reading managed weights from the device's bytes): `res.begin_graph(plan, scratch)`
    first, then each graph's state (arena, cross-segment, outputs, inputs) is allocated once and
    kept for its later runs until the Graph is garbage or `release_graphs` frees it; one scratch
    buffer for every graph; an allocation that fails asks `res.make_room` and is retried once.
    Marks in the device's event log: "state <label>" after a graph's state is allocated,
    "release <label>" when it is released."""
    name = "cuda0"

    def __init__(self, sim, scratch_bytes: int = 0):
        import weakref
        self.memory = sim
        self.scratch_bytes = scratch_bytes
        if scratch_bytes:
            sim.alloc(scratch_bytes)
        self.states = weakref.WeakKeyDictionary()
        self.retries = 0

    def find(self, node):
        from sdrt.ops.cpu import CPU
        return CPU.find(node)

    def alloc(self, nbytes, residency):
        try:
            return self.memory.alloc(nbytes)
        except DeviceOutOfMemoryError:
            self.retries += 1
            residency.make_room(nbytes)
            return self.memory.alloc(nbytes)

    def graph_bytes(self, plan=None):
        mine = sum(st.nbytes for st in self.states.values() if st.plan is plan)
        return mine, sum(st.nbytes for st in self.states.values()) - mine

    def release_graphs(self, keep_plan=None):
        freed = 0
        for g, st in list(self.states.items()):
            if st.plan is not keep_plan:
                del self.states[g]
                freed += st.release()
                self.memory.mark(f"release {st.label}")
        return freed

    def run_graph(self, graph, plan, on_segment=None, residency=None):
        residency.begin_graph(plan, self.scratch_bytes)
        st = self.states.get(graph)
        if st is None or st.plan is not plan:
            st = self.states[graph] = _SimGraphState(self, graph, plan, residency)
            self.memory.mark(f"state {st.label}")
        return graph.run(DeviceReadingCPU(self.memory, residency), on_segment, residency=residency)


class _SimGraphState:
    def __init__(self, gpu, graph, plan, residency):
        self.gpu, self.plan, self.label = gpu, plan, getattr(graph, "label", "")
        inputs = {id(s.owner): s.owner for n in graph.nodes for s in n.src
                  if s.owner.op is None and not residency.manages(s)}
        sizes = [plan.arena_bytes, plan.cross_bytes, plan.output_bytes] + [o.span_bytes() for o in inputs.values()]
        self.ptrs = [gpu.alloc(n, residency) for n in sizes if n]
        self.nbytes = sum(sizes)

    def release(self) -> int:
        for p in self.ptrs:
            self.gpu.memory.free(p)
        self.ptrs = []
        return self.nbytes

    def __del__(self):          # the Graph is garbage: its device state goes (as _GraphState's)
        self.release()


def vae_like(w: Tensor, rows: int = 24, label: str = "vae"):
    """A VAE decode's shape: a small latent, one small weight `w` (N floats), big activations
    (rows * U bytes per intermediate, one segment)."""
    z = Tensor.from_numpy(np.linspace(-1, 1, N, dtype=np.float32), name="z")
    r = F.repeat(z, (N, rows))
    h = F.scale(F.add(r, w), 0.5)   # add and scales run in place; r stays live to the end, so
    g = F.Graph({"out": F.add(F.scale(h, 1.0), r)})  # two intermediates are alive at once
    g._plan, g.label = g.plan(), label
    return g


def activation(plan) -> int:
    return plan.arena_bytes + plan.cross_bytes + plan.output_bytes


def frees_after(sim, label):
    i = sim.events.index(("mark", label))
    return [e[1] for e in sim.events[i:] if e[0] == "free"]


def test_caching_simulated_device_holds_freed_blocks_like_the_cuda_allocator():
    sim = SimulatedDevice(64 * U, caching=True)
    assert [sim.round_size(n) for n in (1, 513, 5 * U, 5 * U + 1, 9 * U)] == [512, 1024, 5 * U, 5 * U + U // 2, 9 * U]
    a = sim.alloc(8 * U)
    sim.free(a)
    assert sim.stats() == {"in_use": 0, "cached": 8 * U} and sim.mem_get_info()[0] == 56 * U
    assert sim.alloc(8 * U) == a and sim.cached == 0          # the same class comes back from the cache
    b = sim.alloc(6 * U)
    sim.free(b)
    c = sim.alloc(7 * U)                                      # another class: fresh memory, the cache stays
    assert c != b and sim.cached == 6 * U and sim.peak_held == 21 * U and sim.peak_used == 15 * U
    sim.free(a)
    sim.free(c)
    assert sim.cached == 21 * U and sim.mem_get_info()[0] == 43 * U
    assert sim.alloc(48 * U) == sim.BASE                      # fits once the cache is given back
    assert sim.cached == 0 and ("release", b, 6 * U) in sim.events


SCRATCH = 2 * U


def three_components():
    """SDXL's case at toy size: a text encoder that fits, a UNet that streams, a VAE whose
    activations fit only once the UNet's weights are evicted and its arenas released. Returns
    the graphs (labelled), their weights by component, and the budget."""
    te, te_ws, _ = chain([6, 6, 6, 6], seed=10)
    unet, unet_ws, _ = chain([10, 8, 10, 9, 10, 7, 10, 10], seed=20, width=4)
    vae_ws = [weight(1, 30)]
    vae = vae_like(vae_ws[0])
    te.label, unet.label = "te", "unet"
    # the VAE's activations + weight + latent + scratch, with 2U to spare: less than the UNet's
    # arenas (12U, kept for its next run) would need beside them
    budget = activation(vae._plan) + 2 * U + SCRATCH + 2 * U
    assert budget < activation(vae._plan) + 2 * U + SCRATCH + activation(unet._plan)
    assert 74 * U + activation(unet._plan) + SCRATCH > budget                         # the UNet streams
    assert 24 * U + activation(te._plan) + SCRATCH < budget                           # the te fits
    return (te, unet, vae), {"te": te_ws, "diffusion": unet_ws, "vae": vae_ws}, budget


def test_te_unet_vae_share_one_budget_on_the_device(caplog):
    """The device's footprint (in use + the allocator's cache) never goes over the one budget."""
    from sdrt.engine.residency import PlacedBackend
    (te, unet, vae), weights, budget = three_components()
    te_ws, unet_ws, vae_ws = weights["te"], weights["diffusion"], weights["vae"]
    refs = {g: g.run("cpu")["out"].to_f32() for g in (te, unet)}
    vae_ref = vae.run("cpu")["out"].to_f32()
    sim = SimulatedDevice(4 * budget, caching=True)
    gpu = SimGpu(sim, SCRATCH)
    mgr = ResidencyManager(sim, max_vram=budget / GiB, graphs=gpu)
    for comp, ws in weights.items():
        mgr.register(ws, comp)
    on = PlacedBackend(gpu, mgr)
    with caplog.at_level("INFO", logger="sdrt"):
        np.testing.assert_array_equal(te.run(on)["out"].to_f32(), refs[te])
        te_ptrs = {mgr.device_ptr(w) for w in te_ws}
        assert mgr.all_resident(te._plan)
        sim.mark("unet")
        for _ in range(3):
            np.testing.assert_array_equal(unet.run(on)["out"].to_f32(), refs[unet])
            assert mgr.stats.uploaded > 0 and mgr.stats.held_peak <= budget
        # the te's weights were the first to go when the UNet needed room
        first = frees_after(sim, "unet")[:len(te_ws)]
        assert set(first) == te_ptrs and not any(mgr.is_resident(w) for w in te_ws)
        sim.mark("vae")
        np.testing.assert_array_equal(vae.run(on)["out"].to_f32(), vae_ref)
        # the UNet's arenas went (after its weights) before the VAE's were allocated
        ev = sim.events
        assert ev.index(("mark", "release unet")) < ev.index(("mark", "state vae"))
        assert unet not in gpu.states and vae in gpu.states
        assert not any(mgr.is_resident(w) for w in unet_ws)
        # a second image: a new te graph (as the conditioner builds one per prompt), the UNet
        # again, a new VAE graph; the old VAE graph is garbage: its arenas wait in the allocator's
        # cache, given back when the te needs the room
        vae_act = activation(vae._plan)
        del vae
        assert sim.cached >= vae_act
        te2, _, _ = chain([6, 6, 6, 6], seed=10)
        te2.label = "te2"
        np.testing.assert_array_equal(te2.run(on)["out"].to_f32(), refs[te])
        assert sim.cached < vae_act
        np.testing.assert_array_equal(unet.run(on)["out"].to_f32(), refs[unet])
        vae2 = vae_like(vae_ws[0], label="vae2")
        np.testing.assert_array_equal(vae2.run(on)["out"].to_f32(), vae_ref)
    assert sim.peak_held <= budget
    text = caplog.text
    assert "(one for diffusion, te, vae on sim0)" in text
    assert "device peak" in text and f"vs the --max-vram budget {budget / 2**20:.1f} MB;" in text
    assert "(over it)" not in text and "over the --max-vram" not in text


def test_without_the_backends_graph_methods_the_run_goes_over_and_says_so(caplog):
    """A backend that cannot release its idle graphs' arenas: the manager cannot keep the budget;
    the run still completes (weights + activations fit), with a warning and the per-run line."""
    from sdrt.engine.residency import PlacedBackend
    (te, _, vae), weights, budget = three_components()
    sim = SimulatedDevice(4 * budget, caching=True)
    gpu = SimGpu(sim, SCRATCH)
    mgr = ResidencyManager(sim, max_vram=budget / GiB)
    for comp, ws in weights.items():
        mgr.register(ws, comp)
    on = PlacedBackend(gpu, mgr)
    te.run(on)
    with caplog.at_level("INFO", logger="sdrt"):
        np.testing.assert_array_equal(vae.run(on)["out"].to_f32(), vae.run("cpu")["out"].to_f32())
    assert sim.peak_held > budget and te in gpu.states
    assert "over the --max-vram budget" in caplog.text and "the residency manager cannot free" in caplog.text
    assert f"vs the --max-vram budget {budget / 2**20:.1f} MB (over it)" in caplog.text


def test_full_blocks_are_allocated_whole_and_reused_from_the_cache():
    """Blocks filled past 7/8 take a whole block_bytes: when streaming evicts one into the
    allocator's cache, the next staging takes it back, nothing is given back to the driver."""
    g, ws, _ = chain([7.5, 7.25, 7.75, 7.5])
    sim = SimulatedDevice(64 * U, caching=True)
    budget = activation(g._plan) + 3 * 8 * U                    # three of the four blocks at a time
    mgr = manager(sim, budget, block_bytes=8 * U)
    mgr.register(ws, "diffusion")
    ref = g.run("cpu")["out"].to_f32()
    be = DeviceReadingCPU(sim, mgr)
    for run in range(4):
        sim.events.clear()
        np.testing.assert_array_equal(run_segments(g, mgr, be), ref)
        assert {e[2] for e in sim.events if e[0] == "alloc"} == {8 * U} and mgr.stats.uploaded > 0
        if run:         # steady streaming: evicted blocks come back from the cache as they are
            assert not any(e[0] == "release" for e in sim.events)
    assert sim.peak_held <= budget - activation(g._plan)


def test_a_failed_backend_allocation_makes_room_and_is_retried():
    """Live memory (no budget): the VAE's arena does not fit beside the te's weights and the te
    graph's arenas; make_room evicts the weights, releases the idle graph, and the retry fits."""
    from sdrt.engine.residency import PlacedBackend
    te, te_ws, _ = chain([6, 6, 6, 6], seed=10)
    te.label = "te"
    vae_w = weight(1, 30)
    vae = vae_like(vae_w, rows=16)
    sim = SimulatedDevice(60 * U, caching=True)
    gpu = SimGpu(sim, 2 * U)
    mgr = ResidencyManager(sim, max_vram=0, graphs=gpu)
    mgr.register(te_ws, "te")
    mgr.register([vae_w], "vae")
    on = PlacedBackend(gpu, mgr)
    np.testing.assert_array_equal(te.run(on)["out"].to_f32(), te.run("cpu")["out"].to_f32())
    assert mgr.all_resident(te._plan) and gpu.retries == 0
    np.testing.assert_array_equal(vae.run(on)["out"].to_f32(), vae.run("cpu")["out"].to_f32())
    assert gpu.retries == 1 and ("mark", "release te") in sim.events
    assert not any(mgr.is_resident(w) for w in te_ws) and mgr.is_resident(vae_w)


# ---- the CUDA backend's graph-memory methods, on a stand-in device ----------------------------------

class StandInCudaDevice:
    """What CudaBackend's graph-memory code uses of a CudaDevice: the allocator (here a caching
    SimulatedDevice), defer(fn) and activate() (which runs the deferred frees)."""

    def __init__(self, sim):
        self.allocator, self._deferred = sim, []

    def defer(self, fn):
        self._deferred.append(fn)

    def activate(self):
        todo, self._deferred = self._deferred, []
        for fn in todo:
            fn()


@pytest.fixture
def standin_cuda(monkeypatch):
    """A CudaBackend whose device is a StandInCudaDevice over a caching SimulatedDevice (host
    buffers instead of pinned ones, a no-op kernel for every node: graphs are laid out, not run)."""
    import threading
    import weakref

    from sdrt.gpu.cuda import backend as cb

    class HostBuffer:
        def __init__(self, device, nbytes):
            self.array, self.nbytes, self.ptr = np.empty(nbytes, np.uint8), nbytes, 0

        def close(self):
            pass

    monkeypatch.setattr(cb, "PinnedBuffer", HostBuffer)
    sim = SimulatedDevice(72 * U, caching=True)
    be = object.__new__(cb.CudaBackend)
    be.name, be.device, be.memory = "cuda0", StandInCudaDevice(sim), sim
    be._states, be._lock, be._registered = weakref.WeakKeyDictionary(), threading.RLock(), cb._LiveStorages()
    be.find = lambda node: Kernel(node.op, None, None)
    return be, cb._GraphState, sim


def test_cuda_backend_counts_releases_and_makes_room_for_graph_state(standin_cuda):
    be, GraphState, sim = standin_cuda
    te, te_ws, _ = chain([6, 6, 6, 6], seed=10)
    vae_w = weight(1, 30)
    vae = vae_like(vae_w, rows=16)
    mgr = ResidencyManager(sim, max_vram=0, graphs=be)
    mgr.register(te_ws, "te")
    mgr.register([vae_w], "vae")
    be.register_weights(te_ws + [vae_w])
    inputs = {"te": U, "vae": U}                        # x and z: the graphs' only inputs
    be._states[te] = GraphState(be, te, te._plan, mgr)
    te_bytes = activation(te._plan) + inputs["te"]
    assert be.graph_bytes(te._plan) == (te_bytes, 0) and be.graph_bytes(None) == (0, te_bytes)
    for k, seg in enumerate(te._plan.segments):         # the te's weights, resident
        mgr.begin_segment(k, seg.name, [s for n in seg.nodes for s in n.src if s.owner.op is None])
        mgr.end_segment(k)
    assert mgr.resident_bytes == 24 * U
    # the VAE's state does not fit beside them on this 72U device: the backend's allocation
    # fails, make_room evicts te weights (into the allocator's cache, then gives that back), the
    # retry fits
    vae_bytes = activation(vae._plan) + inputs["vae"]
    assert vae_bytes > 72 * U - 24 * U - te_bytes
    mgr.begin_graph(vae._plan)
    be._states[vae] = GraphState(be, vae, vae._plan, mgr)
    assert be.graph_bytes(vae._plan) == (vae_bytes, te_bytes)
    assert 0 < mgr.resident_bytes < 24 * U and mgr.evictions and sim.cached == 0
    # release_graphs frees every graph's state but the one kept (into the allocator's cache)
    used = sim.used
    assert be.release_graphs(vae._plan) == te_bytes and te not in be._states and vae in be._states
    assert used - sim.used >= te_bytes and sim.cached == used - sim.used


class _WithoutOutside:
    """A device-memory object less its outside_bytes."""

    def __init__(self, memory):
        self._memory = memory

    def __getattr__(self, name):
        if name == "outside_bytes":
            raise AttributeError(name)
        return getattr(self._memory, name)


@pytest.mark.gpu
def test_cuda_te_unet_vae_share_one_budget():
    """On a GPU (skips without one): the three components through the CUDA backend under one
    budget just above what the VAE needs besides what the device already holds; the footprint
    the allocator reports (in use + cached) stays within it at every check, the UNet's arenas
    are released for the VAE, and the outputs are the CPU's."""
    from sdrt.engine.residency import PlacedBackend
    from sdrt.gpu import cuda
    if not cuda.available():
        pytest.skip(f"no CUDA device: {cuda.unavailable_reason()}")
    from sdrt.ops.backend import get_backend
    be = get_backend("cuda0")
    (te, unet, vae), weights, need = three_components()
    be.release_graphs(None)                 # other tests' graphs
    be.memory.synchronize()
    be.memory.empty_cache()
    budget = be.memory.stats()["in_use"] + need        # what stays held (scratch included) + the toy need
    # a budget of a few MB: the process's use outside the allocator (which a positive budget counts,
    # and which the driver's page rounding of these small blocks moves) is left out here
    mgr = ResidencyManager(_WithoutOutside(be.memory), max_vram=budget / GiB, graphs=be)
    for comp, ws in weights.items():
        be.register_weights(ws)             # writeable numpy weights: weights, not per-run inputs
        mgr.register(ws, comp)
    on = PlacedBackend(be, mgr)
    try:
        for g, runs in ((te, 1), (unet, 3), (vae, 1)):
            for _ in range(runs):
                np.testing.assert_allclose(g.run(on)["out"].to_f32(), g.run("cpu")["out"].to_f32(), rtol=1e-6, atol=1e-6)
                assert mgr.stats.held_peak <= budget
        assert not any(mgr.is_resident(w) for w in weights["te"] + weights["diffusion"])
        assert be.graph_bytes(vae._plan)[0] > 0 and be.graph_bytes(unet._plan)[0] == 0
    finally:
        mgr.release_all()
        be.release_graphs(None)
