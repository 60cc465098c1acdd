"""Qwen2 BPE tokenizer (sdrt.models.te.qwen_tokenizer) against Hugging Face's Qwen2Tokenizer.

Fixture: tools/make_qwen_goldens.py tokenizer -> tests/fixtures/qwen_tokenizer_ids.npz, the ids
transformers' AutoTokenizer gives (over vocab.json / merges.txt / tokenizer_config.json written
from the shipped merges) for the 1,200 prompts of tests/qwen_prompt_gen.py. No transformers here."""
import gzip
import hashlib
import json
import os

import numpy as np
import pytest

from qwen_prompt_gen import qwen_prompts
from sdrt import ModelFileError, UsageError
from sdrt.models.te.qwen_tokenizer import (ENDOFTEXT_ID, SPECIAL_TOKENS, ZIMAGE_TEMPLATE, PromptTemplate,
                                           QwenTokenizer, bytes_to_unicode, merges_path)

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def tok():
    return QwenTokenizer()


@pytest.fixture(scope="module")
def gold():
    d = np.load(os.path.join(FIX, "qwen_tokenizer_ids.npz"))
    return qwen_prompts(), np.split(d["ids"].astype(np.int32), np.cumsum(d["lengths"])[:-1])


def test_prompts_cover_what_they_claim(gold):
    prompts, ids = gold
    assert len(prompts) == len(ids) >= 1000
    cjk = sum(any("\u4e00" <= c <= "\u9fff" for c in p) for p in prompts)
    assert cjk >= 600                                        # Chinese-heavy half and more
    latin = sum(sum(c.isascii() for c in p) > 0.8 * len(p) > 0 for p in prompts)
    assert latin >= 250                                      # mostly-English prompts too
    assert any("<|im_start|>" in p for p in prompts) and any("\n" in p for p in prompts)
    assert any(ord(c) > 0x1F000 for p in prompts for c in p)           # emoji
    assert sum(len(i) > 500 for i in ids) >= 10


def test_ids_match_hf_on_1200_prompts(tok, gold):
    prompts, ids = gold
    got = tok.encode_batch(prompts)
    bad = [i for i, (g, want) in enumerate(zip(got, ids)) if not np.array_equal(g, want)]
    assert not bad, f"{len(bad)} prompts differ, first {prompts[bad[0]]!r}"
    assert tok.encode(prompts[5]) == got[5]                 # single and batch agree


def test_vocabulary_layout(tok):
    assert tok.vocab_size == 151643 + len(SPECIAL_TOKENS) == 151669
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>")] == \
        [ENDOFTEXT_ID, 151644, 151645, 151668]
    b2u = bytes_to_unicode()
    assert tok.token_to_id(b2u[ord("!")]) == 0 and tok.token_to_id(b2u[0]) == 188   # GPT-2's order
    with gzip.open(merges_path(), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest().startswith("599bab54")      # data/LICENSE.qwen


def test_known_ids_and_round_trip(tok):
    assert tok.encode("a cat <|im_end|>") == [64, 8251, 220, 151645]
    for text in ("一只可爱的猫，坐在窗台上。", "Hello, 世界! 123", "e\u0301 🐱\n\n"):
        assert tok.decode(tok.encode(text)) == __import__("unicodedata").normalize("NFC", text)
    assert tok.encode("12345") == [16, 17, 18, 19, 20]      # digits one by one


def test_zimage_template_as_sdcpp(tok):
    """sd.cpp's LLMEmbedder: template parts and each attention segment tokenized on their own,
    weights per token; an empty prompt gives the template alone."""
    ids, w = tok.encode_template(ZIMAGE_TEMPLATE, "a (red:1.5) cat")
    head, tail = tok.encode(ZIMAGE_TEMPLATE.prefix), tok.encode(ZIMAGE_TEMPLATE.suffix)
    assert head == [151644, 872, 198] and tail == [151645, 198, 151644, 77091, 198]
    body = tok.encode("a ") + tok.encode("red") + tok.encode(" cat")
    assert ids == head + body + tail
    assert w == [1.0] * (3 + 2) + [1.5] + [1.0] * (1 + 5)
    ids0, w0 = tok.encode_template(ZIMAGE_TEMPLATE, "")
    assert ids0 == head + tail and w0 == [1.0] * 8
    assert ZIMAGE_TEMPLATE.out_layer == 35 and ZIMAGE_TEMPLATE.drop == 0
    ids2, _ = tok.encode_template(PromptTemplate("", ""), "x")
    assert ids2 == tok.encode("x")


def test_model_folder_files(tmp_path, tok):
    """A model folder's vocab.json + merges.txt (or tokenizer.json) gives the same ids."""
    from sdrt.models.te.qwen_tokenizer import _read_merges, _vocab_from_merges
    merges = _read_merges(merges_path())
    d = tmp_path / "tokenizer"
    d.mkdir()
    (d / "vocab.json").write_text(json.dumps(_vocab_from_merges(merges), ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    t2 = QwenTokenizer(tmp_path)
    for text in qwen_prompts(60):
        assert t2.encode(text) == tok.encode(text)
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    assert QwenTokenizer(tmp_path / "tokenizer.json").encode("猫 cat") == tok.encode("猫 cat")


def test_bad_input(tmp_path, tok):
    with pytest.raises(UsageError, match="string"):
        tok.encode(None)
    with pytest.raises(ModelFileError, match="no tokenizer.json"):
        QwenTokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ModelFileError, match="not a readable Qwen tokenizer"):
        QwenTokenizer(tmp_path / "bad.json")
