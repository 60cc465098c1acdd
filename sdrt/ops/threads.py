"""One knob for CPU parallelism: Numba's thread pool and the BLAS pool (-t/--threads); the host's
available RAM."""
from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_threads: int | None = None
_blas = None  # cached threadpoolctl.ThreadpoolController (building one scans the loaded libraries, ~6 ms)


def default_threads() -> int:
    """sd-cli's default: the number of physical cores; here the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def set_threads(n: int | None) -> int:
    """Use `n` threads (<= 0 or None: the default) for Numba kernels and BLAS; returns n. Numba's
    pool is set now when Numba is loaded, else when it is (numba_target.configure, which every
    module with Numba kernels runs first): a GPU run need not load Numba at all."""
    global _threads
    n = default_threads() if not n or n <= 0 else int(n)
    _threads = n
    if "numba" in sys.modules:
        set_numba_threads()
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(n, user_api="blas")
    except ImportError:
        pass
    return n


def set_numba_threads() -> None:
    """Numba's pool to the -t threads (numba_target.configure calls it when Numba loads)."""
    import numba
    numba.set_num_threads(min(get_threads(), numba.config.NUMBA_NUM_THREADS))


def get_threads() -> int:
    return _threads if _threads is not None else default_threads()


def blas_controller():
    """The process's threadpoolctl controller, built once; its limit() context costs ~25 us."""
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController
        _blas = ThreadpoolController()
    return _blas


def one_blas_thread():
    """Context that runs the BLAS calls inside it on one thread (restoring the pool after)."""
    return blas_controller().limit(limits=1, user_api="blas")


class _Pool:
    """A lazily made pool of Python threads, remade when the thread count changes."""

    def __init__(self, name: str):
        self.name, self.lock, self.ex, self.n = name, threading.Lock(), None, 0

    def get(self, n: int) -> ThreadPoolExecutor:
        with self.lock:
            if self.ex is None or self.n != n:
                if self.ex is not None:
                    self.ex.shutdown(wait=True)
                self.ex = ThreadPoolExecutor(n, thread_name_prefix=self.name)
                self.n = n
            return self.ex


_TASKS, _COPIES = _Pool("sdrt-task"), _Pool("sdrt-copy")


COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
_COPY_SPLIT = 4 << 20      # bytes below which one thread copies


def copy_into(dst, src) -> None:
    """dst[:n] = src for 1-D byte arrays (n = src.nbytes), split over up to COPY_THREADS threads
    when large: one thread's memcpy out of the page cache runs at a fraction of the memory's
    speed (numpy releases the GIL for the copy). Weight uploads into pinned memory and the
    joining of split weights use it."""
    n = src.nbytes
    k = min(COPY_THREADS, n // _COPY_SPLIT)
    if k <= 1:
        dst[:n] = src
        return
    step = -(-n // k)

    def part(i):
        end = min(i + step, n)
        dst[i:end] = src[i:end]
    for _ in _COPIES.get(COPY_THREADS).map(part, range(0, n, step)):
        pass


def map_threads(fn, items) -> list:
    """[fn(x) for x in items] on up to get_threads() Python threads, for work that releases the GIL
    without BLAS in it (zlib, copies)."""
    items = list(items)
    if min(get_threads(), len(items)) <= 1:
        return [fn(x) for x in items]
    return list(_TASKS.get(max(1, get_threads())).map(fn, items))


def run_tasks(fn, jobs) -> None:
    """fn(job) for every job, on get_threads() Python threads each running single-thread BLAS
    (and nogil Numba): a free worker takes the next job, so a core taken by another process
    delays one job, not every barrier of a fork-join GEMM. Used for many independent GEMMs
    (attention's tiles, Winograd's 16 products)."""
    jobs = list(jobs)
    if min(get_threads(), len(jobs)) <= 1:
        for j in jobs:
            fn(j)
        return
    with one_blas_thread():
        map_threads(fn, jobs)
