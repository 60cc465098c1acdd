"""Qwen-Image transformer against diffusers goldens (tools/make_qwen_image_goldens.py), sd.cpp's RoPE
ids, config detection and errors. No torch here."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.diffusion.flux import flux_pe
from sdrt.models.diffusion.qwen_image import PREFIX, QwenImageConfig, QwenImageModel, qwen_image_ids
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen_image_transformer.npz")
AXES = (4, 6, 6)
_cache: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def fixture():
    if "z" not in _cache:
        z = np.load(FIX)
        _cache["z"] = {k: z[k] for k in z.files}
    return _cache["z"]


def table(key="w:", dtype=None, prefix=PREFIX, drop=()):
    out = {}
    for k, v in fixture().items():
        if k.startswith(key) and k[len(key):] not in drop:
            v = np.ascontiguousarray(v)
            out[prefix + k[len(key):]] = Tensor.from_numpy(v.astype(np.float32) if dtype == "F32" else v)
    return out


def model(key="w:", **kw):
    t = table(key, **kw)
    return QwenImageModel(t, config=QwenImageConfig.detect_from_weights(t, axes_dim=AXES))


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("case", ["t2i", "edit", "zc"])
def test_matches_diffusers(case):
    z = fixture()
    g = lambda k: z.get(f"{case}:{k}")   # noqa: E731
    m = model("wz:" if case == "zc" else "w:")
    assert m.config.zero_cond_t is False     # the flag comes from a marker tensor or the CLI, not the names
    refs = [g("ref")] if g("ref") is not None else []
    pe = flux_pe(g("ids"), AXES)
    if case == "zc":
        m = QwenImageModel(table("wz:"), config=QwenImageConfig.detect_from_weights(table("wz:"), axes_dim=AXES,
                                                                                      zero_cond_t=True))
    out = m(g("x"), g("t"), g("context"), refs, pe_np=pe)
    ref = g("out")
    assert out.shape == ref.shape == (1, 16, 8, 12)
    assert rel_err(out, ref) <= 1e-4, rel_err(out, ref)


def test_zero_cond_t_changes_the_edit_output():
    z = fixture()
    pe = flux_pe(z["zc:ids"], AXES)
    args = (z["zc:x"], z["zc:t"], z["zc:context"], [z["zc:ref"]])
    plain = model("wz:")(*args, pe_np=pe)
    assert rel_err(plain, z["zc:out"]) > 1e-2


def test_f32_weights_and_sdcpp_pe_run():
    z = fixture()
    m = model("w:", dtype="F32")
    out = m(z["t2i:x"], z["t2i:t"], z["t2i:context"], pe_np=flux_pe(z["t2i:ids"], AXES))
    assert rel_err(out, z["t2i:out"]) <= 1e-4
    own = m(z["t2i:x"], z["t2i:t"], z["t2i:context"])      # sd.cpp's text positions: a near but other pe
    e = rel_err(own, z["t2i:out"])
    assert 0 < e < 0.5, e


def test_zero_cond_t_marker_detected():
    t = table("w:")
    t[PREFIX + "__index_timestep_zero__"] = Tensor.from_numpy(np.zeros(1, np.float32))
    assert QwenImageConfig.detect_from_weights(t, axes_dim=AXES).zero_cond_t


def test_ids_like_sdcpp():
    # 4x6 latent -> 2x3 patches; 3 text tokens from max(2, 3) = 3 with sd.cpp's linspace step 3/2
    ids = qwen_image_ids(4, 6, 3)
    np.testing.assert_array_equal(ids[:3], [[3, 3, 3], [4.5, 4.5, 4.5], [6, 6, 6]])
    np.testing.assert_array_equal(ids[3:], [[0, r, c] for r in (-1, 0) for c in (-1, 0, 1)])
    # references: fixed mode index 1 beside each other, not centred; increase mode 1, 2 centred
    ids = qwen_image_ids(4, 4, 1, [(4, 2), (2, 4)])
    np.testing.assert_array_equal(ids[1 + 4:1 + 4 + 2], [[1, 0, 0], [1, 1, 0]])
    np.testing.assert_array_equal(ids[1 + 4 + 2:], [[1, 4, 0], [1, 4, 1]])   # offsets in latent pixels, as sd.cpp
    ids = qwen_image_ids(4, 4, 1, [(4, 4), (4, 4)], increase_ref_index=True)
    assert ids[5, 0] == 1 and ids[9, 0] == 2 and ids[5, 1] == -1 and ids[5, 2] == -1


def test_detect_from_weights():
    cfg = QwenImageConfig.detect_from_weights(table("w:"), axes_dim=AXES)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.joint_attention_dim, cfg.out_channels,
            cfg.in_channels) == (2, 32, 2, 24, 16, 64)
    one = table("w:", drop=[k[2:] for k in fixture() if k.startswith("w:transformer_blocks.1.")])
    assert QwenImageConfig.detect_from_weights(one, axes_dim=AXES).num_layers == 1


def test_errors():
    with pytest.raises(ModelFileError, match="axes"):
        QwenImageConfig.detect_from_weights(table("w:"))
    with pytest.raises(ModelFileError, match="transformer_blocks"):
        QwenImageConfig.detect_from_weights({})
    t = table("w:", drop=["transformer_blocks.0.attn.to_out.0.bias"])
    with pytest.raises(ModelFileError, match="to_out.0.bias"):
        QwenImageModel(t, config=QwenImageConfig.detect_from_weights(t, axes_dim=AXES))
    m = model()
    z = fixture()
    with pytest.raises(UsageError, match="channels"):
        m(z["t2i:x"][:, :8], z["t2i:t"], z["t2i:context"])
    with pytest.raises(UsageError, match="width"):
        m(z["t2i:x"], z["t2i:t"], z["t2i:context"][..., :20])
