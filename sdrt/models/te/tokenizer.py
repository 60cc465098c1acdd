"""The CLIP byte-level BPE tokenizer (SD1 CLIP-L, SD2 OpenCLIP-H, SDXL CLIP-L + OpenCLIP-bigG).

Vocabulary: `data/bpe_simple_vocab_16e6.txt.gz`, the merges file OpenAI's CLIP and open_clip ship
(taken from the open_clip_torch wheel, MIT license in `data/LICENSE`). Its first 48894 merges give
the 49408-token vocabulary: 256 byte symbols, the same 256 with `</w>`, one token per merge, then
`<|startoftext|>` (49406) and `<|endoftext|>` (49407).

Two text clean-ups (`style`):
- "sdcpp" (default), what stable-diffusion.cpp's CLIPTokenizer does: runs of ASCII whitespace
  become one space, the ends are stripped, ASCII letters are lowercased; words are split with
  ASCII classes (`'s|'t|'re|'ve|'m|'ll|'d|[a-z]+|[0-9]|[^\\s a-z 0-9]+`), so a non-ASCII letter
  falls in a punctuation run ("café" -> "caf", "é").
- "hf", what transformers' CLIPTokenizer (no ftfy) does: NFC, any Unicode whitespace run becomes a
  space, full Unicode lowercasing, split with Unicode letter / number classes (`\\p{L}+|\\p{N}|...`).
For ASCII text both give the same ids.

Special tokens: `<|startoftext|>`, `<|endoftext|>` and any added with `add_special_token` (sd.cpp
registers textual-inversion names this way) are cut out of the cleaned text first, by substring,
earliest match first and, at one position, the first registered. `encode(text, on_token)` calls
`on_token(piece)` for every special piece and every word; a list of ids it returns replaces the
piece's BPE ids (the embedding hook), None leaves the piece to the BPE.
"""
from __future__ import annotations

import gzip
import os
import re
import unicodedata
from collections.abc import Callable
from functools import lru_cache

from ...errors import ModelFileError, UsageError

__all__ = ["BOS_ID", "EOS_ID", "VOCAB_SIZE", "CLIPTokenizer", "vocab_path"]

BOS_ID, EOS_ID, VOCAB_SIZE = 49406, 49407, 49408
N_MERGES = 49152 - 256 - 2       # the merges CLIP uses (the file holds more)
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"
STYLES = ("sdcpp", "hf")

_ASCII_SPACE = " \t\n\v\f\r"
# Unicode White_Space (what \s means in the tokenizers library's regex)
_UNI_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                       + "".join(chr(c) for c in range(0x2000, 0x200B)))
_RE_ASCII_WORDS = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[A-Za-z]+|[0-9]|[^ \t\n\v\f\rA-Za-z0-9]+")
_RE_ASCII_SPACE = re.compile(r"[ \t\n\v\f\r]+")
_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


def vocab_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bpe_simple_vocab_16e6.txt.gz")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=2)
def _load_vocab(path: str):
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            f.readline()                                  # "#version: 0.2"
            merges = []
            for _ in range(N_MERGES):
                line = f.readline()
                a, sep, b = line.rstrip("\n").partition(" ")
                if not sep or not a or not b:
                    raise ModelFileError(f"{path}: merge line {len(merges) + 2} is not 'a b': {line!r}")
                merges.append((a, b))
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: cannot read the CLIP BPE vocabulary: {e}") from None
    syms = list(bytes_to_unicode().values())
    vocab = syms + [s + "</w>" for s in syms] + [a + b for a, b in merges] + [_BOS, _EOS]
    encoder = {t: i for i, t in enumerate(vocab)}
    ranks = {m: i for i, m in enumerate(merges)}
    return encoder, vocab, ranks


def _split_hf(text: str) -> list[str]:
    """transformers' pre-tokenizer: 's|'t|'re|'ve|'m|'ll|'d|\\p{L}+|\\p{N}|[^\\s\\p{L}\\p{N}]+."""
    def kind(c):
        if c in _UNI_SPACE:
            return "s"
        cat = unicodedata.category(c)[0]
        return cat if cat in "LN" else "o"

    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] == "'":
            m = next((c for c in _CONTRACTIONS if text.startswith(c, i)), None)
            if m:
                out.append(m)
                i += len(m)
                continue
        k = kind(text[i])
        if k == "s":
            i += 1
            continue
        j = i + 1
        if k != "N":                  # numbers are one character each
            while j < n and kind(text[j]) == k:
                j += 1
        out.append(text[i:j])
        i = j
    return out


class CLIPTokenizer:
    """CLIP BPE: `encode(text) -> ids` (no BOS/EOS), `decode(ids) -> text`; `pad_id` is what
    sd.cpp pads chunks with (EOS 49407 for CLIP-L, 0 for OpenCLIP)."""

    def __init__(self, pad_id: int = EOS_ID, style: str = "sdcpp", path: str | None = None):
        if style not in STYLES:
            raise UsageError(f"tokenizer style {style!r}: choose one of {', '.join(STYLES)}")
        self.encoder, self.vocab, self.ranks = _load_vocab(path or vocab_path())
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pad_id, self.style = int(pad_id), style
        self.bos_id, self.eos_id = BOS_ID, EOS_ID
        self.special_tokens: list[str] = [_BOS, _EOS]
        self._cache: dict[str, list[str]] = {}

    def add_special_token(self, token: str) -> None:
        if token and token not in self.special_tokens:
            self.special_tokens.append(token)

    # ---- text -> words -------------------------------------------------------------------
    def normalize(self, text: str) -> str:
        if self.style == "hf":
            text = unicodedata.normalize("NFC", text)
            text = "".join(" " if c in _UNI_SPACE else c for c in text)
            # per character, as the tokenizers library does (no final-sigma rule)
            return "".join(c.lower() for c in re.sub(" +", " ", text))
        text = _RE_ASCII_SPACE.sub(" ", text).strip(_ASCII_SPACE)
        return text.translate(_ASCII_LOWER)

    def split_words(self, text: str) -> list[str]:
        return _split_hf(text) if self.style == "hf" else _RE_ASCII_WORDS.findall(text)

    def split_special(self, text: str) -> list[tuple[str, bool]]:
        """[(piece, is_special)]: sd.cpp's split_with_special_tokens."""
        out, pos, n = [], 0, len(text)
        while pos < n:
            best, tok = n, None
            for t in self.special_tokens:
                k = text.find(t, pos)
                if k != -1 and k < best:
                    best, tok = k, t
            if best > pos:
                out.append((text[pos:best], False))
            if tok is None:
                break
            out.append((tok, True))
            pos = best + len(tok)
        return out

    # ---- BPE -----------------------------------------------------------------------------
    def bpe(self, word: str) -> list[str]:
        """Byte-encoded word -> its BPE symbols (the last one ends with </w>)."""
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        ranks = self.ranks
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            a, b = parts[bi], parts[bi + 1]
            merged, i = [], 0
            while i < len(parts):           # merge every occurrence of the pair, left to right
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        if len(self._cache) < 65536:
            self._cache[word] = parts
        return parts

    def _word_ids(self, word: str) -> list[int]:
        enc = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
        return [self.encoder[s] for s in self.bpe(enc)]

    def encode(self, text: str, on_token: Callable[[str], list[int] | None] | None = None) -> list[int]:
        """Token ids of `text` without BOS/EOS."""
        ids: list[int] = []
        for piece, special in self.split_special(self.normalize(text)):
            if special:
                got = on_token(piece) if on_token is not None else None
                if got is not None:
                    ids.extend(got)
                elif piece in self.encoder:
                    ids.append(self.encoder[piece])
                else:                       # a registered name whose embedding was refused
                    for w in self.split_words(piece):
                        ids.extend(self._word_ids(w))
                continue
            for w in self.split_words(piece):
                got = on_token(w) if on_token is not None else None
                ids.extend(got if got is not None else self._word_ids(w))
        return ids

    def decode(self, ids) -> str:
        """Text of ids (BOS/EOS/pad and ids outside the vocabulary skipped), as sd.cpp decodes."""
        data = bytearray()
        for i in ids:
            i = int(i)
            if i in (BOS_ID, EOS_ID, self.pad_id) or not 0 <= i < len(self.vocab):
                continue
            s = self.vocab[i]
            end = s.endswith("</w>")
            data += bytes(self.byte_decoder[c] for c in (s[:-4] if end else s))
            if end:
                data += b" "
        text = data.decode("utf-8", errors="replace").replace(" ,", ",")
        return text.strip()


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
