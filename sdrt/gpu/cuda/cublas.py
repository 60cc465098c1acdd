"""A thin ctypes binding to cuBLAS: one handle per stream with a preallocated workspace (so the
calls can be captured into a CUDA graph), and strided-batched GEMM in any of the F32/F16/BF16
type combinations the backend uses.

The library is found, in order: $SDRT_CUBLAS (a path), the nvidia-cublas wheel
(`nvidia/cu13/lib/libcublas.so.13`, `nvidia/cublas/lib/libcublas.so.12`), the CUDA toolkit
($CUDA_HOME, /usr/local/cuda), then the dynamic linker's own search path.

Types and compute (cublasGemmStridedBatchedEx):
| a, b | c | compute type |
|---|---|---|
| F32 | F32 | CUBLAS_COMPUTE_32F_PEDANTIC (plain FP32), or CUBLAS_COMPUTE_32F_FAST_TF32 with allow_tf32 |
| F16 | F16 or F32 | CUBLAS_COMPUTE_32F (tensor cores, F32 accumulation) |
| BF16 | BF16 or F32 | CUBLAS_COMPUTE_32F (tensor cores, F32 accumulation) |

`Cublas.gemm_bias` is one GEMM with cuBLASLt's bias epilogue (C = op(A) op(B) + bias broadcast
over C's columns, F32 bias, optionally + a residual matrix read as Lt's C), for the linear
layers' `add(mul_mat(w, x), b)` [+ r]: each separate add read and wrote the whole F32 output
once more; with gelu=True the GELU (tanh form) follows the bias in the same epilogue (a DiT
MLP's fc1 -> gelu). Its descriptors and the heuristic's algorithm are made once per shape and pointer
alignment and kept for the process; a shape cuBLASLt has no algorithm for raises
UnsupportedError (the caller runs the plain GEMM and the adds instead).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import time
from ctypes import POINTER, c_float, c_int, c_longlong, c_size_t, c_void_p
from pathlib import Path

from ...errors import OpError, UnsupportedError
from .driver import bind_signatures

CUDA_TYPES = {"F32": 0, "F16": 2, "BF16": 14}   # cudaDataType: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
C_TYPES = {"F32": ("F32",), "F16": ("F16", "F32"), "BF16": ("BF16", "F32")}   # a/b dtype -> allowed c
COMPUTE_32F, COMPUTE_32F_PEDANTIC, COMPUTE_32F_FAST_TF32 = 68, 69, 77
GEMM_DEFAULT_ALGO = -1
# cuBLASLt (cublasLt.h): matmul descriptor attributes, epilogue, preference attribute
LT_TRANSA, LT_TRANSB, LT_EPILOGUE, LT_BIAS_POINTER = 3, 4, 7, 8
LT_EPILOGUE_BIAS = 4
LT_EPILOGUE_GELU_BIAS = 36   # CUBLASLT_EPILOGUE_GELU | BIAS: the tanh-form GELU after the bias
LT_PREF_MAX_WORKSPACE_BYTES = 1
LT_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)   # of A, B, C, D in bytes (the heuristic assumes 256 unless told)
LT_HEURISTIC_BYTES = 96   # cublasLtMatmulHeuristicResult_t: algo (64 B), workspaceSize, state, waves, 4 ints
ALGO_BYTES = 64           # cublasLtMatmulAlgo_t, which cuBLAS documents as storable for reuse by the same version
OP_N, OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20   # what cuBLAS asks for on Hopper; preallocated so capture works
STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
                7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH",
                11: "CUBLAS_STATUS_MAPPING_ERROR", 13: "CUBLAS_STATUS_EXECUTION_FAILED",
                14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
                16: "CUBLAS_STATUS_LICENSE_ERROR"}
_INT32_MAX = 2**31 - 1


def _candidates() -> list[str]:
    out = []
    if os.environ.get("SDRT_CUBLAS"):
        out.append(os.environ["SDRT_CUBLAS"])
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        out += [os.path.join(base, "cu13", "lib", "libcublas.so.13"),
                os.path.join(base, "cublas", "lib", "libcublas.so.12")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            for sub in ("lib64", "lib"):
                out += [os.path.join(root, sub, "libcublas.so.13"), os.path.join(root, sub, "libcublas.so.12")]
    return out + ["libcublas.so.13", "libcublas.so.12"]


_LIB = None


def library():
    """The loaded libcublas (UnsupportedError listing where it looked when there is none)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    tried = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            lt = Path(path).with_name(Path(path).name.replace("libcublas", "libcublasLt"))
            if lt.exists():  # its sibling first, so the loader does not pick an older one
                ctypes.CDLL(str(lt), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            tried.append(f"{path}: {e}")
    else:
        raise UnsupportedError("cuBLAS not found (install nvidia-cublas or the CUDA toolkit, or set "
                               f"SDRT_CUBLAS); tried: {'; '.join(tried) or ', '.join(_candidates())}")
    sig = {
        "cublasCreate_v2": (POINTER(c_void_p),),
        "cublasDestroy_v2": (c_void_p,),
        "cublasSetStream_v2": (c_void_p, c_void_p),
        "cublasSetWorkspace_v2": (c_void_p, c_void_p, c_size_t),
        "cublasGetVersion_v2": (c_void_p, POINTER(c_int)),
        "cublasGemmStridedBatchedEx": (c_void_p, c_int, c_int, c_int, c_int, c_int, c_void_p,
                                       c_void_p, c_int, c_int, c_longlong,
                                       c_void_p, c_int, c_int, c_longlong, c_void_p,
                                       c_void_p, c_int, c_int, c_longlong, c_int, c_int, c_int),
    }
    bind_signatures(lib, sig)
    lib.cublasGetStatusName.argtypes, lib.cublasGetStatusName.restype = (c_int,), ctypes.c_char_p
    lib.sdrt_path = path
    lib.sdrt_lt = lt if lt.exists() else None
    _LIB = lib
    return lib


_LT = None


def lt_library():
    """libcublasLt, the sibling of the loaded libcublas (or the linker's), with the calls bound."""
    global _LT
    if _LT is not None:
        return _LT
    lib = library()
    try:
        lt = ctypes.CDLL(str(lib.sdrt_lt) if lib.sdrt_lt else "libcublasLt.so.13")
    except OSError as e:
        raise UnsupportedError(f"cuBLASLt not found next to {lib.sdrt_path}: {e}") from e
    u64, i64 = ctypes.c_uint64, c_longlong
    sig = {
        "cublasLtCreate": (POINTER(c_void_p),),
        "cublasLtDestroy": (c_void_p,),
        "cublasLtMatmulDescCreate": (POINTER(c_void_p), c_int, c_int),
        "cublasLtMatmulDescSetAttribute": (c_void_p, c_int, c_void_p, c_size_t),
        "cublasLtMatrixLayoutCreate": (POINTER(c_void_p), c_int, u64, u64, i64),
        "cublasLtMatmulPreferenceCreate": (POINTER(c_void_p),),
        "cublasLtMatmulPreferenceSetAttribute": (c_void_p, c_int, c_void_p, c_size_t),
        "cublasLtMatmulAlgoGetHeuristic": (c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                                           c_void_p, c_int, c_void_p, POINTER(c_int)),
        "cublasLtMatmul": (c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                           c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                           c_size_t, c_void_p),
    }
    bind_signatures(lt, sig)
    _LT = lt
    return lt


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 that divides the address."""
    a = 256
    while ptr % a:
        a //= 2
    return a


class _LtPlan:
    """The descriptors and algorithm of one bias-epilogue GEMM shape (kept for the process)."""

    def __init__(self, lt, handle, transa, transb, m, n, k, ab_type, lda, ldb, c_type, ldc, workspace_bytes,
                 align, epilogue=LT_EPILOGUE_BIAS, algo: bytes | None = None):
        self.desc, self.a, self.b, self.c = c_void_p(), c_void_p(), c_void_p(), c_void_p()
        what = f"cuBLASLt bias GEMM m={m} n={n} k={k}"
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, CUDA_TYPES["F32"]), what)
        for attr, value in ((LT_TRANSA, OP_T if transa else OP_N), (LT_TRANSB, OP_T if transb else OP_N),
                            (LT_EPILOGUE, epilogue)):
            v = c_int(value)
            check(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), what)
        rows_a, cols_a = (k, m) if transa else (m, k)
        rows_b, cols_b = (n, k) if transb else (k, n)
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), ab_type, rows_a, cols_a, lda), what)
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), ab_type, rows_b, cols_b, ldb), what)
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.c), c_type, m, n, ldc), what)
        self.heuristic = ctypes.create_string_buffer(LT_HEURISTIC_BYTES)
        self.algo = ctypes.addressof(self.heuristic)  # the algo is the result's first member
        self.restored = algo is not None
        if self.restored:         # an earlier run's choice for this very key (ALGO_BYTES, serializable)
            ctypes.memmove(self.heuristic, algo, ALGO_BYTES)
            return
        pref = c_void_p()
        check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), what)
        ws = ctypes.c_uint64(workspace_bytes)
        check(lt.cublasLtMatmulPreferenceSetAttribute(pref, LT_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8), what)
        for attr, nbytes in zip(LT_PREF_MIN_ALIGNMENT, align):
            v = ctypes.c_uint32(nbytes)
            check(lt.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(v), 4), what)
        found = c_int(0)
        check(lt.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a, self.b, self.c, self.c, pref, 1,
                                                self.heuristic, ctypes.byref(found)), what)
        if found.value < 1:
            raise UnsupportedError(f"{what}: cuBLASLt has no algorithm for it")


def status_name(code: int) -> str:
    try:
        s = library().cublasGetStatusName(code)
        if s:
            return s.decode()
    except (AttributeError, UnsupportedError):
        pass
    return STATUS_NAMES.get(code, f"cuBLAS status {code}")


def check(code: int, what: str) -> None:
    if code == 0:
        return
    name = status_name(code)
    if code in (8, 15):  # ARCH_MISMATCH, NOT_SUPPORTED
        raise UnsupportedError(f"cuBLAS {what}: {name}")
    raise OpError(f"cuBLAS {what}: {name}")


class Cublas:
    """cuBLAS handles of one device: one per stream, each with its own workspace."""

    def __init__(self, device, stream=None):
        self.device = device
        self.lib = library()
        self._handles: dict[int, c_void_p] = {}
        self._workspaces: list[int] = []
        self._stream_workspace: dict[int, int] = {}   # stream handle -> its handle's workspace
        self._lt = None                               # the cuBLASLt handle, made on first use
        self._lt_plans: dict[tuple, object] = {}      # shape -> _LtPlan, or the error it gave
        # every call's shape in first-use order (tuples replay_shape runs again in a later process)
        self.seen: dict[tuple, None] = {}
        # first use, for the debug logs: new shapes, host seconds in cuBLASLt's heuristic, host
        # seconds of each new shape's first call (a kernel cuBLAS loads on first use loads there)
        self.new_shapes, self.heuristic_s, self.first_call_s = 0, 0.0, 0.0
        # with the GEMM warm-up, cuBLASLt's choices are shared by this device's Cublas objects (ALGOS)
        self.share_algos = gemm_warm_up_on()
        v = c_int()
        h = self.handle(stream if stream is not None else device.compute)
        check(self.lib.cublasGetVersion_v2(h, ctypes.byref(v)), "cublasGetVersion")
        self.version = v.value

    def handle(self, stream) -> c_void_p:
        h = self._handles.get(stream.handle)
        if h is None:
            self.device.activate()
            h = c_void_p()
            check(self.lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
            check(self.lib.cublasSetStream_v2(h, c_void_p(stream.handle)), "cublasSetStream")
            ws = self.device.allocator.alloc(WORKSPACE_BYTES)
            self._workspaces.append(ws)
            self._stream_workspace[stream.handle] = ws
            check(self.lib.cublasSetWorkspace_v2(h, c_void_p(ws), WORKSPACE_BYTES), "cublasSetWorkspace")
            self._handles[stream.handle] = h
        return h

    def gemm(self, stream, transa: bool, transb: bool, m: int, n: int, k: int,
             a: int, a_dtype: str, lda: int, b: int, b_dtype: str, ldb: int, c: int, ldc: int, *,
             alpha: float = 1.0, beta: float = 0.0, c_dtype: str = "F32", batch: int = 1,
             stride_a: int = 0, stride_b: int = 0, stride_c: int = 0, allow_tf32: bool = False) -> None:
        """Column-major C[m,n] = alpha * op(A)[m,k] op(B)[k,n] + beta * C, `batch` times with
        element strides; enqueued on `stream`."""
        what = (f"gemm({'T' if transa else 'N'}{'T' if transb else 'N'} m={m} n={n} k={k} batch={batch} "
                f"{a_dtype}x{b_dtype}->{c_dtype})")
        if a_dtype != b_dtype or a_dtype not in C_TYPES:
            raise UnsupportedError(f"cuBLAS {what}: a and b must share one of F32/F16/BF16 (cast first)")
        if c_dtype not in C_TYPES[a_dtype]:
            raise UnsupportedError(f"cuBLAS {what}: {a_dtype} inputs give {' or '.join(C_TYPES[a_dtype])} outputs")
        if min(m, n, k, batch) < 1 or max(m, n, k, lda, ldb, ldc, batch) > _INT32_MAX:
            raise OpError(f"cuBLAS {what}: dims must be in 1..2^31-1 (lda={lda} ldb={ldb} ldc={ldc})")
        if a_dtype == "F32":
            compute = COMPUTE_32F_FAST_TF32 if allow_tf32 else COMPUTE_32F_PEDANTIC
        else:
            compute = COMPUTE_32F
        one, zero = c_float(alpha), c_float(beta)
        shape = ("gemm", bool(transa), bool(transb), m, n, k, a_dtype, c_dtype, lda, ldb, ldc, batch,
                 stride_a, stride_b, stride_c, beta != 0, bool(allow_tf32))
        t0 = time.perf_counter() if shape not in self.seen else None
        check(self.lib.cublasGemmStridedBatchedEx(
            self.handle(stream), OP_T if transa else OP_N, OP_T if transb else OP_N, m, n, k,
            ctypes.byref(one), c_void_p(a), CUDA_TYPES[a_dtype], lda, stride_a,
            c_void_p(b), CUDA_TYPES[b_dtype], ldb, stride_b, ctypes.byref(zero),
            c_void_p(c), CUDA_TYPES[c_dtype], ldc, stride_c, batch, compute, GEMM_DEFAULT_ALGO), what)
        if t0 is not None:
            self.seen[shape] = None
            self.new_shapes += 1
            self.first_call_s += time.perf_counter() - t0

    def gemm_bias(self, stream, transa: bool, transb: bool, m: int, n: int, k: int,
                  a: int, a_dtype: str, lda: int, b: int, b_dtype: str, ldb: int, c: int, ldc: int,
                  bias: int, *, c_dtype: str = "F32", residual: int | None = None, gelu: bool = False) -> None:
        """Column-major C[m,n] = op(A)[m,k] op(B)[k,n] + bias[m] (F32 bias, broadcast over the
        n columns) [+ R[m,n], a matrix laid out as C, at `residual`] through cuBLASLt's bias
        epilogue, enqueued on `stream`. F16/BF16 a and b. gelu: C = GELU(op(A) op(B) + bias)
        (CUBLASLT_EPILOGUE_GELU_BIAS, the tanh form; no residual); an epilogue the library
        refuses raises UnsupportedError."""
        if a_dtype != b_dtype or a_dtype not in ("F16", "BF16") or c_dtype not in C_TYPES[a_dtype]:
            raise UnsupportedError(f"cuBLASLt bias GEMM: {a_dtype}x{b_dtype}->{c_dtype}")
        if gelu and residual is not None:
            raise UnsupportedError("cuBLASLt GELU-bias GEMM: no residual")
        if min(m, n, k) < 1 or max(m, n, k, lda, ldb, ldc) > _INT32_MAX:
            raise OpError(f"cuBLASLt bias GEMM: dims must be in 1..2^31-1 (m={m} n={n} k={k})")
        lt = lt_library()
        self.handle(stream)  # makes this stream's workspace, shared with the cuBLAS handle
        if self._lt is None:
            self._lt = c_void_p()
            check(lt.cublasLtCreate(ctypes.byref(self._lt)), "cublasLtCreate")
        src_c = c if residual is None else residual
        align = tuple(_alignment(p) for p in (a, b, src_c, c))
        key = (transa, transb, m, n, k, a_dtype, lda, ldb, c_dtype, ldc, align, gelu)
        plan = self._lt_plans.get(key)
        t0 = None
        shared = (self.device.index, key) if self.share_algos else None
        if plan is None:
            t0 = time.perf_counter()
            try:
                plan = _LtPlan(lt, self._lt, transa, transb, m, n, k, CUDA_TYPES[a_dtype], lda, ldb,
                               CUDA_TYPES[c_dtype], ldc, WORKSPACE_BYTES, align,
                               LT_EPILOGUE_GELU_BIAS if gelu else LT_EPILOGUE_BIAS,
                               algo=ALGOS.get(shared) if shared else None)
                if shared:
                    ALGOS[shared] = plan.heuristic.raw[:ALGO_BYTES]
            except UnsupportedError as e:
                plan = e
            except OpError as e:
                if not gelu:
                    raise
                plan = UnsupportedError(str(e))   # a GELU epilogue refused: the caller runs it unfused
            self._lt_plans[key] = plan
            t1 = time.perf_counter()
            self.new_shapes += 1
            self.heuristic_s += t1 - t0
            self.seen[("bias", bool(transa), bool(transb), m, n, k, a_dtype, c_dtype, lda, ldb, ldc, align,
                       bool(gelu), residual is not None)] = None
        if isinstance(plan, Exception):
            raise UnsupportedError(str(plan))
        ptr = c_void_p(bias)
        check(lt.cublasLtMatmulDescSetAttribute(plan.desc, LT_BIAS_POINTER, ctypes.byref(ptr), 8),
              "cuBLASLt bias pointer")
        one, beta = c_float(1.0), c_float(0.0 if residual is None else 1.0)
        res = lt.cublasLtMatmul(self._lt, plan.desc, ctypes.byref(one), c_void_p(a), plan.a, c_void_p(b), plan.b,
                                ctypes.byref(beta), c_void_p(src_c), plan.c, c_void_p(c), plan.c, c_void_p(plan.algo),
                                c_void_p(self._stream_workspace[stream.handle]), WORKSPACE_BYTES,
                                c_void_p(stream.handle))
        if res != 0 and plan.restored:     # a stored choice this library refuses: choose again, once
            ALGOS.pop(shared, None)
            self._lt_plans.pop(key, None)
            return self.gemm_bias(stream, transa, transb, m, n, k, a, a_dtype, lda, b, b_dtype, ldb, c, ldc, bias,
                                  c_dtype=c_dtype, residual=residual, gelu=gelu)
        check(res, f"cuBLASLt bias GEMM m={m} n={n} k={k}")
        if t0 is not None:
            self.first_call_s += time.perf_counter() - t1

    def close(self) -> None:
        if self._lt is not None:
            lt_library().cublasLtDestroy(self._lt)
            self._lt = None
        for h in self._handles.values():
            self.lib.cublasDestroy_v2(h)
        self._handles.clear()
        for ws in self._workspaces:
            self.device.allocator.free(ws)
        self._workspaces.clear()


# ---- the GEMM shapes of earlier runs, replayed to load cuBLAS's kernels ahead -------------------
# A kernel cuBLAS runs is loaded on its first launch in a process (CUDA's lazy loading), which
# costs milliseconds a shape (bench/README.md). The shapes a run met
# (Cublas.seen) are kept on disk under the key of what ran (a model version and image size: one
# process's SD1.5 shapes are no use to the next one's SDXL, and would delay its own); a later
# process replays that key's shapes, in their first-use order, on a stream and cuBLAS handles of
# its own, on scratch memory, as soon as its pipeline names the key.
ALGOS: dict[tuple, bytes] = {}     # (device index, bias-GEMM plan key) -> cuBLASLt's choice, shared
SHAPES_KEEP = 4096                 # shapes kept per key (the first met); cuBLASLt choices (the newest)
KEYS_KEEP = 16                     # keys kept in the file (the newest)
REPLAY_MAX_BYTES = 512 << 20       # a shape needing more scratch than this is not replayed
_SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def shape_layout(shape: tuple) -> tuple[dict[str, int], int]:
    """({operand: byte offset}, bytes) of a scratch region holding every operand of `shape` (a
    Cublas.seen tuple) at the pointer alignment it was called with: regions 512-byte aligned,
    then shifted by the recorded alignment when below 256."""
    kind, transa, transb, m, n, k, a_dt, c_dt, lda, ldb, ldc = shape[:11]
    if kind == "gemm":
        batch, sa, sb, sc = shape[11:15]
        align = (256, 256, 256, 256)
    else:
        batch, sa, sb, sc = 1, 0, 0, 0
        align = shape[11]
    ea, ec = _SIZES[a_dt], _SIZES[c_dt]
    need = {"a": (lda * (m if transa else k) + sa * (batch - 1)) * ea,
            "b": (ldb * (k if transb else n) + sb * (batch - 1)) * ea,
            "c": (ldc * n + sc * (batch - 1)) * ec}
    if kind == "bias":
        need["bias"] = m * 4
        if shape[13]:
            need["r"] = ldc * n * ec
    aligned = {"a": align[0], "b": align[1], "r": align[2], "c": align[3]}   # gemm_bias's key order
    offsets, top = {}, 0
    for name, nbytes in need.items():
        shift = aligned.get(name, 256) % 256
        offsets[name] = top + shift
        top += -(-(shift + nbytes) // 512) * 512
    return offsets, top


def replay_shape(cublas: "Cublas", stream, shape: tuple, base: int) -> None:
    """One call of `shape` on `stream` with operands in the scratch at `base` (shape_layout)."""
    off, _ = shape_layout(shape)
    kind, transa, transb, m, n, k, a_dt, c_dt, lda, ldb, ldc = shape[:11]
    if kind == "gemm":
        batch, sa, sb, sc, beta_nz, tf32 = shape[11:17]
        cublas.gemm(stream, transa, transb, m, n, k, base + off["a"], a_dt, lda, base + off["b"], a_dt, ldb,
                    base + off["c"], ldc, beta=1.0 if beta_nz else 0.0, c_dtype=c_dt, batch=batch,
                    stride_a=sa, stride_b=sb, stride_c=sc, allow_tf32=tf32)
    else:
        gelu, residual = shape[12], shape[13]
        cublas.gemm_bias(stream, transa, transb, m, n, k, base + off["a"], a_dt, lda, base + off["b"], a_dt, ldb,
                         base + off["c"], ldc, base + off["bias"], c_dtype=c_dt,
                         residual=base + off["r"] if residual else None, gelu=gelu)


def gemm_warm_up_on() -> bool:
    """The GEMM warm-up (kept shapes replayed, kept cuBLASLt choices shared): on unless
    SDRT_GEMM_WARMUP=0."""
    return os.environ.get("SDRT_GEMM_WARMUP", "1") != "0"


def shapes_file(cache_dir: Path, arch: str, version: int) -> Path:
    return Path(cache_dir) / f"gemm-shapes-{arch}-cublas{version}.json"


def _read_json(path: Path) -> list:
    """The JSON list at `path`, [] when missing, unreadable or not a list: these files are caches."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    return raw if isinstance(raw, list) else []


def _kept_shapes(path: Path) -> dict[str, list[tuple]]:
    """{key: shapes in first-use order} kept at `path`, oldest key first (odd entries skipped)."""
    out = {}
    for entry in _read_json(path):
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list):
            out[entry[0]] = [_tuples(s) for s in entry[1]
                             if isinstance(s, list) and s and s[0] in ("gemm", "bias") and _plain(s)]
    return out


def _plain(x) -> bool:
    """Only numbers, strings, booleans and lists of them (a shape, hashable once a tuple)."""
    return all(_plain(v) for v in x) if isinstance(x, list) else isinstance(x, (int, float, str))


def load_shapes(path: Path, key: str) -> list[tuple]:
    """The shapes kept at `path` under `key`, in first-use order ([] when none)."""
    return _kept_shapes(path).get(key, [])


def save_shapes(path: Path, key: str, shapes) -> None:
    """Add `shapes` not kept yet to the end of `key`'s list at `path` (at most SHAPES_KEEP), make
    `key` the newest (at most KEYS_KEEP kept), atomically."""
    kept = _kept_shapes(path)
    mine = dict.fromkeys(kept.pop(key, []))
    mine.update(dict.fromkeys(shapes))
    kept[key] = list(mine)[:SHAPES_KEEP]
    _write_json(path, [[k, [_lists(s) for s in v]] for k, v in list(kept.items())[-KEYS_KEEP:]])


def algos_file(cache_dir: Path, arch: str, version: int) -> Path:
    return Path(cache_dir) / f"gemm-algos-{arch}-cublas{version}.json"


def _kept_algos(path: Path) -> dict[tuple, str]:
    """{plan key: hex choice} kept at `path` (odd entries skipped)."""
    return {_tuples(e[0]): e[1] for e in _read_json(path)
            if isinstance(e, list) and len(e) == 2 and isinstance(e[0], list) and _plain(e[0]) and isinstance(e[1], str)}


def load_algos(path: Path, index: int) -> int:
    """Put the cuBLASLt choices kept at `path` into ALGOS for device `index`; returns how many."""
    n = 0
    for key, h in _kept_algos(path).items():
        try:
            algo = bytes.fromhex(h)
        except ValueError:
            continue
        if len(algo) == ALGO_BYTES:
            ALGOS.setdefault((index, key), algo)
            n += 1
    return n


def save_algos(path: Path, index: int) -> None:
    """Keep ALGOS' choices for device `index` at `path` (merged with the file's), atomically."""
    merged = _kept_algos(path)
    merged.update({key: algo.hex() for (i, key), algo in list(ALGOS.items()) if i == index})
    _write_json(path, [[_lists(k), h] for k, h in list(merged.items())[-SHAPES_KEEP:]])


def _write_json(path: Path, obj) -> None:
    """obj as JSON at `path`, atomically (a reader never sees half a file; no temporary is left)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _lists(x):
    return [_lists(v) for v in x] if isinstance(x, tuple) else x
