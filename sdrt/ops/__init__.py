"""Tensor ops, graphs and backends.

OpenMP wait policy: both OpenMP users here (Numba's `omp` threading layer and the Cython quant
module) link libgomp, whose default is to spin a worker after each parallel region; on a few
shared cores that spinning delays the next region (bench/README.md), so sdrt defaults to
PASSIVE. libgomp reads the variable once, when it is loaded, which is only ever after this
package is imported; a value the user set is kept.
"""
import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
