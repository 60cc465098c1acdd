"""Matrix multiply and row gather: mul_mat (ggml_mul_mat), linear, get_rows (ggml_get_rows).

mul_mat(w, x) follows ggml: w ne=[K, N, w2, w3], x ne=[K, M, b2, b3] -> F32 ne=[N, M, b2, b3],
out = x @ w^T for every batch. w's batch dims broadcast when they divide x's: x batch i2 uses
w batch i2 // (b2 // w2) (each w batch serves a run of consecutive x batches, as ggml — this
is np.repeat, not numpy's tiling broadcast). w may be any float type or any block type;
x is F32/F16/BF16 (widened to F32).

get_rows(table, ids): table ne=[D, V, b2, b3] (any float or block type), ids I32/I64
ne=[n, b2, b3] -> F32 ne=[D, n, b2, b3]; row ids[i, i2, i3] of batch (i2, i3) of the table.
"""
from __future__ import annotations

import numpy as np

from ..errors import OpError
from . import dtypes
from .cases import Case, In
from .registry import defop, fail, make_node

X_TYPES = ("F32", "F16", "BF16")
ID_TYPES = ("I32", "I64")


def _weight_type(op, srcs, t):
    if not (t.dtype.is_float or t.dtype.is_quantized):
        fail(op, srcs, f"{t.dtype.name} cannot be a weight/table: needs a float or block type")


# ---- mul_mat --------------------------------------------------------------------------------
def _mul_mat_infer(srcs, params):
    op = "mul_mat"
    w, x = srcs
    _weight_type(op, srcs, w)
    if x.dtype.name not in X_TYPES:
        fail(op, srcs, f"x must be F32/F16/BF16, got {x.dtype.name}")
    if w.ne[0] != x.ne[0]:
        fail(op, srcs, f"inner dims differ: w ne[0]={w.ne[0]} vs x ne[0]={x.ne[0]}")
    wn, xn = w.ne4, x.ne4
    for d in (2, 3):
        if xn[d] % wn[d]:
            fail(op, srcs, f"batch dim {d}: x has {xn[d]}, not a multiple of w's {wn[d]}")
    ndim = max(2, w.ndim, x.ndim)
    return (wn[1], xn[1], xn[2], xn[3])[:ndim], dtypes.F32


def _mul_mat_reference(node, xs):
    w, x = (np.asarray(a, np.float32) for a in xs)
    w4 = w.reshape((1,) * (4 - w.ndim) + w.shape)
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    w4 = np.repeat(np.repeat(w4, x4.shape[0] // w4.shape[0], axis=0), x4.shape[1] // w4.shape[1], axis=1)
    return np.matmul(x4.astype(np.float64), np.swapaxes(w4, -1, -2).astype(np.float64)).reshape(node.shape)


def _block_types():
    from . import quant
    return [t.name for t in quant.supported_dequant_types()]


def _mul_mat_cases():
    return [Case((In((32, 16), w), In((32, 7), x))) for w in ("F32", "F16", "BF16") for x in ("F32", "F16", "BF16")] + [
        Case((In((32, 16, 1, 2)), In((32, 7, 3, 2))), label="batch-broadcast"),
        Case((In((32, 16), "F16"), In((32, 1))), label="mat-vec"),
        Case((In((32, 16)), In((32, 7), view="t")), label="x-view"),
        Case((In((32, 16), "F16", view="s"), In((32, 7), view="s")), label="views"),
        Case((In((32, 16), "F8_E4M3"), In((32, 5))), label="f8-weight"),
        Case((In((32, 16), "F8_E5M2"), In((32, 5))), label="f8-weight")] + [
        Case((In((256, 8), q), In((256, 5)))) for q in _block_types()] + [
        Case((In((256, 8), "Q4_K"), In((256, 1))), label="mat-vec"),
        Case((In((64, 8, 2), "Q8_0"), In((64, 3, 4))), label="batch-broadcast")]


defop("mul_mat", _mul_mat_infer, _mul_mat_reference,
      "ggml_mul_mat: out[N, M, b2, b3] = x @ w^T per batch, w batches broadcast by repetition", nmse=5e-4,
      cases=_mul_mat_cases)


def mul_mat(w, x):
    """ggml_mul_mat(w, x): w ne=[K, N, ...] (weights, any float/block type), x ne=[K, M, ...]
    -> F32 ne=[N, M, ...]."""
    return make_node("mul_mat", (w, x))


def linear(x, w, b=None):
    """x @ w^T (+ b): torch.nn.Linear with w ne=[in, out] (checkpoint layout), b ne=[out]."""
    y = mul_mat(w, x)
    if b is not None:
        from .elementwise import add
        y = add(y, b)
    return y


# ---- get_rows -------------------------------------------------------------------------------
def _get_rows_infer(srcs, params):
    op = "get_rows"
    table, ids = srcs
    _weight_type(op, srcs, table)
    if ids.dtype.name not in ID_TYPES:
        fail(op, srcs, f"ids must be I32 or I64, got {ids.dtype.name}")
    if ids.ndim > 3:
        fail(op, srcs, f"ids have {ids.ndim} dims, at most 3 ([n, b2, b3])")
    tn, idn = table.ne4, ids.ne4
    if tn[2] != idn[1] or tn[3] != idn[2]:
        fail(op, srcs, f"batch dims differ: table ne[2:4]={list(tn[2:])} vs ids ne[1:3]={list(idn[1:3])}")
    ndim = max(2, table.ndim, ids.ndim + 1)
    return (tn[0], idn[0], idn[1], idn[2])[:ndim], dtypes.F32


def check_ids(ids: np.ndarray, nrows: int) -> None:
    """Raise OpError naming the first id outside [0, nrows)."""
    if ids.size == 0:
        return
    if int(ids.min()) < 0 or int(ids.max()) >= nrows:
        bad = ids.reshape(-1)[np.flatnonzero((ids.reshape(-1) < 0) | (ids.reshape(-1) >= nrows))[0]]
        raise OpError(f"get_rows: row id {int(bad)} is out of range for a table of {nrows} rows")


def _get_rows_reference(node, xs):
    table, ids = xs
    t4 = table.reshape((1,) * (4 - table.ndim) + table.shape)
    i3 = ids.reshape((1,) * (3 - ids.ndim) + ids.shape)
    check_ids(i3, t4.shape[2])
    out = np.empty(i3.shape + (t4.shape[3],), np.float32)
    for a in range(i3.shape[0]):
        for b in range(i3.shape[1]):
            out[a, b] = t4[a, b][i3[a, b]]
    return out.reshape(node.shape)


def _get_rows_cases():
    return [Case((In((8, 10), t), In((5,), "I32", lo=0, hi=10))) for t in ("F32", "F16", "BF16", "F8_E4M3")] + [
        Case((In((8, 10)), In((5,), "I64", lo=0, hi=10))),
        Case((In((8, 10, 2)), In((4, 2), "I32", lo=0, hi=10)), label="batched"),
        Case((In((8, 10), view="s"), In((5,), "I32", lo=0, hi=10)), label="table-view")] + [
        Case((In((256, 6), q), In((4,), "I32", lo=0, hi=6))) for q in ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "IQ4_NL")]


defop("get_rows", _get_rows_infer, _get_rows_reference,
      "ggml_get_rows: gather rows of a (possibly quantized) table by I32/I64 ids into F32", cases=_get_rows_cases)


def get_rows(table, ids):
    """ggml_get_rows: table ne=[D, V, (b2, b3)], ids I32/I64 ne=[n, (b2, b3)] -> F32 ne=[D, n, ...].
    An id outside [0, V) raises OpError when the graph runs."""
    return make_node("get_rows", (table, ids))


__all__ = ["get_rows", "linear", "mul_mat"]
