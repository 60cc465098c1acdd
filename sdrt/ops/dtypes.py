"""The dtype table: every element and block type stable-diffusion.cpp (ggml) knows.

Ids are ggml's `enum ggml_type` values (sd.cpp's fork adds F8_E4M3=43, F8_E5M2=44), names are
spelled as GGUF spells them. A block type stores `block_size` elements in `type_size` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import OpError


@dataclass(frozen=True)
class DType:
    name: str
    id: int
    block_size: int
    type_size: int
    # numpy dtype of the stored element for non-block types (bf16/f8 are stored as raw uints)
    np_storage: np.dtype | None = None
    is_float: bool = False

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    def row_bytes(self, ne0: int) -> int:
        """Bytes of one row of `ne0` elements (ne0 must be a multiple of the block size)."""
        if ne0 % self.block_size:
            raise OpError(f"{self.name}: row of {ne0} elements is not a multiple of the block size {self.block_size}")
        return ne0 // self.block_size * self.type_size

    def __repr__(self) -> str:
        return self.name


def _t(name, id, bs, ts, st=None, f=False):
    return DType(name, id, bs, ts, None if st is None else np.dtype(st), f)


_ALL = [
    _t("F32", 0, 1, 4, np.float32, True),
    _t("F16", 1, 1, 2, np.float16, True),
    _t("Q4_0", 2, 32, 18),
    _t("Q4_1", 3, 32, 20),
    _t("Q5_0", 6, 32, 22),
    _t("Q5_1", 7, 32, 24),
    _t("Q8_0", 8, 32, 34),
    _t("Q8_1", 9, 32, 36),  # ggml: half d, half s, int8 qs[32]
    _t("Q2_K", 10, 256, 84),
    _t("Q3_K", 11, 256, 110),
    _t("Q4_K", 12, 256, 144),
    _t("Q5_K", 13, 256, 176),
    _t("Q6_K", 14, 256, 210),
    _t("Q8_K", 15, 256, 292),
    _t("IQ2_XXS", 16, 256, 66),
    _t("IQ2_XS", 17, 256, 74),
    _t("IQ3_XXS", 18, 256, 98),
    _t("IQ1_S", 19, 256, 50),
    _t("IQ4_NL", 20, 32, 18),
    _t("IQ3_S", 21, 256, 110),
    _t("IQ2_S", 22, 256, 82),
    _t("IQ4_XS", 23, 256, 136),
    _t("I8", 24, 1, 1, np.int8),
    _t("I16", 25, 1, 2, np.int16),
    _t("I32", 26, 1, 4, np.int32),
    _t("I64", 27, 1, 8, np.int64),
    _t("F64", 28, 1, 8, np.float64, True),
    _t("IQ1_M", 29, 256, 56),
    _t("BF16", 30, 1, 2, np.uint16, True),
    _t("TQ1_0", 34, 256, 54),
    _t("TQ2_0", 35, 256, 66),
    _t("MXFP4", 39, 32, 17),
    _t("F8_E4M3", 43, 1, 1, np.uint8, True),
    _t("F8_E5M2", 44, 1, 1, np.uint8, True),
]

BY_NAME: dict[str, DType] = {t.name: t for t in _ALL}
BY_ID: dict[int, DType] = {t.id: t for t in _ALL}
globals().update(BY_NAME)  # dtypes.F32, dtypes.Q4_K, ...

FLOAT_TYPES = tuple(t for t in _ALL if t.is_float)
QUANT_TYPES = tuple(t for t in _ALL if t.is_quantized)
INT_TYPES = tuple(t for t in _ALL if t.name in ("I8", "I16", "I32", "I64"))

_NP_TO_DTYPE = {np.dtype(np.float32): BY_NAME["F32"], np.dtype(np.float16): BY_NAME["F16"],
                np.dtype(np.float64): BY_NAME["F64"], np.dtype(np.int8): BY_NAME["I8"],
                np.dtype(np.int16): BY_NAME["I16"], np.dtype(np.int32): BY_NAME["I32"],
                np.dtype(np.int64): BY_NAME["I64"]}


def get(t: "DType | str | int | np.dtype") -> DType:
    """Look a dtype up by DType, GGUF name (any case), ggml id or numpy dtype."""
    if isinstance(t, DType):
        return t
    if isinstance(t, str):
        key = t.upper()
        if key in BY_NAME:
            return BY_NAME[key]
        raise OpError(f"unknown dtype {t!r}; known: {', '.join(BY_NAME)}")
    if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
        if int(t) in BY_ID:
            return BY_ID[int(t)]
        raise OpError(f"unknown ggml type id {t}")
    try:
        return _NP_TO_DTYPE[np.dtype(t)]
    except (TypeError, KeyError):
        raise OpError(f"no sdrt dtype for numpy dtype {t!r}") from None


def from_numpy_dtype(d: np.dtype) -> DType:
    return get(np.dtype(d))
