"""test-backend-ops: every registered op, on every backend, case by case against the numpy
reference (ggml's tests/test-backend-ops.cpp in spirit). Each op declares its cases in its
registry entry (OpDef.cases, sdrt/ops/cases.py): dtypes, odd shapes, non-contiguous views. A
case passes when the backend's result is within the op's NMSE tolerance (registry.max_nmse);
a case the backend has no kernel for is counted, not failed — docs/ops.md lists those, and is
checked here to be current. The CPU runs in the default run; "cuda0" is a GPU test (marker gpu, run with --gpu)
(on the device: `pytest tests/test_backend_ops.py`); "vulkan0" runs wherever a Vulkan device is
usable (Mesa's lavapipe in CI, see .ci/run and docs/vulkan.md) and skips elsewhere (marker vulkan)."""
import os

import pytest

from sdrt.ops.backend import unavailable_reason
from sdrt.ops.cases import all_cases, run_case, support_markdown
from sdrt.ops.registry import OPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = all_cases()
BACKENDS = ["cpu", pytest.param("cuda0", marks=pytest.mark.gpu),   # cuda0: the GPU run (--gpu)
            pytest.param("vulkan0", marks=pytest.mark.vulkan)]     # vulkan0: lavapipe in CI, or a GPU
# Ops the Vulkan backend has no kernel for in any case, named here so the walk says so (xfail)
# instead of passing an op it never ran; an op added to the registry without a Vulkan kernel
# fails on vulkan0 until it gets one or is listed. Empty: every registered op has a kernel.
VULKAN_WITHOUT_KERNEL: set[str] = set()


def _backend_or_skip(name):
    for prefix in ("cuda", "vulkan"):
        if name.startswith(prefix):
            why = unavailable_reason(prefix)
            if why is not None:
                pytest.skip(f"no {prefix} device: {why}")
    return name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_op_on_backend(op, backend):
    be = _backend_or_skip(backend)
    bad, ran = [], 0
    for name, case in CASES:
        if name != op:
            continue
        r = run_case(op, case, be)
        if r is None:
            continue
        ran += 1
        err, tol = r
        if not err <= tol:
            bad.append(f"{case.id()}: NMSE {err:.3g} > {tol:.3g}")
    assert not bad, f"{op} on {backend} differs from the reference:\n" + "\n".join(bad)
    if backend == "cpu":
        assert ran, f"the CPU backend has a kernel for none of {op}'s cases"
    if backend == "vulkan0":
        if op in VULKAN_WITHOUT_KERNEL:
            assert not ran, f"{op} now runs on vulkan0: remove it from VULKAN_WITHOUT_KERNEL"
            pytest.xfail(f"{op}: no Vulkan kernel (VULKAN_WITHOUT_KERNEL)")
        assert ran, (f"vulkan0 has a kernel for none of {op}'s cases: write one (sdrt/gpu/vulkan/ops) "
                     f"or list {op} in VULKAN_WITHOUT_KERNEL")


def test_every_op_declares_cases():
    assert not [n for n, d in OPS.items() if d.cases is None or not d.cases()]


def test_cases_cover_views_and_dtypes():
    # the walk is not only contiguous F32: views and every float dtype appear across the ops
    views = {i.view for _, c in CASES for i in c.inputs}
    types = {i.dtype for _, c in CASES for i in c.inputs}
    assert {"", "t", "p", "s"} <= views and {"F32", "F16", "BF16", "Q8_0", "I32"} <= types


def test_a_wrong_kernel_fails_its_case():
    from sdrt.ops.cpu import CPU
    saved = CPU._kernels["silu"]
    CPU._kernels["silu"] = [type(saved[0])("silu", lambda n, xs, out: out.fill(0), None)]
    try:
        err, tol = run_case("silu", OPS["silu"].cases()[0], "cpu")
    finally:
        CPU._kernels["silu"] = saved
    assert err > tol


def test_ops_md_is_current():
    with open(os.path.join(ROOT, "docs", "ops.md"), encoding="utf-8") as f:
        have = f.read()
    assert have == support_markdown(), "docs/ops.md is stale: run `python tools/make_ops_md.py`"


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_graph_passes_a_whole_unet(backend):
    # the tiny SD1 UNet (534 nodes: convs, group norms, attention, geglu, views...) checked node
    # by node: every op of a real model within its tolerance on the backend
    from test_unet import _graph

    from sdrt.ops.graph import check_graph
    be = _backend_or_skip(backend)
    assert check_graph(_graph("sd1"), be) == 534
