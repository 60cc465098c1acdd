"""The Wan-2.1 causal 3-D VAE on one frame: Qwen-Image's VAE (diffusers AutoencoderKLQwenImage; sd.cpp
wan.hpp WanVAE with Wan-2.1's 16 latent channels).

Weights are Wan's original names (the ComfyUI `qwen_image_vae.safetensors`, sd.cpp's layout) under
`first_stage_model.`: `encoder.conv1`, `encoder.downsamples.N.{residual.{0,2,3,6},shortcut,resample.1,
time_conv}`, `encoder.middle.{0,1,2}`, `encoder.head.{0,2}`, `conv1` (quant), `conv2` (post-quant),
and the decoder's `decoder.conv1`, `decoder.middle.*`, `decoder.upsamples.N.*`, `decoder.head.*`.
`diffusers_to_wan` renames a diffusers folder's names (AutoencoderKLQwenImage / AutoencoderKLWan).

One frame: every causal conv pads time by 2p in front with zeros, so on a single frame a
k x 3 x 3 conv sees only its last temporal kernel slice — exactly a 2-D conv with that slice (a
view of the 3-D weight, no copy of the file). The temporal resamplers' time_conv is skipped on the
first chunk by both diffusers and sd.cpp, so it never runs on one frame. RMS_norm is over channels
(x / rms * gamma, eps 1e-12 as ggml_rms_norm; diffusers' F.normalize * sqrt(C) is the same).

encode(img [N, 3, H, W] in [-1, 1]) -> the mean [N, 16, H/8, W/8] (sd.cpp keeps mu, never samples);
decode(z [N, 16, h, w]) -> [N, 3, 8h, 8w]; `to_diffusion` / `from_diffusion` apply the per-channel
latents mean/std ((z - mean) / std and back), as sd.cpp's WanVAERunner.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import GraphCache, Weights, multihead_attention

__all__ = ["PREFIX", "LATENTS_MEAN", "LATENTS_STD", "WanVAE", "diffusers_to_wan"]

PREFIX = "first_stage_model."
LATENTS_MEAN = np.array([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                         0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921], np.float32)
LATENTS_STD = np.array([2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160], np.float32)


class _Conv:
    """Conv on one frame: a causal 3-D conv's last temporal slice (or a plain 2-D conv)."""

    def __init__(self, w: Weights, name: str, spatial_pad: int | None = None, stride: int = 1, is3d: bool = True):
        self.weight, self.bias = w[name + ".weight"], w.get(name + ".bias")
        self.name, self.stride = w.prefix + name, stride
        wt = self.weight
        if is3d:
            KW, KH, KD, ICOC = wt.ne4
            oc = self.bias.nelements if self.bias is not None else None
            if oc is None or ICOC % oc:
                raise ModelFileError(f"{self.name}: weight ne {list(wt.ne)} does not fit {oc} output channels")
            ic = ICOC // oc
            nb = wt.nb
            self.w2d = wt.view((KW, KH, ic, oc), (nb[0], nb[1], nb[3], nb[3] * ic), offset=(KD - 1) * nb[2])
            if KD > 1:
                self.w2d = F.cont(self.w2d)
        else:
            self.w2d = wt
        self.pad = (self.w2d.ne[0] // 2) if spatial_pad is None else spatial_pad
        self.out_channels = self.w2d.ne[3]

    def __call__(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.w2d, self.bias, stride=self.stride, padding=self.pad)


def rms_norm_channels(x: Tensor, gamma: Tensor) -> Tensor:
    """[W, H, C, N] normalized over C (rms, eps 1e-12) times gamma [C]."""
    t = F.cont(x.permute(1, 2, 0, 3))                                     # [C, W, H, N]
    g = gamma if gamma.ndim == 1 else gamma.reshape(gamma.nelements)
    t = F.mul(F.rms_norm(t, 1e-12), g)
    return F.cont(t.permute(2, 0, 1, 3))                                  # [W, H, C, N]


class ResidualBlock:
    def __init__(self, w: Weights):
        self.w = w
        self.g1, self.g2 = w["residual.0.gamma"], w["residual.3.gamma"]
        self.conv1, self.conv2 = _Conv(w, "residual.2"), _Conv(w, "residual.6")
        self.shortcut = _Conv(w, "shortcut") if "shortcut.weight" in w else None

    def __call__(self, x: Tensor) -> Tensor:
        h = self.shortcut(x) if self.shortcut is not None else x
        y = self.conv1(F.silu(rms_norm_channels(x, self.g1)))
        y = self.conv2(F.silu(rms_norm_channels(y, self.g2)))
        return F.add(y, h)


class AttentionBlock:
    """Single-head self-attention over the frame's pixels (norm, to_qkv 1x1, proj 1x1)."""

    def __init__(self, w: Weights):
        self.gamma = w["norm.gamma"]
        self.to_qkv, self.proj = _Conv(w, "to_qkv", is3d=False), _Conv(w, "proj", is3d=False)

    def __call__(self, x: Tensor) -> Tensor:
        W, H, C, N = x.ne4
        qkv = self.to_qkv(rms_norm_channels(x, self.gamma))                 # [W, H, 3C, N]
        t = F.cont(qkv.reshape(W * H, 3 * C, N).permute(1, 0, 2))          # [3C, WH, N]
        q, k, v = (t.slice(0, i * C, (i + 1) * C) for i in range(3))
        o = multihead_attention(q, k, v, 1)                                  # [C, WH, N]
        o = F.cont(o.permute(1, 0, 2)).reshape(W, H, C, N)
        return F.add(self.proj(o), x)


class Resample:
    """down: zero-pad right/bottom, 3x3 conv stride 2; up: nearest 2x, 3x3 conv (C -> C/2)."""

    def __init__(self, w: Weights, up: bool):
        self.up = up
        self.conv = _Conv(w, "resample.1", spatial_pad=1 if up else 0, stride=1 if up else 2, is3d=False)

    def __call__(self, x: Tensor) -> Tensor:
        if self.up:
            return self.conv(F.upscale(x, scale_factor=2, mode="nearest"))
        return self.conv(F.pad(x, [(0, 1), (0, 1)]))


_RE_IDX = {"encoder": re.compile(r"encoder\.downsamples\.(\d+)\."), "decoder": re.compile(r"decoder\.upsamples\.(\d+)\.")}


def _stack(w: Weights, side: str, names) -> list:
    key = "downsamples" if side == "encoder" else "upsamples"
    n = 1 + max((int(m.group(1)) for k in names if (m := _RE_IDX[side].match(k))), default=-1)
    layers = []
    for i in range(n):
        s = w.sub(f"{side}.{key}.{i}.")
        if "residual.0.gamma" in s:
            layers.append(ResidualBlock(s))
        elif "resample.1.weight" in s:
            layers.append(Resample(s, up=side == "decoder"))
        else:
            raise ModelFileError(f"{w.source}: {w.prefix}{side}.{key}.{i} is neither a residual block nor a resampler "
                                 "(a Wan-2.2 VAE? only the Wan-2.1 / Qwen-Image VAE is supported)")
    return layers


class _Side:
    def __init__(self, w: Weights, side: str, names):
        s = w.sub(side + ".")
        self.conv_in = _Conv(s, "conv1")
        self.mid = (ResidualBlock(s.sub("middle.0.")), AttentionBlock(s.sub("middle.1.")), ResidualBlock(s.sub("middle.2.")))
        self.layers = _stack(w, side, names)
        self.head_gamma, self.head = s["head.0.gamma"], _Conv(s, "head.2")

    def __call__(self, x: Tensor, mid_first: bool) -> Tensor:
        x = self.conv_in(x)
        if mid_first:
            x = self._mid(x)
        for layer in self.layers:
            x = layer(x)
        if not mid_first:
            x = self._mid(x)
        return self.head(F.silu(rms_norm_channels(x, self.head_gamma)))

    def _mid(self, x):
        for m in self.mid:
            x = m(x)
        return x


class WanVAE:
    """WanVAE(table, prefix): encoder (when present) and decoder of a Wan-2.1-layout VAE."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = PREFIX, source: str = "vae"):
        w = Weights(table, prefix, source)
        names = list(w.keys())
        if "decoder.conv1.weight" not in w or "conv2.weight" not in w:
            raise ModelFileError(f"{source}: no Wan VAE decoder under {prefix!r} (decoder.conv1 / conv2; a diffusers "
                                 "AutoencoderKLQwenImage file is not converted: use the Wan-named "
                                 "qwen_image_vae.safetensors)")
        self.source = source
        self.post_quant = _Conv(w, "conv2")
        self.decoder = _Side(w, "decoder", names)
        self.z_dim = self.post_quant.out_channels
        if self.z_dim != 16:
            raise ModelFileError(f"{source}: a Wan VAE with {self.z_dim} latent channels (Wan-2.2?) is not supported; "
                                 "the Qwen-Image / Wan-2.1 VAE has 16")
        self.has_encoder = "encoder.conv1.weight" in w
        if self.has_encoder:
            self.encoder = _Side(w, "encoder", names)
            self.quant = _Conv(w, "conv1")
        self.scale_factor = 2 ** sum(isinstance(m, Resample) for m in self.decoder.layers)
        self._graphs = GraphCache(2)

    # ---- graphs ----------------------------------------------------------------------------------
    def decode_graph(self, z: Tensor) -> Tensor:
        """z [w, h, 16, N] -> [8w, 8h, 3, N]."""
        if z.ne4[2] != self.z_dim:
            raise UsageError(f"Wan VAE: latent has {z.ne4[2]} channels, the VAE takes {self.z_dim}")
        return self.decoder(self.post_quant(z), mid_first=True)

    def encode_graph(self, x: Tensor) -> Tensor:
        """x [W, H, 3, N] -> the mean [W/8, H/8, 16, N]."""
        if not self.has_encoder:
            raise UsageError(f"{self.source}: this VAE file has no encoder (img2img / edit need one)")
        if x.ne4[2] != 3:
            raise UsageError(f"Wan VAE: the image has {x.ne4[2]} channels, needs 3")
        out = self.quant(self.encoder(x, mid_first=False))                   # [w, h, 32, N]
        return F.cont(out.slice(2, 0, self.z_dim))

    # ---- numpy -----------------------------------------------------------------------------------
    def decode(self, z, backend: str = "cpu") -> np.ndarray:
        z = np.asarray(z, np.float32)
        if z.ndim != 4:
            raise UsageError(f"Wan VAE: latent must be [N, C, h, w], got shape {z.shape}")
        return self._graphs.run([z], lambda v: self.decode_graph(v[0]), backend, extra=("dec",))

    def encode(self, x, backend: str = "cpu") -> np.ndarray:
        x = np.asarray(x, np.float32)
        if x.ndim != 4:
            raise UsageError(f"Wan VAE: image must be [N, 3, H, W], got shape {x.shape}")
        f = self.scale_factor
        if x.shape[2] % f or x.shape[3] % f:
            raise UsageError(f"Wan VAE: image size {x.shape[3]}x{x.shape[2]} must be a multiple of {f}")
        return self._graphs.run([x], lambda v: self.encode_graph(v[0]), backend, extra=("enc",))

    @staticmethod
    def to_diffusion(mean: np.ndarray) -> np.ndarray:
        """VAE latent -> diffusion latent: (z - mean) / std per channel (sd.cpp vae_to_diffusion_latents)."""
        m, s = LATENTS_MEAN.reshape(1, -1, 1, 1), LATENTS_STD.reshape(1, -1, 1, 1)
        return ((np.asarray(mean, np.float32) - m) / s).astype(np.float32)

    @staticmethod
    def from_diffusion(latent: np.ndarray) -> np.ndarray:
        """Diffusion latent -> VAE latent: z * std + mean (sd.cpp diffusion_to_vae_latents)."""
        m, s = LATENTS_MEAN.reshape(1, -1, 1, 1), LATENTS_STD.reshape(1, -1, 1, 1)
        return (np.asarray(latent, np.float32) * s + m).astype(np.float32)


# ---- diffusers names -----------------------------------------------------------------------------------
_RES = {"norm1.gamma": "residual.0.gamma", "conv1.": "residual.2.", "norm2.gamma": "residual.3.gamma",
        "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}


def _res(rest: str) -> str:
    for a, b in _RES.items():
        if rest.startswith(a):
            return b + rest[len(a):]
    return rest


def diffusers_to_wan(names, num_res_blocks: int = 2) -> dict[str, str]:
    """{diffusers AutoencoderKLQwenImage name: Wan name} for the names given (others map to themselves)."""
    out = {}
    for n in names:
        m = None
        for side in ("encoder", "decoder"):
            if not n.startswith(side + "."):
                continue
            r = n[len(side) + 1:]
            if r.startswith("conv_in."):
                m = f"{side}.conv1." + r[8:]
            elif r.startswith("conv_out."):
                m = f"{side}.head.2." + r[9:]
            elif r.startswith("norm_out."):
                m = f"{side}.head.0." + r[9:]
            elif (mm := re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", r)):
                kind, i, rest = mm.groups()
                idx = 1 if kind == "attentions" else (0 if i == "0" else 2)
                m = f"{side}.middle.{idx}." + (rest if kind == "attentions" else _res(rest))
            elif (mm := re.match(r"down_blocks\.(\d+)\.(.*)", r)):
                m = f"{side}.downsamples.{mm.group(1)}." + _res(mm.group(2))
            elif (mm := re.match(r"up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.(.*)", r)):
                b, kind, j, rest = int(mm.group(1)), mm.group(2), int(mm.group(3)), mm.group(4)
                k = b * (num_res_blocks + 2) + (j if kind == "resnets" else num_res_blocks + 1)
                m = f"{side}.upsamples.{k}." + (_res(rest) if kind == "resnets" else rest)
        if n.startswith("quant_conv."):
            m = "conv1." + n[len("quant_conv."):]
        elif n.startswith("post_quant_conv."):
            m = "conv2." + n[len("post_quant_conv."):]
        out[n] = m or n
    return out
