"""Goldens for the Qwen tokenizer and the Qwen3 / Qwen2.5 LLM text encoder (needs torch +
transformers; the tests do not).

    python tools/make_qwen_goldens.py             # both fixtures
    python tools/make_qwen_goldens.py tokenizer   # tests/fixtures/qwen_tokenizer_ids.npz
    python tools/make_qwen_goldens.py llm         # tests/fixtures/qwen_llm.npz

tokenizer: the 1,200 prompts of tests/qwen_prompt_gen.py, their ids from transformers'
AutoTokenizer over a Qwen tokenizer folder written from the merges sdrt ships (vocab.json with
the byte symbols and one token per merge, merges.txt, tokenizer_config.json naming
Qwen2Tokenizer and the added tokens with Qwen3's ids): transformers builds its own normalizer,
pre-tokenizer and BPE from those files, so the ids are HF's, independent of how
sdrt.models.te.qwen_tokenizer builds its pipeline.

llm: random transformers Qwen3Model (q/k RMS norm, no qkv bias) and Qwen2Model (qkv bias, the text
stack of Qwen2.5-VL) at small widths (head_dim 32, GQA 4:2, 3 layers), weights rounded to float16
values and stored under the names sd.cpp reads (`model.` + HF names, as in a Qwen3-4B
safetensors file), with all hidden states (embeddings, each layer, the final norm) for a batch of
id sequences.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def hf_tokenizer_folder(d: str) -> str:
    from sdrt.models.te.qwen_tokenizer import SPECIAL_TOKENS, _read_merges, _vocab_from_merges, merges_path
    merges = _read_merges(merges_path())
    vocab = _vocab_from_merges(merges)
    with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    added = {str(151643 + i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                               "single_word": False, "special": i < 22}
             for i, t in enumerate(SPECIAL_TOKENS)}
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "bos_token": None,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "model_max_length": 131072, "clean_up_tokenization_spaces": False, "errors": "replace",
           "split_special_tokens": False, "add_prefix_space": False}
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False)
    return d


def make_tokenizer():
    from transformers import AutoTokenizer

    from qwen_prompt_gen import qwen_prompts
    prompts = qwen_prompts()
    with tempfile.TemporaryDirectory() as d:
        hf = AutoTokenizer.from_pretrained(hf_tokenizer_folder(d))
        print("HF tokenizer:", type(hf).__name__, "vocab", len(hf))
        ids = [hf(p, add_special_tokens=False)["input_ids"] for p in prompts]
    lengths = np.array([len(i) for i in ids], np.int32)
    flat = np.array([t for i in ids for t in i], np.int32)
    np.savez_compressed(os.path.join(FIX, "qwen_tokenizer_ids.npz"), ids=flat, lengths=lengths)
    from sdrt.models.te.qwen_tokenizer import QwenTokenizer
    ours = QwenTokenizer().encode_batch(prompts)
    bad = sum(a != b for a, b in zip(ours, ids))
    print(f"{len(prompts)} prompts, {flat.size} ids, max length {lengths.max()}; sdrt differs on {bad}")


LLM_CFG = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
               rope_theta=1000000.0, max_position_embeddings=40960, attention_dropout=0.0,
               tie_word_embeddings=False)


def _round_f16(model):
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))


def make_llm():
    import torch
    from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, 512, (2, 19)).astype(np.int64)
    seqs[:, :3] = [3, 72, 198]
    out = {"ids": seqs.astype(np.int32)}
    for arch, cfg_cls, model_cls in (("qwen3", Qwen3Config, Qwen3Model), ("qwen2", Qwen2Config, Qwen2Model)):
        kw = dict(LLM_CFG)
        if arch == "qwen2":
            kw.pop("head_dim")                              # Qwen2: head_dim = hidden / heads
            kw.update(hidden_size=128, rms_norm_eps=1e-6)
        cfg = cfg_cls(**kw)
        cfg._attn_implementation = "eager"
        m = model_cls(cfg).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
        _round_f16(m)
        with torch.no_grad():
            r = m(input_ids=torch.from_numpy(seqs), output_hidden_states=True)
        hs = torch.stack(r.hidden_states).numpy()          # [layers+1, N, L, C]; last = final norm
        out[f"{arch}_hidden"] = hs.astype(np.float32)
        for name, p in m.state_dict().items():
            if name == "rotary_emb.inv_freq" or name.endswith(".inv_freq"):
                continue
            out[f"{arch}/model.{name}"] = p.numpy().astype(np.float16)
        print(arch, "layers", cfg.num_hidden_layers, "hidden", cfg.hidden_size, "head_dim",
              getattr(cfg, "head_dim", None), "hs", hs.shape)
    np.savez_compressed(os.path.join(FIX, "qwen_llm.npz"), **out)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("all", "tokenizer"):
        make_tokenizer()
    if what in ("all", "llm"):
        make_llm()
