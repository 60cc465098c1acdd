"""CUDA kernels for mul_mat and get_rows (cuBLAS, kernels/matmul.cu, kernels/quant.cu).

mul_mat(w, x), ggml semantics (sdrt/ops/matmul.py): w ne=[K, M, w2, w3] (any float or block
type), x ne=[K, N, b2, b3] (F32/F16/BF16, any view) -> out F32 ne=[M, N, b2, b3]; x batch
(i2, i3) uses w batch (i2 // (b2 // w2), i3 // (b3 // w3)). The GEMM paths write out in its
device dtype, F16 where fuse.half_nodes stores the product as F16 (the mat-vec writes F32 only).

- Block-type weights with few columns (N per weight batch <= MMV_MAX_COLS): mmv_<type> decodes the
  weight inside the kernel, a warp per output row, up to 8 columns per pass over the weight.
- Everything else is a cuBLAS GEMM (F32 compute) in the "GEMM dtype": the weight's own dtype for
  F32/F16/BF16 weights (read in place when its rows are unit-stride), F16 for block/F8 weights,
  which are decoded into scratch first (in row chunks of DEQUANT_CHUNK_BYTES when bigger). The
  activations are read in place when they already are that dtype with unit-stride rows, otherwise
  packed (cast/transposed) into scratch. F32 x F32 runs in pedantic FP32 (no TF32), so it matches
  the CPU backend to ~1e-5; F16/BF16 GEMMs carry the rounding of x to that dtype.
- Row-major out[N][M] = x[N][K] . w[M][K]^T is, in cuBLAS's column-major terms, C(MxN) =
  A^T B with A = w seen as KxM and B = x seen as KxN: gemm(transa=True, transb=False, m=M, n=N,
  k=K, A=w (lda = w's row stride), B=x (ldb = x's row stride), C=out (ldc=M)). Batch dims
  become strided-batched GEMMs; when w is one matrix and x's rows are evenly spaced (or x was
  packed), all batches fold into one GEMM with N*b2*b3 columns.
- Linear layers' bias (and a transformer block's residual after it) can ride in the GEMM:
  `mul_mat_add_bias` / `mul_mat_add_bias_residual`, which fuse.py puts in place of the add
  nodes, run one cuBLASLt GEMM with the bias epilogue (the residual as its C, beta 1) for a
  dense F16/BF16 weight, and the unfused kernels otherwise. `mul_mat_add_bias_gelu` does the same
  for a DiT MLP's fc1 -> gelu(tanh) with cuBLASLt's GELU-bias epilogue.
- Why no fused dequant+tensor-core GEMM for large N: the decode pass moves ~2.6 bytes per weight
  (Q4_K: 0.56 read + 2 written; cuBLAS then reads the 2), a few % of an N >= 2048 GEMM, while a
  hand-written wmma kernel (no wgmma/TMA) reaches well under cuBLAS's Hopper throughput;
  bench/bench_cuda_matmul.py prints the decode share per shape.

get_rows(table, ids): every float (but F64) and block table type, ids I32/I64, rows decoded to F32
by get_rows_<type>; an id outside [0, V) yields a NaN row (the CPU op raises; a kernel cannot).
"""
from __future__ import annotations

from ....errors import UnsupportedError
from ....ops.registry import FLOATS
from .. import quant
from ..devtensor import DevTensor
from ....ops.dtypes import BY_NAME
from .elementwise import unary
from .elementwise import binary
from ..quant import weight_as  # noqa: F401  (public: other families import it from here)
from ..table import CUDA

MODULE = "matmul"
MMV_MAX_COLS = 16          # columns per weight batch up to which block weights use mmv_<type>
MMV_ROWS_PER_BLOCK = 4     # warps (output rows) per thread block of mmv
DEQUANT_CHUNK_BYTES = 256 << 20  # the largest decoded weight piece kept in scratch at once
GET_ROWS_MAX_BLOCKS = 1 << 16
MAX_GRID_Y = 65535


def _even_rows(ne, nb) -> bool:
    """Whether all rows (over dims 1..3) are spaced by the same stride nb[1]."""
    span = nb[1] * ne[1]
    for d in (2, 3):
        if ne[d] > 1 and nb[d] != span:
            return False
        span *= ne[d]
    return True


def _rows_as_one_matrix(ne, nb):
    """x's (ne, nb) with every batch folded into the columns: one [K, N*b2*b3] matrix, for rows
    evenly spaced over the batch dims (_even_rows)."""
    n = ne[1] * ne[2] * ne[3]
    return (ne[0], n, 1, 1), (nb[0], nb[1], nb[1] * n, nb[1] * n)


def _gemm_ready(dtype: str, ne, nb, want: str, es: int) -> bool:
    """Whether cuBLAS can read the tensor in place as `want`: same dtype, unit element stride,
    row/batch strides in whole elements and rows at least ne0 apart."""
    return (dtype == want and nb[0] == es and all(s % es == 0 for s in nb[1:])
            and nb[1] >= ne[0] * es)


def _supports_mul_mat(node) -> bool:
    return quant.decodable(node.src[0].dtype)


def _gemm_dtype(w_dtype) -> str:
    """The GEMM's input dtype: a float weight's own, F16 for block/F8 weights (decoded first)."""
    return w_dtype.name if w_dtype.name in FLOATS else "F16"


def _mat_vec(w_dtype, w_ne, x_ne) -> bool:
    """Whether mul_mat runs the mat-vec of block weights (few columns per weight batch)."""
    _, N, b2, b3 = x_ne
    return w_dtype.is_quantized and N * (b2 // w_ne[2]) * (b3 // w_ne[3]) <= MMV_MAX_COLS


def gemm_input_dtype(w, x) -> str:
    """The dtype mul_mat reads x as, for graph tensors w and x: F32 in the mat-vec, else the
    GEMM dtype."""
    return "F32" if _mat_vec(w.dtype, w.ne4, x.ne4) else _gemm_dtype(w.dtype)


@CUDA.register("mul_mat", supports=_supports_mul_mat)
def mul_mat(node, xs, out, rt):
    w, x = xs
    K, M, w2, w3 = w.ne
    _, N, b2, b3 = x.ne
    x_ne, x_nb = x.ne, x.nb
    if w2 == 1 and w3 == 1 and (b2 > 1 or b3 > 1) and _even_rows(x_ne, x_nb):
        # one weight for every batch and evenly spaced rows: one matrix of N*b2*b3 columns
        x_ne, x_nb = _rows_as_one_matrix(x_ne, x_nb)
        N, b2, b3 = x_ne[1], 1, 1
    shape = (K, M, N, w2, w3, b2, b3)
    if _mat_vec(w.dtype, w.ne, (K, N, b2, b3)):
        _mul_mat_vec(rt, w, x, x_ne, x_nb, out, shape)
    else:
        _mul_mat_gemm(rt, w, x, x_ne, x_nb, out, shape)


def mul_mat_add_bias(add, xs, out, rt):
    """add(mul_mat(w, x), b) for a bias b of M elements, as one GEMM with cuBLASLt's bias
    epilogue where it is one dense F16/BF16 GEMM (the backend's fuse pass runs it in place of
    the add, on the add's output, which is the product's buffer); otherwise the product and
    then the add."""
    w, x, b = xs
    if not _gemm_with_bias(rt, w, x, out, b):
        mul_mat(None, (w, x), out, rt)
        binary(add, (DevTensor(out.ptr, out.dtype, out.ne, out.nb, add.src[0]), b), out, rt)


def mul_mat_add_bias_residual(res_add, xs, out, rt):
    """add(add(mul_mat(w, x), b), r) (either operand order of the outer add), r the size of the
    output: one bias-epilogue GEMM that also reads r as cuBLASLt's C (beta 1), writing the
    outer add's output (the product's buffer); otherwise the three steps."""
    w, x, b, r = xs
    if _gemm_with_bias(rt, w, x, out, b, residual=r):
        return
    inner = next(s.owner for s in res_add.src if s.owner.op == "add" and s.owner is not r.tensor.owner)
    mul_mat_add_bias(inner, (w, x, b), out, rt)
    y = DevTensor.of(inner, out.ptr)
    binary(res_add, (y, r) if res_add.src[0].owner is inner else (r, y), out, rt)


def mul_mat_add_bias_gelu(gelu, xs, out, rt):
    """gelu_tanh(add(mul_mat(w, x), b)): one GEMM with cuBLASLt's GELU-bias epilogue (its GELU is
    the tanh form) writing the gelu's output (F32, or F16/BF16 where fuse.py stores it) where it
    is one dense F16/BF16 GEMM whose output dtype cuBLASLt writes and whose bias that dtype
    holds exactly; otherwise the bias GEMM into F32 scratch and the gelu kernel from there
    (fuse.py runs this in the gelu's slot)."""
    w, x, b = xs
    # cuBLASLt reads the bias in the output's dtype: only where that rounds nothing
    exact_bias = out.dtype.name == "F32" or b.dtype.name == out.dtype.name
    if exact_bias and _gemm_with_bias(rt, w, x, out, b, gelu=True):
        return
    f32 = BY_NAME["F32"]
    M, N = w.ne[1], x.nrows
    pre = DevTensor(rt.scratch(M * N * 4), f32, out.ne, (4, 4 * M, 4 * M * out.ne[1], 4 * M * out.ne[1] * out.ne[2]),
                    gelu.src[0])
    add = gelu.src[0].owner
    mul_mat_add_bias(add, (w, x, b), pre, rt)
    unary(gelu, (pre,), out, rt)


def _gemm_with_bias(rt, w, x, out, b, residual=None, gelu=False) -> bool:
    """Enqueue out = w . x + b (+ residual) [then gelu] as one bias-epilogue GEMM when the shapes
    allow; False otherwise (nothing enqueued that matters: a packed x in scratch is just not used)."""
    K, M, w2, w3 = w.ne
    _, N, b2, b3 = x.ne
    gd = w.dtype.name
    if gd not in ("F16", "BF16") or w2 * w3 != 1 or not _gemm_ready(gd, w.ne, w.nb, gd, 2):
        return False
    if b.nelements != M or b.nb[0] != b.dtype.type_size or b.dtype.name not in FLOATS:
        return False
    if (b2 > 1 or b3 > 1) and not _even_rows(x.ne, x.nb):
        return False
    if residual is not None and (residual.dtype.name != "F32" or not residual.is_contiguous
                                 or residual.nelements != out.nelements or residual.ne[0] != M):
        return False
    x_ne, x_nb = _rows_as_one_matrix(x.ne, x.nb)
    N = x_ne[1]
    if _gemm_ready(x.dtype.name, x_ne, x_nb, gd, 2):
        xp, ldb = x.ptr, x_nb[1] // 2
    else:
        xp, ldb = rt.scratch(K * N * 2), K
        quant.to_dense(rt, x.ptr, x.dtype, x.ne, x.nb, gd, xp)
    # cuBLASLt reads the bias in the output's dtype
    od = out.dtype.name
    bias = b.ptr
    if b.dtype.name != od:
        bias = rt.scratch(M * out.dtype.type_size)
        rt.cast(bias, od, b.ptr, b.dtype.name, M)
    try:
        rt.gemm_bias(True, False, M, N, K, w.ptr, gd, w.nb[1] // 2, xp, gd, ldb, out.ptr, M, bias,
                     c_dtype=od, residual=None if residual is None else residual.ptr, gelu=gelu)
    except UnsupportedError:
        return False
    return True


def _fold_packed(shape):
    """The shape of a product whose x was just packed contiguous: with one weight matrix, every
    batch folds into the columns."""
    K, M, N, w2, w3, b2, b3 = shape
    return (K, M, N * b2 * b3, 1, 1, 1, 1) if w2 == 1 and w3 == 1 else shape


def _mul_mat_vec(rt, w, x, x_ne, x_nb, out, shape):
    K, M, N, w2, w3, b2, b3 = shape
    if out.dtype.name != "F32":
        raise UnsupportedError(f"mmv_{w.dtype.name}: F32 output only, got {out.dtype.name}")
    if _gemm_ready(x.dtype.name, x_ne, x_nb, "F32", 4):
        xp, xs1, xs2, xs3 = x.ptr, x_nb[1] // 4, x_nb[2] // 4, x_nb[3] // 4
    else:
        xp = rt.scratch(K * N * b2 * b3 * 4)
        quant.to_dense(rt, x.ptr, x.dtype, x_ne, x_nb, "F32", xp)
        xs1, xs2, xs3 = K, K * N, K * N * b2
        K, M, N, w2, w3, b2, b3 = _fold_packed(shape)
    grid = ((M + MMV_ROWS_PER_BLOCK - 1) // MMV_ROWS_PER_BLOCK, min(b2 * b3, MAX_GRID_Y), 1)
    rt.fn(MODULE, f"mmv_{quant.kernel_suffix(w.dtype)}", "PqqqPqqqPiiiiiii")(
        grid, (32, MMV_ROWS_PER_BLOCK, 1), w.ptr, w.nb[1], w.nb[2], w.nb[3], xp, xs1, xs2, xs3,
        out.ptr, K, M, N, b2, b3, b2 // w2, b3 // w3)


def _mul_mat_gemm(rt, w, x, x_ne, x_nb, out, shape):
    K, M, N, w2, w3, b2, b3 = shape
    gd = _gemm_dtype(w.dtype)
    es = quant.dense_itemsize(gd)
    # activations: (address, ldb, batch strides) in elements of gd
    if _gemm_ready(x.dtype.name, x_ne, x_nb, gd, es):
        act = (x.ptr, x_nb[1] // es, x_nb[2] // es, x_nb[3] // es)
    else:
        xp = rt.scratch(K * N * b2 * b3 * es)
        quant.to_dense(rt, x.ptr, x.dtype, x_ne, x_nb, gd, xp)
        act = (xp, K, K * N, K * N * b2)
        shape = _fold_packed(shape)
        K, M, N, w2, w3, b2, b3 = shape
    if _gemm_ready(w.dtype.name, w.ne, w.nb, gd, es):
        wt = (w.ptr, w.nb[1] // es, w.nb[2] // es, w.nb[3] // es)
        _gemms(rt, gd, es, wt, act, out, shape, 0, M)
        return
    if M * K * w2 * w3 * es <= DEQUANT_CHUNK_BYTES:
        wp = rt.scratch(M * K * w2 * w3 * es)
        quant.to_dense(rt, w.ptr, w.dtype, w.ne, w.nb, gd, wp)
        _gemms(rt, gd, es, (wp, K, M * K, M * K * w2), act, out, shape, 0, M)
        return
    # a weight too big to decode at once: row chunks, each multiplied before the next is decoded
    # (stream order makes reusing one scratch buffer safe)
    rows = max(16, DEQUANT_CHUNK_BYTES // (K * es) // 16 * 16)
    buf = rt.scratch(min(rows, M) * K * es)
    for j3 in range(w3):
        for j2 in range(w2):
            for m0 in range(0, M, rows):
                mc = min(rows, M - m0)
                src = w.ptr + j3 * w.nb[3] + j2 * w.nb[2] + m0 * w.nb[1]
                quant.to_dense(rt, src, w.dtype, (K, mc, 1, 1), w.nb, gd, buf)
                _gemms(rt, gd, es, (buf, K, 0, 0), act, out, shape, m0, mc, only=(j2, j3))


def _gemms(rt, gd, es, wt, act, out, shape, m0, mc, only=None):
    """cuBLAS calls for output rows [m0, m0+mc) of every x batch (or, with only=(j2, j3), of the
    x batches that use weight batch (j2, j3), whose rows m0.. are at wt's address)."""
    K, M, N, w2, w3, b2, b3 = shape
    r2, r3 = b2 // w2, b3 // w3
    a, lda, sa2, sa3 = wt
    b, ldb, sb2, sb3 = act
    for i3 in range(b3):
        j3 = i3 // r3
        if only is not None and j3 != only[1]:
            continue
        if w2 == 1 or (r2 == 1 and only is None):
            runs = [(0, b2, sa2 if w2 > 1 else 0)]  # every i2 in one strided-batched call
        else:
            runs = [(j2 * r2, r2, 0) for j2 in range(w2) if only is None or j2 == only[0]]
        for i2, nbatch, stride_a in runs:
            a_ptr = a + ((i2 // r2) * sa2 + j3 * sa3) * es if only is None else a
            b_ptr = b + (i3 * sb3 + i2 * sb2) * es
            c_ptr = out.ptr + ((i3 * b2 + i2) * N * M + m0) * out.dtype.type_size
            rt.gemm(True, False, mc, N, K, a_ptr, gd, lda, b_ptr, gd, ldb, c_ptr, M, c_dtype=out.dtype.name,
                    batch=nbatch, stride_a=stride_a, stride_b=sb2, stride_c=M * N)


# ---- get_rows ------------------------------------------------------------------------------------
def _supports_get_rows(node) -> bool:
    return quant.decodable(node.src[0].dtype)


@CUDA.register("get_rows", supports=_supports_get_rows)
def get_rows(node, xs, out, rt):
    t, ids = xs
    D, V = t.ne[0], t.ne[1]
    n, b2, b3 = ids.ne[0], ids.ne[1], ids.ne[2]
    per_row = D // 8 if t.dtype.is_quantized else D  # work items of one output row
    block = min(256, max(32, (per_row + 31) // 32 * 32))
    grid = (max(1, min(n * b2 * b3, GET_ROWS_MAX_BLOCKS)), 1, 1)
    rt.fn(quant.MODULE, f"get_rows_{quant.kernel_suffix(t.dtype)}", "PqqqqPiqqqiiiiiP")(
        grid, (block, 1, 1), t.ptr, t.nb[0], t.nb[1], t.nb[2], t.nb[3], ids.ptr,
        int(ids.dtype.name == "I64"), ids.nb[0], ids.nb[1], ids.nb[2], D, V, n, b2, b3, out.ptr)
