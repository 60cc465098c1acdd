"""Schemathesis over the served OpenAPI document: generated requests (valid and invalid bodies,
parameters, headers) against every operation; never a 5xx, every 4xx a JSON error.

Bounded by default (SDRT_FUZZ_EXAMPLES per operation, 20); the long run is
`SDRT_FUZZ_EXAMPLES=400 python -m pytest -q tests/test_server_fuzz.py` (docs/server.md)."""
import os

import pytest

pytest.importorskip("starlette")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from test_server_tiny import server_config, tiny_pipe  # noqa: E402,F401

from sdrt.server.app import create_app  # noqa: E402
from sdrt.server.params import Limits  # noqa: E402

EXAMPLES = int(os.environ.get("SDRT_FUZZ_EXAMPLES", "20"))
COUNTS = {"requests": 0, "4xx": 0, "2xx": 0}


@pytest.fixture(scope="module")
def fuzz_app(tiny_pipe):  # noqa: F811
    # 1 step at 64x64 at most: valid bodies generate for real, quickly
    limits = Limits(max_width=64, max_height=64, max_steps=1, max_batch_count=1, max_body_bytes=1 << 20,
                    max_image_pixels=128 * 128)
    return create_app(tiny_pipe, server_config(tiny_pipe, limits=limits))


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_json_errors(case):
    r = case.call()
    COUNTS["requests"] += 1
    assert r.status_code < 500, (case.method, case.path, r.status_code, r.text[:300])
    if r.status_code >= 400:
        COUNTS["4xx"] += 1
        body = r.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], r.text[:300]
    else:
        COUNTS["2xx"] += 1
    if case.path != "/":
        r.json()                                    # every API answer is JSON


def test_fuzz_counts_reported():
    print(f"\nfuzz: {COUNTS}")
