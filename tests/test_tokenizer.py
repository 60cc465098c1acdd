"""CLIP BPE tokenizer against stable-diffusion.cpp's CLIPTokenizer and transformers' CLIPTokenizer.

Goldens: tools/make_clip_goldens.py -> tests/fixtures/clip_tokenizer.npz (sd.cpp ids from its own
code through a C++ harness; transformers ids from a CLIPTokenizer built from the shipped vocab)."""
import json
import os

import numpy as np
import pytest

from sdrt import UsageError
from sdrt.models.te.tokenizer import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    CLIPTokenizer,
    vocab_path,
)

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def gold():
    return json.loads(str(np.load(os.path.join(FIX, "clip_tokenizer.npz"))["data"]))


@pytest.fixture(scope="module")
def tok():
    return CLIPTokenizer()


def test_vocabulary_is_shipped_with_its_license(tok):
    assert os.path.isfile(vocab_path())
    assert os.path.isfile(os.path.join(os.path.dirname(vocab_path()), "LICENSE"))
    assert len(tok.vocab) == VOCAB_SIZE == 49408
    assert tok.encoder["<|startoftext|>"] == BOS_ID and tok.encoder["<|endoftext|>"] == EOS_ID
    assert tok.vocab[256] == "!</w>" and tok.vocab[512] == "in"     # first merge 'i n'


def test_matches_stable_diffusion_cpp(gold, tok):
    assert len(gold["prompts"]) >= 25
    for p, ids in zip(gold["prompts"], gold["sdcpp_encode"]):
        assert tok.encode(p) == ids, p


def test_hf_style_matches_transformers(gold):
    t = CLIPTokenizer(style="hf")
    for p, ids in zip(gold["prompts"], gold["hf"]):
        assert t.encode(p) == ids, p


def test_styles_agree_on_ascii(gold, tok):
    t = CLIPTokenizer(style="hf")
    n = 0
    for p in gold["prompts"]:
        if p.isascii():
            assert tok.encode(p) == t.encode(p), p
            n += 1
    assert n >= 15


def test_unicode_differences_are_sdcpp_s(tok):
    # sd.cpp's std::regex classes are ASCII: a non-ASCII letter joins a punctuation run, and
    # only ASCII is lowercased; transformers splits on Unicode letters and lowercases all
    hf = CLIPTokenizer(style="hf")
    assert tok.decode(tok.encode("café")) == "caf é"
    assert hf.decode(hf.encode("CAFÉ")) == "café"
    assert tok.encode("CAFÉ") != hf.encode("CAFÉ")


def test_decode_round_trip(tok):
    ids = tok.encode("A photo of a cat, 4k, highly-detailed!")
    assert tok.decode([BOS_ID] + ids + [EOS_ID, EOS_ID]) == "a photo of a cat, 4 k, highly - detailed !"


def test_special_tokens_and_hook(tok):
    t = CLIPTokenizer()
    t.add_special_token("myemb")
    seen = []

    def hook(piece):
        seen.append(piece)
        return [VOCAB_SIZE, VOCAB_SIZE + 1] if piece == "myemb" else None

    ids = t.encode("A MyEmb-style<|endoftext|>photo", hook)
    assert ids[1:3] == [VOCAB_SIZE, VOCAB_SIZE + 1] and EOS_ID in ids
    assert "myemb" in seen and "photo" in seen
    assert t.encode("xmyembx", hook) == tok.encode("x") + [VOCAB_SIZE, VOCAB_SIZE + 1] + tok.encode("x")
    # a name whose embedding was refused (hook returns None) is tokenized as text
    assert t.encode("myemb") == tok.encode("myemb")


def test_bad_style_is_a_usage_error():
    with pytest.raises(UsageError, match="style"):
        CLIPTokenizer(style="ftfy")


def test_long_text_is_fast(tok):
    import time
    text = "the quick brown fox jumps over the lazy dog, " * 200
    t0 = time.perf_counter()
    ids = tok.encode(text)
    assert len(ids) == 2000 and time.perf_counter() - t0 < 2.0
