"""CUDA backend pieces that need no GPU: the shipped fatbins match their sources (a .cu edited
without `python tools/build_cuda_kernels.py` fails here), `import sdrt` stays free of pycuda,
the backend says why it is unavailable, the allocator's size classes."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fatbins_match_sources():
    # the check only hashes files: it needs no nvcc and no GPU
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_cuda_kernels.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, "stale CUDA kernels; run `python tools/build_cuda_kernels.py`:\n" + r.stdout + r.stderr


def test_import_sdrt_does_not_import_pycuda():
    code = ("import sys, sdrt, sdrt.ops.api, sdrt.gpu.cuda, sdrt.cli.main; "
            "sdrt.gpu.cuda.available(); "
            "print('pycuda.driver' in sys.modules, sdrt.gpu.cuda.available())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    loaded, available = r.stdout.split()
    assert loaded == available   # pycuda.driver is imported only when a GPU is there to use


def test_unavailable_backend_says_why():
    from sdrt.errors import UnsupportedError
    from sdrt.gpu import cuda
    from sdrt.ops.backend import available_backends, get_backend
    if cuda.available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(UnsupportedError, match="cuda0' is not available: .+"):
        get_backend("cuda0")
    with pytest.raises(UnsupportedError, match="available: cpu, reference"):
        get_backend("cuda")
    # the host backends, and no CUDA name (a Vulkan device, e.g. lavapipe in CI, may follow)
    assert available_backends()[:2] == ["cpu", "reference"]
    assert not [n for n in available_backends() if n.startswith("cuda")]


def test_allocator_size_classes():
    from sdrt.gpu.cuda.driver import CachingAllocator
    r = CachingAllocator.round_size
    assert r(1) == r(512) == 512 and r(513) == 1024 and r(1 << 20) == 1 << 20
    for n in [1000, 5000, 123_457, 10**9 + 7]:
        assert n <= r(n) <= max(512, n * 1.125) and r(r(n)) == r(n)
    # a weight's block: 512-B aligned only (Flux's 15360x3072 BF16 linear2 is 90 MiB, class 96)
    fit = CachingAllocator.fit_size
    assert fit(1) == 512 and fit(513) == 1024 and fit(90 << 20) == 90 << 20 and r(90 << 20) == 96 << 20


def test_kernel_source_digest_covers_local_headers(tmp_path):
    from sdrt.gpu.cuda.driver import source_digest
    (tmp_path / "common.cuh").write_text("#define X 1\n")
    cu = tmp_path / "k.cu"
    cu.write_text('#include "common.cuh"\n#include <cuda_fp16.h>\n')
    d0 = source_digest(cu)
    (tmp_path / "common.cuh").write_text("#define X 2\n")
    assert source_digest(cu) != d0


def test_kernel_names_and_the_fatbin_symbol_check(tmp_path, monkeypatch):
    from sdrt.gpu.cuda import naming
    assert naming.kernel_name("add", ("F32", "F16")) == "binary_add_f32_f16"
    assert naming.kernel_name("silu", ("BF16",)) == "unary_silu_bf16"
    assert naming.kernel_name("gelu_tanh", ("F32",), "BF16") == "unary_gelu_tanh_f32_to_bf16"
    assert naming.kernel_name("add", ("F32", "F16"), "F32") == "binary_add_f32_f16"
    with pytest.raises(KeyError):
        naming.kernel_name("mul_mat", ("F16", "F32"))
    # every unary and binary op of the registry, in every float dtype combination, and from F32
    # first operands into F16/BF16 (the results fuse.half_nodes stores so)
    names = naming.registered_kernels()["elementwise"]
    assert len(names) == 5 * len(naming.ops_of_kind("unary")) + 15 * len(naming.ops_of_kind("binary"))
    assert "binary_mul_f32_bf16_to_f16" in names and "unary_silu_f32_to_bf16" in names
    assert "#define SDRT_UNARY_OPS(X) X(neg)" in naming.ops_header()
    # a fatbin lacking one of them is reported
    fat = tmp_path / "elementwise.fatbin"
    one_arch = b"".join(b".text." + n.encode() + b"\0" for n in names if n != "unary_silu_f16")
    fat.write_bytes(one_arch * len(naming.family_archs("elementwise")[0]))
    monkeypatch.setattr(naming, "KERNELS_DIR", tmp_path)
    assert naming.missing_symbols() == ["elementwise: unary_silu_f16"]


def test_fused_and_half_storage_kernels_are_shipped():
    # the kernels fuse.py's DiT chains and half storage launch by name, in every shipped arch
    from sdrt.gpu.cuda import naming
    from sdrt.gpu.cuda.driver import ARCHS
    from sdrt.gpu.cuda.ops.norm import RMS_ROPE_DIMS
    want = {
        "norm": ["layer_norm_mod_f32", "layer_norm_mod_f32_to_f16", "layer_norm_mod_f32_to_bf16",
                 "layer_norm_f32_to_bf16", "group_norm_apply_f32_to_bf16", "rms_norm_f32_to_f16", "rms_norm_f32_to_bf16",
                 "rms_norm_mod_f32", "rms_norm_mod_f32_to_f16", "rms_norm_mod_f32_to_bf16"]
        + [f"rms_rope_d{d}_{t}" for d in RMS_ROPE_DIMS for t in ("f32", "f32_to_f16")],
        "elementwise": ["gated_add_f32", "geglu_tanh_f32_to_bf16", "geglu_erf_bf16_to_f32", "silu_mul_f32",
                        "silu_mul_f32_to_f16", "silu_mul_f32_to_bf16"],
        "position": ["rope_pe_f32_to_f16", "rope_rotate_f32_to_f16"],
        "layout": [f"cast4d_{a}_{b}" for a, b in (("f32", "f16"), ("f32", "bf16"), ("f16", "bf16"),
                                                  ("bf16", "f16"), ("f16", "f32"), ("bf16", "f32"))],
    }
    for module, names in want.items():
        for n in names:
            assert naming.fatbin_symbols(naming.KERNELS_DIR / f"{module}.fatbin", n) >= len(ARCHS), (module, n)
