# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -ffp-contract=off
"""GGUF/ggml block types in Cython: dequantize, get_rows and quantize, parallel over rows/blocks.

Everything here follows ggml's reference C (ggml-quants.c `dequantize_row_*`,
`quantize_row_*_ref`) operation for operation, in float32, so results are bit-exact with it:

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

# ============================================================================ dequantize
# Each deq_* turns `nb` consecutive blocks at x into nb*block_size floats at y.

cdef void deq_f32(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    memcpy(y, x, nb * 4)

cdef void deq_f16(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        y[i] = fp16_to_f32(rd16(x + 2 * i))

cdef void deq_bf16(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        y[i] = f32_from_bits((<uint32_t>rd16(x + 2 * i)) << 16)

cdef void deq_q4_0(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float d
    cdef uint8_t qs[16]
    for i in range(nb):
        d = ld_f16(x)
        memcpy(qs, x + 2, 16)  # a local copy: the compiler knows the float stores cannot alias it
        for j in range(16):
            y[j] = ((qs[j] & 0x0F) - 8) * d
            y[j + 16] = ((qs[j] >> 4) - 8) * d
        x += 18
        y += 32

cdef void deq_q4_1(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    cdef uint8_t blk[20]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int j
    cdef float d, m
    for i in range(nb):
        memcpy(blk, src, 20)
        d = ld_f16(x)
        m = ld_f16(x + 2)
        for j in range(16):
            y[j] = (x[4 + j] & 0x0F) * d + m
            y[j + 16] = (x[4 + j] >> 4) * d + m
        src += 20
        y += 32

# SPREAD16[v] has byte k = 16 * (bit k of v): turns Q5's 32 packed high bits into 32 bytes with
# 4 loads instead of 32 variable shifts (which SSE2 cannot vectorize)
cdef uint64_t SPREAD16[256]

cdef void _init_spread() noexcept nogil:
    cdef int v, k
    for v in range(256):
        SPREAD16[v] = 0
        for k in range(8):
            SPREAD16[v] |= (<uint64_t>(((v >> k) & 1) << 4)) << (8 * k)

_init_spread()

cdef inline void spread_bits(const uint8_t* qh, uint64_t* hb) noexcept nogil:
    hb[0] = SPREAD16[qh[0]]
    hb[1] = SPREAD16[qh[1]]
    hb[2] = SPREAD16[qh[2]]
    hb[3] = SPREAD16[qh[3]]

cdef void deq_q5_0(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    cdef uint8_t blk[22]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int j, x0, x1
    cdef uint64_t hbw[4]
    cdef const uint8_t* hb = <const uint8_t*>hbw
    cdef float d
    for i in range(nb):
        memcpy(blk, src, 22)
        d = ld_f16(x)
        spread_bits(x + 2, hbw)  # hb[j] = bit j of qh, times 16
        for j in range(16):
            x0 = ((x[6 + j] & 0x0F) | hb[j]) - 16
            x1 = ((x[6 + j] >> 4) | hb[j + 16]) - 16
            y[j] = x0 * d
            y[j + 16] = x1 * d
        src += 22
        y += 32

cdef void deq_q5_1(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    cdef uint8_t blk[24]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int j, x0, x1
    cdef uint64_t hbw[4]
    cdef const uint8_t* hb = <const uint8_t*>hbw
    cdef float d, m
    for i in range(nb):
        memcpy(blk, src, 24)
        d = ld_f16(x)
        m = ld_f16(x + 2)
        spread_bits(x + 4, hbw)
        for j in range(16):
            x0 = (x[8 + j] & 0x0F) | hb[j]
            x1 = (x[8 + j] >> 4) | hb[j + 16]
            y[j] = x0 * d + m
            y[j + 16] = x1 * d + m
        src += 24
        y += 32

cdef void deq_q8_0(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float d
    cdef const int8_t* q
    for i in range(nb):
        d = ld_f16(x)
        q = <const int8_t*>(x + 2)
        for j in range(32):
            y[j] = q[j] * d
        x += 34
        y += 32

cdef void deq_q8_1(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    # {half d, half s, int8 qs[32]}; s = d*sum(qs) is only used by dot products
    cdef Py_ssize_t i
    cdef int j
    cdef float d
    cdef const int8_t* q
    for i in range(nb):
        d = ld_f16(x)
        q = <const int8_t*>(x + 4)
        for j in range(32):
            y[j] = q[j] * d
        x += 36
        y += 32

cdef void deq_mxfp4(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    cdef float lut[16]
    cdef Py_ssize_t i
    cdef int j
    cdef float d
    for i in range(nb):
        d = e8m0_to_f32_half(x[0])
        for j in range(16):  # the 16 possible products (same float ops as per element)
            lut[j] = sdrt_kvalues_mxfp4[j] * d
        for j in range(16):
            y[j] = lut[x[1 + j] & 0x0F]
            y[j + 16] = lut[x[1 + j] >> 4]
        x += 17
        y += 32

cdef void deq_q2_K(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    # scales[16] @0, qs[64] @16, d @80, dmin @82
    cdef Py_ssize_t i
    cdef int n, j, l, shift, is_
    cdef float d, mn, dl, ml
    cdef uint8_t sc
    cdef const uint8_t* q
    for i in range(nb):
        d = ld_f16(x + 80)
        mn = ld_f16(x + 82)
        q = x + 16
        is_ = 0
        for n in range(2):
            shift = 0
            for j in range(4):
                sc = x[is_]
                is_ += 1
                dl = d * (sc & 0xF)
                ml = mn * (sc >> 4)
                for l in range(16):
                    y[l] = dl * (<int8_t>((q[l] >> shift) & 3)) - ml
                y += 16
                sc = x[is_]
                is_ += 1
                dl = d * (sc & 0xF)
                ml = mn * (sc >> 4)
                for l in range(16):
                    y[l] = dl * (<int8_t>((q[l + 16] >> shift) & 3)) - ml
                y += 16
                shift += 2
            q += 32
        x += 84

cdef inline int q3k_scale(const uint8_t* s, int j) noexcept nogil:
    # 6-bit scale j of a Q3_K block (12 packed bytes), minus 32
    cdef int lo
    if j < 8:
        lo = s[j] & 0xF
    else:
        lo = s[j - 8] >> 4
    return (lo | (((s[8 + (j & 3)] >> (2 * (j >> 2))) & 3) << 4)) - 32

cdef void deq_q3_K(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    # hmask[32] @0, qs[64] @32, scales[12] @96, d @108
    cdef Py_ssize_t i
    cdef int n, j, l, shift, is_
    cdef float d_all, dl
    cdef uint8_t m
    cdef const uint8_t* q
    cdef const uint8_t* hm
    for i in range(nb):
        d_all = ld_f16(x + 108)
        q = x + 32
        hm = x
        m = 1
        is_ = 0
        for n in range(2):
            shift = 0
            for j in range(4):
                dl = d_all * q3k_scale(x + 96, is_)
                is_ += 1
                for l in range(16):
                    y[l] = dl * ((<int8_t>((q[l] >> shift) & 3)) - (0 if (hm[l] & m) else 4))
                y += 16
                dl = d_all * q3k_scale(x + 96, is_)
                is_ += 1
                for l in range(16):
                    y[l] = dl * ((<int8_t>((q[l + 16] >> shift) & 3)) - (0 if (hm[l + 16] & m) else 4))
                y += 16
                shift += 2
                m = <uint8_t>(m << 1)
            q += 32
        x += 110

cdef inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) noexcept nogil:
    if j < 4:
        d[0] = q[j] & 63
        m[0] = q[j + 4] & 63
    else:
        d[0] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)
        m[0] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)

cdef void deq_q4_K(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, dmin @2, scales[12] @4, qs[128] @16
    cdef uint8_t blk[144]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int j, l, is_
    cdef float d, mn, d1, m1, d2, m2
    cdef uint8_t sc, m
    cdef const uint8_t* q
    for i in range(nb):
        memcpy(blk, src, 144)
        d = ld_f16(x)
        mn = ld_f16(x + 2)
        q = x + 16
        is_ = 0
        for j in range(4):
            get_scale_min_k4(is_, x + 4, &sc, &m)
            d1 = d * sc
            m1 = mn * m
            get_scale_min_k4(is_ + 1, x + 4, &sc, &m)
            d2 = d * sc
            m2 = mn * m
            for l in range(32):
                y[l] = d1 * (q[l] & 0xF) - m1
            for l in range(32):
                y[l + 32] = d2 * (q[l] >> 4) - m2
            y += 64
            q += 32
            is_ += 2
        src += 144

cdef void deq_q5_K(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
    cdef uint8_t blk[176]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int j, l, is_
    cdef float d, mn, d1, m1, d2, m2
    cdef uint8_t sc, m
    cdef const uint8_t* ql
    cdef const uint8_t* qh
    for i in range(nb):
        memcpy(blk, src, 176)
        d = ld_f16(x)
        mn = ld_f16(x + 2)
        qh = x + 16
        ql = x + 48
        is_ = 0
        for j in range(4):  # high bits of sub-blocks 2j, 2j+1 are bits 2j, 2j+1 of qh (ggml's u1, u2 masks)
            get_scale_min_k4(is_, x + 4, &sc, &m)
            d1 = d * sc
            m1 = mn * m
            get_scale_min_k4(is_ + 1, x + 4, &sc, &m)
            d2 = d * sc
            m2 = mn * m
            for l in range(32):
                y[l] = d1 * ((ql[l] & 0xF) + (((qh[l] >> (2 * j)) & 1) << 4)) - m1
            for l in range(32):
                y[l + 32] = d2 * ((ql[l] >> 4) + (((qh[l] >> (2 * j + 1)) & 1) << 4)) - m2
            y += 64
            ql += 32
            is_ += 2
        src += 176

cdef void deq_q6_K(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # ql[128] @0, qh[64] @128, scales[16] (int8) @192, d @208
    cdef uint8_t blk[210]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int n, l, is_
    cdef float d, d1, d2, d3, d4
    cdef int8_t q1, q2, q3, q4
    cdef const uint8_t* ql
    cdef const uint8_t* qh
    cdef const int8_t* sc
    for i in range(nb):
        memcpy(blk, src, 210)
        d = ld_f16(x + 208)
        ql = x
        qh = x + 128
        sc = <const int8_t*>(x + 192)
        for n in range(2):
            for is_ in range(2):
                # ggml computes d * sc[is] * q as (d * sc[is]) * q: hoisting the product is exact
                d1 = d * sc[is_]
                d2 = d * sc[is_ + 2]
                d3 = d * sc[is_ + 4]
                d4 = d * sc[is_ + 6]
                for l in range(16 * is_, 16 * is_ + 16):
                    q1 = <int8_t>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
                    q2 = <int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
                    q3 = <int8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
                    q4 = <int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
                    y[l] = d1 * q1
                    y[l + 32] = d2 * q2
                    y[l + 64] = d3 * q3
                    y[l + 96] = d4 * q4
            y += 128
            ql += 64
            qh += 32
            sc += 8
        src += 210

cdef void deq_q8_K(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    # float d @0, int8 qs[256] @4, int16 bsums[16] @260
    cdef Py_ssize_t i
    cdef int j
    cdef float d
    cdef const int8_t* q
    for i in range(nb):
        memcpy(&d, x, 4)
        q = <const int8_t*>(x + 4)
        for j in range(256):
            y[j] = d * q[j]
        x += 292
        y += 256

cdef void deq_tq1_0(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # qs[48] @0 (5 trits per byte), qh[4] @48 (4 trits per byte), d @52
    cdef uint8_t blk[54]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int j, n, m
    cdef uint8_t q
    cdef int16_t xi
    cdef float d
    cdef uint8_t pow3[6]
    pow3[0] = 1
    pow3[1] = 3
    pow3[2] = 9
    pow3[3] = 27
    pow3[4] = 81
    pow3[5] = 243
    for i in range(nb):
        memcpy(blk, src, 54)
        d = ld_f16(x + 52)
        for n in range(5):
            for m in range(32):
                q = <uint8_t>(x[m] * pow3[n])
                xi = ((<uint16_t>q) * 3) >> 8
                y[0] = (<float>(xi - 1)) * d
                y += 1
        for n in range(5):
            for m in range(16):
                q = <uint8_t>(x[32 + m] * pow3[n])
                xi = ((<uint16_t>q) * 3) >> 8
                y[0] = (<float>(xi - 1)) * d
                y += 1
        for n in range(4):
            for j in range(4):
                q = <uint8_t>(x[48 + j] * pow3[n])
                xi = ((<uint16_t>q) * 3) >> 8
                y[0] = (<float>(xi - 1)) * d
                y += 1
        src += 54

cdef void deq_tq2_0(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # qs[64] @0 (2 bits per element), d @64
    cdef uint8_t blk[66]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int j, l, m
    cdef int8_t q
    cdef float d
    for i in range(nb):
        memcpy(blk, src, 66)
        d = ld_f16(x + 64)
        for j in range(0, 64, 32):
            for l in range(4):
                for m in range(32):
                    q = (x[j + m] >> (l * 2)) & 3
                    y[m] = (<float>(q - 1)) * d
                y += 32
        src += 66

cdef void deq_iq2_xxs(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, qs[32] (uint16) @2: per 32 values 4 grid bytes + a uint32 of 4x7 sign bits and 4 scale bits
    cdef uint8_t blk[66]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int ib32, l, j
    cdef uint32_t aux1
    cdef uint64_t g
    cdef uint8_t signs
    cdef float d, db
    cdef const uint8_t* qs
    for i in range(nb):
        memcpy(blk, src, 66)
        d = ld_f16(x)
        for ib32 in range(8):
            qs = x + 2 + 8 * ib32
            aux1 = rd32(qs + 4)
            db = d * (<float>0.5 + (aux1 >> 28)) * <float>0.25
            for l in range(4):
                g = sdrt_iq2xxs_grid[qs[l]]
                signs = sdrt_ksigns_iq2xs[(aux1 >> (7 * l)) & 127]
                for j in range(8):
                    y[j] = flip(db * (<uint8_t>(g >> (8 * j))), signs & (1 << j))
                y += 8
        src += 66

cdef void deq_iq2_xs(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, qs[32] (uint16: 9-bit grid index + 7-bit sign index) @2, scales[8] @66
    cdef uint8_t blk[74]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int ib32, l, j
    cdef uint16_t q
    cdef uint64_t g
    cdef uint8_t signs
    cdef float d, dl
    cdef float db[2]
    for i in range(nb):
        memcpy(blk, src, 74)
        d = ld_f16(x)
        for ib32 in range(8):
            db[0] = d * (<float>0.5 + (x[66 + ib32] & 0xf)) * <float>0.25
            db[1] = d * (<float>0.5 + (x[66 + ib32] >> 4)) * <float>0.25
            for l in range(4):
                q = rd16(x + 2 + 2 * (4 * ib32 + l))
                g = sdrt_iq2xs_grid[q & 511]
                signs = sdrt_ksigns_iq2xs[q >> 9]
                dl = db[l // 2]
                for j in range(8):
                    y[j] = flip(dl * (<uint8_t>(g >> (8 * j))), signs & (1 << j))
                y += 8
        src += 74

cdef void deq_iq2_s(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, qs[32] @2, signs[32] @34, qh[8] @66, scales[8] @74
    cdef uint8_t blk[82]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int ib32, l, j
    cdef uint64_t g
    cdef float d, dl
    cdef float db[2]
    cdef const uint8_t* qs
    cdef const uint8_t* signs
    cdef const uint8_t* qh
    for i in range(nb):
        memcpy(blk, src, 82)
        d = ld_f16(x)
        qs = x + 2
        signs = x + 34
        qh = x + 66
        for ib32 in range(8):
            db[0] = d * (<float>0.5 + (x[74 + ib32] & 0xf)) * <float>0.25
            db[1] = d * (<float>0.5 + (x[74 + ib32] >> 4)) * <float>0.25
            for l in range(4):
                dl = db[l // 2]
                g = sdrt_iq2s_grid[qs[l] | ((qh[ib32] << (8 - 2 * l)) & 0x300)]
                for j in range(8):
                    y[j] = flip(dl * (<uint8_t>(g >> (8 * j))), signs[l] & (1 << j))
                y += 8
            qs += 4
            signs += 4
        src += 82

cdef void deq_iq3_xxs(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, qs[64] (grid bytes) @2, scales_and_signs[8] (uint32) @66
    cdef uint8_t blk[98]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int ib32, l, j
    cdef uint32_t aux32, g1, g2
    cdef uint8_t signs
    cdef float d, db
    cdef const uint8_t* qs
    for i in range(nb):
        memcpy(blk, src, 98)
        d = ld_f16(x)
        qs = x + 2
        for ib32 in range(8):
            aux32 = rd32(x + 66 + 4 * ib32)
            db = d * (<float>0.5 + (aux32 >> 28)) * <float>0.5
            for l in range(4):
                signs = sdrt_ksigns_iq2xs[(aux32 >> (7 * l)) & 127]
                g1 = sdrt_iq3xxs_grid[qs[2 * l]]
                g2 = sdrt_iq3xxs_grid[qs[2 * l + 1]]
                for j in range(4):
                    y[j] = flip(db * (<uint8_t>(g1 >> (8 * j))), signs & (1 << j))
                    y[j + 4] = flip(db * (<uint8_t>(g2 >> (8 * j))), signs & (1 << (j + 4)))
                y += 8
            qs += 8
        src += 98

cdef void deq_iq3_s(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, qs[64] @2, qh[8] @66, signs[32] @74, scales[4] @106
    cdef uint8_t blk[110]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int ib32, l, j, half
    cdef uint32_t g1, g2
    cdef float d, db
    cdef const uint8_t* qs
    cdef const uint8_t* qh
    cdef const uint8_t* signs
    for i in range(nb):
        memcpy(blk, src, 110)
        d = ld_f16(x)
        qs = x + 2
        qh = x + 66
        signs = x + 74
        for ib32 in range(0, 8, 2):
            for half in range(2):
                if half == 0:
                    db = d * (1 + 2 * (x[106 + ib32 // 2] & 0xf))
                else:
                    db = d * (1 + 2 * (x[106 + ib32 // 2] >> 4))
                for l in range(4):
                    g1 = sdrt_iq3s_grid[qs[2 * l] | ((qh[half] << (8 - 2 * l)) & 256)]
                    g2 = sdrt_iq3s_grid[qs[2 * l + 1] | ((qh[half] << (7 - 2 * l)) & 256)]
                    for j in range(4):
                        y[j] = flip(db * (<uint8_t>(g1 >> (8 * j))), signs[l] & (1 << j))
                        y[j + 4] = flip(db * (<uint8_t>(g2 >> (8 * j))), signs[l] & (1 << (j + 4)))
                    y += 8
                qs += 8
                signs += 4
            qh += 2
        src += 110

cdef void deq_iq1_s(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, qs[32] @2, qh[8] (uint16) @34
    cdef uint8_t blk[50]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int ib, l, j
    cdef uint16_t qh
    cdef uint64_t g
    cdef float d, dl, delta
    cdef const uint8_t* qs
    for i in range(nb):
        memcpy(blk, src, 50)
        d = ld_f16(x)
        qs = x + 2
        for ib in range(8):
            qh = rd16(x + 34 + 2 * ib)
            dl = d * (2 * ((qh >> 12) & 7) + 1)
            delta = -<float>0.125 if (qh & 0x8000) else <float>0.125
            for l in range(4):
                g = sdrt_iq1s_grid[qs[l] | (((qh >> (3 * l)) & 7) << 8)]
                for j in range(8):
                    y[j] = dl * ((<int8_t>(<uint8_t>(g >> (8 * j)))) + delta)
                y += 8
            qs += 4
        src += 50

cdef void deq_iq1_m(const uint8_t* src, float* y, Py_ssize_t nb) noexcept nogil:
    # qs[32] @0, qh[16] @32, scales[8] @48 (3-bit block scales; the fp16 scale is in the top nibbles)
    cdef uint8_t blk[56]  # the block, copied: float stores cannot alias it, so loops vectorize
    cdef const uint8_t* x = blk
    cdef Py_ssize_t i
    cdef int ib, l, j
    cdef uint16_t sc[4]
    cdef uint16_t idx[4]
    cdef float delta[4]
    cdef uint64_t g
    cdef float d, dl1, dl2, dl
    cdef const uint8_t* qs
    cdef const uint8_t* qh
    for i in range(nb):
        memcpy(blk, src, 56)
        for l in range(4):
            sc[l] = rd16(x + 48 + 2 * l)
        d = fp16_to_f32(<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)))
        qs = x
        qh = x + 32
        for ib in range(8):
            dl1 = d * (2 * ((sc[ib // 2] >> (6 * (ib % 2) + 0)) & 0x7) + 1)
            dl2 = d * (2 * ((sc[ib // 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1)
            idx[0] = qs[0] | ((qh[0] << 8) & 0x700)
            idx[1] = qs[1] | ((qh[0] << 4) & 0x700)
            idx[2] = qs[2] | ((qh[1] << 8) & 0x700)
            idx[3] = qs[3] | ((qh[1] << 4) & 0x700)
            delta[0] = -<float>0.125 if (qh[0] & 0x08) else <float>0.125
            delta[1] = -<float>0.125 if (qh[0] & 0x80) else <float>0.125
            delta[2] = -<float>0.125 if (qh[1] & 0x08) else <float>0.125
            delta[3] = -<float>0.125 if (qh[1] & 0x80) else <float>0.125
            for l in range(4):
                dl = dl1 if l < 2 else dl2
                g = sdrt_iq1s_grid[idx[l]]
                for j in range(8):
                    y[j] = dl * ((<int8_t>(<uint8_t>(g >> (8 * j)))) + delta[l])
                y += 8
            qs += 4
            qh += 2
        src += 56

cdef void deq_iq4_nl(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    cdef float lut[16]
    cdef Py_ssize_t i
    cdef int j
    cdef float d
    for i in range(nb):
        d = ld_f16(x)
        for j in range(16):
            lut[j] = d * sdrt_kvalues_iq4nl[j]
        for j in range(16):
            y[j] = lut[x[2 + j] & 0xf]
            y[j + 16] = lut[x[2 + j] >> 4]
        x += 18
        y += 32

cdef void deq_iq4_xs(const uint8_t* x, float* y, Py_ssize_t nb) noexcept nogil:
    # d @0, scales_h (uint16) @2, scales_l[4] @4, qs[128] @8
    cdef float lut[16]
    cdef Py_ssize_t i
    cdef int ib, j, ls
    cdef uint16_t sh
    cdef float d, dl
    cdef const uint8_t* qs
    for i in range(nb):
        d = ld_f16(x)
        sh = rd16(x + 2)
        qs = x + 8
        for ib in range(8):
            ls = ((x[4 + ib // 2] >> (4 * (ib % 2))) & 0xf) | (((sh >> (2 * ib)) & 3) << 4)
            dl = d * (ls - 32)
            for j in range(16):
                lut[j] = dl * sdrt_kvalues_iq4nl[j]
            for j in range(16):
                y[j] = lut[qs[j] & 0xf]
                y[j + 16] = lut[qs[j] >> 4]
            y += 32
            qs += 16
        x += 136

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

# ============================================================================ quantize helpers
# (the published k-quant scale searches of ggml-quants.c, reference variants without importance
#  weights, written out again operation for operation)

cdef float GROUP_MAX_EPS = <float>1e-15

cdef float make_qx_quants(int n, int nmax, const float* x, int8_t* L, int rmse_type) noexcept nogil:
    # symmetric scale search for signed levels [-nmax, nmax-1]; rmse_type 0 (plain) or 1 (x^2 weights)
    cdef float mx = 0
    cdef float amax = 0
    cdef float ax, iscale, sumlx, suml2, w, scale, best
    cdef int i, l, is_
    for i in range(n):
        ax = fabsf(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return 0
    iscale = -nmax / mx
    if rmse_type == 0:
        for i in range(n):
            l = nearest_int(iscale * x[i])
            L[i] = nmax + imax(-nmax, imin(nmax - 1, l))
        return <float>1 / iscale
    sumlx = 0
    suml2 = 0
    for i in range(n):
        l = nearest_int(iscale * x[i])
        l = imax(-nmax, imin(nmax - 1, l))
        L[i] = l + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * l
        suml2 += w * l * l
    scale = sumlx / suml2 if suml2 != 0 else <float>0
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(nmax + <float>0.1 * is_) / mx
        sumlx = 0
        suml2 = 0
        for i in range(n):
            l = nearest_int(iscale * x[i])
            l = imax(-nmax, imin(nmax - 1, l))
            w = x[i] * x[i]
            sumlx += w * x[i] * l
            suml2 += w * l * l
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                l = nearest_int(iscale * x[i])
                L[i] = nmax + imax(-nmax, imin(nmax - 1, l))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale

cdef float make_q3_quants(int n, int nmax, const float* x, int8_t* L) noexcept nogil:
    # symmetric search with x^2 weights and up to 5 rounds of coordinate descent (do_rmse=true)
    cdef float mx = 0
    cdef float amax = 0
    cdef float ax, iscale, sumlx, suml2, w, slx, sl2
    cdef int i, l, itry, n_changed, new_l
    for i in range(n):
        ax = fabsf(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return 0
    iscale = -nmax / mx
    sumlx = 0
    suml2 = 0
    for i in range(n):
        l = nearest_int(iscale * x[i])
        l = imax(-nmax, imin(nmax - 1, l))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * l
        suml2 += w * l * l
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * L[i]
            if slx > 0:
                sl2 = suml2 - w * L[i] * L[i]
                new_l = nearest_int(x[i] * sl2 / slx)
                new_l = imax(-nmax, imin(nmax - 1, new_l))
                if new_l != L[i]:
                    slx += w * x[i] * new_l
                    sl2 += w * new_l * new_l
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else <float>0

cdef float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L,
                            float* the_min, uint8_t* Laux, float rmin, float rdelta, int nstep,
                            bint use_mad) noexcept nogil:
    # asymmetric (scale, min) search over nstep+1 candidate scales, weighted L2 or L1 error
    cdef float mn = x[0]
    cdef float mx = x[0]
    cdef float sum_w = weights[0]
    cdef float sum_x = sum_w * x[0]
    cdef float w, iscale, scale, best_error, diff, sum_l, sum_l2, sum_xl, D, this_scale, this_min, cur_error
    cdef int i, l, is_
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if mn > 0:
        mn = 0
    if mx == mn:
        for i in range(n):
            L[i] = 0
        the_min[0] = -mn
        return 0
    iscale = nmax / (mx - mn)
    scale = <float>1 / iscale
    best_error = 0
    for i in range(n):
        l = nearest_int(iscale * (x[i] - mn))
        L[i] = imax(0, imin(nmax, l))
        diff = scale * L[i] + mn - x[i]
        diff = fabsf(diff) if use_mad else diff * diff
        w = weights[i]
        best_error += w * diff
    if nstep < 1:
        the_min[0] = -mn
        return scale
    for is_ in range(nstep + 1):
        iscale = (rmin + rdelta * is_ + nmax) / (mx - mn)
        sum_l = 0
        sum_l2 = 0
        sum_xl = 0
        for i in range(n):
            l = nearest_int(iscale * (x[i] - mn))
            l = imax(0, imin(nmax, l))
            Laux[i] = l
            w = weights[i]
            sum_l += w * l
            sum_l2 += w * l * l
            sum_xl += w * l * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = 0
                this_scale = sum_xl / sum_l2
            cur_error = 0
            for i in range(n):
                diff = this_scale * Laux[i] + this_min - x[i]
                diff = fabsf(diff) if use_mad else diff * diff
                w = weights[i]
                cur_error += w * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    the_min[0] = -mn
    return scale

# ============================================================================ quantize
# Each q_* turns nb*block_size floats at x into nb blocks at y (ggml's quantize_row_*_ref).

cdef void q_q4_0(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float amax, mx, v, d, id_, x0, x1
    cdef uint8_t xi0, xi1
    for i in range(nb):
        amax = 0
        mx = 0
        for j in range(32):
            v = x[j]
            if amax < fabsf(v):
                amax = fabsf(v)
                mx = v
        d = mx / <float>-8
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y, f32_to_fp16(d))
        for j in range(16):
            x0 = x[j] * id_
            x1 = x[16 + j] * id_
            xi0 = <uint8_t>imin(15, <int8_t>(x0 + <float>8.5))
            xi1 = <uint8_t>imin(15, <int8_t>(x1 + <float>8.5))
            y[2 + j] = xi0 | (xi1 << 4)
        x += 32
        y += 18

cdef void q_q4_1(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float mn, mx, v, d, id_, x0, x1
    cdef uint8_t xi0, xi1
    for i in range(nb):
        mn = f32_from_bits(0x7f7fffff)  # FLT_MAX
        mx = -f32_from_bits(0x7f7fffff)
        for j in range(32):
            v = x[j]
            if v < mn:
                mn = v
            if v > mx:
                mx = v
        d = (mx - mn) / <float>15
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y, f32_to_fp16(d))
        wr16(y + 2, f32_to_fp16(mn))
        for j in range(16):
            x0 = (x[j] - mn) * id_
            x1 = (x[16 + j] - mn) * id_
            xi0 = <uint8_t>imin(15, <int8_t>(x0 + <float>0.5))
            xi1 = <uint8_t>imin(15, <int8_t>(x1 + <float>0.5))
            y[4 + j] = xi0 | (xi1 << 4)
        x += 32
        y += 20

cdef void q_q5_0(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float amax, mx, v, d, id_, x0, x1
    cdef uint8_t xi0, xi1
    cdef uint32_t qh
    for i in range(nb):
        amax = 0
        mx = 0
        for j in range(32):
            v = x[j]
            if amax < fabsf(v):
                amax = fabsf(v)
                mx = v
        d = mx / <float>-16
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y, f32_to_fp16(d))
        qh = 0
        for j in range(16):
            x0 = x[j] * id_
            x1 = x[16 + j] * id_
            xi0 = <uint8_t>imin(31, <int8_t>(x0 + <float>16.5))
            xi1 = <uint8_t>imin(31, <int8_t>(x1 + <float>16.5))
            y[6 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4)
            qh |= ((xi0 & <uint32_t>0x10) >> 4) << j
            qh |= ((xi1 & <uint32_t>0x10) >> 4) << (j + 16)
        memcpy(y + 2, &qh, 4)
        x += 32
        y += 22

cdef void q_q5_1(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float mn, mx, v, d, id_, x0, x1
    cdef uint8_t xi0, xi1
    cdef uint32_t qh
    for i in range(nb):
        mn = f32_from_bits(0x7f7fffff)
        mx = -f32_from_bits(0x7f7fffff)
        for j in range(32):
            v = x[j]
            if v < mn:
                mn = v
            if v > mx:
                mx = v
        d = (mx - mn) / <float>31
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y, f32_to_fp16(d))
        wr16(y + 2, f32_to_fp16(mn))
        qh = 0
        for j in range(16):
            x0 = (x[j] - mn) * id_
            x1 = (x[16 + j] - mn) * id_
            xi0 = <uint8_t>(x0 + <float>0.5)
            xi1 = <uint8_t>(x1 + <float>0.5)
            y[8 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4)
            qh |= ((xi0 & <uint32_t>0x10) >> 4) << j
            qh |= ((xi1 & <uint32_t>0x10) >> 4) << (j + 16)
        memcpy(y + 4, &qh, 4)
        x += 32
        y += 24

cdef void q_q8_0(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float amax, d, id_
    cdef int8_t* qs
    for i in range(nb):
        amax = 0
        for j in range(32):
            amax = amax if amax >= fabsf(x[j]) else fabsf(x[j])
        d = amax / <float>127
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y, f32_to_fp16(d))
        qs = <int8_t*>(y + 2)
        for j in range(32):
            qs[j] = <int8_t>round_away(x[j] * id_)
        x += 32
        y += 34

cdef void q_q8_1(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j, s
    cdef float amax, d, id_
    cdef int8_t* qs
    for i in range(nb):
        amax = 0
        for j in range(32):
            amax = amax if amax >= fabsf(x[j]) else fabsf(x[j])
        d = amax / <float>127
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y, f32_to_fp16(d))
        qs = <int8_t*>(y + 4)
        s = 0
        for j in range(16):
            qs[j] = <int8_t>round_away(x[j] * id_)
            qs[16 + j] = <int8_t>round_away(x[16 + j] * id_)
            s += qs[j]
            s += qs[16 + j]
        wr16(y + 2, f32_to_fp16(s * d))
        x += 32
        y += 36

cdef inline int best_index_mxfp4(float x, float e) noexcept nogil:
    cdef int best_index = 0
    cdef float best_err = fabsf(sdrt_kvalues_mxfp4[0] * e - x)
    cdef float err
    cdef int i
    for i in range(1, 16):
        err = fabsf(sdrt_kvalues_mxfp4[i] * e - x)
        if err < best_err:
            best_index = i
            best_err = err
    return best_index

cdef void q_mxfp4(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j
    cdef float amax, d
    cdef uint8_t e
    for i in range(nb):
        amax = 0
        for j in range(32):
            if amax < fabsf(x[j]):
                amax = fabsf(x[j])
        e = <uint8_t>(floorf(log2f(amax)) - <float>2 + <float>127) if amax > 0 else 0
        d = e8m0_to_f32_half(e)
        y[0] = e
        for j in range(16):
            y[1 + j] = <uint8_t>(best_index_mxfp4(x[j], d) | (best_index_mxfp4(x[16 + j], d) << 4))
        x += 32
        y += 17

cdef void q_q2_K(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j, l, ii
    cdef uint8_t L[256]
    cdef uint8_t Laux[16]
    cdef float weights[16]
    cdef float mins[16]
    cdef float scales[16]
    cdef float q4scale = 15
    cdef float max_scale, max_min, iscale, d, dm
    for i in range(nb):
        max_scale = 0
        max_min = 0
        for j in range(16):
            for l in range(16):
                weights[l] = fabsf(x[16 * j + l])
            scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux,
                                         <float>-0.5, <float>0.1, 15, True)
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        if max_scale > 0:
            iscale = q4scale / max_scale
            for j in range(16):
                y[j] = <uint8_t>nearest_int(iscale * scales[j])
            wr16(y + 80, f32_to_fp16(max_scale / q4scale))
        else:
            for j in range(16):
                y[j] = 0
            wr16(y + 80, f32_to_fp16(0))
        if max_min > 0:
            iscale = q4scale / max_min
            for j in range(16):
                y[j] |= <uint8_t>(nearest_int(iscale * mins[j]) << 4)
            wr16(y + 82, f32_to_fp16(max_min / q4scale))
        else:
            wr16(y + 82, f32_to_fp16(0))
        for j in range(16):
            d = ld_f16(y + 80) * (y[j] & 0xF)
            if d == 0:
                continue
            dm = ld_f16(y + 82) * (y[j] >> 4)
            for ii in range(16):
                l = nearest_int((x[16 * j + ii] + dm) / d)
                L[16 * j + ii] = imax(0, imin(3, l))
        for j in range(0, 256, 128):
            for l in range(32):
                y[16 + j // 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)
        x += 256
        y += 84

cdef void q_q3_K(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    # hmask[32] @0, qs[64] @32, scales[12] @96, d @108
    cdef Py_ssize_t i
    cdef int j, l, ii, m
    cdef int8_t L[256]
    cdef float scales[16]
    cdef float max_scale, amax, scale, iscale, d
    cdef int8_t ls, sc
    cdef uint8_t hm
    cdef uint8_t* sb
    for i in range(nb):
        sb = y + 96
        max_scale = 0
        amax = 0
        for j in range(16):
            scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j)
            scale = fabsf(scales[j])
            if scale > amax:
                amax = scale
                max_scale = scales[j]
        memset(sb, 0, 12)
        if max_scale != 0:
            iscale = <float>-32.0 / max_scale
            for j in range(16):
                ls = <int8_t>nearest_int(iscale * scales[j])
                ls = <int8_t>(imax(-32, imin(31, ls)) + 32)
                if j < 8:
                    sb[j] = ls & 0xF
                else:
                    sb[j - 8] |= ((ls & 0xF) << 4)
                ls >>= 4
                sb[j % 4 + 8] |= (ls << (2 * (j // 4)))
            wr16(y + 108, f32_to_fp16(<float>1 / iscale))
        else:
            wr16(y + 108, f32_to_fp16(0))
        for j in range(16):
            sc = <int8_t>q3k_scale(sb, j)
            d = ld_f16(y + 108) * sc
            if d == 0:
                continue
            for ii in range(16):
                l = nearest_int(x[16 * j + ii] / d)
                l = imax(-4, imin(3, l))
                L[16 * j + ii] = l + 4
        memset(y, 0, 32)
        m = 0
        hm = 1
        for j in range(256):
            if L[j] > 3:
                y[m] |= hm
                L[j] -= 4
            m += 1
            if m == 32:
                m = 0
                hm = <uint8_t>(hm << 1)
        for j in range(0, 256, 128):
            for l in range(32):
                y[32 + j // 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)
        x += 256
        y += 110

cdef inline void kquant_scales_4_5(const float* x, uint8_t* y, uint8_t* L, int nmax, float rmin,
                                   int nstep) noexcept nogil:
    # shared by Q4_K / Q5_K: 8 sub-blocks of 32, 6-bit scales and mins, fp16 d/dmin at y[0:4],
    # packed scales at y[4:16]; fills L (levels 0..nmax) for the whole super-block
    cdef int j, l, ii
    cdef uint8_t Laux[32]
    cdef float weights[32]
    cdef float mins[8]
    cdef float scales[8]
    cdef float max_scale = 0
    cdef float max_min = 0
    cdef float sum_x2, av_x, inv_scale, inv_min, d, dm
    cdef uint8_t ls, lm, sc, m
    cdef uint8_t* s = y + 4
    for j in range(8):
        sum_x2 = 0
        for l in range(32):
            sum_x2 += x[32 * j + l] * x[32 * j + l]
        av_x = sqrtf(sum_x2 / <float>32)
        for l in range(32):
            weights[l] = av_x + fabsf(x[32 * j + l])
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, <float>0.1, nstep, False)
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = <float>63.0 / max_scale if max_scale > 0 else <float>0
    inv_min = <float>63.0 / max_min if max_min > 0 else <float>0
    for j in range(8):
        ls = <uint8_t>nearest_int(inv_scale * scales[j])
        lm = <uint8_t>nearest_int(inv_min * mins[j])
        ls = ls if ls < 63 else 63
        lm = lm if lm < 63 else 63
        if j < 4:
            s[j] = ls
            s[j + 4] = lm
        else:
            s[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            s[j - 4] |= ((ls >> 4) << 6)
            s[j] |= ((lm >> 4) << 6)
    wr16(y, f32_to_fp16(max_scale / <float>63.0))
    wr16(y + 2, f32_to_fp16(max_min / <float>63.0))
    for j in range(8):
        get_scale_min_k4(j, s, &sc, &m)
        d = ld_f16(y) * sc
        if d == 0:
            continue
        dm = ld_f16(y + 2) * m
        for ii in range(32):
            l = nearest_int((x[32 * j + ii] + dm) / d)
            L[32 * j + ii] = imax(0, imin(nmax, l))

cdef void q_q4_K(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j, l
    cdef uint8_t L[256]
    for i in range(nb):
        kquant_scales_4_5(x, y, L, 15, <float>-1.0, 20)
        for j in range(0, 256, 64):
            for l in range(32):
                y[16 + j // 2 + l] = L[j + l] | (L[j + l + 32] << 4)
        x += 256
        y += 144

cdef void q_q5_K(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    cdef int n, j, l1, l2
    cdef uint8_t L[256]
    cdef uint8_t m1, m2
    cdef uint8_t* qh
    cdef uint8_t* ql
    for i in range(nb):
        kquant_scales_4_5(x, y, L, 31, <float>-0.5, 15)
        qh = y + 16
        ql = y + 48
        memset(qh, 0, 32)
        m1 = 1
        m2 = 2
        for n in range(0, 256, 64):
            for j in range(32):
                l1 = L[n + j]
                if l1 > 15:
                    l1 -= 16
                    qh[j] |= m1
                l2 = L[n + j + 32]
                if l2 > 15:
                    l2 -= 16
                    qh[j] |= m2
                ql[j] = <uint8_t>(l1 | (l2 << 4))
            m1 = <uint8_t>(m1 << 2)
            m2 = <uint8_t>(m2 << 2)
            ql += 32
        x += 256
        y += 176

cdef void q_q6_K(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    # ql[128] @0, qh[64] @128, scales[16] @192, d @208
    cdef Py_ssize_t i
    cdef int ib, j, l, ii
    cdef int8_t L[256]
    cdef float scales[16]
    cdef float max_scale, max_abs_scale, scale, iscale, d
    cdef int8_t* sc
    cdef uint8_t* ql
    cdef uint8_t* qh
    cdef uint8_t q1, q2, q3, q4
    for i in range(nb):
        max_scale = 0
        max_abs_scale = 0
        for ib in range(16):
            scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib, 1)
            scales[ib] = scale
            if fabsf(scale) > max_abs_scale:
                max_abs_scale = fabsf(scale)
                max_scale = scale
        if max_abs_scale < GROUP_MAX_EPS:
            memset(y, 0, 210)
            x += 256
            y += 210
            continue
        sc = <int8_t*>(y + 192)
        iscale = <float>-128.0 / max_scale
        wr16(y + 208, f32_to_fp16(<float>1 / iscale))
        for ib in range(16):
            sc[ib] = <int8_t>imin(127, nearest_int(iscale * scales[ib]))
        for j in range(16):
            d = ld_f16(y + 208) * sc[j]
            if d == 0:
                continue
            for ii in range(16):
                l = nearest_int(x[16 * j + ii] / d)
                l = imax(-32, imin(31, l))
                L[16 * j + ii] = l + 32
        ql = y
        qh = y + 128
        for j in range(0, 256, 128):
            for l in range(32):
                q1 = L[j + l] & 0xF
                q2 = L[j + l + 32] & 0xF
                q3 = L[j + l + 64] & 0xF
                q4 = L[j + l + 96] & 0xF
                ql[l] = q1 | (q3 << 4)
                ql[l + 32] = q2 | (q4 << 4)
                qh[l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6)
            ql += 64
            qh += 32
        x += 256
        y += 210

cdef void q_q8_K(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    # float d @0, int8 qs[256] @4, int16 bsums[16] @260
    cdef Py_ssize_t i
    cdef int j, ii, v, s
    cdef float mx, amax, ax, iscale, d
    cdef int8_t* qs
    cdef int16_t bs
    for i in range(nb):
        qs = <int8_t*>(y + 4)
        mx = 0
        amax = 0
        for j in range(256):
            ax = fabsf(x[j])
            if ax > amax:
                amax = ax
                mx = x[j]
        if amax == 0:
            memset(y, 0, 260)  # d = 0, qs = 0 (ggml leaves bsums as they were; we zero them)
            memset(y + 260, 0, 32)
            x += 256
            y += 292
            continue
        iscale = <float>-127.0 / mx
        for j in range(256):
            v = nearest_int(iscale * x[j])
            qs[j] = <int8_t>imin(127, v)
        for j in range(16):
            s = 0
            for ii in range(16):
                s += qs[j * 16 + ii]
            bs = <int16_t>s
            memcpy(y + 260 + 2 * j, &bs, 2)
        d = <float>1 / iscale
        memcpy(y, &d, 4)
        x += 256
        y += 292

cdef void q_tq1_0(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    # qs[48] @0, qh[4] @48, d @52
    cdef Py_ssize_t i
    cdef int j, m, n, xi
    cdef float amax, d, id_
    cdef uint8_t q
    for i in range(nb):
        amax = 0
        for j in range(256):
            amax = amax if amax >= fabsf(x[j]) else fabsf(x[j])
        d = amax
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y + 52, f32_to_fp16(d))
        for m in range(32):
            q = 0
            for n in range(5):
                xi = round_away(x[m + n * 32] * id_) + 1
                q = <uint8_t>(q * 3)
                q = <uint8_t>(q + xi)
            y[m] = <uint8_t>(((<uint16_t>q) * 256 + (243 - 1)) // 243)
        x += 160
        for m in range(16):
            q = 0
            for n in range(5):
                xi = round_away(x[m + n * 16] * id_) + 1
                q = <uint8_t>(q * 3)
                q = <uint8_t>(q + xi)
            y[32 + m] = <uint8_t>(((<uint16_t>q) * 256 + (243 - 1)) // 243)
        x += 80
        for j in range(4):
            q = 0
            for m in range(4):
                xi = round_away(x[j + m * 4] * id_) + 1
                q = <uint8_t>(q * 3)
                q = <uint8_t>(q + xi)
            q = <uint8_t>(q * 3)
            y[48 + j] = <uint8_t>(((<uint16_t>q) * 256 + (243 - 1)) // 243)
        x += 16
        y += 54

cdef void q_tq2_0(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    # qs[64] @0, d @64
    cdef Py_ssize_t i
    cdef int j, m, n, xi
    cdef float amax, d, id_
    cdef uint8_t q
    for i in range(nb):
        amax = 0
        for j in range(256):
            amax = amax if amax >= fabsf(x[j]) else fabsf(x[j])
        d = amax
        id_ = <float>1 / d if d != 0 else <float>0
        wr16(y + 64, f32_to_fp16(d))
        for j in range(0, 64, 32):
            for m in range(32):
                q = 0
                for n in range(4):
                    xi = round_away(x[m + n * 32] * id_) + 1
                    q = <uint8_t>(q + ((xi & 3) << (2 * n)))
                y[j + m] = q
            x += 128
        y += 66

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
