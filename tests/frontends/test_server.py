"""`rawinfer serve` as a real subprocess on loopback: streaming, aborts, vanished clients, fuzzing, CurveZMQ,
graceful shutdown, `rawinfer client` and `rawinfer bench serve`.

The tiny random model (no tokenizer, token-id prompts) serves every test that needs no text; SmolLM2 serves
the text comparisons with short outputs. Every wait is bounded; every server process is killed in teardown.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import pytest
import zmq

from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.client import AsyncClient, Client, RequestError, ServerTimeout
from rawinfer.frontends.server.server import ServerConfig, SecurityError, check_bind_security, is_loopback_endpoint

from cli_util import Server as ServerProcess, env, free_port, offline  # noqa: E402
from conftest import ROOT  # noqa: E402
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def rawinfer_cmd(*args: str) -> list[str]:
    """The `rawinfer` command as a subprocess (`python -m rawinfer`: the entry point the script runs)."""
    return [sys.executable, "-m", "rawinfer", *args]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    srv = ServerProcess(tiny_llama_dir, "--heartbeat-interval", "0.1", "--client-timeout", "1")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def idle_stats(client: Client, timeout_s: float = 10.0) -> dict:
    """Stats once the server has no request in flight (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = client.stats()
        if s["requests_in_flight"] == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 500, int(rng.integers(3, 12)))] for _ in range(n)]


# ---- streaming ---------------------------------------------------------------------------------------------
def test_32_concurrent_streaming_clients_get_their_own_tokens_in_order(tiny_server, tiny_llm):
    prompts = random_prompts(32, seed=1)
    expected = offline(tiny_llm, prompts, 24)

    async def one(prompt, i):
        async with AsyncClient(tiny_server.addr, timeout_s=60) as c:
            got, t_first, t_final = [], None, None
            async for msg in c.generate(prompt, params={"max_tokens": 24, **GREEDY}, request_id=f"req-{i}"):
                assert msg.request_id == f"req-{i}" and msg.index == 0
                if isinstance(msg, P.Chunk):
                    assert len(msg.token_ids) == 1            # one token per engine step, never batched up
                    t_first = t_first or time.monotonic()
                else:
                    t_final = time.monotonic()
                    final = msg
                got.extend(msg.token_ids)
            return got, final, t_first, t_final

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(p, i) for i, p in enumerate(prompts))), 90)

    with Client(tiny_server.addr, timeout_s=60) as c:
        before = c.stats()
    results = asyncio.run(main())
    with Client(tiny_server.addr, timeout_s=60) as c:
        after = c.stats()
    for (got, final, _, _), want, prompt in zip(results, expected, prompts):
        assert got == want
        assert final.finish_reason == "length" and final.prompt_token_ids == prompt
        assert final.usage.completion_tokens == 24 and final.usage.prompt_tokens == len(prompt)
        assert final.timings.ttft_s > 0 and final.timings.e2e_s >= final.timings.ttft_s
    # the streams really ran side by side: the engine batched them, 32 x 24 tokens in far fewer steps (the
    # clients' own clocks cannot show it: a client process descheduled during the run reads every stream's
    # buffered messages one stream after another)
    steps, tokens = (after[k] - before[k] for k in ("steps", "tokens_generated"))
    assert tokens == 32 * 24 and steps <= tokens / 4, (steps, tokens)


def test_several_requests_on_one_client_are_demultiplexed(tiny_server, tiny_llm):
    prompts = random_prompts(3, seed=2)
    expected = offline(tiny_llm, prompts, 10)
    with Client(tiny_server.addr, timeout_s=60) as c:
        its = [c.generate(p, params={"max_tokens": 10, **GREEDY}, stream=s)
               for p, s in zip(prompts, (True, False, True))]
        last_first = [[t for m in it for t in m.token_ids] for it in reversed(its)]   # read in reverse order
        assert last_first[::-1] == expected
        done = c.complete(prompts[0], params={"max_tokens": 10, **GREEDY})
        assert done.token_ids == expected[0] and done.finish_reason == "length"


def test_n_samples_stream_with_their_index(tiny_server, tiny_llm):
    from rawinfer import SamplingParams
    prompt = random_prompts(1, seed=6)[0]
    params = {"max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11}
    ref = tiny_llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    with Client(tiny_server.addr, timeout_s=60) as c:
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finals = []
        for msg in c.generate(prompt, params=params):
            got[msg.index].extend(msg.token_ids)
            if msg.finished:
                finals.append(msg.index)
    assert sorted(finals) == [0, 1, 2]
    assert [got[i] for i in range(3)] == [o.token_ids for o in ref.outputs]


def test_abort_before_the_first_step_ends_every_sample(tiny_server):
    """An aborted n > 1 request still gets one final per index, whether or not its samples were forked yet."""
    with Client(tiny_server.addr, timeout_s=60) as c:
        for stream in (True, False):
            it = c.generate([4, 5, 6], params={"max_tokens": 1000, "n": 3, **GREEDY}, stream=stream, request_id="x")
            c.abort("x")
            finals = [m for m in it if m.finished]
            assert sorted(f.index for f in finals) == [0, 1, 2]
            assert {f.finish_reason for f in finals} == {"abort"}
        s = c.stats()
        assert s["requests_in_flight"] == 0 and s["kv_blocks_used"] == 0


def test_heartbeats_keep_a_long_non_streaming_request_alive(tiny_server):
    """Nothing but heartbeats arrives for the whole request, yet a client with a short silence limit waits."""
    # a silence limit of 8 heartbeat intervals (0.1 s here): a loaded machine may delay one or two
    with Client(tiny_server.addr, timeout_s=0.8) as c:
        # 8 long requests, so that the work outlasts the silence limit (the test skips if it did not)
        its = [c.generate([5 + i, 6, 7], params={"max_tokens": 1000, **GREEDY}, stream=False) for i in range(8)]
        finals = [m for it in its for m in it]
    assert [(f.finish_reason, len(f.token_ids)) for f in finals] == [("length", 1000)] * 8
    if max(f.timings.e2e_s for f in finals) < 0.8:
        pytest.skip("the request finished within the silence limit: nothing was shown")


# ---- aborts and vanished clients -------------------------------------------------------------------------
def test_abort_mid_stream_frees_blocks(tiny_server):
    with Client(tiny_server.addr, timeout_s=60) as c:
        before = idle_stats(c)
        assert before["kv_blocks_used"] == 0
        it = c.generate([5, 6, 7], params={"max_tokens": 1000, **GREEDY}, request_id="long")
        got = [next(it) for _ in range(3)]
        assert all(isinstance(m, P.Chunk) for m in got)
        busy = c.stats()
        assert busy["running"] == 1 and busy["kv_blocks_used"] > 0
        c.abort("long")
        c.abort("long")                        # asked twice before it ended: one final, counted once
        rest = list(it)
        assert rest[-1].finish_reason == "abort" and rest[-1].usage.completion_tokens < 1000
        assert sum(isinstance(m, P.Final) for m in rest) == 1
        after = c.stats()                      # the abort was handled before this (one connection, in order)
        assert after["running"] == 0 and after["kv_blocks_used"] == 0
        assert after["requests_aborted_by_client"] == before["requests_aborted_by_client"] + 1

        # leaving the iterator early aborts the request on the server as well
        it = c.generate([8, 9], params={"max_tokens": 1000, **GREEDY})
        next(it)
        it.close()
        s = idle_stats(c)
        assert s["requests_in_flight"] == 0 and s["kv_blocks_used"] == 0


KILLED_CLIENT = """
import sys, time
from rawinfer.frontends.client.client import Client
c = Client(sys.argv[1], timeout_s=60)
stream = sys.argv[2] == "stream"
params = {"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True, "n": int(sys.argv[4])}
its = [c.generate([5 + i, 6, 7], params=params, stream=stream) for i in range(int(sys.argv[3]))]
if stream:
    next(its[0])
else:
    c.stats()     # answered after both generates were taken in
print("running", flush=True)
time.sleep(60)
"""


# NOTE: the frozen client's work must outlast the time it takes to notice it (--client-timeout 1), on any
# machine: 64 requests x 4 samples x 1000 tokens are more sequences than one step takes and more KV than
# the pool holds, so they cannot all finish first
@pytest.mark.parametrize("mode, how, n, samples", [("stream", "kill", 2, 1), ("no-stream", "kill", 2, 1),
                                                   ("no-stream", "freeze", 64, 4)])
def test_vanished_client_has_its_requests_aborted(tiny_server, mode, how, n, samples):
    """A killed streaming client is found by a failed chunk send, a killed non-streaming one by a failed
    heartbeat, a frozen one (SIGSTOP: connection open, nobody answering) by missed ZMTP heartbeats."""
    with Client(tiny_server.addr, timeout_s=60) as c:
        before = idle_stats(c)
        proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, tiny_server.addr, mode, str(n), str(samples)],
                                stdout=subprocess.PIPE, text=True, env=env())
        try:
            assert proc.stdout.readline().strip() == "running"
            assert c.stats()["requests_in_flight"] == n
            proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            s = idle_stats(c, timeout_s=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert s["requests_in_flight"] == 0 and s["running"] == 0 and s["kv_blocks_used"] == 0
        assert s["requests_aborted_vanished"] == before["requests_aborted_vanished"] + n
        assert s["clients_vanished"] == before["clients_vanished"] + 1


# ---- bad input -------------------------------------------------------------------------------------------
def _valid_generate(rng: random.Random) -> dict:
    return {"v": 1, "type": "generate", "request_id": f"f{rng.randrange(10**9)}", "prompt": [1, 2, 3],
            "params": {"max_tokens": 4}, "stream": True}


def fuzz_messages(n: int, seed: int) -> list[list[bytes]]:
    """n multipart messages, each certain to be refused with one error reply."""
    rng = random.Random(seed)
    valid = msgpack.packb(_valid_generate(rng))
    bad_params = [{"temperature": -1}, {"max_tokens": -1}, {"top_p": 2}, {"n": 0}, {"bogus": 1}, {"stop": 5},
                  {"stop_token_ids": "x"}, {"seed": -1}, {"max_tokens": "many"}, {"min_p": float("nan")}]
    makers = [
        lambda: [rng.randbytes(rng.randrange(0, 200))],
        lambda: [valid[:rng.randrange(0, len(valid))]],
        lambda: [msgpack.packb(rng.choice([7, "generate", [1, 2], None, 3.5, b"x" * 50]))],
        lambda: [msgpack.packb({**_valid_generate(rng), "v": rng.choice([0, 2, "1", None, 1.5])})],
        lambda: [msgpack.packb({**_valid_generate(rng), "type": rng.choice(["gen", "chunk", "", "x" * 500, 5])})],
        lambda: [msgpack.packb({**_valid_generate(rng), "surprise": 1})],
        lambda: [msgpack.packb({**_valid_generate(rng), "prompt": rng.choice(
            [{"a": 1}, [1, -1], [0.5], [2**40], [], [True], "text on a model without a tokenizer"])})],
        lambda: [msgpack.packb({**_valid_generate(rng), "params": rng.choice(bad_params)})],
        lambda: [msgpack.packb({**_valid_generate(rng), "request_id": rng.choice([5, "", "x" * 300, None])})],
        lambda: [msgpack.packb({**_valid_generate(rng), "prompt": None,        # no chat template on this model
                                "messages": [{"role": "user", "content": "hi"}]})],
        lambda: [msgpack.packb({**_valid_generate(rng), "stream": "yes", "priority": 0.5})],
        lambda: [msgpack.packb({**_valid_generate(rng), "prompt": list(range(3, 512)) * 200})],   # > context
        lambda: [msgpack.packb({**_valid_generate(rng), "params": {f"k{i}": i for i in range(5000)}})],
        lambda: [msgpack.packb({**_valid_generate(rng), "params": {"max_tokens": 10**6}})],      # > context
        lambda: [msgpack.packb({"v": 1, "type": "abort", "request_id": "not-in-flight"})],
        lambda: [msgpack.packb({"v": 1, "type": "ping", "tag": msgpack.ExtType(3, b"zz")})],
        lambda: [b"\x91" * 5000 + b"\x00"],
        lambda: [valid, valid],                                     # two frames
        lambda: [b"", valid, b"x"],
    ]
    return [makers[i % len(makers)]() for i in range(n)]


def test_fuzzed_messages_get_errors_and_the_server_keeps_serving(tiny_server, tiny_llm):
    n = 1200
    messages = fuzz_messages(n, seed=3)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(tiny_server.addr)
    replies = []
    try:
        deadline = time.monotonic() + 60
        for start in range(0, n, 100):
            for frames in messages[start:start + 100]:
                sock.send_multipart(frames)
            while len(replies) < min(start + 100, n) and time.monotonic() < deadline:
                if sock.poll(1000):
                    replies.append(P.decode_reply(sock.recv()))
        assert len(replies) == n, f"{len(replies)} replies to {n} fuzzed messages"
        assert all(isinstance(r, P.Error) for r in replies)
        codes = {r.code for r in replies}
        assert codes <= {c.value for c in P.ErrorCode} and P.ErrorCode.INTERNAL.value not in codes
        assert {"bad_msgpack", "invalid_message", "unsupported_version", "unknown_type", "invalid_params",
                "rejected", "invalid_prompt", "unknown_request", "bad_frames"} <= codes
        assert not sock.poll(200)                                    # exactly one reply each
    finally:
        sock.close()

    # a message over the size cap drops that connection at the socket; nobody else notices
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(tiny_server.addr)
    try:
        big.send(msgpack.packb({**_valid_generate(random.Random(0)), "prompt": "x" * (2 << 20)}))
        assert not big.poll(500)
    finally:
        big.close()

    prompts = random_prompts(2, seed=4)
    with Client(tiny_server.addr, timeout_s=60) as c:
        got = [c.complete(p, params={"max_tokens": 12, **GREEDY}).token_ids for p in prompts]
        s = c.stats()
    assert got == offline(tiny_llm, prompts, 12)
    assert s["messages_invalid"] >= n // 2 and tiny_server.proc.poll() is None


def test_refusals_name_the_problem(tiny_server):
    with Client(tiny_server.addr, timeout_s=60) as c:
        cases = [({"params": {"temperature": -1}}, "invalid_params", "temperature"),
                 ({"params": {"colour": "red"}}, "invalid_params", "colour"),
                 ({"prompt": "text"}, "rejected", "no tokenizer"),
                 ({"prompt": None, "messages": [{"role": "user", "content": "hi"}]}, "invalid_prompt",
                  "chat template"),
                 ({"prompt": [1, 999999]}, "rejected", "outside the vocabulary"),
                 ({"params": {"max_tokens": 5000}}, "rejected", "maximum context")]
        for kw, code, words in cases:
            kw = {"prompt": [1, 2, 3], **kw}
            with pytest.raises(RequestError) as e:
                list(c.generate(**kw))
            assert e.value.code == code and words in e.value.message

    # a second request under an id still in flight is refused; the first one carries on
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_server.addr)
    try:
        msg = P.Generate("dup", prompt=[4, 5], params={"max_tokens": 200, **GREEDY})
        sock.send(P.encode(msg))
        sock.send(P.encode(msg))
        seen, deadline = [], time.monotonic() + 30
        while (not seen or not isinstance(seen[-1], P.Final)) and time.monotonic() < deadline:
            if sock.poll(1000):
                m = P.decode_reply(sock.recv())
                if not isinstance(m, P.Heartbeat):      # a step slower than the heartbeat interval sends one
                    seen.append(m)
        errors = [m for m in seen if isinstance(m, P.Error)]
        assert [e.code for e in errors] == ["duplicate_request_id"] and errors[0].request_id == "dup"
        assert seen[-1].finish_reason == "length" and sum(len(m.token_ids) for m in seen if not
                                                          isinstance(m, P.Error)) == 200
        # a client of another protocol version hears which versions this server speaks
        sock.send(msgpack.packb({"v": 2, "type": "ping"}))
        assert sock.poll(5000)
        reply = P.decode_reply(sock.recv())
        assert reply.code == "unsupported_version" and "version(s) 1" in reply.message
    finally:
        sock.close()


# ---- security --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint, local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:1", True), ("tcp://localhost:80", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/x.sock", True), ("inproc://a", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://eth0:5555", False),
    ("tcp://192.168.1.4:5555", False), ("tcp://[::]:5555", False), ("tcp://example.org:1", False),
    ("udp://127.0.0.1:5", False), ("127.0.0.1:5555", False)])
def test_loopback_detection(endpoint, local):
    assert is_loopback_endpoint(endpoint) is local
    if not local:
        with pytest.raises(SecurityError, match="--curve-secret-key"):
            check_bind_security(ServerConfig(bind=endpoint))
        check_bind_security(ServerConfig(bind=endpoint, insecure=True))
        check_bind_security(ServerConfig(bind=endpoint, curve_secret_key_file="k"))


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:{port}", "tcp://*:{port}"])
def test_non_loopback_bind_without_curve_is_refused(tiny_llama_dir, bind):
    """Refused before the model is loaded or anything is bound."""
    r = subprocess.run(rawinfer_cmd("serve", "--model", tiny_llama_dir, "--bind", bind.format(port=free_port())),
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2
    assert "not a loopback address" in r.stderr and "--curve-secret-key" in r.stderr and "--insecure" in r.stderr


@pytest.fixture(scope="module")
def curve_server(tiny_llama_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    clients = keys / "clients"
    for name, where in (("server", keys), ("alice", keys), ("mallory", keys)):
        r = subprocess.run(rawinfer_cmd("keygen", str(where), "--name", name), capture_output=True, text=True,
                           env=env(), timeout=60)
        assert r.returncode == 0, r.stderr
    clients.mkdir()
    (clients / "alice.key").write_bytes((keys / "alice.key").read_bytes())
    assert oct(os.stat(keys / "server.key_secret").st_mode & 0o777) == "0o600"
    srv = ServerProcess(tiny_llama_dir, "--curve-secret-key", str(keys / "server.key_secret"),
                        "--curve-client-keys", str(clients))
    try:
        srv.wait_ready(server_key=str(keys / "server.key"), client_key_file=str(keys / "alice.key_secret"))
        yield srv, keys
    finally:
        srv.stop()


def test_curve_admits_the_right_keys_only(curve_server, tiny_llm):
    srv, keys = curve_server
    prompt = random_prompts(1, seed=5)[0]
    with Client(srv.addr, server_key=str(keys / "server.key"), client_key_file=str(keys / "alice.key_secret"),
                timeout_s=60) as c:
        assert c.complete(prompt, params={"max_tokens": 8, **GREEDY}).token_ids == offline(tiny_llm, [prompt], 8)[0]
    wrong = [dict(server_key=str(keys / "mallory.key")),                                     # wrong server key
             dict(server_key=str(keys / "server.key"), client_key_file=str(keys / "mallory.key_secret")),
             dict(server_key=str(keys / "server.key")),                                      # anonymous client
             dict()]                                                                          # no encryption
    for kw in wrong:
        with Client(srv.addr, timeout_s=1.0, **kw) as c:
            it = c.generate(prompt, params={"max_tokens": 8, **GREEDY})
            with pytest.raises(ServerTimeout):
                next(it)
            assert not c.sock.poll(100)
    assert srv.proc.poll() is None


# ---- graceful shutdown -----------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_aborts_requests_in_flight_and_exits_0(tiny_llama_dir, sig):
    path = tempfile.mkdtemp(prefix="rwi")
    srv = ServerProcess(tiny_llama_dir, addr=f"ipc://{path}/s.sock")
    try:
        srv.wait_ready()
        with Client(srv.addr, timeout_s=60) as c:
            its = [c.generate([3 + i, 4], params={"max_tokens": 1000, **GREEDY}, stream=bool(i)) for i in range(2)]
            next(its[1])
            srv.proc.send_signal(sig)
            finals = [[m for m in it if m.finished] for it in its]
        assert [f[0].finish_reason for f in finals] == ["abort", "abort"]
        assert srv.proc.wait(20) == 0
        assert "aborted 2 request(s)" in srv.output()
    finally:
        srv.stop()
        shutil.rmtree(path, ignore_errors=True)


# ---- text: SmolLM2 -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_server(smollm2_dir):
    path = tempfile.mkdtemp(prefix="rwi")
    srv = ServerProcess(smollm2_dir, addr=f"ipc://{path}/s.sock", kv="128MiB")
    try:
        srv.wait_ready(timeout_s=180)
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(path, ignore_errors=True)


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You answer in one short sentence."},
          {"role": "user", "content": "Name a colour of the sky."}]]


def test_streamed_equals_non_streamed_equals_offline(smol_server, smollm2_dir):
    from rawinfer import LLM, SamplingParams
    n = 10
    with Client(smol_server.addr, timeout_s=120) as c:
        streams = [c.generate(messages=m, params={"max_tokens": n, "temperature": 0.0}) for m in CHATS]
        whole = [c.generate(messages=m, params={"max_tokens": n, "temperature": 0.0}, stream=False) for m in CHATS]
        streamed = [list(it) for it in streams]
        finals = [list(it) for it in whole]
    llm = LLM(smollm2_dir, device="cpu", kv_cache_memory="64MiB")
    prompts = [llm.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in CHATS]
    ref = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0), use_tqdm=False)
    for s, w, r in zip(streamed, finals, ref):
        assert len(w) == 1 and len(s) >= 2 and all(isinstance(m, P.Chunk) for m in s[:-1])
        s_text, s_ids = "".join(m.text for m in s), [t for m in s for t in m.token_ids]
        assert (s_text, s_ids) == (w[0].text, w[0].token_ids)
        assert (s_ids, s_text) == (r.token_ids, r.text) and r.text.strip()
        assert s[-1].finish_reason == w[0].finish_reason == r.finish_reason
        assert w[0].prompt_token_ids == r.prompt_token_ids


def test_client_cli_json_has_the_keys_of_generate(smol_server, smollm2_dir):
    from rawinfer.frontends.cli.stream import result_json
    r = subprocess.run(rawinfer_cmd("client", "--addr", smol_server.addr, "--json", "--max-tokens", "6",
                                    "What is the capital of France?"),
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == set(result_json("", [], [], None, None, None, None))
    assert out["finish_reason"] in ("stop", "length") and 1 <= len(out["token_ids"]) <= 6 and out["text"]
    assert out["ttft_s"] > 0 and out["prompt_token_ids"]


def test_client_cli_streams_and_summarises(tiny_server, tiny_llm):
    want = offline(tiny_llm, [[5, 6, 7]], 5)[0]
    args = ("client", "--addr", tiny_server.addr, "--token-ids", "--max-tokens", "5", "--ignore-eos", "5, 6 7")
    r = subprocess.run(rawinfer_cmd(*args, "--json"), capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["token_ids"], out["prompt_token_ids"], out["finish_reason"]) == (want, [5, 6, 7], "length")
    r = subprocess.run(rawinfer_cmd(*args), capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 0 and "[prompt 3 tokens | generated 5 tokens | TTFT" in r.stderr
    # a refused request is one clear line and exit status 2
    r = subprocess.run(rawinfer_cmd("client", "--addr", tiny_server.addr, "--temperature", "-1", "hi"),
                       capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("rawinfer: error: --temperature")


# ---- bench serve ---------------------------------------------------------------------------------------
def test_poisson_arrivals():
    from rawinfer.frontends.bench.serve import arrival_times
    assert arrival_times(5, math.inf, 0) == [0.0] * 5
    t = arrival_times(4000, 20.0, 7)
    assert t == arrival_times(4000, 20.0, 7) and t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert abs(gaps.mean() - 1 / 20) < 0.005 and abs(gaps.std() - 1 / 20) < 0.005    # exponential: std = mean


def test_bench_metrics_from_hand_made_records():
    from rawinfer.frontends.bench.serve import RequestRecord, summarize_run
    a = RequestRecord(10, 3, sent=0.0, token_times=[0.5, 0.7, 1.0], message_times=[0.5, 0.7, 1.0], finished=1.0,
                      output_tokens=3, finish_reason="length")
    b = RequestRecord(20, 3, sent=1.0, token_times=[1.2], message_times=[1.2], finished=1.3, output_tokens=1,
                      finish_reason="stop")
    c = RequestRecord(5, 3, sent=1.0, error="refused")
    r = summarize_run([a, b, c], 2.0, [], {"request_rate": 1.0})
    assert (r["completed"], r["failed"], r["errors"]) == (2, 1, ["refused"])
    assert r["output_tokens_per_s"] == pytest.approx(4 / 2.0) and r["total_tokens_per_s"] == pytest.approx(34 / 2)
    assert r["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert r["tpot_ms"]["mean"] == pytest.approx(250.0)              # only a: (1.0 - 0.5) / 2
    assert r["itl_ms"]["mean"] == pytest.approx(250.0) and r["e2e_ms"]["p50"] == pytest.approx(650.0)


def test_bench_serve_end_to_end(tiny_server, tmp_path):
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    r = subprocess.run(rawinfer_cmd("bench", "serve", "--addr", tiny_server.addr, "--num-requests", "12",
                                    "--request-rate", "40", "--input-len", "16", "--output-len", "8",
                                    "--range-ratio", "0.5", "--json", str(out), "--figure", str(fig)),
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (12, 0)
    assert res["output_tokens"] == sum(x["max_tokens"] for x in res["requests"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(res[key]) == {"mean", "p50", "p99"} and res[key]["p99"] >= res[key]["p50"] > 0
    assert res["timeline"]["stats"] and "kv_usage" in res["timeline"]["stats"][0]
    assert "TTFT" in r.stdout and "TPOT" in r.stdout
    pytest.importorskip("matplotlib")
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
