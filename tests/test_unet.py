"""UNet (SD1/SD2/SDXL/SSD-1B/inpaint) against diffusers goldens (tools/make_unet_goldens.py),
config detection, presets, errors, graph budget. No torch here: the goldens are .npz files."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.diffusion.unet import PREFIX, PRESETS, UNetConfig, UNetModel
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
CASES = ("sd1", "sd2", "sdxl", "ssd1b", "inpaint")
_cache: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def load(case):
    if case not in _cache:
        z = np.load(os.path.join(FIX, f"unet_{case}.npz"))
        table = {k[2:]: Tensor.from_numpy(z[k]) for k in z.files if k.startswith("w:")}
        arrays = {k: z[k] for k in z.files if not k.startswith("w:") and k != "meta"}
        _cache[case] = (table, arrays, json.loads(str(z["meta"])))
    return _cache[case]


def model(case, numerics="sdcpp"):
    table, _, meta = load(case)
    cfg = UNetConfig.detect_from_weights(table, numerics=numerics, **meta["sdrt_overrides"])
    return UNetModel(table, config=cfg, source=f"unet_{case}.npz")


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("numerics", ["torch", "sdcpp"])
@pytest.mark.parametrize("case", CASES)
def test_matches_diffusers(case, numerics):
    _, a, _ = load(case)
    m = model(case, numerics)
    x = a["x"][:, :4] if case == "inpaint" else a["x"]
    out = m(x, a["t"], a["context"], a.get("y"), a.get("c_concat"))
    assert out.shape == a["out_torch"].shape and out.dtype == np.float32
    assert rel_err(out, a[f"out_{numerics}"]) <= 1e-4
    # the two numerics differ by more than the tolerance, so each golden pins its own
    assert rel_err(a["out_torch"], a["out_sdcpp"]) > 1e-4


def test_inpaint_full_x_and_reuse():
    """9 channels in x at once equal x4 + c_concat; a second call with new inputs reuses the
    cached graph and gives the new answer."""
    _, a, _ = load("inpaint")
    m = model("inpaint", "torch")
    out = m(a["x"], a["t"], a["context"])
    assert rel_err(out, a["out_torch"]) <= 1e-4
    out2 = m(a["x"][::-1], a["t"][::-1], a["context"][::-1])
    assert rel_err(out2, a["out_torch"][::-1]) <= 1e-4
    assert len(m._graphs) == 1


def test_batch1_conditioning_broadcasts():
    """context / y with batch 1 are repeated to the batch of x, as sd.cpp does."""
    _, a, _ = load("sdxl")
    m = model("sdxl", "torch")
    x = np.stack([a["x"][0], a["x"][0]])
    one = m(x, a["t"][:1].repeat(2), a["context"][:1], a["y"][:1])
    ref = m(a["x"][:1], a["t"][:1], a["context"][:1], a["y"][:1])
    np.testing.assert_allclose(one[0], ref[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(one[1], ref[0], rtol=0, atol=1e-5)
    assert rel_err(ref, a["out_torch"][:1]) <= 1e-4


# ---- detection -------------------------------------------------------------------------------

DETECTED = {  # case: (in, context, adm, heads rule, linear, depth in, mid, depth out, channel_mult)
    "sd1": (4, 32, 0, (8, -1), False, (1, 1, 1, 1), 1, (1,) * 6, (1, 2, 2)),
    "sd2": (4, 32, 0, (-1, 64), True, (1, 1), 1, (1,) * 4, (1, 2)),
    "sdxl": (4, 32, 64, (-1, 64), True, (2, 2), 2, (2, 2, 2), (1, 2)),
    "ssd1b": (4, 32, 64, (-1, 64), True, (2, 2), -1, (2, 1, 3), (1, 2)),
    "inpaint": (9, 32, 0, (8, -1), False, (1,), 1, (1, 1), (1, 2)),
}


@pytest.mark.parametrize("case", CASES)
def test_detect_from_weights(case):
    table, _, _ = load(case)
    cfg = UNetConfig.detect_from_weights(table)      # no overrides: the rules alone
    cin, ctx, adm, heads, linear, d_in, d_mid, d_out, mult = DETECTED[case]
    assert (cfg.in_channels, cfg.out_channels, cfg.model_channels, cfg.time_embed_dim) == (cin, 4, 16, 64)
    assert (cfg.context_dim, cfg.adm_in_channels, (cfg.num_heads, cfg.head_dim)) == (ctx, adm, heads)
    assert (cfg.use_linear, cfg.transformer_depth, cfg.transformer_depth_middle) == (linear, d_in, d_mid)
    assert (cfg.transformer_depth_output, cfg.channel_mult) == (d_out, mult)
    # the layout names exactly the tensors of the file, with their shapes
    shapes = cfg.weight_shapes()
    assert {PREFIX + k for k in shapes} == set(table)
    assert all(table[PREFIX + k].shape == v for k, v in shapes.items())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_roundtrip_detection(name):
    """Each of sd.cpp's layouts, as shapes only (no data), is detected back as itself."""
    cfg = UNetConfig.preset(name)
    table = {PREFIX + k: Tensor("F16", s[::-1]) for k, s in cfg.weight_shapes().items()}
    assert UNetConfig.detect_from_weights(table) == cfg
    cfg.check()


def test_preset_shapes_are_the_real_ones():
    sd1, sd2, xl, ssd, vega = (UNetConfig.preset(n) for n in ("sd1", "sd2", "sdxl", "ssd1b", "vega"))
    s = sd1.weight_shapes()
    assert len(s) == 686 and sum(int(np.prod(v)) for v in s.values()) == 859_520_964   # SD1.5 UNet
    assert s["input_blocks.1.1.proj_in.weight"] == (320, 320, 1, 1)
    assert s["output_blocks.2.1.conv.weight"] == (1280, 1280, 3, 3)
    assert s["output_blocks.5.2.conv.weight"] == (1280, 1280, 3, 3)
    assert sd2.weight_shapes()["input_blocks.1.1.proj_in.weight"] == (320, 320)
    assert sum(int(np.prod(v)) for v in sd2.weight_shapes().values()) == 865_910_724  # SD2.1
    x = xl.weight_shapes()
    assert len(x) == 1680 and sum(int(np.prod(v)) for v in x.values()) == 2_567_463_684  # SDXL base
    assert x["label_emb.0.0.weight"] == (1280, 2816) and "middle_block.1.transformer_blocks.9.norm3.bias" in x
    assert "middle_block.1.norm.weight" not in ssd.weight_shapes() and ssd.transformer_depth_output == (4, 4, 10, 2, 1, 1)
    assert vega.transformer_depth == (1, 1, 2, 2) and vega.transformer_depth_middle == -1
    assert UNetConfig.preset("sd1", in_channels=9).weight_shapes()["input_blocks.0.0.weight"] == (320, 9, 3, 3)


def test_tiny_unet_layout_skipped_blocks():
    """Distilled tiny UNets leave blocks out (no middle block, input_blocks.2 missing, an
    upsampler alone in its output block): the layout follows the names."""
    cfg = UNetConfig.preset("sd1", num_res_blocks=1, channel_mult=(1, 2), model_channels=32,
                            context_dim=16, attention_levels=(0,))
    ib = dict(cfg.input_blocks)
    ob = list(cfg.output_blocks)
    # renumber as BK-SDM does: input 1 (res+attn), [2 gone], 3 down, 4 res; no middle;
    # output 0 res, 1 res, 2.1 upsample alone, 3 res+attn, 4 res+attn
    inputs = ((1, ib[1]), (3, ib[2]), (4, ib[3]))
    up = ob[1][1][-1][1]
    outputs = ((0, ob[0][1]), (1, ob[1][1][:-1]), (2, ((1, up),)), (3, ob[2][1]), (4, ob[3][1]))
    tiny = dataclasses.replace(cfg, input_blocks=inputs, middle_block=(), output_blocks=outputs, num_groups=8)
    rng = np.random.default_rng(0)
    table = {PREFIX + k: Tensor.from_numpy((rng.standard_normal(s) * 0.2).astype(np.float32))
             for k, s in tiny.weight_shapes().items()}
    got = UNetConfig.detect_from_weights(table, num_groups=8)
    assert got == tiny
    tiny.check()
    out = UNetModel(table)  # detects itself (no config given) with 32 groups: 32/64 channels fit
    y = out(rng.standard_normal((1, 4, 8, 8)), [10.0], rng.standard_normal((1, 3, 16)))
    assert y.shape == (1, 4, 8, 8) and np.isfinite(y).all()


# ---- errors -----------------------------------------------------------------------------------

def test_missing_and_misshapen_tensors_are_named():
    table, _, meta = load("sd1")
    t = dict(table)
    del t[PREFIX + "output_blocks.4.1.transformer_blocks.0.attn2.to_v.weight"]
    cfg = UNetConfig.detect_from_weights(table, **meta["sdrt_overrides"])
    with pytest.raises(ModelFileError, match=r"x.safetensors: missing tensor '.*output_blocks\.4\.1\..*attn2\.to_v"):
        UNetModel(t, config=cfg, source="x.safetensors")
    t = dict(table)
    t[PREFIX + "input_blocks.1.0.emb_layers.1.bias"] = Tensor.from_numpy(np.zeros(3, np.float32))
    with pytest.raises(ModelFileError, match=r"input_blocks\.1\.0\.emb_layers\.1\.bias' has shape \[3\]"):
        UNetModel(t, config=cfg)
    t = {k: v for k, v in table.items() if not k.endswith("input_blocks.0.0.weight")}
    with pytest.raises(ModelFileError, match="missing tensor 'model.diffusion_model.input_blocks.0.0.weight'"):
        UNetConfig.detect_from_weights(t)
    t = dict(table)
    t[PREFIX + "input_blocks.1.2.weird.weight"] = Tensor.from_numpy(np.zeros(3, np.float32))
    with pytest.raises(ModelFileError, match=r"input_blocks\.1\.2: not a ResBlock"):
        UNetConfig.detect_from_weights(t)
    t = dict(table)
    t[PREFIX + "input_blocks.1.0.time_stack.in_layers.0.weight"] = Tensor.from_numpy(np.zeros(3, np.float32))
    with pytest.raises(ModelFileError, match="SVD"):
        UNetConfig.detect_from_weights(t)
    bad = dataclasses.replace(cfg, output_blocks=cfg.output_blocks[1:])  # one block short of skips
    with pytest.raises(ModelFileError, match=r"output_blocks\.5\.0 takes 48 channels, but 64 arrive"):
        bad.check()


def test_bad_arguments():
    _, a, _ = load("sdxl")
    m = model("sdxl")
    with pytest.raises(UsageError, match="needs y"):
        m(a["x"], a["t"], a["context"])
    with pytest.raises(UsageError, match="y has 3 features"):
        m(a["x"], a["t"], a["context"], a["y"][:, :3])
    with pytest.raises(UsageError, match="x .* has 5 channels"):
        m(np.zeros((2, 5, 16, 16)), a["t"], a["context"], a["y"])
    with pytest.raises(UsageError, match="context has width 8"):
        m(a["x"], a["t"], a["context"][..., :8], a["y"])
    with pytest.raises(UsageError, match="3 timesteps for a batch of 2"):
        m(a["x"], [1.0, 2.0, 3.0], a["context"], a["y"])
    with pytest.raises(UsageError, match="no label_emb"):
        model("sd2")(a["x"], a["t"], a["context"], a["y"])
    with pytest.raises(UsageError, match="unknown UNet preset 'sd3'"):
        UNetConfig.preset("sd3")
    with pytest.raises(UsageError, match="numerics"):
        dataclasses.replace(m.config, numerics="fast").check()


# ---- graph: cut points and budget ---------------------------------------------------------------

def _graph(case, H=16):
    _table, a, _meta = load(case)
    m = model(case)
    x = Tensor.from_numpy(np.zeros((2, 4, H, H), np.float32))
    out = m.forward(x, Tensor.from_numpy(a["t"]), Tensor.from_numpy(a["context"]))
    return F.Graph(out)


def test_cut_points_name_the_blocks():
    g = _graph("sd1")
    names = [n.cut for n in g.cut_nodes]
    assert names == [f"input_blocks.{i}" for i in range(9)] + ["middle_block"] + [f"output_blocks.{i}" for i in range(9)]


def test_budget_sd1_tiny():
    """Node count and planned intermediate memory of the tiny SD1 graph (16x16, batch 2)."""
    g = _graph("sd1")
    plan = g.plan()
    assert len(g.nodes) == 534  # 545 before GEGLU was one op (11 transformer blocks)
    assert sum(n.op == "geglu" for n in g.nodes) == 11 and not any(n.op.startswith("gelu") for n in g.nodes)
    assert len(plan.segments) == 20
    assert plan.peak_bytes <= 1_140_000, plan.peak_bytes  # 1_139_200 when written


def test_budget_sd15_full_size_plan():
    """The real SD1.5 graph at 64x64, batch 2, planned on zero-stride stand-in weights (no data,
    nothing runs): node count and the planned peak of intermediates."""
    cfg = UNetConfig.preset("sd1")
    one = np.zeros(2, np.uint8)
    table = {PREFIX + k: Tensor.from_buffer(one, "F16", s[::-1], nb=(0,) * len(s)) for k, s in cfg.weight_shapes().items()}
    m = UNetModel(table, config=cfg)
    x = Tensor.from_numpy(np.zeros((2, 4, 64, 64), np.float32))
    out = m.forward(x, Tensor.from_numpy(np.zeros(2, np.float32)), Tensor.from_numpy(np.zeros((2, 77, 768), np.float32)))
    g = F.Graph(out)
    plan = g.plan()
    assert len(g.nodes) == 749  # 765 before GEGLU was one op (16 transformer blocks)
    assert plan.peak_bytes <= 400 * 2**20, plan.peak_bytes / 2**20
