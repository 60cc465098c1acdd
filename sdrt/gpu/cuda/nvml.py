"""A device's memory in use as NVML (the driver's libnvidia-ml) reads it, which needs no CUDA
context: read before this process makes its context on a device and again later, it gives what
the process holds there with the context itself (~0.5 GiB on Hopper), which a positive --max-vram
budget counts (docs/residency.md). Every call returns None where NVML is missing or fails."""
from __future__ import annotations

import ctypes
import threading

_lock = threading.RLock()
_before: dict[str, int | None] = {}     # PCI bus id -> bytes in use before this process's context
_lib = None                             # libnvidia-ml, initialised
_handles: dict[str, ctypes.c_void_p] = {}


def used_bytes(pci_bus_id: str) -> int | None:
    """Bytes in use on the device at `pci_bus_id` ("0000:18:00.0"), every process's (NVML is
    initialised on the first call and kept)."""
    global _lib
    with _lock:
        try:
            if _lib is None:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                if lib.nvmlInit_v2() != 0:
                    return None
                _lib = lib
            handle = _handles.get(pci_bus_id)
            if handle is None:
                handle = ctypes.c_void_p()
                if _lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle)) != 0:
                    return None
                _handles[pci_bus_id] = handle
            mem = (ctypes.c_ulonglong * 3)()      # nvmlMemory_t: total, free, used
            if _lib.nvmlDeviceGetMemoryInfo(handle, mem) != 0:
                return None
            return int(mem[2])
        except (OSError, AttributeError):
            return None


def before_context(pci_bus_id: str) -> int | None:
    """used_bytes read the first time this is asked for the device (call it before this process
    retains the device's context: the warm-up thread and CudaDevice both do; the second waits for
    the first's reading)."""
    with _lock:
        if pci_bus_id not in _before:
            _before[pci_bus_id] = used_bytes(pci_bus_id)
        return _before[pci_bus_id]
