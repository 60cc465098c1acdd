"""CUDA graphs by stream capture, through ctypes on libcuda.so.1 (PyCUDA has no graph API).

Everything enqueued on a stream between `begin` and `end` — PyCUDA `_launch_kernel` calls,
cuBLAS GEMMs (with a preset workspace), async copies from pinned host memory — becomes one
graph that `launch` replays with a single driver call. Rules while capturing: no device
allocation, no synchronisation, no copies from pageable host memory.
"""
from __future__ import annotations

import ctypes
import time
from ctypes import c_size_t, c_void_p

from .driver import CudaDriverError, check, error_name, libcuda

CAPTURE_MODE_RELAXED = 2   # CU_STREAM_CAPTURE_MODE_RELAXED: other threads may keep using CUDA


class CapturedGraph:
    """An instantiated CUDA graph (cuGraphExec) and the graph it came from."""

    def __init__(self, device, graph: int, nodes: int, capture_s: float):
        self.device, self.nodes, self.capture_s = device, nodes, capture_s
        self._graph = graph
        exe = c_void_p()
        t0 = time.perf_counter()
        res = libcuda().cuGraphInstantiateWithFlags(ctypes.byref(exe), c_void_p(graph), 0)
        if res != 0:
            libcuda().cuGraphDestroy(c_void_p(graph))
            check(res, "cuGraphInstantiateWithFlags")
        self.instantiate_s = time.perf_counter() - t0
        self._exec = exe.value

    def launch(self, stream) -> None:
        check(libcuda().cuGraphLaunch(c_void_p(self._exec), c_void_p(stream.handle)), "cuGraphLaunch")

    def destroy(self) -> None:
        """Free the graph (deferred to a thread where the context is current)."""
        exe, graph, self._exec, self._graph = self._exec, self._graph, None, None
        if exe is None:
            return
        lib = libcuda()

        def free():
            lib.cuGraphExecDestroy(c_void_p(exe))
            lib.cuGraphDestroy(c_void_p(graph))
        self.device.defer(free)

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass


def is_capturing(stream) -> bool:
    status = ctypes.c_int()
    check(libcuda().cuStreamIsCapturing(c_void_p(stream.handle), ctypes.byref(status)), "cuStreamIsCapturing")
    return status.value != 0


def capture(device, stream, enqueue) -> CapturedGraph:
    """Run `enqueue()` with `stream` capturing and return the instantiated graph. If `enqueue`
    raises, capture is ended, the partial graph dropped and the error re-raised."""
    lib = libcuda()
    h = c_void_p(stream.handle)
    check(lib.cuStreamBeginCapture_v2(h, CAPTURE_MODE_RELAXED), "cuStreamBeginCapture")
    device.capturing = True
    t0 = time.perf_counter()
    graph = c_void_p()
    try:
        enqueue()
    except BaseException:
        device.capturing = False
        if lib.cuStreamEndCapture(h, ctypes.byref(graph)) == 0 and graph.value:
            lib.cuGraphDestroy(graph)
        raise
    device.capturing = False
    res = lib.cuStreamEndCapture(h, ctypes.byref(graph))
    if res != 0:
        raise CudaDriverError(f"cuStreamEndCapture failed: the captured work used something capture does "
                              f"not allow ({error_name(res)})")
    n = c_size_t()
    lib.cuGraphGetNodes(graph, None, ctypes.byref(n))
    return CapturedGraph(device, graph.value, n.value, time.perf_counter() - t0)

