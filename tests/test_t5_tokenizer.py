"""T5 tokenizer (sdrt.models.te.t5_tokenizer) against Hugging Face's T5TokenizerFast and
stable-diffusion.cpp's T5UniGramTokenizer.

Fixture: tools/make_t5_goldens.py tokenizer -> tests/fixtures/t5_tokenizer_ids.npz, the ids HF
gives (with `</s>`) and the ids sd.cpp's own tokenizer code gives (compiled from the 0.4.7 sdist,
no `</s>`) for the 1,200 prompts of tests/t5_prompt_gen.py. No transformers needed here."""
import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.te.t5_tokenizer import CHUNK_LEN, EOS_ID, PAD_ID, T5Tokenizer, read_spiece_model, vocab_path
from t5_prompt_gen import t5_prompts

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def tok():
    return T5Tokenizer()


@pytest.fixture(scope="module")
def gold():
    d = np.load(os.path.join(FIX, "t5_tokenizer_ids.npz"))
    ids = np.split(d["ids"].astype(np.int32), np.cumsum(d["lengths"])[:-1])
    return t5_prompts(), ids


@pytest.fixture(scope="module")
def gold_sdcpp():
    d = np.load(os.path.join(FIX, "t5_tokenizer_ids.npz"))
    return np.split(d["sdcpp_ids"].astype(np.int32), np.cumsum(d["sdcpp_lengths"])[:-1])


def test_prompts_cover_what_they_claim(gold):
    prompts, ids = gold
    assert len(prompts) == len(ids) >= 1000
    assert sum(len(i) > 512 for i in ids) >= 40
    assert any(any(ord(c) > 0x1F000 for c in p) for p in prompts)          # emoji
    assert any("\t" in p or "\n" in p for p in prompts)
    assert any("  " in p for p in prompts)


def test_ids_match_hf_on_1200_prompts(tok, gold):
    prompts, ids = gold
    bad = [i for i, (p, want) in enumerate(zip(prompts, ids)) if not np.array_equal(tok.encode(p)[0], want)]
    assert not bad, f"{len(bad)} prompts differ, first {prompts[bad[0]]!r}"


def test_sdcpp_style_matches_sdcpp_on_1200_prompts(gold, gold_sdcpp):
    prompts, _ = gold
    sd = T5Tokenizer(style="sdcpp")
    bad = [i for i, (p, want) in enumerate(zip(prompts, gold_sdcpp)) if sd.tokenize(p) != want.tolist()]
    assert not bad, f"{len(bad)} prompts differ, first {prompts[bad[0]]!r}"


def test_styles_agree_on_plain_text_and_differ_where_documented(tok, gold, gold_sdcpp):
    prompts, ids = gold
    plain = [i for i, p in enumerate(prompts) if p and p == p.strip() and all(32 <= ord(c) < 127 for c in p)
             and "  " not in p and not any(t in p for t in ("<pad>", "</s>", "<unk>", "<extra_id_"))]
    assert len(plain) >= 30
    assert all(ids[i][:-1].tolist() == gold_sdcpp[i].tolist() for i in plain)
    sd = T5Tokenizer(style="sdcpp")
    assert sd.tokenize("") == [3] and tok.tokenize("") == []
    assert sd.tokenize("a cat ") == [3, 9, 1712] and tok.tokenize("a cat ") == [3, 9, 1712, 3]
    assert sd.tokenize("\t\t") == [3, 2, 2]                  # one <unk> per unknown character
    assert sd.tokenize("ﬁne") != tok.tokenize("ﬁne")          # no NFKC in sd.cpp
    with pytest.raises(UsageError, match="style"):
        T5Tokenizer(style="sentencepiece")


def test_batch_matches_single(tok, gold):
    prompts, ids = gold
    got = tok.tokenize_batch(prompts[:200])
    assert all(g + [EOS_ID] == w.tolist() for g, w in zip(got, ids[:200]))


def test_known_ids(tok):
    assert tok.tokenize("a cat") == [3, 9, 1712]
    assert tok.encode("")[0].tolist() == [EOS_ID]
    assert tok.vocab_size == 32100


def test_truncate_and_pad_like_hf(tok):
    pieces = tok.tokenize("a photo of a cat on the moon")
    ids, mask = tok.encode("a photo of a cat on the moon", max_length=4, pad=True)
    assert ids.tolist() == pieces[:3] + [EOS_ID] and mask.tolist() == [1, 1, 1, 1]
    ids, mask = tok.encode("a cat", max_length=8, pad=True)
    assert ids.tolist() == [3, 9, 1712, EOS_ID, 0, 0, 0, 0] and mask.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    ids, mask = tok.encode("a cat", max_length=8)
    assert ids.tolist() == [3, 9, 1712, EOS_ID]
    with pytest.raises(UsageError):
        tok.encode("a", pad=True)
    with pytest.raises(UsageError):
        tok.encode("a", max_length=0)


def test_pad_chunks_is_sdcpp_pad_tokens():
    ids, w, m = T5Tokenizer.pad_chunks([], 5)
    assert ids.tolist() == [EOS_ID, 0, 0, 0, 0] and m.tolist() == [1, 0, 0, 0, 0] and w.tolist() == [1] * 5
    ids, w, m = T5Tokenizer.pad_chunks([7, 8, 9, 10], 5, weights=[2, 2, 3, 3])     # exactly one chunk
    assert ids.tolist() == [7, 8, 9, 10, EOS_ID] and w.tolist() == [2, 2, 3, 3, 1] and m.tolist() == [1] * 5
    ids, w, m = T5Tokenizer.pad_chunks([7, 8, 9, 10, 11], 5, weights=[2, 2, 3, 3, 4])  # overflow: 2 chunks
    assert ids.tolist() == [7, 8, 9, 10, EOS_ID, 11, EOS_ID, PAD_ID, PAD_ID, PAD_ID]
    assert w.tolist() == [2, 2, 3, 3, 1, 4, 1, 1, 1, 1]
    assert m.tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert CHUNK_LEN == {"sd3": 77, "flux": 256, "chroma": 512}
    with pytest.raises(UsageError):
        T5Tokenizer.pad_chunks([1, 2], 5, weights=[1])


def test_spiece_model_and_folder_sources(tmp_path, tok, gold):
    """A spiece.model (written here as protobuf from the bundled vocabulary) and a diffusers
    folder's tokenizer_2/tokenizer.json give the same ids as the bundled file."""
    import base64
    import gzip
    import json
    import struct

    with gzip.open(vocab_path(), "rt", encoding="utf-8") as f:
        tj = json.load(f)

    def varint(n):
        out = b""
        while True:
            b, n = n & 0x7F, n >> 7
            out += bytes([b | (0x80 if n else 0)])
            if not n:
                return out

    def field(num, wt, payload):
        return varint(num << 3 | wt) + (varint(len(payload)) + payload if wt == 2 else payload)

    msg = b""
    for piece, score in tj["model"]["vocab"]:
        if not piece.startswith("<extra_id_"):
            msg += field(1, 2, field(1, 2, piece.encode()) + field(2, 5, struct.pack("<f", score)) + field(3, 0, varint(1)))
    charsmap = next(n for n in tj["normalizer"]["normalizers"] if n["type"] == "Precompiled")["precompiled_charsmap"]
    msg += field(3, 2, field(1, 2, b"nmt_nfkc") + field(2, 2, base64.b64decode(charsmap)))
    (tmp_path / "spiece.model").write_bytes(msg)
    pieces, cm = read_spiece_model(str(tmp_path / "spiece.model"))
    assert len(pieces) == 32000 and pieces[3][0] == "\u2581" and cm == base64.b64decode(charsmap)
    sp = T5Tokenizer(str(tmp_path / "spiece.model"))
    prompts, ids = gold
    for p, want in list(zip(prompts, ids))[::7]:
        assert np.array_equal(sp.encode(p)[0], want), p
    folder = tmp_path / "flux" / "tokenizer_2"
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    ft = T5Tokenizer(str(tmp_path / "flux"))
    assert ft.source.endswith("tokenizer.json") and ft.tokenize("a cat") == [3, 9, 1712]


def test_bad_sources(tmp_path):
    with pytest.raises(ModelFileError):
        T5Tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ModelFileError):
        T5Tokenizer(str(tmp_path))                     # empty folder
    (tmp_path / "spiece.model").write_bytes(b"\x0a\xff")
    with pytest.raises(ModelFileError):
        T5Tokenizer(str(tmp_path / "spiece.model"))
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(ModelFileError, match="unigram"):
        T5Tokenizer(str(tmp_path / "tokenizer.json"))
