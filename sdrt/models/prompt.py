"""Prompt text -> weighted CLIP token chunks, as stable-diffusion.cpp does for SD1/SD2/SDXL.

`parse_prompt_attention(text)` is sd.cpp's port of sd-webui's attention syntax:
    (abc)      weight x 1.1          ((abc)) x 1.21, and so on
    (abc:1.3)  weight x 1.3          [abc]   weight / 1.1
    BREAK      pads the current 75-token chunk (returned as ("BREAK", -1.0))
    \\(         a literal "("
Unbalanced brackets close at the end of the text; pieces with equal weights are merged.
Weights are float32 products, bit for bit what sd.cpp computes. Like sd.cpp's code (not its doc
comment), only `\\(` loses its backslash: `\\)`, `\\[`, `\\]`, `\\\\` stay as typed, so they
reach the tokenizer with the backslash and never act as brackets.

`tokenize_weighted(text, tokenizer)` turns the parsed pieces into ids and per-token weights and
cuts them into chunks of 77 = BOS + 75 tokens + EOS, padded with the tokenizer's pad id (sd.cpp:
a plain cut every 75 tokens, no search for a comma; BREAK pads with EOS up to the next multiple
of 75). A prompt of at most 75 tokens is one chunk.

`apply_token_weights(hidden, weights)` is sd.cpp's emphasis: multiply each token's hidden state
by its weight, then rescale the chunk so its mean equals the mean before weighting.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from ..errors import UsageError

__all__ = ["BREAK", "CHUNK_LEN", "apply_token_weights", "parse_prompt_attention", "tokenize_weighted"]

CHUNK_LEN = 77
BREAK = ("BREAK", -1.0)
_ROUND = np.float32(1.1)
_SQUARE = np.float32(1) / np.float32(1.1)
# sd.cpp's std::regex (ECMAScript: \d and \b are ASCII), tried on each remaining suffix in turn
_RE_ATTENTION = re.compile(r"\\\(|\\\)|\\\[|\\\]|\\\\|\\|\(|\[|:([+-]?[.\d]+)\)|\)|\]|\bBREAK\b|"
                           r"[^\\()\[\]:B]+|:|\bB", re.ASCII)
_RE_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.ASCII)
_RE_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)", re.ASCII)


def _stof(s: str, text: str) -> np.float32:
    """std::stof: the longest leading number; sd.cpp aborts on none, we raise UsageError."""
    m = _RE_FLOAT.match(s)
    if m is None:
        raise UsageError(f"prompt {text!r}: attention weight ':{s})' is not a number")
    return np.float32(m.group(0))


def parse_prompt_attention(text: str) -> list[tuple[str, float]]:
    """[(text, weight)] of a prompt; BREAK comes back as ("BREAK", -1.0)."""
    res: list[list] = []
    round_b: list[int] = []
    square_b: list[int] = []

    def multiply(start: int, m: np.float32):
        for p in range(start, len(res)):
            res[p][1] = np.float32(res[p][1] * m)

    rest = text
    while True:
        m = _RE_ATTENTION.search(rest)
        if m is None:
            break
        tok, weight = m.group(0), m.group(1)
        if tok == "(":
            round_b.append(len(res))
        elif tok == "[":
            square_b.append(len(res))
        elif weight is not None:
            if round_b:
                multiply(round_b.pop(), _stof(weight, text))
        elif tok == ")" and round_b:
            multiply(round_b.pop(), _ROUND)
        elif tok == "]" and square_b:
            multiply(square_b.pop(), _SQUARE)
        elif tok == "\\(":
            res.append([tok[1:], np.float32(1.0)])
        elif _RE_BREAK.search(tok):
            res.append(["BREAK", np.float32(-1.0)])
        else:
            res.append([tok, np.float32(1.0)])
        rest = rest[m.end():]
        if not rest:
            break
    for p in round_b:
        multiply(p, _ROUND)
    for p in square_b:
        multiply(p, _SQUARE)
    if not res:
        res.append(["", np.float32(1.0)])
    out: list[list] = [res[0]]
    for piece in res[1:]:
        if piece[1] == out[-1][1]:
            out[-1][0] += piece[0]
        else:
            out.append(piece)
    return [(s, float(w)) for s, w in out]


def tokenize_weighted(text: str, tokenizer, on_token: Callable[[str], list[int] | None] | None = None,
                      chunk_len: int = CHUNK_LEN) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [k*chunk_len], weights float32 [k*chunk_len]): every chunk is BOS, up to
    chunk_len-2 tokens, EOS, then the tokenizer's pad id; BOS/EOS/pad weigh 1."""
    per = chunk_len - 2
    ids: list[int] = []
    weights: list[float] = []
    for piece, w in parse_prompt_attention(text):
        if piece == "BREAK" and w == -1.0:
            pad = (per - len(ids) % per) % per
            ids += [tokenizer.eos_id] * pad
            weights += [1.0] * pad
            continue
        got = tokenizer.encode(piece, on_token)
        ids += got
        weights += [w] * len(got)
    n = len(ids)
    starts = [0] if n + 2 <= chunk_len else list(range(0, n, per))
    out_ids = np.full(len(starts) * chunk_len, tokenizer.pad_id, np.int32)
    out_w = np.ones(len(starts) * chunk_len, np.float32)
    for c, s in enumerate(starts):
        take = min(per, n - s)
        o = c * chunk_len
        out_ids[o] = tokenizer.bos_id
        out_ids[o + 1:o + 1 + take] = ids[s:s + take]
        out_w[o + 1:o + 1 + take] = weights[s:s + take]
        out_ids[o + 1 + take] = tokenizer.eos_id
    return out_ids, out_w


def apply_token_weights(hidden: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sd.cpp's apply_token_weights on one chunk: hidden [L, C] float32, weights [L].
    h *= w per token, then h *= mean_before / mean_after (means in float64, cast to float32)."""
    h = np.asarray(hidden, np.float32)
    w = np.asarray(weights, np.float32).reshape(-1, 1)
    if h.shape[0] != w.shape[0]:
        raise UsageError(f"apply_token_weights: {h.shape[0]} tokens but {w.shape[0]} weights")
    before = np.float32(h.mean(dtype=np.float64))
    h = h * w
    after = np.float32(h.mean(dtype=np.float64))
    if after != 0.0:
        h *= np.float32(before / after)
    return h
