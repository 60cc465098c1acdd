"""ESRGAN / Real-ESRGAN super-resolution: RRDBNet as sd.cpp's esrgan.hpp builds and loads it.

Architecture (BasicSR's rrdbnet_arch; shapes in ne order, x ne=[W, H, 3, N] in [0, 1]):
    feat = conv_first(x)
    body = conv_body(RRDB x num_block (feat));  feat = feat + body
    scale >= 2: feat = lrelu(conv_up1(nearest x2 (feat)))
    scale == 4: feat = lrelu(conv_up2(nearest x2 (feat)))
    out  = conv_last(lrelu(conv_hr(feat)))
  RRDB(x)  = x + 0.2 * rdb3(rdb2(rdb1(x)))
  RDB(x)   = x + 0.2 * conv5([x, x1, x2, x3, x4]),  x_k = lrelu(conv_k([x, x1 .. x_{k-1}]))
  every conv 3x3 / pad 1, lrelu slope 0.2.

Checkpoints (what sd.cpp's ESRGAN::load_from_file accepts):
- BasicSR / Real-ESRGAN names (`conv_first`, `body.N.rdbK.convJ`, `conv_body`, `conv_up1/2`,
  `conv_hr`, `conv_last`), e.g. RealESRGAN_x4plus(.pth) and RealESRGAN_x4plus_anime_6B; a
  `params_ema.` / `params.` wrapper is looked through (sd.cpp flattens the pickle's nested dicts);
  the scale is 4 with `conv_up2`, 2 with `conv_up1` only, else 1.
- "old" ESRGAN names (`model.0`, `model.1.sub.N.RDBK.convJ.0`, ..., 4x-UltraSharp-style files):
  recognised by `model.0.weight`; the scale from the highest `model.N` index (<= 4: 1, <= 7: 2,
  else 4) and the tail mapped as sd.cpp maps it (x4: model.3/6/8/10; x2: 3/5/7; x1: 2/4).
- the number of blocks from the highest body index. sd.cpp fixes 64 features and 32 growth
  channels; here they are read from the weight shapes (the same on every file sd.cpp loads).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import ModelFileError, UsageError
from ..ops import api as F
from ..ops.tensor import Tensor
from .common import Conv2d, GraphCache, Weights

__all__ = ["RRDBNet", "RRDBNetConfig", "detect_esrgan", "to_basicsr_names"]

LRELU_SLOPE = 0.2
RESIDUAL_SCALE = 0.2
_WRAPPERS = ("params_ema.", "params.")


def _lrelu(x: Tensor) -> Tensor:
    return F.leaky_relu(x, LRELU_SLOPE)


def _unwrap(names) -> str:
    """The wrapper prefix the tensors sit under ('' when none); params_ema wins, as in BasicSR."""
    names = list(names)
    for p in _WRAPPERS:
        if any(n.startswith(p) for n in names):
            return p
    return ""


def _max_index(names, pattern: str) -> int:
    rx = re.compile(pattern)
    best = -1
    for n in names:
        m = rx.match(n)
        if m:
            best = max(best, int(m.group(1)))
    return best


@dataclass(frozen=True)
class RRDBNetConfig:
    scale: int
    num_block: int
    num_in_ch: int = 3
    num_out_ch: int = 3
    num_feat: int = 64
    num_grow_ch: int = 32
    old_names: bool = False       # the file used the "old" ESRGAN layout


def detect_esrgan(names) -> tuple[str, bool, int, int]:
    """(wrapper prefix, old layout?, scale, num_block) from the tensor names, as sd.cpp detects them."""
    names = list(names)
    prefix = _unwrap(names)
    inner = [n[len(prefix):] for n in names if n.startswith(prefix)]
    old = "model.0.weight" in inner
    if old:
        num_block = _max_index(inner, r"model\.1\.sub\.(\d+)\.RDB\d") + 1
        top = _max_index(inner, r"model\.(\d+)\.")
        scale = 1 if top <= 4 else 2 if top <= 7 else 4
    else:
        num_block = _max_index(inner, r"body\.(\d+)\.") + 1
        scale = 4 if "conv_up2.weight" in inner else 2 if "conv_up1.weight" in inner else 1
    return prefix, old, scale, num_block


def to_basicsr_names(old: Mapping[str, Tensor], scale: int, num_block: int) -> dict[str, Tensor]:
    """The "old" ESRGAN names mapped to BasicSR's (sd.cpp's expected_to_model table, inverted)."""
    m = {"model.0": "conv_first", f"model.1.sub.{num_block}": "conv_body"}
    for i in range(num_block):
        for j in range(1, 4):
            for k in range(1, 6):
                m[f"model.1.sub.{i}.RDB{j}.conv{k}.0"] = f"body.{i}.rdb{j}.conv{k}"
    tail = {1: {"model.2": "conv_hr", "model.4": "conv_last"},
            2: {"model.3": "conv_up1", "model.5": "conv_hr", "model.7": "conv_last"},
            4: {"model.3": "conv_up1", "model.6": "conv_up2", "model.8": "conv_hr", "model.10": "conv_last"}}[scale]
    m.update(tail)
    out = {}
    for src, dst in m.items():
        for kind in ("weight", "bias"):
            t = old.get(f"{src}.{kind}")
            if t is not None:
                out[f"{dst}.{kind}"] = t
    return out


def _conv(w: Weights, key: str, cin: int, cout: int) -> Conv2d:
    ne = w.shape(f"{key}.weight")
    if tuple(ne) != (3, 3, cin, cout):
        raise ModelFileError(f"{w.source}: {key}.weight has shape {list(reversed(ne))}, "
                             f"expected [{cout}, {cin}, 3, 3]")
    if f"{key}.bias" not in w:
        w[f"{key}.bias"]   # raises, naming it
    return Conv2d(w.sub(key + "."), padding=1)


class ResidualDenseBlock:
    def __init__(self, w: Weights, nf: int, gc: int):
        self.convs = [_conv(w, f"conv{k}", nf + (k - 1) * gc, gc if k < 5 else nf) for k in range(1, 6)]

    def __call__(self, x: Tensor) -> Tensor:
        cat = x
        for conv in self.convs[:4]:
            cat = F.concat(cat, _lrelu(conv(cat)), 2)
        return F.add(F.scale(self.convs[4](cat), RESIDUAL_SCALE), x)


class RRDB:
    def __init__(self, w: Weights, nf: int, gc: int):
        self.rdbs = [ResidualDenseBlock(w.sub(f"rdb{j}."), nf, gc) for j in (1, 2, 3)]

    def __call__(self, x: Tensor) -> Tensor:
        out = x
        for rdb in self.rdbs:
            out = rdb(out)
        return F.add(F.scale(out, RESIDUAL_SCALE), x)


class RRDBNet:
    """`RRDBNet(table, source=path)`: the network from a checkpoint's tensors (either layout).
    `graph(x)` builds the lazy graph; `__call__(x, backend)` takes and gives numpy [N, 3, H, W]
    float32 (values as the model gives them: not clamped)."""

    def __init__(self, table: Mapping[str, Tensor], source: str = "esrgan"):
        prefix, old, scale, num_block = detect_esrgan(table.keys())
        if num_block <= 0:
            raise ModelFileError(f"{source}: not an ESRGAN/RRDBNet model (no body.N / model.1.sub.N RRDB blocks)")
        inner = {k[len(prefix):]: v for k, v in table.items() if k.startswith(prefix)}
        if old:
            inner = to_basicsr_names(inner, scale, num_block)
        w = Weights(inner, "", source)
        first = w.shape("conv_first.weight")       # ne [3, 3, in, feat]
        nf, cin = first[3], first[2]
        gc = w.shape("body.0.rdb1.conv1.weight")[3]
        cout = w.shape("conv_last.weight")[3]
        self.config = RRDBNetConfig(scale, num_block, cin, cout, nf, gc, old)
        self.scale = scale
        self._graphs = GraphCache()
        self.conv_first = _conv(w, "conv_first", cin, nf)
        self.body = [RRDB(w.sub(f"body.{i}."), nf, gc) for i in range(num_block)]
        self.conv_body = _conv(w, "conv_body", nf, nf)
        self.conv_up1 = _conv(w, "conv_up1", nf, nf) if scale >= 2 else None
        self.conv_up2 = _conv(w, "conv_up2", nf, nf) if scale == 4 else None
        self.conv_hr = _conv(w, "conv_hr", nf, nf)
        self.conv_last = _conv(w, "conv_last", nf, cout)

    def graph(self, x: Tensor) -> Tensor:
        """x ne=[W, H, in_ch, N] -> ne=[W*s, H*s, out_ch, N]."""
        if x.ne4[2] != self.config.num_in_ch:
            raise UsageError(f"ESRGAN: input has {x.ne4[2]} channels, the model takes {self.config.num_in_ch}")
        feat = self.conv_first(x)
        body = feat
        for block in self.body:
            body = block(body)
        feat = F.add(feat, self.conv_body(body))
        for up in (self.conv_up1, self.conv_up2):
            if up is not None:
                feat = _lrelu(up(F.upscale(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(_lrelu(self.conv_hr(feat)))

    def __call__(self, x: np.ndarray, backend="cpu") -> np.ndarray:
        a = np.asarray(x)
        if a.ndim != 4:
            raise UsageError(f"ESRGAN input must be [N, C, H, W], got shape {a.shape}")
        # one graph per input shape, run again for every tile of that shape (a GPU replays it)
        return self._graphs.run([np.asarray(a, np.float32)], lambda v: self.graph(v[0]), backend)
