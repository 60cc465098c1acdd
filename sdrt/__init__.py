"""sdrt: stable-diffusion.cpp rebuilt in Python, with no deep-learning framework.

`import sdrt` stays light: numpy only. Numba kernels, the Cython quant module and GPU
backends load on first use.
"""
import os as _os
import sys as _sys

# OpenBLAS (numpy's BLAS) keeps its worker threads spinning for 2^28 cycles (~0.1 s) after
# every call. sdrt interleaves BLAS with Numba's parallel kernels, which then share a core with
# a spinning BLAS thread: a 2-thread element-wise kernel right after a GEMM took 4.0 ms instead
# of 1.9, and the SD1.5 UNet forward 8.3 s instead of 7.1 s on 2 cores. 2^4 cycles makes them
# sleep at once. OpenBLAS reads the variable when numpy loads it, so it applies when sdrt is
# imported first (the CLI always is); load_pipeline says so when numpy came first.
_blas_spin_late = "OPENBLAS_THREAD_TIMEOUT" not in _os.environ and "numpy" in _sys.modules
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .errors import ModelFileError, OpError, SdrtError, UnsupportedError, UsageError  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "GenParams",
    "ModelFileError",
    "ModelParams",
    "OpError",
    "SdrtError",
    "UnsupportedError",
    "UsageError",
    "__version__",
    "generate",
    "load_pipeline",
]

# the image-generation API, imported on first use so `import sdrt` stays numpy-only
_LAZY = {"generate": "sdrt.engine.generate", "load_pipeline": "sdrt.engine.generate",
         "GenParams": "sdrt.engine.params", "ModelParams": "sdrt.engine.params"}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'sdrt' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(mod), name)
