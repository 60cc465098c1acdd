// Convolution helpers (the GEMMs themselves run in cuBLAS) and pooling.
//
// - im2col: every conv (1-D, 2-D, 3-D) is a 3-D conv over (D, H, W) with unit dims where the op
//   has none. The column matrix of a chunk of batch items and output rows is
//   col[b][k][p]  with k = ((c*KD + kz)*KH + ky)*KW + kx  (the weight's row-major [OC][K] order)
//   and p = (r - r0)*OW + ox for output rows r = oz*OH + oy in [r0, r0 + rows);
//   the input is read through byte strides (any view; F32/F16/BF16) and written as F32 or F16
//   (the GEMM's dtype). Zero padding, or circular wrap on x/y (sd.cpp's circular_x/y).
//   With a 1x1 kernel, stride 1 and no padding it is a strided-to-contiguous pack.
// - col2im_add (conv_transpose2d): out[n][oc][oy][ox] += the column entries that land on the
//   pixel, gathered (one thread per output pixel: no atomics, deterministic).
// - bias_store / zero: conv outputs are F32 [N][OC][P]; the bias (OC elements, any view)
//   is added after the GEMM (the CPU kernel's order) or stored before col2im accumulates.
// - conv3x3_mma: the 3x3 / stride-1 / pad-1 conv of large maps as a direct implicit GEMM on
//   tensor cores (no column matrix); conv3x3_pack_w lays its weights out per call.
// - wino_*: the 3x3 / stride-1 / pad-1 conv by Winograd F(2x2, 3x3): transforms around 16
//   cuBLAS GEMMs.
// - pool2d: ggml_pool_2d (avg divides by the full kernel area, max starts at -FLT_MAX);
//   pool1d is pool2d with a 1-row kernel.
//
// Every kernel but im2col is a 1-D grid-stride loop over its outputs (int64 indices).
#include "common.cuh"
#include "conv3x3.cuh"
#include <float.h>

#define GRID_STRIDE_LOOP(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)blockDim.x * gridDim.x)

// input coordinate along one axis; -1 when it falls in the zero padding
__device__ __forceinline__ int64_t conv_src(int64_t o, int64_t k, int s, int p, int d, int64_t n, int circular) {
    int64_t j = o * s + k * d - p;
    if (circular) {
        j %= n;
        return j < 0 ? j + n : j;
    }
    return (j >= 0 && j < n) ? j : -1;
}

// ---- im2col ----------------------------------------------------------------------------------
// Grid: blockIdx.y walks the column rows t = b*Kall + k (batch item, kernel entry), blockIdx.x the
// output rows of the chunk, the threads an output row's columns; each loop strides by its grid
// dimension, so any size runs on any grid (conv.py sizes it to ~16K blocks). The index
// decomposition happens once per (t, row), not per entry: the former one-thread-per-entry loop
// spent ~200 integer operations on each entry's eight divisions (522 us for one SDXL
// 128x128x320 3x3 conv's columns, several times their memory time).
template <typename TI, typename TO>
__device__ void im2col_rows(TO* __restrict__ col, const char* __restrict__ x,
                            int64_t sn, int64_t sc, int64_t sz, int64_t sy, int64_t sx,
                            int C, int D, int H, int W, int KD, int KH, int KW,
                            int s_d, int s_h, int s_w, int p_d, int p_h, int p_w,
                            int d_d, int d_h, int d_w, int circ_y, int circ_x,
                            int OH, int OW, int64_t n0, int64_t nbatch, int64_t r0, int64_t rows) {
    const int64_t kall = (int64_t)C * KD * KH * KW;
    const int64_t npos = rows * OW;
    for (int64_t t = blockIdx.y; t < nbatch * kall; t += gridDim.y) {
        const int64_t b = t / kall;
        const int k = (int)(t - b * kall);
        const int kx = k % KW, ky = (k / KW) % KH, kz = (k / (KW * KH)) % KD, c = k / (KW * KH * KD);
        const char* xc = x + (n0 + b) * sn + (int64_t)c * sc;
        TO* ct = col + t * npos;
        for (int64_t rr = blockIdx.x; rr < rows; rr += gridDim.x) {
            const int64_t r = r0 + rr;
            const int64_t iz = conv_src(r / OH, kz, s_d, p_d, d_d, D, 0);
            const int64_t iy = conv_src(r % OH, ky, s_h, p_h, d_h, H, circ_y);
            TO* dst = ct + rr * OW;
            if (iz < 0 || iy < 0) {
                for (int ox = threadIdx.x; ox < OW; ox += blockDim.x) store_f(dst + ox, 0.0f);
                continue;
            }
            const char* xr = xc + iz * sz + iy * sy;
            for (int ox = threadIdx.x; ox < OW; ox += blockDim.x) {
                const int64_t ix = conv_src(ox, kx, s_w, p_w, d_w, W, circ_x);
                store_f(dst + ox, ix >= 0 ? load_f((const TI*)(xr + ix * sx)) : 0.0f);
            }
        }
    }
}

__device__ __forceinline__ void store8(__half* dst, const float* v) {
    uint4 q;
    __half2* h = reinterpret_cast<__half2*>(&q);
#pragma unroll
    for (int u = 0; u < 4; ++u) h[u] = __floats2half2_rn(v[2 * u], v[2 * u + 1]);
    *reinterpret_cast<uint4*>(dst) = q;
}
__device__ __forceinline__ void store8(float* dst, const float* v) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Stride-1, undilated, non-circular x with OW % 8 == 0 (most of SD's convs): a thread makes 8
// consecutive columns of one output row and stores them as one 16-byte vector (F16) or two (F32),
// with the index split once per 8 entries in 32-bit arithmetic. blockIdx.y walks the column rows
// t, blockIdx.x and the threads the chunk's rows*OW/8 column groups. The scalar kernel above
// moved one 2-byte entry per thread per row, ~4x below the memory speed on SDXL's convs.
template <typename TI, typename TO>
__device__ void im2col_vec8(TO* __restrict__ col, const char* __restrict__ x,
                            int64_t sn, int64_t sc, int64_t sz, int64_t sy, int64_t sx,
                            int C, int D, int H, int W, int KD, int KH, int KW,
                            int s_d, int s_h, int p_d, int p_h, int p_w, int d_d, int d_h, int circ_y,
                            int OH, int OW, int64_t n0, int64_t nbatch, int64_t r0, int64_t rows) {
    const int64_t kall = (int64_t)C * KD * KH * KW;
    const uint32_t groups_per_row = (uint32_t)OW / 8;
    const int64_t ngroups = rows * groups_per_row;
    for (int64_t t = blockIdx.y; t < nbatch * kall; t += gridDim.y) {
        const int64_t b = t / kall;
        const int k = (int)(t - b * kall);
        const int kx = k % KW, ky = (k / KW) % KH, kz = (k / (KW * KH)) % KD, c = k / (KW * KH * KD);
        const char* xc = x + (n0 + b) * sn + (int64_t)c * sc;
        TO* ct = col + t * rows * OW;
        for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups;
             g += (int64_t)gridDim.x * blockDim.x) {
            const uint32_t rr = (uint32_t)g / groups_per_row;
            const int ox0 = (int)((uint32_t)g - rr * groups_per_row) * 8;
            const uint32_t r = (uint32_t)(r0 + rr);
            const int64_t iz = conv_src(r / OH, kz, s_d, p_d, d_d, D, 0);
            const int64_t iy = conv_src(r % OH, ky, s_h, p_h, d_h, H, circ_y);
            float v[8];
            if (iz < 0 || iy < 0) {
#pragma unroll
                for (int u = 0; u < 8; ++u) v[u] = 0.0f;
            } else {
                const char* xr = xc + iz * sz + iy * sy;
                const int ix0 = ox0 + kx - p_w;
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int ix = ix0 + u;
                    v[u] = (ix >= 0 && ix < W) ? load_f((const TI*)(xr + (int64_t)ix * sx)) : 0.0f;
                }
            }
            store8(ct + (int64_t)rr * OW + ox0, v);
        }
    }
}

#define IM2COL_KERNEL(suffix, TI, TO)                                                             \
    extern "C" __global__ void im2col_##suffix(                                                   \
        TO* col, const char* x, int64_t sn, int64_t sc, int64_t sz, int64_t sy, int64_t sx,       \
        int C, int D, int H, int W, int KD, int KH, int KW, int s_d, int s_h, int s_w,            \
        int p_d, int p_h, int p_w, int d_d, int d_h, int d_w, int circ_y, int circ_x,             \
        int OH, int OW, int64_t n0, int64_t nbatch, int64_t r0, int64_t rows) {                   \
        im2col_rows<TI, TO>(col, x, sn, sc, sz, sy, sx, C, D, H, W, KD, KH, KW, s_d, s_h, s_w,    \
                            p_d, p_h, p_w, d_d, d_h, d_w, circ_y, circ_x, OH, OW, n0, nbatch,     \
                            r0, rows);                                                            \
    }
IM2COL_KERNEL(f32_f32, float, float)
IM2COL_KERNEL(f16_f32, __half, float)
IM2COL_KERNEL(bf16_f32, __nv_bfloat16, float)
IM2COL_KERNEL(f32_f16, float, __half)
IM2COL_KERNEL(f16_f16, __half, __half)
IM2COL_KERNEL(bf16_f16, __nv_bfloat16, __half)

#define IM2COL_VEC8_KERNEL(suffix, TI, TO)                                                        \
    extern "C" __global__ void im2col_vec8_##suffix(                                              \
        TO* col, const char* x, int64_t sn, int64_t sc, int64_t sz, int64_t sy, int64_t sx,       \
        int C, int D, int H, int W, int KD, int KH, int KW, int s_d, int s_h,                     \
        int p_d, int p_h, int p_w, int d_d, int d_h, int circ_y,                                  \
        int OH, int OW, int64_t n0, int64_t nbatch, int64_t r0, int64_t rows) {                   \
        im2col_vec8<TI, TO>(col, x, sn, sc, sz, sy, sx, C, D, H, W, KD, KH, KW, s_d, s_h,         \
                            p_d, p_h, p_w, d_d, d_h, circ_y, OH, OW, n0, nbatch, r0, rows);       \
    }
IM2COL_VEC8_KERNEL(f32_f32, float, float)
IM2COL_VEC8_KERNEL(f16_f32, __half, float)
IM2COL_VEC8_KERNEL(bf16_f32, __nv_bfloat16, float)
IM2COL_VEC8_KERNEL(f32_f16, float, __half)
IM2COL_VEC8_KERNEL(f16_f16, __half, __half)
IM2COL_VEC8_KERNEL(bf16_f16, __nv_bfloat16, __half)

// ---- conv_transpose2d: col2im gather ----------------------------------------------------------
// cols[b][(oc*KH + ky)*KW + kx][(iy - r0)*W + ix] for input rows iy in [r0, r0 + rows) of batch
// items n0 + b; adds into out rows oy in [oy0, oy1) (the rows this chunk reaches).
extern "C" __global__ void col2im_add_f32(
    float* out, const float* cols, int OC, int OH, int OW, int H, int W, int KH, int KW,
    int s_h, int s_w, int p_h, int p_w, int d_h, int d_w,
    int64_t n0, int64_t nbatch, int64_t r0, int64_t rows, int64_t oy0, int64_t oy1) {
    const int64_t nrows = oy1 - oy0;
    const int64_t npos = rows * W;
    const int64_t m = (int64_t)OC * KH * KW;
    const int64_t total = nbatch * OC * nrows * OW;
    GRID_STRIDE_LOOP(i, total) {
        const int64_t ox = i % OW;
        const int64_t oy = oy0 + (i / OW) % nrows;
        const int64_t oc = (i / (OW * nrows)) % OC;
        const int64_t b = i / (OW * nrows * OC);
        const float* cb = cols + b * m * npos;
        float acc = 0.0f;
        for (int ky = 0; ky < KH; ++ky) {
            const int64_t ty = oy + p_h - (int64_t)ky * d_h;
            if (ty < 0 || ty % s_h) continue;
            const int64_t iy = ty / s_h;
            if (iy < r0 || iy >= r0 + rows || iy >= H) continue;
            for (int kx = 0; kx < KW; ++kx) {
                const int64_t tx = ox + p_w - (int64_t)kx * d_w;
                if (tx < 0 || tx % s_w) continue;
                const int64_t ix = tx / s_w;
                if (ix >= W) continue;
                acc += cb[((oc * KH + ky) * KW + kx) * npos + (iy - r0) * W + ix];
            }
        }
        out[(((n0 + b) * OC + oc) * OH + oy) * OW + ox] += acc;
    }
}

// ---- 3x3 convolution as a direct implicit GEMM on tensor cores (sm_80+): conv3x3.cuh ------------
// packed[ob][ch][tap][k][n] = w[ob*bn + n][(ch*kc + k)*9 + tap], zero past OC and C
extern "C" __global__ void conv3x3_pack_w(__half* __restrict__ out, const __half* __restrict__ w, int C,
                                          int OC, int bn, int kc, int nch, int64_t total) {
    GRID_STRIDE_LOOP(i, total) {
        const int n = (int)(i % bn);
        int64_t r = i / bn;
        const int k = (int)(r % kc);
        r /= kc;
        const int t = (int)(r % 9);
        r /= 9;
        const int ch = (int)(r % nch), ob = (int)(r / nch);
        const int oc = ob * bn + n, c = ch * kc + k;
        out[i] = (oc < OC && c < C) ? w[((int64_t)oc * C + c) * 9 + t] : __float2half(0.0f);
    }
}

CONV3X3_MMA_KERNELS(conv3x3_mma32, 32, 4, 1, 8, 16)
CONV3X3_MMA_KERNELS(conv3x3_mma64, 64, 2, 2, 8, 16)

// ---- 3x3 convolution by Winograd F(2x2, 3x3) ----------------------------------------------------
// stride 1, padding 1, no dilation, one group. Per 2x2 block of output pixels (a tile t of N * TH
// * TW, tiles (n, ty, tx) in row-major order) and 16 transform points p:
//   U[p][oc][c] = (G g G^T)[p]      g = the 3x3 weight of (oc, c)           (wino_weights)
//   V[p][c][t]  = (B^T d B)[p] / 4  d = the 4x4 input patch at (2ty-1, 2tx-1) (wino_input)
//   M[p][oc][t] = sum_c U[p][oc][c] V[p][c][t]   16 GEMMs (cuBLAS, strided batched)
//   out[n][oc][2ty + i][2tx + j] = 4 (A^T m A)[i][j] + bias[oc]                 (wino_output)
// with G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1], B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1],
// A^T = [1 1 1 0; 0 1 -1 -1]: 2.25x fewer multiplications than the direct conv, the GEMMs at
// cuBLAS's rate. The input is narrowed to F16 before its transform (as im2col narrows it), the
// transforms run in F32, U and V are stored F16, M as the GEMM writes it (F32 or F16), the output
// F32 or F16. A call covers tiles t0 .. t0 + nt (chunks bound the scratch); V and M hold those.
extern "C" __global__ void wino_weights(__half* __restrict__ U, const __half* __restrict__ w, int C, int OC) {
    const int64_t total = (int64_t)OC * C;
    GRID_STRIDE_LOOP(i, total) {  // i = oc * C + c; w[oc][c][3][3]
        float g[3][3], gg[4][3];
#pragma unroll
        for (int k = 0; k < 9; ++k) g[k / 3][k % 3] = __half2float(w[i * 9 + k]);
#pragma unroll
        for (int j = 0; j < 3; ++j) {  // G g
            gg[0][j] = g[0][j];
            gg[1][j] = 0.5f * (g[0][j] + g[1][j] + g[2][j]);
            gg[2][j] = 0.5f * (g[0][j] - g[1][j] + g[2][j]);
            gg[3][j] = g[2][j];
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // (G g) G^T
            const float u[4] = {gg[r][0], 0.5f * (gg[r][0] + gg[r][1] + gg[r][2]),
                                0.5f * (gg[r][0] - gg[r][1] + gg[r][2]), gg[r][2]};
#pragma unroll
            for (int q = 0; q < 4; ++q) U[(int64_t)(r * 4 + q) * total + i] = __float2half_rn(u[q]);
        }
    }
}

template <typename TI>
__device__ void wino_input(__half* __restrict__ V, const char* __restrict__ x, int64_t sn, int64_t sc,
                           int64_t sy, int64_t sx, int C, int H, int W, int TH, int TW, int64_t t0,
                           int64_t nt) {
    const int64_t total = (int64_t)C * nt;
    GRID_STRIDE_LOOP(i, total) {  // i = c * nt + (t - t0): consecutive threads, consecutive tiles
        const int c = (int)(i / nt);
        const int64_t t = t0 + i % nt;
        const int tx = (int)(t % TW), ty = (int)(t / TW % TH), n = (int)(t / ((int64_t)TW * TH));
        const char* xc = x + n * sn + c * sc;
        float d[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int iy = 2 * ty - 1 + r;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int ix = 2 * tx - 1 + q;
                d[r][q] = (iy >= 0 && iy < H && ix >= 0 && ix < W)
                        ? __half2float(__float2half_rn(load_f<TI>(xc, iy * sy + ix * sx))) : 0.0f;
            }
        }
        float bd[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // B^T d
            bd[0][q] = d[0][q] - d[2][q];
            bd[1][q] = d[1][q] + d[2][q];
            bd[2][q] = d[2][q] - d[1][q];
            bd[3][q] = d[1][q] - d[3][q];
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // (B^T d) B
            const float v[4] = {bd[r][0] - bd[r][2], bd[r][1] + bd[r][2], bd[r][2] - bd[r][1], bd[r][1] - bd[r][3]};
            // stored / 4 (exact): a sum of up to four inputs then stays within the F16 range of
            // the input itself, as im2col's narrowing; wino_output multiplies the 4 back
#pragma unroll
            for (int q = 0; q < 4; ++q) V[(int64_t)(r * 4 + q) * total + i] = __float2half_rn(0.25f * v[q]);
        }
    }
}

template <typename TM, typename TO>
__device__ void wino_output(TO* __restrict__ out, const TM* __restrict__ M, const char* __restrict__ bias,
                            int bdt, int64_t bs, int OC, int H, int W, int TH, int TW, int64_t t0, int64_t nt) {
    const int64_t total = (int64_t)OC * nt;
    GRID_STRIDE_LOOP(i, total) {  // i = oc * nt + (t - t0)
        const int oc = (int)(i / nt);
        const int64_t t = t0 + i % nt;
        const int tx = (int)(t % TW), ty = (int)(t / TW % TH), n = (int)(t / ((int64_t)TW * TH));
        float m[4][4];
#pragma unroll
        for (int p = 0; p < 16; ++p) m[p / 4][p % 4] = 4.0f * to_f32(M[(int64_t)p * total + i]);  // V was / 4
        float am[2][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // A^T m
            am[0][q] = m[0][q] + m[1][q] + m[2][q];
            am[1][q] = m[1][q] - m[2][q] - m[3][q];
        }
        const float b = c3_bias(bias, bdt, (int64_t)oc * bs);
        TO* o = out + ((int64_t)n * OC + oc) * H * W;
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // (A^T m) A
            const int oy = 2 * ty + r;
            if (oy >= H) continue;
            const float y0 = am[r][0] + am[r][1] + am[r][2], y1 = am[r][1] - am[r][2] - am[r][3];
            const int ox = 2 * tx;
            store_f(o + (int64_t)oy * W + ox, y0 + b);
            if (ox + 1 < W) store_f(o + (int64_t)oy * W + ox + 1, y1 + b);
        }
    }
}

#define WINO_INPUT_KERNEL(suffix, TI)                                                                 \
    extern "C" __global__ void wino_input_##suffix(__half* V, const char* x, int64_t sn, int64_t sc,  \
                                                   int64_t sy, int64_t sx, int C, int H, int W,       \
                                                   int TH, int TW, int64_t t0, int64_t nt) {          \
        wino_input<TI>(V, x, sn, sc, sy, sx, C, H, W, TH, TW, t0, nt);                               \
    }
WINO_INPUT_KERNEL(f32, float)
WINO_INPUT_KERNEL(f16, __half)
WINO_INPUT_KERNEL(bf16, __nv_bfloat16)
// wino_output_<M>_<out>: M as the GEMM wrote it, the output F32 or F16 (fuse.py's F16 storage)
#define WINO_OUTPUT_KERNEL(suffix, TM, TO)                                                            \
    extern "C" __global__ void wino_output_##suffix(TO* out, const TM* M, const char* bias, int bdt,  \
                                                    int64_t bs, int OC, int H, int W, int TH, int TW,  \
                                                    int64_t t0, int64_t nt) {                          \
        wino_output<TM, TO>(out, M, bias, bdt, bs, OC, H, W, TH, TW, t0, nt);                         \
    }
WINO_OUTPUT_KERNEL(f32_f32, float, float)
WINO_OUTPUT_KERNEL(f16_f32, __half, float)
WINO_OUTPUT_KERNEL(f32_f16, float, __half)
WINO_OUTPUT_KERNEL(f16_f16, __half, __half)

// ---- bias ------------------------------------------------------------------------------------
// out[n][oc][p] (F32, total = N*OC*P elements) = (add ? out : 0) + bias[oc]; bias element oc
// sits at ne-decomposition (b0, b1, b2, b3) of oc through byte strides bnb*. blockIdx.y walks
// the N*OC rows (the bias read and index split once per row), blockIdx.x and the threads a row,
// four elements a thread loaded before any is stored.
template <typename T>
__device__ void bias_store_impl(float* __restrict__ out, const char* __restrict__ bias,
                                int64_t bne0, int64_t bne1, int64_t bne2,
                                int64_t bnb0, int64_t bnb1, int64_t bnb2, int64_t bnb3,
                                int64_t OC, int64_t P, int64_t total, int add) {
    const int64_t nrows = total / P;
    const int64_t step = (int64_t)gridDim.x * blockDim.x * 4;
    for (int64_t row = blockIdx.y; row < nrows; row += gridDim.y) {
        const int64_t oc = row % OC;
        const int64_t b0 = oc % bne0, b1 = (oc / bne0) % bne1, b2 = (oc / (bne0 * bne1)) % bne2;
        const int64_t b3 = oc / (bne0 * bne1 * bne2);
        const float v = load_f((const T*)(bias + b0 * bnb0 + b1 * bnb1 + b2 * bnb2 + b3 * bnb3));
        float* o = out + row * P;
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x * 4 + threadIdx.x; j < P; j += step) {
            float r[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (j + u * blockDim.x < P) r[u] = add ? o[j + u * blockDim.x] + v : v;
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (j + u * blockDim.x < P) o[j + u * blockDim.x] = r[u];
        }
    }
}

#define BIAS_KERNEL(suffix, T)                                                                    \
    extern "C" __global__ void bias_store_##suffix(                                               \
        float* out, const char* bias, int64_t bne0, int64_t bne1, int64_t bne2,                   \
        int64_t bnb0, int64_t bnb1, int64_t bnb2, int64_t bnb3, int64_t OC, int64_t P,            \
        int64_t total, int add) {                                                                 \
        bias_store_impl<T>(out, bias, bne0, bne1, bne2, bnb0, bnb1, bnb2, bnb3, OC, P, total, add); \
    }
BIAS_KERNEL(f32, float)
BIAS_KERNEL(f16, __half)
BIAS_KERNEL(bf16, __nv_bfloat16)

extern "C" __global__ void zero_f32(float* out, int64_t n) {
    GRID_STRIDE_LOOP(i, n) out[i] = 0.0f;
}

// ---- pooling ---------------------------------------------------------------------------------
// x ne (W, H, B2, B3) through byte strides; out F32 contiguous (OW, OH, B2, B3)
template <typename T>
__device__ void pool2d_impl(float* __restrict__ out, const char* __restrict__ x,
                            int64_t W, int64_t H, int64_t B2, int64_t B3,
                            int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3, int64_t OW, int64_t OH,
                            int KW, int KH, int s_w, int s_h, int p_w, int p_h, int is_max) {
    const int64_t total = OW * OH * B2 * B3;
    const float area = (float)(KH * KW);
    GRID_STRIDE_LOOP(i, total) {
        const int64_t ox = i % OW, oy = (i / OW) % OH, b2 = (i / (OW * OH)) % B2, b3 = i / (OW * OH * B2);
        const char* plane = x + b2 * nb2 + b3 * nb3;
        float acc = is_max ? -FLT_MAX : 0.0f;
        for (int ky = 0; ky < KH; ++ky) {
            const int64_t iy = oy * s_h + ky - p_h;
            if (iy < 0 || iy >= H) continue;
            for (int kx = 0; kx < KW; ++kx) {
                const int64_t ix = ox * s_w + kx - p_w;
                if (ix < 0 || ix >= W) continue;
                const float v = load_f((const T*)(plane + iy * nb1 + ix * nb0));
                acc = is_max ? fmaxf(acc, v) : acc + v;
            }
        }
        out[i] = is_max ? acc : acc / area;
    }
}

#define POOL_KERNEL(suffix, T)                                                                    \
    extern "C" __global__ void pool2d_##suffix(                                                   \
        float* out, const char* x, int64_t W, int64_t H, int64_t B2, int64_t B3,                  \
        int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3, int64_t OW, int64_t OH,               \
        int KW, int KH, int s_w, int s_h, int p_w, int p_h, int is_max) {                         \
        pool2d_impl<T>(out, x, W, H, B2, B3, nb0, nb1, nb2, nb3, OW, OH, KW, KH, s_w, s_h,        \
                       p_w, p_h, is_max);                                                         \
    }
POOL_KERNEL(f32, float)
POOL_KERNEL(f16, __half)
POOL_KERNEL(bf16, __nv_bfloat16)
