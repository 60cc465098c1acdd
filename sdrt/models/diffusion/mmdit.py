"""The MMDiT of Stable Diffusion 3 / 3.5 (SAI's sd3 mmdit.py; sd.cpp mmdit.hpp): SD3 Medium,
SD3.5 Large (and Large Turbo), SD3.5 Medium (MMDiT-X).

Weights are SAI's single-file names under `model.diffusion_model.` (a table without the prefix
works with prefix=""): `x_embedder.proj` (2x2 stride-2 conv), `pos_embed` [1, S*S, H],
`t_embedder.mlp.{0,2}`, `y_embedder.mlp.{0,2}`, `context_embedder`,
`joint_blocks.N.{context_block,x_block}.{adaLN_modulation.1, attn.qkv, attn.proj, attn.ln_q,
attn.ln_k, attn2.*, mlp.fc1, mlp.fc2}`, `final_layer.{linear, adaLN_modulation.1}`. The last
joint block's context block is pre-only (2 modulation vectors, no proj, no MLP). Diffusers'
SD3Transformer2DModel folders are converted to these names by mmdit_names.diffusers_to_sai.

`MMDiTConfig.detect_from_weights` reads everything from names and shapes (nothing is flagged):
depth (joint_blocks), hidden size, patch and latent channels (x_embedder), pos_embed size
(SD3 / 3.5 Large 192, 3.5 Medium 384), QK norm (ln_q: "rms", with a bias "ln"), the blocks whose
x_block has `attn2` (3.5 Medium: 0..12), MLP width, context and pooled widths. Heads: D = ln_q's
width when present, else 64 (SAI: heads = depth, hidden = 64 depth, so D = 64).

forward(x [W, H, C, N], timesteps [N] (sigma * 1000, as SD3's flow denoiser gives), context
[4096, L, N], y [2048, N], skip_layers) -> velocity [W, H, C, N]: pad to the patch; patch embed
+ pos_embed cropped from the centre of the S x S grid (sd.cpp cropped_pos_embed); c =
t_embedder(emb256(t)) + y_embedder(y); context_embedder(context); joint blocks, skipping whole
blocks whose index is in skip_layers (skip-layer guidance, as sd.cpp and diffusers); final layer;
unpatchify (features per token in (py, px, c) order), crop.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import GraphCache, batch_cond, check_weights, Conv2d, Linear, Weights
from .flux_blocks import pad_to_patch, unpatchify
from .mmdit_blocks import Embedder, FinalLayer, JointBlock

__all__ = ["PREFIX", "MMDiTConfig", "MMDiTModel", "find_prefix", "VARIANTS"]

PREFIX = "model.diffusion_model."
VARIANTS = ("sd3-medium", "sd3.5-large", "sd3.5-medium")
_RE_JOINT = re.compile(r"joint_blocks\.(\d+)\.")
_RE_ATTN2 = re.compile(r"joint_blocks\.(\d+)\.x_block\.attn2\.qkv\.weight$")


@dataclass(frozen=True)
class MMDiTConfig:
    hidden_size: int = 1536
    depth: int = 24
    num_heads: int = 24
    patch_size: int = 2
    in_channels: int = 16
    out_channels: int = 16
    context_in_dim: int = 4096     # T5-XXL width (CLIP features zero-padded to it)
    adm_in_channels: int = 2048    # pooled CLIP-L ++ CLIP-G
    mlp_hidden: int = 6144
    pos_embed_max_size: int = 192
    qk_norm: str = ""              # "" (SD3), "rms" (SD3.5), "ln"
    dual_attention_layers: tuple = ()   # x blocks with attn2 (SD3.5 Medium: 0..12)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def variant(self) -> str:
        """sd3-medium (no QK norm), sd3.5-medium (MMDiT-X: attn2 blocks), sd3.5-large (QK norm)."""
        if self.dual_attention_layers:
            return "sd3.5-medium"
        return "sd3.5-large" if self.qk_norm else "sd3-medium"

    def summary(self) -> str:
        dual = f" attn2={list(self.dual_attention_layers)}" if self.dual_attention_layers else ""
        return (f"MMDiT ({self.variant}) hidden={self.hidden_size} heads={self.num_heads} depth={self.depth} "
                f"mlp={self.mlp_hidden} qk_norm={self.qk_norm or 'none'} pos={self.pos_embed_max_size}{dual} "
                f"in={self.in_channels} ctx={self.context_in_dim} y={self.adm_in_channels}")

    @classmethod
    def detect_from_weights(cls, table: Mapping[str, Tensor], prefix: str = PREFIX, source: str = "model",
                            **overrides) -> MMDiTConfig:
        w = Weights(table, prefix, source)
        names = list(w.keys())
        depth = 1 + max((int(m.group(1)) for n in names if (m := _RE_JOINT.match(n))), default=-1)
        if not depth:
            raise ModelFileError(f"{source}: no joint_blocks.N tensors under {prefix!r} (not an SD3 MMDiT)")
        p, p2, C, H = w.shape("x_embedder.proj.weight")
        if p != p2:
            raise ModelFileError(f"{source}: {prefix}x_embedder.proj.weight has a {p}x{p2} kernel; MMDiT patches are square")
        S2 = w.shape("pos_embed")[1]
        S = math.isqrt(S2)
        if S * S != S2:
            raise ModelFileError(f"{source}: {prefix}pos_embed holds {S2} positions, not a square grid")
        ln_q = "joint_blocks.0.x_block.attn.ln_q."
        qk_norm = ("ln" if ln_q + "bias" in w else "rms") if ln_q + "weight" in w else ""
        head_dim = w.shape(ln_q + "weight")[0] if qk_norm else 64
        if H % head_dim:
            raise ModelFileError(f"{source}: hidden size {H} is not a multiple of the head width {head_dim}")
        dual = tuple(sorted(int(m.group(1)) for n in names if (m := _RE_ATTN2.match(n))))
        cfg = cls(hidden_size=H, depth=depth, num_heads=H // head_dim, patch_size=p, in_channels=C,
                  out_channels=w.shape("final_layer.linear.weight")[1] // (p * p),
                  context_in_dim=w.shape("context_embedder.weight")[0],
                  adm_in_channels=w.shape("y_embedder.mlp.0.weight")[0] if "y_embedder.mlp.0.weight" in w else 0,
                  mlp_hidden=w.shape("joint_blocks.0.x_block.mlp.fc1.weight")[1], pos_embed_max_size=S,
                  qk_norm=qk_norm, dual_attention_layers=dual)
        return dataclasses.replace(cfg, **overrides) if overrides else cfg

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """{SAI name (no prefix): torch shape} of every tensor this config uses."""
        s: dict[str, tuple[int, ...]] = {}
        H, M, p, D = self.hidden_size, self.mlp_hidden, self.patch_size, self.head_dim

        def lin(name, i, o):
            s[name + ".weight"], s[name + ".bias"] = (o, i), (o,)

        s["x_embedder.proj.weight"], s["x_embedder.proj.bias"] = (H, self.in_channels, p, p), (H,)
        s["pos_embed"] = (1, self.pos_embed_max_size ** 2, H)
        lin("t_embedder.mlp.0", 256, H)
        lin("t_embedder.mlp.2", H, H)
        if self.adm_in_channels:
            lin("y_embedder.mlp.0", self.adm_in_channels, H)
            lin("y_embedder.mlp.2", H, H)
        lin("context_embedder", self.context_in_dim, H)

        def attn(a, proj=True):
            lin(a + "qkv", H, 3 * H)
            if proj:
                lin(a + "proj", H, H)
            for n in ("ln_q", "ln_k") if self.qk_norm else ():
                s[f"{a}{n}.weight"] = (D,)
                if self.qk_norm == "ln":
                    s[f"{a}{n}.bias"] = (D,)

        for i in range(self.depth):
            for st in ("context_block", "x_block"):
                b = f"joint_blocks.{i}.{st}."
                pre_only = st == "context_block" and i == self.depth - 1
                dual = st == "x_block" and i in self.dual_attention_layers
                lin(b + "adaLN_modulation.1", H, (2 if pre_only else 9 if dual else 6) * H)
                attn(b + "attn.", proj=not pre_only)
                if dual:
                    attn(b + "attn2.")
                if not pre_only:
                    lin(b + "mlp.fc1", H, M)
                    lin(b + "mlp.fc2", M, H)
        lin("final_layer.linear", H, p * p * self.out_channels)
        lin("final_layer.adaLN_modulation.1", H, 2 * H)
        return s


def find_prefix(table: Mapping[str, Tensor]) -> str:
    """The prefix under which a table holds SAI MMDiT names (`model.diffusion_model.`, ``, ...)."""
    for name in table:
        if name.endswith("x_embedder.proj.weight"):
            pre = name[: -len("x_embedder.proj.weight")]
            if any(k.startswith(pre + "joint_blocks.") for k in table):
                return pre
    raise ModelFileError("no SD3 MMDiT here: no tensor named '...x_embedder.proj.weight' beside '...joint_blocks.N'")


# ---- the model -------------------------------------------------------------------------------
class MMDiTModel:
    """MMDiTModel(table, prefix, config=None): blocks over the table's weights (any dtype the ops
    take). `forward` builds the graph on ne-order Tensors; `__call__` runs it on numpy."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = PREFIX, config: MMDiTConfig | None = None,
                 source: str = "model", cut_points: bool = True):
        cfg = config or MMDiTConfig.detect_from_weights(table, prefix, source)
        self.config, self.prefix, self.source, self.cut_points = cfg, prefix, source, cut_points
        check_weights(table, prefix, cfg.weight_shapes(), source, "MMDiT", missing_detail=cfg.summary(),
                      same=lambda a, b: _squeeze(a) == _squeeze(b))   # GGUF drops pos_embed's leading 1
        w = Weights(table, prefix, source)
        p = cfg.patch_size
        self.x_embedder = Conv2d(w.sub("x_embedder.proj."), stride=p)
        self.pos_embed = w["pos_embed"]
        self.t_embedder = Embedder(w.sub("t_embedder."))
        self.y_embedder = Embedder(w.sub("y_embedder.")) if cfg.adm_in_channels else None
        self.context_embedder = Linear(w.sub("context_embedder."))
        self.joint_blocks = [JointBlock(w.sub(f"joint_blocks.{i}."), cfg.num_heads, cfg.qk_norm)
                             for i in range(cfg.depth)]
        self.final_layer = FinalLayer(w.sub("final_layer."))
        self._graphs = GraphCache()

    def cropped_pos_embed(self, h: int, w: int) -> Tensor:
        """F32 [H, h*w, 1]: the centre h x w window of the S x S pos_embed grid (h, w in patches)."""
        S, Hd = self.config.pos_embed_max_size, self.config.hidden_size
        if not (0 < h <= S and 0 < w <= S):
            raise UsageError(f"MMDiT: a latent of {h}x{w} patches does not fit the {S}x{S} position embedding "
                             f"(at most {S * self.config.patch_size * 8} pixels a side)")
        top, left = (S - h) // 2, (S - w) // 2
        pe, es = self.pos_embed, self.pos_embed.nb[0]
        view = pe.view((Hd, w, h), (es, es * Hd, es * Hd * S), offset=(top * S + left) * Hd * es)
        return F.cast(view, "F32").reshape(Hd, h * w, 1)

    # ---- graph ------------------------------------------------------------------------------
    def forward(self, x: Tensor, timesteps: Tensor, context: Tensor, y: Tensor | None = None,
                skip_layers: Iterable[int] = ()) -> Tensor:
        """x [w, h, C, N], timesteps F32 [N] (sigma * 1000), context [4096, L, N], y [2048, N],
        skip_layers: joint-block indices to skip -> F32 [w, h, C, N]."""
        cfg = self.config
        W, Hh, C, N = x.ne4
        p = cfg.patch_size
        if C != cfg.in_channels:
            raise UsageError(f"MMDiT: x has {C} channels, the model takes {cfg.in_channels}")
        skip = set(int(i) for i in skip_layers)
        bad = sorted(i for i in skip if not 0 <= i < cfg.depth)
        if bad:
            raise UsageError(f"MMDiT: skip layers {bad} out of range (the model has {cfg.depth} joint blocks)")
        if context.ne[0] != cfg.context_in_dim:
            raise UsageError(f"MMDiT: context has width {context.ne[0]}, the model takes {cfg.context_in_dim}")
        if timesteps.nelements != N:
            raise UsageError(f"MMDiT: {timesteps.nelements} timesteps for a batch of {N}")
        context = batch_cond(context, N, "MMDiT: context")
        hl, wl = (Hh + p - 1) // p, (W + p - 1) // p

        img = self.x_embedder(pad_to_patch(x, p))                                # [wl, hl, H, N]
        Hd = cfg.hidden_size
        img = F.cont(img.reshape(wl * hl, Hd, N).permute(1, 0, 2))               # [H, Li, N]
        img = F.add(img, self.cropped_pos_embed(hl, wl))
        c = self.t_embedder(F.timestep_embedding(timesteps, 256))                 # [H, N]
        if self.y_embedder is not None:
            if y is None:
                raise UsageError(f"MMDiT: this model needs the pooled text vector y [{cfg.adm_in_channels}, N]")
            y = batch_cond(y, N, "MMDiT: y")
            if y.ne[0] != cfg.adm_in_channels:
                raise UsageError(f"MMDiT: y has width {y.ne[0]}, the model takes {cfg.adm_in_channels}")
            c = F.add(c, self.y_embedder(y))
        c_silu = F.silu(c)                                                        # every modulation's input
        ctx = self.context_embedder(context)                                      # [H, Lc, N]
        cut = self._cut
        img, ctx, c_silu = cut(img, "mmdit.prelude.x"), cut(ctx, "mmdit.prelude.context"), cut(c_silu, "mmdit.prelude.c")
        for i, blk in enumerate(self.joint_blocks):
            if i in skip:
                continue
            ctx, img = blk(ctx, img, c_silu)   # ctx is None after the last (pre-only) block
            img = cut(img, f"mmdit.joint_blocks.{i}.x")
            if ctx is not None:
                ctx = cut(ctx, f"mmdit.joint_blocks.{i}.context")
        out = self.final_layer(img, c_silu)                                       # [p*p*C, Li, N], (py, px, c)
        Co = cfg.out_channels
        out = F.cont(out.reshape(Co, p * p, hl * wl, N).permute(1, 0, 2, 3)).reshape(p * p * Co, hl * wl, N)
        out = unpatchify(out, hl, wl, p)                                          # [wl*p, hl*p, C, N]
        if out.ne[0] != W or out.ne[1] != Hh:
            out = F.cont(out.slice(0, 0, W).slice(1, 0, Hh))
        return out

    def _cut(self, t: Tensor, name: str) -> Tensor:
        return F.mark_cut(t, name) if self.cut_points else t

    # ---- numpy ------------------------------------------------------------------------------
    def predict(self, x_np, t_np, cond, backend: str = "cpu", skip_layers: Iterable[int] | None = None) -> np.ndarray:
        """The diffusion-model interface (sdrt.models.families): `cond` a families.Cond (context, y);
        t = sigma * 1000 (the sd3_flow denoiser's sigma_to_t). Skip-layer guidance's extra pass
        calls this with skip_layers. The MMDiT takes no c_concat, reference latents or guidance."""
        if cond.c_concat is not None or cond.ref_latents or cond.guidance is not None:
            raise UsageError("MMDiT: this model takes no concat latents, reference-image latents or distilled guidance")
        return self(x_np, t_np, cond.context, cond.y, skip_layers=skip_layers, backend=backend)

    def __call__(self, x_np, t_np, context_np, y_np=None, skip_layers: Iterable[int] | None = None,
                 backend: str = "cpu") -> np.ndarray:
        """Torch-order numpy: x [N, C, h, w], t [N] (sigma * 1000), context [N, L, 4096], y [N, 2048]
        -> float32 velocity [N, C, h, w]. The graph of each input shape and skip set is built once
        and reused (inputs are copied into its leaves)."""
        arrays = [x_np, t_np, context_np, y_np]
        arrays = [None if a is None else np.asarray(a, dtype=np.float32) for a in arrays]
        if arrays[0].ndim != 4:
            raise UsageError(f"MMDiT: x must be [N, C, H, W], got shape {arrays[0].shape}")
        N = arrays[0].shape[0]
        t = arrays[1].reshape(-1)
        arrays[1] = np.broadcast_to(t, (N,)).copy() if t.size == 1 else t
        skip = frozenset(int(i) for i in (skip_layers or ()))
        return self._graphs.run(arrays, lambda v: self.forward(*v, skip_layers=skip), backend, extra=(skip,))


def _squeeze(shape) -> tuple[int, ...]:
    """A torch shape without its leading 1s."""
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape

