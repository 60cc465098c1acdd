#!/usr/bin/env bash
# Attention and the diffusion-transformer step on a lent GPU, one device command (~8 min):
# eval "$(bash tools/device_setup.sh)" is done here; carry .whl.
#   bash tools/h200_dit.sh                 # attention tests + bench, Flux 4+8-block kernel profile vs
#                                          # diffusers, then the GPU tests ($TESTS, default the suite)
#   PARTS="attn flux" bash tools/h200_dit.sh   # a subset of: attn, flux, fluxfull, dit, cli, ab, conv, unet, wino, tests
#   PARTS=dit bash tools/h200_dit.sh          # the full-size DiT step of every family (~8 min)
#   PARTS=cli bash tools/h200_dit.sh          # the whole CLI vs sd-cli CUDA, full-size files (~8 min)
#   PARTS=ab bash tools/h200_dit.sh           # sdrt's SD1.5/SDXL CLI with each start-up switch off (~3 min)
#   PARTS=conv bash tools/h200_dit.sh         # issue 18's conv kernels per shape vs cuDNN (~3 min)
#   PARTS=unet bash tools/h200_dit.sh         # SD1.5 UNet/VAE vs PyTorch eager and compiled (~8 min; SDXL
#                                              # alone: UNET_ARCHS=sdxl, its compile takes ~2.5 min)
#   PARTS=wino bash tools/h200_dit.sh         # SD1.5 step/decode/image with Winograd convs off and on (~2 min)
# conv: the direct-conv GPU tests, then bench_cuda_conv.py --variants (every conv3x3_mma variant
# per shape, beside im2col + cuBLAS and cuDNN), log in $OUT/conv.log.
# unet: bench_cuda_sd.py for $UNET_ARCHS (default sd15) with sdrt, PyTorch eager and compiled
# (issue 18 done-means 1-3), then CUPTI kernel tables of the UNet step (sdrt, torch eager and
# compiled) and of the VAE decode (sdrt, torch eager): $OUT/unet_<arch>.log, prof_<arch>.log,
# prof_vae_<arch>.log (needs the diffusers wheel: `bash tools/device_tree.sh prepare`, not sdcpp).
# fluxfull: bench_cuda_flux.py on full-size random Flux.1-dev (bf16, written here, ~4 min) against
# diffusers eager and torch.compile ($FLUX_ENGINES, $FLUX_STEPS timed steps).
# dit: bench_cuda_dit.py, full-size random bf16 Z-Image-Turbo, SD3.5 Large, Qwen-Image (41 GB) and
# Flux.1-dev at 1024x1024, sdrt vs diffusers eager and torch.compile on the same weights, each family's
# file written once in /tmp/dit and deleted after it; $DIT_FAMILIES, $DIT_COMPILE (families with a
# compile run: Flux's, 0.134 s/step, was measured in the fifth session), $DIT_STEPS, $DIT_BUDGET (s).
# cli: bench_cuda_cli.py, the whole CLI of $CLI_FAMILIES (default zimage,sd35l; sd15,sdxl for issue 18,
# with CLI_RUNS=2: the second run of each command reported; $CLI_ARGS more bench flags, e.g.
# CLI_ENGINES=sdrt,sdrt-vram,sdcli CLI_ARGS="--max-vram 3 --vram-args=--offload-to-cpu"; the start-up timeline:
# CLI_ARGS="--sdrt-args=--log-level=debug", every run's log in $OUT/cli_logs) at 1024x1024 with each
# family's steps/cfg, sdrt (--backend cuda0) vs sd-cli CUDA --diffusion-fa ($CLI_ENGINES, default
# sdrt,sdcli), full-size random bf16 files in /tmp/cli. sd-cli builds in the background first
# (bench/build_sdcli_cuda.sh from $SDCLI_SRC, default .whl/sdcpp/sdcpp_src.tar.xz: carry .whl with
# sdcpp in it, `bash tools/device_tree.sh prepare sdcpp`) while
# the files are written (--make-only); then the runs, within $CLI_BUDGET s (default 500) of the part's
# start. Estimate (fifth session's rates: 16 jobs ~57 M parameters/s, sd-cli ~5 min to build):
# files ~230 s for SD3.5 Large (8.1 B + T5-XXL 4.7 B + bigG), ~180 s for Z-Image (6.15 B + Qwen3 4.0 B);
# each engine ~40-90 s (loading 20-30 GB, 8-20 steps, decode). Both families do not fit one 600 s
# command from a fresh machine: the files and sd-cli are KEPT (/tmp/cli, /tmp/sdcli; CLI_KEEP=0 deletes
# the files after each family), so the same command again on the warm machine skips what exists and
# runs what the budget cut. Qwen-Image (41 + 15 GB) alone: `rm -rf /tmp/cli` first, CLI_FAMILIES=qwen.
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
if has conv; then
    timeout 150 python3 -m pytest -q --gpu tests/gpu/test_cuda_ops_conv.py -p no:cacheprovider 2>&1 | tail -4
    timeout ${CONV_TIMEOUT:-100} python3 bench/bench_cuda_conv.py --repeat 20 --variants > "$OUT/conv.log" 2>&1
    cut -c1-250 "$OUT/conv.log"
fi
if has unet; then
    for arch in ${UNET_ARCHS:-sd15}; do
        timeout ${UNET_TIMEOUT:-300} python3 bench/bench_cuda_sd.py --arch $arch --engines sdrt,torch,compile \
            > "$OUT/unet_$arch.log" 2>&1
        grep -E "^(sdrt|torch|compile)( failed|:)|^\|" "$OUT/unet_$arch.log" | cut -c1-400
        timeout ${PROFILE_TIMEOUT:-240} python3 bench/profile_cuda_kernels.py --arch $arch --torch --rows 40 \
            > "$OUT/prof_$arch.log" 2>&1
        grep -E "replayed|warm-up|Self CUDA time total" "$OUT/prof_$arch.log"
        v=$([ $arch = sd15 ] && echo vae15 || echo vaexl)
        timeout 90 python3 bench/profile_cuda_kernels.py --arch $v --torch --rows 40 > "$OUT/prof_vae_$arch.log" 2>&1
        grep -E "replayed|Self CUDA time total" "$OUT/prof_vae_$arch.log"
    done
fi
if has wino; then
    # Winograd F(2x2, 3x3) for the UNet's and the VAE's deep convs (issue 18): the SD1.5 step and
    # decode, and the 512x512 4-step image against the default path's and the CPU's (the CPU image
    # made beforehand with the same command: h200_ref/sd15_cpu_4steps.png, ignored by git, so name
    # h200_ref in the device call's carry)
    ls /tmp/sd15_rand_f16.safetensors >/dev/null 2>&1 || \
        python3 tools/make_sd_checkpoint.py --arch sd15 -o /tmp/sd15_rand_f16.safetensors | tail -1
    for cfg in default: wino:SDRT_CUDA_WINOGRAD=1 wino16:SDRT_CUDA_WINOGRAD=1,SDRT_CUDA_WINOGRAD_M=F16; do
        name=${cfg%%:*}; vars=${cfg#*:}
        echo "== $name $vars"
        env ${vars//,/ } timeout 120 python3 bench/bench_cuda_sd.py --arch ${WINO_ARCH:-sd15} --engines sdrt 2>&1 | tail -2
        env ${vars//,/ } timeout 120 python3 -m sdrt -m /tmp/sd15_rand_f16.safetensors -p "a photo of a cat" -W 512 \
            -H 512 --steps 4 -s 42 --sampling-method euler --backend cuda0 -o /tmp/wino_$name.png 2>&1 | grep -E "rror" 
    done
    python3 - <<'PY'
import os
import numpy as np
from PIL import Image
def load(p):
    return np.asarray(Image.open(p), np.float64) if os.path.exists(p) else None
def psnr(a, b):
    if a is None or b is None:
        return float("nan")
    m = ((a - b) ** 2).mean()
    return float("inf") if m == 0 else 10 * np.log10(255 ** 2 / m)
cpu, base = load("h200_ref/sd15_cpu_4steps.png"), load("/tmp/wino_default.png")
for n in ("default", "wino", "wino16"):
    im = load(f"/tmp/wino_{n}.png")
    print(f"SD1.5 512x512 4 steps, {n}: vs CPU {psnr(im, cpu):.2f} dB, vs default GPU {psnr(im, base):.2f} dB")
PY
fi
if has cli; then
    t0=$SECONDS; CB=${CLI_BUDGET:-500}; SDCLI=/tmp/sdcli/sd-cli; SRC=${SDCLI_SRC:-.whl/sdcpp/sdcpp_src.tar.xz}
    building() { [ -e /tmp/sdcli.pid ] && kill -0 "$(cat /tmp/sdcli.pid)" 2>/dev/null; }
    if [ ! -x $SDCLI ] && [ ! -e /tmp/sdcli.done ] && [ -e "$SRC" ] && ! building; then   # once per machine
        setsid nohup bash -c "echo \$\$ > /tmp/sdcli.pid; bash bench/build_sdcli_cuda.sh $SRC /tmp/sdcli \
            > /tmp/sdcli_build.out 2>&1; echo \$? > /tmp/sdcli.done" > /dev/null 2>&1 &
    fi
    F=${CLI_FAMILIES:-zimage,sd35l}
    # the files first, while sd-cli compiles (leave >= 150 s for the runs)
    # ($CLI_ARGS too: --dit-type decides which DiT file is made)
    python3 bench/bench_cuda_cli.py --make-only --family $F --dir /tmp/cli --jobs 16 --budget $((CB - 150)) \
        $CLI_ARGS 2>&1 | tail -12
    while [ ! -x $SDCLI ] && building && [ ! -e /tmp/sdcli.done ] && [ $((SECONDS - t0)) -lt $((CB - 90)) ]; do
        sleep 3; done
    echo "sd-cli: $([ -x $SDCLI ] && echo built || echo "not built ($(cat /tmp/sdcli.done 2>/dev/null || echo unfinished))") at $((SECONDS - t0)) s"
    [ -x $SDCLI ] || tail -5 /tmp/sdcli/sdcli_build.log 2>/dev/null
    KEEP=$([ "${CLI_KEEP:-1}" = 1 ] && echo --keep)
    left=$(( CB - (SECONDS - t0) )); [ $left -ge 1 ] || left=1      # (--budget 0 would mean none)
    timeout $(( left + 30 )) python3 bench/bench_cuda_cli.py --family $F --dir /tmp/cli --sdcli $SDCLI \
        --engines ${CLI_ENGINES:-sdrt,sdcli} --runs ${CLI_RUNS:-1} --jobs 16 --budget $left $KEEP $CLI_ARGS \
        --save-logs "$OUT/cli_logs" --json "$OUT/cli.json" 2>&1 | cut -c1-700 | tail -40
fi
if has ab; then
    # the first-step work one switch at a time (issue 18): sdrt's whole CLI with every default, then
    # with each of the GEMM warm-up, the upload ahead and the read-ahead off ($AB_FAMILIES, default
    # sd15,sdxl; $AB_RUNS runs each, the last reported; the files made here when missing)
    AF=${AB_FAMILIES:-sd15,sdxl}
    python3 bench/bench_cuda_cli.py --make-only --family $AF --dir /tmp/cli --jobs 16 2>&1 | tail -3
    for cfg in defaults: no-warmup:SDRT_GEMM_WARMUP=0 no-ahead:SDRT_UPLOAD_AHEAD=0 no-prefetch:SDRT_PREFETCH=0; do
        name=${cfg%%:*}
        echo "== $name ${cfg#*:}"
        env ${cfg#*:} timeout ${AB_TIMEOUT:-120} python3 bench/bench_cuda_cli.py --family $AF --dir /tmp/cli \
            --engines sdrt --runs ${AB_RUNS:-3} --jobs 16 --keep --sdrt-args=--log-level=debug \
            --save-logs "$OUT/ab/$name" --json "$OUT/ab/$name.json" 2>&1 | grep -E "^\| sdrt|^[A-Z]" | cut -c1-300
    done
    # one file back (the device tool returns a few files per command)
    tar czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$OUT/ab"
fi
} 2>&1 | tee "$OUT/bench.log"
if has tests; then
    T=${TESTS:-"tests/gpu tests/test_backend_ops.py tests/test_residency.py"}
    timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q --gpu $T -p no:cacheprovider 2>&1 | tail -25 > "$OUT/tests.log"
    tail -3 "$OUT/tests.log"
fi
