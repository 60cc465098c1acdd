#version 450
// attention (sdrt/gpu/vulkan/ops/attention.py): out = softmax(q k^T * scale + mask) v per batch and
// head, flash-attention style: one workgroup per query row walks the keys in chunks of 256 (a
// thread per key scores it), keeping a running max and sum (online softmax), and the threads
// then accumulate the chunk's weighted values over the head dim. Fully masked rows give 0.
// Bindings: 0 q, 1 k, 2 v, 3 out (F32 [Dv, Lq, H, N]), 4 mask (dtype: constant 5).
// u: 0 D | Dv << 16, 1 Lq, 2 Lk, 3 H, 4 N, 5 rh | rn << 16 (GQA / batch ratios), 6-10 offsets
//    q, k, v, out, mask, 11-13 q strides (dims 1-3), 14-16 k, 17-19 v, 20-22 mask (0 where it
//    broadcasts), 23 mask ne2 | ne3 << 16; f: 0 scale, 1 has mask. Dim 0 is contiguous.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 5) const int T4 = 0;
layout(std430, set = 0, binding = 4) buffer F32_4 { float f4[]; };
layout(std430, set = 0, binding = 4) buffer F16_4 { float16_t h4[]; };
layout(std430, set = 0, binding = 4) buffer U16_4 { uint16_t s4[]; };
float ld4(uint i) {
    if (T4 == 1) return float(h4[i]);
    if (T4 == 2) return uintBitsToFloat(uint(s4[i]) << 16);
    return f4[i];
}
const float NEG_INF = -1.0 / 0.0;
shared float red[256];
shared float qs[512];
shared float ps[256];

float reduce(float v, bool is_max) {
    uint t = gl_LocalInvocationID.x;
    barrier();
    red[t] = v;
    barrier();
    for (uint s = 128u; s > 0u; s >>= 1) {
        if (t < s) red[t] = is_max ? max(red[t], red[t + s]) : red[t] + red[t + s];
        barrier();
    }
    return red[0];
}

void main() {
    uint D = pc.u[0] & 0xffffu, Dv = pc.u[0] >> 16, Lq = pc.u[1], Lk = pc.u[2], H = pc.u[3], N = pc.u[4];
    uint rh = pc.u[5] & 0xffffu, rn = pc.u[5] >> 16;
    uint w = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (w >= Lq * H * N) return;
    uint i = w % Lq, h = (w / Lq) % H, n = w / (Lq * H);
    uint t = gl_LocalInvocationID.x;
    uint qo = pc.u[6] + i * pc.u[11] + h * pc.u[12] + n * pc.u[13];
    uint ko = pc.u[7] + (h / rh) * pc.u[15] + (n / rn) * pc.u[16];
    uint vo = pc.u[8] + (h / rh) * pc.u[18] + (n / rn) * pc.u[19];
    uint mo = pc.u[10] + i * pc.u[20] + (h % (pc.u[23] & 0xffffu)) * pc.u[21] + (n % (pc.u[23] >> 16)) * pc.u[22];
    bool has_mask = pc.f[1] != 0.0;
    for (uint d = t; d < D; d += 256u) qs[d] = ld0(qo + d);
    barrier();
    float m = NEG_INF, l = 0.0, acc0 = 0.0, acc1 = 0.0;
    for (uint c0 = 0u; c0 < Lk; c0 += 256u) {
        uint j = c0 + t;
        float s = NEG_INF;
        if (j < Lk) {
            uint kr = ko + j * pc.u[14];
            float dot_ = 0.0;
            for (uint d = 0u; d < D; d++) dot_ += qs[d] * ld1(kr + d);
            s = dot_ * pc.f[0] + (has_mask ? ld4(mo + j) : 0.0);
        }
        float cm = reduce(s, true);
        float nm = max(m, cm);
        float p = (nm == NEG_INF || s == NEG_INF) ? 0.0 : exp(s - nm);
        ps[t] = p;
        float cs = reduce(p, false);       // its barriers also publish ps
        float alpha = (m == NEG_INF) ? 0.0 : exp(m - nm);
        l = l * alpha + cs;
        m = nm;
        uint cnt = min(256u, Lk - c0);
        if (t < Dv) {
            float a = acc0 * alpha;
            for (uint jj = 0u; jj < cnt; jj++) a += ps[jj] * ld2(vo + (c0 + jj) * pc.u[17] + t);
            acc0 = a;
        }
        if (t + 256u < Dv) {
            float a = acc1 * alpha;
            for (uint jj = 0u; jj < cnt; jj++) a += ps[jj] * ld2(vo + (c0 + jj) * pc.u[17] + t + 256u);
            acc1 = a;
        }
        barrier();
    }
    uint oo = pc.u[9] + w * Dv;
    float inv = l > 0.0 ? 1.0 / l : 0.0;
    if (t < Dv) st3(oo + t, acc0 * inv);
    if (t + 256u < Dv) st3(oo + t + 256u, acc1 * inv);
}
