"""VulkanBackend ("vulkan0", ...): runs a planned Graph on one Vulkan device.

`Graph.run("vulkan0")` calls `run_graph(graph, plan, on_segment, residency)`:

- Device memory per graph from the same Plan as the CPU runner: one buffer for every segment's
  intermediates (plan.arena_bytes), one for tensors crossing segments, one per output, one per
  input leaf; kept with the graph (freed when the Graph is garbage), so later runs reuse them.
- Leaves follow the CUDA backend's rule: writeable numpy storage not registered as a weight
  (`register_weights`) is an INPUT, copied in on every run through a host-visible staging
  buffer; every other leaf is a WEIGHT, uploaded once and cached while its storage lives.
- Recording: each node's kernel queues its dispatches on a Recorder; the runner records them
  into a command buffer with a memory barrier between dispatches, input copies first and
  output copies last. The command buffer is recorded once per graph and resubmitted on later
  runs (the Vulkan counterpart of a CUDA graph): a run is staging copies plus one submit.
- Mixed placement: a node with no Vulkan kernel runs on the CPU backend's kernel. The graph is
  then split into batches around such nodes: the batch before is submitted, the node's inputs
  are read back, its CPU result is copied up, and the next batch runs. SDRT_VULKAN_FALLBACK=0
  makes a missing kernel an UnsupportedError instead (what the op tests rely on: they ask
  `find` first).
- With a residency object (sdrt.engine.residency.ResidencyManager: `--max-vram`, weights
  streamed per segment) the graph runs segment by segment: `begin_segment` stages the
  segment's weights, the segment's dispatches are recorded with the addresses it gives them
  (the recording is kept and resubmitted while those addresses stay the same) and submitted,
  `end_segment` unpins them. Every submit completes before it returns, so an evicted weight's
  memory is never still being read. `on_segment` is then called before each segment too;
  without a residency object it is called for each segment before the one submit.
- Device memory comes from device.py's sub-allocator (pooled 256 MiB blocks); a failed
  allocation with a residency object asks it to make room (`make_room`) and retries once.
"""
from __future__ import annotations

import atexit
import logging
import os
import struct
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ...errors import DeviceOutOfMemoryError, UnsupportedError
from ...ops.backend import Residency
from ...ops.dtypes import DType
from ...ops.tensor import Tensor
from ..device_backend import GraphStates, align as _align, import_families, node_addresses
from . import ops
from .device import BINDINGS, VulkanDevice
from .table import VULKAN

log = logging.getLogger("sdrt.vulkan")
_EXITING: list = []                   # [True] once the interpreter exits (atexit runs before teardown)
atexit.register(_EXITING.append, True)


def padded_nb(t: Tensor) -> tuple[int, int, int, int]:
    nb, ne = list(t.nb), t.ne4
    while len(nb) < 4:
        nb.append(nb[-1] * ne[len(nb) - 1])
    return tuple(nb)


@dataclass(frozen=True)
class VkTensor:
    """What a Vulkan kernel function sees of a graph tensor: its address (device.py's virtual
    address, offset included), dtype, ggml shape and byte strides (4 dims)."""
    ptr: int
    dtype: DType
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    tensor: Tensor

    @classmethod
    def of(cls, t: Tensor, ptr: int) -> "VkTensor":
        return cls(int(ptr), t.dtype, t.ne4, padded_nb(t), t)

    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def span_bytes(self) -> int:
        if self.dtype.is_quantized:     # whole rows of blocks
            return sum((n - 1) * s for n, s in zip(self.ne[1:], self.nb[1:])) + self.dtype.row_bytes(self.ne[0])
        return sum((n - 1) * s for n, s in zip(self.ne, self.nb)) + self.dtype.type_size

    def strides(self) -> list[int]:
        """Strides in elements (views of float tensors always step whole elements)."""
        return [s // self.dtype.type_size for s in self.nb]


class Recorder:
    """What kernels call: `bind` the tensors of bindings 0..4 (None: unused), which returns each
    one's offset from where it is bound in elements (or in `units` bytes: block types), then `dispatch` a shader with its specialization
    constants, push constants (up to 24 uints, 8 floats) and workgroup counts."""

    def __init__(self, dev: VulkanDevice):
        self.dev = dev
        self.items: list = []
        self._ranges = None

    def bind(self, tensors, units=None) -> list[int]:
        dev, ranges, offs = self.dev, [], []
        tensors = list(tensors) + [None] * (BINDINGS - len(tensors))
        units = list(units or []) + [None] * (BINDINGS - len(units or []))
        for t, unit in zip(tensors, units):
            if t is None:
                b, _ = dev.resolve(dev.dummy)
                ranges.append((b.buffer, 0, b.size))
                offs.append(0)
                continue
            b, off = dev.resolve(t.ptr)
            base = off // dev.offset_align * dev.offset_align
            size = min(b.size - base, dev.max_range)
            if off - base + t.span_bytes > size:
                raise UnsupportedError(f"{dev.name}: {t.tensor!r} spans {t.span_bytes / 2**20:.0f} MiB, more "
                                       f"than one storage binding reaches ({dev.max_range / 2**20:.0f} MiB)")
            ranges.append((b.buffer, base, size))
            offs.append((off - base) // (unit or t.dtype.type_size))   # unit: block types' word size
        self._ranges = ranges
        return offs

    def dispatch(self, shader: str, spec, groups, u=(), f=()) -> None:
        if len(u) > 24 or len(f) > 8:
            raise ValueError(f"{shader}: too many push constants")
        push = struct.pack(f"<{len(u)}I", *[int(x) & 0xFFFFFFFF for x in u]).ljust(96, b"\0") + \
            struct.pack(f"<{len(f)}f", *f)
        self.items.append((self.dev.pipeline(shader, tuple(int(s) for s in spec)), self._ranges, push,
                           tuple(int(g) for g in groups)))


class _Batch:
    """Dispatches recorded into one command buffer, resubmitted on every run."""

    def __init__(self, dev: VulkanDevice, items, copies_in=(), copies_out=()):
        self.dev = dev
        self.pool = dev.descriptor_pool(len(items))
        self.cmd = dev.new_command_buffer()
        dev.begin(self.cmd, once=False)
        for src, dst, n in copies_in:
            dev.cmd_copy(self.cmd, src, dst, n)
        if copies_in:
            dev.barrier(self.cmd)
        for pipe, ranges, push, groups in items:
            ds = dev.descriptor_set(self.pool, ranges)
            dev.dispatch(self.cmd, pipe, ds, push, groups)
            dev.barrier(self.cmd)
        for src, dst, n in copies_out:
            dev.cmd_copy(self.cmd, src, dst, n)
        dev.v.vkEndCommandBuffer(self.cmd)
        self.dispatches = len(items)

    def release(self) -> None:
        self.dev.free_command_buffer(self.cmd)
        self.dev.destroy_descriptor_pool(self.pool)


class _GraphState:
    """What one Graph keeps on one device between runs: buffers, and its steps (recorded batches
    and, for nodes without a Vulkan kernel, host nodes between them)."""

    def __init__(self, backend: "VulkanBackend", graph, plan, residency=None):
        self.backend, self.plan, dev = backend, plan, backend.device
        self.residency = residency
        self.nbytes = 0                  # device bytes held (a residency manager counts idle graphs')
        self.blocks: list[int] = []
        arena = self._alloc(plan.arena_bytes) if plan.arena_bytes else 0
        cross = self._alloc(plan.cross_bytes) if plan.cross_bytes else 0
        self.node_ptr = node_addresses(plan, arena, cross, [self._alloc(_align(n.nbytes)) for n in plan.outputs])
        self.leaves: dict[int, Tensor] = {}
        for n in graph.nodes:
            for s in n.src:
                if s.owner.op is None:
                    self.leaves.setdefault(id(s.owner), s.owner)
        self.input_ptr: dict[int, int] = {}
        self.inputs: list[tuple[Tensor, int]] = []      # (leaf, offset in the staging buffer)
        size_in = 0
        for o in self.leaves.values():
            if backend.is_input(o):
                self.input_ptr[id(o)] = self._alloc(o.span_bytes())
                self.inputs.append((o, size_in))
                size_in += _align(o.span_bytes())
        self.outputs: list[tuple[Tensor, int]] = []     # (node, offset in the staging buffer)
        size_out = 0
        for n in plan.outputs:
            self.outputs.append((n, size_out))
            size_out += _align(n.nbytes)
        self.stage_in = self._alloc(size_in, host=True) if size_in else 0
        self.stage_out = self._alloc(size_out, host=True) if size_out else 0
        # steps: ("gpu", _Batch) and ("host", node, cpu kernel), in node order
        self.steps: list = []
        self.fallback: list[str] = []
        self.runs = 0
        if residency is not None:
            self._plan_segments(graph)
            return
        rec = Recorder(dev)
        copies_in = [(self.stage_in + off, self.input_ptr[id(o)], o.span_bytes()) for o, off in self.inputs]
        allow = os.environ.get("SDRT_VULKAN_FALLBACK", "1") != "0"
        try:
            for n in graph.nodes:
                k = backend.find(n)
                if k is not None:
                    k.fn(n, [self.dev(s) for s in n.src], self.dev(n), rec)
                    continue
                cpu = backend.cpu.find(n)
                if not allow or cpu is None:
                    srcs = ", ".join(s.dtype.name for s in n.src)
                    raise UnsupportedError(f"backend {backend.name!r} has no kernel for {n.op}({srcs}) -> "
                                           f"{n.dtype.name}" + (f" (node {n.name})" if n.name else ""))
                if rec.items or copies_in:      # nothing between two host nodes: no empty batch
                    self.steps.append(("gpu", _Batch(dev, rec.items, copies_in)))
                rec, copies_in = Recorder(dev), []
                self.steps.append(("host", n, cpu))
                self.fallback.append(n.op)
            copies_out = [(self.node_ptr[id(n)], self.stage_out + off, n.nbytes) for n, off in self.outputs]
            self.steps.append(("gpu", _Batch(dev, rec.items, copies_in, copies_out)))
        except Exception:
            self.release()
            raise

    def _alloc(self, nbytes: int, host: bool = False) -> int:
        p = self.backend.alloc_or_make_room(max(nbytes, 16), self.residency, host=host)
        self.blocks.append(p)
        self.nbytes += 0 if host else max(nbytes, 16)
        return p

    def ptr(self, t: Tensor, residency=None) -> int:
        o = t.owner
        if o.op is not None:
            return self.node_ptr[id(o)] + t.offset
        base = self.input_ptr.get(id(o))
        if base is None:
            if residency is not None and residency.manages(t):
                return residency.device_ptr(t)
            base = self.backend.weight_ptr(o)
        return base + (t.offset - o.offset)

    def dev(self, t: Tensor, residency=None) -> VkTensor:
        return VkTensor.of(t, self.ptr(t, residency))

    # ---- segment by segment (with a residency object) ---------------------------------------------
    def _plan_segments(self, graph) -> None:
        """Each segment's nodes with their kernel (Vulkan, or the CPU's: run on the host) and the
        weight leaves they read; recordings are made at run time (weights move between runs)."""
        backend = self.backend
        allow = os.environ.get("SDRT_VULKAN_FALLBACK", "1") != "0"
        self.segments = []
        for seg in self.plan.segments:
            nodes = []
            for n in seg.nodes:
                k = backend.find(n)
                if k is None:
                    cpu = backend.cpu.find(n)
                    if not allow or cpu is None:
                        srcs = ", ".join(s.dtype.name for s in n.src)
                        raise UnsupportedError(f"backend {backend.name!r} has no kernel for {n.op}({srcs}) -> "
                                               f"{n.dtype.name}" + (f" (node {n.name})" if n.name else ""))
                    self.fallback.append(n.op)
                    nodes.append((n, None, cpu))
                else:
                    nodes.append((n, k, None))
            leaves = [s for n in seg.nodes for s in n.src if s.owner.op is None]
            self.segments.append((seg, nodes, leaves))
        self.recorded: dict[int, tuple] = {}    # segment -> (weight addresses, [steps])

    def run_segments(self, on_segment, residency) -> None:
        dev = self.backend.device
        if self.inputs:
            dev.one_shot(lambda cmd: [dev.cmd_copy(cmd, self.stage_in + off, self.input_ptr[id(o)], o.span_bytes())
                                      for o, off in self.inputs])
        for k, (seg, nodes, leaves) in enumerate(self.segments):
            if on_segment is not None:
                on_segment(k, seg.name, seg.nodes)
            residency.begin_segment(k, seg.name, leaves)
            try:
                key = tuple(self.ptr(t, residency) for t in leaves)
                hit = self.recorded.get(k)
                if hit is None or hit[0] != key:
                    if hit is not None:
                        self._release_steps(hit[1])
                    self.recorded[k] = hit = (key, self._record(nodes, residency))
                for step in hit[1]:
                    if step[0] == "gpu":
                        dev.submit(step[1].cmd)
                    else:
                        self.run_host_node(step[1], step[2])
            finally:
                residency.end_segment(k)
        if self.outputs:
            dev.one_shot(lambda cmd: [dev.cmd_copy(cmd, self.node_ptr[id(n)], self.stage_out + off, n.nbytes)
                                      for n, off in self.outputs])

    def _record(self, nodes, residency) -> list:
        dev, steps, rec = self.backend.device, [], Recorder(self.backend.device)
        try:
            for n, k, cpu in nodes:
                if k is not None:
                    k.fn(n, [self.dev(s, residency) for s in n.src], self.dev(n), rec)
                    continue
                if rec.items:
                    steps.append(("gpu", _Batch(dev, rec.items)))
                    rec = Recorder(dev)
                steps.append(("host", n, cpu))
            if rec.items:
                steps.append(("gpu", _Batch(dev, rec.items)))
        except Exception:
            self._release_steps(steps)
            raise
        return steps

    @staticmethod
    def _release_steps(steps) -> None:
        for step in steps:
            if step[0] == "gpu":
                step[1].release()

    def run_host_node(self, n, kern) -> None:
        """A node without a Vulkan kernel: its inputs read back, the CPU kernel, its result up."""
        dev = self.backend.device
        xs = []
        for s in n.src:
            o = s.owner
            if o.op is None:
                xs.append(s.numpy())
            else:
                buf = np.empty(_align(o.nbytes), np.uint8)
                dev.download(buf[:o.nbytes], self.node_ptr[id(o)])
                xs.append(s.numpy_from(buf))
        out = np.zeros(_align(n.nbytes), np.uint8)
        kern.fn(n, xs, n.numpy_from(out))
        dev.upload(self.node_ptr[id(n)], out[:n.nbytes])

    def release(self) -> None:
        self._release_steps(getattr(self, "steps", []))
        self.steps = []
        for _, steps in getattr(self, "recorded", {}).values():
            self._release_steps(steps)
        self.recorded = {}
        blocks, self.blocks = self.blocks, []
        for p in blocks:
            self.backend.device.free(p)

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


class VulkanBackend(GraphStates):
    """The Vulkan backend of one device (the ops.backend.Backend protocol)."""

    def __init__(self, index: int = 0):
        from ...ops.backend import get_backend
        self.name = f"vulkan{index}"
        self.device = VulkanDevice(index)
        self.memory = self.device
        self.cpu = get_backend("cpu")
        self.families = import_families(ops)
        self._weights: dict[tuple[int, int, int], tuple[int, object]] = {}   # key -> (ptr, weakref)
        self._registered: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self._init_states()

    def __repr__(self):
        return f"VulkanBackend({self.name}: {self.device.describe()})"

    def find(self, node):
        return VULKAN.find(node)

    # ---- weights ---------------------------------------------------------------------------------
    def register_weights(self, tensors) -> None:
        for t in (tensors.values() if hasattr(tensors, "values") else tensors):
            st = t.owner.storage
            if st is not None:
                self._registered[id(st)] = st

    def is_input(self, leaf) -> bool:
        st = leaf.storage
        return bool(st.flags.writeable) and self._registered.get(id(st)) is not st

    def weight_ptr(self, leaf) -> int:
        """Device address of the cached copy of weight `leaf` (uploaded on first use; freed when
        its host storage is garbage)."""
        st = leaf.storage
        key = (id(st), leaf.offset, leaf.span_bytes())
        hit = self._weights.get(key)
        if hit is not None and hit[1]() is st:
            return hit[0]
        ptr = self.device.alloc(key[2])
        self.device.upload(ptr, st.reshape(-1).view(np.uint8)[key[1]:key[1] + key[2]])
        self._weights[key] = (ptr, weakref.ref(st, lambda _r, k=key: self._drop_weight(k)))
        return ptr

    def _drop_weight(self, key, _exiting=_EXITING) -> None:
        if _exiting:        # interpreter exit: the process gives the device memory back
            return
        hit = self._weights.pop(key, None)
        if hit is not None:
            self.device.free(hit[0])

    def _drop_weights(self, leaves, keep) -> None:
        def spans(ls):
            return {(id(o.storage), o.offset, o.span_bytes()) for o in ls}
        drop, kept = None if leaves is None else spans(leaves), spans(keep)
        for key in [k for k in self._weights if (drop is None or k in drop) and k not in kept]:
            self._drop_weight(key)

    def weight_bytes(self) -> int:
        return sum(k[2] for k in self._weights)

    # ---- running -------------------------------------------------------------------------------
    def run_graph(self, graph, plan, on_segment=None, residency=None) -> dict:
        if residency is not None and not isinstance(residency, Residency):
            raise UnsupportedError(f"{self.name}: the residency object {type(residency).__name__} lacks the "
                                   f"sdrt.ops.backend.Residency methods (manages, device_ptr, begin_graph, make_room)")
        with self._lock:
            t0 = time.perf_counter()
            if residency is not None:
                residency.begin_graph(plan, 0)
            state = self._states.get(graph)
            made = dict(self.device.pipeline_stats)
            if state is None or state.plan is not plan or (state.residency is None) != (residency is None):
                if state is not None:
                    state.release()
                state = self._states[graph] = _GraphState(self, graph, plan, residency)
                if residency is None:
                    self.device.save_pipeline_cache()
                if state.fallback:
                    log.warning("%s: %d nodes run on the CPU (no Vulkan kernel): %s", self.name, len(state.fallback),
                                ", ".join(sorted(set(state.fallback))))
            state.residency = residency
            dev = self.device
            for o, off in state.inputs:
                lo, size = o.offset, o.span_bytes()
                dev.mapped(state.stage_in + off, size)[:] = o.storage.reshape(-1).view(np.uint8)[lo:lo + size]
            if residency is not None:
                state.run_segments(on_segment, residency)
                dev.save_pipeline_cache()
            else:
                if on_segment is not None:
                    for k, seg in enumerate(plan.segments):
                        on_segment(k, seg.name, seg.nodes)
                for step in state.steps:
                    if step[0] == "gpu":
                        dev.submit(step[1].cmd)
                    else:
                        state.run_host_node(step[1], step[2])
            state.runs += 1
            self._log_pipelines(made, len(graph.nodes))
            result = {}
            host = {id(n): dev.mapped(state.stage_out + off, _align(n.nbytes)).copy() for n, off in state.outputs}
            for name, t in graph.outputs.items():
                o = t.owner
                st = o.storage if o.op is None else host[id(o)]
                result[name] = Tensor(t.dtype, t.ne, t.nb, storage=st, offset=t.offset, name=t.name or name)
            log.debug("%s: run %d of %d nodes (%s, %d on the CPU): %.2f ms", self.name, state.runs,
                      len(graph.nodes), "segment by segment" if residency is not None else
                      f"{sum(s[0] == 'gpu' for s in state.steps)} batches", len(state.fallback),
                      (time.perf_counter() - t0) * 1e3)
            return result

    def _log_pipelines(self, before: dict, nodes: int) -> None:
        """One INFO line when a run made pipelines: how many, how long, and whether the disk
        pipeline cache served them (creation feedback, where the driver gives it)."""
        st = self.device.pipeline_stats
        made = st["created"] - before["created"]
        if not made:
            return
        hits, misses = st["cache_hits"] - before["cache_hits"], st["cache_misses"] - before["cache_misses"]
        fb = f"{hits} cache hits, {misses} misses" if hits + misses else "no creation feedback"
        log.info("%s: graph of %d nodes: %d pipelines made in %.2fs (pipeline cache: %s; %d bytes loaded from %s)",
                 self.name, nodes, made, st["create_s"] - before["create_s"], fb, st["cache_loaded_bytes"],
                 self.device.cache_path or "nowhere (SDRT_VULKAN_CACHE=0)")

    # ---- device memory of graphs (for a residency manager) -------------------------------------
    def alloc_or_make_room(self, nbytes: int, residency=None, host: bool = False) -> int:
        """A device allocation of the backend's own; when it fails, the residency object frees
        memory (make_room: unpinned weights, idle graphs) and it is retried once."""
        try:
            return self.device.alloc(nbytes, host=host)
        except DeviceOutOfMemoryError:
            if residency is None:
                raise
            residency.make_room(nbytes)
            return self.device.alloc(nbytes, host=host)

    def synchronize(self) -> None:
        self.device.synchronize()

    def memory_stats(self) -> dict:
        s = self.device.stats()
        s["weights"] = self.weight_bytes()
        return s


_BACKENDS: dict[int, VulkanBackend] = {}


def get(index: int = 0) -> VulkanBackend:
    be = _BACKENDS.get(index)
    if be is None:
        be = _BACKENDS[index] = VulkanBackend(index)
    return be
