"""What a loaded model's `--type` asks of the CPU kernels, kept outside sdrt.ops.cpu so that
loading a model for a GPU does not load the CPU kernels (and Numba with them, ~0.6 s).

`--type f32` asks for float32 compute, but sdrt keeps F16/BF16 weights in their storage under it
(its kernels widen them exactly), so the bf16 GEMM (sdrt.ops.cpu.bf16gemm) is off while such a
model is in use, whatever SDRT_BF16GEMM/set_path say; any other type (or none) hands the choice
back to them."""
from __future__ import annotations

f32_type = False           # a model loaded with --type f32


def follow_weight_type(wtype: str | None) -> None:
    """Called as a model loads with its `--type`."""
    global f32_type
    f32_type = (wtype or "").lower() == "f32"
