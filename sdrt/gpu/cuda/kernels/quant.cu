// Weight decoding on the device: dequantize every block type, widen/narrow the float types,
// and get_rows (ggml_get_rows) for every table type. Python side: sdrt/gpu/cuda/quant.py and
// matmul.py. Block layouts are in quant_blocks.cuh.
//
// Every kernel reads its source through byte strides (views work) and writes a contiguous
// output; 1-D grid-stride loops with int64 indices (tensors may exceed 2^31 elements).
#include "quant_blocks.cuh"

// ---- float element types (load from raw bytes) -----------------------------------------------
struct ElF32 {
    static __device__ __forceinline__ float load(const uint8_t* p) { return *(const float*)p; }
};
struct ElF16 {
    static __device__ __forceinline__ float load(const uint8_t* p) { return __half2float(*(const __half*)p); }
};
struct ElBF16 {
    static __device__ __forceinline__ float load(const uint8_t* p) {
        return __uint_as_float((uint32_t)(*(const uint16_t*)p) << 16);
    }
};
struct ElF8E4M3 {  // the "fn" variant: no inf, 0x7F/0xFF are NaN (as sdrt.ops.convert)
    static __device__ __forceinline__ float load(const uint8_t* p) {
        const uint32_t b = *p, sign = (b & 0x80) << 24, e = (b >> 3) & 0xF, m = b & 7;
        if ((b & 0x7F) == 0x7F) return __uint_as_float(sign | 0x7FC00000u);
        if (e == 0) return flip((float)m * 0.001953125f, sign);  // m/8 * 2^-6
        return __uint_as_float(sign | ((e + 120) << 23) | (m << 20));
    }
};
struct ElF8E5M2 {  // the top byte of an F16
    static __device__ __forceinline__ float load(const uint8_t* p) { return f16_to_f32((uint32_t)*p << 8); }
};

// ---- output types ------------------------------------------------------------------------------
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {  // round to nearest even, as sdrt/ggml
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 64);  // quiet NaN
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

struct OutF32 {
    static __device__ __forceinline__ void put(void* dst, int64_t i, float v) { ((float*)dst)[i] = v; }
    // 8 values at i (a multiple of 8); one or two 16-byte stores when dst is 16-byte aligned
    static __device__ __forceinline__ void put8(void* dst, int64_t i, const float* v) {
        float* o = (float*)dst + i;
        if (((uintptr_t)dst & 15) == 0) {
            ((float4*)o)[0] = make_float4(v[0], v[1], v[2], v[3]);
            ((float4*)o)[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = v[k];
        }
    }
};

struct OutF16 {
    static __device__ __forceinline__ void put(void* dst, int64_t i, float v) { ((__half*)dst)[i] = __float2half_rn(v); }
    static __device__ __forceinline__ void put8(void* dst, int64_t i, const float* v) {
        __half* o = (__half*)dst + i;
        if (((uintptr_t)dst & 15) == 0) {
            union { __half h[8]; uint4 u; } pack;
#pragma unroll
            for (int k = 0; k < 8; ++k) pack.h[k] = __float2half_rn(v[k]);
            *(uint4*)o = pack.u;
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = __float2half_rn(v[k]);
        }
    }
};

struct OutBF16 {
    static __device__ __forceinline__ void put(void* dst, int64_t i, float v) { ((uint16_t*)dst)[i] = f32_to_bf16_bits(v); }
};

// ---- convert: strided float tensor -> contiguous F32/F16/BF16 ---------------------------------
template <class S, class O>
__device__ void convert(const uint8_t* __restrict__ src, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                        int ne0, int ne1, int ne2, int ne3, void* __restrict__ dst) {
    const int64_t n = (int64_t)ne0 * ne1 * ne2 * ne3;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (nb1 == nb0 * ne0 && nb2 == nb1 * ne1 && nb3 == nb2 * ne2) {
        // evenly strided: no index split; four elements a thread, all loaded before any is
        // stored, so that their loads overlap (the GEMMs' activation packing)
        const int64_t bd = blockDim.x;
        for (int64_t i = blockIdx.x * bd * 4 + threadIdx.x; i < n; i += stride * 4) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (i + u * bd < n) v[u] = S::load(src + (i + u * bd) * nb0);
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (i + u * bd < n) O::put(dst, i + u * bd, v[u]);
        }
        return;
    }
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride) {
        int64_t r = i / ne0;
        const int64_t i0 = i - r * ne0;
        const int64_t i1 = r % ne1;
        r /= ne1;
        const int64_t i2 = r % ne2, i3 = r / ne2;
        O::put(dst, i, S::load(src + i0 * nb0 + i1 * nb1 + i2 * nb2 + i3 * nb3));
    }
}

#define CONVERT(sname, S, oname, O)                                                                    \
    extern "C" __global__ void convert_##sname##_##oname(const uint8_t* src, int64_t nb0, int64_t nb1, \
            int64_t nb2, int64_t nb3, int ne0, int ne1, int ne2, int ne3, void* dst) {                  \
        convert<S, O>(src, nb0, nb1, nb2, nb3, ne0, ne1, ne2, ne3, dst);                                \
    }
#define CONVERT_TO_ALL(sname, S) CONVERT(sname, S, f32, OutF32) CONVERT(sname, S, f16, OutF16) CONVERT(sname, S, bf16, OutBF16)
CONVERT_TO_ALL(f32, ElF32)
CONVERT_TO_ALL(f16, ElF16)
CONVERT_TO_ALL(bf16, ElBF16)
CONVERT_TO_ALL(f8_e4m3, ElF8E4M3)
CONVERT_TO_ALL(f8_e5m2, ElF8E5M2)

// ---- dequantize: block rows (byte strides nb1..nb3) -> contiguous F32/F16 ---------------------
// One thread per group of 8 values; a warp covers 256 consecutive values of a row.
template <class B, class O>
__device__ void dequant(const uint8_t* __restrict__ src, int64_t nb1, int64_t nb2, int64_t nb3,
                        int ne0, int ne1, int ne2, int ne3, void* __restrict__ dst) {
    constexpr int GPB = B::BS / 8;  // groups per block
    const int64_t gpr = ne0 / 8;    // groups per row
    const int64_t ngroups = gpr * ne1 * ne2 * ne3;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t row_bytes = (int64_t)(ne0 / B::BS) * B::TS;
    if (nb1 == row_bytes && nb2 == nb1 * ne1 && nb3 == nb2 * ne2) {  // contiguous: one run of blocks
        for (int64_t gid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; gid < ngroups; gid += stride) {
            float v[8];
            B::dq8(src + (gid / GPB) * B::TS, (int)(gid % GPB) * 8, v);
            O::put8(dst, gid * 8, v);
        }
        return;
    }
    for (int64_t gid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; gid < ngroups; gid += stride) {
        int64_t r = gid / gpr;
        const int g = (int)(gid - r * gpr);
        const int64_t i1 = r % ne1;
        r /= ne1;
        const int64_t i2 = r % ne2, i3 = r / ne2;
        const uint8_t* blk = src + i3 * nb3 + i2 * nb2 + i1 * nb1 + (int64_t)(g / GPB) * B::TS;
        float v[8];
        B::dq8(blk, (g % GPB) * 8, v);
        O::put8(dst, gid * 8, v);
    }
}

#define DEQUANT(name, B)                                                                              \
    extern "C" __global__ void dequant_##name##_f32(const uint8_t* src, int64_t nb1, int64_t nb2,      \
            int64_t nb3, int ne0, int ne1, int ne2, int ne3, void* dst) {                               \
        dequant<B, OutF32>(src, nb1, nb2, nb3, ne0, ne1, ne2, ne3, dst);                                \
    }                                                                                                 \
    extern "C" __global__ void dequant_##name##_f16(const uint8_t* src, int64_t nb1, int64_t nb2,      \
            int64_t nb3, int ne0, int ne1, int ne2, int ne3, void* dst) {                               \
        dequant<B, OutF16>(src, nb1, nb2, nb3, ne0, ne1, ne2, ne3, dst);                                \
    }
SDRT_BLOCK_TYPES(DEQUANT)

// ---- get_rows ----------------------------------------------------------------------------------
// table ne=[D, V, b2, b3] (byte strides nb0..nb3), ids I32/I64 ne=[n, b2, b3] (byte strides
// id_nb0..2) -> dst F32 contiguous [b3][b2][n][D]. One thread block per output row. An id
// outside [0, V) gives a row of NaN (the CPU op raises; a kernel cannot).
__device__ __forceinline__ int64_t row_id(const uint8_t* ids, int ids64, int64_t r, int n, int b2,
                                          int64_t id_nb0, int64_t id_nb1, int64_t id_nb2, int64_t* i2, int64_t* i3) {
    const int64_t i = r % n, t = r / n;
    *i2 = t % b2;
    *i3 = t / b2;
    const uint8_t* p = ids + i * id_nb0 + *i2 * id_nb1 + *i3 * id_nb2;
    return ids64 ? *(const int64_t*)p : (int64_t)*(const int32_t*)p;
}

template <class B>
__device__ void get_rows_blocks(const uint8_t* __restrict__ table, int64_t nb1, int64_t nb2, int64_t nb3,
                                const uint8_t* __restrict__ ids, int ids64, int64_t id_nb0, int64_t id_nb1,
                                int64_t id_nb2, int ne0, int nrows, int n, int b2, int b3, float* __restrict__ dst) {
    constexpr int GPB = B::BS / 8;
    const int64_t nout = (int64_t)n * b2 * b3;
    for (int64_t r = blockIdx.x; r < nout; r += gridDim.x) {
        int64_t i2, i3;
        const int64_t id = row_id(ids, ids64, r, n, b2, id_nb0, id_nb1, id_nb2, &i2, &i3);
        float* o = dst + r * ne0;
        if (id < 0 || id >= nrows) {
            for (int e = threadIdx.x; e < ne0; e += blockDim.x) o[e] = __uint_as_float(0x7FC00000u);
            continue;
        }
        const uint8_t* row = table + i3 * nb3 + i2 * nb2 + id * nb1;
        for (int g = threadIdx.x; g < ne0 / 8; g += blockDim.x) {
            float v[8];
            B::dq8(row + (int64_t)(g / GPB) * B::TS, (g % GPB) * 8, v);
            OutF32::put8(o, 8 * (int64_t)g, v);
        }
    }
}

template <class S>
__device__ void get_rows_floats(const uint8_t* __restrict__ table, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3,
                                const uint8_t* __restrict__ ids, int ids64, int64_t id_nb0, int64_t id_nb1,
                                int64_t id_nb2, int ne0, int nrows, int n, int b2, int b3, float* __restrict__ dst) {
    const int64_t nout = (int64_t)n * b2 * b3;
    for (int64_t r = blockIdx.x; r < nout; r += gridDim.x) {
        int64_t i2, i3;
        const int64_t id = row_id(ids, ids64, r, n, b2, id_nb0, id_nb1, id_nb2, &i2, &i3);
        float* o = dst + r * ne0;
        const bool bad = id < 0 || id >= nrows;
        const uint8_t* row = table + i3 * nb3 + i2 * nb2 + (bad ? 0 : id) * nb1;
        for (int e = threadIdx.x; e < ne0; e += blockDim.x)
            o[e] = bad ? __uint_as_float(0x7FC00000u) : S::load(row + e * nb0);
    }
}

#define GET_ROWS_ARGS                                                                                 \
    const uint8_t *table, int64_t nb0, int64_t nb1, int64_t nb2, int64_t nb3, const uint8_t *ids,     \
        int ids64, int64_t id_nb0, int64_t id_nb1, int64_t id_nb2, int ne0, int nrows, int n, int b2, \
        int b3, float *dst
#define GET_ROWS_BLOCKS(name, B)                                                                      \
    extern "C" __global__ void get_rows_##name(GET_ROWS_ARGS) {                                       \
        get_rows_blocks<B>(table, nb1, nb2, nb3, ids, ids64, id_nb0, id_nb1, id_nb2, ne0, nrows, n, b2, b3, dst); \
    }
#define GET_ROWS_FLOATS(name, S)                                                                      \
    extern "C" __global__ void get_rows_##name(GET_ROWS_ARGS) {                                       \
        get_rows_floats<S>(table, nb0, nb1, nb2, nb3, ids, ids64, id_nb0, id_nb1, id_nb2, ne0, nrows, n, b2, b3, dst); \
    }
SDRT_BLOCK_TYPES(GET_ROWS_BLOCKS)
GET_ROWS_FLOATS(f32, ElF32)
GET_ROWS_FLOATS(f16, ElF16)
GET_ROWS_FLOATS(bf16, ElBF16)
GET_ROWS_FLOATS(f8_e4m3, ElF8E4M3)
GET_ROWS_FLOATS(f8_e5m2, ElF8E5M2)
