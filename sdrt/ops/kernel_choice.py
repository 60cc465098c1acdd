"""The run-time choice among a CPU kernel's code paths (the quantized GEMM's SDRT_QGEMM, the bf16
GEMM's SDRT_BF16GEMM): "auto" (the fastest SIMD path the CPU has, never the portable reference
model), "off" (the exact float32 path), or one path by name; `set`/`using` override the
environment for the process or a block."""
from __future__ import annotations

import contextlib
import os

from ..errors import OpError


class KernelChoice:
    def __init__(self, env: str, what: str, paths):
        self.env, self.what = env, what
        self.choices = ("auto", "off", *paths)
        self._choice: str | None = None  # set(); None: the environment's

    def requested(self) -> str:
        c = self._choice if self._choice is not None else os.environ.get(self.env, "auto").strip().lower() or "auto"
        if c not in self.choices:
            raise OpError(f"{self.env}={c!r}: expected one of {', '.join(self.choices)}")
        return c

    def pick(self, available: tuple[str, ...]) -> str | None:
        """The path to run given the ones this CPU has (fastest first), or None for the exact path."""
        c = self.requested()
        if c == "off":
            return None
        if c == "auto":  # the portable C path is the reference model, slower than BLAS: never auto
            return available[0] if available and available[0] != "scalar" else None
        if c not in available:
            raise OpError(f"{self.what} path {c!r} needs CPU features this machine lacks "
                          f"(available: {', '.join(available) or 'none'})")
        return c

    def set(self, name: str | None) -> None:
        """Pick a path for this process (None: back to the environment / auto)."""
        if name is not None and name not in self.choices:
            raise OpError(f"{self.what} path {name!r}: expected one of {', '.join(self.choices)}")
        self._choice = name

    @contextlib.contextmanager
    def using(self, name: str | None):
        old = self._choice
        self.set(name)
        try:
            yield
        finally:
            self._choice = old
