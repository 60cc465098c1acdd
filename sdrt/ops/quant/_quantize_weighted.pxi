# Included by _quants.pyx: the importance-weighted quantizers, i.e. what ggml_quantize_chunk runs
# when it is given an importance vector (ggml-quants.c `quantize_q*` -> `quantize_row_*_impl`).
# stable-diffusion.cpp's convert and its load-time --type conversion always pass one: a dummy
# vector of ones. llama.cpp's quantize passes a real imatrix.
#
# Each qw_* quantizes nb blocks of ONE row: x and y point at its first block, qw at the matching
# importance weights (the row's imatrix entries from that column on), and sigma2 is the row's
# mean square (sum of x^2 over the whole row, in order, divided by the row length), which only
# the 32-element types use; the K-quants compute their own per super-block. Written out again
# operation for operation in float32, like _quantize.pxi (same rules: `<float>` literals, ggml's
# association order, no FMA).

# ============================================================================ weighted searches

cdef float make_qp_quants(int n, int nmax, const float* x, uint8_t* L, const float* qw) noexcept nogil:
    # scale search for non-negative values (the sub-block scales / mins of the K-quants) on levels
    # 0..nmax: 8 trial scales around nmax/max, then up to 5 rounds of coordinate descent.
    # L is uint8: negative levels wrap as in ggml (they can only come from negative inputs).
    cdef float mx = 0
    cdef float iscale, scale, best_mse, diff, w, iscale_is, scale_is, mse, sumlx, suml2, slx, sl2
    cdef int i, l, is_, itry, n_changed, new_l
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return 0
    iscale = nmax / mx
    for i in range(n):
        L[i] = <uint8_t>nearest_int(iscale * x[i])
    scale = <float>1 / iscale
    best_mse = 0
    for i in range(n):
        diff = x[i] - scale * L[i]
        w = qw[i]
        best_mse += w * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (<float>0.1 * is_ + nmax) / mx
        scale_is = <float>1 / iscale_is
        mse = 0
        for i in range(n):
            l = imin(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * l
            w = qw[i]
            mse += w * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = 0
    suml2 = 0
    for i in range(n):
        l = imin(nmax, nearest_int(iscale * x[i]))
        L[i] = <uint8_t>l
        w = qw[i]
        sumlx += w * x[i] * l
        suml2 += w * l * l
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            slx = sumlx - w * x[i] * L[i]
            sl2 = suml2 - w * L[i] * L[i]
            if slx > 0 and sl2 > 0:
                new_l = imin(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * new_l
                    sl2 += w * new_l * new_l
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = <uint8_t>new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else <float>0

# make_qkx3_quants (ggml's weighted asymmetric search) is make_qkx2_quants of _quantize.pxi
# whenever weights are given: the loops are the same; only its `max <= min` early exit differs
# from qkx2's `max == min`, and max < min cannot happen (min <= x[0] <= max, and min is only
# raised to 0 when it was > 0). The weighted callers use rmin -0.9, rdelta 0.05, 36 steps.

cdef inline void sigma_weights(const float* x, const float* qw, float sigma2, float* w, int n) noexcept nogil:
    # w[l] = qw[l] * sqrt(sigma2 + x[l]^2)
    cdef int l
    for l in range(n):
        w[l] = qw[l] * sqrtf(sigma2 + x[l] * x[l])

cdef inline float block_sum_x2(const float* x, int n) noexcept nogil:
    cdef float s = 0
    cdef int l
    for l in range(n):
        s += x[l] * x[l]
    return s

# ============================================================================ 32-element types

cdef void qw_q4_0(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2) noexcept nogil:
    cdef Py_ssize_t ib
    cdef int j
    cdef float weight[32]
    cdef int8_t L[32]
    cdef float d
    for ib in range(nb):
        sigma_weights(x, qw, sigma2, weight, 32)
        d = make_qx_quants(32, 8, x, L, 1, weight)
        wr16(y, f32_to_fp16(d))
        for j in range(16):
            y[2 + j] = <uint8_t>(L[j] | (L[j + 16] << 4))
        x += 32
        qw += 32
        y += 18

cdef void qw_q4_1(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2) noexcept nogil:
    cdef Py_ssize_t ib
    cdef int j
    cdef float weight[32]
    cdef uint8_t L[32]
    cdef uint8_t Laux[32]
    cdef float d, mn
    for ib in range(nb):
        sigma_weights(x, qw, sigma2, weight, 32)
        d = make_qkx2_quants(32, 15, x, weight, L, &mn, Laux, <float>-0.9, <float>0.05, 36, False)
        wr16(y, f32_to_fp16(d))
        wr16(y + 2, f32_to_fp16(-mn))
        for j in range(16):
            y[4 + j] = <uint8_t>(L[j] | (L[j + 16] << 4))
        x += 32
        qw += 32
        y += 20

cdef inline void pack_q5(const uint8_t* L, uint8_t* qh_out, uint8_t* qs) noexcept nogil:
    # levels 0..31 -> low nibbles in qs[16], 5th bits in the little-endian u32 at qh_out
    cdef int j
    cdef uint8_t xi0, xi1
    cdef uint32_t qh = 0
    for j in range(16):
        xi0 = L[j]
        xi1 = L[j + 16]
        qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4)
        qh |= ((xi0 & <uint32_t>0x10) >> 4) << j
        qh |= ((xi1 & <uint32_t>0x10) >> 4) << (j + 16)
    memcpy(qh_out, &qh, 4)

cdef void qw_q5_0(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2) noexcept nogil:
    cdef Py_ssize_t ib
    cdef float weight[32]
    cdef int8_t L[32]
    cdef float d
    for ib in range(nb):
        sigma_weights(x, qw, sigma2, weight, 32)
        d = make_qx_quants(32, 16, x, L, 1, weight)
        wr16(y, f32_to_fp16(d))
        pack_q5(<uint8_t*>L, y + 2, y + 6)
        x += 32
        qw += 32
        y += 22

cdef void qw_q5_1(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2) noexcept nogil:
    cdef Py_ssize_t ib
    cdef float weight[32]
    cdef uint8_t L[32]
    cdef uint8_t Laux[32]
    cdef float d, mn
    for ib in range(nb):
        sigma_weights(x, qw, sigma2, weight, 32)
        d = make_qkx2_quants(32, 31, x, weight, L, &mn, Laux, <float>-0.9, <float>0.05, 36, False)
        wr16(y, f32_to_fp16(d))
        wr16(y + 2, f32_to_fp16(-mn))
        pack_q5(L, y + 4, y + 8)
        x += 32
        qw += 32
        y += 24

# ============================================================================ K-quants

cdef void qw_q2_K(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2_row) noexcept nogil:
    # scales[16] @0, qs[64] @16, d @80, dmin @82
    cdef Py_ssize_t i
    cdef int j, l, ii
    cdef uint8_t L[256]
    cdef uint8_t Laux[16]
    cdef uint8_t Ls[16]
    cdef uint8_t Lm[16]
    cdef float mins[16]
    cdef float scales[16]
    cdef float sw[16]
    cdef float weight[16]
    cdef float sigma2, dm, mm, d, m, s
    for i in range(nb):
        sigma2 = block_sum_x2(x, 256) / <float>256
        for j in range(16):
            sigma_weights(x + 16 * j, qw + 16 * j, sigma2, weight, 16)
            s = 0
            for l in range(16):
                s += weight[l]
            sw[j] = s
            scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weight, L + 16 * j, &mins[j], Laux,
                                         <float>-0.9, <float>0.05, 36, False)
        dm = make_qp_quants(16, 15, scales, Ls, sw)
        mm = make_qp_quants(16, 15, mins, Lm, sw)
        wr16(y + 80, f32_to_fp16(dm))
        wr16(y + 82, f32_to_fp16(mm))
        dm = ld_f16(y + 80)
        mm = ld_f16(y + 82)
        for j in range(16):
            y[j] = <uint8_t>(Ls[j] | (Lm[j] << 4))
        for j in range(16):
            d = dm * (y[j] & 0xF)
            if d == 0:
                continue
            m = mm * (y[j] >> 4)
            for ii in range(16):
                l = nearest_int((x[16 * j + ii] + m) / d)
                L[16 * j + ii] = imax(0, imin(3, l))
        for j in range(0, 256, 128):
            for l in range(32):
                y[16 + j // 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)
        x += 256
        qw += 256
        y += 84

cdef void qw_q3_K(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2_row) noexcept nogil:
    # hmask[32] @0, qs[64] @32, scales[12] @96, d @108
    cdef Py_ssize_t i
    cdef int j, l, ii, m
    cdef int8_t L[256]
    cdef int8_t Ls[16]
    cdef float scales[16]
    cdef float weight[16]
    cdef float sw[16]
    cdef float sigma2, sumw, d_block, d
    cdef int8_t sc
    cdef uint8_t hm
    cdef uint8_t* sb
    for i in range(nb):
        sb = y + 96
        sigma2 = <float>2 * block_sum_x2(x, 256) / <float>256
        for j in range(16):
            sigma_weights(x + 16 * j, qw + 16 * j, sigma2, weight, 16)
            sumw = 0
            for l in range(16):
                sumw += weight[l]
            sw[j] = sumw
            scales[j] = make_qx_quants(16, 4, x + 16 * j, L + 16 * j, 1, weight)
        memset(sb, 0, 12)
        d_block = make_qx_quants(16, 32, scales, Ls, 1, sw)
        for j in range(16):
            l = Ls[j]
            if j < 8:
                sb[j] = l & 0xF
            else:
                sb[j - 8] |= ((l & 0xF) << 4)
            l >>= 4
            sb[j % 4 + 8] |= (l << (2 * (j // 4)))
        wr16(y + 108, f32_to_fp16(d_block))
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
        qw += 256
        y += 110

cdef inline void kquant_w_4_5(const float* x, uint8_t* y, uint8_t* L, const float* qw, int nmax,
                              bint clamp63) noexcept nogil:
    # Q4_K / Q5_K weighted scales: d @0, dmin @2, scales[12] @4; fills L (levels 0..nmax).
    # Q5_K clamps the 6-bit scale/min levels to 63, Q4_K does not (as ggml)
    cdef int j, l, ii
    cdef uint8_t Laux[32]
    cdef uint8_t Ls[8]
    cdef uint8_t Lm[8]
    cdef float weights[32]
    cdef float sw[8]
    cdef float mins[8]
    cdef float scales[8]
    cdef float sigma2, sumw, d_block, m_block, d, dm
    cdef uint8_t ls, lm, sc, m
    cdef uint8_t* s = y + 4
    sigma2 = <float>2 * block_sum_x2(x, 256) / <float>256
    for j in range(8):
        sigma_weights(x + 32 * j, qw + 32 * j, sigma2, weights, 32)
        sumw = 0
        for l in range(32):
            sumw += weights[l]
        sw[j] = sumw
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     <float>-0.9, <float>0.05, 36, False)
    d_block = make_qp_quants(8, 63, scales, Ls, sw)
    m_block = make_qp_quants(8, 63, mins, Lm, sw)
    for j in range(8):
        ls = Ls[j]
        lm = Lm[j]
        if clamp63:
            ls = ls if ls < 63 else 63
            lm = lm if lm < 63 else 63
        if j < 4:
            s[j] = ls
            s[j + 4] = lm
        else:
            s[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            s[j - 4] |= ((ls >> 4) << 6)
            s[j] |= ((lm >> 4) << 6)
    wr16(y, f32_to_fp16(d_block))
    wr16(y + 2, f32_to_fp16(m_block))
    for j in range(8):
        get_scale_min_k4(j, s, &sc, &m)
        d = ld_f16(y) * sc
        if d == 0:
            continue
        dm = ld_f16(y + 2) * m
        for ii in range(32):
            l = nearest_int((x[32 * j + ii] + dm) / d)
            L[32 * j + ii] = imax(0, imin(nmax, l))

cdef void qw_q4_K(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2_row) noexcept nogil:
    cdef Py_ssize_t i
    cdef int j, l
    cdef uint8_t L[256]
    for i in range(nb):
        kquant_w_4_5(x, y, L, qw, 15, False)
        for j in range(0, 256, 64):
            for l in range(32):
                y[16 + j // 2 + l] = L[j + l] | (L[j + l + 32] << 4)
        x += 256
        qw += 256
        y += 144

cdef void qw_q5_K(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2_row) noexcept nogil:
    cdef Py_ssize_t i
    cdef int n, j, l1, l2
    cdef uint8_t L[256]
    cdef uint8_t m1, m2
    cdef uint8_t* qh
    cdef uint8_t* ql
    for i in range(nb):
        kquant_w_4_5(x, y, L, qw, 31, True)
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
        qw += 256
        y += 176

cdef void qw_q6_K(const float* x, uint8_t* y, Py_ssize_t nb, const float* qw, float sigma2_row) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        q6_K_block(x, y, qw)
        x += 256
        qw += 256
        y += 210
