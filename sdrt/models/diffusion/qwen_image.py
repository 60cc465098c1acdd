"""The Qwen-Image diffusion transformer (diffusers QwenImageTransformer2DModel; sd.cpp qwen_image.hpp):
Qwen-Image, Qwen-Image-Edit (reference-image tokens) and Edit-2511's zero_cond_t.

Weights are diffusers' names under `model.diffusion_model.` (the ComfyUI / sd.cpp single files use
the same names): `img_in`, `txt_norm`, `txt_in`, `time_text_embed.timestep_embedder.linear_{1,2}`,
`transformer_blocks.N.{img,txt}_mod.1`, `.attn.{to_q,to_k,to_v,to_out.0,add_{q,k,v}_proj,to_add_out,
norm_q,norm_k,norm_added_q,norm_added_k}`, `.{img,txt}_mlp.net.{0.proj,2}`, `norm_out.linear`,
`proj_out`.

`QwenImageConfig.detect_from_weights` reads the depth (transformer_blocks.N counted, as sd.cpp),
hidden size, head width (norm_q), text width (txt_in), latent channels (proj_out) and zero_cond_t
(a `__index_timestep_zero__` tensor, as sd.cpp). RoPE axes (16, 56, 56) for 128-wide heads.

forward(x [w, h, C, N], timesteps [N] (sd.cpp's t = 1000 sigma: no scaling inside, unlike Flux),
context [3584, L, N], ref latents) -> [w, h, C, N]: patchify 2x2 -> img_in; txt_in(RMSNorm(ctx));
temb = timestep_embedder(emb(t)); blocks: per stream LayerNorm (no affine) modulated by
{img,txt}_mod.1(silu(temb)) = (shift, scale, gate) x 2, joint attention (text tokens first, QK
RMSNorm, RoPE), gated residuals, GELU(tanh) MLPs; norm_out (scale, shift — scale first) and
proj_out on the image tokens; unpatchify, crop.

With zero_cond_t (Edit-2511) the reference-image tokens are modulated by the img_mod of t = 0
while the generated tokens (and the text stream, and norm_out) use t.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import GraphCache, Linear, Weights, batch_cond, check_weights
from .flux import flux_pe, with_rope_axes
from .flux_blocks import attention, modulate, pad_to_patch, patchify, unpatchify

__all__ = ["PREFIX", "QwenImageConfig", "QwenImageModel", "qwen_image_ids", "ZERO_COND_T_MARKER"]

PREFIX = "model.diffusion_model."
EPS = 1e-6
ZERO_COND_T_MARKER = "__index_timestep_zero__"
_RE_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")


@dataclass(frozen=True)
class QwenImageConfig:
    in_channels: int = 64           # img_in width: latent channels * 4
    out_channels: int = 16          # latent channels (proj_out gives out * 4)
    hidden_size: int = 3072
    num_heads: int = 24
    num_layers: int = 60
    joint_attention_dim: int = 3584
    axes_dim: tuple = (16, 56, 56)
    theta: float = 10000.0
    zero_cond_t: bool = False
    patch_size: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def summary(self) -> str:
        return (f"Qwen-Image hidden={self.hidden_size} heads={self.num_heads} layers={self.num_layers} "
                f"in={self.in_channels} out={self.out_channels} ctx={self.joint_attention_dim} "
                f"axes={list(self.axes_dim)}" + (" zero_cond_t" if self.zero_cond_t else ""))

    @classmethod
    def detect_from_weights(cls, table: Mapping[str, Tensor], prefix: str = PREFIX, source: str = "model",
                            **overrides) -> "QwenImageConfig":
        w = Weights(table, prefix, source)
        names = list(w.keys())
        layers = 1 + max((int(m.group(1)) for n in names if (m := _RE_BLOCK.match(n))), default=-1)
        if not layers:
            raise ModelFileError(f"{source}: no transformer_blocks.N tensors under {prefix!r}")
        ctx, hidden = w.shape("txt_in.weight")
        head_dim = w.shape("transformer_blocks.0.attn.norm_q.weight")[0]
        if hidden % head_dim:
            raise ModelFileError(f"{source}: hidden size {hidden} (txt_in) is not a multiple of the head width "
                                 f"{head_dim} (attn.norm_q)")
        p = 2
        cfg = cls(in_channels=w.shape("img_in.weight")[0], out_channels=w.shape("proj_out.weight")[1] // (p * p),
                  hidden_size=hidden, num_heads=hidden // head_dim, num_layers=layers, joint_attention_dim=ctx,
                  axes_dim=(16, 56, 56) if head_dim == 128 else (),
                  zero_cond_t=any(ZERO_COND_T_MARKER in n for n in names), patch_size=p)
        return with_rope_axes(cfg, overrides, source)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """{diffusers name (no prefix): torch shape} of every tensor this config uses."""
        s: dict[str, tuple[int, ...]] = {}
        H, D, p2 = self.hidden_size, self.head_dim, self.patch_size ** 2

        def lin(name, i, o):
            s[name + ".weight"], s[name + ".bias"] = (o, i), (o,)

        lin("img_in", self.in_channels, H)
        s["txt_norm.weight"] = (self.joint_attention_dim,)
        lin("txt_in", self.joint_attention_dim, H)
        lin("time_text_embed.timestep_embedder.linear_1", 256, H)
        lin("time_text_embed.timestep_embedder.linear_2", H, H)
        for i in range(self.num_layers):
            b = f"transformer_blocks.{i}."
            for st in ("img", "txt"):
                lin(b + st + "_mod.1", H, 6 * H)
                lin(b + st + "_mlp.net.0.proj", H, 4 * H)
                lin(b + st + "_mlp.net.2", 4 * H, H)
            for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
                lin(b + "attn." + n, H, H)
            for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                s[b + "attn." + n + ".weight"] = (D,)
        lin("norm_out.linear", H, 2 * H)
        lin("proj_out", H, p2 * self.out_channels)
        return s


# ---- RoPE ids (sd.cpp rope.hpp gen_qwen_image_ids, float32 as sd.cpp) ---------------------------------
def _linspace(start: float, end: float, num: int) -> np.ndarray:
    """sd.cpp's Rope::linspace in float: start + i * ((end - start) / (num - 1))."""
    f = np.float32
    if num == 1:
        return np.array([start], f)
    step = f(f(f(end) - f(start)) / f(num - 1))
    return (f(start) + np.arange(num, dtype=f) * step).astype(f)


def _img_ids(h: int, w: int, p: int, index: int, h_off: int, w_off: int, centered: bool) -> np.ndarray:
    hl, wl = (h + p // 2) // p, (w + p // 2) // p
    hs, ws = h_off, w_off
    if centered:           # sd.cpp scale_rope: rows -h_len/2 .. (C integer division)
        hs -= hl // 2
        ws -= wl // 2
    ids = np.zeros((hl, wl, 3), np.float32)
    ids[..., 0] = index
    ids[..., 1] = _linspace(hs, hs + hl - 1, hl)[:, None]
    ids[..., 2] = _linspace(ws, ws + wl - 1, wl)[None, :]
    return ids.reshape(-1, 3)


def qwen_image_ids(h: int, w: int, context_len: int, refs: Sequence[tuple[int, int]] = (), patch: int = 2,
                   increase_ref_index: bool = False) -> np.ndarray:
    """float32 [tokens, 3] as sd.cpp's gen_qwen_image_ids: text tokens first, each at position
    linspace(m, m + L, L)[i] on all three axes (m = max(h_len, w_len); sd.cpp's linspace, so the
    step is L/(L-1), not 1 as diffusers'), then the image patches (0, row, col) centred (rows from
    -h_len/2), then each reference latent's patches: index 1 beside the earlier ones and not
    centred, or (increase_ref_index) index 1, 2, ... centred. h, w, refs: latent sizes."""
    hl, wl = (h + patch // 2) // patch, (w + patch // 2) // patch
    start = max(hl, wl)
    t = _linspace(start, context_len + start, context_len)
    parts = [np.repeat(t[:, None], 3, axis=1), _img_ids(h, w, patch, 0, 0, 0, True)]
    index, cur_h, cur_w = 1, 0, 0
    for rh, rw in refs:
        h_off = w_off = 0
        if not increase_ref_index:
            if rh + cur_h > rw + cur_w:
                w_off = cur_w
            else:
                h_off = cur_h
        parts.append(_img_ids(rh, rw, patch, index, h_off, w_off, increase_ref_index))
        if increase_ref_index:
            index += 1
        cur_h, cur_w = max(cur_h, rh + h_off), max(cur_w, rw + w_off)
    return np.concatenate(parts).astype(np.float32)


# ---- blocks ---------------------------------------------------------------------------------------
def _rms(w: Weights, x: Tensor) -> Tensor:
    return F.mul(F.rms_norm(x, EPS), w["weight"])


def _chunks(m: Tensor, n: int) -> list[Tensor]:
    """[n*C, N] (contiguous) -> n views [C, 1, N]."""
    C, N = m.ne[0] // n, m.ne4[1]
    es = m.nb[0]
    row = es * m.ne[0]
    return [m.view((C, 1, N), (es, row, row), offset=j * C * es) for j in range(n)]


class FeedForward:
    """net.0.proj -> GELU(tanh) -> net.2 (diffusers FeedForward, activation gelu-approximate)."""

    def __init__(self, w: Weights):
        self.proj, self.out = Linear(w.sub("net.0.proj.")), Linear(w.sub("net.2."))

    def __call__(self, x: Tensor) -> Tensor:
        return self.out(F.gelu(self.proj(x), approximate="tanh"))


class JointAttention:
    """Image projections to_q/k/v, text add_{q,k,v}_proj, per-head RMSNorm on q and k, one
    attention over [text, image], outputs to_out.0 (image) and to_add_out (text)."""

    def __init__(self, w: Weights, n_head: int):
        self.w, self.n_head = w, n_head
        self.to_q, self.to_k, self.to_v = (Linear(w.sub(n + ".")) for n in ("to_q", "to_k", "to_v"))
        self.add_q, self.add_k, self.add_v = (Linear(w.sub(n + ".")) for n in ("add_q_proj", "add_k_proj", "add_v_proj"))
        self.to_out, self.to_add_out = Linear(w.sub("to_out.0.")), Linear(w.sub("to_add_out."))

    def _heads(self, t: Tensor) -> Tensor:   # [H, L, N] -> [D, heads, L, N]
        H, L, N = t.ne[0], t.ne[1], t.ne4[2]
        return t.reshape(H // self.n_head, self.n_head, L, N)

    def __call__(self, img: Tensor, txt: Tensor, pe: Tensor) -> tuple[Tensor, Tensor]:
        w = self.w
        iq = _rms(w.sub("norm_q."), self._heads(self.to_q(img)))
        ik = _rms(w.sub("norm_k."), self._heads(self.to_k(img)))
        iv = self._heads(self.to_v(img))
        tq = _rms(w.sub("norm_added_q."), self._heads(self.add_q(txt)))
        tk = _rms(w.sub("norm_added_k."), self._heads(self.add_k(txt)))
        tv = self._heads(self.add_v(txt))
        out = attention((tq, iq), (tk, ik), (tv, iv), pe, self.n_head)        # [H, Lt + Li, N]
        Lt, Li = txt.ne[1], img.ne[1]
        return self.to_out(out.slice(1, Lt, Lt + Li)), self.to_add_out(out.slice(1, 0, Lt))


class QwenImageBlock:
    def __init__(self, w: Weights, n_head: int):
        self.img_mod, self.txt_mod = Linear(w.sub("img_mod.1.")), Linear(w.sub("txt_mod.1."))
        self.attn = JointAttention(w.sub("attn."), n_head)
        self.img_mlp, self.txt_mlp = FeedForward(w.sub("img_mlp.")), FeedForward(w.sub("txt_mlp."))

    @staticmethod
    def _modulate(x: Tensor, m: list[Tensor], k: int, m_ref: list[Tensor] | None, n_gen: int) -> Tensor:
        """(1 + scale) x + shift; with zero_cond_t the tokens from n_gen on take the t=0 chunks."""
        if m_ref is None or n_gen == x.ne[1]:
            return modulate(x, m[k], m[k + 1])
        a = modulate(x.slice(1, 0, n_gen), m[k], m[k + 1])
        b = modulate(x.slice(1, n_gen, x.ne[1]), m_ref[k], m_ref[k + 1])
        return F.concat(a, b, 1)

    @staticmethod
    def _gated(y: Tensor, m: list[Tensor], k: int, m_ref: list[Tensor] | None, n_gen: int) -> Tensor:
        if m_ref is None or n_gen == y.ne[1]:
            return F.mul(y, m[k])
        return F.concat(F.mul(y.slice(1, 0, n_gen), m[k]), F.mul(y.slice(1, n_gen, y.ne[1]), m_ref[k]), 1)

    def __call__(self, img: Tensor, txt: Tensor, temb_silu: Tensor, temb0_silu: Tensor | None, n_gen: int,
                 pe: Tensor) -> tuple[Tensor, Tensor]:
        # img [H, Li, N], txt [H, Lt, N], temb_silu [H, N]
        im = _chunks(self.img_mod(temb_silu), 6)                             # shift, scale, gate x 2
        ir = _chunks(self.img_mod(temb0_silu), 6) if temb0_silu is not None else None
        tm = _chunks(self.txt_mod(temb_silu), 6)
        ia, ta = self.attn(self._modulate(F.layer_norm(img, EPS), im, 0, ir, n_gen),
                           modulate(F.layer_norm(txt, EPS), tm[0], tm[1]), pe)
        img = F.add(img, self._gated(ia, im, 2, ir, n_gen))
        txt = F.add(txt, F.mul(ta, tm[2]))
        img = F.add(img, self._gated(self.img_mlp(self._modulate(F.layer_norm(img, EPS), im, 3, ir, n_gen)),
                                     im, 5, ir, n_gen))
        txt = F.add(txt, F.mul(self.txt_mlp(modulate(F.layer_norm(txt, EPS), tm[3], tm[4])), tm[5]))
        return img, txt


# ---- the model -------------------------------------------------------------------------------------
class QwenImageModel:
    """QwenImageModel(table, prefix, config=None): blocks over the table's weights (any dtype the ops
    take). `forward` builds the graph on ne-order Tensors; `__call__` runs it on numpy."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = PREFIX, config: QwenImageConfig | None = None,
                 source: str = "model", cut_points: bool = True):
        cfg = config or QwenImageConfig.detect_from_weights(table, prefix, source)
        self.config, self.prefix, self.source, self.cut_points = cfg, prefix, source, cut_points
        check_weights(table, prefix, cfg.weight_shapes(), source, "Qwen-Image", missing_detail=cfg.summary())
        w = Weights(table, prefix, source)
        self.w = w
        self.img_in, self.txt_in = Linear(w.sub("img_in.")), Linear(w.sub("txt_in."))
        te = w.sub("time_text_embed.timestep_embedder.")
        self.t_lin1, self.t_lin2 = Linear(te.sub("linear_1.")), Linear(te.sub("linear_2."))
        self.blocks = [QwenImageBlock(w.sub(f"transformer_blocks.{i}."), cfg.num_heads) for i in range(cfg.num_layers)]
        self.norm_out, self.proj_out = Linear(w.sub("norm_out.linear.")), Linear(w.sub("proj_out."))
        self._graphs = GraphCache()

    def _temb(self, t: Tensor) -> Tensor:   # [N] (0..1000) -> [H, N]
        return self.t_lin2(F.silu(self.t_lin1(F.timestep_embedding(t, 256))))

    def forward(self, x: Tensor, timesteps: Tensor, context: Tensor, ref_latents: Sequence[Tensor] = (),
                increase_ref_index: bool = False, pe: Tensor | None = None,
                zero_cond_t: bool | None = None) -> Tensor:
        """x [w, h, C, N], timesteps F32 [N] (1000 sigma), context [3584, L, N], ref_latents
        [w_r, h_r, C, N]; pe (tokens, D/2, 2, 2) as F32 [2, 2, D/2, tokens] or None to build
        sd.cpp's; zero_cond_t None: the config's -> F32 [w, h, C, N]."""
        cfg = self.config
        W, Hh, C, N = x.ne4
        p = cfg.patch_size
        if C * p * p != cfg.in_channels:
            raise UsageError(f"Qwen-Image: x has {C} channels, the model takes {cfg.in_channels // (p * p)}")
        img = patchify(pad_to_patch(x, p), p)                                  # [C*4, Li, N]
        n_gen = img.ne[1]
        refs = []
        for r in ref_latents:
            if r.ne4[2] != C or r.ne4[3] != N:
                raise UsageError(f"Qwen-Image: a reference latent has ne {list(r.ne)}, needs {C} channels and batch {N}")
            refs.append(patchify(pad_to_patch(r, p), p))
        if refs:
            img = F.concat_many([img] + refs, 1)                               # [C*4, Li + Lr, N]
        if context.ne[0] != cfg.joint_attention_dim:
            raise UsageError(f"Qwen-Image: context has width {context.ne[0]}, the model takes "
                             f"{cfg.joint_attention_dim}")
        context = batch_cond(context, N, "Qwen-Image: context")
        Lt = context.ne[1]
        if pe is None:
            ids = qwen_image_ids(Hh, W, Lt, [(r.ne[1], r.ne[0]) for r in ref_latents], p, increase_ref_index)
            pe = Tensor.from_numpy(flux_pe(ids, cfg.axes_dim, cfg.theta), name="qwen_image_pe")
        if pe.ne4[3] != Lt + img.ne[1]:
            raise UsageError(f"Qwen-Image: pe has {pe.ne4[3]} tokens, the sequence has {Lt + img.ne[1]}")
        if timesteps.nelements != N:
            raise UsageError(f"Qwen-Image: {timesteps.nelements} timesteps for a batch of {N}")
        zc = cfg.zero_cond_t if zero_cond_t is None else zero_cond_t

        temb = self._temb(timesteps)                                           # [H, N]
        temb_silu = F.silu(temb)
        temb0_silu = None
        if zc and refs:       # sd.cpp: the reference tokens' modulation comes from t = 0
            temb0_silu = F.silu(self._temb(F.scale(timesteps, 0.0)))
        img = self.img_in(img)                                                 # [H, Li(+Lr), N]
        txt = self.txt_in(_rms(self.w.sub("txt_norm."), context))              # [H, Lt, N]
        cut = self._cut
        img, txt = cut(img, "qwen_image.prelude.img"), cut(txt, "qwen_image.prelude.txt")
        for i, blk in enumerate(self.blocks):
            img, txt = blk(img, txt, temb_silu, temb0_silu, n_gen, pe)
            img, txt = cut(img, f"qwen_image.transformer_blocks.{i}.img"), cut(txt, f"qwen_image.transformer_blocks.{i}.txt")
        scale, shift = _chunks(self.norm_out(temb_silu), 2)
        out = self.proj_out(modulate(F.layer_norm(img.slice(1, 0, n_gen), EPS), shift, scale))  # [C*4, Li, N]
        hl, wl = (Hh + p - 1) // p, (W + p - 1) // p
        out = unpatchify(out, hl, wl, p)                                       # [wl*p, hl*p, C, N]
        if out.ne[0] != W or out.ne[1] != Hh:
            out = F.cont(out.slice(0, 0, W).slice(1, 0, Hh))
        return out

    def _cut(self, t: Tensor, name: str) -> Tensor:
        return F.mark_cut(t, name) if self.cut_points else t

    def __call__(self, x_np, t_np, context_np, ref_latents_np: Sequence = (), increase_ref_index: bool = False,
                 pe_np=None, backend: str = "cpu") -> np.ndarray:
        """Torch-order numpy: x [N, C, h, w], t [N] (1000 sigma), context [N, L, 3584], ref latents
        [N, C, h_r, w_r], pe (tokens, D/2, 2, 2) or None -> float32 [N, C, h, w]. The graph of each
        input shape is built once and reused."""
        arrays = [x_np, t_np, context_np, pe_np] + list(ref_latents_np)
        arrays = [None if a is None else np.asarray(a, dtype=np.float32) for a in arrays]
        if arrays[0].ndim != 4:
            raise UsageError(f"Qwen-Image: x must be [N, C, H, W], got shape {arrays[0].shape}")
        N = arrays[0].shape[0]
        arrays[1] = np.broadcast_to(arrays[1].reshape(-1), (N,)).copy() if arrays[1].size == 1 else arrays[1].reshape(-1)

        def build(v):
            return self.forward(v[0], v[1], v[2], ref_latents=v[4:], increase_ref_index=increase_ref_index, pe=v[3])
        return self._graphs.run(arrays, build, backend, extra=(increase_ref_index,))
