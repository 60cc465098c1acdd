"""The family's conditioner bound to sdrt's file readers: textual-inversion files in `--embd-dir`
are opened with sdrt.io (models never read files themselves). The conditioners live in
sdrt.models.conditioning; this is the entry the pipeline and the API use."""
from __future__ import annotations

from collections.abc import Mapping

from ..io import open_model
from ..models.conditioning import (  # noqa: F401 - the conditioning API, importable from here
    EMBEDDING_EXTS,
    Cond,
    Conditioner,
    TextEncoderSpec,
    build_clip_conditioner,
    size_embedding,
)
from ..models.conditioning import build_conditioner as _build
from ..ops.tensor import Tensor

__all__ = ["EMBEDDING_EXTS", "Cond", "Conditioner", "TextEncoderSpec", "build_clip_conditioner", "build_conditioner",
           "open_tensors", "size_embedding"]


def open_tensors(path: str) -> Mapping[str, Tensor]:
    """The tensors of a model file (safetensors, GGUF, safe .pt), for embeddings."""
    return open_model(path).tensors


def build_conditioner(table: Mapping[str, Tensor], version: str, embd_dir: str | None = None, **kw):
    """The conditioner of a model version, as its family builds it, reading `embd_dir` with sdrt.io."""
    kw.setdefault("open_file", open_tensors)
    return _build(table, version, embd_dir, **kw)
