#!/usr/bin/env python3
"""Write docs/ops.md: the op x backend support table, from the op registry's cases and each
backend's kernel table (sdrt.ops.cases.support_markdown; no device needed).

    python tools/make_ops_md.py            # rewrite docs/ops.md
    python tools/make_ops_md.py --check    # exit 1 when docs/ops.md is stale
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import sdrt.gpu  # noqa: E402,F401 - every backend's column
from sdrt.ops.cases import support_markdown  # noqa: E402

OPS_MD = ROOT / "docs" / "ops.md"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = support_markdown()
    if "--check" in argv:
        ok = OPS_MD.exists() and OPS_MD.read_text(encoding="utf-8") == text
        print("ok: docs/ops.md is current" if ok else "stale: run python tools/make_ops_md.py")
        return 0 if ok else 1
    OPS_MD.write_text(text, encoding="utf-8")
    print(f"wrote {OPS_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
