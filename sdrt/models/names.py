"""Tensor names: every supported layout -> the canonical (original-checkpoint) names the models use.

Canonical scheme (stable-diffusion.cpp's, so its files and ours name tensors alike):
- `model.diffusion_model.` + the original repo's names (LDM `input_blocks.1.1.proj_in.weight`,
  BFL Flux `double_blocks.0.img_attn.qkv.weight`, SD3 `joint_blocks.0.x_block.attn.qkv.weight`);
- `first_stage_model.` + LDM VAE names (`decoder.up.3.block.0.conv1.weight`);
- text encoders of UNet models: `cond_stage_model.transformer.` (CLIP-L, or SD2's OpenCLIP-H) and
  `cond_stage_model.1.transformer.` (SDXL's OpenCLIP-G), with HF CLIP names below
  (`text_model.encoder.layers.0.self_attn.q_proj.weight`; OpenCLIP's fused `in_proj` stays fused
  as `self_attn.in_proj.weight`, its `text_projection` becomes `text_model.text_projection`);
- other models: `text_encoders.clip_l.transformer.`, `text_encoders.clip_g.transformer.`,
  `text_encoders.t5xxl.transformer.` (HF T5 names), `text_encoders.llm.` (HF LLM names).
The original SD checkpoints' `conditioner.embedders.N.` (SDXL) become `cond_stage_model.[1.]`.

Fused tensors: diffusers splits what the originals fuse (Flux/SD3 q, k, v into qkv). Such a part
is named `<fused name>.<k>` for k >= 1 (part 0 has the plain name), e.g. `...img_attn.qkv.weight`,
`...img_attn.qkv.weight.1`, `...qkv.weight.2`: the loader concatenates parts along the output dim
(numpy axis 0, ggml ne[-1]) in order. This is sd.cpp's convention.

Entry points: `convert_tensor_name(name, version)` for one name; `convert_names(names, version)`
for a whole table (it reads the UNet/VAE layout from the names, refuses collisions);
`diffusers_unet_to_ldm`, `diffusers_vae_to_ldm`, `open_clip_to_hf_clip` for one component;
`lora_target(name, version)` -> (canonical target name, role) for LoRA tensors (kohya
`lora_unet_…`/`lora_te…_`, diffusers/PEFT `lora_A`/`lora_B`, old diffusers `to_q_lora.down`,
LyCORIS LoHa `hada_*` / LoKr `lokr_*`, `alpha`, `scale`, `diff`, `dora_scale`).
"""
from __future__ import annotations

import re

from ..errors import ModelFileError
from .families import UNKNOWN, family_of


SPLIT_PART = re.compile(r"(.+\.(?:weight|bias))\.([1-9])$")   # `X.k`: part k of fused tensor X


def split_part_names(names) -> set[str]:
    """The names among `names` that are parts of a split fused tensor (`X`, `X.1`, `X.2`, ...):
    the model joins them into a new tensor on first use and never reads them as they are."""
    names = set(names)
    parts = {n for n in names if SPLIT_PART.match(n)}
    return parts | {SPLIT_PART.match(n).group(1) for n in parts} & names


def _family(version):
    return family_of(version)   # each family says how its names convert

__all__ = ["SPLIT_PART", "split_part_names", "convert_tensor_name", "convert_names", "convert_unet_name", "dit_to_original", "diffusers_unet_to_ldm", "diffusers_vae_to_ldm",
           "open_clip_to_hf_clip", "lora_target", "kohya_to_dotted", "UnetLayout", "LORA_ROLES"]

DM, VAE = "model.diffusion_model.", "first_stage_model."


# ---- UNet (SD1/SD2/SDXL): diffusers -> LDM ----------------------------------------------------

class UnetLayout:
    """What the diffusers -> LDM index arithmetic needs: resnets per down block, and which up
    blocks have attentions (that moves their upsampler from slot 1 to slot 2)."""
    __slots__ = ("layers_per_block", "up_blocks_with_attn")

    def __init__(self, layers_per_block=2, up_blocks_with_attn=(1, 2, 3)):
        self.layers_per_block = layers_per_block
        self.up_blocks_with_attn = frozenset(up_blocks_with_attn)

    @classmethod
    def for_version(cls, version: str | None) -> "UnetLayout":
        return cls(*(_family(version).unet_layout or (2, (1, 2, 3))))

    @classmethod
    def from_names(cls, names, default: "UnetLayout") -> "UnetLayout":
        res = {int(m.group(1)) for n in names if (m := re.search(r"down_blocks\.0\.resnets\.(\d+)\.", n))}
        up = {int(m.group(1)) for n in names if (m := re.search(r"up_blocks\.(\d+)\.attentions\.", n))}
        if not res:
            return default
        return cls(max(res) + 1, up)


_UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
                "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_RE_UNET = re.compile(r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)")
_RE_UNET_SAMPLER = re.compile(r"(down_blocks|up_blocks)\.(\d+)\.(downsamplers|upsamplers)\.0\.(.+)")
_RE_UNET_MID = re.compile(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)")
_UNET_HEADS = ("down_blocks.", "up_blocks.", "mid_block.", "conv_in.", "conv_out.", "conv_norm_out.",
               "time_embedding.", "add_embedding.")


def convert_unet_name(rest: str, version: str | None = None, layout: UnetLayout | None = None) -> str:
    """A UNet tensor name after `model.diffusion_model.`: diffusers -> LDM (others unchanged)."""
    if rest.startswith(_UNET_HEADS):
        rest = diffusers_unet_to_ldm(rest, layout or UnetLayout.for_version(version))
        if rest.endswith((".to_out.weight", ".to_out.bias")):      # old diffusers LoRA targets
            rest = rest[: rest.rindex(".")] + ".0" + rest[rest.rindex("."):]
    return rest


def _resnet_rest(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return _UNET_RESNET.get(head, head) + ("." + tail if tail else "")


def diffusers_unet_to_ldm(name: str, layout: UnetLayout | None = None) -> str:
    """One diffusers UNet2DConditionModel name (no prefix) -> its LDM UNetModel name.
    Names that are not diffusers UNet names come back unchanged."""
    lay = layout or UnetLayout()
    step = lay.layers_per_block + 1
    mod, dot, leaf = name.rpartition(".")
    if mod in _UNET_TOP:
        return _UNET_TOP[mod] + dot + leaf
    m = _RE_UNET.fullmatch(name)
    if m:
        kind, i, part, j, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        idx = i * step + j + (1 if kind == "down_blocks" else 0)
        blocks = "input_blocks" if kind == "down_blocks" else "output_blocks"
        if part == "resnets":
            return f"{blocks}.{idx}.0.{_resnet_rest(rest)}"
        return f"{blocks}.{idx}.1.{rest}"
    m = _RE_UNET_SAMPLER.fullmatch(name)
    if m:
        kind, i, rest = m.group(1), int(m.group(2)), m.group(4)
        if kind == "down_blocks":
            return f"input_blocks.{(i + 1) * step}.0.op.{rest[len('conv.'):] if rest.startswith('conv.') else rest}"
        slot = 2 if i in lay.up_blocks_with_attn else 1
        return f"output_blocks.{i * step + lay.layers_per_block}.{slot}.{rest}"
    m = _RE_UNET_MID.fullmatch(name)
    if m:
        part, j, rest = m.group(1), int(m.group(2)), m.group(3)
        return f"middle_block.{2 * j}.{_resnet_rest(rest)}" if part == "resnets" else f"middle_block.1.{rest}"
    return name


# ---- VAE: diffusers -> LDM -----------------------------------------------------------------------

_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "query": "q", "to_k": "k", "key": "k", "to_v": "v", "value": "v",
             "to_out.0": "proj_out", "proj_attn": "proj_out"}
_RE_VAE = re.compile(r"(encoder|decoder)\.(down_blocks|up_blocks)\.(\d+)\.(resnets\.(\d+)|downsamplers\.0|"
                     r"upsamplers\.0)\.(.+)")
_RE_VAE_MID = re.compile(r"(encoder|decoder)\.mid_block\.(resnets\.(\d+)|attentions\.0)\.(.+)")
VAE_ATTN_MATRICES = ("mid.attn_1.q.weight", "mid.attn_1.k.weight", "mid.attn_1.v.weight", "mid.attn_1.proj_out.weight")


def diffusers_vae_to_ldm(name: str, num_up_blocks: int = 4) -> str:
    """One diffusers AutoencoderKL name (no prefix) -> its LDM name. Note diffusers keeps the
    mid-block attention q/k/v/proj_out as Linear (out, in); LDM as 1x1 conv (out, in, 1, 1):
    same bytes, one reshape (see VAE_ATTN_MATRICES)."""
    m = _RE_VAE.fullmatch(name)
    if m:
        side, _, i, what, j, rest = m.groups()
        i = int(i)
        rest = rest.replace("conv_shortcut", "nin_shortcut", 1) if rest.startswith("conv_shortcut") else rest
        if side == "encoder":
            if what.startswith("resnets"):
                return f"encoder.down.{i}.block.{j}.{rest}"
            return f"encoder.down.{i}.downsample.{rest}"
        up = num_up_blocks - 1 - i
        if what.startswith("resnets"):
            return f"decoder.up.{up}.block.{j}.{rest}"
        return f"decoder.up.{up}.upsample.{rest}"
    m = _RE_VAE_MID.fullmatch(name)
    if m:
        side, what, j, rest = m.groups()
        if j is not None:
            rest = rest.replace("conv_shortcut", "nin_shortcut", 1) if rest.startswith("conv_shortcut") else rest
            return f"{side}.mid.block_{int(j) + 1}.{rest}"
        mod, dot, leaf = rest.rpartition(".")
        return f"{side}.mid.attn_1.{_VAE_ATTN.get(mod, mod)}{dot}{leaf}"
    for a, b in (("encoder.conv_norm_out.", "encoder.norm_out."), ("decoder.conv_norm_out.", "decoder.norm_out."),
                 ("decoder.post_quant_conv.", "post_quant_conv."), ("encoder.quant_conv.", "quant_conv.")):
        if name.startswith(a):
            return b + name[len(a):]
    return name


def _looks_diffusers_vae(name: str) -> bool:
    return ".down_blocks." in name or ".up_blocks." in name or ".mid_block." in name or "conv_norm_out" in name


# ---- text encoders ----------------------------------------------------------------------------------

_OPEN_CLIP_TOP = {
    "model.ln_final.weight": "transformer.text_model.final_layer_norm.weight",
    "model.ln_final.bias": "transformer.text_model.final_layer_norm.bias",
    "model.positional_embedding": "transformer.text_model.embeddings.position_embedding.weight",
    "model.token_embedding.weight": "transformer.text_model.embeddings.token_embedding.weight",
    "model.text_projection": "transformer.text_model.text_projection",
    "model.text_projection.weight": "transformer.text_model.text_projection",
    "transformer.text_projection.weight": "transformer.text_model.text_projection",
    "model.visual.class_embedding": "transformer.vision_model.embeddings.class_embedding",
    "model.visual.conv1.weight": "transformer.vision_model.embeddings.patch_embedding.weight",
    "model.visual.ln_post.weight": "transformer.vision_model.post_layernorm.weight",
    "model.visual.ln_post.bias": "transformer.vision_model.post_layernorm.bias",
    "model.visual.ln_pre.weight": "transformer.vision_model.pre_layernorm.weight",
    "model.visual.ln_pre.bias": "transformer.vision_model.pre_layernorm.bias",
    "transformer.vision_model.pre_layrnorm.weight": "transformer.vision_model.pre_layernorm.weight",
    "transformer.vision_model.pre_layrnorm.bias": "transformer.vision_model.pre_layernorm.bias",
    "model.visual.positional_embedding": "transformer.vision_model.embeddings.position_embedding.weight",
    "model.visual.proj": "transformer.visual_projection.weight",
    "vision_model.visual_projection.weight": "visual_projection.weight",
}
_OPEN_CLIP_BLOCK = {
    "attn.in_proj_weight": "self_attn.in_proj.weight", "attn.in_proj_bias": "self_attn.in_proj.bias",
    "attn.out_proj.weight": "self_attn.out_proj.weight", "attn.out_proj.bias": "self_attn.out_proj.bias",
    "ln_1.weight": "layer_norm1.weight", "ln_1.bias": "layer_norm1.bias", "ln_2.weight": "layer_norm2.weight",
    "ln_2.bias": "layer_norm2.bias", "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
}
_RE_OPEN_CLIP = re.compile(r"model\.(visual\.)?transformer\.resblocks\.(\d+)\.(.+)")


def open_clip_to_hf_clip(name: str) -> str:
    """OpenCLIP names (under `cond_stage_model.` / `conditioner.embedders.N.`) -> HF CLIP names
    under `transformer.`, as sd.cpp keeps them."""
    if name in _OPEN_CLIP_TOP:
        return _OPEN_CLIP_TOP[name]
    m = _RE_OPEN_CLIP.fullmatch(name)
    if m and m.group(3) in _OPEN_CLIP_BLOCK:
        tower = "vision_model" if m.group(1) else "text_model"
        return f"transformer.{tower}.encoder.layers.{m.group(2)}.{_OPEN_CLIP_BLOCK[m.group(3)]}"
    return name


# llama.cpp/GGUF-style names that some T5 / LLM files use -> HF names (sd.cpp's tables)
_T5_GGUF = [("enc.", "encoder."), ("blk.", "block."), ("output_norm.", "final_layer_norm."),
            ("attn_q.", "layer.0.SelfAttention.q."), ("attn_k.", "layer.0.SelfAttention.k."),
            ("attn_v.", "layer.0.SelfAttention.v."), ("attn_o.", "layer.0.SelfAttention.o."),
            ("attn_norm.", "layer.0.layer_norm."), ("ffn_norm.", "layer.1.layer_norm."),
            ("ffn_up.", "layer.1.DenseReluDense.wi_1."), ("ffn_down.", "layer.1.DenseReluDense.wo."),
            ("ffn_gate.", "layer.1.DenseReluDense.wi_0."),
            ("attn_rel_b.", "layer.0.SelfAttention.relative_attention_bias."), ("token_embd.", "shared.")]
_LLM_GGUF = [("attn_sinks.weight", "self_attn.sinks"), ("token_embd.", "model.embed_tokens."),
             ("blk.", "model.layers."), ("attn_q.", "self_attn.q_proj."), ("attn_k.", "self_attn.k_proj."),
             ("attn_v.", "self_attn.v_proj."), ("attn_q_norm.", "self_attn.q_norm."),
             ("attn_k_norm.", "self_attn.k_norm."), ("attn_output.", "self_attn.o_proj."),
             ("attn_norm.", "input_layernorm."), ("attn_post_norm.", "post_attention_norm."),
             ("ffn_gate_inp.", "mlp.router."), ("ffn_gate_exps.", "mlp.experts.gate_proj."),
             ("ffn_up_exps.", "mlp.experts.up_proj."), ("ffn_down_exps.", "mlp.experts.down_proj."),
             ("ffn_down.", "mlp.down_proj."), ("ffn_gate.", "mlp.gate_proj."), ("ffn_up.", "mlp.up_proj."),
             ("ffn_post_norm.", "post_ffw_norm."), ("ffn_norm.", "post_attention_layernorm."),
             ("output_norm.", "model.norm.")]


def _replace_each_once(name: str, table) -> str:
    """sd.cpp's replace_with_name_map: each pair, in order, replaces its first occurrence."""
    for a, b in table:
        i = name.find(a)
        if i >= 0:
            name = name[:i] + b + name[i + len(a):]
    return name


def _convert_text_encoder(rest: str, prefix: str) -> str:
    if "t5xxl" in prefix:
        return _replace_each_once(rest, _T5_GGUF)
    if "llm" in prefix:
        return rest if "visual" in prefix else _replace_each_once(rest, _LLM_GGUF)
    return open_clip_to_hf_clip(rest)


# ---- DiT: diffusers -> original (Flux, SD3) ----------------------------------------------------------

def _qkv(src: str, dst: str, names=("to_q", "to_k", "to_v"), extra=()) -> dict:
    out = {}
    for k, n in enumerate(tuple(names) + tuple(extra)):
        for leaf in ("weight", "bias"):
            out[f"{src}{n}.{leaf}"] = f"{dst}.{leaf}" + (f".{k}" if k else "")
    return out


def _flux_block_map(i: int) -> dict:
    s, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
    m = {s + "norm1.linear.": d + "img_mod.lin.", s + "norm1_context.linear.": d + "txt_mod.lin.",
         s + "attn.norm_q.weight": d + "img_attn.norm.query_norm.scale",
         s + "attn.norm_k.weight": d + "img_attn.norm.key_norm.scale",
         s + "attn.norm_added_q.weight": d + "txt_attn.norm.query_norm.scale",
         s + "attn.norm_added_k.weight": d + "txt_attn.norm.key_norm.scale",
         s + "ff.net.0.proj.": d + "img_mlp.0.", s + "ff.net.2.": d + "img_mlp.2.",
         s + "ff_context.net.0.proj.": d + "txt_mlp.0.", s + "ff_context.net.2.": d + "txt_mlp.2.",
         s + "attn.to_out.0.": d + "img_attn.proj.", s + "attn.to_add_out.": d + "txt_attn.proj."}
    m.update(_qkv(s + "attn.", d + "img_attn.qkv"))
    m.update(_qkv(s + "attn.", d + "txt_attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))
    return m


def _flux_single_map(i: int) -> dict:
    s, d = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
    m = {s + "norm.linear.": d + "modulation.lin.", s + "attn.norm_q.weight": d + "norm.query_norm.scale",
         s + "attn.norm_k.weight": d + "norm.key_norm.scale", s + "proj_out.": d + "linear2."}
    for k, n in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
        for leaf in ("weight", "bias"):
            m[f"{s}{n}.{leaf}"] = f"{d}linear1.{leaf}" + (f".{k}" if k else "")
    return m


_FLUX_TOP = {"time_text_embed.timestep_embedder.linear_1.": "time_in.in_layer.",
             "time_text_embed.timestep_embedder.linear_2.": "time_in.out_layer.",
             "time_embed.timestep_embedder.linear_1.": "time_in.in_layer.",
             "time_embed.timestep_embedder.linear_2.": "time_in.out_layer.",
             "time_text_embed.text_embedder.linear_1.": "vector_in.in_layer.",
             "time_text_embed.text_embedder.linear_2.": "vector_in.out_layer.",
             "time_text_embed.guidance_embedder.linear_1.": "guidance_in.in_layer.",
             "time_text_embed.guidance_embedder.linear_2.": "guidance_in.out_layer.",
             "context_embedder.": "txt_in.", "x_embedder.": "img_in.", "proj_out.": "final_layer.linear.",
             "norm_out.linear.": "final_layer.adaLN_modulation.1."}


def _sd3_block_map(i: int) -> dict:
    s, d = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
    m = {s + "norm1.linear.": d + "x_block.adaLN_modulation.1.",
         s + "norm1_context.linear.": d + "context_block.adaLN_modulation.1.",
         s + "attn.norm_q.weight": d + "x_block.attn.ln_q.weight", s + "attn.norm_k.weight": d + "x_block.attn.ln_k.weight",
         s + "attn.norm_added_q.weight": d + "context_block.attn.ln_q.weight",
         s + "attn.norm_added_k.weight": d + "context_block.attn.ln_k.weight",
         s + "attn2.norm_q.weight": d + "x_block.attn2.ln_q.weight",
         s + "attn2.norm_k.weight": d + "x_block.attn2.ln_k.weight",
         s + "ff.net.0.proj.": d + "x_block.mlp.fc1.", s + "ff.net.2.": d + "x_block.mlp.fc2.",
         s + "ff_context.net.0.proj.": d + "context_block.mlp.fc1.", s + "ff_context.net.2.": d + "context_block.mlp.fc2.",
         s + "attn.to_out.0.": d + "x_block.attn.proj.", s + "attn.to_add_out.": d + "context_block.attn.proj.",
         s + "attn2.to_out.0.": d + "x_block.attn2.proj.", s + "attn2.to_add_out.": d + "context_block.attn2.proj."}
    m.update(_qkv(s + "attn.", d + "x_block.attn.qkv"))
    m.update(_qkv(s + "attn.", d + "context_block.attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))
    m.update(_qkv(s + "attn2.", d + "x_block.attn2.qkv"))
    return m


_SD3_TOP = {"time_text_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
            "time_text_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
            "time_text_embed.text_embedder.linear_1.": "y_embedder.mlp.0.",
            "time_text_embed.text_embedder.linear_2.": "y_embedder.mlp.2.",
            "pos_embed.pos_embed": "pos_embed", "pos_embed.proj.": "x_embedder.proj.",
            "context_embedder.": "context_embedder.", "proj_out.": "final_layer.linear.",
            "norm_out.linear.": "final_layer.adaLN_modulation.1."}
_RE_BLOCK = re.compile(r"(single_transformer_blocks|transformer_blocks)\.(\d+)\.")


def dit_to_original(name: str, fam: str) -> str:
    """A diffusers Flux / SD3 transformer name -> the original (BFL / SAI) name."""
    m = _RE_BLOCK.match(name)
    if m:
        i = int(m.group(2))
        table = (_flux_single_map(i) if m.group(1) == "single_transformer_blocks" else _flux_block_map(i)) \
            if fam != "sd3" else (_sd3_block_map(i) if m.group(1) == "transformer_blocks" else {})
    else:
        table = _SD3_TOP if fam == "sd3" else _FLUX_TOP
    if name in table:
        return table[name]
    for a, b in table.items():       # prefix entries end with "."
        if a.endswith(".") and name.startswith(a):
            return b + name[len(a):]
    return name


# ---- the canonical prefix, then the per-component conversion ------------------------------------

def _prefix_map(version: str | None) -> list[tuple[str, str]]:
    unet = family_of(version or "").te_layout == "unet" or version is None
    over = _family(version).diffusers_te_prefixes
    clip_l = "cond_stage_model.transformer." if unet else "text_encoders.clip_l.transformer."
    clip_g = "cond_stage_model.1.transformer." if unet else "text_encoders.clip_g.transformer."
    te1 = over.get("te1.", "cond_stage_model.transformer.")
    # longest first: a name takes the first prefix it starts with
    return [("conditioner.embedders.0.open_clip.", "cond_stage_model."),
            ("conditioner.embedders.0.", "cond_stage_model."), ("conditioner.embedders.1.", "cond_stage_model.1."),
            ("text_encoder.2.", "cond_stage_model.1.transformer."), ("text_encoder_2.", "cond_stage_model.1.transformer."),
            ("diffusion_model.", DM), ("unet.", DM),
            ("transformer.", DM), ("vae.", VAE), ("text_encoder.", "cond_stage_model.transformer."),
            ("te.1.", "cond_stage_model.1.transformer."), ("te.", "cond_stage_model.transformer."), ("te2.", "cond_stage_model.1.transformer."), ("te1.", te1),
            ("te3.", "text_encoders.t5xxl.transformer."), ("clip_vision.", "cond_stage_model.transformer."),
            ("clip_l.", clip_l), ("clip_g.", clip_g)]


_TE_PREFIXES = ("cond_stage_model.1.", "cond_stage_model.", "text_encoders.clip_l.", "text_encoders.clip_g.",
                "text_encoders.t5xxl.", "text_encoders.llm.visual.", "text_encoders.llm.", "text_encoders.")


def convert_tensor_name(name: str, version: str | None = None, *, unet_layout: UnetLayout | None = None,
                        vae_up_blocks: int = 4) -> str:
    """One tensor name -> canonical. `version` (a detect.py version) picks between layouts that
    share names (UNet SD1 vs SDXL, which text-encoder slot `clip_l.` means, Flux vs SD3 DiT)."""
    if not name.startswith(DM):
        for a, b in _prefix_map(version):
            if name.startswith(a):
                name = b + name[len(a):]
                break
    if name.startswith(DM):
        fam = _family(version)
        conv = convert_unet_name if fam.name == UNKNOWN else fam.convert_diffusion_name
        rest = name[len(DM):]
        return DM + (conv(rest, version, unet_layout) if conv is not None else rest)
    if name.startswith(VAE):
        rest = name[len(VAE):]
        return VAE + (diffusers_vae_to_ldm(rest, vae_up_blocks) if _looks_diffusers_vae(rest) or
                      "quant_conv" in rest else rest)
    for p in _TE_PREFIXES:
        if name.startswith(p):
            return p + _convert_text_encoder(name[len(p):], p)
    if name.startswith("control_model."):
        return name[len("control_model."):]
    return name


def convert_names(names, version: str | None = None, what: str = "model") -> dict[str, str]:
    """{original name: canonical name} for a whole table. Reads the diffusers UNet layout
    (resnets per block, up blocks with attention) and the VAE depth from the names themselves.
    Two names that land on one canonical name raise ModelFileError (sd.cpp: last one wins)."""
    names = list(names)
    layout = UnetLayout.from_names([n for n in names if "down_blocks." in n or "up_blocks." in n],
                                   UnetLayout.for_version(version))
    ups = {int(m.group(1)) for n in names if (m := re.search(r"decoder\.up_blocks\.(\d+)\.", n))}
    vae_up = max(ups) + 1 if ups else 4
    out, seen = {}, {}
    for n in names:
        c = convert_tensor_name(n, version, unet_layout=layout, vae_up_blocks=vae_up)
        if c in seen:
            raise ModelFileError(f"{what}: tensors '{seen[c]}' and '{n}' both map to '{c}'")
        seen[c] = n
        out[n] = c
    return out


# ---- LoRA ----------------------------------------------------------------------------------------------

# suffix -> role; longest first so '.lora_A.default.weight' wins over '.weight'
_LORA_SUFFIX = sorted({
    ".lora_down.weight": "lora_down", ".lora_up.weight": "lora_up", ".lora_mid.weight": "lora_mid",
    ".lora.down.weight": "lora_down", ".lora.up.weight": "lora_up", ".lora.mid.weight": "lora_mid",
    "_lora.down.weight": "lora_down", "_lora.up.weight": "lora_up", "_lora.mid.weight": "lora_mid",
    ".lora_A.weight": "lora_down", ".lora_B.weight": "lora_up",
    ".lora_A.default.weight": "lora_down", ".lora_B.default.weight": "lora_up",
    ".lora_A": "lora_down", ".lora_B": "lora_up", ".alpha": "alpha", ".scale": "scale", ".dora_scale": "dora_scale",
    ".diff": "diff", ".diff_b": "diff_b", ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b",
    ".hada_w2_a": "hada_w2_a", ".hada_w2_b": "hada_w2_b", ".hada_t1": "hada_t1", ".hada_t2": "hada_t2",
    ".lokr_w1": "lokr_w1", ".lokr_w1_a": "lokr_w1_a", ".lokr_w1_b": "lokr_w1_b", ".lokr_w2": "lokr_w2",
    ".lokr_w2_a": "lokr_w2_a", ".lokr_w2_b": "lokr_w2_b", ".lokr_t2": "lokr_t2",
}.items(), key=lambda kv: -len(kv[0]))
LORA_ROLES = tuple(sorted({r for _, r in _LORA_SUFFIX}))

# multi-word tokens whose underscores are part of the name (kohya writes every '.' as '_')
_PROTECTED = sorted({
    "self_attn", "out_proj", "q_proj", "k_proj", "v_proj", "to_k", "to_q", "to_v", "to_out", "text_model",
    "down_blocks", "mid_block", "up_blocks", "proj_in", "proj_out", "transformer_blocks", "single_transformer_blocks",
    "single_blocks", "diffusion_model", "cond_stage_model", "first_stage_model", "conv_in", "conv_out",
    "time_emb_proj", "conv_shortcut", "time_embedding", "conv_norm_out", "double_blocks", "txt_attn", "img_attn",
    "input_blocks", "output_blocks", "middle_block", "skip_connection", "emb_layers", "in_layers", "out_layers",
    "add_q_proj", "add_k_proj", "add_v_proj", "add_out_proj", "ff_context", "norm_added_q", "norm_added_k",
    "to_add_out", "txt_mod", "img_mod", "txt_mlp", "img_mlp", "proj_mlp", "wi_0", "wi_1", "norm1_context",
    "x_embedder", "cross_attn", "output_proj", "token_refiner", "label_emb", "time_embed", "add_embedding",
    "linear_1", "linear_2", "final_layer_norm", "layer_norm1", "layer_norm2", "token_embedding",
    "position_embedding", "text_projection", "final_layer", "time_in", "vector_in", "guidance_in", "txt_in",
    "img_in", "in_layer", "out_layer", "context_embedder", "norm_out", "context_block", "x_block", "joint_blocks",
    "adaLN_modulation", "pos_embed", "t_embedder", "y_embedder", "self_attention", "cross_attention",
    "norm_q", "norm_k", "attn_1", "nin_shortcut", "post_quant_conv", "quant_conv",
    "query_norm", "key_norm", "upsamplers", "downsamplers",
}, key=len, reverse=True)
_RE_PROTECTED = re.compile("|".join(re.escape(t) for t in _PROTECTED))
_KOHYA_PARTS = {"unet": "unet.", "te": "te.", "te1": "te1.", "te2": "te2.", "te3": "te3.", "vae": "vae."}


def kohya_to_dotted(s: str) -> str:
    """'down_blocks_0_attentions_0_proj_in' -> 'down_blocks.0.attentions.0.proj_in': every '_'
    becomes '.', except inside the known multi-word tokens (sd.cpp's convert_sep_to_dot)."""
    out, pos = [], 0
    for m in _RE_PROTECTED.finditer(s):
        out.append(s[pos:m.start()].replace("_", "."))
        out.append(m.group(0))
        pos = m.end()
    out.append(s[pos:].replace("_", "."))
    return "".join(out)


def lora_target(name: str, version: str | None = None) -> tuple[str, str] | None:
    """A LoRA tensor name -> (canonical name of the weight it modifies, role), role one of
    LORA_ROLES ('lora_up', 'lora_down', 'lora_mid', 'alpha', 'scale', 'diff', 'diff_b' (the
    target is then the '.bias'), 'hada_*', 'lokr_*', 'dora_scale'). None if `name` is not a
    LoRA tensor. Flux/SD3 targets of a split q/k/v carry the part suffix ('...qkv.weight.1')."""
    n = name
    for p in ("lora.lora.", "lora."):
        if n.startswith(p) and not n.startswith(("lora_", "lora.up", "lora.down")):
            n = n[len(p):]
            break
    for suffix, role in _LORA_SUFFIX:
        if n.endswith(suffix):
            base = n[: -len(suffix)]
            break
    else:
        return None
    if not base:
        return None
    base = base.replace(".processor.", ".").replace(".processor", "")
    m = re.match(r"(?:lora|lycoris)_(unet|te1|te2|te3|te|vae)_(.+)", base)
    if m:                                             # kohya / LyCORIS underscore names
        base = _KOHYA_PARTS[m.group(1)] + kohya_to_dotted(m.group(2))
    elif base.startswith(("lora_", "lycoris_")):
        base = kohya_to_dotted(base.split("_", 1)[1])
    elif base.startswith(("lora.", "lycoris.")):
        base = base.split(".", 1)[1]
    if base.startswith(("transformer_blocks.", "single_transformer_blocks.")):
        base = "transformer." + base
    elif base.startswith(_UNET_HEADS) or base.startswith(("input_blocks.", "middle_block.", "output_blocks.",
                                                          "double_blocks.", "single_blocks.")):
        base = DM + base
    elif base.startswith("text_model."):
        base = "te." + base
    leaf = ".bias" if role == "diff_b" else ".weight"
    target = convert_tensor_name(base + leaf, version)
    return target, role
