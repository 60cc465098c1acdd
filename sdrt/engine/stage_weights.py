"""Where each stage's weights are, stage by stage: read ahead into the page cache before a CPU
stage, uploaded to a GPU before its first step, freed from a GPU after its stage (a one-shot run),
their file pages dropped after a CPU stage. The Pipeline's methods for these (a mixin over its
`models`, `executors` and `one_shot`)."""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("sdrt")


class StageWeights:
    """Mixin of Pipeline: `models` (the loaded weights, or None), `executors` ({component: "cpu",
    a device name, or a residency manager}) and `one_shot` come from it."""

    def read_ahead_weights(self, *components: str):
        """Start reading the mapped weights of `components` (in this order) ahead on a background
        thread (sdrt.engine.prefetch): into the page cache for a CPU stage, into this process's
        page tables for a GPU keeping its weights (their upload copies them out of the map);
        returns its stop Event, or None."""
        if self.models is None:
            return None
        from .placement import classify_tensor
        from .prefetch import read_by_rows, start_read_ahead
        gpu = {c for cs in self._gpus_keeping_weights(components).values() for c in cs}
        want = [c for c in components if self.executors.get(c, "cpu") == "cpu" or c in gpu]
        groups: dict[str, list] = {c: [] for c in want}
        for name, t in self.models.tensors.items():
            c = classify_tensor(name)
            if c in groups and not read_by_rows(name):
                groups[c].append(t)
        return start_read_ahead([(c, ts) for c, ts in groups.items() if ts], populate=gpu)

    def upload_device_weights(self, *components: str) -> int:
        """Upload the weights of `components` that compute on a GPU keeping its weights there (no
        residency manager) before their model first runs, as sd-cli does at load: the first step
        of the sampling loop then costs what the others do. Left out, for their first use: the
        parts of split diffusers tensors (the model joins them into new tensors) and the weights
        with a run-time LoRA (the model may multiply by a folded copy). Waits for what
        upload_weights_ahead started. Returns the bytes uploaded."""
        from ..ops.backend import get_backend
        total, names = 0, self._gpus_keeping_weights(components)
        for dev, ts in self._device_weight_tensors(components).items():
            be = get_backend(dev)
            staging = getattr(getattr(be, "memory", None), "staging_times", None)
            t0, before = time.time(), staging() if staging else None
            n = be.preload_weights(ts)
            ahead = self._sent_ahead().pop(dev, None) is not None and getattr(be, "last_ahead", None)
            if n or ahead:
                how = ""
                if before is not None:      # where the host's time went (the CUDA backend's staging ring)
                    after = staging()
                    how = f" (host copies {after[0] - before[0]:.2f}s, waits for the DMA {after[1] - before[1]:.2f}s)"
                if ahead:
                    how += (f"; {ahead[0] / 2**20:.1f} MB uploaded ahead (the text encoders' weights, then "
                            f"these) in {ahead[1]:.2f}s")
                log.info("%s weights uploaded to %s: %.1f MB in %.2fs%s", "/".join(names[dev]), dev, n / 2**20,
                         time.time() - t0, how)
            total += n
        return total

    def upload_weights_ahead(self, components, beside) -> None:
        """Before the stage of `beside` (the text encoders) starts, let each GPU keeping its
        weights upload on a thread of the backend's own (upload_ahead) first the weights of
        `beside`, which their first run then finds on the device instead of uploading them one by
        one between its launches, then those of `components` (the diffusion model), beside that
        run, whose time is mostly the host's. Of `components`, at most their bytes less those of
        `beside` on that device go ahead: the device then never holds more weights than the
        larger stage does, and the process peak stays that stage's. SDRT_UPLOAD_AHEAD=0: none."""
        if os.environ.get("SDRT_UPLOAD_AHEAD", "1") == "0":
            return
        from ..ops.backend import get_backend
        first, later = self._device_weight_tensors(beside), self._device_weight_tensors(components)
        for dev in {**first, **later}:
            mine, theirs = first.get(dev, []), later.get(dev, [])
            size = sum(t.owner.span_bytes() for t in mine)
            room = sum(t.owner.span_bytes() for t in theirs) - size
            ahead = theirs if room > 0 else []
            if mine or ahead:
                get_backend(dev).upload_ahead(mine + ahead, size + max(room, 0))
                self._sent_ahead()[dev] = ahead

    def name_device_runs(self, key: str) -> None:
        """Tell each GPU this pipeline computes on what runs next (`key`: the model version and
        image size), so that a backend keeping the GEMM shapes of earlier processes per key replays
        that key's before the first runs reach them (CudaBackend.expect_gemm_shapes)."""
        from ..ops.backend import made_backend
        for e in self.executors.values():
            be = made_backend(getattr(e, "backend", e))     # a PlacedBackend's, or a device's name
            expect = getattr(be, "expect_gemm_shapes", None)
            if expect is not None:
                expect(key)

    def _sent_ahead(self) -> dict:
        """{device: the tensors upload_weights_ahead sent there, until upload_device_weights}."""
        return self.__dict__.setdefault("_ahead_tensors", {})

    def _device_weight_tensors(self, components) -> dict[str, list]:
        """{device: the tensors upload_device_weights uploads} for the `components` computing on
        GPUs that keep their weights."""
        groups = self._gpus_keeping_weights(components) if self.models is not None else {}
        if not groups:
            return {}
        from ..models.common import RUNTIME_LORA
        from ..models.names import split_part_names
        from .placement import classify_tensor
        skip = split_part_names(self.models.tensors)
        return {dev: [t for n, t in self.models.tensors.items()
                      if classify_tensor(n) in comps and n not in skip and t not in RUNTIME_LORA]
                for dev, comps in groups.items()}

    def release_device_stage(self, *components: str) -> int:
        """A one-shot pipeline (`one_shot`, the CLI) after the stage of `components`: each GPU they
        computed on without a residency manager drops its cached weights (but those uploaded
        ahead for the next stage) and every graph's device memory, given back to the driver
        (backend.release_weights; what a later stage reads is uploaded again, as the diffusion
        model is anyway), so that the process peak is its largest stage's, as sd-cli frees each
        stage's buffers. Returns the weight bytes freed."""
        if not self.one_shot:
            return 0
        from ..ops.backend import get_backend
        return sum(get_backend(d).release_weights(keep=self._sent_ahead().get(d, ()))
                   for d in self._gpus_keeping_weights(components))

    def _gpus_keeping_weights(self, components) -> dict[str, list[str]]:
        """{device: those of `components` computing there} for the devices that keep the weights
        themselves (an executor named by a string other than "cpu"; a residency manager's is an object)."""
        out: dict[str, list[str]] = {}
        for c in components:
            dev = self.executors.get(c, "cpu")
            if isinstance(dev, str) and dev != "cpu":
                out.setdefault(dev, []).append(c)
        return out

    def release_weight_pages(self, *components: str) -> int:
        """Drop this process's pages of the memory-mapped weights of `components` ("te",
        "diffusion", "vae") computing on the CPU, once a request is done with them; returns the
        bytes covered. They are clean file pages, read again from the page cache on next use;
        keeping them through the VAE decode raises the peak RSS well above sd-cli's (the
        measurements: bench/README.md, "Facts moved out of the code")."""
        if self.models is None:
            return 0
        from ..ops.tensor import Tensor
        from .placement import classify_tensor
        from .host_pages import release_file_pages
        want = {c for c in components if self.executors.get(c, "cpu") == "cpu"}
        done, total = set(), 0
        for name, t in self.models.tensors.items():
            o = t.owner
            if id(o) in done or classify_tensor(name) not in want:
                continue
            done.add(id(o))
            st = Tensor.storage.__get__(o)   # the raw slot: never fills a lazily converted leaf
            if st is not None and release_file_pages(st, o.offset, o.span_bytes()):
                total += o.span_bytes()
        return total
