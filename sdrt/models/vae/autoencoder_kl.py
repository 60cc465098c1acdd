"""AutoencoderKL: the VAE of SD 1.x / 2.x / SDXL (ldm.models.autoencoder.AutoencoderKL, sd.cpp's
auto_encoder_kl.hpp), with the weights named as the original checkpoints name them:
`first_stage_model.encoder.*`, `first_stage_model.decoder.*`, `quant_conv`, `post_quant_conv`
(a diffusers `vae/` folder is converted to these names by sdrt.models.names.diffusers_vae_to_ldm).

Architecture (shapes in ne order, x ne=[W, H, C, N]):
    encoder: conv_in -> per level i: num_res_blocks ResnetBlocks (+ Downsample: pad (0,1,0,1),
             3x3 stride-2 conv, except the last level) -> mid (ResnetBlock, AttnBlock,
             ResnetBlock) -> GroupNorm+SiLU -> conv_out -> moments [w, h, 2*z, N]
             -> quant_conv (1x1) -> [w, h, 2*embed_dim, N]
    decoder: post_quant_conv (1x1) -> conv_in -> mid -> per level i from the top:
             num_res_blocks+1 ResnetBlocks (+ Upsample: nearest x2, 3x3 conv, except level 0)
             -> GroupNorm+SiLU -> conv_out
The config (channels per level, res blocks, z/embed channels, quant convs) is read from the
weight shapes. GroupNorm has 32 groups and eps 1e-6 (sd.cpp's GroupNorm32); `groups` can be
changed for small test configs. The mid attention's q/k/v/proj_out are 1x1 convs in LDM
checkpoints and [C, C] linears in some conversions: both are run as one linear over the
channels (a 1x1 conv *is* that linear), so both layouts build the same graph.

The scale factor between the VAE's latents and the diffusion model's (x / scale + shift) is
the engine's business: each model family's record (sdrt.models.families) holds sd.cpp's constants;
`latent_scale_shift(family)` reads them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Conv2d, GroupNorm, Weights

__all__ = ["AutoencoderKL", "AutoencoderKLConfig", "LATENT_SCALE_SHIFT", "SD_SCALE_FACTOR",
           "SDXL_SCALE_FACTOR", "latent_scale_shift", "gaussian_sample", "upsample_conv3x3",
           "cpu_bf16_winograd"]

# sd.cpp's AutoEncoderKL constructor: diffusion latent = (vae latent - shift) * scale
SD_SCALE_FACTOR = 0.18215
SDXL_SCALE_FACTOR = 0.13025


def __getattr__(name):
    if name == "LATENT_SCALE_SHIFT":     # {family: (scale, shift)}, derived from the registry
        from ..families import families
        return {f.name: (f.latent_scale, f.latent_shift) for f in families() if f.latent_scale is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def latent_scale_shift(family: str) -> tuple[float, float]:
    """(scale, shift) for a model family ('sd1', 'sd2', 'sdxl', ... as sdrt.io.detect.family)."""
    from ..families import families, get_family
    f = get_family(family)
    if f.latent_scale is None:
        known = ", ".join(f.name for f in families() if f.latent_scale is not None)
        raise UsageError(f"no VAE latent scale for model family {family!r}; known: {known}")
    return f.latent_scale_shift()


def gaussian_sample(moments: np.ndarray, noise: np.ndarray | None = None) -> np.ndarray:
    """DiagonalGaussianDistribution: moments [N, 2C, h, w] -> mean + exp(logvar/2) * noise
    (logvar clamped to [-30, 20], as sd.cpp's gaussian_latent_sample); noise None -> the mean.
    The noise comes from the caller's RNG so the engine can reproduce sd.cpp's draws."""
    moments = np.asarray(moments, np.float32)
    if moments.ndim != 4 or moments.shape[1] % 2:
        raise UsageError(f"moments must be [N, 2C, h, w], got shape {moments.shape}")
    C = moments.shape[1] // 2
    mean, logvar = moments[:, :C], moments[:, C:]
    if noise is None:
        return mean.copy()
    noise = np.asarray(noise, np.float32)
    if noise.shape != mean.shape:
        raise UsageError(f"noise shape {noise.shape} must equal the latent shape {mean.shape}")
    std = np.exp(np.float32(0.5) * np.clip(logvar, -30.0, 20.0))
    return (mean + std * noise).astype(np.float32)


# ---- config ----------------------------------------------------------------------------------
def _count(w: Weights, fmt: str) -> int:
    n = 0
    while fmt.format(n) in w:
        n += 1
    return n


@dataclass(frozen=True)
class AutoencoderKLConfig:
    level_channels: tuple[int, ...]   # ch * ch_mult[i] per resolution level
    num_res_blocks: int
    z_channels: int
    embed_dim: int
    in_channels: int
    out_channels: int
    double_z: bool
    use_quant: bool
    has_encoder: bool
    has_decoder: bool
    groups: int = 32
    eps: float = 1e-6

    @property
    def ch(self) -> int:
        return self.level_channels[0]

    @property
    def ch_mult(self) -> tuple[int, ...]:
        return tuple(c // self.ch for c in self.level_channels)

    @property
    def downscale(self) -> int:
        """Pixels per latent pixel (8 for SD)."""
        return 2 ** (len(self.level_channels) - 1)

    @classmethod
    def detect_from_weights(cls, tensors: Mapping[str, Tensor], prefix: str = "first_stage_model.",
                            groups: int = 32, source: str = "vae") -> AutoencoderKLConfig:
        w = Weights(tensors, prefix, source)
        has_dec, has_enc = "decoder.conv_in.weight" in w, "encoder.conv_in.weight" in w
        if not (has_dec or has_enc):
            raise ModelFileError(f"{source}: no VAE here: missing tensor {prefix + 'decoder.conv_in.weight'!r}")
        levels = nrb = None
        z = in_ch = out_ch = None
        if has_dec:
            n = _count(w, "decoder.up.{}.block.0.conv2.weight")
            if n == 0:
                w["decoder.up.0.block.0.conv2.weight"]  # raises, naming it
            levels = tuple(w.shape(f"decoder.up.{i}.block.0.conv2.weight")[3] for i in range(n))
            nrb = _count(w, "decoder.up.0.block.{}.conv1.weight") - 1
            z = w.shape("decoder.conv_in.weight")[2]
            out_ch = w.shape("decoder.conv_out.weight")[3]
        double_z = True
        if has_enc:
            n = _count(w, "encoder.down.{}.block.0.conv2.weight")
            if n == 0:
                w["encoder.down.0.block.0.conv2.weight"]
            elevels = tuple(w.shape(f"encoder.down.{i}.block.0.conv2.weight")[3] for i in range(n))
            enrb = _count(w, "encoder.down.0.block.{}.conv1.weight")
            if levels is not None and (elevels != levels or enrb != nrb):
                raise ModelFileError(f"{source}: encoder levels {elevels} x {enrb} blocks do not match the "
                                     f"decoder's {levels} x {nrb} (under {prefix!r})")
            levels, nrb = elevels, enrb
            in_ch = w.shape("encoder.conv_in.weight")[2]
            zo = w.shape("encoder.conv_out.weight")[3]
            if z is None:
                z = zo // 2
            double_z = zo == 2 * z
            if zo not in (z, 2 * z):
                raise ModelFileError(f"{source}: {prefix}encoder.conv_out.weight has {zo} outputs for "
                                     f"{z} latent channels")
        if nrb is None or nrb < 1:
            raise ModelFileError(f"{source}: no ResnetBlocks found under {prefix!r}")
        use_quant = "post_quant_conv.weight" in w or "quant_conv.weight" in w
        embed = z
        if "post_quant_conv.weight" in w:
            embed = w.shape("post_quant_conv.weight")[2]
        elif "quant_conv.weight" in w:
            embed = w.shape("quant_conv.weight")[3] // (2 if double_z else 1)
        return cls(levels, nrb, z, embed, in_ch or 3, out_ch or 3, double_z, use_quant, has_enc, has_dec,
                   groups=groups)


# ---- blocks ----------------------------------------------------------------------------------
def _conv(w: Weights, key: str, ic: int, oc: int, k: int, source: str, **kw) -> Conv2d:
    sub = w.sub(key + ".")
    ne = sub.shape("weight")
    if ne != (k, k, ic, oc):
        raise ModelFileError(f"{source}: {sub.prefix}weight has shape {ne[::-1]}, expected {(oc, ic, k, k)}")
    return Conv2d(sub, **kw)


class ResnetBlock:
    """norm1+SiLU, conv1, norm2+SiLU, conv2, + x (1x1 nin_shortcut when channels change)."""

    def __init__(self, w: Weights, cin: int, cout: int, cfg: AutoencoderKLConfig):
        src = w.source
        self.norm1 = GroupNorm(w.sub("norm1."), cfg.groups, cfg.eps)
        self.conv1 = _conv(w, "conv1", cin, cout, 3, src, padding=1)
        self.norm2 = GroupNorm(w.sub("norm2."), cfg.groups, cfg.eps)
        self.conv2 = _conv(w, "conv2", cout, cout, 3, src, padding=1)
        self.nin_shortcut = _conv(w, "nin_shortcut", cin, cout, 1, src) if cin != cout else None

    def __call__(self, x: Tensor) -> Tensor:  # [W, H, cin, N] -> [W, H, cout, N]
        h = self.conv1(self.norm1(x, silu=True))
        h = self.conv2(self.norm2(h, silu=True))
        return F.add(h, self.nin_shortcut(x) if self.nin_shortcut is not None else x)


class AttnBlock:
    """Single-head self-attention over the W*H positions (ldm AttnBlock)."""

    def __init__(self, w: Weights, c: int, cfg: AutoencoderKLConfig):
        self.norm = GroupNorm(w.sub("norm."), cfg.groups, cfg.eps)
        self.proj = {}
        for k in ("q", "k", "v", "proj_out"):
            wt = w[f"{k}.weight"]
            if wt.ne not in ((c, c), (1, 1, c, c)):
                raise ModelFileError(f"{w.source}: {w.prefix}{k}.weight has shape {wt.ne[::-1]}, expected "
                                     f"({c}, {c}, 1, 1) or ({c}, {c})")
            self.proj[k] = (wt.reshape(c, c) if wt.ndim == 4 else wt, w.get(f"{k}.bias"))

    def _lin(self, k: str, x: Tensor) -> Tensor:
        wt, b = self.proj[k]
        return F.linear(x, wt, b)

    def __call__(self, x: Tensor) -> Tensor:
        W, H, C = x.ne[0], x.ne[1], x.ne[2]
        N = x.ne4[3]
        h = self.norm(x)
        h = F.cont(h.permute(1, 2, 0, 3)).reshape(C, W * H, N)    # [C, W*H, N]
        q, k, v = (self._lin(n, h).reshape(C, W * H, 1, N) for n in ("q", "k", "v"))
        a = F.attention(q, k, v).reshape(C, W * H, N)            # [C, W*H, N], one head
        a = self._lin("proj_out", a)
        a = a.reshape(C, W, H, N).permute(2, 0, 1, 3)            # view [W, H, C, N]
        return F.add(x, F.cont(a))


class Downsample:
    """LDM's asymmetric pad (right/bottom by 1) then a 3x3 stride-2 conv."""

    def __init__(self, w: Weights, c: int):
        self.conv = _conv(w, "conv", c, c, 3, w.source, stride=2)

    def __call__(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, [(0, 1), (0, 1)]))


def _fold_taps() -> np.ndarray:
    """[16, 9]: conv3x3(nearest2x(x)) as a stride-2 transposed 4x4 conv (padding 1).
    Output row y = 2i + k - 1 takes x row i through tap k. Row 2i reads upsampled rows 2i-1..2i+1
    = x rows (i-1, i, i): taps k=3 (w0) and k=1 (w1+w2); row 2i+1 reads (i, i, i+1): k=2 (w0+w1)
    and k=0 (w2). So tap k folds 3x3 rows {2}, {1, 2}, {0, 1}, {0}; columns alike.
    Row index kx' + 4 ky' (ne order of the 4x4 kernel), column kx + 3 ky."""
    fold = ((2,), (1, 2), (0, 1), (0,))
    m = np.zeros((4, 4, 3, 3), np.float32)   # (ky', kx', ky, kx)
    for yt, ys in enumerate(fold):
        for xt, xs in enumerate(fold):
            for ky in ys:
                for kx in xs:
                    m[yt, xt, ky, kx] = 1.0
    return m.reshape(16, 9)


def upsample_conv3x3(x: Tensor, weight: Tensor, bias: Tensor | None = None, folded: bool = True,
                     backend=None) -> Tensor:
    """conv3x3(nearest2x(x)), padding 1. `folded`: one stride-2 transposed conv with a 4x4 kernel
    folded from the 3x3 one (see _fold_taps) on the small input — 16 instead of 36 multiply-adds
    per output pixel and channel pair and no upscaled copy (faster and lower peak memory:
    bench/README.md, "Facts moved out of the code"). The fold runs inside the graph (one small mul_mat) so weights stay lazy
    leaves; block-quantized or strided weights take the literal path, and so does a graph for the
    CPU `backend` whose bf16 Winograd kernel takes this F16/BF16 weight (`cpu_bf16_winograd`:
    4 bf16 products per output there too, where the folded kernel is a float32 one)."""
    if (not folded or weight.dtype.is_quantized or not weight.is_contiguous()
            or (backend is not None and cpu_bf16_winograd(weight, backend))):
        return F.conv2d(F.upscale(x, scale_factor=2, mode="nearest"), weight, bias, padding=1)
    C, OC = weight.ne[2], weight.ne[3]
    taps = Tensor.from_numpy(_fold_taps(), name="upsample_fold_taps")
    k = F.mul_mat(taps, weight.reshape(9, C * OC))                           # [16, C*OC]
    k = F.cont(k.reshape(16, C, OC).permute(0, 2, 1)).reshape(4, 4, OC, C)   # [KW, KH, OC, C]
    return F.conv_transpose2d(x, k, bias, stride=2, padding=1)


def cpu_bf16_winograd(weight: Tensor, backend) -> bool:
    """Whether a 3x3 conv with this weight runs through the CPU's bf16 Winograd kernel on
    `backend` (the CPU's name or object; sdrt.ops.cpu.conv_winograd.conv_winograd_bf16)."""
    if (backend if isinstance(backend, str) else getattr(backend, "name", None)) != "cpu":
        return False
    from ...ops.cpu import bf16gemm, conv as cpu_conv
    return (cpu_conv.WINOGRAD and cpu_conv.WINOGRAD_BF16 and not weight.dtype.is_quantized
            and bf16gemm.path_for(weight.dtype.name) is not None)


class Upsample:
    """Nearest x2 then a 3x3 conv (the decoder's upsample convs are 28% of an SD VAE decode's
    FLOPs: see upsample_conv3x3 for the folded form used by default)."""

    def __init__(self, w: Weights, c: int, folded: bool = True):
        self.conv = _conv(w, "conv", c, c, 3, w.source, padding=1)
        self.folded = folded

    def __call__(self, x: Tensor, backend=None) -> Tensor:
        return upsample_conv3x3(x, self.conv.weight, self.conv.bias, self.folded, backend)


def _mid(w: Weights, c: int, cfg):
    return (ResnetBlock(w.sub("mid.block_1."), c, c, cfg), AttnBlock(w.sub("mid.attn_1."), c, cfg),
            ResnetBlock(w.sub("mid.block_2."), c, c, cfg))


class Encoder:
    def __init__(self, w: Weights, cfg: AutoencoderKLConfig):
        L = cfg.level_channels
        self.conv_in = _conv(w, "conv_in", cfg.in_channels, L[0], 3, w.source, padding=1)
        self.blocks: list[tuple[str, object]] = []
        cin = L[0]
        for i, c in enumerate(L):
            for j in range(cfg.num_res_blocks):
                self.blocks.append((f"down.{i}.block.{j}", ResnetBlock(w.sub(f"down.{i}.block.{j}."), cin, c, cfg)))
                cin = c
            if i != len(L) - 1:
                self.blocks.append((f"down.{i}.downsample", Downsample(w.sub(f"down.{i}.downsample."), c)))
        self.mid = _mid(w, cin, cfg)
        self.norm_out = GroupNorm(w.sub("norm_out."), cfg.groups, cfg.eps)
        zo = cfg.z_channels * (2 if cfg.double_z else 1)
        self.conv_out = _conv(w, "conv_out", cin, zo, 3, w.source, padding=1)

    def __call__(self, x: Tensor, cut: str | None = None) -> Tensor:  # [W, H, 3, N] -> [w, h, 2z, N]
        h = self.conv_in(x)
        for name, blk in self.blocks:
            h = _cut(blk(h), cut, name)
        for blk in self.mid:
            h = blk(h)
        h = _cut(h, cut, "mid")
        return self.conv_out(self.norm_out(h, silu=True))


class Decoder:
    def __init__(self, w: Weights, cfg: AutoencoderKLConfig, folded_upsample: bool = True):
        L = cfg.level_channels
        cin = L[-1]
        self.conv_in = _conv(w, "conv_in", cfg.z_channels, cin, 3, w.source, padding=1)
        self.mid = _mid(w, cin, cfg)
        self.blocks: list[tuple[str, object]] = []
        for i in reversed(range(len(L))):
            for j in range(cfg.num_res_blocks + 1):
                self.blocks.append((f"up.{i}.block.{j}", ResnetBlock(w.sub(f"up.{i}.block.{j}."), cin, L[i], cfg)))
                cin = L[i]
            if i != 0:
                self.blocks.append((f"up.{i}.upsample", Upsample(w.sub(f"up.{i}.upsample."), cin, folded_upsample)))
        self.norm_out = GroupNorm(w.sub("norm_out."), cfg.groups, cfg.eps)
        self.conv_out = _conv(w, "conv_out", cin, cfg.out_channels, 3, w.source, padding=1)

    def __call__(self, z: Tensor, cut: str | None = None, backend=None) -> Tensor:  # [w, h, z, N] -> [8w, 8h, 3, N]
        h = self.conv_in(z)
        for blk in self.mid:
            h = blk(h)
        h = _cut(h, cut, "mid")
        for name, blk in self.blocks:
            h = _cut(blk(h, backend) if isinstance(blk, Upsample) else blk(h), cut, name)
        return self.conv_out(self.norm_out(h, silu=True))


def _cut(t: Tensor, prefix: str | None, name: str) -> Tensor:
    return F.mark_cut(t, prefix + name) if prefix else t


# ---- the model -------------------------------------------------------------------------------
class AutoencoderKL:
    """`AutoencoderKL(table, prefix="first_stage_model.")`: encoder and/or decoder, whichever the
    table holds. `decode(z)` / `encode(x)` take and give numpy [N, C, H, W] float32;
    `decode_graph` / `encode_graph` build the lazy graph on ne-order Tensors for a runner.

    Values are the model's own: decode gives ~[-1, 1] (sd.cpp then maps to [0, 1] and clamps),
    encode takes [-1, 1] and gives the moments (mean, logvar) — `gaussian_sample` draws the
    latent with the caller's noise, `encode_mean` keeps the mean. `cut_points=True` marks a
    named cut after every block (`vae.decoder.up.3.block.0`, ...) for a segmenting runner; it
    is off by default because the runner keeps every cut output alive for the whole run.
    `folded_upsample=False` runs the decoder's upsample convs literally (see Upsample)."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = "first_stage_model.", *,
                 groups: int = 32, source: str = "vae", cut_points: bool = False,
                 folded_upsample: bool = True):
        self.config = cfg = AutoencoderKLConfig.detect_from_weights(table, prefix, groups, source)
        w = Weights(table, prefix, source)
        self.prefix, self.cut_points = prefix, cut_points
        self.encoder = Encoder(w.sub("encoder."), cfg) if cfg.has_encoder else None
        self.decoder = Decoder(w.sub("decoder."), cfg, folded_upsample) if cfg.has_decoder else None
        zq = cfg.z_channels * (2 if cfg.double_z else 1)
        eq = cfg.embed_dim * (2 if cfg.double_z else 1)
        self.quant_conv = self.post_quant_conv = None
        if cfg.use_quant and cfg.has_encoder:
            self.quant_conv = _conv(w, "quant_conv", zq, eq, 1, source)
        if cfg.use_quant and cfg.has_decoder:
            self.post_quant_conv = _conv(w, "post_quant_conv", cfg.embed_dim, cfg.z_channels, 1, source)

    # graph builders (ne order)
    def decode_graph(self, z: Tensor, backend="cpu") -> Tensor:
        """z ne=[w, h, embed_dim, N] -> F32 [w*f, h*f, out_channels, N], for `backend` (which
        form the upsample convs take: upsample_conv3x3)."""
        if self.decoder is None:
            raise UsageError(f"this VAE has no decoder (no {self.prefix}decoder.* tensors)")
        if z.ne4[2] != self.config.embed_dim:
            raise UsageError(f"VAE decode: latent has {z.ne4[2]} channels, the VAE takes {self.config.embed_dim}")
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z, "vae.decoder." if self.cut_points else None, backend)

    def encode_graph(self, x: Tensor) -> Tensor:
        """x ne=[W, H, in_channels, N] (values in [-1, 1]) -> moments F32 [W/f, H/f, 2*embed_dim, N]."""
        if self.encoder is None:
            raise UsageError(f"this VAE has no encoder (no {self.prefix}encoder.* tensors)")
        f = self.config.downscale
        if x.ne4[2] != self.config.in_channels or x.ne[0] % f or x.ne[1] % f:
            raise UsageError(f"VAE encode: image ne {list(x.ne)} must have {self.config.in_channels} channels "
                             f"and a width and height that are multiples of {f}")
        h = self.encoder(x, "vae.encoder." if self.cut_points else None)
        return self.quant_conv(h) if self.quant_conv is not None else h

    # numpy conveniences
    def decode(self, z: np.ndarray, backend="cpu") -> np.ndarray:
        """z [N, embed_dim, h, w] -> image [N, out_channels, h*f, w*f] (model values, ~[-1, 1])."""
        return F.compute(self.decode_graph(_input(z, "latent"), backend), backend=backend)

    def encode(self, x: np.ndarray, backend="cpu") -> np.ndarray:
        """image [N, in_channels, H, W] in [-1, 1] -> moments [N, 2*embed_dim, H/f, W/f]."""
        return F.compute(self.encode_graph(_input(x, "image")), backend=backend)

    def encode_mean(self, x: np.ndarray) -> np.ndarray:
        return gaussian_sample(self.encode(x))

    def encode_sample(self, x: np.ndarray, noise: np.ndarray) -> np.ndarray:
        """mean + std * noise, noise [N, embed_dim, H/f, W/f] from the engine's RNG (sd.cpp)."""
        return gaussian_sample(self.encode(x), noise)


def _input(a: np.ndarray, what: str) -> Tensor:
    a = np.asarray(a)
    if a.ndim != 4:
        raise UsageError(f"VAE {what} must be [N, C, H, W], got shape {a.shape}")
    return Tensor.from_numpy(np.ascontiguousarray(a, dtype=np.float32), name=f"vae_{what}")
