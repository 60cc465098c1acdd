"""`sdrt serve` / `sdrt-server`: sd-server's flags (-l/--listen-ip, --listen-port, --serve-html-path)
on top of every context and generation flag of the CLI (they become the per-request defaults),
plus sdrt's safety options. The model is loaded before the port opens and stays loaded."""
from __future__ import annotations

import asyncio
import logging
import sys

from ..errors import SdrtError, UsageError

log = logging.getLogger("sdrt.server")


def build_parser():
    from ..cli.main import build_parser as cli_parser
    p = cli_parser()
    p.prog = "sdrt serve"
    p.description = "stable-diffusion.cpp's sd-server, rebuilt in Python (docs/server.md)."
    s = p.add_argument_group("server")
    s.add_argument("-l", "--listen-ip", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--listen-port", type=int, default=1234, help="port to listen on (default: 1234)")
    s.add_argument("--serve-html-path", default=None, help="serve this HTML file at / instead of the built-in page")
    # --lora-model-dir and --hires-upscalers-dir come from the CLI's flags: here also the folders the APIs list
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on everything but /")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow cross-origin requests from ORIGIN (repeatable; default: none)")
    s.add_argument("--max-queue", type=int, default=64, help="queued + running jobs before 429 (default: 64)")
    s.add_argument("--max-steps", type=int, default=150, help="largest steps a request may ask for (default: 150)")
    s.add_argument("--max-batch", type=int, default=8, help="largest batch a request may ask for (default: 8)")
    s.add_argument("--max-width", type=int, default=4096, help="largest width (default: 4096)")
    s.add_argument("--max-height", type=int, default=4096, help="largest height (default: 4096)")
    s.add_argument("--max-body-mb", type=float, default=64, help="largest request body in MiB (default: 64)")
    s.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                   help="largest uploaded image, in pixels (default: 4096*4096)")
    s.add_argument("--job-ttl", type=float, default=600, help="seconds a finished job is kept (default: 600)")
    return p


def config_from_args(args):
    """(ModelParams, ServerConfig) from parsed `serve` arguments."""
    import os

    from ..cli.main import params_from_args
    from .app import ServerConfig
    from .params import Limits
    # the CLI's output flags have no meaning here: refused by name, never silently ignored
    for flag, given in (("-o/--output", args.output is not None), ("--output-begin-idx", args.output_begin_idx != -1),
                        ("--compression-quality", args.compression_quality != 90)):
        if given:
            raise UsageError(f"{flag}: a CLI output flag; the server returns images over HTTP "
                             "(requests carry output_format / output_compression)")
    if args.mode != "img_gen":
        raise UsageError(f"-M/--mode {args.mode}: the server runs img_gen only")
    mp, gp = params_from_args(args)
    for flag, path in (("--lora-model-dir", args.lora_model_dir), ("--hires-upscalers-dir", args.hires_upscalers_dir)):
        if path and not os.path.isdir(path):
            raise UsageError(f"{flag}: not a directory: '{path}'")
    if args.serve_html_path and not os.path.isfile(args.serve_html_path):
        raise UsageError(f"--serve-html-path: no such file: '{args.serve_html_path}'")
    if "*" in args.cors_origin and args.api_key:
        log.warning("--cors-origin '*' with --api-key: credentials are not allowed for a wildcard origin")
    for flag, v in (("--max-queue", args.max_queue), ("--max-steps", args.max_steps), ("--max-batch", args.max_batch),
                    ("--max-width", args.max_width), ("--max-height", args.max_height),
                    ("--max-image-pixels", args.max_image_pixels)):
        if v < 1:
            raise UsageError(f"{flag}: must be at least 1, got {v}")
    limits = Limits(max_width=args.max_width, max_height=args.max_height, max_batch_count=args.max_batch,
                    max_queue_size=args.max_queue, max_steps=args.max_steps, max_image_pixels=args.max_image_pixels,
                    max_body_bytes=int(args.max_body_mb * 1024 * 1024))
    cfg = ServerConfig(defaults=gp, model_path=mp.model or mp.diffusion_model or "", limits=limits,
                       lora_dir=args.lora_model_dir, upscalers_dir=args.hires_upscalers_dir, api_key=args.api_key,
                       cors_origins=tuple(args.cors_origin), html_path=args.serve_html_path, ttl=args.job_ttl)
    return mp, cfg


def run(argv=None) -> int:
    try:
        import uvicorn
    except ImportError:
        raise UsageError("sdrt serve needs the server extra: pip install 'sdrt[server]'") from None
    from ..cli.main import _setup_logging
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    if args.list_devices:
        from ..cli.main import list_devices
        for name, desc in list_devices():
            print(f"{name}\t{desc}")
        return 0
    from ..ops.threads import set_threads
    set_threads(args.threads)
    mp, cfg = config_from_args(args)
    from ..engine.pipeline import Pipeline
    from .app import create_app
    pipe = Pipeline.load(mp)
    app = create_app(pipe, cfg)
    jobs = app.state.server.jobs

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # answer the queued jobs and let the running one end before uvicorn waits on connections
            # (synchronous clients are waiting on those jobs)
            await asyncio.to_thread(jobs.shutdown, cfg.shutdown_grace)
            await super().shutdown(sockets)

    log.info("listening on http://%s:%d/", args.listen_ip, args.listen_port)
    Server(uvicorn.Config(app, host=args.listen_ip, port=args.listen_port, log_level="warning", timeout_keep_alive=5,
                          limit_concurrency=1000, timeout_graceful_shutdown=int(cfg.shutdown_grace) + 5)).run()
    return 0


def main(argv=None) -> int:
    try:
        return run(argv)
    except SdrtError as e:
        print(f"sdrt serve: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
