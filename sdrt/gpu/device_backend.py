"""What the device backends (sdrt.gpu.cuda, sdrt.gpu.vulkan) share: importing their op-family
modules, and the per-graph device state a residency manager reads and frees.

A backend keeps one state object per Graph it ran (`_states`, weak on the graph; each state has
`plan`, `nbytes` and `release()`), under `_lock`; `_after_release()` is the backend's hook for
what freeing needs next (CUDA runs the frees it deferred)."""
from __future__ import annotations

import importlib
import pkgutil
import threading
import weakref

from ..ops.graph import ALIGN


def import_families(ops_package) -> list[str]:
    """Import every op-family module of a backend's ops package (each registers its kernels)."""
    names = [m.name for m in pkgutil.iter_modules(ops_package.__path__) if not m.name.startswith("_")]
    for name in names:
        importlib.import_module(f"{ops_package.__name__}.{name}")
    return names


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def node_addresses(plan, arena: int, cross: int, outputs) -> dict[int, int]:
    """{id(node): address} of every computed node as a device backend lays out a plan: the graph
    outputs at `outputs` (their own allocations, in plan.outputs order), each segment's nodes at
    their offsets in the arena, the nodes living across segments in the cross buffer."""
    ptr = {id(n): p for n, p in zip(plan.outputs, outputs)}
    for seg in plan.segments:
        for n in seg.nodes:
            if id(n) in seg.offsets:
                ptr[id(n)] = arena + seg.offsets[id(n)]
            elif id(n) in plan.cross_offsets:
                ptr[id(n)] = cross + plan.cross_offsets[id(n)]
    return ptr


class GraphStates:
    """The graph-state bookkeeping of a device backend (a mixin: call `_init_states()`)."""

    last_ahead: tuple[int, float] | None = None   # (bytes, seconds) of the last upload_ahead joined

    def _init_states(self) -> None:
        self._states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()

    def _after_release(self) -> None:
        pass

    def _activate(self) -> None:
        """Make this backend's device current for the calling thread (CUDA contexts)."""

    def _finish_uploads(self) -> None:
        """Block until the weight uploads enqueued so far have landed."""

    def preload_weights(self, tensors) -> int:
        """Upload the weights among `tensors` now, into the same cache a graph's first run fills
        on first use (the backend's weight_ptr), so that the first sampling step does not pay for
        them, as sd-cli loads its weights before sampling; returns the bytes uploaded here (an
        upload ahead's are waited for, not counted)."""
        with self._lock:
            self._activate()
            self._join_ahead()
            before = self.weight_bytes()
            for t in tensors:
                o = t.owner
                if o.op is None and o.storage is not None and not self.is_input(o):
                    self.weight_ptr(o)
            self._finish_uploads()
            return self.weight_bytes() - before

    def upload_ahead(self, tensors, max_bytes: int) -> None:
        """Start uploading the weights among `tensors` (at most `max_bytes`) beside the caller's
        next runs on this device. A backend whose weight cache takes uploads from a second thread
        does (CUDA); the default does nothing, leaving them to preload_weights."""

    def _join_ahead(self) -> None:
        """Wait for upload_ahead's work to land (the default has none)."""

    def _drop_weights(self, leaves, keep) -> None:
        """Free the cached device copies of these weight leaves (None: all) but `keep`'s."""
        raise NotImplementedError

    def release_weights(self, tensors=None, keep=()) -> int:
        """Free the device copies of these weights (None: every cached weight) but those of `keep`,
        and every graph's device state (a captured graph holds the weights' addresses), and give
        the freed memory back to the driver; a later run uploads what it reads again. A one-shot
        pipeline calls this when a stage is done with its model (sd-cli frees each stage's buffers
        too), keeping the next stage's uploaded ahead. Returns the weight bytes freed."""
        from ..ops.tensor import Tensor

        def leaves(ts):   # with their storage: a lazy leaf never filled has no device copy
            return [t.owner for t in ts if Tensor.storage.__get__(t.owner) is not None]
        with self._lock:
            self._activate()
            self._join_ahead()
            before = self.weight_bytes()
            self.release_graphs()
            self._drop_weights(None if tensors is None else leaves(tensors), leaves(keep))
            self._after_release()
            self.memory.empty_cache()
            return before - self.weight_bytes()

    def graph_bytes(self, plan=None) -> tuple[int, int]:
        """(device bytes kept for the graph planned as `plan`, for every other graph): arenas,
        input and output buffers held between runs."""
        mine = other = 0
        for state in list(self._states.values()):
            if state.plan is plan:
                mine += state.nbytes
            else:
                other += state.nbytes
        return mine, other

    def release_graphs(self, keep_plan=None) -> int:
        """Free the device state of every graph but the one planned as `keep_plan` (rebuilt on its
        next run); returns the bytes freed. A residency manager calls this when its budget needs
        the room."""
        with self._lock:
            freed = 0
            for graph, state in list(self._states.items()):
                if state.plan is not keep_plan:
                    del self._states[graph]
                    state.release()
                    freed += state.nbytes
            self._after_release()
            return freed

    def forget(self, graph) -> None:
        """Free what `graph` holds on the device now (otherwise when the Graph is garbage)."""
        with self._lock:
            state = self._states.pop(graph, None)
            if state is not None:
                state.release()
                self._after_release()
