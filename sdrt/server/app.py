"""The ASGI app (Starlette): sd-server's OpenAI, sdapi (A1111) and native sdcpp API families, the
web page at `/` and `/openapi.json`. Handlers only parse, check and queue: generation runs in the
JobManager's worker thread, so the event loop never blocks on it.

Errors are JSON, always: `{"error": message, "code": short_code}` with a 4xx for anything the
client sent (sd-server's bodies carry `error`; `code` is sdrt's addition)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..engine.params import GenParams
from .jobs import FINISHED, JobGone, JobManager, JobNotFound, QueueFull, ShuttingDown
from .params import BadRequest, Limits, from_native, from_openai, from_sdapi, list_dir_files, parse_json_object

log = logging.getLogger("sdrt.server")

LORA_EXTS = (".safetensors", ".ckpt", ".pt", ".gguf", ".bin")
UPSCALER_EXTS = (".safetensors", ".pth", ".pt", ".gguf", ".bin")
LATENT_MODES = ("Latent", "Latent (nearest)", "Latent (nearest-exact)", "Latent (antialiased)", "Latent (bicubic)",
                "Latent (bicubic antialiased)")


@dataclass
class ServerConfig:
    defaults: GenParams = field(default_factory=GenParams)
    model_path: str = ""
    limits: Limits = field(default_factory=Limits)
    lora_dir: str | None = None
    upscalers_dir: str | None = None
    api_key: str | None = None
    cors_origins: tuple = ()
    html_path: str | None = None
    ttl: float = 600.0
    shutdown_grace: float = 30.0


def error(message: str, status: int = 400, code: str = "invalid_request", **extra) -> JSONResponse:
    return JSONResponse({"error": message, "code": code, **extra}, status_code=status)


def make_runner(pipeline):
    """The worker's job body: generate, then encode (png/jpeg/webp) to base64."""
    from ..io.png import encode_image

    def run(job, progress):
        req = job.work
        results = pipeline.generate(req.gen, progress=progress, show_progress=False)
        images, infos = [], []
        for i, r in enumerate(results):
            data = encode_image(r.image, req.output_format, r.parameters if req.gen.embed_metadata else None,
                                max(1, req.output_compression))
            images.append({"index": i, "b64_json": base64.b64encode(data).decode("ascii")})
            infos.append({"seed": r.seed, "parameters": r.parameters})
        return {"output_format": req.output_format, "images": images, "info": infos}

    return run


# ---- middleware (pure ASGI: nothing buffered that the limit has not seen) -----------------------

class _TooLarge(Exception):
    pass


class Guard:
    """Bearer-token check (everything but `/`) and the request-body byte limit, before routing."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key, limit = self.config.api_key, self.config.limits.max_body_bytes
        if key and scope["path"] != "/":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not secrets.compare_digest(token.encode(), key.encode()):
                resp = error("missing or wrong API key (Authorization: Bearer ...)", 401, "unauthorized")
                resp.headers["WWW-Authenticate"] = "Bearer"
                return await resp(scope, receive, send)
        clen = dict(scope["headers"]).get(b"content-length")
        if clen is not None:
            try:
                n = int(clen)
            except ValueError:
                return await error("bad Content-Length", 400)(scope, receive, send)
            if n > limit:
                return await error(f"request body over the limit of {limit} bytes", 413, "body_too_large")(
                    scope, receive, send)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _TooLarge()
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await error(f"request body over the limit of {limit} bytes", 413, "body_too_large")(
                    scope, receive, send)


# ---- the app --------------------------------------------------------------------------------------

class Server:
    def __init__(self, pipeline, config: ServerConfig, *, runner=None):
        self.pipeline, self.config = pipeline, config
        self.jobs = JobManager(runner or make_runner(pipeline), max_pending=config.limits.max_queue_size,
                               ttl=config.ttl)

    # discovery --------------------------------------------------------------------------------
    def loras(self) -> list[dict]:
        return [{"name": stem, "path": rel} for stem, rel, _ in list_dir_files(self.config.lora_dir, LORA_EXTS, True)]

    def upscaler_files(self):
        return list_dir_files(self.config.upscalers_dir, UPSCALER_EXTS, False)

    def has_control_net(self) -> bool:
        mp = getattr(self.pipeline, "model_params", None)
        return bool(getattr(mp, "control_net", None))

    def takes_ref_images(self) -> bool:
        family = getattr(self.pipeline, "family", None)
        return family is not None and family.supports("ref_images")

    def loras_ctx(self) -> dict:
        return {"dir": self.config.lora_dir, "exts": LORA_EXTS}

    def model_stem(self) -> tuple[str, str]:
        name = os.path.basename(self.config.model_path or "")
        return name, os.path.splitext(name)[0]

    def defaults_json(self) -> dict:
        d = self.config.defaults
        return {
            "prompt": d.prompt, "negative_prompt": d.negative_prompt, "clip_skip": d.clip_skip,
            "width": d.width if d.width > 0 else 512, "height": d.height if d.height > 0 else 512,
            "strength": d.strength, "seed": d.seed, "batch_count": d.batch_count, "increase_ref_index": d.increase_ref_index,
            "control_strength": d.control_strength, "ip_adapter_strength": 1.0,
            "sample_params": {"scheduler": d.scheduler or "default", "sample_method": d.sampling_method or "default",
                              "sample_steps": d.steps, "eta": d.eta if d.eta == d.eta and abs(d.eta) != float("inf") else None,
                              "shifted_timestep": 0, "flow_shift": None,
                              "guidance": {"txt_cfg": d.cfg_scale,
                                           "img_cfg": None if d.img_cfg_scale == float("inf") else d.img_cfg_scale,
                                           "distilled_guidance": d.guidance,
                                           "slg": {"layers": [7, 8, 9], "layer_start": 0.01, "layer_end": 0.2,
                                                   "scale": 0.0}}},
            "hires": {"enabled": False, "upscaler": "Latent", "scale": 2.0, "target_width": 0, "target_height": 0,
                      "steps": 0, "denoising_strength": 0.7, "custom_sigmas": [], "upscale_tile_size": 128},
            "vae_tiling_params": {"enabled": d.vae_tiling, "temporal_tiling": False, "tile_size_x": d.vae_tile_size[0],
                                  "tile_size_y": d.vae_tile_size[1], "target_overlap": d.vae_tile_overlap,
                                  "rel_size_x": d.vae_relative_tile_size[0], "rel_size_y": d.vae_relative_tile_size[1],
                                  "extra_tiling_args": ""},
            "cache_mode": "disabled", "cache_option": "", "scm_mask": "", "scm_policy_dynamic": True,
            "output_format": "png", "output_compression": 100,
        }

    # handlers ---------------------------------------------------------------------------------
    async def index(self, request):
        if self.config.html_path:
            with open(self.config.html_path, "rb") as f:
                return HTMLResponse(f.read())
        page = resources.files("sdrt.server").joinpath("static/index.html").read_bytes()
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def openapi(self, request):
        from .openapi import document
        return JSONResponse(document(self.config.limits))

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": "sd-cpp-local", "object": "model", "owned_by": "local"}]})

    async def _body_json(self, request) -> dict:
        return parse_json_object(await request.body())

    async def _sync(self, request, kind: str, req) -> tuple[object, Response | None]:
        """Queue a job and await it; a client that goes away cancels its job."""
        try:
            job = self.jobs.submit(kind, req)
        except QueueFull as e:
            return None, error(str(e), 429, "queue_full")
        except ShuttingDown as e:
            return None, error(str(e), 503, "shutting_down")
        waiter = asyncio.ensure_future(self.jobs.wait(job))
        try:
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=0.5)
                if not waiter.done() and await request.is_disconnected():
                    try:
                        self.jobs.cancel(job.id)
                    except (JobNotFound, JobGone):
                        pass
                    return None, error("client disconnected", 400, "client_disconnected")
        finally:
            if not waiter.done():
                waiter.cancel()
        if job.status == "completed":
            return job, None
        err = job.error or {"code": "generation_failed", "message": "generation failed"}
        if err["code"] == "server_shutdown":
            return None, error(err["message"], 503, err["code"])
        if job.status == "cancelled":
            return None, error(err["message"], 409, err["code"])
        return None, error(err["message"], 400 if err["code"] == "invalid_request" else 500, err["code"])

    async def openai_generations(self, request):
        d = await self._body_json(request)
        req = from_openai(d, self.config.defaults, self.config.limits, self.loras_ctx())
        job, resp = await self._sync(request, "img_gen", req)
        if resp is not None:
            return resp
        return JSONResponse({"created": job.completed, "output_format": job.result["output_format"],
                             "data": [{"b64_json": im["b64_json"]} for im in job.result["images"]]})

    async def openai_edits(self, request):
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise BadRequest("expected multipart/form-data", 415, "unsupported_media_type")
        try:
            form = await request.form(max_files=16, max_fields=64)
        except BadRequest:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed multipart body is the client's
            raise BadRequest(f"malformed multipart body: {type(e).__name__}") from None
        try:
            fields, images, mask = {}, [], None
            for key, value in form.multi_items():
                if hasattr(value, "read"):
                    data = await value.read()
                    if key in ("image[]", "image"):
                        images.append(data)
                    elif key == "mask":
                        mask = data
                else:
                    fields[key] = value
            if "n" in fields:
                try:
                    fields["n"] = int(fields["n"])
                except ValueError:
                    raise BadRequest("n: expected an integer") from None
            if "output_compression" in fields:
                try:
                    fields["output_compression"] = int(fields["output_compression"])
                except ValueError:
                    raise BadRequest("output_compression: expected an integer") from None
            for k in ("image", "image[]", "mask"):
                if isinstance(fields.get(k), str):
                    raise BadRequest(f"{k}: must be an uploaded file")
        finally:
            await form.close()
        req = from_openai(fields, self.config.defaults, self.config.limits, self.loras_ctx(), edit=True,
                          images=images, mask=mask)
        job, resp = await self._sync(request, "img_gen", req)
        if resp is not None:
            return resp
        return JSONResponse({"created": job.completed, "output_format": job.result["output_format"],
                             "data": [{"b64_json": im["b64_json"]} for im in job.result["images"]]})

    async def _sdapi(self, request, img2img: bool):
        d = await self._body_json(request)
        req = from_sdapi(d, self.config.defaults, self.config.limits, self.loras_ctx(), img2img=img2img)
        job, resp = await self._sync(request, "img_gen", req)
        if resp is not None:
            return resp
        infos = job.result["info"]
        info = {"prompt": req.gen.prompt, "negative_prompt": req.gen.negative_prompt,
                "seed": infos[0]["seed"] if infos else req.gen.seed, "all_seeds": [i["seed"] for i in infos],
                "width": req.gen.width, "height": req.gen.height, "steps": req.gen.steps,
                "cfg_scale": req.gen.cfg_scale, "sampler_name": req.gen.sampling_method or "default",
                "sd_model_name": self.model_stem()[1], "infotexts": [i["parameters"] for i in infos]}
        return JSONResponse({"images": [im["b64_json"] for im in job.result["images"]], "parameters": req.echo,
                             "info": json.dumps(info)})

    async def txt2img(self, request):
        return await self._sdapi(request, False)

    async def img2img(self, request):
        return await self._sdapi(request, True)

    async def sdapi_loras(self, request):
        return JSONResponse(self.loras())

    async def sdapi_upscalers(self, request):
        out = [{"name": n, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
               for n in ("None", "Lanczos", "Nearest")]
        out += [{"name": stem, "model_name": "ESRGAN", "model_path": real, "model_url": None, "scale": 4}
                for stem, _, real in self.upscaler_files()]
        return JSONResponse(out)

    async def latent_modes(self, request):
        return JSONResponse([{"name": n} for n in LATENT_MODES])

    async def sdapi_samplers(self, request):
        from ..engine.samplers import SAMPLERS
        return JSONResponse([{"name": n, "aliases": [n], "options": {}} for n in ("default",) + tuple(SAMPLERS)])

    async def sdapi_schedulers(self, request):
        from ..engine.schedulers import SCHEDULERS
        return JSONResponse([{"name": n, "label": n} for n in ("default",) + tuple(SCHEDULERS)])

    async def sd_models(self, request):
        name, stem = self.model_stem()
        return JSONResponse([{"title": stem, "model_name": stem, "filename": name, "hash": "", "sha256": "",
                              "config": None}])

    async def options(self, request):
        return JSONResponse({"samples_format": "png", "sd_model_checkpoint": self.model_stem()[1]})

    async def progress(self, request):
        snap = self.jobs.snapshot()
        cur = snap["current"]
        n_q = len(snap["queued"])
        if cur is None:
            return JSONResponse({"progress": 0.0, "eta_relative": 0.0, "current_image": None, "textinfo": "idle",
                                 "state": {"skipped": False, "interrupted": False, "job": "", "job_count": n_q,
                                           "job_timestamp": "0", "job_no": 0, "sampling_step": 0,
                                           "sampling_steps": 0}})
        step, steps = cur["progress"]["step"], cur["progress"]["steps"]
        frac = step / steps if steps else 0.0
        el = time.time() - (cur["started"] or time.time())
        eta = el / frac - el if frac > 0 else 0.0
        return JSONResponse({"progress": frac, "eta_relative": eta, "current_image": None,
                             "textinfo": f"step {step} of {steps}",
                             "state": {"skipped": False, "interrupted": False, "job": cur["id"], "job_count": n_q + 1,
                                       "job_timestamp": str(cur["created"]), "job_no": 0, "sampling_step": step,
                                       "sampling_steps": steps}})

    async def interrupt(self, request):
        return JSONResponse({"interrupted": self.jobs.interrupt_current()})

    async def capabilities(self, request):
        from ..engine.samplers import SAMPLERS
        from ..engine.schedulers import SCHEDULER_ALIASES, SCHEDULERS
        name, stem = self.model_stem()
        defaults = self.defaults_json()
        features = {"init_image": True, "mask_image": True, "control_image": self.has_control_net(), "ip_adapter_image": False,
                    "ref_images": self.takes_ref_images(), "lora": True, "vae_tiling": True, "hires": False, "cache": False,
                    "cancel_queued": True, "cancel_generating": True, "preview": False}
        formats = ["png", "jpeg", "webp"]
        upscalers = [{"name": n, "model": False, "image_upscale": False} for n in ("None", "Lanczos", "Nearest")
                     + LATENT_MODES]
        upscalers += [{"name": stem_, "model": True, "image_upscale": False} for stem_, _, _ in self.upscaler_files()]
        return JSONResponse({
            "model": {"name": name, "stem": stem, "path": name},
            "current_mode": "img_gen", "supported_modes": ["img_gen"],
            "defaults": defaults, "output_formats": formats, "features": features,
            "defaults_by_mode": {"img_gen": defaults}, "output_formats_by_mode": {"img_gen": formats},
            "features_by_mode": {"img_gen": features},
            "samplers": list(SAMPLERS), "schedulers": list(SCHEDULERS) + list(SCHEDULER_ALIASES),
            "loras": self.loras(), "upscalers": upscalers, "limits": self.config.limits.as_dict(),
            "notes": {"lora": "LoRA files are listed; applying them is not implemented yet: a request with "
                              "lora entries is refused (422)"},
        })

    async def img_gen(self, request):
        d = await self._body_json(request)
        req = from_native(d, self.config.defaults, self.config.limits, self.loras_ctx())
        if req.gen.control_image is not None and not self.has_control_net():
            return error("control_image: no ControlNet is loaded (start the server with --control-net FILE)", 422,
                         "unsupported_feature")
        if req.gen.ref_images and not self.takes_ref_images():
            return error("ref_images: the loaded model takes no reference images (Flux Kontext and Qwen-Image-Edit "
                         "do)", 422, "unsupported_feature")
        try:
            job = self.jobs.submit("img_gen", req)
        except QueueFull as e:
            return error(str(e), 429, "queue_full")
        except ShuttingDown as e:
            return error(str(e), 503, "shutting_down")
        # the state it was accepted in (the worker may already have started it: polling tells)
        return JSONResponse({"id": job.id, "kind": job.kind, "status": "queued", "created": job.created,
                             "poll_url": f"/sdcpp/v1/jobs/{job.id}"}, status_code=202)

    async def vid_gen(self, request):
        return error("unsupported generation mode: vid_gen (the loaded model generates images)", 400,
                     "unsupported_mode")

    def _job_or_error(self, job_id: str):
        try:
            return self.jobs.get(job_id), None
        except JobNotFound as e:
            return None, error(str(e), 404, "not_found")
        except JobGone as e:
            return None, error(str(e), 410, "gone")

    async def job(self, request):
        job, resp = self._job_or_error(request.path_params["job_id"])
        if resp is not None:
            return resp
        return JSONResponse(job.public(self.jobs.position(job)))

    async def cancel(self, request):
        job, resp = self._job_or_error(request.path_params["job_id"])
        if resp is not None:
            return resp
        if job.status in FINISHED:
            return error(f"job already {job.status}", 409, "conflict", job_status=job.status)
        self.jobs.cancel(job.id)
        return JSONResponse(job.public(self.jobs.position(job)))

    async def queue(self, request):
        return JSONResponse(self.jobs.snapshot())

    # assembly ---------------------------------------------------------------------------------
    def routes(self) -> list[Route]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/images/generations", self.openai_generations, methods=["POST"]),
            Route("/v1/images/edits", self.openai_edits, methods=["POST"]),
            Route("/sdapi/v1/txt2img", self.txt2img, methods=["POST"]),
            Route("/sdapi/v1/img2img", self.img2img, methods=["POST"]),
            Route("/sdapi/v1/loras", self.sdapi_loras, methods=["GET"]),
            Route("/sdapi/v1/upscalers", self.sdapi_upscalers, methods=["GET"]),
            Route("/sdapi/v1/latent-upscale-modes", self.latent_modes, methods=["GET"]),
            Route("/sdapi/v1/samplers", self.sdapi_samplers, methods=["GET"]),
            Route("/sdapi/v1/schedulers", self.sdapi_schedulers, methods=["GET"]),
            Route("/sdapi/v1/sd-models", self.sd_models, methods=["GET"]),
            Route("/sdapi/v1/options", self.options, methods=["GET"]),
            Route("/sdapi/v1/progress", self.progress, methods=["GET"]),
            Route("/sdapi/v1/interrupt", self.interrupt, methods=["POST"]),
            Route("/sdcpp/v1/capabilities", self.capabilities, methods=["GET"]),
            Route("/sdcpp/v1/img_gen", self.img_gen, methods=["POST"]),
            Route("/sdcpp/v1/vid_gen", self.vid_gen, methods=["POST"]),
            Route("/sdcpp/v1/jobs/{job_id}", self.job, methods=["GET"]),
            Route("/sdcpp/v1/jobs/{job_id}/cancel", self.cancel, methods=["POST"]),
            Route("/sdcpp/v1/queue", self.queue, methods=["GET"]),
        ]


async def _bad_request(request, exc: BadRequest):
    return error(str(exc), exc.status, exc.code)


async def _http_error(request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error(str(exc.detail), exc.status_code, code)


async def _internal(request, exc: Exception):
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error("internal server error", 500, "server_error")


def create_app(pipeline, config: ServerConfig | None = None, *, runner=None) -> Starlette:
    """The Starlette app for a loaded pipeline; `app.state.server` is the Server (its `.jobs`)."""
    config = config or ServerConfig()
    server = Server(pipeline, config, runner=runner)
    middleware = []
    if config.cors_origins:
        origins = list(config.cors_origins)
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_credentials="*" not in origins,
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    middleware.append(Middleware(Guard, config=config))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # graceful shutdown: queued jobs are answered (cancelled), the running one may finish
        await asyncio.to_thread(server.jobs.shutdown, config.shutdown_grace)

    app = Starlette(routes=server.routes(), middleware=middleware, lifespan=lifespan,
                    exception_handlers={BadRequest: _bad_request, HTTPException: _http_error, Exception: _internal})
    app.state.server = server
    return app
