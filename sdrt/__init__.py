"""sdrt: stable-diffusion.cpp rebuilt in Python, with no deep-learning framework.

`import sdrt` stays light: numpy only. Numba kernels, the Cython quant module and GPU
backends load on first use.
"""
from .errors import ModelFileError, OpError, SdrtError, UnsupportedError, UsageError

__version__ = "0.1.0"

__all__ = ["SdrtError", "OpError", "ModelFileError", "UnsupportedError", "UsageError", "__version__"]
