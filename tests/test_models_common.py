import numpy as np

from sdrt.models.common import Weights, multihead_attention
from sdrt.ops import api as F
from sdrt.ops.tensor import Tensor


def test_multihead_attention_matches_numpy(rng):
    N, L, S, H, D = 2, 7, 5, 3, 8
    q = rng.standard_normal((N, L, H * D)).astype(np.float32)
    k = rng.standard_normal((N, S, H * D)).astype(np.float32)
    v = rng.standard_normal((N, S, H * D)).astype(np.float32)
    got = F.compute(multihead_attention(Tensor.from_numpy(q), Tensor.from_numpy(k), Tensor.from_numpy(v), H))

    def split(t):  # [N, L, H*D] -> [N, H, L, D]
        return t.reshape(t.shape[0], t.shape[1], H, D).transpose(0, 2, 1, 3).astype(np.float64)
    s = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = (p @ split(v)).transpose(0, 2, 1, 3).reshape(N, L, H * D)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_weights_missing_key_names_it():
    import pytest
    from sdrt import ModelFileError
    w = Weights({"a.weight": Tensor.from_numpy(np.zeros(2, np.float32))}, "a.", "unet.safetensors")
    assert w["weight"].ne == (2,)
    with pytest.raises(ModelFileError, match="unet.safetensors: missing tensor 'a.bias'"):
        w["bias"]
