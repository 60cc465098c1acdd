// Which structure of a memory-bound element-wise kernel reaches the H200's memory speed?
// bench_cuda_elementwise.py showed sdrt's silu at 1.3 TB/s (PyTorch 3.5) and its geglu/gelu on
// half-row views at the same rate, while a plain flat add reached 3.3 TB/s. This times variants
// of silu (flat, 10.5M floats) and geglu (2048 rows of 2x5120 -> 5120) in one process:
//   nvcc -O3 -arch=sm_90 -o /tmp/ewv bench/cuda_elementwise_variants.cu && /tmp/ewv
// Prints GB/s (bytes read + written once) per variant; CUDA-event medians of 20 launches.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

__device__ __forceinline__ float silu_acc(float v) { return v / (1.0f + expf(-v)); }
__device__ __forceinline__ float silu_fast(float v) { return v * __frcp_rn(1.0f + __expf(-v)); }
__device__ __forceinline__ float gelu_fast(float v) {
    return v * __frcp_rn(1.0f + __expf(-1.5957691216057308f * (v + 0.044715f * v * v * v)));
}

// 1. sdrt's flat walk today: char* + 64-bit byte offset, one element a thread, grid-stride
template <bool FAST>
__global__ void silu_flat(const char* x, float* out, int64_t n, int64_t s0) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = *(const float*)(x + i * s0);
        out[i] = FAST ? silu_fast(v) : silu_acc(v);
    }
}
// 2. four elements a thread, strided by blockDim, loaded before stored
__global__ void silu_ilp4(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
    int64_t base = (int64_t)blockIdx.x * blockDim.x * 4 + threadIdx.x;
    float v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { int64_t i = base + u * blockDim.x; v[u] = i < n ? x[i] : 0.0f; }
#pragma unroll
    for (int u = 0; u < 4; ++u) { int64_t i = base + u * blockDim.x; if (i < n) out[i] = silu_fast(v[u]); }
}
// 3. float4 a thread
__global__ void silu_vec4(const float4* __restrict__ x, float4* __restrict__ out, int64_t n4) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = x[i];
        out[i] = make_float4(silu_fast(v.x), silu_fast(v.y), silu_fast(v.z), silu_fast(v.w));
    }
}
// 4. two float4 a thread
__global__ void silu_vec4x2(const float4* __restrict__ x, float4* __restrict__ out, int64_t n4) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x * 2 + threadIdx.x;
    float4 a = i < n4 ? x[i] : float4{}, b = i + blockDim.x < n4 ? x[i + blockDim.x] : float4{};
    if (i < n4) out[i] = make_float4(silu_fast(a.x), silu_fast(a.y), silu_fast(a.z), silu_fast(a.w));
    if (i + blockDim.x < n4)
        out[i + blockDim.x] = make_float4(silu_fast(b.x), silu_fast(b.y), silu_fast(b.z), silu_fast(b.w));
}

// geglu: x rows of 2h, out rows of h
// 5. sdrt's row walk today: blockIdx.y a row, ILP 4 scalar elements a thread, byte offsets
__global__ void geglu_rows_ilp4(const char* x, float* out, int64_t h, int64_t rows, int64_t s0, int64_t s1) {
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x * 4 + threadIdx.x; j < h; j += (int64_t)gridDim.x * blockDim.x * 4) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                int64_t i0 = j + u * blockDim.x;
                if (i0 < h) {
                    int64_t off = i0 * s0 + r * s1;
                    v[u] = *(const float*)(x + off) * gelu_fast(*(const float*)(x + off + h * s0));
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) if (j + u * blockDim.x < h) out[r * h + j + u * blockDim.x] = v[u];
        }
    }
}
// 6. float4 along the row, one block a row
__global__ void geglu_rows_vec4(const float* __restrict__ x, float* __restrict__ out, int64_t h, int64_t rows) {
    const int64_t h4 = h / 4;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float4* a = reinterpret_cast<const float4*>(x + r * 2 * h);
        const float4* g = reinterpret_cast<const float4*>(x + r * 2 * h + h);
        float4* o = reinterpret_cast<float4*>(out + r * h);
        for (int64_t j = threadIdx.x; j < h4; j += blockDim.x) {
            float4 va = a[j], vg = g[j];
            o[j] = make_float4(va.x * gelu_fast(vg.x), va.y * gelu_fast(vg.y), va.z * gelu_fast(vg.z),
                               va.w * gelu_fast(vg.w));
        }
    }
}

template <typename F>
float time_ms(F launch) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    launch();
    std::vector<float> t;
    for (int k = 0; k < 20; ++k) {
        cudaEventRecord(a);
        launch();
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main() {
    const int64_t n = 2LL * 320 * 128 * 128, h = 5120, rows = 2048;
    float *x, *o;
    cudaMalloc(&x, 2 * h * rows * 4);
    cudaMalloc(&o, 2 * h * rows * 4);
    cudaMemset(x, 0, 2 * h * rows * 4);
    const double silu_bytes = 8.0 * n, geglu_bytes = 12.0 * h * rows;
    auto report = [](const char* name, double bytes, float ms) {
        printf("| %-44s | %8.1f us | %6.0f GB/s |\n", name, ms * 1e3, bytes / ms / 1e6);
    };
    printf("| variant | time | bandwidth |\n|---|---:|---:|\n");
    int blocks = (int)std::min<int64_t>((n + 255) / 256, 65536);
    report("silu flat, accurate expf + IEEE div (before)", silu_bytes,
           time_ms([&] { silu_flat<false><<<blocks, 256>>>((const char*)x, o, n, 4); }));
    report("silu flat, __expf + rcp (sdrt now)", silu_bytes,
           time_ms([&] { silu_flat<true><<<blocks, 256>>>((const char*)x, o, n, 4); }));
    report("silu 4 scalars a thread", silu_bytes,
           time_ms([&] { silu_ilp4<<<(n + 1023) / 1024, 256>>>(x, o, n); }));
    report("silu float4 a thread", silu_bytes,
           time_ms([&] { silu_vec4<<<(n / 4 + 255) / 256, 256>>>((const float4*)x, (float4*)o, n / 4); }));
    report("silu 2 float4 a thread", silu_bytes,
           time_ms([&] { silu_vec4x2<<<(n / 4 + 511) / 512, 256>>>((const float4*)x, (float4*)o, n / 4); }));
    report("geglu row walk, 4 scalars a thread (sdrt now)", geglu_bytes,
           time_ms([&] { geglu_rows_ilp4<<<dim3((h + 1023) / 1024, rows), 256>>>((const char*)x, o, h, rows, 4, 2 * h * 4); }));
    report("geglu float4, one block a row", geglu_bytes,
           time_ms([&] { geglu_rows_vec4<<<rows, 256>>>(x, o, h, rows); }));
    cudaError_t e = cudaDeviceSynchronize();
    printf("%s\n", cudaGetErrorString(e));
    return 0;
}
