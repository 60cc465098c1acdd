/* BF16 GEMM with float32 accumulation: C[M, N] = A[M, K] . B[K, N], A and B float32, float16
 * or bfloat16 (any strides), every operand rounded to bfloat16 (round to nearest even, float32
 * subnormals to signed zero, NaN kept and quieted) while it is packed, C float32.
 *
 * The product is AVX512_BF16's vdpbf16ps: per output element one float32 accumulator, and for
 * each pair of k (2p, 2p+1), as the instruction's specification writes it,
 *     acc = FMA(a[2p+1], b[2p+1], acc);  acc = FMA(a[2p], b[2p], acc)
 * each an FMA with subnormal inputs read as zero, a subnormal result flushed to (signed) zero,
 * round to nearest even. Odd K gets one zero pair element. Every path runs each output's chain in
 * that order from acc = 0 over k = 0..K-1 (the K blocking below reloads the accumulator from C,
 * which holds it exactly), so the portable C path is the bit-exact model of the SIMD one.
 *
 * Packing (bg_pack_rows, bg_pack; the SIMD path's *_avx512 twins write the same bits faster): A
 * row-major as 32-bit bf16 pairs [M rounded up to BG_MR][Kp] (the kernel broadcasts one pair of
 * each of its 6 rows per step); B into panels of BG_NR columns, [Kp][BG_NR] pairs
 * (a 64-byte vector = 16 columns x one k pair, the vdpbf16ps operand). The micro-kernel keeps a
 * BG_MR x BG_NR block of C in 24 zmm accumulators: per k pair, 4 loads of B and 6 broadcasts of
 * A feed 24 vdpbf16ps. Blocking: C tiles of BG_MC rows x BG_NC columns are the OpenMP tasks;
 * inside, K in blocks of BG_KC (a B micro-panel of BG_KC/2 x 64 x 4 bytes stays in L1 while the
 * A panels of the tile stream past it from L2).
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
#define BG_X86 1
#else
#define BG_X86 0
#endif

enum { BG_PATH_SCALAR = 0, BG_PATH_AVX512BF16 = 1 };
enum { BG_F32 = 0, BG_F16 = 1, BG_BF16 = 2 };
#define BG_MR 6
#define BG_NR 64
static int64_t BG_KC = 192;   /* k per block (even) */
static int64_t BG_MC = 96;    /* rows per task tile (a multiple of BG_MR) */
static int64_t BG_NC = 256;   /* columns per task tile (a multiple of BG_NR) */

static inline float bg_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bg_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* float32 bits -> bfloat16 bits, as vcvtne2ps2bf16 */
static inline uint16_t bg_round_bf16(uint32_t u) {
    if ((u & 0x7F800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);        /* 0, subnormal */
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN, quiet */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float16 bits -> float32 bits (exact) */
static inline uint32_t bg_f16_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 31) return sign | 0x7F800000u | (m << 13);
    if (e) return sign | ((e + 112) << 23) | (m << 13);
    if (!m) return sign;
    e = 113;
    while (!(m & 1024)) { m <<= 1; e--; }
    return sign | (e << 23) | ((m & 1023) << 13);
}

static inline uint16_t bg_load(const void* p, int type, int64_t i) {
    if (type == BG_F32) return bg_round_bf16(((const uint32_t*)p)[i]);
    if (type == BG_F16) return bg_round_bf16(bg_f16_bits(((const uint16_t*)p)[i]));
    return ((const uint16_t*)p)[i];
}

/* Pack rows [r0, r0 + w) (w <= width; missing ones zero) of X (element (r, k) at r*rs + k*ks)
 * into [Kp][width] pairs. */
static void bg_pack(const void* X, int type, int64_t rs, int64_t ks, int64_t r0, int64_t w,
                    int64_t K, int width, uint32_t* dst) {
    int64_t Kp = (K + 1) / 2, p;
    if (w < width) memset(dst, 0, (size_t)(Kp * width) * 4);
    if (ks == 1 && type == BG_F32) {  /* rows contiguous along k */
        for (int64_t r = 0; r < w; r++) {
            const uint32_t* x = (const uint32_t*)X + (r0 + r) * rs;
            for (p = 0; p < K / 2; p++)
                dst[p * width + r] = (uint32_t)bg_round_bf16(x[2 * p]) | ((uint32_t)bg_round_bf16(x[2 * p + 1]) << 16);
            if (K & 1) dst[p * width + r] = bg_round_bf16(x[K - 1]);
        }
        return;
    }
    if (ks == 1) {
        for (int64_t r = 0; r < w; r++) {
            int64_t base = (r0 + r) * rs;
            for (p = 0; p < K / 2; p++)
                dst[p * width + r] = (uint32_t)bg_load(X, type, base + 2 * p) | ((uint32_t)bg_load(X, type, base + 2 * p + 1) << 16);
            if (K & 1) dst[p * width + r] = bg_load(X, type, base + K - 1);
        }
        return;
    }
    for (p = 0; p < Kp; p++) {  /* rows contiguous along r (rs == 1) or general */
        int64_t k0 = 2 * p * ks, k1 = (2 * p + 1) * ks;
        uint32_t* d = dst + p * width;
        if (2 * p + 1 < K) {
            if (type == BG_F32 && rs == 1) {
                const uint32_t* x0 = (const uint32_t*)X + r0 + k0;
                const uint32_t* x1 = (const uint32_t*)X + r0 + k1;
                for (int64_t r = 0; r < w; r++)
                    d[r] = (uint32_t)bg_round_bf16(x0[r]) | ((uint32_t)bg_round_bf16(x1[r]) << 16);
            } else {
                for (int64_t r = 0; r < w; r++)
                    d[r] = (uint32_t)bg_load(X, type, (r0 + r) * rs + k0) | ((uint32_t)bg_load(X, type, (r0 + r) * rs + k1) << 16);
            }
        } else {
            for (int64_t r = 0; r < w; r++) d[r] = bg_load(X, type, (r0 + r) * rs + k0);
        }
    }
}

#if BG_X86
/* The same packing with AVX-512 conversions (vcvtph2ps, vcvtne2ps2bf16: bit-identical to
 * bg_round_bf16, which the tests check on subnormals, infinities and NaN) for float32/float16
 * sources; anything else goes to bg_pack. */
#define BG_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

BG_TARGET static inline __m512i bg_cvt32(const void* X, int type, int64_t i) {
    __m512 lo, hi;  /* 32 consecutive elements -> 16 bf16 pairs */
    if (type == BG_F32) { lo = _mm512_loadu_ps((const float*)X + i); hi = _mm512_loadu_ps((const float*)X + i + 16); }
    else {
        lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)X + i)));
        hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)X + i + 16)));
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

BG_TARGET static inline __m256i bg_cvt16(const void* X, int type, int64_t i) {
    __m512 v = type == BG_F32 ? _mm512_loadu_ps((const float*)X + i)
                              : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)X + i)));
    return (__m256i)_mm512_cvtneps_pbh(v);
}

BG_TARGET
static void bg_pack_avx512(const void* X, int type, int64_t rs, int64_t ks, int64_t r0, int64_t w,
                           int64_t K, int width, uint32_t* dst) {
    int64_t Kp = (K + 1) / 2;
    if (type == BG_BF16 || (ks != 1 && rs != 1)) { bg_pack(X, type, rs, ks, r0, w, K, width, dst); return; }
    if (w < width) memset(dst, 0, (size_t)(Kp * width) * 4);
    if (ks == 1) {
        int64_t kv = K / 32 * 32;
        for (int64_t r = 0; r < w; r++) {
            int64_t base = (r0 + r) * rs;
            uint32_t tmp[16];
            for (int64_t k = 0; k < kv; k += 32) {
                _mm512_storeu_si512(tmp, bg_cvt32(X, type, base + k));
                uint32_t* d = dst + (k / 2) * width + r;
                for (int i = 0; i < 16; i++) d[i * width] = tmp[i];
            }
            for (int64_t p = kv / 2; p < Kp; p++) {
                uint32_t lo = bg_load(X, type, base + 2 * p), hi = 2 * p + 1 < K ? bg_load(X, type, base + 2 * p + 1) : 0;
                dst[p * width + r] = lo | (hi << 16);
            }
        }
        return;
    }
    /* rs == 1: two k rows of contiguous elements -> interleaved pairs */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    int64_t rv = w / 16 * 16;
    for (int64_t p = 0; p < Kp; p++) {
        int64_t k0 = 2 * p * ks, k1 = (2 * p + 1) * ks;
        uint32_t* d = dst + p * width;
        int two = 2 * p + 1 < K;
        for (int64_t r = 0; r < rv; r += 16) {
            __m256i lo = bg_cvt16(X, type, r0 + r + k0);
            __m256i hi = two ? bg_cvt16(X, type, r0 + r + k1) : _mm256_setzero_si256();
            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_storeu_si512(d + r, _mm512_permutexvar_epi16(idx, both));
        }
        for (int64_t r = rv; r < w; r++)
            d[r] = (uint32_t)bg_load(X, type, r0 + r + k0) | (two ? (uint32_t)bg_load(X, type, r0 + r + k1) << 16 : 0u);
    }
}
#endif

/* Pack rows [r0, r0 + w) of X row-major: dst[r * Kp + p] = the pair (2p, 2p+1) of row r0 + r. */
static void bg_pack_rows(const void* X, int type, int64_t rs, int64_t ks, int64_t r0, int64_t w,
                         int64_t K, uint32_t* dst) {
    int64_t Kp = (K + 1) / 2;
    for (int64_t r = 0; r < w; r++) {
        int64_t base = (r0 + r) * rs;
        uint32_t* d = dst + r * Kp;
        for (int64_t p = 0; p < K / 2; p++)
            d[p] = (uint32_t)bg_load(X, type, base + 2 * p * ks) | ((uint32_t)bg_load(X, type, base + (2 * p + 1) * ks) << 16);
        if (K & 1) d[Kp - 1] = bg_load(X, type, base + (K - 1) * ks);
    }
}

#if BG_X86
BG_TARGET
static void bg_pack_rows_avx512(const void* X, int type, int64_t rs, int64_t ks, int64_t r0, int64_t w,
                                int64_t K, uint32_t* dst) {
    if (type == BG_BF16 || ks != 1) { bg_pack_rows(X, type, rs, ks, r0, w, K, dst); return; }
    int64_t Kp = (K + 1) / 2, kv = K / 32 * 32;
    for (int64_t r = 0; r < w; r++) {
        int64_t base = (r0 + r) * rs;
        uint32_t* d = dst + r * Kp;
        for (int64_t k = 0; k < kv; k += 32) _mm512_storeu_si512(d + k / 2, bg_cvt32(X, type, base + k));
        for (int64_t p = kv / 2; p < Kp; p++) {
            uint32_t lo = bg_load(X, type, base + 2 * p), hi = 2 * p + 1 < K ? bg_load(X, type, base + 2 * p + 1) : 0;
            d[p] = lo | (hi << 16);
        }
    }
}
#endif

/* ---- portable path: the bit-exact model of vdpbf16ps ---- */
static inline float bg_daz(float x) {
    uint32_t u = bg_f32_bits(x);
    return (u & 0x7F800000u) ? x : bg_bits_f32(u & 0x80000000u);
}

static inline float bg_fma(uint16_t a, uint16_t b, float acc) {
    float r = fmaf(bg_daz(bg_bits_f32((uint32_t)a << 16)), bg_daz(bg_bits_f32((uint32_t)b << 16)), bg_daz(acc));
    return bg_daz(r);  /* flush a subnormal result to signed zero */
}

/* C[r, c] (r < mr, c < nr) = (load ? C : 0) + panels a [kp][MR] . b [kp][NR] */
static void bg_kernel_scalar(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t kp, float* c, int64_t ldc,
                             int load, int mr, int nr) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) {
            float acc = load ? c[r * ldc + j] : 0.0f;
            for (int64_t p = 0; p < kp; p++) {
                uint32_t x = a[r * lda + p], y = b[p * BG_NR + j];
                acc = bg_fma((uint16_t)(x >> 16), (uint16_t)(y >> 16), acc);
                acc = bg_fma((uint16_t)x, (uint16_t)y, acc);
            }
            c[r * ldc + j] = acc;
        }
}

#if BG_X86
BG_TARGET
static void bg_kernel_avx512(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t kp, float* c, int64_t ldc,
                             int load, int mr, int nr) {
    float tmp[BG_MR * BG_NR];
    float* cc = c;
    int64_t ld = ldc;
    int full = mr == BG_MR && nr == BG_NR;
    if (!full) {  /* edge tile: through a local block */
        memset(tmp, 0, sizeof(tmp));
        if (load) for (int r = 0; r < mr; r++) memcpy(tmp + r * BG_NR, c + r * ldc, (size_t)nr * 4);
        cc = tmp; ld = BG_NR;
    }
    __m512 c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23,
           c30, c31, c32, c33, c40, c41, c42, c43, c50, c51, c52, c53;
    if (load) {
#define BG_LD(R) c##R##0 = _mm512_loadu_ps(cc + R * ld); c##R##1 = _mm512_loadu_ps(cc + R * ld + 16); \
                 c##R##2 = _mm512_loadu_ps(cc + R * ld + 32); c##R##3 = _mm512_loadu_ps(cc + R * ld + 48);
        BG_LD(0) BG_LD(1) BG_LD(2) BG_LD(3) BG_LD(4) BG_LD(5)
#undef BG_LD
    } else {
        c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = c20 = c21 = c22 = c23 = _mm512_setzero_ps();
        c30 = c31 = c32 = c33 = c40 = c41 = c42 = c43 = c50 = c51 = c52 = c53 = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < kp; p++) {
        const uint32_t* bp = b + p * BG_NR;
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 16);
        __m512bh b2 = (__m512bh)_mm512_loadu_si512(bp + 32), b3 = (__m512bh)_mm512_loadu_si512(bp + 48);
#define BG_ROW(R) { __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[R * lda + p]); \
        c##R##0 = _mm512_dpbf16_ps(c##R##0, x, b0); c##R##1 = _mm512_dpbf16_ps(c##R##1, x, b1); \
        c##R##2 = _mm512_dpbf16_ps(c##R##2, x, b2); c##R##3 = _mm512_dpbf16_ps(c##R##3, x, b3); }
        BG_ROW(0) BG_ROW(1) BG_ROW(2) BG_ROW(3) BG_ROW(4) BG_ROW(5)
#undef BG_ROW
    }
#define BG_ST(R) _mm512_storeu_ps(cc + R * ld, c##R##0); _mm512_storeu_ps(cc + R * ld + 16, c##R##1); \
                 _mm512_storeu_ps(cc + R * ld + 32, c##R##2); _mm512_storeu_ps(cc + R * ld + 48, c##R##3);
    BG_ST(0) BG_ST(1) BG_ST(2) BG_ST(3) BG_ST(4) BG_ST(5)
#undef BG_ST
    if (!full) for (int r = 0; r < mr; r++) memcpy(c + r * ldc, tmp + r * BG_NR, (size_t)nr * 4);
}
#endif

static int bg_path_available(int path) {
    if (path == BG_PATH_SCALAR) return 1;
#if BG_X86
    __builtin_cpu_init();
    if (path == BG_PATH_AVX512BF16)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#endif
    return 0;
}

typedef void (*bg_pack_fn)(const void*, int, int64_t, int64_t, int64_t, int64_t, int64_t, int, uint32_t*);
typedef void (*bg_rows_fn)(const void*, int, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t*);
typedef void (*bg_kernel_fn)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, int64_t, int, int, int);

/* C[M, N] (row stride ldc) = A . B; element (m, k) of A at A + m*ars + k*acs, (k, n) of B at
 * B + k*brs + n*bcs (in elements of their types). Returns 0, or -1 when out of memory. */
static int bg_gemm(int64_t M, int64_t N, int64_t K, const void* A, int atype, int64_t ars, int64_t acs,
                   const void* B, int btype, int64_t brs, int64_t bcs, float* C, int64_t ldc,
                   int path, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) { for (int64_t m = 0; m < M; m++) memset(C + m * ldc, 0, (size_t)N * 4); return 0; }
    int64_t Kp = (K + 1) / 2, MP = (M + BG_MR - 1) / BG_MR, NP = (N + BG_NR - 1) / BG_NR, i;
    bg_kernel_fn kern = bg_kernel_scalar;
    bg_pack_fn pack = bg_pack;
    bg_rows_fn pack_rows = bg_pack_rows;
#if BG_X86
    if (path == BG_PATH_AVX512BF16) { kern = bg_kernel_avx512; pack = bg_pack_avx512; pack_rows = bg_pack_rows_avx512; }
#endif
    uint32_t* ap = (uint32_t*)aligned_alloc(64, (size_t)(MP * BG_MR * Kp) * 4 + 64);
    uint32_t* bp = (uint32_t*)aligned_alloc(64, (size_t)(NP * BG_NR * Kp) * 4 + 64);
    if (!ap || !bp) { free(ap); free(bp); return -1; }
    if (nthreads < 1) nthreads = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static) nowait
        for (i = 0; i < MP; i++)
        {   /* A row-major in bf16 pairs, rows padded with zeros to a whole panel */
            int64_t w = M - i * BG_MR < BG_MR ? M - i * BG_MR : BG_MR;
            pack_rows(A, atype, ars, acs, i * BG_MR, w, K, ap + i * BG_MR * Kp);
            if (w < BG_MR) memset(ap + (i * BG_MR + w) * Kp, 0, (size_t)((BG_MR - w) * Kp) * 4);
        }
        #pragma omp for schedule(static)
        for (i = 0; i < NP; i++)  /* B's element (n, k) sits at n*bcs + k*brs */
            pack(B, btype, bcs, brs, i * BG_NR, N - i * BG_NR < BG_NR ? N - i * BG_NR : BG_NR, K, BG_NR, bp + i * BG_NR * Kp);
        int64_t mc = BG_MC, nc = BG_NC, kc = BG_KC / 2;
        int64_t tm = (M + mc - 1) / mc, tn = (N + nc - 1) / nc, t;
        #pragma omp for schedule(dynamic, 1)
        for (t = 0; t < tm * tn; t++) {
            int64_t m0 = (t / tn) * mc, n0 = (t % tn) * nc;
            int64_t m1 = m0 + mc < M ? m0 + mc : M, n1 = n0 + nc < N ? n0 + nc : N;
            for (int64_t p0 = 0; p0 < Kp; p0 += kc) {
                int64_t kq = Kp - p0 < kc ? Kp - p0 : kc;
                for (int64_t n = n0; n < n1; n += BG_NR) {
                    const uint32_t* bpan = bp + (n / BG_NR) * BG_NR * Kp + p0 * BG_NR;
                    int nr = (int)(n1 - n < BG_NR ? n1 - n : BG_NR);
                    for (int64_t m = m0; m < m1; m += BG_MR) {
                        const uint32_t* apan = ap + m * Kp + p0;
                        int mr = (int)(m1 - m < BG_MR ? m1 - m : BG_MR);
                        kern(apan, Kp, bpan, kq, C + m * ldc + n, ldc, p0 > 0, mr, nr);
                    }
                }
            }
        }
    }
    free(ap); free(bp);
    return 0;
}
