"""CudaBackend ("cuda0", "cuda1", ...): runs a planned Graph on one GPU.

`Graph.run("cuda0")` calls `run_graph(graph, plan, on_segment, residency)`:

- Device memory per graph, from the CPU runner's planner with the F32 results fuse.py stores as
  F16/BF16 in half their bytes (`fuse.layout`): one arena for every segment's intermediates
  (layout.arena_bytes), one for tensors crossing segments (layout.cross_bytes), one buffer per
  output; kept with the graph (freed when the Graph is garbage) so later runs reuse the same
  addresses.
- Leaves. A leaf is an INPUT when its storage is a writeable numpy array that was not registered
  as a weight (`register_weights`): the UNet's holders (np.empty arrays refilled every call),
  timesteps, positions. Inputs are copied to the device on every run (host -> pinned -> device).
  Every other leaf is a WEIGHT: read-only storage (model files are read-only memory maps) or
  registered. Weights are uploaded once and cached on the device, keyed by (storage, offset,
  span), and dropped when their host storage is garbage; after changing registered weights in
  place (say, merging a LoRA) call `refresh_weights`. With a residency object
  (`Graph.run(be, residency=res)`), the weights it manages come from `res.device_ptr` between
  its `begin_segment` and `end_segment` calls.
- Outputs are copied back into fresh host numpy buffers; the return value is the CPU runner's.
- First run eager (sizes rt.scratch, uploads weights). Later runs: the whole launch sequence
  (input copies, kernels, cuBLAS, output copies) is captured once into a CUDA graph and replayed,
  so a run costs one driver call plus the host copies of inputs and outputs. Runs stay eager with
  a residency object or an on_segment callback (weights can move between runs), with
  SDRT_CUDA_GRAPHS=0, and at SDRT_DEBUG>=2 (per-node GPU times). A capture that fails falls back
  to eager for that graph, with a warning.
- SDRT_DEBUG=1 logs the plan and each run's path and time; 2 adds every node's GPU time.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

import numpy as np

from ...errors import DeviceOutOfMemoryError, UnsupportedError
from ...ops.backend import Residency
from ..device_backend import GraphStates, align as _align, import_families, node_addresses
from . import cudagraph, fuse, ops
from .cublas import gemm_warm_up_on
from .devtensor import DevTensor
from .driver import CudaDevice, PinnedBuffer
from .runtime import CudaRuntime, ScratchOverflow
from .table import CUDA

log = logging.getLogger("sdrt.cuda")

def _span(leaf) -> tuple[int, int]:
    return leaf.offset, leaf.span_bytes()


def _address(storage: np.ndarray) -> int:
    return storage.__array_interface__["data"][0]


class _LiveStorages:
    """Numpy storages grouped by the address of their first byte, alive ones only: several
    Tensor.from_numpy wrappers of one array share an address (and one device copy). When the last
    storage of an address is garbage, `on_gone(address)` runs (in whatever thread the finaliser
    runs: it takes no lock)."""

    def __init__(self, on_gone=None):
        self.on_gone = on_gone
        self._by_addr: dict[int, dict[int, weakref.ref]] = {}

    def add(self, storage: np.ndarray) -> int:
        addr = _address(storage)
        refs = self._by_addr.setdefault(addr, {})
        if id(storage) not in refs:
            refs[id(storage)] = weakref.ref(storage, lambda _r, a=addr, i=id(storage): self._drop(a, i))
        return addr

    def holds(self, storage: np.ndarray) -> bool:
        return _address(storage) in self._by_addr

    def _drop(self, addr: int, sid: int) -> None:
        refs = self._by_addr.get(addr)
        if refs is not None:
            refs.pop(sid, None)
            if not refs:
                del self._by_addr[addr]
                if self.on_gone is not None:
                    self.on_gone(addr)


class _GemmWarmUp:
    """A thread replaying the GEMM shapes earlier processes kept on disk under `key` (a model
    version and image size; cublas.replay_shape) on a stream, cuBLAS handles and scratch memory of
    its own, so that cuBLAS's kernels for them are loaded before the first runs reach them (what
    those first uses cost: bench/README.md). Started when the pipeline names the key, at the start
    of a generation, ahead of the text encoders' first run; it loads cuBLAS (the process's first
    use) and the cuBLASLt choices kept beside the shapes (cublas.ALGOS, which every Cublas of the
    process then uses instead of asking the heuristic again). It shares nothing else with the runs
    but the context and the (locked) allocator; a failure ends it quietly (debug log)."""

    def __init__(self, backend: "CudaBackend", key: str):
        self.stop = False
        self.key = key
        self.thread = threading.Thread(target=self._run, args=(backend,), name=f"sdrt-{backend.name}-gemm-warm-up",
                                       daemon=True)
        self.thread.start()

    def _run(self, be: "CudaBackend") -> None:
        from .cublas import (REPLAY_MAX_BYTES, Cublas, algos_file, load_algos, load_shapes, replay_shape,
                             shape_layout, shapes_file)
        from .driver import _dev_cache_dir, pycuda_driver
        t0, done, base, pooled, cb = time.perf_counter(), 0, None, False, None
        dev = be.device
        try:
            dev.activate()
            stream = pycuda_driver().Stream(flags=1)
            cb = Cublas(dev, stream)
            where = (_dev_cache_dir(), dev.info.arch, cb.version)
            algos = load_algos(algos_file(*where), dev.index)   # cuBLASLt's choices: no heuristic for them
            sizes = {s: shape_layout(s)[1] for s in load_shapes(shapes_file(*where), self.key)}
            shapes = [s for s, n in sizes.items() if n <= REPLAY_MAX_BYTES]
            if shapes:
                # the scratch from the driver's stream-ordered pool, given back when the warm-up
                # ends (from the allocator, the block would stay cached and raise the process's peak)
                need = max(sizes[s] for s in shapes)
                base = dev.alloc_on_stream(need, stream)
                pooled = base is not None
                if not pooled:
                    base = dev.allocator.alloc(need)
                    # a cached block may still be read by compute work queued before it was freed
                    stream.wait_for_event(dev.event("compute"))
                for shape in shapes:
                    if self.stop:
                        break
                    try:
                        replay_shape(cb, stream, shape, base)
                    except UnsupportedError:
                        pass          # a shape cuBLASLt refuses (the run took another path for it)
                    done += 1
                stream.synchronize()
            log.debug("%s: %d of %d GEMM shapes of earlier runs replayed ahead in %.2f s (%s; %d cuBLASLt "
                      "choices kept)", be.name, done, len(shapes), time.perf_counter() - t0, self.key, algos)
        except Exception as e:  # noqa: BLE001  (an optimisation only)
            log.debug("%s: the GEMM warm-up stopped after %d shapes: %s", be.name, done, e)
        finally:
            try:
                if cb is not None:
                    cb.close()
                if pooled:
                    dev.free_on_stream(base, stream)
                    stream.synchronize()
                elif base is not None:
                    dev.allocator.free(base)
            except Exception:  # noqa: BLE001
                pass


class _AheadUpload:
    """One CudaBackend.upload_ahead: the leaves to upload, what its thread has done."""

    def __init__(self, leaves: list, max_bytes: int):
        self.leaves, self.max_bytes = leaves, int(max_bytes)
        self.keys: set = set()      # the weight-cache keys it allocated
        self.landed: dict = {}      # key -> the event of its upload, once enqueued
        self.changed = threading.Condition()
        self.finished = False
        self.bytes = 0
        self.event = None           # its last upload's
        self.error: Exception | None = None
        self.seconds = 0.0
        self.stop = False
        self.thread: threading.Thread | None = None

    def event_of(self, key):
        """The event of `key`'s upload, once the thread has enqueued it; None when it gave the key
        up (its upload failed: the cache entry is gone)."""
        with self.changed:
            self.changed.wait_for(lambda: key in self.landed or key not in self.keys or self.finished)
            return self.landed.get(key)

    def landed_one(self, key, event) -> None:
        with self.changed:
            self.landed[key] = event
            self.changed.notify_all()

    def finish(self) -> None:
        with self.changed:
            self.finished = True
            self.changed.notify_all()


class _GraphState:
    """What one Graph keeps on one device between runs."""

    def __init__(self, backend: "CudaBackend", graph, plan, residency=None):
        self.backend = backend
        self.plan = plan
        self.blocks: list[int] = []
        self.pinned: list[PinnedBuffer] = []
        self.captured = None
        self.nbytes = 0                  # device bytes held (a residency manager counts idle graphs')
        self._residency = residency      # asked to make room when an allocation fails
        # every node's kernel, before anything runs; then the fused runs of nodes and the F32 results
        # stored as F16/BF16 (fuse.py), which lay the graph out again (`layout`: those nodes in half
        # their bytes): per segment [(fn, the tensors it reads)] in node order, {id: dtype} (seen
        # through DevTensor.half_of)
        kernels = []
        for seg in plan.segments:
            ks = []
            for n in seg.nodes:
                k = backend.find(n)
                if k is None:
                    srcs = ", ".join(s.dtype.name for s in n.src)
                    raise UnsupportedError(f"backend {backend.name!r} has no kernel for {n.op}({srcs}) -> "
                                           f"{n.dtype.name}" + (f" (node {n.name})" if n.name else ""))
                ks.append(k.fn)
            kernels.append(ks)
        self.layout, self.kernels, self.half = fuse.layout(graph, plan, kernels, backend.fuse, backend.store_half,
                                                           backend.half_layout)
        layout = self.layout
        self.arena = self._alloc(layout.arena_bytes)
        self.cross = self._alloc(layout.cross_bytes)
        self.node_ptr = node_addresses(layout, self.arena, self.cross,
                                       [self._alloc(_align(n.nbytes)) for n in layout.outputs])
        # leaves: owners in first-use order, split into inputs and weights
        self.leaves: dict[int, object] = {}
        for n in graph.nodes:
            for s in n.src:
                o = s.owner
                if o.op is None:
                    self.leaves.setdefault(id(o), o)
                    lo, size = _span(o)
                    if s.offset < lo or s.offset + s.span_bytes() > lo + size:
                        raise UnsupportedError(f"{backend.name}: view {s!r} reaches outside its leaf {o!r}")
        self.inputs: list[tuple[object, int, PinnedBuffer]] = []   # (leaf, device ptr, pinned)
        self.input_ptr: dict[int, int] = {}
        self.weight_ptr: dict[int, int] = {}     # backend-cached weights, resolved on first use
        for o in self.leaves.values():
            if backend.is_input(o):
                ptr = self._alloc(o.span_bytes())
                pin = PinnedBuffer(backend.device, o.span_bytes())
                self.pinned.append(pin)
                self.inputs.append((o, ptr, pin))
                self.input_ptr[id(o)] = ptr
        self.outputs: list[tuple[object, int, PinnedBuffer]] = []  # (node, device ptr, pinned)
        for n in layout.outputs:
            pin = PinnedBuffer(backend.device, _align(n.nbytes))
            self.pinned.append(pin)
            self.outputs.append((n, self.node_ptr[id(n)], pin))
        self.launches: list | None = None    # [(fn, node, xs, out)] once weights have fixed addresses
        self.captured: cudagraph.CapturedGraph | None = None
        self.capture_ok = True
        self.runs = 0
        self._residency = None

    def _alloc(self, nbytes: int) -> int:
        p = self.backend.alloc_or_make_room(nbytes, self._residency)
        self.blocks.append(p)
        self.nbytes += nbytes
        return p

    def ptr(self, t, residency=None) -> int:
        """Device address of tensor `t` (a node, a leaf or a view of either)."""
        o = t.owner
        if o.op is not None:
            return self.node_ptr[id(o)] + t.offset
        base = self.input_ptr.get(id(o))
        if base is None:
            if residency is not None and residency.manages(t):
                return residency.device_ptr(t)
            base = self.weight_ptr.get(id(o))
            if base is None:
                base = self.weight_ptr[id(o)] = self.backend.weight_ptr(o)
        return base + (t.offset - o.offset)

    def dev(self, t, residency=None) -> DevTensor:
        """What a kernel function sees of tensor `t` (a node, a leaf or a view of either)."""
        d = self.half.get(id(t.owner))
        if d is not None:
            return DevTensor.half_of(t, self.node_ptr[id(t.owner)], d)
        return DevTensor.of(t, self.ptr(t, residency))

    def release(self) -> None:
        dev = self.backend.device
        if self.captured is not None:
            self.captured.destroy()
            self.captured = None
        blocks, self.blocks = self.blocks, []
        for p in blocks:
            dev.defer(lambda p=p: dev.allocator.free(p))
        for pin in self.pinned:
            pin.close()
        self.pinned = []

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


class CudaBackend(GraphStates):
    """The CUDA backend of one device (the ops.backend.Backend protocol); `get_backend("cudaN")`
    makes one per device. A residency object it runs with follows ops.backend.Residency."""

    fuse = True         # fuse.py's fused runs (SDRT_CUDA_FUSE=0: every node alone)
    store_half = True   # fuse.half_nodes (SDRT_CUDA_HALF=0: every result as typed)
    half_layout = True  # fuse.layout's re-plan (SDRT_CUDA_HALF_LAYOUT=0: half-stored results keep F32 slots)

    def __init__(self, index: int = 0):
        self.name = f"cuda{index}"
        t0 = time.perf_counter()
        self.device = CudaDevice(index)
        if log.isEnabledFor(logging.DEBUG):
            from . import warm_up_report
            log.debug("%s: context and streams in %.1f ms (device use %.0f MiB); driver warm-up: %s", self.name,
                      (time.perf_counter() - t0) * 1e3, self.device.used_mib(), warm_up_report(index, t0))
        self.rt = CudaRuntime(self.device)
        self.memory = self.rt.memory
        self.families = import_families(ops)
        self._init_states()
        self._init_weight_cache()
        # cuBLAS's kernels for the GEMM shapes of earlier runs, loaded ahead (SDRT_GEMM_WARMUP=0: off)
        self._gemm_warm: _GemmWarmUp | None = None   # the last one expect_gemm_shapes started
        self._gemm_key: str | None = None     # what runs now (expect_gemm_shapes), its shapes kept under it
        self._shapes_saved = 0
        self.fuse = os.environ.get("SDRT_CUDA_FUSE", "1") != "0"
        self.store_half = os.environ.get("SDRT_CUDA_HALF", "1") != "0"
        self.half_layout = os.environ.get("SDRT_CUDA_HALF_LAYOUT", "1") != "0"

    def _init_weight_cache(self) -> None:
        self._weights: dict[tuple[int, int, int], int] = {}   # (storage address, offset, span) -> ptr
        # the weight cache's check-and-insert, shared with an upload ahead (taken before the
        # allocator's lock; a finaliser's _storage_gone takes neither)
        self._weights_lock = threading.RLock()
        self._weight_storages = _LiveStorages(self._storage_gone)
        self._registered = _LiveStorages()
        self._pending_upload = None   # event of the last weight upload on the copy stream
        self._first_use_bytes = 0     # bytes weight_ptr has uploaded (for the run logs)
        self._ahead: _AheadUpload | None = None

    def __repr__(self):
        return f"CudaBackend({self.name}: {self.device.info.describe()})"

    def find(self, node):
        return CUDA.find(node)

    # ---- weights -------------------------------------------------------------------------------
    def register_weights(self, tensors) -> None:
        """Mark the storages of these tensors (a dict or iterable of Tensors) as weights, so they
        are cached on the device even when their numpy storage is writeable."""
        for t in (tensors.values() if hasattr(tensors, "values") else tensors):
            if t.owner.storage is not None:
                self._registered.add(t.owner.storage)

    def is_input(self, leaf) -> bool:
        """The input rule: writeable numpy storage that is not a registered weight."""
        st = leaf.storage
        return bool(st.flags.writeable) and not self._registered.holds(st)

    def weight_ptr(self, leaf) -> int:
        """Device address of the cached copy of weight leaf `leaf` (uploaded on first use on
        the copy stream; the compute stream waits for it before its next launch)."""
        st = leaf.storage
        off, size = _span(leaf)
        key, ptr, fresh = self._cache_slot(st, off, size)
        if fresh:
            self._pending_upload = self.memory.upload(ptr, st[off:off + size], "copy")
            self._first_use_bytes += size
        elif self._ahead is not None and key in self._ahead.keys:   # claimed ahead, maybe not enqueued yet
            event = self._ahead.event_of(key)
            if event is None:                 # the thread gave it up: upload it here
                return self.weight_ptr(leaf)
            event.synchronize()               # that copy only (mostly landed long before)
        return ptr

    def _cache_slot(self, st, off: int, size: int, claim: set | None = None) -> tuple[tuple, int, bool]:
        """(key, device address, made now) of the weight cache's entry for these bytes, allocated
        when missing; the caller uploads into a new one. A new key also goes into `claim` (under the
        same lock, so another thread finding it knows whose upload it waits for)."""
        with self._weights_lock:
            key = (self._weight_storages.add(st), off, size)
            ptr = self._weights.get(key)
            if ptr is not None:
                return key, ptr, False
            ptr = self._weights[key] = self.device.allocator.alloc(size, fit=True)
            if claim is not None:
                claim.add(key)
            return key, ptr, True

    # ---- uploading the next stage's weights beside this one's compute ---------------------------
    def upload_ahead(self, tensors, max_bytes: int) -> None:
        """Upload the weights among `tensors`, in order and at most `max_bytes` of them, from a
        thread of its own (own staging ring, the copy stream) while the caller goes on computing
        on this device: the text encoders' weights before their first run reads them, then the
        diffusion model's beside that run, whose time is mostly the host's. A run reading one of
        them waits for that one's copy; preload_weights and release_weights wait for all; a
        failure there is logged and leaves the rest to the usual upload."""
        self._join_ahead()
        job = self._ahead = _AheadUpload([t.owner for t in tensors], max_bytes)
        job.thread = threading.Thread(target=self._upload_ahead, args=(job,), name=f"sdrt-{self.name}-ahead",
                                      daemon=True)
        job.thread.start()

    def _upload_ahead(self, job: "_AheadUpload") -> None:
        t0 = time.perf_counter()
        try:
            self.device.activate()
            for o in job.leaves:
                if job.stop:
                    break
                if o.op is not None or o.storage is None or self.is_input(o):
                    continue
                st = o.storage
                off, size = _span(o)
                if job.bytes + size > job.max_bytes:
                    continue
                key, ptr, fresh = self._cache_slot(st, off, size, claim=job.keys)
                if not fresh:
                    continue
                try:
                    job.event = self.memory.upload(ptr, st[off:off + size], "copy", ring="ahead")
                except BaseException:
                    with self._weights_lock:      # never leave a cached weight that was not uploaded
                        self._weights.pop(key, None)
                        job.keys.discard(key)
                    self.device.allocator.free(ptr)
                    raise
                job.landed_one(key, job.event)
                job.bytes += size
            if job.event is not None:
                job.event.synchronize()
        except Exception as e:  # noqa: BLE001  (the weights left are uploaded on first use, as without it)
            job.error = e
        finally:
            job.finish()
        job.seconds = time.perf_counter() - t0

    def _join_ahead(self) -> None:
        """Wait until the upload ahead (if any) has landed on the device."""
        job = self._ahead
        if job is None or job.thread is threading.current_thread():
            return
        t0 = time.perf_counter()
        job.thread.join()
        if job.event is not None:     # what it enqueued before a failure has landed too
            job.event.synchronize()
        self._ahead = None
        self.last_ahead = (job.bytes, job.seconds)
        if job.error is not None:
            log.warning("%s: uploading weights ahead stopped after %.1f MB (%s); the rest upload on first use",
                        self.name, job.bytes / 2**20, job.error)
        log.debug("%s: %.1f MB of weights uploaded ahead in %.2f s (%.2f s of it waited for here)", self.name,
                  job.bytes / 2**20, job.seconds, time.perf_counter() - t0)

    def refresh_weights(self, tensors) -> int:
        """Re-upload the cached device copies of these tensors' storages in place (same
        addresses, so captured graphs stay valid). Returns the bytes uploaded."""
        with self._lock:
            self.device.activate()
            self._join_ahead()
            done, seen = 0, set()
            for t in (tensors.values() if hasattr(tensors, "values") else tensors):
                st = t.owner.storage
                addr = _address(st)
                for key in [k for k in self._weights if k[0] == addr and k not in seen]:
                    seen.add(key)
                    _, off, size = key
                    self._pending_upload = self.memory.upload(self._weights[key], st[off:off + size], "copy")
                    done += size
            self._wait_uploads()
            return done

    def _activate(self) -> None:
        self.device.activate()

    def _finish_uploads(self) -> None:
        if self._pending_upload is not None:
            self._pending_upload.synchronize()

    def _wait_uploads(self) -> None:
        if self._pending_upload is not None:
            self.device.compute.wait_for_event(self._pending_upload)
            self._pending_upload = None

    def _storage_gone(self, addr: int) -> None:
        """The last live storage over `addr` is garbage: its device copies go too. A finaliser
        calls this in any thread, so no lock: list() of the dict and pop are atomic under the GIL."""
        for key in list(self._weights):
            if key[0] == addr:
                self._drop_key(key)

    def _drop_key(self, key) -> None:
        ptr = self._weights.pop(key, None)
        if ptr is not None:
            self.device.defer(lambda p=ptr: self.device.allocator.free(p))

    def _drop_weights(self, leaves, keep) -> None:
        def spans(ls):
            return {(_address(o.storage), *_span(o)) for o in ls}
        drop, kept = None if leaves is None else spans(leaves), spans(keep)
        with self._weights_lock:
            for key in [k for k in self._weights if (drop is None or k in drop) and k not in kept]:
                self._drop_key(key)

    def weight_bytes(self) -> int:
        with self._weights_lock:
            return sum(k[2] for k in self._weights)

    # ---- running -------------------------------------------------------------------------------
    def run_graph(self, graph, plan, on_segment=None, residency=None) -> dict:
        if residency is not None and not isinstance(residency, Residency):
            raise UnsupportedError(f"{self.name}: the residency object {type(residency).__name__} lacks the "
                                   f"sdrt.ops.backend.Residency methods (manages, device_ptr, begin_graph, make_room)")
        with self._lock:
            self.device.activate()
            return self._run(graph, plan, on_segment, residency)

    def _run(self, graph, plan, on_segment, residency):
        debug = int(os.environ.get("SDRT_DEBUG", "0") or 0)
        t0 = time.perf_counter()
        if residency is not None:
            residency.begin_graph(plan, self.rt.scratch_capacity)
        timing = log.isEnabledFor(logging.DEBUG)
        uploaded = self._first_use_bytes
        state = self._states.get(graph)
        if state is None or state.plan is not plan:
            state = self._states[graph] = _GraphState(self, graph, plan, residency)
            if timing:
                log.debug("%s: new graph of %d nodes: kernels, fusions, layout and buffers in %.1f ms", self.name,
                          len(graph.nodes), (time.perf_counter() - t0) * 1e3)
            if debug:
                lay = state.layout
                log.info("%s plan: %d nodes, %d segments, arena %.1f MB (all F32: %.1f), cross-segment %.1f MB, "
                         "outputs %.1f MB, %d inputs, %d weight leaves", self.name, len(graph.nodes), len(plan.segments),
                         lay.arena_bytes / 2**20, plan.arena_bytes / 2**20, lay.cross_bytes / 2**20,
                         lay.output_bytes / 2**20,
                         len(state.inputs), len(state.leaves) - len(state.inputs))
        state.runs += 1
        for leaf, _, pin in state.inputs:     # host -> pinned (the copies to the device are enqueued)
            off, size = _span(leaf)
            pin.array[:] = leaf.storage[off:off + size]
        # no residency, no callbacks, no per-node timing: the launch list is fixed, capture it
        plain = residency is None and on_segment is None and debug < 2
        fixed = plain and state.launches is not None
        stream = self.device.compute
        if plain and state.captured is not None:
            state.captured.launch(stream)
            how = "replayed CUDA graph"
        elif fixed and state.capture_ok and os.environ.get("SDRT_CUDA_GRAPHS", "1") != "0":
            how = self._try_capture(state, stream)
        elif fixed:
            self._enqueue(state)
            how = "eager"
        else:
            self._run_eager(state, graph, on_segment, residency, debug, timing and state.runs == 1)
            how = "eager"
            if gemm_warm_up_on():
                self._save_gemm_shapes()
        t_sync = time.perf_counter()
        stream.synchronize()
        result = self._collect(graph, state)
        if debug or timing:
            uploaded = self._first_use_bytes - uploaded
            t1 = time.perf_counter()
            log.log(logging.INFO if debug else logging.DEBUG, "%s: run %d of %d nodes: %s, %.2f ms (%.2f of them "
                    "waiting for the device at the end)%s", self.name, state.runs, len(graph.nodes), how,
                    (t1 - t0) * 1e3, (t1 - t_sync) * 1e3,
                    f" (weights uploaded in it: {uploaded / 2**20:.1f} MB)" if uploaded else "")
        return result

    def expect_gemm_shapes(self, key: str) -> None:
        """The runs that follow are those of `key` (a model version and image size, from the
        pipeline): a GEMM warm-up starts replaying the shapes earlier processes kept under it
        (unless SDRT_GEMM_WARMUP=0, or one is still running: a server's next size), and the
        shapes these runs meet are kept under it."""
        if key == self._gemm_key:
            return
        self._gemm_key = key
        job = self._gemm_warm
        if gemm_warm_up_on() and (job is None or not job.thread.is_alive()):
            self._gemm_warm = _GemmWarmUp(self, key)

    def _save_gemm_shapes(self) -> None:
        """Add the GEMM shapes met since the last save to the file a later process replays, under
        the key of what runs (none named: nothing is kept)."""
        cb = self.rt._cublas
        if cb is None or self._gemm_key is None or len(cb.seen) == self._shapes_saved:
            return
        from .cublas import algos_file, save_algos, save_shapes, shapes_file
        from .driver import _dev_cache_dir
        where = (_dev_cache_dir(), self.device.info.arch, cb.version)
        try:
            save_shapes(shapes_file(*where), self._gemm_key, list(cb.seen)[self._shapes_saved:])
            save_algos(algos_file(*where), self.device.index)
            self._shapes_saved = len(cb.seen)
        except OSError as e:
            log.debug("%s: the GEMM shapes were not kept (%s)", self.name, e)

    def _try_capture(self, state: _GraphState, stream) -> str:
        try:
            state.captured = cudagraph.capture(self.device, stream, lambda: self._enqueue(state))
        except ScratchOverflow as e:
            log.debug("%s: %s; running eagerly, capturing next run", self.name, e)
            self._enqueue(state)
            return "eager (scratch grew)"
        except Exception as e:
            state.capture_ok = False
            log.warning("%s: CUDA graph capture failed (%s); this graph runs eagerly from now on", self.name, e)
            self._enqueue(state)
            return "eager (capture failed)"
        c = state.captured
        log.debug("%s: captured a CUDA graph of %d nodes (capture %.1f ms, instantiate %.1f ms)", self.name,
                  c.nodes, c.capture_s * 1e3, c.instantiate_s * 1e3)
        c.launch(stream)
        return f"captured CUDA graph ({c.nodes} nodes)"

    def _enqueue(self, state: _GraphState) -> None:
        """The whole run on the compute stream (eager or while capturing), addresses fixed."""
        dev, stream, rt = self.device, self.device.compute, self.rt
        for _, ptr, pin in state.inputs:
            dev.htod_async(ptr, pin.ptr, pin.nbytes, stream)
        for fn, node, xs, out in state.launches:
            rt.begin_kernel()
            fn(node, xs, out, rt)
        rt.begin_kernel()
        for _, ptr, pin in state.outputs:
            dev.dtoh_async(pin.ptr, ptr, pin.nbytes, stream)

    def _run_eager(self, state: _GraphState, graph, on_segment, residency, debug: int, host_times: bool) -> None:
        """One run launched node by node. `host_times` (a graph's first run, with debug logs): log
        the host's time per op kind, its operands' device addresses (weights uploaded on first
        use) apart from its launch (kernel set-up on first use: modules, cuBLAS heuristics)."""
        dev, stream, rt = self.device, self.device.compute, self.rt
        for _, ptr, pin in state.inputs:
            dev.htod_async(ptr, pin.ptr, pin.nbytes, stream)
        fixed = residency is None     # weight addresses stay put: keep the launch list for capture
        launches = [] if fixed else None
        timings = []
        spent: dict[str, list] = {}   # op -> [nodes, operand seconds, launch seconds]
        clock = time.perf_counter
        gemms = rt.gemm_first_use() if host_times else None
        for k, seg in enumerate(state.layout.segments):
            if on_segment is not None:
                on_segment(k, seg.name, seg.nodes)
            if residency is not None:
                residency.begin_segment(k, seg.name, [s for n in seg.nodes for s in n.src if s.owner.op is None])
            for (fn, srcs), n in zip(state.kernels[k], seg.nodes):
                if host_times:
                    ta = clock()
                xs = [state.dev(s, residency) for s in srcs]
                out = state.dev(n)
                self._wait_uploads()
                if host_times:
                    tb = clock()
                if debug >= 2:
                    ev0 = self._timing_event()
                rt.begin_kernel()
                fn(n, xs, out, rt)
                if debug >= 2:
                    timings.append((n, ev0, self._timing_event()))
                if host_times:
                    e = spent.setdefault(n.op, [0, 0.0, 0.0])
                    e[0] += 1
                    e[1] += tb - ta
                    e[2] += clock() - tb
                if fixed:
                    launches.append((fn, n, xs, out))
            if residency is not None:
                residency.end_segment(k)
        if spent:
            top = sorted(spent.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:10]
            shapes, heur, first = (x - y for x, y in zip(rt.gemm_first_use(), gemms))
            log.debug("%s: first run's host time by op (nodes: operands + launch ms): %s; of the launches, "
                      "%d new GEMM shapes: cuBLASLt heuristics %.1f ms, their first calls %.1f ms", self.name,
                      ", ".join(f"{op} ({c}: {a * 1e3:.1f} + {b * 1e3:.1f})" for op, (c, a, b) in top),
                      shapes, heur * 1e3, first * 1e3)
        rt.begin_kernel()
        for _, ptr, pin in state.outputs:
            dev.dtoh_async(pin.ptr, ptr, pin.nbytes, stream)
        if fixed and state.launches is None:
            state.launches = launches
        if timings:
            stream.synchronize()
            for n, a, b in timings:
                log.info("%-16s %-28s %s %8.3f ms", n.op, n.name or "", list(n.ne), b.time_since(a))

    def _timing_event(self):
        from .driver import pycuda_driver
        return pycuda_driver().Event().record(self.device.compute)

    def _collect(self, graph, state: _GraphState) -> dict:
        from ...ops.tensor import Tensor
        host: dict[int, np.ndarray] = {}
        for n, _, pin in state.outputs:
            host[id(n)] = pin.array.copy()
        result = {}
        for name, t in graph.outputs.items():
            o = t.owner
            st = o.storage if o.op is None else host[id(o)]
            result[name] = Tensor(t.dtype, t.ne, t.nb, storage=st, offset=t.offset, name=t.name or name)
        return result

    # ---- device memory of graphs (for a residency manager) -------------------------------------
    def alloc_or_make_room(self, nbytes: int, residency=None) -> int:
        """A device allocation of the backend's own; when it fails, the residency object frees
        memory (make_room: allocator cache, unpinned weights, idle graphs) and it is retried once."""
        try:
            return self.device.allocator.alloc(nbytes)
        except DeviceOutOfMemoryError:
            if residency is None:
                raise
            residency.make_room(nbytes)
            self.device.activate()       # runs the frees deferred meanwhile
            return self.device.allocator.alloc(nbytes)

    def _after_release(self) -> None:
        self.device.activate()       # runs the deferred frees now (freed memory goes to the allocator's cache)

    # ---- housekeeping ------------------------------------------------------------------------
    def synchronize(self) -> None:
        self.device.synchronize()

    def memory_stats(self) -> dict:
        s = self.memory.stats()
        s["weights"] = self.weight_bytes()
        s["scratch"] = self.rt.scratch_capacity
        return s


_BACKENDS: dict[int, CudaBackend] = {}


@atexit.register
def _stop_threads():
    """At exit (after a failed run, say) an upload ahead or a GEMM warm-up stops at its next step,
    before the driver's own clean-up (registered earlier, so run later) frees anything."""
    for be in _BACKENDS.values():
        for job in (be._ahead, be._gemm_warm):
            if job is not None and job.thread is not None:
                job.stop = True
                job.thread.join()


def get(index: int = 0) -> CudaBackend:
    """The backend of device `index` (made once)."""
    be = _BACKENDS.get(index)
    if be is None:
        be = _BACKENDS[index] = CudaBackend(index)
    return be
