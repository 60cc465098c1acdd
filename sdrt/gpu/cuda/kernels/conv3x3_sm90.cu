// Candidate block shapes of the direct 3x3 conv (conv3x3.cuh) for the deep convs, built for sm_90
// only (driver.FAMILY_ARCHS: the Hopper GPUs they are timed on) until a GPU run picks one for
// ops/conv.c3_variant: bench/bench_cuda_conv.py --variants times them beside the defaults.
#include "conv3x3.cuh"

// each in the dtypes the tests and the bench run: F32 or F16 in, F32 out; F16 in and out
#define CONV3X3_MMA_CANDIDATE(name, BN, WM, WN, TH, KC)                                           \
    CONV3X3_MMA_KERNEL(name, f32_f32, float, float, BN, WM, WN, TH, KC)                           \
    CONV3X3_MMA_KERNEL(name, f16_f32, __half, float, BN, WM, WN, TH, KC)                          \
    CONV3X3_MMA_KERNEL(name, f16_f16, __half, __half, BN, WM, WN, TH, KC)
CONV3X3_MMA_CANDIDATE(conv3x3_mma64k32, 64, 2, 2, 8, 32)
CONV3X3_MMA_CANDIDATE(conv3x3_mma128, 128, 2, 4, 8, 16)
CONV3X3_MMA_CANDIDATE(conv3x3_mma128t, 128, 4, 2, 16, 16)

