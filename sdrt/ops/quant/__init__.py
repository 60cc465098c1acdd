"""Quantized GGUF/ggml blocks: dequantize, get_rows and quantize (Cython, OpenMP).

Every block type of `sdrt.ops.dtypes` dequantizes (plus F32/F16/BF16 rows, so get_rows works on
any weight); Q4_0 ... Q8_0, Q8_1, Q2_K ... Q8_K, TQ1_0, TQ2_0 and MXFP4 quantize. Results are
bit-exact with ggml's C code (ggml-quants.c): `dequantize_row_*`; `quantize_row_*_ref` with
`imatrix=None` (the default); and with an importance vector `imatrix=` the weighted
`quantize_row_*_impl` that `ggml_quantize_chunk` runs when given one. stable-diffusion.cpp's
convert always passes a vector of ones, so `sdrt.io.writer.convert` quantizes with
`imatrix=ones` (bytes identical to sd-cli). See docs/quantization.md for both paths, the block
layouts and benchmarks.

Raw data is a uint8 array `[nrows, row_bytes]` (rows may be strided, e.g. a view into a memory
map, but each row must be contiguous); float data is float32 `[nrows, ne0]`. Higher-rank inputs
are treated as stacks of rows over the last axis.

    w = quant.dequantize(raw, "Q4_K")                 # [nrows, ne0] float32
    tile = quant.dequantize_rows(raw, "Q4_K", 64, 128)  # rows 64..127 only
    emb = quant.get_rows(raw, "Q8_0", token_ids)      # [len(ids), ne0]
    raw = quant.quantize(x, "Q6_K")                   # [nrows, ne0 / 256 * 210] uint8
    raw = quant.quantize(x, "Q4_K", imatrix=1.0)      # ggml's weighted path, as sd-cli convert

Threads: OpenMP, `OMP_NUM_THREADS`, `set_num_threads(n)` or per call `nthreads=`; small inputs
run on one thread. Next to a multi-threaded BLAS on few cores pass `nthreads=1`: two thread
teams spinning against each other are far slower than one serial loop.
"""
from __future__ import annotations

import numpy as np

from ...errors import OpError, UnsupportedError
from .. import dtypes
from ..dtypes import DType

try:
    from . import _quants as _q
    _IMPORT_ERROR: Exception | None = None
except ImportError as e:  # the extension is not built
    _q = None
    _IMPORT_ERROR = e

__all__ = [
    "bf16_to_f32",
    "dequantize",
    "dequantize_rows",
    "f16_to_f32",
    "f32_to_f16",
    "get_rows",
    "quantize",
    "random_raw",
    "set_num_threads",
    "supported_dequant_types",
    "supported_quant_types",
    "weighted_quant_types",
]

# below this many output elements a call runs on one thread (OpenMP start-up would dominate)
_PARALLEL_MIN = 1 << 15
_num_threads = 0  # 0: OpenMP's default (OMP_NUM_THREADS or all cores)


def _ext():
    if _q is None:
        raise UnsupportedError(
            "sdrt's Cython quant module (sdrt.ops.quant._quants) is not built: run "
            f"`pip install -e . --no-build-isolation` or `python setup.py build_ext --inplace` ({_IMPORT_ERROR})")
    return _q


def set_num_threads(n: int) -> None:
    """Threads for the quant kernels (0 = OpenMP default)."""
    global _num_threads
    _num_threads = max(0, int(n))


def _threads(nelems: int, nthreads=None) -> int:
    if nthreads is not None and int(nthreads) > 0:
        return int(nthreads)
    if nelems < _PARALLEL_MIN:
        return 1
    return _num_threads or _ext().max_threads()


_DT_CACHE: dict = {}


def _dtype(dtype) -> DType:
    try:
        return _DT_CACHE[dtype]
    except (KeyError, TypeError):
        pass
    dt = dtypes.get(dtype)
    try:
        _DT_CACHE[dtype] = dt
    except TypeError:
        pass
    return dt


_DEQ_NAMES = tuple(t.name for t in dtypes.QUANT_TYPES) + ("F32", "F16", "BF16")
_Q_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "Q8_K", "TQ1_0", "TQ2_0", "MXFP4")


def supported_dequant_types() -> tuple[DType, ...]:
    """Types `dequantize` / `get_rows` accept: every block type, plus F32, F16 and BF16."""
    return tuple(dtypes.BY_NAME[n] for n in _DEQ_NAMES)


def supported_quant_types() -> tuple[DType, ...]:
    return tuple(dtypes.BY_NAME[n] for n in _Q_NAMES)


def _deq_dtype(dtype) -> DType:
    dt = _dtype(dtype)
    if dt.name not in _DEQ_NAMES:
        raise UnsupportedError(f"cannot dequantize {dt.name}: supported types are {', '.join(_DEQ_NAMES)}")
    return dt


def _as_rows(raw, dt: DType, what: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """raw -> (2-D uint8 view [nrows, row_bytes] with unit inner stride, leading shape)."""
    if not isinstance(raw, np.ndarray):
        raw = np.frombuffer(raw, np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else np.asarray(raw)
    if raw.dtype != np.uint8:
        if raw.dtype.itemsize == 1 or raw.dtype.kind in "iuf":
            try:
                raw = raw.view(np.uint8)
            except ValueError:
                raw = np.ascontiguousarray(raw).view(np.uint8)
        else:
            raise OpError(f"{what}: {dt.name} data must be raw bytes (uint8), got {raw.dtype} {raw.shape}")
    if raw.ndim == 0:
        raise OpError(f"{what}: {dt.name} data must be an array of rows, got a scalar")
    lead = raw.shape[:-1]
    row_bytes = raw.shape[-1]
    if row_bytes % dt.type_size:
        raise OpError(f"{what}: {dt.name} row of {row_bytes} bytes is not a whole number of "
                      f"{dt.type_size}-byte blocks (raw shape {raw.shape})")
    if raw.ndim != 2:
        raw = raw.reshape(-1, row_bytes)
    if raw.shape[1] > 1 and raw.strides[1] != 1:
        raw = np.ascontiguousarray(raw)
    return raw, lead


def _check_out(out, shape, what: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != tuple(shape):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise OpError(f"{what}: out must be float32 of shape {tuple(shape)}, got {got}")
    if not out.flags.writeable:
        raise OpError(f"{what}: out is read-only")
    if len(shape) and shape[-1] > 1 and out.strides[-1] != 4:
        raise OpError(f"{what}: out rows must be contiguous (inner stride 4), got strides {out.strides}")
    return out


def _out2d(out: np.ndarray, n: int, ne0: int) -> np.ndarray:
    o = out.reshape(n, ne0) if out.ndim != 2 else out
    if n and ne0 and not np.shares_memory(o, out):  # a reshape of a strided array copied
        raise OpError("out must be reshapeable to [rows, ne0] without copying")
    return o


def dequantize(raw, dtype, out=None, *, nthreads: int | None = None) -> np.ndarray:
    """Raw rows of `dtype` -> float32 [nrows, ne0] (bit-exact with ggml's dequantize_row_*).
    `nthreads` overrides the thread count for this call (e.g. 1 next to a busy BLAS)."""
    q = _ext()
    dt = _deq_dtype(dtype)
    rows, lead = _as_rows(raw, dt, "dequantize")
    n = rows.shape[0]
    ne0 = rows.shape[1] // dt.type_size * dt.block_size
    out = _check_out(out, lead + (ne0,), "dequantize")
    q.dequantize_into(rows, dt.id, dt.block_size, dt.type_size, _out2d(out, n, ne0), _threads(n * ne0, nthreads))
    return out


def dequantize_rows(raw, dtype, row_start: int, row_end: int, out=None, *, nthreads: int | None = None) -> np.ndarray:
    """Rows row_start..row_end-1 of a 2-D raw array -> float32 [row_end-row_start, ne0]
    (e.g. a weight tile for a GEMM). `out` may be a row-strided view of a larger buffer."""
    dt = _deq_dtype(dtype)
    rows, _ = _as_rows(raw, dt, "dequantize_rows")
    r0, r1 = int(row_start), int(row_end)
    if not 0 <= r0 <= r1 <= rows.shape[0]:
        raise OpError(f"dequantize_rows: row range [{r0}, {r1}) is outside the {rows.shape[0]} rows of "
                      f"{dt.name} data {rows.shape}")
    return dequantize(rows[r0:r1], dt, out, nthreads=nthreads)


def get_rows(raw, dtype, ids, out=None, *, nthreads: int | None = None) -> np.ndarray:
    """out[i] = dequantized raw[ids[i]] (ggml_get_rows). ids: integers, any shape -> ids.shape + (ne0,)."""
    q = _ext()
    dt = _deq_dtype(dtype)
    rows, _ = _as_rows(raw, dt, "get_rows")
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise OpError(f"get_rows: ids must be integers, got {ids.dtype}")
    nrows = rows.shape[0]
    ne0 = rows.shape[1] // dt.type_size * dt.block_size
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    if flat.size:
        bad = (flat < 0) | (flat >= nrows)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise OpError(f"get_rows: id {int(ids.reshape(-1)[k])} (at position {k}) is out of range for "
                          f"{dt.name} data with {nrows} rows of {ne0} elements")
    out = _check_out(out, ids.shape + (ne0,), "get_rows")
    q.get_rows_into(rows, dt.id, dt.block_size, dt.type_size, flat, _out2d(out, flat.size, ne0),
                    _threads(flat.size * ne0, nthreads))
    return out


# types whose ggml quantizer uses importance weights (ggml_quantize_chunk -> quantize_row_*_impl);
# every other quantizable type ignores them, as ggml does (Q8_1 and Q8_K are not in
# ggml_quantize_chunk at all: their only quantizer is the _ref one)
_WEIGHTED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def weighted_quant_types() -> tuple[DType, ...]:
    """Types whose quantizer changes with an importance vector (`quantize(..., imatrix=)`)."""
    return tuple(dtypes.BY_NAME[n] for n in _WEIGHTED)


def _imatrix(imatrix, ne0: int, name: str) -> np.ndarray:
    a = np.asarray(imatrix)
    if a.dtype.kind not in "fiu":
        raise OpError(f"quantize: the {name} importance vector must be numbers, got {a.dtype}")
    if a.ndim == 0:
        return np.full(ne0, a, np.float32)
    if a.shape != (ne0,):
        raise OpError(f"quantize: the {name} importance vector must hold one weight per column "
                      f"({ne0},), got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def quantize(x, dtype, imatrix=None, *, nthreads: int | None = None) -> np.ndarray:
    """float rows [..., ne0] -> uint8 [..., ne0 / block_size * type_size].

    imatrix=None: ggml's reference quantizers (`quantize_row_*_ref`; what ggml_quantize_chunk
    does with a NULL importance matrix). imatrix = ne0 float32 weights, one per column (or a
    scalar, broadcast): ggml's weighted quantizers, bit for bit what
    `ggml_quantize_chunk(type, x, y, 0, nrows, ne0, imatrix)` writes (`quantize_row_*_impl`:
    per-column weights times sqrt(sigma2 + x^2), make_qx/qkx3/qp scale searches). This is what
    stable-diffusion.cpp's convert and load-time --type conversion use, with `imatrix=1.0`
    (a dummy vector of ones). Types in `weighted_quant_types()` change with it; Q8_0, Q8_1,
    Q8_K, TQ1_0, TQ2_0 and MXFP4 ignore it, as ggml does. Rows are independent; Q4_0/Q4_1/
    Q5_0/Q5_1 weigh each block with its whole row's mean square, so pass whole rows."""
    q = _ext()
    dt = _dtype(dtype)
    if dt.name not in _Q_NAMES:
        raise UnsupportedError(f"cannot quantize to {dt.name}: supported types are {', '.join(_Q_NAMES)}")
    x = np.asarray(x)
    if x.ndim == 0:
        raise OpError(f"quantize: {dt.name} needs rows of values, got a scalar")
    if x.dtype.kind not in "fiu":
        raise OpError(f"quantize: cannot quantize {x.dtype} data to {dt.name}")
    ne0 = x.shape[-1]
    if ne0 % dt.block_size:
        raise OpError(f"quantize: {dt.name} rows of {ne0} elements are not a multiple of the block size "
                      f"{dt.block_size} (shape {x.shape})")
    out = np.empty(x.shape[:-1] + (ne0 // dt.block_size * dt.type_size,), np.uint8)
    if imatrix is not None:
        qw = _imatrix(imatrix, ne0, dt.name)
        if dt.name in _WEIGHTED and out.size:
            rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, ne0)
            # the weighted K-quant searches cost ~8x the reference ones per element
            q.quantize_weighted_into(rows, qw, dt.id, dt.block_size, dt.type_size,
                                     out.reshape(rows.shape[0], -1), _threads(rows.size * 64, nthreads))
            return out
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    q.quantize_into(flat, dt.id, dt.block_size, dt.type_size, out.reshape(-1), _threads(flat.size * 8, nthreads))
    return out


def _half_to_f32(raw, bf16: bool, name: str) -> np.ndarray:
    q = _ext()
    a = np.asarray(raw)
    if a.dtype.itemsize != 2:
        raise OpError(f"{name}: expected 16-bit raw values (uint16/int16/float16), got {a.dtype}")
    src = np.ascontiguousarray(a).view(np.uint16)
    out = np.empty(a.shape, np.float32)
    q.half_to_f32_into(src.reshape(-1), out.reshape(-1), bf16, _threads(src.size // 4))
    return out


def f16_to_f32(raw) -> np.ndarray:
    """IEEE half bit patterns (uint16, or float16) -> float32, same shape. Exact."""
    return _half_to_f32(raw, False, "f16_to_f32")


def bf16_to_f32(raw) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, same shape. Exact."""
    return _half_to_f32(raw, True, "bf16_to_f32")


def f32_to_f16(x) -> np.ndarray:
    """float32 -> IEEE half bit patterns (uint16) with ggml's rounding (nearest even; NaN -> 0x7E00)."""
    q = _ext()
    a = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(a.shape, np.uint16)
    q.f32_to_f16_bits(a.reshape(-1), out.reshape(-1))
    return out


# ---- test / benchmark data ----------------------------------------------------------------

# byte offsets of the fp16 scale fields of each block (random bytes there could be inf/NaN)
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q8_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}


def random_raw(dtype, nrows: int, ne0: int, seed=0, scale_exp=(-8, 2)) -> np.ndarray:
    """Random but valid raw rows of a block type: random bytes with every scale field set to a
    finite value of magnitude 2**scale_exp[0] .. 2**scale_exp[1] (random sign, some zeros and
    fp16 subnormals), so dequantized values are finite. For tests and benchmarks."""
    dt = _dtype(dtype)
    rng = np.random.default_rng(seed)
    nb = ne0 // dt.block_size
    blocks = rng.integers(0, 256, size=(nrows, nb, dt.type_size), dtype=np.uint8)

    def halves(shape):
        h = (np.exp2(rng.uniform(*scale_exp, size=shape)) * rng.choice([-1.0, 1.0], size=shape)).astype(np.float16)
        h = h.view(np.uint16)
        h[rng.random(shape) < 0.02] = 0
        sub = rng.random(shape) < 0.02
        h[sub] = rng.integers(1, 0x400, size=int(sub.sum()), dtype=np.uint16)  # fp16 subnormals
        return h

    if dt.name in _F16_FIELDS:
        for off in _F16_FIELDS[dt.name]:
            blocks[..., off:off + 2] = halves((nrows, nb)).view(np.uint8).reshape(nrows, nb, 2)
    elif dt.name == "Q8_K":
        d = (np.exp2(rng.uniform(*scale_exp, size=(nrows, nb))) * rng.choice([-1.0, 1.0], size=(nrows, nb)))
        blocks[..., 0:4] = d.astype(np.float32).view(np.uint8).reshape(nrows, nb, 4)
    elif dt.name == "IQ1_M":  # the fp16 scale is split over the top nibbles of 4 uint16 at byte 48
        h = halves((nrows, nb)).astype(np.uint16)
        sc = blocks[..., 48:56].copy().view(np.uint16)
        for k in range(4):
            sc[..., k] = (sc[..., k] & 0x0FFF) | (((h >> (4 * k)) & 0xF) << 12)
        blocks[..., 48:56] = sc.view(np.uint8)
    elif dt.name == "MXFP4":  # e8m0 exponent byte
        blocks[..., 0] = rng.integers(127 + scale_exp[0] - 2, 127 + scale_exp[1] - 2, size=(nrows, nb), dtype=np.uint8)
    elif dt.name in ("F16", "BF16", "F32"):
        raise OpError(f"random_raw: {dt.name} is not a block type")
    return blocks.reshape(nrows, nb * dt.type_size)
