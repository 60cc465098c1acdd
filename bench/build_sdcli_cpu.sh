#!/usr/bin/env bash
# Build stable-diffusion.cpp's sd-cli for the CPU (f32-capable; the test oracle of
# tests/test_image_regression.py, tests/test_io_writer.py and tests/test_flux_sdcli.py) from the
# vendored source of the PyPI sdist stable-diffusion-cpp-python 0.4.7, outside the repo.
#   bench/build_sdcli_cpu.sh SDIST_TAR_GZ SRC_DIR BUILD_DIR OUT_DIR [JOBS]
#   (or SDIST_TAR_GZ = a tar.xz of the sdist's vendor/stable-diffusion.cpp, as the device runs carry)
#   (SDIST_TAR_GZ: `pip download --no-deps --no-binary :all: stable-diffusion-cpp-python==0.4.7`;
#    sha256 998d1957260dd5ae4e18a8acc0c14b0a8757aaa9f96515197b6d5bbf46df9282)
#
# One patch, in the extracted copy only (SRC_DIR), never in this repo: the sdist's T5 encoder is
# fixed at 24 blocks (T5Params::num_layers = 24), so a reduced-depth T5-XXL checkpoint fails to load
# ("tensor not found" for encoder.block.N). Upstream stable-diffusion.cpp later counts the
# `encoder.block.N` tensors of the checkpoint (T5Config::detect_from_weights, commit 3590aa8d,
# "feat: add MiniT2I support (#1683)"). The patch below does the same for the block count only
# (widths stay T5-XXL's 4096 / 10240 / 64 heads, as in the sdist): with the 24 blocks of a real
# t5xxl file nothing changes. Without the patch a Flux reference needs the full 24-block T5-XXL
# (~18 GB in f32).
# A second patch (bench/patch_sdcli_zimage.py, same idea): the sdist's Z-Image DiT is fixed at
# 30 + 2 layers of width 3840; the patch reads layers, width, heads and caption width from the
# weights (tests/test_zimage_sdcli.py's reduced checkpoint). Released Z-Image files: unchanged.
set -euo pipefail
sdist=$1; src=$2; build=$3; out=$4; jobs=${5:-2}
mkdir -p "$src" "$build" "$out"
case "$sdist" in   # the sdist, or its vendor/stable-diffusion.cpp as .whl/sdcpp/sdcpp_src.tar.xz
  *.tar.xz) tar -xJf "$sdist" -C "$src" ;;
  *) tar -xzf "$sdist" -C "$src" ;;
esac
sd=$(find "$src" -maxdepth 3 -type d -name stable-diffusion.cpp | head -1)
t5="$sd/src/t5.hpp"
if ! grep -q "sdrt-patch: T5 depth from weights" "$t5"; then
  python3 - "$t5" <<'EOF'
import sys
p = sys.argv[1]
s = open(p, newline="").read()        # the sdist's sources have CRLF line ends: keep them
eol = "\r\n" if "\r\n" in s else "\n"
anchor = """        model = T5(params);
        model.init(params_ctx, tensor_storage_map, prefix);"""
assert s.count(anchor.replace("\n", eol)) == 1, "t5.hpp: T5Runner constructor not where the 0.4.7 sdist has it"
patched = """        // sdrt-patch: T5 depth from weights (as upstream's T5Config::detect_from_weights):
        // one block per distinct `<prefix>.encoder.block.N`, so reduced-depth checkpoints load.
        {
            std::string block_prefix = prefix + ".encoder.block.";
            int64_t detected        = 0;
            for (const auto& [name, _] : tensor_storage_map) {
                if (!starts_with(name, block_prefix)) {
                    continue;
                }
                size_t pos = block_prefix.size();
                size_t dot = name.find('.', pos);
                if (dot == std::string::npos) {
                    continue;
                }
                detected = std::max<int64_t>(detected, atoi(name.substr(pos, dot - pos).c_str()) + 1);
            }
            if (detected > 0) {
                params.num_layers = detected;
            }
        }
""" + anchor
s = s.replace(anchor.replace("\n", eol), patched.replace("\n", eol))
open(p, "w", newline="").write(s)
print("patched", p)
EOF
fi
python3 "$(dirname "$0")/patch_sdcli_zimage.py" "$sd/src/z_image.hpp"
cmake -S "$sd" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSD_BUILD_EXAMPLES=ON -DSD_WEBP=OFF -DSD_WEBM=OFF \
      -DBUILD_SHARED_LIBS=OFF -DSD_BUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON > "$build/cmake.log" 2>&1
( time nice -n 10 cmake --build "$build" -j"$jobs" --target sd-cli ) > "$build/build.log" 2>&1
cp "$build/bin/sd-cli" "$out/sd-cli"
ls -la "$out/sd-cli"
