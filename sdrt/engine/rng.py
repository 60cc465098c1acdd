"""Random number generators that reproduce stable-diffusion.cpp's noise bit for bit.

sd-cli's ``--rng`` picks one of three generators (``src/core/rng*.hpp``); each is reproduced
here with its state advancing exactly as the original, so the same seed gives the same latent
noise and the same per-step noise in ancestral/SDE samplers:

``cuda`` (default, :class:`PhiloxRNG`)
    The noise torch draws on an NVIDIA GPU, as sd-webui's ``rng_philox.py`` re-creates it on CPU:
    Philox4x32-10 with key = seed and counter = (offset, 0, index, 0); one ``randn`` call uses
    one offset, and Box-Muller turns outputs 0 and 1 of each counter into one normal.
    sd.cpp converts the uint32 outputs to float first and takes ``log``/``sin`` in double
    (its unqualified ``log(float)`` resolves to C's double ``log``), which we follow.

``cpu`` (:class:`MT19937RNG`)
    torch CPU's ``torch.randn`` after ``torch.manual_seed(seed)`` (what ComfyUI uses): mt19937;
    below 16 values it draws double Box-Muller pairs from 53-bit uniforms, keeping the second
    value for the next call; from 16 values on it fills 24-bit float uniforms and transforms
    them 16 at a time (8 cos/sin pairs), recomputing the last 16 when the size is not a
    multiple of 16. sd.cpp's port takes glibc's ``logf``/``cosf``/``sinf`` for that transform;
    torch itself runs its AVX2 kernel on x86-64 (Cephes polynomials from ``avx_mathfun.h``,
    fused multiply-adds) and a portable one (theta rounded from double) elsewhere. The three
    differ in the last ulp of 0.1-20% of values: ``flavor="sdcpp"`` (what ``--rng cpu`` uses,
    to match sd-cli), ``"torch"`` (bit-exact ``torch.randn`` on AVX2 CPUs), ``"torch_scalar"``.

``std_default`` (:class:`STDDefaultRNG`)
    ``std::default_random_engine`` + ``std::normal_distribution<float>`` of libstdc++ (gcc on
    Linux): the engine is ``minstd_rand0`` (Lehmer, a = 16807, m = 2^31 - 1), uniforms come from
    ``generate_canonical<float, 24>``, normals from the Marsaglia polar method with the second
    value cached; sd.cpp makes a new distribution per ``randn`` call, so an odd count drops the
    cached value while the engine has still advanced.

``cpu`` and ``std_default`` call glibc's ``logf``/``sinf``... through Numba kernels
(sdrt/engine/rng_kernels.py, imported on first use); ``cuda`` takes its double ``log``/``sin`` from
numpy, which gave glibc's float32 results on all of 5e7 random inputs (its double results may
differ in the last ulp; the product is rounded to float32), so a GPU run loads no Numba.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError

__all__ = ["MT19937RNG", "RNG", "RNGS", "PhiloxRNG", "STDDefaultRNG", "make_rng", "philox4x32"]

_U32 = 0xFFFFFFFF


class RNG:
    """Interface: ``manual_seed(seed)`` then ``randn(shape)`` -> float32 C-order array.

    Values fill the array in flat (C) order, which is sd.cpp's memory order for the same
    tensor, so ``randn((1, 4, 64, 64))`` here equals ``randn_like`` of a 64x64x4x1 sd::Tensor."""

    name = "?"

    def manual_seed(self, seed: int) -> None:
        raise NotImplementedError

    def _randn_flat(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def randn(self, shape) -> np.ndarray:
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if n < 0 or n > 0xFFFFFFFF:
            raise UsageError(f"cannot draw {n} random values in one call")
        return self._randn_flat(n).reshape(shape)

    def randn_like(self, x) -> np.ndarray:
        return self.randn(np.shape(x))

    def __repr__(self):
        return f"{type(self).__name__}()"


# ============================================================================ cuda: Philox4x32-10
_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def philox4x32(counter, key, rounds=10):
    """Philox4x32 on uint32 arrays: ``counter`` (4, N), ``key`` (k0, k1) scalars; returns (4, N)."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint32) for c in counter)
    k0, k1 = int(key[0]) & _U32, int(key[1]) & _U32
    for r in range(rounds):
        p0 = c0.astype(np.uint64) * _PHILOX_M0
        p1 = c2.astype(np.uint64) * _PHILOX_M1
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ np.uint32(k0),
            p1.astype(np.uint32),
            (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ np.uint32(k1),
            p0.astype(np.uint32),
        )
        if r < rounds - 1:
            k0 = (k0 + _PHILOX_W0) & _U32
            k1 = (k1 + _PHILOX_W1) & _U32
    return np.stack([c0, c1, c2, c3])


def philox_box_muller(g0, g1):
    """sd.cpp's Box-Muller of Philox outputs 0 and 1: the uniforms in float32 (each product and sum
    rounded), log and sin in double, the normal rounded to float32."""
    c = np.float32(2.3283064e-10)
    c2pi = np.float32(c * np.float32(6.2831855))
    u = g0.astype(np.float32) * c + c / np.float32(2.0)
    v = g1.astype(np.float32) * c2pi + c2pi / np.float32(2.0)
    s = np.sqrt(-2.0 * np.log(u.astype(np.float64))).astype(np.float32)
    return (s.astype(np.float64) * np.sin(v.astype(np.float64))).astype(np.float32)


class PhiloxRNG(RNG):
    """``--rng cuda``: sd.cpp ``PhiloxRNG`` (sd-webui's torch-CUDA-compatible randn)."""

    name = "cuda"

    def __init__(self, seed: int = 0):
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.offset = 0

    def _randn_flat(self, n):
        counter = (np.full(n, self.offset, np.uint32), np.zeros(n, np.uint32),
                   np.arange(n, dtype=np.uint32), np.zeros(n, np.uint32))
        self.offset = (self.offset + 1) & _U32
        g = philox4x32(counter, (self.seed & _U32, self.seed >> 32))
        return philox_box_muller(g[0], g[1])


# ============================================================================ cpu: mt19937 (torch)
_MT_N = 624
_MT_FLAVORS = {"sdcpp": 0, "torch": 1, "torch_scalar": 2}


class MT19937RNG(RNG):
    """``--rng cpu``: torch CPU ``torch.randn`` (mt19937) as sd.cpp's ``MT19937RNG`` ports it.

    ``flavor``: ``"sdcpp"`` (default) is sd.cpp's port; ``"torch"`` is torch's AVX2 kernel
    (what ``torch.randn`` gives on any x86-64 CPU with AVX2, AVX-512 ones included);
    ``"torch_scalar"`` is torch's portable kernel (CPUs without AVX2). Below 16 values all agree."""

    name = "cpu"

    def __init__(self, seed: int = 0, flavor: str = "sdcpp"):
        if flavor not in _MT_FLAVORS:
            raise UsageError(f"unknown MT19937RNG flavor '{flavor}'; valid: {', '.join(_MT_FLAVORS)}")
        self.flavor = flavor
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        st = np.empty(_MT_N, np.uint64)
        x = int(seed) & _U32
        st[0] = x
        for j in range(1, _MT_N):
            x = (1812433253 * (x ^ (x >> 30)) + j) & _U32
            st[j] = x
        self._state = st
        self._meta = np.array([1, 0], np.int64)        # left_ = 1, next_ = 0
        self._gauss = np.zeros(2, np.float64)           # has_next_gauss, next_gauss

    def _randn_flat(self, n):
        from .rng_kernels import _mt_randn
        return _mt_randn(self._state, self._meta, self._gauss, n, _MT_FLAVORS[self.flavor])


# ============================================================================ std_default (libstdc++)
_MINSTD_A, _MINSTD_M = 16807, 2147483647



class STDDefaultRNG(RNG):
    """``--rng std_default``: libstdc++ ``std::default_random_engine`` (minstd_rand0) +
    ``std::normal_distribution<float>``, as sd.cpp's ``STDDefaultRNG``."""

    name = "std_default"

    def __init__(self, seed: int = 0):
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        s = (int(seed) & _U32) % _MINSTD_M     # seed((unsigned int)seed)
        self._state = np.array([s if s != 0 else 1], np.int64)

    def _randn_flat(self, n):
        from .rng_kernels import _minstd_randn
        return _minstd_randn(self._state, n)


RNGS = {
    "std_default": (STDDefaultRNG, "std::default_random_engine + std::normal_distribution (libstdc++)"),
    "cuda": (PhiloxRNG, "Philox4x32-10, the noise torch draws on an NVIDIA GPU (sd-webui default)"),
    "cpu": (MT19937RNG, "mt19937, torch CPU's randn (ComfyUI)"),
}


def make_rng(name: str, seed: int | None = None) -> RNG:
    """Build an RNG by its ``--rng`` name, optionally seeded."""
    if name not in RNGS:
        raise UsageError(f"unknown RNG '{name}'; valid: {', '.join(RNGS)}")
    r = RNGS[name][0]()
    if seed is not None:
        r.manual_seed(seed)
    return r
