"""What every model-file reader returns: a lazy table of named tensors plus metadata."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

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

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def filename(self) -> str:
        return os.path.basename(self.path)
