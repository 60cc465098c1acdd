"""tools/q8_sensitivity.py: its emulation of ggml's CPU f16 GELU tables (vec.h GGML_GELU_FP16,
GGML_GELU_QUICK_FP16) against the formulas, and that its kernels take the place of sdrt's."""
import importlib.util
import math
import os

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("q8_sensitivity", os.path.join(ROOT, "tools", "q8_sensitivity.py"))
q8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(q8)


def _bits(v):
    return int(np.array(v, np.float16).view(np.uint16))


def test_tables_are_the_f16_rounded_formulas():
    gelu, quick = q8.ggml_tables()
    for v in (-3.5, -0.75, 0.0, 0.1, 1.0, 2.5, 7.0):
        x = float(np.float16(v))
        g = 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))
        assert gelu[_bits(v)] == np.float16(g), v
        assert quick[_bits(v)] == np.float16(x / (1 + math.exp(-1.702 * x))), v


def test_registered_kernels_compute_from_the_tables():
    import sdrt.ops.api as F
    from sdrt.ops.cpu import CPU
    from sdrt.ops.tensor import Tensor
    x = np.linspace(-12, 12, 4 * 64, dtype=np.float32).reshape(4, 64) + np.float32(1e-3)
    saved = {op: list(CPU._kernels[op]) for op in ("gelu_tanh", "gelu_quick", "geglu")}
    try:
        q8.use_ggml_gelu()
        t = Tensor.from_numpy(x)
        res = F.Graph({"g": F.gelu(t, approximate="tanh"), "q": F.gelu_quick(t)}).run()
    finally:
        CPU._kernels.update(saved)
    gelu, quick = q8.ggml_tables()
    want = np.where(x <= -10, 0, np.where(x >= 10, x, gelu[x.astype(np.float16).view(np.uint16)]))
    np.testing.assert_array_equal(res["g"].to_f32().reshape(x.shape), want)
    np.testing.assert_array_equal(res["q"].to_f32().reshape(x.shape), quick[x.astype(np.float16).view(np.uint16)])
