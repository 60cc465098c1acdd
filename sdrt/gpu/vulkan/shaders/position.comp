#version 450
// Rotary embeddings (sdrt/gpu/vulkan/ops/position.py). One invocation per output element.
// OP (specialization constant 4) 0: rope, sd.cpp's ggml_ext_rope_apply with a precomputed pe;
// 1: rope_ext, ggml_rope_ext / ggml_rope_multi with angles from integer positions.
//
// rope:     bindings 0 x, 1 pe (F32), 3 out [D, L, H*N] contiguous.
//           u: 0-3 x ne (D, H, L, N), 4-7 x strides, 8-11 pe strides, 12 R, 13 interleaved,
//              14 off x, 15 off pe, 16 off out, 17 work items.
// rope_ext: bindings 0 x, 1 positions (I32), 2 freq factors (F32, optional), 3 out (x's shape,
//           contiguous). u: 0-3 x ne, 4-7 x strides, 8 pos stride, 9 ff stride, 10 off x,
//           11 off pos, 12 off ff, 13 off out, 14 n_dims, 15 n_offs, 16 kind (0 normal pairs
//           (2k, 2k+1), 1 neox (k, k + n_dims/2), 2 vision (k, k + n_dims)), 17 pairs, 18 mode
//           (ggml's), 19 has ff, 20-23 sections. f: 0 theta scale, 1 low, 2 high, 3 freq scale,
//           4 ext factor, 5 mscale (float32 scalars computed on the host as the CPU does).
// The angle of pair k replays the CPU's float32 loop (sdrt.ops.position.rope_cache): theta is
// a running product pos*s*s*..., not pos*s^k; `precise` keeps the compiler from fusing FMAs.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 4) const int OP = 0;
const int MODE_MROPE = 8, MODE_VISION = 24, MODE_IMROPE = 40;

void angle(uint l, uint k, uint L, out float c, out float s) {
    int mode = int(pc.u[18]);
    bool multi = mode == MODE_MROPE || mode == MODE_IMROPE || mode == MODE_VISION;
    bool vision = mode == MODE_VISION;
    precise float base[4], theta[4];
    for (int a = 0; a < 4; a++) {
        base[a] = (multi || a == 0) ? float(int(w1[pc.u[11] + (uint(a) * L + l) * pc.u[8]])) : 0.0;
        theta[a] = base[a];
    }
    int s0 = int(pc.u[20]), s1 = int(pc.u[21]), s2 = int(pc.u[22]), s3 = int(pc.u[23]);
    int sect = s0 + s1 + s2 + s3, sec_w = s0 + s1, sec_e = sec_w + s2;
    int axis = 0;
    precise float ts = pc.f[0];
    for (int j = 0; j <= int(k); j++) {
        axis = 0;
        if (multi) {
            int sector = j % sect;
            if (vision) {
                if (sector == 0) theta[0] = base[0];
                else if (sector == s0) theta[1] = base[1];
                else if (sector == sec_w) theta[2] = base[2];
                else if (sector == sec_e) theta[3] = base[3];
            }
            if (mode == MODE_IMROPE) {
                if (sector % 3 == 1 && sector < 3 * s1) axis = 1;
                else if (sector % 3 == 2 && sector < 3 * s2) axis = 2;
                else if (sector % 3 == 0 && sector < 3 * s0) axis = 0;
                else axis = 3;
            } else {
                axis = sector < s0 ? 0 : sector < sec_w ? 1 : sector < sec_w + s2 ? 2 : 3;
            }
        }
        if (j < int(k))
            for (int a = 0; a < 4; a++) theta[a] = theta[a] * ts;
    }
    precise float ff = pc.u[19] != 0u ? f2[pc.u[12] + k * pc.u[9]] : 1.0;
    precise float extrap = theta[axis] / ff;
    precise float th = pc.f[3] * extrap;
    if (pc.f[4] != 0.0) {
        precise float y = (float(k) - pc.f[1]) / max(0.001, pc.f[2] - pc.f[1]);
        precise float mix = (1.0 - min(1.0, max(0.0, y))) * pc.f[4];
        th = th * (1.0 - mix) + extrap * mix;
    }
    c = cos(th) * pc.f[5];
    s = sin(th) * pc.f[5];
}

void main() {
    uint D = pc.u[0], H = pc.u[1], L = pc.u[2];
    uint n = OP == 0 ? pc.u[17] : D * H * L * pc.u[3];
    uint step_ = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * step_; i < n; i += step_ * gl_NumWorkGroups.y) {
        uint d = i % D, r = i / D;
        if (OP == 0) {
            // output row r: token l of head-batch hn = n*H + h
            uint l = r % L, hn = r / L, h = hn % H, b = hn / H;
            uint xr = pc.u[14] + h * pc.u[5] + l * pc.u[6] + b * pc.u[7];
            uint R = pc.u[12];
            float v;
            if (d < 2u * R) {
                uint k, ia, ib, second;
                if (pc.u[13] != 0u) { k = d >> 1; ia = 2u * k; ib = ia + 1u; second = d & 1u; }
                else { k = d < R ? d : d - R; ia = k; ib = k + R; second = d >= R ? 1u : 0u; }
                float a = ld0(xr + ia * pc.u[4]), bb = ld0(xr + ib * pc.u[4]);
                uint m = pc.u[15] + l * pc.u[11] + k * pc.u[10] + second * pc.u[9];
                v = a * f1[m] + bb * f1[m + pc.u[8]];
            } else {
                v = ld0(xr + d * pc.u[4]);
            }
            st3(pc.u[16] + i, v);
        } else {
            uint h = r % H, l = (r / H) % L, b = r / (H * L);
            uint xr = pc.u[10] + h * pc.u[5] + l * pc.u[6] + b * pc.u[7];
            uint nd = pc.u[14], kind = pc.u[16];
            uint half_ = kind == 2u ? nd : nd / 2u;
            uint lo = kind == 2u ? 0u : pc.u[15], hi = kind == 2u ? 2u * nd : pc.u[15] + nd;
            float v;
            if (d >= lo && d < hi) {
                uint rel = d - lo, k, ia, ib, second;
                if (kind == 0u) { k = rel >> 1; ia = lo + 2u * k; ib = ia + 1u; second = rel & 1u; }
                else { second = rel >= half_ ? 1u : 0u; k = second != 0u ? rel - half_ : rel; ia = lo + k; ib = ia + half_; }
                float c, s;
                angle(l, k, L, c, s);
                float a = ld0(xr + ia * pc.u[4]), bb = ld0(xr + ib * pc.u[4]);
                v = second != 0u ? a * s + bb * c : a * c - bb * s;
            } else {
                v = ld0(xr + d * pc.u[4]);
            }
            st3(pc.u[13] + i, v);
        }
    }
}
