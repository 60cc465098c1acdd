"""SD3 MMDiT and the SD3 conditioner on the CUDA backend against the goldens and the CPU (skips
without a GPU). Not yet run on a GPU: the tolerances are first guesses (the CUDA backend stores
some F32 intermediates as F16), as for Flux; to be set from the first H200 run."""
from __future__ import annotations

import numpy as np
import pytest

from tests import test_mmdit as tm
from tests import test_sd3_conditioning as tc

GPU_TOL = 1e-2


@pytest.mark.parametrize("case", ["sd3m", "sd35l", "sd35m", "sd35l_skip"])
@pytest.mark.parametrize("dtype", [None, "F32"])   # the fixture's f16 weights, and f32
def test_mmdit_goldens_on_cuda(cuda, case, dtype):
    """Joint attention, QK RMSNorm, attn2, the pos_embed crop (a cast of a strided weight view)
    and skip layers on cuda0."""
    args, skip, ref = tm.inputs(case)
    m = tm.MMDiTModel(tm.table(case.replace("_skip", ""), dtype))
    gpu = m(*args, skip_layers=skip, backend="cuda0")
    cpu = m(*args, skip_layers=skip)
    assert np.isfinite(gpu).all()
    assert tm.rel_err(gpu, cpu) <= GPU_TOL, tm.rel_err(gpu, cpu)
    assert tm.rel_err(gpu, ref) <= GPU_TOL, tm.rel_err(gpu, ref)


def test_sd3_conditioner_on_cuda(cuda):
    z = tc.gold()
    prompt = str(z["prompts"][3])
    c = tc.SD3Conditioner(tc.table(), heads_l=1, heads_g=2, backend="cuda0").encode(prompt)
    assert tc.rel_err(c.context, z["p3:context"]) <= GPU_TOL
    assert tc.rel_err(c.y, z["p3:y"]) <= GPU_TOL
