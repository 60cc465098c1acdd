"""Flux.1 (dev, schnell, Fill, Kontext, Flux-Lite and other pruned depths) and Chroma: the family
record (docs/adding-a-family.md).

- detection: sd.cpp's get_sd_version rules for the BFL DiT (`double_blocks.` /
  `single_transformer_blocks.` under `model.diffusion_model.`): Fill by img_in's 384 inputs,
  Chroma by its `distilled_guidance_layer`; Flux Controls, Flex.2, Ovis-Image and Chroma Radiance
  are recognized and refused by name (records without a diffusion model); Flux.2 / LongCat keep
  their records in recognized.py (the shape rule here returns their versions, as sd.cpp's).
- components: `--clip_l` (sd.py's record, `text_encoders.clip_l.transformer.` in this layout),
  `--t5xxl` (registered here), `--diffusion-model`, `--vae` (the 16-channel ae.safetensors).
- conditioning: sd.cpp's FluxCLIPEmbedder (CLIP-L's pooled vector of the first 77-token chunk
  -> y [1, 768]; T5-XXL over 256-token chunks with sd.cpp's prompt weighting -> context
  [1, 256k, 4096]) and, for Chroma, its T5CLIPEmbedder (T5 only, 512-token chunks; the attention
  mask travels in `Cond.y` as sd.cpp's c_vector: 0 keep / -inf drop, `chroma_t5_mask_pad`
  padding tokens kept; the DiT applies it unless `chroma_use_dit_mask` is false).
- sampling: flux_flow prediction, euler over the `flux` scheduler, flow shift 1.15 with a
  guidance embedder (dev) else 1.0 (sd.cpp's default_flow_shift), `--guidance` distilled.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from ..errors import ModelFileError, UsageError
from ..ops.tensor import Tensor
from ..ops.threads import copy_into
from .facts import Facts, dim
from .names import SPLIT_PART
from .families import Component, Cond, Family, Variant, register_component, register_family
from .recognized import FLUX2, FLUX2_KLEIN, LONGCAT, OVIS_IMAGE, marker
from .sd import ConcatLatents

__all__ = ["CHROMA", "CHROMA_RADIANCE", "FLEX_2", "FLUX", "FLUX_CONTROLS", "FLUX_FILL", "MODEL_ARGS", "T5XXL",
           "FluxConditioner", "FluxDiffusion", "detect_flux", "flux_conditioner", "flux_fill_concat", "flux_flow_shift",
           "flux_model", "join_diffusers_parts"]

log = logging.getLogger("sdrt")
F32 = np.float32
DM = "model.diffusion_model."
FLUX, FLUX_FILL, FLUX_CONTROLS, FLEX_2, CHROMA, CHROMA_RADIANCE = (
    "flux", "flux_fill", "flux_controls", "flex_2", "chroma", "chroma_radiance")
PREFIX_CLIP_L = "text_encoders.clip_l.transformer.text_model."
PREFIX_T5 = "text_encoders.t5xxl.transformer."
# sd.cpp's model args that reach this family (sd-cli: --chroma-disable-dit-mask,
# --chroma-enable-t5-mask, --chroma-t5-mask-pad; newer builds: --model-args k=v)
MODEL_ARGS = {"chroma_use_dit_mask": True, "chroma_use_t5_mask": False, "chroma_t5_mask_pad": 1}

T5XXL = register_component(Component(
    "t5xxl", "--t5xxl", "t5xxl", "path to the T5-XXL text encoder (Flux, Chroma, SD3; e.g. t5xxl_fp16.safetensors)",
    strip=(PREFIX_T5, "text_encoders.t5xxl.", "t5xxl.transformer.", "t5xxl."),
    prefix={"dit": PREFIX_T5}, replaces=("text_encoders.t5xxl.",)))


# ---- detection (sd.cpp get_sd_version, the Flux branch) -----------------------------------------

def _flux2_of(f: Facts):
    if f.has(DM + "double_stream_modulation_img.lin.weight"):
        return FLUX2 if f.has("single_blocks.47.linear1.weight") else FLUX2_KLEIN
    return None


def detect_flux(f: Facts):
    if not (f.has(DM + "double_blocks.") or f.has(DM + "single_transformer_blocks.")):
        return None
    v = _flux2_of(f)
    if v:
        return v
    if dim(f.context_embedding, 0) == 3584:
        return LONGCAT
    if f.has("distilled_guidance_layer.in_proj.weight"):
        return CHROMA
    return {384: FLUX_FILL, 128: FLUX_CONTROLS, 196: FLEX_2}.get(dim(f.input_block, 0), FLUX)


def flux_flow_shift(version, table) -> float:
    """sd.cpp: 1.15 when the DiT has a guidance embedder (Flux dev, Fill, Kontext), else 1.0."""
    table = getattr(table, "tensors", table) or {}
    return 1.15 if (DM + "guidance_in.in_layer.weight") in table else 1.0


def _names(rest, version, layout):
    from .names import dit_to_original
    return dit_to_original(rest, "flux")


# ---- conditioning ------------------------------------------------------------------------------

def _missing(flag: str, what: str, source: str) -> UsageError:
    return UsageError(f"{source}: this Flux/Chroma model needs {what}: give {flag} FILE "
                      f"(no tensors under {PREFIX_T5 if flag == '--t5xxl' else PREFIX_CLIP_L!r} in the loaded files)")


class FluxConditioner:
    """sd.cpp's FluxCLIPEmbedder (clip given) or T5CLIPEmbedder (clip None: Chroma).

    encode(prompt) -> Cond(context [1, chunk_len * k, d_model], y): Flux's y is CLIP-L's pooled
    vector [1, 768] of the first chunk (final-normed state at the first EOS, no projection, as
    sd.cpp's OPENAI_CLIP_VIT_L_14); Chroma's y is the DiT text mask [1, chunk_len * k]
    (0 / -inf), or None with chroma_use_dit_mask off."""

    def __init__(self, t5, t5_tokenizer, chunk_len: int, clip=None, clip_tokenizer=None, *, backend: str = "cpu",
                 use_t5_mask: bool = False, mask_pad: int = 1, use_dit_mask: bool = True):
        self.t5, self.t5_tokenizer, self.chunk_len = t5, t5_tokenizer, chunk_len
        self.clip, self.clip_tokenizer, self.backend = clip, clip_tokenizer, backend
        self.use_t5_mask, self.mask_pad, self.use_dit_mask = use_t5_mask, int(mask_pad), use_dit_mask

    def tokenize(self, prompt: str):
        """(T5 ids, weights, mask) padded to whole chunks, as sd.cpp's pad_tokens."""
        from .prompt import parse_prompt_attention
        pieces, weights = [], []
        for text, w in parse_prompt_attention(prompt):
            ids = self.t5_tokenizer.tokenize(text)
            pieces += ids
            weights += [w] * len(ids)
        return self.t5_tokenizer.pad_chunks(pieces, self.chunk_len, weights)

    def pooled(self, prompt: str) -> np.ndarray:
        """CLIP-L's pooled output of the first 77-token chunk: float32 [1, hidden]."""
        from .prompt import CHUNK_LEN, tokenize_weighted
        ids, _ = tokenize_weighted(prompt, self.clip_tokenizer, None, CHUNK_LEN)
        first = ids[:CHUNK_LEN]
        eos = np.flatnonzero(first == self.clip_tokenizer.eos_id)
        idx = min(int(eos[0]) if eos.size else CHUNK_LEN, CHUNK_LEN - 1)
        from ..ops import api as F
        _, pooled = self.clip.forward(first.reshape(1, -1), clip_skip=-1, final_ln=True, eos_index=[idx],
                                      cut_prefix="clip_l")
        return F.Graph({"p": pooled}).run(self.backend)["p"].to_f32().reshape(1, -1)

    def encode(self, prompt: str, width: int | None = None, height: int | None = None, clip_skip: int = -1, *,
               zero_out_masked: bool = False) -> Cond:
        from .prompt import apply_token_weights
        if not isinstance(prompt, str):
            raise UsageError(f"prompt must be a string, got {type(prompt).__name__}")
        ids, weights, mask = self.tokenize(prompt)
        L = self.chunk_len
        h = self.t5.encode_chunks(ids, L, mask if self.use_t5_mask else None, self.backend)[0]   # [k*L, D]
        ctx = np.empty_like(h)
        for c in range(ids.size // L):
            s = slice(c * L, (c + 1) * L)
            ctx[s] = apply_token_weights(h[s], weights[s])
            if zero_out_masked:
                if self.clip is None:
                    ctx[s][mask[s] == 0] = 0.0
                else:
                    ctx[s] = 0.0
        if self.clip is not None:
            return Cond(ctx[None], self.pooled(prompt))
        if not self.use_dit_mask:
            return Cond(ctx[None], None)
        additive = np.where(mask > 0, 0.0, -np.inf).astype(F32)
        pad = np.flatnonzero(np.isinf(additive))[:max(self.mask_pad, 0)]   # sd.cpp modify_mask_to_attend_padding
        additive[pad] = 0.0
        return Cond(ctx[None], additive[None])


def flux_conditioner(table: Mapping, version: str, embd_dir=None, *, backend: str = "cpu", model_args=None,
                     source: str = "model", **kw) -> FluxConditioner:
    """The conditioner of a Flux (CLIP-L + T5-XXL) or Chroma (T5-XXL) model in `table`.
    A missing text encoder is a UsageError naming its flag (sd.cpp only warns and feeds zeros)."""
    from .te.clip import CLIPConfig, CLIPTextModel
    from .te.t5 import T5Encoder
    from .te.t5_tokenizer import CHUNK_LEN, T5Tokenizer
    from .te.tokenizer import CLIPTokenizer
    args = {**MODEL_ARGS, **(model_args or {})}
    if embd_dir:
        log.warning("--embd-dir: textual-inversion embeddings are not used by Flux / Chroma (as sd.cpp)")
    if not any(k.startswith(PREFIX_T5) for k in table):
        raise _missing("--t5xxl", "the T5-XXL text encoder (t5xxl_fp16.safetensors or a GGUF of it)", source)
    t5 = T5Encoder(table, PREFIX_T5, source=source)
    tok = T5Tokenizer(style="sdcpp")
    if version == CHROMA:
        return FluxConditioner(t5, tok, CHUNK_LEN["chroma"], backend=backend,
                               use_t5_mask=bool(args["chroma_use_t5_mask"]), mask_pad=int(args["chroma_t5_mask_pad"]),
                               use_dit_mask=bool(args["chroma_use_dit_mask"]))
    if not any(k.startswith(PREFIX_CLIP_L) for k in table):
        raise _missing("--clip_l", "the CLIP-L text encoder (clip_l.safetensors)", source)
    cfg = CLIPConfig.detect_from_weights(table, PREFIX_CLIP_L, act="quick_gelu", source=source)
    cfg = cfg.with_(projection_dim=0)          # sd.cpp: CLIP-L's pooled output is not projected
    clip = CLIPTextModel(table, PREFIX_CLIP_L, cfg, source)
    return FluxConditioner(t5, tok, CHUNK_LEN["flux"], clip, CLIPTokenizer(style="sdcpp"), backend=backend)


# ---- the diffusion model ---------------------------------------------------------------------------

class FluxDiffusion:
    """FluxModel behind the registry's `.predict(x, t, cond, backend=)`: Cond.y is the pooled
    vector (Flux) or the text mask (Chroma); guidance reaches models with a guidance embedder."""

    def __init__(self, model):
        self.model = model
        self.config = model.config

    def predict(self, x, t, cond: Cond, backend: str = "cpu") -> np.ndarray:
        cfg = self.config
        N = x.shape[0]
        guidance = None
        if cfg.guidance_embed:
            if cond.guidance is None:
                raise UsageError("Flux dev: this model needs a distilled guidance value (--guidance)")
            guidance = np.full(N, cond.guidance, F32)
        y, txt_mask = (None, cond.y) if cfg.is_chroma else (cond.y, None)
        return self.model(x, t, cond.context, y, guidance, cond.c_concat, list(cond.ref_latents),
                          getattr(cond, "ref_index_mode", "fixed"), txt_mask, backend=backend)


class _JoinedLeaf(Tensor):
    """A weight made on first use from a diffusers checkpoint's split parts: their rows (torch
    axis 0) joined in order, optionally with the two halves exchanged. Raw bytes, so F16/BF16
    and block-quantized rows join as stored."""
    __slots__ = ("_parts", "_swap")

    def __init__(self, parts, swap: bool, name: str):
        if any(p.ne[:-1] != parts[0].ne[:-1] for p in parts):
            raise ModelFileError(f"{name}: its diffusers parts differ in width "
                                 f"({', '.join(str(list(p.shape)) for p in parts)})")
        if not all(p.is_contiguous() for p in parts):
            raise ModelFileError(f"{name}: a diffusers part is not stored contiguously")
        # parts of one type join as stored; mixed types (--type converts only some names) as F32
        dt = parts[0].dtype if all(p.dtype == parts[0].dtype for p in parts) else "F32"
        self._parts, self._swap = tuple(parts), swap
        super().__init__(dt, parts[0].ne[:-1] + (sum(p.ne[-1] for p in parts),), name=name)

    @property
    def storage(self):
        s = Tensor.storage.__get__(self)
        if s is None:
            if all(p.dtype == self.dtype for p in self._parts):
                raw = [p.storage[p.offset:p.offset + p.nbytes] for p in self._parts]
            else:
                raw = [np.ascontiguousarray(p.to_f32(), F32).reshape(-1).view(np.uint8) for p in self._parts]
            if self._swap:   # (one part) its two halves exchanged
                half = raw[0].nbytes // 2
                raw = [raw[0][half:], raw[0][:half]]
            s = raw[0]
            if len(raw) > 1:     # joined on several threads: GBs of a diffusers Flux file
                s, at = np.empty(sum(r.nbytes for r in raw), np.uint8), 0
                for r in raw:
                    copy_into(s[at:at + r.nbytes], r)
                    at += r.nbytes
            # read-only as the file it was joined from: device backends cache a read-only
            # storage as a weight, a writeable one is an input copied in on every run
            s.flags.writeable = False
            Tensor.storage.__set__(self, s)
        return s

    @storage.setter
    def storage(self, value):
        Tensor.storage.__set__(self, value)


ADALN_FINAL = "final_layer.adaLN_modulation.1."


def join_split_parts(tensors: Mapping, prefix: str, parts_per_tensor: int | None = None) -> Mapping:
    """Diffusers tensors that sdrt.models.names split into `X`, `X.1`, `X.2`, ... (under `prefix`)
    joined back into X (rows in order, raw bytes as stored, made on first use); with
    `parts_per_tensor`, each X must have exactly that many. A table without parts is returned as is."""
    parts: dict = {}
    for name in tensors:
        m = SPLIT_PART.match(name) if name.startswith(prefix) else None
        if m:
            parts.setdefault(m.group(1), {})[int(m.group(2))] = tensors[name]
    if not parts:
        return tensors
    out = {k: v for k, v in tensors.items() if not (k.startswith(prefix) and SPLIT_PART.match(k))}
    for base, more in parts.items():
        n = len(more) if parts_per_tensor is None else parts_per_tensor - 1
        if base not in tensors or sorted(more) != list(range(1, n + 1)):
            raise ModelFileError(f"{base}: a split diffusers tensor with parts missing "
                                 f"(have {', '.join(['0'] * (base in tensors) + [str(i) for i in sorted(more)])})")
        out[base] = _JoinedLeaf([tensors[base]] + [more[i] for i in sorted(more)], False, base)
    return out


def join_diffusers_parts(tensors: Mapping, prefix: str = DM) -> Mapping:
    """A table converted from diffusers Flux names (split q/k/v(/mlp) parts) -> BFL tensors: the
    parts joined, and final_layer.adaLN_modulation.1 (diffusers' norm_out.linear, (scale, shift))
    with its halves exchanged into BFL's (shift, scale), as diffusers' own single-file conversion
    does (sd.cpp's name map only renames it). A table without parts is returned as is."""
    out = join_split_parts(tensors, prefix)
    if out is tensors:
        return tensors
    for leaf in ("weight", "bias"):
        name = prefix + ADALN_FINAL + leaf
        if name in out:
            out[name] = _JoinedLeaf([out[name]], True, name)
    return out


def flux_model(tensors, prefix: str, source: str) -> FluxDiffusion:
    from .diffusion.flux import FluxModel
    model = FluxModel(join_diffusers_parts(tensors, prefix), prefix, source=source)
    log.info("%s", model.config.summary())
    return FluxDiffusion(model)


# ---- Fill and Kontext ------------------------------------------------------------------------------

def flux_fill_concat(encode, init_t, mask_t, latent_mask, init_latent, width, height) -> ConcatLatents:
    """sd.cpp's VERSION_FLUX_FILL: [masked-image latent, the 8x8-folded pixel mask]; the uncond
    pass keeps the mask with a zero image latent; the denoise mask is dilated (inpaint models)."""
    from .diffusion.flux import fill_concat
    if init_t is not None:
        masked = encode((F32(1.0) - mask_t) * (init_t - F32(0.5)) + F32(0.5))
    else:
        masked = np.zeros_like(init_latent)
    f = height // init_latent.shape[2]
    return ConcatLatents(fill_concat(masked, mask_t, f), fill_concat(np.zeros_like(masked), mask_t, f),
                         dilate_mask=True)


def _refused(name: str, description: str, rules=()):
    return register_family(Family(name, {name: Variant()}, description, detect=rules, prediction="flux_flow",
                                  latent_channels=16, size_multiple=16, latent_scale=0.3611, latent_shift=0.1159,
                                  convert_diffusion_name=_names))


register_family(Family(
    "flux", {FLUX: Variant(), FLUX_FILL: Variant("fill"), CHROMA: Variant()}, "Flux",
    detect=((120, detect_flux),), text_encoders=("clip_l", "t5xxl"), te_layout="dit",
    convert_diffusion_name=_names, diffusers_te_prefixes={"te1.": "text_encoders.clip_l.transformer."},
    conditioner=flux_conditioner, diffusion_model=flux_model,
    latent_channels=16, vae_scale_factor=8, size_multiple=16, latent_scale=0.3611, latent_shift=0.1159,
    prediction="flux_flow", flow_shift=flux_flow_shift, default_sampler="euler", default_scheduler="flux",
    distilled_guidance=True, concat_builders={"fill": flux_fill_concat},
    modes=frozenset({"txt2img", "img2img", "inpaint", "ref_images"})))
_refused(CHROMA_RADIANCE, "Chroma Radiance", (marker(4, DM + "nerf_final_layer_conv.", CHROMA_RADIANCE),))
_refused(OVIS_IMAGE, "Ovis-Image", (marker(15, DM + "double_blocks.0.img_mlp.gate_proj.weight", OVIS_IMAGE),))
_refused(FLUX_CONTROLS, "Flux Controls")
_refused(FLEX_2, "Flex.2")
