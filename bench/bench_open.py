"""Time and memory of opening a 2 GB fp16 safetensors file and reading its tensor table.

Target (issue 3): under 0.2 s and under 50 MB of RAM.

Creates /tmp/sdrt_bench_open/unet_fp16.safetensors (kept between runs; --fresh rewrites it)
with ~1100 fp16 tensors shaped like an SD 1.x checkpoint (conv / linear / norm / bias, UNet
+ VAE + text-encoder widths) totalling ~2 GB, written with sdrt's streaming writer. Then, in a
fresh subprocess per measurement (so imports are paid before the clock starts and peak RSS is
the open's own): reset the peak-RSS counter (/proc/self/clear_refs 5), open the file with
sdrt.io.open_model, walk every tensor's name / dtype / ne / nbytes, and report wall seconds
and the VmHWM delta. Also the same for the `safetensors` package's safe_open (numpy) as a peer.

Then (unless --no-convert) the streaming writer: `sdrt.io.convert` of the same file to a q8_0
GGUF in a fresh subprocess, with its time and peak-RSS delta (target: about one tensor's working
set, far below the 2 GB model).

usage: python bench/bench_open.py [--fresh] [--runs 5] [--no-convert] [--type q8_0]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PATH = "/tmp/sdrt_bench_open/unet_fp16.safetensors"


def sd_like_shapes(target_bytes=2_000_000_000, n_target=1100):
    """numpy-order shapes of an SD1.x-like checkpoint, scaled to ~target_bytes in fp16."""
    shapes = []
    widths = [320, 640, 1280, 1280, 640, 320, 128, 256, 512, 512, 768]
    i = 0
    while len(shapes) < n_target:
        c = widths[i % len(widths)]
        blk = f"model.diffusion_model.block{i}"
        shapes += [(f"{blk}.in_layers.0.weight", (c,)), (f"{blk}.in_layers.0.bias", (c,)),
                   (f"{blk}.in_layers.2.weight", (c, c, 3, 3)), (f"{blk}.in_layers.2.bias", (c,)),
                   (f"{blk}.emb_layers.1.weight", (c, 1280)), (f"{blk}.emb_layers.1.bias", (c,)),
                   (f"{blk}.attn1.to_q.weight", (c, c)), (f"{blk}.attn1.to_k.weight", (c, c)),
                   (f"{blk}.attn1.to_v.weight", (c, c)), (f"{blk}.attn2.to_k.weight", (c, 768)),
                   (f"{blk}.ff.net.0.proj.weight", (c * 8, c)), (f"{blk}.ff.net.0.proj.bias", (c * 8,)),
                   (f"{blk}.ff.net.2.weight", (c, c * 4)), (f"{blk}.norm1.weight", (c,))]
        i += 1
    shapes = shapes[:n_target]
    total = sum(2 * _prod(s) for _, s in shapes)
    # pad with a few big embedding-like tensors up to the target size
    k = 0
    while total < target_bytes:
        rows = min(49408, (target_bytes - total) // (2 * 768) or 1)
        shapes.append((f"cond_stage_model.transformer.extra_{k}.weight", (rows, 768)))
        total += 2 * rows * 768
        k += 1
    return shapes


def _prod(s):
    n = 1
    for d in s:
        n *= d
    return n


def make_file(path=PATH, fresh=False):
    if os.path.exists(path) and not fresh:
        return
    sys.path.insert(0, ROOT)
    import numpy as np
    from sdrt.io.writer import TensorPlan, write_safetensors
    from sdrt.ops import dtypes
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = np.random.default_rng(0)
    block = rng.standard_normal(1 << 20).astype(np.float16)
    plans = []
    for name, shape in sd_like_shapes():
        n = _prod(shape)
        plans.append(TensorPlan(name, dtypes.F16, tuple(reversed(shape)),
                                lambda n=n: np.resize(block, n)))
    t0 = time.perf_counter()
    size = write_safetensors(path, plans, {"format": "pt"})
    print(f"wrote {path}: {len(plans)} tensors, {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import sdrt.io
{peer_import}

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
t0 = time.perf_counter()
{body}
dt = time.perf_counter() - t0
print(json.dumps({{"seconds": dt, "peak_delta": status("VmHWM:") - base, "n": n, "bytes": nbytes}}))
"""

SDRT_BODY = """mf = sdrt.io.open_model({path!r})
n, nbytes = 0, 0
for name, t in mf.tensors.items():
    n += 1
    nbytes += t.nbytes
    _ = (name, t.dtype.name, t.ne)"""

PEER_BODY = """n, nbytes = 0, 0
with safe_open({path!r}, framework="numpy") as f:
    for name in f.keys():
        sl = f.get_slice(name)
        n += 1
        _ = (name, sl.get_dtype(), sl.get_shape())
        nbytes += 2 * int(np.prod(sl.get_shape()))"""


CONVERT_BODY = """s = sdrt.io.convert({path!r}, {out!r}, {type!r})
n, nbytes = s.n_tensors, s.bytes_out
print(s, file=sys.stderr)"""


def measure(body, peer_import="", runs=5):
    code = CHILD.format(root=ROOT, body=body.format(path=PATH), peer_import=peer_import)
    out = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-convert", action="store_true")
    ap.add_argument("--type", default="q8_0")
    args = ap.parse_args(argv)
    make_file(fresh=args.fresh)
    size = os.path.getsize(PATH)
    rows = [("sdrt.io.open_model", measure(SDRT_BODY, runs=args.runs))]
    try:
        import safetensors  # noqa: F401
        rows.append(("safetensors.safe_open (peer)",
                     measure(PEER_BODY, "from safetensors import safe_open", runs=args.runs)))
    except ImportError:
        pass
    print(f"file: {PATH} ({size / 1e9:.2f} GB, {rows[0][1][0]['n']} tensors, "
          f"{rows[0][1][0]['bytes'] / 1e9:.2f} GB of tensor data)")
    print(f"{'reader':<30} {'median s':>9} {'max s':>7} {'peak RSS delta MB':>18}")
    for name, res in rows:
        secs = sorted(r["seconds"] for r in res)
        peak = max(r["peak_delta"] for r in res) / 1e6
        print(f"{name:<30} {secs[len(secs) // 2]:>9.4f} {secs[-1]:>7.4f} {peak:>18.1f}")
    if not args.no_convert:
        out = os.path.join(os.path.dirname(PATH), f"out_{args.type}.gguf")
        body = CONVERT_BODY.format(path=PATH, out=out, type=args.type)
        r = measure(body.replace("{", "{{").replace("}", "}}"), runs=1)[0]
        print(f"convert -> {args.type} GGUF: {r['seconds']:.1f} s, output {r['bytes'] / 1e9:.2f} GB, "
              f"peak RSS delta {r['peak_delta'] / 1e6:.1f} MB")
        os.unlink(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
