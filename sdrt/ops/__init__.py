"""Tensor ops, graphs and backends.

OpenMP wait policy: both OpenMP users here (Numba's `omp` threading layer and the Cython quant
module) link libgomp, whose default is to spin a worker for a while after each parallel region.
On a few cores shared with OpenBLAS's threads (and other processes) that spinning costs ~8 ms per
region under load (an empty prange: 7.9 ms spinning vs 0.009 ms PASSIVE, measured at load 5),
so sdrt defaults to PASSIVE. libgomp reads the variable once, when it is loaded, which is only
ever after this package is imported; a value the user set is kept.
"""
import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
