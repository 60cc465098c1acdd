"""ControlNet on cuda0 against the CPU (issue 16): the module on the diffusers-golden fixture
(tests/fixtures/controlnet_sd1.npz), and the whole CLI with a ControlNet on the tiny random SDXL
checkpoint: the CUDA image within 50 dB of the CPU image, with the ControlNet on the GPU and with
--control-net-cpu (the UNet on the GPU, the ControlNet on the CPU). GPU test: `pytest --gpu`."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_controlnet import models, rel_err  # noqa: E402
from test_controlnet_pipeline import files, run  # noqa: E402, F401  (files: the module fixture)
from test_image_regression import psnr  # noqa: E402


@pytest.mark.parametrize("case", ["sd1", "sdxl"])
def test_controlnet_module_cuda_matches_golden(cuda, case):
    a, meta, cn, unet = models(case, "sdcpp")
    y = a["y"] if "y" in a.files else None
    gh = cn.hint(a["hint"], backend="cuda0")
    assert rel_err(gh, cn.hint(a["hint"])) <= 5e-4  # eight convolutions, summed in another order on the GPU
    controls = cn(a["x"], gh, a["t"], a["context"], y, backend="cuda0")
    for i, c in enumerate(controls):
        assert rel_err(c, a[f"controls_sdcpp_{i}"]) <= 2e-3, f"control {i}"  # F16 GEMM inputs
    out = unet(a["x"], a["t"], a["context"], y, controls=controls, control_strength=meta["strength"], backend="cuda0")
    assert rel_err(out, a["out_sdcpp"]) <= 2e-3  # the UNet after it, F16 GEMM inputs on the GPU


@pytest.mark.parametrize("extra", [[], ["--control-net-cpu"]], ids=["cn-on-gpu", "control-net-cpu"])
def test_controlnet_cli_cuda_matches_cpu(cuda, files, extra):  # noqa: F811
    cn = ["--control-net", files["cn"], "--control-image", files["image"], "--canny"]
    cpu = run(files, "gpu_ref_cpu", *cn, "--backend", "cpu")
    gpu = run(files, "gpu_" + ("cncpu" if extra else "cn"), *cn, "--backend", "cuda0", *extra)
    db = psnr(cpu, gpu)
    print(f"controlnet {extra or 'on cuda0'}: cuda0 vs cpu {db:.2f} dB")
    assert db >= 50.0
    assert not np.array_equal(cpu, run(files, "gpu_plain", "--backend", "cuda0"))
