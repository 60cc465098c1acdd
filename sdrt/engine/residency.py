"""Residency: which weights are on the compute device, brought in segment by segment.

A graph's cut points (F.mark_cut) split it into segments (sdrt.ops.graph.Plan.segments). Before a
segment runs, every weight it reads must be on the device; the `ResidencyManager` makes it so:

- weights are registered per component (diffusion, te, vae) with where their bytes live:
  `cpu` (the leaf's host storage: RAM or its file map, kept), `disk` (read from the model
  file's memory map each time they are staged, the pages dropped right after: no host copy
  stays) or `device` (staged once and kept: never evicted). Nothing is read at registration.
- `begin_segment` stages the segment's missing weights in blocks of up to 64 MiB (one device
  allocation each, sd.cpp's MAX_RESIDENCY_BLOCK_BYTES) and pins every block it needs;
  `end_segment` unpins. A pinned block is never evicted.
- When a block does not fit the budget, unpinned blocks are evicted: first those the running
  graph does not use, least recently used first; then the running graph's own, the one whose
  next use (segments repeat step after step) is farthest first. Plain LRU would evict exactly
  the block needed next in a cyclic sweep; this is Belady's choice for it.
- With the plan known (`begin_graph`), `begin_segment(k)` also prefetches segment k+1 on the
  copy stream, after the compute stream's work so far (an event), so the uploads overlap
  segment k; `begin_segment(k+1)` makes the compute stream wait for them. Off with
  --disable-prefetch. A prefetch never evicts what the next segments need sooner.
- The budget (`--max-vram`) is one per device, shared by every component and graph computing
  there (sd.cpp's managed per-device budget): positive GiB = that many bytes; 0 or unset = the
  device's live free memory (allocation failure triggers eviction); negative = free memory when
  the manager was made minus that many GiB. It counts what sdrt holds on the device: resident
  weights, the running graph's activations (plan arena + cross-segment + outputs) and the
  backend's scratch, other graphs' device state (arenas the backend keeps for their next run)
  and the device allocator's cache of freed blocks — measured from the allocator when the
  memory object reports `stats()`. Room is made, in this order, by giving the allocator's cache
  back, evicting weights the running graph does not read (LRU), releasing other graphs' device
  state (the backend, passed as `graphs`, rebuilds it on their next run), then evicting the
  running graph's own weights (farthest next use). `begin_graph` makes room for the graph's
  activations before the backend allocates them. When every weight of a graph fits, nothing is
  ever evicted and steps upload nothing; when it does not and segmented compute is disabled,
  `begin_graph` raises DeviceOutOfMemoryError naming the sizes. Not counted: the driver's
  context and a scratch buffer growing during a graph's first run (counted from the next check).

The device-memory object (`memory`) is duck-typed: name, mem_get_info() -> (free, total),
alloc(n) -> ptr (raises DeviceOutOfMemoryError), free(ptr), upload(ptr, host_u8, stream) ->
event, wait(event, stream), synchronize(), and optionally record(stream) -> event, stats() ->
{"in_use": bytes, "cached": bytes}, empty_cache() (a caching allocator's), and pinned_pool() -> a
pool whose copy(host_u8) returns a pinned host copy (None when full) with upload_pinned(ptr, copy,
stream) -> event (the CUDA backend's: `cpu` weights from a file map are uploaded from there). The `graphs`
object (the backend, optional): graph_bytes(plan) -> (device bytes held for that graph, for
all others) and release_graphs(keep_plan) -> bytes released. `sdrt.engine.simulated_device`
implements the memory contract on the host for tests (with a caching allocator's size classes if asked).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import numpy as np

from ..errors import DeviceOutOfMemoryError, UsageError
from .host_pages import HostPageRelease, read_only_file_map, release_file_pages

__all__ = ["BLOCK_BYTES", "PlacedBackend", "ResidencyManager", "bind_components"]

log = logging.getLogger("sdrt")
MiB, GiB = 2**20, 2**30
BLOCK_BYTES = 64 * MiB
ALIGN = 256
PARAMS = ("cpu", "disk", "device")


def _mb(n: int) -> str:
    return f"{n / MiB:.1f} MB"


def _segment_leaves(seg) -> list:
    return [s for n in seg.nodes for s in n.src if s.owner.op is None]


# ---- the manager -----------------------------------------------------------------------------------

@dataclass(eq=False)
class _Entry:
    """One registered weight (a leaf that owns its bytes) and the byte range graphs read of it."""
    owner: object
    component: str
    params: str
    lo: int                         # byte range in owner.storage that leaves read
    hi: int
    block: _Block | None = None
    offset: int = 0                 # where `lo` sits in the block
    pinned: object = None           # the bytes lo:hi in the manager's pinned host pool (_host_bytes)
    pinned_of: object = None        # the storage they were copied from

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


@dataclass(eq=False)
class _Block:
    ptr: int
    nbytes: int
    entries: list
    permanent: bool
    pins: int = 0
    last_use: int = 0
    ready: object = None            # copy-stream event while a prefetch is in flight


@dataclass(eq=False)
class _PlanInfo:
    plan_ref: object
    names: list
    segments: list                  # per segment: its entries
    activation_bytes: int
    leaf_bytes: int                 # leaves the manager does not place: the backend copies them (inputs)
    uses: dict = field(default_factory=dict)   # id(entry) -> segment indices
    runs: int = 0
    last_upload: int = -1
    warned: bool = False

    def weight_bytes(self, k: int) -> int:
        return sum(e.nbytes for e in self.segments[k])

    def entries(self) -> list:
        return list({id(e): e for s in self.segments for e in s}.values())


@dataclass
class _RunStats:
    uploaded: int = 0
    blocks: int = 0
    prefetched: int = 0
    pinned: int = 0                 # bytes copied into the pinned host pool (first uploads)
    evicted: int = 0
    held_peak: int = 0              # what sdrt holds on the device (the budget's measure), sampled
    device_peak: int = 0            # the device's used memory (all users, the driver's context too)


class ResidencyManager:
    """Weights of the components that compute on one device (see the module docstring).

    `max_vram`: GiB (positive budget, 0/None live free memory, negative keep that much free);
    `prefetch`: overlap the next segment's uploads (--disable-prefetch turns it off);
    `segmented`: False (--disable-segmented-compute) requires a graph's weights to fit at once;
    `graphs`: the backend keeping graphs' device state (graph_bytes, release_graphs), if any."""

    def __init__(self, memory, *, max_vram: float | None = None, prefetch: bool = True, segmented: bool = True,
                 block_bytes: int = BLOCK_BYTES, graphs=None):
        from .placement import resolve_budget
        self.memory, self.name = memory, getattr(memory, "name", "device")
        free = memory.mem_get_info()[0]
        self.max_vram, self.limit = max_vram, resolve_budget(max_vram, free)
        if self.limit == 0:
            raise DeviceOutOfMemoryError(f"{self.name}: --max-vram {max_vram:g} keeps {-max_vram:g} GiB free, but "
                                         f"only {_mb(free)} is free: nothing is left for sdrt")
        self.outside = 0                # the process's device bytes outside the allocator (_count_outside)
        self._count_outside()
        self.prefetch, self.segmented, self.block_bytes = prefetch, segmented, int(block_bytes)
        self.graphs = graphs
        self._entries: dict[int, _Entry] = {}
        self._blocks: list[_Block] = []
        self._plans: dict[int, _PlanInfo] = {}
        self._current: _PlanInfo | None = None
        self._activation = 0
        self._pending = 0               # the running graph's activations the backend has not allocated yet
        self._freed: dict[int, int] = {}    # sizes of blocks evicted into the allocator's cache, unclaimed
        self._warned_over = False
        self._pinned: dict[int, list[_Block]] = {}
        self._epoch = 0
        self._seg = 0
        self.resident_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0              # changes whenever a device address stops being valid
        self.stats = _RunStats()
        self._pool = None               # pinned host copies of `cpu` weights (_host_bytes)

    # ---- registration -------------------------------------------------------------------------
    def register(self, tensors, component: str, params: str = "cpu") -> int:
        """Register weights (a name->Tensor mapping or Tensors) of `component`; `params` is cpu,
        disk or device (or this device's name). Returns the registered bytes. Reads nothing."""
        if params == self.name:
            params = "device"
        if params not in PARAMS:
            raise UsageError(f"residency on {self.name}: params backend '{params}' for {component}; "
                             f"valid: cpu, disk, {self.name}")
        total = 0
        for t in (tensors.values() if hasattr(tensors, "values") else tensors):
            o = t.owner
            if o.op is not None or id(o) in self._entries:
                continue
            self._entries[id(o)] = _Entry(o, component, params, o.offset, o.offset + o.span_bytes())
            total += o.span_bytes()
        return total

    def manages(self, leaf) -> bool:
        """True for a registered weight leaf (or a view of one): its address comes from device_ptr."""
        return id(leaf.owner) in self._entries

    def is_resident(self, leaf) -> bool:
        e = self._entries.get(id(leaf.owner))
        return e is not None and e.block is not None

    def _entry(self, leaf) -> _Entry | None:
        e = self._entries.get(id(leaf.owner))
        if e is not None and (leaf.offset < e.lo or leaf.offset + leaf.span_bytes() > e.hi):
            # a view reaching outside the range staged so far: widen it (restaged on next use)
            if e.block is not None and e.block.pins:
                raise UsageError(f"residency {self.name}: a view of {e.owner.name or e.owner!r} reaches outside "
                                 f"the bytes staged for it while they are in use")
            if e.block is not None:
                self._evict(e.block)
            e.lo, e.hi = min(e.lo, leaf.offset), max(e.hi, leaf.offset + leaf.span_bytes())
            e.pinned = None
        return e

    # ---- the graph ----------------------------------------------------------------------------
    def _plan_info(self, plan) -> _PlanInfo:
        info = self._plans.get(id(plan))
        if info is not None and info.plan_ref() is plan:
            return info
        segs, others = [], {}
        for seg in plan.segments:
            leaves = _segment_leaves(seg)
            segs.append(list({id(e): e for e in map(self._entry, leaves) if e is not None}.values()))
            others.update((id(t.owner), t.owner) for t in leaves if id(t.owner) not in self._entries)
        info = _PlanInfo(weakref.ref(plan), [s.name for s in plan.segments], segs,
                         plan.arena_bytes + plan.cross_bytes + plan.output_bytes,
                         sum(o.span_bytes() for o in others.values()))
        for k, ents in enumerate(segs):
            for e in ents:
                info.uses.setdefault(id(e), []).append(k)
        self._plans = {k: v for k, v in self._plans.items() if v.plan_ref() is not None}
        self._plans[id(plan)] = info
        return info

    def begin_graph(self, plan, extra_bytes: int = 0) -> bool:
        """Announce the graph about to run (its Plan; call before allocating its arenas): checks
        the budget, makes room for the graph's activations within it, logs the segment split the
        first time, enables prefetch. `extra_bytes`: device scratch the backend adds to the plan's
        arenas. True when all its weights are resident."""
        self._unpin(list(self._pinned))    # a run that raised midway left its pins
        self._count_outside()
        info = self._plan_info(plan)
        self._current, self._activation = info, info.activation_bytes + int(extra_bytes)
        self._seg = -1
        self.stats = _RunStats()
        ents = info.entries()
        in_plan = {id(e) for e in ents}
        kept_other = sum(b.nbytes for b in self._blocks if b.permanent and not any(
            id(e) in in_plan for e in b.entries))
        total = sum(e.nbytes for e in ents)
        largest = max(range(len(info.segments)), key=info.weight_bytes, default=0)
        seg_max = info.weight_bytes(largest) if info.segments else 0
        limit = self.budget
        capacity = (self.memory.mem_get_info()[0] + self.resident_bytes if limit is None else limit) - kept_other
        segmented = self.segmented and len(info.segments) > 1
        fits = self._activation + total <= capacity
        budget_txt = self._budget_name() if limit is not None else f"{_mb(capacity)} free"
        if limit is not None and not fits and self._activation + (seg_max if segmented else total) > capacity:
            what = (f"its largest segment '{info.names[largest]}' needs {_mb(seg_max)} of weights" if segmented
                    else f"its weights need {_mb(total)} at once" +
                    (" (--disable-segmented-compute)" if not self.segmented else " (no cut points)"))
            raise DeviceOutOfMemoryError(
                f"{self.name}: the graph does not fit: {what} + {_mb(self._activation)} of activations, over the "
                f"{budget_txt}" + (f" ({_mb(kept_other)} held by weights kept on the device)" if kept_other else "")
                + "; raise --max-vram, or use --vae-tiling / a smaller image")
        graph_bytes = getattr(self.graphs, "graph_bytes", None)
        fresh = graph_bytes is not None and not graph_bytes(plan)[0]
        self._pending = info.activation_bytes + info.leaf_bytes if fresh else 0
        if limit is not None:
            # the backend allocates this graph's arenas next: they must fit beside what stays
            while self._footprint() > limit and self._free_step(set(), False):
                pass
            held = self._footprint()
            if held > limit and not info.warned:
                info.warned = True
                log.warning("residency %s: %s held on the device with this graph's activations, over the %s: "
                            "nothing more can be evicted or released (weights kept on the device, memory the "
                            "backend holds for itself)", self.name, _mb(held), budget_txt)
        if info.runs == 0:
            comps = sorted({e.component for e in ents})
            everyone = sorted({e.component for e in self._entries.values()})
            shared = f" (one for {', '.join(everyone)} on {self.name})" if limit is not None and len(everyone) > 1 else ""
            log.info("residency %s: %s graph, %d segments, weights %s + activations %s, %s%s: %s", self.name,
                     "/".join(comps) or "weightless", len(info.segments), _mb(total), _mb(self._activation),
                     budget_txt, shared, "fits, weights stay resident" if fits else
                     f"streams segment by segment (largest {_mb(seg_max)})")
            log.info("residency %s: segment weights (MB): %s", self.name, ", ".join(
                f"{n or 'final'} {info.weight_bytes(k) / MiB:.1f}" for k, n in enumerate(info.names)))
        return all(e.block is not None for e in ents)

    def all_resident(self, plan) -> bool:
        return all(e.block is not None for e in self._plan_info(plan).entries())

    # ---- segments -----------------------------------------------------------------------------
    def begin_segment(self, index: int, name, leaves) -> None:
        """Make every registered weight among `leaves` resident and pin it until end_segment.
        With segmented compute off, segment 0 brings in and pins the whole graph's weights."""
        info = self._current
        known = info is not None and index < len(info.segments) and info.names[index] == name
        if known:
            for leaf in leaves:            # views the plan did not show (cheap: dict lookups)
                self._entry(leaf)
            ents = info.segments[index]
            if not self.segmented:
                ents = [] if index else list({id(e): e for s in info.segments for e in s}.values())
        else:
            ents = list({id(e): e for e in map(self._entry, leaves) if e is not None}.values())
        self._unpin([index])               # stale: that segment of an aborted run never ended
        self._seg = index
        self._pending = 0                  # the backend has allocated the graph's arenas by now
        self._epoch += 1
        pinned: list[_Block] = []
        for b in {id(e.block): e.block for e in ents if e.block is not None}.values():
            if b.ready is not None:         # prefetched: compute waits for the copy stream
                self.memory.wait(b.ready, "compute")
                b.ready = None
            b.pins += 1
            b.last_use = self._epoch
            pinned.append(b)
        for group in self._pack([e for e in ents if e.block is None]):
            b = self._stage(group, "compute", protect=pinned)
            b.pins += 1
            pinned.append(b)
        self._sample(device=True)
        hold = -1 if known and not self.segmented else index     # -1: the whole graph's pins
        self._pinned.setdefault(hold, []).extend(pinned)
        if self.prefetch and self.segmented and known and index + 1 < len(info.segments):
            self._prefetch(info, index + 1, pinned)

    def device_ptr(self, leaf) -> int:
        """Device address of the leaf's first byte (leaf.offset in its owner's storage)."""
        e = self._entries.get(id(leaf.owner))
        if e is None or e.block is None:
            raise UsageError(f"residency {self.name}: weight {leaf.owner.name or leaf!r} is not resident "
                             f"(begin_segment was not called for a segment that reads it)")
        return e.block.ptr + e.offset + (leaf.offset - e.lo)

    def _unpin(self, indices) -> None:
        for k in indices:
            for b in self._pinned.pop(k, ()):
                b.pins -= 1

    def end_segment(self, index: int) -> None:
        """Unpin the segment's blocks (they stay resident until evicted)."""
        self._sample(device=True)          # the scratch may have grown during the segment
        self._unpin([index])
        info = self._current
        if info is not None and index == len(info.segments) - 1:
            self._unpin([-1])
            self._finish_run(info)
            self._current, self._activation = None, 0

    def _finish_run(self, info: _PlanInfo) -> None:
        s = self.stats
        first = info.runs == 0
        info.runs += 1
        over = self.budget is not None and s.held_peak > self.budget
        level = (logging.WARNING if over else
                 logging.INFO if first or s.uploaded != info.last_upload else logging.DEBUG)
        info.last_upload = s.uploaded
        vs = (f"the {self._budget_name()}" + (" (over it)" if over else "")
              if self.budget is not None else "no --max-vram budget")
        log.log(level, "residency %s: run %d uploaded %s in %d blocks (%s prefetched, %s newly pinned on the host), "
                "evicted %s; device peak %s "
                "held by sdrt (weights, arenas, scratch, allocator cache) vs %s; %s used on the device (all "
                "processes and the driver's context); %s resident", self.name, info.runs, _mb(s.uploaded), s.blocks,
                _mb(s.prefetched), _mb(s.pinned), _mb(s.evicted), _mb(s.held_peak), vs, _mb(s.device_peak),
                _mb(self.resident_bytes))

    # ---- staging ------------------------------------------------------------------------------
    def _pack(self, entries: list[_Entry]) -> list[list[_Entry]]:
        """Group entries (in order) into blocks of at most block_bytes (a bigger one alone);
        weights kept on the device never share a block with evictable ones."""
        groups, cur, size, perm = [], [], 0, None
        for e in entries:
            n = -(-e.nbytes // ALIGN) * ALIGN
            p = e.params == "device"
            if cur and (size + n > self.block_bytes or p != perm):
                groups.append(cur)
                cur, size = [], 0
            cur.append(e)
            size += n
            perm = p
        if cur:
            groups.append(cur)
        return groups

    def _stage(self, group: list[_Entry], stream: str, protect, optional: bool = False) -> _Block | None:
        offsets, size = [], 0
        for e in group:
            offsets.append(size)
            size += -(-e.nbytes // ALIGN) * ALIGN
        # a block filled past 7/8 takes a whole block_bytes (the CUDA allocator's size classes are
        # 1/8 of the power of two apart there anyway): equal sizes let the memory of an evicted
        # block, in the allocator's cache, serve the next one without a driver call
        room = self.block_bytes if self.block_bytes * 7 // 8 < size <= self.block_bytes else size
        ptr = self._alloc(room, protect, optional)
        if ptr is None:
            return None
        b = _Block(ptr, room, list(group), permanent=all(e.params == "device" for e in group),
                   last_use=self._epoch)
        self._blocks.append(b)
        self.resident_bytes += room
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes + self._activation)
        ev = None
        for e, off in zip(group, offsets):
            src, pinned = self._host_bytes(e)
            ev = (self.memory.upload_pinned if pinned else self.memory.upload)(ptr + off, src, stream)
            if e.params == "disk":
                release_file_pages(e.owner.storage, e.lo, e.nbytes)
            e.block, e.offset = b, off
        if stream == "copy":
            b.ready = ev
            self.stats.prefetched += size
        self.stats.uploaded += size
        self.stats.blocks += 1
        return b

    def _host_bytes(self, e: _Entry) -> tuple[np.ndarray, bool]:
        """What to upload for `e`, and whether it is a pinned copy. A `cpu` weight read from a
        model file's map is copied, on its first upload, into this manager's pinned host pool when
        the memory makes one (memory.pinned_pool; its copy returns None once full) and its file
        pages are dropped: the copy is the RAM copy --offload-to-cpu keeps, and each later upload
        is one DMA (memory.upload_pinned) that neither copies nor waits on the host, so prefetches
        overlap the compute. Anything else: its storage."""
        st = e.owner.storage
        if e.pinned is not None and e.pinned_of is st:
            return e.pinned, True
        src = st[e.lo:e.hi]
        if e.params != "cpu" or not read_only_file_map(st):
            return src, False
        if self._pool is None:
            make = getattr(self.memory, "pinned_pool", None)
            if make is None:
                return src, False
            self._pool = make()
        e.pinned = self._pool.copy(src)
        if e.pinned is None:
            return src, False
        e.pinned_of = st
        self.stats.pinned += e.nbytes
        release_file_pages(st, e.lo, e.nbytes)
        return e.pinned, True

    def _prefetch(self, info: _PlanInfo, k: int, pinned: list[_Block]) -> None:
        missing = [e for e in info.segments[k] if e.block is None]
        if not missing:
            return
        protect = list(pinned) + [e.block for e in info.segments[k] if e.block is not None]
        record = getattr(self.memory, "record", None)
        # the copy stream may reuse memory freed from blocks earlier segments read: it starts
        # after the compute stream's work so far (this segment's kernels are not enqueued yet)
        if record is not None:
            self.memory.wait(record("compute"), "copy")
        else:
            self.memory.synchronize()
        for group in self._pack(missing):
            if self._stage(group, "copy", protect, optional=True) is None:
                break

    # ---- memory -------------------------------------------------------------------------------
    def _count_outside(self) -> None:
        """A positive --max-vram caps the process's whole use of the device, as nvidia-smi shows
        it: what the process holds outside the allocator (memory.outside_bytes: the CUDA context,
        cuBLAS, kernel modules) comes off what sdrt may hold. (sd.cpp's budget leaves them out,
        so its process goes ~0.6 GiB over; a negative budget is free memory once the context is
        made, so it is left as it is.)"""
        outside = getattr(self.memory, "outside_bytes", None)
        if outside is None or not self.max_vram or self.max_vram < 0:
            return
        self.outside = int(outside())
        if self.budget <= 0:
            raise DeviceOutOfMemoryError(
                f"{self.name}: --max-vram {self.max_vram:g} GiB ({_mb(self.limit)}): the CUDA context and libraries "
                f"already hold {_mb(self.outside)} of it; nothing is left for sdrt (raise --max-vram)")

    @property
    def budget(self) -> int | None:
        """What sdrt may hold on the device: the --max-vram limit less what the process holds
        outside the allocator (None: no budget)."""
        return None if self.limit is None else self.limit - self.outside

    def _budget_name(self) -> str:
        """'--max-vram budget 3072.0 MB', with what came off it for the process's use outside sdrt."""
        if not self.outside:
            return f"--max-vram budget {_mb(self.budget)}"
        return (f"--max-vram budget {_mb(self.budget)} ({_mb(self.limit)} less {_mb(self.outside)} the process "
                f"holds outside sdrt's allocator: the CUDA context, libraries)")

    def _mem_stats(self) -> tuple[int, int] | None:
        """(bytes in use, bytes cached) of the device allocator, when the memory object says."""
        fn = getattr(self.memory, "stats", None)
        if fn is None:
            return None
        st = fn()
        return int(st.get("in_use", 0)), int(st.get("cached", 0))

    def _running_plan(self):
        return self._current.plan_ref() if self._current is not None else None

    def _idle_bytes(self) -> int:
        """Device bytes the backend holds for graphs other than the running one."""
        fn = getattr(self.graphs, "graph_bytes", None)
        return int(fn(self._running_plan())[1]) if fn is not None else 0

    def _footprint(self, nbytes: int = 0) -> int:
        """What sdrt would hold on the device with `nbytes` more allocated: the larger of the ledger
        (resident weights + the running graph's activations and scratch + other graphs' state) and
        the allocator's bytes in use (+ the running graph's arenas still to come), plus the
        allocator's cache — less `nbytes` when a block of that size was evicted into the cache
        (the allocation takes it back, the device's footprint does not grow)."""
        ledger = self.resident_bytes + self._activation + self._idle_bytes() + nbytes
        st = self._mem_stats()
        if st is None:
            return ledger
        in_use, cached = st
        if not cached:
            self._freed.clear()
        reuse = nbytes if nbytes and cached >= nbytes and self._freed.get(nbytes) else 0
        return max(ledger, in_use + self._pending + nbytes) + cached - reuse

    def _fits_budget(self, nbytes: int) -> bool:
        # live free memory (no budget): the allocation itself decides, since a caching allocator
        # can serve it from blocks mem_get_info does not count as free
        return self.budget is None or self._footprint(nbytes) <= self.budget

    def _sample(self, device: bool = False) -> None:
        st = self._mem_stats()
        held = self.resident_bytes + self._activation + self._idle_bytes()
        if st is not None:
            held = max(held, st[0] + self._pending) + st[1]
        self.stats.held_peak = max(self.stats.held_peak, held)
        if device:
            free, total = self.memory.mem_get_info()
            self.stats.device_peak = max(self.stats.device_peak, total - free)

    def _alloc(self, nbytes: int, protect, optional: bool) -> int | None:
        protected = {id(b) for b in protect}
        while True:
            if self._fits_budget(nbytes):
                before = self._mem_stats()
                try:
                    ptr = self.memory.alloc(nbytes)
                except DeviceOutOfMemoryError:
                    ptr = None
                if ptr is not None:
                    self._allocated(nbytes, before)
                    return ptr
            if not self._free_step(protected, optional):
                if optional:
                    return None
                if self.budget is not None and self.resident_bytes + self._activation + nbytes <= self.budget:
                    # what is over the budget is held outside the manager's reach (memory the
                    # backend keeps for itself, graphs' state it cannot release): go on, say so
                    self._over_budget(nbytes)
                    try:
                        ptr = self.memory.alloc(nbytes)
                    except DeviceOutOfMemoryError:
                        ptr = None
                    if ptr is not None:
                        self._allocated(nbytes, None)
                        return ptr
                raise DeviceOutOfMemoryError(self._oom_message(nbytes))

    def _over_budget(self, nbytes: int) -> None:
        if self._warned_over:
            return
        self._warned_over = True
        held = self._footprint(nbytes)
        log.warning("residency %s: %s would be held on the device, over the %s, though the "
                    "weights (%s) and the running graph's activations (%s) fit in it: the rest is memory the "
                    "residency manager cannot free (other graphs' arenas, the backend's own buffers)", self.name,
                    _mb(held), self._budget_name(), _mb(self.resident_bytes + nbytes), _mb(self._activation))

    def _allocated(self, nbytes: int, before) -> None:
        """Bookkeeping after an allocation: which evicted block it reused from the allocator's
        cache; if it grew the footprint past the budget after all (another user took the block
        it was to reuse), the cache goes back at once."""
        after = self._mem_stats()
        if before is not None and after is not None and self._freed.get(nbytes):
            if after[1] < before[1]:
                self._freed[nbytes] -= 1
            else:
                del self._freed[nbytes]
        if self.budget is not None and after is not None and after[1] and self._footprint() > self.budget:
            self._trim_cache()
        self._sample()

    def _trim_cache(self) -> int:
        """Give the allocator's cached blocks back to the driver; returns the bytes."""
        st = self._mem_stats()
        empty = getattr(self.memory, "empty_cache", None)
        if st is None or not st[1] or empty is None:
            return 0
        self.memory.synchronize()       # queued kernels may still read memory freed into the cache
        empty()
        self._freed.clear()
        return st[1]

    def _release_graphs(self) -> int:
        """Other graphs' device state, through the backend; never without a known running graph
        (its own state would go too)."""
        fn = getattr(self.graphs, "release_graphs", None)
        plan = self._running_plan()
        return int(fn(plan) or 0) if fn is not None and plan is not None else 0

    def _free_step(self, protected: set, optional: bool, trim: bool = True) -> int:
        """Make some room; the bytes freed (0: nothing left to free). In order: the allocator's
        cache (free memory nobody uses), weights the running graph does not read (LRU), other
        graphs' device state (rebuilt on their next run), the running graph's own weights
        (farthest next use)."""
        if trim:
            freed = self._trim_cache()
            if freed:
                return freed
        victim, own = self._victim(protected, optional)
        if victim is not None and not own:
            self._evict(victim)
            return victim.nbytes
        freed = self._release_graphs()
        if freed:
            return freed
        if victim is not None:
            self._evict(victim)
            return victim.nbytes
        return 0

    def _oom_message(self, nbytes: int) -> str:
        free, total = self.memory.mem_get_info()
        held = sum(b.nbytes for b in self._blocks if b.pins or b.permanent)
        msg = (f"{self.name}: cannot make room for {_mb(nbytes)} of weights: {_mb(self.resident_bytes)} resident "
               f"({_mb(held)} pinned by the running segment or kept on the device), ")
        msg += (f"activations {_mb(self._activation)}, {self._budget_name()}" if self.budget is not None
                else f"{_mb(free)} free of {_mb(total)}")
        info = self._current
        if info is not None and not self.segmented:
            msg += (f"; with --disable-segmented-compute all {_mb(sum(e.nbytes for e in info.entries()))} of the "
                    f"graph's weights must be resident at once")
        return msg

    def _victim(self, protected: set, optional: bool) -> tuple[_Block | None, bool]:
        """(block, whether the running graph reads it): unused-by-this-graph blocks LRU first,
        then this graph's by farthest next use. For a prefetch (optional), never a block the
        graph needs before the segment being fetched."""
        info, cur = self._current, self._seg
        n = len(info.segments) if info is not None else 0
        best, best_key = None, None
        for b in self._blocks:
            if b.pins or b.permanent or id(b) in protected:
                continue
            dist = None
            if info is not None:
                for e in b.entries:
                    for s in info.uses.get(id(e), ()):
                        d = (s - cur) % n if n else 0
                        dist = d if dist is None else min(dist, d)
            if dist is None:
                key = (0, b.last_use)
            else:
                if optional and dist <= 1:
                    continue
                key = (1, -dist)
            if best_key is None or key < best_key:
                best, best_key = b, key
        return best, best_key is not None and best_key[0] == 1

    def _evict(self, b: _Block) -> None:
        if b.ready is not None:     # a prefetch still writing it: later users of the memory wait
            self.memory.wait(b.ready, "compute")
            b.ready = None
        self.memory.free(b.ptr)
        self._freed[b.nbytes] = self._freed.get(b.nbytes, 0) + 1
        self._blocks.remove(b)
        self.resident_bytes -= b.nbytes
        self.stats.evicted += b.nbytes
        self.evictions += 1
        for e in b.entries:
            e.block = None

    def make_room(self, nbytes: int) -> int:
        """Free at least `nbytes` of device memory if there is that much to free — the allocator's
        cache, unpinned weights, other graphs' device state, in _free_step's order — and return
        how many bytes were freed (the backend calls this when its own allocation, e.g. an
        activation arena, failed, and then retries it once)."""
        freed = self._trim_cache()
        while freed < nbytes:
            step = self._free_step(set(), False, trim=False)
            if not step:
                break
            freed += step
        self._trim_cache()              # what was evicted sits in the allocator's cache: give it back
        return freed

    def release_all(self) -> None:
        """Free every device copy (pinned ones included: call between runs only)."""
        self.memory.synchronize()
        for b in list(self._blocks):
            b.pins = 0
            self._evict(b)
        self._trim_cache()


class PlacedBackend:
    """A backend bound to a residency object: `Graph.run(PlacedBackend(be, res))` runs on `be`
    with `res` bringing the weights in (models take it where they take a backend name)."""

    def __init__(self, backend, residency):
        from ..ops.backend import get_backend
        self.backend, self.residency = get_backend(backend), residency
        self.name = self.backend.name

    @property
    def memory(self):    # explicit: Python 3.12's Protocol isinstance check does not see __getattr__
        return self.backend.memory

    def find(self, node):
        return self.backend.find(node)

    def run_graph(self, graph, plan, on_segment=None, residency=None):
        return graph.run(self.backend, on_segment=on_segment, residency=residency or self.residency)

    def __getattr__(self, item):       # memory, devices ... of the wrapped backend
        if item in ("backend", "residency"):
            raise AttributeError(item)
        return getattr(self.backend, item)


def bind_components(placement, tensors: dict, *, prefetch: bool = True, segmented: bool = True) -> dict:
    """{component: what its model runs on}: "cpu", or a PlacedBackend carrying the residency
    object (one ResidencyManager per GPU, shared by the components computing there; a
    HostPageRelease for CPU compute with disk params). `tensors`: the canonical weight table."""
    from ..ops.backend import get_backend
    from .placement import classify_tensor, max_vram_for
    parts: dict[str, dict] = {c: {} for c in placement.backend}
    for name, t in tensors.items():
        c = classify_tensor(name)
        if c in parts:
            parts[c][name] = t
    managers: dict[str, ResidencyManager] = {}
    out: dict = {}
    # a GPU whose components all keep their weights there, with no --max-vram, needs no manager:
    # the backend caches the weights itself and can replay its runs as CUDA graphs
    managed = {dev for c, dev in placement.backend.items() if dev != "cpu" and (
        placement.params[c] != dev or max_vram_for(placement.max_vram, dev) is not None)}
    for c, dev in placement.backend.items():
        where = placement.params[c]
        if dev == "cpu":
            if where == "disk":
                host = HostPageRelease()
                host.register(parts[c], c, "disk")
                out[c] = PlacedBackend("cpu", host)
            else:
                out[c] = "cpu"
            continue
        be = get_backend(dev)
        register = getattr(be, "register_weights", None)
        if register is not None:    # weights in writeable RAM (--type conversions) are not inputs
            register(parts[c])
        if dev not in managed:
            out[c] = dev
            log.info("%s computes on %s, weights (%s) kept there", c, dev, _mb(sum(t.nbytes for t in parts[c].values())))
            continue
        mgr = managers.get(dev)
        if mgr is None:
            mgr = managers[dev] = ResidencyManager(be.memory, max_vram=max_vram_for(placement.max_vram, dev),
                                                   prefetch=prefetch, segmented=segmented, graphs=be)
        size = mgr.register(parts[c], c, "device" if where == dev else where)
        out[c] = PlacedBackend(be, mgr)
        log.info("%s computes on %s, weights (%s) %s", c, dev, _mb(size),
                 "kept there" if where == dev else f"staged from {'RAM' if where == 'cpu' else 'the model file'}")
    return out
