"""GPU tests: each one skips itself on a machine without a usable CUDA device (CI has none).

Use the `cuda` fixture (the cuda0 backend) in every GPU test module; `cuda_rt` is its runtime.
"""
import pytest


def cuda_or_skip():
    from sdrt.gpu import cuda
    if not cuda.available():
        pytest.skip(f"no CUDA device: {cuda.unavailable_reason()}")
    from sdrt.ops.backend import get_backend
    return get_backend("cuda0")


@pytest.fixture(scope="session")
def cuda():
    """The cuda0 backend (skips the test without a GPU)."""
    return cuda_or_skip()


@pytest.fixture(scope="session")
def cuda_rt(cuda):
    return cuda.rt
