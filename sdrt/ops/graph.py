"""Graph, planner and runner.

A forward builds Tensors whose `op`/`src` make a DAG (see api.py). `Graph(outputs)` orders the
nodes, `plan()` gives each computed node a slot in one arena by liveness (a node's bytes are
reused once its last consumer — or the last consumer of any view of it — has run), and
`run(backend)` hands the planned graph to the backend's `run_graph` (host backends: `run_on_host`,
node by node over numpy views) and returns the named outputs as leaf Tensors. `check_graph` (and
`run` under SDRT_CHECK=1) runs any backend node by node against the reference backend.

Named cut points (`mark_cut(t, "model.blocks.3")`) split the graph into segments, in the order
the cut nodes are reached: segment k holds what cut k needs that earlier segments did not
compute. Each segment is planned on its own; tensors crossing a boundary live in a second
arena planned by liveness over the whole run (freed after their last consumer). A runner can
bring weights in segment by segment (see `on_segment`). Offsets are placed largest buffer first
(`plan`'s plan_arena).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import OpError, UnsupportedError
from .registry import OPS
from .tensor import Tensor

log = logging.getLogger("sdrt.graph")
ALIGN = 64


def mark_cut(t: Tensor, name: str) -> Tensor:
    """Mark `t` as a named cut point (a segment ends after it is computed)."""
    if t.is_leaf:
        raise OpError(f"mark_cut({name!r}): {t!r} is a leaf, only computed nodes can be cut points")
    t.owner.cut = name
    return t


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Segment:
    name: str | None
    nodes: list[Tensor]
    offsets: dict[int, int] = field(default_factory=dict)  # id(node) -> arena offset
    arena_bytes: int = 0


@dataclass
class Plan:
    segments: list[Segment]
    outputs: list[Tensor]       # computed outputs: own buffers, handed to the caller
    arena_bytes: int            # the largest segment arena (one buffer is reused)
    cross_offsets: dict[int, int]  # id(node) -> offset in the cross-segment arena
    cross_bytes: int
    output_bytes: int
    naive_bytes: int            # every computed node in its own buffer

    @property
    def peak_bytes(self) -> int:
        """Planned peak of intermediate + output memory (weights and inputs not counted)."""
        return self.arena_bytes + self.cross_bytes + self.output_bytes


class Graph:
    def __init__(self, outputs):
        if isinstance(outputs, Tensor):
            outputs = {"out": outputs}
        elif not isinstance(outputs, dict):
            outputs = {f"out{i}": t for i, t in enumerate(outputs)}
        self.outputs: dict[str, Tensor] = dict(outputs)
        self._order_nodes()

    # ---- ordering -----------------------------------------------------------------------
    def _order_nodes(self):
        seen: set[int] = set()
        order: list[Tensor] = []
        seg_of: dict[int, int] = {}

        def visit(root: Tensor, seg: int):
            stack = [(root.owner, False)]
            while stack:
                t, done = stack.pop()
                if done:
                    order.append(t)
                    seg_of[id(t)] = seg
                    continue
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if t.op is None:
                    if t.storage is None:
                        raise OpError(f"graph input {t!r} has no data")
                    continue
                stack.append((t, True))
                for s in reversed(t.src):
                    if id(s.owner) not in seen:
                        stack.append((s.owner, False))

        # first pass: find the cut nodes in dependency order
        for t in self.outputs.values():
            visit(t, 0)
        probe = [n for n in order if n.cut is not None]
        seen.clear()
        order.clear()
        seg_of.clear()
        for k, c in enumerate(probe):
            visit(c, k)
        for t in self.outputs.values():
            visit(t, len(probe))
        self.cut_nodes = probe
        self.nodes = order
        self.segment_index = seg_of

    # ---- planning -----------------------------------------------------------------------
    def plan(self, sizes: dict[int, int] | None = None) -> Plan:
        """Slots for every computed node; `sizes` ({id(node): bytes}) overrides the bytes of nodes a
        backend stores in fewer (the CUDA backend's F32 results kept as F16/BF16)."""
        nodes = self.nodes

        def size(n: Tensor) -> int:
            return _align(sizes.get(id(n), n.nbytes) if sizes else n.nbytes)
        pos = {id(n): i for i, n in enumerate(nodes)}
        last_use = {id(n): pos[id(n)] for n in nodes}
        crossing: set[int] = set()
        for i, n in enumerate(nodes):
            for s in n.src:
                o = s.owner
                if o.op is not None:
                    last_use[id(o)] = max(last_use[id(o)], i)
                    if self.segment_index[id(o)] != self.segment_index[id(n)]:
                        crossing.add(id(o))
        output_ids = {id(t.owner) for t in self.outputs.values() if t.owner.op is not None}
        outputs = [n for n in nodes if id(n) in output_ids]
        crossing -= output_ids
        own_arena = output_ids | crossing

        def inplace_src(n: Tensor) -> Tensor | None:
            """The computed input whose buffer `n` may take over: an element-wise op (OpDef
            .inplace) reading, with the same shape, type and contiguous layout, a node whose
            last consumer is `n`, in the same segment, and read through no other view here; with
            `sizes`, a node of no more bytes than the input's (a half-stored result over an F32
            one keeps the F32 slot)."""
            if id(n) in own_arena or not getattr(OPS.get(n.op), "inplace", False):
                return None
            for s in n.src:
                o = s.owner
                if (o.op is not None and id(o) not in own_arena and last_use[id(o)] == pos[id(n)]
                        and self.segment_index[id(o)] == self.segment_index[id(n)]
                        and s.ne == n.ne and s.dtype == n.dtype and s.offset == o.offset
                        and s.is_contiguous() and size(o) >= size(n)
                        and all(t is s or t.owner is not o for t in n.src)):
                    return o
            return None

        # an attention read only by the cont right after it (the heads merged back): the cont
        # is placed with the attention, apart from the attention's inputs, so that a backend may
        # write the cont from the attention kernel directly (the CUDA one does: fuse.py)
        placed_with: dict[int, Tensor] = {}
        for i, n in enumerate(nodes):
            o = n.src[0].owner if n.op == "cont" else None
            if (o is not None and o.op == "attention" and pos[id(o)] == i - 1 and last_use[id(o)] == i
                    and self.segment_index[id(o)] == self.segment_index[id(n)]
                    and id(o) not in own_arena and id(n) not in own_arena):
                placed_with[id(o)] = n

        def plan_arena(members, offsets) -> int:
            """Offsets for `members` (in run order) in one arena; returns its bytes. A node's
            buffer lives from its own step to its last consumer's (which may be outside
            `members`); an in-place node (inplace_src) continues its input's buffer, and a cont
            placed with the attention before it starts its buffer at the attention's step (apart
            from the attention's inputs). The buffers are placed largest first, each at the
            lowest offset clear of the placed buffers whose lifetimes meet its own (the "greedy
            by size" offline plan: peaks close to the live bytes, which placing in run order
            missed by leaving holes too small for a late large tensor)."""
            bufs: list[list] = []       # [bytes, first step, last step, nodes]
            buf_of: dict[int, list] = {}
            for n in members:
                if id(n) in buf_of:     # a cont placed with the attention before it
                    continue
                src = inplace_src(n)
                b = buf_of.get(id(src)) if src is not None else None
                if b is not None:
                    b[2] = max(b[2], last_use[id(n)])
                    b[3].append(n)
                else:
                    b = [size(n), pos[id(n)], last_use[id(n)], [n]]
                    bufs.append(b)
                buf_of[id(n)] = b
                c = placed_with.get(id(n))
                if c is not None:
                    cb = [size(c), pos[id(n)], last_use[id(c)], [c]]
                    bufs.append(cb)
                    buf_of[id(c)] = cb
            # placed buffers' offsets, ends and lifetimes as arrays: the lifetime test is one
            # vectorized pass per buffer (graphs of thousands of nodes in one segment: ESRGAN)
            k = len(bufs)
            first_step = np.array([b[1] for b in bufs], np.int64)
            last_step = np.array([b[2] for b in bufs], np.int64)
            start, end = np.zeros(k, np.int64), np.zeros(k, np.int64)
            placed = np.zeros(k, bool)
            top = 0
            for i in sorted(range(k), key=lambda i: (-bufs[i][0], bufs[i][1])):
                nbytes, first, last, group = bufs[i]
                meet = np.flatnonzero(placed & (first_step <= last) & (last_step >= first))
                off, best = 0, None
                for o, e in sorted(zip(start[meet].tolist(), end[meet].tolist())):
                    if o - off >= nbytes and (best is None or o - off < best[1]):   # the smallest gap that fits
                        best = (off, o - off)
                    off = max(off, e)
                off = best[0] if best is not None else off
                start[i], end[i], placed[i] = off, off + nbytes, True
                top = max(top, off + nbytes)
                for n in group:
                    offsets[id(n)] = off
            return top

        names = [c.cut for c in self.cut_nodes] + [None]
        segments = [Segment(nm, []) for nm in names]
        for n in nodes:
            segments[self.segment_index[id(n)]].nodes.append(n)
        for seg in segments:
            seg.arena_bytes = plan_arena([n for n in seg.nodes if id(n) not in own_arena], seg.offsets)
        cross_offsets: dict[int, int] = {}
        cross_bytes = plan_arena([n for n in nodes if id(n) in crossing], cross_offsets)
        segments = [s for s in segments if s.nodes or s.name is None]
        return Plan(segments, outputs,
                    arena_bytes=max((s.arena_bytes for s in segments), default=0),
                    cross_offsets=cross_offsets, cross_bytes=cross_bytes,
                    output_bytes=sum(size(n) for n in outputs),
                    naive_bytes=sum(size(n) for n in nodes))

    # ---- running ------------------------------------------------------------------------
    def run(self, backend="cpu", on_segment=None, residency=None) -> dict[str, Tensor]:
        """Execute on `backend` (a name or a Backend, see ops/backend.py); returns {name: leaf
        Tensor with data}. `on_segment(index, name, nodes)` is called before each segment runs.
        `residency` (sdrt.engine.residency; the SegmentHooks protocol, a device backend needs the
        whole Residency one) gets begin_segment(index, name, leaf srcs) before and
        end_segment(index) after each segment. With SDRT_CHECK=1 in the environment every node
        is also run on the reference backend and compared (check_graph): a node that differs
        raises NodeMismatch naming it."""
        from .backend import get_backend
        be = get_backend(backend)
        plan = self.__dict__.get("_plan")
        if plan is None:  # planning the SD1.5 UNet's 765 nodes takes ~23 ms: once per graph
            plan = self._plan = self.plan()
        if not _CHECKING and os.environ.get("SDRT_CHECK", "0") not in ("", "0"):
            return _check_run(self, plan, be, on_segment, residency)[0]
        return be.run_graph(self, plan, on_segment, residency)


def run_on_host(graph: Graph, plan: Plan, be, on_segment=None, residency=None) -> dict[str, Tensor]:
    """The host backends' runner: every node's kernel (be.find) on numpy views of one arena."""
    debug = int(os.environ.get("SDRT_DEBUG", "0") or 0)
    arena = np.empty(plan.arena_bytes, np.uint8)
    cross = np.empty(plan.cross_bytes, np.uint8)
    storage: dict[int, np.ndarray] = {}
    for n in plan.outputs:
        storage[id(n)] = np.empty(_align(n.nbytes), np.uint8)
    if debug:
        log.info("plan: %d nodes, %d segments, arena %.1f MB, cross-segment %.1f MB, outputs %.1f MB "
                 "(naive %.1f MB)", len(graph.nodes), len(plan.segments), plan.arena_bytes / 2**20,
                 plan.cross_bytes / 2**20, plan.output_bytes / 2**20, plan.naive_bytes / 2**20)

    def np_view(t: Tensor) -> np.ndarray:
        o = t.owner
        st = o.storage if o.op is None else storage[id(o)]
        return t.numpy_from(st)

    for k, seg in enumerate(plan.segments):
        if on_segment is not None:
            on_segment(k, seg.name, seg.nodes)
        if residency is not None:
            residency.begin_segment(k, seg.name, [s for n in seg.nodes for s in n.src if s.owner.op is None])
        for n in seg.nodes:
            if id(n) in seg.offsets:
                off = seg.offsets[id(n)]
                storage[id(n)] = arena[off:off + _align(n.nbytes)]
            elif id(n) in plan.cross_offsets:
                off = plan.cross_offsets[id(n)]
                storage[id(n)] = cross[off:off + _align(n.nbytes)]
            kern = be.find(n)
            if kern is None:
                srcs = ", ".join(s.dtype.name for s in n.src)
                raise UnsupportedError(f"backend {be.name!r} has no kernel for {n.op}({srcs}) -> {n.dtype.name}")
            xs = [np_view(s) for s in n.src]
            out = np_view(n)
            t0 = time.perf_counter() if debug >= 2 else 0.0
            kern.fn(n, xs, out)
            if debug >= 2:
                log.info("%-16s %-28s %s %8.3f ms", n.op, n.name or "", list(n.ne),
                         (time.perf_counter() - t0) * 1e3)
        if residency is not None:
            residency.end_segment(k)
    return _results(graph, storage)


def _results(graph: Graph, storage: dict) -> dict[str, Tensor]:
    """The graph's outputs as leaf Tensors over host storages (id(node) -> uint8 array)."""
    result = {}
    for name, t in graph.outputs.items():
        o = t.owner
        st = o.storage if o.op is None else storage[id(o)]
        result[name] = Tensor(t.dtype, t.ne, t.nb, storage=st, offset=t.offset, name=t.name or name)
    return result


def evaluate(*tensors: Tensor, backend="cpu"):
    """Eager helper: run the graph of the given tensors; returns leaf Tensor(s) with data."""
    out = Graph(list(tensors)).run(backend)
    vals = list(out.values())
    return vals[0] if len(vals) == 1 else vals


def compute(t: Tensor, backend="cpu") -> np.ndarray:
    """Eager helper for tests: evaluate and return float32 values in numpy order."""
    return evaluate(t, backend=backend).to_f32()


class NodeMismatch(OpError):
    """check_graph found a node whose backend result differs from the reference."""


_CHECKING = False   # a check run is under way: the graph runs it makes run plainly


def check_graph(outputs, backend="cpu", on_segment=None, residency=None) -> int:
    """Run the graph of `outputs` on `backend` node by node, each node also on the reference
    backend with the same inputs (the backend's results of the nodes before it), and raise
    NodeMismatch naming the first node whose result differs by more than its op's tolerance
    (registry.max_nmse). Works on any backend (a device one runs one-node graphs). Returns the
    number of nodes checked. SDRT_CHECK=1 does this inside every Graph.run."""
    g = outputs if isinstance(outputs, Graph) else Graph(outputs)
    from .backend import get_backend
    plan = g.__dict__.get("_plan") or g.plan()
    _check_run(g, plan, get_backend(backend), on_segment, residency)
    return len(g.nodes)


def _check_run(graph: Graph, plan: Plan, be, on_segment, residency) -> tuple[dict, int]:
    global _CHECKING
    from .backend import get_backend
    from .registry import compare, max_nmse
    ref = get_backend("reference")
    pos = {id(n): i for i, n in enumerate(graph.nodes)}
    last_use = dict(pos)
    for i, n in enumerate(graph.nodes):
        for s in n.src:
            if s.owner.op is not None:
                last_use[id(s.owner)] = i
    keep = {id(t.owner) for t in graph.outputs.values()}
    host: dict[int, np.ndarray] = {}

    def leaf(s: Tensor) -> Tensor:
        o = s.owner
        if o.op is None:
            return s
        return Tensor(s.dtype, s.ne, s.nb, storage=host[id(o)], offset=s.offset, name=s.name)

    _CHECKING, was = True, _CHECKING
    try:
        for k, seg in enumerate(plan.segments):
            if on_segment is not None:
                on_segment(k, seg.name, seg.nodes)
            for n in seg.nodes:
                one = Tensor(n.dtype, n.ne, op=n.op, src=tuple(leaf(s) for s in n.src), params=n.params,
                             name=n.name)
                g1 = Graph(one)
                got = be.run_graph(g1, g1.plan(), None, residency)["out"]
                want = Graph(one).run(ref)["out"]
                err, tol = compare(got, want), max_nmse(n)
                if not err <= tol:
                    srcs = ", ".join(f"{s.dtype.name}{list(s.ne)}" for s in n.src)
                    raise NodeMismatch(
                        f"node {n.op}{' ' + repr(n.name) if n.name else ''} (#{pos[id(n)] + 1} of {len(graph.nodes)}), "
                        f"({srcs}) -> "
                        f"{n.dtype.name}{list(n.ne)}: {be.name} differs from the reference, NMSE {err:.3g} > "
                        f"{tol:.3g} (max |diff| {_max_diff(got, want):.3g})")
                host[id(n)] = got.storage
                for s in n.src:
                    o = s.owner
                    if o.op is not None and last_use[id(o)] == pos[id(n)] and id(o) not in keep:
                        host.pop(id(o), None)
    finally:
        _CHECKING = was
    log.info("check: the %d nodes of the graph agree with the reference on %s", len(graph.nodes), be.name)
    return _results(graph, host), len(graph.nodes)


def _max_diff(a: Tensor, b: Tensor) -> float:
    with np.errstate(invalid="ignore"):
        d = np.abs(a.to_f32().astype(np.float64) - b.to_f32())
    return float(np.nanmax(d)) if d.size and not np.isnan(d).all() else float("nan")
