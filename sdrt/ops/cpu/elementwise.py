"""CPU kernels for element-wise ops. One Numba kernel per arity; the op is a row-level switch.
GEGLU (a * gelu(gate) over the two halves of ne[0]) has its own fused kernels.

Inputs of any float dtype are widened to float32 first (Numba has no fp16/bf16 on CPU);
activations are F32 in practice, where the kernels read and write the views directly.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .. import elementwise as _defs  # noqa: F401  (registers the ops whose codes follow)
from ..registry import ops_of_kind
from . import CPU
from ._util import as4d, f32_input, f32_output, store
from ._util import _bits_as_f32, _f32_as_bits, exp32
from .norm import FM

# The codes the kernels switch on, from the op registry (OPS order). Numba freezes these globals
# into the compiled (and cached) kernels; each formula below names its op through them.
BINARY_CODES = {name: i for i, name in enumerate(ops_of_kind("binary"))}
UNARY_CODES = {name: i for i, name in enumerate(ops_of_kind("unary"))}
ADD, SUB, MUL = BINARY_CODES["add"], BINARY_CODES["sub"], BINARY_CODES["mul"]
NEG, ABS, SQR, SQRT, EXP, LOG, SIN, COS = (UNARY_CODES[n] for n in ("neg", "abs", "sqr", "sqrt", "exp", "log",
                                                                    "sin", "cos"))
STEP, RELU, LEAKY_RELU, SILU, SIGMOID, TANH = (UNARY_CODES[n] for n in ("step", "relu", "leaky_relu", "silu",
                                                                        "sigmoid", "tanh"))
GELU, GELU_TANH, GELU_QUICK, CLAMP, SCALE = (UNARY_CODES[n] for n in ("gelu", "gelu_tanh", "gelu_quick",
                                                                      "clamp", "scale"))


@njit(parallel=True, fastmath=True, cache=True)
def _binary4(a, b, out, op):
    n3, n2, n1, n0 = out.shape
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        ra = a[i3, i2, i1]
        rb = b[i3, i2, i1]
        ro = out[i3, i2, i1]
        if op == ADD:
            for i in range(n0):
                ro[i] = ra[i] + rb[i]
        elif op == SUB:
            for i in range(n0):
                ro[i] = ra[i] - rb[i]
        elif op == MUL:
            for i in range(n0):
                ro[i] = ra[i] * rb[i]
        else:
            for i in range(n0):
                ro[i] = ra[i] / rb[i]


@njit(parallel=True, cache=True)  # no fastmath: it turns / into an approximate reciprocal
def _binary_rows(a, sa3, sa2, sa1, sa0, b, sb3, sb2, sb1, sb0, out, n3, n2, n1, n0, op):
    """_binary4 on flat buffers (see _gelu_tanh_rows): row (i3, i2, i1) of a starts at
    i3*sa3 + i2*sa2 + i1*sa1, its elements sa0 apart (1, or 0 for a broadcast scalar per row);
    same for b; out C-contiguous. Broadcast operands (a bias row, a per-channel embedding) have
    zero strides, which made the 4-D kernel's views layout 'A' and its loops scalar."""
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        pa = np.uint64(i3 * sa3 + i2 * sa2 + i1 * sa1)
        pb = np.uint64(i3 * sb3 + i2 * sb2 + i1 * sb1)
        po = np.uint64(r * n0)
        if sa0 == 1 and sb0 == 1:
            if op == ADD:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] + b[pb + np.uint64(i)]
            elif op == SUB:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] - b[pb + np.uint64(i)]
            elif op == MUL:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] * b[pb + np.uint64(i)]
            else:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] / b[pb + np.uint64(i)]
        elif sa0 == 1:  # b one value per row
            bv = b[pb]
            if op == ADD:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] + bv
            elif op == SUB:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] - bv
            elif op == MUL:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] * bv
            else:
                for i in range(n0):
                    out[po + np.uint64(i)] = a[pa + np.uint64(i)] / bv
        else:
            for i in range(n0):
                av = a[pa + np.uint64(i * sa0)]
                bv = b[pb + np.uint64(i * sb0)]
                if op == ADD:
                    out[po + np.uint64(i)] = av + bv
                elif op == SUB:
                    out[po + np.uint64(i)] = av - bv
                elif op == MUL:
                    out[po + np.uint64(i)] = av * bv
                else:
                    out[po + np.uint64(i)] = av / bv


def _flat(x4):
    """(flat 1-D view from x4's first element, element strides) or None when strides are
    negative or not whole elements."""
    st = x4.strides
    if x4.dtype != np.float32 or min(st) < 0 or any(v % 4 for v in st):
        return None
    e = [v // 4 for v in st]
    span = sum((n - 1) * v for n, v in zip(x4.shape, e)) + 1
    return np.lib.stride_tricks.as_strided(x4, shape=(span,), strides=(4,)), e


@njit(fastmath=True, inline="always")
def _apply(v, op, p0, p1):
    if op == NEG:
        return -v
    if op == ABS:
        return abs(v)
    if op == SQR:
        return v * v
    if op == SQRT:
        return math.sqrt(v)
    if op == EXP:
        return math.exp(v)
    if op == LOG:
        return math.log(v)
    if op == SIN:
        return math.sin(v)
    if op == COS:
        return math.cos(v)
    if op == STEP:
        return 1.0 if v > 0 else 0.0
    if op == RELU:
        return v if v > 0 else 0.0
    if op == LEAKY_RELU:
        return v if v > 0 else v * p0
    if op == SILU:
        return v / (1.0 + math.exp(-v))
    if op == SIGMOID:
        return 1.0 / (1.0 + math.exp(-v))
    if op == TANH:
        return math.tanh(v)
    if op == GELU:
        return 0.5 * v * (1.0 + math.erf(v * 0.7071067811865476))
    if op == GELU_TANH:
        return 0.5 * v * (1.0 + math.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    if op == GELU_QUICK:
        return v / (1.0 + math.exp(-1.702 * v))
    if op == CLAMP:
        return min(max(v, p0), p1)
    if op == SCALE:
        return v * p0 + p1
    return math.nan  # an op without a formula here: test-backend-ops fails on it


@njit(parallel=True, fastmath=False, cache=True)
def _unary4(x, out, op, p0, p1):
    # fastmath off: it would let LLVM drop the NaN/inf semantics the references keep
    n3, n2, n1, n0 = out.shape
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        rx = x[i3, i2, i1]
        ro = out[i3, i2, i1]
        for i in range(n0):
            ro[i] = _apply(rx[i], op, p0, p1)


@njit(fastmath=FM, inline="always")
def _gelu_tanh1(v):
    """0.5*v*(1 + tanh(y)) = v / (1 + exp(-2y)), y = sqrt(2/pi)*(v + 0.044715 v^3), with the
    vectorizable float32 exp of norm.py (libm's tanh is a scalar call: this measured several
    times faster). NaN stays NaN (exp32(NaN) = 0), -inf gives NaN as the tanh form does."""
    z = np.float32(-1.5957691216057308) * (v + np.float32(0.044715) * v * v * v)
    g = v / (np.float32(1.0) + exp32(z))
    return g if v != -np.inf else np.float32(np.nan)


@njit(parallel=True, fastmath=FM, cache=True)
def _gelu_tanh4(x, out):
    n3, n2, n1, n0 = out.shape
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        rx = x[i3, i2, i1]
        ro = out[i3, i2, i1]
        for i in range(n0):
            ro[i] = _gelu_tanh1(rx[i])


@njit(parallel=True, fastmath=FM, cache=True)
def _gelu_tanh_rows(x, s3, s2, s1, out, n3, n2, n1, n0):
    """_gelu_tanh4 on flat buffers: row (i3, i2, i1) of x starts at i3*s3 + i2*s2 + i1*s1, out
    is C-contiguous. Numba types a strided 4-D view (GEGLU's gate half) as layout 'A', whose
    unknown inner stride stops LLVM vectorizing (10x slower measured); flat 1-D 'C' arrays
    with unit-stride rows vectorize. uint64 indices: no negative-index wraparound branch."""
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        src = np.uint64(i3 * s3 + i2 * s2 + i1 * s1)
        dst = np.uint64(r * n0)
        for i in range(n0):
            out[dst + np.uint64(i)] = _gelu_tanh1(x[src + np.uint64(i)])


def _gelu_tanh(x4, o4):
    st = x4.strides
    if (x4.dtype == np.float32 and st[3] == 4 and min(st) >= 0 and all(v % 4 == 0 for v in st)
            and o4.flags.c_contiguous and x4.size):
        n3, n2, n1, n0 = x4.shape
        s3, s2, s1 = st[0] // 4, st[1] // 4, st[2] // 4
        span = (n3 - 1) * s3 + (n2 - 1) * s2 + (n1 - 1) * s1 + n0
        flat = np.lib.stride_tricks.as_strided(x4, shape=(span,), strides=(4,))
        _gelu_tanh_rows(flat, s3, s2, s1, o4.reshape(-1), n3, n2, n1, n0)
    else:
        _gelu_tanh4(x4, o4)


# ---- geglu ----------------------------------------------------------------------------------
ROUND_CODES = {"F32": 0, "F16": 1, "BF16": 2}  # node dtype -> what gelu(gate) is rounded to


@njit(inline="always")
def _round_to(v, rnd):
    """float32 v rounded to the nearest F16 (rnd 1) or BF16 (rnd 2) value, as float32; rnd 0: v.
    Integer bit arithmetic only (exact under any fastmath flags). Round to nearest even as
    numpy's astype(float16) (subnormals, overflow to inf from 65520) and as f32_to_raw's BF16;
    a NaN stays a (quiet) NaN of the same sign."""
    if rnd == 0:
        return v
    u = np.int64(_f32_as_bits(v)) & 0xFFFFFFFF
    a = u & 0x7FFFFFFF
    if rnd == 2:
        if a > 0x7F800000:
            r = (u | 0x400000) & 0xFFFF0000
        else:
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return _bits_as_f32(np.int32(np.uint32(r)))
    sign = u & 0x80000000
    if a > 0x7F800000:  # NaN
        r = 0x7FC00000 | (a & 0x7FE000)
    elif a >= 0x477FF000:  # >= 65520 (the tie above F16's max 65504 goes to the even inf)
        r = 0x7F800000
    elif a >= 0x38800000:  # F16 normal range (>= 2**-14): keep 10 mantissa bits
        r = (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000
    else:  # F16 subnormal or zero: a multiple of 2**-24
        e = a >> 23
        q = np.int64(0)
        if e > 0:
            m = (a & 0x7FFFFF) | 0x800000
            sh = 126 - e  # m * 2**(e - 150) / 2**-24 = m / 2**sh, sh >= 14
            if sh <= 25:
                q = m >> sh
                rem = m - (q << sh)
                half = np.int64(1) << (sh - 1)
                if rem > half or (rem == half and (q & 1) == 1):
                    q += 1
        r = np.int64(_f32_as_bits(np.float32(q) * np.float32(5.960464477539063e-08)))  # exact
    return _bits_as_f32(np.int32(np.uint32(r | sign)))


@njit(inline="always")
def _geglu_row(r, n2, n1, s3, s2, s1, h):
    """Where row r = (i3, i2, i1) of geglu's flat input starts (its values), where its gate half
    starts, and where output row r starts (h wide)."""
    i3 = r // (n2 * n1)
    i2 = (r // n1) % n2
    i1 = r % n1
    src = np.uint64(i3 * s3 + i2 * s2 + i1 * s1)
    return src, src + np.uint64(h), np.uint64(r * h)


@njit(inline="always")
def _times_values(x, src, out, dst, h, rnd):
    """out[dst + i] = x[src + i] * out[dst + i] for i < h, out's gelu values first rounded as an
    F16/BF16 node would store them (rnd, see _round_to): geglu's product, one float32 multiply."""
    if rnd == 0:
        for i in range(h):
            out[dst + np.uint64(i)] = x[src + np.uint64(i)] * out[dst + np.uint64(i)]
    else:
        for i in range(h):
            out[dst + np.uint64(i)] = x[src + np.uint64(i)] * _round_to(out[dst + np.uint64(i)], rnd)


@njit(parallel=True, fastmath=FM, cache=True)
def _geglu_tanh_rows(x, s3, s2, s1, out, n3, n2, n1, h, rnd):
    """out row r (C-contiguous, h wide) = x[a] * gelu_tanh(x[gate]) where row (i3, i2, i1) of the
    flat float32 buffer x starts at i3*s3 + i2*s2 + i1*s1 (unit inner stride), a its first h
    elements and gate the next h. gelu is _gelu_tanh1 under the same flags as _gelu_tanh_rows,
    so the values are bit for bit those of gelu_tanh then mul. It goes through `out` first, in
    its own loop: in one expression the reassoc flag would let LLVM rewrite a * (v / d) as
    (a * v) / d, which rounds differently. rnd: round gelu's output as an F16/BF16 gelu node
    stores it (see _round_to) before the product, as the unfused graph does."""
    for r in prange(n3 * n2 * n1):
        src, gsrc, dst = _geglu_row(r, n2, n1, s3, s2, s1, h)
        for i in range(h):
            out[dst + np.uint64(i)] = _gelu_tanh1(x[gsrc + np.uint64(i)])
        _times_values(x, src, out, dst, h, rnd)


@njit(parallel=True, fastmath=False, cache=True)
def _geglu_erf_rows(x, s3, s2, s1, out, n3, n2, n1, h, rnd, op, p0, p1):
    """_geglu_tanh_rows with the erf GELU: _apply(v, op=14, p0, p1) as _unary4 evaluates it (the
    same argument types and flags: float64 arithmetic, one rounding to float32), then the
    float32 product."""
    for r in prange(n3 * n2 * n1):
        src, gsrc, dst = _geglu_row(r, n2, n1, s3, s2, s1, h)
        for i in range(h):
            out[dst + np.uint64(i)] = _apply(x[gsrc + np.uint64(i)], op, p0, p1)
        _times_values(x, src, out, dst, h, rnd)


def _geglu(node, xs, out):
    """F32 input: read in place (any view with unit-stride, non-negative, element-aligned rows;
    other views are copied contiguous first). F16/BF16: widened to float32 as every element-wise
    kernel does; gelu(gate) is rounded to the dtype before the float32 product and the product
    once more when stored: round(a * round(gelu(gate))), the unfused slice/gelu/mul graph's
    values bit for bit (and ggml's f16 geglu, whose gelu comes from an f16 table)."""
    x4 = as4d(f32_input(node.src[0], xs[0]))
    o = f32_output(node, out)
    o4 = as4d(o)
    if o4.size == 0:
        return
    st = x4.strides
    if not (st[3] == 4 and min(st) >= 0 and all(v % 4 == 0 for v in st)):
        x4 = np.ascontiguousarray(x4)
        st = x4.strides
    n3, n2, n1, n0 = x4.shape
    s3, s2, s1 = st[0] // 4, st[1] // 4, st[2] // 4
    span = (n3 - 1) * s3 + (n2 - 1) * s2 + (n1 - 1) * s1 + n0
    flat = np.lib.stride_tricks.as_strided(x4, shape=(span,), strides=(4,))
    h, rnd, flat_o = n0 // 2, ROUND_CODES[node.dtype.name], o4.reshape(-1)
    if node.params["approximate"] == "tanh":
        _geglu_tanh_rows(flat, s3, s2, s1, flat_o, n3, n2, n1, h, rnd)
    else:
        _geglu_erf_rows(flat, s3, s2, s1, flat_o, n3, n2, n1, h, rnd, GELU, 0.0, 0.0)
    store(node, out, o)


@njit(parallel=True, cache=True)
def _copy4(x, out):
    n3, n2, n1, n0 = out.shape
    for r in prange(n3 * n2 * n1):
        i3 = r // (n2 * n1)
        i2 = (r // n1) % n2
        i1 = r % n1
        rx = x[i3, i2, i1]
        ro = out[i3, i2, i1]
        for i in range(n0):
            ro[i] = rx[i]


def _float_node(node):
    return node.dtype.name in ("F32", "F16", "BF16")


def _binary(node, xs, out):
    a, b = (as4d(f32_input(s, x)) for s, x in zip(node.src, xs))
    o = f32_output(node, out)
    o4 = as4d(o)
    ab, bb = np.broadcast_to(a, o4.shape), np.broadcast_to(b, o4.shape)
    fa, fb = _flat(ab), _flat(bb)
    if (fa is not None and fb is not None and o4.flags.c_contiguous and o4.size
            and not (ab.flags.c_contiguous and bb.flags.c_contiguous)  # those vectorize already
            and fa[1][3] in (0, 1) and fb[1][3] in (0, 1)):
        (xa, ea), (xb, eb) = fa, fb
        if ea[3] == 0 and eb[3] == 1 and node.op in ("add", "mul"):  # commutative: keep a the row
            (xa, ea), (xb, eb) = (xb, eb), (xa, ea)
        _binary_rows(xa, ea[0], ea[1], ea[2], ea[3], xb, eb[0], eb[1], eb[2], eb[3], o4.reshape(-1),
                     *o4.shape, BINARY_CODES[node.op])
    else:
        _binary4(ab, bb, o4, BINARY_CODES[node.op])
    store(node, out, o)


def _unary(node, xs, out):
    x = as4d(f32_input(node.src[0], xs[0]))
    o = f32_output(node, out)
    p = node.params
    if node.op == "clamp":
        p0, p1 = p["min"], p["max"]
    elif node.op == "scale":
        p0, p1 = p["s"], p["b"]
    else:
        p0, p1 = p.get("slope", 0.0), 0.0
    if node.op == "gelu_tanh":
        _gelu_tanh(x, as4d(o))
    else:
        _unary4(x, as4d(o), UNARY_CODES[node.op], p0, p1)
    store(node, out, o)


for _op in BINARY_CODES:
    CPU.register(_op, supports=_float_node)(_binary)
for _op in UNARY_CODES:
    CPU.register(_op, supports=_float_node)(_unary)
CPU.register("geglu", supports=_float_node)(_geglu)


@CPU.register("cont")
def _cont(node, xs, out):
    x = xs[0]
    if x.dtype == out.dtype and x.dtype in (np.float32, np.int32, np.uint16, np.uint8) and not node.dtype.is_quantized:
        _copy4(as4d(x), as4d(out))
    else:
        out[...] = x


@CPU.register("cast")
def _cast(node, xs, out):
    src = node.src[0]
    if src.dtype == node.dtype and not src.dtype.is_quantized:
        return _cont(node, xs, out)
    if src.dtype.is_quantized and src.dtype == node.dtype:
        out[...] = xs[0]
        return
    x = f32_input(src, xs[0])
    store(node, out, np.ascontiguousarray(x))
