"""`sdrt` img_gen: sd-cli's flags, defaults, refusals, errors and output files (stub models)."""
import math
import os
from pathlib import Path

import numpy as np
import pytest
from test_pipeline import StubUNet, make_pipe

from sdrt.cli import main as cli
from sdrt.engine.pipeline import Pipeline
from sdrt.io.png import read_png_text


@pytest.fixture
def model(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"placeholder")          # Pipeline.load is stubbed; only existence is checked
    return str(p)


@pytest.fixture
def stub_load(monkeypatch):
    made = []

    def load(mp):
        p = make_pipe()
        p.model_params = mp
        made.append(p)
        return p

    monkeypatch.setattr(Pipeline, "load", staticmethod(load))
    return made


def _args(argv):
    return cli.params_from_args(cli.build_parser().parse_args(argv))


def _err(capsys, argv):
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


def test_defaults_are_sd_clis(model):
    mp, gp = _args(["-m", model])
    assert (gp.width, gp.height, gp.steps, gp.cfg_scale, gp.seed, gp.batch_count) == (-1, -1, 20, 7.0, 42, 1)
    assert math.isinf(gp.img_cfg_scale) and math.isinf(gp.eta)
    assert gp.sampling_method is None and gp.scheduler is None and gp.sigmas is None
    assert (gp.strength, gp.clip_skip, gp.vae_tiling, gp.vae_tile_overlap) == (0.75, -1, False, 0.5)
    assert gp.embed_metadata and gp.prompt == "" and gp.negative_prompt == ""
    assert (mp.rng, mp.sampler_rng, mp.prediction, mp.type) == ("cuda", None, None, None)
    a = cli.build_parser().parse_args(["-m", model])
    assert a.output is None and a.compression_quality == 90 and a.mode == "img_gen"


def test_every_flag_maps(model, tmp_path):
    f = str(tmp_path / "x.png")
    open(f, "wb").close()
    mp, gp = _args(["-m", model, "-p", "cat", "-n", "dog", "-W", "320", "-H", "192", "--steps", "6",
                    "--cfg-scale", "5.5", "--img-cfg-scale", "1.5", "--sampling-method", "dpm++2m",
                    "--scheduler", "normal", "--eta", "0.3", "-s", "-1", "-b", "3", "--rng", "cpu",
                    "--sampler-rng", "std_default", "--clip-skip", "2", "-i", f, "--strength", "0.4", "--mask", f,
                    "--vae", model, "--taesd", model, "--clip_l", model, "--clip_g", model, "--diffusion-model", model,
                    "--vae-tiling", "--vae-tile-size", "32x48", "--vae-tile-overlap", "0.25",
                    "--vae-relative-tile-size", "0.5", "--prediction", "v", "--embd-dir", str(tmp_path),
                    "--disable-image-metadata", "--type", "f32", "--sigmas", "[14.6, 7.0, 0]", "-t", "1"])
    assert (gp.prompt, gp.negative_prompt, gp.width, gp.height, gp.steps) == ("cat", "dog", 320, 192, 6)
    assert (gp.cfg_scale, gp.img_cfg_scale, gp.sampling_method, gp.scheduler) == (5.5, 1.5, "dpm++2m", "normal")
    assert (gp.eta, gp.seed, gp.batch_count, gp.clip_skip, gp.strength) == (0.3, -1, 3, 2, 0.4)
    assert gp.init_image == f and gp.mask_image == f and not gp.embed_metadata
    assert gp.vae_tiling and gp.vae_tile_size == (32, 48) and gp.vae_relative_tile_size == (0.5, 0.5)
    assert gp.vae_tile_overlap == 0.25 and gp.sigmas == [pytest.approx(14.6), 7.0, 0.0]
    assert (mp.rng, mp.sampler_rng, mp.prediction, mp.type, mp.threads) == ("cpu", "std_default", "v", "f32", 1)
    assert mp.vae == mp.taesd == mp.clip_l == mp.clip_g == mp.diffusion_model == model
    assert mp.embd_dir == str(tmp_path)
    assert _args(["-m", model, "--tae", model])[0].taesd == model     # sd-cli's alias


def test_choices_come_from_registries():
    from sdrt.engine.rng import RNGS
    from sdrt.engine.samplers import SAMPLERS
    from sdrt.engine.schedulers import SCHEDULERS
    acts = {a.dest: a for a in cli.build_parser()._actions}
    assert tuple(acts["sampling_method"].choices) == tuple(SAMPLERS)
    assert set(SCHEDULERS) <= set(acts["scheduler"].choices) and "normal" in acts["scheduler"].choices
    assert tuple(acts["rng"].choices) == tuple(RNGS)
    assert all(k in acts["sampling_method"].help for k in SAMPLERS)


@pytest.mark.parametrize("argv, msg", [
    (["--foo"], "unrecognized arguments: --foo"),
    (["--photo-maker", "d"], "--photo-maker: sd-cli flag sdrt does not support yet"),
    (["--lora-apply-mode", "later"], "argument --lora-apply-mode: invalid choice: 'later'"),
    (["--diffusion-fa"], "--diffusion-fa: sd-cli flag"),
    (["--ste", "3"], "unrecognized arguments: --ste"),                    # no abbreviations
    (["--sampling-method", "nope"], "argument --sampling-method: invalid choice: 'nope' (choose from 'euler'"),
    (["--scheduler", "nope"], "argument --scheduler: invalid choice: 'nope'"),
    (["--rng", "gpu"], "argument --rng: invalid choice: 'gpu' (choose from 'std_default', 'cuda', 'cpu')"),
    (["--prediction", "x"], "argument --prediction: invalid choice"),
    (["-W", "abc"], "argument -W/--width: invalid int value: 'abc'"),
    (["--cfg-scale", "x"], "argument --cfg-scale: invalid float value: 'x'"),
    (["-W", "0"], "-W/--width: must be a positive number of pixels, got 0"),
    (["-H", "-3"], "-H/--height: must be a positive number of pixels"),
    (["--strength", "1.5"], "--strength: must be in [0.0, 1.0], got 1.5"),
    (["--steps", "0"], "--steps: must be greater than 0"),
    (["-b", "0"], "-b/--batch-count: must be greater than 0"),
    (["--compression-quality", "0"], "--compression-quality: must be in [1, 100]"),
    (["--vae-tile-size", "ax2"], "--vae-tile-size: expected N or XxY"),
    (["--sigmas", "a,b"], "--sigmas"),
    (["-i", "/nonexistent/x.png"], "-i/--init-img: no such image file: '/nonexistent/x.png'"),
    (["-M", "vid_gen"], "mode 'vid_gen' is not implemented yet"),
])
def test_errors_are_one_line_naming_the_flag(model, capsys, stub_load, tmp_path, argv, msg, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = _err(capsys, ["-m", model] + argv)
    assert rc == 2
    assert msg in err
    assert err.count("\n") == 1 and err.startswith("sdrt: error: ")
    assert not stub_load and not os.path.exists(tmp_path / "output.png")


def test_missing_model(capsys, tmp_path):
    rc, err = _err(capsys, ["-m", str(tmp_path / "nope.safetensors"), "-o", str(tmp_path / "o.png")])
    assert rc == 2 and "-m/--model: no such file" in err
    rc, err = _err(capsys, ["-p", "x", "-o", str(tmp_path / "o.png")])
    assert rc == 2 and "-m/--model or --diffusion-model" in err
    rc, err = _err(capsys, ["-m", str(tmp_path / "nope.safetensors"), "--vae", str(tmp_path / "v")])
    assert rc == 2
    assert os.listdir(tmp_path) == []


def test_unreadable_model_is_a_clean_error(capsys, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 64)
    rc, err = _err(capsys, ["-m", str(bad), "-o", str(tmp_path / "o.png")])
    last = err.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("sdrt: error: ") and "bad.safetensors" in last
    assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "o.png")


def test_run_writes_images_with_metadata(model, stub_load, tmp_path, capsys):
    out = tmp_path / "sub" / "out.png"
    rc = cli.main(["-m", model, "-p", "a cat", "-W", "64", "-H", "64", "--steps", "2", "-b", "2", "-s", "5",
                   "-o", str(out)])
    assert rc == 0
    files = sorted(os.listdir(tmp_path / "sub"))
    assert files == ["out_0.png", "out_1.png"]
    t0 = read_png_text(Path(tmp_path / "sub" / "out_0.png").read_bytes())["parameters"]
    t1 = read_png_text(Path(tmp_path / "sub" / "out_1.png").read_bytes())["parameters"]
    assert t0.startswith("a cat\nSteps: 2, CFG scale: 7.000000, Guidance: 3.500000, Eta: inf, Seed: 5, Size: 64x64, "
                         "Model: model.safetensors, RNG: cuda, Sampler: euler_a discrete, Version: sdrt, SDCPP: {")
    assert "Seed: 6," in t1
    err = capsys.readouterr().err
    assert "save result image 1 to" in err and "2/2 images saved" in err


def test_run_sequences_formats_and_no_metadata(model, stub_load, tmp_path):
    assert cli.main(["-m", model, "-W", "64", "-H", "64", "--steps", "1", "-b", "2", "--disable-image-metadata",
                     "-o", str(tmp_path / "img_%03d.png"), "--output-begin-idx", "3"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["img_003.png", "img_004.png", "model.safetensors"]
    assert read_png_text(Path(tmp_path / "img_003.png").read_bytes()) == {}
    pytest.importorskip("PIL")
    assert cli.main(["-m", model, "-W", "64", "-H", "64", "--steps", "1", "-o", str(tmp_path / "a.jpg"),
                     "--compression-quality", "50"]) == 0
    assert Path(tmp_path / "a.jpg").read_bytes()[:2] == b"\xff\xd8"


def test_failed_run_leaves_no_output(model, monkeypatch, tmp_path, capsys):
    from sdrt.errors import SdrtError

    class Broken(StubUNet):
        def __call__(self, *a, **k):
            raise SdrtError("UNet: boom")

    def load(mp):
        p = make_pipe()
        p._unet = Broken()
        return p

    monkeypatch.setattr(Pipeline, "load", staticmethod(load))
    rc, err = _err(capsys, ["-m", model, "-W", "64", "-H", "64", "-o", str(tmp_path / "o.png")])
    assert rc == 1 and "sdrt: error: UNet: boom" in err
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_img2img_and_mask_flags_reach_the_pipeline(model, stub_load, tmp_path, capsys):
    from sdrt.io.png import write_image
    img = np.random.default_rng(0).integers(0, 256, (64, 128, 3), dtype=np.uint8)
    init = write_image(tmp_path / "init.png", img)
    mask = write_image(tmp_path / "mask.png", np.zeros((64, 128, 3), np.uint8))
    small = write_image(tmp_path / "small.png", np.zeros((32, 32, 3), np.uint8))
    assert cli.main(["-m", model, "-i", init, "--mask", mask, "--steps", "4", "--strength", "0.5",
                     "-o", str(tmp_path / "o.png")]) == 0
    p = stub_load[-1]
    assert len(p.unet.calls) == 3                                           # t_enc = 2: 3 sigmas steps
    assert "Size: 128x64," in read_png_text(Path(tmp_path / "o.png").read_bytes())["parameters"]
    capsys.readouterr()
    rc, err = _err(capsys, ["-m", model, "-i", init, "--mask", small, "-o", str(tmp_path / "o2.png")])
    assert rc == 2 and "--mask: the mask is 32x32, the init image 128x64" in err
    assert not os.path.exists(tmp_path / "o2.png")
    rc, err = _err(capsys, ["-m", model, "--mask", small, "-o", str(tmp_path / "o3.png")])
    assert rc == 2 and "--mask: needs an init image" in err


def test_convert_mode_still_works(tmp_path):
    from sdrt.io import open_model, write_safetensors
    src = tmp_path / "m.safetensors"
    write_safetensors(src, {"a.weight": np.ones((4, 32), np.float32)})
    assert cli.main(["-M", "convert", "-m", str(src), "-o", str(tmp_path / "m.gguf"), "--type", "f16"]) == 0
    assert open_model(str(tmp_path / "m.gguf")).tensors["a.weight"].dtype.name == "F16"


def test_list_devices(capsys):
    assert cli.main(["--list-devices"]) == 0
    assert capsys.readouterr().out.startswith("cpu\t")


def test_the_command_exits_fast_with_its_code_and_files(tmp_path):
    """`python -m sdrt` (the `sdrt` console script's `console`) ends the process without the
    interpreter's teardown: the image is written whole (a complete PNG, main()'s image in this
    process: pixels within 2 of it, as another process's memory layout may round numpy's
    reductions differently; one full run here once differed in a byte of the compressed data),
    output flushed, the exit code main()'s; errors exit 2 with their one line."""
    import subprocess
    import sys
    import flux_tiny
    args = flux_tiny.write(str(tmp_path / "m"))
    common = [*args, "-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "-s", "3", "--cfg-scale", "1"]
    here = tmp_path / "here.png"
    assert cli.main([*common, "-o", str(here)]) == 0
    there = tmp_path / "there.png"
    p = subprocess.run([sys.executable, "-m", "sdrt", *common, "-o", str(there), "-v"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    data = there.read_bytes()
    assert data.endswith(b"IEND\xaeB`\x82")                  # complete: the last chunk is there
    from PIL import Image
    a, b = (np.asarray(Image.open(f).convert("RGB"), np.int16) for f in (here, there))
    assert a.shape == b.shape == (64, 64, 3) and np.abs(a - b).max() <= 2
    assert "1/1 images saved" in p.stdout + p.stderr           # the last log line got out
    p = subprocess.run([sys.executable, "-m", "sdrt", "--steps", "x"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("sdrt: error:"), (p.returncode, p.stderr)
    prof = tmp_path / "prof.out"                # under a profiler: the normal exit, which writes it
    subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "sdrt", "--version"], check=True,
                   capture_output=True, timeout=60)
    assert prof.stat().st_size > 0
