"""tests/conftest.py's gpu marker, run on a throwaway suite: the default run deselects GPU tests
(never skips them, never exits 5), -m gpu selects them, --gpu demands a device."""
import os

import pytest

pytest_plugins = ["pytester"]
CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")

SUITE = {
    "test_cpu.py": "def test_cpu():\n    assert True\n",
    "test_gpu.py": ("import pytest\n\n@pytest.fixture\ndef cuda():\n    pytest.skip('no CUDA device')\n\n"
                    "def test_uses_fixture(cuda):\n    pass\n\n@pytest.mark.gpu\ndef test_marked():\n    pass\n"),
}


@pytest.fixture
def suite(pytester):
    with open(CONFTEST) as f:
        pytester.makeconftest(f.read())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    pytester.makepyfile(**{k[:-3]: v for k, v in SUITE.items()})
    return pytester


def test_default_run_deselects_gpu_tests(suite):
    r = suite.runpytest("-p", "no:cacheprovider")
    r.assert_outcomes(passed=1, deselected=2)
    r.stdout.fnmatch_lines(["*2 GPU tests deselected*--gpu*"])
    assert r.ret == 0


def test_only_gpu_tests_named_exits_0_not_5(suite):
    r = suite.runpytest("-p", "no:cacheprovider", "test_gpu.py")
    r.assert_outcomes(deselected=2)
    assert r.ret == 0


def test_marker_selects_gpu_tests(suite):
    r = suite.runpytest("-p", "no:cacheprovider", "-m", "gpu")
    r.assert_outcomes(passed=1, skipped=1, deselected=1)      # the fixture's own skip


def test_gpu_option_needs_a_device(suite):
    from sdrt.gpu import cuda
    r = suite.runpytest("-p", "no:cacheprovider", "--gpu")
    if cuda.available():
        r.assert_outcomes(passed=1, skipped=1, deselected=1)
    else:
        assert r.ret == pytest.ExitCode.USAGE_ERROR
        r.stderr.fnmatch_lines(["*--gpu: no usable CUDA device here*"])
