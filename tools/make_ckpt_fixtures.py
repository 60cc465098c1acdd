"""Write the tiny PyTorch checkpoints under tests/fixtures/ and the values they must read back as.

Run with real torch (a test tool only; sdrt never imports it):
    pip install torch && python tools/make_ckpt_fixtures.py

Provenance: torch.save of the dicts below, zip format (default) and legacy format
(`_use_new_zipfile_serialization=False`). Expected values go to ckpt_expected.npz, keyed
`<fixture>::<tensor name>`, as float64 (values) so the test needs no torch. Regenerating gives
byte-different zips (serialization ids) but the same tensors.
"""
from __future__ import annotations

import collections
import os
import sys

import numpy as np
import torch

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")


def state_dict():
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(4, 6, generator=g)
    sd = collections.OrderedDict()
    sd["model.diffusion_model.input_blocks.0.0.weight"] = torch.randn(8, 4, 3, 3, generator=g)
    sd["model.diffusion_model.input_blocks.0.0.bias"] = torch.randn(8, generator=g).half()
    sd["first_stage_model.decoder.conv_in.weight"] = torch.randn(3, 5, generator=g).bfloat16()
    sd["view.transposed"] = base.t()                       # strides (1, 6)
    sd["view.offset_slice"] = base[1:3, 2:5]               # storage offset 8, strides (6, 1)
    sd["view.every_other"] = base[:, ::2]                  # strides (6, 2)
    sd["view.shared_base"] = base                          # same storage as the three views
    sd["dtype.f64"] = torch.arange(5, dtype=torch.float64) / 3
    sd["dtype.i64"] = torch.arange(-3, 3, dtype=torch.int64)
    sd["dtype.i32"] = torch.arange(7, dtype=torch.int32) * 1000
    sd["dtype.i8"] = torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8)
    sd["dtype.f8_e4m3"] = torch.tensor([0.5, -1.0, 448.0, 0.0], dtype=torch.float8_e4m3fn)
    sd["dtype.f8_e5m2"] = torch.tensor([0.25, -2.0, 57344.0, 0.0], dtype=torch.float8_e5m2)
    sd["dtype.u8"] = torch.tensor([0, 200, 255], dtype=torch.uint8)      # no sdrt dtype: ModelFile.raw
    sd["dtype.bool"] = torch.tensor([True, False])                        # read as I8 0/1
    sd["scalar.rank0"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 3)                                       # ModelFile.raw
    sd["five_d"] = torch.randn(3, 2, 1, 2, 2, generator=g)               # folded to 4-D
    sd["param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    return sd


def wrapped():
    inner = collections.OrderedDict()
    inner["cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"] = torch.randn(10, 768).half()
    inner["model.diffusion_model.out.2.bias"] = torch.randn(4)
    return {"epoch": 6, "global_step": 470000, "pytorch-lightning_version": "1.4.2",
            "state_dict": inner, "nested": {"a": {"b": 1}}}


def embedding():
    # A1111 textual-inversion layout: nested dicts, a parameter, non-tensor entries
    return {"string_to_token": {"*": 265}, "string_to_param": {"*": torch.nn.Parameter(torch.randn(2, 768))},
            "name": "tiny", "step": 12}


def expected(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(expected(v, prefix + k + "."))
        elif isinstance(v, torch.Tensor) and v.numel() and v.dtype != torch.uint8:
            out[prefix + k] = v.detach().to(torch.float64).numpy()
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    exp = {}
    cases = {
        "ckpt_zip.ckpt": (state_dict(), True),
        "ckpt_legacy.pt": (state_dict(), False),
        "ckpt_wrapped.ckpt": (wrapped(), True),
        "ckpt_wrapped_legacy.ckpt": (wrapped(), False),
        "ckpt_embedding.pt": (embedding(), True),
    }
    for fname, (obj, zip_) in cases.items():
        torch.manual_seed(0)
        path = os.path.join(OUT, fname)
        torch.save(obj, path, _use_new_zipfile_serialization=zip_)
        sd = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
        for k, v in expected(sd).items():
            exp[f"{fname}::{k}"] = v
        print(f"{fname}: {os.path.getsize(path)} bytes")
    np.savez_compressed(os.path.join(OUT, "ckpt_expected.npz"), **exp)
    print(f"ckpt_expected.npz: {len(exp)} arrays (torch {torch.__version__}, python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
