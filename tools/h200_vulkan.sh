#!/usr/bin/env bash
# Issue 19's Vulkan validation on the lent H200 (NVIDIA's Vulkan driver), in ONE device command
# of at most ~9.5 minutes. docs/vulkan.md ("The H200 run") says what each line checks.
#
#   bash tools/h200_vulkan.sh prepare     # HERE, once, in the repo root (needs the internet):
#                                         #   .whl/vk/  the `vulkan` binding + cffi + pycparser wheels (cp312)
#                                         #   .gl/      the Vulkan loader (libvulkan1 .deb); both git-ignored
#                                         # (and `bash tools/device_setup.sh prepare` for .whl/ as usual)
#   bash tools/h200_vulkan.sh             # THERE: device run with carry [".whl", ".gl"]
#
# The device run, each phase under its own timeout, everything printed going to $OUT/h200_vulkan.log:
#   0. the loader (.gl), the wheels (.whl/vk), device_setup.sh (pycuda for cuda0), --list-devices;
#   1. random full-size SD1.5 and SDXL checkpoints (tools/make_sd_checkpoint.py, background);
#   2. the op x backend walk on vulkan0 (tests/test_backend_ops.py -k vulkan0);
#   3. SD1.5 512x512, 4 steps: vulkan0 with an empty pipeline cache (process 1), vulkan0 again
#      (process 2: pipeline cache hits, time to the first model evaluation), cuda0, and cpu
#      (background, 12 threads); PSNR vulkan0 vs cpu and vs cuda0;
#   4. SDXL 1024x1024, 4 steps: vulkan0, cuda0, vulkan0 --max-vram 3; PSNR of each pair;
#   5. summary: steps per second vulkan0 vs cuda0 (steady: steps after the first), the cache
#      lines, every PSNR, PASS/FAIL against 50 dB. Images in $OUT (at most 8 files come back).
set -u
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 LC_ALL=C

if [ "${1:-}" = prepare ]; then
    set -e
    # .whl/ and .gl/ are in .gitignore: they travel only when `carry` names them
    { git check-ignore -q .whl/vk/x.whl && git check-ignore -q .gl/x.deb; } || { echo "prepare: .whl/ or .gl/ is not git-ignored here" >&2; exit 1; }
    mkdir -p .whl/vk .gl /tmp/amd64/partial
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl/vk vulkan==1.3.275.1 cffi==2.0.0 pycparser==3.0
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    apt-get $o update -qq
    (cd .gl && apt-get $o download libvulkan1)
    ls -la .whl/vk .gl
    du -sh .whl .gl
    echo "prepared: carry [\".whl\", \".gl\"] and run: bash tools/h200_vulkan.sh"
    exit 0
fi

OUT=${OUT:-$PWD/h200_vulkan_out}
mkdir -p "$OUT"
LOG=$OUT/h200_vulkan.log
exec > >(tee "$LOG") 2>&1
T0=$SECONDS
BUDGET=${BUDGET:-560}                   # seconds for the whole run (the device allows 600 a command)
W=/tmp/h200vk
mkdir -p "$W"
say() { echo "[$((SECONDS - T0))s] $*"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
# run NAME SECONDS CMD...: CMD under a timeout no longer than the time left; its output to $W/NAME.log
run() {
    local name=$1 limit=$2 rest
    shift 2
    rest=$(left)
    [ "$limit" -gt "$rest" ] && limit=$rest
    if [ "$limit" -lt 15 ]; then say "SKIP $name: no time left"; return 124; fi
    say "start $name (timeout ${limit}s)"
    timeout -k 5 "$limit" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && say "TIMEOUT $name after ${limit}s" || say "done $name rc=$rc"
    return $rc
}

# ---- 0. environment ------------------------------------------------------------------------------
say "0. environment"
if ls .gl/*.deb > /dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
ldconfig -p | grep -q libvulkan.so.1 || say "WARNING: no libvulkan.so.1 (carry .gl: bash tools/h200_vulkan.sh prepare)"
if ls .whl/vk/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-vk .whl/vk/*.whl \
        || say "WARNING: installing .whl/vk failed"
    export PYTHONPATH=/tmp/site-vk${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f tools/device_setup.sh ] && ls .whl/*.whl > /dev/null 2>&1; then
    eval "$(bash tools/device_setup.sh)" || say "WARNING: device_setup.sh failed: cuda0 comparisons will fail"
else
    say "WARNING: no .whl/*.whl (bash tools/device_setup.sh prepare): cuda0 may be unavailable"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import vulkan" 2>/dev/null || say "WARNING: the vulkan binding does not import"
list_devices() { timeout 60 python3 -m sdrt --list-devices 2>&1; }
DEVS=$(list_devices)
if ! grep -q vulkan0 <<< "$DEVS"; then
    for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
               /etc/vulkan/icd.d/nvidia_icd.json; do
        if [ -f "$icd" ]; then
            say "no vulkan0 yet: VK_DRIVER_FILES=$icd"
            export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
            DEVS=$(list_devices)
            break
        fi
    done
fi
# a Mesa CPU device (lavapipe) listed first would take the name vulkan0: keep NVIDIA's ICD alone
if grep -qE "^vulkan0.*\(CPU\)" <<< "$DEVS"; then
    for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
               /etc/vulkan/icd.d/nvidia_icd.json; do
        if [ -f "$icd" ]; then
            say "vulkan0 is a CPU device: VK_DRIVER_FILES=$icd (NVIDIA's driver alone)"
            export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
            DEVS=$(list_devices)
            break
        fi
    done
    grep -qE "^vulkan0.*\(CPU\)" <<< "$DEVS" && say "WARNING: vulkan0 is still a CPU device (no NVIDIA ICD found)"
fi
echo "$DEVS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
if ! grep -q vulkan0 <<< "$DEVS"; then
    say "FATAL: no vulkan0 (see the lines above: loader, binding, ICD); nothing else can run"
    exit 2
fi
HAVE_CUDA=0
grep -q cuda0 <<< "$DEVS" && HAVE_CUDA=1

# ---- 1. checkpoints (background) -----------------------------------------------------------------
say "1. checkpoints"
# SD15_CKPT / SDXL_CKPT: existing files instead (then nothing is generated); SIZE15 / SIZEXL: image
# sizes (512 / 1024; smaller only to try the script itself on lavapipe)
SD15=${SD15_CKPT:-$W/sd15_rand_f16.safetensors}
SDXL=${SDXL_CKPT:-$W/sdxl_rand_f16.safetensors}
SIZE15=${SIZE15:-512}
SIZEXL=${SIZEXL:-1024}
P15=0 PXL=0
if [ ! -f "$SD15" ]; then
    timeout 240 python3 tools/make_sd_checkpoint.py --arch sd15 -o "$SD15" > "$W/ckpt_sd15.log" 2>&1 &
    P15=$!
fi
if [ ! -f "$SDXL" ]; then
    timeout 300 python3 tools/make_sd_checkpoint.py --arch sdxl -o "$SDXL" > "$W/ckpt_sdxl.log" 2>&1 &
    PXL=$!
fi
wait_ckpt() {   # wait_ckpt PID NAME
    [ "$1" = 0 ] && return 0
    wait "$1" || say "WARNING: the $2 checkpoint failed: $(tail -2 "$W/ckpt_$2.log")"
    tail -1 "$W/ckpt_$2.log"
}

# ---- 2. op x backend walk ------------------------------------------------------------------------
say "2. op x backend on vulkan0"
run ops 150 python3 -m pytest -q -p no:cacheprovider tests/test_backend_ops.py -k vulkan0
tail -15 "$W/ops.log"

# ---- 3. SD1.5 512x512 ----------------------------------------------------------------------------
wait_ckpt $P15 sd15
say "3. SD1.5 ${SIZE15}x${SIZE15}"
SD15ARGS=(-m "$SD15" -p "a photo of a cat" -W "$SIZE15" -H "$SIZE15" --steps 4 -s 42 --sampling-method euler -v)
export SDRT_VULKAN_CACHE=$W/pipeline_cache
rm -rf "$SDRT_VULKAN_CACHE"
(OMP_NUM_THREADS=${CPU_THREADS:-12} timeout 420 python3 -m sdrt "${SD15ARGS[@]}" --backend cpu -t "${CPU_THREADS:-12}" -o "$W/sd15_cpu.png" \
    > "$W/sd15_cpu.log" 2>&1; echo $? > "$W/sd15_cpu.rc") &
PCPU=$!
run sd15_vk1 150 python3 -m sdrt "${SD15ARGS[@]}" --backend vulkan0 -o "$W/sd15_vulkan.png"
run sd15_vk2 120 python3 -m sdrt "${SD15ARGS[@]}" --backend vulkan0 -o "$W/sd15_vulkan2.png"
[ $HAVE_CUDA = 1 ] && run sd15_cuda 120 python3 -m sdrt "${SD15ARGS[@]}" --backend cuda0 -o "$W/sd15_cuda.png"

# ---- 4. SDXL 1024x1024 ---------------------------------------------------------------------------
wait_ckpt $PXL sdxl
say "4. SDXL ${SIZEXL}x${SIZEXL}"
XLARGS=(-m "$SDXL" -p "a photo of a cat" -W "$SIZEXL" -H "$SIZEXL" --steps 4 -s 42 --sampling-method euler -v)
run sdxl_vk 170 python3 -m sdrt "${XLARGS[@]}" --backend vulkan0 -o "$W/sdxl_vulkan.png"
[ $HAVE_CUDA = 1 ] && run sdxl_cuda 90 python3 -m sdrt "${XLARGS[@]}" --backend cuda0 -o "$W/sdxl_cuda.png"
run sdxl_vk_maxvram 200 python3 -m sdrt "${XLARGS[@]}" --backend vulkan0 --max-vram 3 -o "$W/sdxl_vulkan_maxvram.png"

# the CPU image: wait while time is left
while kill -0 $PCPU 2> /dev/null && [ "$(left)" -gt 20 ]; do sleep 2; done
kill $PCPU 2> /dev/null
say "cpu SD1.5 rc=$(cat "$W/sd15_cpu.rc" 2>/dev/null || echo unfinished)"

# ---- 5. summary ----------------------------------------------------------------------------------
say "5. summary"
for f in sd15_vulkan sd15_cpu sdxl_vulkan sdxl_vulkan_maxvram; do
    [ -f "$W/$f.png" ] && cp "$W/$f.png" "$OUT/"
done
for f in "$W"/*.log; do
    echo "===== $(basename "$f") (errors, timings, cache, residency lines)"
    tr '\r' '\n' < "$f" | grep -E "rror|Traceback|first |pipelines made|pipeline cache|sampling completed|generate_image completed|decode_first_stage|residency|run on the CPU|passed|failed|xfail" \
        | cut -c1-400 | tail -30
done
python3 - "$W" "$HAVE_CUDA" << 'PY' 2>&1 | tee "$OUT/summary.txt"
import os, re, sys
import numpy as np
from PIL import Image
W, have_cuda = sys.argv[1], sys.argv[2] == "1"
MIN = 50.0

def img(name):
    p = os.path.join(W, name + ".png")
    return np.asarray(Image.open(p).convert("RGB"), np.float64) if os.path.exists(p) else None

def psnr(a, b):
    if a is None or b is None or a.shape != b.shape:
        return None
    m = ((a - b) ** 2).mean()
    return float("inf") if m == 0 else 10 * np.log10(255 ** 2 / m)

def log(name):
    p = os.path.join(W, name + ".log")
    return open(p, errors="replace").read().replace("\r", "\n") if os.path.exists(p) else ""

def rate(name, steps=4):
    t = log(name)
    s = re.findall(r"sampling completed, taking ([\d.]+)s", t)
    f = re.findall(r"first model evaluation done after ([\d.?]+)s? .*?\(([\d.]+)s in it\)", t)
    if not s:
        return None, None, None
    total = float(s[0])
    first = float(f[0][1]) if f else None
    steady = (steps - 1) / (total - first) if first is not None and total > first else None
    return steps / total, steady, f[0][0] if f else None

ok = True
print("== images (PSNR, dB; need >= 50)")
for a, b in [("sd15_vulkan", "sd15_cpu"), ("sd15_vulkan", "sd15_cuda"), ("sd15_vulkan2", "sd15_vulkan"),
             ("sdxl_vulkan", "sdxl_cuda"), ("sdxl_vulkan_maxvram", "sdxl_vulkan")]:
    p = psnr(img(a), img(b))
    need = not (b.endswith("cuda") and not have_cuda)
    verdict = "missing" if p is None else ("PASS" if p >= MIN else "FAIL")
    ok &= p is not None and p >= MIN or not need
    print(f"  {a} vs {b}: {'-' if p is None else f'{p:.2f}'}  {verdict}")
print("== steps per second (4 steps; all: total, steady: steps 2-4 after the first model evaluation)")
r = {}
for name in ("sd15_vk1", "sd15_vk2", "sd15_cuda", "sdxl_vk", "sdxl_cuda", "sdxl_vk_maxvram"):
    allr, steady, age = rate(name)
    r[name] = steady or allr
    print(f"  {name}: all {'-' if allr is None else f'{allr:.2f}'} it/s, steady "
          f"{'-' if steady is None else f'{steady:.2f}'} it/s, first model evaluation done at {age or '-'} s since start")
for m, v, c in (("SD1.5 512", "sd15_vk2", "sd15_cuda"), ("SDXL 1024", "sdxl_vk", "sdxl_cuda")):
    if r.get(v) and r.get(c):
        print(f"  {m}: vulkan0 / cuda0 = {r[v] / r[c]:.2f} (issue 19 asks >= 0.5)")
print("== pipeline cache (process 1: empty cache; process 2: seeded from process 1's file)")
pat = (r"graph of (\d+) nodes: (\d+) pipelines made in ([\d.]+)s \(pipeline cache: (?:(\d+) cache hits, (\d+) misses|"
       r"no creation feedback); (\d+) bytes loaded from (.*)\)")
for name in ("sd15_vk1", "sd15_vk2"):
    rows = re.findall(pat, log(name))
    made = sum(int(r[1]) for r in rows)
    secs = sum(float(r[2]) for r in rows)
    hits = sum(int(r[3] or 0) for r in rows)
    misses = sum(int(r[4] or 0) for r in rows)
    loaded = rows[0][5] if rows else "-"
    _, _, age = rate(name)
    print(f"  {name}: {made} pipelines in {secs:.2f}s, {hits} cache hits, {misses} misses, {loaded} bytes of "
          f"cache loaded; first model evaluation done at {age or '-'} s since process start")
    if rows:
        print(f"    cache file: {rows[0][6]}")
    if name == "sd15_vk2" and rows:
        print(f"  second process: {'pipeline cache HIT' if hits and not misses else 'partial hit' if hits else 'NO cache hit'}"
              f" ({hits} of {made} pipelines from the cache)")
ops = re.findall(r"\d+ (?:passed|failed|xfailed|skipped|deselected)[^\n]*", log("ops"))
print("== op x backend on vulkan0:", ops[-1] if ops else "no result")
ok &= bool(ops) and "failed" not in ops[-1]
print("OVERALL:", "PASS" if ok else "FAIL (see the lines above and h200_vulkan.log)")
PY
say "total $((SECONDS - T0)) s"
sleep 1   # let tee write the last lines
