"""The T5 tokenizer (SentencePiece unigram, T5 v1.1's 32000 pieces + 100 `<extra_id_N>`), with
the ids of Hugging Face's T5TokenizerFast, and stable-diffusion.cpp's per-family padding.

    from sdrt.models.te.t5_tokenizer import T5Tokenizer
    tok = T5Tokenizer()                         # the vocabulary shipped with sdrt
    tok = T5Tokenizer("flux-dev/tokenizer_2")   # a diffusers folder's own files, when present
    ids, mask = tok.encode("a cat", max_length=256, pad=True)     # HF: tok(text, max_length, ...)
    ids, weights, mask = tok.pad_chunks(tok.tokenize("a cat"), 256)  # sd.cpp's pad_tokens

- `tokenize(text)` -> list of piece ids, no `</s>` (what sd.cpp's T5UniGramTokenizer::encode
  returns; sd.cpp tokenizes each attention-syntax segment on its own and joins the ids).
- `encode(text, max_length=None, pad=False)` -> (ids, mask) int32 numpy: the pieces + `</s>`
  (id 1), cut to max_length with `</s>` kept last (HF truncation=True), padded with `<pad>` (0)
  to max_length when `pad` (HF padding="max_length"); mask 1 for real tokens and `</s>`.
- `pad_chunks(ids, chunk_len, weights=None)` -> (ids, weights, mask): sd.cpp's
  `pad_tokens(tokens, weights, mask, chunk_len, chunk_len, allow_overflow_expand=true)`: chunks
  of chunk_len - 1 pieces + `</s>`, the last one padded with 0 (mask 0, weight 1); an empty
  prompt is `</s>` + padding. Nothing is dropped: a long prompt becomes several chunks, which
  sd.cpp's conditioners encode one by one and concatenate.
  Chunk lengths sd.cpp uses (`CHUNK_LEN`): SD3 77, Flux 256, Chroma 512; only Chroma passes the
  mask to T5 (`--chroma-enable-t5-mask`).

Two styles (`T5Tokenizer(style=...)`), as for the CLIP tokenizer:
- "hf" (default): Hugging Face's ids (T5TokenizerFast over the tokenizer.json).
- "sdcpp": stable-diffusion.cpp's T5UniGramTokenizer::encode: runs of 2+ ASCII spaces become one,
  no charsmap normalization, only `<pad>`, `</s>`, `<unk>` are cut out as special strings
  (earliest match first), each other segment becomes "\u2581" + its spaces as "\u2581" (a
  trailing space dropped, as std::getline splits), one unigram Viterbi over that whole string,
  one `<unk>` per unknown character. sd-cli's ids; on plain text (printable ASCII or composed
  accents, no leading/trailing/repeated whitespace, no special strings) both styles agree.

The work is done by the `tokenizers` library (Hugging Face's Rust tokenizer, the engine behind
T5TokenizerFast), over the same tokenizer.json HF loads, so normalization (the nmt_nfkc
precompiled charsmap, runs of spaces), the Metaspace pre-tokenizer, the unigram Viterbi search
and the special tokens are HF's by construction. stable-diffusion.cpp's own port differs: it
skips the charsmap normalization (a TODO there), so non-ASCII text that NFKC changes (full-width
forms, ligatures, some spaces and control characters) gets different ids in sd-cli, and so do
whitespace at the ends, tabs/newlines and special-token strings (style "sdcpp" reproduces it).

Vocabulary sources, first found wins: a `tokenizer.json`, a `spiece.model` (read with a minimal
protobuf reader and turned into the same tokenizer.json structure), the file or folder given
(also `<folder>/tokenizer_2/`); with no path, `data/t5_tokenizer.json.gz` (provenance and
licenses in data/LICENSE.t5).
"""
from __future__ import annotations

import base64
import copy
import gzip
import json
import os
import re
import struct
from functools import lru_cache

import numpy as np

from ...errors import ModelFileError, UsageError

__all__ = ["CHUNK_LEN", "EOS_ID", "PAD_ID", "STYLES", "UNK_ID", "T5Tokenizer", "read_spiece_model", "vocab_path"]

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
N_EXTRA_IDS = 100
CHUNK_LEN = {"sd3": 77, "flux": 256, "chroma": 512}   # sd.cpp's T5 chunk per conditioner
STYLES = ("hf", "sdcpp")
_SDCPP_SPECIAL = (("<pad>", PAD_ID), ("</s>", EOS_ID), ("<unk>", UNK_ID))
_RE_SPACES = re.compile(" {2,}")


def vocab_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "t5_tokenizer.json.gz")


# ---- spiece.model (protobuf) -------------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message; value bytes for wire type 2."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        if i > len(buf):
            raise ValueError("truncated field")
        yield num, wt, v


def read_spiece_model(path: str) -> tuple[list[tuple[str, float]], bytes]:
    """(pieces with scores, precompiled normalization charsmap) of a SentencePiece model file."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
        pieces, charsmap = [], b""
        for num, wt, v in _fields(buf):
            if num == 1 and wt == 2:                       # ModelProto.pieces
                piece, score = None, 0.0
                for n2, w2, v2 in _fields(v):
                    if n2 == 1 and w2 == 2:
                        piece = v2.decode("utf-8")
                    elif n2 == 2 and w2 == 5:
                        score = struct.unpack("<f", v2)[0]
                if piece is None:
                    raise ValueError(f"piece {len(pieces)} has no text")
                pieces.append((piece, score))
            elif num == 3 and wt == 2:                     # ModelProto.normalizer_spec
                for n2, w2, v2 in _fields(v):
                    if n2 == 2 and w2 == 2:
                        charsmap = bytes(v2)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not a readable SentencePiece model: {e}") from None
    if len(pieces) < 3:
        raise ModelFileError(f"{path}: a SentencePiece model with {len(pieces)} pieces")
    return pieces, charsmap


# ---- loading ---------------------------------------------------------------------------------
@lru_cache(maxsize=2)
def _bundled_json() -> dict:
    path = vocab_path()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, EOFError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read the T5 vocabulary: {e}") from None


def _json_from_spiece(path: str) -> dict:
    """The bundled tokenizer.json's structure (HF's T5 conversion) over a spiece.model's pieces."""
    pieces, charsmap = read_spiece_model(path)
    d = copy.deepcopy(_bundled_json())
    extra = [(f"<extra_id_{i}>", 0.0) for i in range(N_EXTRA_IDS - 1, -1, -1)]
    d["model"]["vocab"] = [list(p) for p in pieces + extra]
    d["model"]["unk_id"] = UNK_ID
    n = len(pieces)
    d["added_tokens"] = [t for t in d["added_tokens"] if t["id"] < 3] + [
        {**d["added_tokens"][0], "id": n + N_EXTRA_IDS - 1 - i, "content": f"<extra_id_{i}>"}
        for i in range(N_EXTRA_IDS)]
    norms = [n_ for n_ in d["normalizer"]["normalizers"] if n_["type"] != "Precompiled"]
    if charsmap:
        norms.insert(0, {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()})
    d["normalizer"]["normalizers"] = norms
    return d


def _resolve(path: str) -> tuple[str, str]:
    """('json' | 'spiece', file) for a file or a folder (a diffusers root: its tokenizer_2/)."""
    if os.path.isfile(path):
        return ("spiece" if path.endswith(".model") else "json"), path
    if os.path.isdir(path):
        for d in (path, os.path.join(path, "tokenizer_2")):
            for kind, name in (("json", "tokenizer.json"), ("spiece", "spiece.model")):
                if os.path.isfile(os.path.join(d, name)):
                    return kind, os.path.join(d, name)
        raise ModelFileError(f"{path}: no tokenizer.json or spiece.model (nor in tokenizer_2/)")
    raise ModelFileError(f"{path}: no such T5 tokenizer file or folder")


class T5Tokenizer:
    """See the module docstring."""

    def __init__(self, path: str | None = None, style: str = "hf"):
        if style not in STYLES:
            raise UsageError(f"T5 tokenizer style {style!r}: choose one of {', '.join(STYLES)}")
        self.style = style
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # a core dependency; say so if the install lost it
            raise ModelFileError(f"the T5 tokenizer needs the `tokenizers` package: {e}") from None
        if path is None:
            self.source, d = vocab_path(), _bundled_json()
        else:
            kind, self.source = _resolve(os.fspath(path))
            if kind == "spiece":
                d = _json_from_spiece(self.source)
            else:
                try:
                    with open(self.source, encoding="utf-8") as f:
                        d = json.load(f)
                except (OSError, ValueError) as e:
                    raise ModelFileError(f"{self.source}: cannot read tokenizer.json: {e}") from None
        if d.get("model", {}).get("type") != "Unigram":
            raise ModelFileError(f"{self.source}: not a SentencePiece-unigram (T5) tokenizer")
        try:
            self._tok = Tokenizer.from_str(json.dumps(d))
        except Exception as e:  # tokenizers raises its own Exception types
            raise ModelFileError(f"{self.source}: tokenizers cannot load it: {e}") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        for tok, want in (("<pad>", PAD_ID), ("</s>", EOS_ID), ("<unk>", UNK_ID)):
            if self._tok.token_to_id(tok) != want:
                raise ModelFileError(f"{self.source}: {tok} is id {self._tok.token_to_id(tok)}, T5 has {want}")

    def tokenize(self, text: str) -> list[int]:
        """Piece ids of `text`, without `</s>`."""
        if not isinstance(text, str):
            raise UsageError(f"T5 tokenizer: text must be a str, got {type(text).__name__}")
        if self.style == "sdcpp":
            return self._tokenize_sdcpp(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self.style == "sdcpp":
            return [self.tokenize(t) for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def _tokenize_sdcpp(self, text: str) -> list[int]:
        text = _RE_SPACES.sub(" ", text)
        ids: list[int] = []
        pos = 0
        while True:                       # cut out the earliest special string, first listed on ties
            hits = [(i, tok, tid) for tok, tid in _SDCPP_SPECIAL if (i := text.find(tok, pos)) >= 0]
            nxt = min(hits, key=lambda h: h[0]) if hits else None
            end = nxt[0] if nxt else len(text)
            if end > pos or (not text and not ids):
                ids += self._viterbi_sdcpp(text[pos:end])
            if nxt is None:
                return ids
            ids.append(nxt[2])
            pos = nxt[0] + len(nxt[1])
            if pos >= len(text):
                return ids

    def _viterbi_sdcpp(self, seg: str) -> list[int]:
        parts = seg.split(" ")
        if seg.endswith(" "):
            parts.pop()                   # std::getline yields no empty field after a final ' '
        out = []
        for t in self._tok.model.tokenize("\u2581" + "\u2581".join(parts)):
            out += [UNK_ID] * len(t.value) if t.id == UNK_ID else [t.id]   # sd.cpp: one <unk> per character
        return out

    def encode(self, text: str, max_length: int | None = None, pad: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask), HF semantics; see the module docstring."""
        return self.finish(self.tokenize(text), max_length, pad)

    @staticmethod
    def finish(pieces: list[int], max_length: int | None = None, pad: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Piece ids -> (ids + `</s>`, cut to max_length, optionally padded; mask)."""
        if max_length is not None and max_length < 1:
            raise UsageError(f"T5 max_length must be >= 1, got {max_length}")
        if pad and max_length is None:
            raise UsageError("T5 padding needs a max_length")
        body = list(pieces) if max_length is None else list(pieces)[:max_length - 1]
        ids = np.asarray(body + [EOS_ID], np.int32)
        mask = np.ones(len(ids), np.int32)
        if pad and len(ids) < max_length:
            n = max_length - len(ids)
            ids = np.concatenate([ids, np.full(n, PAD_ID, np.int32)])
            mask = np.concatenate([mask, np.zeros(n, np.int32)])
        return ids, mask

    @staticmethod
    def pad_chunks(pieces, chunk_len: int, weights=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """sd.cpp's pad_tokens with min = max = chunk_len and overflow expansion: (ids int32,
        weights float32, mask int32), each a multiple of chunk_len long."""
        if chunk_len < 2:
            raise UsageError(f"T5 chunk length must be >= 2, got {chunk_len}")
        pieces = np.asarray(pieces, np.int32).reshape(-1)
        w = np.ones(len(pieces), np.float32) if weights is None else np.asarray(weights, np.float32).reshape(-1)
        if len(w) != len(pieces):
            raise UsageError(f"{len(w)} weights for {len(pieces)} T5 tokens")
        per = chunk_len - 1
        n_chunks = max(1, -(-len(pieces) // per))
        ids = np.full((n_chunks, chunk_len), PAD_ID, np.int32)
        wts = np.ones((n_chunks, chunk_len), np.float32)
        mask = np.zeros((n_chunks, chunk_len), np.int32)
        for c in range(n_chunks):
            seg = slice(c * per, min((c + 1) * per, len(pieces)))
            n = seg.stop - seg.start
            ids[c, :n], wts[c, :n] = pieces[seg], w[seg]
            ids[c, n] = EOS_ID
            mask[c, :n + 1] = 1
        return ids.reshape(-1), wts.reshape(-1), mask.reshape(-1)
