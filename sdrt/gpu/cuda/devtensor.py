"""DevTensor: what a CUDA kernel function sees of a graph tensor (address, dtype, ggml shape)."""
from __future__ import annotations

from dataclasses import dataclass

from ...ops.dtypes import DType
from ...ops.tensor import Tensor


@dataclass(frozen=True)
class DevTensor:
    ptr: int                               # device address of element 0 (offset included)
    dtype: DType
    ne: tuple[int, int, int, int]          # padded with 1s
    nb: tuple[int, int, int, int]          # byte strides, padded as ggml pads them
    tensor: Tensor

    @classmethod
    def of(cls, t: Tensor, ptr: int) -> "DevTensor":
        ne = tuple(t.ne) + (1,) * (4 - len(t.ne))
        nb = list(t.nb)
        while len(nb) < 4:
            nb.append(nb[-1] * ne[len(nb) - 1])
        return cls(int(ptr), t.dtype, ne, tuple(nb), t)

    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nbytes(self) -> int:
        return self.dtype.row_bytes(self.ne[0]) * self.nrows if self.dtype.is_quantized \
            else self.nelements * self.dtype.type_size

    @property
    def is_contiguous(self) -> bool:
        return self.tensor.is_contiguous()
