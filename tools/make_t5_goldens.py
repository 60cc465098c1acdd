"""Goldens for the T5 encoder and tokenizer (needs torch + transformers; the tests do not).

    python tools/make_t5_goldens.py            # both fixtures
    python tools/make_t5_goldens.py encoder    # tests/fixtures/t5_encoder.npz
    python tools/make_t5_goldens.py tokenizer  # tests/fixtures/t5_tokenizer_ids.npz

encoder: a random transformers.T5EncoderModel (T5 v1.1 layout: gated-gelu FFN, d_kv 64, the
real key names, small width and depth), its weights rounded to float16 values (so the fixture is
small and the F16 path is exact), hidden states of several id sequences (one batch with an
attention mask), and HF's relative-position buckets for distances -2048..2048.

tokenizer: >= 1,000 prompts made deterministically by `t5_prompts` (in tests/t5_prompt_gen.py,
shared with the test), their ids from transformers' T5TokenizerFast over the tokenizer.json
sdrt ships (the file diffusers' Flux/SD3 `tokenizer_2` folders carry), plus the ids of
sentencepiece's own SentencePieceProcessor over a spiece.model rebuilt from the same vocabulary
(reported, not stored: HF's fast tokenizer and sentencepiece differ on trailing whitespace).
"""
from __future__ import annotations

import gzip
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

CFG = dict(vocab_size=256, d_model=128, d_kv=64, d_ff=160, num_layers=2, num_heads=2,
           relative_attention_num_buckets=32, relative_attention_max_distance=128,
           feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
           tie_word_embeddings=False)


def make_encoder():
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(1234)
    model = T5EncoderModel(T5Config(**CFG)).eval()
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                v = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            elif "relative_attention_bias" in name:
                v = 2.0 * torch.randn(p.shape, generator=g)        # large enough to matter
            elif name in ("shared.weight", "encoder.embed_tokens.weight"):
                v = torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
            p.copy_(v.half().float())
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    sd.pop("encoder.embed_tokens.weight", None)                     # tied to shared.weight

    rng = np.random.default_rng(5)
    out = {f"w/{k}": v.astype(np.float16) for k, v in sd.items()}
    cases = {"len1": (rng.integers(0, 256, (1, 1)), None),
             "len7": (rng.integers(0, 256, (1, 7)), None),
             "len77": (rng.integers(0, 256, (1, 77)), None),
             "len300": (rng.integers(0, 256, (1, 300)), None)}
    ids = rng.integers(0, 256, (2, 40))
    mask = np.ones((2, 40), np.int64)
    mask[0, 25:] = 0
    mask[1, 33:] = 0
    cases["batch_mask"] = (ids, mask)
    with torch.no_grad():
        for name, (i, m) in cases.items():
            kw = {} if m is None else {"attention_mask": torch.from_numpy(m)}
            h = model(input_ids=torch.from_numpy(i), **kw).last_hidden_state.numpy()
            out[f"ids/{name}"] = i.astype(np.int32)
            if m is not None:
                out[f"mask/{name}"] = m.astype(np.int8)
            out[f"hidden/{name}"] = h.astype(np.float32)
        rel = torch.arange(-2048, 2049)
        from transformers.models.t5.modeling_t5 import T5Attention
        out["buckets"] = T5Attention._relative_position_bucket(rel, True, 32, 128).numpy().astype(np.int32)
    path = os.path.join(FIX, "t5_encoder.npz")
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def make_spiece(tokenizer_json: dict, path: str) -> None:
    """A spiece.model with the vocabulary, scores and normalizer charsmap of a T5 tokenizer.json."""
    import base64

    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    for i, (piece, score) in enumerate(tokenizer_json["model"]["vocab"]):
        if piece.startswith("<extra_id_"):
            continue                     # HF adds these on top of the 32000 pieces
        sp = m.pieces.add()
        sp.piece, sp.score = piece, score
        sp.type = {0: pb.ModelProto.SentencePiece.CONTROL, 1: pb.ModelProto.SentencePiece.CONTROL,
                   2: pb.ModelProto.SentencePiece.UNKNOWN}.get(i, pb.ModelProto.SentencePiece.NORMAL)
    m.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 2, -1, 1, 0
    charsmap = next(n for n in tokenizer_json["normalizer"]["normalizers"] if n["type"] == "Precompiled")
    m.normalizer_spec.name = "nmt_nfkc"
    m.normalizer_spec.precompiled_charsmap = base64.b64decode(charsmap["precompiled_charsmap"])
    m.normalizer_spec.add_dummy_prefix = True
    m.normalizer_spec.remove_extra_whitespaces = True
    m.normalizer_spec.escape_whitespaces = True
    with open(path, "wb") as f:
        f.write(m.SerializeToString())


def make_tokenizer():
    import json
    import tempfile

    import sentencepiece as spm
    from transformers import T5TokenizerFast

    from sdrt.models.te.t5_tokenizer import vocab_path
    from t5_prompt_gen import t5_prompts

    prompts = t5_prompts()
    with gzip.open(vocab_path(), "rt", encoding="utf-8") as f:
        tj = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tj, f, ensure_ascii=False)
        hf = T5TokenizerFast(tokenizer_file=os.path.join(tmp, "tokenizer.json"))
        make_spiece(tj, os.path.join(tmp, "spiece.model"))
        sp = spm.SentencePieceProcessor(model_file=os.path.join(tmp, "spiece.model"))
        ids = [hf(p).input_ids for p in prompts]
        spids = [sp.encode(p) + [1] for p in prompts]
    same = sum(a == b for a, b in zip(ids, spids))
    diff = [i for i, (a, b) in enumerate(zip(ids, spids)) if a != b]
    print(f"{len(prompts)} prompts, {sum(map(len, ids))} ids; sentencepiece agrees on {same}")
    for i in diff[:5]:
        print(f"  differs: {prompts[i]!r}")
    lengths = np.array([len(x) for x in ids], np.int32)
    flat = np.concatenate([np.asarray(x, np.int32) for x in ids])
    path = os.path.join(FIX, "t5_tokenizer_ids.npz")
    np.savez_compressed(path, lengths=lengths, ids=flat.astype(np.uint16),
                        sp_agrees=np.array([a == b for a, b in zip(ids, spids)]))
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    what = sys.argv[1:] or ["encoder", "tokenizer"]
    if "encoder" in what:
        make_encoder()
    if "tokenizer" in what:
        make_tokenizer()
