#version 450
// upscale's bilinear and bicubic modes (sdrt/gpu/vulkan/ops/elementwise.py; nearest is a gather
// in elementwise.comp): 2-D resampling over dims 0/1, nearest over dims 2/3, as
// ggml_compute_forward_upscale_f32 (sdrt.ops.layout._upscale_reference). One invocation per
// output element. Bindings: 0 x (F32/F16/BF16, strided), 3 out (contiguous).
// u: 0-3 x ne, 4-7 x strides, 8-11 out ne, 12 off x, 13 off out, 14 work items, 15 mode
//    (0 bilinear, 1 bicubic, 2 bilinear with antialias); f: 0-3 out/in per dim in float32 (dims
//    0/1: (out-1)/(in-1) with align_corners), 4 the half-pixel offset (0.5, or 0 with align_corners).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;

float at(uint base, int x, int y) {
    return ld0(base + uint(x) * pc.u[4] + uint(y) * pc.u[5]);
}

float cubic1(float x) { const float a = -0.75; return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0; }
float cubic2(float x) { const float a = -0.75; return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a; }

void main() {
    uint n = pc.u[14], mode = pc.u[15];
    int n0 = int(pc.u[0]), n1 = int(pc.u[1]);
    uint o0 = pc.u[8], o1 = pc.u[9], o2 = pc.u[10];
    float off = pc.f[4];
    uint step_ = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * step_; i < n; i += step_ * gl_NumWorkGroups.y) {
        uint i0 = i % o0, r = i / o0, i1 = r % o1; r /= o1;
        uint i2 = r % o2, i3 = r / o2;
        uint j2 = uint(float(i2) / pc.f[2]), j3 = uint(float(i3) / pc.f[3]);
        uint base = pc.u[12] + j2 * pc.u[6] + j3 * pc.u[7];
        precise float cx = (float(i0) + off) / pc.f[0] - off;
        precise float cy = (float(i1) + off) / pc.f[1] - off;
        float v = 0.0;
        if (mode == 0u) {
            int fx = int(floor(cx)), fy = int(floor(cy));
            int x0 = clamp(fx, 0, n0 - 1), x1 = clamp(fx + 1, 0, n0 - 1);
            int y0 = clamp(fy, 0, n1 - 1), y1 = clamp(fy + 1, 0, n1 - 1);
            float dx = clamp(cx - float(x0), 0.0, 1.0), dy = clamp(cy - float(y0), 0.0, 1.0);
            v = at(base, x0, y0) * (1.0 - dx) * (1.0 - dy) + at(base, x1, y0) * dx * (1.0 - dy)
              + at(base, x0, y1) * (1.0 - dx) * dy + at(base, x1, y1) * dx * dy;
        } else if (mode == 1u) {
            float fx = floor(cx), fy = floor(cy);
            float tx = cx - fx, ty = cy - fy;
            float wx[4] = float[4](cubic2(tx + 1.0), cubic1(tx), cubic1(1.0 - tx), cubic2(2.0 - tx));
            float wy[4] = float[4](cubic2(ty + 1.0), cubic1(ty), cubic1(1.0 - ty), cubic2(2.0 - ty));
            for (int b = 0; b < 4; b++) {
                int y = clamp(int(fy) - 1 + b, 0, n1 - 1);
                float row = 0.0;
                for (int a = 0; a < 4; a++)
                    row += wx[a] * at(base, clamp(int(fx) - 1 + a, 0, n0 - 1), y);
                v += wy[b] * row;
            }
        } else {
            // triangle filter widened to 1/sf when downscaling; window truncated as ggml (= torch)
            float ccx = cx + off, ccy = cy + off;
            float sx = max(1.0, 1.0 / pc.f[0]), sy = max(1.0, 1.0 / pc.f[1]);
            int xlo = max(int(ccx - sx + off), 0), xhi = min(int(ccx + sx + off), n0);
            int ylo = max(int(ccy - sy + off), 0), yhi = min(int(ccy + sy + off), n1);
            float totx = 0.0, toty = 0.0;
            for (int x = xlo; x < xhi; x++) totx += max(1.0 - abs((float(x) - ccx + off) / sx), 0.0);
            for (int y = ylo; y < yhi; y++) {
                float wy = max(1.0 - abs((float(y) - ccy + off) / sy), 0.0);
                toty += wy;
                float row = 0.0;
                for (int x = xlo; x < xhi; x++)
                    row += max(1.0 - abs((float(x) - ccx + off) / sx), 0.0) * at(base, x, y);
                v += wy * row;
            }
            v /= (totx > 0.0 ? totx : 1.0) * (toty > 0.0 ? toty : 1.0);
        }
        st3(pc.u[13] + i, v);
    }
}
