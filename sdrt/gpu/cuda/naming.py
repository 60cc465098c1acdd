"""CUDA kernel names from (op, dtypes), and what the op registry says the fatbins must hold.

The element-wise families' kernels are named by their op and operand dtypes alone
(`unary_silu_f16`, `binary_add_f32_bf16`); their op lists come from the registry (OpDef.kind)
into kernels/elementwise_ops.cuh, which tools/build_cuda_kernels.py writes before compiling
and `--check` compares. The same check finds every registered (op, dtypes) kernel in the
shipped fatbins (`missing_symbols`, no GPU needed).
"""
from __future__ import annotations

from itertools import product
from pathlib import Path

from ...ops.registry import FLOATS, OPS, ops_of_kind
from .devtensor import SUFFIX
from .driver import family_archs

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
OPS_HEADER = KERNELS_DIR / "elementwise_ops.cuh"
NAMED = {"unary": ("elementwise", 1), "binary": ("elementwise", 2)}   # kind -> (module, operands)


def _load_ops() -> None:
    from ...ops import api  # noqa: F401  (defines every op)


# the dtypes an F32 element-wise result may be stored as (fuse.half_nodes): "_to_f16"/"_to_bf16"
# kernels of F32 first operands
STORED = ("F16", "BF16")


def kernel_name(op: str, dtypes, out=None) -> str:
    """The kernel of element-wise `op` on operands of these dtypes: ("add", ("F32", "F16")) ->
    "binary_add_f32_f16"; ("silu", ("BF16",)) -> "unary_silu_bf16". With `out` other than the
    first operand's dtype (an F32 result stored as F16/BF16): ("gelu", ("F32",), "BF16") ->
    "unary_gelu_f32_to_bf16"."""
    _load_ops()
    kind = OPS[op].kind
    if kind not in NAMED or len(dtypes) != NAMED[kind][1]:
        raise KeyError(f"{op}{tuple(dtypes)}: not a kernel named by (op, dtypes)")
    names = [getattr(d, "name", d) for d in dtypes]
    out = getattr(out, "name", out) or names[0]
    tail = "" if out == names[0] else f"_to_{SUFFIX[out]}"
    return f"{kind}_{op}_" + "_".join(SUFFIX[d] for d in names) + tail


def ops_header() -> str:
    """The text of kernels/elementwise_ops.cuh: the X-macro op lists, from OPS."""
    _load_ops()
    lines = ["// Generated from the op registry (sdrt.ops.registry.OPS, OpDef.kind) by",
             "// tools/build_cuda_kernels.py: do not edit. elementwise.cu instantiates X(op) for each.",
             "#pragma once"]
    for kind in NAMED:
        lines.append(f"#define SDRT_{kind.upper()}_OPS(X) " + " ".join(f"X({n})" for n in ops_of_kind(kind)))
    return "\n".join(lines) + "\n"


def registered_kernels() -> dict[str, list[str]]:
    """{module: [kernel names]}: every (op, dtypes) the CUDA table registers for a named family
    (the float dtypes its element-wise kernels take)."""
    from ..device_backend import import_families
    from . import ops
    from .table import CUDA
    _load_ops()
    import_families(ops)
    out: dict[str, list[str]] = {}
    for kind, (module, arity) in NAMED.items():
        for op in ops_of_kind(kind):
            if op in CUDA.ops():
                out.setdefault(module, []).extend(kernel_name(op, ds) for ds in product(FLOATS, repeat=arity))
                out[module].extend(kernel_name(op, ("F32", *ds), to) for ds in product(FLOATS, repeat=arity - 1)
                                   for to in STORED)
    return out


def fatbin_symbols(fatbin: Path, name: str) -> int:
    """How many of the fatbin's cubins define kernel `name` (its `.text.<name>` section)."""
    return fatbin.read_bytes().count(b".text." + name.encode() + b"\0")


def missing_symbols() -> list[str]:
    """'module: kernel' for every registered kernel some shipped arch's cubin lacks."""
    bad = []
    for module, names in registered_kernels().items():
        archs = family_archs(module)[0]
        fat = KERNELS_DIR / f"{module}.fatbin"
        data = fat.read_bytes() if fat.exists() else b""
        bad += [f"{module}: {n}" for n in names if data.count(b".text." + n.encode() + b"\0") < len(archs)]
    return bad
