"""BF16 GEMM with float32 accumulation (the C kernel of `_bf16gemm.h`), chosen at run time.

mul_mat and the convolutions multiply F16 and BF16 weights this way by default where the CPU has
AVX512_BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids and later): both operands are rounded to
bfloat16 (round to nearest even) while they are packed, and every k pair is one vdpbf16ps step
into a float32 accumulator — PyTorch's bf16 precision class, a little coarser than ggml's own
F16 path (f16 activations x f16 weights). F16 weights lose 3 of their 11 mantissa bits, the
activations 16 of 24: per product a relative error of at most 2^-8 + 2^-8 (plus float32 summation),
so for one output  |y - y_ref| <= 2^-7.9 * sum_k |x_k w_k|  (`error_bound`).

Code paths: "avx512bf16" (vdpbf16ps on 512-bit vectors, 6 rows x 64 columns a step) and
"scalar" (portable C: the instruction's specification, an FMA per bf16 product with subnormal
inputs read as zero and subnormal results flushed, odd element of each pair first). Both run the
same packing and the same per-output chain of float operations, so their results are
bit-identical; the scalar path is the reference model the tests hold the SIMD path to on any host.

`SDRT_BF16GEMM` (environment) or `set_path()` picks one: "auto" (the default: avx512bf16 where the
CPU has it, else off), "avx512bf16", "scalar" (the model: slow, for tests), or "off" (widen the
weights to float32 and multiply with BLAS: the exact path). F32 weights (an F32 checkpoint) never
come here, and `--type f32` (which keeps F16 storage, widened exactly) turns the kernel off for
its model (sdrt.ops.weight_policy), whatever the setting. A knob of its
own, not SDRT_QGEMM's: a different precision class for different weight types, and either can be
turned off alone when an image must match a reference.
"""
from __future__ import annotations


import numpy as np

from ...errors import OpError
from .. import weight_policy
from ..kernel_choice import KernelChoice

try:
    from . import _bf16 as _k
except ImportError:  # extension not built: every GEMM keeps the float32 path
    _k = None

PATHS = {"scalar": 0, "avx512bf16": 1}
_BEST_FIRST = ("avx512bf16", "scalar")
WEIGHT_TYPES = ("F16", "BF16")
_CODES = {"F32": 0, "F16": 1, "BF16": 2}

_CHOICE = KernelChoice("SDRT_BF16GEMM", "bf16 GEMM", PATHS)
set_path, using_path = _CHOICE.set, _CHOICE.using


def available_paths() -> tuple[str, ...]:
    """The code paths this CPU runs, fastest first."""
    if _k is None:
        return ()
    return tuple(p for p in _BEST_FIRST if _k.path_available(PATHS[p]))


def active_path() -> str | None:
    """The path F16/BF16 weights use now, or None for the exact float32 path."""
    return None if weight_policy.f32_type else _CHOICE.pick(available_paths())


def path_for(weight_type: str) -> str | None:
    """The path a weight of this dtype name multiplies through, or None (exact float32)."""
    return active_path() if weight_type in WEIGHT_TYPES else None


def _operand(x: np.ndarray, dtype: str, what: str) -> int:
    if x.ndim != 2:
        raise OpError(f"bf16 GEMM: {what} must be 2-D, got shape {x.shape}")
    want = np.float32 if dtype == "F32" else np.uint16
    if dtype not in _CODES or x.dtype != want:
        raise OpError(f"bf16 GEMM: {what} of type {dtype} must be stored as {np.dtype(want).name}, got {x.dtype}")
    if any(s % x.itemsize for s in x.strides):
        raise OpError(f"bf16 GEMM: {what} strides {x.strides} are not whole elements")
    return _CODES[dtype]


def gemm(a: np.ndarray, a_type: str, b: np.ndarray, b_type: str, out: np.ndarray, path: str,
         nthreads: int) -> None:
    """out[M, N] = a[M, K] @ b[K, N] in bf16 x bf16 -> float32. Operands of type "F32" are
    float32 arrays, "F16"/"BF16" their raw uint16 bits; any strides (a weight [N, K] is passed
    as its transpose view). out float32 with unit-stride rows."""
    at, bt = _operand(a, a_type, "a"), _operand(b, b_type, "b")
    if out.dtype != np.float32 or out.ndim != 2 or (out.shape[1] > 1 and out.strides[1] != 4) or out.strides[0] % 4:
        raise OpError("bf16 GEMM: out must be float32 with unit-stride rows")
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        raise OpError(f"bf16 GEMM: shapes a{a.shape} b{b.shape} out{out.shape} do not match")
    if path not in PATHS:
        raise OpError(f"bf16 GEMM path {path!r}: expected one of {', '.join(PATHS)}")
    _k.gemm_into(a, at, b, bt, out, PATHS[path], max(1, int(nthreads)))


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its bfloat16 rounding (nearest even, subnormals to signed
    zero, NaN quieted): what the kernel's packing does, in numpy (the tests' reference)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint32)
    r = np.where((u & np.uint32(0x7F800000)) == 0, (u >> np.uint32(16)) & np.uint32(0x8000), r)
    r = np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), (u >> np.uint32(16)) | np.uint32(0x40), r)
    return (r.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(np.shape(x))


def error_bound(a_bf: np.ndarray, b_bf: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[M, N] float64 bound on |gemm(a, b) - a @ b| (a, b the float32 values before rounding,
    a_bf, b_bf after): the rounding of each operand to bf16 (2^-8 relative each, exactly as
    measured from the operands) plus float32 accumulation over K."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ab, bb = a_bf.astype(np.float64), b_bf.astype(np.float64)
    rounding = np.abs(ab - a64) @ np.abs(bb) + np.abs(a64) @ np.abs(bb - b64)
    k = a.shape[1]
    accum = (k + 2) * 2.0 ** -24 * (np.abs(ab) @ np.abs(bb))
    return (rounding + accum) * (1 + 1e-6) + 1e-30
