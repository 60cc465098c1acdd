// Positional ops (sdrt/ops/position.py; CPU kernels: sdrt/ops/cpu/position.py): arange,
// timestep_embedding, rope (sd.cpp's precomputed-pe form) and rope_ext (ggml_rope_ext /
// ggml_rope_multi).
//
// rope_ext runs in two launches: rope_cache builds the (cos, sin) table of every (token, pair)
// with ggml's float32 arithmetic, which sdrt.ops.position.rope_cache mirrors on the CPU —
// theta is a running product pos*s*s*... (not pos*s^k), then YaRN's mix and the attention
// factor; the products are written with __fmul_rn/__fadd_rn so the compiler cannot fuse them
// into FMAs numpy does not do. rope_rotate then rotates every row through that table.
#include "common.cuh"

namespace {

// ---- timestep_embedding -----------------------------------------------------------------------
// out [dim, n] F32: cos(t*f_j) for j < half, sin(t*f_j) for half <= j < 2*half, 0 for an odd
// dim's last column; f_j = exp(-ln(max_period) * j / half) in float32, as ggml and the CPU.
template <typename T>
__device__ __forceinline__ void timestep_embedding(const char* t, float* out, int64_t nbt, int dim, int half,
                                                   float neg_log_max_period) {
    const int64_t i = blockIdx.x;
    const float ts = load_f<T>(t, i * nbt);
    float* o = out + i * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float v = 0.0f;
        if (j < 2 * half) {
            const int k = j < half ? j : j - half;
            const float f = expf(__fdiv_rn(__fmul_rn(neg_log_max_period, (float)k), (float)half));
            const float arg = __fmul_rn(ts, f);
            v = j < half ? cosf(arg) : sinf(arg);
        }
        o[j] = v;
    }
}

// ---- rope (sd.cpp ggml_ext_rope_apply) --------------------------------------------------------
// x [D, H, L, N] through byte strides; pe F32 [2, 2, R, L] through byte strides holding
// [[m00, m01], [m10, m11]] per (pair, token); out [D, L, H*N] contiguous. Pair i is
// (2i, 2i+1) when interleaved, else (i, i+R); channels from 2R on are copied.
template <typename T, typename TO = T>
__device__ __forceinline__ void rope_pe(const char* x, const char* pe, TO* out, int64_t H, int64_t L,
                                        int64_t D, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                                        int64_t pb0, int64_t pb1, int64_t pb2, int64_t pb3, int64_t R,
                                        int interleaved) {
    const int64_t r = blockIdx.x;  // output row: token l of head-batch hn = n*H + h
    const int64_t l = r % L, hn = r / L, h = hn % H, n = hn / H;
    const char* xr = x + h * nb1 + l * nb2 + n * nb3;
    const char* pl = pe + l * pb3;
    TO* o = out + r * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float v;
        if (d < 2 * R) {
            int64_t k, ia, ib;
            int second;
            if (interleaved) {
                k = d >> 1; ia = 2 * k; ib = ia + 1; second = (int)(d & 1);
            } else {
                k = d < R ? d : d - R; ia = k; ib = k + R; second = d >= R;
            }
            const float a = load_f<T>(xr, ia * nb0), b = load_f<T>(xr, ib * nb0);
            const char* m = pl + k * pb2 + second * pb1;  // row `second` of the 2x2 matrix
            v = a * load_f<float>(m, 0) + b * load_f<float>(m, pb0);
        } else {
            v = load_f<T>(xr, d * nb0);
        }
        o[d] = from_f32<TO>(v);
    }
}

// The common case of the same op (Flux's rope: interleaved pairs, every channel rotated, x rows
// contiguous along D, pe's 2x2 matrices contiguous): one thread per pair, its two values and its
// matrix read as one vector each (the kernel above spends one block per row and reads each value
// twice). A block takes 256 / P whole rows (P = D / 2 pairs, a power of two up to 256), rows on
// a grid-stride loop; the products and sums are rounded as above.
template <typename T, typename TO>
__device__ __forceinline__ void rope_pe_pairs(const char* x, const char* pe, TO* out, int64_t H, int64_t L,
                                              int64_t rows, int P, int64_t nb1, int64_t nb2, int64_t nb3,
                                              int64_t pb2, int64_t pb3) {
    const int per = blockDim.x / P, k = threadIdx.x % P;
    for (int64_t r = (int64_t)blockIdx.x * per + threadIdx.x / P; r < rows; r += (int64_t)gridDim.x * per) {
        const int64_t l = r % L, hn = r / L, h = hn % H, n = hn / H;
        const T* xp = reinterpret_cast<const T*>(x + h * nb1 + l * nb2 + n * nb3) + 2 * k;
        const float a = to_f32(xp[0]), b = to_f32(xp[1]);
        const float4 m = *reinterpret_cast<const float4*>(pe + l * pb3 + k * pb2);   // m00 m01 m10 m11
        TO* o = out + r * 2 * P + 2 * k;
        o[0] = from_f32<TO>(a * m.x + b * m.y);
        o[1] = from_f32<TO>(a * m.z + b * m.w);
    }
}

// ---- rope_ext: the (cos, sin) table -----------------------------------------------------------
enum { MODE_NORMAL = 0, MODE_NEOX = 2, MODE_MROPE = 8, MODE_VISION = 24, MODE_IMROPE = 40 };

// cache[l*P + k] = cos, cache[L*P + l*P + k] = sin of pair k of token l (P pairs). Each thread
// replays the CPU's loop over pairs 0..k for its token: the running products and the vision
// sections' restarts come out exactly as there.
__device__ __forceinline__ void rope_cache(const int* pos, const float* ff, float* cache, int64_t L,
                                           int64_t nbpos, int64_t nbff, int P, int mode, int s0, int s1,
                                           int s2, int s3, float theta_scale, float low, float high,
                                           float freq_scale, float ext_factor, float mscale) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= L * P) return;
    const int64_t l = idx / P;
    const int k = (int)(idx % P);
    const bool multi = mode == MODE_MROPE || mode == MODE_IMROPE || mode == MODE_VISION;
    const bool vision = mode == MODE_VISION;
    const char* pb = reinterpret_cast<const char*>(pos);
    float base[4], theta[4];
    for (int a = 0; a < 4; ++a) {
        base[a] = (multi || a == 0) ? (float)*reinterpret_cast<const int*>(pb + ((int64_t)a * L + l) * nbpos) : 0.0f;
        theta[a] = base[a];
    }
    const int sect_dims = s0 + s1 + s2 + s3, sec_w = s0 + s1, sec_e = sec_w + s2;
    int axis = 0;
    for (int j = 0; j <= k; ++j) {
        axis = 0;
        if (multi) {
            const int sector = j % sect_dims;
            if (vision) {  // each section restarts its running product
                if (sector == 0) theta[0] = base[0];
                else if (sector == s0) theta[1] = base[1];
                else if (sector == sec_w) theta[2] = base[2];
                else if (sector == sec_e) theta[3] = base[3];
            }
            if (mode == MODE_IMROPE) {
                if (sector % 3 == 1 && sector < 3 * s1) axis = 1;
                else if (sector % 3 == 2 && sector < 3 * s2) axis = 2;
                else if (sector % 3 == 0 && sector < 3 * s0) axis = 0;
                else axis = 3;
            } else {
                axis = sector < s0 ? 0 : sector < sec_w ? 1 : sector < sec_w + s2 ? 2 : 3;
            }
        }
        if (j < k)
            for (int a = 0; a < 4; ++a) theta[a] = __fmul_rn(theta[a], theta_scale);
    }
    const float f = ff ? *reinterpret_cast<const float*>(reinterpret_cast<const char*>(ff) + k * nbff) : 1.0f;
    const float extrap = __fdiv_rn(theta[axis], f);
    float th = __fmul_rn(freq_scale, extrap);
    if (ext_factor != 0.0f) {
        const float y = __fdiv_rn(__fsub_rn((float)k, low), fmaxf(0.001f, __fsub_rn(high, low)));
        const float mix = __fmul_rn(__fsub_rn(1.0f, fminf(1.0f, fmaxf(0.0f, y))), ext_factor);
        th = __fadd_rn(__fmul_rn(th, __fsub_rn(1.0f, mix)), __fmul_rn(extrap, mix));
    }
    cache[l * P + k] = __fmul_rn(cosf(th), mscale);
    cache[L * P + l * P + k] = __fmul_rn(sinf(th), mscale);
}

// ---- rope_ext: rotate -------------------------------------------------------------------------
// x [D, H, L, N] through byte strides, out the same shape contiguous; one block per row
// (h, l, n). kind 0: pairs (o+2k, o+2k+1); 1: (o+k, o+k+n_dims/2); 2 (vision): (k, k+n_dims)
// over the whole head. Channels outside [o, o+n_dims) are copied (kinds 0 and 1).
template <typename T, typename TO = T>
__device__ __forceinline__ void rope_rotate(const char* x, const float* cache, TO* out, int64_t D, int64_t H,
                                            int64_t L, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                                            int n_dims, int n_offs, int kind, int P) {
    const int64_t r = blockIdx.x;
    const int64_t h = r % H, l = (r / H) % L, n = r / (H * L);
    const char* xr = x + h * nb1 + l * nb2 + n * nb3;
    const float* cs = cache + l * P;
    const float* sn = cache + L * P + l * P;
    TO* o = out + r * D;
    const int half = kind == 2 ? n_dims : n_dims / 2;
    const int lo = kind == 2 ? 0 : n_offs, hi = kind == 2 ? 2 * n_dims : n_offs + n_dims;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float v;
        if (d >= lo && d < hi) {
            const int rel = (int)(d - lo);
            int k, ia, ib, second;
            if (kind == 0) {
                k = rel >> 1; ia = lo + 2 * k; ib = ia + 1; second = rel & 1;
            } else {
                second = rel >= half; k = second ? rel - half : rel; ia = lo + k; ib = ia + half;
            }
            const float a = load_f<T>(xr, ia * nb0), b = load_f<T>(xr, ib * nb0);
            v = second ? a * sn[k] + b * cs[k] : a * cs[k] - b * sn[k];
        } else {
            v = load_f<T>(xr, d * nb0);
        }
        o[d] = from_f32<TO>(v);
    }
}

}  // namespace

// ---- entry points -----------------------------------------------------------------------------
// out[i] = start + step*i, rounded as the CPU's float32 (no FMA)
extern "C" __global__ void arange_f32(float* out, int64_t n, float start, float step) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __fadd_rn(start, __fmul_rn(step, (float)i));
}

#define TSEMB_ENTRY(t, T)                                                                               \
    extern "C" __global__ void timestep_embedding_##t(const char* ts, float* out, int64_t nbt, int dim, \
                                                      int half, float neg_log_max_period) {             \
        timestep_embedding<T>(ts, out, nbt, dim, half, neg_log_max_period);                             \
    }
TSEMB_ENTRY(f32, float)
TSEMB_ENTRY(f16, __half)
TSEMB_ENTRY(bf16, bf16_t)

// the _to_ ones: an F32 result stored as F16 for the attention that reads it (fuse.py)
#define ROPE_PE_ENTRY(t, T, TO)                                                                          \
    extern "C" __global__ void rope_pe_##t(const char* x, const char* pe, TO* out, int64_t H, int64_t L, \
                                           int64_t D, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3, \
                                           int64_t pb0, int64_t pb1, int64_t pb2, int64_t pb3, int64_t R, \
                                           int interleaved) {                                            \
        rope_pe<T, TO>(x, pe, out, H, L, D, nb0, nb1, nb2, nb3, pb0, pb1, pb2, pb3, R, interleaved);     \
    }
ROPE_PE_ENTRY(f32, float, float)
ROPE_PE_ENTRY(f16, __half, __half)
ROPE_PE_ENTRY(bf16, bf16_t, bf16_t)
ROPE_PE_ENTRY(f32_to_f16, float, __half)

#define ROPE_PAIRS_ENTRY(t, T, TO)                                                                       \
    extern "C" __global__ void rope_pe_pairs_##t(const char* x, const char* pe, TO* out, int64_t H,     \
                                                 int64_t L, int64_t rows, int P, int64_t nb1, int64_t nb2, \
                                                 int64_t nb3, int64_t pb2, int64_t pb3) {               \
        rope_pe_pairs<T, TO>(x, pe, out, H, L, rows, P, nb1, nb2, nb3, pb2, pb3);                      \
    }
ROPE_PAIRS_ENTRY(f32, float, float)
ROPE_PAIRS_ENTRY(f16, __half, __half)
ROPE_PAIRS_ENTRY(bf16, bf16_t, bf16_t)
ROPE_PAIRS_ENTRY(f32_to_f16, float, __half)

extern "C" __global__ void rope_cache_f32(const int* pos, const float* ff, float* cache, int64_t L,
                                          int64_t nbpos, int64_t nbff, int P, int mode, int s0, int s1,
                                          int s2, int s3, float theta_scale, float low, float high,
                                          float freq_scale, float ext_factor, float mscale) {
    rope_cache(pos, ff, cache, L, nbpos, nbff, P, mode, s0, s1, s2, s3, theta_scale, low, high, freq_scale,
               ext_factor, mscale);
}

#define ROPE_ROTATE_ENTRY(t, T, TO)                                                                      \
    extern "C" __global__ void rope_rotate_##t(const char* x, const float* cache, TO* out, int64_t D,    \
                                               int64_t H, int64_t L, int64_t nb0, int64_t nb1, int64_t nb2, \
                                               int64_t nb3, int n_dims, int n_offs, int kind, int P) {   \
        rope_rotate<T, TO>(x, cache, out, D, H, L, nb0, nb1, nb2, nb3, n_dims, n_offs, kind, P);         \
    }
ROPE_ROTATE_ENTRY(f32, float, float)
ROPE_ROTATE_ENTRY(f16, __half, __half)
ROPE_ROTATE_ENTRY(bf16, bf16_t, bf16_t)
ROPE_ROTATE_ENTRY(f32_to_f16, float, __half)
