#!/usr/bin/env bash
# The issue-6 validation on a lent GPU machine, in one device command (about 6-9 minutes):
#   eval "$(bash tools/device_setup.sh)" is done here; carry .whl (tools/device_setup.sh prepare).
#
#   bash tools/h200_validation.sh                 # everything below but sd-cli
#   SDCLI_SRC=.whl/sdcpp/sdcpp_src.tar.xz bash tools/h200_validation.sh   # + sd-cli, same run
#   TESTS=tests bash tools/h200_validation.sh     # the whole GPU suite (about 2 minutes)
#
# 1. sd-cli CUDA (bench/build_sdcli_cuda.sh) builds in the background when SDCLI_SRC names the
#    trimmed source tarball (vendor/stable-diffusion.cpp of the PyPI sdist 0.4.7, tar.xz);
# 2. random full-size SD1.5 and SDXL checkpoints (tools/make_sd_checkpoint.py, the CPU references'
#    bytes) and the GPU tests of $TESTS (`pytest --gpu`: only tests marked gpu, an error without a
#    device; default tests/gpu/test_cuda_fuse.py tests/test_residency.py);
# 3. SDXL 1024x1024, 4 steps: resident, --offload-to-cpu --max-vram 3 and --params-backend disk
#    --max-vram 3, their PSNR against the resident image, the residency log lines;
# 4. the CLI images to compare with the same commands on the CPU (sd15_gpu.png, sdxl_gpu.png);
# 5. once sd-cli is built (or at once without it): bench/bench_cuda_sd.py for SDXL and SD1.5 against
#    PyTorch [and sd-cli], then bench/bench_cuda_elementwise.py while time is left.
# Logs and images go to $OUT (the device tool's folder), else ./h200_out.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/h200_out}; mkdir -p "$OUT"
TESTS=${TESTS:-"tests/gpu/test_cuda_fuse.py tests/test_residency.py"}
eval "$(bash tools/device_setup.sh)" || exit 1
python3 -c "import diffusers" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site .whl/peer/*.whl
t0=$SECONDS
if [ -n "$SDCLI_SRC" ]; then
  setsid nohup bash -c "bash bench/build_sdcli_cuda.sh $SDCLI_SRC /tmp/sdcli > /tmp/sdcli_build.out 2>&1; \
      echo \$? > /tmp/sdcli.done" > /dev/null 2>&1 &
fi
{
python3 tools/make_sd_checkpoint.py --arch sd15 -o /tmp/sd15_rand_f16.safetensors | tail -1 &
python3 tools/make_sd_checkpoint.py --arch sdxl -o /tmp/sdxl_rand_f16.safetensors | tail -1 &
python3 -m pytest -q --gpu $TESTS -p no:cacheprovider 2>&1 | tail -3
echo "tests: $((SECONDS - t0)) s"
wait
} 2>&1 | tee "$OUT/main.log"
XL="-m /tmp/sdxl_rand_f16.safetensors -p a_photo_of_a_cat -W 1024 -H 1024 --steps 4 -s 42 --sampling-method euler --backend cuda0"
{
python3 -m sdrt $XL -o /tmp/xl_res.png 2>&1 | grep -E "sampling|generate_image|rror"
for flags in "--offload-to-cpu --max-vram 3" "--params-backend disk --max-vram 3"; do
  echo "--- $flags"
  python3 -m sdrt $XL $flags -o "/tmp/xl_${flags%% *}.png" 2>&1 | grep -E "residency|sampling|generate_image|rror" | cut -c1-420
done
python3 - <<'PY'
import numpy as np
from PIL import Image
def load(k):
    try:
        return np.asarray(Image.open(f"/tmp/xl_{k}.png"), np.float64)
    except OSError as e:
        print(e)
def psnr(x, y):
    if x is None or y is None:
        return float("nan")
    m = ((x - y) ** 2).mean()
    return float("inf") if m == 0 else 10 * np.log10(255 ** 2 / m)
a = load("res")
print(f"PSNR resident vs --offload-to-cpu {psnr(a, load('--offload-to-cpu')):.2f} dB, "
      f"vs --params-backend disk {psnr(a, load('--params-backend')):.2f} dB")
PY
echo "offload: $((SECONDS - t0)) s"
} 2>&1 | tee "$OUT/offload.log" | grep -vE "segment weights"
{
python3 -m sdrt -m /tmp/sd15_rand_f16.safetensors -p "a photo of a cat" -W 512 -H 512 --steps 4 -s 42 \
    --sampling-method euler --backend cuda0 -o "$OUT/sd15_gpu.png" 2>&1 | grep -E "generate_image c|rror"
python3 -m sdrt -m /tmp/sdxl_rand_f16.safetensors -p "a photo of a cat" -W 512 -H 512 --steps 3 -s 42 \
    --sampling-method euler --backend cuda0 -o "$OUT/sdxl_gpu.png" 2>&1 | grep -E "generate_image c|rror"
echo "images: $((SECONDS - t0)) s"
} 2>&1 | tee -a "$OUT/main.log"
E=sdrt,torch
if [ -n "$SDCLI_SRC" ]; then
  while [ ! -e /tmp/sdcli.done ] && [ $((SECONDS - t0)) -lt 390 ]; do sleep 3; done
  echo "sd-cli build: $(cat /tmp/sdcli.done 2>/dev/null || echo unfinished) at $((SECONDS - t0)) s"
  [ "$(cat /tmp/sdcli.done 2>/dev/null)" = 0 ] && E=sdrt,torch,sdcli
fi
for arch in sdxl sd15; do
  python3 bench/bench_cuda_sd.py --arch $arch --engines $E --sdcli /tmp/sdcli/sd-cli 2>&1 | tail -7 \
      | tee "$OUT/bench_$arch.log"
  echo "$arch bench: $((SECONDS - t0)) s"
done
if [ $((SECONDS - t0)) -lt 540 ]; then
  timeout $((585 - SECONDS + t0)) python3 bench/bench_cuda_elementwise.py 2>&1 | tee "$OUT/elementwise.log"
fi
echo "total: $((SECONDS - t0)) s"
