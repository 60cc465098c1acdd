"""Merging LoRA deltas into F16 / BF16 / F32 weights (`--lora-apply-mode immediately`), fast.

W' = W + sum(up_i @ down_i) + dense, stored in W's own type. The straightforward way (delta as a
float32 [out, in] array, W widened to float32, added, narrowed back with numpy) moves ~12 bytes
per weight element through memory three times and spends most of its time in numpy's F16
conversions (bench/README.md "LoRA": 46 s of CPU for an SDXL rank-32 LoRA). Here a weight is
done a block of rows at a time: BLAS writes the block's low-rank product into a cache-sized
float32 scratch, and one Numba pass reads the stored weight, widens it (the hardware half ->
float conversion, as sdrt.ops.cpu.matmul), adds the scratch and narrows to the stored type
(hardware float -> half with round-to-nearest-even, as ggml's F16C cast; BF16 with ggml's
rounding). Blocks are independent: sdrt.ops.threads.run_tasks spreads them over the -t threads,
each with single-thread BLAS, every weight in at least two tasks per thread. Other stored types
(quantized, F8) keep the generic path in sdrt.engine.lora.
"""
from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from ..ops.cpu.matmul import _f16_bits_to_f32

__all__ = ["FUSED_TYPES", "merge_into"]

FUSED_TYPES = ("F16", "BF16", "F32")
BLOCK_ELEMS = 1 << 18      # float32 elements of one block's scratch (1 MiB: stays in L2)
BLOCKS_PER_TASK = 8        # at most, for big weights (fewer, longer tasks)
TASKS_PER_THREAD = 2       # at least, per thread: a core taken by another process delays one task


@intrinsic
def _f32_to_f16_bits(typingctx, x):
    """float32 -> F16 bits through LLVM's fptrunc (vcvtps2ph, round to nearest even)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _f32_bits(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(cache=True, nogil=True)
def _add_f16(w, d, out):
    for i in range(w.shape[0]):
        wi, di, oi = w[i], d[i], out[i]
        for j in range(wi.shape[0]):
            oi[j] = _f32_to_f16_bits(_f16_bits_to_f32(wi[j]) + di[j])


@njit(cache=True, nogil=True)
def _add_bf16(w, d, out):
    """ggml's fp32 -> bf16: round to nearest even; NaN keeps its top bits, made quiet."""
    for i in range(w.shape[0]):
        wi, di, oi = w[i], d[i], out[i]
        for j in range(wi.shape[0]):
            u = _f32_bits(_bits_f32(np.uint32(wi[j]) << np.uint32(16)) + di[j])
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                oi[j] = np.uint16((u >> np.uint32(16)) | np.uint32(64))
            else:
                oi[j] = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@njit(cache=True, nogil=True)
def _add_f32(w, d, out):
    for i in range(w.shape[0]):
        wi, di, oi = w[i], d[i], out[i]
        for j in range(wi.shape[0]):
            oi[j] = wi[j] + di[j]


_KERNELS = {"F16": (_add_f16, np.uint16), "BF16": (_add_bf16, np.uint16), "F32": (_add_f32, np.float32)}
_F16_OK: bool | None = None


def _f16_narrowing_ok() -> bool:
    """Whether the hardware narrowing compiled and equals numpy's astype(float16) (round to
    nearest even) on values around every F16 rounding boundary; else the generic path runs."""
    global _F16_OK
    if _F16_OK is None:
        try:
            h = np.arange(0, 0x7C00, dtype=np.uint16)              # every finite positive half
            lo = h.view(np.float16).astype(np.float32)
            hi = np.append(lo[1:], np.float32(65520.0))
            probes = np.concatenate([lo, (lo + hi) / 2, np.nextafter((lo + hi) / 2, np.inf, dtype=np.float32),
                                     np.nextafter((lo + hi) / 2, -np.inf, dtype=np.float32), [7e4, 1e-9]])
            probes = np.concatenate([probes, -probes]).astype(np.float32)
            w = np.zeros((1, probes.size), np.uint16)
            got = np.empty_like(w)
            _add_f16(w, probes.reshape(1, -1), got)
            with np.errstate(over="ignore"):      # 7e4 rounds to inf in both
                want = (np.float32(0) + probes).astype(np.float16)     # +0 + -0 is +0
            _F16_OK = bool(np.array_equal(got[0], want.view(np.uint16)))
        except Exception:     # no half type in this LLVM target
            _F16_OK = False
    return _F16_OK


def supported(dtype_name: str) -> bool:
    return dtype_name in _KERNELS and (dtype_name != "F16" or _f16_narrowing_ok())


def merge_into(raw: np.ndarray, dtype_name: str, shape2d: tuple[int, int], lowrank: list, dense: np.ndarray | None
               ) -> np.ndarray:
    """W + sum(up @ down for (up, down) in lowrank) + dense, in W's type, as new 1-D uint8 storage.
    raw: W's storage bytes; shape2d: (out, in) with in = every dim past the first (torch
    layout); up [out, r] and down [r, in] float32 (the scale folded into up); dense: float32
    [out, in] or None."""
    from ..ops.threads import get_threads, run_tasks
    kernel, st = _KERNELS[dtype_name]
    rows, cols = shape2d
    w = np.asarray(raw).view(st).reshape(rows, cols)
    out = np.empty((rows, cols), st)
    lowrank = [(np.ascontiguousarray(u, np.float32), np.ascontiguousarray(d, np.float32)) for u, d in lowrank]
    # every weight is split into at least TASKS_PER_THREAD tasks per thread (the pipeline fills
    # one leaf at a time, so a weight of one task would leave the other cores idle)
    want = TASKS_PER_THREAD * get_threads()
    step = max(1, min(BLOCK_ELEMS // max(cols, 1), -(-rows // want)))
    blocks = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    n_tasks = min(len(blocks), max(want, -(-len(blocks) // BLOCKS_PER_TASK)))
    tasks = [blocks[len(blocks) * i // n_tasks: len(blocks) * (i + 1) // n_tasks] for i in range(n_tasks)]

    def run(task):
        scratch = np.empty((step, cols), np.float32)
        extra = np.empty((step, cols), np.float32) if len(lowrank) > 1 else None
        for r0, r1 in task:
            s = scratch[: r1 - r0]
            if lowrank:
                np.matmul(lowrank[0][0][r0:r1], lowrank[0][1], out=s)
                for up, down in lowrank[1:]:
                    e = extra[: r1 - r0]
                    np.matmul(up[r0:r1], down, out=e)
                    s += e
                if dense is not None:
                    s += dense[r0:r1]
            else:
                s[...] = dense[r0:r1]
            kernel(w[r0:r1], s, out[r0:r1])

    if threading.current_thread().name.startswith("sdrt-task"):   # already inside a run_tasks job
        for t in tasks:
            run(t)
    else:
        run_tasks(run, tasks)
    return out.reshape(-1).view(np.uint8)
