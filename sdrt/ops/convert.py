"""Conversions between storage dtypes and float32 (widening, dequantizing, narrowing)."""
from __future__ import annotations

import numpy as np

from ..errors import OpError
from . import dtypes


def raw_to_f32(raw: np.ndarray, dtype) -> np.ndarray:
    """Raw storage (as Tensor.numpy() returns it) to a new float32 array of the logical shape."""
    dt = dtypes.get(dtype)
    if dt.is_quantized:
        from . import quant
        rows = raw.reshape(-1, raw.shape[-1])
        return quant.dequantize(rows, dt).reshape(raw.shape[:-1] + (-1,))
    if dt.name == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dt.name in ("F8_E4M3", "F8_E5M2"):
        return _f8_table(dt.name)[raw]
    return raw.astype(np.float32)


def f32_to_raw(x: np.ndarray, dtype) -> np.ndarray:
    """float32 values to raw storage of `dtype` (round to nearest even for BF16, as ggml)."""
    dt = dtypes.get(dtype)
    x = np.asarray(x, np.float32)
    if dt.is_quantized:
        from . import quant
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        return quant.quantize(rows, dt).reshape(x.shape[:-1] + (-1,))
    if dt.name == "BF16":
        u = x.view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        return np.where(nan, ((u >> 16) | 64).astype(np.uint16), r)
    if dt.name in ("F8_E4M3", "F8_E5M2"):
        return _f32_to_f8(x, dt.name)
    if dt.np_storage is None:
        raise OpError(f"cannot convert to {dt.name}")
    return x.astype(dt.np_storage)


def to_f32(t) -> np.ndarray:
    return raw_to_f32(t.numpy(), t.dtype)


_F8_CACHE: dict[str, np.ndarray] = {}


def _f8_table(name: str) -> np.ndarray:
    """All 256 values of an FP8 format as float32 (E4M3: the 'fn' variant, no inf, 0x7F/0xFF NaN)."""
    if name not in _F8_CACHE:
        b = np.arange(256, dtype=np.uint32)
        sign = np.where(b & 0x80, -1.0, 1.0)
        if name == "F8_E4M3":
            e, m, bias, mbits = (b >> 3) & 0xF, b & 0x7, 7, 3
        else:
            e, m, bias, mbits = (b >> 2) & 0x1F, b & 0x3, 15, 2
        val = np.where(e == 0, m / 2.0**mbits * 2.0 ** (1 - bias), (1 + m / 2.0**mbits) * 2.0 ** (e.astype(np.float64) - bias))
        val = sign * val
        if name == "F8_E4M3":
            val[(b & 0x7F) == 0x7F] = np.nan
        else:
            val[(e == 0x1F) & (m != 0)] = np.nan
            val[(e == 0x1F) & (m == 0)] = sign[(e == 0x1F) & (m == 0)] * np.inf
        _F8_CACHE[name] = val.astype(np.float32)
    return _F8_CACHE[name]


def _f32_to_f8(x: np.ndarray, name: str) -> np.ndarray:
    """Round to the nearest FP8 value (ties to even code), saturating finite values at the max."""
    table = _f8_table(name)
    pos = np.arange(128, dtype=np.uint8)
    vals = table[:128]
    keep = np.isfinite(vals)
    pos, vals = pos[keep], vals[keep]
    order = np.argsort(vals, kind="stable")
    pos, vals = pos[order], vals[order]
    a = np.abs(x)
    i = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (pos[i] % 2 == 0))
    code = np.where(pick_hi, pos[i], pos[i - 1])
    code = np.where(a >= vals[-1], pos[-1], code).astype(np.uint8)
    code = np.where(np.signbit(x), code | 0x80, code)
    nan_code = 0x7F if name == "F8_E4M3" else 0x7E
    return np.where(np.isnan(x), nan_code, code).astype(np.uint8)
