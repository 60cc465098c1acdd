"""`sdrt`: sd-cli's command line. Flags keep sd-cli's names, defaults and meanings; a flag
sdrt does not support yet is refused by name (argparse: "unrecognized arguments")."""
from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from ..errors import SdrtError, UsageError

MODES = ("img_gen", "vid_gen", "upscale", "convert", "metadata")
IMPLEMENTED_MODES = ("convert",)
LOG_LEVELS = {"debug": logging.DEBUG, "verbose": 15, "info": logging.INFO, "warn": logging.WARNING,
              "error": logging.ERROR}
CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "q2_K", "q3_K", "q4_K",
                 "q5_K", "q6_K")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # never a traceback; sd-cli-style one-line error and usage
        self.print_usage(sys.stderr)
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sdrt", description="stable-diffusion.cpp's sd-cli, rebuilt in Python.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"sdrt {__version__}")
    p.add_argument("-M", "--mode", default="img_gen", choices=MODES, help="run mode (default: img_gen)")
    p.add_argument("-m", "--model", help="path to the model file (safetensors, gguf, ckpt) or diffusers folder")
    p.add_argument("-o", "--output", help="output path (default ./output.png; output.gguf in convert mode)")
    p.add_argument("--type", choices=CONVERT_TYPES, metavar="TYPE",
                   help="weight type: " + ", ".join(CONVERT_TYPES) + " (default: keep the file's types)")
    p.add_argument("--tensor-type-rules", default="",
                   help='per-tensor weight types, "regex=type,..." e.g. "^vae\\.=f16,model\\.=q8_0"')
    p.add_argument("-t", "--threads", type=int, default=-1,
                   help="threads for the CPU kernels and BLAS (-1: all CPUs this process may use)")
    p.add_argument("--list-devices", action="store_true", help="print the compute devices, name<TAB>description")
    p.add_argument("--log-level", choices=tuple(LOG_LEVELS), default="info", help="logging level (default info)")
    p.add_argument("-v", "--verbose", dest="log_level", action="store_const", const="verbose",
                   help="same as --log-level verbose")
    return p


def _setup_logging(level: str):
    logging.addLevelName(15, "VERBOSE")
    logging.basicConfig(level=LOG_LEVELS[level], format="[%(levelname)-7s] %(message)s", stream=sys.stderr)


def list_devices() -> list[tuple[str, str]]:
    from ..ops.threads import default_threads
    return [("cpu", f"CPU ({default_threads()} threads, numpy BLAS + Numba)")]


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    if args.list_devices:
        for name, desc in list_devices():
            print(f"{name}\t{desc}")
        return 0
    from ..ops.threads import set_threads
    set_threads(args.threads)
    if args.mode not in IMPLEMENTED_MODES:
        raise UsageError(f"mode {args.mode!r} is not implemented yet in sdrt {__version__} "
                         f"(implemented: {', '.join(IMPLEMENTED_MODES)})")
    if args.mode == "convert":
        return _convert(args)
    return 0


def _convert(args) -> int:
    if not args.model:
        raise UsageError("convert: -m/--model is required")
    from ..io.writer import convert
    out = args.output or "output.gguf"
    summary = convert(args.model, out, args.type, tensor_type_rules=args.tensor_type_rules or None)
    logging.info("converted %s -> %s: %s", args.model, out, summary)
    return 0


def main(argv=None) -> int:
    try:
        return run(argv)
    except SdrtError as e:
        print(f"sdrt: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print("sdrt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
