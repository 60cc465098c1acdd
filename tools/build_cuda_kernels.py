#!/usr/bin/env python3
"""Compile sdrt's CUDA kernel sources to the fatbins shipped in the package.

    python tools/build_cuda_kernels.py                     # every family, all archs (what we ship)
    python tools/build_cuda_kernels.py --arch sm_90 norm   # one family, one arch (development)
    python tools/build_cuda_kernels.py --check             # exit 1 when a fatbin is missing or stale

Each `sdrt/gpu/cuda/kernels/<family>.cu` becomes `<family>.fatbin` holding SASS for sm_80,
sm_86, sm_89 and sm_90 plus compute_90 PTX (newer GPUs JIT it), built with -O3 -std=c++17;
a family of driver.FAMILY_ARCHS ships its own list instead (attention_sm90: sm_90a SASS only).
`manifest.json` records per family the sha256 of the source and of the local headers it
includes, the archs built and the nvcc version. `--check` (run by tests/test_cuda_build.py in CI)
and the runtime (sdrt.gpu.cuda.driver.load_module) compare it with the sources, so a .cu edited
without a full rebuild fails CI, and on a machine with nvcc is rebuilt for the local GPU.
Families build one after another; `-j N` builds N at once.

The element-wise op lists are the op registry's: a build first writes kernels/elementwise_ops.cuh
from OPS (sdrt.gpu.cuda.naming.ops_header), and `--check` also fails when that header is stale
or when a shipped fatbin lacks the kernel of a registered (op, dtypes) (naming.missing_symbols,
read from the fatbins' bytes: no nvcc, no GPU).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sdrt.gpu.cuda.driver import (FAMILY_ARCHS, KERNELS_DIR, MANIFEST, CudaDriverError,  # noqa: E402
                                  compile_fatbin, family_archs, find_nvcc, read_manifest,
                                  source_digest)
from sdrt.gpu.cuda.naming import OPS_HEADER, missing_symbols, ops_header  # noqa: E402


def families(names=None) -> list[Path]:
    sources = sorted(KERNELS_DIR.glob("*.cu"))
    if not names:
        return sources
    by_name = {p.stem: p for p in sources}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        sys.exit(f"unknown kernel families {unknown}; have: {', '.join(sorted(by_name))}")
    return [by_name[n] for n in names]


def update_manifest(family: str, entry: dict) -> None:
    """Record one family's build; the lock keeps parallel builds of other families intact."""
    with open(KERNELS_DIR / ".manifest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = {p.stem for p in families()}
        man = {k: v for k, v in read_manifest().items() if k in known}
        man[family] = entry
        tmp = MANIFEST.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(sorted(man.items())), indent=1, sort_keys=True) + "\n")
        tmp.replace(MANIFEST)


def stale_reasons(names=None) -> list[str]:
    """What is missing or out of date, one line per family (empty when ready to ship)."""
    man, problems = read_manifest(), []
    for cu in families(names):
        entry, fat = man.get(cu.stem), cu.with_suffix(".fatbin")
        if not fat.exists():
            problems.append(f"{cu.stem}: {fat.name} is missing")
        elif entry is None:
            problems.append(f"{cu.stem}: not in {MANIFEST.name}")
        elif entry.get("sha256") != source_digest(cu):
            problems.append(f"{cu.stem}: {cu.name} changed since {fat.name} was built")
        elif (tuple(entry.get("archs", ())), entry.get("ptx")) != family_archs(cu.stem):
            archs, ptx = family_archs(cu.stem)
            problems.append(f"{cu.stem}: built for {entry.get('archs')} only; ship {list(archs)} + {ptx}")
    if not names:
        known = {p.stem for p in families()}
        problems += [f"{k}: in {MANIFEST.name} but {k}.cu is gone" for k in man if k not in known]
    if not OPS_HEADER.exists() or OPS_HEADER.read_text() != ops_header():
        problems.append(f"{OPS_HEADER.name} differs from the op registry (rebuild writes it)")
    elif not problems:
        problems += [f"{m}: kernel missing from the fatbin" for m in missing_symbols()]
    return problems


def build_one(nvcc: str, version: str, cu: Path, archs) -> str:
    """Build one family for every arch it ships (archs None), or for `archs` (development;
    an arch-specific family takes its own name of the arch: sm_90 -> sm_90a)."""
    t0 = time.perf_counter()
    fat = cu.with_suffix(".fatbin")
    own, ptx = family_archs(cu.stem)
    if archs is not None:
        ptx = None
        if cu.stem in FAMILY_ARCHS:
            archs = tuple(a for a in own if a.rstrip("a") in {x.rstrip("a") for x in archs})
            if not archs:
                return f"{cu.stem}: skipped (built for {', '.join(own)} only)"
    else:
        archs = own
    compile_fatbin(nvcc, cu, fat, archs, ptx)
    update_manifest(cu.stem, {"sha256": source_digest(cu), "archs": list(archs), "ptx": ptx, "nvcc": version})
    return f"{cu.stem}: {fat.stat().st_size / 1024:.0f} KiB ({', '.join(archs)}) in {time.perf_counter() - t0:.1f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="kernel families to build (default: all)")
    ap.add_argument("--arch", action="append", help="build only this arch, e.g. sm_90 (repeatable; "
                    "for development: --check fails until every arch is built)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a fatbin is missing or stale")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="families built at once")
    a = ap.parse_args(argv)
    if a.check:
        problems = stale_reasons(a.families)
        for p in problems:
            print(f"stale: {p}")
        if not problems:
            print(f"ok: {len(families(a.families))} CUDA kernel families up to date")
        return 1 if problems else 0
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc not found (set NVCC or put it on PATH)", file=sys.stderr)
        return 2
    if not OPS_HEADER.exists() or OPS_HEADER.read_text() != ops_header():
        OPS_HEADER.write_text(ops_header())
        print(f"wrote {OPS_HEADER.name} from the op registry")
    archs = tuple(a.arch) if a.arch else None
    bad = [x for x in archs or () if not re.fullmatch(r"sm_\d+a?", x)]
    if bad:
        print(f"--arch takes names like sm_90, got {bad}", file=sys.stderr)
        return 2
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    rc = 0
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        futures = [pool.submit(build_one, nvcc, version, cu, archs) for cu in families(a.families)]
        for f in futures:
            try:
                print(f.result(), flush=True)
            except CudaDriverError as e:
                print(e, file=sys.stderr)
                rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
