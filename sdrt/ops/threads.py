"""One knob for CPU parallelism: Numba's thread pool and the BLAS pool (-t/--threads)."""
from __future__ import annotations

import os
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


def set_threads(n: int | None) -> int:
    """Use `n` threads (<= 0 or None: the default) for Numba kernels and BLAS; returns n."""
    global _threads
    n = default_threads() if not n or n <= 0 else int(n)
    import numba
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(n, user_api="blas")
    except ImportError:
        pass
    _threads = n
    return n


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
    lock = threading.Lock()
    ex: ThreadPoolExecutor | None = None
    n = 0

    @classmethod
    def get(cls, n: int) -> ThreadPoolExecutor:
        with cls.lock:
            if cls.ex is None or cls.n != n:
                if cls.ex is not None:
                    cls.ex.shutdown(wait=True)
                cls.ex = ThreadPoolExecutor(n, thread_name_prefix="sdrt-task")
                cls.n = n
            return cls.ex


COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
_COPY_SPLIT = 4 << 20      # bytes below which one thread copies
_copy_pool: ThreadPoolExecutor | None = None


def copy_into(dst, src) -> None:
    """dst[:n] = src for 1-D byte arrays (n = src.nbytes), split over up to COPY_THREADS threads
    when large: one thread's memcpy out of the page cache runs at a fraction of the memory's
    speed (numpy releases the GIL for the copy). Weight uploads into pinned memory and the
    joining of split weights use it."""
    global _copy_pool
    n = src.nbytes
    k = min(COPY_THREADS, n // _COPY_SPLIT)
    if k <= 1:
        dst[:n] = src
        return
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="sdrt-copy")
    step = -(-n // k)

    def part(i):
        dst[i:i + step] = src[i:i + step]
    for f in [_copy_pool.submit(part, i) for i in range(0, n, step)]:
        f.result()


def run_tasks(fn, jobs) -> None:
    """fn(job) for every job, on get_threads() Python threads each running single-thread BLAS
    (and nogil Numba): a free worker takes the next job, so a core taken by another process
    delays one job, not every barrier of a fork-join GEMM. Used for many independent GEMMs
    (attention's tiles, Winograd's 16 products)."""
    jobs = list(jobs)
    workers = max(1, get_threads())
    if workers == 1 or len(jobs) == 1:
        for j in jobs:
            fn(j)
        return
    with one_blas_thread():
        for _ in _Pool.get(workers).map(fn, jobs):
            pass
