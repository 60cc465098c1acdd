/* 3x3 stride-1 convolution by Winograd F(2x2, 3x3) with bf16 products, in one C call (included
 * after _bf16gemm.h, whose rounding, packing layouts and micro-kernels it reuses).
 *
 * conv_winograd.py's float32 path runs the input transform into a float32 V (16 planes), 16 GEMMs
 * into a float32 M and the output transform as separate passes over memory; at the VAE's 128-256
 * channels x 256-512 px those passes, not the products, were most of the time. Here:
 *   filters  U = G g G^T per (oc, c), rounded to bf16 straight into the GEMM's A layout
 *            ([16][OCp][Kp] pairs, OCp = OC rounded up to BG_MR, rows past OC zero);
 *   input    per chunk of tile rows, V = B^T d B per (c, tile) rounded to bf16 straight into the
 *            B panel layout ([16][panel][Kp][BG_NR] pairs): no float32 V, no per-GEMM packing;
 *            `up` = 1 reads the input through a nearest 2x upsample (x[iy >> 1][ix >> 1]), so
 *            conv3x3(upscale2x(x)) needs no upscaled copy;
 *   products per task (a group of BG_MR-row blocks x one panel of BG_NR tiles) the 16 micro-tile
 *            products go to a local [16][BG_MR][BG_NR] block and the output transform
 *            A^T m A + bias writes the output pixels from there: no float32 M.
 * Arithmetic per value is the float path's (the same transform formulas in float32, each operand
 * rounded once to bf16, vdpbf16ps's chain over channel pairs), and the portable path runs the
 * same steps in plain C: the two are bit-identical (the tests hold them to each other). */

/* one row/column of G g G^T */
#define BW_G4(a, b, e, o0, o1, o2, o3) { o0 = (a); o1 = 0.5f * ((a) + (b) + (e)); o2 = 0.5f * ((a) - (b) + (e)); o3 = (e); }

static inline float bw_weight(const void* w, int type, int64_t i) {
    if (type == BG_F32) return ((const float*)w)[i];
    if (type == BG_F16) return bg_bits_f32(bg_f16_bits(((const uint16_t*)w)[i]));
    return bg_bits_f32((uint32_t)((const uint16_t*)w)[i] << 16);
}

/* The 16 filter-transform values of the 3x3 filter at w + base. */
static inline void bw_filter16(const void* w, int type, int64_t base, float u[16]) {
    float g[9], q[4][3];
    for (int i = 0; i < 9; i++) g[i] = bw_weight(w, type, base + i);
    for (int j = 0; j < 3; j++)  /* G g, column j */
        BW_G4(g[j], g[3 + j], g[6 + j], q[0][j], q[1][j], q[2][j], q[3][j]);
    for (int i = 0; i < 4; i++)  /* (G g) G^T, row i */
        BW_G4(q[i][0], q[i][1], q[i][2], u[4 * i], u[4 * i + 1], u[4 * i + 2], u[4 * i + 3]);
}

/* w (OC, C, 3, 3) -> Up [16][OCp][Kp] bf16 pairs (channel 2p low half, 2p + 1 high half). */
static void bw_pack_filters(const void* w, int type, int64_t OC, int64_t C, int64_t OCp, uint32_t* Up, int nthreads) {
    int64_t Kp = (C + 1) / 2, o;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (o = 0; o < OCp; o++) {
        float lo[16], hi[16];
        for (int64_t p = 0; p < Kp; p++) {
            int64_t c = 2 * p;
            if (o < OC) bw_filter16(w, type, (o * C + c) * 9, lo); else memset(lo, 0, sizeof(lo));
            if (o < OC && c + 1 < C) bw_filter16(w, type, (o * C + c + 1) * 9, hi); else memset(hi, 0, sizeof(hi));
            for (int k = 0; k < 16; k++)
                Up[(k * OCp + o) * Kp + p] = (uint32_t)bg_round_bf16(bg_f32_bits(lo[k])) |
                                             ((uint32_t)bg_round_bf16(bg_f32_bits(hi[k])) << 16);
        }
    }
}

/* Padded input row i of tile row ty for channel plane xc (H x W, read through the upsample):
 * E[j] = padded column 2j, O[j] = 2j + 1 (j < L), zero outside the input. */
static inline void bw_rows(const float* xc, int64_t H, int64_t W, int up, int64_t iy, int64_t pw,
                           int64_t L, float* E, float* O) {
    int64_t HL = H << up, WL = W << up;
    if (iy < 0 || iy >= HL) { memset(E, 0, (size_t)L * 4); memset(O, 0, (size_t)L * 4); return; }
    const float* row = xc + (iy >> up) * W;
    for (int64_t j = 0; j < L; j++) {
        int64_t ix = 2 * j - pw;
        E[j] = (ix >= 0 && ix < WL) ? row[ix >> up] : 0.0f;
        O[j] = (ix + 1 >= 0 && ix + 1 < WL) ? row[(ix + 1) >> up] : 0.0f;
    }
}

/* B^T d B of the tile at column tx: R[i] = (E, O) of padded row i. */
static inline void bw_tile16(float* const E[4], float* const O[4], int64_t tx, float v[16]) {
    float c[4][4];  /* c[col][entry]: B^T d for the 4 columns E[tx], O[tx], E[tx+1], O[tx+1] */
    for (int s = 0; s < 4; s++) {
        float* const* R = (s & 1) ? O : E;
        int64_t t = tx + (s >> 1);
        float d0 = R[0][t], d1 = R[1][t], d2 = R[2][t], d3 = R[3][t];
        c[s][0] = d0 - d2; c[s][1] = d1 + d2; c[s][2] = d2 - d1; c[s][3] = d1 - d3;
    }
    for (int e = 0; e < 4; e++) {  /* along the row: (c0 - c2, c1 + c2, c2 - c1, c1 - c3) */
        v[4 * e] = c[0][e] - c[2][e];
        v[4 * e + 1] = c[1][e] + c[2][e];
        v[4 * e + 2] = c[2][e] - c[1][e];
        v[4 * e + 3] = c[1][e] - c[3][e];
    }
}

typedef struct {
    const float* x; int64_t N, C, H, W; int up;
    int64_t th, tw, ph, pw, Kp, NPn;
} bw_geom;

/* The 4 input rows of tile row ty of batch item n for channels 2p and 2p + 1 into `buf`, split
 * into even (E) and odd (O) columns of L floats each; channels past C are zero. */
static void bw_stage_rows(const bw_geom* g, int64_t p, int64_t n, int64_t ty, int64_t L, float* buf,
                          float* E[2][4], float* O[2][4]) {
    for (int h = 0; h < 2; h++) {
        int64_t c = 2 * p + h;
        for (int i = 0; i < 4; i++) {
            E[h][i] = buf + (h * 8 + 2 * i) * L; O[h][i] = E[h][i] + L;
            if (c < g->C)
                bw_rows(g->x + (n * g->C + c) * g->H * g->W, g->H, g->W, g->up, 2 * ty - g->ph + i, g->pw, L, E[h][i], O[h][i]);
            else { memset(E[h][i], 0, (size_t)L * 4); memset(O[h][i], 0, (size_t)L * 4); }
        }
    }
}

/* Tile rows [r0, r1) of the batch (r = n*th + ty) -> Vp [16][NPn][Kp][BG_NR] (chunk tile q =
 * (r - r0)*tw + tx), channel pairs p in [p0, p1). `buf` holds 2 x 8 rows of L = tw + 1 floats. */
static void bw_input_scalar(const bw_geom* g, int64_t r0, int64_t r1, int64_t p0, int64_t p1, uint32_t* Vp, float* buf) {
    int64_t L = g->tw + 1, nq = (r1 - r0) * g->tw;
    for (int64_t p = p0; p < p1; p++) {
        for (int64_t r = r0; r < r1; r++) {
            int64_t n = r / g->th, ty = r - n * g->th;
            float *E[2][4], *O[2][4];
            bw_stage_rows(g, p, n, ty, L, buf, E, O);
            int64_t q0 = (r - r0) * g->tw;
            for (int64_t tx = 0; tx < g->tw; tx++) {
                float lo[16], hi[16];
                bw_tile16(E[0], O[0], tx, lo);
                bw_tile16(E[1], O[1], tx, hi);
                int64_t q = q0 + tx, j = q / BG_NR, t = q % BG_NR;
                for (int k = 0; k < 16; k++)
                    Vp[((k * g->NPn + j) * g->Kp + p) * BG_NR + t] =
                        (uint32_t)bg_round_bf16(bg_f32_bits(lo[k])) | ((uint32_t)bg_round_bf16(bg_f32_bits(hi[k])) << 16);
            }
        }
        /* tiles past the chunk's last one, up to its last panel's end: zero */
        for (int64_t q = nq; q < g->NPn * BG_NR; q++)
            for (int k = 0; k < 16; k++)
                Vp[((k * g->NPn + q / BG_NR) * g->Kp + p) * BG_NR + q % BG_NR] = 0;
    }
}

#if BG_X86
/* The same values 16 tiles at a time (the float operations per value are the scalar path's, the
 * rounding vcvtneps2bf16, bit-identical to bg_round_bf16). */
BG_TARGET static inline __m512i bw_pair16(__m512 lo, __m512 hi) {
    __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
    __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
    return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

BG_TARGET static inline void bw_tile16x16(float* const E[4], float* const O[4], int64_t tx, __m512 v[16]) {
    __m512 c[4][4];
    for (int s = 0; s < 4; s++) {
        float* const* R = (s & 1) ? O : E;
        int64_t t = tx + (s >> 1);
        __m512 d0 = _mm512_loadu_ps(R[0] + t), d1 = _mm512_loadu_ps(R[1] + t);
        __m512 d2 = _mm512_loadu_ps(R[2] + t), d3 = _mm512_loadu_ps(R[3] + t);
        c[s][0] = _mm512_sub_ps(d0, d2); c[s][1] = _mm512_add_ps(d1, d2);
        c[s][2] = _mm512_sub_ps(d2, d1); c[s][3] = _mm512_sub_ps(d1, d3);
    }
    for (int e = 0; e < 4; e++) {
        v[4 * e] = _mm512_sub_ps(c[0][e], c[2][e]);
        v[4 * e + 1] = _mm512_add_ps(c[1][e], c[2][e]);
        v[4 * e + 2] = _mm512_sub_ps(c[2][e], c[1][e]);
        v[4 * e + 3] = _mm512_sub_ps(c[1][e], c[3][e]);
    }
}

BG_TARGET
static void bw_input_avx512(const bw_geom* g, int64_t r0, int64_t r1, int64_t p0, int64_t p1, uint32_t* Vp, float* buf) {
    int64_t L = g->tw + 1, nq = (r1 - r0) * g->tw;
    for (int64_t p = p0; p < p1; p++) {
        for (int64_t r = r0; r < r1; r++) {
            int64_t n = r / g->th, ty = r - n * g->th;
            float *E[2][4], *O[2][4];
            bw_stage_rows(g, p, n, ty, L, buf, E, O);
            int64_t q0 = (r - r0) * g->tw, tx = 0;
            while (tx < g->tw) {  /* runs of tiles inside one panel */
                int64_t q = q0 + tx, j = q / BG_NR, t = q % BG_NR;
                int64_t run = g->tw - tx < BG_NR - t ? g->tw - tx : BG_NR - t, e = 0;
                uint32_t* base = Vp + (j * g->Kp + p) * BG_NR + t;
                int64_t kstride = g->NPn * g->Kp * BG_NR;
                for (; e + 16 <= run; e += 16) {
                    __m512 lo[16], hi[16];
                    bw_tile16x16(E[0], O[0], tx + e, lo);
                    bw_tile16x16(E[1], O[1], tx + e, hi);
                    for (int k = 0; k < 16; k++) _mm512_storeu_si512(base + k * kstride + e, bw_pair16(lo[k], hi[k]));
                }
                for (; e < run; e++) {
                    float lo[16], hi[16];
                    bw_tile16(E[0], O[0], tx + e, lo);
                    bw_tile16(E[1], O[1], tx + e, hi);
                    for (int k = 0; k < 16; k++)
                        base[k * kstride + e] = (uint32_t)bg_round_bf16(bg_f32_bits(lo[k])) |
                                                ((uint32_t)bg_round_bf16(bg_f32_bits(hi[k])) << 16);
                }
                tx += run;
            }
        }
        for (int64_t q = nq; q < g->NPn * BG_NR; q++)
            for (int k = 0; k < 16; k++)
                Vp[((k * g->NPn + q / BG_NR) * g->Kp + p) * BG_NR + q % BG_NR] = 0;
    }
}
#endif

/* Output transform of one block: m [16][BG_MR][BG_NR] for output channels oc0 + r (r < mr) and
 * chunk tiles q0 + t (t < nt) -> out (N, OC, OH, OW) + bias. */
static void bw_output(const float* m, int mr, int nt, int64_t oc0, int64_t q0, int64_t r0, const bw_geom* g,
                      const float* bias, float* out, int64_t OC, int64_t OH, int64_t OW) {
    const int64_t S = BG_MR * BG_NR;
    for (int r = 0; r < mr; r++) {
        int64_t oc = oc0 + r;
        float bv = bias ? bias[oc] : 0.0f;
        for (int t = 0; t < nt; t++) {
            const float* p = m + r * BG_NR + t;
            int64_t q = q0 + t, rr = r0 + q / g->tw, tx = q % g->tw;
            int64_t n = rr / g->th, y = 2 * (rr - n * g->th), x = 2 * tx;
            float s00 = p[0] + p[4 * S] + p[8 * S], s01 = p[S] + p[5 * S] + p[9 * S];
            float s02 = p[2 * S] + p[6 * S] + p[10 * S], s03 = p[3 * S] + p[7 * S] + p[11 * S];
            float s10 = p[4 * S] - p[8 * S] - p[12 * S], s11 = p[5 * S] - p[9 * S] - p[13 * S];
            float s12 = p[6 * S] - p[10 * S] - p[14 * S], s13 = p[7 * S] - p[11 * S] - p[15 * S];
            float* o = out + ((n * OC + oc) * OH + y) * OW + x;
            o[0] = s00 + s01 + s02 + bv;
            if (x + 1 < OW) o[1] = s01 - s02 - s03 + bv;
            if (y + 1 < OH) {
                o[OW] = s10 + s11 + s12 + bv;
                if (x + 1 < OW) o[OW + 1] = s11 - s12 - s13 + bv;
            }
        }
    }
}

/* out (N, OC, OH, OW) = conv3x3(x (N, C, H, W), read through a nearest 2^up upsample) with weight w
 * (OC, C, 3, 3) of type wtype (F32/F16/BF16), bias (or NULL), zero padding (ph, pw), stride 1.
 * chunk_bytes caps the packed V of one chunk of tile rows. Returns 0, or -1 when out of memory. */
static int bw_conv(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int up,
                   const void* w, int wtype, const float* bias, float* out, int64_t OC, int64_t OH, int64_t OW,
                   int64_t ph, int64_t pw, int64_t chunk_bytes, int64_t mc, int path, int nthreads) {
    bw_geom g = {x, N, C, H, W, up, (OH + 1) / 2, (OW + 1) / 2, ph, pw, (C + 1) / 2, 0};
    int64_t Kp = g.Kp, OCp = (OC + BG_MR - 1) / BG_MR * BG_MR, L = g.tw + 1;
    int64_t per_row = 16 * Kp * g.tw * 4;                         /* packed V bytes per tile row */
    int64_t rc = chunk_bytes / per_row, rows = N * g.th;
    if (rc < 1) rc = 1;
    if (rc > rows) rc = rows;
    rc = (rows + ((rows + rc - 1) / rc) - 1) / ((rows + rc - 1) / rc);  /* near-equal chunks */
    int64_t npmax = (rc * g.tw + BG_NR - 1) / BG_NR;
    if (mc < BG_MR) mc = BG_MR;
    mc = mc / BG_MR * BG_MR;
    if (nthreads < 1) nthreads = 1;
    bg_kernel_fn kern = bg_kernel_scalar;
    void (*input)(const bw_geom*, int64_t, int64_t, int64_t, int64_t, uint32_t*, float*) = bw_input_scalar;
#if BG_X86
    if (path == BG_PATH_AVX512BF16) { kern = bg_kernel_avx512; input = bw_input_avx512; }
#endif
    uint32_t* Up = (uint32_t*)aligned_alloc(64, (size_t)(16 * OCp * Kp) * 4 + 64);
    uint32_t* Vp = (uint32_t*)aligned_alloc(64, (size_t)(16 * npmax * Kp * BG_NR) * 4 + 64);
    float* rowbuf = (float*)malloc((size_t)(nthreads * 16 * L) * 4 + 64);
    float* mbuf = (float*)aligned_alloc(64, (size_t)(nthreads * 16 * BG_MR * BG_NR) * 4 + 64);
    if (!Up || !Vp || !rowbuf || !mbuf) { free(Up); free(Vp); free(rowbuf); free(mbuf); return -1; }
    bw_pack_filters(w, wtype, OC, C, OCp, Up, nthreads);
    for (int64_t r0 = 0; r0 < rows; r0 += rc) {
        int64_t r1 = r0 + rc < rows ? r0 + rc : rows, nq = (r1 - r0) * g.tw;
        g.NPn = (nq + BG_NR - 1) / BG_NR;
        int64_t ng = (OCp + mc - 1) / mc, ntask = ng * g.NPn, t, p;
        #pragma omp parallel num_threads(nthreads)
        {
#ifdef _OPENMP
            int me = omp_get_thread_num();
#else
            int me = 0;
#endif
            #pragma omp for schedule(static)
            for (p = 0; p < Kp; p++) input(&g, r0, r1, p, p + 1, Vp, rowbuf + me * 16 * L);
            float* m = mbuf + me * 16 * BG_MR * BG_NR;
            #pragma omp for schedule(dynamic, 1)
            for (t = 0; t < ntask; t++) {  /* row group outer: its U block stays in cache across panels */
                int64_t gi = t / g.NPn, j = t % g.NPn;
                int64_t o1 = (gi + 1) * mc < OCp ? (gi + 1) * mc : OCp;
                int nt = (int)(nq - j * BG_NR < BG_NR ? nq - j * BG_NR : BG_NR);
                for (int64_t o = gi * mc; o < o1; o += BG_MR) {
                    for (int k = 0; k < 16; k++)
                        kern(Up + (k * OCp + o) * Kp, Kp, Vp + (k * g.NPn + j) * Kp * BG_NR, Kp,
                             m + k * BG_MR * BG_NR, BG_NR, 0, BG_MR, BG_NR);
                    int mr = (int)(OC - o < BG_MR ? OC - o : BG_MR);
                    if (mr > 0) bw_output(m, mr, nt, o, j * BG_NR, r0, &g, bias, out, OC, OH, OW);
                }
            }
        }
    }
    free(Up); free(Vp); free(rowbuf); free(mbuf);
    return 0;
}
