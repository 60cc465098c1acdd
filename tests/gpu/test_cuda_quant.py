"""Device weight decoding (sdrt/gpu/cuda/quant.py, kernels/quant.cu, kernels/quant_blocks.cuh).

Two layers:
- On the host (runs without a GPU, needs g++): quant_blocks.cuh compiled as plain C++
  (SDRT_HOST_TEST) must decode every block type bit for bit as the CPU decoder
  (sdrt.ops.quant.dequantize), and its compact IQ grids must expand to ggml's tables.
- On the GPU (skips without one): weight_as / dense_copy / to_dense on the device, every block
  type to F32 (bit-exact) and F16 (the F32 values rounded to nearest even, bit-exact), row-strided
  and batched views, and every float storage type converted among F32/F16/BF16 through views.
"""
import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from sdrt.ops import dtypes, quant
from sdrt.ops.convert import f32_to_raw, raw_to_f32
from sdrt.ops.tensor import Tensor

from ._helpers import quant_tensor

KERNELS = Path(__file__).resolve().parents[2] / "sdrt" / "gpu" / "cuda" / "kernels"
IQ_TABLES = Path(__file__).resolve().parents[2] / "sdrt" / "ops" / "quant" / "_iq_tables.pxi"
BLOCK_TYPES = [t.name for t in dtypes.QUANT_TYPES]
FLOAT_SOURCES = ["F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"]

HOST_DRIVER = r"""
#include "quant_blocks.cuh"
template <class B> static void deq(const uint8_t* x, long nblocks, float* y) {
    for (long b = 0; b < nblocks; ++b)
        for (int e0 = 0; e0 < B::BS; e0 += 8) B::dq8(x + b * B::TS, e0, y + (long)b * B::BS + e0);
}
extern "C" int host_dequant(const char* name, const uint8_t* x, long nblocks, float* y) {
#define X(n, B) if (!strcmp(name, #n)) { deq<B>(x, nblocks, y); return 0; }
    SDRT_BLOCK_TYPES(X)
#undef X
    return -1;
}
extern "C" void host_grids(float* o) {  // every grid entry expanded, in table order, then ksigns
    for (int i = 0; i < 256; ++i, o += 8) iq2_grid(iq2xxs_codes[i], o);
    for (int i = 0; i < 512; ++i, o += 8) iq2_grid(iq2xs_codes[i], o);
    for (int i = 0; i < 1024; ++i, o += 8) iq2_grid(iq2s_codes[i], o);
    for (int i = 0; i < 256; ++i) for (int k = 0; k < 4; ++k) *o++ = iq3xxs_byte(iq3xxs_codes[i], k);
    for (int i = 0; i < 512; ++i) for (int k = 0; k < 4; ++k) *o++ = iq3s_byte(iq3s_codes[i], k);
    for (int i = 0; i < 2048; ++i, o += 8) iq1_grid(iq1s_codes[i], o);
    for (int i = 0; i < 128; ++i) *o++ = (float)ksigns(i);
}
"""


# ---- host: the block decoders as plain C++ ------------------------------------------------------
@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the host decoder check")
    d = tmp_path_factory.mktemp("quant_blocks")
    (d / "driver.cpp").write_text(HOST_DRIVER)
    so = d / "host_blocks.so"
    # -ffp-contract=off: the CPU decoder is built so; the device code uses __fmul_rn instead
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-Wno-unknown-pragmas",
                    "-DSDRT_HOST_TEST", f"-I{KERNELS}", "-o", str(so), str(d / "driver.cpp")],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(so))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_block_decoders_on_host_match_cpu(host_lib, name):
    dt = dtypes.get(name)
    raw = quant.random_raw(name, 96, 4 * dt.block_size, seed=11)
    want = quant.dequantize(raw, dt)
    got = np.empty_like(want)
    rc = host_lib.host_dequant(name.lower().encode(), raw.ctypes.data_as(ctypes.c_void_p),
                               ctypes.c_long(raw.size // dt.type_size), got.ctypes.data_as(ctypes.c_void_p))
    assert rc == 0, f"{name} is not in SDRT_BLOCK_TYPES"
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{name}: {diff.size} values differ, first at {diff[0]}: {got.flat[diff[0]]} vs {want.flat[diff[0]]}"


def _pxi_tables() -> dict:
    src = IQ_TABLES.read_text()
    tabs = {}
    for m in re.finditer(r"static const (\w+) (\w+)\[(\d+)\] = \{(.*?)\};", src, re.S):
        _, name, n, body = m.groups()
        vals = [int(v.strip().lower().rstrip("ul"), 0) for v in body.replace("\n", " ").split(",") if v.strip()]
        assert len(vals) == int(n)
        tabs[name] = vals
    return tabs


def test_iq_grids_on_host_match_ggml_tables(host_lib):
    tabs = _pxi_tables()
    want = []
    for name, nbytes, signed in [("sdrt_iq2xxs_grid", 8, False), ("sdrt_iq2xs_grid", 8, False),
                                 ("sdrt_iq2s_grid", 8, False), ("sdrt_iq3xxs_grid", 4, False),
                                 ("sdrt_iq3s_grid", 4, False), ("sdrt_iq1s_grid", 8, True)]:
        for v in tabs[name]:
            for k in range(nbytes):
                b = (v >> (8 * k)) & 0xFF
                want.append(b - 256 if signed and b > 127 else b)
    want += tabs["sdrt_ksigns_iq2xs"]
    got = np.full(len(want), np.nan, np.float32)
    host_lib.host_grids(got.ctypes.data_as(ctypes.c_void_p))
    np.testing.assert_array_equal(got, np.array(want, np.float32))


# ---- GPU harness (the `cuda` fixture is tests/gpu/conftest.py's: the cuda0 backend, or skip) -----
class Device:
    """Upload tensors, run one decoding call, download the result (synchronously)."""

    def __init__(self, be):
        self.be, self.mem, self.rt = be, be.memory, be.rt
        self.ptrs = []

    def put(self, t: Tensor):
        from sdrt.gpu.cuda.devtensor import DevTensor
        own = t.owner.storage
        ptr = self.mem.alloc(max(own.nbytes, 1))
        self.ptrs.append(ptr)
        self.mem.upload(ptr, np.ascontiguousarray(own).view(np.uint8).reshape(-1))
        return DevTensor.of(t, ptr + t.offset)

    def get(self, ptr: int, nbytes: int) -> np.ndarray:
        host = np.empty(nbytes, np.uint8)
        self.mem.download(host, ptr)
        return host

    def close(self):
        self.mem.synchronize()
        for p in self.ptrs:
            self.mem.free(p)


@pytest.fixture
def dev(cuda):
    d = Device(cuda)
    d.rt.begin_kernel()
    yield d
    d.close()


def cpu_values(t: Tensor) -> np.ndarray:
    return raw_to_f32(np.ascontiguousarray(t.numpy()), t.dtype).reshape(t.shape)


def f16_bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint16)


# ---- GPU: dequantize every block type -------------------------------------------------------------
@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("out", ["F32", "F16"])
def test_weight_as_dequantizes_every_type(dev, name, out):
    from sdrt.gpu.cuda.quant import weight_as
    dt = dtypes.get(name)
    t = quant_tensor(name, 37, 3 * dt.block_size, seed=5)
    want = cpu_values(t)
    ptr = weight_as(dev.rt, dev.put(t), out)
    if out == "F32":
        got = dev.get(ptr, want.size * 4).view(np.float32).reshape(want.shape)
        assert same_bits(got, want), f"{name} -> F32 differs from the CPU decoder"
    else:
        got = dev.get(ptr, want.size * 2).view(np.uint16).reshape(want.shape)
        np.testing.assert_array_equal(got, f16_bits(want), err_msg=f"{name} -> F16")


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "IQ2_XXS", "IQ4_XS", "MXFP4", "TQ1_0"])
def test_dequant_of_row_strided_and_batched_views(dev, name):
    from sdrt.gpu.cuda.quant import dense_copy
    dt = dtypes.get(name)
    t = quant_tensor(name, 12, 2 * dt.block_size, batch=(2, 3), seed=9)
    views = [t,                                # contiguous, 4-D
             t.slice(1, 1, 11, 3),             # every third row: strided rows
             t.slice(2, 1, 3),                 # a batch slice
             t.permute(0, 2, 1, 3)]            # rows and batches swapped
    for v in views:
        want = cpu_values(v)
        for out, es in (("F32", 4), ("F16", 2)):
            ptr = dense_copy(dev.rt, dev.put(v), out)
            got = dev.get(ptr, want.size * es)
            if out == "F32":
                assert same_bits(got.view(np.float32).reshape(want.shape), want), f"{name} view ne={v.ne} nb={v.nb}"
            else:
                np.testing.assert_array_equal(got.view(np.uint16).reshape(want.shape), f16_bits(want))


def test_weight_as_returns_a_dense_weight_in_place(dev, rng):
    from sdrt.gpu.cuda.quant import weight_as
    for dt in ("F16", "F32"):
        t = Tensor.from_numpy(f32_to_raw(rng.standard_normal((5, 64)).astype(np.float32), dt), dtype=dt)
        w = dev.put(t)
        assert weight_as(dev.rt, w, dt) == w.ptr
    t = Tensor.from_numpy(rng.standard_normal((8, 64)).astype(np.float32)).slice(1, 0, 8, 2)  # strided rows
    w = dev.put(t)
    ptr = weight_as(dev.rt, w, "F32")
    assert ptr != w.ptr
    np.testing.assert_array_equal(dev.get(ptr, 4 * 64 * 4).view(np.float32).reshape(4, 64), cpu_values(t))


def test_weight_as_rejects_other_dtypes(dev):
    from sdrt.errors import UnsupportedError
    from sdrt.gpu.cuda.quant import weight_as
    w = dev.put(quant_tensor("Q8_0", 2, 32))
    with pytest.raises(UnsupportedError):
        weight_as(dev.rt, w, "BF16")
    w = dev.put(Tensor.from_numpy(np.zeros((2, 4), np.float64)))
    with pytest.raises(UnsupportedError):
        weight_as(dev.rt, w, "F32")


# ---- GPU: float storage types ----------------------------------------------------------------------
def float_tensor(rng, name, shape):
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x.flat[:4] = [0.0, -0.0, 1e-6, -3e-5]  # zeros and (F16/F8) subnormals
    return Tensor.from_numpy(f32_to_raw(x, name), dtype=name)


@pytest.mark.parametrize("src", FLOAT_SOURCES)
@pytest.mark.parametrize("out", ["F32", "F16", "BF16"])
def test_convert_float_types_through_views(dev, rng, src, out):
    from sdrt.gpu.cuda.quant import dense_copy
    t = float_tensor(rng, src, (3, 4, 5, 6))
    for v in (t, t.transpose(), t.permute(2, 0, 3, 1), t.slice(0, 1, 6, 2)):
        want = f32_to_raw(cpu_values(v), out)
        es = 4 if out == "F32" else 2
        got = dev.get(dense_copy(dev.rt, dev.put(v), out), want.size * es)
        np.testing.assert_array_equal(got.view(want.dtype).reshape(want.shape).view(f"u{es}"),
                                      want.view(f"u{es}"), err_msg=f"{src} view ne={v.ne} -> {out}")


def test_f8_e4m3_every_code(dev):
    from sdrt.gpu.cuda.quant import dense_copy
    t = Tensor.from_numpy(np.arange(256, dtype=np.uint8), dtype="F8_E4M3")
    want = cpu_values(t)
    got = dev.get(dense_copy(dev.rt, dev.put(t), "F32"), 256 * 4).view(np.float32)
    np.testing.assert_array_equal(got, want)  # NaN codes compare equal as NaN
