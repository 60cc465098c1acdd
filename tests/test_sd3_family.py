"""The SD3 family through the registry: the record and detection, the skip-layer-guidance flags,
whole runs on a tiny random `all+te` checkpoint with the real tensor names (tests/sd3_tiny.py)
checked against an independent re-implementation of the sampling loop (SD3's discrete flow
schedule with shift 3, Euler, CFG and skip-layer guidance written out here), a golden image, and
diffusers-named MMDiT weights through the loader against diffusers' own output.

The golden (tests/fixtures/regression_sd3_tiny.png) was written by this code; regenerate it only
for an intended image change: `SDRT_UPDATE_GOLDEN=1 python -m pytest tests/test_sd3_family.py`.
"""
from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest

import sd3_tiny as st
from sdrt.cli import main as cli
from sdrt.engine.params import GenParams, ModelParams
from sdrt.engine.pipeline import Pipeline
from sdrt.engine.rng import make_rng
from sdrt.errors import SdrtError, UnsupportedError, UsageError
from sdrt.io import open_model
from sdrt.io.detect import detect_version
from sdrt.models import families as FM
from sdrt.models.families import get_family

F32 = np.float32
DM = "model.diffusion_model."
GOLDEN = os.path.join(st.ROOT, "tests", "fixtures", "regression_sd3_tiny.png")
MIN_PSNR = 60.0
PROMPT, NEG = "a red (fox:1.3) in snow", "blurry"
ARGS = ["-p", PROMPT, "-W", "64", "-H", "64", "--steps", "4", "-s", "7", "-t", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return st.write(str(tmp_path_factory.mktemp("sd3")))


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- registry, detection, flags ------------------------------------------------------------------

def test_record():
    fam = get_family("sd3")
    assert fam.runnable and set(fam.versions) == {"sd3"}
    assert (fam.latent_channels, fam.latent_scale_shift(), fam.size_multiple) == (16, (1.5305, 0.0609), 16)
    assert (fam.prediction, fam.default_sampler, fam.default_scheduler) == ("flow", "euler", "discrete")
    assert fam.flow_shift_of("sd3", {}) == 3.0
    assert fam.text_encoders == ("clip_l", "clip_g", "t5xxl") and fam.te_layout == "dit"
    assert not fam.distilled_guidance
    # one t5xxl component (flux.py's), not two
    assert FM.component("t5xxl").prefix_for("dit") == "text_encoders.t5xxl.transformer."
    assert [c.role for c in FM.components().values()].count("t5xxl") == 1


def test_detection(files):
    assert detect_version({DM + k: v for k, v in st.dit_names().items()}) == "sd3"
    assert detect_version(open_model(files[1])) == "sd3"


def test_flags():
    p = cli.build_parser()
    a = p.parse_args(["-m", "x", "--clip_g", "g", "--t5xxl", "t", "--slg-scale", "2.5", "--skip-layers", "[1,2]",
                      "--skip-layer-start", "0.1", "--skip-layer-end", "0.5"])
    assert (a.clip_g, a.t5xxl, a.slg_scale, a.skip_layers, a.skip_layer_start, a.skip_layer_end) == (
        "g", "t", 2.5, [1, 2], 0.1, 0.5)
    d = p.parse_args(["-m", "x"])
    assert (d.slg_scale, d.skip_layers, d.skip_layer_start, d.skip_layer_end) == (0.0, [7, 8, 9], 0.01, 0.2)
    assert p.parse_args(["-m", "x", "--skip-layers", "[]"]).skip_layers == []
    assert p.parse_args(["-m", "x", "--skip-layers", "3,4"]).skip_layers == [3, 4]
    with pytest.raises(UsageError, match="--skip-layers"):
        p.parse_args(["-m", "x", "--skip-layers", "[a]"])
    mp, gp = cli.params_from_args(p.parse_args(["-m", __file__, "--slg-scale", "2", "--skip-layers", "[1]"]))
    assert (gp.slg_scale, gp.skip_layers, gp.skip_layer_start, gp.skip_layer_end) == (2.0, [1], 0.01, 0.2)
    with pytest.raises(UsageError, match="--skip-layers"):
        GenParams(skip_layers=[-1]).validate()
    with pytest.raises(UsageError, match="--slg-scale"):
        GenParams(slg_scale=math.nan).validate()


def test_slg_step_window_like_sdcpp():
    """sd.cpp: active at step i (1-based) with int(start * n_sigmas) < i < int(end * n_sigmas)."""
    from sdrt.engine.stages import plan_guidance
    v = get_family("sd3").variant("sd3")
    g = plan_guidance(GenParams(slg_scale=2.0), v)
    assert [i for i in range(1, 21) if g.slg_active(i, 21)] == [1, 2, 3]     # int(0.21)=0 .. int(4.2)=4
    assert [i for i in range(1, 5) if g.slg_active(i, 5)] == []             # 4 steps: int(1.0) = 1: none
    assert not plan_guidance(GenParams(slg_scale=0.0), v).slg_active(2, 21)
    assert not plan_guidance(GenParams(slg_scale=2.0, skip_layers=[]), v).slg_active(2, 21)
    assert not g.slg_active(-2, 21)                                          # a sampler's extra call


# ---- runs -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipe(files):
    return Pipeline.load(ModelParams(model=files[1], rng="cuda"))


def sd3_sigmas(steps: int, shift: float = 3.0) -> np.ndarray:
    """sd.cpp's discrete schedule over SD3's flow: t from 999 down to 0 in steps - 1 equal parts,
    sigma = shift s / (1 + (shift - 1) s) with s = (t + 1) / 1000; then 0 (float64 here)."""
    ts = [999 - 999 / (steps - 1) * i for i in range(steps)]
    s = [(t + 1) / 1000 for t in ts]
    return np.array([shift * v / (1 + (shift - 1) * v) for v in s] + [0.0])


def reference_run(pipe, steps, cfg, seed, slg=None, size=64):
    """Euler on x' = v (denoised = x - sigma v), CFG when cfg != 1, skip-layer guidance
    (v += scale (v_cond - v_cond_skipped) in its sd.cpp step window), from the context RNG's noise;
    the MMDiT is called directly with the conditioner's outputs at t = 1000 sigma."""
    model = pipe.diffusion_model
    cond = pipe.conditioner.encode(PROMPT)
    unc = pipe.conditioner.encode(NEG) if cfg != 1 else None
    lat = size // 8
    sig = sd3_sigmas(steps)
    x = make_rng("cuda", seed).randn((1, 16, lat, lat)).astype(np.float64) * sig[0]
    skipped_steps = []
    for i in range(steps):
        t = np.array([sig[i] * 1000], F32)
        vc = model(x.astype(F32), t, cond.context, cond.y).astype(np.float64)
        v = vc
        if unc is not None:
            vu = model(x.astype(F32), t, unc.context, unc.y).astype(np.float64)
            v = vu + cfg * (vc - vu)
        if slg is not None:
            scale, layers, start, end = slg
            if int(start * (steps + 1)) < i + 1 < int(end * (steps + 1)):
                skipped_steps.append(i + 1)
                vs = model(x.astype(F32), t, cond.context, cond.y, skip_layers=layers).astype(np.float64)
                v = v + scale * (vc - vs)
        denoised = x - sig[i] * v
        x = x + (x - denoised) / sig[i] * (sig[i + 1] - sig[i])
    return x, skipped_steps


@pytest.mark.parametrize("cfg,slg", [(1.0, None), (4.0, None), (4.0, (2.5, [1], 0.01, 0.6))])
def test_sampling_matches_reimplementation(pipe, cfg, slg):
    gp = GenParams(prompt=PROMPT, negative_prompt=NEG, width=64, height=64, steps=4, cfg_scale=cfg, seed=7)
    if slg:
        gp = gp.replace(slg_scale=slg[0], skip_layers=slg[1], skip_layer_start=slg[2], skip_layer_end=slg[3])
    out = pipe.generate(gp, show_progress=False)[0]
    want, skipped = reference_run(pipe, 4, cfg, 7, slg)
    if slg:
        assert skipped == [1, 2]                      # int(0.05) = 0 < i < int(3.0) = 3
    got = out.latent
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max(), np.abs(got - want).max()
    assert out.info["method"] == "euler" and out.info["scheduler"] == "discrete"
    if slg:
        plain, _ = reference_run(pipe, 4, cfg, 7)
        assert np.abs(plain - want).max() > 1e-3 * np.abs(want).max()    # SLG moved it


def test_flow_shift_reaches_the_schedule(pipe):
    gp = GenParams(prompt="a fox", width=64, height=64, steps=2, cfg_scale=1.0, seed=3)
    a = pipe.generate(gp, show_progress=False)[0].latent
    b = pipe.generate(gp.replace(flow_shift=1.5), show_progress=False)[0].latent
    assert np.abs(a - b).max() > 1e-3


def test_slg_refused_by_a_family_without_skippable_layers():
    class NoSkip:
        def predict(self, x, t, cond, backend="cpu"):
            return np.zeros_like(x)

    pipe = Pipeline(version="sd1", prediction="eps", diffusion_model=NoSkip(), vae=object(), conditioner=object())
    with pytest.raises(UnsupportedError, match="--slg-scale.*SD 1.x"):
        pipe.generate(GenParams(prompt="x", width=64, height=64, steps=1, slg_scale=2.0), show_progress=False)


def read_rgb(path):
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.float64)


def psnr(a, b):
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_cli_matches_golden_and_reimplementation(files, pipe, tmp_path):
    out = str(tmp_path / "sd3.png")
    assert cli.main([*files, *ARGS, "-n", NEG, "--cfg-scale", "4", "--slg-scale", "2.5", "--skip-layers", "[1]",
                     "--skip-layer-end", "0.6", "-o", out]) == 0
    img = read_rgb(out)
    lat, _ = reference_run(pipe, 4, 4.0, 7, (2.5, [1], 0.01, 0.6))
    dec = pipe.vae.decode((lat / 1.5305 + 0.0609).astype(F32))           # SD3's latent scale / shift
    want = np.clip((np.asarray(dec, np.float64)[0].transpose(1, 2, 0) + 1) / 2, 0, 1) * 255
    assert psnr(img, want) >= 45
    if os.environ.get("SDRT_UPDATE_GOLDEN"):
        shutil.copyfile(out, GOLDEN)
        pytest.fail(f"golden rewritten at {GOLDEN}; commit it and run again without SDRT_UPDATE_GOLDEN")
    assert img.shape == (64, 64, 3) and img.std() > 5
    assert psnr(img, read_rgb(GOLDEN)) >= MIN_PSNR


def test_cli_slg_changes_the_image(files, tmp_path):
    out = str(tmp_path / "noslg.png")
    assert cli.main([*files, *ARGS, "-n", NEG, "--cfg-scale", "4", "-o", out]) == 0
    assert psnr(read_rgb(out), read_rgb(GOLDEN)) < MIN_PSNR - 10


# ---- diffusers-named MMDiT weights -------------------------------------------------------------------

@pytest.mark.parametrize("case", ["sd3m", "sd35l"])
def test_diffusers_file_matches_golden(tmp_path, case):
    """A diffusers-named SD3Transformer2DModel file through the loader (names.py renames and splits
    q/k/v into parts) and the family's model builder (parts joined, norm_out's and the last
    norm1_context's halves swapped) reproduces diffusers' output (tests/fixtures/sd3_mmdit.npz)."""
    from sdrt.engine.model_manager import load_models
    from sdrt.io import write_safetensors
    from sdrt.models.sd3 import join_sd3_diffusers, sd3_model
    from test_mmdit import diffusers_state, inputs, rel_err
    path = str(tmp_path / "diffusion_pytorch_model.safetensors")
    write_safetensors(path, {k: np.ascontiguousarray(v) for k, v in diffusers_state(case).items()})
    models = load_models(ModelParams(diffusion_model=path))
    assert models.version == "sd3" and DM + "joint_blocks.0.x_block.attn.qkv.weight.1" in models.tensors
    m = sd3_model(models.tensors, DM, path)
    args, skip, ref = inputs(case)
    assert rel_err(m(*args, skip_layers=skip), ref) <= 1e-4
    plain = {k: v for k, v in models.tensors.items() if not k.endswith((".1", ".2"))}
    assert join_sd3_diffusers(plain) is plain                  # SAI tables pass through untouched


def test_missing_text_encoder_warns_and_runs_with_zeros(pipe, caplog):
    from sdrt.models.sd3 import sd3_conditioner
    tab = {k: v for k, v in pipe.models.tensors.items() if not k.startswith("text_encoders.t5xxl.")}
    with caplog.at_level("WARNING", logger="sdrt"):
        c = sd3_conditioner(tab).encode("a fox")
    assert "--t5xxl" in caplog.text
    assert c.context.shape == (1, 154, 4096) and not c.context[0, 77:].any()


def test_errors_are_sdrt_errors(files, tmp_path):
    with pytest.raises(SdrtError, match="--skip-layer-end"):
        cli.params_from_args(cli.build_parser().parse_args(["-m", __file__, "--skip-layer-end", "inf"]))
