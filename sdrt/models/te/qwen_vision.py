"""The Qwen2.5-VL vision tower (transformers Qwen2_5_VisionTransformerPretrainedModel; sd.cpp llm.hpp's
vision model): Qwen-Image-Edit's image encoder.

Weights (HF names under `prefix`, e.g. `text_encoders.llm.visual.` for sd.cpp's --llm file):
    patch_embed.proj.weight        torch [C, 3, 2, 14, 14] (conv3d over two copies of the frame)
    blocks.N.norm{1,2}.weight      RMS norms (eps 1e-6)
    blocks.N.attn.qkv.{weight,bias}, blocks.N.attn.proj.{weight,bias}
    blocks.N.mlp.{gate,up,down}_proj.{weight,bias}   SwiGLU (SiLU)
    merger.ln_q.weight, merger.mlp.0.*, merger.mlp.2.*   2x2 patch merger (GELU)
Depth, width, heads (hidden / 80 in the release; `head_dim=` for others), FFN and output width come
from the weights; full-attention blocks (7, 15, 23, 31 in the release) and the window (112 px)
are arguments.

encode(image [3, H, W] normalized, H and W multiples of 28) -> [H/28 * W/28, out] in the LLM's
token order (merge units row by row). One image = two identical temporal frames, so the conv3d is
a 2-D conv with the sum of its two temporal slices. Tokens are kept in raster-of-merge-units
order (units (bh, bw), each 2x2 patches (mh, mw)); window attention is a block mask (tokens
attend within their 4x4-unit window) instead of transformers' permutation — the same result,
since positions travel with the tokens. RoPE: per head, pairs (i, i + D/2) rotated by
[row * f, col * f] with f_j = theta^(-2j/(D/2)) (theta 10000), as transformers' axial rope.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from ...errors import ModelFileError, UsageError
from ...ops import api as F
from ...ops.tensor import Tensor
from ..common import Linear, Weights

__all__ = ["QwenVisionEncoder", "FULLATT_BLOCKS", "patch_order"]

FULLATT_BLOCKS = (7, 15, 23, 31)
_RE_BLOCK = re.compile(r"blocks\.(\d+)\.")


def patch_order(gh: int, gw: int, m: int = 2) -> np.ndarray:
    """Raster patch index (row * gw + col) of each token in Qwen2-VL's order (bh, bw, mh, mw)."""
    r = np.arange(gh).reshape(gh // m, m)[:, None, :, None]
    c = np.arange(gw).reshape(gw // m, m)[None, :, None, :]
    return (r * gw + c).reshape(-1).astype(np.int32)


class QwenVisionEncoder:
    def __init__(self, table: Mapping[str, Tensor], prefix: str = "", source: str = "llm", head_dim: int = 80,
                 fullatt_blocks=FULLATT_BLOCKS, window_size: int = 112, patch: int = 14, merge: int = 2,
                 theta: float = 10000.0):
        w = Weights(table, prefix, source)
        if "patch_embed.proj.weight" not in w:
            raise ModelFileError(f"{source}: no Qwen2.5-VL vision tower under {prefix!r} (patch_embed.proj.weight)")
        self.w, self.source = w, source
        depth = 1 + max((int(m.group(1)) for k in w.keys() if (m := _RE_BLOCK.match(k))), default=-1)
        self.hidden = w.shape("blocks.0.norm1.weight")[0] if depth else 0
        if not depth or self.hidden % head_dim:
            raise ModelFileError(f"{source}: vision tower with {depth} blocks, width {self.hidden}: not a whole number "
                                 f"of {head_dim}-wide heads")
        self.depth, self.heads, self.head_dim = depth, self.hidden // head_dim, head_dim
        self.fullatt = set(fullatt_blocks)
        self.patch, self.merge, self.window = patch, merge, window_size // patch // merge
        self.theta = theta
        pw = w["patch_embed.proj.weight"]          # ne [14, 14, 2, 3*C] (folded 5-D)
        KW, KH, KT, ICOC = pw.ne4
        ic = 3
        nb = pw.nb
        sl = [F.cast(pw.view((KW, KH, ic, ICOC // ic), (nb[0], nb[1], nb[3], nb[3] * ic), offset=t * nb[2]), "F32")
              for t in range(KT)]     # summed in F32: an F16 sum would round the kernel
        self.patch_w = sl[0] if KT == 1 else F.add(sl[0], sl[1]) if KT == 2 else None
        if self.patch_w is None:
            raise ModelFileError(f"{source}: patch_embed.proj.weight has {KT} temporal taps, Qwen2.5-VL has 2")
        self.blocks = []
        for i in range(depth):
            b = w.sub(f"blocks.{i}.")
            self.blocks.append(dict(n1=b["norm1.weight"], n2=b["norm2.weight"], qkv=Linear(b.sub("attn.qkv.")),
                                    proj=Linear(b.sub("attn.proj.")), gate=Linear(b.sub("mlp.gate_proj.")),
                                    up=Linear(b.sub("mlp.up_proj.")), down=Linear(b.sub("mlp.down_proj."))))
        self.ln_q = w["merger.ln_q.weight"]
        self.mlp0, self.mlp2 = Linear(w.sub("merger.mlp.0.")), Linear(w.sub("merger.mlp.2."))
        self.out_dim = self.mlp2.out_features

    # ---- host-side tables ------------------------------------------------------------------------
    def _pe(self, gh: int, gw: int, order: np.ndarray) -> np.ndarray:
        """(L, D/2, 2, 2) rotations for half-split pairs: angle [row f, col f]."""
        D = self.head_dim
        half = D // 2
        inv = (1.0 / self.theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))).astype(np.float32)
        rows, cols = (order // gw).astype(np.float32), (order % gw).astype(np.float32)
        ang = np.concatenate([rows[:, None] * inv[None], cols[:, None] * inv[None]], axis=1).astype(np.float32)
        c, s = np.cos(ang), np.sin(ang)
        return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)

    def _window_mask(self, gh: int, gw: int, order: np.ndarray) -> np.ndarray:
        """Additive [Lq, Lk] (ne [Lk, Lq]) mask: 0 within a window of `window` x `window` merge units."""
        ur, uc = (order // gw) // self.merge, (order % gw) // self.merge
        win = (ur // self.window) * 100003 + (uc // self.window)
        return np.where(win[:, None] == win[None, :], 0.0, -np.inf).astype(np.float32)

    # ---- graph -----------------------------------------------------------------------------------
    def forward(self, image: Tensor, pe: Tensor, mask: Tensor, order: Tensor) -> Tensor:
        """image [W, H, 3, 1] -> [out, L/4]."""
        C, D, nh = self.hidden, self.head_dim, self.heads
        x = F.conv2d(image, self.patch_w, None, stride=self.patch)              # [gw, gh, C, 1]
        gw, gh = x.ne[0], x.ne[1]
        L = gw * gh
        x = F.cont(x.reshape(L, C).permute(1, 0))                               # [C, L] raster
        x = F.get_rows(x, order)                                                # [C, L] Qwen order
        for i, b in enumerate(self.blocks):
            h = F.mul(F.rms_norm(x, 1e-6), b["n1"])
            qkv = b["qkv"](h)                                                   # [3C, L]
            q, k, v = (F.cont(qkv.slice(0, j * C, (j + 1) * C)).reshape(D, nh, L, 1) for j in range(3))
            q = F.rope(q, pe, interleaved=False)                                # [D, L, nh]
            k = F.rope(k, pe, interleaved=False)
            vv = v.permute(0, 2, 1, 3)                                          # view [D, L, nh, 1]
            o = F.attention(q.reshape(D, L, nh, 1), k.reshape(D, L, nh, 1), vv,
                            mask=None if i in self.fullatt else mask)           # [D, L, nh, 1]
            o = F.cont(o.permute(0, 2, 1, 3)).reshape(C, L)
            x = F.add(x, b["proj"](o))
            h = F.mul(F.rms_norm(x, 1e-6), b["n2"])
            x = F.add(x, b["down"](F.mul(F.silu(b["gate"](h)), b["up"](h))))
        m2 = self.merge * self.merge
        h = F.mul(F.rms_norm(x, 1e-6), self.ln_q).reshape(C * m2, L // m2)    # 4 tokens of a unit joined
        return self.mlp2(F.gelu(self.mlp0(h)))

    def encode(self, image: np.ndarray, backend: str = "cpu") -> np.ndarray:
        """image float [3, H, W] (normalized) -> float32 [H*W / (28*28), out]."""
        img = np.asarray(image, np.float32)
        f = self.patch * self.merge
        if img.ndim != 3 or img.shape[0] != 3 or img.shape[1] % f or img.shape[2] % f:
            raise UsageError(f"Qwen2.5-VL vision: image must be [3, H, W] with H, W multiples of {f}, got {img.shape}")
        gh, gw = img.shape[1] // self.patch, img.shape[2] // self.patch
        order = patch_order(gh, gw, self.merge)
        out = self.forward(Tensor.from_numpy(img[None]), Tensor.from_numpy(self._pe(gh, gw, order)),
                           Tensor.from_numpy(self._window_mask(gh, gw, order)), Tensor.from_numpy(order))
        return F.Graph({"o": out}).run(backend)["o"].to_f32().reshape(-1, self.out_dim)
