"""What every model-file reader returns: a lazy table of named tensors plus metadata."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import ModelFileError
from ..ops.tensor import Tensor


# ---- the resource policy every reader follows (docs/model-files.md, "Limits") ---------------
# A file may only make sdrt allocate what its own bytes justify: every count, length and size
# it declares is checked against the bytes that are really there (and these caps) before any
# list, dict, string or array is built from it.
MAX_HEADER_BYTES = 100_000_000      # safetensors JSON header (the reference reader's cap), GGUF tables
MAX_TENSORS = 1 << 16               # tensors (and empty entries) in one file: 65,536
MAX_NAME_BYTES = 65535              # one tensor name / metadata key, every format
MAX_METADATA_ENTRIES = 1 << 16      # GGUF key/values, safetensors __metadata__ entries
MAX_ARRAY_STRINGS = 1 << 20         # strings in all GGUF string arrays together (vocabularies)
MAX_PICKLE_BYTES = 256 << 20        # data.pkl / legacy pickle bytes
MAX_PICKLE_OPS = 500_000            # opcodes per pickle (a tensor costs ~30; SDXL with EMA needs ~150,000)
PICKLE_BUDGET_BASE = 64 << 20       # the pickle VM's memory budget: this + min(8 x pickle bytes, file size / 2)
PICKLE_BUDGET_PER_BYTE = 8
PICKLE_BUDGET_MAX = 1 << 30
MAX_INFLATE_RATIO = 64              # a deflated zip entry: real inflated bytes <= 64 x real compressed + 1 MiB
MAX_ZIP_ENTRIES = 1 << 17           # entries in a torch zip's central directory


def inflate_budget(file_size: int) -> int:
    """Total bytes the deflated entries of one torch zip (data.pkl and storages) may inflate to:
    1.5 x the file's size + 32 MiB. torch writes its zips stored; a re-zipped checkpoint of floats
    deflates by a few percent, so more than this is a bomb."""
    return file_size + file_size // 2 + (32 << 20)


def pickle_budget(pickle_bytes: int, file_size: int) -> int:
    """The memory (bytes of Python objects, estimated) a pickle may make the VM build: enough for
    any real state dict (~8 bytes of objects per pickle byte), never more than the file justifies."""
    return min(PICKLE_BUDGET_MAX, PICKLE_BUDGET_BASE + min(PICKLE_BUDGET_PER_BYTE * pickle_bytes, file_size // 2))


def check_regular_file(path: str, what: str = "model file") -> os.stat_result:
    """stat() a path and refuse anything but a regular file (FIFOs, devices, sockets block or never
    end when read) before it is opened. Raises ModelFileError naming the path."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFileError(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or
                stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise ModelFileError(f"{path}: is {kind}, not a {what}; refusing to read it")
    return st


def open_regular(path: str, what: str = "model file"):
    """open(path, 'rb') of a regular file only: checked by stat() first, opened non-blocking (a FIFO
    swapped in between cannot block), then checked again on the open descriptor."""
    check_regular_file(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelFileError(f"{path}: is not a regular file, not a {what}; refusing to read it")
    return os.fdopen(fd, "rb")


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
        with open_regular(path, what) as f:
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
