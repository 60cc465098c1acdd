#!/usr/bin/env bash
# Fit the working tree into the device tool's 64 MiB (tracked files + untracked + carry) and back:
#   bash tools/device_tree.sh prepare          # sm_90-only fatbins (the H200's; built once, kept by a later
#                                              # prepare, so switching trees is instant), .whl's big dirs set aside
#   bash tools/device_tree.sh prepare sdcpp    # the same but sd-cli's source kept (runs that build sd-cli:
#                                              # h200_sd3cpu.sh, PARTS=cli) and the diffusers wheel set aside
#   bash tools/device_tree.sh restore          # the committed fatbins and manifest, the .whl dirs back
# The shipped fatbins hold SASS for four archs plus PTX (~50 MB together), more than the device
# run can carry beside the wheels; the H200 only needs sm_90 (sm_90a for attention_sm90).
# ASIDE (default ../device_aside) keeps .whl/sdcpp and .whl/vk (sd-cli's and Vulkan's sources,
# needed only by the runs that build them) while they are out.
set -euo pipefail
cd "$(dirname "$0")/.."
ASIDE=${ASIDE:-../device_aside}
case "${1:-}" in
prepare)
    mkdir -p "$ASIDE"
    if [ "${2:-}" = sdcpp ]; then
        aside="vk diffusers-*.whl"
        [ -e .whl/sdcpp ] || mv "$ASIDE/sdcpp" .whl/
    else
        aside="sdcpp vk"
        for w in "$ASIDE"/diffusers-*.whl; do [ ! -e "$w" ] || mv "$w" .whl/; done
    fi
    for d in $aside; do for p in .whl/$d; do [ ! -e "$p" ] || mv "$p" "$ASIDE/"; done; done
    # the sm_90-only build once; a later prepare (switching between the two trees) only moves dirs
    if ! python - <<'PY'
import sys
sys.path.insert(0, "tools")
from build_cuda_kernels import families, read_manifest, source_digest
man = read_manifest()
sys.exit(0 if all(man.get(cu.stem, {}).get("archs") in (["sm_90"], ["sm_90a"]) and cu.with_suffix(".fatbin").exists()
                  and man[cu.stem].get("sha256") == source_digest(cu) for cu in families()) else 1)
PY
    then
        python tools/build_cuda_kernels.py --arch sm_90 -j 2
    fi
    tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    carried=$(du -sb .whl | cut -f1)
    echo "device tree: $(( (tracked + carried) >> 20 )) MiB (tracked $(( tracked >> 20 )), .whl $(( carried >> 20 ))); limit 64"
    ;;
restore)
    git checkout -- sdrt/gpu/cuda/kernels/*.fatbin sdrt/gpu/cuda/kernels/manifest.json
    for p in "$ASIDE"/sdcpp "$ASIDE"/vk "$ASIDE"/diffusers-*.whl; do [ ! -e "$p" ] || mv "$p" .whl/; done
    python tools/build_cuda_kernels.py --check
    ;;
*)
    echo "usage: $0 prepare|restore" >&2
    exit 2
    ;;
esac
