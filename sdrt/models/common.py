"""Building blocks every model family uses.

A model is built from a table of weights named as the original checkpoint names them
(`sdrt.io` converts every other layout to these names). A block knows its prefix; its
parameters are looked up by `prefix + key`, so a block's attribute names *are* the checkpoint
keys. `forward` methods build lazy graph nodes (sdrt.ops); nothing is computed until a runner
runs the graph. Shapes in comments are in ne order (dim 0 innermost): a torch [N, C, H, W]
activation is ne [W, H, C, N], a torch [N, L, C] sequence is ne [C, L, N].
"""
from __future__ import annotations

import weakref
from typing import Callable, Mapping

import numpy as np

from ..errors import ModelFileError, UsageError
from ..ops import api as F
from ..ops.tensor import Tensor


class Weights:
    """A read-only view of a weight table under a prefix: `w["conv.weight"]`."""

    def __init__(self, table: Mapping[str, Tensor], prefix: str = "", source: str = "model"):
        self.table, self.prefix, self.source = table, prefix, source

    def __getitem__(self, key: str) -> Tensor:
        name = self.prefix + key
        t = self.table.get(name)
        if t is None:
            raise ModelFileError(f"{self.source}: missing tensor {name!r}")
        return t

    def get(self, key: str, default=None):
        return self.table.get(self.prefix + key, default)

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.table

    def sub(self, prefix: str) -> "Weights":
        return Weights(self.table, self.prefix + prefix, self.source)

    def shape(self, key: str) -> tuple[int, ...]:
        """ne of a parameter (raises ModelFileError when missing)."""
        return self[key].ne

    def keys(self):
        n = len(self.prefix)
        return (k[n:] for k in self.table if k.startswith(self.prefix))


# Run-time LoRA (sdrt.engine.lora, --lora-apply-mode at_runtime): weight leaf -> a path whose
# `output(x, conv_params | None)` is added to the layer's output. Keyed by the leaf itself so the
# weight stays as stored (quantized) and a pipeline's registrations leave with its tensors.
RUNTIME_LORA: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def with_lora(out: Tensor, x: Tensor, weight: Tensor, conv: dict | None = None) -> Tensor:
    """out + the run-time LoRA path registered for `weight` (out unchanged when none is)."""
    path = RUNTIME_LORA.get(weight) if RUNTIME_LORA else None
    return out if path is None else F.add(out, path.output(x, conv))


def linear_lora(x: Tensor, w: Tensor, b: Tensor | None = None, leaf: Tensor | None = None) -> Tensor:
    """F.linear(x, w, b) with the run-time LoRA registered for `leaf` (default w; the stored
    weight when w is a reshaped view of it): the path builds the layer (it may fold the delta
    into w, see sdrt.engine.lora.RuntimePath.linear)."""
    path = RUNTIME_LORA.get(w if leaf is None else leaf) if RUNTIME_LORA else None
    return F.linear(x, w, b) if path is None else path.linear(x, w, b)


def check_weights(table: Mapping[str, Tensor], prefix: str, shapes: Mapping[str, tuple], source: str,
                  layout: str, same: Callable | None = None, missing_detail: str = "") -> None:
    """Every tensor of `shapes` (names under `prefix`) is in `table` with that shape; else a
    ModelFileError naming the first that is not. `same(got, want)` compares shapes (default: equal,
    or a 1-D shape given as any tensor of as many elements); `missing_detail` ends the message of
    a missing tensor (a config summary)."""
    for name, shape in shapes.items():
        t = table.get(prefix + name)
        if t is None:
            raise ModelFileError(f"{source}: missing tensor {prefix + name!r}" + (f" ({missing_detail})" if missing_detail else ""))
        ok = same(t.shape, shape) if same is not None else \
            tuple(t.shape) == shape or (len(shape) == 1 and t.nelements == shape[0])
        if not ok:
            raise ModelFileError(f"{source}: tensor {prefix + name!r} has shape {list(t.shape)}, "
                                 f"this {layout} layout needs {list(shape)}")


class Linear:
    """torch.nn.Linear: weight ne=[in, out], bias ne=[out]; x ne=[in, ...] -> [out, ...]."""

    def __init__(self, w: Weights, bias: bool | None = None):
        self.weight = w["weight"]
        self.bias = w.get("bias") if bias is not False else None
        if bias and self.bias is None:
            w["bias"]  # raises, naming the missing key
        self.in_features, self.out_features = self.weight.ne[0], self.weight.ne[1]

    def __call__(self, x: Tensor) -> Tensor:
        return linear_lora(x, self.weight, self.bias)


class Conv2d:
    """torch.nn.Conv2d: weight ne=[KW, KH, C/groups, OC]; x ne=[W, H, C, N]."""

    def __init__(self, w: Weights, stride=1, padding=0, dilation=1, groups=1):
        self.weight, self.bias = w["weight"], w.get("bias")
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.out_channels = self.weight.ne[-1]

    def __call__(self, x: Tensor) -> Tensor:
        out = F.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding,
                       dilation=self.dilation, groups=self.groups)
        if self.groups != 1:      # sd.cpp: depthwise convs never receive LoRA
            return out
        return with_lora(out, x, self.weight, {"stride": self.stride, "padding": self.padding,
                                               "dilation": self.dilation})


class GroupNorm:
    """torch.nn.GroupNorm (affine) over ne[2]; `silu=True` fuses the SiLU that follows."""

    def __init__(self, w: Weights, groups: int = 32, eps: float = 1e-6):
        self.weight, self.bias, self.groups, self.eps = w["weight"], w["bias"], groups, eps

    def __call__(self, x: Tensor, silu: bool = False) -> Tensor:
        return F.group_norm_affine(x, self.weight, self.bias, self.groups, self.eps, silu=silu)


class LayerNorm:
    """torch.nn.LayerNorm over ne[0] (weight/bias optional, as elementwise_affine=False)."""

    def __init__(self, w: Weights, eps: float = 1e-5):
        self.weight, self.bias, self.eps = w.get("weight"), w.get("bias"), eps

    def __call__(self, x: Tensor) -> Tensor:
        return F.layer_norm_affine(x, self.weight, self.bias, self.eps)


class Embedding:
    """torch.nn.Embedding: weight ne=[dim, vocab]; ids I32 ne=[n, ...] -> ne=[dim, n, ...]."""

    def __init__(self, w: Weights, key: str = "weight"):
        self.weight = w[key]

    def __call__(self, ids: Tensor) -> Tensor:
        return F.get_rows(self.weight, ids)


def multihead_attention(q: Tensor, k: Tensor, v: Tensor, n_head: int, mask: Tensor | None = None) -> Tensor:
    """q ne=[H*D, Lq, N], k/v ne=[H*D, Lk, N] -> ne=[H*D, Lq, N] (sd.cpp's ggml_ext_attention_ext).

    The heads are split with views; the attention op reads the strided views directly."""
    C, Lq = q.ne[0], q.ne[1]
    N = q.ne4[2]
    D = C // n_head

    def heads(t):  # [H*D, L, N] -> view [D, L, H, N]
        t = t if t.is_contiguous() else F.cont(t)
        return t.reshape(D, n_head, t.ne[1], t.ne4[2]).permute(0, 2, 1, 3)

    out = F.attention(heads(q), heads(k), heads(v), mask=mask)  # [D, Lq, H, N]
    return F.cont(out.permute(0, 2, 1, 3)).reshape(C, Lq, N)     # [D, H, Lq, N] -> [C, Lq, N]


# ---- what every diffusion model's numpy entry point needs -------------------------------------------

class GraphCache:
    """A model's graph per input-shape key, built once and run again every sampling step: the
    graph's input leaves are numpy holders each call copies its arrays into. The last `size`
    shapes are kept."""

    def __init__(self, size: int = 4):
        self.size, self.graphs = size, {}

    def __len__(self) -> int:
        return len(self.graphs)

    def run(self, arrays: list, build: Callable, backend, extra: tuple = ()):
        """arrays: float32 numpy inputs (None: absent); build(leaves) -> the output node, leaves
        in the order of `arrays`; extra: what besides the shapes tells graphs apart. A build that
        returns a list of nodes gets a list of arrays back (one graph, several outputs)."""
        key = tuple(None if a is None else a.shape for a in arrays) + tuple(extra)
        entry = self.graphs.get(key)
        if entry is None:
            holders = [None if a is None else np.empty(a.shape, np.float32) for a in arrays]
            out = build([None if h is None else Tensor.from_numpy(h) for h in holders])
            outs = {f"out{i}": o for i, o in enumerate(out)} if isinstance(out, (list, tuple)) else {"out": out}
            if len(self.graphs) >= self.size:
                self.graphs.pop(next(iter(self.graphs)))
            entry = self.graphs[key] = (holders, F.Graph(outs))
        holders, graph = entry
        for h, a in zip(holders, arrays):
            if h is not None:
                np.copyto(h, a)
        res = graph.run(backend)
        if "out" in res:
            return _owned_f32(res["out"])
        return [_owned_f32(res[f"out{i}"]) for i in range(len(res))]


def _owned_f32(t: Tensor) -> np.ndarray:
    """A graph output's values as float32: its own buffer when it is already one (every run hands
    computed outputs fresh buffers), else a converted copy."""
    return t.numpy() if t.dtype.name == "F32" and not t.is_leaf else t.to_f32()


def batch_cond(t: Tensor, N: int, what: str) -> Tensor:
    """Repeat a batch-1 conditioning tensor to N (its last dim), as sd.cpp's ggml_repeat; a 1-D
    vector becomes [C, N]. `what` names it in the error ("Flux: context")."""
    b = t.ne[-1] if t.ndim > 1 else 1
    if b == N:
        return t
    if b != 1:
        raise UsageError(f"{what} has batch {b}, x has {N}")
    ne = list(t.ne) if t.ndim > 1 else [t.ne[0], 1]
    ne[-1] = N
    return F.repeat(t if t.ndim > 1 else t.reshape(t.ne[0], 1), tuple(ne))


def token_ids(ids, vocab: int, what: str) -> np.ndarray:
    """A text encoder's ids as int32 [N, L] (an [L] array is one sequence), each in [0, vocab)."""
    a = np.asarray(ids)
    if a.ndim not in (1, 2) or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise UsageError(f"{what} ids must be a non-empty int array [L] or [N, L], got {a.dtype} {a.shape}")
    a = a.reshape(1, -1) if a.ndim == 1 else a
    if a.min() < 0 or a.max() >= vocab:
        bad = int(a.min()) if a.min() < 0 else int(a.max())
        raise UsageError(f"{what} token id {bad} is outside the vocabulary of {vocab}")
    return a.astype(np.int32)
