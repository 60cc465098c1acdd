"""The fused LoRA merge (sdrt.engine.lora_merge) equals the generic numpy path bit for bit:
W + sum(up @ down) + dense rounded to W's type (F16 round-to-nearest-even as numpy's astype,
BF16 with ggml's rounding, F32), over several row blocks and tasks, and through apply_loras."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from sdrt.engine import lora as L  # noqa: E402
from sdrt.engine import lora_merge as M  # noqa: E402
from sdrt.io import write_safetensors  # noqa: E402
from sdrt.ops.convert import f32_to_raw, raw_to_f32  # noqa: E402
from sdrt.ops.tensor import Tensor  # noqa: E402


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(M, "BLOCK_ELEMS", 1000)     # many blocks and tasks on small weights
    monkeypatch.setattr(M, "BLOCKS_PER_TASK", 2)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_merge_into_equals_numpy(small_blocks, dtype):
    rng = np.random.default_rng(0)
    rows, cols = 301, 77
    w32 = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = f32_to_raw(w32, dtype)
    u1, d1 = rng.standard_normal((rows, 4)).astype(np.float32), rng.standard_normal((4, cols)).astype(np.float32)
    u2, d2 = rng.standard_normal((rows, 8)).astype(np.float32), rng.standard_normal((8, cols)).astype(np.float32)
    dense = rng.standard_normal((rows, cols)).astype(np.float32)
    assert M.supported(dtype)
    for lowrank, dn in (([(u1, d1)], None), ([(u1, d1), (u2, d2)], dense), ([], dense)):
        got = M.merge_into(np.ascontiguousarray(raw).reshape(-1).view(np.uint8), dtype, (rows, cols), lowrank, dn)
        delta = sum((u @ d for u, d in lowrank), np.zeros((rows, cols), np.float32))
        if dn is not None:
            delta = delta + dn
        want = np.asarray(f32_to_raw(delta + raw_to_f32(raw, dtype), dtype))
        got = got.view(want.dtype).reshape(rows, cols)
        if dtype == "F32":      # BLAS on row blocks may sum in another order: last-bit differences
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert np.mean(got != want) < 1e-3, np.mean(got != want)


def test_f16_rounding_edges():
    """Halfway cases round to even, overflow gives inf, as numpy's astype(float16)."""
    x = np.array([[1 + 2 ** -11, 1 + 3 * 2 ** -11, 65519.0, 65520.0, 1e-8, -2.0 ** -25, 2.0 ** -24 * 1.5]], np.float32)
    w = np.zeros(x.shape, np.uint16)
    got = M.merge_into(w.reshape(-1).view(np.uint8), "F16", x.shape, [], x)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got.view(np.uint16), (np.float32(0) + x).astype(np.float16).view(np.uint16).ravel())


def test_apply_loras_fused_equals_generic(tmp_path, monkeypatch, small_blocks):
    """A kohya LoRA + a LoHa on one F16 weight, a LoRA on a conv: the fused leaves equal the generic ones
    and are read-only (GPU backends cache read-only storage as weights)."""
    rng = np.random.default_rng(1)
    dm = "model.diffusion_model."
    lin, conv = dm + "input_blocks.1.1.proj_in.weight", dm + "input_blocks.1.0.in_layers.2.weight"
    table = {lin: Tensor.from_numpy(rng.standard_normal((64, 96)).astype(np.float16), name=lin),
             conv: Tensor.from_numpy(rng.standard_normal((32, 16, 3, 3)).astype(np.float16), name=conv)}
    k1, k2 = "lora_unet_input_blocks_1_1_proj_in", "lora_unet_input_blocks_1_0_in_layers_2"
    lo = {k1 + ".lora_down.weight": rng.standard_normal((8, 96)).astype(np.float16),
          k1 + ".lora_up.weight": rng.standard_normal((64, 8)).astype(np.float16), k1 + ".alpha": np.array(4.0, np.float16),
          k2 + ".lora_down.weight": rng.standard_normal((4, 16, 3, 3)).astype(np.float16),
          k2 + ".lora_up.weight": rng.standard_normal((32, 4, 1, 1)).astype(np.float16)}
    ha = {k1 + ".hada_w1_a": rng.standard_normal((64, 2)).astype(np.float32),
          k1 + ".hada_w1_b": rng.standard_normal((2, 96)).astype(np.float32),
          k1 + ".hada_w2_a": rng.standard_normal((64, 2)).astype(np.float32),
          k1 + ".hada_w2_b": rng.standard_normal((2, 96)).astype(np.float32)}
    write_safetensors(str(tmp_path / "lo.safetensors"), lo)
    write_safetensors(str(tmp_path / "ha.safetensors"), ha)
    specs = [L.LoraSpec(str(tmp_path / "lo.safetensors"), 0.7), L.LoraSpec(str(tmp_path / "ha.safetensors"), 0.3)]
    fused, _ = L.apply_loras(table, specs, "sd1", "immediately")
    monkeypatch.setattr(L, "_fused_ok", lambda name: False)
    generic, _ = L.apply_loras(table, specs, "sd1", "immediately")
    for k in (lin, conv):
        assert fused[k] is not table[k] and fused[k].dtype.name == "F16"
        a, b = fused[k].numpy(), generic[k].numpy()
        assert not fused[k].storage.flags.writeable
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-3, atol=2e-3)
        # one rounding of the same f32 sum: equal but for the summation order of the deltas
        assert np.mean(a != b) < 0.01
