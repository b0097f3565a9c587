"""The decode role behind the ZeroMQ client server, a prefill instance in its own process: clients get the
colocated engine's tokens, the K/V come from the other process; SIGKILL of that process mid-run leaves
every request completed (policy recompute) and no block held."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from rawinfer import LLM, LLMEngine, SamplingParams
from rawinfer.frontends.disagg.connector import DecodeConfig, DecodeConnector
from rawinfer.frontends.client.client import Client
from rawinfer.frontends.server.server import Server, ServerConfig

from conftest import free_port, start_prefill

OPTS = dict(device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256, warmup=False)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_decode_server_with_a_prefill_process_that_gets_killed(tiny_llama_dir):
    addr, paddr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = start_prefill(tiny_llama_dir, paddr, OPTS)
    decode = LLMEngine(tiny_llama_dir, **OPTS)
    conn = DecodeConnector(decode, DecodeConfig(prefill=[paddr], min_remote_tokens=16, heartbeat_s=0.05,
                                                peer_timeout_s=0.5, transfer_timeout_s=3.0))
    server = Server(decode, ServerConfig(bind=addr, heartbeat_interval_s=0.1), kv_connector=conn)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    prompts = [list(range(20 + i, 60 + 3 * i)) for i in range(8)]
    want = [r.token_ids for r in LLM(tiny_llama_dir, **OPTS).generate(
        prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)]
    try:
        with Client(addr, timeout_s=30) as c:
            end = time.monotonic() + 20
            while not conn.peers_up():
                assert time.monotonic() < end, "the prefill instance never answered a heartbeat"
                time.sleep(0.05)
            got = [c.complete(p, params={"max_tokens": 8, **GREEDY}).token_ids for p in prompts[:4]]
            assert got == want[:4] and conn.counters["remote"] == 4
            # the prefill process's own gauges, from its heartbeats: four prompts sent, no block kept there
            end = time.monotonic() + 10
            want_p = {"prefills": 4, "kv_blocks_used": 0, "sent_bytes": conn.counters["bytes"]}
            while {k: (p := c.stats()["prefill_instances"][0]).get(k) for k in want_p} != want_p:
                assert time.monotonic() < end, p
                time.sleep(0.05)
            assert p["up"] and p["addr"] == paddr and p["running"] == p["waiting"] == p["backlog"] == 0, p
            assert p["kv_blocks_total"] > 0, p
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            its = [c.generate(p, params={"max_tokens": 8, **GREEDY}, stream=False) for p in prompts[4:]]
            got = [[t for m in it for t in m.token_ids] for it in its]
            assert got == want[4:]
            s = c.stats()
            assert s["kv_blocks_used"] == 0 and s["receiving_kv"] == 0
            assert s["kv_transfer"]["remote"] == conn.counters["remote"] >= 4 and s["kv_transfer"]["bytes"] > 0
            assert not s["prefill_instances"][0]["up"]
        assert conn.counters["bytes"] > 0 and conn.peers_up() == []
        assert conn.counters["fallbacks"] + conn.counters["local"] >= 4     # the last four: prefilled here
    finally:
        proc.kill()
        server.shutdown()
        thread.join(10)
    decode.scheduler.check_invariants()
