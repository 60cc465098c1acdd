"""Flux.1 transformer against diffusers goldens (tools/make_flux_goldens.py), the diffusers -> BFL
conversion, config detection, RoPE ids/pe, errors and the full-size graph budget. No torch here."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.errors import UnsupportedError
from sdrt.models.diffusion.flux import PREFIX, FluxConfig, FluxModel, fill_concat, find_prefix, flux_ids, flux_pe
from sdrt.models.diffusion.flux_names import Part, apply_part, convert_diffusers_flux, diffusers_to_bfl_plan
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "flux_transformer.npz")
AXES = (4, 6, 6)
_cache: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def fixture():
    if "z" not in _cache:
        z = np.load(FIX)
        _cache["z"] = {k: z[k] for k in z.files}
    return _cache["z"]


def diffusers_state(case):
    z = fixture()
    return {k.split(":w:")[1]: v for k, v in z.items() if k.startswith(case + ":w:")}


def table(case, dtype=None, prefix=PREFIX):
    out = {}
    for k, v in convert_diffusers_flux(diffusers_state(case), prefix).items():
        v = np.ascontiguousarray(v)
        if dtype == "F32":
            t = Tensor.from_numpy(v.astype(np.float32))
        elif dtype == "BF16":
            t = Tensor.from_numpy(_bf16(v), "BF16")
        else:
            t = Tensor.from_numpy(v)  # the fixture's f16
        out[k] = t
    return out


def _bf16(v):
    """float32 -> bf16 bits (round to nearest even), as uint16."""
    b = np.ascontiguousarray(v, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def inputs(case):
    z = fixture()
    g = lambda k: z.get(f"{case}:{k}")
    refs = [g("ref")] if g("ref") is not None else []
    return (g("x"), g("t"), g("context"), g("y"), g("guidance"), g("c_concat"), refs), g("out")


def run(case, dtype=None, **kw):
    wcase = "dev" if case == "kontext" else case
    m = FluxModel(table(wcase, dtype), config=FluxConfig.detect_from_weights(table(wcase, dtype), axes_dim=AXES))
    args, ref = inputs(case)
    return m(*args, **kw), ref


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


# ---- goldens ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["dev", "schnell", "fill", "kontext"])
def test_matches_diffusers(case):
    out, ref = run(case)
    assert out.shape == ref.shape == (2, 16, 6, 8) and out.dtype == np.float32
    assert rel_err(out, ref) <= 1e-4


def test_f32_weights_match_and_bf16_loosely():
    out, ref = run("dev", "F32")
    assert rel_err(out, ref) <= 1e-4
    out, ref = run("dev", "BF16")          # bf16-rounded weights: a different model, close by
    e = rel_err(out, ref)
    assert 1e-4 < e <= 5e-2, e


@pytest.mark.parametrize("qtype,tol", [("Q8_0", 1e-2), ("Q4_0", 1.5e-1)])  # 4.9e-3, 7.0e-2 when written
def test_quantized_weights_loosely(qtype, tol):
    """Block-quantized matrices (every 2-D weight whose rows are whole 32-blocks, as sd.cpp's
    convert types them) run through the same graph and stay near the golden."""
    quant = pytest.importorskip("sdrt.ops.quant")
    from sdrt.io.writer import tensor_should_be_converted
    from sdrt.ops import dtypes as D
    dt = D.get(qtype)
    tab = {}
    for k, t in table("dev", "F32").items():
        v = t.numpy()
        if v.ndim == 2 and tensor_should_be_converted(k, t.ne, dt):
            tab[k] = Tensor.from_numpy(quant.quantize(np.ascontiguousarray(v), dt), qtype)
        else:
            tab[k] = t
    assert sum(t.dtype.name == qtype for t in tab.values()) >= 20
    m = FluxModel(tab, config=FluxConfig.detect_from_weights(tab, axes_dim=AXES))
    args, ref = inputs("dev")
    e = rel_err(m(*args), ref)
    assert 1e-4 < e <= tol, e


def test_guidance_and_timestep_matter():
    """Each conditioning input moves the output (no path is dead)."""
    args, ref = inputs("dev")
    m = FluxModel(table("dev"), config=FluxConfig.detect_from_weights(table("dev"), axes_dim=AXES))
    base = m(*args)
    for i, bump in ((1, 0.1), (4, 1.0)):   # timestep, guidance
        a = list(args)
        a[i] = a[i] + bump
        assert rel_err(m(*a), base) > 1e-3
    assert len(m._graphs) == 1  # same shapes: one graph, reused


def test_batch1_conditioning_broadcasts():
    """context / y with batch 1 are repeated to the batch of x (sd.cpp's ggml_repeat)."""
    (x, t, ctx, y, g, _, _), ref = inputs("dev")
    m = FluxModel(table("dev"), config=FluxConfig.detect_from_weights(table("dev"), axes_dim=AXES))
    one = m(x[:1], t[:1], ctx[:1], y[:1], g[:1])
    two = m(np.concatenate([x[:1], x[:1]]), t[:1].repeat(2), ctx[:1], y[:1], g[:1].repeat(2))
    np.testing.assert_allclose(two[1], one[0], rtol=0, atol=1e-5)
    assert rel_err(one, ref[:1]) <= 1e-4
    with pytest.raises(UsageError, match="context has batch 2, x has 3"):
        m(np.concatenate([x, x[:1]]), np.ones(3, np.float32), ctx, y[:1], np.ones(3, np.float32))


def test_odd_latent_is_padded_then_cropped():
    """sd.cpp pads h, w to even with zeros and crops the output: equal to running the padded
    latent and cropping (the pad is exact, the ids use (h + 1) // 2 rows)."""
    args, _ = inputs("schnell")
    m = FluxModel(table("schnell"), config=FluxConfig.detect_from_weights(table("schnell"), axes_dim=AXES))
    x = args[0][:, :, :5, :7]
    padded = np.zeros_like(args[0])
    padded[:, :, :5, :7] = x
    out = m(x, *args[1:4])
    assert out.shape == (2, 16, 5, 7)
    np.testing.assert_allclose(out, m(padded, *args[1:4])[:, :, :5, :7], rtol=0, atol=1e-5)


def test_chroma_matches_diffusers():
    """Chroma: the approximator's modulations, T5 context only, the text mask as an additive key
    mask (0 / -inf; diffusers' boolean pairwise mask gives the same image tokens). Tolerance 3e-4:
    the modulation index embedding takes sin/cos of up to 31,000 (1000 j) in float32, where
    diffusers' and ggml's (sdrt's) roundings differ by up to 5e-4 (each ~1e-3 from float64)."""
    z = fixture()
    tab = table("chroma")
    cfg = FluxConfig.detect_from_weights(tab, axes_dim=AXES, chroma_mod_layout="counted")  # diffusers'
    assert cfg.is_chroma and (cfg.vec_in_dim, cfg.guidance_embed) == (0, False)
    assert f"{PREFIX}distilled_guidance_layer.norms.1.scale" in tab
    assert f"{PREFIX}distilled_guidance_layer.layers.0.in_layer.weight" in tab
    m = FluxModel(tab, config=cfg)
    mask = np.where(z["chroma:mask"] > 0, 0.0, -np.inf).astype(np.float32)
    ref = z["chroma:out"]
    out = m(z["chroma:x"], z["chroma:t"], z["chroma:context"], txt_mask_np=mask)
    assert rel_err(out, ref) <= 3e-4
    # without the mask, the sample whose last tokens were masked changes; the other does not
    nomask = m(z["chroma:x"], z["chroma:t"], z["chroma:context"])
    assert rel_err(nomask[1], ref[1]) > 1e-2 and rel_err(nomask[0], ref[0]) <= 3e-4
    # sd.cpp's layout (344 indices at 19/38-block offsets) differs on this 2/2-block model
    sd = FluxModel(tab, config=FluxConfig.detect_from_weights(tab, axes_dim=AXES))
    assert sd.config.chroma_mod_layout == "sdcpp"
    assert rel_err(sd(z["chroma:x"], z["chroma:t"], z["chroma:context"], txt_mask_np=mask), ref) > 1e-2
    plan = diffusers_to_bfl_plan(diffusers_state("chroma"))
    assert {PREFIX + k for k in plan} == set(tab) == {PREFIX + k for k in cfg.weight_shapes()}
    assert (cfg.approx_hidden, cfg.approx_layers) == (48, 2)
    with pytest.raises(UsageError, match="txt_mask is Chroma's"):
        FluxModel(table("schnell"), config=FluxConfig.detect_from_weights(table("schnell"), axes_dim=AXES))(
            *inputs("schnell")[0][:4], txt_mask_np=mask)


def test_chroma_mod_layouts_agree_at_full_depth():
    """sd.cpp's fixed layout and the counted one pick the same modulation indices for the
    released 19/38-block Chroma (stand-in weights; only the views' offsets are compared)."""
    cfg = FluxConfig(is_chroma=True, guidance_embed=False, vec_in_dim=0)
    one = np.zeros(2, np.uint8)
    tab = {PREFIX + k: Tensor.from_buffer(one, "BF16", s[::-1], nb=(0,) * len(s)) for k, s in cfg.weight_shapes().items()}
    t = Tensor.from_numpy(np.zeros(1, np.float32))

    def offsets(layout):
        single, double, final = FluxModel(tab, config=FluxConfig(**{**cfg.__dict__, "chroma_mod_layout": layout}))._chroma_mods(t, 1)
        row = single[0][0].nb[1]
        flat = [v for blk in single for v in blk] + [v for i, tx in double for v in i + tx] + list(final)
        return [v.offset // row for v in flat]

    a = offsets("sdcpp")
    assert a == offsets("counted") and sorted(a) == list(range(344))


def test_fill_concat_folds_the_mask():
    """Channel 8*py + px of latent pixel (y, x) is mask[8y + py, 8x + px]: an impulse lands there."""
    lat = np.arange(2 * 16 * 3 * 4, dtype=np.float32).reshape(2, 16, 3, 4)
    mask = np.zeros((2, 24, 32), np.float32)
    mask[1, 8 * 2 + 5, 8 * 3 + 6] = 1.0
    c = fill_concat(lat, mask)
    assert c.shape == (2, 80, 3, 4) and np.array_equal(c[:, :16], lat)
    hot = np.argwhere(c[:, 16:])
    assert hot.tolist() == [[1, 8 * 5 + 6, 2, 3]]
    with pytest.raises(UsageError, match="mask shape"):
        fill_concat(lat, mask[:, :16])


# ---- the diffusers -> BFL conversion ----------------------------------------------------------

def test_conversion_plan():
    names = list(diffusers_state("dev"))
    plan = diffusers_to_bfl_plan(names)
    assert plan["double_blocks.1.img_attn.qkv.weight"].sources == tuple(
        f"transformer_blocks.1.attn.to_{c}.weight" for c in "qkv")
    assert plan["double_blocks.0.txt_attn.qkv.bias"].sources == tuple(
        f"transformer_blocks.0.attn.add_{c}_proj.bias" for c in "qkv")
    assert plan["single_blocks.1.linear1.weight"].sources == tuple(
        f"single_transformer_blocks.1.{p}.weight" for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
    assert plan["final_layer.adaLN_modulation.1.weight"] == Part(("norm_out.linear.weight",), True)
    assert plan["double_blocks.0.txt_attn.norm.key_norm.scale"].sources == ("transformer_blocks.0.attn.norm_added_k.weight",)
    # every diffusers tensor is used exactly once; the BFL set is the detected layout's
    used = [s for p in plan.values() for s in p.sources]
    assert sorted(used) == sorted(names)
    cfg = FluxConfig.detect_from_weights(table("dev", prefix=""), prefix="", axes_dim=AXES)
    assert set(plan) == set(cfg.weight_shapes())
    # prefixes are accepted
    assert set(diffusers_to_bfl_plan("transformer." + n for n in names)) == set(plan)


def test_conversion_swap_is_needed():
    """Without exchanging norm_out's (scale, shift) halves the output is wrong: the swap is what
    diffusers' own single-file loader does (sd.cpp's name map does not)."""
    state = diffusers_state("dev")
    tab = table("dev")
    for leaf in ("weight", "bias"):
        v = apply_part(Part((f"norm_out.linear.{leaf}",), False), state)
        tab[f"{PREFIX}final_layer.adaLN_modulation.1.{leaf}"] = Tensor.from_numpy(np.ascontiguousarray(v))
    m = FluxModel(tab, config=FluxConfig.detect_from_weights(tab, axes_dim=AXES))
    args, ref = inputs("dev")
    assert rel_err(m(*args), ref) > 1e-2


def test_conversion_errors():
    names = list(diffusers_state("dev"))
    with pytest.raises(ModelFileError, match="unknown tensor 'transformer_blocks.0.attn.foo.weight'"):
        diffusers_to_bfl_plan(names + ["transformer_blocks.0.attn.foo.weight"])
    with pytest.raises(ModelFileError, match="missing single_transformer_blocks.0.proj_mlp.weight"):
        diffusers_to_bfl_plan([n for n in names if n != "single_transformer_blocks.0.proj_mlp.weight"])


# ---- detection, errors -----------------------------------------------------------------------

def test_detect_from_weights():
    cfg = FluxConfig.detect_from_weights(table("dev"), axes_dim=AXES)
    assert (cfg.depth, cfg.depth_single_blocks, cfg.hidden_size, cfg.num_heads, cfg.mlp_hidden) == (2, 2, 32, 2, 128)
    assert (cfg.in_channels, cfg.out_channels, cfg.latent_channels, cfg.concat_channels) == (64, 64, 16, 0)
    assert (cfg.context_in_dim, cfg.vec_in_dim, cfg.guidance_embed) == (32, 24, True)
    assert not FluxConfig.detect_from_weights(table("schnell"), axes_dim=AXES).guidance_embed
    fill = FluxConfig.detect_from_weights(table("fill"), axes_dim=AXES)
    assert (fill.in_channels, fill.concat_channels) == (384, 80)
    assert find_prefix(table("dev")) == PREFIX and find_prefix(table("dev", prefix="")) == ""


def test_pruned_depth_loads():
    """Flux-Lite style: fewer blocks in the file -> a shallower model (no per-version table)."""
    tab = {k: v for k, v in table("dev").items() if ".double_blocks.1." not in k and ".single_blocks.1." not in k}
    cfg = FluxConfig.detect_from_weights(tab, axes_dim=AXES)
    assert (cfg.depth, cfg.depth_single_blocks) == (1, 1)
    args, _ = inputs("dev")
    assert FluxModel(tab, config=cfg)(*args).shape == (2, 16, 6, 8)


def test_errors():
    tab = table("dev")
    with pytest.raises(ModelFileError, match="axes_dim"):
        FluxConfig.detect_from_weights(tab)   # 16-wide heads: no default RoPE split
    cfg = FluxConfig.detect_from_weights(tab, axes_dim=AXES)
    bad = dict(tab)
    del bad[PREFIX + "single_blocks.0.linear2.bias"]
    with pytest.raises(ModelFileError, match="missing tensor 'model.diffusion_model.single_blocks.0.linear2.bias'"):
        FluxModel(bad, config=cfg)
    bad = dict(tab)
    bad[PREFIX + "double_blocks.1.img_mlp.2.weight"] = Tensor.from_numpy(np.zeros((32, 64), np.float16))
    with pytest.raises(ModelFileError, match="double_blocks.1.img_mlp.2.weight' has shape \\[32, 64\\]"):
        FluxModel(bad, config=cfg)
    bad = dict(tab)
    bad[PREFIX + "double_stream_modulation_img.lin.weight"] = Tensor.from_numpy(np.zeros((4, 4), np.float16))
    with pytest.raises(UnsupportedError, match="Flux.2"):
        FluxConfig.detect_from_weights(bad, axes_dim=AXES)
    m = FluxModel(tab, config=cfg)
    (x, t, ctx, y, g, _, _), _ = inputs("dev")
    with pytest.raises(UsageError, match="guidance"):
        m(x, t, ctx, y, None)
    with pytest.raises(UsageError, match="pooled text vector"):
        m(x, t, ctx, None, g)
    with pytest.raises(UsageError, match="context has width 7"):
        m(x, t, ctx[..., :7], y, g)
    with pytest.raises(UsageError, match="channels"):
        m(x[:, :4], t, ctx, y, g)


# ---- RoPE ----------------------------------------------------------------------------------------

def test_ids_like_sdcpp():
    ids = flux_ids(4, 6, 3)
    assert ids.shape == (3 + 2 * 3, 3) and not ids[:3].any()
    assert ids[3:].tolist() == [[0, r, c] for r in range(2) for c in range(3)]
    # odd sizes round up: (h + 1) // 2 rows
    assert flux_ids(5, 7, 0).shape == (3 * 4, 3)
    # fixed mode: index 1; the second reference goes beside the first along the shorter side
    ids = flux_ids(4, 4, 0, refs=[(4, 6), (2, 2)])
    r1, r2 = ids[4:4 + 6], ids[10:]
    assert (r1[:, 0] == 1).all() and r1[:, 1].min() == 0 and r1[:, 2].min() == 0
    # second ref: 2 + 4 > 2 + 6 is false -> placed below (h offset 4 latent rows, as sd.cpp)
    assert (r2[:, 0] == 1).all() and r2[:, 1].min() == 4 and r2[:, 2].min() == 0
    inc = flux_ids(4, 4, 0, refs=[(4, 6), (2, 2)], ref_index_mode="increase")
    assert inc[4, 0] == 1 and inc[10, 0] == 2 and inc[10, 1] == 0
    dec = flux_ids(4, 4, 0, refs=[(2, 2)], ref_index_mode="decrease")
    assert dec[4, 0] == 0
    with pytest.raises(UsageError, match="ref index mode"):
        flux_ids(4, 4, 0, refs=[(2, 2)], ref_index_mode="sideways")


def test_pe_against_float64():
    ids = flux_ids(64, 64, 4)
    pe = flux_pe(ids, (16, 56, 56))
    assert pe.shape == (4 + 32 * 32, 64, 2, 2) and pe.dtype == np.float32
    ang = []
    for i, d in enumerate((16, 56, 56)):
        freqs = 1.0 / 10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d)
        ang.append(np.outer(ids[:, i].astype(np.float64), freqs))
    ang = np.concatenate(ang, 1)
    np.testing.assert_allclose(pe[..., 0, 0], np.cos(ang), atol=2e-5)
    np.testing.assert_allclose(pe[..., 1, 0], np.sin(ang), atol=2e-5)
    np.testing.assert_array_equal(pe[..., 0, 1], -pe[..., 1, 0])
    np.testing.assert_array_equal(pe[..., 1, 1], pe[..., 0, 0])


# ---- the full-size graph ------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dev", "chroma"])
def test_full_size_plan_has_no_score_matrix(variant):
    """Flux.1-dev at 1024x1024 (4096 image + 512 text tokens, 24 heads of 128), planned on
    zero-stride stand-in weights (no data, nothing runs): attention is one op per block whose
    output is [128, 4608, 24] — no node holds a 4608 x 4608 score matrix — and the planned
    peak of intermediates stays near the widest activation (linear1's [21504, 4608] F32)."""
    cfg = FluxConfig() if variant == "dev" else FluxConfig(is_chroma=True, guidance_embed=False, vec_in_dim=0)
    one = np.zeros(2, np.uint8)
    tab = {PREFIX + k: Tensor.from_buffer(one, "BF16", s[::-1], nb=(0,) * len(s)) for k, s in cfg.weight_shapes().items()}
    assert FluxConfig.detect_from_weights(tab) == cfg
    m = FluxModel(tab, config=cfg)
    z = lambda *s: Tensor.from_numpy(np.zeros(s, np.float32))
    if variant == "dev":
        out = m.forward(z(1, 16, 128, 128), z(1), z(1, 512, 4096), z(1, 768), z(1))
    else:
        out = m.forward(z(1, 16, 128, 128), z(1), z(1, 512, 4096), txt_mask=z(1, 512))
    assert out.ne == (128, 128, 16, 1)
    g = F.Graph(out)
    L = 4096 + 512
    att = [n for n in g.nodes if n.op == "attention"]
    assert len(att) == 19 + 38 and all(n.ne == (128, L, 24, 1) for n in att)
    assert not any(list(n.ne).count(L) >= 2 for n in g.nodes), "a tokens x tokens node (score matrix)"
    assert [n.cut for n in g.cut_nodes][-1] == "flux.single_blocks.37"
    assert len(g.nodes) <= (2148 if variant == "dev" else 2026), len(g.nodes)  # rope per stream, linear1 in two
    plan = g.plan()
    assert plan.peak_bytes <= 1000 * 2**20, plan.peak_bytes / 2**20  # 979 MiB when written
