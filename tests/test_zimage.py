"""Z-Image: the DiT (sdrt.models.diffusion.zimage) against diffusers' ZImageTransformer2DModel, the
family record (sdrt.models.zimage: detection, diffusers names, the --llm component, the
conditioner = sd.cpp's LLMEmbedder) and a CLI run on tiny random files.

Golden: tools/make_zimage_goldens.py -> tests/fixtures/zimage_transformer.npz (weights with
float16-exact values under the original names; diffusers' output, negated as sd.cpp returns it).
No torch here. The comparison with sd-cli itself is tests/test_zimage_sdcli.py (opt-in)."""
import os

import numpy as np
import pytest

import zimage_tiny as zt
from sdrt import ModelFileError, UsageError
from sdrt.cli import main as cli
from sdrt.models import families as FM
from sdrt.models.diffusion.zimage import ZImageConfig, ZImageModel, zimage_ids
from sdrt.models.llm_conditioning import PREFIX_LLM, LLMConditioner
from sdrt.models.prompt import apply_token_weights
from sdrt.models.te.qwen_llm import QwenLLM
from sdrt.models.te.qwen_tokenizer import ZIMAGE_TEMPLATE, QwenTokenizer
from sdrt.models.zimage import Z_IMAGE, join_zimage_parts, zimage_diffusers_name
from sdrt.ops.convert import f32_to_raw
from sdrt.ops.tensor import Tensor
from sdrt.ops.threads import get_threads, set_threads

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
DM = "model.diffusion_model."


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(os.path.join(FIX, "zimage_transformer.npz")))


def table(gold, dtype="F32", prefix=DM):
    out = {}
    for k, v in gold.items():
        if k.startswith("w/"):
            x = v.astype(np.float32)
            t = Tensor.from_numpy(f32_to_raw(x, dtype), dtype=dtype) if x.ndim == 2 and dtype != "F32" \
                else Tensor.from_numpy(x)
            out[prefix + k[2:]] = t
    return out


def test_config_from_weights(gold):
    cfg = ZImageConfig.detect_from_weights(table(gold))
    assert cfg == ZImageConfig(hidden=128, layers=2, noise_refiner_layers=1, context_refiner_layers=1, heads=1,
                               kv_heads=1, head_dim=128, ffn=341, in_channels=16, out_channels=16, cap_dim=64,
                               t_freq=256, adaln_dim=128)
    assert cfg.norm_eps == 1e-5 and cfg.qk_eps == 1e-6                  # sd.cpp's q/k norm eps


@pytest.mark.parametrize("case", ["odd", "even"])
def test_matches_diffusers(gold, case):
    """diffusers' q/k norm eps (1e-5) gives the exact comparison; sd.cpp's 1e-6 (the default)
    differs from it by far less than the bar."""
    cfg = ZImageConfig.detect_from_weights(table(gold))
    ref = gold[f"out/{case}"]
    args = (gold[f"x/{case}"], gold[f"t/{case}"].reshape(1), gold[f"ctx/{case}"])
    for qk, tol in ((1e-5, 1e-4), (1e-6, 2e-4)):
        y = ZImageModel(table(gold), config=cfg.with_(qk_eps=qk))(*args)
        err = float(np.abs(y - ref).max())
        print(f"Z-Image {case} qk_eps {qk}: max-abs {err:.2e} (|ref| max {np.abs(ref).max():.2f})")
        assert y.shape == ref.shape and err < tol


def test_f16_weights_and_batch(gold):
    """F16 weights run as stored (same values: same result); a batch of 2 equals two single runs."""
    m32, m16 = ZImageModel(table(gold)), ZImageModel(table(gold, "F16"))
    assert m16.layers[0].qkv.weight.dtype.name == "F16"
    x, ctx = gold["x/odd"], gold["ctx/odd"]
    y = m32(x, [700.0], ctx)
    np.testing.assert_allclose(m16(x, [700.0], ctx), y, atol=1e-4)
    xb = np.concatenate([x, x[:, :, ::-1].copy()])
    yb = m32(xb, [700.0, 300.0], ctx)
    np.testing.assert_allclose(yb[0], y[0], atol=1e-4)
    np.testing.assert_allclose(yb[1], m32(xb[1:], [300.0], ctx)[0], atol=1e-4)


def test_rope_ids_as_sdcpp():
    ids = zimage_ids(6, 10, 7)                       # 7 text tokens -> 32; 3x5 patches -> 15 + 17 pads
    assert ids.shape == (64, 3)
    assert ids[:32, 0].tolist() == list(range(1, 33)) and not ids[:32, 1:].any()
    assert (ids[32:47, 0] == 33).all() and ids[32:47, 1].tolist() == [r for r in range(3) for _ in range(5)]
    assert ids[32:47, 2].tolist() == list(range(5)) * 3 and not ids[47:].any()


def test_diffusers_names_and_joined_qkv(gold):
    """A diffusers-named transformer (to_q/k/v split, norm_q, to_out.0, all_x_embedder.2-1)
    converts to the original names and gives the same model."""
    assert zimage_diffusers_name("all_x_embedder.2-1.weight") == "x_embedder.weight"
    assert zimage_diffusers_name("all_final_layer.2-1.adaLN_modulation.1.bias") == "final_layer.adaLN_modulation.1.bias"
    assert zimage_diffusers_name("layers.40.attention.to_v.weight") == "layers.40.attention.qkv.weight.2"
    assert zimage_diffusers_name("context_refiner.0.attention.norm_k.weight") == "context_refiner.0.attention.k_norm.weight"
    assert zimage_diffusers_name("noise_refiner.1.attention.to_out.0.weight") == "noise_refiner.1.attention.out.weight"
    assert zimage_diffusers_name("layers.0.feed_forward.w1.weight") == "layers.0.feed_forward.w1.weight"
    t = table(gold)
    split = {}
    for k, v in t.items():
        if k.endswith("attention.qkv.weight"):
            a = v.to_f32()
            n = a.shape[0] // 3
            for j, part in enumerate(("to_q", "to_k", "to_v")):
                dname = k[len(DM):].replace("qkv", part)
                split[DM + zimage_diffusers_name(dname)] = Tensor.from_numpy(np.ascontiguousarray(a[j * n:(j + 1) * n]))
        else:
            split[k] = v
    joined = join_zimage_parts(split)
    x, ctx = gold["x/even"], gold["ctx/even"]
    np.testing.assert_allclose(ZImageModel(joined)(x, [250.0], ctx), ZImageModel(t)(x, [250.0], ctx), atol=1e-6)
    del split[DM + "layers.1.attention.qkv.weight.2"]
    with pytest.raises(ModelFileError, match="parts missing"):
        join_zimage_parts(split)


def test_family_record():
    fam = FM.get_family("z_image")
    assert fam.runnable and FM.family_of(Z_IMAGE) is fam and fam.text_encoders == ("llm",)
    assert (fam.latent_channels, fam.latent_scale, fam.latent_shift) == (16, 0.3611, 0.1159)
    assert (fam.prediction, fam.flow_shift, fam.default_sampler, fam.default_scheduler) == ("flow", 3.0, "euler",
                                                                                            "discrete")
    c = FM.component("llm")
    assert c.flag == "--llm" and c.prefix_for("dit") == PREFIX_LLM
    from sdrt.io.detect import detect_version
    assert detect_version({DM + "cap_embedder.0.weight": (4,)}) == Z_IMAGE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return zt.write(str(tmp_path_factory.mktemp("zimage_tiny")))


def test_conditioner_is_sdcpp_llm_embedder(tiny):
    """Cond.context = apply_token_weights(LLM(template ids), weights) (the final norm: 2 < 35 layers)."""
    from sdrt.io import open_model
    llm_table = {PREFIX_LLM + k: v for k, v in open_model(tiny["llm"]).tensors.items()}
    fam = FM.get_family("z_image")
    cond = fam.conditioner(llm_table, Z_IMAGE)
    assert isinstance(cond, LLMConditioner)
    c = cond.encode("a (red:1.3) cat")
    tok = QwenTokenizer()
    ids, w = tok.encode_template(ZIMAGE_TEMPLATE, "a (red:1.3) cat")
    h = QwenLLM(llm_table).run(ids, 0)[0]
    np.testing.assert_allclose(c.context[0], apply_token_weights(h, w), atol=1e-6)
    assert c.context.shape == (1, len(ids), 64) and c.y is None
    with pytest.raises(UsageError, match="--llm"):
        fam.conditioner({}, Z_IMAGE)


def test_cli_runs_tiny_files(tiny, tmp_path):
    out = str(tmp_path / "z.png")
    args = [*zt.args(tiny), "-p", "a cat", "-W", "64", "-H", "48", "--steps", "2",
            "--cfg-scale", "1", "-s", "7", "-o", out]
    assert cli.main(args) == 0
    from PIL import Image
    img = np.asarray(Image.open(out))
    assert img.shape == (48, 64, 3) and img.std() > 1.0

def test_missing_llm_is_named(tiny, capsys):
    args = ["--diffusion-model", tiny["diffusion_model"], "--vae", tiny["vae"], "-p", "x",
            "-W", "32", "-H", "32", "--steps", "1", "-o", "unused.png"]
    assert cli.main(args) != 0
    assert "--llm" in capsys.readouterr().err


_LLAMA = (("model.embed_tokens.", "token_embd."), ("model.norm.", "output_norm."), ("model.layers.", "blk."),
          ("self_attn.q_proj.", "attn_q."), ("self_attn.k_proj.", "attn_k."), ("self_attn.v_proj.", "attn_v."),
          ("self_attn.o_proj.", "attn_output."), ("self_attn.q_norm.", "attn_q_norm."),
          ("self_attn.k_norm.", "attn_k_norm."), ("input_layernorm.", "attn_norm."),
          ("post_attention_layernorm.", "ffn_norm."), ("mlp.gate_proj.", "ffn_gate."), ("mlp.up_proj.", "ffn_up."),
          ("mlp.down_proj.", "ffn_down."))


def test_llm_gguf_q8_0_with_llama_cpp_names(tiny, tmp_path, monkeypatch):
    """A Q8_0 GGUF of the LLM with llama.cpp's names (as the Qwen3-4B GGUFs people download) loads
    through --llm, keeps Q8_0 in memory and conditions as the same values in F32 do (with the
    dequantizing GEMM; the default int8-activation kernel rounds x as ggml does: ~5e-3 here)."""
    monkeypatch.setenv("SDRT_QGEMM", "off")
    from sdrt.engine.model_manager import load_models
    from sdrt.engine.params import ModelParams
    from sdrt.io import open_model, write_gguf
    src = open_model(tiny["llm"]).tensors
    q8, f32 = {}, {}
    for name, t in src.items():
        llama = name
        for a, b in _LLAMA:
            llama = llama.replace(a, b)
        x = t.to_f32()
        if x.ndim == 2:
            q = Tensor.from_numpy(f32_to_raw(x, "Q8_0"), dtype="Q8_0")
            q8[llama], f32[name] = q, Tensor.from_numpy(q.to_f32())
        else:
            q8[llama] = f32[name] = Tensor.from_numpy(x)
    path = str(tmp_path / "qwen3-q8_0.gguf")
    write_gguf(path, q8)
    lm = load_models(ModelParams(diffusion_model=tiny["diffusion_model"], vae=tiny["vae"], parts={"llm": path}))
    assert lm.version == Z_IMAGE
    w = lm.tensors[PREFIX_LLM + "model.layers.1.self_attn.q_proj.weight"]
    assert w.dtype.name == "Q8_0"
    fam = FM.get_family("z_image")
    got = fam.conditioner(lm.tensors, Z_IMAGE).encode("a cat").context
    want = fam.conditioner({PREFIX_LLM + k: v for k, v in f32.items()}, Z_IMAGE).encode("a cat").context
    np.testing.assert_allclose(got, want, atol=1e-5)


def _stubs(layout: dict, prefix: str) -> dict:
    """Shape-only F32 tensors (no data) for a {name: torch shape} layout."""
    from sdrt.ops import dtypes
    f32 = dtypes.get("F32")
    return {prefix + n: Tensor(f32, tuple(reversed(s)), nb=(0,) * len(s), storage=np.zeros(8, np.uint8))
            for n, s in layout.items()}


def test_released_shapes_give_sdcpp_numbers():
    """The released Z-Image DiT and Qwen3-4B layouts (tools/make_zimage_checkpoint.py at full size)
    detect as sd.cpp's fixed ZImageParams / LLMParams, and every tensor's shape checks out."""
    mkz = zt.mkz
    dit = _stubs(mkz.dit_layout(3840, 30, 2, 2560), DM)
    assert ZImageConfig.detect_from_weights(dit) == ZImageConfig()
    assert len(ZImageModel(dit).layers) == 30
    llm = _stubs(mkz.qwen3_layout(2560, 36, 9728), PREFIX_LLM)
    from sdrt.models.te.qwen_llm import QwenLLMConfig
    assert QwenLLMConfig.detect_from_weights(llm) == QwenLLMConfig()
    assert QwenLLM(llm).reads_layer(ZIMAGE_TEMPLATE.out_layer) == 35


def test_checkpoint_tool_writes_gguf_as_sdcpp_convert(tmp_path):
    """tools/make_zimage_checkpoint.py --type q4_K / --llm-type q8_0 (issue 20's full-size CPU bench
    files, here at width 256): the types sd-cli's `-M convert` gives each tensor (tensor_should_be_converted:
    biases, x_embedder / t_embedder / final_layer and the 128-wide q/k norms under Q4_K stay in the base
    type), the same values as the float file up to the quantization, and the files load as Z-Image / Qwen3."""
    from sdrt.io import read_gguf
    from sdrt.ops.convert import raw_to_f32
    mkz = zt.mkz
    d = str(tmp_path)
    assert mkz.main(["-o", d, "--width", "256", "--llm-hidden", "256", "--llm-ffn", "512", "--type", "q4_K",
                     "--llm-type", "q8_0"]) == 0
    dit = read_gguf(os.path.join(d, "zimage-q4_K.gguf")).tensors
    layout = mkz.dit_layout(256, 2, 1, 256)
    assert set(dit) == set(layout)
    for n, t in dit.items():
        kept = (n.endswith(".bias") or n.startswith(("x_embedder.", "t_embedder.", "final_layer."))
                or layout[n][-1] % 256 != 0)
        assert t.dtype.name == ("BF16" if kept else "Q4_K"), n
    w = "layers.1.feed_forward.w2.weight"
    ref = mkz._mkflux().values(w, layout[w], 0)
    got = raw_to_f32(dit[w].numpy(), dit[w].dtype).reshape(ref.shape)
    assert np.sqrt(np.mean((got - ref) ** 2)) < 0.15 * ref.std()          # Q4_K: ~4 bits
    assert ZImageConfig.detect_from_weights(dit, "").hidden == 256
    llm = read_gguf(os.path.join(d, "qwen3-q8_0.gguf")).tensors
    assert {t.dtype.name for t in llm.values()} == {"Q8_0"}               # every row a multiple of 32, no bias
    from sdrt.models.te.qwen_llm import QwenLLMConfig
    assert QwenLLMConfig.detect_from_weights(llm, "").hidden == 256
