"""SD3 conditioner (sdrt.models.sd3_conditioning) against tools/make_sd3_cond_goldens.py: sd.cpp's
SD3CLIPEmbedder re-implemented in torch over transformers' CLIP and T5 models. No torch here."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.sd3_conditioning import CHUNK, SD3Conditioner
from sdrt.ops.tensor import Tensor
from test_te_clip import spec_arrays

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sd3_cond.npz")
_cache: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def gold():
    if "z" not in _cache:
        z = np.load(FIX)
        _cache["z"] = {k: z[k] for k in z.files}
    return _cache["z"]


def table(drop=()):
    if "t" not in _cache:
        # canonical names (sdrt.models.names, as sd.cpp): HF's `transformer.text_projection.weight`
        # is `transformer.text_model.text_projection`, values as stored (a Linear weight)
        _cache["t"] = {k.replace("transformer.text_projection.weight", "transformer.text_model.text_projection"):
                       Tensor.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in spec_arrays(gold(), "w").items()}
    return {k: v for k, v in _cache["t"].items() if not k.startswith(tuple(drop))}


def conditioner(**kw):
    key = tuple(sorted(kw.items(), key=str))
    if key not in _cache:
        _cache[key] = SD3Conditioner(table(kw.pop("drop", ())), heads_l=1, heads_g=2, **kw)
    return _cache[key]


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("i", range(4))
def test_matches_reference(i):
    z = gold()
    prompt = str(z["prompts"][i])
    c = conditioner().encode(prompt)
    ids, _, t_ids, _ = conditioner().tokenize(prompt)
    assert np.array_equal(ids, z[f"p{i}:ids"]) and np.array_equal(t_ids, z[f"p{i}:t5_ids"])
    ref_ctx, ref_y = z[f"p{i}:context"], z[f"p{i}:y"]
    assert c.context.shape == ref_ctx.shape and c.y.shape == ref_y.shape == (1, 64 + 128)
    assert rel_err(c.context, ref_ctx) <= 1e-4
    assert rel_err(c.y, ref_y) <= 1e-4


def test_layout_of_a_chunk():
    """[CLIP-L | bigG | zeros] for the first 77 tokens, T5 for the next 77; per chunk."""
    c = conditioner().encode(str(gold()["prompts"][3]))
    ctx = c.context[0].reshape(2, 2 * CHUNK, 256)
    assert not ctx[:, :CHUNK, 192:].any() and ctx[:, :CHUNK, :192].std() > 0.1
    assert ctx[:, CHUNK:].std() > 0.1


def test_clip_l_projection_is_ignored_like_sdcpp():
    """sd.cpp's CLIP-L has no text_projection: the pooled 64 are the final-normed EOS row; with
    clip_l_projection=True (diffusers' pipeline) they change, bigG's do not."""
    z = gold()
    y = conditioner(clip_l_projection=True).encode(str(z["prompts"][0])).y
    assert rel_err(y[:, :64], z["p0:y"][:, :64]) > 1e-2
    assert rel_err(y[:, 64:], z["p0:y"][:, 64:]) <= 1e-4


def test_missing_encoders_give_zeros():
    """As sd.cpp: no T5 -> zeros of 4096 for its tokens (context width 4096); no CLIP-L -> zeros."""
    z = gold()
    p = str(z["prompts"][1])
    no_t5 = conditioner(drop=("text_encoders.t5xxl.",)).encode(p)
    assert no_t5.context.shape == (1, 2 * CHUNK, 4096)
    assert not no_t5.context[0, CHUNK:].any()
    np.testing.assert_allclose(no_t5.context[0, :CHUNK, :192], z["p1:context"][0, :CHUNK, :192], rtol=0, atol=1e-4)
    no_l = conditioner(drop=("text_encoders.clip_l.", "text_encoders.t5xxl.")).encode(p)   # 768 zeros + bigG
    assert no_l.y.shape == (1, 768 + 128) and not no_l.y[0, :768].any()
    assert no_l.context.shape == (1, 2 * CHUNK, 4096) and not no_l.context[0, :CHUNK, :768].any()
    np.testing.assert_allclose(no_l.context[0, :CHUNK, 768:896], z["p1:context"][0, :CHUNK, 64:192], rtol=0, atol=1e-4)
    np.testing.assert_allclose(no_l.y[0, 768:], z["p1:y"][0, 64:], rtol=0, atol=1e-4)
    with pytest.raises(ModelFileError, match="exceed the T5 width 256"):
        SD3Conditioner(table(("text_encoders.clip_l.",)), heads_g=2)
    with pytest.raises(ModelFileError, match="no SD3 text encoder"):
        SD3Conditioner({})


def test_weights_zero_out_and_errors():
    c = conditioner()
    base = c.encode("a red fox")
    assert rel_err(c.encode("a (red:1.5) fox").context, base.context) > 1e-3
    assert not c.encode("a red fox", zero_out_masked=True).context.any()
    pos, neg = c.encode_pair("a red fox", "")
    np.testing.assert_array_equal(pos.context, base.context)
    assert neg.context.any()          # SD3's empty negative is encoded, not zeroed
    assert rel_err(c.encode("a red fox", clip_skip=1).context, base.context) > 1e-3
    with pytest.raises(UsageError, match="prompt must be a string"):
        c.encode(None)
