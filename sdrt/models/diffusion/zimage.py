"""The Z-Image transformer (Tongyi's single-stream DiT, Lumina-2 lineage), as stable-diffusion.cpp's
z_image.hpp and diffusers' ZImageTransformer2DModel compute it.

    from sdrt.models.diffusion.zimage import ZImageModel
    m = ZImageModel(table, "model.diffusion_model.")       # shape read from the weights
    v = m(x, t, context)     # x [N, 16, h, w], t [N] (sigma * 1000), context [N, L, 2560] -> [N, 16, h, w]

Weights (sd.cpp's / the original names; diffusers names are converted by sdrt.models.zimage):
    x_embedder.{weight,bias}                 ne=[2*2*16, H]
    t_embedder.mlp.{0,2}.{weight,bias}       256 -> min(H, 1024) -> 256
    cap_embedder.0.weight (RMS norm), cap_embedder.1.{weight,bias}     ne=[cap_dim], [cap_dim, H]
    cap_pad_token, x_pad_token               [H]
    {noise_refiner, context_refiner, layers}.N.
        attention.qkv.weight  ne=[H, (heads + 2 kv) * 128]    attention.out.weight
        attention.{q_norm,k_norm}.weight  [128]
        attention_norm{1,2}.weight, ffn_norm{1,2}.weight      [H]
        feed_forward.{w1,w3}.weight ne=[H, F], feed_forward.w2.weight ne=[F, H]
        adaLN_modulation.0.{weight,bias} ne=[256, 4H]   (not in context_refiner)
    final_layer.adaLN_modulation.1.{weight,bias} ne=[256, H], final_layer.linear.{weight,bias}
Depth (main layers, noise and context refiner layers), width, heads (width / the q_norm width),
kv heads, FFN size, caption width and the timestep MLP come from the weights; the released model is
30 + 2 + 2 layers, width 3840, 30 heads of 128, FFN 10240, captions 2560 (Qwen3-4B). Patch 2,
RoPE axes (32, 48, 48) with theta 256 and the sequence padding to multiples of 32 are fixed, as
in both references.

Forward: img = x_embedder(patchify(x)) (patch features in (ph, pw, C) order), txt =
cap_embedder(context); each padded to a multiple of 32 tokens with its learned pad token; the
context refiner runs on txt (no modulation), the noise refiner on img (modulated by the timestep
embedding t_emb = t_embedder(emb(1000 - t))), then the main layers on [txt, img] and the final
layer; the image tokens are unpatchified and negated (sd.cpp returns -v; diffusers' pipeline
negates). RoPE ids: text token i (i+1, 0, 0) including its pads, image patch (Lt_pad + 1, row,
col), image pads (0, 0, 0); interleaved pairs. A block: x += tanh(g1) * rms2(attn(rms1(x) *
(1 + s1))), x += tanh(g2) * rms4(ffn(rms3(x) * (1 + s2))) with (s1, g1, s2, g2) =
adaLN_modulation(t_emb); the context refiner the same without modulation. RMS norms eps 1e-5;
q/k norms eps 1e-6 (sd.cpp; diffusers uses 1e-5, `qk_eps`), final LayerNorm eps 1e-6 without
affine; FFN w2(silu(w1 x) * w3 x).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import GraphCache, Linear, Weights, batch_cond
from .flux import flux_pe
from .flux_blocks import chunks, pad_to_patch, patchify, unpatchify

__all__ = ["PREFIX", "ZImageConfig", "ZImageModel", "zimage_ids"]

PREFIX = "model.diffusion_model."
SEQ_MULTI_OF = 32
PATCH = 2
AXES_DIM = (32, 48, 48)
THETA = 256.0


@dataclass(frozen=True)
class ZImageConfig:
    hidden: int = 3840
    layers: int = 30
    noise_refiner_layers: int = 2
    context_refiner_layers: int = 2
    heads: int = 30
    kv_heads: int = 30
    head_dim: int = 128
    ffn: int = 10240
    in_channels: int = 16
    out_channels: int = 16
    cap_dim: int = 2560
    t_freq: int = 256
    adaln_dim: int = 256
    norm_eps: float = 1e-5
    qk_eps: float = 1e-6

    def summary(self) -> str:
        return (f"Z-Image DiT: {self.layers} layers + {self.noise_refiner_layers}/{self.context_refiner_layers} "
                f"noise/context refiner, width {self.hidden}, {self.heads} heads ({self.kv_heads} kv) x "
                f"{self.head_dim}, FFN {self.ffn}, captions {self.cap_dim}")

    def with_(self, **kw) -> ZImageConfig:
        return replace(self, **kw)

    @classmethod
    def detect_from_weights(cls, table: Mapping[str, Tensor], prefix: str = PREFIX,
                            source: str = "model") -> ZImageConfig:
        w = Weights(table, prefix, source)

        def count(stem):
            idx = sorted({int(m.group(1)) for k in w.keys() if (m := re.match(re.escape(stem) + r"(\d+)\.", k))})
            if idx != list(range(len(idx))):
                missing = sorted(set(range(idx[-1] + 1)) - set(idx))
                raise ModelFileError(f"{source}: {prefix}{stem}{missing[0]} is missing (0..{idx[-1]} expected)")
            return len(idx)

        xe = w.shape("x_embedder.weight")
        H = xe[1]
        layers = count("layers.")
        if layers == 0:
            raise ModelFileError(f"{source}: no Z-Image layers (layers.N) under {prefix!r}")
        hd = w.shape("layers.0.attention.q_norm.weight")[0]
        if hd != sum(AXES_DIM) or H % hd:
            raise ModelFileError(f"{source}: Z-Image heads of {hd} channels with width {H}: the RoPE axes "
                                 f"{AXES_DIM} need heads of {sum(AXES_DIM)} and a width that is a multiple of it")
        heads = H // hd
        qkv = w.shape("layers.0.attention.qkv.weight")[1] // hd
        if (qkv - heads) % 2 or qkv <= heads:
            raise ModelFileError(f"{source}: {prefix}layers.0.attention.qkv.weight has {qkv * hd} outputs: not "
                                 f"{heads} query heads and 2x some kv heads of {hd}")
        t0 = w.shape("t_embedder.mlp.0.weight")
        return cls(hidden=H, layers=layers, noise_refiner_layers=count("noise_refiner."),
                   context_refiner_layers=count("context_refiner."), heads=heads, kv_heads=(qkv - heads) // 2,
                   head_dim=hd, ffn=w.shape("layers.0.feed_forward.w1.weight")[1],
                   in_channels=xe[0] // (PATCH * PATCH),
                   out_channels=w.shape("final_layer.linear.weight")[1] // (PATCH * PATCH),
                   cap_dim=w.shape("cap_embedder.1.weight")[0], t_freq=t0[0],
                   adaln_dim=w.shape("t_embedder.mlp.2.weight")[1])


def zimage_ids(h: int, w: int, context_len: int) -> np.ndarray:
    """float32 [Lt_pad + Li_pad, 3]: sd.cpp's gen_z_image_ids for latent size (h, w)."""
    lt = context_len + (-context_len) % SEQ_MULTI_OF
    txt = np.zeros((lt, 3), np.float32)
    txt[:, 0] = np.arange(1, lt + 1, dtype=np.float32)
    hl, wl = (h + PATCH // 2) // PATCH, (w + PATCH // 2) // PATCH
    img = np.zeros((hl, wl, 3), np.float32)
    img[..., 0] = lt + 1
    img[..., 1] = np.arange(hl, dtype=np.float32)[:, None]
    img[..., 2] = np.arange(wl, dtype=np.float32)[None, :]
    li = hl * wl
    pad = np.zeros(((-li) % SEQ_MULTI_OF, 3), np.float32)
    return np.concatenate([txt, img.reshape(-1, 3), pad])


def _check(w: Weights, key: str, ne: tuple) -> Tensor:
    t = w[key]
    if tuple(t.ne) != tuple(ne) and not (len(ne) == 1 and t.nelements == ne[0]):
        raise ModelFileError(f"{w.source}: {w.prefix}{key} has shape ne={t.ne}, expected ne={tuple(ne)}")
    return t


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.mul(F.rms_norm(x, eps), weight)


class _Block:
    """JointTransformerBlock (`modulation`: the noise refiner and the main layers)."""

    def __init__(self, w: Weights, cfg: ZImageConfig, modulation: bool):
        H, D, F_ = cfg.hidden, cfg.head_dim, cfg.ffn
        self.cfg, self.modulation = cfg, modulation
        a = w.sub("attention.")
        _check(a, "qkv.weight", (H, (cfg.heads + 2 * cfg.kv_heads) * D))
        _check(a, "out.weight", (cfg.heads * D, H))
        self.qkv, self.out = Linear(a.sub("qkv."), bias=False), Linear(a.sub("out."), bias=False)
        self.q_norm, self.k_norm = _check(a, "q_norm.weight", (D,)), _check(a, "k_norm.weight", (D,))
        self.norms = [_check(w, f"{n}.weight", (H,)) for n in ("attention_norm1", "attention_norm2",
                                                                "ffn_norm1", "ffn_norm2")]
        f = w.sub("feed_forward.")
        for n, ne in (("w1", (H, F_)), ("w3", (H, F_)), ("w2", (F_, H))):
            _check(f, f"{n}.weight", ne)
        self.w1, self.w2, self.w3 = (Linear(f.sub(n + "."), bias=False) for n in ("w1", "w2", "w3"))
        if modulation:
            _check(w, "adaLN_modulation.0.weight", (cfg.adaln_dim, 4 * H))
            self.adaln = Linear(w.sub("adaLN_modulation.0."))

    def attention(self, x: Tensor, pe: Tensor) -> Tensor:
        cfg = self.cfg
        D, Hq, K = cfg.head_dim, cfg.heads, cfg.kv_heads
        t = self.qkv(x)                                              # [(Hq + 2K) * D, L, N]
        es, L, N = t.nb[0], t.ne[1], t.ne4[2]
        nb = (es, es * D, t.nb[1], t.nb[1] * L)
        q = t.view((D, Hq, L, N), nb, offset=0)
        k = t.view((D, K, L, N), nb, offset=Hq * D * es)
        v = t.view((D, K, L, N), nb, offset=(Hq + K) * D * es)
        q = F.rope(_rms(q, self.q_norm, cfg.qk_eps), pe).reshape(D, L, Hq, N)
        k = F.rope(_rms(k, self.k_norm, cfg.qk_eps), pe).reshape(D, L, K, N)
        out = F.attention(q, k, v.permute(0, 2, 1, 3))               # [D, L, Hq, N]
        return self.out(F.cont(out.permute(0, 2, 1, 3)).reshape(D * Hq, L, N))

    def __call__(self, x: Tensor, pe: Tensor, t_emb: Tensor | None = None) -> Tensor:
        eps = self.cfg.norm_eps
        n1, n2, n3, n4 = self.norms
        if self.modulation:
            scale_msa, gate_msa, scale_mlp, gate_mlp = chunks(self.adaln(t_emb), 4)   # [H, 1, N] views
            h = _rms(x, n1, eps)
            h = self.attention(F.mul(h, F.scale(scale_msa, 1.0, 1.0)), pe)
            x = F.add(x, F.mul(_rms(h, n2, eps), F.tanh(gate_msa)))
            h = F.mul(_rms(x, n3, eps), F.scale(scale_mlp, 1.0, 1.0))
            h = self.w2(F.mul(F.silu(self.w1(h)), self.w3(h)))
            return F.add(x, F.mul(_rms(h, n4, eps), F.tanh(gate_mlp)))
        x = F.add(x, _rms(self.attention(_rms(x, n1, eps), pe), n2, eps))
        h = _rms(x, n3, eps)
        return F.add(x, _rms(self.w2(F.mul(F.silu(self.w1(h)), self.w3(h))), n4, eps))


def _patch_tokens(x: Tensor) -> Tensor:
    """[W, H, C, N] -> tokens [C*4, L, N] with features in (ph, pw, C) order, C fastest
    (sd.cpp's patchify with patch_last=false; diffusers' ZImage patchify)."""
    t = patchify(pad_to_patch(x, PATCH), PATCH)                       # [(pw, ph) fastest, C] per token
    C, L, N = t.ne[0] // (PATCH * PATCH), t.ne[1], t.ne4[2]
    return F.cont(t.reshape(PATCH * PATCH, C, L, N).permute(1, 0, 2, 3)).reshape(C * PATCH * PATCH, L, N)


def _tokens_to_image(t: Tensor, h: int, w: int) -> Tensor:
    C, L, N = t.ne[0] // (PATCH * PATCH), t.ne[1], t.ne4[2]
    t = F.cont(t.reshape(C, PATCH * PATCH, L, N).permute(1, 0, 2, 3)).reshape(C * PATCH * PATCH, L, N)
    return unpatchify(t, h, w, PATCH)


class ZImageModel:
    """ZImageModel(table, prefix, config=None); `forward` builds the graph, `__call__` runs it on numpy."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = PREFIX, config: ZImageConfig | None = None,
                 source: str = "model", cut_points: bool = True):
        cfg = config or ZImageConfig.detect_from_weights(table, prefix, source)
        self.config, self.prefix, self.source, self.cut_points = cfg, prefix, source, cut_points
        w = Weights(table, prefix, source)
        H = cfg.hidden
        _check(w, "x_embedder.weight", (cfg.in_channels * PATCH * PATCH, H))
        self.x_embedder = Linear(w.sub("x_embedder."))
        self.t0, self.t2 = Linear(w.sub("t_embedder.mlp.0.")), Linear(w.sub("t_embedder.mlp.2."))
        self.cap_norm = _check(w, "cap_embedder.0.weight", (cfg.cap_dim,))
        _check(w, "cap_embedder.1.weight", (cfg.cap_dim, H))
        self.cap_embedder = Linear(w.sub("cap_embedder.1."))
        self.cap_pad, self.x_pad = _check(w, "cap_pad_token", (H,)), _check(w, "x_pad_token", (H,))
        self.noise_refiner = [_Block(w.sub(f"noise_refiner.{i}."), cfg, True) for i in range(cfg.noise_refiner_layers)]
        self.context_refiner = [_Block(w.sub(f"context_refiner.{i}."), cfg, False)
                                for i in range(cfg.context_refiner_layers)]
        self.layers = [_Block(w.sub(f"layers.{i}."), cfg, True) for i in range(cfg.layers)]
        _check(w, "final_layer.adaLN_modulation.1.weight", (cfg.adaln_dim, H))
        self.final_adaln = Linear(w.sub("final_layer.adaLN_modulation.1."))
        _check(w, "final_layer.linear.weight", (H, cfg.out_channels * PATCH * PATCH))
        self.final_linear = Linear(w.sub("final_layer.linear."))
        self._graphs = GraphCache()

    def _cut(self, t: Tensor, name: str) -> Tensor:
        return F.mark_cut(t, name) if self.cut_points else t

    @staticmethod
    def _pad(t: Tensor, token: Tensor) -> Tensor:
        C, L, N = t.ne[0], t.ne[1], t.ne4[2]
        n = (-L) % SEQ_MULTI_OF
        if not n:
            return t
        token = token if token.dtype.name == "F32" else F.cast(token, "F32")
        return F.concat(t, F.repeat(token.reshape(C, 1, 1), (C, n, N)), 1)

    def forward(self, x: Tensor, timesteps: Tensor, context: Tensor) -> Tensor:
        """x [w, h, C, N], timesteps F32 [N] (sigma * 1000), context [cap_dim, L, 1 or N] -> the
        negated velocity F32 [w, h, C, N] (sd.cpp's output)."""
        cfg = self.config
        W, Hh, C, N = x.ne4
        if C != cfg.in_channels:
            raise UsageError(f"Z-Image: x has {C} channels, the model takes {cfg.in_channels}")
        if context.ne[0] != cfg.cap_dim:
            raise UsageError(f"Z-Image: context has width {context.ne[0]}, the model takes {cfg.cap_dim} "
                             "(the hidden size of its LLM text encoder)")
        if timesteps.nelements != N:
            raise UsageError(f"Z-Image: {timesteps.nelements} timesteps for a batch of {N}")
        context = batch_cond(context, N, "Z-Image: context")
        Lt = context.ne[1]
        # t_embedder(emb(1000 - t)): 1000 - t as sd.cpp's timestep for Z-Image
        t = F.scale(timesteps, -1.0, 1000.0)
        t_emb = self.t2(F.silu(self.t0(F.timestep_embedding(t, cfg.t_freq))))            # [adaln, N]
        img = self.x_embedder(_patch_tokens(x))                                          # [H, Li, N]
        Li = img.ne[1]
        txt = self.cap_embedder(_rms(context, self.cap_norm, cfg.norm_eps))              # [H, Lt, N]
        txt, img = self._pad(txt, self.cap_pad), self._pad(img, self.x_pad)
        lt = txt.ne[1]
        pe_np = flux_pe(zimage_ids(Hh, W, Lt), AXES_DIM, THETA)
        pe = Tensor.from_numpy(pe_np, name="zimage_pe")                                  # [2, 2, 64, lt + li]
        pe_txt = Tensor.from_numpy(np.ascontiguousarray(pe_np[:lt]), name="zimage_pe_txt")
        pe_img = Tensor.from_numpy(np.ascontiguousarray(pe_np[lt:]), name="zimage_pe_img")
        cut = self._cut
        txt, img, t_emb = cut(txt, "zimage.prelude.txt"), cut(img, "zimage.prelude.img"), cut(t_emb, "zimage.prelude.t")
        for i, blk in enumerate(self.context_refiner):
            txt = cut(blk(txt, pe_txt), f"zimage.context_refiner.{i}")
        for i, blk in enumerate(self.noise_refiner):
            img = cut(blk(img, pe_img, t_emb), f"zimage.noise_refiner.{i}")
        h = F.concat(txt, img, 1)
        for i, blk in enumerate(self.layers):
            h = cut(blk(h, pe, t_emb), f"zimage.layers.{i}")
        scale = chunks(self.final_adaln(F.silu(t_emb)), 1)[0]                            # [H, 1, N]
        h = F.mul(F.layer_norm(h.slice(1, lt, lt + Li), 1e-6), F.scale(scale, 1.0, 1.0))
        out = self.final_linear(h)                                                       # [C*4, Li, N]
        hl, wl = (Hh + PATCH - 1) // PATCH, (W + PATCH - 1) // PATCH
        out = _tokens_to_image(out, hl, wl)
        if out.ne[0] != W or out.ne[1] != Hh:
            out = F.cont(out.slice(0, 0, W).slice(1, 0, Hh))
        return F.scale(out, -1.0)

    def __call__(self, x_np, t_np, context_np, backend: str = "cpu") -> np.ndarray:
        """Torch-order numpy: x [N, C, h, w], t [N] (sigma * 1000), context [N or 1, L, cap_dim]
        -> float32 [N, C, h, w] (sd.cpp's output: the negated velocity)."""
        arrays = [np.asarray(a, dtype=np.float32) for a in (x_np, t_np, context_np)]
        if arrays[0].ndim != 4:
            raise UsageError(f"Z-Image: x must be [N, C, H, W], got shape {arrays[0].shape}")
        if arrays[2].ndim == 2:
            arrays[2] = arrays[2][None]
        if arrays[2].ndim != 3:
            raise UsageError(f"Z-Image: context must be [N, L, D], got shape {arrays[2].shape}")
        N = arrays[0].shape[0]
        t = arrays[1].reshape(-1)
        arrays[1] = np.broadcast_to(t, (N,)).copy() if t.size == 1 else t
        return self._graphs.run(arrays, lambda v: self.forward(*v), backend)
