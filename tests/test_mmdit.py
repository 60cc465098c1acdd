"""SD3 / SD3.5 MMDiT against diffusers goldens (tools/make_sd3_goldens.py), the diffusers -> SAI
conversion, detection of SD3 Medium / SD3.5 Large / SD3.5 Medium from shapes, skip layers,
errors and the full-size graph. No torch here."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.diffusion.mmdit import PREFIX, MMDiTConfig, MMDiTModel, find_prefix
from sdrt.models.diffusion.mmdit_names import convert_diffusers_sd3, diffusers_to_sai_plan
from sdrt.models.diffusion.flux_names import Part, apply_part
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sd3_mmdit.npz")
CASES = ("sd3m", "sd35l", "sd35m")
_cache: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def fixture():
    if "z" not in _cache:
        z = np.load(FIX)
        _cache["z"] = {k: z[k] for k in z.files}
    return _cache["z"]


def diffusers_state(case):
    return {k.split(":w:")[1]: v for k, v in fixture().items() if k.startswith(case + ":w:")}


def table(case, dtype=None, prefix=PREFIX):
    out = {}
    for k, v in convert_diffusers_sd3(diffusers_state(case), prefix).items():
        v = np.ascontiguousarray(v)
        out[k] = Tensor.from_numpy(v.astype(np.float32)) if dtype == "F32" else Tensor.from_numpy(v)  # fixture f16
    return out


def inputs(case):
    z = fixture()
    args = tuple(z[f"{case}:{k}"] for k in ("x", "t", "context", "y"))
    skip = [int(s) for s in z[f"{case}:skip"]] if f"{case}:skip" in z else None
    return args, skip, z[f"{case}:out"]


def model(case, dtype=None, prefix=PREFIX):
    if (case, dtype, prefix) not in _cache:
        _cache[(case, dtype, prefix)] = MMDiTModel(table(case, dtype, prefix), prefix)
    return _cache[(case, dtype, prefix)]


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


# ---- goldens ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES + ("sd35l_skip",))
def test_matches_diffusers(case):
    args, skip, ref = inputs(case)
    out = model(case.replace("_skip", ""), "F32")(*args, skip_layers=skip)
    assert out.shape == ref.shape == (2, 16, 6, 8) and out.dtype == np.float32
    assert rel_err(out, ref) <= 1e-4          # 3e-6..6e-6 when written


def test_f16_weights_and_no_prefix():
    """The fixture's f16 tensors as they are (the golden ran on the same values in f32), and a
    table without `model.diffusion_model.`."""
    args, _, ref = inputs("sd35m")
    assert rel_err(model("sd35m")(*args), ref) <= 2e-3
    assert rel_err(model("sd35m", "F32", prefix="")(*args), ref) <= 1e-4
    assert find_prefix(table("sd35m")) == PREFIX and find_prefix(table("sd35m", prefix="")) == ""


def test_q8_0_weights_loosely():
    """Q8_0 matrices (2-D weights whose rows are whole 32-blocks, as sd.cpp's convert types them)
    run through the same graph and stay near the golden."""
    quant = pytest.importorskip("sdrt.ops.quant")
    from sdrt.io.writer import tensor_should_be_converted
    from sdrt.ops import dtypes as D
    dt = D.get("Q8_0")
    tab = {}
    for k, t in table("sd3m", "F32").items():
        v = t.numpy()
        if v.ndim == 2 and tensor_should_be_converted(k, t.ne, dt):
            tab[k] = Tensor.from_numpy(quant.quantize(np.ascontiguousarray(v), dt), "Q8_0")
        else:
            tab[k] = t
    assert sum(t.dtype.name == "Q8_0" for t in tab.values()) >= 15
    args, _, ref = inputs("sd3m")
    from sdrt.ops.quant import gemm as qgemm
    with qgemm.using_path("off"):  # dequantized weights, float32 activations
        e = rel_err(MMDiTModel(tab)(*args), ref)
    assert 1e-5 < e <= 1e-2, e
    # the default int8-activation kernel (as ggml) rounds the activations too: about twice the error
    e8 = rel_err(MMDiTModel(tab)(*args), ref)
    assert 1e-5 < e8 <= 2.5e-2, e8


def test_skip_layers_change_the_output_and_reuse_graphs():
    """Skipping a block changes the velocity; each skip set is its own graph, the plain one is reused."""
    m = model("sd35l", "F32")
    args, _, _ = inputs("sd35l")
    base = m(*args)
    assert rel_err(m(*args, skip_layers=[1]), base) > 1e-2
    assert rel_err(m(*args, skip_layers={2}), base) > 1e-2     # the pre-only last block: its x half counts
    np.testing.assert_array_equal(m(*args, skip_layers=[]), base)
    with pytest.raises(UsageError, match=r"skip layers \[3\] out of range"):
        m(*args, skip_layers=[3])


def test_predict_takes_a_cond():
    from sdrt.models.families import Cond
    (x, t, ctx, y), _, ref = inputs("sd35l_skip")
    m = model("sd35l", "F32")
    assert rel_err(m.predict(x, t, Cond(ctx, y), skip_layers=[1]), ref) <= 1e-4
    with pytest.raises(UsageError, match="no concat latents"):
        m.predict(x, t, Cond(ctx, y, c_concat=x))


def test_batch1_conditioning_broadcasts_and_timestep_matters():
    (x, t, ctx, y), _, ref = inputs("sd3m")
    m = model("sd3m", "F32")
    one = m(x[:1], t[:1], ctx[:1], y[:1])
    two = m(np.concatenate([x[:1], x[:1]]), t[:1].repeat(2), ctx[:1], y[:1])
    np.testing.assert_allclose(two[1], one[0], rtol=0, atol=1e-5)
    assert rel_err(one, ref[:1]) <= 1e-4
    assert rel_err(m(x[:1], t[:1] - 100, ctx[:1], y[:1]), one) > 1e-3
    assert rel_err(m(x[:1], t[:1], ctx[:1], y[:1] + 0.5), one) > 1e-3


def test_odd_latent_is_padded_then_cropped():
    """sd.cpp pads h, w to the patch with zeros and crops the output (pos_embed cropped for
    (h + 1) // 2 rows): equal to running the padded latent and cropping."""
    args, _, _ = inputs("sd35m")
    m = model("sd35m", "F32")
    x = args[0][:, :, :5, :7]
    padded = np.zeros_like(args[0])
    padded[:, :, :5, :7] = x
    out = m(x, *args[1:])
    assert out.shape == (2, 16, 5, 7)
    np.testing.assert_allclose(out, m(padded, *args[1:])[:, :, :5, :7], rtol=0, atol=1e-5)


# ---- the diffusers -> SAI conversion ----------------------------------------------------------

def test_conversion_plan():
    names = list(diffusers_state("sd35m"))
    plan = diffusers_to_sai_plan(names)
    assert plan["joint_blocks.1.x_block.attn.qkv.weight"].sources == tuple(
        f"transformer_blocks.1.attn.to_{c}.weight" for c in "qkv")
    assert plan["joint_blocks.0.context_block.attn.qkv.bias"].sources == tuple(
        f"transformer_blocks.0.attn.add_{c}_proj.bias" for c in "qkv")
    assert plan["joint_blocks.1.x_block.attn2.qkv.weight"].sources == tuple(
        f"transformer_blocks.1.attn2.to_{c}.weight" for c in "qkv")
    assert plan["joint_blocks.0.context_block.attn.ln_k.weight"].sources == ("transformer_blocks.0.attn.norm_added_k.weight",)
    assert plan["pos_embed"] == Part(("pos_embed.pos_embed",), False)
    assert plan["x_embedder.proj.weight"] == Part(("pos_embed.proj.weight",), False)
    # (scale, shift) -> (shift, scale): the final layer and the last, pre-only context block only
    assert plan["final_layer.adaLN_modulation.1.weight"].swap_halves
    assert plan["joint_blocks.2.context_block.adaLN_modulation.1.bias"].swap_halves
    assert not plan["joint_blocks.1.context_block.adaLN_modulation.1.bias"].swap_halves
    used = [s for p in plan.values() for s in p.sources]
    assert sorted(used) == sorted(names)
    for case in CASES:
        cfg = MMDiTConfig.detect_from_weights(table(case))
        assert set(diffusers_to_sai_plan(diffusers_state(case))) == set(cfg.weight_shapes())
    assert set(diffusers_to_sai_plan("transformer." + n for n in names)) == set(plan)


@pytest.mark.parametrize("name", ["final_layer.adaLN_modulation.1", "joint_blocks.1.context_block.adaLN_modulation.1"])
def test_conversion_swaps_are_needed(name):
    """Without exchanging the halves (a plain rename, as sdrt.models.names' SD3 map does) the output is wrong."""
    state = diffusers_state("sd3m")
    src = {"final_layer.adaLN_modulation.1": "norm_out.linear",
           "joint_blocks.1.context_block.adaLN_modulation.1": "transformer_blocks.1.norm1_context.linear"}[name]
    tab = table("sd3m", "F32")
    for leaf in ("weight", "bias"):
        v = apply_part(Part((f"{src}.{leaf}",), False), state).astype(np.float32)
        tab[f"{PREFIX}{name}.{leaf}"] = Tensor.from_numpy(np.ascontiguousarray(v))
    args, _, ref = inputs("sd3m")
    assert rel_err(MMDiTModel(tab)(*args), ref) > 1e-2


def test_conversion_errors():
    names = list(diffusers_state("sd35l"))
    with pytest.raises(ModelFileError, match="unknown tensor 'transformer_blocks.0.attn.foo.weight'"):
        diffusers_to_sai_plan(names + ["transformer_blocks.0.attn.foo.weight"])
    with pytest.raises(ModelFileError, match="missing transformer_blocks.0.attn.add_v_proj.weight"):
        diffusers_to_sai_plan([n for n in names if n != "transformer_blocks.0.attn.add_v_proj.weight"])


# ---- detection, errors -----------------------------------------------------------------------

def test_detect_variants_from_shapes():
    m = MMDiTConfig.detect_from_weights(table("sd3m"))
    assert (m.variant, m.depth, m.hidden_size, m.num_heads, m.head_dim, m.qk_norm) == ("sd3-medium", 2, 128, 2, 64, "")
    assert (m.mlp_hidden, m.pos_embed_max_size, m.context_in_dim, m.adm_in_channels) == (512, 8, 32, 24)
    assert (m.patch_size, m.in_channels, m.out_channels, m.dual_attention_layers) == (2, 16, 16, ())
    lg = MMDiTConfig.detect_from_weights(table("sd35l"))
    assert (lg.variant, lg.depth, lg.num_heads, lg.head_dim, lg.qk_norm) == ("sd3.5-large", 3, 2, 16, "rms")
    md = MMDiTConfig.detect_from_weights(table("sd35m"))
    assert (md.variant, md.dual_attention_layers, md.pos_embed_max_size) == ("sd3.5-medium", (0, 1), 10)


@pytest.mark.parametrize("variant,shape", [
    ("sd3-medium", dict(hidden_size=1536, depth=24, num_heads=24, mlp_hidden=6144, pos_embed_max_size=192)),
    ("sd3.5-large", dict(hidden_size=2432, depth=38, num_heads=38, mlp_hidden=9728, pos_embed_max_size=192,
                         qk_norm="rms")),
    ("sd3.5-medium", dict(hidden_size=1536, depth=24, num_heads=24, mlp_hidden=6144, pos_embed_max_size=384,
                          qk_norm="rms", dual_attention_layers=tuple(range(13))))])
def test_full_size_detection_and_graph(variant, shape):
    """The released shapes, on zero-stride stand-in weights (no data, nothing runs): detection
    gives the config back, and a 1024x1024 graph has one attention per stream per block with
    no tokens x tokens node."""
    cfg = MMDiTConfig(**shape)
    one = np.zeros(2, np.uint8)
    tab = {PREFIX + k: Tensor.from_buffer(one, "BF16", s[::-1], nb=(0,) * len(s)) for k, s in cfg.weight_shapes().items()}
    got = MMDiTConfig.detect_from_weights(tab)
    assert got == cfg and got.variant == variant
    m = MMDiTModel(tab, config=cfg)
    z = lambda *s: Tensor.from_numpy(np.zeros(s, np.float32))  # noqa: E731
    out = m.forward(z(1, 16, 128, 128), z(1), z(1, 154, 4096), z(1, 2048))
    assert out.ne == (128, 128, 16, 1)
    g = F.Graph(out)
    L = 4096 + 154
    att = [n for n in g.nodes if n.op == "attention"]
    assert len(att) == cfg.depth + len(cfg.dual_attention_layers)
    assert sum(n.ne == (64, L, cfg.num_heads, 1) for n in att) == cfg.depth
    assert not any(list(n.ne).count(L) >= 2 or list(n.ne).count(4096) >= 2 for n in g.nodes)
    assert [n.cut for n in g.cut_nodes][-1] == f"mmdit.joint_blocks.{cfg.depth - 1}.x"


def test_errors_name_the_tensor():
    tab = table("sd35m")
    bad = dict(tab)
    del bad[PREFIX + "joint_blocks.1.x_block.attn2.proj.bias"]
    with pytest.raises(ModelFileError, match="missing tensor 'model.diffusion_model.joint_blocks.1.x_block.attn2.proj.bias'"):
        MMDiTModel(bad)
    bad = dict(tab)
    bad[PREFIX + "joint_blocks.0.context_block.mlp.fc2.weight"] = Tensor.from_numpy(np.zeros((32, 64), np.float16))
    with pytest.raises(ModelFileError, match=r"joint_blocks.0.context_block.mlp.fc2.weight' has shape \[32, 64\]"):
        MMDiTModel(bad)
    bad = dict(tab)
    bad[PREFIX + "pos_embed"] = Tensor.from_numpy(np.zeros((1, 99, 32), np.float16))
    with pytest.raises(ModelFileError, match="pos_embed holds 99 positions"):
        MMDiTModel(bad)
    with pytest.raises(ModelFileError, match="no joint_blocks"):
        MMDiTConfig.detect_from_weights({k: v for k, v in tab.items() if ".joint_blocks." not in k})
    with pytest.raises(ModelFileError, match="missing tensor 'model.diffusion_model.x_embedder.proj.weight'"):
        MMDiTConfig.detect_from_weights({k: v for k, v in tab.items() if "x_embedder" not in k})
    with pytest.raises(ModelFileError, match="no SD3 MMDiT"):
        find_prefix({"foo.weight": tab[PREFIX + "pos_embed"]})
    m = MMDiTModel(tab)
    (x, t, ctx, y), _, _ = inputs("sd35m")
    with pytest.raises(UsageError, match="pooled text vector"):
        m(x, t, ctx, None)
    with pytest.raises(UsageError, match="context has width 7"):
        m(x, t, ctx[..., :7], y)
    with pytest.raises(UsageError, match="channels"):
        m(x[:, :4], t, ctx, y)
    with pytest.raises(UsageError, match="does not fit the 10x10 position embedding"):
        m(np.zeros((1, 16, 22, 8), np.float32), t[:1], ctx[:1], y[:1])


def test_quantized_qk_norm_weight_is_dequantized():
    """sd-cli's convert quantizes the 64-wide ln_q/ln_k weights (1-D, whole 32-blocks, not a bias or
    scale); the norm runs on their dequantized values."""
    quant = pytest.importorskip("sdrt.ops.quant")
    from sdrt.models.common import Weights
    from sdrt.models.diffusion.mmdit_blocks import QKNorm
    from sdrt.ops import dtypes as D
    rng = np.random.default_rng(5)
    wv = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    q8 = Tensor.from_numpy(quant.quantize(wv.reshape(1, 64), D.get("Q8_0")), "Q8_0").reshape(64)
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    got = F.evaluate(QKNorm(Weights({"weight": q8}), "rms")(Tensor.from_numpy(x))).to_f32()
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * q8.to_f32()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# ---- the random-weight checkpoint maker ---------------------------------------------------------

def _maker():
    import importlib.util
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tools"))
    spec = importlib.util.spec_from_file_location("make_sd3_checkpoint", os.path.join(root, "tools", "make_sd3_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checkpoint_layouts_have_the_released_sizes():
    """Parameter counts of the released models (SD3 Medium 2.08 B, SD3.5 Large 8.15 B, SD3.5 Medium
    2.47 B; CLIP-L 123.65 M and bigG 694.66 M with projections; T5-XXL encoder 4.76 B), and
    reduced depths keep the widths and the pre-only last context block."""
    mk = _maker()
    count = lambda s: sum(int(np.prod(v)) for v in s.values())  # noqa: E731
    assert count(mk.transformer_config("sd3-medium").weight_shapes()) == 2_084_951_104
    assert count(mk.transformer_config("sd3.5-large").weight_shapes()) == 8_146_280_768
    assert count(mk.transformer_config("sd3.5-medium").weight_shapes()) == 2_469_663_936
    assert [count(mk.te_layout(t)) for t in ("clip_l", "clip_g", "t5xxl")] == [123_650_304, 694_659_840, 4_762_310_656]
    small = mk.transformer_config("sd3.5-medium", depth=3)
    assert small.dual_attention_layers == (0, 1, 2) and small.hidden_size == 1536
    shapes = small.weight_shapes()
    assert "joint_blocks.2.context_block.mlp.fc1.weight" not in shapes
    assert shapes["joint_blocks.2.context_block.adaLN_modulation.1.weight"] == (2 * 1536, 1536)
    table, key_of = mk.build_table("all+te", "sd3.5-large", 2)
    assert "text_encoders.clip_g.transformer.text_projection.weight" in table
    assert "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in table
    assert "first_stage_model.decoder.conv_in.weight" in table and key_of("x") == "x"
    bare, key_of = mk.build_table("transformer", "sd3.5-large", 2)
    assert "pos_embed" in bare and key_of("pos_embed") == "model.diffusion_model.pos_embed"
    # the same values alone and in the combined file; QK norms near 1
    v = mk.values("model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight", (64,), 0)
    assert abs(float(v.mean()) - 1) < 0.05


def test_checkpoint_maker_writes_a_loadable_file(tmp_path, monkeypatch):
    """A narrowed SD3.5 Medium (the maker's real code path, widths shrunk so the test is quick)
    written as Q8_0 GGUF and as bf16 safetensors loads, is detected and runs."""
    mk = _maker()
    from sdrt.io import open_model
    monkeypatch.setitem(mk.VARIANTS, "sd3.5-medium", dict(hidden_size=64, depth=24, num_heads=1, mlp_hidden=256,
                                                          pos_embed_max_size=16, qk_norm="rms",
                                                          dual_attention_layers=tuple(range(13))))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
    ctx, y = rng.standard_normal((1, 4, 4096)).astype(np.float32), rng.standard_normal((1, 2048)).astype(np.float32)
    outs = []
    for kind, name in (("bf16", "m.safetensors"), ("q8_0", "m.gguf")):
        path = str(tmp_path / name)
        mk.main(["--variant", "sd3.5-medium", "--depth", "2", "--component", "transformer", "--type", kind, "-o", path])
        tab = open_model(path).tensors
        assert find_prefix(tab) == ""
        m = MMDiTModel(tab, "")
        assert (m.config.variant, m.config.depth, m.config.dual_attention_layers) == ("sd3.5-medium", 2, (0, 1))
        outs.append(m(x, [700.0], ctx, y))
    assert np.isfinite(outs[0]).all() and 1e-4 < rel_err(outs[1], outs[0]) < 5e-2
