"""Which model is this? From tensor names and shapes alone, as stable-diffusion.cpp's
`ModelLoader::get_sd_version` tells it; plus per-component dtype statistics and the prediction type.

Input: a ModelFile, or a dict name -> Tensor (shape from `.ne`, ggml order) or name -> shape
(a tuple in numpy/torch order, e.g. (320, 4, 3, 3)); data is never read. Names are the canonical
ones (`model.diffusion_model.`, `first_stage_model.`, `cond_stage_model.`, `conditioner.`,
`text_encoders.`), or a raw diffusers table (`unet.`, `vae.`, `te.`), as sd.cpp accepts both.
A table with none of these prefixes is a bare diffusion model (`--diffusion-model` file): its
names are looked at under `model.diffusion_model.`, as sd.cpp prefixes them.

How: one pass collects the few facts any rule needs (`_Facts`), then the families decide.
`MARKERS` is a table of tensor names that identify one model each (sd.cpp's early returns, in its
order, first match wins); `FAMILIES` are small functions for the families told apart by shapes
(Wan, the UNets, Flux, Flux2, SD1/SD2). Adding a model is one table row or one function.

Versions are short strings (`SD1`, `SDXL_INPAINT`, ...); `family(version)` groups them.
Beyond sd.cpp: `chroma` (sd.cpp: FLUX + a flag from `distilled_guidance_layer`) and
`sdxl_refiner` (an ADM UNet with only the OpenCLIP-G encoder; sd.cpp says unknown).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["detect_version", "family", "is_unet", "dtype_stats", "prediction_type", "default_flow_shift",
           "component_of", "VERSIONS", "UNKNOWN"]

SD1, SD1_INPAINT, SD1_PIX2PIX, SD1_TINY_UNET = "sd1", "sd1_inpaint", "sd1_pix2pix", "sd1_tiny_unet"
SD2, SD2_INPAINT, SD2_TINY_UNET = "sd2", "sd2_inpaint", "sd2_tiny_unet"
SDXS_512_DS, SDXS_09 = "sdxs_512_ds", "sdxs_09"
SDXL, SDXL_INPAINT, SDXL_PIX2PIX = "sdxl", "sdxl_inpaint", "sdxl_pix2pix"
SDXL_VEGA, SDXL_SSD1B, SDXL_REFINER = "sdxl_vega", "sdxl_ssd1b", "sdxl_refiner"
SVD, SD3 = "svd", "sd3"
FLUX, FLUX_FILL, FLUX_CONTROLS, FLEX_2, CHROMA, CHROMA_RADIANCE = (
    "flux", "flux_fill", "flux_controls", "flex_2", "chroma", "chroma_radiance")
WAN2, WAN2_2_I2V, WAN2_2_TI2V = "wan2", "wan2.2_i2v", "wan2.2_ti2v"
FLUX2, FLUX2_KLEIN = "flux2", "flux2_klein"
QWEN_IMAGE, QWEN_IMAGE_LAYERED = "qwen_image", "qwen_image_layered"
(LINGBOT_VIDEO, HUNYUAN_VIDEO, ANIMA, LTXAV, MINIMAX_H3, HIDREAM_O1, Z_IMAGE, BOOGU_IMAGE, OVIS_IMAGE,
 ERNIE_IMAGE, LENS, MINIT2I, LONGCAT, PID, IDEOGRAM4, SEFI_IMAGE, KREA2, MAGE_FLOW) = (
    "lingbot_video", "hunyuan_video", "anima", "ltxav", "minimax_h3", "hidream_o1", "z_image", "boogu_image",
    "ovis_image", "ernie_image", "lens", "minit2i", "longcat", "pid", "ideogram4", "sefi_image", "krea2",
    "mage_flow")
UNKNOWN = "unknown"

_FAMILY = {
    "sd1": (SD1, SD1_INPAINT, SD1_PIX2PIX, SD1_TINY_UNET, SDXS_512_DS),
    "sd2": (SD2, SD2_INPAINT, SD2_TINY_UNET, SDXS_09),
    "sdxl": (SDXL, SDXL_INPAINT, SDXL_PIX2PIX, SDXL_VEGA, SDXL_SSD1B, SDXL_REFINER),
    "svd": (SVD,), "sd3": (SD3,),
    "flux": (FLUX, FLUX_FILL, FLUX_CONTROLS, FLEX_2, OVIS_IMAGE, CHROMA, CHROMA_RADIANCE),
    "flux2": (FLUX2, FLUX2_KLEIN), "wan": (WAN2, WAN2_2_I2V, WAN2_2_TI2V),
    "qwen_image": (QWEN_IMAGE, QWEN_IMAGE_LAYERED),
    **{v: (v,) for v in (LINGBOT_VIDEO, HUNYUAN_VIDEO, ANIMA, LTXAV, MINIMAX_H3, HIDREAM_O1, Z_IMAGE, BOOGU_IMAGE,
                         ERNIE_IMAGE, LENS, MINIT2I, LONGCAT, PID, IDEOGRAM4, SEFI_IMAGE, KREA2, MAGE_FLOW)},
}
_FAMILY_OF = {v: f for f, vs in _FAMILY.items() for v in vs}
VERSIONS = tuple(_FAMILY_OF) + (UNKNOWN,)

DM = "model.diffusion_model."
_KNOWN_TOPS = ("model.", "first_stage_model.", "cond_stage_model.", "conditioner.", "text_encoders.", "unet.",
               "vae.", "te.", "text_encoder", "transformer.", "tae.", "net.", "llm_adapter.")


def family(version: str) -> str:
    """'sd1', 'sd2', 'sdxl', 'sd3', 'flux', 'flux2', 'wan', 'qwen_image', ... or 'unknown'."""
    return _FAMILY_OF.get(version, UNKNOWN)


def is_unet(version: str) -> bool:
    return family(version) in ("sd1", "sd2", "sdxl")


# ---- facts: one pass over the names -------------------------------------------------------------

def _ne_of(v) -> tuple:
    ne = getattr(v, "ne", None)
    if ne is not None:
        return tuple(ne)
    shape = tuple(int(x) for x in v)
    return tuple(reversed(shape)) or (1,)


@dataclass
class _Facts:
    names: dict                      # name -> ne (ggml order, not folded)
    blob: str = ""                   # all names joined by "\n", for fast substring tests
    token_embedding: tuple = ()
    input_block: tuple = ()
    context_embedding: tuple = ()
    flags: set = field(default_factory=set)

    def has(self, s: str) -> bool:
        return s in self.blob

    def ne(self, name: str) -> tuple:
        return self.names.get(name, ())


_TOKEN_EMBEDDINGS = ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
                     "cond_stage_model.model.token_embedding.weight", "text_model.embeddings.token_embedding.weight",
                     "te.text_model.embeddings.token_embedding.weight",
                     "conditioner.embedders.0.model.token_embedding.weight",
                     "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight")
_INPUT_BLOCKS = (DM + "input_blocks.0.0.weight", DM + "img_in.weight", "unet.conv_in.weight")
_CONTEXT = (DM + "txt_in.weight", DM + "context_embedder.weight")


def _facts(tensors) -> _Facts:
    table = getattr(tensors, "tensors", tensors)
    names = {str(k): _ne_of(v) for k, v in table.items()}
    if names and not any(n.startswith(_KNOWN_TOPS) for n in names):
        names = {DM + k: v for k, v in names.items()}     # a bare --diffusion-model file
    f = _Facts(names, "\n" + "\n".join(names) + "\n")
    for n in _TOKEN_EMBEDDINGS:
        if n in names:
            f.token_embedding = names[n]
    for n in _INPUT_BLOCKS:
        if n in names:
            f.input_block = names[n]
    for n in _CONTEXT:
        if n in names:
            f.context_embedding = names[n]
    return f


def _dim(ne: tuple, i: int) -> int:
    """ne[i], with dims past 3 folded into ne[3] as sd.cpp's loader folds 5-D weights."""
    if i < 3:
        return ne[i] if len(ne) > i else (1 if ne else 0)
    p = 1
    for d in ne[3:]:
        p *= d
    return p if len(ne) > 3 else (1 if ne else 0)


# ---- the rules -------------------------------------------------------------------------------------

# (substring of some tensor name, version, extra test or None). sd.cpp's early returns.
MARKERS: list[tuple[str, str, Callable[[_Facts], bool] | None]] = [
    (DM + "net.lq_proj.latent_proj.0.weight", PID, None),
    ("embed_image_indicator.weight", IDEOGRAM4, None),
    (DM + "txtfusion.projector.weight", KREA2, None),
    (DM + "text_fusion.projector.weight", KREA2, None),
    (DM + "nerf_final_layer_conv.", CHROMA_RADIANCE, None),
    (DM + "joint_blocks.", SD3, None),
    ("model.x_embedder.proj1.weight", HIDREAM_O1,
     lambda f: "model.language_model.layers.0.self_attn.q_proj.weight" in f.names),
    (DM + "transformer_blocks.0.attn.norm_added_q.weight", LENS,
     lambda f: DM + "transformer_blocks.0.img_mlp.w1.weight" in f.names),
    ("net.img_embedder.proj1.weight", MINIT2I, None),
    (DM + "transformer_blocks.0.img_mod.1.weight", MAGE_FLOW, lambda f: _dim(f.ne(DM + "img_in.weight"), 0) == 128),
    (DM + "transformer_blocks.0.img_mod.1.weight", QWEN_IMAGE_LAYERED,
     lambda f: DM + "time_text_embed.addition_t_embedding.weight" in f.names),
    (DM + "transformer_blocks.0.img_mod.1.weight", QWEN_IMAGE, None),
    (DM + "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight", HUNYUAN_VIDEO, None),
    ("llm_adapter.blocks.0.cross_attn.q_proj.weight", ANIMA, None),
    ("dual_time_embed.semantic_embedder.linear_1.weight", SEFI_IMAGE, None),
    (DM + "double_blocks.0.img_mlp.gate_proj.weight", OVIS_IMAGE, None),
    (DM + "cap_embedder.0.weight", Z_IMAGE, None),
    ("double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight", BOOGU_IMAGE, None),
    (DM + "layers.0.adaLN_sa_ln.weight", ERNIE_IMAGE, None),
    (DM + "adaln_single.emb.timestep_embedder.linear_1.bias", LTXAV, None),
    (DM + "video_patch_proj.weight", MINIMAX_H3, lambda f: DM + "audio_patch_proj.weight" in f.names),
    (DM + "patch_embedder.weight", LINGBOT_VIDEO, None),
    (DM + "input_blocks.8.0.time_mixer.mix_factor", SVD, None),
]


def _wan(f: _Facts):
    if not f.has(DM + "blocks.0.cross_attn.norm_k.weight"):
        return None
    ch = _dim(f.ne(DM + "patch_embedding.weight"), 3)
    img_emb = f.has(DM + "img_emb")
    if ch == 184320 and not img_emb:          # 5120 x 36 input channels
        return WAN2_2_I2V
    if ch == 147456 and not img_emb:          # 3072 x 48
        return WAN2_2_TI2V
    return WAN2


def _unet_layout(f: _Facts):
    unet = f.has(DM + "input_blocks.") or f.has("\nunet.down_blocks.")
    multi = f.has("conditioner.embedders.1") or f.has("cond_stage_model.1") or f.has("te.1")
    return unet, multi


def _inpaint_kind(f: _Facts):
    c = _dim(f.input_block, 2)
    return "inpaint" if c == 9 else "pix2pix" if c == 8 else None


def _has_mid1(f):
    return f.has(DM + "middle_block.1.") or f.has("\nunet.mid_block.resnets.1.")


def _sdxl(f: _Facts):
    unet, multi = _unet_layout(f)
    if not unet:
        return None
    if not multi:
        refiner = f.has(DM + "label_emb.0.0.weight") and (
            _dim(f.token_embedding, 0) == 1280 or _dim(f.input_block, 3) == 384)
        return SDXL_REFINER if refiner else None
    kind = _inpaint_kind(f)
    if kind:
        return SDXL_INPAINT if kind == "inpaint" else SDXL_PIX2PIX
    if not _has_mid1(f):
        has_311 = (f.has(DM + "output_blocks.3.1.transformer_blocks.1")
                   or f.has("\nunet.up_blocks.1.attentions.0.transformer_blocks.1"))
        return SDXL_SSD1B if has_311 else SDXL_VEGA
    return SDXL


def _flux(f: _Facts):
    if not (f.has(DM + "double_blocks.") or f.has(DM + "single_transformer_blocks.")):
        return None
    if f.has(DM + "double_stream_modulation_img.lin.weight"):
        return FLUX2 if f.has("single_blocks.47.linear1.weight") else FLUX2_KLEIN
    if _dim(f.context_embedding, 0) == 3584:
        return LONGCAT
    if f.has("distilled_guidance_layer.in_proj.weight"):
        return CHROMA
    return {384: FLUX_FILL, 128: FLUX_CONTROLS, 196: FLEX_2}.get(_dim(f.input_block, 0), FLUX)


def _flux2_only(f: _Facts):
    if f.has(DM + "double_stream_modulation_img.lin.weight"):
        return FLUX2 if f.has("single_blocks.47.linear1.weight") else FLUX2_KLEIN
    return None


def _sd12(f: _Facts):
    width = _dim(f.token_embedding, 0)
    kind = _inpaint_kind(f)
    mid1 = _has_mid1(f)
    if width == 768:
        if kind:
            return SD1_INPAINT if kind == "inpaint" else SD1_PIX2PIX
        if not mid1:
            has_71 = f.has(DM + "output_blocks.7.1") or f.has("\nunet.up_blocks.2.attentions.1")
            return SD1_TINY_UNET if has_71 else SDXS_512_DS
        return SD1
    if width == 1024:
        if kind == "inpaint":
            return SD2_INPAINT
        if not mid1:
            k = f.ne(DM + "output_blocks.7.1.transformer_blocks.0.attn1.to_k.weight")
            return SDXS_09 if _dim(k, 0) == 1024 else SD2_TINY_UNET
        return SD2
    return None


# Families told apart by shapes, in sd.cpp's order (Wan, then the XL UNets, Flux, Flux2, SD1/SD2).
FAMILIES: list[Callable[[_Facts], str | None]] = [_wan, _sdxl, _flux, _flux2_only, _sd12]


def detect_version(tensors) -> str:
    """The model version (one of VERSIONS) from names and shapes; 'unknown' if nothing matches."""
    f = _facts(tensors)
    for marker, version, extra in MARKERS:
        if f.has(marker) and (extra is None or extra(f)):
            return version
    for rule in FAMILIES:
        v = rule(f)
        if v is not None:
            return v
    return UNKNOWN


# ---- dtype statistics -----------------------------------------------------------------------------

# never loaded by sd.cpp (training leftovers, buffers recomputed at run time)
UNUSED_PREFIXES = (
    "betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
    "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
    "cond_stage_model.transformer.text_model.embeddings.position_ids",
    "cond_stage_model.1.model.text_model.embeddings.position_ids",
    "cond_stage_model.transformer.vision_model.embeddings.position_ids", "cond_stage_model.model.logit_scale",
    "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
    "conditioner.embedders.0.model.logit_scale", "conditioner.embedders.1.model.logit_scale",
    "model.diffusion_model.time_embedding.cond_proj.weight", "unet.time_embedding.cond_proj.weight",
    "model_ema.decay", "model_ema.num_updates", "model_ema.diffusion_model", "embedding_manager", "denoiser.sigmas",
    "text_encoders.t5xxl.transformer.encoder.embed_tokens.weight", "ztsnr", "edm_vpred.sigma_min",
    "text_encoders.llm.output.weight", "text_encoders.llm.lm_head.")


def component_of(name: str) -> str:
    """'diffusion_model', 'vae', 'text_encoders' or 'other' for a tensor name (sd.cpp's split)."""
    if name.startswith(("model.diffusion_model.", "unet.", "transformer.")):
        return "diffusion_model"
    if name.startswith(("first_stage_model.", "vae.", "tae.")):
        return "vae"
    if any(p in name for p in ("text_encoders", "cond_stage_model", "te.text_model.", "conditioner")) \
            or name.startswith(("te.", "te1.", "te2.", "te3.", "text_encoder")):
        return "text_encoders"
    return "other"


def dtype_stats(tensors) -> dict[str, dict[str, int]]:
    """{component: {dtype name: count}} over the tensors sd.cpp would load (see component_of)."""
    table = getattr(tensors, "tensors", tensors)
    out: dict[str, Counter] = {}
    for name, t in table.items():
        if name.startswith(UNUSED_PREFIXES):
            continue
        dt = getattr(t, "dtype", None)
        out.setdefault(component_of(name), Counter())[getattr(dt, "name", str(dt))] += 1
    return {k: dict(v) for k, v in out.items()}


# ---- prediction type -------------------------------------------------------------------------------

_FLOW = {SD3, *_FAMILY["wan"], HUNYUAN_VIDEO, LINGBOT_VIDEO, MINIMAX_H3, *_FAMILY["qwen_image"], MAGE_FLOW,
         HIDREAM_O1, ANIMA, ERNIE_IMAGE, Z_IMAGE, BOOGU_IMAGE, PID, IDEOGRAM4}
_FLUX_FLOW = {*_FAMILY["flux"], *_FAMILY["flux2"], LONGCAT, LENS, LTXAV, KREA2}
_FLOW_SHIFT = {**{v: 5.0 for v in _FAMILY["wan"]}, HUNYUAN_VIDEO: 7.0, MINIMAX_H3: 12.0, ERNIE_IMAGE: 4.0,
               PID: 1.5, IDEOGRAM4: 1.0, BOOGU_IMAGE: 3.16, MAGE_FLOW: 6.0, LONGCAT: 3.0, LENS: 1.83,
               LTXAV: 2.37, KREA2: 1.15}


def _truthy(v) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "v", "v_prediction", "v-prediction")


def prediction_type(model_file, version: str | None = None) -> str | None:
    """'eps', 'v', 'edm_v', 'flow' (SD3-style discrete flow), 'flux_flow', 'sefi_flow' or
    'minit2i_flow', as sd.cpp chooses it without a --prediction flag; None when the file does not
    say (SD2.x: sd.cpp then runs the UNet once to tell eps from v — that is the engine's job).

    Evidence, strongest first: the `edm_vpred.sigma_max` / `v_pred` marker tensors (CosXL, SDXL
    v-pred), metadata (`modelspec.prediction_type`, kohya's `ss_v_parameterization`), the family."""
    table = getattr(model_file, "tensors", model_file)
    meta = getattr(model_file, "metadata", {}) or {}
    version = version or detect_version(table)
    fam = family(version)
    if fam in ("sd1", "sd2", "sdxl"):
        if "edm_vpred.sigma_max" in table:
            return "edm_v"
        if "v_pred" in table:
            return "v"
        spec = str(meta.get("modelspec.prediction_type", meta.get("scheduler.prediction_type", ""))).strip().lower()
        if spec:
            return "v" if spec in ("v", "v_prediction", "v-prediction") else "eps" if spec in (
                "epsilon", "eps") else None
        if "ss_v_parameterization" in meta:
            return "v" if _truthy(meta["ss_v_parameterization"]) else "eps"
        return None if fam == "sd2" else "eps"
    if version in _FLOW:
        return "flow"
    if version in _FLUX_FLOW:
        return "flux_flow"
    if version == SEFI_IMAGE:
        return "sefi_flow"
    if version == MINIT2I:
        return "minit2i_flow"
    return "eps" if version == SVD else None


def default_flow_shift(version: str, tensors=None) -> float | None:
    """sd.cpp's default flow shift for flow models (3.0 unless listed; Flux with a guidance
    embedder 1.15, without 1.0); None for eps/v models."""
    pred = prediction_type({}, version)
    if pred not in ("flow", "flux_flow"):
        return None
    if version in _FLOW_SHIFT:
        return _FLOW_SHIFT[version]
    if pred == "flux_flow":
        table = getattr(tensors, "tensors", tensors) or {}
        return 1.15 if any(n.startswith(DM + "guidance_in.in_layer.weight") for n in table) else 1.0
    return 3.0
