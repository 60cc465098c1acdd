# Included by _quants.pyx: the reference quantizers (ggml's quantize_row_*_ref) and the k-quant
# scale searches they use, written out again operation for operation in float32.

# ============================================================================ quantize helpers
# (the published k-quant scale searches of ggml-quants.c, written out again operation for
#  operation; make_qx_quants takes ggml's optional `qw` weights, make_qkx2_quants any weights and
#  also serves as ggml's make_qkx3_quants; make_qp_quants is in _quantize_weighted.pxi)

cdef float GROUP_MAX_EPS = <float>1e-15

cdef float make_qx_quants(int n, int nmax, const float* x, int8_t* L, int rmse_type,
                          const float* qw) noexcept nogil:
    # symmetric scale search for signed levels [-nmax, nmax-1]; rmse_type 0 (plain) or 1 (weighted
    # least squares: weights qw[i], or x[i]^2 when qw is NULL)
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
        w = qw[i] if qw != NULL else x[i] * x[i]
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
            w = qw[i] if qw != NULL else x[i] * x[i]
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

cdef inline void q6_K_block(const float* x, uint8_t* y, const float* qw) noexcept nogil:
    # one Q6_K block: ql[128] @0, qh[64] @128, scales[16] @192, d @208. qw: NULL for the
    # reference quantizer (x^2 weights), else the block's 256 importance weights (the _impl path
    # uses them as they are, with no sigma2 term)
    cdef int ib, j, l, ii
    cdef int8_t L[256]
    cdef float scales[16]
    cdef float max_scale = 0
    cdef float max_abs_scale = 0
    cdef float scale, iscale, d
    cdef int8_t* sc
    cdef uint8_t* ql
    cdef uint8_t* qh
    cdef uint8_t q1, q2, q3, q4
    for ib in range(16):
        scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib, 1, qw + 16 * ib if qw != NULL else NULL)
        scales[ib] = scale
        if fabsf(scale) > max_abs_scale:
            max_abs_scale = fabsf(scale)
            max_scale = scale
    if max_abs_scale < GROUP_MAX_EPS:
        memset(y, 0, 210)
        return
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

cdef void q_q6_K(const float* x, uint8_t* y, Py_ssize_t nb) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(nb):
        q6_K_block(x, y, NULL)
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
