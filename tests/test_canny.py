"""sd-cli's --canny (sdrt.engine.canny) against stable-diffusion.cpp's own compiled
preprocess_canny (fixture from tools/make_canny_goldens.py: sd-cli's static library linked into
a harness): the maps must be identical, byte for byte."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sdrt.engine.canny import canny, edge_map, gaussian_kernel
from sdrt.errors import UsageError

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "canny_sdcpp.npz")
DATA = np.load(FIX)
CASES = json.loads(str(DATA["meta"]))["cases"]


@pytest.mark.parametrize("case", CASES)
def test_identical_to_sdcpp(case):
    got = canny(DATA[f"in_{case}"])
    want = DATA[f"out_{case}"]
    assert got.shape == want.shape and got.dtype == np.uint8
    assert (got[:, :, 0] == 255).sum() > 100          # edges were found (the test can fail)
    np.testing.assert_array_equal(got, want)


def test_kernel_and_quirks():
    k = gaussian_kernel(5)
    assert k.shape == (5, 5) and k.dtype == np.float32
    assert 0.8 < float(k.sum()) < 0.9 and k[2, 2] == k.max()   # truncated, not renormalized to 1 (sd.cpp)
    m = edge_map(DATA[f"in_{CASES[0]}"])
    # sd.cpp zeroes a 3-pixel frame and keeps sub-threshold values: more than {0, 0.8, 1} remain
    assert not m[:3].any() and not m[:, :3].any() and not m[-2:].any() and not m[:, -2:].any()
    assert len(np.unique(m)) > 3


def test_bad_input():
    with pytest.raises(UsageError, match="canny"):
        canny(np.zeros((8, 8), np.uint8))
