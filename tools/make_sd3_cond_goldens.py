"""Goldens for sdrt's SD3 conditioner (sdrt.models.sd3_conditioning) -> tests/fixtures/sd3_cond.npz.

    python tools/make_sd3_cond_goldens.py      # needs torch + transformers (CPU)

Oracles: transformers' CLIPTextModelWithProjection (CLIP-L-like: width 64, 3 layers, quick_gelu,
WITH a text_projection that sd.cpp ignores; bigG-like: width 128, 3 layers, 2 heads, tanh GELU,
projection) and T5EncoderModel (T5 v1.1 layout, d_model 256, 2 layers, 2 heads of 64 (sdrt reads d_kv 64), gated-gelu),
eager float32, under the names SAI's single files use (text_encoders.{clip_l,clip_g}.transformer.
text_model.*, text_encoders.t5xxl.transformer.*). sd.cpp's SD3CLIPEmbedder::get_learned_condition_common
is re-implemented in torch below (per chunk: CLIP-L and bigG penultimate states without final LN,
T5 states, each with its token weights and restored mean; [L | G zero-padded to the T5 width ; T5]
along tokens; y = [CLIP-L pooled, unprojected | bigG pooled, projected] of chunk 0), fed with the ids
and weights sdrt's tokenizers give (tokenization has its own goldens: tests/test_tokenizer.py,
tests/test_t5_tokenizer.py).

Weights are not stored: every tensor is `offset + scale * det_uniform(seed, shape)`
(tools/make_clip_goldens.py's generator and recipe format); the fixture keeps the recipe, the
prompts and the outputs.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
FIX = os.path.join(ROOT, "tests", "fixtures")

from make_clip_goldens import EOS, Spec, hf_clip_weights, hf_model, provenance  # noqa: E402

PL, PG, PT = ("text_encoders.clip_l.transformer.", "text_encoders.clip_g.transformer.",
              "text_encoders.t5xxl.transformer.")
T5 = dict(vocab_size=32128, d_model=256, d_kv=64, d_ff=256, num_layers=2, num_heads=2,
          relative_attention_num_buckets=32, relative_attention_max_distance=128,
          feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0, tie_word_embeddings=False)
PROMPTS = ["a photo of a cat", "a (red:1.3) fox [in the snow] BREAK at night", "",
           "a lighthouse on a cliff, " * 14 + "(dramatic sky:0.8)"]


def t5_weights(spec: Spec) -> dict:
    out = {}
    D, I, F_ = T5["d_model"], T5["num_heads"] * T5["d_kv"], T5["d_ff"]

    def add(k, shape, off, sc):
        out[k] = spec.add(PT + k, shape, off, sc)

    add("shared.weight", (T5["vocab_size"], D), 0.0, 1.0)
    for i in range(T5["num_layers"]):
        b = f"encoder.block.{i}.layer."
        for q in "qkv":
            add(f"{b}0.SelfAttention.{q}.weight", (I, D), 0.0, 1.7 / np.sqrt(D))
        add(f"{b}0.SelfAttention.o.weight", (D, I), 0.0, 1.7 / np.sqrt(I))
        if i == 0:
            add(f"{b}0.SelfAttention.relative_attention_bias.weight", (32, T5["num_heads"]), 0.0, 1.0)
        add(f"{b}0.layer_norm.weight", (D,), 1.0, 0.2)
        add(f"{b}1.DenseReluDense.wi_0.weight", (F_, D), 0.0, 1.7 / np.sqrt(D))
        add(f"{b}1.DenseReluDense.wi_1.weight", (F_, D), 0.0, 1.7 / np.sqrt(D))
        add(f"{b}1.DenseReluDense.wo.weight", (D, F_), 0.0, 1.7 / np.sqrt(F_))
        add(f"{b}1.layer_norm.weight", (D,), 1.0, 0.2)
    add("encoder.final_layer_norm.weight", (D,), 1.0, 0.2)
    return out


def t5_model(sd: dict):
    from transformers import T5Config, T5EncoderModel
    m = T5EncoderModel(T5Config(**T5)).eval()
    sd = dict(sd)
    sd["encoder.embed_tokens.weight"] = sd["shared.weight"]
    missing, unexpected = m.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                                            strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return m


def weighted(h, w):
    """sd.cpp's apply_token_weights on one chunk [77, C] (means in double, as sdrt's reference)."""
    before = h.double().mean().float()
    x = h * w[:, None]
    after = x.double().mean().float()
    return x * (before / after) if after != 0 else x


def torch_sd3(ml, mg, mt, ids, w, t_ids, t_w, clip_skip=2):
    k = len(ids) // 77
    assert len(t_ids) // 77 == k, "the golden prompts give CLIP and T5 the same chunk count"
    chunks = torch.tensor(np.asarray(ids, np.int64).reshape(k, 77))
    tch = torch.tensor(np.asarray(t_ids, np.int64).reshape(k, 77))
    w, t_w = torch.tensor(w).reshape(k, 77), torch.tensor(t_w).reshape(k, 77)
    D = T5["d_model"]
    ctx = []
    with torch.no_grad():
        for c in range(k):
            ids_c = chunks[c:c + 1]
            eos = int((ids_c[0] == EOS).nonzero()[0])
            g_ids = ids_c.clone()
            g_ids[0, eos + 1:] = 0
            ol = ml(ids_c, output_hidden_states=True)
            og = mg(g_ids, output_hidden_states=True)
            hl = weighted(ol.hidden_states[-clip_skip][0], w[c])
            hg = weighted(og.hidden_states[-clip_skip][0], w[c])
            ht = weighted(mt(tch[c:c + 1]).last_hidden_state[0], t_w[c])
            lg = torch.cat([hl, hg, torch.zeros(77, D - hl.shape[1] - hg.shape[1])], -1)
            ctx.append(torch.cat([lg, ht], 0))
            if c == 0:
                pooled_l = ol.last_hidden_state[0, eos]            # final LN, no projection (sd.cpp)
                pooled_g = og.text_embeds[0]                       # final LN, EOS row, projection
        y = torch.cat([pooled_l, pooled_g])[None]
    return torch.cat(ctx, 0)[None].numpy(), y.numpy()


def main():
    from sdrt.models.sd3_conditioning import SD3Conditioner
    from sdrt.ops.tensor import Tensor
    spec = Spec(1503)
    wl = hf_clip_weights(spec, PL, 64, 3, 128, 49408, proj=64)
    wg = hf_clip_weights(spec, PG, 128, 3, 256, 49408, proj=128)
    wt = t5_weights(spec)
    ml = hf_model(wl, 64, 3, 128, 1, "quick_gelu", proj=64)
    mg = hf_model(wg, 128, 3, 256, 2, "gelu_pytorch_tanh", proj=128)
    mt = t5_model(wt)
    table = {}
    for pre, ws in ((PL, wl), (PG, wg), (PT, wt)):
        table.update({pre + k: Tensor.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in ws.items()})
    tok = SD3Conditioner(table, heads_l=1, heads_g=2)     # its tokenizers only
    arrays = spec.pack("w")
    arrays["prompts"] = np.array(PROMPTS)
    for i, p in enumerate(PROMPTS):
        ids, w, t_ids, t_w = tok.tokenize(p)
        ctx, y = torch_sd3(ml, mg, mt, ids, w, t_ids, t_w)
        arrays[f"p{i}:ids"], arrays[f"p{i}:t5_ids"] = ids, t_ids
        arrays[f"p{i}:context"], arrays[f"p{i}:y"] = ctx, y
        print(f"{p[:40]!r}: context {ctx.shape}, y {y.shape}")
    arrays["meta"] = provenance({"tool": "tools/make_sd3_cond_goldens.py"})
    path = os.path.join(FIX, "sd3_cond.npz")
    np.savez_compressed(path, **arrays)
    print(f"{path}: {os.path.getsize(path) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
