"""The OpenAPI 3.0 document of what sdrt's server serves (tests check its paths against the routes
and fuzz every operation from it)."""
from __future__ import annotations

from .params import Limits

ERR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(schema) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _ok(schema=None, desc="ok") -> dict:
    return {"description": desc, **_json(schema or {"type": "object"})}


def _errors(*codes) -> dict:
    return {str(c): ERR for c in codes}


def document(limits: Limits) -> dict:
    L = limits
    sample_params = {"type": "object", "properties": {
        "scheduler": {"type": "string"}, "sample_method": {"type": "string"},
        "sample_steps": {"type": "integer", "minimum": 1, "maximum": L.max_steps},
        "eta": {"type": "number", "nullable": True}, "shifted_timestep": {"type": "integer"},
        "custom_sigmas": {"type": "array", "items": {"type": "number"}}, "flow_shift": {"type": "number", "nullable": True},
        "guidance": {"type": "object", "properties": {
            "txt_cfg": {"type": "number"}, "img_cfg": {"type": "number", "nullable": True},
            "distilled_guidance": {"type": "number"},
            "slg": {"type": "object", "properties": {
                "layers": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "layer_start": {"type": "number"}, "layer_end": {"type": "number"}, "scale": {"type": "number"}}}}}}}
    native = {"type": "object", "properties": {
        "prompt": {"type": "string"}, "negative_prompt": {"type": "string"}, "clip_skip": {"type": "integer"},
        "width": {"type": "integer", "minimum": L.min_width, "maximum": L.max_width},
        "height": {"type": "integer", "minimum": L.min_height, "maximum": L.max_height},
        "strength": {"type": "number", "minimum": 0, "maximum": 1}, "seed": {"type": "integer"},
        "batch_count": {"type": "integer", "minimum": 1, "maximum": L.max_batch_count},
        "embed_image_metadata": {"type": "boolean"},
        "init_image": {"type": "string", "nullable": True, "description": "base64 or data URL"},
        "mask_image": {"type": "string", "nullable": True, "description": "base64 or data URL, 1 channel"},
        "sample_params": sample_params,
        "lora": {"type": "array", "items": {"type": "object", "properties": {
            "path": {"type": "string"}, "multiplier": {"type": "number"}, "is_high_noise": {"type": "boolean"}}},
            "description": "LoRA files inside --lora-model-dir, applied with their multiplier (docs/lora.md)"},
        "vae_tiling_params": {"type": "object", "properties": {
            "enabled": {"type": "boolean"}, "tile_size_x": {"type": "integer"}, "tile_size_y": {"type": "integer"},
            "target_overlap": {"type": "number"}, "rel_size_x": {"type": "number"}, "rel_size_y": {"type": "number"}}},
        "output_format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
        "output_compression": {"type": "integer"}}}
    images = {"type": "object", "properties": {
        "created": {"type": "integer"}, "output_format": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object", "properties": {"b64_json": {"type": "string"}}}}}}
    job = {"type": "object", "required": ["id", "kind", "status", "created"], "properties": {
        "id": {"type": "string"}, "kind": {"type": "string"},
        "status": {"type": "string", "enum": ["queued", "generating", "completed", "failed", "cancelled"]},
        "created": {"type": "integer"}, "started": {"type": "integer", "nullable": True},
        "completed": {"type": "integer", "nullable": True}, "queue_position": {"type": "integer"},
        "result": {"type": "object", "nullable": True}, "error": {"type": "object", "nullable": True}}}
    sdapi = {"type": "object", "properties": {
        "prompt": {"type": "string"}, "negative_prompt": {"type": "string"},
        "width": {"type": "integer", "minimum": L.min_width, "maximum": L.max_width},
        "height": {"type": "integer", "minimum": L.min_height, "maximum": L.max_height},
        "steps": {"type": "integer", "minimum": 1, "maximum": L.max_steps}, "cfg_scale": {"type": "number"},
        "seed": {"type": "integer"}, "batch_size": {"type": "integer", "minimum": 1, "maximum": L.max_batch_count},
        "clip_skip": {"type": "integer"}, "sampler_name": {"type": "string"}, "scheduler": {"type": "string"},
        "denoising_strength": {"type": "number"}}}
    img2img = {"allOf": [sdapi, {"type": "object", "required": ["init_images"], "properties": {
        "init_images": {"type": "array", "items": {"type": "string"}}, "mask": {"type": "string"},
        "inpainting_mask_invert": {"type": "integer"}}}]}
    sdapi_out = {"type": "object", "properties": {"images": {"type": "array", "items": {"type": "string"}},
                                                  "parameters": {"type": "object"}, "info": {"type": "string"}}}
    arr = {"type": "array", "items": {"type": "object"}}
    get = lambda summary, schema=None: {"get": {"summary": summary, "responses": {"200": _ok(schema), **_errors(401)}}}
    job_id = [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    sync_errors = _errors(400, 401, 409, 413, 415, 422, 429)
    return {
        "openapi": "3.0.3",
        "info": {"title": "sdrt server (stable-diffusion.cpp sd-server compatible)", "version": "1"},
        "components": {
            "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {
                "error": {"type": "string"}, "code": {"type": "string"}}}},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
        "paths": {
            "/": {"get": {"summary": "the web page", "security": [], "responses": {
                "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": get("this document"),
            "/v1/models": get("OpenAI: the loaded model"),
            "/v1/images/generations": {"post": {
                "summary": "OpenAI: generate images (synchronous)",
                "requestBody": {"required": True, **_json({"type": "object", "required": ["prompt"], "properties": {
                    "prompt": {"type": "string", "minLength": 1}, "n": {"type": "integer", "minimum": 1,
                                                                      "maximum": L.max_batch_count},
                    "size": {"type": "string", "pattern": "^[0-9]+x[0-9]+$"},
                    "output_format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
                    "output_compression": {"type": "integer"}}})},
                "responses": {"200": _ok(images), **sync_errors}}},
            "/v1/images/edits": {"post": {
                "summary": "OpenAI: edit an image (multipart, synchronous)",
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                    "type": "object", "required": ["prompt", "image"], "properties": {
                        "prompt": {"type": "string"}, "image": {"type": "string", "format": "binary"},
                        "mask": {"type": "string", "format": "binary"}, "n": {"type": "integer"},
                        "size": {"type": "string"}, "output_format": {"type": "string", "enum": ["png", "jpeg"]},
                        "output_compression": {"type": "integer"}}}}}},
                "responses": {"200": _ok(images), **sync_errors}}},
            "/sdapi/v1/txt2img": {"post": {"summary": "A1111 txt2img (synchronous)",
                                           "requestBody": {"required": True, **_json(sdapi)},
                                           "responses": {"200": _ok(sdapi_out), **sync_errors}}},
            "/sdapi/v1/img2img": {"post": {"summary": "A1111 img2img (synchronous)",
                                           "requestBody": {"required": True, **_json(img2img)},
                                           "responses": {"200": _ok(sdapi_out), **sync_errors}}},
            "/sdapi/v1/loras": get("LoRA files under --lora-model-dir", arr),
            "/sdapi/v1/upscalers": get("upscalers", arr),
            "/sdapi/v1/latent-upscale-modes": get("latent upscale modes", arr),
            "/sdapi/v1/samplers": get("samplers", arr),
            "/sdapi/v1/schedulers": get("schedulers", arr),
            "/sdapi/v1/sd-models": get("the loaded model", arr),
            "/sdapi/v1/options": get("options"),
            "/sdapi/v1/progress": get("progress of the running job"),
            "/sdapi/v1/interrupt": {"post": {"summary": "cancel the running job",
                                             "responses": {"200": _ok(), **_errors(401)}}},
            "/sdcpp/v1/capabilities": get("model, defaults, features, samplers, schedulers, loras, limits"),
            "/sdcpp/v1/img_gen": {"post": {
                "summary": "queue an image job", "requestBody": {"required": True, **_json(native)},
                "responses": {"202": _ok({"type": "object", "properties": {
                    "id": {"type": "string"}, "kind": {"type": "string"}, "status": {"type": "string"},
                    "created": {"type": "integer"}, "poll_url": {"type": "string"}}}, "queued"),
                    **_errors(400, 401, 404, 413, 422, 429)}}},
            "/sdcpp/v1/vid_gen": {"post": {"summary": "video jobs: not supported by the loaded model",
                                           "requestBody": {"required": False, **_json({"type": "object"})},
                                           "responses": _errors(400, 401, 413)}},
            "/sdcpp/v1/jobs/{job_id}": {"get": {"summary": "a job", "parameters": job_id,
                                                "responses": {"200": _ok(job), **_errors(401, 404, 410)}}},
            "/sdcpp/v1/jobs/{job_id}/cancel": {"post": {"summary": "cancel a job", "parameters": job_id,
                                                        "responses": {"200": _ok(job), **_errors(401, 404, 409, 410)}}},
            "/sdcpp/v1/queue": get("the running and queued jobs (sdrt)"),
        },
    }
