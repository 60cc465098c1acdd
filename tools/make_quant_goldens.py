"""Produce the ggml reference goldens for tests/test_quant.py (tests/fixtures/quant_ggml_*.npz).

ggml's own C code is the reference: this script compiles ggml-quants.c from the
stable-diffusion-cpp-python sdist (vendor/stable-diffusion.cpp/ggml) into a throw-away shared
library in a temp dir, with a tiny shim for the few ggml.c symbols it links against, and calls
`quantize_row_*_ref` / `dequantize_row_*` through ctypes. No ggml code is copied into the repo;
only the inputs and the bytes/floats ggml produced are saved.

    pip download --no-deps --no-binary :all: stable-diffusion-cpp-python -d /tmp/sdcpp
    python tools/make_quant_goldens.py [--ggml /path/to/ggml]   # default: found under /tmp/sdcpp

It also checks that sdrt/ops/quant/_iq_tables.pxi (generated from the gguf package by
tools/make_iq_tables.py) holds exactly ggml-common.h's tables, and reports whether sdrt's
current build already matches every golden.

Compiled like ggml's release builds for the reference functions: -O2 -DNDEBUG, no -march (so no
FMA), -ffp-contract=off.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT))

QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "Q8_K", "TQ1_0", "TQ2_0", "MXFP4"]
# every block type that ggml can dequantize (Q8_1 has no dequantize_row in ggml)
DEQUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
                 "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
                 "TQ1_0", "TQ2_0", "MXFP4"]
TABLES = ["iq2xxs_grid", "iq2xs_grid", "iq2s_grid", "iq3xxs_grid", "iq3s_grid", "iq1s_grid",
          "ksigns_iq2xs", "kvalues_iq4nl", "kvalues_mxfp4"]

SHIM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <stddef.h>
#define GGML_COMMON_DECL_C
#define GGML_COMMON_IMPL_C
#include "ggml-common.h"
/* the few ggml.c symbols ggml-quants.c references (none is reached by the _ref/dequantize paths) */
void ggml_abort(const char * file, int line, const char * fmt, ...) { fprintf(stderr, "ggml_abort %s:%d\n", file, line); abort(); }
size_t ggml_row_size(int type, int64_t ne) { (void)type; (void)ne; return 0; }
size_t ggml_type_size(int type) { (void)type; return 0; }
const char * ggml_type_name(int type) { (void)type; return "?"; }
const void * shim_table(int i) {
    switch (i) {
        case 0: return iq2xxs_grid; case 1: return iq2xs_grid; case 2: return iq2s_grid;
        case 3: return iq3xxs_grid; case 4: return iq3s_grid; case 5: return iq1s_grid;
        case 6: return ksigns_iq2xs; case 7: return kvalues_iq4nl; case 8: return kvalues_mxfp4;
    }
    return 0;
}
"""
TABLE_SHAPES = {"iq2xxs_grid": (256, np.uint64), "iq2xs_grid": (512, np.uint64), "iq2s_grid": (1024, np.uint64),
                "iq3xxs_grid": (256, np.uint32), "iq3s_grid": (512, np.uint32), "iq1s_grid": (2048, np.uint64),
                "ksigns_iq2xs": (128, np.uint8), "kvalues_iq4nl": (16, np.int8), "kvalues_mxfp4": (16, np.int8)}


def find_ggml(arg: str | None) -> pathlib.Path:
    if arg:
        return pathlib.Path(arg)
    hits = glob.glob("/tmp/sdcpp*/**/vendor/stable-diffusion.cpp/ggml", recursive=True)
    if hits:
        return pathlib.Path(hits[0])
    for tgz in glob.glob("/tmp/sdcpp*/stable_diffusion_cpp_python-*.tar.gz"):
        with tarfile.open(tgz) as tf:
            tf.extractall(os.path.dirname(tgz), filter="data")
        return find_ggml(None)
    sys.exit("ggml source not found: pip download --no-deps --no-binary :all: stable-diffusion-cpp-python "
             "-d /tmp/sdcpp, or pass --ggml")


def build(ggml: pathlib.Path, tmp: pathlib.Path) -> ctypes.CDLL:
    (tmp / "shim.c").write_text(SHIM)
    so = tmp / "libggmlq.so"
    inc = [f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{ggml / 'src' / 'ggml-cpu'}"]
    cmd = ["gcc", "-O2", "-DNDEBUG", "-ffp-contract=off", "-fPIC", "-shared", *inc,
           str(ggml / "src" / "ggml-quants.c"), str(tmp / "shim.c"), "-lm", "-o", str(so)]
    print(" ".join(cmd))
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(so))


def c_fn(lib, name):
    f = getattr(lib, name)
    f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return f


def quant_inputs(ne0: int = 512) -> np.ndarray:
    """Rows that exercise the corner cases of the scale searches."""
    rng = np.random.default_rng(20240531)
    rows = [
        rng.standard_normal(ne0),                                   # plain gaussian
        np.zeros(ne0),                                              # all zeros
        rng.standard_normal(ne0) * 1e-12,                           # tiny (above GROUP_MAX_EPS)
        rng.standard_normal(ne0) * 1e-17,                           # below GROUP_MAX_EPS
        rng.standard_normal(ne0) * 1e15,                            # huge (fp16 scales overflow)
        rng.uniform(-1, 1, ne0),
        np.abs(rng.standard_normal(ne0)),                           # all positive
        -np.abs(rng.standard_normal(ne0)) * 100,                    # all negative
        rng.standard_t(2, ne0),                                     # heavy tails
        rng.integers(-4, 5, ne0).astype(np.float64),                # exact ties for rounding
        rng.standard_normal(ne0) * 0.01 + (rng.random(ne0) < 0.02) * 5.0,  # outliers
        np.full(ne0, 0.5),                                          # constant (max == min)
        rng.standard_normal(ne0) * np.repeat(10.0 ** rng.uniform(-3, 3, ne0 // 16), 16),  # mixed sub-block scales
        rng.standard_normal(ne0) * (rng.random(ne0) < 0.05),        # sparse
        rng.standard_normal(ne0) * 0.02,                            # weight-like
        np.where(np.arange(ne0) % 32 < 16, 0.0, rng.standard_normal(ne0)),  # half-zero sub-blocks
        rng.standard_normal(ne0) + 3.0,                             # offset (positive min)
        np.linspace(-1, 1, ne0),                                    # ramp
    ]
    return np.stack(rows).astype(np.float32)


def pxi_tables() -> dict[str, np.ndarray]:
    text = (ROOT / "sdrt" / "ops" / "quant" / "_iq_tables.pxi").read_text()
    out = {}
    for m in re.finditer(r"static const \w+ sdrt_(\w+)\[(\d+)\] = \{(.*?)\};", text, re.DOTALL):
        name, body = m.group(1), m.group(3)
        vals = [int(v.rstrip("uUlL"), 0) for v in re.findall(r"-?0x[0-9a-fA-F]+[uUlL]*|-?\d+", body)]
        out[name] = np.array(vals, dtype=np.int64 if name.startswith("kvalues") else np.uint64)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ggml", help="path to the ggml directory (with include/ and src/)")
    args = ap.parse_args()
    ggml = find_ggml(args.ggml)
    from sdrt.ops import dtypes, quant

    with tempfile.TemporaryDirectory() as td:
        lib = build(ggml, pathlib.Path(td))

        # 1. the IQ tables of the .pxi are ggml's
        lib.shim_table.restype = ctypes.c_void_p
        lib.shim_table.argtypes = [ctypes.c_int]
        mine = pxi_tables()
        for i, name in enumerate(TABLES):
            n, t = TABLE_SHAPES[name]
            ref = np.ctypeslib.as_array((ctypes.c_uint8 * (n * np.dtype(t).itemsize)).from_address(lib.shim_table(i)))
            ref = ref.view(t).astype(np.int64 if t == np.int8 else np.uint64)
            assert np.array_equal(ref, mine[name]), f"_iq_tables.pxi: {name} differs from ggml-common.h"
        print("IQ tables: identical to ggml-common.h")

        # 2. quantize goldens
        x = quant_inputs()
        qg = {"x": x}
        for name in QUANT_TYPES:
            dt = dtypes.get(name)
            out = np.zeros((x.shape[0], x.shape[1] // dt.block_size * dt.type_size), np.uint8)
            f = c_fn(lib, f"quantize_row_{name.lower().replace('_k', '_K')}_ref")
            for r in range(x.shape[0]):  # row by row: Q8_K leaves bsums untouched on zero blocks
                f(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
            qg[name] = out
        # 3. dequantize goldens: random valid blocks of every type
        dg = {}
        for name in DEQUANT_TYPES:
            dt = dtypes.get(name)
            raw = np.ascontiguousarray(quant.random_raw(dt, 2, 512, seed=7))
            out = np.empty((2, 512), np.float32)
            f = c_fn(lib, f"dequantize_row_{name.lower().replace('_k', '_K')}")
            f(raw.ctypes.data, out.ctypes.data, raw.shape[0] * 512)
            dg[name + "_raw"] = raw
            dg[name] = out

    FIX.mkdir(parents=True, exist_ok=True)
    prov = np.array(f"ggml-quants.c from {ggml} (stable-diffusion-cpp-python sdist), gcc -O2 -DNDEBUG "
                    "-ffp-contract=off; made by tools/make_quant_goldens.py")
    np.savez_compressed(FIX / "quant_ggml_quantize.npz", provenance=prov, **qg)
    np.savez_compressed(FIX / "quant_ggml_dequantize.npz", provenance=prov, **dg)
    for f in ("quant_ggml_quantize.npz", "quant_ggml_dequantize.npz"):
        print(f"wrote {FIX / f} ({(FIX / f).stat().st_size // 1024} KB)")

    # 4. how does the current build compare?
    for name in QUANT_TYPES:
        ok = np.array_equal(quant.quantize(x, name), qg[name])
        print(f"quantize   {name:8s} {'bit-exact' if ok else 'DIFFERS'}")
    for name in DEQUANT_TYPES:
        ok = np.array_equal(quant.dequantize(dg[name + '_raw'], name), dg[name])
        print(f"dequantize {name:8s} {'bit-exact' if ok else 'DIFFERS'}")


if __name__ == "__main__":
    main()
