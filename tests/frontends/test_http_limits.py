"""Issue 50's HTTP findings against one real `rawinfer serve` (loopback only, bounded loops): no client, body
or connection holds the others up. A request of too many prompts is refused before the engine sees it; a
flooding client (its own loopback address) waits in the worker while another's requests go through; a large
body is parsed while another stream keeps its pace; an oversized body is 413 at once; idle, slow and
oversized request heads are closed; and, last (it kills the server), open streams end with an error event and
[DONE] when the engine's process dies."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from cli_util import Server  # noqa: E402
from http_util import API_KEY, AUTH, _health_until_ready, engine_stats, post, wait_idle  # noqa: E402

MAX_PROMPTS = 16
MAX_IN_FLIGHT = 20              # one flooding job of 16 at a time, and room for another client's small ones
MAX_BODY = 12 * 1024 * 1024
READ_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0


@pytest.fixture(scope="module")
def srv(smollm2_dir):
    s = Server(smollm2_dir, "--kv-cache-memory", "64MiB", "--api-key", API_KEY, "--max-num-seqs", "16",
               "--max-prompts-per-request", str(MAX_PROMPTS), "--http-max-in-flight", str(MAX_IN_FLIGHT),
               "--max-request-body", str(MAX_BODY), "--http-read-timeout", str(READ_TIMEOUT_S),
               "--http-keep-alive", str(KEEP_ALIVE_S), http=True)
    try:
        _health_until_ready(s)
        yield s
    finally:
        s.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _events(response: httpx.Response, times: list | None = None):
    """The `data:` payloads of an SSE response as they arrive (JSON decoded; "[DONE]" as is)."""
    buf = b""
    for data in response.iter_raw():
        buf += data
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            assert block.startswith(b"data: "), block
            if times is not None:
                times.append(time.monotonic())
            payload = block[len(b"data: "):].decode()
            yield payload if payload == "[DONE]" else json.loads(payload)


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


def test_a_large_body_is_parsed_while_another_stream_keeps_its_pace(srv):
    """A 10 MiB body of token ids (refused after parsing: too many prompts) while a stream runs: the stream's
    longest pause between events stays far below the time the large request took."""
    times: list[float] = []
    started = threading.Event()
    out: dict = {}

    def streamer():
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            out["events"] = []
            for e in _events(r, times):
                out["events"].append(e)
                if len(times) == 10:
                    started.set()

    th = threading.Thread(target=streamer)
    th.start()
    assert started.wait(120)
    big = json.dumps({"prompt": [[12345] * 1000] * 1700, "max_tokens": 1}).encode()
    assert 10 * 2**20 < len(big) < MAX_BODY
    t0 = time.monotonic()
    r = httpx.post(srv.base_url + "/v1/completions", content=big, timeout=120,
                   headers={**AUTH, "content-type": "application/json"})
    t1 = time.monotonic()
    th.join(120)
    assert _error(r, 400)["param"] == "prompt"
    assert out["events"][-1] == "[DONE]" and len(out["events"]) > 50
    during = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
    print(f"large request {t1 - t0:.2f} s; the stream's longest pause meanwhile {max(during):.3f} s")
    assert t1 - t0 > 0.5                                    # parsing it took a while ...
    assert max(during) < (t1 - t0) / 3                      # ... and did not stop the stream


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n{extra}\r\n").encode()


def _response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) == 0:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_an_oversized_body_is_413_at_once(srv):
    with _raw(srv.http_port) as s:                          # declared too large, sent only if asked: at once
        t = time.monotonic()
        s.sendall(_head("/v1/completions", MAX_BODY + 1, "expect: 100-continue\r\n"))
        data = _response(s)
        assert data.startswith(b"HTTP/1.1 413") and b"--max-request-body" in data, data[:300]
        assert time.monotonic() - t < 2
    body = b"[" + b"1," * (MAX_BODY // 2) + b"1]"
    t = time.monotonic()
    r = httpx.post(srv.base_url + "/v1/completions", content=body, headers=AUTH, timeout=60)   # sent whole
    assert _error(r, 413)["code"] == "request_too_large" and time.monotonic() - t < 5

    def chunks():                                           # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536

    t = time.monotonic()
    r = httpx.post(srv.base_url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert _error(r, 413)["code"] == "request_too_large" and time.monotonic() - t < 5
    assert post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


def _closed_within(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closed the connection (reading and dropping what it sent)."""
    t = time.monotonic()
    sock.settimeout(limit_s)
    while sock.recv(65536):
        pass
    return time.monotonic() - t


def test_idle_slow_and_oversized_request_heads_are_closed(srv):
    """Each closed, and each begun request among them refused in one warning line of the log (status, the
    route as far as it came, the reason); a connection that sent nothing was no request and leaves none."""
    with _raw(srv.http_port) as s:                          # a connection that sends nothing
        assert _closed_within(s, READ_TIMEOUT_S + 5) < READ_TIMEOUT_S + 2
    assert not srv.log_lines("HTTP 408 (request line", timeout_s=1)
    with _raw(srv.http_port) as s:                          # a head a byte at a time (slowloris)
        t = time.monotonic()
        head = _head("/v1/completions", 10)
        try:
            for i in range(len(head)):
                s.sendall(head[i:i + 1])
                time.sleep(0.2)
                assert time.monotonic() - t < READ_TIMEOUT_S + 2
        except OSError:
            pass                                            # closed by the server
        assert _closed_within(s, 5) < 5 and time.monotonic() - t < READ_TIMEOUT_S + 2
    (line,) = srv.log_lines("HTTP 408 (request line", timeout_s=5)
    assert re.search(r" WARNING rawinfer http \d+: HTTP 408 \(request line incomplete: 'P[^']*'\): the "
                     rf"request head was not whole {READ_TIMEOUT_S:g} s after .*--http-read-timeout", line), line
    with _raw(srv.http_port) as s:                          # an endless header
        s.sendall(b"GET /big-head?x=1 HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70000)
        assert _response(s).startswith(b"HTTP/1.1 431")
    (line,) = srv.log_lines("HTTP 431 GET /big-head", timeout_s=5)
    assert line.endswith("HTTP 431 GET /big-head: the request line and headers are over 65536 bytes; the "
                         "connection was closed"), line
    with _raw(srv.http_port) as s:                          # idle after an answer: uvicorn's keep-alive timeout
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _response(s).startswith(b"HTTP/1.1 200")
        assert _closed_within(s, KEEP_ALIVE_S + 5) < KEEP_ALIVE_S + 1.5


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_open_streams_end_with_an_error_event_when_the_engine_dies(srv):
    """Last in this module: SIGKILL to `rawinfer serve` (the engine's process); its HTTP worker outlives it
    for a moment, ends the open stream with an error event and [DONE], and exits."""
    workers = _children(srv.proc.pid)
    assert workers
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for e in _events(r):
            events.append(e)
            if len(events) == 5:
                killed = time.monotonic()
                os.kill(srv.proc.pid, signal.SIGKILL)
    ended = time.monotonic() - killed
    assert events[-1] == "[DONE]", events[-3:]
    err = events[-2]["error"]
    assert err["code"] == "engine_unavailable" and "lost the engine" in err["message"], err
    assert ended < 5
    deadline = time.monotonic() + 15
    while any(_running(pid) for pid in workers):
        assert time.monotonic() < deadline, "the HTTP worker outlived the server"
        time.sleep(0.1)
