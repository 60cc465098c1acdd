"""Skip-layer guidance (issue 15) in the PNG metadata and the server, as sd-cli / sd-server:
build_sdcpp_image_metadata_json writes the request's `sampling.guidance.slg` {scale, layers, start,
end} and `flow_shift` (null when not given: sd-cli's INFINITY), get_image_params a `TE:` for the
T5-XXL file; sd-server's native requests read `sample_params.guidance.slg` {layers, layer_start,
layer_end, scale} and `sample_params.flow_shift`."""
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from sdrt.engine.params import GenParams  # noqa: E402
from sdrt.io import png as P  # noqa: E402
from sdrt.server.params import BadRequest, Limits, apply_native  # noqa: E402

BASE = dict(prompt="a cat", steps=4, cfg_scale=4.0, seed=42, width=256, height=256, model="m.safetensors",
            method="euler", scheduler="discrete")


def _sdcpp(text: str) -> dict:
    return json.loads(text.split("SDCPP: ", 1)[1])


def test_defaults_are_sd_clis():
    js = _sdcpp(P.parameters_text(**BASE))
    assert js["sampling"]["guidance"]["slg"] == {"scale": 0.0, "layers": [7, 8, 9], "start": 0.009999999776482582,
                                                 "end": 0.20000000298023224}
    assert js["sampling"]["flow_shift"] is None


def test_request_slg_flow_shift_and_t5xxl():
    text = P.parameters_text(**BASE, slg=(2.5, [1, 2], 0.01, 0.6), flow_shift=3.0, t5xxl="/x/t5xxl_fp16.safetensors",
                             clip_l="/x/clip_l.safetensors", clip_g="/x/clip_g.safetensors")
    js = _sdcpp(text)
    assert js["sampling"]["guidance"]["slg"] == {"scale": 2.5, "layers": [1, 2], "start": 0.009999999776482582,
                                                 "end": 0.6000000238418579}      # C floats widened, as nlohmann
    assert js["sampling"]["flow_shift"] == 3.0
    assert js["models"]["t5xxl"] == "t5xxl_fp16.safetensors"
    head = text.split(", SDCPP: ")[0]
    # sd-cli's order: TE clip_l, clip_g, t5xxl
    assert "TE: clip_l.safetensors, TE: clip_g.safetensors, TE: t5xxl_fp16.safetensors, " in head


def test_server_reads_slg_and_flow_shift():
    d = {"prompt": "a cat", "sample_params": {"flow_shift": 2.0, "guidance": {
        "txt_cfg": 4.5, "slg": {"layers": [7, 8], "layer_start": 0.05, "layer_end": 0.3, "scale": 2.5}}}}
    gp = apply_native(GenParams(), d, Limits(), {})
    assert (gp.slg_scale, gp.skip_layers, gp.skip_layer_start, gp.skip_layer_end, gp.flow_shift, gp.cfg_scale) == \
        (2.5, [7, 8], 0.05, 0.3, 2.0, 4.5)
    gp = apply_native(GenParams(), {"prompt": "x"}, Limits(), {})
    assert (gp.slg_scale, gp.skip_layers, gp.flow_shift) == (0.0, [7, 8, 9], math.inf)
    for bad in ({"layers": ["a"]}, {"layers": 3}, {"scale": "x"}, {"layer_end": True}):
        with pytest.raises(BadRequest, match="slg"):
            apply_native(GenParams(), {"sample_params": {"guidance": {"slg": bad}}}, Limits(), {})


def test_cli_writes_the_requests_slg(tmp_path):
    """The tiny SD3 file through the CLI with skip-layer guidance: the PNG says so."""
    import sd3_tiny as st

    from sdrt.cli import main as cli
    from sdrt.io.png import read_png_text
    args = st.write(str(tmp_path))
    out = str(tmp_path / "o.png")
    assert cli.main([*args, "-p", "a cat", "-W", "64", "-H", "64", "--steps", "2", "--cfg-scale", "3",
                     "--slg-scale", "2.5", "--skip-layers", "[1]", "--skip-layer-end", "0.7", "--flow-shift", "2",
                     "-o", out]) == 0
    js = _sdcpp(read_png_text(open(out, "rb").read())["parameters"])
    assert js["sampling"]["guidance"]["slg"]["scale"] == 2.5
    assert js["sampling"]["guidance"]["slg"]["layers"] == [1]
    assert js["sampling"]["guidance"]["slg"]["end"] == pytest.approx(0.7)
    assert js["sampling"]["flow_shift"] == 2.0
