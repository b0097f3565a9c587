"""Helpers of the HTTP tests: one `rawinfer serve` with the HTTP API on SmolLM2 shared by the HTTP test
modules (an API key on, so every client sends it), its /metrics parsed, and SSE read from raw HTTP."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from cli_util import Server  # noqa: E402

API_KEY = "test-key-17"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def http_server(smollm2_dir):
    srv = Server(smollm2_dir, "--kv-cache-memory", "64MiB", "--api-key", API_KEY,
                 http=True)
    try:
        srv.health_seen = _health_until_ready(srv)
        yield srv
    finally:
        srv.stop()


def _health_until_ready(srv: Server, timeout_s: float = 240.0) -> list[int]:
    """The /health statuses seen from the first answer until 200 (the engine loads meanwhile)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise AssertionError(f"server exited with {srv.proc.returncode}:\n{srv.output()}")
        try:
            seen.append(httpx.get(srv.base_url + "/health", timeout=3.0).status_code)
            if seen[-1] == 200:
                return seen
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"HTTP not ready after {timeout_s} s (statuses {seen[-5:]}):\n{srv.output()}")


def openai_client(srv: Server, **kw):
    import openai
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120, **kw)


def post(srv: Server, path: str, body, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers=AUTH if headers is None else headers, timeout=timeout)


def sse_events(srv: Server, path: str, body: dict) -> list:
    """Every `data:` payload of a streamed response (JSON decoded; "[DONE]" as is), checking the framing."""
    out = []
    with httpx.stream("POST", srv.base_url + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metrics(srv: Server) -> dict[str, float]:
    """Every sample of /metrics by name (labels other than model_name in braces), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(srv.base_url + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else "")
            out[key] = s.value
    return out


def engine_stats(srv: Server) -> dict:
    from rawinfer.server import Client
    with Client(srv.addr, timeout_s=10) as c:
        return c.stats()


def wait_idle(srv: Server, timeout_s: float = 30.0) -> dict:
    """The engine's stats once nothing runs, waits or holds a KV block."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine_stats(srv)
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0 and s["requests_in_flight"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout_s} s: {s}")
        time.sleep(0.05)
