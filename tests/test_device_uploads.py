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
    fake = SimpleNamespace(release_weights=lambda: calls.append("cuda9") or 7)
    monkeypatch.setitem(backends._BACKENDS, "cuda9", fake)
    pipe = Pipeline.__new__(Pipeline)
    pipe.models, pipe.one_shot = SimpleNamespace(tensors={}), False
    pipe.executors = {"diffusion": "cuda9", "te": "cuda9", "vae": "cpu", "controlnet": SimpleNamespace(name="cuda9")}
    assert pipe.release_device_stage("te") == 0 and not calls          # a server keeps them
    pipe.one_shot = True
    assert pipe.release_device_stage("te") == 7 and calls == ["cuda9"]
    assert pipe.release_device_stage("diffusion", "controlnet") == 7 and calls == ["cuda9"] * 2   # managed: skipped
    assert pipe.release_device_stage("vae") == 0
