#version 450
// conv2d (sdrt/gpu/vulkan/ops/conv.py) as an implicit GEMM: im2col happens in the tile loader
// (no column buffer), then matmul.comp's 64 x 64 tiling. For image n and group g:
// out[ow, oh, g*OCg + oc, n] = b[oc'] + sum over k = (c, kh, kw) of w[kw, kh, c, oc'] * x[iw, ih, g*Cg + c, n]
// with ih = oh*sy - py + kh*dy (zero outside, or wrapped where circular). Transposed (flag bit
// 19, conv_transpose2d, one group): the gather form, ih = (oh + py - kh*dy) / sy where that
// divides exactly and lands inside, with w's OC/C strides swapped by the host. Bindings: 0 w, 1 x,
// 2 bias, 3 out (F32, contiguous [OW, OH, OC, N]).
// u: 0 OW, 1 OH, 2 OCg, 3 Cg, 4 W, 5 H, 6 KW | KH << 16, 7 sx | sy << 16, 8 px | py << 16,
//    9 dx | dy << 16, 10 G | circular x << 16 | circular y << 17 | bias << 18 | transposed << 19, 11-14 offsets
//    w, x, b, out, 15-18 w strides, 19-22 x strides, 23 bias stride.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
const uint TILE = 64u, BK = 16u;
shared float ws[BK][TILE + 1u];
shared float xs[BK][TILE + 1u];

void main() {
    uint OW = pc.u[0], OH = pc.u[1], OCg = pc.u[2], Cg = pc.u[3];
    int W = int(pc.u[4]), H = int(pc.u[5]);
    uint KW = pc.u[6] & 0xffffu, KH = pc.u[6] >> 16;
    int sx = int(pc.u[7] & 0xffffu), sy = int(pc.u[7] >> 16);
    int px = int(pc.u[8] & 0xffffu), py = int(pc.u[8] >> 16);
    int dx = int(pc.u[9] & 0xffffu), dy = int(pc.u[9] >> 16);
    uint G = pc.u[10] & 0xffffu;
    bool cx = (pc.u[10] & 0x10000u) != 0u, cy = (pc.u[10] & 0x20000u) != 0u, bias = (pc.u[10] & 0x40000u) != 0u;
    bool tr = (pc.u[10] & 0x80000u) != 0u;
    uint z = gl_WorkGroupID.z, g = z % G, n = z / G;
    uint M = OW * OH, K = Cg * KH * KW;
    uint wo = pc.u[11] + g * OCg * pc.u[18];
    uint xo = pc.u[12] + g * Cg * pc.u[21] + n * pc.u[22];
    uint n0 = gl_WorkGroupID.x * TILE, m0 = gl_WorkGroupID.y * TILE;
    uint t = gl_LocalInvocationID.x, tn = t % 16u, tm = t / 16u;
    float acc[4][4];
    for (uint i = 0u; i < 4u; i++)
        for (uint j = 0u; j < 4u; j++) acc[i][j] = 0.0;
    for (uint k0 = 0u; k0 < K; k0 += BK) {
        for (uint l = t; l < BK * TILE; l += 256u) {
            uint kk = l % BK, r = l / BK, k = k0 + kk, oc = n0 + r, m = m0 + r;
            uint kw = k % KW, kh = (k / KW) % KH, c = k / (KW * KH);
            ws[kk][r] = (k < K && oc < OCg) ? ld0(wo + kw * pc.u[15] + kh * pc.u[16] + c * pc.u[17] + oc * pc.u[18]) : 0.0;
            float v = 0.0;
            if (k < K && m < M) {
                int iw, ih;
                bool ok = true;
                if (tr) {
                    int a = int(m % OW) + px - int(kw) * dx, b = int(m / OW) + py - int(kh) * dy;
                    ok = a >= 0 && b >= 0 && a % sx == 0 && b % sy == 0;
                    iw = a / sx; ih = b / sy;
                } else {
                    iw = int(m % OW) * sx - px + int(kw) * dx; ih = int(m / OW) * sy - py + int(kh) * dy;
                    if (cx) iw = ((iw % W) + W) % W;
                    if (cy) ih = ((ih % H) + H) % H;
                }
                if (ok && iw >= 0 && iw < W && ih >= 0 && ih < H)
                    v = ld1(xo + uint(iw) * pc.u[19] + uint(ih) * pc.u[20] + c * pc.u[21]);
            }
            xs[kk][r] = v;
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
    uint OC = OCg * G;
    for (uint i = 0u; i < 4u; i++) {
        uint oc = n0 + tn + 16u * i;
        if (oc >= OCg) continue;
        uint ocg = g * OCg + oc;
        float bv = bias ? ld2(pc.u[13] + ocg * pc.u[23]) : 0.0;
        for (uint j = 0u; j < 4u; j++) {
            uint m = m0 + tm + 16u * j;
            if (m < M) st3(pc.u[14] + (n * OC + ocg) * M + m, acc[i][j] + bv);
        }
    }
}
