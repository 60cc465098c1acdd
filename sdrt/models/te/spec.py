"""How a CLIP conditioner runs one text model (data only: family records import it without
pulling in the model code)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TextEncoderSpec"]


@dataclass(frozen=True)
class TextEncoderSpec:
    """One text model of a CLIP conditioner: where its weights are and how sd.cpp runs it."""
    prefix: str
    act: str
    final_ln: bool
    pooled: bool = False         # SDXL bigG: pooled output for y
    zero_after_eos: bool = False  # SDXL bigG: ids after the first EOS of a chunk become 0
