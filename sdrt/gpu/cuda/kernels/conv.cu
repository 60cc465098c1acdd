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
// - pool2d: ggml_pool_2d (avg divides by the full kernel area, max starts at -FLT_MAX);
//   pool1d is pool2d with a 1-row kernel.
//
// Every kernel but im2col is a 1-D grid-stride loop over its outputs (int64 indices).
#include "common.cuh"
#include "mma.cuh"
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

// ---- 3x3 convolution as a direct implicit GEMM on tensor cores (sm_80+) ---------------------------
// stride 1, padding 1, no dilation, one group, F16 weights, any input view (F32/F16/BF16). A block
// computes a C3_TH x C3_TW tile of output pixels (M = 128) by BN output channels of one batch item.
// Per chunk of C3_KC input channels, shared memory holds the input patch with its one-pixel halo,
// channel-contiguous per pixel ([pixel][C3_KC + 8] halves, narrowed to F16 while staged, as
// im2col narrows it), and the chunk's weights [tap][C3_KC][BN + 8] (conv3x3_pack_w's layout).
// A tap's A operand is the patch shifted by (ky, kx): ldmatrix takes one row address per lane, so
// the shift is only a different row, and the input is read from global memory once per block
// and chunk. Two buffers: the next chunk's weights come by cp.async and its patch through
// registers while the 9 taps of the current one run as mma.sync m16n8k16 (f16 in, f32 sums).
// Row strides of 48 / 2*(BN+8) bytes keep every ldmatrix conflict-free. Output: F32
// [N][OC][H][W] = epilogue(sum + bias) (bdt 0: no bias, 1 F32, 2 F16, 3 BF16; element oc at
// oc*bs bytes); the epilogue is the ops fuse.py folds in, in graph order: leaky_relu(slope) when
// act, then * scale + shift, then + res (F32, the output's layout) when res is not null.
constexpr int C3_TH = 8, C3_TW = 16, C3_BM = C3_TH * C3_TW, C3_KC = 16, C3_NT = 128;
constexpr int C3_PW = C3_TW + 2, C3_PIX = (C3_TH + 2) * C3_PW;
constexpr int C3_XS = C3_KC + 8;  // patch pixel stride in halves
constexpr int C3_XH = C3_PIX * C3_XS;
constexpr int C3_PAIRS = C3_KC / 2 * C3_PIX;  // half2 items of a patch
constexpr int C3_PER_THREAD = (C3_PAIRS + C3_NT - 1) / C3_NT;

// packed[ob][ch][tap][k][n] = w[ob*bn + n][(ch*C3_KC + k)*9 + tap], zero past OC and C
extern "C" __global__ void conv3x3_pack_w(__half* __restrict__ out, const __half* __restrict__ w, int C,
                                          int OC, int bn, int nch, int64_t total) {
    GRID_STRIDE_LOOP(i, total) {
        const int n = (int)(i % bn);
        int64_t r = i / bn;
        const int k = (int)(r % C3_KC);
        r /= C3_KC;
        const int t = (int)(r % 9);
        r /= 9;
        const int ch = (int)(r % nch), ob = (int)(r / nch);
        const int oc = ob * bn + n, c = ch * C3_KC + k;
        out[i] = (oc < OC && c < C) ? w[((int64_t)oc * C + c) * 9 + t] : __float2half(0.0f);
    }
}

__device__ __forceinline__ float c3_bias(const char* b, int bdt, int64_t off) {
    return bdt == 1 ? load_f<float>(b, off) : bdt == 2 ? load_f<__half>(b, off)
         : bdt == 3 ? load_f<__nv_bfloat16>(b, off) : 0.0f;
}

template <typename TI, typename TO, int BN, int WM, int WN>
__device__ void conv3x3_mma(TO* __restrict__ out, const char* __restrict__ x,
                            const __half* __restrict__ wp, const char* __restrict__ bias, int bdt,
                            int64_t bs, int64_t sn, int64_t sc, int64_t sy, int64_t sx, int C,
                            int H, int W, int OC, int nch, int act, float slope, float scale,
                            float shift, const float* __restrict__ res) {
#ifdef SDRT_HAVE_MMA
    constexpr int MW = C3_BM / WM, NW = BN / WN;  // a warp's tile
    constexpr int FM = MW / 16, FN = NW / 8;
    constexpr int WS = BN + 8, WH = 9 * C3_KC * WS;  // weight row stride, one buffer (halves)
    constexpr int WV = 9 * C3_KC * BN / 8;             // 16-byte vectors of one chunk's weights
    extern __shared__ __align__(16) unsigned char c3_smem[];
    __half* sX = reinterpret_cast<__half*>(c3_smem);  // [2][C3_XH]
    __half* sW = sX + 2 * C3_XH;                       // [2][WH]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WM, wn = warp / WM;
    const int tiles_x = (W + C3_TW - 1) / C3_TW;
    const int x0 = (blockIdx.x % tiles_x) * C3_TW, y0 = (blockIdx.x / tiles_x) * C3_TH;
    const char* xn = x + (int64_t)blockIdx.z * sn;
    const __half* wb = wp + (int64_t)blockIdx.y * nch * 9 * C3_KC * BN;

    // the next chunk's patch, as stored: converted only when written to shared memory, so that
    // no conversion waits on a load while the current chunk's MMAs could run
    TI pre_a[C3_PER_THREAD], pre_b[C3_PER_THREAD];
    auto load_patch = [&](int c0) {
        const TI zero = from_f32<TI>(0.0f);
#pragma unroll
        for (int j = 0; j < C3_PER_THREAD; ++j) {
            const int i = tid + j * C3_NT;
            TI a = zero, b = zero;
            if (i < C3_PAIRS) {
                const int cp = i / C3_PIX, p = i - cp * C3_PIX, r = p / C3_PW, col = p - r * C3_PW;
                const int iy = y0 + r - 1, ix = x0 + col - 1, c = c0 + 2 * cp;
                if (iy >= 0 && iy < H && ix >= 0 && ix < W) {
                    const int64_t off = (int64_t)c * sc + (int64_t)iy * sy + (int64_t)ix * sx;
                    if (c < C) a = load<TI>(xn, off);
                    if (c + 1 < C) b = load<TI>(xn, off + sc);
                }
            }
            pre_a[j] = a;
            pre_b[j] = b;
        }
    };
    auto store_patch = [&](__half* dst) {
#pragma unroll
        for (int j = 0; j < C3_PER_THREAD; ++j) {
            const int i = tid + j * C3_NT;
            if (i < C3_PAIRS) {
                const int cp = i / C3_PIX, p = i - cp * C3_PIX;
                *reinterpret_cast<__half2*>(dst + p * C3_XS + 2 * cp) =
                    __floats2half2_rn(to_f32(pre_a[j]), to_f32(pre_b[j]));
            }
        }
    };
    auto load_w = [&](int ch, __half* dst) {
        const __half* src = wb + (int64_t)ch * 9 * C3_KC * BN;
        for (int i = tid; i < WV; i += C3_NT) {
            const int row = i / (BN / 8), v = i - row * (BN / 8);
            cp_async16(dst + row * WS + v * 8, src + (int64_t)i * 8, true);
        }
        cp_async_commit();
    };

    float acc[FM][FN][4];
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
        for (int j = 0; j < FN; ++j) acc[f][j][0] = acc[f][j][1] = acc[f][j][2] = acc[f][j][3] = 0.0f;

    load_w(0, sW);
    load_patch(0);
    store_patch(sX);
    cp_async_wait<0>();
    __syncthreads();
    for (int ch = 0; ch < nch; ++ch) {
        const int cur = ch & 1;
        const bool more = ch + 1 < nch;
        if (more) {
            load_w(ch + 1, sW + (cur ^ 1) * WH);
            load_patch((ch + 1) * C3_KC);
        }
        const __half* X = sX + cur * C3_XH;
        const __half* Wt = sW + cur * WH;
#pragma unroll
        for (int t = 0; t < 9; ++t) {
            const int ky = t / 3, kx = t - ky * 3;
            unsigned a[FM][4], b[FN][2];
#pragma unroll
            for (int f = 0; f < FM; ++f) {  // m16 tile f: output row (wm*MW + f*16) / C3_TW
                const int ty = (wm * MW + f * 16) / C3_TW, tx = lane & 15;
                ldsm_x4(a[f], X + ((ty + ky) * C3_PW + tx + kx) * C3_XS + (lane >> 4) * 8);
            }
#pragma unroll
            for (int g = 0; g < FN / 2; ++g) {
                unsigned r[4];
                ldsm_x4_t(r, Wt + (t * C3_KC + (lane & 7) + ((lane >> 3) & 1) * 8) * WS + wn * NW + g * 16 +
                                 (lane >> 4) * 8);
                b[2 * g][0] = r[0];
                b[2 * g][1] = r[1];
                b[2 * g + 1][0] = r[2];
                b[2 * g + 1][1] = r[3];
            }
#pragma unroll
            for (int f = 0; f < FM; ++f)
#pragma unroll
                for (int j = 0; j < FN; ++j) mma16816(acc[f][j], a[f], b[j][0], b[j][1]);
        }
        if (more) {
            store_patch(sX + (cur ^ 1) * C3_XH);
            cp_async_wait<0>();
        }
        __syncthreads();
    }

    const int64_t item = (int64_t)blockIdx.z * OC * H * W;
    TO* on = out + item;
    const float* rn = res ? res + item : nullptr;
    const int oc0 = blockIdx.y * BN + wn * NW + 2 * (lane & 3);
    float bv[FN][2];  // this thread's bias values, read once (per use, they cost a stack frame)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int oc = oc0 + j * 8 + e;
            bv[j][e] = oc < OC ? c3_bias(bias, bdt, (int64_t)oc * bs) : 0.0f;
        }
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = wm * MW + f * 16 + (lane >> 2) + h * 8;
            const int oy = y0 + m / C3_TW, ox = x0 + m % C3_TW;
            if (oy >= H || ox >= W) continue;
#pragma unroll
            for (int j = 0; j < FN; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int oc = oc0 + j * 8 + e;
                    if (oc >= OC) continue;
                    const int64_t o = ((int64_t)oc * H + oy) * W + ox;
                    float v = acc[f][j][2 * h + e] + bv[j][e];
                    if (act) v = v > 0.0f ? v : v * slope;  // elementwise.cu's leaky_relu
                    v = v * scale + shift;
                    store_f(on + o, rn ? v + rn[o] : v);
                }
        }
#endif
}

// conv3x3_mma<BN>_<in>_<out>: BN output channels a block (32: four warps of 32 pixels x 32
// channels; 64: 2 x 2 warps of 64 x 32), input F32/F16/BF16, output F32 or F16 (fuse.py's F16
// storage)
#define CONV3X3_MMA_KERNEL(name, suffix, TI, TO, BN, WM, WN)                                      \
    extern "C" __global__ void __launch_bounds__(C3_NT) name##_##suffix(                          \
        TO* out, const char* x, const __half* wp, const char* bias, int bdt, int64_t bs,          \
        int64_t sn, int64_t sc, int64_t sy, int64_t sx, int C, int H, int W, int OC, int nch,     \
        int act, float slope, float scale, float shift, const float* res) {                       \
        conv3x3_mma<TI, TO, BN, WM, WN>(out, x, wp, bias, bdt, bs, sn, sc, sy, sx, C, H, W, OC,   \
                                        nch, act, slope, scale, shift, res);                      \
    }
#define CONV3X3_MMA_KERNELS(name, BN, WM, WN)                                                     \
    CONV3X3_MMA_KERNEL(name, f32_f32, float, float, BN, WM, WN)                             \
    CONV3X3_MMA_KERNEL(name, f16_f32, __half, float, BN, WM, WN)                            \
    CONV3X3_MMA_KERNEL(name, bf16_f32, __nv_bfloat16, float, BN, WM, WN)                    \
    CONV3X3_MMA_KERNEL(name, f32_f16, float, __half, BN, WM, WN)                            \
    CONV3X3_MMA_KERNEL(name, f16_f16, __half, __half, BN, WM, WN)                           \
    CONV3X3_MMA_KERNEL(name, bf16_f16, __nv_bfloat16, __half, BN, WM, WN)
CONV3X3_MMA_KERNELS(conv3x3_mma32, 32, 4, 1)
CONV3X3_MMA_KERNELS(conv3x3_mma64, 64, 2, 2)

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
