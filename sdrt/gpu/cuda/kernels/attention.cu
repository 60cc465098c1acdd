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
#include "attention.cuh"
#include <mma.h>

namespace wm = nvcuda::wmma;

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

// ---------------------------------------------------------------------------------------------
// Flash attention, sm_80+ path (attn_mma_d<DP>_r<RF>_w<NW>): FlashAttention-2's scheme on the
// mma.sync m16n8k16 (f16 in, f32 accumulate) instructions, with ldmatrix fragment loads and a
// cp.async pipeline of K/V tiles. It is PTX, so it exists only for __CUDA_ARCH__ >= 800 (every
// SASS target we ship plus the compute_90 PTX); elsewhere (HIP, older GPUs) the body compiles
// to nothing and sdrt/gpu/cuda/attention.py takes the portable wmma kernel above, which
// computes the same thing. Unlike that kernel:
//  * scores, probabilities and the output accumulator never leave registers: the m16n8 f32
//    accumulator of S = Q K^T holds, lane for lane, exactly the elements the m16n8k16 A
//    operand of P V needs, so P is just repacked to half2 (the layouts are fixed by the PTX
//    ISA: lane l holds rows l/4 and l/4 + 8, columns 2*(l%4) + {0, 1} of each 16x8 tile);
//    a row's max and sum need two shuffles within each group of 4 lanes; the row sum is kept
//    per lane and reduced once at the end;
//  * the running max moves (and O and l are rescaled) only when a row of the warp grew by more
//    than MMA_LAZY (log2 units): with a stale max the probabilities stay below 2^MMA_LAZY and
//    the result after O / l is the same; it spares most tiles the rescaling;
//  * Q is read once into registers (ldmatrix from a shared tile) and scaled there by
//    scale*log2(e) when it was not staged pre-scaled;
//  * q/k/v are read straight from their F16 source through row/head/batch strides when the
//    rows are 16-byte aligned with D a multiple of 8 (the Python side stages anything else:
//    F32/BF16 or odd strides, into [n][h][l][round_up(D, 8)] half with attn_pack_*); head
//    dims below DP and keys beyond Lk are zero-filled on the way into shared memory;
//  * K/V tiles are copied (cp.async, 16 bytes a thread) STAGES - 1 tiles ahead of the one
//    being computed, one __syncthreads per tile; the blocks of one head start at staggered
//    tiles (the order does not matter to the online softmax) so that they do not all read the
//    same tile at once.
// One warp owns 16*RF query rows, a block NW warps; MMA_BK = 64 keys a tile. Shared memory is
// dynamic (mma_smem_halves, above 48 KiB opted into by the launcher): K and V tiles
// [STAGES][2][BK][DP+8] halves (rows skewed by 16 bytes so ldmatrix's 8 row addresses hit
// distinct banks), with the Q tile [BQ][DP+8] aliasing the last stage before the first tile.
// Measured on the H200 (bench/bench_cuda_attention.py, docs/cuda.md): larger key tiles (128)
// or smaller ones (32), 16 rows per warp, 8 warps, Q re-read from shared memory, half2 exp2
// and rescaling at every tile were no faster than this, most of them slower.
#define MMA_BK 64
#define MMA_LAZY 8

__host__ __device__ constexpr int mma_smem_halves(int dp, int rf, int nw, int stages) {
    return (2 * stages * MMA_BK * (dp + 8)) > (2 * (stages - 1) * MMA_BK * (dp + 8) + nw * 16 * rf * (dp + 8))
               ? 2 * stages * MMA_BK * (dp + 8)
               : 2 * (stages - 1) * MMA_BK * (dp + 8) + nw * 16 * rf * (dp + 8);
}

#include "mma.cuh"

// Q [.., Lq rows, Dq cols] at Q + n*qs3 + h*qs2 + i*qs1 (strides in halves, 16-byte aligned);
// K, V likewise at kv head h/rh of batch n/rn with Dq / Dvv valid columns (multiples of 8), their
// offsets from a head's start below 2^31 halves; output row i of head h, batch n at out +
// n*os3 + h*os2 + i*os1 elements, float, or half when out_half (the backend writes a permuted,
// F16-stored cont of the output this way: fuse.py). Scores are in log2 units once Q is times qscale.
template <int DP, int RF, int NW, int STAGES>
__device__ void mma_body(const __half* __restrict__ Q, int64_t qs1, int64_t qs2, int64_t qs3,
                         const __half* __restrict__ K, int64_t ks1, int64_t ks2, int64_t ks3,
                         const __half* __restrict__ V, int64_t vs1, int64_t vs2, int64_t vs3,
                         int Dq, int Dvv, float qscale, const char* __restrict__ mask, int mdt,
                         int64_t mnb0, int64_t mnb1, int64_t mnb2, int64_t mnb3, int Mq, int M2,
                         int M3, void* __restrict__ out, int64_t os1, int64_t os2, int64_t os3, int out_half,
                         int Dv, int Lq, int Lk, int H, int N, int rh, int rn) {
#ifdef SDRT_HAVE_MMA
    constexpr int BK = MMA_BK;
    constexpr int NT = NW * 32;
    constexpr int ROWS = 16 * RF;       // query rows per warp
    constexpr int BQ = NW * ROWS;       // query rows per block
    constexpr int LD = DP + 8;          // shared row stride, halves
    constexpr int CH = DP / 8;          // 16-byte chunks per row
    constexpr int KD = DP / 16;         // k-steps of Q K^T (head dim)
    constexpr int NS = BK / 8;          // n-tiles of S (keys)
    constexpr int KS = BK / 16;         // k-steps of P V (keys)
    constexpr int ND = DP / 8;          // n-tiles of O (head dim)
    constexpr int TPR = CH <= 8 ? 8 : CH <= 16 ? 16 : 32;  // threads per row in tile loads
    constexpr int RSTEP = NT / TPR;     // rows apart of one thread's chunks
    static_assert(DP % 16 == 0 && BK % RSTEP == 0 && STAGES >= 2, "tiles");

    extern __shared__ __align__(128) unsigned char dsmem[];
    if (dynamic_smem_bytes() < 2u * mma_smem_halves(DP, RF, NW, STAGES)) __trap();  // launch bug
    __half* sm = reinterpret_cast<__half*>(dsmem);
    __half* Qs = sm + (STAGES - 1) * 2 * BK * LD;  // aliases the last stage until the first tile

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int qb = blockIdx.x * BQ;     // first query row of the block
    const int qw = qb + warp * ROWS;    // ... of this warp
    const int nkt = (Lk + BK - 1) / BK;
    const int kstart = (int)(blockIdx.x % (unsigned)nkt);  // staggered first tile
    auto tile_of = [&](int t) { const int u = t + kstart; return u >= nkt ? u - nkt : u; };

    for (int n = blockIdx.z; n < N; n += gridDim.z) {
        for (int h = blockIdx.y; h < H; h += gridDim.y) {
            __syncthreads();  // the previous (n, h) is done with shared memory
            const __half* Qg = Q + (int64_t)n * qs3 + (int64_t)h * qs2;
            const __half* Kg = K + (int64_t)(n / rn) * ks3 + (int64_t)(h / rh) * ks2;
            const __half* Vg = V + (int64_t)(n / rn) * vs3 + (int64_t)(h / rh) * vs2;

            // K/V tile loads: thread (lr, lc) copies 16-byte chunk lc of rows lr, lr + RSTEP, ...
            // (columns at or beyond Dq / Dvv are zero-filled, their source clamped to column 0)
            const int lc = tid % TPR, lr = tid / TPR;
            const bool kcol = lc < CH && lc * 8 < Dq, vcol = lc < CH && lc * 8 < Dvv;
            const int ks1i = (int)ks1, vs1i = (int)vs1;
            const int koff0 = lr * ks1i + (kcol ? lc * 8 : 0), voff0 = lr * vs1i + (vcol ? lc * 8 : 0);
            const int soff = lr * LD + lc * 8;
            auto load_kv = [&](int t) {  // loop step t into stage t % STAGES
                if (lc >= CH) return;
                __half* Kb = sm + (t % STAGES) * 2 * BK * LD + soff;
                __half* Vb = Kb + BK * LD;
                const int k0 = tile_of(t) * BK;
                int ko = koff0 + k0 * ks1i, vo = voff0 + k0 * vs1i;
                if (k0 + BK <= Lk) {
#pragma unroll
                    for (int i = 0; i < BK / RSTEP; ++i) {
                        cp_async16(Kb + i * RSTEP * LD, Kg + ko, kcol);
                        cp_async16(Vb + i * RSTEP * LD, Vg + vo, vcol);
                        ko += RSTEP * ks1i;
                        vo += RSTEP * vs1i;
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < BK / RSTEP; ++i) {
                        const bool in = k0 + lr + i * RSTEP < Lk;
                        cp_async16(Kb + i * RSTEP * LD, in ? Kg + ko : Kg, in && kcol);
                        cp_async16(Vb + i * RSTEP * LD, in ? Vg + vo : Vg, in && vcol);
                        ko += RSTEP * ks1i;
                        vo += RSTEP * vs1i;
                    }
                }
            };

            stage_q_rows<NT, BQ, CH>(Qs, LD, Qg, qs1, qb, Lq, Dq, Q, tid);
            prime_tiles<STAGES>(load_kv, nkt);
            cp_async_wait<STAGES - 2>();  // Q and tile 0
            __syncthreads();

            unsigned qf[RF][KD][4];
#pragma unroll
            for (int f = 0; f < RF; ++f) load_q_frags<KD>(qf[f], Qs + (warp * ROWS + f * 16) * LD, LD, lane);
            if (qscale != 1.0f) {
#pragma unroll
                for (int f = 0; f < RF; ++f) scale_q_frags<KD>(qf[f], qscale);
            }

            float o[RF][ND][4];
            float m_run[RF][2], l_run[RF][2];
#pragma unroll
            for (int f = 0; f < RF; ++f) {
#pragma unroll
                for (int d = 0; d < ND; ++d)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[f][d][e] = 0.0f;
                m_run[f][0] = m_run[f][1] = NEG_INF;
                l_run[f][0] = l_run[f][1] = 0.0f;
            }

            for (int t = 0; t < nkt; ++t) {
                cp_async_wait<STAGES - 2>();  // tile t has landed (this thread's part) ...
                __syncthreads();  // ... everyone's; and stage (t-1) % STAGES (or Q) is free
                if (t + STAGES - 1 < nkt) load_kv(t + STAGES - 1);
                cp_async_commit();
                const __half* Kb = sm + (t % STAGES) * 2 * BK * LD;
                const __half* Vb = Kb + BK * LD;
                const int k0 = tile_of(t) * BK;

                // S = Q K^T
                float s[RF][NS][4];
#pragma unroll
                for (int f = 0; f < RF; ++f)
#pragma unroll
                    for (int j = 0; j < NS; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[f][j][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
                    for (int p = 0; p < NS / 2; ++p) {
                        unsigned b[4];
                        ldsm_x4(b, Kb + (p * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                        for (int f = 0; f < RF; ++f) {
                            mma16816(s[f][2 * p], qf[f][kk], b[0], b[1]);
                            mma16816(s[f][2 * p + 1], qf[f][kk], b[2], b[3]);
                        }
                    }
                }

                // keys beyond Lk, and the mask (natural-log units, so times log2(e))
                if (mask != nullptr || k0 + BK > Lk) {
#pragma unroll
                    for (int f = 0; f < RF; ++f)
                        mask_scores<NS>(s[f], qw + f * 16 + g, tq, k0, Lk, Lq, mask, mdt, mnb0, mnb1, mnb2, mnb3,
                                        Mq, M2, M3, n, h);
                }

                // online softmax on the registers: the tile's row maxima ...
                float mx[RF][2];
#pragma unroll
                for (int f = 0; f < RF; ++f)
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        float m = fmaxf(s[f][0][2 * hr], s[f][0][2 * hr + 1]);
#pragma unroll
                        for (int j = 1; j < NS; ++j) m = fmaxf(m, fmaxf(s[f][j][2 * hr], s[f][j][2 * hr + 1]));
                        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                        mx[f][hr] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                    }
                // ... move the running max only when some row of the warp grew by > MMA_LAZY
                bool grow = false;
#pragma unroll
                for (int f = 0; f < RF; ++f)
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) grow |= mx[f][hr] > m_run[f][hr] + (float)MMA_LAZY;
                if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
                    for (int f = 0; f < RF; ++f)
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr) {
                            const float m_new = fmaxf(m_run[f][hr], mx[f][hr]);
                            const float m_use = (m_new == NEG_INF) ? 0.0f : m_new;  // all masked so far
                            const float alpha = fast_exp2(m_run[f][hr] - m_use);    // m_run = -inf: 0
                            m_run[f][hr] = m_new;
                            l_run[f][hr] *= alpha;
#pragma unroll
                            for (int d = 0; d < ND; ++d) {
                                o[f][d][2 * hr] *= alpha;
                                o[f][d][2 * hr + 1] *= alpha;
                            }
                        }
                }
                // ... probabilities, row sums (per lane), P in the A-operand layout
                unsigned pa[RF][KS][4];
#pragma unroll
                for (int f = 0; f < RF; ++f) {
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        const float m_use = (m_run[f][hr] == NEG_INF) ? 0.0f : m_run[f][hr];
                        float sum = 0.0f;
#pragma unroll
                        for (int j = 0; j < NS; ++j) {
                            s[f][j][2 * hr] = fast_exp2(s[f][j][2 * hr] - m_use);
                            s[f][j][2 * hr + 1] = fast_exp2(s[f][j][2 * hr + 1] - m_use);
                            sum += s[f][j][2 * hr] + s[f][j][2 * hr + 1];
                        }
                        l_run[f][hr] += sum;
                    }
#pragma unroll
                    for (int kb = 0; kb < KS; ++kb) {
                        pa[f][kb][0] = pack_half2(s[f][2 * kb][0], s[f][2 * kb][1]);
                        pa[f][kb][1] = pack_half2(s[f][2 * kb][2], s[f][2 * kb][3]);
                        pa[f][kb][2] = pack_half2(s[f][2 * kb + 1][0], s[f][2 * kb + 1][1]);
                        pa[f][kb][3] = pack_half2(s[f][2 * kb + 1][2], s[f][2 * kb + 1][3]);
                    }
                }

                // O += P V
#pragma unroll
                for (int kb = 0; kb < KS; ++kb) {
#pragma unroll
                    for (int q = 0; q < ND / 2; ++q) {
                        unsigned b[4];
                        ldsm_x4_t(b, Vb + (kb * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + q * 16 + (lane >> 4) * 8);
#pragma unroll
                        for (int f = 0; f < RF; ++f) {
                            mma16816(o[f][2 * q], pa[f][kb], b[0], b[1]);
                            mma16816(o[f][2 * q + 1], pa[f][kb], b[2], b[3]);
                        }
                    }
                }
            }
            cp_async_wait<0>();  // nothing in flight when shared memory is reused

            // out = O / l; a fully masked row (l = 0) gives zeros
#pragma unroll
            for (int f = 0; f < RF; ++f)
                store_rows<ND>(o[f], l_run[f], qw + f * 16 + g, tq, Lq, Dv, out, os1, os2, os3, n, h, out_half);
        }
    }
#endif  // SDRT_HAVE_MMA
}

#define MMA_KERNEL(DP, RF, NW, STAGES)                                                             \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                          \
    attn_mma_d##DP##_r##RF##_w##NW(const __half* Q, int64_t qs1, int64_t qs2, int64_t qs3,        \
                                   const __half* K, int64_t ks1, int64_t ks2, int64_t ks3,        \
                                   const __half* V, int64_t vs1, int64_t vs2, int64_t vs3,        \
                                   int Dq, int Dvv, float qscale, const char* mask, int mdt,      \
                                   int64_t mnb0, int64_t mnb1, int64_t mnb2, int64_t mnb3, int Mq, \
                                   int M2, int M3, void* out, int64_t os1, int64_t os2,           \
                                   int64_t os3, int out_half, int Dv, int Lq, int Lk, int H,      \
                                   int N, int rh, int rn) {                                       \
        mma_body<DP, RF, NW, STAGES>(Q, qs1, qs2, qs3, K, ks1, ks2, ks3, V, vs1, vs2, vs3, Dq, Dvv, \
                                     qscale, mask, mdt, mnb0, mnb1, mnb2, mnb3, Mq, M2, M3, out,  \
                                     os1, os2, os3, out_half, Dv, Lq, Lk, H, N, rh, rn);          \
    }

// (DP, RF, NW, STAGES): the defaults of sdrt/gpu/cuda/attention.py MMA_VARIANT (RF 2 up to DP
// 80, where two m-tiles share every K/V fragment load; 1 above, for registers), and the
// alternatives the bench times (MMA_KERNELS there lists them all; MMA_STAGES the stages per
// DP: more for small DP, 2 above 80 so that sm_86/sm_89's 99 KiB per block still hold them).
MMA_KERNEL(16, 2, 4, 3)
MMA_KERNEL(32, 2, 4, 3)
MMA_KERNEL(48, 2, 4, 3)
MMA_KERNEL(64, 2, 4, 4)
MMA_KERNEL(80, 2, 4, 3)
MMA_KERNEL(96, 1, 4, 2)
MMA_KERNEL(128, 1, 4, 2)
MMA_KERNEL(160, 1, 4, 2)
MMA_KERNEL(48, 1, 4, 3)
MMA_KERNEL(64, 1, 4, 4)
MMA_KERNEL(128, 1, 8, 2)

// ---------------------------------------------------------------------------------------------
// Staging for the mma path: a strided 4-D view (ne [D, L, H, N], byte strides nb) into
// dst[N][H][L][Dpad] half (Dpad = D rounded up to 8, columns >= D zero), times `scale`. One
// thread writes one 16-byte chunk (8 halves); heads and batches on grid y/z.
template <typename Tin>
__device__ void pack_body(const char* src, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                          __half* dst, int D, int L, int H, int N, int Dpad, float scale) {
    const int CHn = Dpad / 8;
    const int total = L * CHn;
    for (int n = blockIdx.z; n < N; n += gridDim.z)
        for (int h = blockIdx.y; h < H; h += gridDim.y) {
            const char* base = src + (int64_t)n * nb3 + (int64_t)h * nb2;
            __half* dbase = dst + ((int64_t)n * H + h) * (int64_t)L * Dpad;
            for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
                const int l = idx / CHn, c = idx - l * CHn;
                const char* row = base + (int64_t)l * nb1;
                __half2 v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int d = c * 8 + 2 * e;
                    const float x0 = d < D ? load_f<Tin>(row, (int64_t)d * nb0) * scale : 0.0f;
                    const float x1 = d + 1 < D ? load_f<Tin>(row, (int64_t)(d + 1) * nb0) * scale : 0.0f;
                    v[e] = __floats2half2_rn(x0, x1);
                }
                *reinterpret_cast<uint4*>(dbase + (int64_t)l * Dpad + c * 8) = *reinterpret_cast<uint4*>(v);
            }
        }
}

#define PACK_KERNEL(NAME, TIN)                                                                     \
    extern "C" __global__ void NAME(const char* src, int64_t nb0, int64_t nb1, int64_t nb2,      \
                                    int64_t nb3, __half* dst, int D, int L, int H, int N,         \
                                    int Dpad, float scale) {                                      \
        pack_body<TIN>(src, nb0, nb1, nb2, nb3, dst, D, L, H, N, Dpad, scale);                    \
    }

PACK_KERNEL(attn_pack_f32, float)
PACK_KERNEL(attn_pack_f16, __half)
PACK_KERNEL(attn_pack_bf16, __nv_bfloat16)
