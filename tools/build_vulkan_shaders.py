"""Compile sdrt/gpu/vulkan/shaders/<family>.comp to SPIR-V (<family>.spv, shipped in the package)
and write manifest.json ({family: source SHA-256}, and the compiler's version line).

    python tools/build_vulkan_shaders.py            # every family
    python tools/build_vulkan_shaders.py --check    # exit 1 if a .spv is stale (no writes)

Needs glslangValidator (Debian: glslang-tools); glslc works too (--compiler glslc).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sdrt.gpu.vulkan.shaders import HERE, families, source_digest  # noqa: E402

MANIFEST = os.path.join(HERE, "manifest.json")


def compiler_cmd(compiler: str, src: str, out: str) -> list[str]:
    if os.path.basename(compiler).startswith("glslc"):
        return [compiler, "--target-env=vulkan1.1", "-O", src, "-o", out]
    return [compiler, "-V", "--target-env", "vulkan1.1", src, "-o", out]


def compiler_version(compiler: str) -> str:
    r = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return (r.stdout or r.stderr).splitlines()[0].strip()


def compile_family(compiler: str, family: str) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, f"{family}.spv")
        r = subprocess.run(compiler_cmd(compiler, os.path.join(HERE, f"{family}.comp"), out),
                           capture_output=True, text=True, cwd=HERE)
        if r.returncode != 0:
            raise SystemExit(f"{family}.comp failed to compile:\n{r.stdout}{r.stderr}")
        with open(out, "rb") as f:
            return f.read()


def find_compiler(name: str | None) -> str:
    for c in ([name] if name else ["glslangValidator", "glslc"]):
        path = shutil.which(c)
        if path:
            return path
    raise SystemExit("no GLSL compiler: apt-get install glslang-tools (or glslc)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help="families to build (default: all)")
    ap.add_argument("--check", action="store_true", help="only report stale .spv files")
    ap.add_argument("--compiler", help="glslangValidator or glslc (default: the first found)")
    a = ap.parse_args(argv)
    compiler = find_compiler(a.compiler)
    manifest = {"compiler": compiler_version(compiler), "sources": {}}
    if os.path.exists(MANIFEST):
        with open(MANIFEST) as f:
            manifest["sources"] = json.load(f).get("sources", {})
    stale = []
    for fam in a.families or families():
        spv = compile_family(compiler, fam)
        path = os.path.join(HERE, f"{fam}.spv")
        have = open(path, "rb").read() if os.path.exists(path) else b""
        if have != spv or manifest["sources"].get(fam) != source_digest(fam):
            stale.append(fam)
            if not a.check:
                with open(path, "wb") as f:
                    f.write(spv)
        manifest["sources"][fam] = source_digest(fam)
        print(f"{fam}: {len(spv)} bytes{' (changed)' if fam in stale else ''}")
    if a.check:
        return 1 if stale else 0
    manifest["sources"] = {k: manifest["sources"][k] for k in sorted(manifest["sources"]) if k in families()}
    with open(MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
