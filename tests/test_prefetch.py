"""Read-ahead of mapped weights (sdrt.engine.prefetch): the ranges it hands the kernel are the
tensors' bytes in the file, and it never reads ahead more than the memory budget allows."""
import mmap
import os
import threading

import numpy as np

from sdrt.engine import prefetch
from sdrt.io import open_model
from sdrt.io.writer import write_gguf


def _file(tmp_path):
    rng = np.random.default_rng(0)
    arrs = {f"t{i}": rng.standard_normal((i + 3, 64)).astype(np.float32) for i in range(5)}
    p = str(tmp_path / "w.gguf")
    write_gguf(p, arrs)
    return p, arrs, open_model(p)


def test_ranges_cover_the_tensors_bytes(tmp_path):
    p, arrs, mf = _file(tmp_path)
    ranges = prefetch.file_ranges(list(mf.tensors.values()))
    assert ranges and all(path == os.path.abspath(p) for path, _, _ in ranges)
    data = open(p, "rb").read()
    covered = np.zeros(len(data), bool)
    for _, lo, hi in ranges:
        covered[lo:hi] = True
    for name, a in arrs.items():          # every tensor's bytes lie in a range
        off = data.find(a.tobytes())
        assert off >= 0 and covered[off:off + a.nbytes].all(), name
    assert covered.sum() < len(data)      # the header is not read ahead


def test_ram_tensors_have_no_ranges():
    from sdrt.ops.tensor import Tensor
    assert prefetch.file_ranges([Tensor.from_numpy(np.ones((4, 4), np.float32))]) == []


def test_budget_stops_read_ahead(tmp_path, monkeypatch):
    _, _, mf = _file(tmp_path)
    ranges = prefetch.file_ranges(list(mf.tensors.values()))
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: calls.append((off, n)))
    prefetch._read_ahead([("te", ranges)], budget=1, stop=threading.Event())
    assert calls == []                    # over budget: left to page faults
    prefetch._read_ahead([("te", ranges), ("vae", ranges)], budget=sum(h - lo for _, lo, h in ranges),
                         stop=threading.Event())
    assert sum(n for _, n in calls) == sum(h - lo for _, lo, h in ranges)   # the first group only


def test_off_switch(monkeypatch, tmp_path):
    _, _, mf = _file(tmp_path)
    monkeypatch.setenv("SDRT_PREFETCH", "0")
    assert prefetch.start_read_ahead([("te", list(mf.tensors.values()))]) is None
    monkeypatch.setenv("SDRT_PREFETCH", "1")
    ev = prefetch.start_read_ahead([("te", list(mf.tensors.values()))])
    assert ev is not None
    ev.set()


def test_token_tables_are_left_to_page_faults():
    """The text encoders' token embedding tables are read by row lookup: not read ahead."""
    for n in ("text_encoders.llm.model.embed_tokens.weight", "cond_stage_model.transformer.text_model.embeddings."
              "token_embedding.weight", "text_encoders.t5xxl.transformer.shared.weight", "token_embd.weight"):
        assert prefetch.read_by_rows(n), n
    for n in ("text_encoders.llm.model.layers.0.mlp.up_proj.weight", "model.diffusion_model.x_embedder.weight",
              "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight"):
        assert not prefetch.read_by_rows(n), n


def _resident_pages(lo, hi):
    """How many pages of [lo, hi) are in this process's page tables (mincore of the mapping is the
    page cache's view; /proc/self/pagemap's present bit is the page tables')."""
    page = mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // page * 8)
        entries = np.frombuffer(f.read((hi - lo) // page * 8), np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


def test_populate_enters_a_gpu_components_pages_into_the_page_tables(tmp_path):
    """A component uploaded to a GPU gets its mapped pages populated (MADV_POPULATE_READ): the
    ranges are page-aligned and cover every tensor, and after the read-ahead the pages are
    present in the page tables, where a fresh map has none."""
    p = str(tmp_path / "big.gguf")
    rng = np.random.default_rng(0)
    arrs = {f"t{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(4)}   # 4 MiB
    write_gguf(p, arrs)
    mf = open_model(p)
    ts = list(mf.tensors.values())
    ranges = prefetch.address_ranges(ts)
    page = mmap.PAGESIZE
    assert ranges and all(lo % page == 0 and hi % page == 0 and lo < hi for lo, hi in ranges)
    for t in ts:
        a = t.owner.storage.ctypes.data + t.owner.offset
        assert any(lo <= a and a + t.owner.span_bytes() <= hi for lo, hi in ranges)
    lo, hi = ranges[0]
    before = _resident_pages(lo, hi)
    if not prefetch._populate(ranges, threading.Event()):
        import pytest
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    assert before < (hi - lo) // page and _resident_pages(lo, hi) == (hi - lo) // page
    for name, t in mf.tensors.items():                    # the bytes are the file's, unchanged
        np.testing.assert_array_equal(np.asarray(t.owner.storage[t.owner.offset:t.owner.offset + arrs[name].nbytes])
                                      .view(np.float32).reshape(arrs[name].shape), arrs[name])


def test_gpu_components_are_populated_and_cpu_ones_read_into_the_page_cache(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from sdrt.engine.stage_weights import StageWeights
    _, _, mf = _file(tmp_path)
    got = []
    monkeypatch.setattr(prefetch, "start_read_ahead", lambda groups, populate=(): got.append(
        ([c for c, _ in groups], set(populate))))
    monkeypatch.setattr("sdrt.engine.placement.classify_tensor", lambda name: "te" if name in ("t0", "t1") else "vae")
    pipe = StageWeights()
    pipe.models = SimpleNamespace(tensors=mf.tensors)
    pipe.executors = {"te": "cuda0", "vae": "cpu", "diffusion": SimpleNamespace(name="cuda0")}
    pipe.read_ahead_weights("te", "diffusion", "vae")
    assert got == [(["te", "vae"], {"te"})]     # a residency manager's component: neither
