// Element types shared by the kernel families: float conversions, loads and stores.
//
// Two kinds of BF16, because they round NaN differently:
//  - bf16_t (and the F8 types) are storage structs converted on the bits, bit for bit as
//    sdrt/ops/convert.py: a NaN keeps its top bits and is made quiet. The element-wise, norm
//    and position kernels use them, so their outputs equal the CPU's exactly.
//  - __nv_bfloat16 is CUDA's own type, converted by CUDA's intrinsics (every NaN canonical);
//    layout, conv and attention use it where only finite values matter.
// F16 is CUDA's __half in both (round to nearest even).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

// ---- storage types ----------------------------------------------------------------------------
struct bf16_t { unsigned short bits; };
struct f8e4m3_t { unsigned char bits; };
struct f8e5m2_t { unsigned char bits; };

// ---- to float ---------------------------------------------------------------------------------
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(bf16_t v) { return __uint_as_float((unsigned)v.bits << 16); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// F8 E4M3 ("fn": no inf, S.1111.111 is NaN) and E5M2 (IEEE-like), as sdrt/ops/convert.py's
// table, whose NaNs are all the positive quiet NaN 0x7FC00000
__device__ __forceinline__ float to_f32(f8e4m3_t v) {
    const unsigned b = v.bits, e = (b >> 3) & 0xF, m = b & 7;
    if ((b & 0x7F) == 0x7F) return __uint_as_float(0x7FC00000u);
    const float r = e == 0 ? ldexpf((float)m, -9)              // m/8 * 2^-6
                           : ldexpf(1.0f + (float)m * 0.125f, (int)e - 7);
    return (b & 0x80) ? -r : r;
}
__device__ __forceinline__ float to_f32(f8e5m2_t v) {
    const unsigned b = v.bits, e = (b >> 2) & 0x1F, m = b & 3;
    if (e == 0x1F && m) return __uint_as_float(0x7FC00000u);
    const float r = e == 0x1F ? __uint_as_float(0x7F800000u)
                  : e == 0 ? ldexpf((float)m, -16)                // m/4 * 2^-14
                           : ldexpf(1.0f + (float)m * 0.25f, (int)e - 15);
    return (b & 0x80) ? -r : r;
}

// ---- from float -------------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
// round to nearest even; NaN keeps its top bits and is made quiet (sdrt/ops/convert.f32_to_raw)
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float v) {
    const unsigned u = __float_as_uint(v);
    bf16_t r;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) r.bits = (unsigned short)((u >> 16) | 64);
    else r.bits = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return r;
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// ---- loads and stores -------------------------------------------------------------------------
// the T at byte offset `off` of p, as stored
template <typename T> __device__ __forceinline__ T load(const char* p, int64_t off) {
    return *reinterpret_cast<const T*>(p + off);
}
// the T at byte offset `off` of p, as float
template <typename T> __device__ __forceinline__ float load_f(const char* p, int64_t off) {
    return to_f32(load<T>(p, off));
}
// the T at p, as float
template <typename T> __device__ __forceinline__ float load_f(const T* p) { return to_f32(*p); }
template <typename T> __device__ __forceinline__ void store_f(T* p, float v) { *p = from_f32<T>(v); }

}  // namespace
