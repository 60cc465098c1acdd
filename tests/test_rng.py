"""RNGs against stable-diffusion.cpp's own generators and torch.randn (goldens, no torch needed).

tests/fixtures/sampling_rng.npz (tools/make_sampling_goldens.py) holds, per generator and seed,
the values of a sequence of randn calls of sizes such as 1, 3, 16, 17, 5, 100, 4099 made by
sd.cpp's PhiloxRNG / MT19937RNG / STDDefaultRNG compiled from its source, and the values of
``torch.randn`` on CPU (torch 2.13) for the same calls. All must match bit for bit, which also
checks that the generator state advances across calls exactly as the originals.
"""

import os

import numpy as np
import pytest

from sdrt.engine import rng as R
from sdrt.errors import UsageError

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "sampling_rng.npz")
G = np.load(FIX)
SEEDS = (0, 42, 4294967303, 1234567)


def _draw(r, calls):
    return np.concatenate([r.randn(int(n)) for n in calls])


@pytest.mark.parametrize("kind", ["cuda", "cpu", "std_default"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("calls", ["a", "b"])
def test_bit_exact_vs_sdcpp(kind, seed, calls):
    tag = f"rng__{kind}__{seed}__{calls}"
    got = _draw(R.make_rng(kind, seed), G[tag + "__calls"])
    ref = G[tag]
    assert got.dtype == np.float32
    assert np.array_equal(got, ref), f"{np.sum(got != ref)} of {ref.size} differ"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("calls", ["a", "b"])
def test_torch_flavor_bit_exact_vs_torch_randn(seed, calls):
    tag = f"torch__{seed}__{calls}"
    if tag not in G.files:
        pytest.skip("goldens made without torch")
    got = _draw(R.MT19937RNG(seed, flavor="torch"), G[f"rng__cpu__{seed}__{calls}__calls"])
    assert np.array_equal(got, G[tag]), f"{np.sum(got != G[tag])} differ"


def test_cpu_flavors_agree_closely():
    a = R.MT19937RNG(5).randn((4, 64, 64))
    for flavor in ("torch", "torch_scalar"):
        b = R.MT19937RNG(5, flavor=flavor).randn((4, 64, 64))
        assert np.max(np.abs(a - b)) < 1e-5 and np.mean(a != b) < 0.3
    assert np.array_equal(R.MT19937RNG(5).randn(7), R.MT19937RNG(5, flavor="torch").randn(7))


def _philox_scalar(seed, offset, n):
    """A straightforward per-element transcription of sd.cpp's rng_philox.hpp (Python ints)."""
    M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
    out = []
    for i in range(n):
        c = [offset, 0, i, 0]
        k = [seed & 0xFFFFFFFF, seed >> 32]
        for r in range(10):
            v1 = c[0] * M0
            v2 = c[2] * M1
            c = [((v2 >> 32) ^ c[1] ^ k[0]) & 0xFFFFFFFF, v2 & 0xFFFFFFFF,
                 ((v1 >> 32) ^ c[3] ^ k[1]) & 0xFFFFFFFF, v1 & 0xFFFFFFFF]
            if r < 9:
                k = [(k[0] + W0) & 0xFFFFFFFF, (k[1] + W1) & 0xFFFFFFFF]
        out.append((c[0], c[1]))
    return out


def test_philox_vectorized_matches_scalar_transcription():
    for seed, offset in ((0, 0), (42, 3), (2 ** 40 + 17, 9)):
        ref = np.array(_philox_scalar(seed, offset, 37), np.uint64)
        n = 37
        g = R.philox4x32((np.full(n, offset, np.uint32), np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32),
                          np.zeros(n, np.uint32)), (seed & 0xFFFFFFFF, seed >> 32))
        np.testing.assert_array_equal(g[0], ref[:, 0])
        np.testing.assert_array_equal(g[1], ref[:, 1])


def test_philox_statistics_and_offsets():
    r = R.PhiloxRNG(123)
    a = r.randn((4, 64, 64))
    b = r.randn((4, 64, 64))
    assert abs(a.mean()) < 0.03 and abs(a.std() - 1) < 0.03
    assert not np.array_equal(a, b)            # each call takes the next offset
    r.manual_seed(123)
    assert np.array_equal(r.randn((4, 64, 64)), a)
    # the flat index is the counter: a prefix of a bigger draw at the same offset is the same
    assert np.array_equal(R.PhiloxRNG(123).randn(10), a.reshape(-1)[:10])


def test_registry_and_errors():
    assert list(R.RNGS) == ["std_default", "cuda", "cpu"]
    with pytest.raises(UsageError, match="valid: std_default, cuda, cpu"):
        R.make_rng("gpu")
    assert R.make_rng("cuda", 1).randn((2, 3)).shape == (2, 3)


def test_philox_box_muller_matches_libm():
    """The numpy Box-Muller against Python's math (C's libm, which sd.cpp calls), value by value,
    on 200k random Philox outputs (the extremes included)."""
    import math
    rng = np.random.default_rng(7)
    g0, g1 = (rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    g0[:2], g1[:2] = (0, 0xFFFFFFFF), (0xFFFFFFFF, 0)
    c = np.float32(2.3283064e-10)
    c2pi = np.float32(c * np.float32(6.2831855))
    u = g0.astype(np.float32) * c + c / np.float32(2)
    v = g1.astype(np.float32) * c2pi + c2pi / np.float32(2)
    want = np.array([np.float32(float(np.float32(math.sqrt(-2.0 * math.log(a)))) * math.sin(b))
                     for a, b in zip(u.tolist(), v.tolist())], np.float32)
    np.testing.assert_array_equal(R.philox_box_muller(g0, g1), want)


def test_default_rng_loads_no_numba():
    """A GPU run's noise (and -t) must not load Numba (~0.8 s of a one-image CUDA command)."""
    import subprocess
    import sys
    code = ("import sys; from sdrt.ops.threads import set_threads; set_threads(1); "
            "from sdrt.engine.rng import make_rng; make_rng('cuda', 1).randn(8); "
            "assert 'numba' not in sys.modules, 'numba loaded'; "
            "import sdrt.ops.cpu, numba; assert numba.get_num_threads() == 1, numba.get_num_threads()")
    subprocess.run([sys.executable, "-c", code], check=True)
