"""The Vulkan backend (sdrt/gpu/vulkan; docs/vulkan.md) beyond the op x backend walk in
test_backend_ops.py: the shipped SPIR-V matches its GLSL sources, `import sdrt` stays free of
the binding, device listing, command buffers reused across runs, and mixed placement (a node
with no Vulkan kernel runs on the CPU between recorded batches). Device tests carry the
`vulkan` marker and skip without a Vulkan device (CI installs Mesa's lavapipe: .ci/run)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import sdrt.gpu  # noqa: E402,F401 - registers the device backends (docs/ops.md's column order)
from sdrt.gpu.vulkan import shaders  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _device():
    from sdrt.gpu import vulkan
    why = vulkan.unavailable_reason()
    if why is not None:
        pytest.skip(f"no Vulkan device: {why}")
    from sdrt.ops.backend import get_backend
    return get_backend("vulkan0")


# ---- host-side: no device needed ----------------------------------------------------------------
def test_manifest_names_every_shader_with_its_source_digest():
    with open(os.path.join(shaders.HERE, "manifest.json")) as f:
        manifest = json.load(f)
    assert sorted(manifest["sources"]) == shaders.families()
    stale = [fam for fam in shaders.families() if manifest["sources"][fam] != shaders.source_digest(fam)]
    assert not stale, f"shaders changed since their .spv were built: {stale}; run python tools/build_vulkan_shaders.py"
    for fam in shaders.families():
        spv = shaders.spirv(fam)
        assert spv[:4] == b"\x03\x02\x23\x07", f"{fam}.spv is not SPIR-V"


def test_shipped_spirv_matches_a_fresh_compile():
    import build_vulkan_shaders as build
    compiler = shutil.which("glslangValidator")
    if compiler is None:
        pytest.skip("glslangValidator not installed (Debian: glslang-tools)")
    with open(os.path.join(shaders.HERE, "manifest.json")) as f:
        if json.load(f)["compiler"] != build.compiler_version(compiler):
            pytest.skip("a different glslang version than the one that built the shipped SPIR-V")
    for fam in shaders.families():
        assert build.compile_family(compiler, fam) == shaders.spirv(fam), \
            f"{fam}.spv is stale: run python tools/build_vulkan_shaders.py"


def test_import_sdrt_does_not_import_the_binding():
    code = ("import sys, sdrt, sdrt.ops.backend as b; b.backend_kernels('vulkan'); "
            "print('vulkan' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_without_the_binding_vulkan_says_why(monkeypatch):
    import importlib.util

    from sdrt.gpu import vulkan
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vulkan" else real(name, *a))
    assert "pip install 'sdrt[vulkan]'" in vulkan._probe_now()[0]


def test_kernel_table_loads_without_a_device():
    from sdrt.ops.backend import backend_kernels
    ops = backend_kernels("vulkan").ops()
    assert {"add", "silu", "mul_mat", "softmax", "group_norm", "conv2d", "attention", "get_rows"} <= set(ops)


# ---- on a device ---------------------------------------------------------------------------------
@pytest.mark.vulkan
def test_list_devices_names_vulkan0():
    _device()
    from sdrt.ops.backend import list_devices
    names = dict(list_devices())
    assert "vulkan0" in names and "GiB" in names["vulkan0"] and "Vulkan 1." in names["vulkan0"]


@pytest.mark.vulkan
def test_a_graph_is_recorded_once_and_replayed(rng):
    be = _device()
    from sdrt.ops import api as F
    from sdrt.ops.graph import Graph
    from sdrt.ops.tensor import Tensor
    xa = rng.standard_normal((3, 40, 33)).astype(np.float32)
    x = Tensor.from_numpy(xa)          # writeable storage: an input, copied in on every run
    w = Tensor.from_numpy(rng.standard_normal((17, 33)).astype(np.float32))
    w.owner.storage.flags.writeable = False    # read-only: a weight, uploaded once
    g = Graph(F.softmax(F.mul_mat(w, F.silu(x)), scale=0.5))
    first = g.run(be)["out"].numpy().copy()
    state = be._states[g]
    cmd = state.steps[0][1].cmd
    xa2 = rng.standard_normal(xa.shape).astype(np.float32)
    x.owner.storage[:] = xa2.reshape(-1).view(np.uint8)
    second = g.run(be)["out"].numpy()
    assert be._states[g] is state and state.steps[0][1].cmd is cmd and state.runs == 2
    want = Graph(F.softmax(F.mul_mat(w, F.silu(x)), scale=0.5)).run("cpu")["out"].numpy()
    np.testing.assert_allclose(second, want, rtol=1e-4, atol=1e-6)
    assert not np.allclose(first, second)


@pytest.mark.vulkan
def test_a_node_without_a_vulkan_kernel_runs_on_the_cpu_between_batches(rng):
    be = _device()
    from sdrt.ops import api as F
    from sdrt.ops.graph import Graph
    from sdrt.ops.registry import compare
    from sdrt.ops.tensor import Tensor
    x = Tensor.from_numpy(rng.standard_normal((2, 3, 5, 6)).astype(np.float32))
    f8 = F.cast(F.silu(x), "F8_E4M3")          # casts to and from F8 have no Vulkan kernel: on the CPU
    node = F.cast(f8, "F32")
    assert be.find(f8) is None and be.find(node) is None
    g = Graph(F.add(node, F.scale(node, 0.5)))
    got = g.run(be)["out"]
    assert [s[0] for s in be._states[g].steps] == ["gpu", "host", "host", "gpu"]
    assert compare(got, g.run("cpu")["out"]) < 1e-12


@pytest.mark.vulkan
def test_fallback_can_be_refused(monkeypatch, rng):
    be = _device()
    from sdrt.errors import UnsupportedError
    from sdrt.ops import api as F
    from sdrt.ops.graph import Graph
    from sdrt.ops.tensor import Tensor
    monkeypatch.setenv("SDRT_VULKAN_FALLBACK", "0")
    x = Tensor.from_numpy(rng.standard_normal((1, 2, 3, 4)).astype(np.float32))
    with pytest.raises(UnsupportedError, match="no kernel for cast"):
        Graph(F.cast(F.cast(x, "F8_E4M3"), "F32")).run(be)


@pytest.mark.vulkan
def test_the_tiny_sd1_unet_runs_whole_on_vulkan0():
    # 534 nodes (convs, group norms, attention, geglu, concat...) in recorded batches; the few
    # ops without a Vulkan kernel run on the CPU between them; the result is the CPU's
    be = _device()
    from test_unet import _graph

    from sdrt.ops.registry import compare
    g = _graph("sd1")
    assert compare(g.run(be)["out"], g.run("cpu")["out"]) < 1e-8


@pytest.mark.vulkan
def test_pipelines_go_through_a_disk_cache(monkeypatch, tmp_path):
    # a second process seeds its VkPipelineCache from the file the first one wrote (lavapipe's
    # cache holds only a header; NVIDIA's and AMD's hold the compiled pipelines)
    _device()
    from sdrt.gpu.vulkan.device import VulkanDevice
    monkeypatch.setenv("SDRT_VULKAN_CACHE", str(tmp_path))
    first = VulkanDevice(0)
    first.pipeline("elementwise", (0, 0, 0, 0, 11))
    assert first.save_pipeline_cache() > 0 and os.path.exists(first.cache_path)
    assert first.save_pipeline_cache() == 0          # nothing new since
    second = VulkanDevice(0)
    assert second.cache_path == first.cache_path
    assert second.pipeline_stats["cache_loaded_bytes"] == os.path.getsize(first.cache_path)
    monkeypatch.setenv("SDRT_VULKAN_CACHE", "0")
    assert VulkanDevice(0).cache_path is None


@pytest.mark.vulkan
def test_max_vram_streams_the_tiny_unet_weights_segment_by_segment():
    # a budget of about half the UNet's weights: the residency manager stages each segment's
    # weights and evicts others between segments; the image is the resident run's, bit for bit
    be = _device()
    from test_unet import _graph, load

    from sdrt.engine.residency import PlacedBackend, ResidencyManager
    from sdrt.ops.registry import compare
    table, _, _ = load("sd1")
    be.register_weights(table)
    weights = sum(t.nbytes for t in table.values())
    g = _graph("sd1")
    act = g.plan().arena_bytes + g.plan().cross_bytes + g.plan().output_bytes
    held = be.memory.stats()["in_use"]           # what earlier tests left on the device
    mgr = ResidencyManager(be.memory, max_vram=(held + act + weights // 2) / 2**30, graphs=be)
    mgr.register(table, "diffusion", "cpu")
    placed = PlacedBackend(be, mgr)
    streamed = [g.run(placed)["out"].to_f32() for _ in range(2)]
    assert mgr.stats.evicted > 0 and mgr.resident_bytes <= weights // 2 + 1
    mgr.release_all()
    resident = g.run(be)["out"].to_f32()
    assert np.array_equal(streamed[0], resident) and np.array_equal(streamed[1], resident)
    assert compare(g.run(be)["out"], g.run("cpu")["out"]) < 1e-8


@pytest.mark.vulkan
def test_preloaded_weights_are_the_ones_a_run_reads():
    # backend.preload_weights (the pipeline's upload before sampling) fills the cache the first run
    # would: the run then uploads nothing more and gives the CPU's output
    be = _device()
    from sdrt.ops import api as F
    from sdrt.ops.graph import Graph
    from sdrt.ops.tensor import Tensor
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 32)).astype(np.float32)
    w.flags.writeable = False                       # as a model file's memory map
    wt = Tensor.from_numpy(w)
    x = Tensor.from_numpy(rng.standard_normal((5, 32)).astype(np.float32))
    g = Graph(F.mul_mat(wt, x))
    before = be.weight_bytes()
    assert be.preload_weights([wt]) == w.nbytes and be.weight_bytes() == before + w.nbytes
    out = g.run(be)["out"].to_f32()
    assert be.weight_bytes() == before + w.nbytes
    np.testing.assert_allclose(out, g.run("cpu")["out"].to_f32(), rtol=1e-5, atol=1e-5)
    # a one-shot pipeline's stage end: the weight and the graph's buffers go; a later run uploads again
    assert be.release_weights([wt]) == w.nbytes and be.weight_bytes() == before and not be.graph_bytes()[1]
    np.testing.assert_array_equal(g.run(be)["out"].to_f32(), out)
    assert be.weight_bytes() == before + w.nbytes
    be.release_weights([wt])


def test_the_sub_allocator_carves_blocks_and_merges_free_runs():
    from sdrt.gpu.vulkan.device import _Buffer
    b = _Buffer(None, None, 1024, pooled=True)
    offs = [b.take(256) for _ in range(4)]
    assert offs == [0, 256, 512, 768] and b.take(256) is None and b.used == 1024
    b.give(256, 256)
    b.give(768, 256)
    assert b.take(512) is None                   # two runs of 256, not adjacent
    b.give(512, 256)                             # 256..1024 merges into one run
    assert b.free == [(256, 768)] and b.take(512) == 256 and b.used == 768
    b.give(0, 256)
    b.give(256, 512)
    assert b.free == [(0, 1024)] and b.used == 0


@pytest.mark.vulkan
def test_device_memory_comes_from_pooled_blocks():
    be = _device()
    d = be.device
    before = d.stats()
    ptrs = [d.alloc(n) for n in (100, 5000, 2**20)]
    assert len({p >> 40 for p in ptrs}) == 1                 # one block's buffer
    assert d.stats()["buffers"] <= before["buffers"] + 1
    data = np.arange(1250, dtype=np.float32)
    d.upload(ptrs[1], data)
    back = np.empty_like(data)
    d.download(back, ptrs[1])
    assert np.array_equal(back, data)
    for p in ptrs:
        d.free(p)
    assert d.stats()["in_use"] == before["in_use"]
