"""TAESD / TAE: the tiny autoencoders of madebyollin/taesd (sd.cpp's tae.hpp `TAESD`).

TAESD (SD 1.x/2.x), TAESDXL (SDXL), TAESD3 / TAEF1 (16 latent channels) and TAEF2 (FLUX.2: 32
latent channels, a GroupNorm "pool" in the mid blocks, latents patchified 2x2 into the 128
channels FLUX.2 samples in). All are one architecture, read from the weights:

    encoder: conv(3, C), Block, [conv stride 2 (no bias), Block x3] x3, conv(C, z)
    decoder: tanh(z/3)*3, conv(z, C), ReLU, [Block x3, upsample x2 nearest, conv (no bias)] x3,
             Block, conv(C, 3)
    Block(x): x += pool(x) (TAEF2 mid blocks: 1x1 conv C->4C, GroupNorm(4), ReLU, 1x1 conv 4C->C);
              ReLU(conv3x3-ReLU-conv3x3-ReLU-conv3x3 (x) + skip(x))

Images are [0, 1] on both sides (sd.cpp does not rescale TAE input/output; the decoder output is
not clamped). Latents are the diffusion model's own (no scale factor).

Name layouts (both as sd.cpp and diffusers load them):
- diffusers `AutoencoderTiny` / sd.cpp: `decoder.layers.N.*`, `encoder.layers.N.*` (decoder
  conv_in is layer 0, the clamp is not a layer);
- taesd.py's separate files (`taesd_decoder.pth`, `taef2_encoder.pth`, ...): bare `N.*`, where
  the decoder's nn.Sequential starts with the Clamp module, so every decoder index is one higher.
The decoder's layout is told by whether `0.weight` exists.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Conv2d, Weights
from .autoencoder_kl import upsample_conv3x3

__all__ = ["TinyAutoencoder", "TAEConfig", "patchify", "unpatchify"]

NUM_BLOCKS = 3
# layer plans in diffusers / sd.cpp indexing: (index, kind); kinds: conv_in, conv_s2 (stride 2, no bias),
# block, relu, up (nearest x2), conv (the no-bias conv after up), conv_out
ENCODER_PLAN = ([(0, "conv_in"), (1, "block")]
                + [(2 + 4 * s + k, "conv_s2" if k == 0 else "block") for s in range(3) for k in range(4)]
                + [(14, "conv_out")])
DECODER_PLAN = ([(0, "conv_in"), (1, "relu")]
                + [(2 + 5 * s + k, ("block", "block", "block", "up", "conv")[k]) for s in range(3) for k in range(5)]
                + [(17, "block"), (18, "conv_out")])
GN_GROUPS, GN_EPS = 4, 1e-5   # taesd.py's nn.GroupNorm(4, 4C) (sd.cpp runs it with eps 1e-6)


def patchify(x: Tensor, p: int = 2) -> Tensor:
    """ne [W, H, C, N] -> [W/p, H/p, C*p*p, N]; channel c*p*p + dy*p + dx (sd.cpp's patchify,
    diffusers' Flux2 _patchify_latents)."""
    W, H, C = x.ne[0], x.ne[1], x.ne4[2]
    N = x.ne4[3]
    w, h = W // p, H // p
    x = F.cont(x).reshape(W, p, h, C * N)
    x = F.cont(x.permute(0, 2, 1, 3)).reshape(p, w, h, p * C * N)    # [dx, w, h, (n, c, dy)]
    x = F.cont(x.permute(2, 0, 1, 3))                               # [w, h, dx, (n, c, dy)]
    return x.reshape(w, h, p * p * C, N)


def unpatchify(x: Tensor, p: int = 2) -> Tensor:
    """ne [w, h, C*p*p, N] -> [w*p, h*p, C, N], the inverse of `patchify`."""
    w, h, Cp = x.ne[0], x.ne[1], x.ne4[2]
    N = x.ne4[3]
    C = Cp // (p * p)
    x = F.cont(x).reshape(w, h, p, p * C * N)
    x = F.cont(x.permute(1, 2, 0, 3)).reshape(p * w, h, p, C * N)   # [(w, dx), h, dy, (n, c)]
    x = F.cont(x.permute(0, 2, 1, 3))                               # [(w, dx), dy, h, (n, c)]
    return x.reshape(p * w, p * h, C, N)


@dataclass(frozen=True)
class TAEConfig:
    z_channels: int
    channels: int
    midblock_gn: bool
    has_encoder: bool
    has_decoder: bool
    decoder_offset: int = 0   # 1 for taesd.py decoder files (Clamp at index 0)

    @property
    def latent_channels(self) -> int:
        """Channels of the diffusion latent: z, or 4z for TAEF2 (2x2 patchified)."""
        return self.z_channels * 4 if self.midblock_gn and self.z_channels == 32 else self.z_channels


class _Block:
    def __init__(self, w: Weights, c: int):
        self.conv = [Conv2d(w.sub(f"conv.{i}."), padding=1) for i in (0, 2, 4)]
        for i, cv in zip((0, 2, 4), self.conv):
            _check(cv, w, f"conv.{i}.weight", (3, 3, c, c))
        self.skip = Conv2d(w.sub("skip.")) if "skip.weight" in w else None
        self.pool = None
        if "pool.0.weight" in w:
            self.pool = (Conv2d(w.sub("pool.0.")), w["pool.1.weight"], w["pool.1.bias"], Conv2d(w.sub("pool.3.")))

    def __call__(self, x: Tensor) -> Tensor:
        if self.pool is not None:
            c0, gw, gb, c3 = self.pool
            p = F.relu(F.group_norm_affine(c0(x), gw, gb, GN_GROUPS, GN_EPS))
            x = F.add(x, c3(p))
        h = F.relu(self.conv[0](x))
        h = F.relu(self.conv[1](h))
        h = self.conv[2](h)
        return F.relu(F.add(h, self.skip(x) if self.skip is not None else x))


def _check(conv: Conv2d, w: Weights, key: str, ne):
    if conv.weight.ne != tuple(ne):
        raise ModelFileError(f"{w.source}: {w.prefix}{key} has shape {conv.weight.ne[::-1]}, "
                             f"expected {tuple(ne)[::-1]}")


def _layers(w: Weights, plan, offset: int, c: int, cin: int, cout: int, folded: bool = True):
    out = []
    for i, kind in plan:
        sub = w.sub(f"{i + offset}.")
        if kind == "block":
            out.append(_Block(sub, c))
        elif kind == "relu":
            out.append(F.relu)
        elif kind == "up":
            continue   # the upsample conv that follows takes it (see _UpConv)
        else:
            cv = Conv2d(sub, stride=2 if kind == "conv_s2" else 1, padding=1)
            ic = cin if kind == "conv_in" else c
            oc = cout if kind == "conv_out" else c
            _check(cv, sub, "weight", (3, 3, ic, oc))
            out.append(_UpConv(cv, folded) if kind == "conv" else cv)
    return out


class _UpConv:
    """nn.Upsample(x2 nearest) + conv: one folded transposed conv (autoencoder_kl.upsample_conv3x3)."""

    def __init__(self, conv: Conv2d, folded: bool):
        self.conv, self.folded = conv, folded

    def __call__(self, x: Tensor) -> Tensor:
        return upsample_conv3x3(x, self.conv.weight, self.conv.bias, self.folded)


def _role(w: Weights) -> str | None:
    """'encoder' / 'decoder' for a bare layer table, from its first conv's input channels."""
    for k in ("0.weight", "1.weight"):
        t = w.get(k)
        if t is not None and t.ndim == 4:
            return "encoder" if k == "0.weight" and t.ne[2] == 3 and "14.weight" in w else "decoder"
    return None


class TinyAutoencoder:
    """`TinyAutoencoder(decoder=table, encoder=table, decoder_prefix=..., encoder_prefix=...)`
    from layer tables of either layout, or `TinyAutoencoder.from_table(table, prefix)` for one
    file (`decoder.layers.*` / `encoder.layers.*`, or a bare taesd.py encoder/decoder file).
    `decode(z)` / `encode(x)` take and give numpy [N, C, H, W]; images in [0, 1].
    The decoder's upsample + conv pairs run folded (autoencoder_kl.upsample_conv3x3) unless
    `folded_upsample=False`."""

    def __init__(self, decoder: Mapping[str, Tensor] | None = None, encoder: Mapping[str, Tensor] | None = None,
                 *, decoder_prefix: str = "", encoder_prefix: str = "", source: str = "tae",
                 folded_upsample: bool = True):
        if decoder is None and encoder is None:
            raise UsageError("TinyAutoencoder needs a decoder and/or an encoder weight table")
        self.source = source
        self.decoder = self.encoder = None
        zc = ch = None
        gn = False
        off = 0
        if decoder is not None:
            w = Weights(decoder, decoder_prefix, source)
            off = 0 if "0.weight" in w else 1
            first = w[f"{off}.weight"]
            zc, ch = first.ne[2], first.ne[3]
            gn = f"{2 + off}.pool.0.weight" in w
            self.decoder = _layers(w, DECODER_PLAN, off, ch, zc, 3, folded_upsample)
        if encoder is not None:
            w = Weights(encoder, encoder_prefix, source)
            ech, ezc = w.shape("0.weight")[3], w.shape("14.weight")[3]
            if zc is not None and (ech, ezc) != (ch, zc):
                raise ModelFileError(f"{source}: encoder ({ech} channels, {ezc} latent) does not match the "
                                     f"decoder ({ch} channels, {zc} latent)")
            zc, ch = ezc, ech
            gn = gn or "11.pool.0.weight" in w
            self.encoder = _layers(w, ENCODER_PLAN, 0, ch, 3, zc)
        self.config = TAEConfig(zc, ch, gn, encoder is not None, decoder is not None, off)

    @classmethod
    def from_table(cls, table: Mapping[str, Tensor], prefix: str = "", source: str = "tae") -> TinyAutoencoder:
        w = Weights(table, prefix, source)
        dec = "decoder.layers.0.weight" in w or "decoder.layers.1.weight" in w
        enc = "encoder.layers.0.weight" in w
        if dec or enc:
            return cls(table if dec else None, table if enc else None, decoder_prefix=prefix + "decoder.layers.",
                       encoder_prefix=prefix + "encoder.layers.", source=source)
        role = _role(w)
        if role is None:
            raise ModelFileError(f"{source}: not a TAESD/TAE file: no {prefix}decoder.layers.0.weight, "
                                 f"{prefix}0.weight or {prefix}1.weight")
        return cls(**{role: table, f"{role}_prefix": prefix}, source=source)

    # graph builders (ne order)
    def decode_graph(self, z: Tensor) -> Tensor:
        """z ne=[w, h, z or 4z (patchified TAEF2), N] -> F32 [8w(*2), 8h(*2), 3, N], ~[0, 1]."""
        if self.decoder is None:
            raise UsageError("this TAE has no decoder weights")
        zc = self.config.z_channels
        if z.ne4[2] == 4 * zc:
            z = unpatchify(z, 2)
        elif z.ne4[2] != zc:
            raise UsageError(f"TAE decode: latent has {z.ne4[2]} channels, this TAE takes {zc} "
                             f"(or {4 * zc} patchified)")
        h = F.scale(F.tanh(F.scale(z, 1.0 / 3.0)), 3.0)
        for layer in self.decoder:
            h = layer(h)
        return h

    def encode_graph(self, x: Tensor, patchified: bool = False) -> Tensor:
        """x ne=[W, H, 3, N] in [0, 1] -> [W/8, H/8, z, N] (patchified: [W/16, H/16, 4z, N])."""
        if self.encoder is None:
            raise UsageError("this TAE has no encoder weights")
        f = 16 if patchified else 8
        if x.ne4[2] != 3 or x.ne[0] % f or x.ne[1] % f:
            raise UsageError(f"TAE encode: image ne {list(x.ne)} must have 3 channels and sides that are "
                             f"multiples of {f}")
        h = x
        for layer in self.encoder:
            h = layer(h)
        return patchify(h, 2) if patchified else h

    def decode(self, z: np.ndarray, backend="cpu") -> np.ndarray:
        """z [N, z or 4z, h, w] -> image [N, 3, 8h, 8w] (x2 for patchified latents), ~[0, 1]."""
        return F.compute(self.decode_graph(_input(z, "latent")), backend=backend)

    def encode(self, x: np.ndarray, patchified: bool = False, backend="cpu") -> np.ndarray:
        """image [N, 3, H, W] in [0, 1] -> latent [N, z, H/8, W/8] (or patchified)."""
        return F.compute(self.encode_graph(_input(x, "image"), patchified), backend=backend)


def _input(a: np.ndarray, what: str) -> Tensor:
    a = np.asarray(a)
    if a.ndim != 4:
        raise UsageError(f"TAE {what} must be [N, C, H, W], got shape {a.shape}")
    return Tensor.from_numpy(np.ascontiguousarray(a, dtype=np.float32), name=f"tae_{what}")
