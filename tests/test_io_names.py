"""Name conversion against real name lists: diffusers' SD1.5/SDXL UNet and SD VAE state dicts, mapped
to LDM names that diffusers' own LDM->diffusers converters turned back into the same tables
(tools/make_ckpt_fixtures.py names). No torch or diffusers needed here."""
from __future__ import annotations

import gzip
import json
import os

import pytest

from sdrt.errors import ModelFileError
from sdrt.models.names import (UnetLayout, convert_names, convert_tensor_name, diffusers_unet_to_ldm, kohya_to_dotted,
                           lora_target, open_clip_to_hf_clip)

with gzip.open(os.path.join(os.path.dirname(__file__), "fixtures", "ckpt_names_diffusers_ldm.json.gz"), "rt") as f:
    TABLES = json.load(f)
DM, VAE = "model.diffusion_model.", "first_stage_model."


@pytest.mark.parametrize("key,version", [("sd15_unet", "sd1"), ("sdxl_unet", "sdxl")])
def test_unet_every_key(key, version):
    rows = TABLES[key]
    assert len(rows) == {"sd15_unet": 686, "sdxl_unet": 1680}[key]
    for diff, dshape, ldm, lshape in rows:
        assert convert_tensor_name("unet." + diff, version) == DM + ldm, diff
        assert dshape == lshape
    # the whole table, with the layout read from the names (no version needed), and no collisions
    mapping = convert_names(["unet." + r[0] for r in rows])
    assert mapping == {"unet." + d: DM + ldm for d, _, ldm, _ in rows}
    assert len(set(mapping.values())) == len(rows)
    # canonical names are a fixed point
    for _, _, ldm, _ in rows:
        assert convert_tensor_name(DM + ldm, version) == DM + ldm


def test_unet_known_pairs():
    sd1 = UnetLayout.for_version("sd1")
    assert diffusers_unet_to_ldm("up_blocks.0.upsamplers.0.conv.weight", sd1) == "output_blocks.2.1.conv.weight"
    assert diffusers_unet_to_ldm("up_blocks.1.upsamplers.0.conv.weight", sd1) == "output_blocks.5.2.conv.weight"
    assert diffusers_unet_to_ldm("down_blocks.2.downsamplers.0.conv.bias", sd1) == "input_blocks.9.0.op.bias"
    assert diffusers_unet_to_ldm("mid_block.resnets.1.time_emb_proj.weight", sd1) == "middle_block.2.emb_layers.1.weight"
    assert diffusers_unet_to_ldm("down_blocks.1.resnets.0.conv_shortcut.weight", sd1) == \
        "input_blocks.4.0.skip_connection.weight"
    xl = UnetLayout.for_version("sdxl")
    assert diffusers_unet_to_ldm("up_blocks.0.upsamplers.0.conv.weight", xl) == "output_blocks.2.2.conv.weight"
    assert diffusers_unet_to_ldm("add_embedding.linear_2.bias", xl) == "label_emb.0.2.bias"


def test_vae_every_key():
    rows = TABLES["sd_vae"]
    for diff, dshape, ldm, lshape in rows:
        assert convert_tensor_name("vae." + diff) == VAE + ldm, diff
        assert dshape == lshape or (lshape == dshape + [1, 1] and ".mid.attn_1." in ldm)
        assert convert_tensor_name(VAE + ldm) == VAE + ldm
    m = {r[0]: r[2] for r in rows}
    assert m["decoder.up_blocks.0.resnets.2.conv2.weight"] == "decoder.up.3.block.2.conv2.weight"
    assert m["encoder.down_blocks.1.resnets.0.conv_shortcut.weight"] == "encoder.down.1.block.0.nin_shortcut.weight"
    assert m["decoder.mid_block.attentions.0.to_out.0.weight"] == "decoder.mid.attn_1.proj_out.weight"
    assert m["encoder.conv_norm_out.bias"] == "encoder.norm_out.bias"
    assert len(set(m.values())) == len(m)


def _open_clip_names(layers=32):
    names = ["model.token_embedding.weight", "model.positional_embedding", "model.ln_final.weight",
             "model.ln_final.bias", "model.text_projection", "model.logit_scale"]
    for i in range(layers):
        for s in ["attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias",
                  "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                  "mlp.c_proj.weight", "mlp.c_proj.bias"]:
            names.append(f"model.transformer.resblocks.{i}.{s}")
    return names


def test_open_clip_to_hf_names():
    hf = {n for n, _ in TABLES["hf_clip_g"]}
    for n in _open_clip_names():
        c = convert_tensor_name("conditioner.embedders.1." + n, "sdxl")
        assert c.startswith("cond_stage_model.1.transformer.") or n == "model.logit_scale", c
        rest = c[len("cond_stage_model.1.transformer."):]
        if "in_proj" in n:
            assert rest.endswith(("self_attn.in_proj.weight", "self_attn.in_proj.bias"))
        elif n == "model.text_projection":
            assert rest == "text_model.text_projection"
        elif n != "model.logit_scale":
            assert rest in hf, rest
    # SD2: OpenCLIP-H under cond_stage_model.model.
    assert convert_tensor_name("cond_stage_model.model.transformer.resblocks.3.mlp.c_fc.weight", "sd2") == \
        "cond_stage_model.transformer.text_model.encoder.layers.3.mlp.fc1.weight"
    assert open_clip_to_hf_clip("model.ln_final.weight") == "transformer.text_model.final_layer_norm.weight"
    # SDXL original embedders.0 is already HF CLIP-L
    n = "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    assert convert_tensor_name(n, "sdxl") == "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"


def test_text_encoder_prefixes():
    assert convert_tensor_name("clip_l.text_model.final_layer_norm.weight", "flux") == \
        "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"
    assert convert_tensor_name("clip_l.text_model.final_layer_norm.weight", "sdxl") == \
        "cond_stage_model.transformer.text_model.final_layer_norm.weight"
    assert convert_tensor_name("clip_g.text_model.final_layer_norm.weight", "sd3") == \
        "text_encoders.clip_g.transformer.text_model.final_layer_norm.weight"
    assert convert_tensor_name("te.1.text_model.embeddings.token_embedding.weight", "sdxl") == \
        "cond_stage_model.1.transformer.text_model.embeddings.token_embedding.weight"
    # llama.cpp-style T5 names in a GGUF t5xxl
    assert convert_tensor_name("text_encoders.t5xxl.transformer.enc.blk.3.attn_q.weight", "flux") == \
        "text_encoders.t5xxl.transformer.encoder.block.3.layer.0.SelfAttention.q.weight"
    assert convert_tensor_name("text_encoders.llm.blk.0.ffn_down.weight", "qwen_image") == \
        "text_encoders.llm.model.layers.0.mlp.down_proj.weight"


def test_dit_diffusers_to_original():
    f = "flux"
    assert convert_tensor_name("transformer.transformer_blocks.3.attn.to_q.weight", f) == \
        DM + "double_blocks.3.img_attn.qkv.weight"
    assert convert_tensor_name("transformer.transformer_blocks.3.attn.to_v.bias", f) == \
        DM + "double_blocks.3.img_attn.qkv.bias.2"
    assert convert_tensor_name("transformer.transformer_blocks.3.attn.add_k_proj.weight", f) == \
        DM + "double_blocks.3.txt_attn.qkv.weight.1"
    assert convert_tensor_name("transformer.single_transformer_blocks.7.proj_mlp.weight", f) == \
        DM + "single_blocks.7.linear1.weight.3"
    assert convert_tensor_name("transformer.single_transformer_blocks.7.attn.norm_k.weight", f) == \
        DM + "single_blocks.7.norm.key_norm.scale"
    assert convert_tensor_name("transformer.x_embedder.weight", f) == DM + "img_in.weight"
    assert convert_tensor_name("transformer.norm_out.linear.bias", f) == DM + "final_layer.adaLN_modulation.1.bias"
    assert convert_tensor_name("transformer.transformer_blocks.0.ff_context.net.2.weight", "sd3") == \
        DM + "joint_blocks.0.context_block.mlp.fc2.weight"
    assert convert_tensor_name("transformer.pos_embed.proj.weight", "sd3") == DM + "x_embedder.proj.weight"
    # an original Flux name is a fixed point
    assert convert_tensor_name(DM + "double_blocks.0.img_attn.qkv.weight", f) == DM + "double_blocks.0.img_attn.qkv.weight"


def test_collision_is_an_error():
    with pytest.raises(ModelFileError, match="both map"):
        convert_names(["unet.conv_in.weight", "model.diffusion_model.input_blocks.0.0.weight"], "sd1")


# ---- LoRA -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,version", [("sd15_unet", "sd1"), ("sdxl_unet", "sdxl")])
def test_kohya_names_for_every_unet_weight(key, version):
    for diff, shape, ldm, _ in TABLES[key]:
        if not diff.endswith(".weight") or len(shape) < 2:
            continue
        stem = diff[: -len(".weight")]
        assert lora_target("lora_unet_" + stem.replace(".", "_") + ".lora_down.weight", version) == \
            (DM + ldm, "lora_down"), diff
        # kohya's LDM-style names (SDXL trainers) and PEFT names reach the same target
        ldm_stem = ldm[: -len(".weight")]
        assert lora_target("lora_unet_" + ldm_stem.replace(".", "_") + ".alpha", version) == (DM + ldm, "alpha")
        assert lora_target("unet." + stem + ".lora_B.weight", version) == (DM + ldm, "lora_up")


def test_lora_families():
    t = lora_target
    te = "cond_stage_model.transformer.text_model.encoder.layers.0."
    assert t("lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight", "sd1") == \
        (te + "self_attn.q_proj.weight", "lora_up")
    assert t("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", "sdxl") == \
        (te + "mlp.fc1.weight", "lora_down")
    assert t("lora_te2_text_model_encoder_layers_0_mlp_fc2.alpha", "sdxl") == \
        ("cond_stage_model.1.transformer.text_model.encoder.layers.0.mlp.fc2.weight", "alpha")
    assert t("text_encoder.text_model.encoder.layers.0.self_attn.k_proj.lora_A.weight", "sd1") == \
        (te + "self_attn.k_proj.weight", "lora_down")
    # old diffusers attention-processor LoRA
    assert t("unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor.to_out_lora.up.weight", "sd1") == \
        (DM + "input_blocks.1.1.transformer_blocks.0.attn1.to_out.0.weight", "lora_up")
    # PEFT with adapter name
    assert t("unet.mid_block.attentions.0.proj_in.lora_A.default.weight", "sd1") == \
        (DM + "middle_block.1.proj_in.weight", "lora_down")
    # LyCORIS
    assert t("lora_unet_down_blocks_0_resnets_0_conv1.hada_w1_a", "sd1") == \
        (DM + "input_blocks.1.0.in_layers.2.weight", "hada_w1_a")
    assert t("lycoris_down_blocks_0_resnets_0_conv1.lokr_w2_b", "sd1") == \
        (DM + "input_blocks.1.0.in_layers.2.weight", "lokr_w2_b")
    assert t("lora_unet_down_blocks_0_resnets_0_conv1.diff_b", "sd1") == \
        (DM + "input_blocks.1.0.in_layers.2.bias", "diff_b")
    # Flux: kohya (BFL names), PEFT diffusers (split q/k/v -> part suffix), ComfyUI
    assert t("lora_unet_double_blocks_0_img_attn_proj.lora_down.weight", "flux") == \
        (DM + "double_blocks.0.img_attn.proj.weight", "lora_down")
    assert t("lora_unet_single_blocks_5_linear1.lora_up.weight", "flux") == (DM + "single_blocks.5.linear1.weight", "lora_up")
    assert t("transformer.transformer_blocks.2.attn.to_k.lora_A.weight", "flux") == \
        (DM + "double_blocks.2.img_attn.qkv.weight.1", "lora_down")
    assert t("transformer_blocks.2.attn.add_v_proj.lora_B.weight", "flux") == \
        (DM + "double_blocks.2.txt_attn.qkv.weight.2", "lora_up")
    assert t("diffusion_model.double_blocks.1.txt_mod.lin.lora_B.weight", "flux") == \
        (DM + "double_blocks.1.txt_mod.lin.weight", "lora_up")
    # not LoRA tensors
    assert t("model.diffusion_model.input_blocks.0.0.weight") is None
    assert t(".alpha") is None


def test_kohya_to_dotted():
    assert kohya_to_dotted("down_blocks_0_attentions_1_transformer_blocks_0_attn1_to_out_0") == \
        "down_blocks.0.attentions.1.transformer_blocks.0.attn1.to_out.0"
    assert kohya_to_dotted("time_embedding_linear_1") == "time_embedding.linear_1"
    assert kohya_to_dotted("text_model_encoder_layers_11_self_attn_out_proj") == \
        "text_model.encoder.layers.11.self_attn.out_proj"


# ---- diffusers folders ------------------------------------------------------------------------------

import struct  # noqa: E402

import numpy as np  # noqa: E402

from sdrt.io.diffusers import read_diffusers_folder  # noqa: E402


def write_st(path, tensors: dict):
    """A safetensors file by hand (no dependency): header JSON + raw little-endian data."""
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[k] = {"dtype": {"float32": "F32", "float16": "F16"}[a.dtype.name], "shape": list(a.shape),
                     "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def bin_file(path, name, values):
    """A one-tensor PyTorch zip checkpoint, pickle written by hand."""
    import io
    import zipfile
    U = lambda s: b"X" + struct.pack("<I", len(s)) + s.encode()   # noqa: E731
    n = len(values)
    pkl = (b"\x80\x02}(" + U(name) + b"ctorch._utils\n_rebuild_tensor_v2\n((" + U("storage")
           + b"ctorch\nFloatStorage\n" + U("0") + U("cpu") + b"J" + struct.pack("<i", n) + b"tQK\x00(J"
           + struct.pack("<i", n) + b"t(K\x01t\x89ccollections\nOrderedDict\n)RtRu.")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/data/0", np.asarray(values, np.float32).tobytes())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(out.getvalue())


def sd_folder(root, xl=False, te_bin=False, index=None):
    r = np.random.default_rng(0)
    z = lambda *s: r.standard_normal(s).astype(np.float32)   # noqa: E731
    json.dump({"_class_name": "StableDiffusionXLPipeline" if xl else "StableDiffusionPipeline",
               "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
               "text_encoder": ["transformers", "CLIPTextModel"]}, open(os.path.join(root, "model_index.json"), "w"))
    rows = TABLES["sdxl_unet" if xl else "sd15_unet"]
    unet = {d: z(4) for d, *_ in rows}
    unet["conv_in.weight"] = z(8, 4, 3, 3)
    write_st(os.path.join(root, "unet", "diffusion_pytorch_model.safetensors"), unet)
    vae = {d: z(2) for d, *_ in TABLES["sd_vae"]}
    vae["decoder.mid_block.attentions.0.to_q.weight"] = z(6, 5)
    write_st(os.path.join(root, "vae", "diffusion_pytorch_model.fp16.safetensors"),
             {k: v.astype(np.float16) for k, v in vae.items()})
    te = {"text_model.embeddings.token_embedding.weight": z(10, 768), "text_model.final_layer_norm.weight": z(768)}
    if te_bin:
        bin_file(os.path.join(root, "text_encoder", "pytorch_model-1.bin"), "text_model.final_layer_norm.weight",
                 [1.0, 2.0])
        bin_file(os.path.join(root, "text_encoder", "pytorch_model-2.bin"), "text_model.embeddings.position_ids",
                 [0.0, 1.0])
        wm = index or {"text_model.final_layer_norm.weight": "pytorch_model-1.bin",
                       "text_model.embeddings.position_ids": "pytorch_model-2.bin"}
        json.dump({"weight_map": wm}, open(os.path.join(root, "text_encoder", "pytorch_model.bin.index.json"), "w"))
    else:
        write_st(os.path.join(root, "text_encoder", "model.safetensors"), te)
    if xl:
        write_st(os.path.join(root, "text_encoder_2", "model.safetensors"),
                 {"text_model.embeddings.token_embedding.weight": z(10, 1280), "text_projection.weight": z(3, 1280)})
    return unet, vae


@pytest.mark.parametrize("xl", [False, True])
def test_diffusers_folder(tmp_path, xl):
    unet, vae = sd_folder(str(tmp_path), xl=xl)
    m = read_diffusers_folder(str(tmp_path))
    key = "sdxl_unet" if xl else "sd15_unet"
    for d, _, ldm, _ in TABLES[key]:
        assert DM + ldm in m.tensors
        assert m.metadata["source_names"][DM + ldm] == "unet." + d
    np.testing.assert_array_equal(m[DM + "input_blocks.0.0.weight"].to_f32(), unet["conv_in.weight"])
    for _d, _, ldm, _ in TABLES["sd_vae"]:
        assert VAE + ldm in m.tensors
    q = m[VAE + "decoder.mid.attn_1.q.weight"]
    assert q.shape == (6, 5, 1, 1) and q.dtype.name == "F16"           # Linear -> 1x1 conv, zero copy
    np.testing.assert_array_equal(q.to_f32()[:, :, 0, 0], vae["decoder.mid_block.attentions.0.to_q.weight"].astype(np.float16))
    assert "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight" in m.tensors
    assert m.metadata["version"] == ("sdxl" if xl else "sd1")
    if xl:
        p = m["cond_stage_model.1.transformer.text_model.text_projection"]
        assert p.shape == (1280, 3)                                     # OpenCLIP layout (in, out)
    assert m.sources and all(os.path.exists(s[0]) for s in m.sources)


def test_diffusers_folder_bin_shards_and_refusals(tmp_path):
    sd_folder(str(tmp_path), te_bin=True)
    m = read_diffusers_folder(str(tmp_path))
    np.testing.assert_array_equal(m["cond_stage_model.transformer.text_model.final_layer_norm.weight"].to_f32(), [1, 2])
    # a shard name that climbs out of the folder, a tensor missing from its shard, a broken component
    for wm, words in [({"text_model.final_layer_norm.weight": "../unet/x.bin"}, "plain file"),
                      ({"text_model.nope": "pytorch_model-1.bin"}, "missing from its declared shard"),
                      ({"text_model.final_layer_norm.weight": "gone.bin"}, "missing")]:
        d = tmp_path / ("case" + str(abs(hash(str(wm)))))
        d.mkdir()
        sd_folder(str(d), te_bin=True, index=wm)
        with pytest.raises(ModelFileError, match=words):
            read_diffusers_folder(str(d))
    d = tmp_path / "broken"
    d.mkdir()
    sd_folder(str(d))
    with open(d / "vae" / "diffusion_pytorch_model.fp16.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ModelFileError, match="component 'vae'"):
        read_diffusers_folder(str(d))
    e = tmp_path / "empty"
    e.mkdir()
    with pytest.raises(ModelFileError, match="unet/ or transformer/"):
        read_diffusers_folder(str(e))
    (e / "model_index.json").write_text("{not json")
    with pytest.raises(ModelFileError):
        read_diffusers_folder(str(e))


def test_diffusers_flux_transformer(tmp_path):
    z = np.zeros((2, 2), np.float32)
    json.dump({"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
               "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"]},
              open(tmp_path / "model_index.json", "w"))
    write_st(str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"),
             {"transformer_blocks.0.attn.to_q.weight": z, "transformer_blocks.0.attn.to_k.weight": z,
              "single_transformer_blocks.0.proj_mlp.weight": z, "x_embedder.weight": np.zeros((8, 64), np.float32)})
    write_st(str(tmp_path / "text_encoder_2" / "model.safetensors"),
             {"encoder.block.0.layer.0.SelfAttention.q.weight": z, "shared.weight": z})
    write_st(str(tmp_path / "text_encoder" / "model.safetensors"),
             {"text_model.embeddings.token_embedding.weight": np.zeros((4, 768), np.float32)})
    m = read_diffusers_folder(str(tmp_path))
    assert set(m.tensors) == {DM + "double_blocks.0.img_attn.qkv.weight", DM + "double_blocks.0.img_attn.qkv.weight.1",
                              DM + "single_blocks.0.linear1.weight.3", DM + "img_in.weight",
                              "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight",
                              "text_encoders.t5xxl.transformer.shared.weight",
                              "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight"}
    assert m.metadata["version"] == "flux"
