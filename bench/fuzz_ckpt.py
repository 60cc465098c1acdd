"""Fuzz the PyTorch checkpoint reader: mutate valid .ckpt files (zip and legacy) and count outcomes.

    python bench/fuzz_ckpt.py [--cases 10000] [--seed 0] [--write-docs]

Invariants checked on every case:
- the only exception that escapes `read_ckpt` is ModelFileError;
- a file that loads has tensors whose data can all be read (every view is inside its buffer);
- no side effect: no os.system / os.popen / subprocess / exec* call, no canary file.

Mutations: byte flips, interesting integers, random opcode bytes, chunk insert/delete, truncation —
applied either to the raw file (zip CRCs then stop most pickle damage at the door), or to the
pickle inside the zip, which is then re-packed with valid CRCs so the pickle VM sees it; plus
mutations of the same pickles with globals swapped for dangerous ones (os.system, builtins.eval, ...).
`--write-docs` puts the counts into docs/model-files-ckpt.md between the FUZZ markers.
"""
from __future__ import annotations

import argparse
import collections
import io
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sdrt.errors import ModelFileError  # noqa: E402
from sdrt.io.ckpt import read_ckpt  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
SEEDS = ["ckpt_zip.ckpt", "ckpt_legacy.pt", "ckpt_wrapped.ckpt", "ckpt_wrapped_legacy.ckpt", "ckpt_embedding.pt"]
CANARY = os.path.join(tempfile.gettempdir(), "sdrt_fuzz_canary")
OPCODES = b"\x80\x95.(012N\x88\x89IJKML\x8a\x8bFGSTUVX\x8c\x8dBC\x8e\x96)t\x85\x86\x87]lae}dsu\x8f\x90\x91c\x93R\x81\x92bQghjpqr\x94ioP\x82\x83\x84\x97\x98"
INTERESTING = [b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\x00\x80", b"\x00\x00\x00\x00",
               b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x01", b"\xff", b"\x80"]
EVIL_GLOBALS = [b"os\nsystem", b"posix\nsystem", b"builtins\neval", b"builtins\nexec", b"__builtin__\neval",
                b"subprocess\nPopen", b"builtins\ngetattr", b"marshal\nloads", b"types\nFunctionType",
                b"pip\nmain", b"timeit\ntimeit", b"torch\nload", b"runpy\n_run_code", b"nt\nsystem"]


def _zip_parts(data: bytes):
    """[(name, bytes)] of a torch zip, or None when it is not a readable zip."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return [(i.filename, z.read(i)) for i in z.infolist()]
    except Exception:
        return None


def _repack(parts) -> bytes:
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # duplicate entry names are one of the mutations
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
            for name, b in parts:
                z.writestr(name, b)
    return out.getvalue()


def _mutate_bytes(b: bytearray, rng: random.Random) -> bytearray:
    kind = rng.randrange(6)
    if not b:
        return bytearray(rng.randbytes(rng.randrange(1, 16)))
    if kind == 0:                                   # flip a few bytes
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:                                 # interesting integer
        v = rng.choice(INTERESTING)
        p = rng.randrange(len(b))
        b[p:p + len(v)] = v
    elif kind == 2:                                 # an opcode byte
        b[rng.randrange(len(b))] = rng.choice(OPCODES)
    elif kind == 3:                                 # insert a chunk
        p = rng.randrange(len(b) + 1)
        b[p:p] = rng.randbytes(rng.randint(1, 32))
    elif kind == 4:                                 # delete a chunk
        p = rng.randrange(len(b))
        del b[p:p + rng.randint(1, 32)]
    else:                                           # truncate
        del b[rng.randrange(len(b)):]
    return b


def _evil(pkl: bytes, rng: random.Random) -> bytes:
    """Swap one GLOBAL for a dangerous one (the rest of the pickle stays valid)."""
    starts = [i for i in range(len(pkl)) if pkl[i:i + 1] == b"c" and pkl[i + 1:i + 7] in (b"torch.", b"torch\n", b"collec")]
    if not starts:
        return pkl
    i = rng.choice(starts)
    j = pkl.index(b"\n", pkl.index(b"\n", i) + 1)
    return pkl[:i + 1] + rng.choice(EVIL_GLOBALS) + b"\n" + pkl[j + 1:]


def make_case(seed_bytes: bytes, rng: random.Random) -> tuple[str, bytes]:
    parts = _zip_parts(seed_bytes) if seed_bytes[:2] == b"PK" else None
    mode = rng.randrange(4)
    if parts and mode in (0, 1):                    # mutate the pickle (or a record) and re-pack
        idx = next(i for i, (n, _) in enumerate(parts) if n.endswith("data.pkl"))
        if mode == 1 and rng.random() < 0.3:
            idx = rng.randrange(len(parts))
        name, b = parts[idx]
        evil = rng.random() < 0.15
        b = bytearray(_evil(b, rng) if evil else b)
        for _ in range(rng.randint(1, 3)):
            b = _mutate_bytes(b, rng)
        parts = list(parts)
        parts[idx] = (name, bytes(b))
        if rng.random() < 0.1:                      # structural: drop or duplicate an entry
            j = rng.randrange(len(parts))
            parts = parts[:j] + parts[j + 1:] if rng.random() < 0.5 else parts + [parts[j]]
        return ("zip-evil" if evil else "zip-pickle"), _repack(parts)
    if not parts and mode in (0, 1) and rng.random() < 0.15:
        b = bytearray(_evil(seed_bytes, rng))
        return "legacy-evil", bytes(_mutate_bytes(b, rng) if rng.random() < 0.5 else b)
    b = bytearray(seed_bytes)
    for _ in range(rng.randint(1, 4)):
        b = _mutate_bytes(b, rng)
    return ("zip-raw" if parts else "legacy-raw"), bytes(b)


class SideEffects:
    """Record calls that would mean code ran; restored on exit."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.saved = {}
        for mod, name in [(os, "system"), (os, "popen"), (os, "execv"), (os, "execve"), (os, "fork"),
                          (subprocess, "Popen"), (subprocess, "run"), (subprocess, "call")]:
            self.saved[(mod, name)] = getattr(mod, name)
            setattr(mod, name, self._rec(f"{mod.__name__}.{name}"))
        return self

    def _rec(self, what):
        def f(*a, **k):
            self.calls.append(what)
            raise PermissionError(f"fuzz: {what} called")
        return f

    def __exit__(self, *exc):
        for (mod, name), v in self.saved.items():
            setattr(mod, name, v)


def run(cases: int = 10000, seed: int = 0, verbose: bool = False) -> dict:
    rng = random.Random(seed)
    seeds = [open(os.path.join(FIXTURES, f), "rb").read() for f in SEEDS]
    counts = collections.Counter()
    by_kind = collections.Counter()
    failures = []
    if os.path.exists(CANARY):
        os.remove(CANARY)
    with tempfile.TemporaryDirectory() as tmp, SideEffects() as fx:
        path = os.path.join(tmp, "case.ckpt")
        for i in range(cases):
            kind, data = make_case(rng.choice(seeds), rng)
            with open(path, "wb") as f:
                f.write(data)
            try:
                m = read_ckpt(path)
                for t in m.tensors.values():
                    t.to_f32()
                outcome = "loaded"
            except ModelFileError:
                outcome = "ModelFileError"
            except BaseException as e:  # noqa: BLE001 - the point is to see anything else
                outcome = "OTHER"
                failures.append((i, kind, f"{type(e).__name__}: {e}"))
                if verbose:
                    print(f"case {i} ({kind}): {type(e).__name__}: {e}")
            counts[outcome] += 1
            by_kind[(kind, outcome)] += 1
        side = list(fx.calls)
    if os.path.exists(CANARY):
        side.append("canary file created")
    return {"cases": cases, "seed": seed, "counts": dict(counts), "by_kind": dict(by_kind),
            "failures": failures, "side_effects": side}


def _docs_table(res, seconds) -> str:
    kinds = sorted({k for k, _ in res["by_kind"]})
    lines = [f"Run: `python bench/fuzz_ckpt.py --cases {res['cases']} --seed {res['seed']}` "
             f"({seconds:.0f} s on the 2-core dev machine).", "",
             "| mutation | cases | loaded | ModelFileError | other exception |", "|---|---|---|---|---|"]
    for k in kinds:
        row = [res["by_kind"].get((k, o), 0) for o in ("loaded", "ModelFileError", "OTHER")]
        lines.append(f"| {k} | {sum(row)} | " + " | ".join(map(str, row)) + " |")
    c = res["counts"]
    lines.append(f"| **all** | **{res['cases']}** | **{c.get('loaded', 0)}** | **{c.get('ModelFileError', 0)}** "
                 f"| **{c.get('OTHER', 0)}** |")
    lines += ["", f"Side effects (os.system/popen/exec/fork, subprocess, canary file): "
              f"{len(res['side_effects'])}."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    t = time.perf_counter()
    res = run(a.cases, a.seed, a.verbose)
    dt = time.perf_counter() - t
    table = _docs_table(res, dt)
    print(table)
    for f in res["failures"][:20]:
        print("FAILURE", f)
    if a.write_docs:
        doc = os.path.join(ROOT, "docs", "model-files-ckpt.md")
        text = open(doc).read()
        s, e = text.index("<!-- FUZZ -->"), text.index("<!-- /FUZZ -->")
        open(doc, "w").write(text[:s] + "<!-- FUZZ -->\n" + table + "\n" + text[e:])
    return 1 if res["failures"] or res["side_effects"] else 0


if __name__ == "__main__":
    sys.exit(main())
