"""Element-wise ops: binary with broadcasting, unary activations, scale/clamp, a fused GEGLU, casts.

Binary ops broadcast from the low dims (ggml's ne order): a missing high dim or a dim of 1
repeats. The result takes the first operand's dtype.
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes
from .cases import Case, In, floats
from .registry import FLOATS, defop, fail, make_node, require_float

__all__ = ["add", "sub", "mul", "div", "neg", "abs", "sqr", "sqrt", "exp", "log", "sin", "cos", "step",
           "relu", "leaky_relu", "silu", "sigmoid", "tanh", "gelu", "gelu_quick", "clamp", "scale",
           "geglu", "cast", "cont"]




def broadcast_ne(op, srcs):
    a, b = srcs
    n = max(a.ndim, b.ndim)
    ne = []
    for i in range(n):
        x = a.ne[i] if i < a.ndim else 1
        y = b.ne[i] if i < b.ndim else 1
        if x != y and 1 not in (x, y):
            fail(op, srcs, f"cannot broadcast dim {i}: {x} vs {y}")
        ne.append(max(x, y))
    return tuple(ne)


# ---- binary ---------------------------------------------------------------------------------
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


def _binary_infer(op):
    def infer(srcs, params):
        require_float(op, srcs)
        return broadcast_ne(op, srcs), srcs[0].dtype
    return infer


def _binary_cases():
    b = dict(lo=0.5, hi=2.0)   # div's divisor away from 0; the same values for every op
    return floats(lambda t: Case((In((7, 5, 3), t), In((7, 5, 3), t, **b)))) + [
        Case((In((33, 4, 2, 3)), In((33, 1, 2), **b)), label="broadcast"),
        Case((In((5, 4)), In((1, 4), **b)), label="broadcast-dim0"),
        Case((In((7, 5), "F16"), In((7, 5), "F32", **b))),
        Case((In((7, 5), "F32"), In((7, 5), "BF16", **b))),
        Case((In((6, 5), view="t"), In((6, 5), view="s", **b))),
        Case((In((300, 3), view="s"), In((300, 1), **b)), label="row-bias"),
    ]


for _name, _f in BINARY.items():
    defop(_name, _binary_infer(_name), (lambda f: lambda node, xs: f(xs[0], xs[1]))(_f),
          f"element-wise {_name} with broadcasting", inplace=True, kind="binary", cases=_binary_cases)


def add(a, b): return make_node("add", (a, b))
def sub(a, b): return make_node("sub", (a, b))
def mul(a, b): return make_node("mul", (a, b))
def div(a, b): return make_node("div", (a, b))


# ---- unary ----------------------------------------------------------------------------------
def _erf(x):
    from scipy.special import erf
    return erf(x)


# name -> numpy reference of x (params p0, p1 where an op has them)
UNARY = {
    "neg": lambda x, p: -x,
    "abs": lambda x, p: np.abs(x),
    "sqr": lambda x, p: x * x,
    "sqrt": lambda x, p: np.sqrt(x),
    "exp": lambda x, p: np.exp(x),
    "log": lambda x, p: np.log(x),
    "sin": lambda x, p: np.sin(x),
    "cos": lambda x, p: np.cos(x),
    "step": lambda x, p: (x > 0).astype(x.dtype),
    "relu": lambda x, p: np.maximum(x, 0),
    "leaky_relu": lambda x, p: np.where(x > 0, x, x * p["slope"]),
    "silu": lambda x, p: x / (1 + np.exp(-x)),
    "sigmoid": lambda x, p: 1 / (1 + np.exp(-x)),
    "tanh": lambda x, p: np.tanh(x),
    "gelu": lambda x, p: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x, p: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "gelu_quick": lambda x, p: x / (1 + np.exp(-1.702 * x)),
    "clamp": lambda x, p: np.clip(x, p["min"], p["max"]),
    "scale": lambda x, p: x * p["s"] + p["b"],
}


def _unary_infer(op):
    def infer(srcs, params):
        require_float(op, srcs)
        return srcs[0].ne, srcs[0].dtype
    return infer


def unary_scalars(node) -> tuple[float, float]:
    """The two float parameters a device kernel of a unary op takes: clamp (min, max), scale
    (s, b), leaky_relu (slope, 0), every other op (0, 0)."""
    p = node.params
    if node.op == "clamp":
        return p["min"], p["max"]
    if node.op == "scale":
        return p["s"], p["b"]
    return p.get("slope", 0.0), 0.0


UNARY_PARAMS = {"leaky_relu": {"slope": 0.1}, "clamp": {"min": -0.5, "max": 0.5}, "scale": {"s": 1.5, "b": 0.25}}


def _unary_cases(name):
    r = dict(lo=0.1, hi=4.0) if name in ("sqrt", "log") else dict(lo=-3.0, hi=3.0)
    p = UNARY_PARAMS.get(name, {})
    return floats(lambda t: Case((In((37, 3, 2), t, **r),), p)) + [
        Case((In((9, 7), view="t", **r),), p), Case((In((9, 7, 2), view="s", **r),), p),
        Case((In((300, 2, 2), view="p", **r),), p)]


for _name, _f in UNARY.items():
    defop(_name, _unary_infer(_name),
          (lambda f: lambda node, xs: f(xs[0].astype(np.float64), node.params))(_f),
          f"element-wise {_name}", inplace=True, kind="unary",
          cases=(lambda n: lambda: _unary_cases(n))(_name))


def neg(x): return make_node("neg", (x,))
def abs(x): return make_node("abs", (x,))  # noqa: A001 (ggml's name)
def sqr(x): return make_node("sqr", (x,))
def sqrt(x): return make_node("sqrt", (x,))
def exp(x): return make_node("exp", (x,))
def log(x): return make_node("log", (x,))
def sin(x): return make_node("sin", (x,))
def cos(x): return make_node("cos", (x,))
def step(x): return make_node("step", (x,))
def relu(x): return make_node("relu", (x,))
def silu(x): return make_node("silu", (x,))
def sigmoid(x): return make_node("sigmoid", (x,))
def tanh(x): return make_node("tanh", (x,))
def gelu_quick(x): return make_node("gelu_quick", (x,))
def leaky_relu(x, slope=0.01): return make_node("leaky_relu", (x,), slope=float(slope))
def clamp(x, min=-math.inf, max=math.inf): return make_node("clamp", (x,), min=float(min), max=float(max))  # noqa: A002
def scale(x, s, b=0.0): return make_node("scale", (x,), s=float(s), b=float(b))


def gelu(x, approximate: str = "none"):
    """GELU; approximate='tanh' gives the tanh form (ggml_gelu), 'none' the erf form (ggml_gelu_erf)."""
    return make_node("gelu_tanh" if approximate == "tanh" else "gelu", (x,))


# ---- gated ----------------------------------------------------------------------------------
GELU_FORMS = {"tanh": "gelu_tanh", "none": "gelu"}  # geglu's `approximate` -> the unary op it uses


def _geglu_infer(srcs, params):
    require_float("geglu", srcs)
    x, = srcs
    if params["approximate"] not in GELU_FORMS:
        fail("geglu", srcs, f"approximate must be 'tanh' or 'none', got {params['approximate']!r}")
    if x.ne[0] % 2:
        fail("geglu", srcs, f"ne[0]={x.ne[0]} must be even (the halves a and gate)")
    return (x.ne[0] // 2,) + tuple(x.ne[1:]), x.dtype


def _geglu_reference(node, xs):
    x = xs[0].astype(np.float64)
    h = x.shape[-1] // 2
    return x[..., :h] * UNARY[GELU_FORMS[node.params["approximate"]]](x[..., h:], node.params)


def _geglu_cases():
    return [Case((In((16, 5, 2), t, lo=-3, hi=3),), {"approximate": a}) for t in FLOATS for a in ("tanh", "none")] + [
        Case((In((8, 6), view="t", lo=-3, hi=3),), {"approximate": "none"}),
        Case((In((640, 3), view="s", lo=-3, hi=3),), {"approximate": "tanh"})]


defop("geglu", _geglu_infer, _geglu_reference,
      "GEGLU (ggml_geglu swapped, diffusers' GEGLU): x[:h] * gelu(x[h:]) along ne[0] = 2h; "
      "approximate='tanh' | 'none' picks the GELU form", cases=_geglu_cases)


def geglu(x, approximate: str = "none"):
    """GEGLU fused: ne[0] = 2h splits into (a, gate) = x[0:h], x[h:2h]; the result, ne (h, ...)
    and x's dtype, is a * gelu(gate) with gelu's `approximate` form ('tanh' or 'none' = erf).
    On the CPU the same values as mul(x.slice(0, 0, h), gelu(x.slice(0, h), approximate)) bit for
    bit, F16/BF16 included."""
    return make_node("geglu", (x,), approximate=str(approximate))


# ---- casts and copies -----------------------------------------------------------------------
def _cast_infer(srcs, params):
    src, = srcs
    dt = dtypes.get(params["dtype"])
    if not (src.dtype.is_float or src.dtype.is_quantized):
        fail("cast", srcs, f"source must be a float or block type, got {src.dtype.name}")
    if not dt.is_float and not dt.is_quantized:
        fail("cast", srcs, f"target must be a float or block type, got {dt.name}")
    if dt.is_quantized and src.ne[0] % dt.block_size:
        fail("cast", srcs, f"ne[0]={src.ne[0]} is not a multiple of {dt.name}'s block size {dt.block_size}")
    return src.ne, dt


def _cast_cases():
    pairs = [("F32", "F16"), ("F32", "BF16"), ("F16", "F32"), ("BF16", "F32"), ("F16", "BF16"),
             ("F8_E4M3", "F32"), ("F8_E5M2", "F16"), ("F32", "F8_E4M3"), ("F32", "Q8_0"), ("Q4_0", "F32"),
             ("Q8_0", "Q8_0"), ("F32", "F32")]
    return [Case((In((64, 3), a),), {"dtype": b}) for a, b in pairs] + [
        Case((In((9, 7), "F32", view="t"),), {"dtype": "F16"}),
        Case((In((9, 7, 3), "F16", view="p"),), {"dtype": "F32"})]


def _cont_cases():
    return [Case((In((9, 7), "F32", view="t"),)), Case((In((9, 7, 3), "F16", view="p"),)),
            Case((In((9, 7), "BF16", view="s"),)), Case((In((9, 7), "I32", view="t", lo=-50, hi=50),)),
            Case((In((64, 3), "Q8_0", view="s"),)), Case((In((64, 5), "F8_E4M3", view="s"),)),
            Case((In((300, 4, 3), "F32", view="p"),))]


defop("cast", _cast_infer, lambda node, xs: xs[0], "copy into a new contiguous tensor of another dtype (ggml_cpy)",
      cases=_cast_cases)
defop("cont", lambda srcs, p: (srcs[0].ne, srcs[0].dtype), lambda node, xs: xs[0],
      "contiguous copy of a view", cases=_cont_cases)


def cast(x, dtype):
    return make_node("cast", (x,), dtype=dtypes.get(dtype).name)


def cont(x):
    return make_node("cont", (x,))
