# cython: language_level=3
"""The bf16 GEMM of _bf16gemm.h and the bf16 Winograd conv of _bf16wino.h (see sdrt/ops/cpu/bf16gemm.py
and conv_winograd.py, which validate every call)."""
from libc.stdint cimport int64_t
cimport numpy as cnp

cnp.import_array()

cdef extern from "_bf16gemm.h" nogil:
    int bg_path_available(int path)
    int bg_gemm(int64_t M, int64_t N, int64_t K, const void* A, int atype, int64_t ars, int64_t acs,
                const void* B, int btype, int64_t brs, int64_t bcs, float* C, int64_t ldc,
                int path, int nthreads)
    int64_t BG_KC, BG_MC, BG_NC

cdef extern from "_bf16wino.h" nogil:
    int bw_conv(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int up,
                const void* w, int wtype, const float* bias, float* out, int64_t OC, int64_t OH, int64_t OW,
                int64_t ph, int64_t pw, int64_t chunk_bytes, int64_t mc, int path, int nthreads)


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


def wino_conv(cnp.ndarray x, int up, cnp.ndarray w, int wtype, bias, cnp.ndarray out, int64_t ph, int64_t pw,
              int64_t chunk_bytes, int64_t mc, int path, int nthreads):
    """out (N, OC, OH, OW) = Winograd conv3x3 of x (N, C, H, W) through a 2^up nearest upsample:
    C-contiguous arrays already validated (x, out float32; w (OC, C*9) float32 or uint16 bits;
    bias float32 (OC,) or None)."""
    cdef int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int64_t OC = out.shape[1], OH = out.shape[2], OW = out.shape[3]
    cdef const float* px = <const float*>cnp.PyArray_DATA(x)
    cdef const void* pw_ = cnp.PyArray_DATA(w)
    cdef float* po = <float*>cnp.PyArray_DATA(out)
    cdef const float* pb = NULL
    cdef cnp.ndarray b
    if bias is not None:
        b = bias
        pb = <const float*>cnp.PyArray_DATA(b)
    cdef int rc
    with nogil:
        rc = bw_conv(px, N, C, H, W, up, pw_, wtype, pb, po, OC, OH, OW, ph, pw, chunk_bytes, mc, path, nthreads)
    if rc != 0:
        raise MemoryError("bf16 Winograd conv: out of memory for its packed operands")
