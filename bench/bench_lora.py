"""LoRA costs on the CPU (issue 16): the at-runtime overhead of a SD1.5 step and the time to merge
an SDXL rank-32 LoRA at load.

    python bench/bench_lora.py step  [--size 64] [--rank 32] [--repeat 2] [--backend cpu|cuda0] [--runtime-merge auto|on|off]
    python bench/bench_lora.py merge [--rank 32] [--generic]

step: the SD1.5 UNet (random F16 weights of the real shapes, bench_unet.random_table), one
forward at a [2, 4, size, size] latent (cond + uncond), without LoRA and then with a kohya LoRA
of the given rank on every attention, feed-forward and proj_in/out weight of the transformer
blocks (what kohya trains by default) applied at_runtime (sdrt.engine.lora.RuntimePath: the delta
folded into a copy of the weight once, at the first call, or the low-rank chain beside the GEMM,
--runtime-merge).
Each model is warmed once (graph build), then the two run alternately --repeat times; the
fastest run of each gives the figure (medians printed too). --profile first prints per-op time
sums of one step of each (CPU), split into the LoRA's own nodes and the other ops' difference. --backend cuda0
times the same on the GPU (weights registered as weights, so the step runs as a replayed CUDA
graph; the LoRA factors are read-only leaves, cached on the device the same way).
merge: the SDXL UNet's tensor names and shapes (tools/make_sd_checkpoint.py layout); the same
kind of LoRA at the given rank, merged `immediately`: apply_loras (read + map the file) plus
filling every patched leaf (delta by BLAS, add, round to F16) one at a time, each dropped after
(base weights are zero F16 views, so reading the checkpoint is not in the figure). The imports
and merge-kernel load a first LoRA costs once per process are timed before it, on their own. The fused
merge (sdrt.engine.lora_merge) runs unless --generic, which times the generic path (float32
delta, numpy add and conversions) for comparison.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np  # noqa: E402

DM = "model.diffusion_model."
_KOHYA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out")


def kohya_lora(shapes: dict, rank: int, path: str, seed: int = 0) -> int:
    """Write a random kohya LoRA (LDM-named keys) for the targets among `shapes` (torch shapes)."""
    from sdrt.io import write_safetensors
    r = np.random.default_rng(seed)
    out = {}
    for name, s in shapes.items():
        stem = name[len(DM):-len(".weight")]
        if not name.endswith(".weight") or len(s) < 2 or not stem.endswith(_KOHYA_TARGETS):
            continue
        key = "lora_unet_" + stem.replace(".", "_")
        tail = (1, 1) if len(s) == 4 else ()
        out[key + ".lora_down.weight"] = (r.standard_normal((rank,) + tuple(s[1:]), dtype=np.float32) * 0.01).astype(np.float16)
        out[key + ".lora_up.weight"] = (r.standard_normal((s[0], rank) + tail, dtype=np.float32) * 0.01).astype(np.float16)
        out[key + ".alpha"] = np.array(rank / 2, np.float16)
    write_safetensors(path, out)
    return len(out) // 3


def step(args):
    from bench_unet import random_table

    from sdrt.engine import lora as L
    from sdrt.engine.lora import LoraSpec, apply_loras
    from sdrt.models.common import RUNTIME_LORA
    L.RUNTIME_MERGE = args.runtime_merge
    from sdrt.models.diffusion.unet import UNetConfig, UNetModel
    cfg = UNetConfig.preset("sd1")
    table, _ = random_table(cfg, np.float16)
    rng = np.random.default_rng(1)
    S = args.size
    x = rng.standard_normal((2, 4, S, S), dtype=np.float32)
    t = np.array([999.0, 999.0], np.float32)
    ctx = rng.standard_normal((2, 77, 768), dtype=np.float32)

    be = args.backend
    if be != "cpu":
        from sdrt.ops.backend import get_backend
        get_backend(be).register_weights(table)           # writeable numpy weights are not inputs

    first: dict = {}

    def warm(key, model):
        t0 = time.perf_counter()
        model(x, t, ctx, backend=be)                       # builds (and caches) the graph
        first[key] = time.perf_counter() - t0
        return model

    base_model = warm("base", UNetModel(table, config=cfg))      # its graph is built before the LoRA exists
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "lora.safetensors")
        n = kohya_lora({k: v.ne[::-1] for k, v in table.items()}, args.rank, path)
        _, runtime = apply_loras(table, [LoraSpec(path, 1.0)], "sd1", "at_runtime")
        for w, p in runtime.items():
            RUNTIME_LORA[w] = p
        lora_model = warm("lora", UNetModel(table, config=cfg))   # folds build here, once
    if args.profile:
        _profile(lambda: base_model(x, t, ctx, backend=be), lambda: lora_model(x, t, ctx, backend=be))
    # alternating runs: on a shared host, load that comes and goes hits both alike; the fastest
    # run of each is the least disturbed one
    ts: dict = {"base": [], "lora": []}
    for _ in range(args.repeat):
        for key, model in (("base", base_model), ("lora", lora_model)):
            t0 = time.perf_counter()
            model(x, t, ctx, backend=be)
            ts[key].append(time.perf_counter() - t0)
    base, lora = min(ts["base"]), min(ts["lora"])
    med = {key: statistics.median(v) for key, v in ts.items()}
    unit, k = ("ms", 1e3) if be != "cpu" else ("s", 1.0)
    print(f"SD1.5 UNet step on {be}, latent {S}x{S} batch 2, F16 weights: {base * k:.2f} {unit}; with a rank-{args.rank} "
          f"LoRA on {n} weights at_runtime: {lora * k:.2f} {unit} ({100 * (lora / base - 1):+.1f} %; "
          f"RUNTIME_MERGE={args.runtime_merge}; fastest of {args.repeat} alternating runs each, medians "
          f"{med['base'] * k:.2f} / {med['lora'] * k:.2f} {unit}); first call (graph build, the LoRA's folds): "
          f"{first['base'] * k:.2f} / {first['lora'] * k:.2f} {unit}")


def _profile(run_base, run_lora):
    """Per-op time sums of one base and one LoRA step on a host backend (each node's kernel timed
    in sdrt.ops.graph.run_on_host): the LoRA's own nodes (those reading a LoRA factor) and the
    other ops' difference, steadier on a shared host than whole-step times."""
    import collections

    import sdrt.ops.graph as G
    sums: dict = collections.defaultdict(float)
    real = G.run_on_host

    class Timed:
        def __init__(self, be):
            self.be, self.name = be, be.name

        def find(self, node):
            k = self.be.find(node)
            lora = any((s.name or "").endswith(".lora") for s in node.src)

            class K:
                @staticmethod
                def fn(n, xs, out):
                    t0 = time.perf_counter()
                    k.fn(n, xs, out)
                    sums[(n.op, lora)] += time.perf_counter() - t0
            return K

    G.run_on_host = lambda graph, plan, be, *a, **kw: real(graph, plan, Timed(be), *a, **kw)
    try:
        got = {}
        for key, run in (("base", run_base), ("lora", run_lora)):
            sums.clear()
            t0 = time.perf_counter()
            run()
            got[key] = (time.perf_counter() - t0, dict(sums))
    finally:
        G.run_on_host = real
    (tb, b), (tl, lo) = got["base"], got["lora"]
    own = sum(v for (op, is_lora), v in lo.items() if is_lora)
    ops = sorted({op for op, _ in list(b) + list(lo)})
    diff = {op: sum(v for (o, _), v in lo.items() if o == op) - b.get((op, False), 0.0) for op in ops}
    print(f"profile: base step {tb:.2f} s, LoRA step {tl:.2f} s; LoRA-factor nodes {own * 1e3:.0f} ms "
          f"({', '.join(f'{op} {v * 1e3:.0f}' for (op, il), v in sorted(lo.items()) if il)}); other ops' "
          f"difference: {', '.join(f'{op} {diff[op] * 1e3:+.0f}' for op in ops if abs(diff[op]) >= 0.005)} ms")


def merge(args):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_sd_checkpoint import layout

    from sdrt.engine import lora as L
    from sdrt.engine.lora import LoraSpec, apply_loras
    from sdrt.ops.tensor import Tensor
    from sdrt.ops.threads import get_threads
    if args.generic:
        L._fused_ok = lambda name: False
    shapes = {DM + k: v for k, v in layout("sdxl", "unet").items()}
    zero = np.zeros(max(int(np.prod(s)) for s in shapes.values()), np.float16)
    table = {k: Tensor.from_numpy(zero[: int(np.prod(s))].reshape(s), name=k) for k, s in shapes.items()}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "lora.safetensors")
        n = kohya_lora(shapes, args.rank, path)
        size = os.path.getsize(path)
        # once per process, not per LoRA: the modules a pipeline has loaded with its checkpoint,
        # and the merge kernels (Numba cache) with their F16-rounding self-check
        t0 = time.perf_counter()
        import sdrt.io  # noqa: F401
        import sdrt.models.names  # noqa: F401
        L._fused_ok("F16")
        t_setup = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        out, _ = apply_loras(table, [LoraSpec(path, 1.0)], "sdxl", "immediately")
        t_map = time.perf_counter() - t0
        patched = [k for k in out if out[k] is not table[k]]
        params = 0
        for k in patched:
            out[k].storage                               # noqa: B018 - fills: delta, add, round to F16
            params += out[k].nelements
            out[k] = None
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"SDXL rank-{args.rank} LoRA ({n} weights, {size / 2**20:.0f} MiB file, {params / 1e6:.0f} M weight "
          f"elements patched): read + map {t_map:.2f} s, merge total {total:.2f} s wall, {cpu:.2f} s CPU "
          f"({'generic' if args.generic else 'fused'} merge, {get_threads()} threads; first-use imports and "
          f"kernel load before it {t_setup:.2f} s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("step", "merge"))
    ap.add_argument("--size", type=int, default=64, help="latent H = W (64: a 512x512 image)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--backend", default="cpu", help="step: cpu or cudaN")
    ap.add_argument("--generic", action="store_true", help="merge: time the generic (unfused) path")
    ap.add_argument("--profile", action="store_true", help="step (cpu): per-op time sums of one base and one LoRA step first")
    ap.add_argument("--runtime-merge", default="auto", choices=("auto", "on", "off"),
                    help="step: sdrt.engine.lora.RUNTIME_MERGE (off: the low-rank chain beside every GEMM)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    (step if args.what == "step" else merge)(args)


if __name__ == "__main__":
    main()
