"""T5 encoder (sdrt.models.te.t5) on cuda0 against transformers' golden and the CPU backend.

Same fixture as tests/test_te_t5.py. The last test gives one block FFN activations beyond the
F16 range (T5-XXL's FFN is known for them: HF clamps in fp16, sd.cpp scales `wo` by 1/32 on
CUDA): the GPU result must stay finite and match the F32 CPU result."""
import os

import numpy as np
import pytest

from sdrt.models.te.t5 import T5Encoder
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.tensor import Tensor

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(os.path.join(FIX, "t5_encoder.npz")))


def table(gold, dtype="F32", scale=None):
    out = {}
    for k, v in gold.items():
        if not k.startswith("w/"):
            continue
        name, x = k[2:], v.astype(np.float32)
        if scale and name in scale:
            x = x * np.float32(scale[name])
        if x.ndim == 2 and dtype != "F32" and not (dtype.startswith("Q") and x.shape[-1] % 32):
            out[name] = Tensor.from_numpy(f32_to_raw(x, dtype), dtype=dtype, name=name)
        else:
            out[name] = Tensor.from_numpy(x, name=name)
    return out


@pytest.mark.parametrize("case", ["len7", "len300", "batch_mask"])
@pytest.mark.parametrize("dtype", ["F32", "F16"])
def test_cuda_matches_transformers(cuda, gold, case, dtype):
    enc = T5Encoder(table(gold, dtype), "")
    h = enc.run(gold[f"ids/{case}"], gold.get(f"mask/{case}"), backend=cuda)
    ref = gold[f"hidden/{case}"]
    err = float(np.abs(h - ref).max())
    rel = float(np.sqrt(np.mean((h - ref) ** 2) / np.mean(ref ** 2)))
    print(f"T5 cuda {dtype} {case}: max-abs {err:.2e}, rel-rms {rel:.2e} (|ref| max {np.abs(ref).max():.2f})")
    assert np.isfinite(h).all()
    assert rel < 2e-2   # F16 GEMM inputs on the GPU; this random model amplifies rounding ~15x


@pytest.mark.parametrize("dtype", ["BF16", "Q8_0"])
def test_cuda_stored_types_match_cpu(cuda, gold, dtype):
    enc = T5Encoder(table(gold, dtype), "")
    ids, mask = gold["ids/batch_mask"], gold["mask/batch_mask"]
    cpu = enc.run(ids, mask)
    h = enc.run(ids, mask, backend=cuda)
    rel = float(np.sqrt(np.mean((h - cpu) ** 2) / np.mean(cpu ** 2)))
    print(f"T5 cuda {dtype}: rel-rms vs cpu {rel:.2e}, max-abs {np.abs(h - cpu).max():.2e}")
    assert rel < 1e-2


def test_cuda_ffn_beyond_f16_range_stays_finite(cuda, gold):
    """Block 1's FFN norm weight x400: wi_0/wi_1 outputs ~1e2..1e3, their product past 65504."""
    scale = {"encoder.block.1.layer.1.layer_norm.weight": 400.0}
    enc = T5Encoder(table(gold, "F16", scale), "")
    ids = gold["ids/len77"]
    cpu = enc.run(ids)
    h = enc.run(ids, backend=cuda)
    assert np.isfinite(cpu).all()
    assert np.isfinite(h).all(), "F16 overflow in the T5 FFN on the GPU"
    rel = float(np.sqrt(np.mean((h - cpu) ** 2) / np.mean(cpu ** 2)))
    print(f"T5 cuda FFN past F16 range: rel-rms vs cpu {rel:.2e}")
    assert rel < 2e-2
