#!/usr/bin/env bash
# sdrt on the lent GPU machine (no package index there), and the preparation here that feeds it.
#
#   bash tools/device_setup.sh prepare    # HERE (internet, python3.12 via pyenv, nvcc): fill .whl/
#   eval "$(bash tools/device_setup.sh)"  # THERE, first thing in every device command (carry .whl)
#
# prepare:
#   - builds a cp312 pycuda wheel against a generated stub libcuda.so.1 (every cu* symbol of
#     cuda.h, soname libcuda.so.1, returning CUDA_ERROR_NO_DEVICE): configure.py
#     --no-cuda-enable-curand, -g0 (650 KB instead of 5 MB); it links the real driver there.
#   - downloads pycuda's pure-Python needs that the machine's image lacks (pytools, platformdirs,
#     mako, and pytools' siphash24) as cp312 wheels;
#   - builds sdrt's Cython extensions (sdrt/ops/quant/_quants, sdrt/ops/cpu/_bf16) for Python 3.12 into .whl/ext/, with
#     a stamp of its sources: carrying the 0.4 MB .so beats compiling it there (about a minute of
#     single-threaded gcc on every fresh machine).
#   Everything lands in .whl/ (ignored by git through .git/info/exclude); about 1.5 MB in all.
# default (on the device):
#   - pip-installs .whl/*.whl into /tmp/site (--no-index --no-deps);
#   - puts the carried extension in place when its stamp matches the sources, else builds it;
#   - prints the exports to apply (PYTHONPATH); all other output goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C
PY=${PYTHON:-python3}
SITE=${SDRT_DEVICE_SITE:-/tmp/site}
EXT_SRC=(setup.py sdrt/ops/quant/*.pyx sdrt/ops/quant/*.pxi sdrt/ops/quant/*.h sdrt/ops/cpu/_bf16.pyx sdrt/ops/cpu/_bf16*.h)

ext_stamp() { cat "${EXT_SRC[@]}" | sha256sum | cut -c1-64; }

prepare() {
    local py312=${PY312:-}
    if [ -z "$py312" ]; then  # the first Python 3.12 that runs (a pyenv shim may not)
        for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
            if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312=$c; break; fi
        done
    fi
    [ -n "$py312" ] || { echo "device_setup prepare: no Python 3.12 here (set PY312)" >&2; exit 1; }
    local cuda_root=${CUDA_ROOT:-${CUDA_HOME:-}} nvcc c
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    if [ -z "$cuda_root" ]; then  # the toolkit holding cuda.h (nvcc may be a wrapper script)
        for c in "$(dirname "$(readlink -f "$nvcc")")/.." /usr/local/cuda; do
            if [ -e "$c/include/cuda.h" ]; then cuda_root=$(cd "$c" && pwd -P); break; fi
        done
    fi
    [ -e "$cuda_root/include/cuda.h" ] || { echo "device_setup prepare: no CUDA toolkit (set CUDA_ROOT)" >&2; exit 1; }
    local work=/tmp/sdrt-device-prepare
    mkdir -p .whl/ext "$work"
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    [ -x "$work/venv/bin/python" ] || "$py312" -m venv "$work/venv"
    "$work/venv/bin/pip" install -q "numpy>=2.0" setuptools wheel "Cython>=3.0"
    # stub libcuda.so.1
    mkdir -p "$work/stub"
    "$work/venv/bin/python" - "$cuda_root" "$work/stub/stub.c" <<'EOF'
import re, subprocess, sys
src = subprocess.run(["gcc", "-E", f"-I{sys.argv[1]}/include", "-x", "c", "-"], check=True, text=True,
                     capture_output=True, input="#include <cuda.h>\n#include <cudaProfiler.h>\n").stdout
names = sorted(set(re.findall(r"\bCUresult\s+(cu\w+)\s*\(", src)))
open(sys.argv[2], "w").write("".join(f"int {n}(void) {{ return 100; }}\n" for n in names))
EOF
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/stub/libcuda.so.1" "$work/stub/stub.c"
    ln -sf libcuda.so.1 "$work/stub/libcuda.so"
    # pycuda wheel
    (cd "$work" && rm -rf pycuda-* && "$work/venv/bin/pip" download -q --no-deps --no-build-isolation --no-binary=pycuda pycuda -d . \
        && tar xzf pycuda-*.tar.gz && cd "$(ls -d pycuda-*/ | head -1)" \
        && PATH="$cuda_root/bin:$PATH" "$work/venv/bin/python" configure.py --cuda-root="$cuda_root" \
             --no-cuda-enable-curand --cudadrv-lib-dir="$work/stub" > /dev/null \
        && sed -i "s/^CXXFLAGS = \[\]/CXXFLAGS = ['-g0']/" siteconf.py \
        && PATH="$cuda_root/bin:$PATH" "$work/venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$work/wheels" .)
    rm -f .whl/pycuda-*.whl && cp "$work"/wheels/pycuda-*-cp312-*.whl .whl/
    # pure-Python needs missing on the device image, and pytools' compiled siphash24
    rm -f .whl/pytools-*.whl .whl/platformdirs-*.whl .whl/mako-*.whl .whl/siphash24-*.whl
    "$work/venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl pytools platformdirs mako siphash24
    # sdrt's extension for Python 3.12, built in a copy of its sources
    rm -rf "$work/ext" && mkdir -p "$work/ext/sdrt/ops"
    cp setup.py pyproject.toml "$work/ext/" && cp -r sdrt/ops/quant "$work/ext/sdrt/ops/"
    rm -f "$work"/ext/sdrt/ops/quant/*.so "$work"/ext/sdrt/ops/quant/_quants.c
    mkdir -p "$work/ext/sdrt/ops/cpu" && cp sdrt/ops/cpu/_bf16.pyx sdrt/ops/cpu/_bf16*.h "$work/ext/sdrt/ops/cpu/"
    (cd "$work/ext" && "$work/venv/bin/python" setup.py -q build_ext --inplace > "$work/ext.log" 2>&1) \
        || { tail -20 "$work/ext.log" >&2; echo "device_setup prepare: the extension build failed" >&2; exit 1; }
    cp "$work"/ext/sdrt/ops/quant/_quants.cpython-312-*.so "$work"/ext/sdrt/ops/cpu/_bf16.cpython-312-*.so .whl/ext/
    strip --strip-debug .whl/ext/*.so
    ext_stamp > .whl/ext/_quants.stamp
    ls -la .whl .whl/ext >&2
}

setup() {
    local t0=$SECONDS
    ls .whl/*.whl > /dev/null 2>&1 || { echo "device_setup: no .whl/*.whl (run 'bash tools/device_setup.sh prepare' here and carry .whl)" >&2; exit 1; }
    # bytecode compiled at install, as pip does for users (with --no-compile, a profiled CUDA CLI run
    # spent 0.58 s compiling 246 modules from source: the site's are never cached)
    "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >&2
    local tag so
    tag=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    so="sdrt/ops/quant/_quants$tag"
    local so2="sdrt/ops/cpu/_bf16$tag"
    if [ ! -e "$so" ] || [ ! -e "$so2" ]; then
        if [ -e ".whl/ext/_quants$tag" ] && [ -e ".whl/ext/_bf16$tag" ] && [ "$(cat .whl/ext/_quants.stamp 2>/dev/null)" = "$(ext_stamp)" ]; then
            cp ".whl/ext/_quants$tag" "$so"
            cp ".whl/ext/_bf16$tag" "$so2"
        else
            echo "device_setup: building sdrt's Cython extension for $("$PY" -V) (no matching carried build)" >&2
            "$PY" setup.py -q build_ext --inplace > /tmp/sdrt_build_ext.log 2>&1 || { cat /tmp/sdrt_build_ext.log >&2; exit 1; }
        fi
    fi
    echo "device_setup: wheels in $SITE, extension $so ready ($((SECONDS - t0)) s)" >&2
    echo "export PYTHONPATH=$SITE:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "${1:-setup}" in
    prepare) prepare ;;
    setup) setup ;;
    *) echo "usage: $0 [prepare|setup]" >&2; exit 2 ;;
esac
