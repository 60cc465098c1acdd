import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def shared_dir():
    if not os.path.isdir(SHARED):
        pytest.skip(f"../shared not found at {SHARED}: real weights/images unavailable")
    return SHARED
