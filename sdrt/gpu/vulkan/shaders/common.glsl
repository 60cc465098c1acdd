// Shared by every shader: 4 storage-buffer bindings, each seen as F32, F16, BF16 (raw 16-bit)
// and raw 32-bit words; its dtype is specialization constant T<binding> (0 F32, 1 F16, 2 BF16,
// 3 raw 32-bit, 4 raw 16-bit), so one SPIR-V serves every dtype mix. Push constants: 24 uints
// and 8 floats whose meaning each shader states.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require

layout(push_constant) uniform PC { uint u[24]; float f[8]; } pc;

uint16_t f32_to_bf16(float x) {
    uint b = floatBitsToUint(x);
    if (isnan(x)) return uint16_t(0x7fc0u | (b >> 16));
    return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);   // round to nearest even
}

layout(constant_id = 0) const int T0 = 0;
layout(std430, set = 0, binding = 0) buffer F32_0 { float f0[]; };
layout(std430, set = 0, binding = 0) buffer F16_0 { float16_t h0[]; };
layout(std430, set = 0, binding = 0) buffer U16_0 { uint16_t s0[]; };
layout(std430, set = 0, binding = 0) buffer U32_0 { uint w0[]; };
float ld0(uint i) {
    if (T0 == 1) return float(h0[i]);
    if (T0 == 2) return uintBitsToFloat(uint(s0[i]) << 16);
    return f0[i];
}
void st0(uint i, float x) {
    if (T0 == 1) h0[i] = float16_t(x);
    else if (T0 == 2) s0[i] = f32_to_bf16(x);
    else f0[i] = x;
}

layout(constant_id = 1) const int T1 = 0;
layout(std430, set = 0, binding = 1) buffer F32_1 { float f1[]; };
layout(std430, set = 0, binding = 1) buffer F16_1 { float16_t h1[]; };
layout(std430, set = 0, binding = 1) buffer U16_1 { uint16_t s1[]; };
layout(std430, set = 0, binding = 1) buffer U32_1 { uint w1[]; };
float ld1(uint i) {
    if (T1 == 1) return float(h1[i]);
    if (T1 == 2) return uintBitsToFloat(uint(s1[i]) << 16);
    return f1[i];
}
void st1(uint i, float x) {
    if (T1 == 1) h1[i] = float16_t(x);
    else if (T1 == 2) s1[i] = f32_to_bf16(x);
    else f1[i] = x;
}

layout(constant_id = 2) const int T2 = 0;
layout(std430, set = 0, binding = 2) buffer F32_2 { float f2[]; };
layout(std430, set = 0, binding = 2) buffer F16_2 { float16_t h2[]; };
layout(std430, set = 0, binding = 2) buffer U16_2 { uint16_t s2[]; };
layout(std430, set = 0, binding = 2) buffer U32_2 { uint w2[]; };
float ld2(uint i) {
    if (T2 == 1) return float(h2[i]);
    if (T2 == 2) return uintBitsToFloat(uint(s2[i]) << 16);
    return f2[i];
}
void st2(uint i, float x) {
    if (T2 == 1) h2[i] = float16_t(x);
    else if (T2 == 2) s2[i] = f32_to_bf16(x);
    else f2[i] = x;
}

layout(constant_id = 3) const int T3 = 0;
layout(std430, set = 0, binding = 3) buffer F32_3 { float f3[]; };
layout(std430, set = 0, binding = 3) buffer F16_3 { float16_t h3[]; };
layout(std430, set = 0, binding = 3) buffer U16_3 { uint16_t s3[]; };
layout(std430, set = 0, binding = 3) buffer U32_3 { uint w3[]; };
float ld3(uint i) {
    if (T3 == 1) return float(h3[i]);
    if (T3 == 2) return uintBitsToFloat(uint(s3[i]) << 16);
    return f3[i];
}
void st3(uint i, float x) {
    if (T3 == 1) h3[i] = float16_t(x);
    else if (T3 == 2) s3[i] = f32_to_bf16(x);
    else f3[i] = x;
}
