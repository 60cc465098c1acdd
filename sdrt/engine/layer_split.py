"""Layer split: one graph's segments spread over several devices (sd.cpp's
partition_graph_cut_layer_split, docs/multi-gpu.md).

The graph-cut segments are walked in order and stay on the current device while the cumulative
bytes of their weights fit its capacity (the device's budget: `--max-vram`, else free memory minus
a 2 GiB compute headroom); the next segment then moves to the next device. A segment is never cut,
so a block's residual path stays on one device; the activations crossing a device boundary are
the plan's cross-segment tensors read by a later segment on another device (peer copies on real
GPUs, counted here).

`SplitResidency` is the Residency protocol (sdrt.ops.backend) over one ResidencyManager per
device: segment k's weights are staged on, and pinned by, the manager of its device alone, with
prefetch off (sd.cpp disables single-device prefetch for split modules: a prefetch would stage the
next segment's weights on the wrong device). Weights stay where the split put them across runs.
The simulated devices (engine/simulated_device.py) run it on the CPU; no GPU backend executes a
split graph yet (placement refuses `cuda0&cuda1`).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import DeviceOutOfMemoryError
from .residency import ResidencyManager, _mb

__all__ = ["COMPUTE_HEADROOM", "SplitResidency", "split_segments"]

log = logging.getLogger("sdrt")
COMPUTE_HEADROOM = 2 << 30       # sd.cpp: a device's capacity for a split is free - 2 GiB (capped by --max-vram)


def split_segments(weight_bytes: Sequence[int], capacities: Sequence[int], names: Sequence[str] = ()) -> list[int]:
    """The device index of each segment (see the module docstring). Raises DeviceOutOfMemoryError
    when a segment fits no device on its own or the devices together run out."""
    out, dev, used = [], 0, 0
    for k, nbytes in enumerate(weight_bytes):
        while dev < len(capacities) and used + nbytes > capacities[dev]:
            if used == 0 and nbytes > capacities[dev]:
                name = names[k] if k < len(names) else f"#{k}"
                raise DeviceOutOfMemoryError(f"layer split: segment '{name}' needs {_mb(nbytes)} of weights, more "
                                             f"than device {dev}'s capacity {_mb(capacities[dev])}")
            dev, used = dev + 1, 0
        if dev == len(capacities):
            raise DeviceOutOfMemoryError(f"layer split: {_mb(sum(weight_bytes))} of weights do not fit "
                                         f"{len(capacities)} devices ({', '.join(_mb(c) for c in capacities)})")
        out.append(dev)
        used += nbytes
    return out


class SplitResidency:
    """Residency over several devices: `managers` in split order (the first takes the first
    segments). `capacities`: the weight bytes each device may take; by default each manager's
    --max-vram budget less the graph's activations, else its free memory less COMPUTE_HEADROOM."""

    def __init__(self, managers: Sequence[ResidencyManager], capacities: Sequence[int] | None = None):
        if len(managers) < 2:
            raise ValueError("a layer split needs at least two devices")
        for m in managers:
            m.prefetch = False
        self.managers = list(managers)
        self.given = list(capacities) if capacities is not None else None
        self._splits: dict[int, tuple[object, list[int], int]] = {}   # id(plan) -> (plan, split, peer bytes)
        self._device_of: list[int] = []
        self.peer_bytes = 0          # activation bytes crossing a device boundary in the last run
        self.name = "&".join(m.name for m in managers)

    # ---- registration (every manager knows every weight; only one stages it) -------------------
    def register(self, tensors, component: str, params: str = "cpu") -> int:
        tensors = list(tensors.values() if hasattr(tensors, "values") else tensors)
        return max(m.register(tensors, component, "cpu" if params == "device" else params) for m in self.managers)

    def manages(self, leaf) -> bool:
        return self.managers[0].manages(leaf)

    def is_resident(self, leaf) -> bool:
        return any(m.is_resident(leaf) for m in self.managers)

    def device_of(self, leaf) -> str | None:
        """The device whose memory holds the weight now (None: not resident)."""
        return next((m.name for m in self.managers if m.is_resident(leaf)), None)

    def device_ptr(self, leaf) -> int:
        for m in self.managers:
            if m.is_resident(leaf):
                return m.device_ptr(leaf)
        return self.managers[0].device_ptr(leaf)     # raises the manager's "not resident" error

    # ---- the graph ----------------------------------------------------------------------------
    def capacities(self, activation_bytes: int = 0) -> list[int]:
        if self.given is not None:
            return self.given
        return [max(m.budget - activation_bytes, 0) if m.budget is not None
                else max(m.memory.mem_get_info()[0] - COMPUTE_HEADROOM, 0) for m in self.managers]

    def split_of(self, plan) -> list[int]:
        """The device index of each segment of `plan` (computed once per plan)."""
        return self._split(plan)[1]

    def _split(self, plan) -> tuple[object, list[int], int]:
        """(plan, device index of each segment, peer bytes), computed once per plan."""
        hit = self._splits.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit
        info = self.managers[0]._plan_info(plan)
        wb = [info.weight_bytes(k) for k in range(len(info.segments))]
        split = split_segments(wb, self.capacities(info.activation_bytes), [n or "final" for n in info.names])
        self._splits[id(plan)] = hit = (plan, split, _peer_bytes(plan, split))
        per = [sum(b for b, d in zip(wb, split) if d == j) for j in range(len(self.managers))]
        log.info("layer split over %s: %s", self.name, ", ".join(
            f"{m.name} segments {split.index(j)}-{len(split) - 1 - split[::-1].index(j)} ({_mb(per[j])})"
            for j, m in enumerate(self.managers) if j in split))
        return hit

    def begin_graph(self, plan, extra_bytes: int = 0) -> bool:
        _, split, self.peer_bytes = self._split(plan)
        self._device_of = split
        used = sorted(set(split))
        return all([self.managers[j].begin_graph(plan, extra_bytes) for j in used])

    def begin_segment(self, index: int, name, leaves) -> None:
        self.managers[self._device_of[index]].begin_segment(index, name, leaves)

    def end_segment(self, index: int) -> None:
        self.managers[self._device_of[index]].end_segment(index)
        if index == len(self._device_of) - 1:        # the other devices' runs end with the graph's
            for j in sorted(set(self._device_of) - {self._device_of[index]}):
                self.managers[j].end_segment(index)

    def make_room(self, nbytes: int) -> int:
        return max(m.make_room(nbytes) for m in self.managers)

    def release_all(self) -> None:
        for m in self.managers:
            m.release_all()


def _peer_bytes(plan, split: list[int]) -> int:
    """Bytes of the cross-segment tensors that a segment on another device reads."""
    seg_of = {id(n): k for k, s in enumerate(plan.segments) for n in s.nodes}
    moved: dict[tuple, int] = {}
    for k, s in enumerate(plan.segments):
        for n in s.nodes:
            for src in n.src:
                o = src.owner
                j = seg_of.get(id(o))
                if j is not None and split[j] != split[k]:
                    moved[id(o), split[k]] = o.nbytes
    return sum(moved.values())
