"""Conditioning by an LLM text encoder (Z-Image, Qwen-Image): the `--llm` component and sd.cpp's
LLMEmbedder for text prompts.

- component `llm` (`--llm FILE`): a Qwen3 / Qwen2.5(-VL) decoder as safetensors (HF names,
  `model.layers.N...`) or a llama.cpp GGUF (`blk.N.attn_q...`, renamed by sdrt.models.names),
  loaded under sd.cpp's canonical prefix `text_encoders.llm.`.
- `LLMConditioner(llm, tokenizer, template)`: sd.cpp's LLMEmbedder::get_learned_condition for a
  text prompt: the template wrapped around the prompt (sdrt.models.te.qwen_tokenizer.PromptTemplate:
  prefix, suffix, the layer read, the hidden states dropped from the front), the prompt's
  attention syntax applied per token, one causal pass without padding (sd.cpp's min_length 0:
  its mask is all ones), sd.cpp's apply_token_weights over the whole sequence, then the first
  `drop` states cut. encode(...) -> Cond(context [1, L - drop, hidden]).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from ..errors import UsageError
from .families import Component, Cond, register_component

__all__ = ["LLM", "PREFIX_LLM", "LLMConditioner", "build_llm_conditioner"]

log = logging.getLogger("sdrt")
PREFIX_LLM = "text_encoders.llm."

LLM = register_component(Component(
    "llm", "--llm", "llm",
    "path to the LLM text encoder (Z-Image: Qwen3-4B, e.g. qwen_3_4b.safetensors or a GGUF of it)",
    strip=(PREFIX_LLM,), prefix={"dit": PREFIX_LLM}, replaces=(PREFIX_LLM,)))


class LLMConditioner:
    """sd.cpp's LLMEmbedder over a text prompt (see the module docstring)."""

    def __init__(self, llm, tokenizer, template, *, backend: str = "cpu"):
        self.llm, self.tokenizer, self.template, self.backend = llm, tokenizer, template, backend

    def tokenize(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        ids, weights = self.tokenizer.encode_template(self.template, prompt)
        return np.asarray(ids, np.int32), np.asarray(weights, np.float32)

    def hidden_states(self, prompt: str) -> np.ndarray:
        """float32 [1, L - drop, hidden]."""
        from .prompt import apply_token_weights
        ids, weights = self.tokenize(prompt)
        drop = self.template.drop
        if ids.size <= drop:
            raise UsageError(f"the prompt template gives {ids.size} tokens, not more than the {drop} it drops")
        h = self.llm.run(ids, self.template.out_layer, self.backend)[0]          # [L, hidden]
        return apply_token_weights(h, weights)[drop:][None]

    def encode(self, prompt: str, width: int | None = None, height: int | None = None, clip_skip: int = -1, *,
               zero_out_masked: bool = False) -> Cond:
        if not isinstance(prompt, str):
            raise UsageError(f"prompt must be a string, got {type(prompt).__name__}")
        return Cond(self.hidden_states(prompt))


def build_llm_conditioner(table: Mapping, template, *, family: str, backend: str = "cpu", source: str = "model",
                          head_dim: int | None = None, tokenizer_path: str | None = None) -> LLMConditioner:
    """The LLM under PREFIX_LLM in `table` with the Qwen tokenizer; a missing LLM is a UsageError
    naming --llm (sd.cpp would run on without one and fail later)."""
    from .te.qwen_llm import QwenLLM
    from .te.qwen_tokenizer import QwenTokenizer
    if not any(k.startswith(PREFIX_LLM + "model.") for k in table):
        raise UsageError(f"{source}: this {family} model needs its LLM text encoder: give --llm FILE "
                         f"(no tensors under {PREFIX_LLM!r} in the loaded files)")
    llm = QwenLLM(table, PREFIX_LLM, source=source, head_dim=head_dim)
    log.info("%s", llm.config.summary())
    if template.out_layer and not llm.reads_layer(template.out_layer):
        log.info("LLM: layer %d does not exist (%d layers): the final-norm output is used, as sd.cpp",
                 template.out_layer, llm.config.layers)
    return LLMConditioner(llm, QwenTokenizer(tokenizer_path), template, backend=backend)
