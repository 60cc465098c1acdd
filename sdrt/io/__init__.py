"""Model files: readers (safetensors, sharded safetensors, GGUF, PyTorch checkpoints, diffusers
folders), writers and convert. `open_model(path)` picks the reader by content, then by name.

Every reader returns a `ModelFile` (lazy tensors over a memory map) and raises only
`sdrt.ModelFileError` for a bad file; `open_model` also turns any unexpected exception from a
reader into a ModelFileError, so nothing a file can trigger escapes as another type.
"""
from __future__ import annotations

import os
import struct

from ..errors import ModelFileError, SdrtError
from .base import ConvertedTensor, ModelFile, open_regular
from .gguf_file import read_gguf
from .safetensors import read_safetensors, read_safetensors_index
from .writer import (CONVERT_TYPES, ConvertSummary, GGUFValue, TensorPlan, convert, parse_tensor_type_rules,
                     write_gguf, write_safetensors)

__all__ = ["open_model", "sniff_format", "ModelFile", "ConvertedTensor", "read_safetensors",
           "read_safetensors_index", "read_gguf", "write_gguf", "write_safetensors", "convert", "ConvertSummary",
           "CONVERT_TYPES", "GGUFValue", "TensorPlan", "parse_tensor_type_rules"]

_DIFFUSERS_DIRS = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
_MODEL_EXTS = (".safetensors", ".gguf", ".ckpt", ".pt", ".pth", ".bin")


def sniff_format(path) -> str:
    """'safetensors', 'safetensors-index', 'gguf', 'ckpt', 'diffusers' or 'unknown', from the
    file's first bytes (then its name). Raises ModelFileError if the path does not exist."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "model_index.json")) or \
                any(os.path.isdir(os.path.join(path, d)) for d in _DIFFUSERS_DIRS):
            return "diffusers"
        return "folder"
    try:
        with open_regular(path) as f:  # a FIFO or device is refused here, never opened for reading
            head = f.read(264)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read: {e.strerror or e}") from None
    low = path.lower()
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "ckpt"
    # before the pickle test: a header length of 0x2?80 begins with the bytes of a pickle PROTO 2
    if len(head) >= 9 and head[8:9] in (b"{", b" ", b"\n", b"\t", b"\r"):
        (n,) = struct.unpack_from("<Q", head)
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        if 2 <= n <= 100_000_000 and (n + 8 <= size or low.endswith(".safetensors")):
            return "safetensors"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # a pickle: legacy torch.save
        return "ckpt"
    if head[257:262] == b"ustar":  # torch's pre-1.0 tar format; the ckpt reader explains the refusal
        return "ckpt"
    if low.endswith(".json"):
        return "safetensors-index"
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith(".gguf"):
        return "gguf"
    if low.endswith((".ckpt", ".pt", ".pth", ".bin")):
        return "ckpt"
    return "unknown"


def _reader(fmt: str, path: str):
    if fmt == "safetensors":
        return read_safetensors
    if fmt == "safetensors-index":
        return read_safetensors_index
    if fmt == "gguf":
        return read_gguf
    if fmt == "ckpt":
        try:
            from .ckpt import read_ckpt
        except ImportError as e:
            raise ModelFileError(f"{path}: PyTorch checkpoint reader is not available ({e})") from None
        return read_ckpt
    if fmt == "diffusers":
        try:
            from .diffusers import read_diffusers_folder
        except ImportError as e:
            raise ModelFileError(f"{path}: diffusers folder reader is not available ({e})") from None
        return read_diffusers_folder
    raise ModelFileError(f"{path}: unknown model file format (not safetensors, GGUF, a PyTorch checkpoint "
                         f"or a diffusers folder)")


def _folder_file(path: str) -> str:
    """A plain folder: its one *.safetensors.index.json, else its one model file."""
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise ModelFileError(f"{path}: cannot list the folder: {e.strerror or e}") from None
    idx = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(idx) == 1:
        return os.path.join(path, idx[0])
    files = [n for n in names if n.lower().endswith(_MODEL_EXTS) and os.path.isfile(os.path.join(path, n))]
    if len(names) > 100_000:
        raise ModelFileError(f"{path}: folder holds {len(names)} entries; name the file to open")
    if len(idx) == 0 and len(files) == 1:
        return os.path.join(path, files[0])
    raise ModelFileError(f"{path}: folder holds {len(idx)} index files and {len(files)} model files; "
                         f"name the file to open")


def open_model(path) -> ModelFile:
    """Open any supported model file or folder lazily; raises only ModelFileError."""
    path = os.fspath(path)
    try:
        fmt = sniff_format(path)
        if fmt == "folder":
            path = _folder_file(path)
            fmt = sniff_format(path)
        return _reader(fmt, path)(path)
    except SdrtError:
        raise
    except RecursionError:
        raise ModelFileError(f"{path}: structure nested too deeply to read") from None
    except MemoryError:
        raise ModelFileError(f"{path}: not enough memory to read the file's tables") from None
    except Exception as e:  # a reader bug must still reach the user as a clean error
        raise ModelFileError(f"{path}: unexpected {type(e).__name__} while reading: {e}") from e
