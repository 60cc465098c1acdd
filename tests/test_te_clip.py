"""CLIP text models (sdrt.models.te.clip) against transformers on tiny configs.

Goldens: tools/make_clip_goldens.py -> tests/fixtures/clip_text_models.npz. Weights are rebuilt
here from the recipe the fixture keeps (det_uniform: the tool's exact generator)."""
import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.names import convert_names
from sdrt.models.te.clip import (
    PREFIX_CLIP_G,
    PREFIX_CLIP_L,
    CLIPConfig,
    CLIPTextModel,
    causal_mask,
)
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
TOL = 1e-4


def det_uniform(seed: int, shape) -> np.ndarray:
    """float32 in [-1, 1) from splitmix64 over arange (tools/make_clip_goldens.py's generator)."""
    n = int(np.prod(shape))
    off = ((int(seed) & 0xFFFFFFFF) + 1) * 0x9E3779B97F4A7C15 % 2**64
    z = np.arange(n, dtype=np.uint64) + np.uint64(off)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)).reshape(shape)


def spec_arrays(d, key: str) -> dict[str, np.ndarray]:
    """{file name: float32 array} from a fixture's weight recipe."""
    out = {}
    for i, name in enumerate(d[f"{key}_names"]):
        shape = tuple(int(s) for s in d[f"{key}_shapes"][i][:int(d[f"{key}_ndim"][i])])
        out[str(name)] = d[f"{key}_offsets"][i] + d[f"{key}_scales"][i] * det_uniform(int(d[f"{key}_seeds"][i]), shape)
    return out


def spec_table(d, key: str) -> dict[str, Tensor]:
    return {k: Tensor.from_numpy(v, name=k) for k, v in spec_arrays(d, key).items()}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gold():
    return np.load(os.path.join(FIX, "clip_text_models.npz"))


def test_det_uniform_is_the_tools_generator():
    u = det_uniform(5, (4, 3))
    assert u.dtype == np.float32 and u.shape == (4, 3) and u.min() >= -1 and u.max() < 1
    # fixed values: the stream must never change, the fixtures depend on it
    np.testing.assert_array_equal(det_uniform(0, (3,)), det_uniform(0, (5,))[:3])
    assert not np.array_equal(det_uniform(0, (3,)), det_uniform(1, (3,)))


def test_clip_l_config_detected(gold):
    cfg = CLIPConfig.detect_from_weights(spec_table(gold, "clip_l"), PREFIX_CLIP_L, heads=4)
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.intermediate, cfg.vocab, cfg.positions) == (64, 3, 4, 160, 1000, 77)
    assert cfg.act == "quick_gelu" and not cfg.fused_qkv and cfg.projection_dim == 0
    assert CLIPConfig.detect_from_weights(spec_table(gold, "clip_l"), PREFIX_CLIP_L).heads == 1   # width / 64


def test_clip_l_matches_transformers(gold):
    table = spec_table(gold, "clip_l")
    m = CLIPTextModel(table, PREFIX_CLIP_L, CLIPConfig.detect_from_weights(table, PREFIX_CLIP_L, heads=4))
    ids, eos = gold["ids"], gold["eos"]
    h, pooled = m.run(ids, clip_skip=-1, final_ln=True, eos_index=eos)
    assert h.shape == (2, 77, 64) and pooled.shape == (2, 64)
    assert np.abs(h - gold["clip_l_last"]).max() <= TOL
    assert np.abs(pooled - gold["clip_l_pooled"]).max() <= TOL
    h, _ = m.run(ids, clip_skip=2, final_ln=False)                 # SDXL: penultimate, no final LN
    assert np.abs(h - gold["clip_l_pen"]).max() <= TOL
    h, _ = m.run(ids, clip_skip=2, final_ln=True)                  # SD1 --clip-skip 2: final LN on it
    assert np.abs(h - gold["clip_l_pen_ln"]).max() <= TOL
    h1, _ = m.run(ids, clip_skip=1, final_ln=True)
    np.testing.assert_array_equal(h1, m.run(ids, clip_skip=0)[0])  # <= 0 and 1: every layer


def test_open_clip_names_fused_qkv_and_projection(gold):
    raw = spec_table(gold, "oc")                                   # conditioner.embedders.1.model.*
    names = convert_names(list(raw), "sdxl")
    table = {names[k]: v for k, v in raw.items()}
    assert all(k.startswith(PREFIX_CLIP_G) for k in table)
    assert PREFIX_CLIP_G + "encoder.layers.0.self_attn.in_proj.weight" in table
    ids, eos = gold["ids"], gold["eos"]
    for layout, key in (("matmul", "oc_pooled_ref"), ("linear", "oc_pooled_sdcpp")):
        cfg = CLIPConfig.detect_from_weights(table, PREFIX_CLIP_G, act="gelu", heads=4, projection_layout=layout)
        assert cfg.fused_qkv and cfg.projection_dim == 64 and cfg.layers == 3
        m = CLIPTextModel(table, PREFIX_CLIP_G, cfg)
        h, pooled = m.run(ids, clip_skip=2, final_ln=False, eos_index=eos)
        assert np.abs(h - gold["oc_pen"]).max() <= TOL
        assert np.abs(pooled - gold[key]).max() <= TOL, layout
    h, _ = m.run(ids, clip_skip=1, final_ln=True)
    assert np.abs(h - gold["oc_last"]).max() <= TOL


def test_custom_embedding_rows_replace_token_rows(gold):
    table = spec_table(gold, "clip_l")
    m = CLIPTextModel(table, PREFIX_CLIP_L, CLIPConfig.detect_from_weights(table, PREFIX_CLIP_L, heads=4))
    custom = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    ids = gold["ids"][:1].copy()
    ids[0, 3], ids[0, 5] = 1000, 1001                              # vocab + 0, vocab + 1
    got, _ = m.run(ids, custom=Tensor.from_numpy(custom), clip_skip=1)
    # the same ids through a model whose table has the two rows appended
    big = dict(table)
    key = PREFIX_CLIP_L + "embeddings.token_embedding.weight"
    big[key] = Tensor.from_numpy(np.concatenate([table[key].to_f32(), custom]))
    ref, _ = CLIPTextModel(big, PREFIX_CLIP_L, CLIPConfig.detect_from_weights(big, PREFIX_CLIP_L, heads=4)).run(ids)
    np.testing.assert_array_equal(got, ref)


def test_errors_name_the_problem(gold):
    table = spec_table(gold, "clip_l")
    m = CLIPTextModel(table, PREFIX_CLIP_L, CLIPConfig.detect_from_weights(table, PREFIX_CLIP_L, heads=4))
    with pytest.raises(UsageError, match="clip_skip 4"):
        m.forward(gold["ids"], clip_skip=4)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        m.forward(np.full((1, 77), 1000))
    with pytest.raises(UsageError, match="78 tokens"):
        m.forward(np.zeros((1, 78), np.int64))
    broken = {k: v for k, v in table.items() if "layers.1.mlp.fc2.bias" not in k}
    with pytest.raises(ModelFileError, match="layers.1.mlp.fc2.bias"):
        CLIPTextModel(broken, PREFIX_CLIP_L, CLIPConfig.detect_from_weights(broken, PREFIX_CLIP_L, heads=4))
    with pytest.raises(ModelFileError, match="token_embedding"):
        CLIPConfig.detect_from_weights(table, PREFIX_CLIP_G)
    with pytest.raises(UsageError, match="activation"):
        CLIPConfig(act="relu").check()


def test_causal_mask_layout():
    m = causal_mask(4)
    assert m.ne == (4, 4)
    a = m.numpy()
    assert a[0, 1] == -np.inf and a[1, 0] == 0 and a[3, 3] == 0
