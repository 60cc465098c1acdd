"""Goldens for the T5 encoder and tokenizer (needs torch + transformers; the tests do not).

    python tools/make_t5_goldens.py            # both fixtures
    python tools/make_t5_goldens.py encoder    # tests/fixtures/t5_encoder.npz
    python tools/make_t5_goldens.py fullwidth  # T5-XXL widths, 2 blocks, vs transformers (prints)
    python tools/make_t5_goldens.py tokenizer [--sdist stable_diffusion_cpp_python-0.4.7.tar.gz]
                                               # tests/fixtures/t5_tokenizer_ids.npz

encoder: a random transformers.T5EncoderModel (T5 v1.1 layout: gated-gelu FFN, d_kv 64, the
real key names, small width and depth), its weights rounded to float16 values (so the fixture is
small and the F16 path is exact), hidden states of several id sequences (one batch with an
attention mask), and HF's relative-position buckets for distances -2048..2048.

tokenizer: >= 1,000 prompts made deterministically by `t5_prompts` (in tests/t5_prompt_gen.py,
shared with the test), their ids from transformers' T5TokenizerFast over the tokenizer.json
sdrt ships (the file diffusers' Flux/SD3 `tokenizer_2` folders carry), plus the ids of
sentencepiece's own SentencePieceProcessor over a spiece.model rebuilt from the same vocabulary
(reported, not stored: HF's fast tokenizer and sentencepiece differ on trailing whitespace),
and the ids of stable-diffusion.cpp's own T5UniGramTokenizer::encode: its sources from the
stable-diffusion-cpp-python sdist (downloaded with pip unless --sdist is given) are compiled with
g++ into a small harness (SDCPP_MAIN below; logging stubbed, the vocabulary read from the same
tokenizer.json) and run over the prompts.
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


SDCPP_MAIN = r'''
// prompts separated by \x1e on stdin -> one line of ids per prompt (sd.cpp's encode, no </s>)
#include "tokenizers/t5_unigram_tokenizer.h"
#include <iostream>
#include <iterator>
int main() {
    T5UniGramTokenizer tok(false);
    std::string all((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    for (size_t start = 0, end; (end = all.find('\x1e', start)) != std::string::npos; start = end + 1) {
        std::vector<int> ids = tok.encode(all.substr(start, end - start));
        for (size_t i = 0; i < ids.size(); i++) std::cout << (i ? " " : "") << ids[i];
        std::cout << "\n";
    }
}
'''
SDCPP_STUBS = {
    "util.h": r'''#pragma once
#include <cstdio>
#include <string>
#define LOG_DEBUG(...) do {} while (0)
#define LOG_INFO(...) do {} while (0)
#define LOG_WARN(...) do {} while (0)
#define LOG_ERROR(...) do { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } while (0)
inline bool ends_with(const std::string& s, const std::string& x) {
    return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0; }
inline bool starts_with(const std::string& s, const std::string& x) { return s.rfind(x, 0) == 0; }
inline std::string trim(const std::string& s) {
    size_t a = s.find_first_not_of(" \t\n\r\f\v");
    if (a == std::string::npos) return "";
    return s.substr(a, s.find_last_not_of(" \t\n\r\f\v") - a + 1); }
''',
    "vocab_stub.cpp": r'''#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
std::string load_t5_tokenizer_json() {
    std::ifstream f(std::getenv("T5_JSON")); std::stringstream s; s << f.rdbuf(); return s.str(); }
std::string load_umt5_tokenizer_json() { return "{}"; }
std::string load_clip_merges() { return ""; }
std::string load_qwen2_merges() { return ""; }
std::string load_mistral_merges() { return ""; }
std::string load_mistral_vocab_json() { return ""; }
''',
}


def sdcpp_ids(prompts, tokenizer_json_path: str, sdist: str | None, tmp: str) -> list[list[int]]:
    """sd.cpp's T5UniGramTokenizer::encode ids, from its sources compiled here."""
    import subprocess
    import tarfile

    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "stable-diffusion-cpp-python==0.4.7", "-d", tmp], check=True)
        sdist = os.path.join(tmp, "stable_diffusion_cpp_python-0.4.7.tar.gz")
    with tarfile.open(sdist) as tf:
        want = [m for m in tf.getmembers() if "/vendor/stable-diffusion.cpp/src/tokenizers/" in m.name
                and not m.name.endswith(".hpp") or m.name.endswith(("thirdparty/json.hpp", "thirdparty/darts.h"))]
        tf.extractall(tmp, members=want, filter="data")
    root = os.path.join(tmp, os.path.basename(sdist)[:-len(".tar.gz")], "vendor", "stable-diffusion.cpp")
    os.makedirs(os.path.join(tmp, "stub"), exist_ok=True)
    for name, text in SDCPP_STUBS.items():
        with open(os.path.join(tmp, "stub" if name.endswith(".h") else "", name), "w") as f:
            f.write(text)
    with open(os.path.join(tmp, "main.cpp"), "w") as f:
        f.write(SDCPP_MAIN)
    exe = os.path.join(tmp, "t5tok")
    src = os.path.join(root, "src", "tokenizers")
    subprocess.run(["g++", "-O1", "-std=c++17", "-I" + os.path.join(tmp, "stub"), "-I" + os.path.join(root, "src"),
                    "-I" + os.path.join(root, "thirdparty"), "-o", exe, os.path.join(tmp, "main.cpp"),
                    os.path.join(tmp, "vocab_stub.cpp")] + [os.path.join(src, n) for n in
                   ("t5_unigram_tokenizer.cpp", "tokenizer.cpp", "tokenize_util.cpp")], check=True)
    out = subprocess.run([exe], input="".join(p + "\x1e" for p in prompts).encode("utf-8"), check=True,
                         capture_output=True, env={**os.environ, "T5_JSON": tokenizer_json_path}).stdout
    lines = out.decode().split("\n")[:-1]
    assert len(lines) == len(prompts)
    return [[int(x) for x in line.split()] for line in lines]


def make_tokenizer(sdist: str | None = None):
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
        sdids = sdcpp_ids(prompts, os.path.join(tmp, "tokenizer.json"), sdist, tmp)
    same = sum(a == b for a, b in zip(ids, spids))
    diff = [i for i, (a, b) in enumerate(zip(ids, spids)) if a != b]
    print(f"{len(prompts)} prompts, {sum(map(len, ids))} ids; sentencepiece agrees on {same}")
    for i in diff[:5]:
        print(f"  differs: {prompts[i]!r}")
    print(f"sd.cpp's tokenizer agrees with HF on {sum(a[:-1] == b for a, b in zip(ids, sdids))}")
    lengths = np.array([len(x) for x in ids], np.int32)
    flat = np.concatenate([np.asarray(x, np.int32) for x in ids])
    sd_lengths = np.array([len(x) for x in sdids], np.int32)
    sd_flat = np.concatenate([np.asarray(x, np.int32) for x in sdids])
    path = os.path.join(FIX, "t5_tokenizer_ids.npz")
    np.savez_compressed(path, lengths=lengths, ids=flat.astype(np.uint16),
                        sdcpp_lengths=sd_lengths, sdcpp_ids=sd_flat.astype(np.uint16),
                        sp_agrees=np.array([a == b for a, b in zip(ids, spids)]))
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def check_full_width(layers: int = 2):
    """T5-XXL's real widths (d_model 4096, 64 heads, d_ff 10240, vocab 32128) at reduced depth,
    HF's own random init, f32: sdrt against transformers on real prompts (printed, no fixture:
    ~1.9 GB of weights per 2 blocks, shared between the two)."""
    import time

    import torch
    from transformers import T5Config, T5EncoderModel

    from sdrt.models.te.t5 import T5Encoder
    from sdrt.models.te.t5_tokenizer import T5Tokenizer
    from sdrt.ops.tensor import Tensor

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers, num_heads=64,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False)
    model = T5EncoderModel(cfg).eval()
    table = {k: Tensor.from_numpy(v.detach().numpy(), name=k) for k, v in model.state_dict().items()}
    enc = T5Encoder(table, "")
    tok = T5Tokenizer()
    prompts = ["a lovely cat", "A photo of an astronaut riding a horse on the moon, cinematic lighting, 8k",
               "x " * 300]
    for p in prompts:
        for max_len, use_mask in ((256, False), (512, True)):
            ids, mask = tok.encode(p, max_length=max_len, pad=True)
            with torch.no_grad():
                kw = {"attention_mask": torch.from_numpy(mask[None].astype(np.int64))} if use_mask else {}
                t0 = time.perf_counter()
                ref = model(input_ids=torch.from_numpy(ids[None].astype(np.int64)), **kw).last_hidden_state.numpy()
                t1 = time.perf_counter()
            h = enc.run(ids[None], mask[None] if use_mask else None)
            t2 = time.perf_counter()
            print(f"{layers} blocks, {p[:24]!r:28} L={max_len} mask={use_mask}: max-abs {np.abs(h - ref).max():.2e} "
                  f"at max |ref| {np.abs(ref).max():.2f} (torch {t1 - t0:.1f} s, sdrt {t2 - t1:.1f} s)")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", default=["encoder", "tokenizer"])
    ap.add_argument("--sdist", help="stable_diffusion_cpp_python-0.4.7.tar.gz (else pip downloads it)")
    a = ap.parse_args()
    if "encoder" in a.what:
        make_encoder()
    if "tokenizer" in a.what:
        make_tokenizer(a.sdist)
    if "fullwidth" in a.what:
        check_full_width()
