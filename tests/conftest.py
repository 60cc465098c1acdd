"""Shared fixtures, and the `gpu` marker: which tests need a CUDA device, and when they run.

A test is a GPU test when it asks for the `cuda`/`cuda_rt` fixture (tests/gpu/conftest.py) or
carries `@pytest.mark.gpu`. The default run deselects GPU tests (they are counted as deselected,
not skipped, so its passed/skipped counts are about what ran); tests under tests/gpu that check
host-side code (kernel tables, fatbin contents, host decoders) are not GPU tests and run here.

    python -m pytest -q            # CI: every test but the GPU tests
    python -m pytest -q --gpu      # the GPU machine: only the GPU tests; an error without a device
    python -m pytest -q -m gpu     # the GPU tests by marker (each skips itself without a device)
"""
import os
import sys

import numpy as np
import pytest

import sdrt.gpu  # noqa: F401 - the device backends register themselves (tests use sdrt.ops alone too)

# hypothesis imports its third-party entry-point plugins when the terminal summary is written;
# trio's (installed with the server test oracles) fails to load there after this suite has run,
# which crashed the whole run before it printed its counts. No test here needs those plugins.
os.environ.setdefault("HYPOTHESIS_NO_PLUGINS", "1")
# F16/BF16 weights multiply in bf16 by default where the CPU has AVX512_BF16; the suite's op and
# model tests hold the exact float32 path to their fp32 references, so they run it on every host
# (children inherit it). tests/test_ops_bf16gemm.py forces each bf16 path itself.
os.environ.setdefault("SDRT_BF16GEMM", "off")
# The CUDA backend replays the GEMM shapes of earlier processes from the user's cache by default;
# the GPU tests' backends do not (no thread sharing their allocator, nothing written to ~/.cache):
# tests/gpu/test_cuda_runtime.py starts the warm-up itself.
os.environ.setdefault("SDRT_GEMM_WARMUP", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny graphs on one CPU thread (`pytestmark = pytest.mark.usefixtures("one_thread")`): Numba's
    parallel regions cost more than they save on tiny tensors, and far more on a loaded 2-core
    machine (one tiny SD1 forward: 4 s on 2 threads, 0.05 s on 1; a tiny VAE decode 1.5 s vs 20 ms)."""
    from sdrt.ops.threads import get_threads, set_threads
    before = get_threads()
    set_threads(1)
    yield
    set_threads(before)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def shared_dir():
    if not os.path.isdir(SHARED):
        pytest.skip(f"../shared not found at {SHARED}: real weights/images unavailable")
    return SHARED


# ---- the gpu marker ------------------------------------------------------------------------------
GPU_FIXTURES = {"cuda", "cuda_rt"}


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", default=False,
                     help="run only the GPU tests (marker gpu), on a machine with a usable CUDA device "
                          "(an error without one); the default run deselects them")


def pytest_configure(config):
    config._gpu_deselected = 0


def _device_or_error():
    from sdrt.gpu import cuda
    if not cuda.available():
        raise pytest.UsageError(f"--gpu: no usable CUDA device here ({cuda.unavailable_reason()}); "
                                "the GPU tests must run, not skip, in the GPU run")


@pytest.hookimpl(tryfirst=True)        # before pytest's own -m selection sees the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if GPU_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gpu)
    gpu = [it for it in items if it.get_closest_marker("gpu")]
    if config.getoption("gpu"):
        _device_or_error()
        drop = [it for it in items if not it.get_closest_marker("gpu")]
    elif config.option.markexpr:
        return                          # -m decides
    else:
        drop = gpu
        config._gpu_deselected = len(gpu)
    if drop:
        keep = set(map(id, drop))
        items[:] = [it for it in items if id(it) not in keep]
        config.hook.pytest_deselected(items=drop)


def pytest_terminal_summary(terminalreporter, config):
    if config._gpu_deselected:
        terminalreporter.write_line(f"{config._gpu_deselected} GPU tests deselected (they need a CUDA device: "
                                    "python -m pytest --gpu on the GPU machine)")


def pytest_sessionfinish(session, exitstatus):
    """Naming only GPU tests on a machine without --gpu runs nothing: exit 0 with the summary's
    note (as when they skipped), not pytest's 5 ("no tests collected"), so CI never sees 5."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config._gpu_deselected:
        session.exitstatus = pytest.ExitCode.OK
