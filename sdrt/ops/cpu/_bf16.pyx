# cython: language_level=3
"""The bf16 GEMM of _bf16gemm.h (see sdrt/ops/cpu/bf16gemm.py, which validates every call)."""
from libc.stdint cimport int64_t
cimport numpy as cnp

cnp.import_array()

cdef extern from "_bf16gemm.h" nogil:
    int bg_path_available(int path)
    int bg_gemm(int64_t M, int64_t N, int64_t K, const void* A, int atype, int64_t ars, int64_t acs,
                const void* B, int btype, int64_t brs, int64_t bcs, float* C, int64_t ldc,
                int path, int nthreads)
    int64_t BG_KC, BG_MC, BG_NC


def path_available(int path):
    return bool(bg_path_available(path))


def set_blocking(int64_t kc, int64_t mc, int64_t nc):
    """Override the cache blocking (tuning only): kc even, mc a multiple of 6, nc of 64."""
    global BG_KC, BG_MC, BG_NC
    BG_KC, BG_MC, BG_NC = kc, mc, nc


def gemm_into(cnp.ndarray a, int atype, cnp.ndarray b, int btype, cnp.ndarray c, int path, int nthreads):
    """c[M, N] = a[M, K] . b[K, N]: 2-D arrays already validated (element strides whole, c rows unit-stride)."""
    cdef int64_t M = a.shape[0], K = a.shape[1], N = b.shape[1]
    cdef int64_t asz = a.itemsize, bsz = b.itemsize
    cdef int64_t ars = a.strides[0] // asz, acs = a.strides[1] // asz
    cdef int64_t brs = b.strides[0] // bsz, bcs = b.strides[1] // bsz, ldc = c.strides[0] // 4
    cdef const void* pa = cnp.PyArray_DATA(a)
    cdef const void* pb = cnp.PyArray_DATA(b)
    cdef float* pc = <float*>cnp.PyArray_DATA(c)
    cdef int rc
    with nogil:
        rc = bg_gemm(M, N, K, pa, atype, ars, acs, pb, btype, brs, bcs, pc, ldc, path, nthreads)
    if rc != 0:
        raise MemoryError("bf16 GEMM: out of memory for its packed operands")
