"""The CUDA runtime and backend on a real GPU (skips without one): allocator, copies, rt.cast,
rt.fill, rt.gemm against numpy, graphs through Graph.run("cuda0") against the CPU backend, CUDA
graph capture and replay, weights vs inputs, a residency object."""
import numpy as np
import pytest

from sdrt.errors import DeviceOutOfMemoryError, UnsupportedError
from sdrt.ops import api as F
from sdrt.ops.convert import f32_to_raw, raw_to_f32
from sdrt.ops.graph import Graph, mark_cut
from sdrt.ops.tensor import Tensor


# ---- helpers -------------------------------------------------------------------------------
def to_device(be, arr: np.ndarray) -> int:
    ptr = be.memory.alloc(arr.nbytes)
    be.memory.upload(ptr, np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    return ptr


def from_device(be, ptr: int, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    be.memory.download(out.reshape(-1).view(np.uint8), ptr)
    return out


def weight(a: np.ndarray, dtype=None) -> Tensor:
    """A read-only leaf (how model files come in): the backend caches it on the device."""
    a = np.array(a)
    a.flags.writeable = False
    return Tensor.from_numpy(a, dtype)


def require_kernels(be, graph):
    missing = [f"{n.op}({', '.join(s.dtype.name for s in n.src)})" for n in graph.nodes if be.find(n) is None]
    if missing:
        pytest.skip(f"no CUDA kernel yet for {', '.join(missing)}")


# ---- allocator, memory -----------------------------------------------------------------------
def test_allocator_reuse_and_stats(cuda):
    al = cuda.device.allocator
    al.empty_cache()
    s0 = al.stats()
    assert s0["cached"] == 0
    p = cuda.memory.alloc(1000)
    s1 = al.stats()
    assert s1["in_use"] == s0["in_use"] + al.round_size(1000) == s0["in_use"] + 1024
    assert s1["peak"] >= s1["in_use"] and s1["allocations"] == s0["allocations"] + 1
    cuda.memory.free(p)
    s2 = al.stats()
    assert s2["in_use"] == s0["in_use"] and s2["cached"] == 1024
    q = cuda.memory.alloc(900)                     # same size class: the cached block comes back
    assert q == p and al.stats()["allocations"] == s1["allocations"]
    r = cuda.memory.alloc(5000)                    # another class: a new block
    assert r != p and al.stats()["allocations"] == s1["allocations"] + 1
    cuda.memory.free(q)
    cuda.memory.free(r)
    assert al.stats()["cached"] == 1024 + al.round_size(5000)
    cuda.memory.empty_cache()
    assert al.stats()["cached"] == 0 and al.stats()["in_use"] == s0["in_use"]
    with pytest.raises(ValueError):
        cuda.memory.free(r)                        # not handed out any more


def test_out_of_memory_and_mem_info(cuda):
    free, total = cuda.memory.mem_get_info()
    assert 0 < free <= total
    with pytest.raises(DeviceOutOfMemoryError, match="out of memory"):
        cuda.memory.alloc(2 * total)


@pytest.mark.parametrize("nbytes", [1, 4097, (70 << 20) + 3])   # the last spans three staging chunks
@pytest.mark.parametrize("stream", ["compute", "copy"])
def test_upload_download_round_trip(cuda, rng, nbytes, stream):
    host = rng.integers(0, 256, nbytes, dtype=np.uint8)
    ptr = cuda.memory.alloc(nbytes)
    try:
        ev = cuda.memory.upload(ptr, host, stream)
        cuda.memory.wait(ev, "compute")
        back = np.zeros_like(host)
        cuda.memory.download(back, ptr)
        assert np.array_equal(back, host)
    finally:
        cuda.memory.free(ptr)


# ---- rt.cast, rt.fill ------------------------------------------------------------------------
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 1e-8, -3e-5, 1 + 2**-8, 1 + 3 * 2**-8,
                    3.0e38, -1.0e-40, np.nan], np.float32)


def cast_input(rng, n):
    x = (rng.standard_normal(n) * 300).astype(np.float32)
    x[: len(SPECIAL)] = SPECIAL
    return x


@pytest.mark.parametrize("src,dst", [("F32", "F16"), ("F32", "BF16"), ("F16", "F32"), ("BF16", "F32"),
                                     ("F16", "BF16"), ("BF16", "F16"), ("F32", "F32")])
def test_rt_cast_matches_cpu_conversion(cuda, rng, src, dst):
    n = 100_003
    x = f32_to_raw(cast_input(rng, n), src)            # raw source storage
    want = f32_to_raw(raw_to_f32(x, src), dst)         # the CPU's conversion
    a = to_device(cuda, x)
    b = cuda.memory.alloc(want.nbytes)
    try:
        cuda.rt.cast(b, dst, a, src, n)
        got = from_device(cuda, b, want)
    finally:
        cuda.memory.free(a)
        cuda.memory.free(b)
    bits = np.uint16 if dst != "F32" else np.uint32     # bit for bit, NaN payloads too
    g, w = got.view(bits), want.view(bits)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{bad.size} differ, first at {bad[:5]}: got {g[bad[:5]]}, want {w[bad[:5]]}"


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_rt_fill(cuda, dtype):
    n = 12_345
    want = f32_to_raw(np.full(n, 0.1, np.float32), dtype)
    p = cuda.memory.alloc(want.nbytes)
    try:
        cuda.rt.fill(p, dtype, 0.1, n)
        assert np.array_equal(from_device(cuda, p, want), want)
    finally:
        cuda.memory.free(p)


# ---- rt.gemm ---------------------------------------------------------------------------------
TOL = {("F32", "F32"): 2e-5, ("F16", "F32"): 2e-5, ("BF16", "F32"): 2e-5, ("F16", "F16"): 2e-3,
       ("BF16", "BF16"): 1e-2}


@pytest.mark.parametrize("dtype,c_dtype", list(TOL))
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("batch", [1, 3])
def test_rt_gemm_matches_numpy(cuda, rng, dtype, c_dtype, trans_a, trans_b, batch):
    """Row-major C[M,N] = A[M,K] B[K,N] through the column-major cuBLAS call; A/B stored transposed
    when trans_a/trans_b (weights are stored [out, in])."""
    M, N, K = 37, 53, 71
    A = raw_to_f32(f32_to_raw(rng.standard_normal((batch, M, K)).astype(np.float32), dtype), dtype)
    B = raw_to_f32(f32_to_raw(rng.standard_normal((batch, K, N)).astype(np.float32), dtype), dtype)
    ref = np.einsum("bmk,bkn->bmn", A.astype(np.float64), B.astype(np.float64))
    a_store = np.ascontiguousarray(A.transpose(0, 2, 1) if trans_a else A)
    b_store = np.ascontiguousarray(B.transpose(0, 2, 1) if trans_b else B)
    pa, pb = to_device(cuda, f32_to_raw(a_store, dtype)), to_device(cuda, f32_to_raw(b_store, dtype))
    like = f32_to_raw(np.zeros((batch, M, N), np.float32), c_dtype)
    pc = cuda.memory.alloc(like.nbytes)
    try:
        cuda.rt.gemm(trans_b, trans_a, N, M, K, pb, dtype, K if trans_b else N, pa, dtype, M if trans_a else K,
                     pc, N, c_dtype=c_dtype, batch=batch, stride_a=K * N, stride_b=M * K, stride_c=M * N)
        got = raw_to_f32(from_device(cuda, pc, like), c_dtype)
    finally:
        for p in (pa, pb, pc):
            cuda.memory.free(p)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < TOL[(dtype, c_dtype)], err


def test_rt_gemm_alpha_beta_and_tf32(cuda, rng):
    M, N, K = 64, 48, 96
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    pa, pb, pc = to_device(cuda, A), to_device(cuda, B), to_device(cuda, C0)
    try:
        cuda.rt.gemm(False, False, N, M, K, pb, "F32", N, pa, "F32", K, pc, N, alpha=0.5, beta=2.0)
        got = from_device(cuda, pc, C0)
        want = 0.5 * (A.astype(np.float64) @ B) + 2.0 * C0
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
        cuda.rt.gemm(False, False, N, M, K, pb, "F32", N, pa, "F32", K, pc, N, allow_tf32=True)
        got = from_device(cuda, pc, C0)
        assert np.abs(got - A.astype(np.float64) @ B).max() < 1e-2 * np.abs(A @ B).max()
    finally:
        for p in (pa, pb, pc):
            cuda.memory.free(p)
    with pytest.raises(UnsupportedError, match="cast first"):
        cuda.rt.gemm(False, False, N, M, K, pb, "F16", N, pa, "F32", K, pc, N)


# ---- graphs ----------------------------------------------------------------------------------
def assert_close_to_cpu(gpu_out, cpu_out, rtol=1e-4):
    for name, t in cpu_out.items():
        want, got = t.to_f32(), gpu_out[name].to_f32()
        assert got.shape == want.shape, name
        scale = max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() <= rtol * scale, (name, np.abs(got - want).max())


def small_graph(rng, holder):
    """An input holder -> F16 mul_mat with a bias -> cut -> views of computed nodes, a cast."""
    x = Tensor.from_numpy(holder)                                       # writeable: an input
    w = weight(rng.standard_normal((40, 32)).astype(np.float16))        # ne [32, 40]
    b = weight(rng.standard_normal(40).astype(np.float32))
    y = mark_cut(F.add(F.mul_mat(w, x), b), "first")                    # F32 ne [40, 5, 3]
    z = F.cast(F.scale(y.transpose(), 0.5), "F16")                      # a view of a computed node
    return Graph({"y": y, "z": z})


def test_graph_run_matches_cpu(cuda, rng):
    holder = np.empty((3, 5, 32), np.float32)
    g = small_graph(rng, holder)
    require_kernels(cuda, g)
    holder[...] = rng.standard_normal(holder.shape)
    out = g.run(cuda)
    assert_close_to_cpu(out, g.run("cpu"), rtol=2e-3)                 # z is F16
    assert set(out) == {"y", "z"} and out["y"].ne == (40, 5, 3) and out["z"].dtype.name == "F16"


def test_cuda_graph_replay_with_changing_inputs(cuda, rng, monkeypatch):
    """Run 1 eager, run 2 captures, runs 3-4 replay: every run follows its inputs, and the replay
    of run 1's inputs gives run 1's bits."""
    monkeypatch.setenv("SDRT_CUDA_GRAPHS", "1")
    monkeypatch.delenv("SDRT_DEBUG", raising=False)
    holder = np.empty((3, 5, 32), np.float32)
    g = small_graph(rng, holder)
    require_kernels(cuda, g)
    inputs = [rng.standard_normal(holder.shape).astype(np.float32) for _ in range(3)]
    inputs.append(inputs[0])
    got = []
    for k, a in enumerate(inputs):
        holder[...] = a
        out = g.run(cuda)
        got.append({n: np.array(t.numpy(), copy=True) for n, t in out.items()})
        assert_close_to_cpu(out, g.run("cpu"), rtol=2e-3)
        if k == 0:
            assert cuda._states[g].captured is None
    state = cuda._states[g]
    assert state.captured is not None and state.captured.nodes >= 4 and state.runs == 4
    for n in got[0]:
        assert np.array_equal(got[0][n], got[3][n]), n
        assert not np.array_equal(got[0][n], got[1][n]), n


def test_graphs_off_stays_eager(cuda, rng, monkeypatch):
    monkeypatch.setenv("SDRT_CUDA_GRAPHS", "0")
    holder = np.empty((3, 5, 32), np.float32)
    g = small_graph(rng, holder)
    require_kernels(cuda, g)
    for _ in range(3):
        holder[...] = rng.standard_normal(holder.shape)
        assert_close_to_cpu(g.run(cuda), g.run("cpu"), rtol=2e-3)
    assert cuda._states[g].captured is None


def test_registered_weights_and_refresh(cuda, rng):
    """A writeable leaf is an input unless registered; a registered one is cached, and
    refresh_weights brings in-place host changes to the device copy (replays too)."""
    wa = rng.standard_normal((24, 16)).astype(np.float32)
    w = Tensor.from_numpy(wa)
    x = weight(rng.standard_normal((2, 16)).astype(np.float32))
    assert cuda.is_input(w)
    cuda.register_weights([w])
    assert not cuda.is_input(w)
    g = Graph({"y": F.mul_mat(w, x)})
    require_kernels(cuda, g)
    first = g.run(cuda)["y"].to_f32()
    wa *= 2.0                                   # in place: the device copy is stale until refreshed
    assert np.allclose(g.run(cuda)["y"].to_f32(), first, rtol=1e-5)
    assert cuda.refresh_weights([w]) == wa.nbytes
    for _ in range(2):                          # eager/capture, then replay
        assert_close_to_cpu(g.run(cuda), g.run("cpu"))


class FakeResidency:
    """The residency contract, minimally: places every read-only leaf itself through be.memory."""

    def __init__(self, memory):
        self.memory, self.ptrs, self.calls = memory, {}, []

    def manages(self, leaf):
        return not leaf.owner.storage.flags.writeable

    def begin_segment(self, index, name, leaves):
        self.calls.append(("begin", index, name))
        for t in leaves:
            o = t.owner
            if self.manages(o) and id(o) not in self.ptrs:
                p = self.memory.alloc(o.span_bytes())
                ev = self.memory.upload(p, o.storage[o.offset:o.offset + o.span_bytes()], "copy")
                self.memory.wait(ev, "compute")
                self.ptrs[id(o)] = (p, o)

    def device_ptr(self, leaf):
        p, o = self.ptrs[id(leaf.owner)]
        return p + (leaf.offset - o.offset)

    def end_segment(self, index):
        self.calls.append(("end", index))

    def begin_graph(self, plan, extra_bytes=0):
        return True          # no budget: every graph may run

    def make_room(self, nbytes):
        return 0             # holds nothing it could drop

    def close(self):
        for p, _ in self.ptrs.values():
            self.memory.free(p)


def test_residency_object_places_weights(cuda, rng):
    holder = np.empty((3, 5, 32), np.float32)
    g = small_graph(rng, holder)
    require_kernels(cuda, g)
    res = FakeResidency(cuda.memory)
    try:
        for _ in range(2):
            holder[...] = rng.standard_normal(holder.shape)
            assert_close_to_cpu(g.run(cuda, residency=res), g.run("cpu"), rtol=2e-3)
        assert res.calls[:4] == [("begin", 0, "first"), ("end", 0), ("begin", 1, None), ("end", 1)]
        assert len(res.ptrs) == 2 and cuda._states[g].captured is None    # weights may move: eager
    finally:
        res.close()


def test_missing_kernel_names_op_and_dtypes(cuda):
    x = Tensor.from_numpy(np.ones((2, 64), np.float32))
    node = F.cast(x, "Q8_0")
    if cuda.find(node) is not None:
        pytest.skip("the CUDA backend quantizes now; no missing kernel to show")
    with pytest.raises(UnsupportedError, match=r"cuda0.*cast\(F32\) -> Q8_0"):
        Graph(node).run(cuda)


def test_runs_from_worker_threads(cuda, rng):
    """A server thread runs graphs and ends; the context it pushed is popped as it ends (pycuda
    would abort the process otherwise) and the main thread carries on."""
    import threading
    holder = np.empty((3, 5, 32), np.float32)
    g = small_graph(rng, holder)
    require_kernels(cuda, g)
    holder[...] = rng.standard_normal(holder.shape)
    want = g.run("cpu")
    results, errors = [], []

    def work():
        try:
            for _ in range(3):
                results.append(g.run(cuda))
        except Exception as e:  # reported below: pytest does not see a thread's exceptions
            errors.append(e)

    for _ in range(2):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert not errors, errors
    for out in results:
        assert_close_to_cpu(out, want, rtol=2e-3)
    assert_close_to_cpu(g.run(cuda), want, rtol=2e-3)


def test_upload_ahead_beside_runs(cuda, rng):
    """The diffusion model's weights uploaded from the backend's own thread while the main thread
    runs a graph (the text encoder's): both graphs match the CPU, the run's weights are its own
    first-use uploads, release_weights(keep=...) keeps the ones sent ahead, and preload_weights
    then uploads only what did not fit the ahead budget."""
    holder = np.empty((3, 5, 32), np.float32)
    te = small_graph(rng, holder)
    require_kernels(cuda, te)
    big = [weight(rng.standard_normal((2560, 2048 + 64 * i)).astype(np.float16)) for i in range(3)]  # 10-11 MB
    unet = Graph({f"y{i}": F.mul_mat(w, Tensor.from_numpy(rng.standard_normal((2, 2048 + 64 * i)).astype(np.float32)))
                  for i, w in enumerate(big)})
    room = big[0].nbytes + big[1].nbytes
    cuda.upload_ahead(big, room)
    for _ in range(3):
        holder[...] = rng.standard_normal(holder.shape)
        assert_close_to_cpu(te.run(cuda), te.run("cpu"), rtol=2e-3)
    cuda.release_weights(keep=big)                       # the text encoder's stage ends: all else goes
    assert cuda.last_ahead[0] == room and cuda.weight_bytes() == room
    assert cuda.preload_weights(big) == big[2].nbytes
    assert_close_to_cpu(unet.run(cuda), unet.run("cpu"), rtol=2e-3)
    cuda.release_weights(big)
    assert cuda.weight_bytes() == 0


def test_a_run_reads_its_own_weights_while_they_upload_ahead(cuda, rng):
    """The text encoders' weights go ahead first, so a run may read a weight the thread has
    claimed: it waits for that weight's copy (not the whole job) and matches the CPU."""
    holder = np.empty((3, 5, 32), np.float32)
    x = Tensor.from_numpy(holder)
    w = weight(rng.standard_normal((2560, 32)).astype(np.float16))
    b = weight(rng.standard_normal(2560).astype(np.float32))
    g = Graph({"y": F.add(F.mul_mat(w, x), b)})
    require_kernels(cuda, g)
    big = [weight(rng.standard_normal((2560, 2048)).astype(np.float16)) for _ in range(4)]      # 10 MB each
    cuda.upload_ahead([w, b] + big, w.nbytes + b.nbytes + 2 * big[0].nbytes)
    holder[...] = rng.standard_normal(holder.shape)
    assert_close_to_cpu(g.run(cuda), g.run("cpu"), rtol=2e-3)
    cuda.release_weights(keep=big)
    # (the run may have claimed w or b before the thread: then it uploaded them itself)
    assert 2 * big[0].nbytes <= cuda.last_ahead[0] <= w.nbytes + b.nbytes + 2 * big[0].nbytes
    assert cuda.weight_bytes() == 2 * big[0].nbytes
    cuda.release_weights()
    assert cuda.weight_bytes() == 0


def test_gemm_warm_up_replays_the_shapes_kept_by_earlier_runs(cuda, rng, tmp_path, monkeypatch, caplog):
    """The GEMM shapes a run met go to the cache file; a warm-up thread (as a later process's
    backend starts one unless SDRT_GEMM_WARMUP=0) replays them on its own stream and handles, and
    the runs after it still match the CPU."""
    from sdrt.gpu.cuda import backend as B
    from sdrt.gpu.cuda.cublas import load_shapes, shapes_file
    monkeypatch.setenv("SDRT_CUDA_CACHE", str(tmp_path))
    holder = np.empty((3, 5, 32), np.float32)
    g = small_graph(rng, holder)
    require_kernels(cuda, g)
    holder[...] = rng.standard_normal(holder.shape)
    want = g.run("cpu")
    assert_close_to_cpu(g.run(cuda), want, rtol=2e-3)
    key, cuda._gemm_key, cuda._shapes_saved = "test 32x5", None, 0
    cuda.expect_gemm_shapes(key)
    cuda._save_gemm_shapes()
    kept = load_shapes(shapes_file(tmp_path, cuda.device.info.arch, cuda.rt.cublas.version), key)
    assert kept and set(kept) <= set(cuda.rt.cublas.seen)
    with caplog.at_level("DEBUG", logger="sdrt.cuda"):
        job = B._GemmWarmUp(cuda, key)     # as expect_gemm_shapes starts it when on
        job.thread.join(60)
    assert "GEMM shapes of earlier runs replayed ahead" in caplog.text and "warm-up stopped" not in caplog.text
    assert_close_to_cpu(g.run(cuda), want, rtol=2e-3)
