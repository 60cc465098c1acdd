"""The backend registry (sdrt/ops/backend.py): a backend registers itself with a prefix, a
factory and a device list, and get_backend, --list-devices and placement see it — the way a
Vulkan backend will plug in, shown here with a stand-in device backend."""
import pytest

from sdrt import UnsupportedError
from sdrt.ops import backend as B


class StandInMemory:
    name = "fake0"

    def mem_get_info(self):
        return 3 << 30, 4 << 30


class StandIn:
    """A device backend: CPU kernels, its own 'device memory'."""

    def __init__(self, index):
        self.name, self.memory = f"fake{index}", StandInMemory()

    def find(self, node):
        from sdrt.ops.cpu import CPU
        return CPU.find(node)

    def run_graph(self, graph, plan, on_segment=None, residency=None):
        from sdrt.ops.graph import run_on_host
        return run_on_host(graph, plan, self, on_segment, residency)


@pytest.fixture
def fake(monkeypatch):
    B.entries()     # the known backend packages register first, into the real registry
    monkeypatch.setattr(B, "_REGISTRY", dict(B._REGISTRY))
    monkeypatch.setattr(B, "_BACKENDS", {})
    B.register_backend("fake", StandIn, lambda: [("fake0", "stand-in GPU, 4.0 GiB")],
                       kernels=lambda: __import__("sdrt.ops.cpu", fromlist=["CPU"]).CPU)


def test_registered_backend_is_found_listed_and_placed(fake):
    from sdrt.cli.main import list_devices
    from sdrt.engine.placement import check_device, gpu_devices
    be = B.get_backend("fake0")
    assert isinstance(be, B.Backend) and be is B.get_backend("fake0") and be.name == "fake0"
    assert ("fake0", "stand-in GPU, 4.0 GiB") in list_devices() and list_devices()[0][0] == "cpu"
    assert "fake0" in B.available_backends() and "fake0" in B.gpu_names()
    assert check_device("fake0", "--backend", False) == "fake0"
    assert ("fake0", 4 << 30) in [(g.name, g.total) for g in gpu_devices()]
    with pytest.raises(UnsupportedError, match="'fake1' is not available: no such device"):
        B.get_backend("fake1")
    assert "fakeN" in B.device_syntax()


def test_graphs_run_on_a_registered_backend(fake, rng):
    import numpy as np

    from sdrt.ops import api as F
    from sdrt.ops.tensor import Tensor
    x = Tensor.from_numpy(rng.standard_normal((3, 5)).astype(np.float32))
    np.testing.assert_array_equal(F.compute(F.silu(x), "fake0"), F.compute(F.silu(x), "cpu"))


def test_host_backends_and_kernel_tables():
    from sdrt.ops.cpu import CPU
    cpu = B.get_backend("cpu")
    assert cpu.name == "cpu" and cpu.memory is None and isinstance(cpu, B.Backend)
    assert B.get_backend(CPU).table is CPU               # a bare kernel table runs on the host
    assert B.backend_kernels("cpu") is CPU and "reference" not in [n for n, _ in B.list_devices()]
    with pytest.raises(UnsupportedError, match="unknown backend 'tpu0'; available: cpu, reference"):
        B.get_backend("tpu0")


def test_residency_protocols():
    from sdrt.engine.host_pages import HostPageRelease
    from sdrt.engine.residency import ResidencyManager
    assert isinstance(ResidencyManager.__new__(ResidencyManager), B.Residency)
    assert isinstance(HostPageRelease(), B.SegmentHooks) and not isinstance(HostPageRelease(), B.Residency)


def test_warm_up_starts_the_devices_a_spec_names(fake, monkeypatch):
    """--backend's devices (auto-fit: device 0 of each backend that can warm up) get warm_up(index);
    a failing warm-up is swallowed (the device's own error comes at its first use); a device warms
    up once per process."""
    calls = []
    monkeypatch.setattr(B, "_warmed", set())

    def warm(index):
        calls.append(index)
        if index == 3:
            raise RuntimeError("no such device")
    entry = B._REGISTRY["fake"]
    monkeypatch.setitem(B._REGISTRY, "fake", B.BackendEntry(**{**entry.__dict__, "warm_up": warm}))
    monkeypatch.setitem(B._REGISTRY, "cuda", B.BackendEntry(**{**B._REGISTRY["cuda"].__dict__, "warm_up": None}))
    B.warm_up("diffusion=fake1,te=cpu,vae=fake1")
    B.warm_up("cpu")
    B.warm_up(None)
    B.warm_up("fake3")
    B.warm_up("fake1")
    assert calls == [1, 0, 3]


@pytest.mark.parametrize("argv, spec", [
    (["-m", "x.safetensors", "-p", "a cat"], None),
    (["-m", "x", "--backend", "diffusion=cuda1,vae=cpu"], "diffusion=cuda1,vae=cpu"),
    (["-m", "x", "--backend=cuda0", "-M", "img_gen"], "cuda0"),
    (["-M", "convert", "-m", "x", "--backend", "cuda0"], "none"),
    (["--mode=upscale", "-i", "a.png"], "none"),
    (["-m", "x", "--help"], "none"),
    (["--list-devices"], "none"),
])
def test_an_image_command_warms_its_gpu_up_before_parsing(argv, spec, monkeypatch):
    """cli.main starts the --backend spec's drivers from a look at argv before it builds the parser;
    help, a device list and the other modes start nothing."""
    from sdrt.cli import main as cli
    seen = []
    monkeypatch.setattr(B, "warm_up", seen.append)
    cli._early_warm_up(argv)
    assert seen == ([] if spec == "none" else [spec])


def test_the_cuda_warm_up_reports_its_phases(monkeypatch):
    """The CUDA backend's debug line says how long each warm-up phase took and whether the driver
    was ready when the backend was first asked for (the first-step timeline, issue 18)."""
    import sdrt.gpu.cuda as cuda
    monkeypatch.setattr(cuda, "_WARM", {})
    assert cuda.warm_up_report(0, 5.0) == "no warm-up thread ran"
    cuda._WARM[0] = {"start": 1.0, "cuInit": 1.4, "NVML": 1.43, "context": 1.5}
    assert cuda.warm_up_report(0, 1.2) == ("started 200 ms before, cuInit 400 ms, NVML 30 ms, context 70 ms; "
                                           "ready 300 ms after the backend was asked for")
    assert cuda.warm_up_report(0, 1.6).endswith("ready 100 ms before it was asked for")
    cuda._WARM[0] = {"start": 1.0, "cuInit": 1.4}          # cuInit failed: no later phase
    assert cuda.warm_up_report(0, 1.0) == "started 0 ms before, cuInit 400 ms; ready 400 ms after the backend was asked for"

