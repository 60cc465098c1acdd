"""The Numba kernels of the ``cpu`` (mt19937) and ``std_default`` (minstd) generators of
sdrt.engine.rng, kept apart so that the default ``cuda`` generator (numpy) loads no Numba: a GPU
run that imports Numba only for its noise pays ~0.3 s of import and ~0.5 s of cache loading.

They call glibc's ``logf``/``sinf``... through Numba (which binds the C math library; numpy's own
float32 ufuncs differ from it in the last ulp), with fastmath off so nothing is fused."""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba.core import types
from numba.extending import intrinsic

from ..ops.numba_target import configure as _configure_numba
from .rng import _MT_N

_configure_numba()  # before this module's kernels compile (see sdrt/ops/numba_target.py)

_MT_M = 397


@numba.njit(cache=True)
def _mt_next_state(st):  # pragma: no cover - numba
    upper, lower, mat = np.uint64(0x80000000), np.uint64(0x7FFFFFFF), np.uint64(0x9908B0DF)
    for kk in range(_MT_N):
        y = (st[kk] & upper) | (st[(kk + 1) % _MT_N] & lower)
        v = st[(kk + _MT_M) % _MT_N] ^ (y >> np.uint64(1))
        if st[(kk + 1) % _MT_N] & np.uint64(1):
            v ^= mat
        st[kk] = v


@numba.njit(cache=True)
def _mt_u32(st, meta):  # pragma: no cover - numba
    # meta = [left, next]; torch/sd.cpp: if (--left == 0) next_state();
    meta[0] -= 1
    if meta[0] == 0:
        _mt_next_state(st)
        meta[0] = _MT_N
        meta[1] = 0
    y = st[meta[1]]
    meta[1] += 1
    y ^= y >> np.uint64(11)
    y ^= (y << np.uint64(7)) & np.uint64(0x9D2C5680)
    y ^= (y << np.uint64(15)) & np.uint64(0xEFC60000)
    y ^= y >> np.uint64(18)
    return y & np.uint64(0xFFFFFFFF)


@intrinsic
def _fmaf(typingctx, a, b, c):
    """Exact fused multiply-add on float32 (``llvm.fma.f32``), as torch's AVX2 kernel computes it."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = llvm_ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], llvm_ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)
    return sig, codegen


@numba.njit(cache=True)
def _f32_bits(x):  # pragma: no cover - numba
    return np.array([x], np.float32).view(np.int32)[0]


@numba.njit(cache=True)
def _bits_f32(b):  # pragma: no cover - numba
    return np.array([b], np.int32).view(np.float32)[0]


@numba.njit(cache=True)
def _avx_log(x):  # pragma: no cover - numba
    """torch's avx_mathfun ``log256_ps`` on one lane (x > 0; GCC fuses mul+add into FMA)."""
    f = np.float32
    if x < _bits_f32(0x00800000):
        x = _bits_f32(0x00800000)
    bits = _f32_bits(x)
    imm0 = (bits >> 23) & 0x1FF
    x = _bits_f32((bits & ~0x7F800000) | _f32_bits(f(0.5)))
    e = f(f(imm0 - 0x7F) + f(1.0))
    mask = x < f(0.707106781186547524)
    tmp = x if mask else f(0.0)
    x = f(x - f(1.0))
    if mask:
        e = f(e - f(1.0))
    x = f(x + tmp)
    z = f(x * x)
    y = f(7.0376836292E-2)
    y = _fmaf(y, x, f(-1.1514610310E-1))
    y = _fmaf(y, x, f(1.1676998740E-1))
    y = _fmaf(y, x, f(-1.2420140846E-1))
    y = _fmaf(y, x, f(1.4249322787E-1))
    y = _fmaf(y, x, f(-1.6668057665E-1))
    y = _fmaf(y, x, f(2.0000714765E-1))
    y = _fmaf(y, x, f(-2.4999993993E-1))
    y = _fmaf(y, x, f(3.3333331174E-1))
    y = f(y * x)
    y = _fmaf(y, z, f(e * f(-2.12194440e-4)))
    y = _fmaf(z, f(-0.5), y)
    x = f(x + y)
    return _fmaf(e, f(0.693359375), x)


@numba.njit(cache=True)
def _avx_sincos(x):  # pragma: no cover - numba
    """torch's avx_mathfun ``sincos256_ps`` on one lane (Cephes sinf/cosf, FMA-fused)."""
    f = np.float32
    sign_sin = x < f(0.0)
    x = abs(x)
    j = np.int32(f(x * f(1.27323954473516)))
    j = (j + 1) & ~1
    y = f(j)
    swap_sin = (j & 4) != 0
    poly = (j & 2) == 0
    x = _fmaf(y, f(-0.78515625), x)
    x = _fmaf(y, f(-2.4187564849853515625e-4), x)
    x = _fmaf(y, f(-3.77489497744594108e-8), x)
    sign_cos = ((~(j - 2)) & 4) != 0
    sign_sin = sign_sin != swap_sin
    z = f(x * x)
    c = _fmaf(f(2.443315711809948E-005), z, f(-1.388731625493765E-003))
    c = _fmaf(c, z, f(4.166664568298827E-002))
    c = f(c * z)
    c = _fmaf(c, z, f(-f(z * f(0.5))))
    c = f(c + f(1.0))
    s = _fmaf(f(-1.9515295891E-4), z, f(8.3321608736E-3))
    s = _fmaf(s, z, f(-1.6666654611E-1))
    s = f(s * z)
    s = _fmaf(s, x, x)
    if not poly:
        s, c = c, s
    if sign_sin:
        s = -s
    if sign_cos:
        c = -c
    return s, c


@numba.njit(cache=True)
def _mt_fill16(data, off, flavor):  # pragma: no cover - numba
    # flavor 0: sd.cpp port (float theta, glibc logf/cosf/sinf)
    #        1: torch AVX2 kernel (avx_mathfun log256_ps / sincos256_ps, FMA)
    #        2: torch scalar kernel (double theta, glibc)
    two_pi_f = np.float32(6.2831855)  # 2.0f * 3.14159265358979323846f == (float)(2.0f * pi<double>)
    for j in range(8):
        u1 = np.float32(np.float32(1.0) - data[off + j])
        u2 = data[off + j + 8]
        if flavor == 1:
            r = np.float32(np.sqrt(np.float32(np.float32(-2.0) * _avx_log(u1))))
            s, c = _avx_sincos(np.float32(two_pi_f * u2))
            data[off + j] = np.float32(r * c)
            data[off + j + 8] = np.float32(r * s)
            continue
        r = np.float32(np.sqrt(np.float32(np.float32(-2.0) * np.log(u1))))
        if flavor == 2:
            theta = np.float32(6.283185307179586 * np.float64(u2))
        else:
            theta = np.float32(two_pi_f * u2)
        data[off + j] = np.float32(r * np.cos(theta))
        data[off + j + 8] = np.float32(r * np.sin(theta))


@numba.njit(cache=True)
def _mt_randn(st, meta, gauss, n, flavor):  # pragma: no cover - numba
    # gauss = [has_next (0/1), next_value] (float64 array)
    out = np.empty(n, np.float32)
    inv24 = np.float32(1.0 / 16777216.0)
    if n >= 16:
        for i in range(n):
            out[i] = np.float32(np.float32(_mt_u32(st, meta) & np.uint64(0xFFFFFF)) * inv24)
        i = 0
        while i < n - 15:
            _mt_fill16(out, i, flavor)
            i += 16
        if n % 16 != 0:
            base = n - 16
            for k in range(16):
                out[base + k] = np.float32(np.float32(_mt_u32(st, meta) & np.uint64(0xFFFFFF)) * inv24)
            _mt_fill16(out, base, flavor)
    else:
        inv53 = 1.0 / 9007199254740992.0
        m53 = np.uint64(0x1FFFFFFFFFFFFF)
        for i in range(n):
            if gauss[0] != 0.0:
                gauss[0] = 0.0
                out[i] = np.float32(gauss[1])
                continue
            hi = _mt_u32(st, meta)
            lo = _mt_u32(st, meta)
            u1 = np.float64(((hi << np.uint64(32)) | lo) & m53) * inv53
            hi = _mt_u32(st, meta)
            lo = _mt_u32(st, meta)
            u2 = np.float64(((hi << np.uint64(32)) | lo) & m53) * inv53
            r = math.sqrt(-2.0 * math.log1p(-u2))
            theta = 2.0 * 3.14159265358979323846 * u1
            gauss[1] = r * math.sin(theta)
            gauss[0] = 1.0
            out[i] = np.float32(r * math.cos(theta))
    return out


@numba.njit(cache=True)
def _minstd_randn(state, n):  # pragma: no cover - numba
    out = np.empty(n, np.float32)
    x = state[0]
    tmp = np.float32(2147483648.0)           # float(2^31 - 2) rounds up to 2^31
    below_one = np.float32(0.99999994)       # nextafter(1.0f, 0.0f)
    i = 0
    while i < n:
        while True:
            x = (x * 16807) % 2147483647
            ux = np.float32(np.float32(x - 1) / tmp)
            if ux >= np.float32(1.0):
                ux = below_one
            x = (x * 16807) % 2147483647
            uy = np.float32(np.float32(x - 1) / tmp)
            if uy >= np.float32(1.0):
                uy = below_one
            fx = np.float32(np.float64(np.float32(2.0) * ux) - 1.0)
            fy = np.float32(np.float64(np.float32(2.0) * uy) - 1.0)
            r2 = np.float32(np.float32(fx * fx) + np.float32(fy * fy))
            if not (r2 > np.float32(1.0) or r2 == np.float32(0.0)):
                break
        mult = np.float32(np.sqrt(np.float32(np.float32(np.float32(-2.0) * np.log(r2)) / r2)))
        out[i] = np.float32(fy * mult)
        i += 1
        if i < n:
            out[i] = np.float32(fx * mult)
            i += 1
    state[0] = x
    return out
