"""Backends by name. A backend is a kernel table plus what it needs to run them; the CPU one
runs on numpy buffers, the reference one runs each op's numpy definition."""
from __future__ import annotations

import re

import numpy as np

from ..errors import UnsupportedError
from .convert import f32_to_raw, raw_to_f32
from .registry import OPS, Kernel


class ReferenceBackend:
    """Runs every op through its plain-numpy reference: slow, the living definition."""
    name = "reference"

    def find(self, node):
        return Kernel(node.op, _run_reference, None) if node.op in OPS else None


def _widen(t, x: np.ndarray) -> np.ndarray:
    if t.dtype.is_float or t.dtype.is_quantized:
        return raw_to_f32(x, t.dtype)
    return x


def _run_reference(node, xs, out):
    vals = [_widen(s, x) for s, x in zip(node.src, xs)]
    r = np.asarray(OPS[node.op].reference(node, vals))
    if r.shape != out.shape[: r.ndim] and r.size == int(np.prod(node.ne)):
        r = r.reshape(node.shape)
    if node.dtype.is_float or node.dtype.is_quantized:
        out[...] = f32_to_raw(np.asarray(r, np.float32).reshape(node.shape), node.dtype).reshape(out.shape)
    else:
        out[...] = r.reshape(out.shape)


_BACKENDS: dict[str, object] = {}


def get_backend(name):
    if not isinstance(name, str):
        return name
    if name not in _BACKENDS:
        if name == "cpu":
            from .cpu import CPU
            _BACKENDS[name] = CPU
        elif name == "reference":
            _BACKENDS[name] = ReferenceBackend()
        elif re.fullmatch(r"cuda\d+", name):
            _BACKENDS[name] = _cuda_backend(int(name[4:]))
        else:
            raise UnsupportedError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    return _BACKENDS[name]


def available_backends() -> list[str]:
    """Names get_backend accepts on this machine."""
    from ..gpu import cuda
    return ["cpu", "reference"] + [n for n, _ in cuda.devices()]


def _cuda_backend(index: int):
    from ..gpu import cuda
    why = cuda.unavailable_reason()
    if why is not None:
        raise UnsupportedError(f"backend 'cuda{index}' is not available: {why}")
    from ..gpu.cuda.backend import get
    return get(index)
