"""Qwen2.5-VL vision tower against transformers (tools/make_qwen_image_goldens.py --only vision):
patch embedding of one frame, axial RoPE, window / full attention, the 2x2 merger. No torch here."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sdrt import ModelFileError, UsageError
from sdrt.models.te.qwen_vision import QwenVisionEncoder, patch_order
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen_vl_vision.npz")


@pytest.fixture(scope="module")
def z():
    f = np.load(FIX)
    return {k: f[k] for k in f.files}


def table(z, prefix="text_encoders.llm.visual."):
    def fold(v):
        return v.reshape((-1,) + v.shape[2:]) if v.ndim == 5 else v
    return {prefix + k[2:]: Tensor.from_numpy(np.ascontiguousarray(fold(v))) for k, v in z.items() if k.startswith("w:")}


def encoder(z, **kw):
    return QwenVisionEncoder(table(z), "text_encoders.llm.visual.", head_dim=16, fullatt_blocks=(1, 3), **kw)


def test_matches_transformers(z):
    enc = encoder(z)
    assert (enc.depth, enc.hidden, enc.heads, enc.out_dim) == (4, 32, 2, 24)
    out = enc.encode(z["img"].astype(np.float32))
    ref = z["out"]
    assert out.shape == ref.shape == (48, 24)
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    assert err <= 1e-4, err


def test_window_attention_matters(z):
    out = QwenVisionEncoder(table(z), "text_encoders.llm.visual.", head_dim=16, fullatt_blocks=(0, 1, 2, 3)).encode(
        z["img"].astype(np.float32))
    assert float(np.abs(out - z["out"]).max() / np.abs(z["out"]).max()) > 1e-3


def test_patch_order():
    np.testing.assert_array_equal(patch_order(2, 4), [0, 1, 4, 5, 2, 3, 6, 7])


def test_errors(z):
    with pytest.raises(ModelFileError, match="patch_embed"):
        QwenVisionEncoder({}, "x.")
    with pytest.raises(UsageError, match="multiples of 28"):
        encoder(z).encode(np.zeros((3, 30, 56), np.float32))
