"""Time and peak RSS of opening the hostile files issue 22 lists, each in a fresh process.

    python bench/bench_hostile_files.py

For each file: sdrt's `open_model` (and the `safetensors` package's `safe_open` for the
safetensors ones), CPU seconds (user + system of the child) and peak RSS (ru_maxrss of the
child, interpreter and imports included), and the outcome. Files are written to /dev/shm.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import fuzz_torch_corpus as TC  # noqa: E402

# the child reports its own VmHWM: wait4's ru_maxrss would keep the parent's RSS from before exec
HWM = ("\nfor line in open('/proc/self/status'):\n"
       "    if line.startswith('VmHWM:'): print('HWM', int(line.split()[1]) // 1024)\n")
SDRT = ("import sys; from sdrt.io import open_model\n"
        "try:\n    m = open_model(sys.argv[1]); print('ok', len(m.tensors) + len(m.raw))\n"
        "except Exception as e:\n    print(type(e).__name__, str(e)[-90:])\n" + HWM)
REF = ("import sys; from safetensors import safe_open\n"
       "try:\n    f = safe_open(sys.argv[1], 'numpy'); print('ok', len(f.keys()))\n"
       "except Exception as e:\n    print(type(e).__name__, str(e)[-90:])\n" + HWM)


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def files():
    """(name, bytes) of each hostile file, built one at a time."""
    n = 99_000_000 // 13
    hb = b"{" + b",".join(b'"%07x":[]' % i for i in range(n)) + b"}"
    yield "safetensors: 99 MB header of empty arrays", struct.pack("<Q", len(hb)) + hb
    h = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(65536)}
    hb = json.dumps(h).encode()
    yield "safetensors: 65,536 tensors (the limit)", struct.pack("<Q", len(hb)) + hb + bytes(4 * 65536)
    g = b"GGUF" + struct.pack("<IQQ", 3, 0, 2_000_000)
    yield "GGUF: 2M empty keys", g + b"".join(_s(b"%x" % i) + struct.pack("<IB", 0, 0) for i in range(2_000_000))
    yield "GGUF: 1M empty strings (the limit)", (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s(b"a")
                                                 + struct.pack("<IIQ", 9, 8, 1 << 20) + bytes(8 << 20) + bytes(32))
    yield "GGUF: 2M tensors", (b"GGUF" + struct.pack("<IQQ", 3, 2_000_000, 0)
                               + b"".join(_s(b"%x" % i) + struct.pack("<IQIQ", 1, 0, 0, 0) for i in range(2_000_000)))
    pkl = b"\x80\x02(" + b"\x8f" * (16 << 20) + b"1" + TC.state_pickle([], legacy=False)[2:]
    yield "zip: 16M EMPTY_SETs, deflated", TC.torch_zip(pkl, {}, deflate=True)
    pkl = b"\x80\x02(" + b"\x8f" * 400_000 + b"1" + TC.state_pickle([], legacy=False)[2:]
    yield "zip: 400k EMPTY_SETs, stored", TC.torch_zip(pkl, {})
    s = b"k" * (10 << 20)
    snip = (b"(X" + struct.pack("<I", len(s)) + s + b"r" + struct.pack("<I", 9)
            + (b"}j" + struct.pack("<I", 9) + b"Ns") * 2000 + b"1")
    pkl = b"\x80\x02" + snip + TC.state_pickle([("w", "FloatStorage", "0", 4, 0, (4,), (1,))], False)[2:]
    yield "zip: 10 MB memo key set into 2,000 dicts", TC.torch_zip(pkl, {"0": bytes(16)})
    entries = [(f"t{i}", "FloatStorage", "0", 4, 0, (1,), (1,)) for i in range(300)]
    yield "zip: 10 MB dict key above 300 tensors", TC.torch_zip(TC.state_pickle(entries, False, "k" * (10 << 20)),
                                                               {"0": bytes(16)})
    yield "zip: stride 0, (32768, 16384)", TC.torch_zip(
        TC.state_pickle([("w", "FloatStorage", "0", 4, 0, (32768, 16384), (0, 0))], False), {"0": bytes(16)})


def measure(code, path):
    """(CPU seconds, peak RSS MB, outcome) of one fresh child (CPU from wait4, RSS from its VmHWM)."""
    p = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT})
    out = p.stdout.read()
    err = p.stderr.read()
    _, _, ru = os.wait4(p.pid, 0)
    p.returncode = 0
    lines = out.strip().splitlines()
    hwm = float(lines[-1].split()[1]) if lines and lines[-1].startswith("HWM") else float("nan")
    what = lines[0].split(" ")[0] if lines else err.strip()[-60:]
    return ru.ru_utime + ru.ru_stime, hwm, what


def main():
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    print("| file | size | sdrt CPU s | sdrt peak RSS MB | sdrt | safetensors CPU s | safetensors RSS MB | safetensors |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        import safetensors  # noqa: F401
        have_ref = True
    except ImportError:
        have_ref = False
    for name, data in files():
        p = os.path.join(folder, "f.safetensors" if name.startswith("safetensors") else "f.bin")
        with open(p, "wb") as f:
            f.write(data)
        cpu, rss, res = measure(SDRT, p)
        ref = ("", "", "")
        if have_ref and name.startswith("safetensors"):
            c2, r2, res2 = measure(REF, p)
            ref = (f"{c2:.2f}", f"{r2:.0f}", res2)
        size = f"{len(data) / 2**20:.1f} MB" if len(data) >= 1 << 20 else f"{len(data) / 1024:.1f} KB"
        print(f"| {name} | {size} | {cpu:.2f} | {rss:.0f} | {res} | {ref[0]} | {ref[1]} | {ref[2]} |",
              flush=True)
        os.unlink(p)
    os.rmdir(folder)


if __name__ == "__main__":
    main()
