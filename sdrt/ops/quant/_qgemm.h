/* Quantized GEMM with integer dot products: out[M, N] = x[M, K] . w[N, K]^T for block-quantized
 * weights, the way ggml's CPU backend multiplies them: the activations are quantized to 8-bit
 * blocks of 32 (one scale each, round-to-nearest-even; for the Q8_0 / Q8_1 partners exactly
 * ggml's quantize_row_q8_0 / q8_1 with the scale rounded to f16: qg_quantize_row) and each
 * 32-element block product is an exact int32 sum, scaled in float32 after.
 *
 * Every weight type here is, per 32-element block, w = a * q + b with integer q in [-128, 127]:
 * Q8_0, Q4_0, Q5_0 (b = 0), Q4_1, Q5_1 (b = m) and the sub-blocks of Q4_K, Q5_K (a = d * sc,
 * b = -dmin * m). With x ~ dx * qx per block, a block contributes
 *     dx * (a * sum(qx * q)) + b * (dx * sum(qx)),
 * evaluated as acc = fma((float)I, a * dx, acc); acc = fma(b, dx * sum(qx), acc), block by block
 * in K order. Every code path below does exactly these float operations in this order and its
 * integer sum is exact, so all paths give bit-identical results (the portable C path is the
 * bit-exact model of the SIMD ones on any host).
 *
 * Weights are repacked per thread, 32 output columns (weight rows) at a time, into
 * [K/32][8 quads][32 columns][4 bytes] int8 so a 64-byte vector holds 4 consecutive k of 16
 * columns: VNNI's vpdpbusd then multiplies it by 4 activation bytes broadcast to every lane.
 * vpdpbusd wants unsigned x signed bytes: activations are stored as qx + 128 (u8) and the
 * int32 accumulator starts at -128 * sum(q) of the weight block (precomputed in the repack).
 * The AVX2 path (no VNNI) uses ggml's sign trick, |q| (u8) x sign(qx, q) (s8) through vpmaddubsw,
 * whose int16 pair sums cannot saturate because |qx| <= 127.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QG_X86 1
#else
#define QG_X86 0
#endif

enum { QG_PATH_SCALAR = 0, QG_PATH_AVX2 = 1, QG_PATH_AVX512VNNI = 2 };
#define QG_NT 32  /* output columns per packed weight tile */

static float qg_f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 31) bits = sign | 0x7F800000u | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else {  /* subnormal half: normalise */
        e = 113;
        while (!(m & 1024)) { m <<= 1; e--; }
        bits = sign | (e << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ggml type ids */
enum { QG_Q4_0 = 2, QG_Q4_1 = 3, QG_Q5_0 = 6, QG_Q5_1 = 7, QG_Q8_0 = 8, QG_Q4_K = 12, QG_Q5_K = 13 };

static int qg_supported(int type) {
    return type == QG_Q4_0 || type == QG_Q4_1 || type == QG_Q5_0 || type == QG_Q5_1 ||
           type == QG_Q8_0 || type == QG_Q4_K || type == QG_Q5_K;
}

static int qg_has_offset(int type) {
    return type == QG_Q4_1 || type == QG_Q5_1 || type == QG_Q4_K || type == QG_Q5_K;
}

static void qg_scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Block kb (32 elements) of one raw weight row -> q[32], scale a, offset b; the same values
 * (a * q + b, in float32, a*q rounded first) that ggml's dequantize_row_* computes. */
static void qg_decode(int type, const uint8_t* row, int64_t kb, int8_t* q, float* a, float* b) {
    int j;
    *a = 0.0f; *b = 0.0f;
    switch (type) {
    case QG_Q8_0: {
        const uint8_t* x = row + kb * 34;
        *a = qg_f16(x); *b = 0.0f;
        memcpy(q, x + 2, 32);
        break; }
    case QG_Q4_0: {
        const uint8_t* x = row + kb * 18;
        *a = qg_f16(x); *b = 0.0f;
        for (j = 0; j < 16; j++) { q[j] = (int8_t)((x[2 + j] & 15) - 8); q[j + 16] = (int8_t)((x[2 + j] >> 4) - 8); }
        break; }
    case QG_Q4_1: {
        const uint8_t* x = row + kb * 20;
        *a = qg_f16(x); *b = qg_f16(x + 2);
        for (j = 0; j < 16; j++) { q[j] = (int8_t)(x[4 + j] & 15); q[j + 16] = (int8_t)(x[4 + j] >> 4); }
        break; }
    case QG_Q5_0: case QG_Q5_1: {
        int off = type == QG_Q5_0 ? 22 : 24, hq = type == QG_Q5_0 ? 2 : 4, bias = type == QG_Q5_0 ? 16 : 0;
        const uint8_t* x = row + kb * off;
        uint32_t qh;
        memcpy(&qh, x + hq, 4);
        *a = qg_f16(x); *b = type == QG_Q5_0 ? 0.0f : qg_f16(x + 2);
        for (j = 0; j < 16; j++) {
            q[j] = (int8_t)(((x[hq + 4 + j] & 15) | (((qh >> j) & 1) << 4)) - bias);
            q[j + 16] = (int8_t)(((x[hq + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
        }
        break; }
    case QG_Q4_K: case QG_Q5_K: {
        int five = type == QG_Q5_K, sub = (int)(kb & 7), sc, mn;
        const uint8_t* x = row + (kb >> 3) * (five ? 176 : 144);
        const uint8_t* ql = x + (five ? 48 : 16) + (sub >> 1) * 32;
        qg_scale_min_k4(sub, x + 4, &sc, &mn);
        *a = qg_f16(x) * (float)sc;
        *b = -(qg_f16(x + 2) * (float)mn);
        for (j = 0; j < 32; j++) {
            int v = (sub & 1) ? (ql[j] >> 4) : (ql[j] & 15);
            if (five) v += ((x[16 + j] >> sub) & 1) << 4;
            q[j] = (int8_t)v;
        }
        break; }
    }
}

typedef struct {
    int8_t* q;   /* [KB][8][QG_NT][4] */
    float* a;    /* [KB][QG_NT] */
    float* b;    /* [KB][QG_NT] */
    int32_t* c;  /* [KB][QG_NT]: -128 * sum(q) of the block */
} qg_tile;

/* Repack weight rows [n0, n0 + nc) (nc <= QG_NT; missing columns are zeros). */
static void qg_pack(int type, const uint8_t* w, int64_t wstride, int64_t n0, int nc, int64_t KB, qg_tile* t) {
    int32_t qw[8];  /* one block's 32 int8 values as 8 words of 4 consecutive k */
    int8_t* q = (int8_t*)qw;
    int32_t* tq = (int32_t*)t->q;
    if (nc < QG_NT) {
        memset(t->q, 0, (size_t)KB * 8 * QG_NT * 4);
        memset(t->a, 0, (size_t)KB * QG_NT * 4);
        memset(t->b, 0, (size_t)KB * QG_NT * 4);
        memset(t->c, 0, (size_t)KB * QG_NT * 4);
    }
    for (int col = 0; col < nc; col++) {
        const uint8_t* row = w + (n0 + col) * wstride;
        for (int64_t kb = 0; kb < KB; kb++) {
            float a = 0.0f, b = 0.0f;
            qg_decode(type, row, kb, q, &a, &b);
            int32_t s = 0;
            for (int e = 0; e < 32; e++) s += q[e];
            for (int qd = 0; qd < 8; qd++) tq[(kb * 8 + qd) * QG_NT + col] = qw[qd];
            t->a[kb * QG_NT + col] = a;
            t->b[kb * QG_NT + col] = b;
            t->c[kb * QG_NT + col] = -128 * s;
        }
    }
}

/* float32 -> IEEE half, round to nearest even (subnormals, overflow to inf), back as float: the
 * value ggml's GGML_CPU_FP32_TO_FP16 (F16C vcvtps2ph, imm 0) stores. */
static float qg_round_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    uint16_t h;
    if (ax >= 0x7F800000u) h = (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
    else if (ax >= 0x477FF000u) h = (uint16_t)(sign | 0x7C00u);          /* rounds past 65504 */
    else if (ax >= 0x38800000u) {                                          /* normal half */
        uint32_t m = ax + 0xFFFu + ((ax >> 13) & 1u);                     /* RNE on the 13 dropped bits */
        h = (uint16_t)(sign | ((m - 0x38000000u) >> 13));
    } else {                                                               /* subnormal half or zero */
        float v;
        memcpy(&v, &ax, 4);
        v = v * 16777216.0f;                                               /* exact: times 2^24 */
        float r = v + 12582912.0f;                                         /* RNE to an integer (v < 2^10) */
        int32_t bits;
        memcpy(&bits, &r, 4);
        h = (uint16_t)(sign | (uint32_t)((bits & 0x007FFFFF) - 0x00400000));
    }
    uint8_t b[2];
    memcpy(b, &h, 2);
    return qg_f16(b);
}

/* Activation row -> u8 (q + 128), per-block scale d and d * sum(q). With f16_scale (the types
 * whose ggml vec_dot_type is Q8_0 / Q8_1: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1) exactly ggml's CPU
 * quantize_row_q8_0 / q8_1: q = round-half-even(x * (127 / amax)), d = amax / 127 stored as
 * f16, and Q8_1's s = f16(d * sum(q)) with the float d. The K-quants (ggml: Q8_K, one float scale
 * per 256) keep sdrt's float32 d = amax / 127 per 32 and q = rne(x / d). */
static void qg_quantize_row(const float* x, int64_t KB, uint8_t* u, float* d, float* s, int f16_scale) {
    for (int64_t kb = 0; kb < KB; kb++) {
        const float* xb = x + kb * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) { float v = fabsf(xb[j]); amax = v > amax ? v : amax; }
        float dd = amax / 127.0f, id;
        if (f16_scale) id = amax != 0.0f ? 127.0f / amax : 0.0f;
        else id = dd != 0.0f ? 1.0f / dd : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            /* round half to even without a libm call (ggml's nearest_int): |x * id| <= 127 */
            float p = xb[j] * id;
            float v = p + 12582912.0f;
            int32_t bits;
            memcpy(&bits, &v, 4);
            int qv = (bits & 0x007FFFFF) - 0x00400000;
            u[kb * 32 + j] = (uint8_t)(qv + 128);
            sum += qv;
        }
        if (f16_scale) {
            d[kb] = qg_round_f16(dd);
            s[kb] = qg_round_f16(dd * (float)sum);
        } else {
            d[kb] = dd;
            s[kb] = dd * (float)sum;
        }
    }
}

/* ---- portable path: the bit-exact model of the SIMD kernels ---- */
static void qg_rows_scalar(const qg_tile* t, int64_t KB, const uint8_t* u, const float* d, const float* s,
                           int64_t K, int mr, int has_b, float* out, int64_t ostride, int nc) {
    for (int r = 0; r < mr; r++) {
        const uint8_t* ur = u + r * K;
        for (int col = 0; col < nc; col++) {
            float acc = 0.0f;
            for (int64_t kb = 0; kb < KB; kb++) {
                int32_t I = 0;
                for (int e = 0; e < 32; e++)
                    I += ((int32_t)ur[kb * 32 + e] - 128) * t->q[((kb * 8 + (e >> 2)) * QG_NT + col) * 4 + (e & 3)];
                float sc = t->a[kb * QG_NT + col] * d[r * KB + kb];
                acc = fmaf((float)I, sc, acc);
                if (has_b) acc = fmaf(t->b[kb * QG_NT + col], s[r * KB + kb], acc);
            }
            out[r * ostride + col] = acc;
        }
    }
}

#if QG_X86
/* ---- AVX2 + FMA: 1 row x 32 columns, sign trick through vpmaddubsw ---- */
__attribute__((target("avx2,fma")))
static void qg_rows_avx2(const qg_tile* t, int64_t KB, const uint8_t* u, const float* d, const float* s,
                         int64_t K, int mr, int has_b, float* out, int64_t ostride, int nc) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi32((int)0x80808080u);
    for (int r = 0; r < mr; r++) {
        const uint8_t* ur = u + r * K;
        __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
        for (int64_t kb = 0; kb < KB; kb++) {
            const int8_t* wq = t->q + kb * 8 * QG_NT * 4;
            __m256i i0 = _mm256_setzero_si256(), i1 = i0, i2 = i0, i3 = i0;
            for (int qd = 0; qd < 8; qd++) {
                int32_t x4;
                memcpy(&x4, ur + kb * 32 + qd * 4, 4);
                __m256i xb = _mm256_xor_si256(_mm256_set1_epi32(x4), flip);  /* back to signed q */
#define QG_AVX2_STEP(I, G) { __m256i w = _mm256_loadu_si256((const __m256i*)(wq + qd * 128 + (G) * 32)); \
                __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xb, w)); \
                I = _mm256_add_epi32(I, _mm256_madd_epi16(p, ones)); }
                QG_AVX2_STEP(i0, 0) QG_AVX2_STEP(i1, 1) QG_AVX2_STEP(i2, 2) QG_AVX2_STEP(i3, 3)
#undef QG_AVX2_STEP
            }
            __m256 dx = _mm256_set1_ps(d[r * KB + kb]);
            const float* a = t->a + kb * QG_NT;
            f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(_mm256_loadu_ps(a), dx), f0);
            f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(_mm256_loadu_ps(a + 8), dx), f1);
            f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i2), _mm256_mul_ps(_mm256_loadu_ps(a + 16), dx), f2);
            f3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i3), _mm256_mul_ps(_mm256_loadu_ps(a + 24), dx), f3);
            if (has_b) {
                __m256 sx = _mm256_set1_ps(s[r * KB + kb]);
                const float* b = t->b + kb * QG_NT;
                f0 = _mm256_fmadd_ps(_mm256_loadu_ps(b), sx, f0);
                f1 = _mm256_fmadd_ps(_mm256_loadu_ps(b + 8), sx, f1);
                f2 = _mm256_fmadd_ps(_mm256_loadu_ps(b + 16), sx, f2);
                f3 = _mm256_fmadd_ps(_mm256_loadu_ps(b + 24), sx, f3);
            }
        }
        float tmp[QG_NT];
        _mm256_storeu_ps(tmp, f0); _mm256_storeu_ps(tmp + 8, f1);
        _mm256_storeu_ps(tmp + 16, f2); _mm256_storeu_ps(tmp + 24, f3);
        memcpy(out + r * ostride, tmp, (size_t)nc * 4);
    }
}

/* ---- AVX512-VNNI: MR rows x 32 columns, vpdpbusd with the activation bytes broadcast ---- */
#define QG_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))

static inline __attribute__((always_inline)) QG_VNNI_TARGET
void qg_vnni_mr(const qg_tile* t, int64_t KB, const uint8_t* u, const float* d, const float* s,
                int64_t K, const int MR, const int HB, float* out, int64_t ostride, int nc) {
    __m512 f[4][2];
    for (int r = 0; r < MR; r++) { f[r][0] = _mm512_setzero_ps(); f[r][1] = _mm512_setzero_ps(); }
    for (int64_t kb = 0; kb < KB; kb++) {
        const int8_t* wq = t->q + kb * 8 * QG_NT * 4;
        __m512i c0 = _mm512_loadu_si512(t->c + kb * QG_NT), c1 = _mm512_loadu_si512(t->c + kb * QG_NT + 16);
        __m512i acc[4][2];
        for (int r = 0; r < MR; r++) { acc[r][0] = c0; acc[r][1] = c1; }
        for (int qd = 0; qd < 8; qd++) {
            __m512i w0 = _mm512_loadu_si512(wq + qd * 128), w1 = _mm512_loadu_si512(wq + qd * 128 + 64);
            for (int r = 0; r < MR; r++) {
                int32_t x4;
                memcpy(&x4, u + r * K + kb * 32 + qd * 4, 4);
                __m512i xb = _mm512_set1_epi32(x4);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
            }
        }
        __m512 a0 = _mm512_loadu_ps(t->a + kb * QG_NT), a1 = _mm512_loadu_ps(t->a + kb * QG_NT + 16);
        for (int r = 0; r < MR; r++) {
            __m512 dx = _mm512_set1_ps(d[r * KB + kb]);
            f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(a0, dx), f[r][0]);
            f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(a1, dx), f[r][1]);
        }
        if (HB) {
            __m512 b0 = _mm512_loadu_ps(t->b + kb * QG_NT), b1 = _mm512_loadu_ps(t->b + kb * QG_NT + 16);
            for (int r = 0; r < MR; r++) {
                __m512 sx = _mm512_set1_ps(s[r * KB + kb]);
                f[r][0] = _mm512_fmadd_ps(b0, sx, f[r][0]);
                f[r][1] = _mm512_fmadd_ps(b1, sx, f[r][1]);
            }
        }
    }
    __mmask16 m0 = nc >= 16 ? 0xFFFF : (__mmask16)((1u << nc) - 1);
    __mmask16 m1 = nc <= 16 ? 0 : (nc >= 32 ? 0xFFFF : (__mmask16)((1u << (nc - 16)) - 1));
    for (int r = 0; r < MR; r++) {
        _mm512_mask_storeu_ps(out + r * ostride, m0, f[r][0]);
        _mm512_mask_storeu_ps(out + r * ostride + 16, m1, f[r][1]);
    }
}

QG_VNNI_TARGET
static void qg_rows_vnni(const qg_tile* t, int64_t KB, const uint8_t* u, const float* d, const float* s,
                         int64_t K, int mr, int has_b, float* out, int64_t ostride, int nc) {
#define QG_CASE(MR) case MR: { if (has_b) qg_vnni_mr(t, KB, u, d, s, K, MR, 1, out, ostride, nc); \
                               else qg_vnni_mr(t, KB, u, d, s, K, MR, 0, out, ostride, nc); } break;
    switch (mr) { QG_CASE(1) QG_CASE(2) QG_CASE(3) QG_CASE(4) }
#undef QG_CASE
}
#endif

static int qg_path_available(int path) {
    if (path == QG_PATH_SCALAR) return 1;
#if QG_X86
    __builtin_cpu_init();
    if (path == QG_PATH_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (path == QG_PATH_AVX512VNNI)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("fma");
#endif
    return 0;
}

typedef void (*qg_rows_fn)(const qg_tile*, int64_t, const uint8_t*, const float*, const float*,
                           int64_t, int, int, float*, int64_t, int);

/* out[m, n] for m < M, n < N. x: rows of K floats (row stride xs), w: raw rows (byte stride ws),
 * out: row stride os. K % 32 == 0 (K % 256 for the K-quants). Returns 0, or -1 when out of memory. */
static int qg_gemm(int type, const uint8_t* w, int64_t ws, int64_t N, const float* x, int64_t xs,
                   int64_t M, int64_t K, float* out, int64_t os, int path, int nthreads) {
    int64_t KB = K / 32;
    int has_b = qg_has_offset(type), f16_scale = type != QG_Q4_K && type != QG_Q5_K, mrmax = path == QG_PATH_AVX512VNNI ? 4 : 1, failed = 0;
    qg_rows_fn rows = qg_rows_scalar;
#if QG_X86
    if (path == QG_PATH_AVX2) rows = qg_rows_avx2;
    if (path == QG_PATH_AVX512VNNI) rows = qg_rows_vnni;
#endif
    uint8_t* u = (uint8_t*)malloc((size_t)(M * K) + 64);
    float* d = (float*)malloc((size_t)(M * KB) * 4 + 64);
    float* sm = (float*)malloc((size_t)(M * KB) * 4 + 64);
    if (!u || !d || !sm) { free(u); free(d); free(sm); return -1; }
    int64_t ntile = (N + QG_NT - 1) / QG_NT, m;
    if (nthreads < 1) nthreads = 1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (m = 0; m < M; m++) qg_quantize_row(x + m * xs, KB, u + m * K, d + m * KB, sm + m * KB, f16_scale);
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        qg_tile t;
        size_t qb = (size_t)KB * 8 * QG_NT * 4, fb = (size_t)KB * QG_NT * 4;
        char* buf = (char*)aligned_alloc(64, qb + 3 * fb);
        if (!buf) failed = 1;
        else {
            t.q = (int8_t*)buf; t.a = (float*)(buf + qb); t.b = (float*)(buf + qb + fb); t.c = (int32_t*)(buf + qb + 2 * fb);
        }
        int64_t it;
        #pragma omp for schedule(dynamic, 1)
        for (it = 0; it < ntile; it++) {
            if (!buf) continue;
            int64_t n0 = it * QG_NT;
            int nc = (int)(N - n0 < QG_NT ? N - n0 : QG_NT);
            qg_pack(type, w, ws, n0, nc, KB, &t);
            for (int64_t m0 = 0; m0 < M; m0 += mrmax) {
                int mr = (int)(M - m0 < mrmax ? M - m0 : mrmax);
                rows(&t, KB, u + m0 * K, d + m0 * KB, sm + m0 * KB, K, mr, has_b, out + m0 * os + n0, os, nc);
            }
        }
        free(buf);
    }
    free(u); free(d); free(sm);
    return failed ? -1 : 0;
}
