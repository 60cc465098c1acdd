"""Goldens for the CLIP tokenizer, the prompt parser, the CLIP text models and the conditioner.

    python tools/make_clip_goldens.py [--sdcpp DIR]

Oracles (test tools only):
- stable-diffusion.cpp's own code: a small C++ harness (HARNESS below, compiled here against the
  sd.cpp tree's build/libstable-diffusion.a) prints, per prompt, parse_prompt_attention, the
  CLIPTokenizer ids and FrozenCLIPEmbedderWithCustomWords::tokenize (ids + weights) for SD1
  (pad 49407) and SD2 (pad 0), with a textual-inversion file in the embedding map.
- transformers' CLIPTokenizer built from vocab/merges that this script derives from the shipped
  bpe_simple_vocab_16e6.txt.gz (open_clip's SimpleTokenizer recipe), for the "hf" style.
- transformers' CLIPTextModel / CLIPTextModelWithProjection (eager attention, float32) on tiny
  configs of the real architectures; the conditioner is re-implemented in torch below (token
  weighting with the mean restored, SDXL's bigG ids, pooled output and size embeddings), fed
  with the ids/weights that sd.cpp's tokenizer gives.

Weights are not stored: every tensor is `offset + scale * det_uniform(seed, shape)`, a splitmix64
stream that numpy reproduces exactly anywhere (tests/test_te_clip.py has the same function);
the fixtures keep names, shapes, seeds, scales, inputs and outputs.

Writes tests/fixtures/clip_tokenizer.npz, clip_text_models.npz, clip_cond_{sd1,sd2,sdxl}.npz.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FIX = os.path.join(ROOT, "tests", "fixtures")
VOCAB = os.path.join(ROOT, "sdrt", "models", "te", "data", "bpe_simple_vocab_16e6.txt.gz")
SDCPP = "/work/sdcpp/stable_diffusion_cpp_python-0.4.7/vendor/stable-diffusion.cpp"
BOS, EOS, V = 49406, 49407, 49408

HARNESS = r"""
// stdin: one hex-encoded UTF-8 prompt per line ("-" = empty). argv: sd1|sd2, then name=path embeddings.
#include "conditioner.hpp"
#include <cstdio>
#include <iostream>
static std::string unhex(const std::string& h) {
    std::string s;
    if (h == "-") return s;
    for (size_t i = 0; i + 1 < h.size(); i += 2) s.push_back((char)std::stoi(h.substr(i, 2), nullptr, 16));
    return s;
}
static void hex(const std::string& s) {
    if (s.empty()) { printf("-"); return; }
    for (unsigned char c : s) printf("%02x", c);
}
int main(int argc, char** argv) {
    sd_set_log_callback([](sd_log_level_t, const char*, void*) {}, nullptr);
    std::map<std::string, std::string> emb;
    for (int i = 2; i < argc; i++) {
        std::string a = argv[i];
        auto p = a.find('=');
        emb[a.substr(0, p)] = a.substr(p + 1);
    }
    SDVersion ver = std::string(argv[1]) == "sd2" ? VERSION_SD2 : VERSION_SD1;
    FrozenCLIPEmbedderWithCustomWords cond(ggml_backend_cpu_init(), false, String2TensorStorage(), emb, ver);
    CLIPTokenizer tok(49407);
    std::string line;
    while (std::getline(std::cin, line)) {
        std::string text = unhex(line);
        auto parsed = parse_prompt_attention(text);
        printf("parse");
        for (auto& kv : parsed) { printf(" "); hex(kv.first); printf(" %.9g", kv.second); }
        printf("\nencode");
        for (int id : tok.encode(text)) printf(" %d", id);
        auto tw = cond.tokenize(text, 77, 77, true);
        printf("\ntokenize");
        for (size_t i = 0; i < tw.first.size(); i++) printf(" %d:%.9g", tw.first[i], tw.second[i]);
        printf("\n");
        fflush(stdout);
    }
    return 0;
}
"""

HARNESS_COND = r"""
// argv: model.safetensors sd1|sdxl out.bin; stdin lines "hexprompt clip_skip width height".
// Runs sd.cpp's FrozenCLIPEmbedderWithCustomWords::get_learned_condition; writes per prompt
// int64 n, n floats (c_crossattn), int64 m, m floats (c_vector).
#include "conditioner.hpp"
#include <cstdio>
#include <iostream>
#include <sstream>
int main(int argc, char** argv) {
    sd_set_log_callback([](sd_log_level_t l, const char* t, void*) { if (l >= SD_LOG_WARN) fputs(t, stderr); }, nullptr);
    ModelLoader loader;
    if (!loader.init_from_file(argv[1])) return 1;
    SDVersion ver = std::string(argv[2]) == "sdxl" ? VERSION_SDXL : VERSION_SD1;
    FrozenCLIPEmbedderWithCustomWords cond(ggml_backend_cpu_init(), false, loader.get_tensor_storage_map(),
                                           std::map<std::string, std::string>(), ver);
    cond.alloc_params_buffer();
    std::map<std::string, ggml_tensor*> tensors;
    cond.get_param_tensors(tensors);
    if (!loader.load_tensors(tensors)) return 2;
    FILE* f = fopen(argv[3], "wb");
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream ss(line);
        std::string h;
        ConditionerParams p;
        ss >> h >> p.clip_skip >> p.width >> p.height;
        for (size_t i = 0; h != "-" && i + 1 < h.size(); i += 2) p.text.push_back((char)std::stoi(h.substr(i, 2), nullptr, 16));
        p.adm_in_channels = 2816;
        SDCondition c = cond.get_learned_condition(2, p);
        for (auto* t : {&c.c_crossattn, &c.c_vector}) {
            int64_t n = t->empty() ? 0 : t->numel();
            fwrite(&n, 8, 1, f);
            if (n) fwrite(t->data(), 4, n, f);
        }
    }
    fclose(f);
    return 0;
}
"""

# ---- prompts ------------------------------------------------------------------------------------
TOKENIZER_PROMPTS = [
    "a photo of a cat", "A Photo Of A CAT", "", "   ", "  leading and trailing  ", "tabs\tand\nnewlines\r\nhere",
    "Hello, World!", "it's don't I'M we're they've I'll he'd y'all rock'n'roll ''quoted'' 'single'",
    "3.14159 1,000,000 $100 50% 2024-01-01 12:30 #1 No.7 ½ ² ⅓ ٣ 三", "C++ / C# -> x->y => a|b a&b a_b a~b",
    "café naïve résumé façade Ærøskøbing straße", "CAFÉ NAÏVE ΣΊΣΥΦΟΣ İSTANBUL ÉCOLE", "e\u0301 vs \u00e9 (combining accent)",
    "日本語のテキスト 中文 한국어", "Привет, мир! Ελληνικά", "مرحبا بالعالم עברית", "हिन्दी ภาษาไทย",
    "emoji 😀😃 🐱‍👤 👍🏽 🇯🇵 ❤️ ✨", "nbsp\u00a0ideographic\u3000em\u2003space", "zero\u200bwidth joiner\u200d",
    "<|startoftext|>hello<|endoftext|> world", "&amp; &lt;tag&gt; html", "\\(escaped\\) \\[brackets\\] back\\\\slash",
    "masterpiece, best quality, (ultra-detailed:1.2), 8k, RAW photo, 1girl, solo, looking_at_viewer",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "!!!???...,,,;;;:::",
    "The quick brown fox jumps over the lazy dog. " * 12,
    ("a painting of a majestic lion in the savanna at sunset, golden hour lighting, highly detailed, "
     "trending on artstation, by greg rutkowski and alphonse mucha, 4k wallpaper, volumetric fog"),
]
PARSE_PROMPTS = [
    "normal text", "an (important) word", "(unbalanced", "\\(literal\\]", "(unnecessary)(parens)",
    "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).", "((a:1.2), b) [c:1.3] \\\\ \\) :", "[[[deep]]] ((((up))))",
    "(x:0) (y:-1) (z:+.5) (w:1.2.3) (v:2.)", "a BREAK b", "xBREAK y BREAKfast BREAK", "BREAK BREAK start",
    "(weighted BREAK inside:1.5) end", "a:b c:(d) e]f[g h)i(j", "B b BB BRE BREAKB", "((mixed [nest] ing):0.7)",
    "word " * 80, "(long " + "words " * 80 + ":1.1) tail", "x, " * 40 + "BREAK " + "y " * 40, "", "   ",
]


def _read(path: str, gz: bool = False) -> bytes:
    with (gzip.open if gz else open)(path, "rb") as f:
        return f.read()


def hexs(s: str) -> str:
    return s.encode("utf-8").hex() or "-"


def build_harness(sdcpp: str, workdir: str, code: str = HARNESS, name: str = "harness") -> str:
    src = os.path.join(workdir, name + ".cpp")
    exe = os.path.join(workdir, name)
    with open(src, "w") as f:
        f.write(code)
    b = os.path.join(sdcpp, "build")
    libs = ["libstable-diffusion.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a",
            "thirdparty/libwebm/libwebm.a", "thirdparty/libwebp/libwebpmux.a", "thirdparty/libwebp/libwebp.a",
            "thirdparty/libwebp/libsharpyuv.a"]
    cmd = (["g++", "-std=c++17", "-O1", "-DGGML_MAX_NAME=128", "-DGGML_USE_CPU"]
           + [f"-I{os.path.join(sdcpp, d)}" for d in (".", "src", "include", "thirdparty", "ggml/include")]
           + [src, "-o", exe] + [os.path.join(b, lib) for lib in libs] + ["-lpthread", "-fopenmp"])
    subprocess.run(cmd, check=True, capture_output=True)
    return exe


def run_harness(exe: str, version: str, prompts: list[str], emb: dict[str, str] | None = None) -> list[dict]:
    args = [exe, version] + [f"{k}={v}" for k, v in (emb or {}).items()]
    inp = "".join(hexs(p) + "\n" for p in prompts)
    out = subprocess.run(args, input=inp.encode(), capture_output=True, check=True).stdout.decode().splitlines()
    out = [ln for ln in out if ln.startswith(("parse", "encode", "tokenize"))]   # drop progress bars
    res = []
    for i in range(len(prompts)):
        parse, enc, tok = (ln.split()[1:] for ln in out[3 * i:3 * i + 3])
        pairs = [(bytes.fromhex("" if parse[j] == "-" else parse[j]).decode("utf-8"), float(np.float32(parse[j + 1])))
                 for j in range(0, len(parse), 2)]
        tw = [t.split(":") for t in tok]
        res.append({"parse": pairs, "encode": [int(x) for x in enc],
                    "ids": [int(a) for a, _ in tw], "weights": [float(np.float32(b)) for _, b in tw]})
    return res


def hf_tokenizer():
    """transformers' CLIPTokenizer from vocab/merges derived as open_clip's SimpleTokenizer does."""
    from transformers import CLIPTokenizer
    merges = _read(VOCAB, gz=True).decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    merges = [tuple(m.split()) for m in merges]
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    syms = [chr(c) for c in cs]
    vocab = syms + [s + "</w>" for s in syms] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges)


# ---- deterministic weights -----------------------------------------------------------------------
def det_uniform(seed: int, shape) -> np.ndarray:
    """float32 in [-1, 1) from splitmix64 over arange: exact on every platform / numpy version."""
    n = int(np.prod(shape))
    off = ((seed & 0xFFFFFFFF) + 1) * 0x9E3779B97F4A7C15 % 2**64     # Python ints: no overflow warnings
    z = np.arange(n, dtype=np.uint64) + np.uint64(off)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)).reshape(shape)


class Spec:
    """name -> (shape, seed, offset, scale): the recipe the tests rebuild tensors from."""

    def __init__(self, base_seed: int):
        self.base, self.rows = base_seed, []

    def add(self, name, shape, offset, scale) -> np.ndarray:
        seed = (zlib.crc32(name.encode()) ^ self.base) & 0xFFFFFFFF
        self.rows.append((name, tuple(shape), seed, offset, scale))
        return np.float32(offset) + np.float32(scale) * det_uniform(seed, shape)

    def pack(self, key: str) -> dict:
        names = [r[0] for r in self.rows]
        shapes = np.zeros((len(names), 2), np.int64)
        for i, r in enumerate(self.rows):
            shapes[i, :len(r[1])] = r[1]
        return {f"{key}_names": np.array(names), f"{key}_shapes": shapes,
                f"{key}_ndim": np.array([len(r[1]) for r in self.rows]),
                f"{key}_seeds": np.array([r[2] for r in self.rows], np.uint64),
                f"{key}_offsets": np.array([r[3] for r in self.rows], np.float32),
                f"{key}_scales": np.array([r[4] for r in self.rows], np.float32)}


def hf_clip_weights(spec: Spec, prefix: str, C, layers, inter, vocab, proj=0) -> dict:
    """HF CLIP text names (no 'text_model.' prefix stripping) -> arrays, generated under `prefix`."""
    out = {}

    def add(k, shape, off, sc):
        out[k] = spec.add(prefix + k, shape, off, sc)

    add("text_model.embeddings.token_embedding.weight", (vocab, C), 0.0, 0.5)
    add("text_model.embeddings.position_embedding.weight", (77, C), 0.0, 0.2)
    for i in range(layers):
        p = f"text_model.encoder.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            add(p + f"self_attn.{n}.weight", (C, C), 0.0, 1.7 / np.sqrt(C))
            add(p + f"self_attn.{n}.bias", (C,), 0.0, 0.1)
        for n in ("layer_norm1", "layer_norm2"):
            add(p + f"{n}.weight", (C,), 1.0, 0.2)
            add(p + f"{n}.bias", (C,), 0.0, 0.1)
        add(p + "mlp.fc1.weight", (inter, C), 0.0, 1.7 / np.sqrt(C))
        add(p + "mlp.fc1.bias", (inter,), 0.0, 0.1)
        add(p + "mlp.fc2.weight", (C, inter), 0.0, 1.7 / np.sqrt(inter))
        add(p + "mlp.fc2.bias", (C,), 0.0, 0.1)
    add("text_model.final_layer_norm.weight", (C,), 1.0, 0.2)
    add("text_model.final_layer_norm.bias", (C,), 0.0, 0.1)
    if proj:
        add("text_projection.weight", (proj, C), 0.0, 1.7 / np.sqrt(C))
    return out


def open_clip_weights(spec: Spec, prefix: str, C, layers, inter, vocab, proj=0) -> tuple[dict, dict]:
    """OpenCLIP names under `prefix` (fused in_proj) -> (file arrays, HF-named arrays for torch).
    model.text_projection is stored as generated and given to HF's text_projection.weight as is,
    so HF computes x @ P^T: what sd.cpp computes from such a file."""
    f = {}

    def add(k, shape, off, sc):
        f[k] = spec.add(prefix + k, shape, off, sc)

    add("model.token_embedding.weight", (vocab, C), 0.0, 0.5)
    add("model.positional_embedding", (77, C), 0.0, 0.2)
    hf = {}
    for i in range(layers):
        p, q = f"model.transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}."
        add(p + "attn.in_proj_weight", (3 * C, C), 0.0, 1.7 / np.sqrt(C))
        add(p + "attn.in_proj_bias", (3 * C,), 0.0, 0.1)
        add(p + "attn.out_proj.weight", (C, C), 0.0, 1.7 / np.sqrt(C))
        add(p + "attn.out_proj.bias", (C,), 0.0, 0.1)
        for a, b in (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2")):
            add(p + f"{a}.weight", (C,), 1.0, 0.2)
            add(p + f"{a}.bias", (C,), 0.0, 0.1)
            hf[q + f"{b}.weight"], hf[q + f"{b}.bias"] = f[p + f"{a}.weight"], f[p + f"{a}.bias"]
        add(p + "mlp.c_fc.weight", (inter, C), 0.0, 1.7 / np.sqrt(C))
        add(p + "mlp.c_fc.bias", (inter,), 0.0, 0.1)
        add(p + "mlp.c_proj.weight", (C, inter), 0.0, 1.7 / np.sqrt(inter))
        add(p + "mlp.c_proj.bias", (C,), 0.0, 0.1)
        for j, n in enumerate(("q_proj", "k_proj", "v_proj")):
            hf[q + f"self_attn.{n}.weight"] = f[p + "attn.in_proj_weight"][j * C:(j + 1) * C]
            hf[q + f"self_attn.{n}.bias"] = f[p + "attn.in_proj_bias"][j * C:(j + 1) * C]
        hf[q + "self_attn.out_proj.weight"], hf[q + "self_attn.out_proj.bias"] = (
            f[p + "attn.out_proj.weight"], f[p + "attn.out_proj.bias"])
        hf[q + "mlp.fc1.weight"], hf[q + "mlp.fc1.bias"] = f[p + "mlp.c_fc.weight"], f[p + "mlp.c_fc.bias"]
        hf[q + "mlp.fc2.weight"], hf[q + "mlp.fc2.bias"] = f[p + "mlp.c_proj.weight"], f[p + "mlp.c_proj.bias"]
    add("model.ln_final.weight", (C,), 1.0, 0.2)
    add("model.ln_final.bias", (C,), 0.0, 0.1)
    hf["text_model.embeddings.token_embedding.weight"] = f["model.token_embedding.weight"]
    hf["text_model.embeddings.position_embedding.weight"] = f["model.positional_embedding"]
    hf["text_model.final_layer_norm.weight"] = f["model.ln_final.weight"]
    hf["text_model.final_layer_norm.bias"] = f["model.ln_final.bias"]
    if proj:
        add("model.text_projection", (C, proj), 0.0, 1.7 / np.sqrt(C))
        hf["text_projection.weight"] = f["model.text_projection"]
    return f, hf


def hf_model(sd: dict, C, layers, inter, heads, act, proj=0, extra_rows=None, bos=BOS, eos=EOS):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    sd = dict(sd)
    tok = sd["text_model.embeddings.token_embedding.weight"]
    if extra_rows is not None:
        tok = np.concatenate([tok, extra_rows])
        sd["text_model.embeddings.token_embedding.weight"] = tok
    cfg = CLIPTextConfig(vocab_size=tok.shape[0], hidden_size=C, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, layer_norm_eps=1e-5,
                         projection_dim=proj or C, bos_token_id=bos, eos_token_id=eos, pad_token_id=1,
                         attn_implementation="eager")
    m = (CLIPTextModelWithProjection if proj else CLIPTextModel)(cfg).eval()
    own = set(m.state_dict())           # transformers 5's CLIPTextModel has no 'text_model.' level
    sd = {(k if k in own else k.removeprefix("text_model.")): v for k, v in sd.items()}
    missing, unexpected = m.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                                            strict=False)
    assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
    return m


def _fln(m):
    return m.text_model.final_layer_norm if hasattr(m, "text_model") else m.final_layer_norm


def provenance(extra=None) -> np.ndarray:
    import transformers
    p = {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
         "tool": "tools/make_clip_goldens.py"}
    p.update(extra or {})
    return np.array(json.dumps(p))


# ---- tokenizer / parser goldens -------------------------------------------------------------------
def make_tokenizer_goldens(exe: str | None, sdcpp: str):
    import tokenizers
    tok = hf_tokenizer()
    hf = [tok(p, add_special_tokens=False).input_ids for p in TOKENIZER_PROMPTS]
    data = {"prompts": TOKENIZER_PROMPTS, "hf": hf}
    if exe:
        allp = TOKENIZER_PROMPTS + PARSE_PROMPTS
        for ver in ("sd1", "sd2"):
            r = run_harness(exe, ver, allp)
            data[f"sdcpp_{ver}"] = [{"ids": x["ids"], "weights": x["weights"]} for x in r]
            if ver == "sd1":
                data["sdcpp_encode"] = [x["encode"] for x in r[:len(TOKENIZER_PROMPTS)]]
                data["sdcpp_parse"] = [x["parse"] for x in r]
        data["parse_prompts"] = PARSE_PROMPTS
    sha = __import__("hashlib").sha256(_read(VOCAB)).hexdigest()
    np.savez_compressed(os.path.join(FIX, "clip_tokenizer.npz"), data=np.array(json.dumps(data)),
                        provenance=provenance({"tokenizers": tokenizers.__version__, "vocab_sha256": sha,
                                               "sdcpp": sdcpp if exe else None}))


# ---- text-model goldens ------------------------------------------------------------------------------
def make_text_model_goldens():
    out = {}
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 998, (2, 77))
    ids[:, 0] = 998
    eos = [12, 40]
    for n, e in enumerate(eos):
        ids[n, e] = 999
        ids[n, e + 1:] = 999 if n == 0 else 0
    out["ids"], out["eos"] = ids.astype(np.int32), np.array(eos, np.int32)
    C, L, I, H = 64, 3, 160, 4
    # 1) CLIP-L names (SD1), quick_gelu
    spec = Spec(1)
    sd = hf_clip_weights(spec, "cond_stage_model.transformer.", C, L, I, 1000)
    m = hf_model(sd, C, L, I, H, "quick_gelu", bos=998, eos=999)
    with torch.no_grad():
        o = m(torch.from_numpy(ids).long(), output_hidden_states=True)
        fl = _fln(m)
        out["clip_l_last"] = o.last_hidden_state.numpy()
        out["clip_l_pen"] = o.hidden_states[-2].numpy()
        out["clip_l_pen_ln"] = fl(o.hidden_states[-2]).numpy()
        out["clip_l_pooled"] = o.pooler_output.numpy()
    out.update(spec.pack("clip_l"))
    # 2) OpenCLIP names (SDXL bigG slot), exact GELU, square projection in OpenCLIP layout [C, P]
    spec = Spec(2)
    f, hfsd = open_clip_weights(spec, "conditioner.embedders.1.", C, L, I, 1000, proj=C)
    hfsd["text_projection.weight"] = f["model.text_projection"].T.copy()     # HF: x @ W^T = x @ P
    m = hf_model(hfsd, C, L, I, H, "gelu", proj=C, bos=998, eos=999)
    with torch.no_grad():
        o = m(torch.from_numpy(ids).long(), output_hidden_states=True)
        out["oc_last"] = _fln(m)(o.hidden_states[-1]).numpy()
        out["oc_pen"] = o.hidden_states[-2].numpy()
        out["oc_pooled_ref"] = o.text_embeds.numpy()                            # x @ P (open_clip)
        x = _fln(m)(o.hidden_states[-1])[torch.arange(2), torch.tensor(eos)]
        out["oc_pooled_sdcpp"] = (x @ torch.from_numpy(f["model.text_projection"]).T).numpy()  # sd.cpp: x @ P^T
    out.update(spec.pack("oc"))
    out["provenance"] = provenance({"configs": "C=64 layers=3 inter=160 heads=4 vocab=1000; clip_l quick_gelu; "
                                               "oc gelu(erf), OpenCLIP names under conditioner.embedders.1."})
    np.savez_compressed(os.path.join(FIX, "clip_text_models.npz"), **out)


# ---- conditioner goldens -------------------------------------------------------------------------------
COND_PROMPTS = {
    "basic": "a (lovely:1.3) cat, [blurry] photo, ((sharp))",
    "long": "masterpiece, " + ", ".join(f"(detail{i}:1.{i % 9 + 1})" if i % 3 == 0 else f"word{i}" for i in range(40)),
    "break": "first part, (red:1.2) BREAK [second:0.8] part",
    "empty": "",
    "emb": "a myemb style (painting:1.2) of myemb",
}


def torch_conditioner(models, ids, weights, clip_skip, width=None, height=None, zero_out=False):
    """sd.cpp's get_learned_condition in torch: models = [(hf_model, final_ln, is_bigg)]."""
    k = len(ids) // 77
    chunks = torch.tensor(np.asarray(ids, np.int64).reshape(k, 77))
    w = torch.tensor(np.asarray(weights, np.float32).reshape(k, 77))
    hs, pooled = [], None
    with torch.no_grad():
        for m, final_ln, bigg in models:
            c = chunks.clone()
            if bigg:
                for r in range(k):
                    e = int((c[r] == EOS).nonzero()[0])
                    c[r, e + 1:] = 0
            o = m(c, output_hidden_states=True)
            h = o.hidden_states[-clip_skip]
            if final_ln:
                h = _fln(m)(h)
            hs.append(h)
            if bigg:
                pooled = o.text_embeds[0]
        h = torch.cat(hs, -1)
        ctx = []
        for r in range(k):
            before = h[r].double().mean().float()
            x = h[r] * w[r][:, None]
            after = x.double().mean().float()
            ctx.append(x * (before / after) if after != 0 else x)
        ctx = torch.cat(ctx, 0)[None]
        if zero_out:
            ctx = torch.zeros_like(ctx)
        y = None
        if pooled is not None:
            t = torch.tensor([height, width, 0, 0, height, width], dtype=torch.float32)
            half = 128
            # sd.cpp's host timestep_embedding: double frequencies rounded to float, float products
            freqs = torch.exp(-np.log(10000.0) * torch.arange(half, dtype=torch.float64) / half).float()
            args = t[:, None] * freqs[None]
            emb = torch.cat([torch.cos(args), torch.sin(args)], -1).reshape(-1)
            y = torch.cat([pooled, emb])[None]
    return ctx.numpy(), (None if y is None else y.numpy())


def save_safetensors(path, tensors: dict):
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)


def make_cond_goldens(exe: str, workdir: str):
    n_emb = 2
    for fam in ("sd1", "sd2", "sdxl"):
        spec, out = Spec({"sd1": 11, "sd2": 12, "sdxl": 13}[fam]), {}
        emb_spec = Spec(100 + len(fam))
        if fam == "sd1":
            C, L, I, H = 64, 2, 128, 2
            sd = hf_clip_weights(spec, "cond_stage_model.transformer.", C, L, I, V)
            emb = {"emb_params": emb_spec.add("emb_params", (n_emb, C), 0.0, 0.5)}
            models = [(hf_model(sd, C, L, I, H, "quick_gelu", extra_rows=emb["emb_params"]), True, False)]
            emb_file, harness_w = "myemb.safetensors", 768
        elif fam == "sd2":
            C, L, I, H = 64, 3, 128, 2
            _, sd = open_clip_weights(spec, "cond_stage_model.", C, L, I, V)
            emb = {"string_to_param.*": emb_spec.add("string_to_param.*", (n_emb, C), 0.0, 0.5)}
            models = [(hf_model(sd, C, L, I, H, "gelu_pytorch_tanh", extra_rows=emb["string_to_param.*"]), True, False)]
            emb_file, harness_w = "myemb.pt", 1024
            tpath = os.path.join(workdir, "myemb.pt")
            torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": torch.from_numpy(emb["string_to_param.*"])},
                        "name": "myemb", "step": 100}, tpath)
            out["emb_pt_bytes"] = np.frombuffer(_read(tpath), np.uint8)
        else:
            C, L, I, H = 64, 2, 128, 2
            CG, LG, IG = 96, 3, 192
            sd = hf_clip_weights(spec, "conditioner.embedders.0.transformer.", C, L, I, V)
            _, sdg = open_clip_weights(spec, "conditioner.embedders.1.", CG, LG, IG, V, proj=CG)
            emb = {"clip_l": emb_spec.add("clip_l", (n_emb, C), 0.0, 0.5),
                   "clip_g": emb_spec.add("clip_g", (n_emb, CG), 0.0, 0.5)}
            models = [(hf_model(sd, C, L, I, H, "quick_gelu", extra_rows=emb["clip_l"]), False, False),
                      (hf_model(sdg, CG, LG, IG, H, "gelu_pytorch_tanh", proj=CG, extra_rows=emb["clip_g"]), False, True)]
            emb_file, harness_w = "myemb.safetensors", 768
        # sd.cpp tokenizes (ids + weights); its embedding file only needs the right width and count
        hfile = os.path.join(workdir, f"harness_{fam}_myemb.safetensors")
        save_safetensors(hfile, {"emb_params": np.zeros((n_emb, harness_w), np.float32)})
        names = list(COND_PROMPTS)
        toks = run_harness(exe, "sd2" if fam == "sd2" else "sd1", [COND_PROMPTS[n] for n in names], {"myemb": hfile})
        cases = [(n, -1) for n in names] + ([("basic", 2)] if fam == "sd1" else []) + \
                ([("basic", 1)] if fam == "sd2" else [])
        for n, skip in cases:
            t = toks[names.index(n)]
            eff = skip if skip > 0 else (1 if fam == "sd1" else 2)
            ctx, y = torch_conditioner(models, t["ids"], t["weights"], eff, width=768, height=1024)
            key = f"{n}_skip{skip}"
            out[f"{key}_ids"], out[f"{key}_weights"] = np.array(t["ids"], np.int32), np.array(t["weights"], np.float32)
            out[f"{key}_context"] = ctx
            if y is not None:
                out[f"{key}_y"] = y
        if fam == "sdxl":   # sd-cli's uncond for an empty negative prompt: zero context, same y
            t = toks[names.index("empty")]
            ctx, y = torch_conditioner(models, t["ids"], t["weights"], 2, width=768, height=1024, zero_out=True)
            out["uncond_context"], out["uncond_y"] = ctx, y
        out["prompt_names"] = np.array(names)
        out["prompts"] = np.array([COND_PROMPTS[n] for n in names])
        out["emb_file"] = np.array(emb_file)
        out.update(spec.pack("w"))
        out.update(emb_spec.pack("emb"))
        out["provenance"] = provenance({"family": fam, "width": 768, "height": 1024,
                                        "ids/weights": "stable-diffusion.cpp FrozenCLIPEmbedderWithCustomWords::tokenize",
                                        "models": "transformers CLIPTextModel(WithProjection), eager, float32; "
                                                  "OpenCLIP-H/bigG with gelu_pytorch_tanh (sd.cpp's ggml_gelu)"})
        np.savez_compressed(os.path.join(FIX, f"clip_cond_{fam}.npz"), **out)


# ---- one-off cross-check against sd.cpp's own conditioner on full-size random text encoders ----
CROSS_PROMPTS = [("a (lovely:1.3) cat, [blurry] photo, ((sharp))", -1), (COND_PROMPTS["long"], -1),
                 (COND_PROMPTS["break"], 2), ("", -1)]


def _emulate_ggml_f16_activations():
    """ggml's CPU gelu / gelu_quick read an f16 table at the f16-rounded input (GGML_GELU_FP16,
    GGML_GELU_QUICK_FP16 in ggml-cpu/vec.h): y = f16(act(f16(x))). Patch sdrt's CLIP to do that."""
    import types

    from sdrt.models.te import clip
    from sdrt.ops import api as F

    def wrap(fn):
        return lambda x, *a: F.cast(fn(F.cast(x, "F16"), *a), "F32")
    ns = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    ns.gelu_quick, ns.gelu = wrap(F.gelu_quick), wrap(F.gelu)
    clip.F = ns


def crosscheck(sdcpp: str, workdir: str, fam: str, emulate_f16_acts: bool = False):
    """sd.cpp's get_learned_condition vs sdrt's Conditioner.encode on random full-size CLIP-L
    (SD1) or CLIP-L + bigG (SDXL) in f32, canonical names. Prints max abs errors; writes no fixture
    (the weights are GBs)."""
    from sdrt.engine.conditioning import build_conditioner
    from sdrt.io import open_model, write_safetensors
    spec = Spec(77)
    t = {}
    sd = hf_clip_weights(spec, "", 768, 12, 3072, V)
    t.update({"cond_stage_model.transformer." + k: v for k, v in sd.items()})
    del sd
    if fam == "sdxl":
        f, _ = open_clip_weights(spec, "", 1280, 32, 5120, V, proj=1280)
        from sdrt.models.names import open_clip_to_hf_clip
        t.update({"cond_stage_model.1." + open_clip_to_hf_clip(k): v for k, v in f.items()})
        del f
    path = os.path.join(workdir, f"cross_{fam}.safetensors")
    write_safetensors(path, t)                    # streams: no second in-memory copy
    del t
    exe = build_harness(sdcpp, workdir, HARNESS_COND, "harness_cond")
    out = os.path.join(workdir, "cond.bin")
    inp = "".join(f"{hexs(p)} {k} 768 1024\n" for p, k in CROSS_PROMPTS)
    subprocess.run([exe, path, fam, out], input=inp.encode(), check=True)
    raw = _read(out)
    if emulate_f16_acts:
        _emulate_ggml_f16_activations()
    cond = build_conditioner(open_model(path).tensors, fam)
    pos = 0
    for p, k in CROSS_PROMPTS:
        vals = []
        for _ in range(2):
            n = int(np.frombuffer(raw, np.int64, 1, pos)[0])
            vals.append(np.frombuffer(raw, np.float32, n, pos + 8))
            pos += 8 + 4 * n
        c = cond.encode(p, 768, 1024, k)
        e = np.abs(c.context.reshape(-1) - vals[0]).max()
        ey = np.abs(c.y.reshape(-1) - vals[1]).max() if c.y is not None else 0.0
        print(f"crosscheck {fam} clip_skip={k} chunks={c.context.shape[1] // 77}: context max|d| {e:.3g} "
              f"(|x| max {np.abs(vals[0]).max():.3g}), y max|d| {ey:.3g}  {p[:40]!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdcpp", default=SDCPP, help="stable-diffusion.cpp tree with build/libstable-diffusion.a")
    ap.add_argument("--crosscheck", choices=("sd1", "sdxl"), help="only compare sdrt with sd.cpp's conditioner "
                    "on random full-size text encoders (several GB in a temp dir); writes no fixture")
    ap.add_argument("--f16-acts", action="store_true", help="with --crosscheck: emulate ggml's f16 GELU tables")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.crosscheck:
        with tempfile.TemporaryDirectory() as wd:
            crosscheck(a.sdcpp, wd, a.crosscheck, a.f16_acts)
        return
    with tempfile.TemporaryDirectory() as wd:
        exe = build_harness(a.sdcpp, wd)
        make_tokenizer_goldens(exe, a.sdcpp)
        make_text_model_goldens()
        make_cond_goldens(exe, wd)
    for f in sorted(os.listdir(FIX)):
        if f.startswith("clip_"):
            print(f, os.path.getsize(os.path.join(FIX, f)))


if __name__ == "__main__":
    main()
