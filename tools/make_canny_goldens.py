"""Write tests/fixtures/canny_sdcpp.npz: stable-diffusion.cpp's own canny preprocessor (the
`preprocess_canny` that sd-cli's `--canny` calls, compiled into sd-cli's static library) run on a
few images, for tests/test_canny.py.

    python tools/make_canny_goldens.py --sdcli-build /work/sdcli_build \
        [--sdcpp-src .../vendor/stable-diffusion.cpp] [--image ../shared/images/cat_1024.png]

It links a 20-line C++ harness against the sd-cli build's libstable-diffusion.a and ggml
libraries (bench/build_sdcli_cpu.sh makes them; the same object code as sd-cli's), feeds it the
raw RGB bytes and calls preprocess_canny(img, 0.08, 0.08, 0.8, 1.0, false) exactly as sd-cli's
main.cpp does. Keys: `in_<case>` HxWx3 uint8, `out_<case>` HxWx3 uint8 (sd.cpp's result), `meta`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, os.path.join(ROOT, "tests"))

HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include "stable-diffusion.h"
int main(int argc, char** argv) {
    int w = atoi(argv[1]), h = atoi(argv[2]);
    size_t n = (size_t)w * h * 3;
    uint8_t* buf = (uint8_t*)malloc(n);
    if (fread(buf, 1, n, stdin) != n) return 1;
    sd_image_t img = {(uint32_t)w, (uint32_t)h, 3, buf};
    preprocess_canny(img, 0.08f, 0.08f, 0.8f, 1.0f, false);   // sd-cli's arguments (examples/cli/main.cpp)
    fwrite(buf, 1, n, stdout);
    return 0;
}
"""


def build(build_dir: str, src: str, out_dir: str) -> str:
    c = os.path.join(out_dir, "canny.cpp")
    exe = os.path.join(out_dir, "canny")
    with open(c, "w") as f:
        f.write(HARNESS)
    libs = [os.path.join(build_dir, p) for p in ("libstable-diffusion.a", "ggml/src/libggml.a",
                                                  "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a")]
    subprocess.run(["g++", "-O2", c, "-I", os.path.join(src, "include"), *libs, "-lpthread", "-lgomp", "-o", exe],
                   check=True)
    return exe


def run(exe: str, img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    out = subprocess.run([exe, str(w), str(h)], input=np.ascontiguousarray(img).tobytes(), capture_output=True,
                         check=True).stdout
    return np.frombuffer(out, np.uint8).reshape(h, w, 3).copy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdcli-build", default="/work/sdcli_build")
    ap.add_argument("--sdcpp-src", default="/work/sdcli_src/stable_diffusion_cpp_python-0.4.7/vendor/stable-diffusion.cpp")
    ap.add_argument("--image", default=os.path.join(ROOT, "..", "shared", "images", "cat_1024.png"))
    a = ap.parse_args(argv)
    from PIL import Image
    from test_controlnet_sdcli import control_image
    cases = {"shapes_256": control_image(256),
             "noise_80x64": np.random.default_rng(5).integers(0, 256, (64, 80, 3), dtype=np.uint8)}
    if os.path.exists(a.image):
        with Image.open(a.image) as im:
            cases["cat_192x256"] = np.asarray(im.convert("RGB").resize((192, 256), Image.LANCZOS))
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(a.sdcli_build, a.sdcpp_src, tmp)
        arrays = {}
        for name, img in cases.items():
            arrays[f"in_{name}"] = img
            arrays[f"out_{name}"] = out = run(exe, img)
            print(f"{name}: {img.shape}, {(out[:, :, 0] == 255).sum()} strong pixels, "
                  f"{len(np.unique(out))} distinct values")
    arrays["meta"] = np.array(json.dumps({"sdcli_build": a.sdcli_build, "call": "preprocess_canny(img, 0.08f, 0.08f, "
                                          "0.8f, 1.0f, false)", "cases": list(cases)}))
    path = os.path.join(FIX, "canny_sdcpp.npz")
    np.savez_compressed(path, **arrays)
    print(f"{path}: {os.path.getsize(path) / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
