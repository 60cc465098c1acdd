// Attention kernels for the CUDA backend (op "attention", see sdrt/ops/attention.py and the
// Python side in sdrt/gpu/cuda/attention.py).
//
// Two paths:
//  * flash (attn_flash_d<DP>_r<RF>): our own flash attention on tensor cores through the
//    portable wmma API (half inputs, float accumulators). Q, K and V are first staged by
//    attn_stage_* into contiguous half buffers [batch][head][row][DP] (DP = head dim padded to
//    a multiple of 16 with zeros; Q pre-multiplied by scale*log2(e) so the softmax runs on
//    exp2). One block = 4 warps = 64*RF query rows of one (head, batch); each warp owns 16*RF
//    rows. K/V tiles of BK keys go through shared memory; the online softmax (running max m and
//    sum l per row, in float) runs on the score tile that each warp stores to shared memory;
//    the probabilities P overwrite that tile in place as half and feed P*V. The Lq x Lk score
//    matrix never exists.
//  * gemm (attn_stage_* + cuBLAS + attn_softmax_*): S = Q K^T per query chunk with cuBLAS,
//    a row softmax here, O = P V with cuBLAS. Used for full precision (F32 everywhere, no
//    tensor cores) and for head dims the flash tiles do not cover (the VAE's D=512).
//
// wmma fragments do not say which (row, col) each thread's element x[e] holds. The flash
// kernel needs it to rescale the output accumulators row by row and to write them out, so it
// asks: it loads a 16x16 matrix of row indices (and one of column indices) into an
// accumulator fragment once; x[e] then *is* the row (column) of element e. Every accumulator
// fragment of that type shares the mapping, on any architecture (and on HIP's rocWMMA).
//
// Warp = 32 lanes is assumed (softmax lane pairs); AMD wave64 devices would need a variant.
#include "common.cuh"
#include <mma.h>

namespace wm = nvcuda::wmma;

// dtype codes passed from Python (sdrt/gpu/cuda/attention.py DTYPE_CODE)
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

#define LOG2E 1.4426950408889634f
#define NEG_INF (-__int_as_float(0x7f800000))

// One element of a mask (F32/F16/BF16, code `dt`) at byte offset `off`.
__device__ __forceinline__ float load_mask(const char* base, int64_t off, int dt) {
    const char* p = base + off;
    if (dt == DT_F32) return *reinterpret_cast<const float*>(p);
    if (dt == DT_F16) return __half2float(*reinterpret_cast<const __half*>(p));
    return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

// ---------------------------------------------------------------------------------------------
// Staging: a strided 4-D view (ne [D, L, Hs, Ns], byte strides nb) into a contiguous buffer
// dst[N][H][Lpad][Dpad] of Tout, times `scale`; rows l >= L and columns d >= D are zeros.
// Destination head h of batch n reads source head h / rh of batch n / rn (GQA / batch
// broadcast expanded here when the gemm path needs one K/V per query head; rh = rn = 1 keeps
// the source's own heads).
template <typename Tin, typename Tout>
__device__ void stage_body(const char* src, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                           Tout* dst, int D, int L, int H, int N, int rh, int rn, int Dpad,
                           int Lpad, float scale) {
    const int64_t total = (int64_t)N * H * Lpad * Dpad;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int d = (int)(idx % Dpad);
        const int64_t row = idx / Dpad;  // (n*H + h)*Lpad + l
        const int l = (int)(row % Lpad);
        const int64_t nh = row / Lpad;
        const int h = (int)(nh % H);
        const int n = (int)(nh / H);
        float x = 0.0f;
        if (l < L && d < D) {
            const int64_t off = (int64_t)(n / rn) * nb3 + (int64_t)(h / rh) * nb2 + (int64_t)l * nb1 + (int64_t)d * nb0;
            x = load_f<Tin>(src, off) * scale;
        }
        dst[idx] = from_f32<Tout>(x);
    }
}

#define STAGE_KERNEL(NAME, TIN, TOUT)                                                              \
    extern "C" __global__ void NAME(const char* src, int64_t nb0, int64_t nb1, int64_t nb2,      \
                                    int64_t nb3, TOUT* dst, int D, int L, int H, int N, int rh,   \
                                    int rn, int Dpad, int Lpad, float scale) {                    \
        stage_body<TIN, TOUT>(src, nb0, nb1, nb2, nb3, dst, D, L, H, N, rh, rn, Dpad, Lpad,       \
                              scale);                                                             \
    }

STAGE_KERNEL(attn_stage_f32_f16, float, __half)
STAGE_KERNEL(attn_stage_f16_f16, __half, __half)
STAGE_KERNEL(attn_stage_bf16_f16, __nv_bfloat16, __half)
STAGE_KERNEL(attn_stage_f32_f32, float, float)
STAGE_KERNEL(attn_stage_f16_f32, __half, float)
STAGE_KERNEL(attn_stage_bf16_f32, __nv_bfloat16, float)

// ---------------------------------------------------------------------------------------------
// Row softmax of the gemm path: S [B][rows][Lk] float (already scaled scores of queries
// i0 .. i0+rows-1) -> P [B][rows][Lk] = softmax(S + mask) in Tout; a fully masked row gives
// zeros. One warp per row: pass 1 keeps a running (max, sum) per lane, pass 2 writes.
// Batch b is (n, h) = (b / H, b % H); the mask plane is (h % M2, n % M3), its row i (or 0
// when the mask has one row, Mq == 1).
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
    if (x == NEG_INF) return;
    if (x > m) {
        s = s * expf(m - x) + 1.0f;  // m = -inf: s is 0 and expf gives 0
        m = x;
    } else {
        s += expf(x - m);
    }
}

__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) { m = m2; s = s2; return; }
    const float mx = fmaxf(m, m2);
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}

template <typename Tout>
__device__ void softmax_body(const float* S, Tout* P, int B, int rows, int Lk, int H, int i0,
                             const char* mask, int mdt, int64_t mnb0, int64_t mnb1, int64_t mnb2,
                             int64_t mnb3, int Mq, int M2, int M3) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int64_t nrows = (int64_t)B * rows;
    for (int64_t r = (int64_t)blockIdx.x * warps + (threadIdx.x >> 5); r < nrows;
         r += (int64_t)gridDim.x * warps) {
        const float* srow = S + r * Lk;
        Tout* prow = P + r * Lk;
        const int b = (int)(r / rows);
        const int i = i0 + (int)(r % rows);
        const int n = b / H, h = b % H;
        const char* mrow = mask ? mask + (int64_t)(n % M3) * mnb3 + (int64_t)(h % M2) * mnb2 +
                                      (int64_t)(Mq == 1 ? 0 : i) * mnb1
                                : nullptr;
        float m = NEG_INF, s = 0.0f;
        for (int j = lane; j < Lk; j += 32) {
            const float x = srow[j] + (mrow ? load_mask(mrow, (int64_t)j * mnb0, mdt) : 0.0f);
            online_add(m, s, x);
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
            online_merge(m, s, m2, s2);
        }
        const float inv = (m == NEG_INF || s <= 0.0f) ? 0.0f : 1.0f / s;
        const float mu = (m == NEG_INF) ? 0.0f : m;
        for (int j = lane; j < Lk; j += 32) {
            const float x = srow[j] + (mrow ? load_mask(mrow, (int64_t)j * mnb0, mdt) : 0.0f);
            prow[j] = from_f32<Tout>(expf(x - mu) * inv);  // x = -inf gives 0
        }
    }
}

#define SOFTMAX_KERNEL(NAME, TOUT)                                                                 \
    extern "C" __global__ void NAME(const float* S, TOUT* P, int B, int rows, int Lk, int H,     \
                                    int i0, const char* mask, int mdt, int64_t mnb0,              \
                                    int64_t mnb1, int64_t mnb2, int64_t mnb3, int Mq, int M2,     \
                                    int M3) {                                                     \
        softmax_body<TOUT>(S, P, B, rows, Lk, H, i0, mask, mdt, mnb0, mnb1, mnb2, mnb3, Mq, M2,   \
                           M3);                                                                   \
    }

SOFTMAX_KERNEL(attn_softmax_f16, __half)
SOFTMAX_KERNEL(attn_softmax_f32, float)

// ---------------------------------------------------------------------------------------------
// Flash attention on tensor cores.
#define FLASH_WARPS 4
#define ROW_OF(e) ((int)((rows_packed >> (4 * (e))) & 15))
#define COL_OF(e) ((int)((cols_packed >> (4 * (e))) & 15))
#define FLASH_THREADS (FLASH_WARPS * 32)
#define FLASH_SMEM_LIMIT (48 * 1024)  // static shared memory, no opt-in needed (and HIP-safe)

// Shared memory of one block: K and V tiles (BK rows of DP halves, rows skewed by 8 halves so
// ldmatrix-style fragment loads hit distinct banks), each warp's score tile (16*RF rows of BK
// floats + 4 pad; P is written over it as half) and each warp's per-row factors.
__host__ __device__ constexpr int flash_smem_bytes(int dp, int rf, int bk) {
    return 2 * bk * (dp + 8) * 2 + FLASH_WARPS * 16 * rf * (bk + 4) * 4 + FLASH_WARPS * 16 * rf * 4;
}

// The largest key tile (64, 48, 32 or 16 keys) whose shared memory fits.
__host__ __device__ constexpr int flash_bk(int dp, int rf) {
    return flash_smem_bytes(dp, rf, 64) <= FLASH_SMEM_LIMIT ? 64
         : flash_smem_bytes(dp, rf, 48) <= FLASH_SMEM_LIMIT ? 48
         : flash_smem_bytes(dp, rf, 32) <= FLASH_SMEM_LIMIT ? 32 : 16;
}

typedef wm::fragment<wm::accumulator, 16, 16, 16, float> AccFrag;
typedef wm::fragment<wm::matrix_a, 16, 16, 16, __half, wm::row_major> AFrag;
typedef wm::fragment<wm::matrix_b, 16, 16, 16, __half, wm::col_major> BColFrag;
typedef wm::fragment<wm::matrix_b, 16, 16, 16, __half, wm::row_major> BRowFrag;

// Qh [N][H][Lqp][DP]: queries times scale*log2(e), rows padded with zeros to a multiple of
// 64*RF (Lqp). Kh, Vh [N/rn][H/rh][Lk][DP]. out [N][H][Lq][Dv] float, contiguous.
template <int DP, int RF>
__device__ void flash_body(const __half* __restrict__ Qh, const __half* __restrict__ Kh,
                           const __half* __restrict__ Vh, const char* __restrict__ mask, int mdt,
                           int64_t mnb0, int64_t mnb1, int64_t mnb2, int64_t mnb3, int Mq, int M2,
                           int M3, float* __restrict__ out, int Dv, int Lq, int Lk, int Lqp, int H,
                           int N, int rh, int rn) {
    constexpr int ROWS = 16 * RF;                 // query rows per warp
    constexpr int BQ = FLASH_WARPS * ROWS;        // query rows per block
    constexpr int BK = flash_bk(DP, RF);          // keys per tile
    constexpr int LDK = DP + 8;                   // K/V tile row stride, halves
    constexpr int LDS = BK + 4;                   // score tile row stride, floats
    constexpr int LDP = 2 * LDS;                  // P row stride, halves (P overwrites S)
    constexpr int DF = DP / 16;                   // 16-wide fragments along the head dim
    constexpr int KF = BK / 16;                   // 16-wide fragments along the key tile
    constexpr int NE = AccFrag::num_elements;
    constexpr int VEC = DP / 8;                   // uint4 (8 halves) per K/V row
    static_assert(DP % 16 == 0 && BK % 16 == 0, "tile sizes");
    static_assert(flash_smem_bytes(DP, RF, BK) <= FLASH_SMEM_LIMIT, "shared memory");

    __shared__ __align__(128) unsigned char smem[flash_smem_bytes(DP, RF, BK)];
    __half* Ks = reinterpret_cast<__half*>(smem);
    __half* Vs = Ks + BK * LDK;
    float* S_all = reinterpret_cast<float*>(smem + 2 * BK * LDK * 2);
    float* F_all = S_all + FLASH_WARPS * ROWS * LDS;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    float* Sw = S_all + warp * ROWS * LDS;        // this warp's score tile
    __half* Pw = reinterpret_cast<__half*>(Sw);   // ... and its probabilities, in place
    float* Fw = F_all + warp * ROWS;              // per-row factor (alpha, then 1/l)

    // Which (row, col) of the 16x16 tile accumulator element e holds (see the file comment),
    // packed 4 bits per element to spare registers.
    static_assert(NE <= 16, "accumulator elements per lane");
    uint64_t rows_packed = 0, cols_packed = 0;
    {
        for (int t = tid; t < 256; t += FLASH_THREADS) {
            S_all[t] = (float)(t / 16);
            S_all[256 + t] = (float)(t % 16);
        }
        __syncthreads();
        AccFrag fr, fc;
        wm::load_matrix_sync(fr, S_all, 16, wm::mem_row_major);
        wm::load_matrix_sync(fc, S_all + 256, 16, wm::mem_row_major);
#pragma unroll
        for (int e = 0; e < NE; ++e) {
            rows_packed |= (uint64_t)fr.x[e] << (4 * e);
            cols_packed |= (uint64_t)fc.x[e] << (4 * e);
        }
        __syncthreads();
    }

    const int rr = lane >> 1;  // softmax: lanes 2r and 2r+1 share row r of each 16-row group
    const int hh = lane & 1;   // ... and take alternate column pairs
    const int q0 = blockIdx.x * BQ + warp * ROWS;  // first query row of this warp

    for (int n = blockIdx.z; n < N; n += gridDim.z) {
        for (int h = blockIdx.y; h < H; h += gridDim.y) {
            const int64_t nh = (int64_t)n * H + h;
            const int64_t kv = ((int64_t)(n / rn) * (H / rh) + h / rh) * (int64_t)Lk * DP;
            const __half* Kg = Kh + kv;
            const __half* Vg = Vh + kv;

            AFrag qf[RF][DF];
#pragma unroll
            for (int f = 0; f < RF; ++f)
#pragma unroll
                for (int d = 0; d < DF; ++d)
                    wm::load_matrix_sync(qf[f][d], Qh + (nh * Lqp + q0 + f * 16) * DP + d * 16, DP);

            AccFrag of[RF][DF];
#pragma unroll
            for (int f = 0; f < RF; ++f)
#pragma unroll
                for (int d = 0; d < DF; ++d) wm::fill_fragment(of[f][d], 0.0f);

            float m_run[RF], l_run[RF];
            const char* mrow[RF];
#pragma unroll
            for (int f = 0; f < RF; ++f) {
                m_run[f] = NEG_INF;
                l_run[f] = 0.0f;
                const int i = q0 + f * 16 + rr;
                mrow[f] = (mask && i < Lq) ? mask + (int64_t)(n % M3) * mnb3 + (int64_t)(h % M2) * mnb2 +
                                                 (int64_t)(Mq == 1 ? 0 : i) * mnb1
                                           : nullptr;
            }

            for (int k0 = 0; k0 < Lk; k0 += BK) {
                __syncthreads();  // every warp is done with the previous tile
                for (int t = tid; t < BK * VEC; t += FLASH_THREADS) {
                    const int r = t / VEC, c = t % VEC;
                    uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
                    if (k0 + r < Lk) {
                        kx = reinterpret_cast<const uint4*>(Kg + (int64_t)(k0 + r) * DP)[c];
                        vx = reinterpret_cast<const uint4*>(Vg + (int64_t)(k0 + r) * DP)[c];
                    }
                    reinterpret_cast<uint4*>(Ks + r * LDK)[c] = kx;
                    reinterpret_cast<uint4*>(Vs + r * LDK)[c] = vx;
                }
                __syncthreads();

                // S = Q K^T (log2 units) for this warp's rows, into its score tile
#pragma unroll
                for (int kb = 0; kb < KF; ++kb) {
                    AccFrag acc[RF];
#pragma unroll
                    for (int f = 0; f < RF; ++f) wm::fill_fragment(acc[f], 0.0f);
#pragma unroll
                    for (int d = 0; d < DF; ++d) {
                        BColFrag kf;
                        wm::load_matrix_sync(kf, Ks + kb * 16 * LDK + d * 16, LDK);
#pragma unroll
                        for (int f = 0; f < RF; ++f) wm::mma_sync(acc[f], qf[f][d], kf, acc[f]);
                    }
#pragma unroll
                    for (int f = 0; f < RF; ++f)
                        wm::store_matrix_sync(Sw + f * 16 * LDS + kb * 16, acc[f], LDS, wm::mem_row_major);
                }
                __syncwarp();

                // online softmax: row max, probabilities, running sum; P overwrites S in place
#pragma unroll
                for (int f = 0; f < RF; ++f) {
                    const int row = f * 16 + rr;
                    float sv[BK / 2];
                    float mx = NEG_INF;
#pragma unroll
                    for (int j = 0; j < BK / 4; ++j) {
                        const int c = 2 * (2 * j + hh);
                        const float2 s2 = *reinterpret_cast<const float2*>(Sw + row * LDS + c);
                        const int key = k0 + c;
                        float s0 = NEG_INF, s1 = NEG_INF;
                        if (key < Lk)
                            s0 = s2.x + (mrow[f] ? load_mask(mrow[f], (int64_t)key * mnb0, mdt) * LOG2E : 0.0f);
                        if (key + 1 < Lk)
                            s1 = s2.y + (mrow[f] ? load_mask(mrow[f], (int64_t)(key + 1) * mnb0, mdt) * LOG2E : 0.0f);
                        sv[2 * j] = s0;
                        sv[2 * j + 1] = s1;
                        mx = fmaxf(mx, fmaxf(s0, s1));
                    }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    const float m_new = fmaxf(m_run[f], mx);
                    const float m_use = (m_new == NEG_INF) ? 0.0f : m_new;  // all masked so far
                    const float alpha = exp2f(m_run[f] - m_use);           // m_run = -inf: 0
                    float sum = 0.0f;
#pragma unroll
                    for (int e = 0; e < BK / 2; ++e) {
                        sv[e] = exp2f(sv[e] - m_use);
                        sum += sv[e];
                    }
                    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                    l_run[f] = l_run[f] * alpha + sum;
                    m_run[f] = m_new;
                    __syncwarp();  // both lanes of the row have read it before P overwrites it
#pragma unroll
                    for (int j = 0; j < BK / 4; ++j) {
                        const int c = 2 * (2 * j + hh);
                        *reinterpret_cast<__half2*>(Pw + row * LDP + c) = __floats2half2_rn(sv[2 * j], sv[2 * j + 1]);
                    }
                    if (hh == 0) Fw[row] = alpha;
                }
                __syncwarp();

                // O = O * alpha (per row) + P V
#pragma unroll
                for (int f = 0; f < RF; ++f) {
                    float a[NE];
#pragma unroll
                    for (int e = 0; e < NE; ++e) a[e] = Fw[f * 16 + ROW_OF(e)];
#pragma unroll
                    for (int d = 0; d < DF; ++d)
#pragma unroll
                        for (int e = 0; e < NE; ++e) of[f][d].x[e] *= a[e];
                }
#pragma unroll
                for (int kb = 0; kb < KF; ++kb) {
                    AFrag pf[RF];
#pragma unroll
                    for (int f = 0; f < RF; ++f) wm::load_matrix_sync(pf[f], Pw + f * 16 * LDP + kb * 16, LDP);
#pragma unroll
                    for (int d = 0; d < DF; ++d) {
                        BRowFrag vf;
                        wm::load_matrix_sync(vf, Vs + kb * 16 * LDK + d * 16, LDK);
#pragma unroll
                        for (int f = 0; f < RF; ++f) wm::mma_sync(of[f][d], pf[f], vf, of[f][d]);
                    }
                }
                __syncwarp();  // P reads done before the next tile's scores overwrite it
            }

            // out = O / l; a fully masked row (l = 0) gives zeros
            __syncwarp();
#pragma unroll
            for (int f = 0; f < RF; ++f)
                if (hh == 0) Fw[f * 16 + rr] = l_run[f] > 0.0f ? 1.0f / l_run[f] : 0.0f;
            __syncwarp();
#pragma unroll
            for (int f = 0; f < RF; ++f) {
#pragma unroll
                for (int e = 0; e < NE; ++e) {
                    const int i = q0 + f * 16 + ROW_OF(e);
                    if (i >= Lq) continue;
                    const float inv = Fw[f * 16 + ROW_OF(e)];
                    float* orow = out + (nh * Lq + i) * Dv;
#pragma unroll
                    for (int d = 0; d < DF; ++d) {
                        const int c = d * 16 + COL_OF(e);
                        if (c < Dv) orow[c] = of[f][d].x[e] * inv;
                    }
                }
            }
        }
    }
}

#define FLASH_KERNEL(DP, RF)                                                                       \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                    \
    attn_flash_d##DP##_r##RF(const __half* Qh, const __half* Kh, const __half* Vh,                \
                             const char* mask, int mdt, int64_t mnb0, int64_t mnb1, int64_t mnb2, \
                             int64_t mnb3, int Mq, int M2, int M3, float* out, int Dv, int Lq,    \
                             int Lk, int Lqp, int H, int N, int rh, int rn) {                     \
        flash_body<DP, RF>(Qh, Kh, Vh, mask, mdt, mnb0, mnb1, mnb2, mnb3, Mq, M2, M3, out, Dv,    \
                           Lq, Lk, Lqp, H, N, rh, rn);                                            \
    }

// Head dims (padded to 16): SD1.x 40/80/160 -> 48/80/160, SDXL/SD3 64, Flux/Wan 128; the rest
// round up to the next one. RF=2 (32 rows per warp) halves K/V fragment loads per product
// where the registers allow it; sdrt/gpu/cuda/attention.py FLASH_VARIANTS lists these.
FLASH_KERNEL(16, 1)
FLASH_KERNEL(32, 1)
FLASH_KERNEL(48, 1)
FLASH_KERNEL(64, 1)
FLASH_KERNEL(80, 1)
FLASH_KERNEL(96, 1)
FLASH_KERNEL(128, 1)
FLASH_KERNEL(160, 1)
FLASH_KERNEL(32, 2)
FLASH_KERNEL(48, 2)
FLASH_KERNEL(64, 2)
FLASH_KERNEL(80, 2)
