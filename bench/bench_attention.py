"""Attention at 4096 tokens x 64 dims x 8 heads, and GroupNorm(+SiLU) / softmax / layer_norm at
SD shapes: sdrt vs plain numpy, time and peak memory.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_attention.py [--repeat 5]

Attention (N=1, q/k/v F32 ne=[64, 4096, 8, 1]):
- sdrt:  F.attention(q, k, v) through Graph(...).run("cpu") (tiled, never 4096x4096);
- numpy: per head the full score matrix, done as leanly as numpy allows (in place):
         s = q @ k.T; s *= scale; s -= max; exp(s, out=s); s /= sum; out[h] = s @ v.
Times: median (and min) of --repeat runs after a warm-up, sdrt and numpy interleaved in one
process; GFLOP/s count the two products, 4*H*L*L*D.
Memory: each side runs once more in its own subprocess (inputs made, kernels warm, peak RSS
reset through /proc/self/clear_refs), and reports the peak RSS above that baseline ("peak"),
and the same less the 8 MiB output both must produce ("working").

SD1.5 heads (--sd15, on by default; --no-sd15 skips): the UNet's three attention shapes with
batch 2 (CFG) and 8 heads as the model views them (strided head views of [N, L, H*D] storage):
40-wide self-attention over 4096 tokens, cross-attention to 77 text tokens, 80-wide over 1024
tokens; sdrt against PyTorch's scaled_dot_product_attention (the step's peer) when torch is
installed, interleaved, median times and the median of per-repeat ratios.

Norms: x F32 ne=[64, 64, 320, 2] (numpy (2, 320, 64, 64)), 32 groups, eps 1e-6, per-channel
w/b; numpy reference does mean/var over (N, G, -1) then the affine and SiLU. softmax rows
ne=[4096, 1024, 8] with scale (a score block), layer_norm ne=[768, 4096, 2] (a text encoder's).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from sdrt.ops import api as F  # noqa: E402
from sdrt.ops.graph import Graph  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402

L, D, H = 4096, 64, 8


def make_qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, H, L, D), dtype=np.float32) for _ in range(3)]


def numpy_attention(q, k, v, scale):
    out = np.empty(q.shape[:-1] + (v.shape[-1],), np.float32)
    for n in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = q[n, h] @ k[n, h].T
            s *= scale
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            np.matmul(s, v[n, h], out=out[n, h])
            del s
    return out


def sdrt_runner(q, k, v):
    node = F.attention(*(Tensor.from_numpy(a) for a in (q, k, v)))
    return lambda: Graph(node).run("cpu")["out"].numpy()


def median_time(fn, repeat):
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), ts


# ---- memory, one side per subprocess ---------------------------------------------------------
def _rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def mem_child(which):
    q, k, v = make_qkv()
    scale = 1 / math.sqrt(D)
    if which == "sdrt":
        small = [a[:, :2, :256].copy() for a in (q, k, v)]
        sdrt_runner(*small)()  # Numba kernels loaded, thread pool started
        fn = sdrt_runner(q, k, v)
    else:
        numpy_attention(*(a[:, :1, :256] for a in (q, k, v)), scale)
        fn = lambda: numpy_attention(q, k, v, scale)  # noqa: E731
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    base = _rss_kb("VmRSS:")
    out = fn()
    peak = _rss_kb("VmHWM:")
    print(json.dumps({"peak_mib": (peak - base) / 1024, "out_mib": out.nbytes / 2**20}))


def measure_mem(which):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mem-child", which],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- norms -----------------------------------------------------------------------------------
def numpy_group_norm(x, G, eps, w=None, b=None, silu=False):
    N = x.shape[0]
    xg = x.reshape(N, G, -1)
    mean = xg.mean(axis=-1, keepdims=True)
    var = xg.var(axis=-1, keepdims=True)
    y = ((xg - mean) / np.sqrt(var + eps)).reshape(x.shape)
    if w is not None:
        y = y * w[None, :, None, None] + b[None, :, None, None]
    if silu:
        y = y / (1 + np.exp(-y))
    return y


def numpy_softmax(x, scale):
    s = x * scale
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def numpy_layer_norm(x, eps):
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)


def bench_norms(repeat):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 320, 64, 64), dtype=np.float32)
    w = rng.standard_normal(320, dtype=np.float32)
    b = rng.standard_normal(320, dtype=np.float32)
    tx, tw, tb = (Tensor.from_numpy(a) for a in (x, w, b))
    s = rng.standard_normal((8, 1024, 4096), dtype=np.float32)
    ln = rng.standard_normal((2, 4096, 768), dtype=np.float32)
    cases = [
        ("group_norm [64,64,320,2] G=32", F.group_norm(tx, 32, 1e-6), lambda: numpy_group_norm(x, 32, 1e-6)),
        ("group_norm+affine+silu (fused)", F.group_norm_silu(tx, tw, tb, 32, 1e-6),
         lambda: numpy_group_norm(x, 32, 1e-6, w, b, silu=True)),
        ("softmax [4096,1024,8] scale", F.softmax(Tensor.from_numpy(s), scale=0.125), lambda: numpy_softmax(s, 0.125)),
        ("layer_norm [768,4096,2]", F.layer_norm(Tensor.from_numpy(ln), 1e-5), lambda: numpy_layer_norm(ln, 1e-5)),
    ]
    rows = []
    for name, node, ref in cases:
        run = lambda node=node: Graph(node).run("cpu")["out"].numpy()  # noqa: E731
        got, want = run(), ref()
        err = float(np.max(np.abs(got - want)))
        ts_s, ts_n = [], []
        for _ in range(max(repeat, 15)):  # interleaved; cheap, so more runs against the noise
            ts_s.append(median_time(run, 1)[0])
            ts_n.append(median_time(ref, 1)[0])
        rows.append((name, ts_s, ts_n, err))
    return rows


SD15_SHAPES = [("self 4096 x 40", 40, 4096, 4096), ("cross 4096 x 77 x 40", 40, 4096, 77),
               ("self 1024 x 80", 80, 1024, 1024)]


def bench_sd15(repeat):
    """Rows (name, GFLOP, sdrt times, torch times or None, max |diff| vs torch or numpy)."""
    try:
        import torch
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    except ImportError:
        torch = None
    rng = np.random.default_rng(2)
    rows = []
    for name, d, lq, lk in SD15_SHAPES:
        n, h = 2, 8
        # [N, L, H*D] storage viewed as [N, H, L, D], as multihead_attention's head views are
        q, k, v = (rng.standard_normal((n, ln, h, d), dtype=np.float32).transpose(0, 2, 1, 3)
                   for ln in (lq, lk, lk))
        tq, tk, tv = (Tensor.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).reshape(d, h, a.shape[2], n)
                      .permute(0, 2, 1, 3) for a in (q, k, v))
        graph = Graph(F.attention(tq, tk, tv))
        run = lambda g=graph: g.run("cpu")["out"].numpy()  # noqa: E731
        got = run().reshape(n, h, lq, d)
        if torch is not None:
            pq, pk, pv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
            peer = lambda: torch.nn.functional.scaled_dot_product_attention(pq, pk, pv)  # noqa: E731
            want = peer().numpy()
        else:
            peer, want = None, numpy_attention(q, k, v, 1 / math.sqrt(d))
        err = float(np.max(np.abs(got - want)))
        ts, tp = [], []
        for _ in range(repeat):
            ts.append(median_time(run, 1)[0])
            if peer is not None:
                tp.append(median_time(peer, 1)[0])
        rows.append((name, 4 * n * h * lq * lk * d / 1e9, ts, tp or None, err))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mem-child", choices=["sdrt", "numpy"])
    ap.add_argument("--skip-norms", action="store_true")
    ap.add_argument("--sd15", action=argparse.BooleanOptionalAction, default=True,
                    help="SD1.5's attention shapes against PyTorch SDPA")
    a = ap.parse_args()
    if a.mem_child:
        return mem_child(a.mem_child)

    from sdrt.ops.threads import get_threads
    q, k, v = make_qkv()
    scale = 1 / math.sqrt(D)
    run = sdrt_runner(q, k, v)
    got, want = run(), numpy_attention(q, k, v, scale)
    err = float(np.max(np.abs(got.reshape(want.shape) - want)))
    ts_s, ts_n = [], []
    for _ in range(a.repeat):
        ts_s.append(median_time(run, 1)[0])
        ts_n.append(median_time(lambda: numpy_attention(q, k, v, scale), 1)[0])
    t_s, t_n = float(np.median(ts_s)), float(np.median(ts_n))
    m_s, m_n = measure_mem("sdrt"), measure_mem("numpy")
    flop = 4 * H * L * L * D
    print(f"attention {L} tokens x {D} dims x {H} heads, N=1, F32, {get_threads()} threads, "
          f"median of {a.repeat} (max |diff| {err:.2e})")
    print(f"{'':8s} {'median s':>8s} {'min s':>7s} {'GFLOP/s':>8s} {'peak MiB':>9s} {'working MiB':>12s}")
    for name, t, ts, m in (("sdrt", t_s, ts_s, m_s), ("numpy", t_n, ts_n, m_n)):
        print(f"{name:8s} {t:8.3f} {min(ts):7.3f} {flop / t / 1e9:8.1f} {m['peak_mib']:9.1f} "
              f"{m['peak_mib'] - m['out_mib']:12.1f}")
    print(f"time sdrt/numpy {t_s / t_n:.2f} (target <= 2); peak memory sdrt/numpy "
          f"{m_s['peak_mib'] / m_n['peak_mib']:.3f}, working memory sdrt/numpy "
          f"{(m_s['peak_mib'] - m_s['out_mib']) / (m_n['peak_mib'] - m_n['out_mib']):.3f} (target < 0.125)")
    if a.sd15:
        print()
        rows = bench_sd15(a.repeat)
        peer = "torch SDPA" if rows[0][3] is not None else "-"
        print(f"{'SD1.5 attention, N=2, 8 heads':30s} {'GFLOP':>6s} {'sdrt s':>7s} {'GFLOP/s':>8s} "
              f"{peer + ' s':>13s} {'sdrt/peer':>10s} {'max|diff|':>10s}")
        for name, gf, ts, tp, e in rows:
            t = float(np.median(ts))
            line = f"{name:30s} {gf:6.1f} {t:7.3f} {gf / t:8.1f} "
            if tp is not None:
                ratio = float(np.median([x / y for x, y in zip(ts, tp)]))
                line += f"{float(np.median(tp)):13.3f} {ratio:10.2f} "
            else:
                line += f"{'':13s} {'':10s} "
            print(line + f"{e:10.2e}")
    if a.skip_norms:
        return
    print()
    print(f"{'norm op (F32), median (min) ms':34s} {'sdrt':>15s} {'numpy':>15s} {'speedup':>8s} {'max|diff|':>10s}")
    for name, ts, tn, e in bench_norms(a.repeat):
        ms, mn = np.median(ts), np.median(tn)
        print(f"{name:34s} {ms * 1e3:7.2f} ({min(ts) * 1e3:5.2f}) {mn * 1e3:7.2f} ({min(tn) * 1e3:5.2f}) "
              f"{mn / ms:8.2f} {e:10.2e}")


if __name__ == "__main__":
    main()
