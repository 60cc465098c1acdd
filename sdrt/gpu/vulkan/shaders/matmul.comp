#version 450
// mul_mat (sdrt/gpu/vulkan/ops/matmul.py): out[n, m, b] = sum_k w[k, n, b / r] * x[k, m, b], a tiled
// shared-memory GEMM: a workgroup computes a 64 x 64 tile of out, each of its 256 threads a 4 x 4
// block, stepping through K 16 at a time; both operands read through their strides (any
// F32/F16/BF16), accumulated in F32. Bindings: 0 w, 1 x, 3 out (F32, contiguous).
// Q8_0 weights (constant 5 = 1) are dequantized in the tile loader: a block is 17 16-bit words
// (an F16 scale, then 32 int8), and w's offset and strides (dims 1-3) come in 16-bit words.
// u: 0 N, 1 M, 2 K, 3 x ne2, 4-5 batch ratios x/w in dims 2, 3, 6 off w, 7 off x, 8 off out,
//    9-12 w strides, 13-16 x strides.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
const uint TILE = 64u, BK = 16u;
layout(constant_id = 5) const int WQ = 0;
shared float ws[BK][TILE + 1u];

float ldw(uint base, uint k) {
    if (WQ == 1) {
        uint word = base + (k / 32u) * 17u, j = k % 32u;
        uint pair = uint(s0[word + 1u + j / 2u]);
        int q = int(((j & 1u) != 0u ? pair >> 8 : pair) << 24) >> 24;
        return float(h0[word]) * float(q);
    }
    return ld0(base + k * pc.u[9]);
}
shared float xs[BK][TILE + 1u];

void main() {
    uint N = pc.u[0], M = pc.u[1], K = pc.u[2], b2 = pc.u[3];
    uint z = gl_WorkGroupID.z, i2 = z % b2, i3 = z / b2;
    uint wo = pc.u[6] + (i2 / pc.u[4]) * pc.u[11] + (i3 / pc.u[5]) * pc.u[12];
    uint xo = pc.u[7] + i2 * pc.u[15] + i3 * pc.u[16];
    uint n0 = gl_WorkGroupID.x * TILE, m0 = gl_WorkGroupID.y * TILE;
    uint t = gl_LocalInvocationID.x, tn = t % 16u, tm = t / 16u;
    float acc[4][4];
    for (uint i = 0u; i < 4u; i++)
        for (uint j = 0u; j < 4u; j++) acc[i][j] = 0.0;
    for (uint k0 = 0u; k0 < K; k0 += BK) {
        for (uint l = t; l < BK * TILE; l += 256u) {
            uint kk = l % BK, r = l / BK, k = k0 + kk, n = n0 + r, m = m0 + r;
            ws[kk][r] = (k < K && n < N) ? ldw(wo + n * pc.u[10], k) : 0.0;
            xs[kk][r] = (k < K && m < M) ? ld1(xo + k * pc.u[13] + m * pc.u[14]) : 0.0;
        }
        barrier();
        for (uint kk = 0u; kk < BK; kk++) {
            float a[4], b[4];
            for (uint i = 0u; i < 4u; i++) { a[i] = ws[kk][tn + 16u * i]; b[i] = xs[kk][tm + 16u * i]; }
            for (uint i = 0u; i < 4u; i++)
                for (uint j = 0u; j < 4u; j++) acc[i][j] += a[i] * b[j];
        }
        barrier();
    }
    uint ob = pc.u[8] + (i3 * b2 + i2) * M * N;
    for (uint j = 0u; j < 4u; j++) {
        uint m = m0 + tm + 16u * j;
        if (m >= M) continue;
        for (uint i = 0u; i < 4u; i++) {
            uint n = n0 + tn + 16u * i;
            if (n < N) st3(ob + m * N + n, acc[i][j]);
        }
    }
}
