#version 450
// Row and group reductions (sdrt/gpu/vulkan/ops/norm.py): softmax (scale, optional broadcast
// mask), layer_norm(_affine), rms_norm, l2_norm, group_norm(_affine, optional SiLU). One
// workgroup per row (or per group and batch), 256 threads reducing through shared memory.
// Bindings: 0 x, 1 mask or weight, 2 bias, 3 out (contiguous). OP: specialization constant 4.
// u: 0-3 x ne, 4 off x, 5 off 1, 6 off 2, 7 off out, 8-11 x strides, 12-15 mask strides (0 where it
//    broadcasts), 16 mask ne2, 17 mask ne3, 18 weight stride, 19 bias stride, 20 flags (1 weight,
//    2 bias, 4 silu, 8 mask), 21 channels per group, 22 groups, 23 work items; f: 0 eps or scale.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 4) const int OP = 0;
const int SOFTMAX = 0, LAYER = 1, RMS = 2, L2 = 3, GROUP = 4;
shared float red[256];

float reduce_sum(float v) {
    uint t = gl_LocalInvocationID.x;
    barrier();
    red[t] = v;
    barrier();
    for (uint s = 128u; s > 0u; s >>= 1) {
        if (t < s) red[t] += red[t + s];
        barrier();
    }
    return red[0];
}

float reduce_max(float v) {
    uint t = gl_LocalInvocationID.x;
    barrier();
    red[t] = v;
    barrier();
    for (uint s = 128u; s > 0u; s >>= 1) {
        if (t < s) red[t] = max(red[t], red[t + s]);
        barrier();
    }
    return red[0];
}

void main() {
    uint w = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (w >= pc.u[23]) return;
    uint t = gl_LocalInvocationID.x;
    uint ne0 = pc.u[0], ne1 = pc.u[1], ne2 = pc.u[2];
    uint flags = pc.u[20];
    if (OP == GROUP) {
        // elements (i0, i1, c) for c in the group's channels, batch i3
        uint G = pc.u[22], g = w % G, i3 = w / G, per = pc.u[21];
        uint c0 = g * per, c1 = min(ne2, c0 + per);
        uint plane = ne0 * ne1, cnt = plane * (c1 - c0);
        float s = 0.0;
        for (uint j = t; j < cnt; j += 256u) {
            uint i0 = j % ne0, i1 = (j / ne0) % ne1, c = c0 + j / plane;
            s += ld0(pc.u[4] + i0 * pc.u[8] + i1 * pc.u[9] + c * pc.u[10] + i3 * pc.u[11]);
        }
        float mean = reduce_sum(s) / float(cnt);
        float q = 0.0;
        for (uint j = t; j < cnt; j += 256u) {
            uint i0 = j % ne0, i1 = (j / ne0) % ne1, c = c0 + j / plane;
            float d = ld0(pc.u[4] + i0 * pc.u[8] + i1 * pc.u[9] + c * pc.u[10] + i3 * pc.u[11]) - mean;
            q += d * d;
        }
        float inv = inversesqrt(reduce_sum(q) / float(cnt) + pc.f[0]);
        for (uint j = t; j < cnt; j += 256u) {
            uint i0 = j % ne0, i1 = (j / ne0) % ne1, c = c0 + j / plane;
            float y = (ld0(pc.u[4] + i0 * pc.u[8] + i1 * pc.u[9] + c * pc.u[10] + i3 * pc.u[11]) - mean) * inv;
            if ((flags & 1u) != 0u) y *= ld1(pc.u[5] + c * pc.u[18]);
            if ((flags & 2u) != 0u) y += ld2(pc.u[6] + c * pc.u[19]);
            if ((flags & 4u) != 0u) y = y / (1.0 + exp(-y));
            st3(pc.u[7] + ((i3 * ne2 + c) * ne1 + i1) * ne0 + i0, y);
        }
        return;
    }
    uint i1 = w % ne1, i2 = (w / ne1) % ne2, i3 = w / (ne1 * ne2);
    uint xo = pc.u[4] + i1 * pc.u[9] + i2 * pc.u[10] + i3 * pc.u[11];
    uint oo = pc.u[7] + w * ne0;
    if (OP == SOFTMAX) {
        bool has_mask = (flags & 8u) != 0u;
        uint mo = pc.u[5] + i1 * pc.u[13] + (i2 % pc.u[16]) * pc.u[14] + (i3 % pc.u[17]) * pc.u[15];
        float m = -1.0 / 0.0;
        for (uint i = t; i < ne0; i += 256u) {
            float v = ld0(xo + i * pc.u[8]) * pc.f[0] + (has_mask ? ld1(mo + i * pc.u[12]) : 0.0);
            m = max(m, v);
        }
        m = reduce_max(m);
        float s = 0.0;
        for (uint i = t; i < ne0; i += 256u) {
            float v = ld0(xo + i * pc.u[8]) * pc.f[0] + (has_mask ? ld1(mo + i * pc.u[12]) : 0.0);
            s += exp(v - m);
        }
        s = reduce_sum(s);
        for (uint i = t; i < ne0; i += 256u) {
            float v = ld0(xo + i * pc.u[8]) * pc.f[0] + (has_mask ? ld1(mo + i * pc.u[12]) : 0.0);
            st3(oo + i, exp(v - m) / s);
        }
        return;
    }
    float mean = 0.0;
    if (OP == LAYER) {
        float s = 0.0;
        for (uint i = t; i < ne0; i += 256u) s += ld0(xo + i * pc.u[8]);
        mean = reduce_sum(s) / float(ne0);
    }
    float q = 0.0;
    for (uint i = t; i < ne0; i += 256u) {
        float d = ld0(xo + i * pc.u[8]) - mean;
        q += d * d;
    }
    q = reduce_sum(q);
    float inv = OP == L2 ? 1.0 / max(sqrt(q), pc.f[0]) : inversesqrt(q / float(ne0) + pc.f[0]);
    for (uint i = t; i < ne0; i += 256u) {
        float y = (ld0(xo + i * pc.u[8]) - mean) * inv;
        if ((flags & 1u) != 0u) y *= ld1(pc.u[5] + i * pc.u[18]);
        if ((flags & 2u) != 0u) y += ld2(pc.u[6] + i * pc.u[19]);
        st3(oo + i, y);
    }
}
