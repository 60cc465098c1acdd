"""Numba's code-generation target: full-width AVX-512 vectors where the CPU has them.

LLVM tunes Intel's AVX-512 server cores (Skylake-SP and later) to prefer 256-bit vectors
(`prefer-256-bit`), so every Numba kernel vectorized to ymm registers only and used half of
each AVX-512 unit. Switching the tuning off is worth most where a kernel computes rather than
streams: attention's exp pass went from 0.39 to 0.26 ns per score here (Xeon, Emerald Rapids,
one thread), its whole softmax 0.57 -> 0.47 ns.

`configure()` must run before the process's first Numba compile or cache load (the target
machine is made once per process); every module with Numba kernels calls it when imported. It
also applies a thread count set before Numba was loaded (ops.threads.set_threads). It sets
NUMBA_CPU_FEATURES (host features + `-prefer-256-bit`) through the environment, because Numba
re-reads its config from there before every compile; a NUMBA_CPU_NAME or NUMBA_CPU_FEATURES
the user set is kept, and so is SDRT_NUMBA_PREFER_256=1 (the old tuning). The feature string is
part of Numba's cache key, so kernels cached under another setting are compiled once more.
"""
from __future__ import annotations

import os

_done = False


def configure() -> None:
    global _done
    if _done:
        return
    _done = True
    _tune_target()
    from . import threads
    if threads._threads is not None:        # -t given before Numba was loaded
        threads.set_numba_threads()


def _tune_target() -> None:
    env = os.environ
    if env.get("NUMBA_CPU_FEATURES") or env.get("NUMBA_CPU_NAME") or env.get("SDRT_NUMBA_PREFER_256") == "1":
        return
    try:
        import llvmlite.binding as ll
        features = ll.get_host_cpu_features()
    except Exception:  # no feature query on this platform: keep Numba's default
        return
    if not features.get("avx512f"):
        return
    env["NUMBA_CPU_FEATURES"] = features.flatten() + ",-prefer-256-bit"
    from numba.core import config
    config.reload_config()
