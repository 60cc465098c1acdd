"""Goldens for sdrt.engine.lora from independent implementations (torch, diffusers, peft: tool-time
oracles only; the test reads the .npz).

1. kohya LoRA on a small SD1.5-layout diffusers UNet2DConditionModel (random weights; SD1.5's block
   structure at 32 channels): diffusers converts the kohya keys
   (`_convert_non_diffusers_lora_to_diffusers`), loads them through peft (`load_lora_adapter`) and
   fuses them at a multiplier (`fuse_lora`). Stored: the LoRA tensors and what fusing added to each
   targeted weight, by diffusers name.
2. peft's own LoHa and LoKr (factorized, Tucker conv) on a Linear and a Conv2d: delta weights of
   the adapter (`get_delta_weight`) with its tensors, renamed to the LyCORIS keys they are.

    python tools/make_lora_goldens.py   # writes tests/fixtures/lora_goldens.npz
"""
from __future__ import annotations

import os
import re

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "lora_goldens.npz")
MULT = 0.7


def _module_of(alpha_key: str) -> str:
    """diffusers' converted alpha key ('M.lora.down.weight.alpha', 'M.processor.to_q_lora.down.weight.alpha')
    -> the module path peft's alpha_pattern is keyed by ('M', 'M.to_q', 'M.to_out.0')."""
    m = re.match(r"(.+)\.processor\.(to_q|to_k|to_v|to_out)_lora\.down\.weight\.alpha$", alpha_key)
    if m:
        return m.group(1) + "." + m.group(2) + (".0" if m.group(2) == "to_out" else "")
    return alpha_key.split(".lora.down.weight")[0]


def kohya_unet(out: dict) -> None:
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_lora_to_diffusers
    from diffusers.utils import convert_unet_state_dict_to_peft
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 32, 32, 32),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32).eval()
    sd = {k: v.detach().clone() for k, v in unet.state_dict().items()}   # fusing merges in place
    g = torch.Generator().manual_seed(1)
    lora = {}
    # blocks where the diffusers -> LDM index arithmetic differs (second down block with its
    # downsampler, the middle, an up block with attention and its upsampler), to keep the file small
    targets = [n[: -len(".weight")] for n in sd if n.endswith(".weight") and sd[n].ndim >= 2 and (
        any(k in n for k in ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net", "time_emb_proj",
                             "conv1", "conv_shortcut", "downsamplers", "upsamplers"))) and
        n.startswith(("down_blocks.1.", "mid_block.", "up_blocks.2.", "conv_in", "time_embedding")) and
        not n.startswith(("up_blocks.2.attentions.1.", "up_blocks.2.attentions.2.", "down_blocks.1.attentions.1."))]
    for i, t in enumerate(targets):
        w = sd[t + ".weight"]
        rank = 4
        key = "lora_unet_" + t.replace(".", "_")
        if w.ndim == 4:
            down = torch.randn((rank,) + tuple(w.shape[1:]), generator=g) * 0.2
            up = torch.randn((w.shape[0], rank, 1, 1), generator=g) * 0.2
        else:
            down = torch.randn((rank, w.shape[1]), generator=g) * 0.2
            up = torch.randn((w.shape[0], rank), generator=g) * 0.2
        lora[key + ".lora_down.weight"], lora[key + ".lora_up.weight"] = down, up
        # every module has its alpha, as kohya writes them (diffusers gives a module without one the
        # file's most common alpha; sd.cpp scale 1: tests/test_lora.py checks that case against numpy)
        lora[key + ".alpha"] = torch.tensor(2.0 + i % 5)
    conv_sd, alphas = _convert_non_diffusers_lora_to_diffusers({k: v.clone() for k, v in lora.items()})
    # attention LoRAs come out in the old attention-processor naming; diffusers' pipeline loader
    # converts them to peft's (convert_unet_state_dict_to_peft), and the alphas alike
    conv_sd = {"unet." + k: v for k, v in convert_unet_state_dict_to_peft(
        {k[len("unet."):]: v for k, v in conv_sd.items()}).items()}
    alphas = {"unet." + _module_of(k[len("unet."):]) + ".alpha": v for k, v in alphas.items()}
    unet.load_lora_adapter(conv_sd, prefix="unet", network_alphas=alphas, adapter_name="k")
    unet.fuse_lora(lora_scale=MULT)
    fused = {k.replace(".base_layer", ""): v for k, v in unet.state_dict().items() if "lora_" not in k}
    for k, v in lora.items():
        out["kohya/" + k] = v.numpy().astype(np.float32)
    for t in targets:      # what fusing added (the test patches its own base weights)
        out["delta/" + t + ".weight"] = (fused[t + ".weight"].detach().double() - sd[t + ".weight"].double()
                                         ).float().numpy()


def peft_lyco(out: dict) -> None:
    import torch
    from peft import LoHaConfig, LoKrConfig, get_peft_model

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 96)        # big enough that peft factorizes LoKr's w2
            self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)

    for kind, cfg in (("loha", LoHaConfig(r=4, alpha=6, target_modules=["lin", "conv"], use_effective_conv2d=True,
                                          init_weights=False)),
                      ("lokr", LoKrConfig(r=4, alpha=6, target_modules=["lin", "conv"], use_effective_conv2d=True,
                                          decompose_both=True, decompose_factor=-1, init_weights=False))):
        torch.manual_seed(3)
        m = get_peft_model(M(), cfg)
        for mod in ("lin", "conv"):
            layer = m.base_model.model.get_submodule(mod)
            out[f"{kind}/{mod}.delta"] = layer.get_delta_weight("default").detach().numpy()
            for pname, p in layer.named_parameters():
                if "default" in pname and "base_layer" not in pname:
                    role = pname.split(".")[0]               # hada_w1_a / lokr_w1_a / lokr_t2 ...
                    out[f"{kind}/{mod}.{role}"] = p.detach().numpy()
            out[f"{kind}/{mod}.alpha"] = np.array(6.0, np.float32)


def main():
    out: dict = {"multiplier": np.array(MULT, np.float32)}
    kohya_unet(out)
    peft_lyco(out)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT}: {len(out)} arrays, {os.path.getsize(OUT)} bytes")


if __name__ == "__main__":
    main()
