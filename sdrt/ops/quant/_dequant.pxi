# Included by _quants.pyx: the dequantizers, one per ggml block type (ggml's dequantize_row_*).
# Each deq_* turns `nb` consecutive blocks at x into nb*block_size floats at y; block offsets are
# ggml-common.h's struct offsets. Helpers (ld_f16, flip, ...) are defined in _quants.pyx.

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
