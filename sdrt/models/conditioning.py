"""Text conditioning for SD1.x, SD2.x and SDXL: prompt -> cross-attention context (+ SDXL vector),
as stable-diffusion.cpp's FrozenCLIPEmbedderWithCustomWords does.

API
    cond = build_conditioner(table, version, embd_dir=None)       # -> Conditioner
    c = cond.encode("a (lovely:1.2) cat", width=1024, height=1024, clip_skip=-1)
    c.context   # float32 [1, 77*k, C]: C = 768 (SD1), 1024 (SD2), 2048 (SDXL: CLIP-L | bigG)
    c.y         # float32 [1, 2816] for SDXL (pooled bigG 1280 + 6 x 256 size embeddings), else None
    pos, neg = cond.encode_pair(prompt, negative_prompt, width=w, height=h)   # one graph for both
    conds = cond.encode_many([(prompt, False), ("", True)], width=w, height=h)  # (prompt, zero_out_masked)

`table` maps canonical tensor names to Tensors (a ModelFile's `.tensors` after sdrt.models.names;
raw original / diffusers names are converted here too). `version` is a sdrt.io.detect version
('sd1', 'sd2_inpaint', 'sdxl', ...). `embd_dir` holds textual-inversion files, read with `open_file(path) -> {name: Tensor}` (the engine passes sdrt.io's reader; see sdrt.engine.conditioning) (.safetensors,
.pt, .gguf); a file's stem, lowercased, is the word that calls it up in a prompt.

What encode does (sd.cpp's get_learned_condition):
1. parse the attention syntax and tokenize into 77-token chunks (sdrt.models.prompt);
2. run every chunk through the text model(s) as one batch: SD1 CLIP-L with final_layer_norm,
   SD2 OpenCLIP-H with final_layer_norm, SDXL CLIP-L and bigG without it (whose ids are 0 after
   each chunk's first EOS), at `clip_skip` (-1 / 0: 1 for SD1, 2 = penultimate for SD2/SDXL);
3. per chunk (SDXL: after joining CLIP-L and bigG states), scale each token by its weight and
   restore the chunk's mean; `zero_out_masked` zeroes the context (sd.cpp does that for SDXL's
   empty negative prompt, see encode_pair);
4. SDXL: y = bigG pooled output of chunk 0 (all layers, final_layer_norm, EOS row, projection),
   then a 256-wide sinusoidal embedding (sd.cpp's host timestep_embedding) of each of orig (h, w),
   crop (top, left), target (h, w); sd.cpp uses
   the image size for orig and target and (0, 0) for the crop.

Textual inversion: an embedding gives n vectors for each model (SD1 768 wide, SD2 1024, SDXL both
768 and 1280, e.g. `clip_l` / `clip_g` tensors). Its word becomes n custom ids after the vocabulary
(49408 + i) whose rows come from the embedding. A file with no tensor of the needed width is
skipped with a warning and its word tokenized as text (sd.cpp does the same for SD1/SD2).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelFileError, SdrtError, UnsupportedError, UsageError
from .families import families, family_of
from .te.clip import PREFIX_CLIP_G, PREFIX_CLIP_L, CLIPConfig, CLIPTextModel
from .te.spec import TextEncoderSpec
from .te.tokenizer import EOS_ID, VOCAB_SIZE, CLIPTokenizer
from ..ops import api as F
from ..ops.tensor import Tensor
from .prompt import CHUNK_LEN, apply_token_weights, tokenize_weighted

__all__ = ["EMBEDDING_EXTS", "Cond", "Conditioner", "TextEncoderSpec", "build_clip_conditioner", "build_conditioner",
           "size_embedding"]

log = logging.getLogger("sdrt.conditioning")
EMBEDDING_EXTS = (".gguf", ".safetensors", ".pt")
SIZE_EMB_DIM = 256


@dataclass
class Cond:
    """One prompt's conditioning. context [1, 77*k, C] float32; y [1, adm] float32 or None;
    ids / weights: the CLIP-L (first model's) token chunks, for logs and tests."""
    context: np.ndarray
    y: np.ndarray | None = None
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))


def size_embedding(values, dim: int = SIZE_EMB_DIM, max_period: int = 10000) -> np.ndarray:
    """Sinusoidal embedding of each value, concatenated: float32 [dim * len(values)], [cos | sin]
    per value. Computed as sd.cpp's host-side timestep_embedding (frequencies in double rounded
    to float, float products) rather than with the timestep_embedding op (ggml's float
    frequencies): at sizes like 1024 the argument reaches 1024 rad, where that rounding shows."""
    half = dim // 2
    freqs = np.exp(-np.log(float(max_period)) * np.arange(half, dtype=np.float64) / half).astype(np.float32)
    args = np.asarray(values, np.float32).reshape(-1, 1) * freqs[None, :]
    out = np.zeros((args.shape[0], dim), np.float32)
    out[:, :half], out[:, half:2 * half] = np.cos(args), np.sin(args)
    return out.reshape(-1)


class _Embeddings:
    """Textual-inversion files of a directory, loaded on first use (sd.cpp's load_embedding)."""

    def __init__(self, embd_dir: str | None, widths: tuple[int, ...], open_file=None):
        self.widths, self.open_file = widths, open_file
        self.files: dict[str, str] = {}
        self.rows: list[list[np.ndarray]] = [[] for _ in widths]
        self.count = 0
        self.slots: dict[str, tuple[int, int] | None] = {}
        if not embd_dir:
            return
        if not os.path.isdir(embd_dir):
            raise UsageError(f"--embd-dir {embd_dir!r}: not a directory")
        if open_file is None:
            raise UsageError("--embd-dir needs a file reader: build the conditioner through "
                             "sdrt.engine.conditioning.build_conditioner (or pass open_file=)")
        for name in sorted(os.listdir(embd_dir)):
            stem, ext = os.path.splitext(name)
            path = os.path.join(embd_dir, name)
            if ext in EMBEDDING_EXTS and os.path.isfile(path):
                self.files[stem.lower()] = path

    def names(self) -> list[str]:
        return sorted(self.files)

    def _load(self, name: str) -> tuple[int, int] | None:
        path = self.files[name]
        try:
            tensors = self.open_file(path)
            found: list[np.ndarray | None] = [None] * len(self.widths)
            for t in tensors.values():
                if t.ndim > 2 or not (t.dtype.is_float or t.dtype.is_quantized):
                    continue
                for m, wdt in enumerate(self.widths):
                    if t.ne[0] == wdt:
                        found[m] = t.to_f32().reshape(-1, wdt)      # [n, C]; the last one wins
        except SdrtError as e:
            log.warning("embedding '%s' (%s) not loaded: %s", name, path, e)
            return None
        if any(f is None for f in found):
            log.warning("embedding '%s' (%s) has no tensor %d wide; its word stays text", name, path,
                        self.widths[found.index(None)])
            return None
        n = found[0].shape[0]
        if any(f.shape[0] != n for f in found):
            log.warning("embedding '%s' (%s): its tensors hold different vector counts %s; skipped", name, path,
                        [f.shape[0] for f in found])
            return None
        for m, f in enumerate(found):
            self.rows[m].append(np.ascontiguousarray(f, np.float32))
        start = self.count
        self.count += n
        log.debug("embedding '%s' applied: %d vectors", name, n)
        return start, self.count

    def lookup(self, word: str) -> list[int] | None:
        if word not in self.files:
            return None
        if word not in self.slots:
            self.slots[word] = self._load(word)
        slot = self.slots[word]
        return None if slot is None else [VOCAB_SIZE + i for i in range(*slot)]

    def table(self, m: int) -> Tensor | None:
        if not self.count:
            return None
        return Tensor.from_numpy(np.concatenate(self.rows[m], axis=0), name="custom_embeddings")  # ne=[C, n]


class Conditioner:
    """CLIP conditioning of one SD1/SD2/SDXL model (see the module docstring)."""

    def __init__(self, version: str, models: list[tuple[TextEncoderSpec, CLIPTextModel]], tokenizer: CLIPTokenizer,
                 embd_dir: str | None = None, backend: str = "cpu", *, default_clip_skip: int | None = None,
                 zero_empty_negative: bool | None = None, open_file=None):
        fam = family_of(version)
        self.version = version
        self.models, self.tokenizer, self.backend = models, tokenizer, backend
        self.default_clip_skip = 1 if default_clip_skip is None else default_clip_skip
        self.zero_empty_negative = fam.zero_empty_negative if zero_empty_negative is None else zero_empty_negative
        self.embeddings = _Embeddings(embd_dir, tuple(m.config.hidden for _, m in models), open_file)
        for name in self.embeddings.names():
            tokenizer.add_special_token(name)

    @property
    def context_dim(self) -> int:
        return sum(m.config.hidden for _, m in self.models)

    def tokenize(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [77*k], weights float32 [77*k]) of a prompt."""
        return tokenize_weighted(prompt, self.tokenizer, self.embeddings.lookup, CHUNK_LEN)

    def encode(self, prompt: str, width: int | None = None, height: int | None = None, clip_skip: int = -1, *,
               zero_out_masked: bool = False, orig_size: tuple[int, int] | None = None,
               crop: tuple[int, int] = (0, 0), target_size: tuple[int, int] | None = None) -> Cond:
        """Cond of one prompt. width/height: the image size in pixels (needed for SDXL's y);
        orig_size / target_size (h, w) default to (height, width), crop (top, left) to (0, 0)."""
        return self.encode_many([(prompt, zero_out_masked)], width, height, clip_skip, orig_size=orig_size,
                                crop=crop, target_size=target_size)[0]

    def encode_many(self, prompts, width: int | None = None, height: int | None = None, clip_skip: int = -1, *,
                    orig_size: tuple[int, int] | None = None, crop: tuple[int, int] = (0, 0),
                    target_size: tuple[int, int] | None = None) -> list[Cond]:
        """The Conds of several (prompt, zero_out_masked) pairs from one graph: each text model runs
        once over the chunks of every prompt that needs it (a zeroed prompt only needs a pooled
        output). Chunks are independent batch items, so each prompt's values are encode's."""
        prompts = [(p, bool(z)) for p, z in prompts]
        for p, _ in prompts:
            if not isinstance(p, str):
                raise UsageError(f"prompt must be a string, got {type(p).__name__}")
        clip_skip = int(clip_skip) if clip_skip is not None else -1
        if clip_skip <= 0:
            clip_skip = self.default_clip_skip
        toks = [self.tokenize(p) for p, _ in prompts]
        chunks = [ids.reshape(-1, CHUNK_LEN) for ids, _ in toks]
        outs, rows = {}, {}            # rows[m]: {prompt index: its first row in model m's batch}
        for m, (spec, model) in enumerate(self.models):
            sel = [i for i, (_, zero) in enumerate(prompts) if spec.pooled or not zero]
            if not sel:
                continue        # every context here is zeroed and this model has no pooled output
            rows[m] = dict(zip(sel, np.cumsum([0] + [len(chunks[i]) for i in sel[:-1]]).tolist()))
            cid = np.concatenate([chunks[i] for i in sel])
            eos_index = None
            if spec.zero_after_eos:
                cid = cid.copy()
                is_eos = cid == EOS_ID
                eos_index = np.where(is_eos.any(1), is_eos.argmax(1), CHUNK_LEN - 1)
                cid[np.arange(CHUNK_LEN)[None, :] > eos_index[:, None]] = 0
            hidden, pooled = model.forward(cid, clip_skip=clip_skip, final_ln=spec.final_ln,
                                           custom=self.embeddings.table(m),
                                           eos_index=eos_index if spec.pooled else None, cut_prefix=f"te{m}")
            if not all(prompts[i][1] for i in sel):
                outs[f"h{m}"] = hidden
            if pooled is not None:
                outs[f"p{m}"] = pooled
        res = {k: v.to_f32() for k, v in F.Graph(outs).run(self.backend).items()} if outs else {}
        conds = []
        for i, ((_, zero), (ids, weights)) in enumerate(zip(prompts, toks)):
            k = len(chunks[i])
            hs = []
            for m, (_, model) in enumerate(self.models):
                if zero or f"h{m}" not in res:
                    hs.append(np.zeros((k, CHUNK_LEN, model.config.hidden), np.float32))
                else:
                    r = rows[m][i]
                    hs.append(res[f"h{m}"].reshape(-1, CHUNK_LEN, model.config.hidden)[r:r + k])
            h = hs[0] if len(hs) == 1 else np.concatenate(hs, axis=-1)      # [k, 77, C]
            ctx = np.zeros_like(h)
            if not zero:
                for c in range(k):
                    ctx[c] = apply_token_weights(h[c], weights[c * CHUNK_LEN:(c + 1) * CHUNK_LEN])
            y = None
            pooled = [m for m in rows if f"p{m}" in res]
            if pooled:          # the pooled output of the prompt's first chunk
                m = pooled[-1]
                p = res[f"p{m}"].reshape(sum(len(chunks[j]) for j in rows[m]), -1)[rows[m][i]]
                y = self._vector(p, width, height, orig_size, crop, target_size)
            conds.append(Cond(ctx.reshape(1, k * CHUNK_LEN, -1), y, ids, weights))
        return conds

    def encode_pair(self, prompt: str, negative_prompt: str = "", width: int | None = None,
                    height: int | None = None, clip_skip: int = -1, **kw) -> tuple[Cond, Cond]:
        """(cond, uncond) as sd-cli makes them, from one graph: SDXL's empty negative prompt gives
        a zero context."""
        zero = self.zero_empty_negative and not negative_prompt
        cond, uncond = self.encode_many([(prompt, False), (negative_prompt, zero)], width, height, clip_skip, **kw)
        return cond, uncond

    def _vector(self, pooled, width, height, orig_size, crop, target_size) -> np.ndarray:
        no_size = width is None or height is None or int(width) <= 0 or int(height) <= 0
        if (orig_size is None or target_size is None) and no_size:
            raise UsageError(f"SDXL conditioning needs the image size: width={width}, height={height}")
        oh, ow = orig_size if orig_size is not None else (height, width)
        th, tw = target_size if target_size is not None else (height, width)
        emb = size_embedding([oh, ow, crop[0], crop[1], th, tw])
        return np.concatenate([pooled.astype(np.float32), emb]).reshape(1, -1)


_TE_RAW = ("cond_stage_model.", "conditioner.", "te.", "te1.", "te2.", "text_encoder", "clip_l.", "clip_g.")


def _canonical(table: Mapping[str, Tensor], version: str) -> Mapping[str, Tensor]:
    """The table itself when it has canonical text-encoder names, else its text-encoder
    tensors renamed by sdrt.models.names (original OpenCLIP / SDXL `conditioner.` / diffusers)."""
    if any(k.startswith((PREFIX_CLIP_L, PREFIX_CLIP_G)) for k in table):
        return table
    from .names import convert_names
    te = [k for k in table if k.startswith(_TE_RAW)]
    names = convert_names(te, version, "text encoder")
    return {names[k]: table[k] for k in te}


def build_conditioner(table: Mapping[str, Tensor], version: str, embd_dir: str | None = None, **kw):
    """The conditioner of a model version, as its family builds it (sdrt.models.families);
    keyword arguments go to the family's builder (for CLIP: see build_clip_conditioner)."""
    fam = family_of(version or "")
    if fam.conditioner is None:
        ok = ", ".join(f.description for f in families() if f.conditioner is not None)
        raise UnsupportedError(f"text conditioning for model version {version!r} is not supported ({ok} are)")
    return fam.conditioner(table, version, embd_dir, **kw)


def build_clip_conditioner(table: Mapping[str, Tensor], version: str, specs, *, pad_id: int | None = None,
                           default_clip_skip: int = 1, embd_dir: str | None = None, gelu: str = "tanh",
                           projection_layout: str = "linear", tokenizer_style: str = "sdcpp", heads: int | None = None,
                           backend: str = "cpu", source: str = "model", open_file=None) -> Conditioner:
    """A CLIP conditioner over the text models `specs` (TextEncoderSpec, in context order) of a
    weight table; `pad_id`: the tokenizer's pad id (None: EOS, 0: SD 2.x's OpenCLIP).

    gelu: "tanh" (sd.cpp's ggml_gelu for OpenCLIP) or "erf" (open_clip's exact GELU);
    projection_layout: how bigG's text_projection is applied, "linear" (sd.cpp) or "matmul"
    (OpenCLIP / original SDXL checkpoints read as the reference does); tokenizer_style: "sdcpp"
    or "hf" (see sdrt.models.te.tokenizer); heads: override width/64 (tiny test models)."""
    if gelu not in ("tanh", "erf"):
        raise UsageError(f"gelu {gelu!r}: 'tanh' or 'erf'")
    fam = family_of(version or "")
    table = _canonical(table, version)
    models = []
    for spec in specs:
        act = spec.act if spec.act == "quick_gelu" else ("gelu_tanh" if gelu == "tanh" else "gelu")
        if not any(k.startswith(spec.prefix) for k in table):
            raise ModelFileError(f"{source}: no text encoder weights under {spec.prefix!r} "
                                 f"(a {fam.name.upper()} model needs them)")
        cfg = CLIPConfig.detect_from_weights(table, spec.prefix, act=act, heads=heads,
                                             projection_layout=projection_layout, source=source)
        if cfg.positions != CHUNK_LEN:
            raise ModelFileError(f"{source}: {spec.prefix}embeddings.position_embedding.weight has "
                                 f"{cfg.positions} positions, expected {CHUNK_LEN}")
        if spec.pooled and not cfg.projection_dim:
            log.debug("%s has no text_projection: pooled output unprojected (sd.cpp: identity)", spec.prefix)
        models.append((spec, CLIPTextModel(table, spec.prefix, cfg, source)))
    pad = EOS_ID if pad_id is None else pad_id
    return Conditioner(version, models, CLIPTokenizer(pad, tokenizer_style), embd_dir, backend,
                       default_clip_skip=default_clip_skip, zero_empty_negative=fam.zero_empty_negative,
                       open_file=open_file)
