// Pieces shared by the attention kernel families (attention.cu, attention_sm90.cu): the mask
// dtype codes, log2(e) and -inf of the exp2 softmax, one mask element as float.
#pragma once
#include "common.cuh"

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
