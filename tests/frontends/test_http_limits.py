"""Issue 50's HTTP findings against one real `rawinfer serve` (loopback only, bounded loops): no client or
request holds the others up. A request of too many prompts is refused before the engine sees it; a
flooding client (its own loopback address) waits in the worker while another's requests go through."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cli_util import Server  # noqa: E402
from http_util import API_KEY, AUTH, _health_until_ready, engine_stats, post, wait_idle  # noqa: E402

MAX_PROMPTS = 16
MAX_IN_FLIGHT = 20              # one flooding job of 16 at a time, and room for another client's small ones


@pytest.fixture(scope="module")
def srv(smollm2_dir):
    s = Server(smollm2_dir, "--kv-cache-memory", "64MiB", "--api-key", API_KEY, "--max-num-seqs", "16",
               "--max-prompts-per-request", str(MAX_PROMPTS), "--http-max-in-flight", str(MAX_IN_FLIGHT),
               http=True)
    try:
        _health_until_ready(s)
        yield s
    finally:
        s.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_a_request_of_too_many_prompts_is_refused_before_the_engine_sees_it(srv):
    received = engine_stats(srv)["requests_received"]
    err = _error(post(srv, "/v1/completions", {"prompt": ["Hi"] * 10000, "max_tokens": 16}), 400)
    assert err["param"] == "prompt" and "--max-prompts-per-request" in err["message"] and "(16" in err["message"]
    err = _error(post(srv, "/v1/completions", {"prompt": ["Hi"] * 4, "n": 5, "max_tokens": 1}), 400)
    assert err["param"] == "n" and "20 generations" in err["message"]
    err = _error(post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 17}), 400)
    assert err["param"] == "n"
    assert engine_stats(srv)["requests_received"] == received          # nothing was sent to the engine
    r = post(srv, "/v1/completions", {"prompt": ["Hi"] * 4, "n": 4, "max_tokens": 1})      # 16: at the limit
    assert r.status_code == 200 and len(r.json()["choices"]) == 16


def test_a_flooding_client_waits_in_the_worker_while_another_clients_requests_go_through(srv):
    """Client A (127.0.0.2) sends 12 requests of 16 prompts at once, and requests of 10,000 prompts; client B
    (127.0.0.1) then asks 3 short questions. The worker keeps one of A's jobs in the engine at a time, so B
    waits behind at most that one, not behind all 192 of A's generations."""
    flood = {"prompt": ["Tell me a story"] * MAX_PROMPTS, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    statuses: list[int] = []
    a = httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=300,
                     transport=httpx.HTTPTransport(local_address="127.0.0.2"))

    def flooder(body):
        statuses.append(a.post("/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=flooder, args=(flood,)) for _ in range(12)]
    threads += [threading.Thread(target=flooder, args=({"prompt": ["Hi"] * 10000, "max_tokens": 16},))
                for _ in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while engine_stats(srv)["running"] == 0:                # A's first job runs
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b_times = []
    for _ in range(3):
        t = time.monotonic()
        r = post(srv, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        b_times.append(time.monotonic() - t)
    b_done = time.monotonic()
    for t in threads:
        t.join(300)
    a.close()
    flood_s = time.monotonic() - t0
    print(f"flood {flood_s:.1f} s; B's requests {', '.join(f'{x:.2f}' for x in b_times)} s")
    assert sorted(statuses) == [200] * 12 + [400] * 3
    assert b_done - t0 < flood_s / 2                        # B was done while the flood ran on
    assert max(b_times) < flood_s / 4                       # each waited behind one of A's jobs, not all
    s = wait_idle(srv)
    assert s["running"] == 0 and s["waiting"] == 0
