"""ControlNet for the LDM UNet (sd.cpp control.hpp; ComfyUI cldm.py; diffusers ControlNetModel).

A copy of the UNet's encoder (time/label embedding, input blocks, middle block) whose input is
the latent plus a "guided hint": the control image [W, H, 3] (values in [0, 1]) through
`input_hint_block` (8 3x3 convs with SiLU between them, three of stride 2, so the hint lands on
the latent grid with model_channels channels). After conv_in and after every input block a
1x1 "zero conv" (`zero_convs.N.0`) gives one control, and `middle_block_out.0` one for the middle
block; the UNet adds control_strength times each to its skip connections and its middle block's
output (UNetModel.forward's `controls`).

Weights: sd.cpp's names, which are the original ControlNet checkpoint's (`control_model.` in the
.pth files, stripped by sd.cpp and by sdrt's name conversion): time_embed.{0,2}, label_emb.0.{0,2}
(SDXL), input_blocks.N.M, middle_block.M, zero_convs.N.0, input_hint_block.{0,2,...,14},
middle_block_out.0. They are read here under the canonical prefix `control_model.`.

The layout is read from the names and shapes (as UNetConfig.detect_from_weights does for the
UNet; the same Layer records, blocks and head rule): sd.cpp instead builds a fixed layout from the
base model's version — SD1 (8 heads), SD2/SDXL (64-wide heads; SDXL channel_mult (1, 2, 4) and
transformer depth (0, 2, 10)) — always with 1x1-conv proj_in/proj_out, so the files it loads are
those layouts; sdrt also takes linear projections (diffusers-converted SDXL ControlNets).
sd.cpp reads no diffusers-format ControlNet (`controlnet_cond_embedding.*`, `down_blocks.*`): its
name conversion has no rule for them, and neither does sdrt.

Shapes in ne order: x [W, H, C, N], hint [W*8, H*8, 3, 1], guided hint [W, H, mc, 1].
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Conv2d, GraphCache, Linear, Weights
from .unet import (
    _RE_BLOCK,
    UNetConfig,
    _classify,
    _heads_rule,
    build_blocks,
    check_context,
    embed_timesteps,
    make_layer,
    run_layers,
)

__all__ = ["PREFIX", "ControlNetModel", "canonical_controlnet_names", "detect_controlnet"]

PREFIX = "control_model."
HINT_CONVS = (0, 2, 4, 6, 8, 10, 12, 14)     # input_hint_block.N: convs; the odd indices are SiLUs
HINT_STRIDE2 = (4, 8, 12)


def detect_controlnet(table: Mapping[str, Tensor], prefix: str = PREFIX, source: str = "control net") -> UNetConfig:
    """The encoder layout (a UNetConfig without output blocks) from the tensor names and shapes."""
    w = Weights(table, prefix, source)
    for need in ("input_blocks.0.0.weight", "time_embed.0.weight", "input_hint_block.0.weight",
                 "zero_convs.0.0.weight", "middle_block_out.0.weight"):
        if need not in w:
            raise ModelFileError(f"{source}: not a ControlNet (no {need!r}; sd.cpp's names: time_embed.*, "
                                 f"input_blocks.*, zero_convs.*, input_hint_block.*, middle_block_out.*)")
    conv_in = w["input_blocks.0.0.weight"]
    if conv_in.ndim != 4:
        raise ModelFileError(f"{source}: input_blocks.0.0.weight has ne={conv_in.ne}, expected a 3x3 conv")
    found: dict[tuple, set] = {}
    for key in w.keys():
        m = _RE_BLOCK.match(key)
        if m:
            part, n, M, rest = m.group(1), int(m.group(2) or 0), int(m.group(3)), m.group(4)
            if part == "output_blocks":
                raise ModelFileError(f"{source}: {prefix}{key}: a ControlNet has no output blocks (a UNet?)")
            if part == "input_blocks" and n == 0:
                continue
            found.setdefault((part, n, M), set()).add(rest)
    layouts: dict = {"input_blocks": {}, "middle_block": {}}
    context_dim = 0
    for (part, n, M), keys in sorted(found.items()):
        base = f"{part}.{n}.{M}." if part != "middle_block" else f"middle_block.{M}."
        layer = _classify(w.sub(base), keys, f"{source}: {prefix}{base[:-1]}")
        if layer.kind == "attn" and not context_dim:
            context_dim = w.shape(base + "transformer_blocks.0.attn2.to_k.weight")[0]
        layouts[part].setdefault(n, []).append((M, layer))
    adm = w.shape("label_emb.0.0.weight")[0] if "label_emb.0.0.weight" in w else 0
    inputs = tuple((n, tuple(ls)) for n, ls in sorted(layouts["input_blocks"].items()))
    for n, _ in inputs:
        if f"zero_convs.{n}.0.weight" not in w:
            raise ModelFileError(f"{source}: input_blocks.{n} has no zero conv ({prefix}zero_convs.{n}.0.weight)")
    return UNetConfig(in_channels=conv_in.ne[2], out_channels=0, model_channels=conv_in.ne[3],
                      time_embed_dim=w.shape("time_embed.0.weight")[1], context_dim=context_dim,
                      adm_in_channels=adm, **_heads_rule(context_dim, layouts), input_blocks=inputs,
                      middle_block=tuple(layouts["middle_block"].get(0, ())), output_blocks=())


def _check_channels(cfg: UNetConfig, source: str) -> None:
    ch = cfg.model_channels
    for name, block in [(f"input_blocks.{n}", b) for n, b in cfg.input_blocks] + [("middle_block", cfg.middle_block)]:
        for M, la in block:
            got = la.in_ch if la.kind == "res" else la.ch
            if got != ch:
                raise ModelFileError(f"{source}: {name}.{M} takes {got} channels, but {ch} arrive there")
            if la.kind == "attn" and (cfg.heads(la.ch) < 1 or la.ch % cfg.heads(la.ch)):
                raise ModelFileError(f"{source}: {name}.{M}: {la.ch} channels do not split into heads")
            ch = la.ch


class ControlNetModel:
    """ControlNetModel(table, prefix="control_model."): `hint` runs input_hint_block once per
    control image; `forward` / `__call__` give the controls of one step."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = PREFIX, source: str = "control net",
                 config: UNetConfig | None = None):
        cfg = config or detect_controlnet(table, prefix, source)
        _check_channels(cfg, source)
        self.config, self.prefix, self.source = cfg, prefix, source
        w = Weights(table, prefix, source)
        self.time_embed = (Linear(w.sub("time_embed.0.")), Linear(w.sub("time_embed.2.")))
        self.label_emb = ((Linear(w.sub("label_emb.0.0.")), Linear(w.sub("label_emb.0.2.")))
                          if cfg.adm_in_channels else None)
        self.conv_in = Conv2d(w.sub("input_blocks.0.0."), padding=1)
        self.hint_convs = [Conv2d(w.sub(f"input_hint_block.{i}."), stride=2 if i in HINT_STRIDE2 else 1, padding=1)
                           for i in HINT_CONVS]
        hint_out = w.shape("input_hint_block.14.weight")[3]   # ne order: [kw, kh, in, out]
        if hint_out != cfg.model_channels:
            raise ModelFileError(f"{source}: input_hint_block.14 gives {hint_out} channels, conv_in "
                                 f"{cfg.model_channels}")
        self.hint_channels = w.shape("input_hint_block.0.weight")[2]
        self.input_blocks = build_blocks(w, cfg, "input_blocks", cfg.input_blocks)
        self.middle_block = [(la.kind, make_layer(w.sub(f"middle_block.{M}."), la, cfg)) for M, la in cfg.middle_block]
        self.zero_convs = [Conv2d(w.sub(f"zero_convs.{n}.0.")) for n in [0] + [n for n, _ in cfg.input_blocks]]
        self.middle_out = Conv2d(w.sub("middle_block_out.0."))
        self._graphs = GraphCache()
        self._hint_graphs = GraphCache(size=2)

    @property
    def num_controls(self) -> int:
        return len(self.zero_convs) + 1

    # ---- graph ------------------------------------------------------------------------------
    def hint_forward(self, hint: Tensor) -> Tensor:
        """hint [W8, H8, 3, 1] in [0, 1] -> guided hint [W, H, mc, 1] (conv, SiLU, ..., conv)."""
        h = hint
        for i, conv in enumerate(self.hint_convs):
            h = conv(h)
            if i < len(self.hint_convs) - 1:
                h = F.silu(h)
        return h

    def forward(self, x: Tensor, guided_hint: Tensor, timesteps: Tensor, context: Tensor | None = None,
                y: Tensor | None = None) -> list[Tensor]:
        """x [W, H, C, N], guided hint [W, H, mc, 1 or N], timesteps [N], context [Cctx, L, N or 1],
        y [adm, N or 1] -> the controls: one [W_i, H_i, C_i, N] per zero conv, then the middle one."""
        cfg = self.config
        N = x.ne4[3]
        if x.ne4[2] != cfg.in_channels:
            raise UsageError(f"ControlNet: x has {x.ne4[2]} channels, the model takes {cfg.in_channels}")
        if guided_hint.ne4[:3] != (x.ne4[0], x.ne4[1], cfg.model_channels):
            raise UsageError(f"ControlNet: the guided hint is {guided_hint.ne4[:3]}, the latent grid "
                             f"{x.ne4[:2]} with {cfg.model_channels} channels")
        emb_silu = F.silu(embed_timesteps(self, timesteps, y, N, "ControlNet"))
        context = check_context(cfg, context, N, "ControlNet")
        h = F.add(self.conv_in(x), guided_hint)                                    # [W, H, mc, N]
        outs = [self.zero_convs[0](h)]
        for i, (n, layers) in enumerate(self.input_blocks):
            h = F.mark_cut(run_layers(layers, h, emb_silu, context), f"input_blocks.{n}")
            outs.append(self.zero_convs[i + 1](h))
        h = run_layers(self.middle_block, h, emb_silu, context)
        outs.append(self.middle_out(h))
        return outs

    # ---- numpy ------------------------------------------------------------------------------
    def hint(self, image_np, backend="cpu") -> np.ndarray:
        """Control image [1, 3, H, W] float32 in [0, 1] -> guided hint [1, mc, H/8, W/8]."""
        a = np.asarray(image_np, np.float32)
        if a.ndim != 4 or a.shape[0] != 1 or a.shape[1] != self.hint_channels or a.shape[2] % 8 or a.shape[3] % 8:
            raise UsageError(f"ControlNet: the control image must be [1, {self.hint_channels}, H, W] with H and W "
                             f"multiples of 8, got {a.shape}")
        return np.array(self._hint_graphs.run([a], lambda v: self.hint_forward(v[0]), backend))

    def __call__(self, x_np, guided_hint_np, t_np, context_np=None, y_np=None, backend="cpu") -> list[np.ndarray]:
        """Torch order: x [N, C, h, w], guided hint [1 or N, mc, h, w], t [N], context [N, L, Cctx],
        y [N, adm] -> the controls, [N, C_i, h_i, w_i] float32 each (copies)."""
        arrays = [x_np, guided_hint_np, t_np, context_np, y_np]
        arrays = [None if a is None else np.asarray(a, np.float32) for a in arrays]
        if arrays[0].ndim != 4:
            raise UsageError(f"ControlNet: x must be [N, C, H, W], got shape {arrays[0].shape}")
        arrays[2] = arrays[2].reshape(-1)
        outs = self._graphs.run(arrays, lambda v: self.forward(*v), backend)
        return [np.array(o) for o in outs]


_ROOTS = ("time_embed.", "label_emb.", "input_blocks.", "middle_block.", "zero_convs.", "input_hint_block.",
          "middle_block_out.")


def canonical_controlnet_names(names) -> dict[str, str]:
    """{file name: canonical name} of a ControlNet file's tensors: sd.cpp strips a leading
    `control_model.` (the .pth form) and reads the rest by its own names; sdrt puts them under
    PREFIX. Names outside the ControlNet (the full SD model some early .pth files carry beside
    it) are left out, as sd.cpp ignores them ("unknown tensor")."""
    out = {}
    for n in names:
        rest = n[len(PREFIX):] if n.startswith(PREFIX) else n
        if rest.startswith(_ROOTS):
            out[n] = PREFIX + rest
    return out
