"""Layout and positional ops at SD/FLUX shapes: sdrt's CPU kernels vs their numpy peer (and
PyTorch when installed), timed in the same run, medians of repeats.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=. python bench/bench_layout.py \
        [--repeat 7] [--threads N] [--clock wall|cpu]

Prints per case: sdrt ms, numpy ms, torch ms, and numpy/sdrt (>1 means sdrt is faster).
On a loaded machine parallel kernels wait for descheduled threads; `--threads 1 --clock cpu`
compares single-threaded CPU time, which the load disturbs far less.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from sdrt.ops import api as F
from sdrt.ops.graph import Graph
from sdrt.ops.tensor import Tensor

try:
    import torch
    import torch.nn.functional as TF
except ImportError:  # torch is optional: a peer, never a dependency
    torch = None


CLOCK = time.perf_counter


def timeit(fn, repeat):
    fn()  # warm (Numba compile / cache load, page faults)
    ts = []
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return statistics.median(ts) * 1e3


def np_resize_mats(n_in, n_out, mode):
    """Dense per-axis interpolation matrices (half-pixel), for the numpy BLAS peer."""
    from sdrt.ops.cpu.layout import axis_taps
    idx, w = axis_taps(n_in, n_out, mode, False, False)
    M = np.zeros((n_out, n_in), np.float32)
    np.add.at(M, (np.arange(n_out)[:, None].repeat(idx.shape[1], 1), idx), w)
    return M


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="Numba and torch threads (0: all)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        import numba
        numba.set_num_threads(a.threads)
        if torch is not None:
            torch.set_num_threads(a.threads)
    print(f"clock={a.clock} threads={a.threads or 'all'} repeat={a.repeat}")
    rng = np.random.default_rng(0)
    rows = []

    def case(name, node, np_fn, torch_fn=None):
        g = Graph(node)
        t_s = timeit(lambda: g.run("cpu"), a.repeat)
        t_n = timeit(np_fn, a.repeat)
        t_t = timeit(torch_fn, a.repeat) if (torch is not None and torch_fn is not None) else float("nan")
        rows.append((name, t_s, t_n, t_t))
        print(f"{name:44s} sdrt {t_s:8.2f} ms  numpy {t_n:8.2f} ms  torch {t_t:8.2f} ms  "
              f"numpy/sdrt {t_n / t_s:5.2f}  torch/sdrt {t_t / t_s:5.2f}", flush=True)

    # SD VAE decoder upsample: (1, 512, 64, 64) -> 128x128
    x = rng.standard_normal((1, 512, 64, 64)).astype(np.float32)
    tx = Tensor.from_numpy(x)
    xt = torch.from_numpy(x) if torch is not None else None
    case("upscale nearest x2 [64,64,512]", F.upscale(tx, scale_factor=2),
         lambda: np.ascontiguousarray(x.repeat(2, axis=2).repeat(2, axis=3)),
         lambda: TF.interpolate(xt, scale_factor=2, mode="nearest"))
    def np_sep(My, Mx):  # two 2-D BLAS GEMMs: rows, then columns
        t = (x.reshape(-1, 64) @ Mx.T).reshape(512, 64, 128)
        return np.ascontiguousarray(np.tensordot(My, t, axes=([1], [1])).transpose(1, 0, 2))

    My, Mx = np_resize_mats(64, 128, "bilinear"), np_resize_mats(64, 128, "bilinear")
    case("upscale bilinear x2 [64,64,512]", F.upscale(tx, scale_factor=2, mode="bilinear"),
         lambda: np_sep(My, Mx),
         lambda: TF.interpolate(xt, scale_factor=2, mode="bilinear", align_corners=False))
    Cy, Cx = np_resize_mats(64, 128, "bicubic"), np_resize_mats(64, 128, "bicubic")
    case("upscale bicubic x2 [64,64,512]", F.upscale(tx, scale_factor=2, mode="bicubic"),
         lambda: np_sep(Cy, Cx),
         lambda: TF.interpolate(xt, scale_factor=2, mode="bicubic", align_corners=False))
    # conv padding of a 128-channel 256x256 activation (VAE decoder), zero and circular
    y = rng.standard_normal((1, 128, 256, 256)).astype(np.float32)
    ty = Tensor.from_numpy(y)
    yt = torch.from_numpy(y) if torch is not None else None
    case("pad zero (1,1) [256,256,128]", F.pad(ty, [(1, 1), (1, 1)]),
         lambda: np.pad(y, ((0, 0), (0, 0), (1, 1), (1, 1))),
         lambda: TF.pad(yt, (1, 1, 1, 1)))
    case("pad circular (1,1) [256,256,128]", F.pad(ty, [(1, 1), (1, 1)], mode="circular"),
         lambda: np.pad(y, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="wrap"),
         lambda: TF.pad(yt, (1, 1, 1, 1), mode="circular"))
    case("pad reflect (1,1) [256,256,128]", F.pad(ty, [(1, 1), (1, 1)], mode="reflect"),
         lambda: np.pad(y, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="reflect"),
         lambda: TF.pad(yt, (1, 1, 1, 1), mode="reflect"))
    # UNet skip concat: two (2, 640, 32, 32) on channels (dim 2)
    c1 = rng.standard_normal((2, 640, 32, 32)).astype(np.float32)
    c2 = rng.standard_normal((2, 320, 32, 32)).astype(np.float32)
    t1, t2 = torch.from_numpy(c1) if torch else None, torch.from_numpy(c2) if torch else None
    case("concat channels [32,32,640|320,2]", F.concat(Tensor.from_numpy(c1), Tensor.from_numpy(c2), 2),
         lambda: np.concatenate([c1, c2], axis=1), lambda: torch.cat([t1, t2], 1))
    # broadcast a per-channel vector over a 64x64 map (ggml_repeat of a bias)
    b = rng.standard_normal((1, 512, 1, 1)).astype(np.float32)
    bt = torch.from_numpy(b) if torch else None
    case("repeat [1,1,512] -> [64,64,512]", F.repeat(Tensor.from_numpy(b), (64, 64, 512, 1)),
         lambda: np.tile(b, (1, 1, 64, 64)), lambda: bt.repeat(1, 1, 64, 64))
    # FLUX attention RoPE: 24 heads x 128 dims, 4096 + 512 tokens, pe [2,2,64,L]
    L, H, D = 4608, 24, 128
    q = rng.standard_normal((1, L, H, D)).astype(np.float32)  # ne [D, H, L, 1]
    ang = rng.uniform(-3, 3, (L, D // 2)).astype(np.float32)
    pe = np.stack([np.cos(ang), -np.sin(ang), np.sin(ang), np.cos(ang)], -1).reshape(L, D // 2, 2, 2)
    qt = torch.from_numpy(q.transpose(0, 2, 1, 3)) if torch else None  # (B, H, L, D) view
    pet = torch.from_numpy(pe)[None, None] if torch else None

    def np_flux():  # FLUX apply_rope in numpy, then (B*H, L, D) like sd.cpp
        xq = q.transpose(0, 2, 1, 3).reshape(1, H, L, D // 2, 1, 2)
        pe6 = pe[None, None]
        out = pe6[..., 0] * xq[..., 0] + pe6[..., 1] * xq[..., 1]
        return out.reshape(H, L, D)

    def torch_flux():
        xq = qt.float().reshape(*qt.shape[:-1], -1, 1, 2)
        return (pet[..., 0] * xq[..., 0] + pet[..., 1] * xq[..., 1]).reshape(H, L, D)
    case(f"rope (pe, FLUX) [{D},{H},{L}]", F.rope(Tensor.from_numpy(q), Tensor.from_numpy(pe)), np_flux,
         torch_flux)
    # LLM text encoder RoPE: neox, 28 heads x 128, 512 tokens
    L2, H2 = 512, 28
    k = rng.standard_normal((1, L2, H2, D)).astype(np.float32)
    pos = np.arange(L2, dtype=np.int32)

    def np_neox():
        inv = 1e6 ** (-np.arange(0, D, 2, dtype=np.float32) / D)
        a_ = pos[:, None].astype(np.float32) * inv[None, :]
        c = np.concatenate([np.cos(a_)] * 2, -1)[None, :, None, :]
        s = np.concatenate([np.sin(a_)] * 2, -1)[None, :, None, :]
        return k * c + rotate_half(k) * s
    case(f"rope_ext neox [{D},{H2},{L2}]", F.rope_ext(Tensor.from_numpy(k), pos, D, mode="neox", freq_base=1e6),
         np_neox)
    print("\nratio > 1: sdrt faster than the peer")


if __name__ == "__main__":
    main()
