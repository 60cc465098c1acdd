import numpy as np
import pytest

from sdrt import OpError
from sdrt.ops import dtypes
from sdrt.ops.tensor import Tensor

try:
    import gguf
except ImportError:  # pragma: no cover
    gguf = None


def test_dtype_table_complete():
    names = ["F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I8", "I16", "I32", "I64", "F64", "Q4_0", "Q4_1",
             "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS",
             "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"]
    for n in names:
        assert dtypes.get(n).name == n
        assert dtypes.get(n.lower()) is dtypes.get(n)
        assert dtypes.get(dtypes.get(n).id) is dtypes.get(n)
    with pytest.raises(OpError, match="unknown dtype"):
        dtypes.get("Q9_9")


@pytest.mark.skipif(gguf is None, reason="gguf package not installed")
def test_dtype_sizes_match_gguf():
    for t in gguf.GGMLQuantizationType:
        if t.name in dtypes.BY_NAME and t.name != "Q8_1":  # gguf still has the old float-scale Q8_1
            bs, ts = gguf.GGML_QUANT_SIZES[t]
            d = dtypes.get(t.name)
            assert (d.block_size, d.type_size, d.id) == (bs, ts, t.value), t.name


def test_from_numpy_zero_copy_and_layout():
    a = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    t = Tensor.from_numpy(a)
    assert t.ne == (4, 3, 2) and t.nb == (4, 16, 48) and t.is_contiguous()
    v = t.numpy()
    assert np.shares_memory(v, a)
    v[0, 0, 0] = 42
    assert a[0, 0, 0] == 42


def test_from_numpy_noncontiguous_is_zero_copy():
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    b = a.transpose(0, 2, 1)[:, 1:4]
    t = Tensor.from_numpy(b)
    assert not t.is_contiguous()
    assert np.shares_memory(t.numpy(), a)
    np.testing.assert_array_equal(t.numpy(), b)


def test_views_match_numpy():
    a = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    t = Tensor.from_numpy(a)
    # ggml_permute: source dim i goes to position axes[i]
    p = t.permute(1, 2, 0, 3)  # ne0->1, ne1->2, ne2->0
    assert p.ne == (3, 5, 4, 2)
    np.testing.assert_array_equal(p.numpy(), a.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(t.transpose().numpy(), np.swapaxes(a, -1, -2))
    np.testing.assert_array_equal(t.slice(0, 1, 5, 2).numpy(), a[..., 1:5:2])
    np.testing.assert_array_equal(t.slice(2, -2).numpy(), a[:, -2:])
    np.testing.assert_array_equal(t.reshape(20, 6).numpy(), a.reshape(6, 20))
    v = t.view((5, 2), nb=(4, 40), offset=8)
    np.testing.assert_array_equal(v.numpy(), np.lib.stride_tricks.as_strided(a.reshape(-1)[2:], (2, 5), (40, 4)))
    assert np.shares_memory(v.numpy(), a)


def test_view_errors():
    t = Tensor.from_numpy(np.zeros((4, 6), np.float32))
    with pytest.raises(OpError, match="not contiguous"):
        t.transpose().reshape(24)
    with pytest.raises(OpError, match="elements"):
        t.reshape(5, 5)
    with pytest.raises(OpError, match="outside"):
        t.view((10, 10))
    with pytest.raises(OpError, match="permutation"):
        t.permute(0, 0)
    with pytest.raises(OpError, match="dims must be >= 1"):
        Tensor(dtypes.F32, (0, 3))


def test_block_type_rows():
    q = dtypes.get("Q8_0")
    raw = np.zeros((3, 2 * q.type_size), np.uint8)
    t = Tensor.from_numpy(raw, dtype="Q8_0")
    assert t.ne == (64, 3) and t.nb == (34, 68)
    assert t.slice(1, 1, 3).numpy().shape == (2, 68)
    assert t.slice(0, 32, 64).numpy().shape == (3, 34)
    with pytest.raises(OpError, match="block"):
        t.slice(0, 0, 16)
    with pytest.raises(OpError, match="rows"):
        t.transpose()


def test_from_buffer_bounds():
    buf = np.zeros(100, np.uint8)
    with pytest.raises(OpError, match="needs 104 bytes"):
        Tensor.from_buffer(buf, "F32", (26,))
    t = Tensor.from_buffer(buf, "F16", (10, 5))
    assert t.numpy().shape == (5, 10)


def test_bf16_roundtrip_is_nearest_even():
    from sdrt.ops.convert import f32_to_raw, raw_to_f32
    x = np.array([1.0, 1.00390625, 1.01171875, -3.5, 1e-40, np.inf, -np.inf], np.float32)
    r = f32_to_raw(x, "BF16")
    # 1 + 2^-8 is a tie between 1 and 1+2^-7: rounds to the even mantissa (1.0)
    np.testing.assert_array_equal(raw_to_f32(r, "BF16")[:4], [1.0, 1.0, 1.015625, -3.5])
    assert np.isnan(raw_to_f32(f32_to_raw(np.array([np.nan], np.float32), "BF16"), "BF16")[0])
