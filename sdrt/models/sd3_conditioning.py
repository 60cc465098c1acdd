"""Text conditioning for SD3 / SD3.5: CLIP-L + OpenCLIP bigG + T5-XXL, as stable-diffusion.cpp's
SD3CLIPEmbedder (conditioner.hpp) does.

    cond = SD3Conditioner(table)                  # canonical names under text_encoders.*
    c = cond.encode("a (lovely:1.2) cat")         # c.context [1, 154*k, 4096], c.y [1, 2048]

What encode does, per sd.cpp:
1. parse the attention syntax; CLIP ids (one BPE for both CLIPs) in 77-token chunks [BOS, up to 75
   tokens, EOS, pad]: CLIP-L pads with EOS, bigG with 0 (its tokenizer's pad id); T5 pieces per
   segment, chunks of 76 pieces + `</s>`, the last padded with 0 (sd.cpp pad_tokens at 77/77);
2. each chunk through each model: CLIP-L and bigG hidden states at clip_skip (<= 0: 2, the
   penultimate layer) WITHOUT the final LayerNorm; T5 (final norm, no mask); each model's chunk
   states get the token weights with their mean restored (apply_token_weights, per model);
3. chunk context = [CLIP-L | bigG (768 + 1280) zero-padded to 4096 ; T5] along tokens (77 + 77);
   chunks joined along tokens; zero_out_masked zeroes everything;
4. y = [CLIP-L pooled | bigG pooled] of chunk 0: all layers, final LayerNorm, the first EOS row;
   bigG's through its text_projection. CLIP-L's is NOT projected: sd.cpp's CLIP-L model has no
   text_projection parameter, so a file's `text_encoders.clip_l.transformer.text_projection.weight`
   is ignored (diffusers' SD3 pipeline projects it; `clip_l_projection=True` does that).
A missing encoder contributes zeros of its width (768 / 1280 / 4096), as sd.cpp; with no T5 the
context width is 4096. Where the CLIP and T5 token streams have different chunk counts, sd.cpp reads
past the shorter one (undefined); sdrt gives the missing chunks zeros.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import ModelFileError, UsageError
from ..ops import api as F
from ..ops.tensor import Tensor
from .conditioning import Cond
from .prompt import apply_token_weights, parse_prompt_attention
from .te.clip import CLIPConfig, CLIPTextModel
from .te.t5 import T5Encoder
from .te.t5_tokenizer import CHUNK_LEN as T5_CHUNK_LEN, T5Tokenizer
from .te.tokenizer import EOS_ID, CLIPTokenizer

__all__ = ["SD3Conditioner", "build_sd3_conditioner", "PREFIX_SD3_CLIP_L", "PREFIX_SD3_CLIP_G", "PREFIX_SD3_T5", "CHUNK"]

PREFIX_SD3_CLIP_L = "text_encoders.clip_l.transformer.text_model."
PREFIX_SD3_CLIP_G = "text_encoders.clip_g.transformer.text_model."
PREFIX_SD3_T5 = "text_encoders.t5xxl.transformer."
CHUNK = 77
WIDTHS = {"clip_l": 768, "clip_g": 1280, "t5": 4096}   # sd.cpp's zeros for a missing encoder


class SD3Conditioner:
    """SD3CLIPEmbedder over a canonical weight table (any of the three encoders may be absent).
    heads_l / heads_g override width/64 (tiny test models); t5_style: the T5 tokenizer's style."""

    def __init__(self, table: Mapping[str, Tensor], *, clip_l_projection: bool = False, t5_style: str = "hf",
                 heads_l: int | None = None, heads_g: int | None = None, backend: str = "cpu",
                 source: str = "model"):
        has = lambda p: any(k.startswith(p) for k in table)  # noqa: E731
        self.clip_l = self.clip_g = self.t5 = None
        if has(PREFIX_SD3_CLIP_L):
            cfg = CLIPConfig.detect_from_weights(table, PREFIX_SD3_CLIP_L, act="quick_gelu", heads=heads_l, source=source)
            if not clip_l_projection:
                cfg = cfg.with_(projection_dim=0)
            self.clip_l = CLIPTextModel(table, PREFIX_SD3_CLIP_L, cfg, source)
        if has(PREFIX_SD3_CLIP_G):
            cfg = CLIPConfig.detect_from_weights(table, PREFIX_SD3_CLIP_G, act="gelu_tanh", heads=heads_g, source=source)
            self.clip_g = CLIPTextModel(table, PREFIX_SD3_CLIP_G, cfg, source)
        if has(PREFIX_SD3_T5):
            self.t5 = T5Encoder(table, PREFIX_SD3_T5, source=source)
        if self.clip_l is None and self.clip_g is None and self.t5 is None:
            raise ModelFileError(f"{source}: no SD3 text encoder weights (text_encoders.clip_l / clip_g / t5xxl)")
        for m in (self.clip_l, self.clip_g):
            if m is not None and m.config.positions != CHUNK:
                raise ModelFileError(f"{source}: {m.prefix}embeddings.position_embedding.weight has "
                                     f"{m.config.positions} positions, expected {CHUNK}")
        self.width_l = self.clip_l.config.hidden if self.clip_l else WIDTHS["clip_l"]
        self.width_g = self.clip_g.config.hidden if self.clip_g else WIDTHS["clip_g"]
        self.context_dim = self.t5.config.d_model if self.t5 else WIDTHS["t5"]
        if self.width_l + self.width_g > self.context_dim:
            raise ModelFileError(f"{source}: CLIP widths {self.width_l} + {self.width_g} exceed the T5 width "
                                 f"{self.context_dim}")
        self.tokenizer = CLIPTokenizer(EOS_ID, "sdcpp")
        self.t5_tokenizer = T5Tokenizer(style=t5_style) if self.t5 else None
        self.backend = backend
        assert T5_CHUNK_LEN["sd3"] == CHUNK

    # ---- tokens ---------------------------------------------------------------------------
    def tokenize(self, prompt: str):
        """(clip ids [77k], clip weights, t5 ids [77k'] or None, t5 weights or None). As sd.cpp's
        SD3CLIPEmbedder::tokenize, every parsed segment is tokenized as text: a BREAK is the word
        "break" at weight -1 (only the SD1/SDXL embedder treats it as a chunk break)."""
        parsed = parse_prompt_attention(prompt)
        pieces, pw = [], []
        for text, weight in parsed:
            got = self.tokenizer.encode(text)
            pieces += got
            pw += [weight] * len(got)
        ids, w = _clip_chunks(pieces, pw, self.tokenizer)
        if self.t5_tokenizer is None:
            return ids, w, None, None
        pieces, pw = [], []
        for text, weight in parsed:
            got = self.t5_tokenizer.tokenize(text)
            pieces += got
            pw += [weight] * len(got)
        t_ids, t_w, _ = self.t5_tokenizer.pad_chunks(pieces, CHUNK, pw)
        return ids, w, t_ids, t_w

    # ---- encode ---------------------------------------------------------------------------
    def encode(self, prompt: str, width: int | None = None, height: int | None = None, clip_skip: int = -1, *,
               zero_out_masked: bool = False) -> Cond:
        """Cond of one prompt (width/height unused: SD3's y has no size embedding)."""
        if not isinstance(prompt, str):
            raise UsageError(f"prompt must be a string, got {type(prompt).__name__}")
        clip_skip = int(clip_skip) if clip_skip is not None else -1
        if clip_skip <= 0:
            clip_skip = 2
        ids, w, t_ids, t_w = self.tokenize(prompt)
        kc = ids.size // CHUNK
        kt = 0 if t_ids is None else t_ids.size // CHUNK
        k = max(kc if (self.clip_l or self.clip_g) else 0, kt)     # sd.cpp: the longest token stream
        chunks = ids.reshape(kc, CHUNK)
        is_eos = chunks == EOS_ID
        first_eos = np.where(is_eos.any(1), is_eos.argmax(1), CHUNK - 1)
        outs = {}
        if self.clip_l is not None:
            h, p = self.clip_l.forward(chunks, clip_skip=clip_skip, final_ln=False, eos_index=first_eos, cut_prefix="te0")
            outs.update(hl=h, pl=p)
        if self.clip_g is not None:
            g_ids = chunks.copy()
            g_ids[np.arange(CHUNK)[None, :] > first_eos[:, None]] = 0     # bigG's tokenizer pads with 0
            h, p = self.clip_g.forward(g_ids, clip_skip=clip_skip, final_ln=False, eos_index=first_eos, cut_prefix="te1")
            outs.update(hg=h, pg=p)
        if self.t5 is not None:
            outs["ht"] = self.t5.forward(t_ids.reshape(kt, CHUNK), cut_prefix="t5")
        res = F.Graph(outs).run(self.backend)
        get = lambda n, width, kk: res[n].to_f32().reshape(kk, CHUNK, width)  # noqa: E731
        C = self.context_dim
        ctx = np.zeros((k, 2 * CHUNK, C), np.float32)
        for name, off, width, kk, ws in (("hl", 0, self.width_l, kc, w), ("hg", self.width_l, self.width_g, kc, w),
                                         ("ht", None, C, kt, t_w)):
            if name not in res:
                continue
            h = get(name, width, kk)
            for c in range(kk):
                hw = apply_token_weights(h[c], ws[c * CHUNK:(c + 1) * CHUNK])
                if off is None:
                    ctx[c, CHUNK:] = hw
                else:
                    ctx[c, :CHUNK, off:off + width] = hw
        if zero_out_masked:
            ctx[:] = 0.0
        pl = res["pl"].to_f32().reshape(kc, -1)[0] if "pl" in res else np.zeros(WIDTHS["clip_l"], np.float32)
        pg = res["pg"].to_f32().reshape(kc, -1)[0] if "pg" in res else np.zeros(WIDTHS["clip_g"], np.float32)
        y = np.concatenate([pl, pg]).reshape(1, -1).astype(np.float32)
        return Cond(ctx.reshape(1, k * 2 * CHUNK, C), y, ids, w)

    def encode_pair(self, prompt: str, negative_prompt: str = "", width: int | None = None,
                    height: int | None = None, clip_skip: int = -1, **kw) -> tuple[Cond, Cond]:
        """(cond, uncond); SD3's empty negative prompt is encoded as text (sd.cpp zeroes only SDXL's)."""
        return (self.encode(prompt, width, height, clip_skip, **kw),
                self.encode(negative_prompt, width, height, clip_skip, **kw))


def _clip_chunks(pieces: list[int], weights: list[float], tok: CLIPTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """sd.cpp's CLIPTokenizer::pad_tokens at min = max = 77 with overflow expansion (the chunking of
    sdrt.models.prompt.tokenize_weighted): chunks [BOS, up to 75 pieces, EOS, pad]; weights 1 on
    BOS/EOS/pad."""
    per, n = CHUNK - 2, len(pieces)
    starts = [0] if n + 2 <= CHUNK else list(range(0, n, per))
    ids = np.full(len(starts) * CHUNK, tok.pad_id, np.int32)
    w = np.ones(len(starts) * CHUNK, np.float32)
    for c, s in enumerate(starts):
        take, o = min(per, n - s), c * CHUNK
        ids[o] = tok.bos_id
        ids[o + 1:o + 1 + take] = pieces[s:s + take]
        w[o + 1:o + 1 + take] = weights[s:s + take]
        ids[o + 1 + take] = tok.eos_id
    return ids, w


def build_sd3_conditioner(table: Mapping[str, Tensor], version: str = "sd3", embd_dir: str | None = None,
                          **kw) -> SD3Conditioner:
    """The family-registry builder `(table, version, embd_dir, **kw)`. Textual-inversion files are
    not used: sd.cpp's SD3 embedder runs its CLIPs without custom embeddings."""
    if embd_dir:
        import logging
        logging.getLogger("sdrt.conditioning").debug("SD3: embeddings in %s are not used (as sd.cpp)", embd_dir)
    return SD3Conditioner(table, **kw)
