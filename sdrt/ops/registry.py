"""One registry for ops and the kernels backends register for them.

An op is one entry: its name, a shape rule (`infer`) and a plain-numpy reference. A backend
supports a node iff it registered a kernel for that op whose `supports` accepts the node —
there is no hand-kept switch anywhere else.

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


OPS: dict[str, OpDef] = {}


def defop(name: str, infer: Callable, reference: Callable, doc: str = "", inplace: bool = False) -> OpDef:
    if name in OPS:
        raise RuntimeError(f"op {name!r} defined twice")
    OPS[name] = OpDef(name, infer, reference, doc, inplace)
    return OPS[name]


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
