// Generated from the op registry (sdrt.ops.registry.OPS, OpDef.kind) by
// tools/build_cuda_kernels.py: do not edit. elementwise.cu instantiates X(op) for each.
#pragma once
#define SDRT_UNARY_OPS(X) X(neg) X(abs) X(sqr) X(sqrt) X(exp) X(log) X(sin) X(cos) X(step) X(relu) X(leaky_relu) X(silu) X(sigmoid) X(tanh) X(gelu) X(gelu_tanh) X(gelu_quick) X(clamp) X(scale)
#define SDRT_BINARY_OPS(X) X(add) X(sub) X(mul) X(div)
