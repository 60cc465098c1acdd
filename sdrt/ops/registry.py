"""One registry for ops and the kernels backends register for them.

An op is one entry: its name, a shape rule (`infer`), a plain-numpy reference, its kind
(`unary`/`binary` element-wise ops: the op lists every backend registers kernels for come from
here), the tolerance a backend's result must meet (`nmse`) and its test cases (`cases`: the
inputs tests/test_backend_ops.py runs on every backend, see ops/cases.py). A backend supports a
node iff it registered a kernel for that op whose `supports` accepts the node — there is no
hand-kept switch anywhere else.

Calling conventions
- `infer(srcs, params) -> (ne, dtype)` raises OpError (use `fail`) naming the op and shapes.
- `reference(node, xs) -> np.ndarray`: xs are the inputs as numpy arrays in numpy order
  (reversed ne), float types widened to float32, int types as they are; returns the result
  in numpy order (any float dtype; the reference backend narrows it to the node's dtype).
- kernel `fn(node, xs, out) -> None`: xs are zero-copy numpy views of the inputs as
  `Tensor.numpy()` gives them (raw uint16 for BF16, uint8 for F8 and block rows), `out` a
  writable contiguous numpy view of the node's output in the node's storage dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import OpError


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable
    reference: Callable
    doc: str = ""
    # output element i is computed from element i of each same-shaped input alone, so the
    # planner may give the output the buffer of an input that dies here (graph.py, "in place")
    inplace: bool = False
    kind: str = ""             # "unary" / "binary" for the element-wise families, else ""
    nmse: float = 1e-7         # largest normalized mean squared error vs the reference (F32)
    cases: Callable | None = None   # () -> [ops.cases.Case]: what test-backend-ops runs


OPS: dict[str, OpDef] = {}


def defop(name: str, infer: Callable, reference: Callable, doc: str = "", inplace: bool = False, *,
          kind: str = "", nmse: float = 1e-7, cases: Callable | None = None) -> OpDef:
    if name in OPS:
        raise RuntimeError(f"op {name!r} defined twice")
    OPS[name] = OpDef(name, infer, reference, doc, inplace, kind, nmse, cases)
    return OPS[name]


def ops_of_kind(kind: str) -> list[str]:
    """The registered ops of one kind, in registration order (e.g. every unary op)."""
    return [n for n, d in OPS.items() if d.kind == kind]


# the error a value rounded to this dtype brings, as NMSE (F32 is the op's own tolerance)
DTYPE_NMSE = {"F16": 1e-6, "BF16": 1e-4, "F8_E4M3": 1e-2, "F8_E5M2": 3e-2}


def max_nmse(node) -> float:
    """The NMSE a backend's result of `node` may have against the reference: the op's, or
    the rounding of the lowest-precision float among its output and float inputs."""
    names = [node.dtype.name] + [s.dtype.name for s in node.src if s.dtype.name in ("F16", "BF16")]
    return max([OPS[node.op].nmse] + [DTYPE_NMSE.get(n, 0.0) for n in names])


def compare(got, want) -> float:
    """NMSE of Tensor `got` against Tensor `want` (ggml's test-backend-ops measure):
    sum((got - want)^2) / sum(want^2); inf where NaNs or infinities sit in other places."""
    import numpy as np
    a, b = got.to_f32().astype(np.float64), want.to_f32().astype(np.float64)
    if a.shape != b.shape:
        return float("inf")
    bad_a, bad_b, nan_a, nan_b = ~np.isfinite(a), ~np.isfinite(b), np.isnan(a), np.isnan(b)
    if (bad_a != bad_b).any() or (nan_a != nan_b).any() or (a[bad_a & ~nan_a] != b[bad_b & ~nan_b]).any():
        return float("inf")
    ok = ~bad_b
    num = float(((a[ok] - b[ok]) ** 2).sum())
    den = float((b[ok] ** 2).sum())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def fail(op: str, srcs, msg: str):
    shapes = ", ".join(f"{s.dtype.name}{list(s.ne)}" for s in srcs)
    raise OpError(f"{op}({shapes}): {msg}")


@dataclass(frozen=True)
class Kernel:
    op: str
    fn: Callable
    supports: Callable | None  # node -> bool; None accepts every node


class KernelTable:
    """The kernels of one backend, found by op name."""

    def __init__(self, backend: str):
        self.backend = backend
        self._kernels: dict[str, list[Kernel]] = {}

    def register(self, op: str, supports: Callable | None = None):
        """Decorator: `@CPU.register("add", supports=float_inputs)`."""
        def deco(fn):
            self._kernels.setdefault(op, []).append(Kernel(op, fn, supports))
            return fn
        return deco

    def find(self, node) -> Kernel | None:
        for k in self._kernels.get(node.op, ()):
            if k.supports is None or k.supports(node):
                return k
        return None

    def ops(self) -> list[str]:
        return sorted(self._kernels)


def make_node(op: str, srcs, **params):
    """Build a lazy graph node: shape and dtype come from the op's rule, now."""
    from .tensor import Tensor
    d = OPS.get(op)
    if d is None:
        raise OpError(f"unknown op {op!r}")
    srcs = tuple(srcs)
    for s in srcs:
        if not isinstance(s, Tensor):
            raise OpError(f"{op}: inputs must be sdrt Tensors, got {type(s).__name__}")
    ne, dtype = d.infer(srcs, params)
    return Tensor(dtype, ne, op=op, src=srcs, params=params)


# dtypes an activation may have; weights may also be F8 or block types (see matmul/conv)
FLOATS = ("F32", "F16", "BF16")


def require_float(op: str, srcs, which=None):
    """Fail unless every tensor in `which` (default: all srcs) is F32/F16/BF16."""
    for s in srcs if which is None else which:
        if s.dtype.name not in FLOATS:
            fail(op, srcs, f"needs F32/F16/BF16 inputs, got {s.dtype.name}")
