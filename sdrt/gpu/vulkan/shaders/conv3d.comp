#version 450
// conv3d in ggml_conv_3d's layout (sdrt/gpu/vulkan/ops/conv.py): x [W, H, D, IC*N], w [KW, KH,
// KD, IC*OC], out [OW, OH, OD, OC*N] F32 contiguous (batch outer in dim 3), optional bias [OC].
// Direct form: one invocation per output element, looping over IC x KD x KH x KW (the video
// VAEs' few conv3d layers; the 2-D convs of the image models use conv.comp's implicit GEMM).
// Bindings: 0 x, 1 w, 2 bias, 3 out. u: 0 OW | OH << 16, 1 OD, 2 OC, 3 W | H << 16, 4 D, 5 IC,
// 6-9 x strides, 10-13 w strides, 14 bias stride, 15 has bias, 16-19 offsets x, w, bias, out,
// 20 work items, 21-23 per axis x, y, z: stride | pad << 8 | dilation << 16 | kernel << 24.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
    uint OW = pc.u[0] & 0xffffu, OH = pc.u[0] >> 16, OD = pc.u[1], OC = pc.u[2];
    int W = int(pc.u[3] & 0xffffu), H = int(pc.u[3] >> 16), D = int(pc.u[4]);
    uint IC = pc.u[5], n = pc.u[20];
    int sx = int(pc.u[21] & 255u), px = int((pc.u[21] >> 8) & 255u), dx = int((pc.u[21] >> 16) & 255u), KW = int(pc.u[21] >> 24);
    int sy = int(pc.u[22] & 255u), py = int((pc.u[22] >> 8) & 255u), dy = int((pc.u[22] >> 16) & 255u), KH = int(pc.u[22] >> 24);
    int sz = int(pc.u[23] & 255u), pz = int((pc.u[23] >> 8) & 255u), dz = int((pc.u[23] >> 16) & 255u), KD = int(pc.u[23] >> 24);
    uint step_ = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * step_; i < n; i += step_ * gl_NumWorkGroups.y) {
        uint ow = i % OW, r = i / OW, oh = r % OH; r /= OH;
        uint od = r % OD, q = r / OD, oc = q % OC, b = q / OC;
        float acc = pc.u[15] != 0u ? ld2(pc.u[18] + oc * pc.u[14]) : 0.0;
        for (uint c = 0u; c < IC; c++) {
            uint xc = pc.u[16] + (b * IC + c) * pc.u[9];
            uint wc = pc.u[17] + (oc * IC + c) * pc.u[13];
            for (int kz = 0; kz < KD; kz++) {
                int z = int(od) * sz - pz + kz * dz;
                if (z < 0 || z >= D) continue;
                for (int ky = 0; ky < KH; ky++) {
                    int y = int(oh) * sy - py + ky * dy;
                    if (y < 0 || y >= H) continue;
                    for (int kx = 0; kx < KW; kx++) {
                        int x = int(ow) * sx - px + kx * dx;
                        if (x < 0 || x >= W) continue;
                        acc += ld0(xc + uint(x) * pc.u[6] + uint(y) * pc.u[7] + uint(z) * pc.u[8])
                             * ld1(wc + uint(kx) * pc.u[10] + uint(ky) * pc.u[11] + uint(kz) * pc.u[12]);
                    }
                }
            }
        }
        st3(pc.u[19] + i, acc);
    }
}
