"""The CPU backend: BLAS GEMM through numpy, everything else Numba kernels (cache=True).

Each op family's kernels live in their own module and register into `CPU` when imported.
"""
from __future__ import annotations

import importlib
import pkgutil

from ..numba_target import configure as _configure_numba
from ..registry import KernelTable

_configure_numba()  # before any kernel compiles or loads from the cache

CPU = KernelTable("cpu")
CPU.name = "cpu"

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
