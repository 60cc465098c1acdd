# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -ffp-contract=off
"""GGUF/ggml block types in Cython: dequantize, get_rows and quantize, parallel over rows/blocks.

Everything here follows ggml's C (ggml-quants.c `dequantize_row_*`, `quantize_row_*_ref`, and
the importance-weighted `quantize_row_*_impl` of `ggml_quantize_chunk`) operation for operation,
in float32, so results are bit-exact with it:

- every float literal in a float expression is written `<float>c` (ggml's `cf`), so C never
  widens an intermediate to double;
- products and sums keep ggml's association order (`w*x[i]*l` is `(w*x[i])*l`);
- the extension is built with -ffp-contract=off so no `a*b+c` is fused into an FMA;
- half <-> float conversions are the exact bit-manipulation ones ggml uses.

Block byte layouts are documented in docs/quantization.md; the offsets used below are the
struct offsets of ggml-common.h (little-endian). The Python API lives in `__init__.py`; the
functions here take already-validated arrays.
"""
from libc.stdint cimport uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, int64_t, uint64_t
from libc.string cimport memcpy, memset
from libc.stdlib cimport malloc, free
from libc.math cimport fabsf, sqrtf, floorf, log2f
from cython.parallel cimport prange
cimport openmp

include "_iq_tables.pxi"

# ggml type ids (enum ggml_type)
cdef enum:
    T_F32 = 0
    T_F16 = 1
    T_Q4_0 = 2
    T_Q4_1 = 3
    T_Q5_0 = 6
    T_Q5_1 = 7
    T_Q8_0 = 8
    T_Q8_1 = 9
    T_Q2_K = 10
    T_Q3_K = 11
    T_Q4_K = 12
    T_Q5_K = 13
    T_Q6_K = 14
    T_Q8_K = 15
    T_IQ2_XXS = 16
    T_IQ2_XS = 17
    T_IQ3_XXS = 18
    T_IQ1_S = 19
    T_IQ4_NL = 20
    T_IQ3_S = 21
    T_IQ2_S = 22
    T_IQ4_XS = 23
    T_IQ1_M = 29
    T_BF16 = 30
    T_TQ1_0 = 34
    T_TQ2_0 = 35
    T_MXFP4 = 39

ctypedef void (*deq_fn)(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil
ctypedef void (*q_fn)(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil
# weighted quantizers: nb blocks of one row, its importance weights from the same column, and the
# row's mean square (used by Q4_0/Q4_1/Q5_0/Q5_1 only)
ctypedef void (*qw_fn)(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2) noexcept nogil

cdef Py_ssize_t CHUNK_ELEMS = 16384  # elements per parallel work item

# ============================================================================ scalar helpers

cdef inline float f32_from_bits(uint32_t u) noexcept nogil:
    cdef float f
    memcpy(&f, &u, 4)
    return f

cdef inline uint32_t f32_bits(float f) noexcept nogil:
    cdef uint32_t u
    memcpy(&u, &f, 4)
    return u

cdef inline uint16_t rd16(const uint8_t* p) noexcept nogil:
    cdef uint16_t v
    memcpy(&v, p, 2)  # little-endian hosts only (as ggml's GGUF files)
    return v

cdef inline uint32_t rd32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v

cdef inline void wr16(uint8_t* p, uint16_t v) noexcept nogil:
    memcpy(p, &v, 2)

cdef inline float fp16_to_f32(uint16_t h) noexcept nogil:
    # exact: normals are rebiased by a multiply with 2^-112, subnormals by the magic-bias trick
    cdef uint32_t w = (<uint32_t>h) << 16
    cdef uint32_t sign = w & <uint32_t>0x80000000
    cdef uint32_t two_w = w + w
    cdef float normalized = f32_from_bits((two_w >> 4) + (<uint32_t>0xE0 << 23)) * f32_from_bits(0x07800000)
    cdef float denormalized = f32_from_bits((two_w >> 17) | (<uint32_t>126 << 23)) - <float>0.5
    cdef uint32_t res
    if two_w < (<uint32_t>1 << 27):
        res = sign | f32_bits(denormalized)
    else:
        res = sign | f32_bits(normalized)
    return f32_from_bits(res)

cdef inline float ld_f16(const uint8_t* p) noexcept nogil:
    return fp16_to_f32(rd16(p))

cdef inline uint16_t f32_to_fp16(float f) noexcept nogil:
    # round to nearest even; overflow -> inf, NaN -> 0x7E00 (with sign), as ggml
    cdef float base = (fabsf(f) * f32_from_bits(0x77800000)) * f32_from_bits(0x08800000)
    cdef uint32_t w = f32_bits(f)
    cdef uint32_t shl1_w = w + w
    cdef uint32_t sign = w & <uint32_t>0x80000000
    cdef uint32_t bias = shl1_w & <uint32_t>0xFF000000
    if bias < <uint32_t>0x71000000:
        bias = <uint32_t>0x71000000
    base = f32_from_bits((bias >> 1) + <uint32_t>0x07800000) + base
    cdef uint32_t bits = f32_bits(base)
    cdef uint32_t exp_bits = (bits >> 13) & <uint32_t>0x00007C00
    cdef uint32_t mantissa_bits = bits & <uint32_t>0x00000FFF
    cdef uint32_t nonsign = exp_bits + mantissa_bits
    if shl1_w > <uint32_t>0xFF000000:
        nonsign = 0x7E00
    return <uint16_t>((sign >> 16) | nonsign)

cdef inline float e8m0_to_f32_half(uint8_t x) noexcept nogil:
    cdef uint32_t bits
    if x < 2:
        bits = (<uint32_t>0x00200000) << x
    else:
        bits = (<uint32_t>(x - 1)) << 23
    return f32_from_bits(bits)

cdef inline int nearest_int(float fval) noexcept nogil:
    # round half to even through the 1.5*2^23 trick (|fval| <= 4194303)
    cdef float val = fval + <float>12582912.0
    cdef int32_t i
    memcpy(&i, &val, 4)
    return (i & 0x007fffff) - 0x00400000

cdef inline int round_away(float v) noexcept nogil:
    # (int)roundf(v): round half away from zero, for |v| < 2^31, without a libm call
    # (v - trunc(v) is exact, so the comparison with 0.5 is too)
    cdef int t = <int>v
    cdef float frac = v - <float>t
    if frac >= <float>0.5:
        t += 1
    elif frac <= <float>-0.5:
        t -= 1
    return t

cdef inline int imin(int a, int b) noexcept nogil:
    return a if a < b else b

cdef inline int imax(int a, int b) noexcept nogil:
    return a if a > b else b

cdef inline float flip(float v, uint32_t neg) noexcept nogil:
    # v * (neg ? -1.f : 1.f) without a branch (signs are random: a branch mispredicts half the
    # time). gcc emits exactly this sign-bit xor for ggml's multiply by -1.f as well.
    return f32_from_bits(f32_bits(v) ^ ((<uint32_t>(neg != 0)) << 31))

include "_dequant.pxi"

cdef deq_fn get_deq(int t) noexcept nogil:
    if t == T_F32: return deq_f32
    if t == T_F16: return deq_f16
    if t == T_BF16: return deq_bf16
    if t == T_Q4_0: return deq_q4_0
    if t == T_Q4_1: return deq_q4_1
    if t == T_Q5_0: return deq_q5_0
    if t == T_Q5_1: return deq_q5_1
    if t == T_Q8_0: return deq_q8_0
    if t == T_Q8_1: return deq_q8_1
    if t == T_Q2_K: return deq_q2_K
    if t == T_Q3_K: return deq_q3_K
    if t == T_Q4_K: return deq_q4_K
    if t == T_Q5_K: return deq_q5_K
    if t == T_Q6_K: return deq_q6_K
    if t == T_Q8_K: return deq_q8_K
    if t == T_IQ2_XXS: return deq_iq2_xxs
    if t == T_IQ2_XS: return deq_iq2_xs
    if t == T_IQ2_S: return deq_iq2_s
    if t == T_IQ3_XXS: return deq_iq3_xxs
    if t == T_IQ3_S: return deq_iq3_s
    if t == T_IQ1_S: return deq_iq1_s
    if t == T_IQ1_M: return deq_iq1_m
    if t == T_IQ4_NL: return deq_iq4_nl
    if t == T_IQ4_XS: return deq_iq4_xs
    if t == T_TQ1_0: return deq_tq1_0
    if t == T_TQ2_0: return deq_tq2_0
    if t == T_MXFP4: return deq_mxfp4
    return NULL

include "_quantize.pxi"

cdef q_fn get_q(int t) noexcept nogil:
    if t == T_Q4_0: return q_q4_0
    if t == T_Q4_1: return q_q4_1
    if t == T_Q5_0: return q_q5_0
    if t == T_Q5_1: return q_q5_1
    if t == T_Q8_0: return q_q8_0
    if t == T_Q8_1: return q_q8_1
    if t == T_Q2_K: return q_q2_K
    if t == T_Q3_K: return q_q3_K
    if t == T_Q4_K: return q_q4_K
    if t == T_Q5_K: return q_q5_K
    if t == T_Q6_K: return q_q6_K
    if t == T_Q8_K: return q_q8_K
    if t == T_TQ1_0: return q_tq1_0
    if t == T_TQ2_0: return q_tq2_0
    if t == T_MXFP4: return q_mxfp4
    return NULL

include "_quantize_weighted.pxi"

cdef qw_fn get_qw(int t) noexcept nogil:
    # the types whose ggml quantize_* takes the importance weights (quantize_row_*_impl); the
    # others (Q8_0, TQ1_0, TQ2_0, MXFP4) ignore them
    if t == T_Q4_0: return qw_q4_0
    if t == T_Q4_1: return qw_q4_1
    if t == T_Q5_0: return qw_q5_0
    if t == T_Q5_1: return qw_q5_1
    if t == T_Q2_K: return qw_q2_K
    if t == T_Q3_K: return qw_q3_K
    if t == T_Q4_K: return qw_q4_K
    if t == T_Q5_K: return qw_q5_K
    if t == T_Q6_K: return qw_q6_K
    return NULL

# ============================================================================ parallel drivers

cdef inline void _deq_item(deq_fn fn, const uint8_t* base, Py_ssize_t rstride, const int64_t* ids,
                           Py_ssize_t nch, Py_ssize_t cb, Py_ssize_t nblk, Py_ssize_t tsize,
                           Py_ssize_t bsize, float* out, Py_ssize_t ostride, Py_ssize_t it) noexcept nogil:
    cdef Py_ssize_t r = it // nch
    cdef Py_ssize_t b0 = (it - r * nch) * cb
    cdef Py_ssize_t nb = nblk - b0
    cdef Py_ssize_t src = r
    if nb > cb:
        nb = cb
    if ids != NULL:
        src = <Py_ssize_t>ids[r]
    fn(base + src * rstride + b0 * tsize, out + r * ostride + b0 * bsize, nb)

cdef Py_ssize_t _row_chunks(Py_ssize_t nrows, Py_ssize_t nblk, Py_ssize_t bsize, int nthreads,
                            Py_ssize_t* cb_out) noexcept nogil:
    # work items are (row, chunk of blocks); rows are split only when there are too few of them
    # to keep every thread busy. Returns the number of chunks per row, chunk size in cb_out.
    cdef Py_ssize_t cb = nblk
    cdef Py_ssize_t nch = 1
    if nthreads > 1 and nrows < 8 * nthreads:
        cb = CHUNK_ELEMS // bsize
        if cb < 1:
            cb = 1
        nch = (nblk + cb - 1) // cb
        cb = (nblk + nch - 1) // nch
    cb_out[0] = cb
    return nch

cdef void _run_deq(deq_fn fn, const uint8_t* base, Py_ssize_t rstride, const int64_t* ids,
                   Py_ssize_t nrows, Py_ssize_t nblk, Py_ssize_t tsize, Py_ssize_t bsize,
                   float* out, Py_ssize_t ostride, int nthreads):
    cdef Py_ssize_t cb
    cdef Py_ssize_t nch = _row_chunks(nrows, nblk, bsize, nthreads, &cb)
    cdef Py_ssize_t nit = nrows * nch
    cdef Py_ssize_t it
    # dynamic scheduling in chunks of >= CHUNK_ELEMS outputs: a thread that gets descheduled
    # (other processes on the cores) holds up at most one chunk instead of its static share
    cdef Py_ssize_t per = CHUNK_ELEMS // (cb * bsize)
    if per < 1:
        per = 1
    if nthreads <= 1 or nit == 1:
        with nogil:
            for it in range(nit):
                _deq_item(fn, base, rstride, ids, nch, cb, nblk, tsize, bsize, out, ostride, it)
    else:
        for it in prange(nit, nogil=True, num_threads=nthreads, schedule="dynamic", chunksize=per):
            _deq_item(fn, base, rstride, ids, nch, cb, nblk, tsize, bsize, out, ostride, it)

cdef inline void _q_item(q_fn fn, const float* x, uint8_t* y, Py_ssize_t ntot, Py_ssize_t cb,
                         Py_ssize_t bsize, Py_ssize_t tsize, Py_ssize_t it) noexcept nogil:
    cdef Py_ssize_t b0 = it * cb
    cdef Py_ssize_t nb = ntot - b0
    if nb > cb:
        nb = cb
    fn(x + b0 * bsize, y + b0 * tsize, nb)

cdef inline void _cvt_item(const uint16_t* src, float* dst, Py_ssize_t n, Py_ssize_t it, bint bf16) noexcept nogil:
    cdef Py_ssize_t i0 = it * CHUNK_ELEMS
    cdef Py_ssize_t i1 = i0 + CHUNK_ELEMS
    cdef Py_ssize_t i
    if i1 > n:
        i1 = n
    if bf16:
        for i in range(i0, i1):
            dst[i] = f32_from_bits((<uint32_t>src[i]) << 16)
    else:
        for i in range(i0, i1):
            dst[i] = fp16_to_f32(src[i])

# ============================================================================ Python entry points
# (called by sdrt.ops.quant after validation; arrays are trusted here)

def max_threads():
    return openmp.omp_get_max_threads()

def has_dequant(int type_id):
    return get_deq(type_id) != NULL

def has_quant(int type_id):
    return get_q(type_id) != NULL

def dequantize_into(const uint8_t[:, :] raw, int type_id, Py_ssize_t block_size, Py_ssize_t type_size,
                    float[:, :] out, int nthreads):
    """raw [nrows, row_bytes] (unit stride inside rows) -> out [nrows, ne0] (unit stride inside rows)."""
    cdef deq_fn fn = get_deq(type_id)
    cdef Py_ssize_t nrows = raw.shape[0]
    cdef Py_ssize_t nblk = raw.shape[1] // type_size
    if fn == NULL:
        raise ValueError(f"no dequantizer for ggml type {type_id}")
    if nrows == 0 or nblk == 0:
        return
    _run_deq(fn, &raw[0, 0], raw.strides[0], NULL, nrows, nblk, type_size, block_size,
             &out[0, 0], out.strides[0] // 4, nthreads)

def get_rows_into(const uint8_t[:, :] raw, int type_id, Py_ssize_t block_size, Py_ssize_t type_size,
                  const int64_t[::1] ids, float[:, :] out, int nthreads):
    """out[i] = dequantized raw[ids[i]]; ids must already be bounds-checked."""
    cdef deq_fn fn = get_deq(type_id)
    cdef Py_ssize_t n = ids.shape[0]
    cdef Py_ssize_t nblk = raw.shape[1] // type_size
    if fn == NULL:
        raise ValueError(f"no dequantizer for ggml type {type_id}")
    if n == 0 or nblk == 0 or raw.shape[0] == 0:
        return
    _run_deq(fn, &raw[0, 0], raw.strides[0], &ids[0], n, nblk, type_size, block_size,
             &out[0, 0], out.strides[0] // 4, nthreads)

def quantize_into(const float[::1] x, int type_id, Py_ssize_t block_size, Py_ssize_t type_size,
                  uint8_t[::1] out, int nthreads):
    """Contiguous floats (a whole number of blocks) -> contiguous blocks."""
    cdef q_fn fn = get_q(type_id)
    cdef Py_ssize_t ntot = x.shape[0] // block_size
    cdef Py_ssize_t cb, nit, it
    if fn == NULL:
        raise ValueError(f"no quantizer for ggml type {type_id}")
    if ntot == 0:
        return
    cb = 4096 // block_size
    if cb < 1:
        cb = 1
    nit = (ntot + cb - 1) // cb
    cdef const float* xp = &x[0]
    cdef uint8_t* yp = &out[0]
    if nthreads <= 1 or nit == 1:
        with nogil:
            fn(xp, yp, ntot)
    else:
        for it in prange(nit, nogil=True, num_threads=nthreads, schedule="dynamic"):
            _q_item(fn, xp, yp, ntot, cb, block_size, type_size, it)

cdef inline float _row_sigma2(const float* x, Py_ssize_t n) noexcept nogil:
    # ggml's row mean square for the 32-element weighted types: a float sum in order, / n
    cdef float s = 0
    cdef Py_ssize_t j
    for j in range(n):
        s += x[j] * x[j]
    return s / <float>n

cdef inline void _qw_item(qw_fn fn, const float* x, const float* qw, const float* sig, uint8_t* y,
                          Py_ssize_t ne0, Py_ssize_t rbytes, Py_ssize_t nch, Py_ssize_t cb, Py_ssize_t nblk,
                          Py_ssize_t bsize, Py_ssize_t tsize, Py_ssize_t it) noexcept nogil:
    cdef Py_ssize_t r = it // nch
    cdef Py_ssize_t b0 = (it - r * nch) * cb
    cdef Py_ssize_t nb = nblk - b0
    if nb > cb:
        nb = cb
    fn(x + r * ne0 + b0 * bsize, y + r * rbytes + b0 * tsize, nb, qw + b0 * bsize, sig[r])

def has_weighted_quant(int type_id):
    return get_qw(type_id) != NULL

def quantize_weighted_into(const float[:, ::1] x, const float[::1] qw, int type_id, Py_ssize_t block_size,
                           Py_ssize_t type_size, uint8_t[:, ::1] out, int nthreads):
    """Rows x [nrows, ne0] with importance weights qw [ne0] -> out [nrows, row_bytes]
    (ggml_quantize_chunk with an imatrix). Work items are (row, chunk of blocks)."""
    cdef qw_fn fn = get_qw(type_id)
    cdef Py_ssize_t nrows = x.shape[0]
    cdef Py_ssize_t ne0 = x.shape[1]
    cdef Py_ssize_t nblk = ne0 // block_size
    cdef Py_ssize_t rbytes = nblk * type_size
    cdef Py_ssize_t cb, nch, nit, it, r
    cdef bint row_sigma = type_id in (T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1)
    if fn == NULL:
        raise ValueError(f"no weighted quantizer for ggml type {type_id}")
    if qw.shape[0] < ne0 or out.shape[0] < nrows or out.shape[1] < rbytes:
        raise ValueError(f"quantize_weighted_into: {qw.shape[0]} weights / out {out.shape[0]} x {out.shape[1]} "
                         f"do not fit {nrows} rows of {ne0}")
    if nrows == 0 or nblk == 0:
        return
    cdef float* sig = <float*>malloc(nrows * sizeof(float))
    if sig == NULL:
        raise MemoryError()
    cdef const float* xp = &x[0, 0]
    cdef const float* wp = &qw[0]
    cdef uint8_t* yp = &out[0, 0]
    cb = 4096 // block_size
    if cb < 1:
        cb = 1
    if cb > nblk:
        cb = nblk
    nch = (nblk + cb - 1) // cb
    nit = nrows * nch
    try:
        if nthreads <= 1 or nit == 1:
            with nogil:
                for r in range(nrows):
                    sig[r] = _row_sigma2(xp + r * ne0, ne0) if row_sigma else <float>0
                for it in range(nit):
                    _qw_item(fn, xp, wp, sig, yp, ne0, rbytes, nch, cb, nblk, block_size, type_size, it)
        else:
            if row_sigma:
                for r in prange(nrows, nogil=True, num_threads=nthreads, schedule="static"):
                    sig[r] = _row_sigma2(xp + r * ne0, ne0)
            else:
                for r in range(nrows):
                    sig[r] = 0
            for it in prange(nit, nogil=True, num_threads=nthreads, schedule="dynamic"):
                _qw_item(fn, xp, wp, sig, yp, ne0, rbytes, nch, cb, nblk, block_size, type_size, it)
    finally:
        free(sig)

def half_to_f32_into(const uint16_t[::1] src, float[::1] dst, bint bf16, int nthreads):
    """fp16 (bf16=False) or bf16 (bf16=True) bit patterns -> float32, element for element."""
    cdef Py_ssize_t n = src.shape[0]
    cdef Py_ssize_t nit = (n + CHUNK_ELEMS - 1) // CHUNK_ELEMS
    cdef Py_ssize_t it
    if n == 0:
        return
    cdef const uint16_t* sp = &src[0]
    cdef float* dp = &dst[0]
    if nthreads <= 1 or nit == 1:
        with nogil:
            for it in range(nit):
                _cvt_item(sp, dp, n, it, bf16)
    else:
        for it in prange(nit, nogil=True, num_threads=nthreads, schedule="dynamic"):
            _cvt_item(sp, dp, n, it, bf16)

def f32_to_f16_bits(const float[::1] src, uint16_t[::1] dst):
    """float32 -> fp16 bit patterns with ggml's rounding (round to nearest even, NaN -> 0x7E00)."""
    cdef Py_ssize_t i
    with nogil:
        for i in range(src.shape[0]):
            dst[i] = f32_to_fp16(src[i])

# ============================================================================ quantized GEMM
cdef extern from "_qgemm.h" nogil:
    int qg_supported(int type)
    int qg_path_available(int path)
    int qg_gemm(int type, const uint8_t* w, int64_t ws, int64_t N, const float* x, int64_t xs,
                int64_t M, int64_t K, float* out, int64_t os, int path, int nthreads)

def qgemm_supported(int type_id):
    return bool(qg_supported(type_id))

def qgemm_path_available(int path):
    return bool(qg_path_available(path))

def qgemm_into(const float[:, :] x, const uint8_t[:, :] w, int type_id, float[:, :] out, int path, int nthreads):
    """out[M, N] = x[M, K] . dequant(w)[N, K]^T with int8 activations (see _qgemm.h); arrays
    already validated: unit stride inside rows, K % 32 == 0 (% 256 for K-quants)."""
    cdef int64_t M = x.shape[0], K = x.shape[1], N = w.shape[0]
    cdef int rc
    if M == 0 or N == 0:
        return
    with nogil:
        rc = qg_gemm(type_id, &w[0, 0], w.strides[0], N, &x[0, 0], x.strides[0] // 4, M, K,
                     &out[0, 0], out.strides[0] // 4, path, nthreads)
    if rc != 0:
        raise MemoryError("qgemm: out of memory for its activation/weight-tile buffers")
