"""The model-family registry (sdrt.models.families): detection per version through the
registry, components and the flags derived from them, latent space and sampling defaults; and a
family registered by a test alone (no other file touched) running through the CLI's flag table,
the model manager and the pipeline, as docs/adding-a-family.md promises."""
from __future__ import annotations

import numpy as np
import pytest

from sdrt.cli import main as cli
from sdrt.engine import pipeline as PL
from sdrt.engine.params import GenParams, ModelParams
from sdrt.errors import UnsupportedError, UsageError
from sdrt.io.detect import detect_version, prediction_type
from sdrt.models import families as FM
from sdrt.models.families import Component, Cond, Family, Variant, family_of, get_family
from test_io_detect import DM, refiner, sd1, sd2, sdxl, unet

F32 = np.float32


# ---- detection through the registry ------------------------------------------------------------

@pytest.mark.parametrize("table, version, family", [
    (sd1, "sd1", "sd1"), (lambda: sd1(in_ch=9), "sd1_inpaint", "sd1"), (lambda: sd1(in_ch=8), "sd1_pix2pix", "sd1"),
    (sd2, "sd2", "sd2"), (lambda: sd2(in_ch=9), "sd2_inpaint", "sd2"),
    (sdxl, "sdxl", "sdxl"), (lambda: sdxl(in_ch=9), "sdxl_inpaint", "sdxl"), (lambda: sdxl(in_ch=8), "sdxl_pix2pix", "sdxl"),
    (lambda: sdxl(drop=("middle_block.1.",)), "sdxl_ssd1b", "sdxl"),
    (lambda: sdxl(drop=("middle_block.1.", "output_blocks.3.1.transformer_blocks.1")), "sdxl_vega", "sdxl"),
    (refiner, "sdxl_refiner", "sdxl"),
])
def test_sd_versions_detected_by_their_family_rule(table, version, family):
    t = table()
    assert detect_version(t) == version
    fam = family_of(version)
    assert fam.name == family and version in fam.versions
    from sdrt.io.detect import facts
    f = facts(t)
    assert any(rule(f) == version for _, rule in fam.detect)        # the family's own rule says so


def test_registry_is_consistent():
    seen = set()
    for fam in FM.families():
        for v in fam.versions:
            assert v not in seen and family_of(v) is fam
            seen.add(v)
        for role in fam.text_encoders:
            assert role in FM.components()
    orders = [o for o, _ in FM.detection_rules()]
    assert orders == sorted(orders)
    assert family_of("nope").name == "unknown" and family_of(None).name == "unknown"
    # SD first (sd.py), then every family module's runnable records (other branches add theirs)
    runnable = [f.name for f in FM.runnable_families()]
    assert runnable[:3] == ["sd1", "sd2", "sdxl"] and "flux" in runnable
    with pytest.raises(ValueError, match="already belongs"):
        FM.register_family(Family("dup", {"sd1": Variant()}))


def test_latent_space_and_defaults():
    sd, xl, flux = get_family("sd1"), get_family("sdxl"), get_family("flux")
    assert (sd.latent_channels, sd.latent_scale_shift(), sd.size_multiple, sd.vae_scale_factor) == (4, (0.18215, 0.0), 64, 8)
    assert xl.latent_scale_shift() == (0.13025, 0.0) and flux.latent_channels == 16
    assert flux.latent_scale_shift() == (0.3611, 0.1159) and flux.runnable
    assert (sd.default_sampler, sd.default_scheduler) == ("euler_a", "discrete")
    assert (flux.default_sampler, flux.default_scheduler) == ("euler", "flux")
    assert get_family("sd2").probe_prediction is not None and get_family("sd1").probe_prediction is None
    assert xl.zero_empty_negative and not sd.zero_empty_negative
    assert sd.variant("sd1_inpaint").concat == "inpaint" and sd.variant("sd1_pix2pix").vae_encode == "mean"
    assert sd.variant("sd1").concat is None
    assert prediction_type(sd2(), "sd2") is None and prediction_type(sd1(), "sd1") == "eps"
    assert prediction_type({**sdxl(), "v_pred": (1,)}, "sdxl") == "v"
    with pytest.raises(UsageError, match="no VAE latent scale"):
        get_family("wan").latent_scale_shift()


def test_components_and_flags_derive_from_the_registry():
    comps = FM.components()
    assert {r: c.flag for r, c in comps.items()} == {"clip_l": "--clip_l", "clip_g": "--clip_g", "t5xxl": "--t5xxl",
                                                     "llm": "--llm", "llm_vision": "--llm_vision"}
    assert comps["clip_l"].prefix_for("unet") == "cond_stage_model.transformer."
    assert comps["clip_g"].prefix_for("dit") == "text_encoders.clip_g.transformer."
    flags = {a.dest: a.option_strings for a in cli.build_parser()._actions}
    assert flags["clip_l"] == ["--clip_l"] and flags["clip_g"] == ["--clip_g"]
    assert "--t5xxl" not in cli._sdcli_only() and "--clip_l" not in cli._sdcli_only() and "--llm" not in cli._sdcli_only()
    assert "--clip_vision" in cli._sdcli_only()
    assert "--guidance" not in cli._sdcli_only() and "guidance" in flags      # Flux takes distilled guidance
    assert FM.component("vae").flag == "--vae"
    with pytest.raises(UsageError, match="unknown model component"):
        FM.component("nope")


def test_unrunnable_family_is_refused_by_name():
    with pytest.raises(UnsupportedError, match="Wan.*SD 1.x, SD 2.x, SDXL"):
        PL.Pipeline(version="wan2", prediction="sd3_flow")


# ---- a new family from one registry entry -------------------------------------------------------

TOY_TE = "text_encoders.toy_te.transformer."


class ToyDiT:
    """A 'diffusion model' of 16-channel latents that uses every Cond field it is given."""

    def __init__(self):
        self.conds = []

    def predict(self, x, t, cond, backend="cpu"):
        self.conds.append(cond)
        out = F32(0.5) * x + cond.context.mean(axis=(1, 2))[:, None, None, None] * F32(0.1)
        if cond.y is not None:
            out = out + cond.y.mean(axis=1)[:, None, None, None] * F32(0.01)
        return out.astype(F32)


class ToyCond:
    def __init__(self, table):
        self.table = table

    def encode(self, prompt, width, height, clip_skip=-1):
        v = len(prompt) / 10
        return Cond(np.full((1, 3, 8), v, F32), np.full((1, 4), v, F32))


class ToyVAE:
    def encode(self, x):
        n, c, H, W = x.shape
        m = x.reshape(n, c, H // 16, 16, W // 16, 16).mean(axis=(3, 5))
        mean = np.concatenate([m] * 5 + [m[:, :1]], 1)                        # 16 channels
        return np.concatenate([mean, np.full_like(mean, -9.0)], 1).astype(F32)

    def decode(self, z):
        return np.tanh(z[:, :3]).repeat(16, 2).repeat(16, 3).astype(F32)


@pytest.fixture
def toy_family():
    """Register a family + one text-encoder component, as a new family's module would; removed after."""
    comp = FM.register_component(Component("toy_te", "--toy-te", "toy text encoder", "path to the toy encoder",
                                           strip=(TOY_TE,), prefix={"dit": TOY_TE}, replaces=(TOY_TE,)))
    fam = FM.register_family(Family(
        "toy", {"toy": Variant()}, "Toy", detect=((50, lambda f: "toy" if f.has(DM + "toy_blocks.") else None),),
        text_encoders=("toy_te",), conditioner=lambda table, version, embd_dir=None, **kw: ToyCond(table),
        diffusion_model=lambda tensors, prefix, source: ToyDiT(), latent_channels=16, vae_scale_factor=16,
        size_multiple=32, latent_scale=0.5, latent_shift=0.25, prediction="eps", default_sampler="euler",
        distilled_guidance=True, modes=frozenset({"txt2img", "img2img"})))
    yield fam
    del FM._FAMILIES["toy"], FM._VERSION["toy"], FM._COMPONENTS["toy_te"]
    assert comp.role not in FM.components()


def test_new_family_registers_flag_detection_and_loading(toy_family, tmp_path):
    from safetensors.numpy import save_file
    assert detect_version({DM + "toy_blocks.0.weight": (4, 4)}) == "toy"
    ap = cli.build_parser()
    args = ap.parse_args(["-m", "m", "--toy-te", "te.safetensors"])
    assert args.toy_te == "te.safetensors" and "--toy-te" not in cli._sdcli_only()
    assert ap.parse_args(["--guidance", "2.5"]).guidance == 2.5 and "--guidance" not in cli._sdcli_only()
    model, te = str(tmp_path / "m.safetensors"), str(tmp_path / "te.safetensors")
    save_file({DM + "toy_blocks.0.weight": np.ones((4, 4), F32)}, model)
    save_file({"embed.weight": np.ones((2, 2), F32)}, te)
    mp, gp = cli.params_from_args(ap.parse_args(["-m", model, "--toy-te", te, "--guidance", "4"]))
    assert gp.guidance == 4.0
    assert mp.parts == {"toy_te": te} and mp.path_of("toy_te") == te
    from sdrt.engine.model_manager import load_models
    m = load_models(mp)
    assert m.version == "toy" and m.family == "toy" and m.paths["toy_te"] == te
    assert TOY_TE + "embed.weight" in m.tensors                              # under its component's prefix


def test_new_family_runs_through_the_pipeline(toy_family):
    p = PL.Pipeline(version="toy", prediction="eps", diffusion_model=ToyDiT(), vae=ToyVAE(),
                    conditioner=ToyCond({}), model_params=ModelParams(model="/m/toy.safetensors"))
    r = p.generate(GenParams(prompt="a cat", width=80, height=64, steps=2, guidance=3.5), show_progress=False)[0]
    assert r.latent.shape == (1, 16, 4, 6) and r.image.shape == (64, 96, 3)   # 80 aligned up to 96 (multiple 32)
    c = p.unet.conds[0]
    assert c.guidance == 3.5 and c.y.shape == (2, 4) and c.context.shape == (2, 3, 8)   # cond + uncond batched
    with pytest.raises(UnsupportedError, match="do not inpaint"):
        p.generate(GenParams(prompt="x", width=32, height=32, steps=1, init_image=np.zeros((32, 32, 3), np.uint8),
                             mask_image=np.zeros((32, 32), np.uint8)), show_progress=False)
