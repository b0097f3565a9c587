"""The replica router (frontends/cluster/router.py) over real `rawinfer serve` processes of the tiny model.

A test pool stands in for Ray here: each replica is a subprocess, and one that died is started again when
the router asks for it, as Ray restarts a dead actor. tests/frontends/test_ray_replicas.py runs the same
router on Ray with the default model.

The replicas and the in-process engine the answers are compared with run in the batch-invariant mode:
a replica sees other batches than the offline engine (the router splits the load), and without that
mode a float32 prompt's last bits depend on its batch (OpenBLAS rounds by call shape), enough to turn
a near-tie in a random model's 200-token greedy run.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from rawinfer.frontends.cluster.router import ReplicaRouter, RouterConfig
from rawinfer.frontends.cluster.routing import TOKEN_PIECE, RoutingConfig
from rawinfer.frontends.client.client import Client, RequestError
from rawinfer.frontends.server.server import ServerConfig

from cli_util import Server as ServerProcess, free_port, offline, run_concurrently  # noqa: E402

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class ProcessPool:
    """ReplicaPool of `rawinfer serve` subprocesses; a dead one is restarted by endpoint()."""

    def __init__(self, model: str):
        self.model = model
        self.procs: dict[int, ServerProcess] = {}
        self.starts = 0
        self.stopped: list[int] = []

    def start(self, slot: int) -> None:
        self.starts += 1
        self.procs[slot] = ServerProcess(self.model, "--heartbeat-interval", "0.2", "--batch-invariant")

    def endpoint(self, slot: int, timeout_s: float):
        proc = self.procs[slot]
        if proc.proc.poll() is not None:          # died: start it again, on a new port
            proc.stop()
            self.start(slot)
            proc = self.procs[slot]
        proc.wait_ready(timeout_s)
        return proc.addr, {"pid": proc.proc.pid}

    def stop(self, slot: int) -> None:
        self.procs.pop(slot).stop()
        self.stopped.append(slot)

    def close(self) -> None:
        for slot in list(self.procs):
            self.procs.pop(slot).stop()


class RunningRouter:
    def __init__(self, model: str, replicas: int, policy: str = "cache_aware"):
        self.pool = ProcessPool(model)
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.router = ReplicaRouter(ServerConfig(bind=self.addr, heartbeat_interval_s=0.2),
                                    self.pool, RouterConfig(replicas=replicas, routing=RoutingConfig(policy=policy),
                                                            lost_after_s=30.0, start_timeout_s=120))
        self.thread = threading.Thread(target=self.router.run, daemon=True)
        self.thread.start()

    def wait_serving(self, n: int, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        with Client(self.addr, timeout_s=10) as c:
            while time.monotonic() < deadline:
                s = c.stats()
                states = [r["state"] for r in s["replicas"].values()]
                if states.count("up") == n and len(states) == n:
                    return s
                time.sleep(0.1)
        raise AssertionError(f"not {n} replicas serving: {s['replicas']}")

    def stop(self) -> None:
        self.router.shutdown()
        self.thread.join(30)


@pytest.fixture(scope="module")
def tiny_router(tiny_llama_dir):
    r = RunningRouter(tiny_llama_dir, 2)      # lost_after_s 30: a killed replica is found by its closed connection
    try:
        r.wait_serving(2)
        yield r
    finally:
        r.stop()
        r.pool.close()


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    """The offline engine the routed answers are compared with, batch-invariant as the replicas are."""
    from rawinfer import LLM
    return LLM(tiny_llama_dir, device="cpu", kv_cache_memory="16MiB", batch_invariant=True)


def prompts(n: int, seed: int, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 500, length)] for _ in range(n)]


def ask(addr: str, ps: list[list[int]], max_tokens: int, stream: bool = True) -> list:
    return run_concurrently(addr, ps, {"max_tokens": max_tokens, **GREEDY}, stream)


def busiest_replica(addr: str, timeout_s: float = 30.0) -> int:
    """The slot of the replica with the most requests in flight, once some replica has at least one."""
    deadline = time.monotonic() + timeout_s
    with Client(addr, timeout_s=10) as c:
        while time.monotonic() < deadline:
            replicas = c.stats()["replicas"]
            slot = max(replicas, key=lambda k: replicas[k]["requests_in_flight"])
            if replicas[slot]["requests_in_flight"] > 0:
                return int(slot)
            time.sleep(0.02)
    raise AssertionError(f"no replica got a request within {timeout_s} s: {replicas}")


def test_outputs_through_the_router_equal_one_engine_and_reach_both_replicas(tiny_router, tiny_llm):
    ps = prompts(12, seed=1)
    got = ask(tiny_router.addr, ps, 24)
    assert [g.token_ids for g in got] == offline(tiny_llm, ps, 24)
    with Client(tiny_router.addr) as c:
        s = c.stats()
        info = c.model_info()
    assert all(r["requests_routed"] > 0 for r in s["replicas"].values()), s["replicas"]
    assert s["routing"]["requests_routed"] >= 12 and s["requests_completed"] + s["finals_unconfirmed"] >= 12
    assert info["replicas"] == 2 and info["routing"] == "cache_aware" and info["vocab_size"] == 512
    assert s["metrics"]["counters"]["generation_tokens_total"] >= 12 * 24     # summed over the replicas
    assert set(s["replica_metrics"]) == set(s["replicas"])


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix(tiny_router):
    history = prompts(1, seed=2, length=4 * TOKEN_PIECE)[0]
    with Client(tiny_router.addr, timeout_s=60) as c:
        slots, before = [], c.stats()
        for turn in range(4):
            r = c.complete(history, params={"max_tokens": 8, **GREEDY})
            s = c.stats()
            slots.append(max(s["replicas"], key=lambda k: s["replicas"][k]["requests_routed"]
                             - before["replicas"][k]["requests_routed"]))
            before = s
            history = history + r.token_ids + prompts(1, seed=10 + turn, length=20)[0]
        after = c.stats()
    assert len(set(slots)) == 1, slots
    assert after["routing"]["routed_by_prefix"] >= 3
    hits = after["metrics"]["counters"]["prefix_cache_hits_total"]
    assert hits >= 3 * 4 * TOKEN_PIECE           # each later turn found at least the first prompt's blocks


def test_tokenize_and_scale_refusals_go_through_the_router(tiny_router):
    with Client(tiny_router.addr) as c:
        with pytest.raises(RequestError, match="no tokenizer"):
            c.tokenize("hello")
        with pytest.raises(RequestError, match="replicas must be from 1 to 64"):
            c.scale(65)


def test_a_replica_that_stops_answering_gets_no_new_request_within_two_heartbeats(tiny_router, tiny_llm):
    proc = tiny_router.pool.procs[0].proc
    with Client(tiny_router.addr) as c:
        before = {k: r["requests_routed"] for k, r in c.stats()["replicas"].items()}
    os.kill(proc.pid, signal.SIGSTOP)            # alive, connection open, silent
    try:
        time.sleep(0.6)                          # heartbeat interval 0.2 s here
        ps = prompts(6, seed=5)
        got = ask(tiny_router.addr, ps, 8)
        with Client(tiny_router.addr) as c:
            after = {k: r["requests_routed"] for k, r in c.stats()["replicas"].items()}
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert [g.token_ids for g in got] == offline(tiny_llm, ps, 8)
    assert after["0"] == before["0"] and after["1"] == before["1"] + 6
    tiny_router.wait_serving(2)                  # answering again: back in the rotation


def test_a_killed_replica_leaves_requests_completed_or_cleanly_failed_and_comes_back(tiny_router, tiny_llm):
    ps = prompts(16, seed=3)
    results: list = []

    def load():
        results.extend(ask(tiny_router.addr, ps[:8], 400, stream=True))
    streaming = threading.Thread(target=load)
    held = [None]

    def load_held():                   # not streamed: nothing reaches the client before the final
        held[0] = ask(tiny_router.addr, ps[8:], 400, stream=False)
    holding = threading.Thread(target=load_held)
    streaming.start()
    holding.start()
    slot = busiest_replica(tiny_router.addr)    # kill one that holds requests, whatever routing chose
    victim = tiny_router.pool.procs[slot].proc.pid
    os.kill(victim, signal.SIGKILL)
    streaming.join(120)
    holding.join(120)
    everything = results + held[0]
    assert len(everything) == 16
    expected = offline(tiny_llm, ps, 400)
    failed = 0
    for i, r in enumerate(everything):
        assert not isinstance(r, Exception), r
        if r.finish_reason == "error":
            failed += 1
            assert "was lost" in r.error and "send the request again" in r.error
        else:
            assert r.finish_reason == "length" and r.token_ids == expected[i]
    assert all(r.finish_reason == "length" for r in held[0])      # never streamed: retried elsewhere
    s = tiny_router.wait_serving(2)
    assert s["routing"]["replicas_lost"] >= 1 and s["routing"]["requests_retried"] + failed >= 1
    assert tiny_router.pool.procs[slot].proc.pid != victim
    again = ask(tiny_router.addr, ps[:4], 8)
    assert [g.token_ids for g in again] == offline(tiny_llm, ps[:4], 8)


def test_scaling_up_and_down_while_serving_loses_no_request(tiny_router, tiny_llm):
    with Client(tiny_router.addr) as c:
        assert c.scale(1) == 2
    tiny_router.wait_serving(1)
    ps = prompts(24, seed=4)
    results: list = []
    load = threading.Thread(target=lambda: results.extend(ask(tiny_router.addr, ps, 200)))
    load.start()
    with Client(tiny_router.addr) as c:
        assert c.scale(2) == 1
        tiny_router.wait_serving(2)
        assert c.scale(1) == 2           # drains one while the load may still run on it
    load.join(180)
    assert [r.token_ids for r in results] == offline(tiny_llm, ps, 200)
    s = tiny_router.wait_serving(1)
    assert s["routing"]["scale_events"] >= 4 and len(tiny_router.pool.stopped) >= 2
    with Client(tiny_router.addr) as c:
        c.scale(2)
    tiny_router.wait_serving(2)


def test_http_is_ready_only_once_a_replica_describes_the_model():
    """The HTTP front end's /health: a router answers pings before any replica serves; readiness waits
    for the model's description, which the router has once a replica is up."""
    import asyncio

    from rawinfer.frontends.http.engine_link import EngineLink
    from rawinfer.frontends.http.errors import APIError

    class Router:                        # the two calls readiness makes, as a router answers them
        serving = False

        async def ping(self):
            return 0.001

        async def model_info(self):
            if not self.serving:
                raise RequestError("overloaded", "no replica is serving yet; retry when one has loaded the model")
            return {"model": "m", "vocab_size": 512}

        def close(self):
            pass

    link = EngineLink("tcp://127.0.0.1:9")
    link.client.close()
    link.client = Router()
    assert asyncio.run(link.ready()) is False
    with pytest.raises(APIError, match="not ready: no replica is serving yet"):
        asyncio.run(link.info())
    link.client.serving = True
    assert asyncio.run(link.ready()) is True and asyncio.run(link.info())["model"] == "m"
