#version 450
// Element-wise ops over strided operands (sdrt/gpu/vulkan/ops/elementwise.py): unary, binary with
// broadcasting (stride 0), geglu, cast and copies. Binding 0: x (a), 1: b, 3: out (contiguous).
// The op is specialization constant 4 (ids below = elementwise.py's UNARY/BINARY tables).
// u: 0 n, 1-3 merged ne0..ne2, 4 off a, 5 off b, 6 off out, 7-10 strides a, 11-14 strides b,
//    15 geglu's gate offset, 16-19 out strides (used when u20 is 1: a strided output, as concat
//    writes its parts), 20 strided-out flag; f: 0-1 the op's params (slope / min,max / s,b).
// GET_ROWS: dims are not merged; binding 1 holds the ids (I32, or I64 read as its low word:
//    strides u11-14 in 32-bit words), a row id outside [0, u21) writes zeros.
// UPSCALE (nearest), PAD (and repeat: circular padding by 0): dims not merged; each output
//    coordinate maps to a source one. UPSCALE: src = int(o / f[d]) with f the float32 scale
//    factors. PAD: u11-14 low pads, u16-19 source ne, u21 mode (0 constant f[0], 1 circular,
//    2 reflect, 3 replicate). The raw modes of T0 (3, 4) copy bits (I32, I16).
// TSEMB: timestep_embedding, out [dim, n]: u1 dim, u2 half; f0 ln(max_period).
// POOL (avg/max over dims 0, 1): u11-13 kernel, stride, padding as x | y << 16, u14 1 for max,
//    u16-17 x ne0, ne1; padding counts as 0 (avg, divided by the whole window) or -FLT_MAX (max).
// ARANGE: out[i] = f0 + f1 * i.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 4) const int OP = 0;

const int NEG = 0, ABS = 1, SQR = 2, SQRT = 3, EXP = 4, LOG = 5, SIN = 6, COS = 7, STEP = 8, RELU = 9,
    LEAKY_RELU = 10, SILU = 11, SIGMOID = 12, TANH = 13, GELU = 14, GELU_TANH = 15, GELU_QUICK = 16,
    CLAMP = 17, SCALE = 18, COPY = 19, GEGLU_ERF = 20, GEGLU_TANH = 21, RAW32 = 22, RAW16 = 23, GET_ROWS = 24, UPSCALE = 25, PAD = 26, TSEMB = 27, POOL = 28, ARANGE = 29,
    ADD = 100, SUB = 101, MUL = 102, DIV = 103;

float erf_(float x) {   // Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7)
    float t = 1.0 / (1.0 + 0.3275911 * abs(x));
    float y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
                      + 0.254829592) * t * exp(-x * x);
    return sign(x) * y;
}
float tanh_(float x) { return tanh(clamp(x, -15.0, 15.0)); }
float gelu_erf(float x) { return 0.5 * x * (1.0 + erf_(x * 0.7071067811865476)); }
float gelu_tanh(float x) { return 0.5 * x * (1.0 + tanh_(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

float unary(float x) {
    switch (OP) {
    case NEG: return -x;
    case ABS: return abs(x);
    case SQR: return x * x;
    case SQRT: return sqrt(x);
    case EXP: return exp(x);
    case LOG: return log(x);
    case SIN: return sin(x);
    case COS: return cos(x);
    case STEP: return x > 0.0 ? 1.0 : 0.0;
    case RELU: return max(x, 0.0);
    case LEAKY_RELU: return x > 0.0 ? x : x * pc.f[0];
    case SILU: return x / (1.0 + exp(-x));
    case SIGMOID: return 1.0 / (1.0 + exp(-x));
    case TANH: return tanh_(x);
    case GELU: return gelu_erf(x);
    case GELU_TANH: return gelu_tanh(x);
    case GELU_QUICK: return x / (1.0 + exp(-1.702 * x));
    case CLAMP: return min(max(x, pc.f[0]), pc.f[1]);
    case SCALE: return x * pc.f[0] + pc.f[1];
    }
    return x;   // COPY
}

uint walk(uint i, uint s) {   // element offset of output index i in an operand with strides u[s..s+3]
    uint i0 = i % pc.u[1]; uint r = i / pc.u[1];
    uint i1 = r % pc.u[2]; r /= pc.u[2];
    uint i2 = r % pc.u[3]; uint i3 = r / pc.u[3];
    return i0 * pc.u[s] + i1 * pc.u[s + 1] + i2 * pc.u[s + 2] + i3 * pc.u[s + 3];
}

void main() {
    uint n = pc.u[0];
    uint step_ = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * step_; i < n; i += step_ * gl_NumWorkGroups.y) {
        uint io = pc.u[6] + (pc.u[20] != 0u ? walk(i, 16) : i);
        if (OP == GET_ROWS) {
            uint i0 = i % pc.u[1], r = i / pc.u[1], i1 = r % pc.u[2], i2 = (r / pc.u[2]) % pc.u[3];
            uint i3 = r / (pc.u[2] * pc.u[3]);
            int id = int(w1[pc.u[5] + i1 * pc.u[11] + i2 * pc.u[12] + i3 * pc.u[13]]);
            bool ok = id >= 0 && uint(id) < pc.u[21];
            st3(io, ok ? ld0(pc.u[4] + i0 * pc.u[7] + uint(id) * pc.u[8] + i2 * pc.u[9] + i3 * pc.u[10]) : 0.0);
            continue;
        }
        if (OP == UPSCALE || OP == PAD) {
            uint o[4];
            o[0] = i % pc.u[1]; uint r = i / pc.u[1]; o[1] = r % pc.u[2]; r /= pc.u[2]; o[2] = r % pc.u[3]; o[3] = r / pc.u[3];
            uint src = pc.u[4];
            bool inside = true;
            for (int d = 0; d < 4; d++) {
                int j;
                if (OP == UPSCALE) {
                    j = int(float(o[d]) / pc.f[d]);
                } else {
                    int n = int(pc.u[16 + d]);
                    j = int(o[d]) - int(pc.u[11 + d]);
                    uint mode = pc.u[21];
                    if (mode == 1u) j = ((j % n) + n) % n;
                    else if (mode == 2u) {
                        int per = max(2 * (n - 1), 1);
                        j = ((j % per) + per) % per;
                        if (j >= n) j = per - j;
                    } else if (mode == 3u) j = clamp(j, 0, n - 1);
                    else if (j < 0 || j >= n) inside = false;
                }
                src += uint(max(j, 0)) * pc.u[7 + d];
            }
            if (T0 == 3) w3[io] = inside ? w0[src] : floatBitsToUint(pc.f[0]);
            else if (T0 == 4) s3[io] = inside ? s0[src] : uint16_t(0);
            else st3(io, inside ? ld0(src) : pc.f[0]);
            continue;
        }
        if (OP == ARANGE) { st3(io, pc.f[0] + pc.f[1] * float(i)); continue; }
        if (OP == POOL) {
            uint o0 = i % pc.u[1], r = i / pc.u[1], o1 = r % pc.u[2]; r /= pc.u[2];
            uint o2 = r % pc.u[3], o3 = r / pc.u[3];
            int k0 = int(pc.u[11] & 0xffffu), k1 = int(pc.u[11] >> 16);
            int s0 = int(pc.u[12] & 0xffffu), s1 = int(pc.u[12] >> 16);
            int p0 = int(pc.u[13] & 0xffffu), p1 = int(pc.u[13] >> 16);
            bool is_max = pc.u[14] != 0u;
            float acc = is_max ? -3.4028234663852886e38 : 0.0;
            uint base = pc.u[4] + o2 * pc.u[9] + o3 * pc.u[10];
            for (int b = 0; b < k1; b++) {
                int y = int(o1) * s1 - p1 + b;
                for (int a = 0; a < k0; a++) {
                    int x = int(o0) * s0 - p0 + a;
                    float v = (x >= 0 && x < int(pc.u[16]) && y >= 0 && y < int(pc.u[17]))
                        ? ld0(base + uint(x) * pc.u[7] + uint(y) * pc.u[8]) : (is_max ? -3.4028234663852886e38 : 0.0);
                    acc = is_max ? max(acc, v) : acc + v;
                }
            }
            st3(io, is_max ? acc : acc / float(k0 * k1));
            continue;
        }
        if (OP == TSEMB) {
            uint d = i % pc.u[1], k = i / pc.u[1], half_ = pc.u[2];
            float y = 0.0;
            if (d < 2u * half_) {
                uint j = d < half_ ? d : d - half_;
                float arg = ld0(pc.u[4] + k * pc.u[7]) * exp(-pc.f[0] * float(j) / float(half_));
                arg -= 6.283185307179586 * round(arg / 6.283185307179586);    // sin/cos are accurate near 0
                y = d < half_ ? cos(arg) : sin(arg);
            }
            st3(io, y);
            continue;
        }
        uint ia = pc.u[4] + walk(i, 7);
        if (OP == RAW32) { w3[io] = w0[ia]; continue; }
        if (OP == RAW16) { s3[io] = s0[ia]; continue; }
        float x = ld0(ia), y;
        if (OP >= ADD) {
            float b = ld1(pc.u[5] + walk(i, 11));
            y = OP == ADD ? x + b : OP == SUB ? x - b : OP == MUL ? x * b : x / b;
        } else if (OP == GEGLU_ERF || OP == GEGLU_TANH) {
            float g = ld0(ia + pc.u[15]);
            y = x * (OP == GEGLU_ERF ? gelu_erf(g) : gelu_tanh(g));
        } else {
            y = unary(x);
        }
        st3(io, y);
    }
}
