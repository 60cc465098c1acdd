"""ControlNet (sdrt.models.diffusion.controlnet) and the UNet's control inputs against diffusers'
ControlNetModel + UNet2DConditionModel (fixtures from tools/make_controlnet_goldens.py: tiny SD1-
and SDXL-style configs, random f16 weights under sd.cpp's names)."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from sdrt.errors import ModelFileError, UsageError
from sdrt.models.diffusion.controlnet import ControlNetModel, canonical_controlnet_names, detect_controlnet
from sdrt.models.diffusion.unet import UNetConfig, UNetModel
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
CASES = ("sd1", "sdxl")


def load(case):
    a = np.load(os.path.join(FIX, f"controlnet_{case}.npz"))
    meta = json.loads(str(a["meta"]))
    cn = {k[3:]: Tensor.from_numpy(a[k]) for k in a.files if k.startswith("cn:")}
    un = {k[5:]: Tensor.from_numpy(a[k]) for k in a.files if k.startswith("unet:")}
    return a, meta, cn, un


def models(case, numerics):
    a, meta, cn, un = load(case)
    ov = meta["sdrt_overrides"]
    ccfg = dataclasses.replace(detect_controlnet(cn), numerics=numerics, **ov)
    ucfg = UNetConfig.detect_from_weights(un, numerics=numerics, **ov)
    return a, meta, ControlNetModel(cn, config=ccfg), UNetModel(un, config=ucfg)


def rel_err(a, b):
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("numerics", ["torch", "sdcpp"])
def test_controls_and_unet_match_diffusers(case, numerics):
    a, meta, cn, unet = models(case, numerics)
    y = a["y"] if "y" in a.files else None
    gh = cn.hint(a["hint"])
    assert gh.shape == (1, cn.config.model_channels) + a["x"].shape[2:]
    controls = cn(a["x"], gh, a["t"], a["context"], y)
    assert len(controls) == meta["controls"] == cn.num_controls
    for i, c in enumerate(controls):
        assert rel_err(c, a[f"controls_{numerics}_{i}"]) <= 1e-4, f"control {i}"
    out = unet(a["x"], a["t"], a["context"], y, controls=controls, control_strength=meta["strength"])
    assert rel_err(out, a[f"out_{numerics}"]) <= 1e-4
    # the hint matters (4-13% of each control here), so the 1e-4 agreement covers the hint block
    no_hint = cn(a["x"], gh * 0, a["t"], a["context"], y)
    assert min(rel_err(c0, c) for c0, c in zip(no_hint, controls)) > 1e-2
    # the controls matter: without them the UNet's output is far from the golden
    plain = unet(a["x"], a["t"], a["context"], y)
    assert rel_err(plain, a[f"out_{numerics}"]) > 1e-2
    # batch-1 conditioning and a batch-1 guided hint broadcast like sd.cpp's ggml_repeat
    one = cn(a["x"][:1], gh, a["t"][:1], a["context"][:1], None if y is None else y[:1])
    for c1, c in zip(one, controls):
        assert rel_err(c1, c[:1]) <= 1e-5


def test_detect_layouts():
    _, _, cn, _ = load("sdxl")
    cfg = detect_controlnet(cn)
    assert cfg.adm_in_channels == 64 and cfg.context_dim == 32 and cfg.use_linear
    assert [la.kind for _, b in cfg.input_blocks for _, la in b] == ["res", "res", "down", "res", "attn", "res", "attn"]
    assert cfg.transformer_depth == (2, 2) and cfg.transformer_depth_middle == 2
    _, _, cn1, _ = load("sd1")
    c1 = detect_controlnet(cn1)
    assert c1.adm_in_channels == 0 and not c1.use_linear and c1.num_heads == 8


def test_names_from_pth_and_bare():
    assert canonical_controlnet_names(["control_model.zero_convs.0.0.weight", "input_hint_block.0.bias",
                                       "model.diffusion_model.out.2.weight", "control_model.foo"]) == {
        "control_model.zero_convs.0.0.weight": "control_model.zero_convs.0.0.weight",
        "input_hint_block.0.bias": "control_model.input_hint_block.0.bias"}


def test_bad_files_and_inputs_are_named():
    _, _, cn, un = load("sd1")
    with pytest.raises(ModelFileError, match="not a ControlNet"):
        detect_controlnet({k.replace("control_model.", "model.diffusion_model."): v for k, v in cn.items()})
    broken = {k: v for k, v in cn.items() if not k.startswith("control_model.zero_convs.2.")}
    with pytest.raises(ModelFileError, match="zero conv"):
        detect_controlnet(broken)
    a, meta, net, unet = models("sd1", "sdcpp")
    with pytest.raises(UsageError, match="control image"):
        net.hint(a["hint"][:, :, :60])
    gh = net.hint(a["hint"])
    controls = net(a["x"], gh, a["t"], a["context"])
    with pytest.raises(UsageError, match="controls"):
        unet(a["x"], a["t"], a["context"], controls=controls[:-1], control_strength=0.9)
