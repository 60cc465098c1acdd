"""What every model-file reader returns: a lazy table of named tensors plus metadata."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import ModelFileError
from ..ops.tensor import Tensor


@dataclass
class ModelFile:
    """Tensors of one file (or folder / sharded set), named as the file names them.

    Tensors are leaves over a memory map (or positioned reads), in their stored dtype;
    quantized ones stay quantized. Nothing is read until a tensor's data is used.
    """
    path: str
    format: str                      # "safetensors", "gguf", "ckpt", "diffusers", ...
    tensors: dict[str, Tensor] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    # entries the file holds that are not sdrt tensors: dtypes outside the tensor table
    # (safetensors U8/U16/U32/U64/..., e.g. ComfyUI `*.comfy_quant` JSON blobs) and empty
    # (0-element) tensors, as read-only numpy arrays (memory-map views) in numpy order
    raw: dict[str, np.ndarray] = field(default_factory=dict)
    # (path, size, mtime_ns) of every file the tensors map, taken when it was parsed
    sources: list[tuple[str, int, int]] = field(default_factory=list)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def filename(self) -> str:
        return os.path.basename(self.path)

    def check_unchanged(self) -> None:
        """Raise ModelFileError if a file behind this table changed size or mtime since it
        was parsed. Memory-mapped pages of a file truncated after mapping raise SIGBUS on
        access, which Python cannot catch: a long-lived holder calls this before reading."""
        for path, size, mtime in self.sources:
            try:
                st = os.stat(path)
            except OSError as e:
                raise ModelFileError(f"{path}: model file disappeared while in use ({e.strerror})") from None
            if st.st_size != size or st.st_mtime_ns != mtime:
                raise ModelFileError(f"{path}: model file changed on disk after it was opened "
                                     f"(size {size} -> {st.st_size}); open it again")


def file_stamp(path: str, fd: int | None = None) -> tuple[str, int, int]:
    st = os.fstat(fd) if fd is not None else os.stat(path)
    return (path, st.st_size, st.st_mtime_ns)


class ConvertedTensor(Tensor):
    """A leaf whose storage is produced on first access by `fill()` (then cached).

    Readers use it for stored dtypes that sdrt widens or narrows as sd.cpp does
    (F64 -> F32, I64 -> I32): the table costs nothing until the data is used.
    `fill` returns a 1-D uint8 array of exactly `nbytes` bytes, or raises ModelFileError.
    """
    __slots__ = ("_fill",)

    def __init__(self, dtype, ne, fill: Callable[[], np.ndarray], name: str = ""):
        self._fill = fill
        super().__init__(dtype, ne, name=name)

    @property
    def storage(self):
        s = Tensor.storage.__get__(self)
        if s is None and self._fill is not None:
            s = self._fill()
            if s.dtype != np.uint8 or s.ndim != 1 or s.nbytes != self.nbytes:
                raise ModelFileError(f"{self.name}: converted data has {s.nbytes} bytes, expected {self.nbytes}")
            Tensor.storage.__set__(self, s)
            self._fill = None
        return s

    @storage.setter
    def storage(self, value):
        Tensor.storage.__set__(self, value)

    @property
    def is_loaded(self) -> bool:
        return Tensor.storage.__get__(self) is not None


def map_file(path: str, what: str = "model file") -> tuple[np.ndarray, tuple[str, int, int]]:
    """Read-only memory map of a whole file as 1-D uint8, plus its (path, size, mtime) stamp.
    Every failure is a ModelFileError naming the file."""
    try:
        with open(path, "rb") as f:
            stamp = file_stamp(path, f.fileno())
            if stamp[1] == 0:
                raise ModelFileError(f"{path}: empty file, not a {what}")
            mm = np.memmap(f, dtype=np.uint8, mode="r", shape=(stamp[1],))
    except ModelFileError:
        raise
    except IsADirectoryError:
        raise ModelFileError(f"{path}: is a directory, not a {what}") from None
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except (OSError, ValueError, OverflowError, MemoryError) as e:
        raise ModelFileError(f"{path}: cannot map the {what}: {e}") from None
    return mm, stamp
