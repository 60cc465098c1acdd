#!/usr/bin/env bash
# Build stable-diffusion.cpp's sd-cli with CUDA (the peer of bench/bench_cuda_sd.py) from the
# vendored source of the PyPI sdist stable-diffusion-cpp-python 0.4.7, on the GPU machine.
#   bench/build_sdcli_cuda.sh SRC_TARBALL_OR_DIR OUT_DIR
# The tarball is vendor/stable-diffusion.cpp of the sdist (tar.xz, without build/, ggml/examples,
# ggml/tests). sd-cli is linked statically against ggml so the binary travels alone.
set -euo pipefail
src=$1; out=$2
mkdir -p "$out"
if [ -f "$src" ]; then mkdir -p /tmp/sdcpp && tar -xJf "$src" -C /tmp/sdcpp && src=/tmp/sdcpp/stable-diffusion.cpp; fi
cmake -S "$src" -B /tmp/sdcpp_build -DCMAKE_BUILD_TYPE=Release -DSD_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF -DSD_BUILD_SHARED_LIBS=OFF > "$out/sdcli_cmake.log" 2>&1
cmake --build /tmp/sdcpp_build -j"$(nproc)" --target sd-cli > "$out/sdcli_build.log" 2>&1
cp "$(find /tmp/sdcpp_build -name sd-cli -type f -perm -u+x | head -1)" "$out/sd-cli"
strip "$out/sd-cli" || true
ls -la "$out/sd-cli"
