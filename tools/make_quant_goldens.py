"""Produce the ggml reference goldens for tests/test_quant.py (tests/fixtures/quant_ggml_*.npz).

ggml's own C code is the reference: this script compiles ggml.c, ggml-quants.c and
ggml-threading.cpp from the stable-diffusion-cpp-python sdist (vendor/stable-diffusion.cpp/ggml)
into a throw-away shared library in a temp dir, with a tiny shim (the IQ tables, stubs for the
two ggml-backend calls ggml.c links against), and calls `quantize_row_*_ref` / `dequantize_row_*`
and `ggml_quantize_chunk` (with an importance vector: all ones, as stable-diffusion.cpp's
convert passes, and a random positive one) through ctypes. No ggml code is copied into the repo;
only the inputs and the bytes/floats ggml produced are saved.

    pip download --no-deps --no-binary :all: stable-diffusion-cpp-python -d /tmp/sdcpp
    python tools/make_quant_goldens.py [--ggml /path/to/ggml]   # default: found under /tmp/sdcpp
    python tools/make_quant_goldens.py --check-only --rows 3000  # compare more data, write nothing

It also checks that sdrt/ops/quant/_iq_tables.pxi (generated from the gguf package by
tools/make_iq_tables.py) holds exactly ggml-common.h's tables, and reports whether sdrt's
current build already matches every golden.

Compiled like ggml's release builds for these functions (ggml-base: -O3 -DNDEBUG, no -march, so
no FMA): -O2 -DNDEBUG -ffp-contract=off.
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
# what ggml_quantize_chunk accepts (of sdrt's quantizers); of these, Q8_0 TQ1_0 TQ2_0 MXFP4 ignore the imatrix
CHUNK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0",
               "MXFP4"]
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
/* ggml.c's only references outside ggml-base's C files (never reached by quantization) */
struct ggml_tensor;
void ggml_backend_tensor_memset(struct ggml_tensor * t, uint8_t v, size_t off, size_t n) { (void)t; (void)v; (void)off; (void)n; abort(); }
void ggml_backend_tensor_set(struct ggml_tensor * t, const void * d, size_t off, size_t n) { (void)t; (void)d; (void)off; (void)n; abort(); }
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
    flags = ["-O2", "-DNDEBUG", "-ffp-contract=off", "-fPIC", "-D_GNU_SOURCE", '-DGGML_VERSION="golden"',
             '-DGGML_COMMIT="golden"', *inc]
    objs = []
    for src, cc in ((ggml / "src" / "ggml.c", "gcc"), (ggml / "src" / "ggml-quants.c", "gcc"),
                    (ggml / "src" / "ggml-threading.cpp", "g++"), (tmp / "shim.c", "gcc")):
        obj = tmp / (src.stem + ".o")
        cmd = [cc, *flags, "-c", str(src), "-o", str(obj)]
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)
        objs.append(str(obj))
    subprocess.run(["g++", "-shared", *objs, "-lm", "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def quantize_chunk(lib, name: str, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """ggml_quantize_chunk(type, x, y, 0, nrows, ne0, imatrix) -> uint8 [nrows, row_bytes]."""
    from sdrt.ops import dtypes
    dt = dtypes.get(name)
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // dt.block_size * dt.type_size), np.uint8)
    im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    n = lib.ggml_quantize_chunk(dt.id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                               None if im is None else im.ctypes.data)
    assert n == out.size, (name, n, out.size)
    return out


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


def imatrix_for(ne0: int, seed: int = 7) -> np.ndarray:
    """A random positive importance vector spanning ~2.6 decades (as real imatrices do)."""
    return np.exp(np.random.default_rng(seed).uniform(-3.0, 3.0, ne0)).astype(np.float32)


def check_rows(n: int, ne0: int = 1024) -> np.ndarray:
    """n extra rows of six distributions (for --check-only; not kept as fixtures)."""
    rng = np.random.default_rng(n)
    k = n // 6 + 1
    parts = [rng.standard_normal((k, ne0)), rng.standard_normal((k, ne0)) * 0.02,
             rng.standard_t(2, (k, ne0)), rng.uniform(-1, 1, (k, ne0)) + rng.uniform(-1, 1, (k, 1)),
             rng.standard_normal((k, ne0)) * np.repeat(10.0 ** rng.uniform(-3, 3, (k, ne0 // 16)), 16, axis=1),
             rng.standard_normal((k, ne0)) * (rng.random((k, ne0)) < 0.1)]
    return np.concatenate(parts)[:n].astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ggml", help="path to the ggml directory (with include/ and src/)")
    ap.add_argument("--check-only", action="store_true", help="compare sdrt with ggml on more data; write nothing")
    ap.add_argument("--rows", type=int, default=600, help="rows for --check-only (of 1024 values)")
    args = ap.parse_args()
    ggml = find_ggml(args.ggml)
    from sdrt.ops import dtypes, quant

    with tempfile.TemporaryDirectory() as td:
        lib = build(ggml, pathlib.Path(td))

        if args.check_only:
            xc = check_rows(args.rows)
            for im_name, im in (("ref", None), ("ones", np.ones(xc.shape[1], np.float32)),
                                ("imat", imatrix_for(xc.shape[1], seed=args.rows)),
                                ("imat0", imatrix_for(xc.shape[1], seed=1) * (np.arange(xc.shape[1]) % 5 != 0))):
                for name in CHUNK_TYPES:
                    ref = quantize_chunk(lib, name, xc, im)
                    ours = quant.quantize(xc, name, im)
                    bad = int((ref != ours).any(axis=1).sum())
                    print(f"{im_name:5s} {name:6s} {'bit-exact' if not bad else f'{bad} of {len(xc)} rows DIFFER'}")
            return

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

        # 2. quantize goldens: the reference quantizers
        x = quant_inputs()
        qg = {"x": x}
        for name in QUANT_TYPES:
            dt = dtypes.get(name)
            out = np.zeros((x.shape[0], x.shape[1] // dt.block_size * dt.type_size), np.uint8)
            f = c_fn(lib, f"quantize_row_{name.lower().replace('_k', '_K')}_ref")
            for r in range(x.shape[0]):  # row by row: Q8_K leaves bsums untouched on zero blocks
                f(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
            qg[name] = out
        # 3. ... and ggml_quantize_chunk with an importance vector: ones (stable-diffusion.cpp's
        # convert), a random positive one; rows of 512 and (the same values) of 1024, since
        # Q4_0/Q4_1/Q5_0/Q5_1 weigh by the whole row's mean square
        imat = imatrix_for(1024)
        wg = {"x": x, "imat": imat}
        x1024 = x.reshape(-1, 1024)
        for name in CHUNK_TYPES:
            wg[name + "@ones"] = quantize_chunk(lib, name, x, np.ones(512, np.float32))
            wg[name + "@imat"] = quantize_chunk(lib, name, x, imat[:512])
            wg[name + "@ones_1024"] = quantize_chunk(lib, name, x1024, np.ones(1024, np.float32))
            wg[name + "@imat_1024"] = quantize_chunk(lib, name, x1024, imat)
            assert np.array_equal(quantize_chunk(lib, name, x, None), qg[name]), name  # NULL imatrix = _ref
        # 4. dequantize goldens: random valid blocks of every type
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
    prov = np.array(f"ggml.c + ggml-quants.c from {ggml} (stable-diffusion-cpp-python sdist), gcc -O2 -DNDEBUG "
                    "-ffp-contract=off; made by tools/make_quant_goldens.py")
    files = {"quant_ggml_quantize.npz": qg, "quant_ggml_quantize_imatrix.npz": wg, "quant_ggml_dequantize.npz": dg}
    for f, d in files.items():
        np.savez_compressed(FIX / f, provenance=prov, **d)
        print(f"wrote {FIX / f} ({(FIX / f).stat().st_size // 1024} KB)")

    # 5. how does the current build compare?
    for name in QUANT_TYPES:
        ok = np.array_equal(quant.quantize(x, name), qg[name])
        print(f"quantize            {name:8s} {'bit-exact' if ok else 'DIFFERS'}")
    for name in CHUNK_TYPES:
        for key, xx, im in (("ones", x, 1.0), ("imat", x, imat[:512]), ("ones_1024", x1024, 1.0),
                            ("imat_1024", x1024, imat)):
            ok = np.array_equal(quant.quantize(xx, name, im), wg[f"{name}@{key}"])
            print(f"quantize imatrix={key:9s} {name:8s} {'bit-exact' if ok else 'DIFFERS'}")
    for name in DEQUANT_TYPES:
        ok = np.array_equal(quant.dequantize(dg[name + '_raw'], name), dg[name])
        print(f"dequantize          {name:8s} {'bit-exact' if ok else 'DIFFERS'}")


if __name__ == "__main__":
    main()
