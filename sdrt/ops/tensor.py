"""Tensor: ggml's layout in Python.

`ne` holds the dims low-to-high (ne[0] is the innermost, contiguous one), `nb` the byte strides,
as in ggml. A tensor is either

- a leaf with data: `storage` is a 1-D uint8 numpy array (RAM or a memory map), `offset` the byte
  offset of element 0 in it;
- a graph node: `op`, `src` and `params` say how it is computed; a runner gives it storage;
- a view: `view_src` is the tensor that owns the storage (never itself a view), `offset` is
  relative to it. Views of leaves are leaves too (they share the storage, zero copy).

A numpy array maps to a tensor by reversing its shape: numpy shape (N, C, H, W) is ne (W, H, C, N).
Up to 4 dims, as in ggml (GGML_MAX_DIMS); `len(ne)` is the tensor's number of dims.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import OpError
from . import dtypes
from .dtypes import DType

MAX_DIMS = 4


def contiguous_strides(dtype: DType, ne) -> tuple[int, ...]:
    nb = [dtype.type_size]
    if len(ne) > 1:
        nb.append(dtype.row_bytes(ne[0]) if dtype.is_quantized else dtype.type_size * ne[0])
    for i in range(2, len(ne)):
        nb.append(nb[i - 1] * ne[i - 1])
    return tuple(nb[: len(ne)])


def _check_ne(ne, what="tensor") -> tuple[int, ...]:
    ne = tuple(int(n) for n in ne)
    if not 1 <= len(ne) <= MAX_DIMS:
        raise OpError(f"{what}: {len(ne)} dims, sdrt tensors have 1 to {MAX_DIMS}")
    if any(n < 1 for n in ne):
        raise OpError(f"{what}: dims must be >= 1, got ne={ne}")
    return ne


class Tensor:
    __slots__ = ("dtype", "ne", "nb", "op", "src", "params", "storage", "offset", "view_src",
                 "name", "device", "cut", "__weakref__")

    def __init__(self, dtype, ne, nb=None, *, op=None, src=(), params=None, storage=None,
                 offset=0, view_src=None, name="", device="cpu"):
        self.dtype: DType = dtypes.get(dtype)
        self.ne: tuple[int, ...] = _check_ne(ne, name or op or "tensor")
        self.nb: tuple[int, ...] = tuple(nb) if nb is not None else contiguous_strides(self.dtype, self.ne)
        self.op: str | None = op
        self.src: tuple[Tensor, ...] = tuple(src)
        self.params: dict = params or {}
        self.storage: np.ndarray | None = storage
        self.offset: int = int(offset)
        self.view_src: Tensor | None = view_src
        self.name: str = name
        self.device: str = device
        self.cut: str | None = None  # named cut point (see Graph)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_buffer(cls, buf, dtype, ne, offset=0, nb=None, name="") -> "Tensor":
        """A leaf over raw bytes (uint8 array, memmap, bytes...) without copying."""
        dtype = dtypes.get(dtype)
        storage = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf
        if storage.dtype != np.uint8 or storage.ndim != 1:
            storage = storage.reshape(-1).view(np.uint8)
        t = cls(dtype, ne, nb, storage=storage, offset=offset, name=name)
        need = t.offset + t.span_bytes()
        if t.offset < 0 or need > storage.nbytes:
            raise OpError(f"{name or 'tensor'}: {dtype.name} {t.ne} at offset {offset} needs {need} bytes, "
                          f"buffer has {storage.nbytes}")
        return t

    @classmethod
    def from_numpy(cls, arr, dtype=None, name="") -> "Tensor":
        """Wrap a numpy array. Zero copy when it is contiguous or a positive-stride view of a
        contiguous array; otherwise it is copied. `dtype` reinterprets raw storage
        (uint16 as BF16, uint8 as F8_E4M3/F8_E5M2, uint8 rows as a block type)."""
        arr = np.asarray(arr)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if dtype is None:
            dt = dtypes.from_numpy_dtype(arr.dtype)
        else:
            dt = dtypes.get(dtype)
        if dt.is_quantized:
            arr = np.ascontiguousarray(arr, dtype=np.uint8)
            if arr.shape[-1] % dt.type_size:
                raise OpError(f"{dt.name}: last axis of {arr.shape[-1]} bytes is not whole blocks of {dt.type_size}")
            shape = arr.shape[:-1] + (arr.shape[-1] // dt.type_size * dt.block_size,)
            return cls.from_buffer(arr.reshape(-1), dt, shape[::-1], name=name)
        if dt.np_storage is not None and dt.np_storage.itemsize != arr.dtype.itemsize:
            raise OpError(f"cannot view numpy {arr.dtype} as {dt.name}")
        if arr.ndim > MAX_DIMS:
            raise OpError(f"{name or 'array'}: {arr.ndim} dims, at most {MAX_DIMS}")
        base, off = _owning_base(arr)
        if base is None:
            arr = np.ascontiguousarray(arr)
            base, off = arr, 0
        storage = base.reshape(-1).view(np.uint8)
        return cls(dt, arr.shape[::-1], arr.strides[::-1], storage=storage, offset=off, name=name)

    # ---- properties ---------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.ne)

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy-order shape (ne reversed)."""
        return self.ne[::-1]

    @property
    def ne4(self) -> tuple[int, int, int, int]:
        return self.ne + (1,) * (MAX_DIMS - len(self.ne))

    @property
    def nelements(self) -> int:
        return math.prod(self.ne)      # Python ints (_check_ne): exact, and ~10x np.prod's speed

    @property
    def nbytes(self) -> int:
        """Bytes of the data if it were contiguous."""
        return self.nelements // self.dtype.block_size * self.dtype.type_size

    def nrows(self) -> int:
        return self.nelements // self.ne[0]

    def span_bytes(self) -> int:
        """Bytes from element 0 to one past the last element, for this layout."""
        last = sum((n - 1) * s for n, s in zip(self.ne[1:], self.nb[1:]))
        return last + (self.dtype.row_bytes(self.ne[0]) if self.dtype.is_quantized
                       else (self.ne[0] - 1) * self.nb[0] + self.dtype.type_size)

    def is_contiguous(self) -> bool:
        return self.nb == contiguous_strides(self.dtype, self.ne)

    @property
    def owner(self) -> "Tensor":
        """The tensor that owns this tensor's storage (itself unless a view)."""
        return self.view_src if self.view_src is not None else self

    @property
    def is_leaf(self) -> bool:
        return self.owner.op is None

    @property
    def has_data(self) -> bool:
        return self.owner.storage is not None

    def __repr__(self) -> str:
        kind = "leaf" if self.is_leaf else f"op={self.op}"
        v = f" view of {self.view_src.name or self.view_src.op}" if self.view_src is not None else ""
        return f"Tensor({self.name or '-'} {self.dtype.name} ne={self.ne} {kind}{v})"

    # ---- numpy --------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view (writable where the storage is). Raw storage for BF16
        (uint16), F8 (uint8) and block types (uint8 rows of blocks). Use `to_f32` for values."""
        if self.owner.storage is None:
            raise OpError(f"{self!r} has no data yet: run its graph first (sdrt.ops.evaluate)")
        return self.numpy_from(self.owner.storage)

    def numpy_from(self, storage: np.ndarray) -> np.ndarray:
        """This tensor's layout over `storage` (its owner's bytes) as a numpy view."""
        if self.dtype.is_quantized:
            if self.nb[0] != self.dtype.type_size:
                raise OpError(f"{self!r}: a block-type tensor must keep whole contiguous rows")
            rb = self.dtype.row_bytes(self.ne[0])
            shape = self.ne[1:][::-1] + (rb,)
            strides = self.nb[1:][::-1] + (1,)
            return np.ndarray(shape, np.uint8, storage, self.offset, strides)
        return np.ndarray(self.shape, self.dtype.np_storage, storage, self.offset, self.nb[::-1])

    def to_f32(self) -> np.ndarray:
        """Values as a new float32 numpy array (dequantized / widened)."""
        from .convert import to_f32
        return to_f32(self)

    # ---- views (zero copy; ne/nb/offset only) -------------------------------------------
    def _view(self, ne, nb, offset_delta=0, name=None) -> "Tensor":
        ne = _check_ne(ne, self.name or "view")
        return Tensor(self.dtype, ne, nb, offset=self.offset + offset_delta, view_src=self.owner,
                      name=name if name is not None else self.name, device=self.device)

    def reshape(self, *ne) -> "Tensor":
        if len(ne) == 1 and isinstance(ne[0], (tuple, list)):
            ne = tuple(ne[0])
        ne = _check_ne(ne, f"reshape of {self.name or self.op or 'tensor'}")
        if math.prod(ne) != self.nelements:
            raise OpError(f"reshape: {self.ne} has {self.nelements} elements, {ne} has {int(np.prod(ne))}")
        if not self.is_contiguous():
            raise OpError(f"reshape: {self!r} is not contiguous; call .cont() first")
        if self.dtype.is_quantized and ne[0] % self.dtype.block_size:
            raise OpError(f"reshape: {self.dtype.name} rows must stay whole blocks, ne[0]={ne[0]}")
        return self._view(ne, contiguous_strides(self.dtype, ne))

    def view(self, ne, nb=None, offset=0) -> "Tensor":
        """Arbitrary view: `ne`, byte strides `nb` (default contiguous) at byte `offset`."""
        ne = _check_ne(ne, "view")
        nb = tuple(nb) if nb is not None else contiguous_strides(self.dtype, ne)
        t = self._view(ne, nb, offset)
        base = self.owner
        if base.op is None and base.storage is not None:
            if t.offset < 0 or t.offset + t.span_bytes() > base.storage.nbytes:
                raise OpError(f"view {ne}/{nb} at offset {offset} is outside {self!r}")
        return t

    def permute(self, *axes) -> "Tensor":
        """ggml_permute: source dim i goes to position axes[i]."""
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        n = self.ndim
        if sorted(axes) != list(range(len(axes))) or len(axes) < n:
            raise OpError(f"permute{tuple(axes)}: not a permutation of the {n} dims of {self.ne}")
        ne4, nb4 = list(self.ne4[:len(axes)]), list(self.nb) + [self.nb[-1] * self.ne[-1]] * (len(axes) - n)
        if self.dtype.is_quantized and axes[0] != 0:
            raise OpError(f"permute: {self.dtype.name} rows (dim 0) cannot move")
        ne, nb = [0] * len(axes), [0] * len(axes)
        for i, a in enumerate(axes):
            ne[a], nb[a] = ne4[i], nb4[i]
        return self._view(ne, nb)

    def transpose(self) -> "Tensor":
        """Swap dims 0 and 1 (ggml_transpose)."""
        axes = [1, 0] + list(range(2, max(2, self.ndim)))
        return self.permute(*axes)

    def slice(self, dim: int, start: int, stop: int | None = None, step: int = 1) -> "Tensor":
        """Python-style slice of one ggml dim (negative start/stop count from the end)."""
        if not 0 <= dim < self.ndim:
            raise OpError(f"slice: dim {dim} out of range for {self.ne}")
        n = self.ne[dim]
        start, stop, step = slice(start, stop, step).indices(n)
        if step <= 0:
            raise OpError("slice: step must be positive")
        count = len(range(start, stop, step))
        if count == 0:
            raise OpError(f"slice: empty slice [{start}:{stop}] of dim {dim} (size {n})")
        if dim == 0 and self.dtype.is_quantized:
            bs = self.dtype.block_size
            if step != 1 or start % bs or count % bs:
                raise OpError(f"slice: {self.dtype.name} dim 0 must be cut on block boundaries of {bs}")
            off = start // bs * self.dtype.type_size
        else:
            off = start * self.nb[dim]
        ne, nb = list(self.ne), list(self.nb)
        ne[dim], nb[dim] = count, nb[dim] * step
        return self._view(ne, nb, off)

    def cont(self) -> "Tensor":
        from . import api
        return api.cont(self)

    # arithmetic sugar builds graph nodes
    def __add__(self, o): from . import api; return api.add(self, o)
    def __sub__(self, o): from . import api; return api.sub(self, o)
    def __mul__(self, o): from . import api; return api.mul(self, o)
    def __truediv__(self, o): from . import api; return api.div(self, o)
    def __neg__(self): from . import api; return api.neg(self)


def _owning_base(arr: np.ndarray):
    """(contiguous base array, byte offset of arr in it) for a positive-stride view, else (None, 0)."""
    if arr.flags.c_contiguous:
        return arr, 0
    if any(s < 0 for s in arr.strides):
        return None, 0
    base = arr.base
    while base is not None and isinstance(base, np.ndarray):
        if base.flags.c_contiguous:
            off = arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            last = off + sum((n - 1) * s for n, s in zip(arr.shape, arr.strides)) + arr.itemsize
            if 0 <= off and last <= base.nbytes:
                return base, off
            return None, 0
        base = base.base
    return None, 0
