"""test-backend-ops: the cases each op declares, and the walk of OPS x backends x cases.

An op's registry entry carries `cases`, a function returning `Case`s: the inputs (shape in ne
order, dtype, memory layout, value range) and the params — or a `build` function of the input
leaves — of one node to test. `run_case(op, case, backend)` runs that node on a backend and on
the reference backend (every op's plain-numpy definition) and returns the NMSE between them
(ggml's measure) with the op's tolerance (registry.max_nmse); tests/test_backend_ops.py does
that for every op, case and backend, and `support_markdown()` writes docs/ops.md, which
backend has a kernel for which case (tools/make_ops_md.py).

Layouts (`In.view`): "" contiguous; "t" dims 0 and 1 swapped in memory (a transpose view);
"p" dims 1 and 2 swapped (the attention-style permute); "s" a slice of a wider tensor (row
stride larger than the row; block types: every other row).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import dtypes
from .convert import f32_to_raw
from .registry import FLOATS, OPS, compare, make_node, max_nmse
from .tensor import Tensor


@dataclass(frozen=True)
class In:
    """One input of a case: ne (ggml order), dtype, layout ("", "t", "p", "s") and the range
    of its random values (uniform floats, or integers in [lo, hi))."""
    ne: tuple
    dtype: str = "F32"
    view: str = ""
    lo: float = -1.0
    hi: float = 1.0

    def label(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.ne))}]{self.view}"


@dataclass(frozen=True)
class Case:
    """One node to test: inputs, and params for make_node or a `build(*leaves)` function."""
    inputs: tuple = ()
    params: dict = field(default_factory=dict)
    build: Callable | None = None
    label: str = ""

    def id(self) -> str:
        parts = [i.label() for i in self.inputs]
        if self.label:
            parts.append(self.label)
        elif self.params:
            parts.append(",".join(f"{k}={v}" for k, v in sorted(self.params.items())))
        return "-".join(parts) or "no-inputs"

    def node(self, op: str, seed: int = 0) -> Tensor:
        rng = np.random.default_rng(seed)
        leaves = [make_input(i, rng, seed + k) for k, i in enumerate(self.inputs)]
        if self.build is not None:
            n = self.build(*leaves)
            if n.op != op:
                raise AssertionError(f"case {self.id()} of {op} builds a {n.op} node")
            return n
        return make_node(op, leaves, **self.params)


def floats(fn) -> list:
    """[fn("F32"), fn("F16"), fn("BF16")]: one case per activation dtype."""
    return [fn(t) for t in FLOATS]


def make_input(spec: In, rng, seed: int = 0) -> Tensor:
    """A leaf of spec's ne and dtype with random values, laid out as spec.view says."""
    dt = dtypes.get(spec.dtype)
    ne = tuple(spec.ne)
    if dt.is_quantized:
        from . import quant
        rows = int(np.prod(ne[1:], dtype=np.int64)) * (2 if spec.view == "s" else 1)
        raw = quant.random_raw(dt.name, rows, ne[0], seed=seed)
        shape = ne[::-1][:-1]
        if spec.view == "s":
            shape = shape[:-1] + (2 * shape[-1],) if shape else (2,)
        t = Tensor.from_numpy(raw.reshape(shape + (raw.shape[-1],)), dtype=dt.name)
        if spec.view == "s":
            t = t.slice(1, 0, None, 2)
        elif spec.view:
            raise ValueError(f"{spec.label()}: block types take view '' or 's'")
        return t
    shape = ne[::-1]
    if dt.name in ("I8", "I16", "I32", "I64"):
        vals = rng.integers(int(spec.lo), int(spec.hi), shape).astype(dt.np_storage)
    else:
        vals = rng.uniform(spec.lo, spec.hi, shape).astype(np.float32)
    if spec.view == "t":        # stored with dims 0/1 swapped, viewed back
        t = _leaf(np.ascontiguousarray(np.swapaxes(vals, -1, -2)), dt).transpose()
    elif spec.view == "p":      # stored with dims 1/2 swapped, viewed back
        t = _leaf(np.ascontiguousarray(np.swapaxes(vals, -2, -3)), dt).permute(0, 2, 1, *range(3, len(ne)))
    elif spec.view == "s":      # inside a tensor 3 elements wider in dim 0
        wide = np.zeros(shape[:-1] + (shape[-1] + 3,), vals.dtype)
        wide[..., 1:1 + shape[-1]] = vals
        t = _leaf(wide, dt).slice(0, 1, 1 + shape[-1])
    else:
        t = _leaf(vals, dt)
    if t.ne != ne:
        raise AssertionError(f"{spec.label()}: built ne {t.ne}")
    return t


def _leaf(vals: np.ndarray, dt) -> Tensor:
    if dt.is_float:
        return Tensor.from_numpy(f32_to_raw(vals, dt.name), dtype=dt.name)
    return Tensor.from_numpy(vals, dtype=dt.name)


def all_cases() -> list[tuple[str, Case]]:
    """(op, case) for every registered op's declared cases."""
    from . import api  # noqa: F401  (defines every op)
    out = []
    for name, d in sorted(OPS.items()):
        for c in (d.cases() if d.cases is not None else []):
            out.append((name, c))
    return out


def run_case(op: str, case: Case, backend) -> tuple[float, float] | None:
    """(NMSE of the backend's result against the reference, the tolerance), or None when the
    backend has no kernel for the node."""
    from .backend import get_backend
    from .graph import Graph
    be = get_backend(backend)
    node = case.node(op)
    if be.find(node) is None:
        return None
    got = Graph(node).run(be)["out"]
    want = Graph(case.node(op)).run("reference")["out"]
    return compare(got, want), max_nmse(node)


# ---- docs/ops.md ------------------------------------------------------------------------------
HEADER = """# Ops and backends

Generated by `python tools/make_ops_md.py` from the op registry (`sdrt/ops/registry.py`, `OPS`)
and each backend's kernel table; `tests/test_backend_ops.py` fails when this file is stale, and
runs every case below on every backend against the numpy reference (NMSE within the op's
tolerance, as ggml's test-backend-ops). CPU runs in the default test run; CUDA
(`pytest tests/test_backend_ops.py`) on a machine with a GPU.

✅ every case has a kernel · 🟡 some cases do (the rest listed below) · ❌ none.

**Adding an op** is one registry entry: `defop(name, infer, reference, doc, cases=...)` in its
family module under `sdrt/ops/`, where `cases` returns `Case`s (`sdrt/ops/cases.py`: inputs with
ne, dtype, layout and value range, and params or a builder). Then add kernels (`sdrt/ops/cpu/`,
`sdrt/gpu/cuda/ops/`) and run `python tools/make_ops_md.py`. Element-wise unary/binary ops
(`kind=`) also need a formula in `ops/cpu/elementwise.py` and `kernels/elementwise.cu`
(`python tools/build_cuda_kernels.py elementwise` rebuilds their list from `OPS`).
"""


def support_table(backends=None) -> tuple[list[str], dict[str, dict[str, list[str]]]]:
    """(backend prefixes, {op: {backend: [ids of cases it has no kernel for]}}) from the kernel
    tables alone (no device needed); a backend missing from an op's dict has no kernel at all."""
    from .backend import backend_kernels, entries
    if backends is None:
        backends = [e.prefix for e in entries() if e.device and e.kernels is not None]
    tables = {b: backend_kernels(b) for b in backends}
    cases = all_cases()
    out: dict[str, dict[str, list[str]]] = {name: {} for name in OPS}
    for op in OPS:
        mine = [c for o, c in cases if o == op]
        for b, table in tables.items():
            out[op][b] = [c.id() for c in mine if table.find(c.node(op)) is None]
            if mine and len(out[op][b]) == len(mine):
                out[op][b] = ["*"]
    return backends, out


def support_markdown() -> str:
    backends, table = support_table()
    counts = {op: len(OPS[op].cases()) if OPS[op].cases else 0 for op in OPS}
    lines = [HEADER, "| op | cases | " + " | ".join(backends) + " |",
             "|---|---|" + "---|" * len(backends)]
    notes = []
    for op in sorted(OPS):
        cells = []
        for b in backends:
            miss = table[op][b]
            if miss == ["*"]:
                cells.append("❌")
            elif miss:
                cells.append("🟡")
                notes.append(f"- {op} on {b}: no kernel for {', '.join(miss)}")
            else:
                cells.append("✅")
        lines.append(f"| {op} | {counts[op]} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    if notes:
        out += "\n## Partial support\n\n" + "\n".join(notes) + "\n"
    return out
