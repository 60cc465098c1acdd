"""The Vulkan backend's compute shaders: GLSL sources (<family>.comp, common.glsl) and the SPIR-V
built from them (<family>.spv, shipped as package data so users need no compiler).
`python tools/build_vulkan_shaders.py` rebuilds the .spv and manifest.json (each source's
SHA-256 with its includes, and the compiler's version); tests/test_vulkan.py checks both."""
from __future__ import annotations

import hashlib
import os
from functools import cache

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ("common.glsl",)


def families() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".comp"))


def source_digest(family: str) -> str:
    """SHA-256 over the family's .comp and the shared includes (what its .spv depends on)."""
    h = hashlib.sha256()
    for name in (f"{family}.comp",) + COMMON:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


@cache
def spirv(family: str) -> bytes:
    with open(os.path.join(HERE, f"{family}.spv"), "rb") as f:
        return f.read()
