#!/usr/bin/env bash
# Issue 15 done-means 2 for the Large shape, on the lent GPU machine's host CPU (its 128 GB; this
# machine's 24 GB cannot hold an 8 B-parameter model in f32 twice): tests/test_sd3_sdcli.py with the
# released SD3.5 Large widths at depth 38 (random weights), f32, 256x256, 4 steps, CFG 4, with and
# without skip-layer guidance, sdrt against a CPU sd-cli built there (bench/build_sdcli_cpu.sh from
# the carried .whl/sdcpp/sdcpp_src.tar.xz, T5-depth patch; GGML_NATIVE for that host) on all cores.
#   bash tools/h200_sd3cpu.sh                 # both cases (~12 min: two device commands, see TESTK)
#   TESTK=False bash tools/h200_sd3cpu.sh     # without SLG; the build and the files are made first
#   TESTK=True bash tools/h200_sd3cpu.sh      # with SLG, on the same warm machine (reuses /tmp)
#   CUDA=1 bash tools/h200_sd3cpu.sh          # instead: the same files on cuda0 against this CPU
#                                              # (tests/gpu/test_sd3_pipeline_cuda.py, >= 50 dB; without
#                                              # SLG, TESTK=slg with it); no sd-cli needed
# The sd-cli build and the 16 GB DiT file are made in parallel and kept in /tmp for the next call.
# Logs go to $OUT (the device tool's folder), else ./h200_out: sd3cpu.log, sdcli_build.log.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/h200_out}; mkdir -p "$OUT"
eval "$(bash tools/device_setup.sh)" || exit 1
J=$(nproc)
VARIANT=${SD3_VARIANT:-sd3.5-large}; DEPTH=${SD3_DEPTH:-38}   # SD3_VARIANT=sd3.5-medium SD3_DEPTH=24: Medium's
D=/tmp/sd3l; mkdir -p "$D"
SDCLI=/tmp/sdcli_cpu/sd-cli
t0=$(date +%s)
if [ ! -x "$SDCLI" ] && [ -z "${CUDA:-}" ]; then
    bash bench/build_sdcli_cpu.sh .whl/sdcpp/sdcpp_src.tar.xz /tmp/sdcpp_cpu_src /tmp/sdcpp_cpu_build \
        /tmp/sdcli_cpu "$J" > "$OUT/sdcli_build.log" 2>&1 &
    build=$!
fi
DIT=$D/${VARIANT}_d$DEPTH.safetensors
if [ ! -e "$DIT" ]; then
    python3 tools/make_sd3_checkpoint.py --variant $VARIANT --depth $DEPTH --component transformer --type f16 \
        --jobs $J -o "$DIT.part" > /dev/null && mv "$DIT.part" "$DIT"
fi
echo "DiT file: $(( $(date +%s) - t0 )) s"
if [ -n "${build:-}" ]; then
    wait "$build" || { tail -20 /tmp/sdcpp_cpu_build/build.log; exit 1; }
    echo "sd-cli built: $(( $(date +%s) - t0 )) s"
fi
if [ -n "${CUDA:-}" ]; then
    SDRT_SD3_SHAPED_DIR=$D SDRT_SDCLI_SD3_VARIANT=$VARIANT SDRT_SDCLI_SD3_DEPTH=$DEPTH SDRT_SDCLI_THREADS=$J \
    timeout ${TEST_TIMEOUT:-540} python3 -m pytest -s -q --gpu tests/gpu/test_sd3_pipeline_cuda.py -p no:cacheprovider \
        -k "shaped and (${TESTK:-not slg})" 2>&1 | grep --line-buffered -E "dB|passed|failed|Error|error" | tee "$OUT/sd3cuda.log"
    echo "total: $(( $(date +%s) - t0 )) s"
    exit 0
fi
SDRT_SDCLI=$SDCLI SDRT_SDCLI_SD3_VARIANT=$VARIANT SDRT_SDCLI_SD3_DEPTH=$DEPTH SDRT_SDCLI_THREADS=$J \
SDRT_SDCLI_SD3_DIR=$D timeout ${TEST_TIMEOUT:-540} python3 -m pytest -s -q tests/test_sd3_sdcli.py \
    -p no:cacheprovider ${TESTK:+-k "$TESTK"} 2>&1 | grep --line-buffered -E "PSNR|passed|failed|Error|error" | tee "$OUT/sd3cpu.log"
echo "total: $(( $(date +%s) - t0 )) s"
