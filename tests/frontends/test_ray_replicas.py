"""`rawinfer serve --replicas 2` on a local Ray cluster of 2 CPUs with the default model (SmolLM2): what
a user runs. Greedy outputs equal one engine's; a replica killed mid-run leaves every request completed
or cleanly failed and Ray brings it back; scaling from 1 to 2 replicas and back loses no request.
Skipped when Ray is not installed (`pip install -e '.[ray]'`; tools/run_tests.sh installs it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rawinfer.frontends.client.client import Client

from cli_util import Server as ServerProcess, env, run_concurrently  # noqa: E402
from conftest import ROOT  # noqa: E402

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in Spanish.",
             "What do bees make?", "Name a planet.", "What is ice made of?", "Count to five."]
GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    srv = ServerProcess(smollm2_dir, "--replicas", "2", "--ray-num-cpus", "2", "--heartbeat-interval", "0.5",
                        kv="64MiB", RAY_AUTH_MODE="disabled")
    try:
        srv.wait_ready(timeout_s=300)
        wait_serving(srv.addr, 2)
        yield srv
    finally:
        srv.stop()                   # SIGTERM: the router stops the replicas and the Ray cluster it started


def wait_serving(addr: str, n: int, timeout_s: float = 300.0, not_pid: int | None = None) -> dict:
    """The router's stats once exactly n replicas serve (and none has pid not_pid)."""
    deadline = time.monotonic() + timeout_s
    with Client(addr, timeout_s=30) as c:
        while True:
            s = c.stats()
            reps = s["replicas"].values()
            if [r["state"] for r in reps] == ["up"] * n and all(r.get("pid") != not_pid for r in reps):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"not {n} replicas serving after {timeout_s} s: {s['replicas']}")
            time.sleep(0.25)


@pytest.fixture(scope="module")
def reference(smollm2_dir, cluster):
    """The prompts as token ids (rendered by the served model's chat template) and one engine's greedy answers."""
    from rawinfer import LLM, SamplingParams
    with Client(cluster.addr) as c:
        prompts = [c.tokenize(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
    llm = LLM(smollm2_dir, device="cpu", kv_cache_memory="64MiB")
    out = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    return prompts, [r.token_ids for r in out]


def ask_all(addr: str, prompts: list[list[int]]) -> list:
    """Each prompt as its own request, all at once: an Outcome each (or the exception)."""
    return run_concurrently(addr, prompts, GREEDY, timeout_s=120)


def test_greedy_outputs_through_two_ray_replicas_equal_one_engine(cluster, reference):
    prompts, expected = reference
    got = ask_all(cluster.addr, prompts)
    assert [g.token_ids for g in got] == expected
    with Client(cluster.addr) as c:
        s = c.stats()
    assert sorted(s["replicas"]) == ["0", "1"]
    assert all(r["requests_routed"] > 0 for r in s["replicas"].values()), s["replicas"]
    assert len({r["pid"] for r in s["replicas"].values()}) == 2 and os.getpid() not in {
        r["pid"] for r in s["replicas"].values()}


def test_killing_a_replica_process_mid_run(cluster, reference):
    prompts, expected = reference
    with Client(cluster.addr) as c:
        victim = c.stats()["replicas"]["0"]["pid"]
    results: list = []
    load = threading.Thread(target=lambda: results.extend(ask_all(cluster.addr, prompts * 2)))
    load.start()
    time.sleep(1.5)
    os.kill(victim, signal.SIGKILL)
    load.join(300)
    assert len(results) == 2 * len(prompts)
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), r
        if r.finish_reason == "error":
            assert "was lost" in r.error
        else:
            assert r.token_ids == expected[i % len(prompts)]
    s = wait_serving(cluster.addr, 2, not_pid=victim)            # Ray restarted the actor
    assert s["routing"]["replicas_lost"] >= 1
    assert [g.token_ids for g in ask_all(cluster.addr, prompts[:2])] == expected[:2]


def test_scaling_from_one_to_two_replicas_and_back_loses_no_request(cluster, reference):
    prompts, expected = reference
    scale = [sys.executable, "-m", "rawinfer", "scale", "--addr", cluster.addr]
    assert subprocess.run(scale + ["1"], capture_output=True, env=env(), cwd=ROOT, timeout=60).returncode == 0
    wait_serving(cluster.addr, 1)
    results: list = []
    load = threading.Thread(target=lambda: [results.extend(ask_all(cluster.addr, prompts)) for _ in range(3)])
    load.start()
    r = subprocess.run(scale + ["2"], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "replicas: 1 -> 2" in r.stdout, r.stderr
    wait_serving(cluster.addr, 2)
    assert subprocess.run(scale + ["1"], capture_output=True, env=env(), cwd=ROOT, timeout=60).returncode == 0
    load.join(300)
    assert [g.token_ids for g in results] == expected * 3
    s = wait_serving(cluster.addr, 1)
    assert s["routing"]["scale_events"] >= 4


def test_prefill_and_decode_pools_as_ray_actors(tiny_llama_dir):
    """--prefill-replicas: the prefill instances are actors too, and the decode replicas send them prompts;
    greedy outputs equal one engine's."""
    from rawinfer import LLM, SamplingParams
    srv = ServerProcess(tiny_llama_dir, "--replicas", "1", "--prefill-replicas", "1", "--ray-num-cpus", "2",
                        "--min-remote-tokens", "8", RAY_AUTH_MODE="disabled")
    try:
        srv.wait_ready(timeout_s=300)
        wait_serving(srv.addr, 1)
        prompts = [list(range(3 + k, 60 + k)) for k in range(6)]
        params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
        got, deadline = [], time.monotonic() + 60
        with Client(srv.addr, timeout_s=60) as c:
            for p in prompts:
                got.append(c.complete(p, params=params).token_ids)
            # the decode replica prefills locally until its link to the prefill instance is up
            k = 0
            while c.stats()["replicas"]["0"]["stats"]["kv_transfer"]["remote"] == 0 and time.monotonic() < deadline:
                k += 1                   # a new prompt each time: a cached one would be prefilled locally
                c.complete(list(range(100 + k, 160 + k)), params=params)
                time.sleep(0.2)
            transfers = c.stats()["replicas"]["0"]["stats"]["kv_transfer"]
    finally:
        srv.stop()
    llm = LLM(tiny_llama_dir, device="cpu", kv_cache_memory="16MiB")
    assert got == [r.token_ids for r in llm.generate(prompts, SamplingParams(**params), use_tqdm=False)]
    assert transfers["remote"] >= 1 and transfers["bytes"] > 0 and transfers["failed"] == 0


def test_a_replica_actor_logs_each_line_with_its_time_and_level():
    """A Ray actor's log lines (its engine's, its server's) carry their time and level as `rawinfer serve`'s do:
    the log of a replica is read after the fact too. Runs the actors' set-up in this process (no cluster)."""
    import logging
    import re

    from rawinfer.config import EngineConfig
    from rawinfer.frontends.cluster.ray_pool import ReplicaSpec, _actor_setup
    from rawinfer.frontends.server.config import ServerConfig
    root = logging.getLogger()
    kept, level = root.handlers[:], root.level
    spec = ReplicaSpec("model", EngineConfig(), ServerConfig(), log_level=logging.WARNING)     # as with -q
    try:
        assert _actor_setup(spec, "replica 3", "127.0.0.1") == "127.0.0.1"
        record = logging.LogRecord("rawinfer", logging.WARNING, __file__, 1, "request %s finished", ("r1",), None)
        line = root.handlers[-1].format(record)
        assert root.level == logging.WARNING
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING rawinfer replica 3: request r1 finished",
                            line), line
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in kept:
            root.addHandler(h)
        root.setLevel(level)
