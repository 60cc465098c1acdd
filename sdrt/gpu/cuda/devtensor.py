"""DevTensor: what a CUDA kernel function sees of a graph tensor (address, dtype, ggml shape).

Its dtype is the tensor's, except for the F32 results that fuse.py stores as F16 or BF16 ("half"
nodes): those, and every view of them, are seen as that dtype with halved byte strides and offsets.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ops.dtypes import BY_NAME, DType
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
        return cls(int(ptr), t.dtype, t.ne4, padded_nb(t), t)

    @classmethod
    def half_of(cls, t: Tensor, node_ptr: int, dtype: str = "F16") -> "DevTensor":
        """View `t` of an F32 node stored as `dtype` (F16 or BF16) at node_ptr: every byte
        offset and stride halved."""
        return cls(int(node_ptr) + t.offset // 2, BY_NAME[dtype], t.ne4, tuple(b // 2 for b in padded_nb(t)), t)

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


# the dtype part of the float kernels' names
SUFFIX = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def padded_nb(t: Tensor) -> tuple[int, int, int, int]:
    """t's byte strides over 4 dims, padded as ggml pads them."""
    nb, ne = list(t.nb), t.ne4
    while len(nb) < 4:
        nb.append(nb[-1] * ne[len(nb) - 1])
    return tuple(nb)


def kernel_dtypes(x: DevTensor, out: DevTensor) -> str:
    """The dtype part of a kernel name: "f32" when x and out share the dtype, "f32_to_f16" when
    they differ (an F32 result stored as F16, or read back from F16)."""
    a, b = SUFFIX[x.dtype.name], SUFFIX[out.dtype.name]
    return a if a == b else f"{a}_to_{b}"
