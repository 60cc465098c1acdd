"""Run-time LoRA on cuda0 against the CPU (issue 16): the tiny SD1 checkpoint of tests/test_lora.py
with its LoCon (linear, 1x1 and 3x3 conv, text encoder) and LyCORIS (LoHa, LoKr) files applied
`--lora-apply-mode at_runtime` (low-rank chains and a dense LoKr delta beside each GEMM / conv,
LoHa patched into the weight), on F16 and on a Q8_0 base; the CUDA image within 50 dB of the
CPU one, and the LoRA still moving the image. GPU test: runs with `pytest --gpu`."""
import logging

import numpy as np
import pytest

from test_lora import _psnr, tiny  # noqa: F401  (tiny: the module-scoped fixture)

PROMPT = "a cat <lora:locon:0.8><lora:lyco:0.5>"


def _image(tiny, backend, prompt=PROMPT, **mp):  # noqa: F811
    from sdrt.engine.params import GenParams, ModelParams
    from sdrt.engine.pipeline import Pipeline
    pipe = Pipeline.load(ModelParams(model=tiny["ckpt"], lora_model_dir=tiny["dir"], backend=backend, **mp))
    out = pipe.generate(GenParams(prompt=prompt, width=64, height=64, steps=2, sampling_method="euler", seed=3),
                        show_progress=False, lora_tags=True)
    return out[0].image.astype(np.float64)


@pytest.mark.parametrize("wtype, merge", [(None, "auto"), (None, "on"), ("q8_0", "auto")])
def test_runtime_lora_cuda_matches_cpu(cuda, tiny, caplog, monkeypatch, wtype, merge):  # noqa: F811
    """merge "on": every float Linear folds its delta into the weight in the graph
    (sdrt.engine.lora.RUNTIME_MERGE; "auto" picks per layer, the chain at this small size)."""
    from sdrt.engine import lora as L
    monkeypatch.setattr(L, "RUNTIME_MERGE", merge)
    mp = dict(lora_apply_mode="at_runtime", type=wtype)
    cpu = _image(tiny, "cpu", **mp)
    with caplog.at_level(logging.INFO, "sdrt"):
        gpu = _image(tiny, "cuda0", **mp)
    assert f"({tiny['n_locon']} / {tiny['n_locon']}) LoRA tensors have been applied" in caplog.text
    assert f"({tiny['n_lyco']} / {tiny['n_lyco']}) LoRA tensors have been applied" in caplog.text
    none = _image(tiny, "cuda0", "a cat", type=wtype)
    db = _psnr(cpu, gpu)
    print(f"runtime LoRA, weights {wtype or 'f16'}, RUNTIME_MERGE={merge}: cuda0 vs cpu {db:.2f} dB; vs cuda0 without LoRA {_psnr(gpu, none):.2f} dB")
    assert db >= 50.0
    assert _psnr(gpu, none) < db - 10


def test_merged_lora_cuda_matches_cpu(cuda, tiny):  # noqa: F811
    cpu = _image(tiny, "cpu", lora_apply_mode="immediately")
    gpu = _image(tiny, "cuda0", lora_apply_mode="immediately")
    db = _psnr(cpu, gpu)
    print(f"merged LoRA: cuda0 vs cpu {db:.2f} dB")
    assert db >= 50.0
