#!/usr/bin/env bash
# The direct 3x3 conv and run-time LoRA on a lent GPU, one device command (~6 min):
# eval "$(bash tools/device_setup.sh)" is done here; carry .whl.
#   BENCH=conv bash tools/h200_conv.sh    # + bench_cuda_conv (direct vs im2col vs cuDNN per shape)
# bench_esrgan (x4 of 512x512 vs PyTorch), run-time LoRA on cuda0, the ESRGAN kernel profile, the
# SD1.5 VAE decode vs PyTorch, then the GPU tests ($TESTS, default the whole GPU suite). Logs go to
# $OUT (the device tool's folder), else ./h200_out: bench.log and tests.log.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/h200_out}; mkdir -p "$OUT"
eval "$(bash tools/device_setup.sh)" || exit 1
{
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ "$BENCH" != conv ] || python3 bench/bench_cuda_conv.py 2>&1
python3 bench/bench_esrgan.py --runs 3 2>&1
python3 bench/bench_lora.py step --backend cuda0 --repeat 5 2>&1 | tail -1
python3 bench/profile_cuda_kernels.py --arch esrgan 2>&1 | tail -22 | cut -c1-36,100-190
timeout 150 python3 bench/bench_cuda_sd.py --arch sd15 --engines sdrt,torch --steps 5 2>&1 | tail -8
} 2>&1 | tee "$OUT/bench.log"
T=${TESTS:-"tests/gpu tests/test_backend_ops.py tests/test_residency.py"}
timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q --gpu $T -p no:cacheprovider 2>&1 | tail -25 > "$OUT/tests.log"
tail -3 "$OUT/tests.log"
