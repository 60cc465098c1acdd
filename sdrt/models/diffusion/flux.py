"""The Flux.1 diffusion transformer (BFL flux/model.py; sd.cpp flux.hpp): Flux.1-dev/schnell,
Flux-Lite and other pruned depths, Fill (inpaint channels), Controls (control channels) and
Kontext (reference-image tokens).

Weights are BFL's names under `model.diffusion_model.` (sd.cpp's canonical layout; a table
without the prefix works with prefix=""): `img_in`, `txt_in`, `time_in.{in,out}_layer`,
`vector_in`, `guidance_in` (dev), `double_blocks.N.{img,txt}_{mod,attn,mlp}`,
`single_blocks.N.{linear1,linear2,norm,modulation}`, `final_layer.{linear,adaLN_modulation.1}`.
Diffusers folders are converted to these names by flux_names.diffusers_to_bfl.

`FluxConfig.detect_from_weights` reads everything from names and shapes: the block counts,
hidden size (txt_in), head width (the QK norm's scale: heads = hidden / head_dim), MLP width,
input channels (img_in: 64, Fill 384, Controls 128), guidance embedding, pooled-vector width.
The RoPE axes are [16, 56, 56] for 128-wide heads (every released Flux.1); other widths need
`axes_dim=` (small test models).

forward(x [N, C, h, w], timesteps [N] (sigma in [0, 1]; scaled by 1000 inside, as BFL's
timestep_embedding's time_factor), context [N, L, 4096], y [N, 768], guidance [N]) -> [N, C, h, w]:
pad h, w to even, patchify 2x2 -> img_in; txt_in(context); vec = time_in(emb(1000 t)) +
guidance_in(emb(1000 g)) + vector_in(y); double blocks on (img, txt); single blocks on [txt, img];
final layer on the img tokens; unpatchify, crop. RoPE ids: txt tokens (0, 0, 0), img tokens
(0, row, col), reference-latent tokens (1, row + h_off, col + w_off) (sd.cpp's gen_flux_ids,
ref index modes fixed / increase / decrease).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFileError, UnsupportedError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import GraphCache, batch_cond, check_weights, Linear, Weights
from .flux_blocks import (ChromaApproximator, DoubleStreamBlock, LastLayer, MLPEmbedder, SingleStreamBlock,
                          pad_to_patch, patchify, unpatchify)

__all__ = ["PREFIX", "FluxConfig", "FluxModel", "fill_concat", "flux_ids", "flux_pe", "REF_INDEX_MODES", "with_rope_axes"]

PREFIX = "model.diffusion_model."
REF_INDEX_MODES = ("fixed", "increase", "decrease")
CHROMA_MOD_INDEX = 344   # sd.cpp/Chroma: 3*38 single + 2*6*19 double + 2 final modulation vectors
CHROMA_MOD_LAYOUTS = ("sdcpp", "counted")

_UNSUPPORTED = {  # a tensor that names a Flux-like model sdrt does not run -> its name
    "double_stream_modulation_img.lin.weight": "Flux.2 (shared modulation)",
    "img_in_patch.weight": "Chroma Radiance (pixel-space NeRF head)",
    "nerf_image_embedder.embedder.0.weight": "Chroma Radiance (pixel-space NeRF head)",
    "dual_time_embed.": "SeFi-Image",
    "pulid_ca.0.": "Flux with PuLID",
    "txt_norm.scale": "Ovis-Image",
}


def with_rope_axes(cfg, overrides: dict, source: str):
    """A detected DiT config with the caller's `overrides` applied, its RoPE axes checked against
    the head width (Flux, Qwen-Image: axes (16, 56, 56) for 128-wide heads, else given)."""
    cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
    if sum(cfg.axes_dim) != cfg.head_dim or any(d % 2 for d in cfg.axes_dim):
        raise ModelFileError(f"{source}: head width {cfg.head_dim} needs RoPE axes of even sizes summing to it "
                             f"(got axes_dim={list(cfg.axes_dim)}; pass axes_dim= for non-128 heads)")
    return cfg


@dataclass(frozen=True)
class FluxConfig:
    in_channels: int = 64           # img_in width: latent channels * 4 (+ Fill/Controls concat)
    out_channels: int = 64          # final_layer.linear width: latent channels * 4
    vec_in_dim: int = 768           # pooled CLIP-L; 0: no vector_in (Chroma)
    context_in_dim: int = 4096      # T5-XXL
    hidden_size: int = 3072
    mlp_hidden: int = 12288
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: tuple = (16, 56, 56)
    theta: float = 10000.0
    guidance_embed: bool = True
    is_chroma: bool = False
    approx_hidden: int = 5120       # Chroma's distilled_guidance_layer width and depth
    approx_layers: int = 5
    chroma_mod_layout: str = "sdcpp"  # "sdcpp": 344 indices, offsets of 19/38 blocks; "counted": diffusers
    patch_size: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def latent_channels(self) -> int:
        return self.out_channels // (self.patch_size ** 2)

    @property
    def concat_channels(self) -> int:
        """Latent channels joined to x before patchify (Fill 80 = 16 masked + 64 mask, Controls 16)."""
        return (self.in_channels - self.out_channels) // (self.patch_size ** 2)

    def summary(self) -> str:
        kind = "chroma" if self.is_chroma else ("dev" if self.guidance_embed else "schnell")
        return (f"Flux ({kind}) hidden={self.hidden_size} heads={self.num_heads} depth={self.depth}+"
                f"{self.depth_single_blocks} in={self.in_channels} out={self.out_channels} "
                f"ctx={self.context_in_dim} vec={self.vec_in_dim} axes={list(self.axes_dim)}")

    @classmethod
    def detect_from_weights(cls, table: Mapping[str, Tensor], prefix: str = PREFIX, source: str = "model",
                            **overrides) -> FluxConfig:
        w = Weights(table, prefix, source)
        names = list(w.keys())
        for key, what in _UNSUPPORTED.items():
            if any(n.startswith(key) for n in names):
                raise UnsupportedError(f"{source}: {what} is not supported (found {prefix}{key}...)")
        depth = 1 + max((int(m.group(1)) for n in names if (m := _RE_DOUBLE.match(n))), default=-1)
        single = 1 + max((int(m.group(1)) for n in names if (m := _RE_SINGLE.match(n))), default=-1)
        ctx, hidden = w.shape("txt_in.weight")
        if depth:
            head_dim = w.shape("double_blocks.0.img_attn.norm.key_norm.scale")[0]
        elif single:
            head_dim = w.shape("single_blocks.0.norm.key_norm.scale")[0]
        else:
            raise ModelFileError(f"{source}: no double_blocks.N / single_blocks.N tensors under {prefix!r}")
        if hidden % head_dim:
            raise ModelFileError(f"{source}: hidden size {hidden} (txt_in) is not a multiple of the head width "
                                 f"{head_dim} (QK norm scale)")
        if depth:
            mlp = w.shape("double_blocks.0.img_mlp.0.weight")[1]
        else:
            mlp = w.shape("single_blocks.0.linear1.weight")[1] - 3 * hidden
        is_chroma = "distilled_guidance_layer.in_proj.weight" in w
        approx = {}
        if is_chroma:
            n = 1 + max((int(m.group(1)) for k in names if (m := _RE_APPROX.match(k))), default=-1)
            approx = dict(approx_hidden=w.shape("distilled_guidance_layer.in_proj.weight")[1], approx_layers=n)
        cfg = cls(**approx, in_channels=w.shape("img_in.weight")[0], out_channels=w.shape("final_layer.linear.weight")[1],
                  vec_in_dim=w.shape("vector_in.in_layer.weight")[0] if "vector_in.in_layer.weight" in w else 0,
                  context_in_dim=ctx, hidden_size=hidden, mlp_hidden=mlp, num_heads=hidden // head_dim,
                  depth=depth, depth_single_blocks=single, guidance_embed="guidance_in.in_layer.weight" in w,
                  is_chroma=is_chroma,
                  axes_dim=(16, 56, 56) if head_dim == 128 else ())
        return with_rope_axes(cfg, overrides, source)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """{BFL name (no prefix): torch shape} of every tensor this config uses."""
        s: dict[str, tuple[int, ...]] = {}
        H, M = self.hidden_size, self.mlp_hidden

        def lin(name, i, o):
            s[name + ".weight"], s[name + ".bias"] = (o, i), (o,)

        lin("img_in", self.in_channels, H)
        lin("txt_in", self.context_in_dim, H)
        if self.is_chroma:
            A, a = self.approx_hidden, "distilled_guidance_layer."
            lin(a + "in_proj", 64, A)
            for i in range(self.approx_layers):
                lin(f"{a}layers.{i}.in_layer", A, A)
                lin(f"{a}layers.{i}.out_layer", A, A)
                s[f"{a}norms.{i}.scale"] = (A,)
            lin(a + "out_proj", A, H)
        else:
            lin("time_in.in_layer", 256, H)
            lin("time_in.out_layer", H, H)
            if self.vec_in_dim:
                lin("vector_in.in_layer", self.vec_in_dim, H)
                lin("vector_in.out_layer", H, H)
            if self.guidance_embed:
                lin("guidance_in.in_layer", 256, H)
                lin("guidance_in.out_layer", H, H)
        D = self.head_dim
        for i in range(self.depth):
            b = f"double_blocks.{i}."
            for st in ("img", "txt"):
                if not self.is_chroma:
                    lin(b + st + "_mod.lin", H, 6 * H)
                lin(b + st + "_attn.qkv", H, 3 * H)
                lin(b + st + "_attn.proj", H, H)
                s[b + st + "_attn.norm.query_norm.scale"] = (D,)
                s[b + st + "_attn.norm.key_norm.scale"] = (D,)
                lin(b + st + "_mlp.0", H, M)
                lin(b + st + "_mlp.2", M, H)
        for i in range(self.depth_single_blocks):
            b = f"single_blocks.{i}."
            lin(b + "linear1", H, 3 * H + M)
            lin(b + "linear2", H + M, H)
            s[b + "norm.query_norm.scale"] = (D,)
            s[b + "norm.key_norm.scale"] = (D,)
            if not self.is_chroma:
                lin(b + "modulation.lin", H, 3 * H)
        lin("final_layer.linear", H, self.out_channels)
        if not self.is_chroma:
            lin("final_layer.adaLN_modulation.1", H, 2 * H)
        return s


_RE_DOUBLE = re.compile(r"double_blocks\.(\d+)\.")
_RE_SINGLE = re.compile(r"single_blocks\.(\d+)\.")
_RE_APPROX = re.compile(r"distilled_guidance_layer\.layers\.(\d+)\.")


def find_prefix(table: Mapping[str, Tensor]) -> str:
    """The prefix under which a table holds BFL Flux names (`model.diffusion_model.`, ``, ...)."""
    for name in table:
        if name.endswith("txt_in.weight"):
            return name[: -len("txt_in.weight")]
    raise ModelFileError("no Flux transformer here: no tensor named '...txt_in.weight'")


# ---- RoPE ids and pe (sd.cpp rope.hpp, in its float32 arithmetic) ---------------------------------
def flux_ids(h: int, w: int, context_len: int, refs: Sequence[tuple[int, int]] = (), patch: int = 2,
             ref_index_mode: str = "fixed") -> np.ndarray:
    """float32 [tokens, 3]: txt (0, 0, 0) x context_len, img (0, row, col) for the (h/p, w/p)
    patches, then each reference latent's patches (index, row + h_off, col + w_off). `h`, `w`
    and `refs` ((h, w) per reference) are latent sizes. Offsets as sd.cpp's gen_refs_ids: in
    'fixed' mode every reference has index 1 and is placed beside the earlier ones (offsets in
    latent pixels, as sd.cpp); 'increase'/'decrease' step the index and keep offsets 0."""
    if ref_index_mode not in REF_INDEX_MODES:
        raise UsageError(f"unknown ref index mode {ref_index_mode!r}; modes: {', '.join(REF_INDEX_MODES)}")

    def grid(hh, ww, index, h_off, w_off):
        hl, wl = (hh + patch // 2) // patch, (ww + patch // 2) // patch
        ids = np.zeros((hl, wl, 3), np.float32)
        ids[..., 0] = index
        ids[..., 1] = (np.arange(hl, dtype=np.float32) + np.float32(h_off))[:, None]
        ids[..., 2] = (np.arange(wl, dtype=np.float32) + np.float32(w_off))[None, :]
        return ids.reshape(-1, 3)

    parts = [np.zeros((context_len, 3), np.float32), grid(h, w, 0, 0, 0)]
    index, cur_h, cur_w = 1, 0, 0
    for rh, rw in refs:
        h_off = w_off = 0
        if ref_index_mode == "fixed":
            if rh + cur_h > rw + cur_w:
                w_off = cur_w
            else:
                h_off = cur_h
        elif ref_index_mode == "decrease":
            index -= 1
        parts.append(grid(rh, rw, index, h_off, w_off))
        if ref_index_mode == "increase":
            index += 1
        cur_h, cur_w = max(cur_h, rh + h_off), max(cur_w, rw + w_off)
    return np.concatenate(parts)


def flux_pe(ids: np.ndarray, axes_dim: Sequence[int], theta: float = 10000.0) -> np.ndarray:
    """float32 (tokens, head_dim/2, 2, 2): [[cos, -sin], [sin, cos]] per token and rotated pair,
    the axes' pairs in order (sd.cpp embed_nd; F.rope's pe). Angle of pair j of an axis of
    width d: pos * theta^(-2j/d)."""
    ids = np.asarray(ids, np.float32)
    cols = []
    for i, d in enumerate(axes_dim):
        half = d // 2
        step = np.float32(np.float32(d - 2) / np.float32(d)) / np.float32(half - 1) if half > 1 else np.float32(0)
        scale = np.arange(half, dtype=np.float32) * step
        omega = (np.float32(1.0) / np.power(np.float32(theta), scale)).astype(np.float32)
        cols.append(ids[:, i:i + 1] * omega[None, :])
    ang = np.concatenate(cols, axis=1).astype(np.float32)
    c, s = np.cos(ang), np.sin(ang)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)


def fill_concat(masked_latent: np.ndarray, mask: np.ndarray, factor: int = 8) -> np.ndarray:
    """Flux Fill's c_concat: the masked image's latent [N, 16, h, w] (the VAE latent of the image
    with the masked area grey — sd.cpp: (1 - mask) * (image - 0.5) + 0.5 in [0, 1]) joined with
    the pixel mask [N, H, W] (1 = inpaint) folded into factor^2 channels: channel 8*py + px of
    latent pixel (y, x) is mask[8y + py, 8x + px] (sd.cpp's reshape/permute; diffusers'
    FluxFillPipeline.prepare_mask_latents) -> [N, 16 + 64, h, w]."""
    masked_latent = np.asarray(masked_latent, np.float32)
    mask = np.asarray(mask, np.float32)
    if mask.ndim == 4 and mask.shape[1] == 1:
        mask = mask[:, 0]
    N, _, h, w = masked_latent.shape
    if mask.shape != (N, h * factor, w * factor):
        raise UsageError(f"Flux Fill: mask shape {mask.shape} must be (N, {h * factor}, {w * factor}) for a "
                         f"latent of {h}x{w}")
    folded = mask.reshape(N, h, factor, w, factor).transpose(0, 2, 4, 1, 3).reshape(N, factor * factor, h, w)
    return np.concatenate([masked_latent, folded], axis=1)


# ---- the model -------------------------------------------------------------------------------
class FluxModel:
    """FluxModel(table, prefix, config=None): blocks over the table's weights (any dtype the ops
    take). `forward` builds the graph on ne-order Tensors; `__call__` runs it on numpy."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = PREFIX, config: FluxConfig | None = None,
                 source: str = "model", cut_points: bool = True):
        cfg = config or FluxConfig.detect_from_weights(table, prefix, source)
        self.config, self.prefix, self.source, self.cut_points = cfg, prefix, source, cut_points
        check_weights(table, prefix, cfg.weight_shapes(), source, "Flux", missing_detail=cfg.summary())
        w = Weights(table, prefix, source)
        H, nh = cfg.hidden_size, cfg.num_heads
        self.img_in, self.txt_in = Linear(w.sub("img_in.")), Linear(w.sub("txt_in."))
        if cfg.is_chroma:
            self.approximator = ChromaApproximator(w.sub("distilled_guidance_layer."))
            self.time_in = self.vector_in = self.guidance_in = None
        else:
            self.approximator = None
            self.time_in = MLPEmbedder(w.sub("time_in."))
            self.vector_in = MLPEmbedder(w.sub("vector_in.")) if cfg.vec_in_dim else None
            self.guidance_in = MLPEmbedder(w.sub("guidance_in.")) if cfg.guidance_embed else None
        self.double_blocks = [DoubleStreamBlock(w.sub(f"double_blocks.{i}."), nh) for i in range(cfg.depth)]
        self.single_blocks = [SingleStreamBlock(w.sub(f"single_blocks.{i}."), nh, H)
                              for i in range(cfg.depth_single_blocks)]
        self.final_layer = LastLayer(w.sub("final_layer."))
        self._graphs = GraphCache()

    # ---- graph ------------------------------------------------------------------------------
    def forward(self, x: Tensor, timesteps: Tensor, context: Tensor, y: Tensor | None = None,
                guidance: Tensor | None = None, pe: Tensor | None = None, c_concat: Tensor | None = None,
                ref_latents: Sequence[Tensor] = (), ref_index_mode: str = "fixed",
                txt_mask: Tensor | None = None) -> Tensor:
        """x [w, h, C, N], timesteps F32 [N] (sigmas), context [4096, L, N], y [768, N], guidance
        F32 [N] (dev), c_concat [w, h, Cc, N] (Fill: masked latent + 64 mask channels; Controls:
        the control latent), ref_latents [w_r, h_r, C, N] (Kontext); pe (tokens, D/2, 2, 2) as
        F32 [2, 2, D/2, tokens] or None to build it; txt_mask F32 [L, N] (Chroma: added to the
        attention scores of the text keys, 0 keep / -inf drop; image keys get 0) -> F32 [w, h, C, N]."""
        cfg = self.config
        W, Hh, C, N = x.ne4
        p = cfg.patch_size
        if C != cfg.latent_channels:
            raise UsageError(f"Flux: x has {C} channels, the model takes {cfg.latent_channels}")
        img = patchify(pad_to_patch(x, p), p)                                   # [C*4, Li, N]
        Li = img.ne[1]
        if c_concat is not None:
            if c_concat.ne4[:2] != (W, Hh) or c_concat.ne4[3] != N:
                raise UsageError(f"Flux: c_concat ne {list(c_concat.ne)} does not match x ne {list(x.ne)}")
            img = F.concat(img, patchify(pad_to_patch(c_concat, p), p), 0)
        if img.ne[0] != cfg.in_channels:
            raise UsageError(f"Flux: {img.ne[0] // (p * p)} latent channels reach img_in (x + c_concat), the model "
                             f"takes {cfg.in_channels // (p * p)} ({cfg.concat_channels} to concatenate)")
        refs = []
        for r in ref_latents:
            if r.ne4[2] != cfg.latent_channels or r.ne4[3] != N:
                raise UsageError(f"Flux: a reference latent has ne {list(r.ne)}, needs {cfg.latent_channels} "
                                 f"channels and batch {N}")
            rt = patchify(pad_to_patch(r, p), p)
            if c_concat is not None:   # sd.cpp: refs join after the concat; they carry no concat channels
                raise UsageError("Flux: reference latents with c_concat (Fill/Controls) are not supported")
            refs.append(rt)
        if refs:
            img = F.concat_many([img] + refs, 1)                                # [C*4, Li + Lr, N]
        if context.ne[0] != cfg.context_in_dim:
            raise UsageError(f"Flux: context has width {context.ne[0]}, the model takes {cfg.context_in_dim}")
        context = batch_cond(context, N, "Flux: context")
        y = batch_cond(y, N, "Flux: y") if y is not None else None
        txt_mask = batch_cond(txt_mask, N, "Flux: txt_mask") if txt_mask is not None else None
        Lt = context.ne[1]
        if pe is None:
            ids = flux_ids(Hh, W, Lt, [(r.ne[1], r.ne[0]) for r in ref_latents], p, ref_index_mode)
            pe = Tensor.from_numpy(flux_pe(ids, cfg.axes_dim, cfg.theta), name="flux_pe")
        if pe.ne4[3] != Lt + img.ne[1]:
            raise UsageError(f"Flux: pe has {pe.ne4[3]} tokens, the sequence has {Lt + img.ne[1]}")
        if timesteps.nelements != N:
            raise UsageError(f"Flux: {timesteps.nelements} timesteps for a batch of {N}")

        img = self.img_in(img)                                                  # [H, Li(+Lr), N]
        txt = self.txt_in(context)                                              # [H, Lt, N]
        mask = None
        if cfg.is_chroma:
            vec_silu = None
            single_mods, double_mods, final_mods = self._chroma_mods(timesteps, N)
            if txt_mask is not None:
                if txt_mask.ne4[:2] != (Lt, N):
                    raise UsageError(f"Flux: txt_mask has ne {list(txt_mask.ne)}, needs [{Lt}, {N}]")
                mask = F.pad(txt_mask.reshape(Lt, 1, 1, N), [(0, img.ne[1])])      # [Lt + Li, 1, 1, N]
        else:
            if txt_mask is not None:
                raise UsageError("Flux: txt_mask is Chroma's; this model has no DiT mask")
            single_mods = double_mods = final_mods = None
            vec_silu = F.silu(self._vec(timesteps, y, guidance, N))                 # every modulation's input
        cut = self._cut
        img, txt = cut(img, "flux.prelude.img"), cut(txt, "flux.prelude.txt")
        if vec_silu is not None:
            vec_silu = cut(vec_silu, "flux.prelude.vec")
        for i, blk in enumerate(self.double_blocks):
            img, txt = blk(img, txt, vec_silu, pe, double_mods[i] if double_mods else None, mask)
            txt, img = cut(txt, f"flux.double_blocks.{i}.txt"), cut(img, f"flux.double_blocks.{i}.img")
        h = F.concat(txt, img, 1)                                               # [H, Lt + Li, N]
        for i, blk in enumerate(self.single_blocks):
            h = cut(blk(h, vec_silu, pe, single_mods[i] if single_mods else None, mask), f"flux.single_blocks.{i}")
        out = self.final_layer(h.slice(1, Lt, Lt + Li), vec_silu, final_mods)   # [C*4, Li, N]
        hl, wl = (Hh + p - 1) // p, (W + p - 1) // p
        out = unpatchify(out, hl, wl, p)                                        # [wl*p, hl*p, C, N]
        if out.ne[0] != W or out.ne[1] != Hh:
            out = F.cont(out.slice(0, 0, W).slice(1, 0, Hh))
        return out

    def _vec(self, timesteps: Tensor, y: Tensor | None, guidance: Tensor | None, N: int) -> Tensor:
        """time_in(emb(1000 t)) + guidance_in(emb(1000 g)) + vector_in(y): [H, N]."""
        cfg = self.config
        vec = self.time_in(F.timestep_embedding(F.scale(timesteps, 1000.0), 256))  # [H, N]
        if self.guidance_in is not None:
            if guidance is None:
                raise UsageError("Flux: this model (dev: guidance_in) needs a guidance value")
            vec = F.add(vec, self.guidance_in(F.timestep_embedding(F.scale(guidance, 1000.0), 256)))
        if self.vector_in is not None:
            if y is None:
                raise UsageError(f"Flux: this model needs the pooled text vector y [{cfg.vec_in_dim}, N]")
            if y.ne[0] != cfg.vec_in_dim or y.ne4[1] != N:
                raise UsageError(f"Flux: y has ne {list(y.ne)}, needs [{cfg.vec_in_dim}, {N}]")
            vec = F.add(vec, self.vector_in(y))
        return vec

    def _chroma_mods(self, timesteps: Tensor, N: int):
        """Chroma: the approximator maps [emb16(1000 t), emb16(0), emb32(1000 j)] for each
        modulation index j to that index's vector (views [H, 1, N]; sd.cpp and diffusers feed
        guidance 0 here). Returns (single, double, final) modulations: single block i takes
        indices 3i..3i+2, double block i takes 3S + 6i.. (img) and 3S + 6D + 6i.. (txt), the final
        layer the last two (shift, scale). `chroma_mod_layout` "sdcpp" is sd.cpp's flux.hpp:
        344 indices with S=38, D=19 whatever the file holds; "counted" is diffusers' (and the
        layout of a pruned file's training): 3S + 12D + 2 indices, S and D counted. For the
        released 19/38-block Chroma both are the same."""
        cfg = self.config
        S, D = cfg.depth_single_blocks, cfg.depth
        if cfg.chroma_mod_layout == "sdcpp":
            n, So, Do = CHROMA_MOD_INDEX, 38, 19
            if S > So or D > Do:
                raise ModelFileError(f"{self.source}: Chroma with {D} double / {S} single blocks does not fit sd.cpp's "
                                     "modulation layout (19 / 38); use chroma_mod_layout='counted'")
        elif cfg.chroma_mod_layout == "counted":
            n, So, Do = 3 * S + 12 * D + 2, S, D
        else:
            raise UsageError(f"chroma_mod_layout={cfg.chroma_mod_layout!r}: choose from {', '.join(CHROMA_MOD_LAYOUTS)}")
        t = F.timestep_embedding(F.scale(timesteps, 1000.0), 16)                 # [16, N]
        g = F.timestep_embedding(Tensor.from_numpy(np.zeros(N, np.float32)), 16)  # [16, N] (guidance 0)
        tg = F.repeat(F.concat(t, g, 0).reshape(32, 1, N), (32, n, N))          # [32, n, N]
        idx = F.timestep_embedding(F.scale(F.arange(n), 1000.0), 32)             # [32, n]
        idx = F.repeat(idx.reshape(32, n, 1), (32, n, N)) if N > 1 else idx.reshape(32, n, 1)
        vec = self.approximator(F.concat(tg, idx, 0))                            # [H, n, N]
        H, es = cfg.hidden_size, vec.nb[0]
        m = lambda j: vec.view((H, 1, N), (es, vec.nb[1], vec.nb[2]), offset=j * vec.nb[1])  # noqa: E731
        single = [[m(3 * i + k) for k in range(3)] for i in range(S)]
        double = [([m(3 * So + 6 * i + k) for k in range(6)], [m(3 * So + 6 * Do + 6 * i + k) for k in range(6)])
                  for i in range(D)]
        return single, double, [m(n - 2), m(n - 1)]

    def _cut(self, t: Tensor, name: str) -> Tensor:
        return F.mark_cut(t, name) if self.cut_points else t

    # ---- numpy ------------------------------------------------------------------------------
    def __call__(self, x_np, t_np, context_np, y_np=None, guidance_np=None, c_concat_np=None,
                 ref_latents_np: Sequence = (), ref_index_mode: str = "fixed", txt_mask_np=None,
                 backend: str = "cpu") -> np.ndarray:
        """Torch-order numpy: x [N, C, h, w], t [N], context [N, L, 4096], y [N, 768], guidance [N],
        c_concat [N, Cc, h, w], ref latents [N, C, h_r, w_r], txt_mask [N, L] (Chroma, additive)
        -> float32 [N, C, h, w]. The graph of each input shape is built once and reused (inputs are
        copied into its leaves)."""
        arrays = [x_np, t_np, context_np, y_np, guidance_np, c_concat_np, txt_mask_np] + list(ref_latents_np)
        arrays = [None if a is None else np.asarray(a, dtype=np.float32) for a in arrays]
        if arrays[0].ndim != 4:
            raise UsageError(f"Flux: x must be [N, C, H, W], got shape {arrays[0].shape}")
        N = arrays[0].shape[0]
        for i in (1, 4):
            if arrays[i] is not None:
                arrays[i] = np.broadcast_to(arrays[i].reshape(-1), (N,)).copy() if arrays[i].size == 1 else arrays[i].reshape(-1)
        def build(v):
            return self.forward(v[0], v[1], v[2], v[3], v[4], c_concat=v[5], ref_latents=v[7:],
                                ref_index_mode=ref_index_mode, txt_mask=v[6])
        return self._graphs.run(arrays, build, backend, extra=(ref_index_mode,))

