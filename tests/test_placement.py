"""--backend / --params-backend / --max-vram / --offload-to-cpu / auto-fit: parsing, errors, the
auto-fit plan, CLI and API plumbing, and a pipeline component run through a simulated `cuda0`
(the residency path the CUDA backend takes, on CPU kernels)."""
from __future__ import annotations

import numpy as np
import pytest
from test_residency import DeviceReadingCPU, tiny_unet

import sdrt
from sdrt.cli import main as cli
from sdrt.engine.params import ModelParams
from sdrt.engine.placement import (
    GpuInfo,
    Placement,
    auto_fit,
    component_sizes,
    parse_assignments,
    parse_max_vram,
    resolve_placement,
)
from sdrt.engine.residency import PlacedBackend, bind_components
from sdrt.engine.simulated_device import SimulatedDevice
from sdrt.errors import UnsupportedError, UsageError

GiB, MiB = 2**30, 2**20


def mp(**kw):
    return ModelParams(model="m.safetensors", **kw)


# ---- syntax -----------------------------------------------------------------------------------------

def test_assignment_syntax_and_aliases():
    assert parse_assignments("cuda0", "--backend") == {"*": "cuda0"}
    assert parse_assignments(" Diffusion=cuda0, TE=cpu ,first-stage=CUDA0", "--backend") == {
        "diffusion": "cuda0", "te": "cpu", "vae": "cuda0"}
    assert parse_assignments("all=cpu,unet=cuda1,clip=cpu,t5xxl=cpu", "--backend") == {
        "*": "cpu", "diffusion": "cuda1", "te": "cpu"}
    assert parse_assignments("*=cpu,default=cuda0", "--backend") == {"*": "cuda0"}   # later entries win
    assert parse_assignments("diffusion=disk", "--params-backend", allow_disk=True) == {"diffusion": "disk"}
    assert parse_assignments("", "--backend") == {} and parse_assignments(None, "--backend") == {}
    assert parse_assignments("auto", "--backend") == {"*": "auto"}


@pytest.mark.parametrize("spec,err,msg", [
    ("foo=cpu", UsageError, "--backend: unknown module 'foo'; modules: diffusion (model, unet, dit)"),
    ("diffusion=tpu0", UsageError, "--backend: unknown device 'tpu0'; valid: cpu, cuda0"),
    ("disk", UsageError, "'disk' is only valid for --params-backend"),
    ("cuda0,cpu", UsageError, "'cuda0' in a list needs a module"),
    ("metal0", UnsupportedError, "device 'metal0': sdrt has no such backend yet"),
    ("diffusion=cuda0&cuda1", UnsupportedError, "layer split across devices"),
])
def test_assignment_errors(spec, err, msg):
    with pytest.raises(err, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse_assignments(spec, "--backend")


def test_max_vram_syntax():
    assert parse_max_vram("6") == {"*": 6.0} and parse_max_vram(-1) == {"*": -1.0}
    assert parse_max_vram("cuda0=6,CUDA1=-1.5,all=2") == {"cuda0": 6.0, "cuda1": -1.5, "*": 2.0}
    assert parse_max_vram(None) == {} and parse_max_vram("") == {}
    with pytest.raises(UsageError, match="'lots' is not a number of GiB"):
        parse_max_vram("lots")
    with pytest.raises(UsageError, match="unknown device 'tpu0'"):
        parse_max_vram("tpu0=3")


def test_model_params_validate_placement_syntax(tmp_path):
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"x")
    ModelParams(model=str(f), backend="diffusion=cuda0,te=cpu", params_backend="disk", max_vram="-1").validate()
    with pytest.raises(UsageError, match="--params-backend: unknown module 'text_model'"):
        ModelParams(model=str(f), params_backend="text_model=cpu").validate()
    with pytest.raises(UsageError, match="--max-vram"):
        ModelParams(model=str(f), max_vram="6GB").validate()


# ---- resolution ---------------------------------------------------------------------------------------

SD15 = {"diffusion": (1720 * MiB, 30 * MiB), "te": (246 * MiB, 90 * MiB), "vae": (167 * MiB, 10 * MiB)}
SDXL = {"diffusion": (5135 * MiB, 50 * MiB), "te": (1640 * MiB, 200 * MiB), "vae": (167 * MiB, 10 * MiB)}
H200 = [GpuInfo("cuda0", 140 * GiB, 141 * GiB)]


def test_explicit_devices_and_params():
    p = resolve_placement(mp(backend="diffusion=cuda0,te=cpu,vae=cuda0", auto_fit=True), SD15, gpus=H200)
    assert p.backend == {"diffusion": "cuda0", "te": "cpu", "vae": "cuda0"} and p.params == p.backend
    assert p.auto_fit       # no --params-backend: auto-fit placed the weights (all fit on the H200)
    p = resolve_placement(mp(backend="diffusion=cuda0,te=cpu,vae=cuda0", auto_fit=False), SD15, gpus=H200)
    assert p.params == p.backend and not p.auto_fit
    p = resolve_placement(mp(backend="cuda0", offload_to_cpu=True, params_backend="vae=disk"), SD15, gpus=H200)
    assert p.params == {"diffusion": "cpu", "te": "cpu", "vae": "disk"}
    p = resolve_placement(mp(backend="cuda0", clip_on_cpu=True, vae_on_cpu=True), SD15, gpus=H200)
    assert p.backend == {"diffusion": "cuda0", "te": "cpu", "vae": "cpu"}
    p = resolve_placement(mp(backend="cuda0,", clip_on_cpu=True), SD15, gpus=H200)   # trailing comma is fine
    assert p.backend["te"] == "cpu"
    p = resolve_placement(mp(clip_on_cpu=True, backend="te=gpu"), SD15, gpus=H200)   # explicit entry wins
    assert p.backend == {"diffusion": "cuda0", "te": "cuda0", "vae": "cuda0"}
    p = resolve_placement(mp(auto_fit=False), SD15, gpus=[])                      # default device: cpu
    assert p.backend == p.params == {"diffusion": "cpu", "te": "cpu", "vae": "cpu"}
    p = resolve_placement(mp(params_backend="disk"), SD15, gpus=[])              # cpu compute, disk weights
    assert p.backend["diffusion"] == "cpu" and p.params["diffusion"] == "disk"


def test_missing_and_impossible_devices():
    with pytest.raises(UnsupportedError, match="--backend: device 'cuda0' not found; no CUDA device is usable"):
        resolve_placement(mp(backend="cuda0"), SD15, gpus=[])
    with pytest.raises(UnsupportedError, match="device 'cuda1' not found; devices: cpu, cuda0"):
        resolve_placement(mp(backend="diffusion=cuda1"), SD15, gpus=H200)
    with pytest.raises(UnsupportedError, match="'gpu' asks for a GPU"):
        resolve_placement(mp(backend="gpu"), SD15, gpus=[])
    with pytest.raises(UnsupportedError, match="diffusion weights on cuda0 while diffusion computes on cpu"):
        resolve_placement(mp(backend="cpu", params_backend="diffusion=cuda0"), SD15, gpus=H200)


def test_explicit_backend_with_a_budget_lets_auto_fit_place_the_weights():
    """sd.cpp: without --params-backend auto-fit chooses where weights live, also under an explicit
    --backend: full-size Flux (22.7 GB DiT, 9.3 GB T5) on cuda0 under --max-vram 8 streams both
    from host RAM instead of failing to keep them on the device."""
    flux = {"diffusion": (22700 * MiB, 400 * MiB), "te": (9318 * MiB, 368 * MiB), "vae": (160 * MiB, 10 * MiB)}
    p = resolve_placement(mp(backend="cuda0", max_vram="8"), flux, gpus=H200, ram=100 * GiB)
    assert p.backend == dict.fromkeys(flux, "cuda0")
    assert p.params == {"diffusion": "cpu", "te": "cpu", "vae": "cpu"}   # sd.cpp's headroom rule
    p = resolve_placement(mp(backend="cuda0", max_vram="8"), flux, gpus=H200, ram=20 * GiB)
    assert p.params == {"diffusion": "disk", "te": "cpu", "vae": "cpu"}
    p = resolve_placement(mp(backend="cuda0"), flux, gpus=H200, ram=100 * GiB)          # fits: kept there
    assert p.params == p.backend
    p = resolve_placement(mp(backend="cuda0", max_vram="8", auto_fit=False), flux, gpus=H200)
    assert p.params == p.backend                                                     # as asked


def test_auto_fit_plans():
    # no GPU: everything on cpu
    p = resolve_placement(mp(), SD15, gpus=[], ram=64 * GiB)
    assert p.auto_fit and set(p.backend.values()) == set(p.params.values()) == {"cpu"}
    # a big GPU: everything resident there
    p = resolve_placement(mp(), SD15, gpus=H200, ram=64 * GiB)
    assert p.backend == p.params == {"diffusion": "cuda0", "te": "cuda0", "vae": "cuda0"}
    # a 6 GiB card and SDXL: offloaded diffusion needs the GPU, so te and vae are offloaded too
    small = [GpuInfo("cuda0", 6 * GiB, 8 * GiB)]
    p = auto_fit(SDXL, small, {}, ram=64 * GiB)
    assert p.backend == {"diffusion": "cuda0", "te": "cuda0", "vae": "cuda0"}
    assert p.params == {"diffusion": "cpu", "te": "cpu", "vae": "cpu"}
    # ... and with little RAM the diffusion weights stay on disk
    p = auto_fit(SDXL, small, {}, ram=3 * GiB)
    assert p.params == {"diffusion": "disk", "te": "cpu", "vae": "cpu"}
    # a 12 GiB card: diffusion resident, the rest too (reserves fit)
    p = auto_fit(SDXL, [GpuInfo("cuda0", 12 * GiB, 12 * GiB)], {}, ram=64 * GiB)
    assert p.params == {"diffusion": "cuda0", "te": "cuda0", "vae": "cuda0"}
    # --max-vram caps the budget; the main GPU is the one with the largest budget
    p = auto_fit(SD15, [GpuInfo("cuda0", 8 * GiB, 8 * GiB), GpuInfo("cuda1", 24 * GiB, 24 * GiB)],
                 {"cuda1": 3}, ram=64 * GiB)
    assert set(p.backend.values()) == {"cuda0"} and p.params["diffusion"] == "cuda0"
    p = auto_fit(SD15, H200, {"*": 3}, ram=64 * GiB)     # 3 GiB - 2 GiB reserve < 1.7 GiB of UNet
    assert p.params == {"diffusion": "cpu", "te": "cpu", "vae": "cpu"}
    p = auto_fit(SD15, H200, {"*": 3.8}, ram=64 * GiB)   # the UNet fits, then te's reserve does not
    assert p.params == {"diffusion": "cuda0", "te": "cpu", "vae": "cpu"}
    p = auto_fit(SD15, H200, {"*": 4.5}, ram=64 * GiB)
    assert p.params == {"diffusion": "cuda0", "te": "cuda0", "vae": "cuda0"}
    # a GPU with nothing to spare: cpu
    p = auto_fit(SD15, [GpuInfo("cuda0", 256 * MiB, 8 * GiB)], {}, ram=64 * GiB)
    assert set(p.backend.values()) == {"cpu"}


def test_component_sizes_classify_canonical_names():
    from sdrt.ops.tensor import Tensor
    t = {"model.diffusion_model.a": Tensor.from_numpy(np.zeros(10, np.float32)),
         "first_stage_model.b": Tensor.from_numpy(np.zeros(4, np.float16)),
         "cond_stage_model.transformer.c": Tensor.from_numpy(np.zeros(3, np.float32)),
         "conditioner.embedders.1.model.d": Tensor.from_numpy(np.zeros(5, np.float32)),
         "alphas_cumprod": Tensor.from_numpy(np.zeros(7, np.float32))}
    assert component_sizes(t) == {"diffusion": (104, 40), "vae": (72, 8), "te": (160, 20)}


# ---- CLI and API ------------------------------------------------------------------------------------

def test_cli_flags_map_to_model_params(tmp_path):
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"x")
    args = cli.build_parser().parse_args(
        ["-m", str(f), "--backend", "diffusion=cuda0,te=cpu", "--params-backend", "vae=disk", "--offload-to-cpu",
         "--max-vram", "-1", "--disable-prefetch", "--disable-segmented-compute", "--auto-fit", "off",
         "--clip-on-cpu", "--vae-on-cpu"])
    m, _ = cli.params_from_args(args)
    assert (m.backend, m.params_backend, m.max_vram) == ("diffusion=cuda0,te=cpu", "vae=disk", "-1")
    assert m.offload_to_cpu and m.disable_prefetch and m.disable_segmented_compute and not m.auto_fit
    assert m.clip_on_cpu and m.vae_on_cpu
    m, _ = cli.params_from_args(cli.build_parser().parse_args(["-m", str(f)]))
    assert m.auto_fit and m.backend is None and m.max_vram is None and not m.offload_to_cpu


def test_cli_and_api_refuse_missing_devices(tmp_path, capsys):
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"not read: the device check comes first")
    rc = cli.main(["-m", str(f), "-p", "a cat", "--backend", "cuda99", "-o", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert rc == 1 and "sdrt: error: --backend: device 'cuda99' not found" in err
    rc = cli.main(["-m", str(f), "--backend", "te=tpu", "-o", str(tmp_path / "o.png")])
    assert rc == 2 and "--backend: unknown device 'tpu'" in capsys.readouterr().err
    with pytest.raises(UnsupportedError, match="--params-backend: device 'cuda99' not found"):
        sdrt.generate("a cat", model=str(f), params_backend="cuda99")


def test_backend_cuda0_without_cuda_is_unsupported(tmp_path, capsys):
    from sdrt.gpu import cuda
    if cuda.available():
        pytest.skip("this machine has CUDA")
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"x")
    rc = cli.main(["-m", str(f), "--backend", "cuda0", "-o", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert rc == 1 and "device 'cuda0' not found; no CUDA device is usable: " in err


# ---- a component on a simulated cuda0 ---------------------------------------------------------------

class FakeCuda:
    """What the CUDA backend does with a residency object, on CPU kernels reading the simulated
    device's bytes: begin_graph(plan), then each segment between begin/end_segment."""
    name = "cuda0"

    def __init__(self, sim):
        self.memory = sim

    def find(self, node):
        from sdrt.ops.cpu import CPU
        return CPU.find(node)

    def run_graph(self, graph, plan, on_segment=None, residency=None):
        residency.begin_graph(plan)
        return graph.run(DeviceReadingCPU(self.memory, residency), on_segment, residency=residency)


@pytest.fixture
def fake_cuda0(monkeypatch):
    from sdrt.ops import backend
    sim = SimulatedDevice(64 * MiB)
    monkeypatch.setitem(backend._BACKENDS, "cuda0", FakeCuda(sim))
    return sim


@pytest.mark.parametrize("params", ["cpu", "cuda0"])
def test_unet_runs_through_a_placed_backend(fake_cuda0, params):
    from sdrt.ops.threads import get_threads, set_threads
    g, table = tiny_unet()
    plan = g._plan
    act = plan.arena_bytes + plan.cross_bytes + plan.output_bytes
    weights = sum(t.nbytes for t in table.values())
    gib = (act + weights // 3 if params == "cpu" else act + 2 * weights) / GiB
    p = Placement(backend={"diffusion": "cuda0"}, params={"diffusion": params}, max_vram={"*": gib})
    run_on = bind_components(p, table)["diffusion"]
    assert isinstance(run_on, PlacedBackend) and run_on.memory is fake_cuda0
    before = get_threads()
    set_threads(1)
    try:
        ref = g.run("cpu")["out"].to_f32()
        for _ in range(2):
            np.testing.assert_array_equal(g.run(run_on)["out"].to_f32(), ref)
    finally:
        set_threads(before)
    mgr = run_on.residency
    if params == "cpu":        # a third of the weights fit: streamed, every run uploads
        assert mgr.stats.uploaded > 0 and mgr.evictions > 0
    else:                      # kept on the device: uploaded once
        assert mgr.stats.uploaded == 0 and mgr.evictions == 0 and mgr.resident_bytes >= weights


def test_weights_kept_on_the_gpu_without_a_budget_need_no_manager(fake_cuda0):
    _, table = tiny_unet()
    p = Placement(backend={"diffusion": "cuda0", "vae": "cpu"}, params={"diffusion": "cuda0", "vae": "cpu"})
    assert bind_components(p, table) == {"diffusion": "cuda0", "vae": "cpu"}     # the backend's own cache
    p.max_vram = {"cuda1": 2}
    assert bind_components(p, table)["diffusion"] == "cuda0"
    p.max_vram = {"*": 2}
    assert isinstance(bind_components(p, table)["diffusion"], PlacedBackend)


def test_cpu_compute_with_disk_params_runs_through_page_release():
    from sdrt.engine.host_pages import HostPageRelease
    from sdrt.ops.threads import get_threads, set_threads
    g, table = tiny_unet()
    p = Placement(backend={"diffusion": "cpu", "te": "cpu"}, params={"diffusion": "disk", "te": "cpu"})
    on = bind_components(p, table)
    assert on["te"] == "cpu" and isinstance(on["diffusion"].residency, HostPageRelease)
    before = get_threads()
    set_threads(1)
    try:
        np.testing.assert_array_equal(g.run(on["diffusion"])["out"].to_f32(), g.run("cpu")["out"].to_f32())
    finally:
        set_threads(before)


def test_pipeline_passes_each_component_its_backend():
    from test_pipeline import StubCond, StubUNet, StubVAE

    from sdrt.engine.params import GenParams
    from sdrt.engine.pipeline import Pipeline
    seen = []

    class UNet(StubUNet):
        def __call__(self, x, t, context, y=None, c_concat=None, backend="cpu"):
            seen.append(("unet", backend))
            return super().__call__(x, t, context, y, c_concat)

    class VAE(StubVAE):
        def encode(self, x, backend="cpu"):
            seen.append(("encode", backend))
            return super().encode(x)

        def decode(self, z, backend="cpu"):
            seen.append(("decode", backend))
            return super().decode(z)

    pipe = Pipeline(version="sd1", prediction="eps", unet=UNet(), vae=VAE(), conditioner=StubCond())
    pipe.executors = {"diffusion": "dev-d", "vae": "dev-v"}
    init = np.full((64, 64, 3), 128, np.uint8)
    for tiling in (False, True):
        seen.clear()
        pipe.generate(GenParams(prompt="a cat", steps=2, init_image=init, vae_tiling=tiling,
                                vae_tile_size=(4, 4)), show_progress=False)
        assert {b for w, b in seen if w == "unet"} == {"dev-d"}
        assert {b for w, b in seen if w != "unet"} == {"dev-v"}
        assert {w for w, _ in seen} == {"unet", "encode", "decode"}
    pipe.executors = {}                                   # cpu: the components are called as before
    seen.clear()
    pipe.generate(GenParams(prompt="a cat", steps=1), show_progress=False)
    assert {b for _, b in seen} == {"cpu"}
