"""Weight uploads, without a GPU: ops.threads.copy_into (the threaded copy into pinned memory),
StagingRing.upload's chunking with a stand-in device whose "DMA" is a memmove into a numpy array,
the device backends' preload_weights and the pipeline's upload before sampling."""
from __future__ import annotations

import ctypes

from types import SimpleNamespace

import numpy as np
import pytest

from sdrt.gpu.cuda import driver
from sdrt.gpu.device_backend import GraphStates
from sdrt.ops import backend as backends
from sdrt.ops import threads
from sdrt.ops.tensor import Tensor


@pytest.mark.parametrize("n", [0, 1, 4 << 20, (4 << 20) + 1, (8 << 20) - 3, 33 << 20, (33 << 20) + 5])
def test_copy_into_copies_every_byte(n, monkeypatch):
    monkeypatch.setattr(threads, "COPY_THREADS", 3)    # uneven split across the threads
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 16, np.uint8)
    threads.copy_into(dst, src)
    assert np.array_equal(dst[:n], src) and not dst[n:].any()


class _Event:
    def synchronize(self):
        pass


class _Buffer:
    def __init__(self, n):
        self.array = np.zeros(n, np.uint8)
        self.ptr = self.array.ctypes.data


class _Device:
    """htod_async as a synchronous memmove into `self.mem` (device address = offset into it)."""

    def __init__(self, n):
        self.mem = np.zeros(n, np.uint8)
        self.copies = 0

    def htod_async(self, dst, src_ptr, nbytes, stream):
        ctypes.memmove(self.mem.ctypes.data + dst, src_ptr, nbytes)
        self.copies += 1

    def event(self, stream):
        return _Event()


def test_staging_ring_upload_in_chunks(monkeypatch):
    monkeypatch.setattr(driver.StagingRing, "CHUNK", 5 << 20)
    n = (23 << 20) + 7
    ring = driver.StagingRing.__new__(driver.StagingRing)
    ring.device, ring.stream = _Device(n + 100), None
    ring.bufs = [_Buffer(5 << 20) for _ in range(2)]
    ring.events, ring.turn = [None, None], 0
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    ring.upload(100, src)
    assert np.array_equal(ring.device.mem[100:], src) and not ring.device.mem[:100].any()
    assert ring.device.copies == 5
    assert ring.copy_s > 0 and ring.wait_s >= 0          # the host's time, for the upload log line


def test_pinned_pool_copies_into_slabs_until_its_limit_or_the_driver_refuses(monkeypatch):
    """PinnedPool (--offload-to-cpu's pinned host copies): copies land in slabs, each byte right; past `limit`, or once cuMemHostAlloc fails, copy returns None (the weight stays
    on the staging path) and the pool asks the driver no more."""
    made = []

    class Slab(_Buffer):
        def __init__(self, device, n):
            if len(made) == 3:
                raise driver.CudaDriverError("cuMemHostAlloc(1048576): CUDA_ERROR_OUT_OF_MEMORY (2)")
            made.append(n)
            super().__init__(n)
            self.nbytes = n

    monkeypatch.setattr(driver, "PinnedBuffer", Slab)
    monkeypatch.setattr(driver.PinnedPool, "SLAB", 1 << 20)
    src = np.random.default_rng(2).integers(0, 256, 700_001, dtype=np.uint8)
    small = driver.PinnedPool(SimpleNamespace(index=0), limit=1_000_000)
    assert np.array_equal(small.copy(src), src) and small.copy(src) is None       # over its limit
    made.clear()
    pool = driver.PinnedPool(SimpleNamespace(index=0), limit=10 << 30)
    copies = [pool.copy(src) for _ in range(3)]
    assert all(np.array_equal(c, src) for c in copies) and len(made) == 3
    assert pool.copy(src) is None and pool.limit == pool.used and len(made) == 3   # refused: no more tries
    assert pool.copy(src[:10]) is None


class _Cache(GraphStates):
    """GraphStates with the weight cache of a device backend: (storage, offset, span) -> upload."""

    def __init__(self):
        self._init_states()
        self.uploads = {}

    def is_input(self, leaf):
        return bool(leaf.storage.flags.writeable)

    def weight_ptr(self, leaf):
        key = (id(leaf.storage), leaf.offset, leaf.span_bytes())
        return self.uploads.setdefault(key, len(self.uploads))

    def weight_bytes(self):
        return sum(k[2] for k in self.uploads)


def _weight(n, writeable=False):
    a = np.arange(n, dtype=np.float32)
    a.flags.writeable = writeable
    return Tensor.from_numpy(a)


def test_preload_weights_fills_the_first_run_cache():
    be = _Cache()
    w, x = _weight(64), _weight(8, writeable=True)   # a weight, and an input (writeable, unregistered)
    assert be.preload_weights([w, x, w]) == 64 * 4
    assert be.preload_weights([w]) == 0                 # cached: a second preload uploads nothing
    assert list(be.uploads) == [(id(w.storage), w.offset, w.span_bytes())]


def test_pipeline_uploads_device_weights_before_sampling(monkeypatch):
    from sdrt.engine.pipeline import Pipeline
    DM, TE = "model.diffusion_model.", "text_encoders.t5xxl.transformer."
    tab = {DM + "img_in.weight": _weight(16), DM + "qkv.weight": _weight(8), DM + "qkv.weight.1": _weight(8),
           TE + "shared.weight": _weight(32), "first_stage_model.conv.weight": _weight(4)}
    seen = []
    fake = SimpleNamespace(preload_weights=lambda ts: seen.extend(ts) or sum(t.nbytes for t in ts))
    monkeypatch.setitem(backends._BACKENDS, "cuda9", fake)
    pipe = Pipeline.__new__(Pipeline)
    pipe.models = SimpleNamespace(tensors=tab)
    pipe.executors = {"diffusion": "cuda9", "te": "cuda9", "vae": "cpu"}
    assert pipe.upload_device_weights("diffusion", "controlnet") == 16 * 4
    assert seen == [tab[DM + "img_in.weight"]]          # split diffusers parts are joined later, not sent
    from sdrt.models.common import RUNTIME_LORA
    RUNTIME_LORA[tab[DM + "img_in.weight"]] = object()      # a run-time LoRA may fold it into a copy
    try:
        assert pipe.upload_device_weights("diffusion") == 0
    finally:
        del RUNTIME_LORA[tab[DM + "img_in.weight"]]
    pipe.executors["diffusion"] = SimpleNamespace(name="cuda9")   # a residency manager streams them
    assert pipe.upload_device_weights("diffusion") == 0


def test_one_shot_pipeline_releases_each_stage(monkeypatch):
    # the CLI's pipeline frees a GPU's weights and graph buffers when a stage ends (the text
    # encoders before the diffusion model's upload, the diffusion model before the VAE decode)
    from sdrt.engine.pipeline import Pipeline
    calls = []
    fake = SimpleNamespace(release_weights=lambda keep=(): calls.append("cuda9") or 7)
    monkeypatch.setitem(backends._BACKENDS, "cuda9", fake)
    pipe = Pipeline.__new__(Pipeline)
    pipe.models, pipe.one_shot = SimpleNamespace(tensors={}), False
    pipe.executors = {"diffusion": "cuda9", "te": "cuda9", "vae": "cpu", "controlnet": SimpleNamespace(name="cuda9")}
    assert pipe.release_device_stage("te") == 0 and not calls          # a server keeps them
    pipe.one_shot = True
    assert pipe.release_device_stage("te") == 7 and calls == ["cuda9"]
    assert pipe.release_device_stage("diffusion", "controlnet") == 7 and calls == ["cuda9"] * 2   # managed: skipped
    assert pipe.release_device_stage("vae") == 0


# ---- the diffusion model's weights uploaded beside the conditioning (CudaBackend.upload_ahead) ----
class _Allocator:
    def __init__(self):
        self.top, self.live = 0, {}

    def alloc(self, n, fit=False):
        p, self.top = self.top, self.top + -(-n // 512) * 512
        self.live[p] = n
        return p

    def free(self, p):
        del self.live[p]

    def empty_cache(self):
        pass


class _StandInDevice:
    """What CudaBackend's weight cache asks of its device and memory objects: an allocator, defer,
    activate, and uploads that memmove into `mem` (each upload may wait on `gate`; `fail_at`
    makes the k-th upload raise)."""

    def __init__(self, n):
        self.mem = np.zeros(n, np.uint8)
        self.allocator = _Allocator()
        self.gate, self.fail_at, self.uploads = None, None, []

    def activate(self):
        pass

    def defer(self, fn):
        fn()

    def upload(self, ptr, host_u8, stream="compute", ring=None):
        import threading
        if self.gate is not None and ring == "ahead":
            assert self.gate.wait(10)
        self.uploads.append((ring, host_u8.nbytes, threading.current_thread().name))
        if self.fail_at is not None and len(self.uploads) == self.fail_at:
            raise driver.CudaDriverError("cuMemcpyHtoDAsync: CUDA_ERROR_LAUNCH_FAILED (719)")
        src = np.ascontiguousarray(host_u8).reshape(-1).view(np.uint8)
        self.mem[ptr:ptr + src.nbytes] = src
        return _Event()

    def empty_cache(self):
        pass


def _cuda_backend_without_gpu(n=1 << 20):
    from sdrt.gpu.cuda.backend import CudaBackend
    be = CudaBackend.__new__(CudaBackend)
    be.name = "cuda9"
    be.device = be.memory = _StandInDevice(n)
    be._init_states()
    be._init_weight_cache()
    return be


def _on_device(be, t) -> np.ndarray:
    o = t.owner
    ptr = be.weight_ptr(o)
    return be.device.mem[ptr:ptr + o.span_bytes()].view(np.float32)


def test_upload_ahead_runs_on_its_own_thread_within_its_bytes_and_preload_waits_for_it():
    import threading
    be = _cuda_backend_without_gpu()
    unet = [_weight(1000 + i) for i in range(6)]          # 4000..4020 bytes each
    te = _weight(500)
    be.device.gate = threading.Event()
    be.upload_ahead(unet, max_bytes=3 * 4012)            # room for three of them
    # the text encoder's run meanwhile: its weight uploads on the calling thread, not blocked
    assert np.array_equal(_on_device(be, te), np.arange(500, dtype=np.float32))
    assert be.device.uploads == [(None, 2000, threading.current_thread().name)]
    be.device.gate.set()
    assert be.preload_weights(unet) == sum(w.nbytes for w in unet[3:])   # the rest, after waiting
    assert be.last_ahead[0] == sum(w.nbytes for w in unet[:3])
    ahead = [u for u in be.device.uploads if u[0] == "ahead"]
    assert [u[1] for u in ahead] == [w.nbytes for w in unet[:3]] and all(u[2] == "sdrt-cuda9-ahead" for u in ahead)
    for w in unet:                                        # every byte where the cache says
        assert np.array_equal(_on_device(be, w), np.arange(w.ne[0], dtype=np.float32))
    assert len(be.device.uploads) == 7                    # each weight once


def test_a_run_reading_a_weight_uploaded_ahead_waits_for_that_ones_copy_only():
    import threading
    be = _cuda_backend_without_gpu()
    unet = [_weight(256) for _ in range(3)]
    first, rest = threading.Event(), threading.Event()
    upload = be.device.upload

    def held_after_the_first(ptr, host_u8, stream="compute", ring=None):
        if ring == "ahead" and first.is_set():
            assert rest.wait(10)
        event = upload(ptr, host_u8, stream, ring)
        first.set()
        return event

    be.device.upload = held_after_the_first
    be.upload_ahead(unet, max_bytes=1 << 30)
    assert first.wait(10)
    # the first copy is done, the second held: reading the first does not wait for the others
    assert np.array_equal(_on_device(be, unet[0]), np.arange(256, dtype=np.float32))
    assert be._ahead is not None and not be._ahead.finished
    # the second is claimed (the cache holds its address) but not copied yet: the read waits for it
    threading.Timer(0.2, rest.set).start()
    assert np.array_equal(_on_device(be, unet[1]), np.arange(256, dtype=np.float32))
    assert be.preload_weights(unet) == 0 and be.last_ahead[0] == 3 * 1024
    assert [u[0] for u in be.device.uploads] == ["ahead"] * 3        # each weight once, all ahead


def test_a_weight_whose_upload_ahead_failed_is_uploaded_by_the_run_reading_it():
    be = _cuda_backend_without_gpu()
    unet = [_weight(128) for _ in range(2)]
    be.device.fail_at = 1
    be.upload_ahead(unet, max_bytes=1 << 30)
    be._ahead.thread.join(10)
    assert np.array_equal(_on_device(be, unet[0]), np.arange(128, dtype=np.float32))
    assert be.device.uploads[-1][0] is None                          # uploaded here, on first use


def test_a_failed_upload_ahead_leaves_no_weight_unuploaded(caplog):
    be = _cuda_backend_without_gpu()
    unet = [_weight(300 + i) for i in range(4)]
    be.device.fail_at = 2
    be.upload_ahead(unet, max_bytes=1 << 30)
    with caplog.at_level("WARNING", logger="sdrt.cuda"):
        assert be.preload_weights(unet) == sum(w.nbytes for w in unet[1:])
    assert "uploading weights ahead stopped after" in caplog.text and "LAUNCH_FAILED" in caplog.text
    assert len(be.device.allocator.live) == 4              # the failed one's block was given back
    for w in unet:
        assert np.array_equal(_on_device(be, w), np.arange(w.ne[0], dtype=np.float32))


def test_release_keeps_the_weights_sent_ahead_for_the_next_stage():
    be = _cuda_backend_without_gpu()
    file_map = np.arange(3000, dtype=np.float32).view(np.uint8)   # one file holds both models
    file_map.flags.writeable = False
    te = Tensor.from_buffer(file_map, "F32", (1000,))
    unet = [Tensor.from_buffer(file_map, "F32", (1000,), offset=4000), Tensor.from_buffer(file_map, "F32", (1000,), offset=8000)]
    _on_device(be, te)
    be.upload_ahead(unet, max_bytes=1 << 30)
    assert be.release_weights(keep=unet) == te.nbytes       # the text encoder's copy only
    assert be.weight_bytes() == 8000 and len(be.device.allocator.live) == 2
    uploads = len(be.device.uploads)
    assert be.preload_weights(unet) == 0 and len(be.device.uploads) == uploads


def test_pipeline_sends_ahead_at_most_what_keeps_the_device_within_the_sampling_weights(monkeypatch, caplog):
    from sdrt.engine.pipeline import Pipeline
    DM, TE = "model.diffusion_model.", "cond_stage_model.transformer."
    tab = {DM + "a.weight": _weight(400), DM + "b.weight": _weight(300), TE + "c.weight": _weight(200),
           "first_stage_model.d.weight": _weight(50)}
    sent, released = [], []
    fake = SimpleNamespace(upload_ahead=lambda ts, room: sent.append((ts, room)),
                           release_weights=lambda keep=(): released.append(keep) or 0,
                           preload_weights=lambda ts: 0, last_ahead=(3 << 20, 0.25))
    monkeypatch.setitem(backends._BACKENDS, "cuda9", fake)
    pipe = Pipeline.__new__(Pipeline)
    pipe.models, pipe.one_shot = SimpleNamespace(tensors=tab), True
    pipe.executors = {"diffusion": "cuda9", "te": "cuda9", "vae": "cuda9"}
    pipe.upload_weights_ahead(("diffusion", "controlnet"), beside=("te",))
    # the text encoder's weights first (its first run reads them), then the diffusion model's
    # up to its bytes less the text encoder's
    assert sent == [([tab[TE + "c.weight"], tab[DM + "a.weight"], tab[DM + "b.weight"]], 200 * 4 + (700 - 200) * 4)]
    pipe.release_device_stage("te")                      # the text encoders' stage ends
    assert released == [[tab[DM + "a.weight"], tab[DM + "b.weight"]]]   # ... keeping the diffusion model's
    with caplog.at_level("INFO", logger="sdrt"):
        pipe.upload_device_weights("diffusion", "controlnet")
    assert "3.0 MB uploaded ahead (the text encoders' weights, then these) in 0.25s" in caplog.text
    pipe.release_device_stage("diffusion")
    assert released[-1] == ()                            # nothing ahead any more: all of it goes
    # the text encoders on another device (or the CPU): all of the diffusion model goes ahead
    sent.clear()
    pipe.executors["te"] = "cpu"
    pipe.upload_weights_ahead(("diffusion",), beside=("te",))
    assert sent[0][1] == 700 * 4
    # a text encoder as large as the diffusion model (T5-XXL beside a small DiT): its own only
    sent.clear()
    pipe.executors["te"] = "cuda9"
    tab[TE + "e.weight"] = _weight(600)
    pipe.upload_weights_ahead(("diffusion",), beside=("te",))
    assert sent == [([tab[TE + "c.weight"], tab[TE + "e.weight"]], 800 * 4)]
    del tab[TE + "e.weight"]
    sent.clear()
    monkeypatch.setenv("SDRT_UPLOAD_AHEAD", "0")
    pipe.upload_weights_ahead(("diffusion",), beside=("te",))
    assert sent == []
