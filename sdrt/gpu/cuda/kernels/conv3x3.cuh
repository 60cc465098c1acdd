// The direct 3x3 conv's device template (conv.cu instantiates the default block shapes,
// conv3x3_sm90.cu the candidates timed on Hopper) and its kernel-defining macros.
#pragma once
#include "common.cuh"
#include "mma.cuh"

// ---- 3x3 convolution as a direct implicit GEMM on tensor cores (sm_80+) ---------------------------
// stride 1, padding 1, no dilation, one group, F16 weights, any input view (F32/F16/BF16). A block
// computes a TH x C3_TW tile of output pixels (M = 128 or 256) by BN output channels of one batch
// item. Per chunk of KC input channels, shared memory holds the input patch with its one-pixel
// halo, channel-contiguous per pixel ([pixel][KC + 8] halves, narrowed to F16 while staged, as
// im2col narrows it), and the chunk's weights [tap][KC][BN + 8] (conv3x3_pack_w's layout).
// A tap's A operand is the patch shifted by (ky, kx): ldmatrix takes one row address per lane, so
// the shift is only a different row, and the input is read from global memory once per block
// and chunk. Two buffers: the next chunk's weights come by cp.async and its patch through
// registers while the 9 taps of the current one run as mma.sync m16n8k16 (f16 in, f32 sums).
// Row strides of 2*(KC+8) / 2*(BN+8) bytes keep every ldmatrix conflict-free. Output: F32
// [N][OC][H][W] = epilogue(sum + bias) (bdt 0: no bias, 1 F32, 2 F16, 3 BF16; element oc at
// oc*bs bytes); the epilogue is the ops fuse.py folds in, in graph order: leaky_relu(slope) when
// act, then * scale + shift, then + res (F32, the output's layout) when res is not null.
// A tile is TH rows of C3_TW = 16 pixels (an m16 MMA tile is one output row); NT threads; KC
// input channels a chunk (16 or 32).
constexpr int C3_TW = 16;
constexpr int C3_PW = C3_TW + 2;

__device__ __forceinline__ float c3_bias(const char* b, int bdt, int64_t off) {
    return bdt == 1 ? load_f<float>(b, off) : bdt == 2 ? load_f<__half>(b, off)
         : bdt == 3 ? load_f<__nv_bfloat16>(b, off) : 0.0f;
}

template <typename TI, typename TO, int BN, int WM, int WN, int TH, int NT, int KC>
__device__ void conv3x3_mma(TO* __restrict__ out, const char* __restrict__ x,
                            const __half* __restrict__ wp, const char* __restrict__ bias, int bdt,
                            int64_t bs, int64_t sn, int64_t sc, int64_t sy, int64_t sx, int C,
                            int H, int W, int OC, int nch, int act, float slope, float scale,
                            float shift, const float* __restrict__ res) {
#ifdef SDRT_HAVE_MMA
    constexpr int C3_TH = TH, C3_BM = TH * C3_TW, C3_NT = NT, C3_KC = KC;
    constexpr int C3_XS = C3_KC + 8;  // patch pixel stride in halves (16-byte rows, no conflicts)
    constexpr int C3_PIX = (C3_TH + 2) * C3_PW, C3_XH = C3_PIX * C3_XS;
    constexpr int C3_PAIRS = C3_KC / 2 * C3_PIX;  // half2 items of a patch
    constexpr int C3_PER_THREAD = (C3_PAIRS + C3_NT - 1) / C3_NT;
    static_assert(WM * WN * 32 == NT, "one warp per warp tile");
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
        for (int tk = 0; tk < 9 * (C3_KC / 16); ++tk) {  // tap t, k16 step kk of the chunk
            const int t = tk / (C3_KC / 16), kk = tk % (C3_KC / 16);
            const int ky = t / 3, kx = t - ky * 3;
            unsigned a[FM][4], b[FN][2];
#pragma unroll
            for (int f = 0; f < FM; ++f) {  // m16 tile f: output row (wm*MW + f*16) / C3_TW
                const int ty = (wm * MW + f * 16) / C3_TW, tx = lane & 15;
                ldsm_x4(a[f], X + ((ty + ky) * C3_PW + tx + kx) * C3_XS + kk * 16 + (lane >> 4) * 8);
            }
#pragma unroll
            for (int g = 0; g < FN / 2; ++g) {
                unsigned r[4];
                ldsm_x4_t(r, Wt + (t * C3_KC + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * WS + wn * NW +
                                 g * 16 + (lane >> 4) * 8);
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

// conv3x3_<variant>_<in>_<out>: BN output channels a block (32: four warps of 32 pixels x 32
// channels; 64: 2 x 2 warps of 64 x 32; 128: eight warps, 2 x 4 of 64 x 32 on an 8-row tile, or
// 128t: 4 x 2 of 64 x 64 on a 16-row tile; k32: 32 input channels a chunk), input F32/F16/BF16,
// output F32 or F16 (fuse.py's F16 storage). ops/conv.py's C3_VARIANTS mirrors this list.
#define CONV3X3_MMA_KERNEL(name, suffix, TI, TO, BN, WM, WN, TH, KC)                              \
    extern "C" __global__ void __launch_bounds__(WM * WN * 32) name##_##suffix(                   \
        TO* out, const char* x, const __half* wp, const char* bias, int bdt, int64_t bs,          \
        int64_t sn, int64_t sc, int64_t sy, int64_t sx, int C, int H, int W, int OC, int nch,     \
        int act, float slope, float scale, float shift, const float* res) {                       \
        conv3x3_mma<TI, TO, BN, WM, WN, TH, WM * WN * 32, KC>(out, x, wp, bias, bdt, bs, sn, sc,  \
                                        sy, sx, C, H, W, OC, nch, act, slope, scale, shift, res); \
    }
#define CONV3X3_MMA_KERNELS(name, BN, WM, WN, TH, KC)                                             \
    CONV3X3_MMA_KERNEL(name, f32_f32, float, float, BN, WM, WN, TH, KC)                           \
    CONV3X3_MMA_KERNEL(name, f16_f32, __half, float, BN, WM, WN, TH, KC)                          \
    CONV3X3_MMA_KERNEL(name, bf16_f32, __nv_bfloat16, float, BN, WM, WN, TH, KC)                  \
    CONV3X3_MMA_KERNEL(name, f32_f16, float, __half, BN, WM, WN, TH, KC)                          \
    CONV3X3_MMA_KERNEL(name, f16_f16, __half, __half, BN, WM, WN, TH, KC)                         \
    CONV3X3_MMA_KERNEL(name, bf16_f16, __nv_bfloat16, __half, BN, WM, WN, TH, KC)
