"""The few facts any family's detection rule reads, collected in one pass over a table's names
and shapes (data is never read): the input of every rule registered in sdrt.models.families.

Input: a ModelFile, or a dict name -> Tensor (shape from `.ne`, ggml order) or name -> shape
(numpy/torch order). A table with none of the known top-level prefixes is a bare diffusion model
(`--diffusion-model` file): its names are looked at under `model.diffusion_model.`, as sd.cpp does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Facts", "facts", "dim", "DM"]

DM = "model.diffusion_model."
_KNOWN_TOPS = ("model.", "first_stage_model.", "cond_stage_model.", "conditioner.", "text_encoders.", "unet.",
               "vae.", "te.", "text_encoder", "transformer.", "tae.", "net.", "llm_adapter.")


def _ne_of(v) -> tuple:
    ne = getattr(v, "ne", None)
    if ne is not None:
        return tuple(ne)
    shape = tuple(int(x) for x in v)
    return tuple(reversed(shape)) or (1,)


@dataclass
class Facts:
    names: dict                      # name -> ne (ggml order, not folded)
    blob: str = ""                   # all names joined by "\n", for fast substring tests
    token_embedding: tuple = ()
    input_block: tuple = ()
    context_embedding: tuple = ()
    flags: set = field(default_factory=set)

    def has(self, s: str) -> bool:
        return s in self.blob

    def ne(self, name: str) -> tuple:
        return self.names.get(name, ())


_TOKEN_EMBEDDINGS = ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
                     "cond_stage_model.model.token_embedding.weight", "text_model.embeddings.token_embedding.weight",
                     "te.text_model.embeddings.token_embedding.weight",
                     "conditioner.embedders.0.model.token_embedding.weight",
                     "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight")
_INPUT_BLOCKS = (DM + "input_blocks.0.0.weight", DM + "img_in.weight", "unet.conv_in.weight")
_CONTEXT = (DM + "txt_in.weight", DM + "context_embedder.weight")


def facts(tensors) -> Facts:
    table = getattr(tensors, "tensors", tensors)
    names = {str(k): _ne_of(v) for k, v in table.items()}
    if names and not any(n.startswith(_KNOWN_TOPS) for n in names):
        names = {DM + k: v for k, v in names.items()}     # a bare --diffusion-model file
    f = Facts(names, "\n" + "\n".join(names) + "\n")
    for n in _TOKEN_EMBEDDINGS:
        if n in names:
            f.token_embedding = names[n]
    for n in _INPUT_BLOCKS:
        if n in names:
            f.input_block = names[n]
    for n in _CONTEXT:
        if n in names:
            f.context_embedding = names[n]
    return f


def dim(ne: tuple, i: int) -> int:
    """ne[i], with dims past 3 folded into ne[3] as sd.cpp's loader folds 5-D weights."""
    if i < 3:
        return ne[i] if len(ne) > i else (1 if ne else 0)
    p = 1
    for d in ne[3:]:
        p *= d
    return p if len(ne) > 3 else (1 if ne else 0)
