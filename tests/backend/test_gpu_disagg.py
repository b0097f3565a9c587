"""GPU suite (marker `gpu`), issue 20 end to end: a prefill instance on CUDA in its own process sends K/V
blocks (device -> pinned host -> ZeroMQ frames) to a decode server on CUDA in this one, which writes them
into device blocks it reserved. Clients get a colocated CUDA engine's greedy tokens; after the prefill
process is killed the decode side prefills locally (policy recompute) and no block is held on either
side. Skipped wherever no usable GPU or no pyzmq is present."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]
pytest.importorskip("zmq")

from conftest import DATA, free_port, start_prefill  # noqa: E402

# An explicit pool: two processes share the GPU, so neither may size its pool from all free memory.
OPTS = dict(device="cuda", kv_cache_memory="64MiB", max_num_batched_tokens=256, warmup=False)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> str:
    from rawinfer.convert import convert
    dst = str(tmp_path_factory.mktemp("gpu-disagg") / "tiny-llama-bf16")
    convert(os.path.join(DATA, "tiny-llama"), dst, dtype="bfloat16", progress=False)
    return dst


def test_cuda_decode_server_with_a_cuda_prefill_process(bf16_llama):
    from rawinfer import LLM, LLMEngine, SamplingParams
    from rawinfer.frontends.disagg.connector import DecodeConfig, DecodeConnector
    from rawinfer.frontends.client.client import Client
    from rawinfer.frontends.server.server import Server, ServerConfig

    addr, paddr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    # warmed up as `rawinfer serve --role prefill` is: a cold CUDA engine's first steps load modules and
    # pick cuBLAS algorithms, which can outlast a heartbeat
    proc = start_prefill(bf16_llama, paddr, {**OPTS, "warmup": True})
    prompts = [list(range(20 + i, 60 + 5 * i)) for i in range(8)]
    want = [r.token_ids for r in LLM(bf16_llama, **OPTS).generate(
        prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)]
    decode = LLMEngine(bf16_llama, **OPTS)
    conn = DecodeConnector(decode, DecodeConfig(prefill=[paddr], min_remote_tokens=16, heartbeat_s=0.05,
                                                peer_timeout_s=5.0, transfer_timeout_s=20.0))
    server = Server(decode, ServerConfig(bind=addr, heartbeat_interval_s=0.1), kv_connector=conn)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with Client(addr, timeout_s=60) as c:
            end = time.monotonic() + 30
            while not conn.peers_up():
                assert time.monotonic() < end, "the prefill instance never answered a heartbeat"
                time.sleep(0.05)
            got = [c.complete(p, params={"max_tokens": 8, **GREEDY}).token_ids for p in prompts[:4]]
            assert got == want[:4]
            assert conn.counters["remote"] == 4 and conn.counters["bytes"] > 0, conn.counters
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            got = [c.complete(p, params={"max_tokens": 8, **GREEDY}).token_ids for p in prompts[4:]]
            assert got == want[4:]
            s = c.stats()
            assert s["kv_blocks_used"] == 0 and s["receiving_kv"] == 0
            assert s["kv_transfer"]["remote"] >= 4 and s["kv_transfer"]["bytes"] > 0, s["kv_transfer"]
    finally:
        proc.kill()
        server.shutdown()
        thread.join(10)
    decode.scheduler.check_invariants()
