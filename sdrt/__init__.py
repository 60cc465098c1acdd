"""sdrt: stable-diffusion.cpp rebuilt in Python, with no deep-learning framework.

`import sdrt` stays light: numpy only. Numba kernels, the Cython quant module and GPU
backends load on first use.
"""
from .errors import ModelFileError, OpError, SdrtError, UnsupportedError, UsageError

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
