"""The LDM UNet of SD 1.x, SD 2.x and SDXL (sd.cpp unet.hpp; LDM openaimodel.UNetModel).

Weights are the original checkpoint's, under `model.diffusion_model.`: `time_embed.{0,2}`,
`label_emb.0.{0,2}` (SDXL), `input_blocks.N.M`, `middle_block.M`, `output_blocks.N.M`,
`out.{0,2}`. `UNetConfig.detect_from_weights` reads the whole block layout from the tensor
names and shapes: each `input_blocks.N.M` / `middle_block.M` / `output_blocks.N.M` is a ResBlock
(`in_layers.*`), a SpatialTransformer (`proj_in`, with as many `transformer_blocks.K` as the file
has), a Downsample (`op`) or an Upsample (`conv`). So SD1/SD2/SDXL, their inpaint (9 input
channels) and instruct-pix2pix (8) variants, the SDXL refiner, SSD-1B and Vega (other depths, a
middle block of one ResBlock) and the distilled tiny UNets (blocks left out, no middle block)
need no per-version table; sd.cpp instead keys a fixed layout on the detected version.
Not detectable from shapes, so set by rule: the head count — 8 heads for SD1 (context 768),
64-wide heads for SD2/SDXL (context 1024/2048/1280) — and GroupNorm's 32 groups.

Numerics (`UNetConfig.numerics`): "sdcpp" (default) is what sd.cpp computes — GroupNorm eps
1e-6 everywhere, GEGLU with the tanh GELU (ggml_gelu) — so images match sd-cli's; "torch" is
the LDM/diffusers model — ResBlock and `out.0` GroupNorm eps 1e-5, GEGLU with the erf GELU. They
differ by ~2e-4 of the output scale on random weights.

Shapes in ne order: x [W, H, C, N], timesteps [N], context [Cctx, L, N], y [adm, N].
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import GraphCache, batch_cond, check_weights, Conv2d, GroupNorm, Linear, Weights
from .unet_blocks import Downsample, ResBlock, SpatialTransformer, Upsample

__all__ = ["PRESETS", "Layer", "UNetConfig", "UNetModel"]

PREFIX = "model.diffusion_model."
NUMERICS = {"sdcpp": (1e-6, "tanh"), "torch": (1e-5, "none")}  # (ResBlock/out GroupNorm eps, GEGLU gelu)


@dataclass(frozen=True)
class Layer:
    """One layer of a block: kind "res" (ResBlock in_ch -> ch), "attn" (SpatialTransformer of
    `depth` blocks; `linear` proj_in/proj_out, else 1x1 convs), "down" or "up" (ch -> ch)."""
    kind: str
    ch: int
    in_ch: int = 0
    depth: int = 0
    linear: bool = False


Block = tuple  # ((sub-index M, Layer), ...)


def _res(in_ch, ch):
    return Layer("res", ch, in_ch)


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 4
    out_channels: int = 4
    model_channels: int = 320
    time_embed_dim: int = 1280
    context_dim: int = 768
    adm_in_channels: int = 0          # SDXL label_emb input (2816); 0: no label_emb
    num_heads: int = 8                # fixed head count (SD1), or -1
    head_dim: int = -1                # fixed head width (SD2/SDXL: 64), or -1
    num_groups: int = 32
    numerics: str = "sdcpp"
    input_blocks: tuple = ()          # ((N, Block), ...) for input_blocks.N, N >= 1 (0 is the conv_in)
    middle_block: Block = ()
    output_blocks: tuple = ()         # ((N, Block), ...)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_hparams(cls, *, model_channels=320, channel_mult=(1, 2, 4, 4), num_res_blocks=2,
                     attention_levels=(0, 1, 2), transformer_depth=1, depth_middle=1,
                     transformer_depth_output=None, use_linear=False, in_channels=4, out_channels=4,
                     context_dim=768, adm_in_channels=0, num_heads=8, head_dim=-1, **kw) -> UNetConfig:
        """The layout LDM's UNetModel (and sd.cpp's UnetModelBlock) builds from its hparams.
        `transformer_depth`: an int or one per level; `depth_middle`: None for a middle block of
        one ResBlock (SSD-1B, Vega); `transformer_depth_output`: one per output block."""
        levels = len(channel_mult)
        td = (transformer_depth,) * levels if isinstance(transformer_depth, int) else tuple(transformer_depth)
        ch, idx, chans, inputs = model_channels, 0, [model_channels], []
        for lvl, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                idx += 1
                layers = [(0, _res(ch, mult * model_channels))]
                ch = mult * model_channels
                if lvl in attention_levels:
                    layers.append((1, Layer("attn", ch, depth=td[lvl], linear=use_linear)))
                inputs.append((idx, tuple(layers)))
                chans.append(ch)
            if lvl != levels - 1:
                idx += 1
                inputs.append((idx, ((0, Layer("down", ch)),)))
                chans.append(ch)
        middle = ((0, _res(ch, ch)),)
        if depth_middle is not None:
            middle += ((1, Layer("attn", ch, depth=depth_middle, linear=use_linear)), (2, _res(ch, ch)))
        outputs, k = [], 0
        for lvl in reversed(range(levels)):
            mult = channel_mult[lvl]
            for j in range(num_res_blocks + 1):
                layers = [(0, _res(ch + chans.pop(), mult * model_channels))]
                ch = mult * model_channels
                if lvl in attention_levels:
                    d = transformer_depth_output[k] if transformer_depth_output else td[lvl]
                    layers.append((1, Layer("attn", ch, depth=d, linear=use_linear)))
                if lvl > 0 and j == num_res_blocks:
                    layers.append((len(layers), Layer("up", ch)))
                outputs.append((k, tuple(layers)))
                k += 1
        return cls(in_channels=in_channels, out_channels=out_channels, model_channels=model_channels,
                   time_embed_dim=4 * model_channels, context_dim=context_dim, adm_in_channels=adm_in_channels,
                   num_heads=num_heads, head_dim=head_dim, input_blocks=tuple(inputs), middle_block=middle,
                   output_blocks=tuple(outputs), **kw)

    @classmethod
    def preset(cls, name: str, **overrides) -> UNetConfig:
        """sd.cpp's layouts by version name (see PRESETS); `overrides` are from_hparams arguments
        or fields, e.g. in_channels=9 (inpaint), numerics="torch"."""
        if name not in PRESETS:
            raise UsageError(f"unknown UNet preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls.from_hparams(**{**PRESETS[name], **overrides})

    @classmethod
    def detect_from_weights(cls, table: Mapping[str, Tensor], prefix: str = PREFIX, source: str = "model",
                            **overrides) -> UNetConfig:
        """The config from tensor names and shapes alone (see the module docstring).
        `overrides` replace fields afterwards (e.g. head_dim, num_groups for odd models)."""
        w = Weights(table, prefix, source)
        conv_in = w["input_blocks.0.0.weight"]
        if conv_in.ndim != 4:
            raise ModelFileError(f"{source}: {prefix}input_blocks.0.0.weight has ne={conv_in.ne}, expected a "
                                 "3x3 conv [3, 3, in_channels, model_channels]")
        found: dict[tuple, set] = {}
        names = w.keys()  # (Weights is not iterable: keys() lists the names under the prefix)
        for key in names:
            m = _RE_BLOCK.match(key)
            if m:
                part, n, rest = m.group(1), int(m.group(2) or 0), m.group(4)
                M = int(m.group(3))
                if part == "input_blocks" and n == 0:
                    continue
                if "time_stack" in rest or "time_mixer" in rest:
                    raise ModelFileError(f"{source}: {prefix}{key}: video UNets (SVD) are not supported")
                found.setdefault((part, n, M), set()).add(rest)
        layouts = {"input_blocks": {}, "middle_block": {}, "output_blocks": {}}
        context_dim = 0
        for (part, n, M), keys in sorted(found.items()):
            base = f"{part}.{n}.{M}." if part != "middle_block" else f"middle_block.{M}."
            lw = w.sub(base)
            layer = _classify(lw, keys, f"{source}: {prefix}{base[:-1]}")
            if layer.kind == "attn" and not context_dim:
                context_dim = lw.shape("transformer_blocks.0.attn2.to_k.weight")[0]
            layouts[part].setdefault(n, []).append((M, layer))
        adm = w.shape("label_emb.0.0.weight")[0] if "label_emb.0.0.weight" in w else 0
        heads = _heads_rule(context_dim, layouts)
        cfg = cls(in_channels=conv_in.ne[2], out_channels=w.shape("out.2.weight")[3], model_channels=conv_in.ne[3],
                  time_embed_dim=w.shape("time_embed.0.weight")[1], context_dim=context_dim, adm_in_channels=adm,
                  **heads,
                  input_blocks=tuple((n, tuple(ls)) for n, ls in sorted(layouts["input_blocks"].items())),
                  middle_block=tuple(layouts["middle_block"].get(0, ())),
                  output_blocks=tuple((n, tuple(ls)) for n, ls in sorted(layouts["output_blocks"].items())))
        return dataclasses.replace(cfg, **overrides) if overrides else cfg

    # ---- derived --------------------------------------------------------------------------
    @property
    def norm_eps(self) -> float:
        return NUMERICS[self.numerics][0]

    @property
    def gelu(self) -> str:
        return NUMERICS[self.numerics][1]

    def heads(self, ch: int) -> int:
        return self.num_heads if self.num_heads > 0 else ch // self.head_dim

    def _layers(self):
        for part, blocks in (("input_blocks", self.input_blocks), ("middle_block", ((None, self.middle_block),)),
                             ("output_blocks", self.output_blocks)):
            for n, block in blocks:
                for M, layer in block:
                    yield (f"{part}.{n}.{M}." if n is not None else f"{part}.{M}."), layer

    @property
    def transformer_depth(self) -> tuple[int, ...]:
        """Transformer blocks per input block that has attention (ComfyUI's transformer_depth)."""
        return tuple(la.depth for b in self.input_blocks for _, la in b[1] if la.kind == "attn")

    @property
    def transformer_depth_output(self) -> tuple[int, ...]:
        return tuple(la.depth for b in self.output_blocks for _, la in b[1] if la.kind == "attn")

    @property
    def transformer_depth_middle(self) -> int:
        """Transformer blocks in the middle block; -1 when it has no attention."""
        return next((la.depth for _, la in self.middle_block if la.kind == "attn"), -1)

    @property
    def channel_mult(self) -> tuple[int, ...]:
        """Width of each resolution level (levels end at each Downsample) / model_channels."""
        levels = [self.model_channels]
        for _, b in self.input_blocks:
            for _, la in b:
                if la.kind == "down":
                    levels.append(la.ch)
                elif la.kind == "res":
                    levels[-1] = la.ch
        return tuple(c // self.model_channels for c in levels)

    @property
    def use_linear(self) -> bool:
        return any(la.linear for _, la in self._layers() if la.kind == "attn")

    def summary(self) -> str:
        return (f"UNet in={self.in_channels} out={self.out_channels} ch={self.model_channels} "
                f"context={self.context_dim} adm={self.adm_in_channels} "
                f"heads={self.num_heads if self.num_heads > 0 else f'dim {self.head_dim}'} "
                f"linear={self.use_linear} depth in={list(self.transformer_depth)} "
                f"mid={self.transformer_depth_middle} out={list(self.transformer_depth_output)} "
                f"blocks in={len(self.input_blocks) + 1} out={len(self.output_blocks)}")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """{LDM name (no prefix): torch shape} of every tensor this config uses."""
        s: dict[str, tuple[int, ...]] = {}
        mc, ted = self.model_channels, self.time_embed_dim

        def lin(name, i, o, bias=True):
            s[name + "weight"] = (o, i)
            if bias:
                s[name + "bias"] = (o,)

        def conv(name, i, o, k=3):
            s[name + "weight"], s[name + "bias"] = (o, i, k, k), (o,)

        def norm(name, c):
            s[name + "weight"], s[name + "bias"] = (c,), (c,)

        lin("time_embed.0.", mc, ted)
        lin("time_embed.2.", ted, ted)
        if self.adm_in_channels:
            lin("label_emb.0.0.", self.adm_in_channels, ted)
            lin("label_emb.0.2.", ted, ted)
        conv("input_blocks.0.0.", self.in_channels, mc)
        for p, la in self._layers():
            c = la.ch
            if la.kind == "res":
                norm(p + "in_layers.0.", la.in_ch)
                conv(p + "in_layers.2.", la.in_ch, c)
                lin(p + "emb_layers.1.", ted, c)
                norm(p + "out_layers.0.", c)
                conv(p + "out_layers.3.", c, c)
                if la.in_ch != c:
                    conv(p + "skip_connection.", la.in_ch, c, 1)
            elif la.kind == "attn":
                norm(p + "norm.", c)
                for name in ("proj_in.", "proj_out."):
                    (lin if la.linear else lambda n, i, o: conv(n, i, o, 1))(p + name, c, c)
                for k in range(la.depth):
                    b = f"{p}transformer_blocks.{k}."
                    for a, ctx in (("attn1.", c), ("attn2.", self.context_dim)):
                        lin(b + a + "to_q.", c, c, False)
                        lin(b + a + "to_k.", ctx, c, False)
                        lin(b + a + "to_v.", ctx, c, False)
                        lin(b + a + "to_out.0.", c, c)
                    lin(b + "ff.net.0.proj.", c, 8 * c)
                    lin(b + "ff.net.2.", 4 * c, c)
                    for i in (1, 2, 3):
                        norm(b + f"norm{i}.", c)
            else:
                conv(p + ("op." if la.kind == "down" else "conv."), c, c)
        norm("out.0.", mc)
        conv("out.2.", mc, self.out_channels)
        return s

    def check(self, source: str = "model"):
        """Follow the channels through the layout as forward will (skips included); raise
        ModelFileError naming the first block that does not fit."""
        if self.numerics not in NUMERICS:
            raise UsageError(f"UNetConfig.numerics={self.numerics!r}; choose from {', '.join(NUMERICS)}")
        ch, skips = self.model_channels, [self.model_channels]

        def run(name, block, skip):
            nonlocal ch
            for M, la in block:
                want = ch + (skips.pop() if skip and M == block[0][0] else 0)
                got = la.in_ch if la.kind == "res" else la.ch
                if got != want:
                    raise ModelFileError(f"{source}: {name}.{M} takes {got} channels, but {want} arrive there")
                if la.kind == "attn" and (self.heads(la.ch) < 1 or la.ch % self.heads(la.ch)):
                    raise ModelFileError(f"{source}: {name}.{M}: {la.ch} channels do not split into heads "
                                         f"(num_heads={self.num_heads}, head_dim={self.head_dim})")
                ch = la.ch

        for n, block in self.input_blocks:
            run(f"input_blocks.{n}", block, False)
            skips.append(ch)
        run("middle_block", self.middle_block, False)
        for n, block in self.output_blocks:
            if block and block[0][1].kind == "res" and not skips:
                raise ModelFileError(f"{source}: output_blocks.{n} needs a skip connection, none is left")
            run(f"output_blocks.{n}", block, bool(block) and block[0][1].kind == "res")
        if ch != self.model_channels:
            raise ModelFileError(f"{source}: out.0 takes {self.model_channels} channels, {ch} arrive there")


_RE_BLOCK = re.compile(r"(input_blocks|output_blocks|middle_block)\.(?:(\d+)\.)?(\d+)\.(.+)")

# sd.cpp's UnetModelBlock hparams per version (LDM configs v1-inference.yaml, v2-inference.yaml,
# sd_xl_base.yaml; SSD-1B / Vega from sd.cpp's overrides). Inpaint/pix2pix: in_channels=9/8.
PRESETS = {
    "sd1": {},
    "sd2": {"context_dim": 1024, "use_linear": True, "num_heads": -1, "head_dim": 64},
    "sdxl": {"channel_mult": (1, 2, 4), "attention_levels": (1, 2), "transformer_depth": (0, 2, 10), "depth_middle": 10,
                 "context_dim": 2048, "adm_in_channels": 2816, "use_linear": True, "num_heads": -1, "head_dim": 64},
    "ssd1b": {"channel_mult": (1, 2, 4), "attention_levels": (1, 2), "transformer_depth": (0, 2, 4), "depth_middle": None,
                  "transformer_depth_output": (4, 4, 10, 2, 1, 1), "context_dim": 2048, "adm_in_channels": 2816,
                  "use_linear": True, "num_heads": -1, "head_dim": 64},
    "vega": {"channel_mult": (1, 2, 4), "attention_levels": (1, 2), "transformer_depth": (0, 1, 2), "depth_middle": None,
                 "context_dim": 2048, "adm_in_channels": 2816, "use_linear": True, "num_heads": -1, "head_dim": 64},
}


def _classify(lw: Weights, keys: set, where: str) -> Layer:
    if "in_layers.0.weight" in keys:
        return Layer("res", lw.shape("in_layers.2.weight")[3], lw["in_layers.0.weight"].nelements)
    if "op.weight" in keys:
        return Layer("down", lw.shape("op.weight")[3])
    if "proj_in.weight" in keys:
        depth = 1 + max((int(m.group(1)) for k in keys if (m := re.match(r"transformer_blocks\.(\d+)\.", k))),
                        default=-1)
        if depth < 1:
            raise ModelFileError(f"{where}: a SpatialTransformer without transformer_blocks")
        return Layer("attn", lw["norm.weight"].nelements, depth=depth, linear=lw["proj_in.weight"].ndim == 2)
    if "conv.weight" in keys:
        return Layer("up", lw.shape("conv.weight")[3])
    raise ModelFileError(f"{where}: not a ResBlock, SpatialTransformer, Downsample or Upsample "
                         f"(tensors: {', '.join(sorted(keys)[:4])}...)")


def _heads_rule(context_dim: int, layouts) -> dict:
    """SD1 (CLIP-L context, 768) has 8 heads; SD2 (1024), SDXL (2048) and the SDXL refiner (1280)
    have 64-wide heads (sd.cpp: num_heads=8 vs num_head_channels=64 by version). Other widths
    (tiny test models): 1x1-conv projections mean SD1-style, linear ones SD2-style."""
    if context_dim == 768:
        return {"num_heads": 8, "head_dim": -1}
    if context_dim in (1024, 1280, 2048):
        return {"num_heads": -1, "head_dim": 64}
    linear = any(la.linear for part in layouts.values() for ls in part.values() for _, la in ls if la.kind == "attn")
    return {"num_heads": -1, "head_dim": 64} if linear else {"num_heads": 8, "head_dim": -1}


def _same_shape(a, b) -> bool:
    """A 1x1 conv weight may be stored 2-D ([out, in]) or 4-D ([out, in, 1, 1])."""
    strip = lambda s: tuple(s[:2]) if len(s) == 4 and s[2:] == (1, 1) else tuple(s)
    return strip(tuple(a)) == strip(tuple(b))


class UNetModel:
    """UNetModel(table, prefix, config=None): blocks over the table's weights (any dtype the ops
    take: F32/F16/BF16/block types). `forward` builds the graph; `__call__` runs it on numpy."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = PREFIX, config: UNetConfig | None = None,
                 source: str = "model"):
        cfg = config or UNetConfig.detect_from_weights(table, prefix, source)
        cfg.check(source)
        self.config, self.prefix, self.source = cfg, prefix, source
        check_weights(table, prefix, cfg.weight_shapes(), source, "UNet", same=_same_shape)
        w = Weights(table, prefix, source)
        g, eps = cfg.num_groups, cfg.norm_eps
        self.time_embed = (Linear(w.sub("time_embed.0.")), Linear(w.sub("time_embed.2.")))
        self.label_emb = ((Linear(w.sub("label_emb.0.0.")), Linear(w.sub("label_emb.0.2.")))
                          if cfg.adm_in_channels else None)
        self.conv_in = Conv2d(w.sub("input_blocks.0.0."), padding=1)

        self.input_blocks = build_blocks(w, cfg, "input_blocks", cfg.input_blocks)
        self.middle_block = [(la.kind, make_layer(w.sub(f"middle_block.{M}."), la, cfg)) for M, la in cfg.middle_block]
        self.output_blocks = build_blocks(w, cfg, "output_blocks", cfg.output_blocks)
        self.out_norm = GroupNorm(w.sub("out.0."), g, eps)
        self.out_conv = Conv2d(w.sub("out.2."), padding=1)
        self._graphs = GraphCache()

    # ---- graph ------------------------------------------------------------------------------
    def forward(self, x: Tensor, timesteps: Tensor, context: Tensor | None = None, y: Tensor | None = None,
                c_concat: Tensor | None = None, controls: list | None = None,
                control_strength: float = 0.0) -> Tensor:
        """x [W, H, C, N], timesteps F32 [N], context [Cctx, L, N] (N or 1), y [adm, N] (SDXL),
        c_concat [W, H, Cc, N or 1] (inpaint/pix2pix: joined to x on channels) -> [W, H, out, N].
        controls: a ControlNet's outputs (one per input block, then the middle block's; sd.cpp
        unet.hpp): control_strength * the last is added to the middle block's output, the others
        to the skip connections, last first."""
        cfg = self.config
        N = x.ne4[3]
        if c_concat is not None:
            x = F.concat(x, batch_cond(c_concat, N, "UNet: c_concat"), 2)
        if x.ne4[2] != cfg.in_channels:
            raise UsageError(f"UNet: x (+ c_concat) has {x.ne4[2]} channels, the model takes {cfg.in_channels}")
        if timesteps.nelements not in (1, N):
            raise UsageError(f"UNet: {timesteps.nelements} timesteps for a batch of {N}")
        emb_silu = F.silu(embed_timesteps(self, timesteps, y, N, "UNet"))         # shared by all ResBlocks
        context = check_context(cfg, context, N, "UNet")
        if controls and len(controls) != len(self.input_blocks) + 2:
            raise UsageError(f"UNet: the ControlNet gives {len(controls)} controls, this UNet takes "
                             f"{len(self.input_blocks) + 2} (one per input block and the middle block)")

        def control(h, i):
            return F.add(h, F.scale(controls[i], control_strength)) if controls else h

        h = F.mark_cut(self.conv_in(x), "input_blocks.0")                          # [W, H, mc, N]
        hs = [h]
        for n, layers in self.input_blocks:
            h = F.mark_cut(run_layers(layers, h, emb_silu, context), f"input_blocks.{n}")
            hs.append(h)
        if self.middle_block:
            h = F.mark_cut(run_layers(self.middle_block, h, emb_silu, context), "middle_block")
        h = control(h, -1)                                                         # middle control
        k = len(hs) - 1                                                            # controls[k]: hs[k]'s
        for n, layers in self.output_blocks:
            if layers and layers[0][0] == "res":
                h = F.concat(h, control(hs.pop(), k), 2)                           # skip connection
                k -= 1
            h = F.mark_cut(run_layers(layers, h, emb_silu, context), f"output_blocks.{n}")
        return self.out_conv(self.out_norm(h, silu=True))                          # [W, H, out, N]

    # ---- numpy ------------------------------------------------------------------------------
    def predict(self, x_np, t_np, cond, backend: str = "cpu", controls=None, control_strength: float = 0.0
                ) -> np.ndarray:
        """The diffusion-model interface (sdrt.models.families): `cond` a Cond record; the UNet
        takes its context, y and c_concat and refuses reference latents and distilled guidance.
        controls / control_strength: a ControlNet's outputs (numpy, see forward)."""
        if cond.ref_latents or cond.guidance is not None:
            raise UsageError("UNet: this model takes no reference-image latents and no distilled guidance")
        return self(x_np, t_np, cond.context, cond.y, cond.c_concat, backend=backend, controls=controls,
                    control_strength=control_strength)

    def __call__(self, x_np, t_np, context_np=None, y_np=None, c_concat_np=None, backend: str = "cpu",
                 controls=None, control_strength: float = 0.0) -> np.ndarray:
        """Torch-order numpy in and out: x [N, C, H, W], t [N], context [N, L, Cctx], y [N, adm],
        c_concat [N, Cc, H, W], controls [[N, C_i, H_i, W_i], ...] -> float32 [N, out_channels, H, W]
        (eps or v). The graph of each input shape is built once and reused (inputs are copied into
        its leaves)."""
        arrays = [x_np, t_np, context_np, y_np, c_concat_np, *(controls or ())]
        arrays = [None if a is None else np.asarray(a, dtype=np.float32) for a in arrays]
        x = arrays[0]
        if x.ndim != 4:
            raise UsageError(f"UNet: x must be [N, C, H, W], got shape {x.shape}")
        arrays[1] = arrays[1].reshape(-1)
        strength = float(control_strength) if controls else 0.0
        return self._graphs.run(arrays, lambda v: self.forward(*v[:5], controls=v[5:], control_strength=strength),
                                backend, extra=(strength,))


# ---- pieces the ControlNet (controlnet.py) shares -------------------------------------------------

def make_layer(lw: Weights, la: Layer, cfg: UNetConfig):
    """The block of one Layer over its weights (`lw` at the layer's prefix)."""
    g, eps = cfg.num_groups, cfg.norm_eps
    if la.kind == "res":
        return ResBlock(lw, g, eps)
    if la.kind == "attn":
        return SpatialTransformer(lw, cfg.heads(la.ch), la.depth, g, cfg.gelu)
    return Downsample(lw) if la.kind == "down" else Upsample(lw)


def build_blocks(w: Weights, cfg: UNetConfig, part: str, layout) -> list:
    """[(N, [(kind, block), ...]), ...] for `part.N.M.` of a layout ((N, Block), ...)."""
    return [(n, [(la.kind, make_layer(w.sub(f"{part}.{n}.{M}."), la, cfg)) for M, la in b]) for n, b in layout]


def run_layers(layers, h: Tensor, emb_silu: Tensor, context: Tensor | None) -> Tensor:
    for kind, blk in layers:
        h = blk(h, emb_silu) if kind == "res" else blk(h, context) if kind == "attn" else blk(h)
    return h


def embed_timesteps(m, timesteps: Tensor, y: Tensor | None, N: int, who: str) -> Tensor:
    """time_embed(timestep_embedding(t)) (+ label_emb(y), SDXL) of a model `m` with .config,
    .time_embed and .label_emb, repeated to batch N -> [E, N] (before the SiLU)."""
    cfg = m.config
    emb = F.timestep_embedding(timesteps, cfg.model_channels)                     # [mc, N or 1]
    emb = m.time_embed[1](F.silu(m.time_embed[0](emb)))                          # [E, .]
    if m.label_emb is not None:
        if y is None:
            raise UsageError(f"{who}: this model (SDXL-style label_emb) needs y [adm, N]")
        if y.ne[0] != cfg.adm_in_channels:
            raise UsageError(f"{who}: y has {y.ne[0]} features, label_emb takes {cfg.adm_in_channels}")
        lab = m.label_emb[1](F.silu(m.label_emb[0](batch_cond(y, N, f"{who}: y"))))  # [E, N]
        emb = F.add(lab, emb)
    elif y is not None:
        raise UsageError(f"{who}: y given, but this model has no label_emb")
    if emb.ne4[1] != N:
        emb = F.repeat(emb, (emb.ne[0], N))
    return emb


def check_context(cfg: UNetConfig, context: Tensor | None, N: int, who: str) -> Tensor | None:
    if context is not None:
        if context.ne[0] != cfg.context_dim:
            raise UsageError(f"{who}: context has width {context.ne[0]}, the model takes {cfg.context_dim}")
        return batch_cond(context, N, f"{who}: context")
    if cfg.transformer_depth or cfg.transformer_depth_middle > 0:
        raise UsageError(f"{who}: this model has cross-attention and needs a context")
    return None

