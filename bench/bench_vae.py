"""Full-size SD 1.x VAE decode (64x64 latent -> 512x512 image) with random F16 weights: sdrt, and
diffusers/PyTorch (fp32, the same weights) in the same run when it is installed.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_vae.py [--latent 64] [--threads 2]
        [--repeat 3] [--no-peer]

The SD 1.x VAE (ch 128, ch_mult 1,2,4,4, 2 res blocks, 4 latent channels) is built from LDM names
with N(0, 1/fan_in) weights stored as F16, as checkpoints store them (sdrt widens them per op;
PyTorch gets the same values in fp32). Each side is built once and warmed up on an 8x8 latent
(Numba kernels, BLAS pools), then the full decodes are timed --repeat times, interleaved
(sdrt, diffusers, sdrt, ...) so machine noise hits both alike; the best of each is printed.
DESIGN.md's reference on this 2-core machine: diffusers 11.0 s, sd-cli 35.9 s, 2.48 TFLOP.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdrt  # noqa: E402,F401  before numpy: sdrt/__init__.py sets OpenBLAS's thread spin

import numpy as np

from sdrt.models.vae.autoencoder_kl import AutoencoderKL  # noqa: E402
from sdrt.ops import api as F  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402
from sdrt.ops.threads import set_threads  # noqa: E402

DECODE_TFLOP_512 = 2.48   # DESIGN.md: SD VAE decode 64x64 -> 512x512
P = "first_stage_model."


def sd_vae_spec(ch=128, mult=(1, 2, 4, 4), nrb=2, z=4):
    """(LDM name, torch shape) of an SD VAE's decoder + post_quant_conv."""
    spec = [("post_quant_conv.weight", (z, z, 1, 1)), ("post_quant_conv.bias", (z,))]
    L = [ch * m for m in mult]

    def conv(name, ic, oc, k=3):
        spec.extend([(name + ".weight", (oc, ic, k, k)), (name + ".bias", (oc,))])

    def norm(name, c):
        spec.extend([(name + ".weight", (c,)), (name + ".bias", (c,))])

    def res(name, ic, oc):
        norm(name + ".norm1", ic)
        conv(name + ".conv1", ic, oc)
        norm(name + ".norm2", oc)
        conv(name + ".conv2", oc, oc)
        if ic != oc:
            conv(name + ".nin_shortcut", ic, oc, 1)

    c = L[-1]
    conv("decoder.conv_in", z, c)
    res("decoder.mid.block_1", c, c)
    norm("decoder.mid.attn_1.norm", c)
    for k in ("q", "k", "v", "proj_out"):
        conv(f"decoder.mid.attn_1.{k}", c, c, 1)
    res("decoder.mid.block_2", c, c)
    for i in reversed(range(len(L))):
        for j in range(nrb + 1):
            res(f"decoder.up.{i}.block.{j}", c, L[i])
            c = L[i]
        if i:
            conv(f"decoder.up.{i}.upsample.conv", c, c)
    norm("decoder.norm_out", c)
    conv("decoder.conv_out", c, 3)
    return [(P + n, s) for n, s in spec]


def random_weights(spec, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in spec:
        if len(shape) > 1:
            v = rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(np.prod(shape[1:])))
        elif "norm" in name and name.endswith("weight"):
            v = 1 + 0.1 * rng.standard_normal(shape, np.float32)
        else:
            v = 0.1 * rng.standard_normal(shape, np.float32)
        out[name] = v.astype(np.float16)
    return out


def sdrt_runner(weights, z, small):
    vae = AutoencoderKL({k: Tensor.from_numpy(v, name=k) for k, v in weights.items()})
    vae.decode(small)   # Numba kernels compiled / loaded, BLAS pool up
    g = F.Graph(vae.decode_graph(Tensor.from_numpy(z)))
    return (lambda: g.run()["out"].to_f32()), g.plan()


def diffusers_runner(weights, z, small, threads, bf16=False):
    import torch
    from diffusers import AutoencoderKL as DAE

    from sdrt.models.names import diffusers_vae_to_ldm
    torch.set_num_threads(threads)
    m = DAE(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4).eval()
    sd = {k: v for k, v in m.state_dict().items() if not k.startswith(("encoder.", "quant_conv."))}
    new = {k: torch.from_numpy(weights[P + diffusers_vae_to_ldm(k, 4)].astype(np.float32).reshape(tuple(v.shape)))
           for k, v in sd.items()}
    m.load_state_dict(new, strict=False)
    zt = torch.from_numpy(z)
    dt = torch.bfloat16 if bf16 else torch.float32
    m, zt = m.to(dt), zt.to(dt)

    def run():
        with torch.no_grad():
            return m.decode(zt).sample.float().numpy()
    with torch.no_grad():
        m.decode(torch.from_numpy(small).to(dt))
    return run, f"torch {torch.__version__}"


def _profiler():
    """Per-node times from the CPU runner's SDRT_DEBUG=2 log: (per op, per (op, output ne))."""
    import collections
    import logging
    by_op, by_shape = collections.Counter(), collections.Counter()

    class H(logging.Handler):
        def emit(self, rec):
            if isinstance(rec.msg, str) and rec.msg.startswith("%-16s"):
                by_op[rec.args[0]] += rec.args[-1] / 1e3
                by_shape[(rec.args[0], str(rec.args[2]))] += rec.args[-1] / 1e3
    lg = logging.getLogger("sdrt")
    lg.addHandler(H())
    lg.setLevel(logging.INFO)
    os.environ["SDRT_DEBUG"] = "2"
    return by_op, by_shape


def _print_profile(by_op, by_shape, repeat):
    tot = sum(by_op.values())
    print(f"profile (per decode, node sum {tot / repeat:.2f} s):")
    for op, s in by_op.most_common():
        print(f"  {op:20s} {s / repeat:7.3f} s  {100 * s / tot:5.1f}%")
    print("  largest (op, output ne):")
    for (op, ne), s in by_shape.most_common(20):
        print(f"  {op:20s} {ne:24s} {s / repeat:7.3f} s  {100 * s / tot:5.1f}%")


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latent", type=int, default=64, help="latent side (64 -> 512x512 image)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="skip diffusers")
    ap.add_argument("--peer-bf16", action="store_true", help="also time diffusers in bfloat16")
    ap.add_argument("--profile", action="store_true", help="sdrt only: time per op kind and the "
                    "largest (op, output ne) entries over the timed runs (SDRT_DEBUG=2 per-node timing)")
    a = ap.parse_args()
    if a.profile:
        a.no_peer = True
    set_threads(a.threads)
    weights = random_weights(sd_vae_spec())
    rng = np.random.default_rng(1)
    z = rng.standard_normal((1, 4, a.latent, a.latent), np.float32)
    small = rng.standard_normal((1, 4, 8, 8), np.float32)
    tflop = DECODE_TFLOP_512 * (a.latent / 64) ** 2
    print(f"SD VAE decode {a.latent}x{a.latent} -> {8 * a.latent}x{8 * a.latent}, F16 weights, "
          f"{a.threads} threads, ~{tflop:.2f} TFLOP")
    peer = None
    if not a.no_peer:
        try:
            import diffusers  # noqa: F401
            import torch  # noqa: F401
            peer = True
        except ImportError:
            print("diffusers/torch not installed: sdrt only")
    run_s, plan = sdrt_runner(weights, z, small)
    run_p = ver = None
    if peer:
        run_p, ver = diffusers_runner(weights, z, small, a.threads)
    run_b = diffusers_runner(weights, z, small, a.threads, bf16=True)[0] if peer and a.peer_bf16 else None
    prof = _profiler() if a.profile else None
    best_s = best_p = best_b = float("inf")
    for r in range(a.repeat):   # interleaved, so machine noise hits both alike
        ts, ys = timed(run_s)
        best_s = min(best_s, ts)
        line = f"[{r}] sdrt {ts:7.2f} s ({tflop / ts * 1e3:5.0f} GFLOP/s)"
        if run_p is not None:
            tp, yp = timed(run_p)
            best_p = min(best_p, tp)
            err = float(np.abs(ys - yp).max() / max(1.0, np.abs(yp).max()))
            line += f"   diffusers {tp:7.2f} s   sdrt/diffusers time {ts / tp:.2f}x   max err {err:.1e}"
        if run_b is not None:
            tb, _ = timed(run_b)
            best_b = min(best_b, tb)
            line += f"   diffusers bf16 {tb:7.2f} s   sdrt/bf16 {ts / tb:.2f}x"
        print(line, flush=True)
    if prof is not None:
        os.environ["SDRT_DEBUG"] = "0"
        _print_profile(*prof, a.repeat)
    if run_b is not None:
        print(f"best diffusers bf16: {best_b:.2f} s, sdrt / diffusers bf16 {best_s / best_b:.2f}x")
    print(f"best: sdrt {best_s:.2f} s (planned arena {plan.arena_bytes / 2**20:.0f} MiB)"
          + (f", diffusers {best_p:.2f} s ({ver}), ratio {best_s / best_p:.2f}x" if run_p is not None else ""))


if __name__ == "__main__":
    main()
