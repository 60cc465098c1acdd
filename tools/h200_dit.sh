#!/usr/bin/env bash
# Attention and the diffusion-transformer step on a lent GPU, one device command (~8 min):
# eval "$(bash tools/device_setup.sh)" is done here; carry .whl.
#   bash tools/h200_dit.sh                 # attention tests + bench, Flux 4+8-block kernel profile vs
#                                          # diffusers, then the GPU tests ($TESTS, default the suite)
#   PARTS="attn flux" bash tools/h200_dit.sh   # a subset of: attn, flux, fluxfull, dit, tests
#   PARTS=dit bash tools/h200_dit.sh          # the full-size DiT step of every family (~8 min)
# fluxfull: bench_cuda_flux.py on full-size random Flux.1-dev (bf16, written here, ~4 min) against
# diffusers eager and torch.compile ($FLUX_ENGINES, $FLUX_STEPS timed steps).
# dit: bench_cuda_dit.py, full-size random bf16 Z-Image-Turbo, SD3.5 Large, Qwen-Image (41 GB) and
# Flux.1-dev at 1024x1024, sdrt vs diffusers eager and torch.compile on the same weights, each family's
# file written once in /tmp/dit and deleted after it; $DIT_FAMILIES, $DIT_COMPILE (families with a
# compile run: Flux's, 0.134 s/step, was measured in the fifth session), $DIT_STEPS, $DIT_BUDGET (s).
# Logs go to $OUT (the device tool's folder), else ./h200_out:
# bench.log and tests.log.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/h200_out}; mkdir -p "$OUT"
PARTS=${PARTS:-"attn flux tests"}
has() { [[ " $PARTS " == *" $1 "* ]]; }
eval "$(bash tools/device_setup.sh)" || exit 1
{
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if has attn; then
    timeout 150 python3 -m pytest -q --gpu tests/gpu/test_cuda_ops_attention.py -p no:cacheprovider 2>&1 | tail -6
    timeout 150 python3 bench/bench_cuda_attention.py --repeat 20 2>&1
fi
if has flux; then
    python3 tools/make_flux_checkpoint.py --depth 4 --single-depth 8 --jobs 16 -o /tmp/flux12.safetensors >/dev/null 2>&1
    timeout 200 python3 bench/profile_cuda_kernels.py --arch flux --ckpt /tmp/flux12.safetensors --torch --rows 30 2>&1 \
        | grep -v "^\s*$" | tail -75 | cut -c1-200
fi
if has fluxfull; then
    timeout ${FLUX_TIMEOUT:-400} python3 bench/bench_cuda_flux.py --dir /tmp/flux --jobs 16 \
        --engines ${FLUX_ENGINES:-sdrt,torch,compile} --steps ${FLUX_STEPS:-20} 2>&1 | tail -30
fi
if has dit; then
    timeout $(( ${DIT_BUDGET:-510} + 40 )) python3 bench/bench_cuda_dit.py --dir /tmp/dit --steps ${DIT_STEPS:-10} \
        --family ${DIT_FAMILIES:-zimage,sd35l,qwen,flux} --compile-for ${DIT_COMPILE:-zimage,sd35l,qwen} \
        --budget ${DIT_BUDGET:-510} --child-timeout 200 --json "$OUT/dit.json" 2>&1 | cut -c1-700 | tail -45
    rm -rf /tmp/dit
fi
} 2>&1 | tee "$OUT/bench.log"
if has tests; then
    T=${TESTS:-"tests/gpu tests/test_backend_ops.py tests/test_residency.py"}
    timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q --gpu $T -p no:cacheprovider 2>&1 | tail -25 > "$OUT/tests.log"
    tail -3 "$OUT/tests.log"
fi
