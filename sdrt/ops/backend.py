"""The backend registry, and the small protocols a backend and a residency object follow.

A backend is one unit that registers itself here: `register_backend(prefix, factory,
list_devices, ...)`. The host backends ("cpu", "reference") are registered below; a device
backend package (sdrt.gpu.cuda, sdrt.gpu.vulkan) registers itself when it is imported;
`import sdrt.gpu` imports them all, and the engine does that (so do scripts that use sdrt.ops
alone). Nothing in sdrt.ops names sdrt.gpu: the one direction is gpu -> ops.

- `get_backend("cuda0")` makes (once) and returns the backend of a device name;
- `list_devices()` gives every usable compute device, name and description (`--list-devices`);
- `available_backends()` every name `get_backend` accepts on this machine;
- `backend_kernels(prefix)` a backend's kernel table without a device (docs/ops.md's table).

This module stays light (no numpy kernels, no driver): placement and the CLI read it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from ..errors import UnsupportedError



def as_weight(a):
    """Numpy array `a`, made read-only and returned: device backends take a writeable numpy leaf
    for a per-run input (copied to the device on every run) and cache a read-only one as a weight
    (or see `register_weights`)."""
    a.flags.writeable = False
    return a


# ---- protocols --------------------------------------------------------------------------------
class DeviceMemory(Protocol):
    """A device backend's `memory`: what a residency manager allocates and stages through."""

    name: str

    def mem_get_info(self) -> tuple[int, int]: ...          # (free, total) bytes
    def alloc(self, nbytes: int) -> int: ...                # device address
    def free(self, ptr: int) -> None: ...
    def upload(self, ptr: int, host_u8, stream: str = "compute"): ...   # -> event
    def download(self, host_u8, ptr: int, stream: str = "compute") -> None: ...
    def record(self, stream: str = "compute"): ...          # -> event
    def wait(self, event, stream: str = "compute") -> None: ...
    def synchronize(self) -> None: ...
    def stats(self) -> dict: ...
    def empty_cache(self) -> None: ...


@runtime_checkable
class SegmentHooks(Protocol):
    """What `Graph.run` tells a residency object on any backend: before segment `index` runs
    (with the leaves its nodes read) and after it. sdrt.engine.host_pages.HostPageRelease is one."""

    def begin_segment(self, index: int, name, leaves) -> None: ...
    def end_segment(self, index: int) -> None: ...


@runtime_checkable
class Residency(SegmentHooks, Protocol):
    """A residency object a device backend runs a graph with (sdrt.engine.residency
    .ResidencyManager): it says which weights it places (`manages`) and where they are
    between begin_segment and end_segment (`device_ptr`), hears of a graph before it runs
    (`begin_graph`, with the backend's scratch bytes) and frees device memory on demand
    (`make_room`, when one of the backend's own allocations fails)."""

    def manages(self, leaf) -> bool: ...
    def device_ptr(self, leaf) -> int: ...
    def begin_graph(self, plan, extra_bytes: int = 0) -> bool: ...
    def make_room(self, nbytes: int) -> int: ...


@runtime_checkable
class Backend(Protocol):
    """A backend: a name, a kernel per node (`find`, None when it has none), a graph runner and
    its device memory (`memory`; None for host backends). `run_graph(graph, plan, on_segment,
    residency)` returns {output name: leaf Tensor with host data}, as Graph.run documents."""

    name: str
    memory: DeviceMemory | None

    def find(self, node): ...
    def run_graph(self, graph, plan, on_segment=None, residency=None) -> dict: ...


# ---- the registry -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendEntry:
    prefix: str                                   # "cpu", or "cuda" for cuda0, cuda1, ...
    factory: Callable                             # factory(index or None) -> Backend
    list_devices: Callable                        # () -> [(name, description)] usable here
    unavailable_reason: Callable | None = None    # () -> why none is usable (None: usable)
    kernels: Callable | None = None               # () -> KernelTable, no device needed
    indexed: bool = False                         # names are prefix + device index
    device: bool = True                           # a compute device (placement, --list-devices)
    has_memory: bool = False                      # its own device memory (a GPU for placement)
    warm_up: Callable | None = None               # (index) -> None: start making the device's context


_REGISTRY: dict[str, BackendEntry] = {}
_BACKENDS: dict[str, object] = {}


def register_backend(prefix: str, factory: Callable, list_devices: Callable, *,
                     unavailable_reason: Callable | None = None, kernels: Callable | None = None,
                     indexed: bool = True, device: bool = True, has_memory: bool = True,
                     warm_up: Callable | None = None) -> BackendEntry:
    """Register a backend. `factory(index)` makes the backend of device `prefix<index>` (index
    None for a backend that is not indexed); `list_devices()` lists the usable ones as
    [(name, description)]; `unavailable_reason()` says why there is none; `kernels()` returns
    its kernel table without touching a device; `warm_up(index)` starts making a device's context
    in the background (see warm_up). Registering a prefix again replaces it."""
    if not re.fullmatch(r"[a-z][a-z_]*", prefix):
        raise ValueError(f"backend prefix {prefix!r}: lower-case letters only")
    entry = BackendEntry(prefix, factory, list_devices, unavailable_reason, kernels, indexed, device, has_memory,
                         warm_up)
    _REGISTRY[prefix] = entry
    for name in [n for n in _BACKENDS if _split(n, entry) is not None]:
        del _BACKENDS[name]
    return entry



def entries() -> list[BackendEntry]:
    """Every registered backend, host ones first."""
    return list(_REGISTRY.values())


def _split(name: str, entry: BackendEntry):
    """The device index a name gives for `entry` (None for an unindexed match), or None."""
    if entry.indexed:
        m = re.fullmatch(rf"{entry.prefix}(\d+)", name)
        return int(m.group(1)) if m else None
    return -1 if name == entry.prefix else None


def entry_of(name: str) -> BackendEntry | None:
    """The registered backend a device name belongs to (cuda3 -> the cuda entry), or None."""
    for e in entries():
        if _split(name, e) is not None:
            return e
    return None


def get_backend(name):
    """The backend of `name` (made once per name). A backend object is returned as it is; a
    bare kernel table (`name` and `find` only, like ops.cpu.CPU) runs on the host."""
    if not isinstance(name, str):
        return name if isinstance(name, Backend) else HostBackend(name.name, name)
    be = _BACKENDS.get(name)
    if be is not None:
        return be
    entry = entry_of(name)
    if entry is None:
        raise UnsupportedError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    why = entry.unavailable_reason() if entry.unavailable_reason is not None else None
    if why is not None:
        raise UnsupportedError(f"backend {name!r} is not available: {why}")
    index = _split(name, entry)
    if entry.indexed and name not in {n for n, _ in entry.list_devices()}:
        have = ", ".join(n for n, _ in entry.list_devices())
        raise UnsupportedError(f"backend {name!r} is not available: no such device (have: {have})")
    be = _BACKENDS[name] = entry.factory(None if index == -1 else index)
    return be


_warmed: set[str] = set()      # devices warm_up has started


def made_backend(name):
    """The backend get_backend has made for `name` (a backend object as it is), or None:
    unlike get_backend, nothing is made."""
    return _BACKENDS.get(name) if isinstance(name, str) else name


def warm_up(spec: str | None) -> None:
    """Start making the contexts of the devices a --backend spec names (None: auto-fit, which takes
    a GPU when there is one: device 0 of each backend that can warm up) in the background, so that
    a driver's start-up overlaps the imports and file reading before the first use. Never raises:
    a device that is not there is found by the caller later, with its message. A device warms
    up once per process."""
    if spec is None:
        names = [f"{e.prefix}0" for e in entries() if e.warm_up is not None]
    else:
        names = re.findall(r"[a-z][a-z_]*\d+", spec)
    for name in dict.fromkeys(names):
        if name in _warmed:
            continue
        _warmed.add(name)
        e = entry_of(name)
        if e is not None and e.warm_up is not None:
            try:
                e.warm_up(_split(name, e))
            except Exception:   # noqa: BLE001  (a warm-up is an optimisation only)
                pass


def list_devices() -> list[tuple[str, str]]:
    """[(name, description)] of every usable compute device, the CPU first."""
    return [d for e in entries() if e.device for d in e.list_devices()]


def gpu_names() -> list[str]:
    """Names of the usable devices with their own memory (what placement calls GPUs)."""
    return [n for e in entries() if e.device and e.has_memory for n, _ in e.list_devices()]


def available_backends() -> list[str]:
    """Names get_backend accepts on this machine."""
    return [n for e in entries() for n, _ in e.list_devices()]


def device_syntax() -> list[str]:
    """How device names are spelled, for messages: cpu, cudaN, ..."""
    return [f"{e.prefix}N" if e.indexed else e.prefix for e in entries() if e.device]


def unavailable_reason(prefix: str) -> str | None:
    """Why backend `prefix` has no usable device (None when it has one or is unknown)."""
    e = next((e for e in entries() if e.prefix == prefix), None)
    if e is None or e.unavailable_reason is None:
        return None
    return e.unavailable_reason()


def backend_kernels(prefix: str):
    """A backend's kernel table (KernelTable), loaded without a device; None if it has none."""
    e = next((e for e in entries() if e.prefix == prefix), None)
    return None if e is None or e.kernels is None else e.kernels()


# ---- the host backends ------------------------------------------------------------------------
class HostBackend:
    """A backend computing on host numpy buffers (graph.run_on_host) with one kernel table."""

    memory = None

    def __init__(self, name: str, table):
        self.name, self.table = name, table

    def __repr__(self):
        return f"HostBackend({self.name})"

    def find(self, node):
        return self.table.find(node)

    def run_graph(self, graph, plan, on_segment=None, residency=None) -> dict:
        from .graph import run_on_host
        return run_on_host(graph, plan, self, on_segment, residency)


def _cpu_table():
    from .cpu import CPU
    return CPU


def _reference_table():
    from .reference import REFERENCE
    return REFERENCE


def _cpu_devices():
    from .threads import default_threads
    return [("cpu", f"CPU ({default_threads()} threads, numpy BLAS + Numba)")]


register_backend("cpu", lambda _: HostBackend("cpu", _cpu_table()), _cpu_devices, kernels=_cpu_table,
                 indexed=False, has_memory=False)
register_backend("reference", lambda _: HostBackend("reference", _reference_table()),
                 lambda: [("reference", "every op's plain-numpy definition (slow; for checks)")],
                 kernels=_reference_table, indexed=False, device=False, has_memory=False)

