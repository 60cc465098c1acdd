"""GPU tests: a test that asks for the `cuda` fixture (the cuda0 backend) or `cuda_rt` (its
runtime) is a GPU test: tests/conftest.py marks it `gpu`, the default run deselects it and
`python -m pytest --gpu` runs it (an error without a device). Selected by `-m gpu` on a machine
without a usable CUDA device, each one skips itself. Tests here that need no device (kernel
tables, fatbin contents, host-side decoders) take neither fixture and run in the default run.
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


@pytest.fixture(autouse=True)
def exact_cpu_quant_gemm():
    """The CPU backend is these tests' reference: its quantized GEMM runs the exact path (float32
    products of the dequantized weights), not the int8-activation kernel that is its default."""
    from sdrt.ops.quant.gemm import using_path
    with using_path("off"):
        yield
