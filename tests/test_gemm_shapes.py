"""The GEMM shapes a CUDA run meets, kept on disk and replayed by a later process to load cuBLAS's
kernels ahead (sdrt/gpu/cuda/cublas.py, CudaBackend's GEMM warm-up), without a GPU: Cublas with a
stand-in library records each new shape once, replay_shape calls it again with operands laid out
at the recorded alignment in a scratch region, and the file keeps the newest shapes."""
from __future__ import annotations

from types import SimpleNamespace

from sdrt.gpu.cuda import cublas as C


class _Lib:
    """cublasGemmStridedBatchedEx and cuBLASLt's calls as recorders (status 0)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args)) or 0


class _Plan:
    made = []

    def __init__(self, *args, algo=None, **kw):
        self.desc = self.a = self.b = self.c = None
        self.algo, self.restored = 0, algo is not None
        self.heuristic = SimpleNamespace(raw=(algo or bytes(range(64))) + bytes(32))
        _Plan.made.append(algo)


def _cublas(monkeypatch):
    lib = _Lib()
    monkeypatch.setattr(C, "lt_library", lambda: lib)
    monkeypatch.setattr(C, "_LtPlan", _Plan)
    cb = C.Cublas.__new__(C.Cublas)
    cb.device, cb.lib, cb.share_algos = SimpleNamespace(index=0), lib, False
    cb._handles, cb._workspaces, cb._stream_workspace = {}, [], {}
    cb._lt, cb._lt_plans, cb.seen = None, {}, {}
    cb.new_shapes, cb.heuristic_s, cb.first_call_s = 0, 0.0, 0.0
    cb.handle = lambda stream: cb._stream_workspace.setdefault(stream.handle, 1 << 40) and 7
    return cb, lib


STREAM = SimpleNamespace(handle=5)


def test_each_new_shape_is_recorded_once_and_replays_as_it_was_called(monkeypatch):
    cb, lib = _cublas(monkeypatch)
    base = 1 << 30
    cb.gemm(STREAM, False, False, 4096, 320, 2880, base + 512, "F16", 4096, base + 4096, "F16", 2880, base, 4096,
            c_dtype="F32")
    cb.gemm(STREAM, False, False, 4096, 320, 2880, base + 1024, "F16", 4096, base + 8192, "F16", 2880, base, 4096,
            c_dtype="F32")                                          # same shape elsewhere: not new
    cb.gemm(STREAM, True, False, 64, 77, 64, base, "F16", 64, base, "F16", 64, base, 64, c_dtype="F16",
            batch=24, stride_a=4928, stride_b=4928, stride_c=5929, beta=1.0)
    cb.gemm_bias(STREAM, True, False, 768, 154, 768, base + 64, "F16", 768, base + 256, "F16", 768,
                 base + 2048, 768, base + 4096, c_dtype="F16", residual=base + 8192 + 128)
    assert len(cb.seen) == 3 and cb.new_shapes == 3
    shapes = list(cb.seen)
    assert shapes[2][0] == "bias" and shapes[2][11] == (64, 256, 128, 256)    # the pointers' alignments
    # replayed into a fresh Cublas: exactly the same shapes, alignments included
    again, _ = _cublas(monkeypatch)
    for s in shapes:
        offsets, total = C.shape_layout(s)
        assert all(0 <= o < total for o in offsets.values())
        C.replay_shape(again, STREAM, s, 1 << 32)
    assert list(again.seen) == shapes


def test_layout_holds_every_operand():
    s = ("gemm", False, True, 100, 30, 70, "F16", "F32", 128, 40, 100, 3, 128 * 70, 40 * 70, 100 * 30, False, False)
    off, total = C.shape_layout(s)
    a, b, c = 2 * (128 * 70 * 3), 2 * (40 * 70 * 3), 4 * (100 * 30 * 3)
    assert off["a"] == 0 and off["b"] >= a and off["c"] >= off["b"] + b and total >= off["c"] + c
    assert all(o % 512 == 0 for o in off.values())


def test_the_shapes_file_keeps_each_keys_shapes_in_first_use_order(tmp_path, monkeypatch):
    path = C.shapes_file(tmp_path / "cache", "sm_90", 130100)
    assert C.load_shapes(path, "sdxl 1024x1024") == []
    g = ("gemm", False, False, 8, 8, 8, "F16", "F32", 8, 8, 8, 1, 0, 0, 0, False, False)
    b = ("bias", True, False, 8, 8, 8, "F16", "F16", 8, 8, 8, (256, 256, 64, 64), True, False)
    g2 = g[:3] + (16,) + g[4:]
    C.save_shapes(path, "sd15 512x512", [g, b])
    C.save_shapes(path, "sdxl 1024x1024", [g2])
    assert C.load_shapes(path, "sd15 512x512") == [g, b] and C.load_shapes(path, "sdxl 1024x1024") == [g2]
    C.save_shapes(path, "sd15 512x512", [g2, g])        # g kept where it was met first, g2 after
    assert C.load_shapes(path, "sd15 512x512") == [g, b, g2]
    monkeypatch.setattr(C, "SHAPES_KEEP", 2)
    monkeypatch.setattr(C, "KEYS_KEEP", 2)
    C.save_shapes(path, "flux 1024x1024", [g])          # a third key: the oldest (sdxl) goes
    assert C.load_shapes(path, "sdxl 1024x1024") == [] and C.load_shapes(path, "flux 1024x1024") == [g]
    assert C.load_shapes(path, "sd15 512x512") == [g, b, g2]        # untouched until saved again
    C.save_shapes(path, "sd15 512x512", [b])
    assert C.load_shapes(path, "sd15 512x512") == [g, b]            # the first SHAPES_KEEP met
    path.write_text("{not json")
    assert C.load_shapes(path, "sd15 512x512") == []    # a cache: unreadable means empty


def test_odd_entries_are_skipped(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('[["gemm", false, false, 8, 8, 8, "F16", "F32", 8, 8, 8, 1, 0, 0, 0, false, false], 3, [], '
                    '["k", [["nope", 1], 3, ["gemm", false, false, 8, 8, 8, "F16", "F32", 8, 8, 8, 1, 0, 0, 0, '
                    'false, false], ["gemm", {"a": 1}]]], [1, []]]')
    assert C.load_shapes(path, "k") == [("gemm", False, False, 8, 8, 8, "F16", "F32", 8, 8, 8, 1, 0, 0, 0,
                                         False, False)]


def test_cublaslt_choices_are_shared_kept_and_restored(tmp_path, monkeypatch):
    """With the warm-up on, a bias GEMM's plan takes the choice another Cublas of the device made
    (or one kept on disk) instead of asking cuBLASLt's heuristic; a stored choice the library
    refuses is dropped and the heuristic asked again."""
    monkeypatch.setattr(C, "ALGOS", {})
    _Plan.made.clear()
    first, lib = _cublas(monkeypatch)
    first.share_algos = True
    args = (STREAM, True, False, 768, 154, 768, 1 << 30, "F16", 768, 1 << 31, "F16", 768, 1 << 32, 768, 1 << 33)
    first.gemm_bias(*args, c_dtype="F16")
    assert _Plan.made == [None] and len(C.ALGOS) == 1           # the heuristic's choice, now shared
    second, lib2 = _cublas(monkeypatch)
    second.share_algos = True
    second.gemm_bias(*args, c_dtype="F16")
    assert _Plan.made[-1] == bytes(range(64))                   # taken over, no heuristic
    path = C.algos_file(tmp_path, "sm_90", 130100)
    C.save_algos(path, 0)
    monkeypatch.setattr(C, "ALGOS", {})
    assert C.load_algos(path, 0) == 1 and list(C.ALGOS.values()) == [bytes(range(64))]
    key = next(iter(C.ALGOS))
    assert key[0] == 0 and key[1][10] == (256, 256, 256, 256)   # the key, alignments tuple included
    # a refused stored choice: the call fails once, the plan is made again by the heuristic
    third, lib3 = _cublas(monkeypatch)
    third.share_algos = True
    calls = []
    lib3.cublasLtMatmul = lambda *a: calls.append(a) or (0 if len(calls) > 1 else 15)
    third.gemm_bias(*args, c_dtype="F16")
    assert len(calls) == 2 and _Plan.made[-2:] == [bytes(range(64)), None]
    path.write_text("[[1, 2")
    assert C.load_algos(path, 0) == 0


def test_the_warm_up_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("SDRT_GEMM_WARMUP", raising=False)
    assert C.gemm_warm_up_on()
    monkeypatch.setenv("SDRT_GEMM_WARMUP", "0")
    assert not C.gemm_warm_up_on()


def test_the_warm_up_scratch_comes_from_the_stream_ordered_pool_where_the_driver_has_one():
    """CudaDevice.alloc_on_stream: cuMemAllocAsync's block on the stream, or None (the warm-up then
    takes an allocator block) where the driver lacks the call or refuses it."""
    import ctypes

    from sdrt.gpu.cuda.driver import CudaDevice
    dev = CudaDevice.__new__(CudaDevice)
    stream = SimpleNamespace(handle=9)

    def alloc(res):
        def f(p, nbytes, h):
            ctypes.cast(p, ctypes.POINTER(ctypes.c_uint64))[0] = 1 << 33
            calls.append((nbytes, h))
            return res
        return f

    calls = []
    dev.lib = SimpleNamespace(cuMemAllocAsync=alloc(0), cuMemFreeAsync=lambda p, h: calls.append((p, h)) or 0)
    assert dev.alloc_on_stream(4096, stream) == 1 << 33 and calls == [(4096, 9)]
    dev.free_on_stream(1 << 33, stream)
    assert calls[-1] == (1 << 33, 9)
    dev.lib = SimpleNamespace(cuMemAllocAsync=alloc(2))          # CUDA_ERROR_OUT_OF_MEMORY
    assert dev.alloc_on_stream(4096, stream) is None
    dev.lib = SimpleNamespace()                                   # a driver without the pool
    assert dev.alloc_on_stream(4096, stream) is None


def test_the_pipeline_names_what_runs_and_a_warm_up_starts_for_it(monkeypatch):
    """Pipeline.name_device_runs tells each GPU backend it computes on (a device name or a
    PlacedBackend's) the family and size; CudaBackend.expect_gemm_shapes starts a warm-up for a
    new key unless one is still running (then only the key its runs' shapes go under changes),
    and none with SDRT_GEMM_WARMUP=0."""
    from sdrt.engine.stage_weights import StageWeights
    from sdrt.gpu.cuda import backend as B

    class Job:
        def __init__(self, be, key):
            self.key, self.alive = key, True
            self.thread = SimpleNamespace(is_alive=lambda: self.alive)

    monkeypatch.setattr(B, "_GemmWarmUp", Job)
    monkeypatch.delenv("SDRT_GEMM_WARMUP", raising=False)
    be = B.CudaBackend.__new__(B.CudaBackend)
    be._gemm_key, be._gemm_warm = None, None
    pipe = StageWeights()
    pipe.executors = {"te": SimpleNamespace(backend=be), "diffusion": SimpleNamespace(backend=be), "vae": "cpu"}
    pipe.name_device_runs("sdxl 1024x1024")
    first = be._gemm_warm
    assert first.key == "sdxl 1024x1024" and be._gemm_key == "sdxl 1024x1024"
    be.expect_gemm_shapes("sdxl 832x1216")          # the warm-up still running: only the key changes
    assert be._gemm_warm is first and be._gemm_key == "sdxl 832x1216"
    first.alive = False
    be.expect_gemm_shapes("sdxl 1024x1024")         # over: a new warm-up for the new key
    assert be._gemm_warm is not first and be._gemm_warm.key == "sdxl 1024x1024"
    be._gemm_warm.alive = False
    monkeypatch.setenv("SDRT_GEMM_WARMUP", "0")     # off: the key only
    last = be._gemm_warm
    be.expect_gemm_shapes("sd15 512x512")
    assert be._gemm_key == "sd15 512x512" and be._gemm_warm is last
