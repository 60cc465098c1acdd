// Quantized mul_mat kernels that dequantize inside the kernel. Python side: sdrt/gpu/cuda/matmul.py
// (large N goes through a dequantize-to-F16 pass and cuBLAS instead; see there).
//
// mmv_<type>: out[b][n][m] = sum_k W[m][k] * x[b][n][k] for few columns n (mat-vec and N <= 16).
// One warp per output row m: each lane decodes groups of 8 weights (quant_blocks.cuh) and dots
// them with up to MMV_COLS columns of x at once, so a weight row is read once per 8 columns.
// Float accumulation; the warp's partial sums are reduced with shuffles.
#include "quant_blocks.cuh"

#define MMV_COLS 8

#if defined(__HIP_PLATFORM_AMD__)
#define SHFL_XOR(v, o) __shfl_xor((v), (o), 32)
#else
#define SHFL_XOR(v, o) __shfl_xor_sync(0xffffffffu, (v), (o), 32)
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += SHFL_XOR(v, o);
    return v;
}

// dot of 8 weights with 8 consecutive floats of x (16-byte loads when x16 says they are aligned)
__device__ __forceinline__ float dot8(const float* v, const float* xp, bool x16) {
    if (x16) {
        const float4 a = ((const float4*)xp)[0], b = ((const float4*)xp)[1];
        return v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y + v[6] * b.z + v[7] * b.w;
    }
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s += v[k] * xp[k];
    return s;
}

// w: block rows with byte strides w_nb1..3, ne=[K, M, b2/r2, b3/r3]; x: F32 with unit stride along
// K and element strides xs1..3, ne=[K, N, b2, b3]; out: contiguous F32 ne=[M, N, b2, b3].
// x batch (i2, i3) uses weight batch (i2 / r2, i3 / r3) as ggml broadcasts.
// Launch: block (32, rows per block), grid (ceil(M / rows per block), min(b2 * b3, 65535)).
template <class B>
__device__ void mmv(const uint8_t* __restrict__ w, int64_t w_nb1, int64_t w_nb2, int64_t w_nb3,
                    const float* __restrict__ x, int64_t xs1, int64_t xs2, int64_t xs3, float* __restrict__ out,
                    int K, int M, int N, int b2, int b3, int r2, int r3) {
    constexpr int GPB = B::BS / 8;  // groups of 8 per block
    const int lane = threadIdx.x;
    const int m = blockIdx.x * blockDim.y + threadIdx.y;
    if (m >= M) return;  // a whole warp leaves together: the shuffles below stay convergent
    const int ngroups = K / 8;
    const bool x16 = ((uintptr_t)x & 15) == 0 && (xs1 & 3) == 0 && (xs2 & 3) == 0 && (xs3 & 3) == 0;
    const int64_t nbatch = (int64_t)b2 * b3;
    for (int64_t bt = blockIdx.y; bt < nbatch; bt += gridDim.y) {
        const int64_t i2 = bt % b2, i3 = bt / b2;
        const uint8_t* wrow = w + (i3 / r3) * w_nb3 + (i2 / r2) * w_nb2 + (int64_t)m * w_nb1;
        const float* xb = x + i3 * xs3 + i2 * xs2;
        for (int n0 = 0; n0 < N; n0 += MMV_COLS) {
            float acc[MMV_COLS];
#pragma unroll
            for (int c = 0; c < MMV_COLS; ++c) acc[c] = 0.0f;
            for (int g = lane; g < ngroups; g += 32) {
                float v[8];
                B::dq8(wrow + (int64_t)(g / GPB) * B::TS, (g % GPB) * 8, v);
#pragma unroll
                for (int c = 0; c < MMV_COLS; ++c)
                    if (n0 + c < N) acc[c] += dot8(v, xb + (int64_t)(n0 + c) * xs1 + 8 * g, x16);
            }
#pragma unroll
            for (int c = 0; c < MMV_COLS; ++c) {
                const float s = warp_sum(acc[c]);
                if (lane == 0 && n0 + c < N) out[(bt * N + n0 + c) * M + m] = s;
            }
        }
    }
}

#define MMV(name, B)                                                                                  \
    extern "C" __global__ void mmv_##name(const uint8_t* w, int64_t w_nb1, int64_t w_nb2, int64_t w_nb3, \
            const float* x, int64_t xs1, int64_t xs2, int64_t xs3, float* out, int K, int M, int N,    \
            int b2, int b3, int r2, int r3) {                                                          \
        mmv<B>(w, w_nb1, w_nb2, w_nb3, x, xs1, xs2, xs3, out, K, M, N, b2, b3, r2, r3);                \
    }
SDRT_BLOCK_TYPES(MMV)
