// Softmax and the normalizations (sdrt/ops/norm.py; CPU kernels: sdrt/ops/cpu/norm.py).
//
// Row ops (softmax, layer/rms/l2 norm) run one block per row of ne0 elements; the row is read
// through its byte strides (any view), the output is contiguous. Statistics are float,
// reduced with warp shuffles (the CPU accumulates in float64): per-thread partial sums are
// short and the tree over them is log2(threads) deep, and means are taken of x - x[0] so a
// large common offset (values around 1000 with unit spread) does not cost float32 precision.
//
// Group norm splits each (sample, group) into K chunks of the channel planes: gn_stats writes
// every chunk's sum and its squared deviations about its own mean (two passes over a chunk
// that stays in L2), gn_apply merges the K pairs (Chan et al., in double) into the group's mean
// and variance and writes its chunk. So a group of SD's 10 x 64 x 64 values is spread over K
// blocks instead of one.
#include "common.cuh"

namespace {

// small per-channel / per-column vectors (weights, biases, masks' dtype): 0 F32, 1 F16, 2 BF16
__device__ __forceinline__ float load_any(const char* p, int64_t off, int dtype) {
    if (dtype == 0) return load_f<float>(p, off);
    if (dtype == 1) return load_f<__half>(p, off);
    return load_f<bf16_t>(p, off);
}

// ---- reductions (blockDim.x is a multiple of 32, at most 1024) --------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

// every thread gets the block's total; `sh` holds 32 floats
__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    if (blockDim.x > 32) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        __syncthreads();  // an earlier reduction may still be reading sh
        if (lane == 0) sh[warp] = v;
        __syncthreads();
        v = warp_sum(lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.0f);
    }
    return v;
}

// ---- softmax ----------------------------------------------------------------------------------
// Online softmax state: the running max m and the sum s of exp(w - m).
__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -INFINITY) {  // both empty (all -inf so far): sums are 0
        s += s2;
        return;
    }
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

__device__ __forceinline__ void block_ms(float& m, float& s, float* shm, float* shs) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o), s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
        ms_merge(m, s, m2, s2);
    }
    if (blockDim.x > 32) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        __syncthreads();
        if (lane == 0) { shm[warp] = m; shs[warp] = s; }
        __syncthreads();
        const bool have = lane < (int)(blockDim.x >> 5);
        m = have ? shm[lane] : -INFINITY;
        s = have ? shs[lane] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o), s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
            ms_merge(m, s, m2, s2);
        }
    }
}

// w = x*scale + mask; a NaN w counts as -inf (the CPU kernel's max skips NaN and its exp gives 0)
template <typename TX, typename TM, bool MASK>
__device__ __forceinline__ float softmax_w(const char* xr, int64_t nb0, const char* mr, int64_t nbm0,
                                           int64_t i, float scale) {
    float w = load_f<TX>(xr, i * nb0) * scale;
    if (MASK) w += load_f<TM>(mr, i * nbm0);
    return w == w ? w : -INFINITY;
}

// one block per row (i1, i2, i3) of x [ne0, ne1, ne2, ne3]; the mask [ne0, m1, m2, m3] row is
// (m1 > 1 ? i1 : 0, i2 % m2, i3 % m3). A row that is all -inf gives NaN (0 * inf), as the CPU.
template <typename TX, typename TM, bool MASK>
__device__ __forceinline__ void softmax(const char* x, const char* mask, TX* out, int64_t ne0, int64_t ne1,
                                        int64_t ne2, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                                        int64_t m1, int64_t m2, int64_t m3, int64_t nbm0, int64_t nbm1,
                                        int64_t nbm2, int64_t nbm3, float scale) {
    __shared__ float shm[32], shs[32];
    const int64_t r = blockIdx.x;
    const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
    const char* xr = x + i1 * nb1 + i2 * nb2 + i3 * nb3;
    const char* mr = MASK ? mask + (m1 > 1 ? i1 : 0) * nbm1 + (i2 % m2) * nbm2 + (i3 % m3) * nbm3 : mask;
    float m = -INFINITY, s = 0.0f;
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float w = softmax_w<TX, TM, MASK>(xr, nb0, mr, nbm0, i, scale);
        if (w > m) {
            s = s * expf(m - w) + 1.0f;
            m = w;
        } else if (m != -INFINITY) {
            s += expf(w - m);
        }
    }
    block_ms(m, s, shm, shs);
    const float inv = 1.0f / s;
    TX* o = out + r * ne0;
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x)
        o[i] = from_f32<TX>(expf(softmax_w<TX, TM, MASK>(xr, nb0, mr, nbm0, i, scale) - m) * inv);
}

// ---- row norms: layer_norm(_affine), rms_norm, l2_norm -----------------------------------------
enum { LAYER, RMS, L2 };

// Rows of up to ROW_CACHE * blockDim elements are read from memory once into registers (the
// three passes read x three times); each thread sums its elements in the same order either way.
// TX is x's dtype, TO the output's (F32 results stored as F16 by fuse.py's half storage).
#define ROW_CACHE 8

// MOD: the DiT modulations. MOD_SHIFT, fuse.py's layer_norm -> mul(., w) -> add(., b): w and b are
// any broadcast views, row (i1, i2, i3) reading theirs at w + i1*wr1 + i2*wr2 + i3*wr3 (b alike),
// the value rounded after the product and after the sum as the unfused kernels (no FMA).
// MOD_SCALE, rms_norm -> mul(., w) -> mul(., b) (Z-Image's adaLN: w the norm's weight, b the
// 1 + scale vector, row strides as above): rounded after each product.
enum { MOD_NONE, MOD_SHIFT, MOD_SCALE };
template <int MODE, typename TX, typename TO, int MOD = MOD_NONE>
__device__ __forceinline__ void row_norm(const char* x, const char* w, const char* b, TO* out, int64_t ne0,
                                         int64_t ne1, int64_t ne2, int64_t nb0, int64_t nb1, int64_t nb2,
                                         int64_t nb3, int64_t nbw, int64_t nbb, int w_type, int b_type,
                                         float eps, int64_t wr1 = 0, int64_t wr2 = 0, int64_t wr3 = 0,
                                         int64_t br1 = 0, int64_t br2 = 0, int64_t br3 = 0) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x, bd = blockDim.x;
    const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
    const char* xr = x + i1 * nb1 + i2 * nb2 + i3 * nb3;
    if (MOD) {
        w += i1 * wr1 + i2 * wr2 + i3 * wr3;
        b += i1 * br1 + i2 * br2 + i3 * br3;
    }
    const bool cached = ne0 <= ROW_CACHE * bd;
    float xv[ROW_CACHE];
    if (cached) {
#pragma unroll
        for (int k = 0; k < ROW_CACHE; ++k) {
            const int64_t i = threadIdx.x + k * bd;
            xv[k] = i < ne0 ? load_f<TX>(xr, i * nb0) : 0.0f;
        }
    }
    // sum over the thread's elements of f(x_i)
    auto thread_sum = [&](auto f) {
        float s = 0.0f;
        if (cached) {
#pragma unroll
            for (int k = 0; k < ROW_CACHE; ++k)
                if (threadIdx.x + k * bd < ne0) s += f(xv[k]);
        } else {
            for (int64_t i = threadIdx.x; i < ne0; i += bd) s += f(load_f<TX>(xr, i * nb0));
        }
        return s;
    };
    float mean = 0.0f;
    if (MODE == LAYER) {
        const float shift = load_f<TX>(xr, 0);
        mean = shift + block_sum(thread_sum([&](float v) { return v - shift; }), sh) / (float)ne0;
    }
    const float s2 = block_sum(thread_sum([&](float v) { v -= mean; return v * v; }), sh);
    const float sc = MODE == L2 ? 1.0f / fmaxf(sqrtf(s2), eps) : 1.0f / sqrtf(s2 / (float)ne0 + eps);
    TO* o = out + r * ne0;
    auto store = [&](int64_t i, float xi) {
        float v = (xi - mean) * sc;
        if (MOD == MOD_SHIFT) {
            v = __fadd_rn(__fmul_rn(v, load_any(w, i * nbw, w_type)), load_any(b, i * nbb, b_type));
        } else if (MOD == MOD_SCALE) {
            v = __fmul_rn(__fmul_rn(v, load_any(w, i * nbw, w_type)), load_any(b, i * nbb, b_type));
        } else {
            if (w) v *= load_any(w, i * nbw, w_type);
            if (b) v += load_any(b, i * nbb, b_type);
        }
        o[i] = from_f32<TO>(v);
    };
    if (cached) {
#pragma unroll
        for (int k = 0; k < ROW_CACHE; ++k)
            if (threadIdx.x + k * bd < ne0) store(threadIdx.x + k * bd, xv[k]);
    } else {
        for (int64_t i = threadIdx.x; i < ne0; i += bd) store(i, load_f<TX>(xr, i * nb0));
    }
}

// ---- rms norm + rope (fuse.py: rope(mul(rms_norm(x), w), pe), a DiT block's QK norm and RoPE) ----
// One warp per row of D F32 values; lane holds pairs k = lane + 32 j < D/2 (values 2k, 2k+1:
// interleaved rope over all of D), so a row is read once and the sum of squares is a warp sum.
// Rows (h, l, n) of x [D, H, L, N] through byte strides; output row r = l + L (h + H n), rope's
// [D, L, H*N]; the 2x2 matrix of (pair k, token l) has element (i, j) at
// pe + l pb3 + k pb2 + i pb1 + j pb0. Rounded as the unfused kernels: x times the row's scale,
// times w, then rope's two products and their sum.
template <typename TO, int D>
__device__ __forceinline__ void rms_rope_pairs(const char* x, const char* w, const char* pe, TO* out,
                                               int64_t H, int64_t L, int64_t rows, int64_t nb1,
                                               int64_t nb2, int64_t nb3, int64_t nbw, int w_type,
                                               int64_t pb0, int64_t pb1, int64_t pb2, int64_t pb3,
                                               float eps) {
    constexpr int P = D / 2, PPL = (P + 31) / 32;   // pairs, pairs per lane
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int64_t r = (int64_t)blockIdx.x * warps + (threadIdx.x >> 5); r < rows;
         r += (int64_t)gridDim.x * warps) {
        const int64_t l = r % L, hn = r / L, h = hn % H, n = hn / H;
        const char* xr = x + h * nb1 + l * nb2 + n * nb3;
        float a[PPL], b[PPL], s = 0.0f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
            const int64_t k = lane + 32 * j;
            if (P % 32 != 0 && k >= P) {
                a[j] = b[j] = 0.0f;
                continue;
            }
            a[j] = load_f<float>(xr, 8 * k);
            b[j] = load_f<float>(xr, 8 * k + 4);
            s += a[j] * a[j];
            s += b[j] * b[j];
        }
        const float sc = 1.0f / sqrtf(warp_sum(s) / (float)D + eps);
        const char* pl = pe + l * pb3;
        TO* o = out + r * D;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
            const int64_t k = lane + 32 * j;
            if (P % 32 != 0 && k >= P) continue;
            const float va = __fmul_rn(a[j] * sc, load_any(w, 2 * k * nbw, w_type));
            const float vb = __fmul_rn(b[j] * sc, load_any(w, (2 * k + 1) * nbw, w_type));
            const char* m = pl + k * pb2;
            o[2 * k] = from_f32<TO>(va * load_f<float>(m, 0) + vb * load_f<float>(m, pb0));
            o[2 * k + 1] = from_f32<TO>(va * load_f<float>(m, pb1) + vb * load_f<float>(m, pb1 + pb0));
        }
    }
}

// ---- group norm -------------------------------------------------------------------------------
// x [W, H, C, N] through byte strides; block (k, g, n) owns plane positions [p0, p1) of the
// group's channels [g*per, min(C, (g+1)*per)), p = w + W*h. The walk over (channel, position)
// advances incrementally: no division per element when the planes are contiguous.
struct GroupChunk {
    int64_t c0, nc, p0, plen;
};

__device__ __forceinline__ GroupChunk group_chunk(int64_t C, int64_t per, int64_t WH, int K) {
    GroupChunk q;
    q.c0 = (int64_t)blockIdx.y * per;
    q.nc = min(C, q.c0 + per) - q.c0;
    q.p0 = (int64_t)blockIdx.x * WH / K;
    q.plen = ((int64_t)blockIdx.x + 1) * WH / K - q.p0;
    return q;
}

// f(c, p) for every element of the block's chunk
template <typename F>
__device__ __forceinline__ void walk_chunk(const GroupChunk& q, F f) {
    if (q.plen == 0) return;
    int64_t c = q.c0 + threadIdx.x / q.plen, p = threadIdx.x % q.plen;
    const int64_t c1 = q.c0 + q.nc, dc = blockDim.x / q.plen, dp = blockDim.x % q.plen;
    while (c < c1) {
        f(c, q.p0 + p);
        p += dp;
        c += dc;
        if (p >= q.plen) { p -= q.plen; ++c; }
    }
}

__device__ __forceinline__ int64_t plane_offset(int64_t p, int64_t W, int64_t nb0, int64_t nb1, bool contiguous) {
    return contiguous ? p * nb0 : (p % W) * nb0 + (p / W) * nb1;
}

// stats[((n*G + g)*K + k)*2 + {0, 1}] = chunk sum of (x - shift), chunk sum of (x - chunk mean)^2,
// shift = the group's first value (keeps a large common offset from costing precision)
template <typename T>
__device__ __forceinline__ void gn_stats(const char* x, float* stats, int64_t W, int64_t WH, int64_t C,
                                         int64_t per, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                                         int planes_contiguous) {
    __shared__ float sh[32];
    const int K = gridDim.x;
    const GroupChunk q = group_chunk(C, per, WH, K);
    const char* xn = x + (int64_t)blockIdx.z * nb3;
    const bool pc = planes_contiguous != 0;
    const float shift = load_f<T>(xn, q.c0 * nb2);
    float s = 0.0f;
    walk_chunk(q, [&](int64_t c, int64_t p) { s += load_f<T>(xn, c * nb2 + plane_offset(p, W, nb0, nb1, pc)) - shift; });
    s = block_sum(s, sh);
    const float cnt = (float)(q.nc * q.plen), mean = shift + (cnt > 0.0f ? s / cnt : 0.0f);
    float s2 = 0.0f;
    walk_chunk(q, [&](int64_t c, int64_t p) {
        const float v = load_f<T>(xn, c * nb2 + plane_offset(p, W, nb0, nb1, pc)) - mean;
        s2 += v * v;
    });
    s2 = block_sum(s2, sh);
    if (threadIdx.x == 0) {
        float* st = stats + (((int64_t)blockIdx.z * gridDim.y + blockIdx.y) * K + blockIdx.x) * 2;
        st[0] = s;
        st[1] = s2;
    }
}

// y = x*a + d with a = rstd*w[c], d = b[c] - mean*a (the CPU kernel's folding), then SiLU
template <typename T, typename TO>
__device__ __forceinline__ void gn_apply(const char* x, const float* stats, const char* w, const char* b, TO* out,
                                         int64_t W, int64_t WH, int64_t C, int64_t per, int64_t nb0,
                                         int64_t nb1, int64_t nb2, int64_t nb3, int planes_contiguous,
                                         int64_t nbw, int64_t nbb, int w_type, int b_type, float eps, int silu) {
    __shared__ float mean_rstd[2];
    const int K = gridDim.x;
    const GroupChunk q = group_chunk(C, per, WH, K);
    const char* xn = x + (int64_t)blockIdx.z * nb3;
    if (threadIdx.x == 0) {
        // Chan et al.: M2 = sum_k M2_k + n_k (mean_k - mean)^2 over the K chunks (double);
        // the chunk sums are of x - shift, so the shift cancels in mean_k - mean
        const float* st = stats + ((int64_t)blockIdx.z * gridDim.y + blockIdx.y) * K * 2;
        double sum = 0.0;
        for (int k = 0; k < K; ++k) sum += st[2 * k];
        const double total = (double)q.nc * (double)WH, shifted_mean = sum / total;
        double m2 = 0.0;
        for (int k = 0; k < K; ++k) {
            const double nk = (double)q.nc * (double)(((int64_t)k + 1) * WH / K - (int64_t)k * WH / K);
            if (nk > 0.0) {
                const double d = st[2 * k] / nk - shifted_mean;
                m2 += st[2 * k + 1] + nk * d * d;
            }
        }
        mean_rstd[0] = (float)((double)load_f<T>(xn, q.c0 * nb2) + shifted_mean);
        mean_rstd[1] = (float)(1.0 / sqrt(m2 / total + (double)eps));
    }
    __syncthreads();
    const float mean = mean_rstd[0], rstd = mean_rstd[1];
    TO* on = out + (int64_t)blockIdx.z * C * WH;
    const bool pc = planes_contiguous != 0;
    walk_chunk(q, [&](int64_t c, int64_t p) {
        const float a = w ? rstd * load_any(w, c * nbw, w_type) : rstd;
        const float d = (b ? load_any(b, c * nbb, b_type) : 0.0f) - mean * a;
        float v = load_f<T>(xn, c * nb2 + plane_offset(p, W, nb0, nb1, pc)) * a + d;
        if (silu) v = v / (1.0f + expf(-v));
        on[c * WH + p] = from_f32<TO>(v);
    });
}

}  // namespace

// ---- entry points -----------------------------------------------------------------------------
#define SOFTMAX_ENTRY(name, TX, TM, MASK)                                                              \
    extern "C" __global__ void name(const char* x, const char* mask, TX* out, int64_t ne0, int64_t ne1, \
                                    int64_t ne2, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,    \
                                    int64_t m1, int64_t m2, int64_t m3, int64_t nbm0, int64_t nbm1,     \
                                    int64_t nbm2, int64_t nbm3, float scale) {                          \
        softmax<TX, TM, MASK>(x, mask, out, ne0, ne1, ne2, nb0, nb1, nb2, nb3, m1, m2, m3, nbm0, nbm1,  \
                              nbm2, nbm3, scale);                                                       \
    }
#define SOFTMAX_TYPES(tx, TX)                                 \
    SOFTMAX_ENTRY(softmax_##tx, TX, float, false)             \
    SOFTMAX_ENTRY(softmax_##tx##_mask_f32, TX, float, true)   \
    SOFTMAX_ENTRY(softmax_##tx##_mask_f16, TX, __half, true)  \
    SOFTMAX_ENTRY(softmax_##tx##_mask_bf16, TX, bf16_t, true)
SOFTMAX_TYPES(f32, float)
SOFTMAX_TYPES(f16, __half)
SOFTMAX_TYPES(bf16, bf16_t)

#define ROW_NORM_ENTRY(name, MODE, TX, TO)                                                             \
    extern "C" __global__ void name(const char* x, const char* w, const char* b, TO* out, int64_t ne0, \
                                    int64_t ne1, int64_t ne2, int64_t nb0, int64_t nb1, int64_t nb2,    \
                                    int64_t nb3, int64_t nbw, int64_t nbb, int w_type, int b_type,      \
                                    float eps) {                                                        \
        row_norm<MODE, TX, TO>(x, w, b, out, ne0, ne1, ne2, nb0, nb1, nb2, nb3, nbw, nbb, w_type, b_type, eps); \
    }
#define ROW_NORM_TYPES(mode, MODE)                              \
    ROW_NORM_ENTRY(mode##_f32, MODE, float, float)              \
    ROW_NORM_ENTRY(mode##_f16, MODE, __half, __half)            \
    ROW_NORM_ENTRY(mode##_bf16, MODE, bf16_t, bf16_t)
ROW_NORM_TYPES(layer_norm, LAYER)
ROW_NORM_TYPES(rms_norm, RMS)
ROW_NORM_TYPES(l2_norm, L2)
// F32 layer norms stored as F16/BF16 and read back (fuse.py's half storage)
ROW_NORM_ENTRY(layer_norm_f32_to_f16, LAYER, float, __half)
ROW_NORM_ENTRY(layer_norm_f32_to_bf16, LAYER, float, bf16_t)
ROW_NORM_ENTRY(layer_norm_f16_to_f32, LAYER, __half, float)
// F32 rms norms (the fused QK norm, rms_norm_scaled) stored as F16/BF16 for the join or GEMM reading them
ROW_NORM_ENTRY(rms_norm_f32_to_f16, RMS, float, __half)
ROW_NORM_ENTRY(rms_norm_f32_to_bf16, RMS, float, bf16_t)

// the modulated norms (row_norm's MOD): w and b with per-row strides
#define NORM_MOD_ENTRY(name, MODE, MOD, TX, TO)                                                             \
    extern "C" __global__ void name(const char* x, const char* w, const char* b, TO* out, int64_t ne0, \
                                    int64_t ne1, int64_t ne2, int64_t nb0, int64_t nb1, int64_t nb2,    \
                                    int64_t nb3, int64_t nbw, int64_t nbb, int w_type, int b_type,      \
                                    float eps, int64_t wr1, int64_t wr2, int64_t wr3, int64_t br1,      \
                                    int64_t br2, int64_t br3) {                                         \
        row_norm<MODE, TX, TO, MOD>(x, w, b, out, ne0, ne1, ne2, nb0, nb1, nb2, nb3, nbw, nbb, w_type, \
                                      b_type, eps, wr1, wr2, wr3, br1, br2, br3);                       \
    }
NORM_MOD_ENTRY(layer_norm_mod_f32, LAYER, MOD_SHIFT, float, float)
NORM_MOD_ENTRY(layer_norm_mod_f32_to_f16, LAYER, MOD_SHIFT, float, __half)
NORM_MOD_ENTRY(layer_norm_mod_f32_to_bf16, LAYER, MOD_SHIFT, float, bf16_t)
// the rms one (fuse.py: rms_norm -> mul(., weight) -> mul(., 1 + scale))
NORM_MOD_ENTRY(rms_norm_mod_f32, RMS, MOD_SCALE, float, float)
NORM_MOD_ENTRY(rms_norm_mod_f32_to_f16, RMS, MOD_SCALE, float, __half)
NORM_MOD_ENTRY(rms_norm_mod_f32_to_bf16, RMS, MOD_SCALE, float, bf16_t)

#define RMS_ROPE_ENTRY(name, TO, D)                                                                    \
    extern "C" __global__ void name(const char* x, const char* w, const char* pe, TO* out, int64_t H,   \
                                    int64_t L, int64_t rows, int64_t nb1, int64_t nb2, int64_t nb3,     \
                                    int64_t nbw, int w_type, int64_t pb0, int64_t pb1, int64_t pb2,     \
                                    int64_t pb3, float eps) {                                           \
        rms_rope_pairs<TO, D>(x, w, pe, out, H, L, rows, nb1, nb2, nb3, nbw, w_type, pb0, pb1, pb2, pb3, \
                                eps);                                                                   \
    }
// head dims 16 to 256 (ops/norm.py RMS_ROPE_DIMS; the small ones are the test models'); F32 in,
// F32 or F16 (for the attention) out
#define RMS_ROPE_DIM(d) RMS_ROPE_ENTRY(rms_rope_d##d##_f32, float, d) RMS_ROPE_ENTRY(rms_rope_d##d##_f32_to_f16, __half, d)
RMS_ROPE_DIM(16)
RMS_ROPE_DIM(32)
RMS_ROPE_DIM(64)
RMS_ROPE_DIM(128)
RMS_ROPE_DIM(256)

#define GROUP_NORM_APPLY_ENTRY(name, T, TO)                                                             \
    extern "C" __global__ void name(                                                                    \
        const char* x, const float* stats, const char* w, const char* b, TO* out, int64_t W, int64_t WH, \
        int64_t C, int64_t per, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,                     \
        int planes_contiguous, int64_t nbw, int64_t nbb, int w_type, int b_type, float eps, int silu) { \
        gn_apply<T, TO>(x, stats, w, b, out, W, WH, C, per, nb0, nb1, nb2, nb3, planes_contiguous, nbw, \
                        nbb, w_type, b_type, eps, silu);                                                \
    }
#define GROUP_NORM_ENTRIES(t, T)                                                                        \
    extern "C" __global__ void group_norm_stats_##t(const char* x, float* stats, int64_t W, int64_t WH, \
                                                    int64_t C, int64_t per, int64_t nb0, int64_t nb1,   \
                                                    int64_t nb2, int64_t nb3, int planes_contiguous) {  \
        gn_stats<T>(x, stats, W, WH, C, per, nb0, nb1, nb2, nb3, planes_contiguous);                    \
    }                                                                                                   \
    GROUP_NORM_APPLY_ENTRY(group_norm_apply_##t, T, T)
GROUP_NORM_ENTRIES(f32, float)
GROUP_NORM_ENTRIES(f16, __half)
GROUP_NORM_ENTRIES(bf16, bf16_t)
// an F32 group norm stored as F16/BF16 (fuse.py's half storage)
GROUP_NORM_APPLY_ENTRY(group_norm_apply_f32_to_f16, float, __half)
GROUP_NORM_APPLY_ENTRY(group_norm_apply_f32_to_bf16, float, bf16_t)
