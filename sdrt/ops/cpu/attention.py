"""CPU kernel for attention: flash-attention style tiles, BLAS for the products, Numba for the
online softmax.

For each (batch, head, block of `bq` queries) — one task — the keys are walked in blocks of
`bk`:
    S = Q_blk @ K_blk^T                      BLAS sgemm into a (bq, bk) float32 tile
    S <- 2^(S*c + mask*log2e - m_new)        Numba, base 2 (c = scale*log2e): running row max m,
                                             row sum l, and the factor alpha = 2^(m_old - m_new)
    O = O * alpha + S @ V_blk                BLAS, then a Numba multiply-add
and finally O /= l. When Lk fits one block (cross-attention: 77 keys) there is no rescaling:
O = S @ V straight into the output. The score tile is the only large buffer, never Lq x Lk.

Tile size: the score tile makes three trips per block (written by the first GEMM, rewritten by
the softmax, packed by the second GEMM), so it is kept L2-sized: SCORE_ELEMS = 256K floats
(1 MB), key blocks of at most 512, query blocks of up to 1024 filling the rest (the fastest of
the tile shapes timed, bench/README.md); cross-attention (77 keys) runs 1024-query blocks.
The exp is _util.exp2_32 (all float32, full-width AVX-512; ops/numba_target.py).

Where the bf16 GEMM is active (sdrt.ops.cpu.bf16gemm: AVX512_BF16, not SDRT_BF16GEMM=off, not a
--type f32 model) both products of self-attention-sized tiles run in bf16 (q, k, probabilities and
v rounded to bf16, float32 accumulation and softmax): the exp dominates these tiles, so this saves
about a fifth of the op at SD1.5's 4096 x 40 heads (bench/README.md).

Threads: the tasks go to a pool of `get_threads()` Python threads, each running single-thread
BLAS and `nogil` Numba; a free worker takes the next task, so a core stolen by another process
delays one tile, not a whole fork-join region (thin K=64 GEMMs split over two BLAS threads
stall whenever either thread is descheduled). So BLAS is held at 1 thread for the op.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from numba import njit

from ..convert import raw_to_f32
from ..threads import get_threads, run_tasks
from . import CPU
from . import bf16gemm
from ._util import as4d, exp2_32, f32_input
from .norm import FM, fmax32

SCORE_ELEMS = 256 * 1024  # float32 elements of one thread's score tile (1 MB; L2 is 2 MB per core here)
MAX_BLOCK_K = 512
MAX_BLOCK_Q = 1024
MIN_BLOCK_Q = 16
BLOCK_Q: int | None = None  # overrides, for tests that force ragged tiles
BLOCK_K: int | None = None
BF16 = True         # both products in bf16 (bf16gemm, one thread per task) when its kernel is active ...
BF16_MIN_KEYS = 256  # ... and there are this many keys (77-key cross-attention was slower in bf16)


LOG2E = np.float32(1.4426950408889634)


@njit(nogil=True, fastmath=FM, cache=True)
def _probs(S, mask, has_mask, c, m, l, alpha):
    """S (bq, bk) raw scores -> 2**(S*c + mask*log2(e) - m_new) in place, c = scale*log2(e):
    the softmax in base 2, so each score costs one fused multiply-add and an exp2_32 (no ln 2
    reduction). Updates the running max `m` (base-2 units) and sum `l` of each row and leaves
    alpha = 2**(m_old - m_new) for the accumulator."""
    bq, bk = S.shape
    for r in range(bq):
        row = S[r]
        mb = np.float32(-np.inf)
        if has_mask:
            mr = mask[r]
            for j in range(bk):
                mb = fmax32(mb, row[j] * c + mr[j] * LOG2E)
        elif c > 0:  # max(row) * c is max(row * c) exactly: a multiply saved
            for j in range(bk):
                mb = fmax32(mb, row[j])
            mb *= c
        else:
            for j in range(bk):
                mb = fmax32(mb, row[j] * c)
        m_old = m[r]
        m_new = fmax32(m_old, mb)
        s = np.float32(0.0)
        # all -inf so far: m_new = -inf, every exponent is NaN and exp2_32 gives 0
        if has_mask:
            for j in range(bk):
                e = exp2_32(row[j] * c + mr[j] * LOG2E - m_new)
                row[j] = e
                s += e
        else:
            for j in range(bk):
                e = exp2_32(row[j] * c - m_new)
                row[j] = e
                s += e
        a = exp2_32(m_old - m_new)
        alpha[r] = a
        l[r] = l[r] * a + s
        m[r] = m_new


@njit(nogil=True, fastmath=FM, cache=True)
def _accumulate(O, T, alpha):
    for r in range(O.shape[0]):
        a = alpha[r]
        for d in range(O.shape[1]):
            O[r, d] = O[r, d] * a + T[r, d]


@njit(nogil=True, fastmath=FM, cache=True)
def _finish(O, l):
    for r in range(O.shape[0]):
        inv = np.float32(1.0) / l[r] if l[r] > 0 else np.float32(0.0)  # fully masked -> 0
        for d in range(O.shape[1]):
            O[r, d] *= inv


def block_sizes(Lq: int, Lk: int, n_heads: int, workers: int) -> tuple[int, int]:
    """(bq, bk): key blocks of at most MAX_BLOCK_K, near-equal (no sliver of a last block); the
    query block fills the score tile, shrunk until every worker has at least two tasks."""
    bk = BLOCK_K or -(-Lk // -(-Lk // MAX_BLOCK_K))
    if BLOCK_Q:
        return min(BLOCK_Q, Lq), bk
    bq = max(MIN_BLOCK_Q, min(MAX_BLOCK_Q, SCORE_ELEMS // bk))
    while bq > MIN_BLOCK_Q and n_heads * math.ceil(Lq / bq) < 2 * workers:
        bq //= 2
    return min(bq, Lq), bk


_TLS = threading.local()


def _scratch(bq: int, bk: int, dv: int):
    """This thread's score tile S (bq, bk), accumulator tile T (bq, dv) and row vectors m, l,
    alpha, kept between tasks and calls: a fresh 1 MB np.empty per task is a new mmap whose
    pages fault in on every task."""
    key = (bq, bk, dv)
    if getattr(_TLS, "key", None) != key:
        _TLS.key = key
        _TLS.bufs = (np.empty((bq, bk), np.float32), np.empty((bq, dv), np.float32),
                     np.empty(bq, np.float32), np.empty(bq, np.float32), np.empty(bq, np.float32))
    return _TLS.bufs


def _attention(node, xs, out):
    q, k, v = (as4d(f32_input(s, x)) for s, x in zip(node.src[:3], xs[:3]))
    o4 = as4d(out)
    N, H, Lq, _ = q.shape
    Nk, Hk, Lk, _ = k.shape
    rh, rn = H // Hk, N // Nk
    c = np.float32(node.params["scale"]) * LOG2E
    has_mask = len(xs) == 4
    if has_mask:
        mraw = as4d(xs[3])
        mask_f32 = node.src[3].dtype.name == "F32"
        M3, M2, Mq = mraw.shape[:3]
    workers = max(1, get_threads())
    bq, bk = block_sizes(Lq, Lk, N * H, workers)
    nokey = np.zeros((1, 1), np.float32)
    path = bf16gemm.active_path() if BF16 and Lk >= BF16_MIN_KEYS else None

    def mm(a, b, o):
        if path is None or o.strides[1] != 4:
            np.matmul(a, b, out=o)
        else:
            bf16gemm.gemm(a, "F32", b, "F32", o, path, 1)

    def task(job):
        n, h, i0 = job
        i1 = min(i0 + bq, Lq)
        nq = i1 - i0
        Q = q[n, h, i0:i1]
        K = k[n // rn, h // rh]
        V = v[n // rn, h // rh]
        O = o4[n, h, i0:i1]
        if has_mask:
            plane = mraw[n % M3, h % M2]
            mrows = plane[i0:i1] if Mq > 1 else np.broadcast_to(plane[:1], (nq, Lk))
        S, T, m, l, alpha = _scratch(bq, bk, O.shape[1])
        S, T, m, l, alpha = S[:nq], T[:nq], m[:nq], l[:nq], alpha[:nq]
        m.fill(-np.inf)
        l.fill(0.0)
        for k0 in range(0, Lk, bk):
            k1 = min(k0 + bk, Lk)
            St = S[:, : k1 - k0]
            mm(Q, K[k0:k1].T, St)
            mb = nokey
            if has_mask:
                mb = mrows[:, k0:k1]
                if not mask_f32:
                    mb = raw_to_f32(mb, node.src[3].dtype)
            _probs(St, mb, has_mask, c, m, l, alpha)
            if k0 == 0:
                mm(St, V[k0:k1], O)
            else:
                mm(St, V[k0:k1], T)
                _accumulate(O, T, alpha)
        _finish(O, l)

    run_tasks(task, [(n, h, i0) for n in range(N) for h in range(H) for i0 in range(0, Lq, bq)])


CPU.register("attention", supports=lambda node: all(s.dtype.name in ("F32", "F16", "BF16") for s in node.src))(_attention)
