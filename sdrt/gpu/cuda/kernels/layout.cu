// Layout and resampling kernels: pad, repeat, concat (a strided 4-D copy), upscale.
//
// Tensors follow ggml: ne[0] innermost; sources are read through byte strides nb (int64), so
// any view (permute, transpose, slice) works; outputs are contiguous. Data movement copies raw
// storage as unsigned ints of the element size (u8/u16/u32/u64), so every non-block dtype moves
// bit exact. Bilinear/bicubic resampling reads F32/F16/BF16, accumulates in float and recomputes
// each axis's taps per output element with the float32 coordinate formulas of the CPU kernel
// (sdrt/ops/cpu/layout.py axis_taps), so no per-axis tables need device memory.
//
// Every kernel is a 1-D grid-stride loop over output elements. The flat index and its
// decomposition into (i0, i1, i2, i3) run in uint32 when the tensor has < 2^31 elements (64-bit
// integer division costs several times more and dominates these memory-light kernels); byte
// offsets are always int64.
#include "common.cuh"

// flat index i of a contiguous (n0, n1, n2, *) tensor -> j[0..3]
template <typename I>
__device__ __forceinline__ void unravel4(I i, I n0, I n1, I n2, int64_t* j) {
    I t = i / n0;
    j[0] = (int64_t)(i - t * n0);
    I u = t / n1;
    j[1] = (int64_t)(t - u * n1);
    t = u / n2;
    j[2] = (int64_t)(u - t * n2);
    j[3] = (int64_t)t;
}

// Calls f(i, i0, i1, i2, i3) for every flat index i (of type I) of a contiguous (n0, n1, n2, n3)
// tensor, grid-stride. f by reference: a copy made nvcc order pad's code differently.
template <typename I, typename F>
__device__ __forceinline__ void for_each_index4(int64_t n0, int64_t n1, int64_t n2, int64_t n3, const F& f) {
    const I total = (I)(n0 * n1 * n2 * n3);
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)blockDim.x * gridDim.x) {
        int64_t j[4];
        unravel4<I>(i, (I)n0, (I)n1, (I)n2, j);
        f(i, j[0], j[1], j[2], j[3]);
    }
}

// impl<T, uint32_t>(...) when the n elements have 32-bit indices, else impl<T, int64_t>(...)
#define WITH_INDEX_TYPE(n, impl, T, ...)   \
    if ((n) < INT32_MAX) {                 \
        impl<T, uint32_t>(__VA_ARGS__);    \
    } else {                               \
        impl<T, int64_t>(__VA_ARGS__);     \
    }

// the parameters int64_t x0 .. x3, and the arguments x0 .. x3
#define DIMS4(x) int64_t x##0, int64_t x##1, int64_t x##2, int64_t x##3
#define ARGS4(x) x##0, x##1, x##2, x##3

// ---- pad -------------------------------------------------------------------------------------
// modes as sdrt.ops.layout.PAD_MODES: constant, circular, reflect, replicate
enum { PAD_CONSTANT = 0, PAD_CIRCULAR = 1, PAD_REFLECT = 2, PAD_REPLICATE = 3 };

// source index of output index i along one dim padded by `lo` on the left; -1 = fill
__device__ __forceinline__ int64_t pad_index(int64_t i, int64_t lo, int64_t n, int mode) {
    int64_t j = i - lo;
    if (mode == PAD_CONSTANT) return (j >= 0 && j < n) ? j : -1;
    if (mode == PAD_CIRCULAR) { j %= n; return j < 0 ? j + n : j; }
    if (mode == PAD_REPLICATE) return j < 0 ? 0 : (j >= n ? n - 1 : j);
    // reflect without repeating the edge; padding < n (checked when the node is built)
    if (j < 0) j = -j;
    return j >= n ? 2 * (n - 1) - j : j;
}

template <typename T, typename I>
__device__ void pad_impl(T* __restrict__ dst, const char* __restrict__ src, DIMS4(n), DIMS4(nb), DIMS4(o),
                         DIMS4(lo), int mode, T fill) {
    for_each_index4<I>(o0, o1, o2, o3, [&](I i, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        const int64_t j0 = pad_index(i0, lo0, n0, mode), j1 = pad_index(i1, lo1, n1, mode);
        const int64_t j2 = pad_index(i2, lo2, n2, mode), j3 = pad_index(i3, lo3, n3, mode);
        if ((j0 | j1 | j2 | j3) < 0) {
            dst[i] = fill;
        } else {
            dst[i] = *(const T*)(src + j0 * nb0 + j1 * nb1 + j2 * nb2 + j3 * nb3);
        }
    });
}

#define PAD_KERNEL(suffix, T)                                                                              \
    extern "C" __global__ void pad_##suffix(T* dst, const char* src, DIMS4(n), DIMS4(nb), DIMS4(o),        \
                                            DIMS4(lo), int mode, int64_t fill_bits) {                      \
        WITH_INDEX_TYPE(o0 * o1 * o2 * o3, pad_impl, T, dst, src, ARGS4(n), ARGS4(nb), ARGS4(o), ARGS4(lo), \
                        mode, (T)(uint64_t)fill_bits)                                                      \
    }
PAD_KERNEL(u8, uint8_t)
PAD_KERNEL(u16, uint16_t)
PAD_KERNEL(u32, uint32_t)
PAD_KERNEL(u64, uint64_t)

// ---- repeat ----------------------------------------------------------------------------------
// out[i3,i2,i1,i0] = src[i3 % n3, i2 % n2, i1 % n1, i0 % n0]
template <typename T, typename I>
__device__ void repeat_impl(T* __restrict__ dst, const char* __restrict__ src, DIMS4(n), DIMS4(nb), DIMS4(o)) {
    for_each_index4<I>(o0, o1, o2, o3, [&](I i, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        const int64_t j0 = (int64_t)((I)i0 % (I)n0), j1 = (int64_t)((I)i1 % (I)n1);
        const int64_t j2 = (int64_t)((I)i2 % (I)n2), j3 = (int64_t)((I)i3 % (I)n3);
        dst[i] = *(const T*)(src + j0 * nb0 + j1 * nb1 + j2 * nb2 + j3 * nb3);
    });
}

#define REPEAT_KERNEL(suffix, T)                                                                           \
    extern "C" __global__ void repeat_##suffix(T* dst, const char* src, DIMS4(n), DIMS4(nb), DIMS4(o)) {   \
        WITH_INDEX_TYPE(o0 * o1 * o2 * o3, repeat_impl, T, dst, src, ARGS4(n), ARGS4(nb), ARGS4(o))        \
    }
REPEAT_KERNEL(u8, uint8_t)
REPEAT_KERNEL(u16, uint16_t)
REPEAT_KERNEL(u32, uint32_t)
REPEAT_KERNEL(u64, uint64_t)

// ---- strided copy (concat writes each source into its slot of the output) ----------------------
// dst[i3,i2,i1,i0] (byte strides dnb*) = src[i3,i2,i1,i0] (byte strides snb*), shape ne*
template <typename T, typename I>
__device__ void copy4d_impl(char* __restrict__ dst, DIMS4(dnb), const char* __restrict__ src, DIMS4(snb),
                            DIMS4(n)) {
    for_each_index4<I>(n0, n1, n2, n3, [&](I, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        *(T*)(dst + i0 * dnb0 + i1 * dnb1 + i2 * dnb2 + i3 * dnb3) =
            *(const T*)(src + i0 * snb0 + i1 * snb1 + i2 * snb2 + i3 * snb3);
    });
}

#define COPY4D_KERNEL(suffix, T)                                                                           \
    extern "C" __global__ void copy4d_##suffix(char* dst, DIMS4(dnb), const char* src, DIMS4(snb),          \
                                               DIMS4(n)) {                                                 \
        WITH_INDEX_TYPE(n0 * n1 * n2 * n3, copy4d_impl, T, dst, ARGS4(dnb), src, ARGS4(snb), ARGS4(n))     \
    }
COPY4D_KERNEL(u8, uint8_t)
COPY4D_KERNEL(u16, uint16_t)
COPY4D_KERNEL(u32, uint32_t)
COPY4D_KERNEL(u64, uint64_t)

// the same walk converting float dtypes (a concat stored as F16/BF16 by fuse.py whose sources'
// parts are not contiguous runs); bf16_t rounds as the cast kernels and sdrt/ops/convert.py
template <typename TS, typename TD> struct Convert { using S = TS; using D = TD; };

template <typename C, typename I>
__device__ void cast4d_impl(char* __restrict__ dst, DIMS4(dnb), const char* __restrict__ src, DIMS4(snb),
                            DIMS4(n)) {
    for_each_index4<I>(n0, n1, n2, n3, [&](I, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        *(typename C::D*)(dst + i0 * dnb0 + i1 * dnb1 + i2 * dnb2 + i3 * dnb3) =
            from_f32<typename C::D>(load_f<typename C::S>(src, i0 * snb0 + i1 * snb1 + i2 * snb2 + i3 * snb3));
    });
}

#define CAST4D_KERNEL(s, d, TS, TD)                                                                        \
    extern "C" __global__ void cast4d_##s##_##d(char* dst, DIMS4(dnb), const char* src, DIMS4(snb),         \
                                                DIMS4(n)) {                                                \
        using C = Convert<TS, TD>;                                                                         \
        WITH_INDEX_TYPE(n0 * n1 * n2 * n3, cast4d_impl, C, dst, ARGS4(dnb), src, ARGS4(snb), ARGS4(n))     \
    }
CAST4D_KERNEL(f32, f16, float, __half)
CAST4D_KERNEL(f32, bf16, float, bf16_t)
CAST4D_KERNEL(f16, f32, __half, float)
CAST4D_KERNEL(bf16, f32, bf16_t, float)
CAST4D_KERNEL(f16, bf16, __half, bf16_t)
CAST4D_KERNEL(bf16, f16, bf16_t, __half)

// ---- upscale: nearest ------------------------------------------------------------------------
// ggml: floor(i / sf) with sf = (float)out / in, float32, clamped to the last index
__device__ __forceinline__ int64_t nearest_index(int64_t i, int64_t n_in, int64_t n_out) {
    const float sf = (float)n_out / (float)n_in;
    const int64_t j = (int64_t)((float)i / sf);
    return j < n_in - 1 ? j : n_in - 1;
}

template <typename T, typename I>
__device__ void upscale_nearest_impl(T* __restrict__ dst, const char* __restrict__ src, DIMS4(n), DIMS4(nb),
                                     DIMS4(o)) {
    for_each_index4<I>(o0, o1, o2, o3, [&](I i, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        dst[i] = *(const T*)(src + nearest_index(i0, n0, o0) * nb0 + nearest_index(i1, n1, o1) * nb1 +
                             nearest_index(i2, n2, o2) * nb2 + nearest_index(i3, n3, o3) * nb3);
    });
}

#define UPSCALE_NEAREST_KERNEL(suffix, T)                                                                  \
    extern "C" __global__ void upscale_nearest_##suffix(T* dst, const char* src, DIMS4(n), DIMS4(nb),       \
                                                        DIMS4(o)) {                                        \
        WITH_INDEX_TYPE(o0 * o1 * o2 * o3, upscale_nearest_impl, T, dst, src, ARGS4(n), ARGS4(nb),          \
                        ARGS4(o))                                                                          \
    }
UPSCALE_NEAREST_KERNEL(u8, uint8_t)
UPSCALE_NEAREST_KERNEL(u16, uint16_t)
UPSCALE_NEAREST_KERNEL(u32, uint32_t)
UPSCALE_NEAREST_KERNEL(u64, uint64_t)

// ---- upscale: bilinear / bicubic / antialiased bilinear ----------------------------------------
enum { INTERP_BILINEAR = 1, INTERP_BICUBIC = 2 };

// The taps of one output index along one axis: up to MAX_TAPS (index, weight) pairs, or a
// window [lo, hi) whose weights are computed on demand (antialias, any width).
struct AxisTaps {
    int count;        // direct taps (bilinear 2, bicubic 4); 0 = antialias window
    int64_t idx[4];
    float w[4];
    // antialias window
    int64_t lo, hi;
    float cc, off, inv, norm;  // centre, pixel offset, 1/support, 1/sum of weights (0: none)
};

// float32 source coordinate (i + off) / sf - off, as ggml / sdrt.ops.cpu.layout._coord
__device__ __forceinline__ float src_coord(int64_t n_in, int64_t n_out, bool align_corners, int64_t i,
                                           float* sf_out, float* off_out) {
    float sf = (float)n_out / (float)n_in;
    float off = 0.5f;
    if (align_corners) {
        off = 0.0f;
        if (n_out > 1 && n_in > 1) sf = (float)(n_out - 1) / (float)(n_in - 1);
    }
    *sf_out = sf;
    *off_out = off;
    return ((float)i + off) / sf - off;
}

__device__ __forceinline__ int64_t clamp_index(int64_t j, int64_t n) {
    return j < 0 ? 0 : (j > n - 1 ? n - 1 : j);
}

// antialias triangle weight, computed in double then rounded as the CPU kernel's numpy does
// (int64 index - float32 centre promotes to float64)
__device__ __forceinline__ float aa_weight(int64_t k, float cc, float off, float inv) {
    const double v = ((double)k - (double)cc + (double)off) * (double)inv;
    const double w = 1.0 - fabs(v);
    return (float)(w > 0.0 ? w : 0.0);
}

__device__ void axis_taps(int64_t n_in, int64_t n_out, int mode, bool align_corners, bool antialias,
                          int64_t i, AxisTaps* t) {
    float sf, off;
    const float c = src_coord(n_in, n_out, align_corners, i, &sf, &off);
    if (mode == INTERP_BILINEAR && antialias) {
        // window centre (i + off) / sf, support widened to 1/sf when downscaling (ggml = torch)
        const float cc = c + off;
        const float support = (float)fmax(1.0, 1.0 / (double)sf);
        const float inv = 1.0f / support;
        int64_t lo = (int64_t)(cc - support + off);
        int64_t hi = (int64_t)(cc + support + off);
        lo = lo > 0 ? lo : 0;
        hi = hi < n_in ? hi : n_in;
        float tot = 0.0f;
        for (int64_t k = lo; k < hi; ++k) tot += aa_weight(k, cc, off, inv);
        t->count = 0;
        t->lo = lo;
        t->hi = hi;
        t->cc = cc;
        t->off = off;
        t->inv = inv;
        t->norm = tot > 0.0f ? tot : 1.0f;
        return;
    }
    if (mode == INTERP_BILINEAR) {
        const int64_t f = (int64_t)floorf(c);
        const int64_t j0 = clamp_index(f, n_in), j1 = clamp_index(f + 1, n_in);
        float d = c - (float)j0;
        d = d < 0.0f ? 0.0f : (d > 1.0f ? 1.0f : d);
        t->count = 2;
        t->idx[0] = j0; t->w[0] = 1.0f - d;
        t->idx[1] = j1; t->w[1] = d;
        return;
    }
    // bicubic, Keys A = -0.75, taps floor(c)-1 .. floor(c)+2 clamped to the border
    const float f = floorf(c);
    const float u = c - f;
    const float a = -0.75f;
    const float v0 = u + 1.0f, v1 = u, v2 = 1.0f - u, v3 = 2.0f - u;
    t->count = 4;
    t->w[0] = ((a * v0 - 5.0f * a) * v0 + 8.0f * a) * v0 - 4.0f * a;
    t->w[1] = ((a + 2.0f) * v1 - (a + 3.0f)) * v1 * v1 + 1.0f;
    t->w[2] = ((a + 2.0f) * v2 - (a + 3.0f)) * v2 * v2 + 1.0f;
    t->w[3] = ((a * v3 - 5.0f * a) * v3 + 8.0f * a) * v3 - 4.0f * a;
    const int64_t fi = (int64_t)f;
    for (int k = 0; k < 4; ++k) t->idx[k] = clamp_index(fi - 1 + k, n_in);
}

__device__ __forceinline__ int tap_count(const AxisTaps& t) {
    return t.count ? t.count : (int)(t.hi - t.lo);
}
__device__ __forceinline__ int64_t tap_index(const AxisTaps& t, int k) {
    return t.count ? t.idx[k] : t.lo + k;
}
__device__ __forceinline__ float tap_weight(const AxisTaps& t, int k) {
    return t.count ? t.w[k] : aa_weight(t.lo + k, t.cc, t.off, t.inv) / t.norm;
}

template <typename T, typename I>
__device__ void upscale_interp_impl(T* __restrict__ dst, const char* __restrict__ src, DIMS4(n), DIMS4(nb),
                                    DIMS4(o), int mode, int align_corners, int antialias) {
    // the loop written out, not through for_each_index4: with the lambda nvcc 13.0 schedules and
    // allocates this kernel differently (its SASS is kept as it was measured)
    const I total = (I)(o0 * o1 * o2 * o3);
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)blockDim.x * gridDim.x) {
        int64_t j[4];
        unravel4<I>(i, (I)o0, (I)o1, (I)o2, j);
        const int64_t i0 = j[0], i1 = j[1], i2 = j[2], i3 = j[3];
        // dims 2/3 resample by nearest in every mode (ggml_interpolate)
        const char* plane = src + nearest_index(i2, n2, o2) * nb2 + nearest_index(i3, n3, o3) * nb3;
        AxisTaps ty, tx;
        axis_taps(n1, o1, mode, align_corners != 0, antialias != 0, i1, &ty);
        axis_taps(n0, o0, mode, align_corners != 0, antialias != 0, i0, &tx);
        const int ky = tap_count(ty), kx = tap_count(tx);
        // vertical pass first, then horizontal, as the CPU kernel sums
        float acc = 0.0f;
        for (int b = 0; b < kx; ++b) {
            const char* col = plane + tap_index(tx, b) * nb0;
            float v = 0.0f;
            for (int a = 0; a < ky; ++a) v += tap_weight(ty, a) * load_f((const T*)(col + tap_index(ty, a) * nb1));
            acc += tap_weight(tx, b) * v;
        }
        store_f(dst + i, acc);
    }
}

#define UPSCALE_INTERP_KERNEL(suffix, T)                                                                   \
    extern "C" __global__ void upscale_interp_##suffix(T* dst, const char* src, DIMS4(n), DIMS4(nb),        \
                                                       DIMS4(o), int mode, int align_corners,               \
                                                       int antialias) {                                     \
        WITH_INDEX_TYPE(o0 * o1 * o2 * o3, upscale_interp_impl, T, dst, src, ARGS4(n), ARGS4(nb), ARGS4(o), \
                        mode, align_corners, antialias)                                                    \
    }
UPSCALE_INTERP_KERNEL(f32, float)
UPSCALE_INTERP_KERNEL(f16, __half)
UPSCALE_INTERP_KERNEL(bf16, __nv_bfloat16)
