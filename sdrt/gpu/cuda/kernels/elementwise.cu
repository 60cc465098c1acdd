// Element-wise ops (sdrt/ops/elementwise.py): binary with broadcasting, unary activations,
// scale/clamp, casts and contiguous copies. The CPU kernels are sdrt/ops/cpu/elementwise.py;
// the formulas here are theirs, computed in float.
//
// Indexing: every input is a strided view described by the output's shape ne[0..3] and the
// input's byte strides (0 along a broadcast dim); the output is contiguous. The host merges
// adjacent dims that every operand walks through as one (a contiguous tensor is one dim), so
// the common cases index without any division.
#include "common.cuh"
#include "elementwise_ops.cuh"  // SDRT_UNARY_OPS / SDRT_BINARY_OPS: generated from the op registry

#include <type_traits>

namespace {

// ---- the index walk ---------------------------------------------------------------------------
// Stores out[i] = op(load(i0, i1, i2, i3)) for every flat output index i < n of a tensor of shape
// (ne0, ne1, ne2, n / (ne0*ne1*ne2)). `load` reads one element's operands (a float, a float2, raw
// bits), `op` makes its value from them. Each thread takes ILP elements and loads all their
// operands before computing or storing any, so that ILP loads are in flight at once: with one,
// silu ran at 1.3-1.6 TB/s, with four 3.0 (bench/cuda_elementwise_variants.cu on the H200). Reading
// all before writing is safe in place: an element only reads its own index of a same-shape operand.
// Two walks, chosen by the shape alone (elementwise.py sizes the grid by the same rule, ROW_MIN):
//  - rows (ne0 >= ROW_MIN, more than one row): blockIdx.y walks the rows, whose index is split
//    once per row; a thread's ILP elements are blockDim apart in the row.
//  - flat: a grid-stride loop over groups of ILP*blockDim elements; one dim needs no division,
//    otherwise 32-bit division while the indices fit (the branch is uniform over the grid).
#define ROW_MIN 256
#define ILP 4

__device__ __forceinline__ void split_row(int64_t r, int64_t ne1, int64_t ne2, int64_t nrows,
                                          int64_t& i1, int64_t& i2, int64_t& i3) {
    if (nrows <= 0xFFFFFFFFLL) {
        const uint32_t m1 = (uint32_t)ne1, m2 = (uint32_t)ne2;
        uint32_t q = (uint32_t)r;
        i1 = q % m1; q /= m1;
        i2 = q % m2;
        i3 = q / m2;
    } else {
        i1 = r % ne1;
        i2 = (r / ne1) % ne2;
        i3 = r / ne1 / ne2;
    }
}

template <typename T, typename L, typename O>
__device__ __forceinline__ void map_index(T* __restrict__ out, int64_t n, int64_t ne0, int64_t ne1, int64_t ne2,
                                          L load, O op) {
    using V = decltype(load(int64_t(0), int64_t(0), int64_t(0), int64_t(0)));
    const int64_t bd = blockDim.x;
    if (ne0 >= ROW_MIN && ne0 < n) {
        const int64_t nrows = n / ne0;
        const int64_t step = (int64_t)gridDim.x * bd * ILP;
#pragma unroll 1
        for (int64_t r = blockIdx.y; r < nrows; r += gridDim.y) {
            int64_t i1, i2, i3;
            split_row(r, ne1, ne2, nrows, i1, i2, i3);
            T* o = out + r * ne0;
#pragma unroll 1
            for (int64_t j = (int64_t)blockIdx.x * bd * ILP + threadIdx.x; j < ne0; j += step) {
                V v[ILP];
#pragma unroll
                for (int u = 0; u < ILP; ++u)
                    if (j + u * bd < ne0) v[u] = load(j + u * bd, i1, i2, i3);
#pragma unroll
                for (int u = 0; u < ILP; ++u)
                    if (j + u * bd < ne0) o[j + u * bd] = op(v[u]);
            }
        }
        return;
    }
    const bool one_dim = ne0 == n;
    if (!one_dim && n > 0xFFFFFFFFLL) {  // 64-bit index splits (over 2^32 elements): one at a time
#pragma unroll 1
        for (int64_t i = (int64_t)blockIdx.x * bd + threadIdx.x; i < n; i += (int64_t)gridDim.x * bd) {
            int64_t r = i;
            const int64_t i0 = r % ne0; r /= ne0;
            const int64_t i1 = r % ne1; r /= ne1;
            out[i] = op(load(i0, i1, r % ne2, r / ne2));
        }
        return;
    }
    const int64_t step = (int64_t)gridDim.x * bd * ILP;
    const uint32_t m0 = (uint32_t)ne0, m1 = (uint32_t)ne1, m2 = (uint32_t)ne2;
#pragma unroll 1
    for (int64_t base = (int64_t)blockIdx.x * bd * ILP + threadIdx.x; base < n; base += step) {
        V v[ILP];
#pragma unroll
        for (int u = 0; u < ILP; ++u) {
            const int64_t i = base + u * bd;
            if (i >= n) continue;
            if (one_dim) {
                v[u] = load(i, 0, 0, 0);
            } else {
                uint32_t r = (uint32_t)i;
                const uint32_t i0 = r % m0; r /= m0;
                const uint32_t i1 = r % m1; r /= m1;
                v[u] = load(i0, i1, r % m2, r / m2);
            }
        }
#pragma unroll
        for (int u = 0; u < ILP; ++u)
            if (base + u * bd < n) out[base + u * bd] = op(v[u]);
    }
}

// ---- binary -----------------------------------------------------------------------------------
// One functor per binary op of the registry (elementwise_ops.cuh lists them; a listed op without
// one here fails to compile).
#define BINARY_OP(name, expr) \
    struct binary_##name { __device__ __forceinline__ float operator()(float a, float b) const { return expr; } };
BINARY_OP(add, a + b)
BINARY_OP(sub, a - b)
BINARY_OP(mul, a * b)
BINARY_OP(div, a / b)  // IEEE division (the build never passes -use_fast_math)

// TO is the output's dtype: TA's, or F16/BF16 for an F32 result stored as such (fuse.py)
template <typename F, typename TA, typename TB, typename TO>
__device__ __forceinline__ void binary(const char* a, const char* b, TO* out, int64_t n,
                                       int64_t ne0, int64_t ne1, int64_t ne2,
                                       int64_t sa0, int64_t sa1, int64_t sa2, int64_t sa3,
                                       int64_t sb0, int64_t sb1, int64_t sb2, int64_t sb3) {
    map_index(out, n, ne0, ne1, ne2, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        return make_float2(load_f<TA>(a, i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3),
                           load_f<TB>(b, i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3));
    }, [](float2 v) { return from_f32<TO>(F()(v.x, v.y)); });
}

// ---- unary ------------------------------------------------------------------------------------
// One functor per unary op of the registry (elementwise_ops.cuh lists them), value v, params p0, p1.
#define UNARY_OP(name, expr)                                                                          \
    struct unary_##name {                                                                             \
        __device__ __forceinline__ float operator()(float v, float p0, float p1) const { return expr; } \
    };

// v / (1 + e^t) with the hardware's exp (ex2.approx) and a correctly rounded reciprocal: the
// accurate expf and IEEE division made the sigmoid-shaped activations compute-bound, at a third
// of the memory speed (bench/README.md). Within ~2e-6 relative of the CPU's expf form;
// infinities, NaNs and underflow come out as there (inf * 0 = NaN as -inf/inf).
__device__ __forceinline__ float over_one_plus_exp(float v, float t) { return v * __frcp_rn(1.0f + __expf(t)); }

UNARY_OP(neg, -v)
UNARY_OP(abs, fabsf(v))
UNARY_OP(sqr, v * v)
UNARY_OP(sqrt, sqrtf(v))
UNARY_OP(exp, expf(v))
UNARY_OP(log, logf(v))
UNARY_OP(sin, sinf(v))
UNARY_OP(cos, cosf(v))
UNARY_OP(step, v > 0.0f ? 1.0f : 0.0f)
UNARY_OP(relu, v > 0.0f ? v : 0.0f)  // NaN -> 0, as the CPU kernel
UNARY_OP(leaky_relu, v > 0.0f ? v : v * p0)
UNARY_OP(silu, over_one_plus_exp(v, -v))
UNARY_OP(sigmoid, over_one_plus_exp(1.0f, -v))
UNARY_OP(tanh, tanhf(v))
UNARY_OP(gelu, 0.5f * v * (1.0f + erff(v * 0.70710678118654752f)))
// 0.5 v (1 + tanh(y)) = v / (1 + exp(-2y)), y = sqrt(2/pi) (v + 0.044715 v^3): the CPU's form;
// -inf gives -inf/inf = NaN as the tanh form does
UNARY_OP(gelu_tanh, over_one_plus_exp(v, -1.5957691216057308f * (v + 0.044715f * v * v * v)))
UNARY_OP(gelu_quick, over_one_plus_exp(v, -1.702f * v))
UNARY_OP(clamp, fminf(fmaxf(v, p0), p1))
UNARY_OP(scale, v * p0 + p1)

// TX is x's dtype, TO the output's (F16/BF16 for an F32 result stored as such, fuse.py)
template <typename F, typename TX, typename TO>
__device__ __forceinline__ void unary(const char* x, TO* out, int64_t n, int64_t ne0, int64_t ne1, int64_t ne2,
                                      int64_t s0, int64_t s1, int64_t s2, int64_t s3, float p0, float p1) {
    map_index(out, n, ne0, ne1, ne2, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        return load_f<TX>(x, i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3);
    }, [&](float v) { return from_f32<TO>(F()(v, p0, p1)); });
}

// ---- gated residual ----------------------------------------------------------------------------
// out = x + y * g (fuse.py's add(x, mul(y, g)), a DiT block's gated residual), every operand F32
// through its strides (g a broadcast vector); rounded after the product and after the sum as the
// two unfused kernels (no FMA)
__device__ __forceinline__ void gated_add(const char* x, const char* y, const char* g, float* out, int64_t n,
                                          int64_t ne0, int64_t ne1, int64_t ne2, int64_t sx0, int64_t sx1,
                                          int64_t sx2, int64_t sx3, int64_t sy0, int64_t sy1, int64_t sy2,
                                          int64_t sy3, int64_t sg0, int64_t sg1, int64_t sg2, int64_t sg3) {
    map_index(out, n, ne0, ne1, ne2, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        return make_float3(load_f<float>(x, i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3),
                           load_f<float>(y, i0 * sy0 + i1 * sy1 + i2 * sy2 + i3 * sy3),
                           load_f<float>(g, i0 * sg0 + i1 * sg1 + i2 * sg2 + i3 * sg3));
    }, [](float3 v) { return __fadd_rn(v.x, __fmul_rn(v.y, v.z)); });
}

// out = silu(a) * b (fuse.py's mul(silu(a), b): a SwiGLU feed-forward, Z-Image's and the Qwen
// LLMs'), a and b F32 through their strides; silu as unary_silu, the product rounded as the mul's,
// written as TO (F32, or the F16/BF16 of the GEMM reading it)
template <typename TO>
__device__ __forceinline__ void silu_mul(const char* a, const char* b, TO* out, int64_t n, int64_t ne0, int64_t ne1,
                                         int64_t ne2, int64_t sa0, int64_t sa1, int64_t sa2, int64_t sa3,
                                         int64_t sb0, int64_t sb1, int64_t sb2, int64_t sb3) {
    map_index(out, n, ne0, ne1, ne2, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        return make_float2(load_f<float>(a, i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3),
                           load_f<float>(b, i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3));
    }, [](float2 v) { return from_f32<TO>(__fmul_rn(unary_silu()(v.x, 0.0f, 0.0f), v.y)); });
}

// ---- geglu -------------------------------------------------------------------------------------
// out (h, ne1, ne2, ne3) = x[i0] * gelu(x[h + i0]) per row of x (2h wide); the gate half starts
// gate_off bytes after the value half. GELU is the tanh form or the erf one, as the op's param.
// TX is x's dtype, TO the output's (the CUDA backend stores some F32 results as F16, fuse.py).
template <typename GELU, typename TX, typename TO>
__device__ __forceinline__ void geglu(const char* x, TO* out, int64_t n, int64_t ne0, int64_t ne1, int64_t ne2,
                                      int64_t s0, int64_t s1, int64_t s2, int64_t s3, int64_t gate_off) {
    map_index(out, n, ne0, ne1, ne2, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        const int64_t off = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3;
        return make_float2(load_f<TX>(x, off), load_f<TX>(x, off + gate_off));
    }, [](float2 v) {
        // rounded between the gelu and the product as the CPU's unfused mul(a, gelu(gate)) in
        // the op's dtype (F32 stored as F16: the F32 op's value, rounded once at the end)
        using TR = typename std::conditional<sizeof(TX) == 4 || sizeof(TO) == 4, float, TO>::type;
        const float g = to_f32(from_f32<TR>(GELU()(v.y, 0.0f, 0.0f)));
        return from_f32<TO>(v.x * g);
    });
}

// ---- casts and copies -------------------------------------------------------------------------
template <typename TS, typename TD>
__device__ __forceinline__ void cast(const char* x, TD* out, int64_t n, int64_t ne0, int64_t ne1, int64_t ne2,
                                     int64_t s0, int64_t s1, int64_t s2, int64_t s3) {
    map_index(out, n, ne0, ne1, ne2, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        return load_f<TS>(x, i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3);
    }, [](float v) { return from_f32<TD>(v); });
}

// bit-exact copy of elements of one size (any non-block dtype)
template <typename U>
__device__ __forceinline__ void copy(const char* x, U* out, int64_t n, int64_t ne0, int64_t ne1, int64_t ne2,
                                     int64_t s0, int64_t s1, int64_t s2, int64_t s3) {
    map_index(out, n, ne0, ne1, ne2, [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
        return load<U>(x, i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3);
    }, [](U v) { return v; });
}

// whole rows of `units` U each (block-type rows are contiguous bytes), rows strided by nb1..nb3
template <typename U>
__device__ __forceinline__ void copy_rows(const char* x, U* out, int64_t units, int64_t nrows,
                                          int64_t ne1, int64_t ne2, int64_t nb1, int64_t nb2, int64_t nb3) {
    for (int64_t r = blockIdx.x; r < nrows; r += gridDim.x) {
        const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
        const U* src = reinterpret_cast<const U*>(x + i1 * nb1 + i2 * nb2 + i3 * nb3);
        U* dst = out + r * units;
        for (int64_t j = threadIdx.x; j < units; j += blockDim.x) dst[j] = src[j];
    }
}

}  // namespace

// ---- entry points -----------------------------------------------------------------------------
#define STRIDES4(s) int64_t s##0, int64_t s##1, int64_t s##2, int64_t s##3

#define BINARY_ENTRY(name, OP, TA, TB, TO)                                                           \
    extern "C" __global__ void name(const char* a, const char* b, TO* out, int64_t n, int64_t ne0,    \
                                    int64_t ne1, int64_t ne2, STRIDES4(sa), STRIDES4(sb)) {          \
        binary<OP, TA, TB, TO>(a, b, out, n, ne0, ne1, ne2, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3); \
    }
// kernel names: sdrt.gpu.cuda.naming.kernel_name(op, dtypes[, out]); the _to_ ones write an F32
// result as F16/BF16 (fuse.py's half storage)
#define BINARY_F32_TO(op, b, TB)                                                             \
    BINARY_ENTRY(binary_##op##_f32_##b##_to_f16, binary_##op, float, TB, __half)           \
    BINARY_ENTRY(binary_##op##_f32_##b##_to_bf16, binary_##op, float, TB, bf16_t)
#define BINARY_TYPES(op)                                                          \
    BINARY_ENTRY(binary_##op##_f32_f32, binary_##op, float, float, float)       \
    BINARY_ENTRY(binary_##op##_f32_f16, binary_##op, float, __half, float)      \
    BINARY_ENTRY(binary_##op##_f32_bf16, binary_##op, float, bf16_t, float)     \
    BINARY_ENTRY(binary_##op##_f16_f32, binary_##op, __half, float, __half)     \
    BINARY_ENTRY(binary_##op##_f16_f16, binary_##op, __half, __half, __half)    \
    BINARY_ENTRY(binary_##op##_f16_bf16, binary_##op, __half, bf16_t, __half)   \
    BINARY_ENTRY(binary_##op##_bf16_f32, binary_##op, bf16_t, float, bf16_t)    \
    BINARY_ENTRY(binary_##op##_bf16_f16, binary_##op, bf16_t, __half, bf16_t)   \
    BINARY_ENTRY(binary_##op##_bf16_bf16, binary_##op, bf16_t, bf16_t, bf16_t)  \
    BINARY_F32_TO(op, f32, float)                                                 \
    BINARY_F32_TO(op, f16, __half)                                                \
    BINARY_F32_TO(op, bf16, bf16_t)
SDRT_BINARY_OPS(BINARY_TYPES)

extern "C" __global__ void gated_add_f32(const char* x, const char* y, const char* g, float* out, int64_t n,
                                         int64_t ne0, int64_t ne1, int64_t ne2, STRIDES4(sx), STRIDES4(sy),
                                         STRIDES4(sg)) {
    gated_add(x, y, g, out, n, ne0, ne1, ne2, sx0, sx1, sx2, sx3, sy0, sy1, sy2, sy3, sg0, sg1, sg2, sg3);
}

#define SILU_MUL_ENTRY(name, TO)                                                                      \
    extern "C" __global__ void name(const char* a, const char* b, TO* out, int64_t n, int64_t ne0,   \
                                    int64_t ne1, int64_t ne2, STRIDES4(sa), STRIDES4(sb)) {          \
        silu_mul<TO>(a, b, out, n, ne0, ne1, ne2, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3);           \
    }
SILU_MUL_ENTRY(silu_mul_f32, float)
SILU_MUL_ENTRY(silu_mul_f32_to_f16, __half)
SILU_MUL_ENTRY(silu_mul_f32_to_bf16, bf16_t)

#define UNARY_ENTRY(name, OP, TX, TO)                                                                 \
    extern "C" __global__ void name(const char* x, TO* out, int64_t n, int64_t ne0, int64_t ne1,     \
                                    int64_t ne2, STRIDES4(s), float p0, float p1) {                  \
        unary<OP, TX, TO>(x, out, n, ne0, ne1, ne2, s0, s1, s2, s3, p0, p1);                          \
    }
#define UNARY_TYPES(op)                                                     \
    UNARY_ENTRY(unary_##op##_f32, unary_##op, float, float)                 \
    UNARY_ENTRY(unary_##op##_f16, unary_##op, __half, __half)               \
    UNARY_ENTRY(unary_##op##_bf16, unary_##op, bf16_t, bf16_t)              \
    UNARY_ENTRY(unary_##op##_f32_to_f16, unary_##op, float, __half)         \
    UNARY_ENTRY(unary_##op##_f32_to_bf16, unary_##op, float, bf16_t)
SDRT_UNARY_OPS(UNARY_TYPES)

#define GEGLU_ENTRY(name, GELU, TX, TO)                                                               \
    extern "C" __global__ void name(const char* x, TO* out, int64_t n, int64_t ne0, int64_t ne1,     \
                                    int64_t ne2, STRIDES4(s), int64_t gate_off) {                    \
        geglu<GELU, TX, TO>(x, out, n, ne0, ne1, ne2, s0, s1, s2, s3, gate_off);                      \
    }
// the _to_ pairs: F32 results stored as F16/BF16 and read back (fuse.py's half storage)
#define GEGLU_TYPES(gelu, GELU)                                      \
    GEGLU_ENTRY(geglu_##gelu##_f32, GELU, float, float)              \
    GEGLU_ENTRY(geglu_##gelu##_f16, GELU, __half, __half)            \
    GEGLU_ENTRY(geglu_##gelu##_bf16, GELU, bf16_t, bf16_t)           \
    GEGLU_ENTRY(geglu_##gelu##_f32_to_f16, GELU, float, __half)      \
    GEGLU_ENTRY(geglu_##gelu##_f16_to_f32, GELU, __half, float)      \
    GEGLU_ENTRY(geglu_##gelu##_f32_to_bf16, GELU, float, bf16_t)     \
    GEGLU_ENTRY(geglu_##gelu##_bf16_to_f32, GELU, bf16_t, float)
GEGLU_TYPES(erf, unary_gelu)
GEGLU_TYPES(tanh, unary_gelu_tanh)

#define CAST_ENTRY(name, TS, TD)                                                                      \
    extern "C" __global__ void name(const char* x, TD* out, int64_t n, int64_t ne0, int64_t ne1,     \
                                    int64_t ne2, STRIDES4(s)) {                                       \
        cast<TS, TD>(x, out, n, ne0, ne1, ne2, s0, s1, s2, s3);                                       \
    }
#define CAST_TO(src, TS)                           \
    CAST_ENTRY(cast_##src##_f32, TS, float)        \
    CAST_ENTRY(cast_##src##_f16, TS, __half)       \
    CAST_ENTRY(cast_##src##_bf16, TS, bf16_t)
CAST_TO(f32, float)
CAST_TO(f16, __half)
CAST_TO(bf16, bf16_t)
CAST_TO(f8_e4m3, f8e4m3_t)
CAST_TO(f8_e5m2, f8e5m2_t)

#define COPY_ENTRY(name, U)                                                                           \
    extern "C" __global__ void name(const char* x, U* out, int64_t n, int64_t ne0, int64_t ne1,      \
                                    int64_t ne2, STRIDES4(s)) {                                       \
        copy<U>(x, out, n, ne0, ne1, ne2, s0, s1, s2, s3);                                            \
    }
COPY_ENTRY(copy_b8, uint8_t)
COPY_ENTRY(copy_b16, uint16_t)
COPY_ENTRY(copy_b32, uint32_t)
COPY_ENTRY(copy_b64, unsigned long long)

#define COPY_ROWS_ENTRY(name, U)                                                                      \
    extern "C" __global__ void name(const char* x, U* out, int64_t units, int64_t nrows, int64_t ne1, \
                                    int64_t ne2, int64_t nb1, int64_t nb2, int64_t nb3) {             \
        copy_rows<U>(x, out, units, nrows, ne1, ne2, nb1, nb2, nb3);                                  \
    }
COPY_ROWS_ENTRY(copy_rows_u8, uint8_t)
COPY_ROWS_ENTRY(copy_rows_u32, uint32_t)
