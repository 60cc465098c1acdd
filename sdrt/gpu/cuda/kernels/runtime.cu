// The CUDA runtime's own small kernels: dtype casts among F32/F16/BF16 and fills.
//
// Conversions match the CPU side (sdrt/ops/convert.py, numpy) bit for bit, NaN payloads
// included, so they are written on the bits where CUDA's own differ: F16 rounds to nearest even
// as numpy's astype (a NaN keeps its top payload bits; CUDA's conversions make every NaN
// canonical), BF16 rounds to nearest even on the float's bits and turns a NaN into a quiet NaN
// with the same sign and top payload bits ((u >> 16) | 64), as ggml does.
//
// Every kernel is a 1-D grid-stride loop over int64 element indices.
#include <cuda_fp16.h>
#include <stdint.h>

#define GRID_STRIDE_LOOP(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)blockDim.x * gridDim.x)

// bf16 is kept as raw uint16 storage here, so only cuda_fp16.h is needed
struct bf16_bits { uint16_t x; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) {
    // finite values convert exactly; inf/NaN on the bits, keeping the NaN payload as numpy
    // does (the hardware conversion returns the canonical 0x7FFFFFFF for every NaN)
    const uint32_t h = __half_as_ushort(v);
    if ((h & 0x7C00u) == 0x7C00u) {
        return __uint_as_float(((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13));
    }
    return __half2float(v);
}
__device__ __forceinline__ float to_float(bf16_bits v) {
    return __uint_as_float(((uint32_t)v.x) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
    const uint32_t u = __float_as_uint(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: numpy keeps the top payload bits, never 0
        uint32_t h = 0x7C00u + ((u & 0x7FFFFFu) >> 13);
        if (h == 0x7C00u) h++;
        return __ushort_as_half((unsigned short)(((u & 0x80000000u) >> 16) | h));
    }
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ bf16_bits from_float<bf16_bits>(float v) {
    const uint32_t u = __float_as_uint(v);
    bf16_bits r;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        r.x = (uint16_t)((u >> 16) | 64u);  // NaN: keep it a (quiet) NaN
    } else {
        r.x = (uint16_t)((u + (0x7FFFu + ((u >> 16) & 1u))) >> 16);
    }
    return r;
}

template <typename S, typename D>
__device__ void cast_impl(D* __restrict__ dst, const S* __restrict__ src, int64_t n) {
    GRID_STRIDE_LOOP(i, n) { dst[i] = from_float<D>(to_float(src[i])); }
}

template <typename T>
__device__ void fill_impl(T* __restrict__ dst, float value, int64_t n) {
    const T v = from_float<T>(value);
    GRID_STRIDE_LOOP(i, n) { dst[i] = v; }
}

#define CAST(SN, S, DN, D) \
    extern "C" __global__ void cast_##SN##_##DN(D* dst, const S* src, int64_t n) { cast_impl<S, D>(dst, src, n); }

CAST(f32, float, f16, __half)
CAST(f32, float, bf16, bf16_bits)
CAST(f16, __half, f32, float)
CAST(f16, __half, bf16, bf16_bits)
CAST(bf16, bf16_bits, f32, float)
CAST(bf16, bf16_bits, f16, __half)

extern "C" __global__ void fill_f32(float* dst, float value, int64_t n) { fill_impl<float>(dst, value, n); }
extern "C" __global__ void fill_f16(__half* dst, float value, int64_t n) { fill_impl<__half>(dst, value, n); }
extern "C" __global__ void fill_bf16(bf16_bits* dst, float value, int64_t n) { fill_impl<bf16_bits>(dst, value, n); }
