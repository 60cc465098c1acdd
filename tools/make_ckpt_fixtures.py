"""Write the tiny PyTorch checkpoints under tests/fixtures/ and the values they must read back as;
with `names`, the verified diffusers -> LDM name tables for tests/test_io_names.py.

Run with real torch (a test tool only; sdrt never imports it):
    pip install torch && python tools/make_ckpt_fixtures.py
    pip install diffusers transformers && python tools/make_ckpt_fixtures.py names

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


# ---- name tables ----------------------------------------------------------------------------------
#
# Provenance: diffusers' own models (UNet2DConditionModel / AutoencoderKL built on the meta device
# with the SD1.5 / SDXL configs) give the diffusers names and shapes. sdrt.models.names maps each to
# an LDM name; diffusers' own LDM -> diffusers converters (single_file_utils) are then run on that
# LDM table, and must give back exactly the diffusers table (names and shapes). Only then is the
# triple (diffusers name, shape, LDM name) written. So the fixture is checked by an independent
# converter, and the test needs neither torch nor diffusers.

SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
SDXL_UNET = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280), cross_attention_dim=2048, attention_head_dim=(5, 10, 20),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816)
SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
              layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4)


def _meta_state(cls, cfg):
    with torch.device("meta"):
        m = cls(**cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def _verify_unet(diff: dict, ldm_of: dict, cfg: dict):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    ldm = {"model.diffusion_model." + ldm_of[k]: torch.empty(v, device="meta") for k, v in diff.items()}
    back = convert_ldm_unet_checkpoint(ldm, dict(cfg))
    got = {k: tuple(v.shape) for k, v in back.items()}
    assert got == diff, sorted(set(got) ^ set(diff))[:10]


def _verify_vae(diff: dict, ldm_of: dict, cfg: dict):
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    ldm = {"first_stage_model." + ldm_of[k]: torch.empty(v, device="meta") for k, v in diff.items()}
    back = convert_ldm_vae_checkpoint(ldm, dict(cfg))
    got = {k: tuple(v.shape) for k, v in back.items()}
    # diffusers reshapes the LDM 1x1-conv attention weights to Linear: compare names, then shapes
    assert set(got) == set(diff), sorted(set(got) ^ set(diff))[:10]
    assert all(got[k] == diff[k] for k in diff)


def _ldm_shape(ldm_name, shape):
    from sdrt.models.names import VAE_ATTN_MATRICES
    return tuple(shape) + (1, 1) if ldm_name.endswith(VAE_ATTN_MATRICES) and len(shape) == 2 else tuple(shape)


def names():
    import gzip
    import json

    from diffusers import AutoencoderKL, UNet2DConditionModel

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from sdrt.models.names import UnetLayout, diffusers_unet_to_ldm, diffusers_vae_to_ldm

    out = {}
    for key, cfg, layout in (("sd15_unet", SD15_UNET, UnetLayout(2, (1, 2, 3))),
                             ("sdxl_unet", SDXL_UNET, UnetLayout(2, (0, 1)))):
        diff = _meta_state(UNet2DConditionModel, cfg)
        ldm_of = {k: diffusers_unet_to_ldm(k, layout) for k in diff}
        _verify_unet(diff, ldm_of, cfg)
        out[key] = [[k, list(v), ldm_of[k], list(v)] for k, v in diff.items()]
    diff = _meta_state(AutoencoderKL, SD_VAE)
    ldm_of = {k: diffusers_vae_to_ldm(k) for k in diff}
    _verify_vae(diff, ldm_of, SD_VAE)
    out["sd_vae"] = [[k, list(v), ldm_of[k], list(_ldm_shape(ldm_of[k], v))] for k, v in diff.items()]
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection
    cfg = CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32,
                         projection_dim=1280, hidden_act="gelu")
    with torch.device("meta"):
        te = CLIPTextModelWithProjection(cfg)
    out["hf_clip_g"] = [[k, list(v.shape)] for k, v in te.state_dict().items()]
    import diffusers
    import transformers
    out["provenance"] = (f"diffusers {diffusers.__version__}, torch {torch.__version__}: meta-device state dicts "
                         f"of UNet2DConditionModel (SD1.5, SDXL configs) and AutoencoderKL (SD config); LDM names "
                         f"from sdrt.models.names, verified by diffusers' convert_ldm_unet_checkpoint / "
                         f"convert_ldm_vae_checkpoint round trip; hf_clip_g: transformers {transformers.__version__} "
                         f"CLIPTextModelWithProjection (OpenCLIP bigG sizes) names")
    path = os.path.join(OUT, "ckpt_names_diffusers_ldm.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump(out, f)
    print(f"{path}: " + ", ".join(f"{k} {len(v)}" for k, v in out.items() if k != "provenance"))


if __name__ == "__main__":
    names() if sys.argv[1:] == ["names"] else main()
