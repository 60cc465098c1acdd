"""The Vulkan backend ("vulkan0", ...): SPIR-V compute shaders through the `vulkan` (cffi)
binding, for GPUs without CUDA and for Mesa's lavapipe (a CPU Vulkan driver: how CI runs it);
docs/vulkan.md.

Importing this package imports nothing heavy: `unavailable_reason()` looks for the binding and
the loader first, and only then imports `vulkan` and lists devices. Importing it registers the
backend with sdrt.ops.backend. Layout: device.py (instance, buffers, pipelines, command
buffers), backend.py (the graph runner), table.py (the kernel table), ops/ (op families, each
with its shaders/<family>.comp), shaders/ (GLSL sources and the shipped SPIR-V).
"""
from __future__ import annotations

import ctypes
import importlib.util

from ...ops.backend import register_backend

_PROBE: list = []   # [(reason or None, [(name, description)])], probed once


def _probe():
    if not _PROBE:
        _PROBE.append(_probe_now())
    return _PROBE[0]


def _probe_now():
    try:
        if importlib.util.find_spec("vulkan") is None:
            return "the vulkan Python package is not installed (pip install 'sdrt[vulkan]')", []
        try:
            ctypes.CDLL("libvulkan.so.1")
        except OSError:
            return "no Vulkan loader (libvulkan.so.1; Debian: apt-get install libvulkan1 mesa-vulkan-drivers)", []
        from .device import describe, make_instance, usable_devices, vk
        v = vk()
        inst = make_instance()
        try:
            pds = usable_devices(inst)
            found = [(f"vulkan{i}", describe(v, pd)) for i, pd in enumerate(pds)]
        finally:
            v.vkDestroyInstance(inst, None)
        if not found:
            return "no Vulkan device with a compute queue and 16-bit storage buffers (no ICD installed?)", []
        return None, found
    except Exception as e:  # a broken binding, vkCreateInstance failing without an ICD, ...
        return f"{type(e).__name__}: {e}", []


def unavailable_reason() -> str | None:
    """None when a Vulkan device can be used, else why not (never raises)."""
    return _probe()[0]


def available() -> bool:
    return unavailable_reason() is None


def devices() -> list[tuple[str, str]]:
    """[(name, description)] such as ("vulkan0", "llvmpipe (...) (CPU), 23.4 GiB, Vulkan 1.3.230, ...")."""
    return _probe()[1]


def _make(index: int):
    from .backend import get
    return get(index)


def _kernels():
    from ..device_backend import import_families
    from . import ops
    from .table import VULKAN
    import_families(ops)
    return VULKAN


# has_memory=False: placement never picks a Vulkan device on its own (lavapipe is a CPU driver,
# slower than the CPU backend, and a machine with CUDA should get cuda0); `--backend vulkan0`
# names it, and --max-vram then streams its weights per segment (backend.py)
register_backend("vulkan", _make, devices, unavailable_reason=unavailable_reason, kernels=_kernels,
                 has_memory=False)
