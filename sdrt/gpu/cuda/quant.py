"""Weight decoding on the CUDA device (kernels/quant.cu): dense F32/F16/BF16 copies of weights
and activations, for mul_mat, get_rows and any op family whose weights may be quantized.

- `weight_as(rt, w, "F16" | "F32")`: the device address of a contiguous [rows][ne0] copy of
  weight `w` in that dtype — `w.ptr` itself when it already is one, otherwise decoded into
  `rt.scratch` (valid until the calling kernel function returns).
- `dense_copy(rt, x, dtype)`: the same for any float tensor view into F32/F16/BF16 (packs
  strided/transposed activations for cuBLAS).
- `to_dense(...)`: the launcher behind both, on raw (ptr, dtype, ne, nb).

Every block type of sdrt.ops.dtypes decodes (quant_blocks.cuh ports our CPU decoder, bit-exact:
F32 results equal sdrt.ops.quant.dequantize, F16 results equal its F32 rounded to nearest
even), and so do F32, F16, BF16, F8_E4M3 and F8_E5M2. F64 and integer tensors do not.
"""
from __future__ import annotations

from ...errors import UnsupportedError
from ...ops.dtypes import DType
from .devtensor import DevTensor

MODULE = "quant"
BLOCK = 256
MAX_BLOCKS = 1 << 16  # grid-stride loops cover the rest
INT32_MAX = (1 << 31) - 1

# float storage types the kernels read, and the dense types they write
FLOAT_SOURCES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F8_E4M3": "f8_e4m3", "F8_E5M2": "f8_e5m2"}
DENSE_TYPES = {"F32": ("f32", 4), "F16": ("f16", 2), "BF16": ("bf16", 2)}


def decodable(dt: DType) -> bool:
    """Whether the device kernels can read a tensor of dtype `dt` as values."""
    return dt.is_quantized or dt.name in FLOAT_SOURCES


def kernel_suffix(dt: DType) -> str:
    """The name part of a type's kernels: q4_k, iq2_xxs, f8_e4m3, bf16 ..."""
    if not decodable(dt):
        raise UnsupportedError(f"cuda: no device decoder for {dt.name} tensors "
                               f"(block types and {', '.join(FLOAT_SOURCES)} only)")
    return dt.name.lower()


def dense_itemsize(dtype: str) -> int:
    if dtype not in DENSE_TYPES:
        raise UnsupportedError(f"cuda: dense copies are F32, F16 or BF16, not {dtype}")
    return DENSE_TYPES[dtype][1]


def _grid(n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return (max(1, min((n + BLOCK - 1) // BLOCK, MAX_BLOCKS)), 1, 1), (BLOCK, 1, 1)


def _check_dims(ne, what: str) -> None:
    if any(n > INT32_MAX for n in ne):
        raise UnsupportedError(f"cuda {what}: a dim of {list(ne)} exceeds 2^31-1")


def to_dense(rt, ptr: int, dtype: DType, ne, nb, out_dtype: str, dst: int) -> None:
    """Enqueue dst = the values of the tensor at device address `ptr` (ggml `ne`/`nb`, 4 dims)
    as a contiguous [ne3][ne2][ne1][ne0] array of `out_dtype` (F32/F16; BF16 for float sources)."""
    out_suffix = DENSE_TYPES[out_dtype][0] if out_dtype in DENSE_TYPES else None
    if out_suffix is None:
        raise UnsupportedError(f"cuda to_dense: output dtype must be F32, F16 or BF16, not {out_dtype}")
    _check_dims(ne, "to_dense")
    name = kernel_suffix(dtype)
    if dtype.is_quantized:
        if out_dtype == "BF16":
            raise UnsupportedError(f"cuda to_dense: {dtype.name} dequantizes to F32 or F16, not BF16")
        if nb[0] != dtype.type_size:
            raise UnsupportedError(f"cuda to_dense: {dtype.name} rows must be contiguous blocks (nb0={nb[0]})")
        groups = ne[0] // 8 * ne[1] * ne[2] * ne[3]
        grid, block = _grid(groups)
        rt.fn(MODULE, f"dequant_{name}_{out_suffix}", "PqqqiiiiP")(
            grid, block, ptr, nb[1], nb[2], nb[3], ne[0], ne[1], ne[2], ne[3], dst)
    else:
        grid, block = _grid(-(-ne[0] * ne[1] * ne[2] * ne[3] // 4))  # 4 elements a thread (quant.cu)
        rt.fn(MODULE, f"convert_{name}_{out_suffix}", "PqqqqiiiiP")(
            grid, block, ptr, nb[0], nb[1], nb[2], nb[3], ne[0], ne[1], ne[2], ne[3], dst)


def dense_copy(rt, x: DevTensor, dtype: str) -> int:
    """A contiguous copy of `x` in `dtype` (F32/F16/BF16) in rt.scratch; returns its address."""
    dst = rt.scratch(x.nelements * dense_itemsize(dtype))
    to_dense(rt, x.ptr, x.dtype, x.ne, x.nb, dtype, dst)
    return dst


def weight_as(rt, w: DevTensor, dtype: str) -> int:
    """Device address of a contiguous [rows][ne0] copy of weight `w` in `dtype` ("F16" or "F32"):
    `w.ptr` itself when `w` already is one, otherwise `w` decoded into rt.scratch (valid until
    the calling kernel function returns; never keep it)."""
    if dtype not in ("F16", "F32"):
        raise UnsupportedError(f"cuda weight_as: dtype must be F16 or F32, not {dtype}")
    if w.dtype.name == dtype and w.is_contiguous:
        return w.ptr
    return dense_copy(rt, w, dtype)


__all__ = ["decodable", "dense_copy", "to_dense", "weight_as"]
