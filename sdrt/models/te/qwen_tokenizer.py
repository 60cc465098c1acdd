"""The Qwen2 byte-level BPE tokenizer (shared by Qwen2, Qwen2.5(-VL) and Qwen3), with the ids of
Hugging Face's Qwen2Tokenizer(Fast), and the prompt templates stable-diffusion.cpp wraps around a
prompt for the LLM-conditioned families.

    from sdrt.models.te.qwen_tokenizer import QwenTokenizer
    tok = QwenTokenizer()                       # the merges shipped with sdrt
    tok = QwenTokenizer("Z-Image/tokenizer")    # a model folder's tokenizer.json / vocab.json+merges.txt
    tok.encode("a cat <|im_end|>")              # -> [64, 8251, 220, 151645] (no BOS/EOS added)
    ids, weights = tok.encode_template(ZIMAGE_TEMPLATE, "a (red:1.2) cat")   # sd.cpp's LLMEmbedder

- `encode(text)` -> list of ids: HF's `tok(text, add_special_tokens=False).input_ids` (Qwen adds
  no BOS/EOS anyway): NFC normalization, the special-token strings cut out first, Qwen2's split
  regex, byte-level symbols, BPE by merge rank.
- `encode_template(template, prompt)` -> (ids, weights): sd.cpp's LLMEmbedder::tokenize: the
  template's text before and after the prompt tokenized on their own (weight 1), the prompt parsed
  for attention syntax (`(word:1.2)`, sdrt.models.prompt) and each segment tokenized on its own;
  no padding (the Z-Image / Qwen-Image min_length is 0).

The work is done by the `tokenizers` library (the engine behind HF's Qwen2TokenizerFast) over a
tokenizer built here as HF's tokenizer.json for Qwen2 describes it (NFC normalizer; Split on the
Qwen2 regex, isolated, then ByteLevel without prefix space or its own regex; BPE without
dropout/unk; the added tokens), so the ids are HF's by construction and the test compares them on
1,000+ prompts (tests/test_qwen_tokenizer.py). stable-diffusion.cpp's own port skips the NFC step,
so text whose NFC form differs (decomposed accents, some CJK compatibility characters) gets other
ids in sd-cli; on NFC text both agree.

Vocabulary: data/qwen2_merges.txt.gz (Qwen's merges, taken from the stable-diffusion.cpp sources;
provenance and licenses in data/LICENSE.qwen): ids 0-255 are the byte symbols in GPT-2's
bytes_to_unicode order, merge rule r is id 256 + r, then SPECIAL_TOKENS from 151643.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from functools import lru_cache

from ...errors import ModelFileError, UsageError

__all__ = ["ENDOFTEXT_ID", "QWEN2_SPLIT_REGEX", "SPECIAL_TOKENS", "ZIMAGE_TEMPLATE", "PromptTemplate",
           "QwenTokenizer", "bytes_to_unicode", "merges_path"]

_DATA = os.path.join(os.path.dirname(__file__), "data", "qwen2_merges.txt.gz")
N_REGULAR = 151643
ENDOFTEXT_ID = 151643
# Qwen3's added tokens in id order from 151643 (Qwen2.5 has the first 22; the same ids)
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>")
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PromptTemplate:
    """Text around the user prompt (sd.cpp's LLMEmbedder::get_learned_condition): the LLM reads
    prefix + prompt + suffix; `drop` hidden states are removed from the front
    (prompt_template_encode_start_idx) and `out_layer` is the 1-based layer whose output is read
    (sd.cpp's out_layers; 0: the final-norm output of the last layer)."""
    prefix: str
    suffix: str
    drop: int = 0
    out_layer: int = 0


# Z-Image (no reference images): Qwen3's chat template for one user turn with the generation
# prompt; the output of layer 35 of 36 (hidden_states[-2]), nothing dropped
ZIMAGE_TEMPLATE = PromptTemplate("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", 0, 35)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map, in its order (the first 256 ids)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(161, 173)) + list(range(174, 256))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def merges_path() -> str:
    return _DATA


def _read_merges(path: str) -> list[tuple[str, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ModelFileError(f"{path}: merge rule {i + 1} is not two symbols: {line[:60]!r}")
        out.append((parts[0], parts[1]))
    return out


def _vocab_from_merges(merges) -> dict[str, int]:
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab


def _build(vocab: dict, merges: list, specials) -> "object":
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


@lru_cache(maxsize=4)
def _load(path: str | None):
    from tokenizers import Tokenizer
    if path is None:
        merges = _read_merges(_DATA)
        vocab = _vocab_from_merges(merges)
        if len(vocab) != N_REGULAR:
            raise ModelFileError(f"{_DATA}: {len(vocab)} regular tokens, expected {N_REGULAR}")
        return _build(vocab, merges, SPECIAL_TOKENS)
    if os.path.isdir(path):
        for sub in ("", "tokenizer"):
            d = os.path.join(path, sub)
            if os.path.isfile(os.path.join(d, "tokenizer.json")):
                return _load(os.path.join(d, "tokenizer.json"))
            if os.path.isfile(os.path.join(d, "vocab.json")) and os.path.isfile(os.path.join(d, "merges.txt")):
                return _from_vocab_merges(d)
        raise ModelFileError(f"{path}: no tokenizer.json or vocab.json + merges.txt in this folder (or tokenizer/)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:    # the tokenizers library raises plain Exception
        raise ModelFileError(f"{path}: not a readable Qwen tokenizer ({e})") from e


def _from_vocab_merges(d: str):
    try:
        with open(os.path.join(d, "vocab.json"), encoding="utf-8") as f:
            vocab = json.load(f)
        return _build(vocab, _read_merges(os.path.join(d, "merges.txt")), SPECIAL_TOKENS)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(f"{d}: not a readable Qwen vocab.json + merges.txt ({e})") from e


class QwenTokenizer:
    """The Qwen2 BPE tokenizer (see the module docstring)."""

    def __init__(self, path: str | None = None):
        self._tok = _load(None if path is None else os.fspath(path))
        self.eos_id = self.pad_id = ENDOFTEXT_ID

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise UsageError(f"text to tokenize must be a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_template(self, template: PromptTemplate, prompt: str) -> tuple[list[int], list[float]]:
        """sd.cpp's LLMEmbedder::tokenize(prefix + prompt + suffix, attn_range = the prompt)."""
        from ..prompt import parse_prompt_attention
        if not isinstance(prompt, str):
            raise UsageError(f"prompt must be a string, got {type(prompt).__name__}")
        segments = []
        if template.prefix:
            segments.append((template.prefix, 1.0))
        if prompt:
            segments += parse_prompt_attention(prompt)
        if template.suffix:
            segments.append((template.suffix, 1.0))
        ids: list[int] = []
        weights: list[float] = []
        for text, w in segments:
            piece = self.encode(text)
            ids += piece
            weights += [float(w)] * len(piece)
        return ids, weights
