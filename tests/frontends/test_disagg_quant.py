"""Prefill/decode disaggregation on the default model's quantized conversions: with --batch-invariant on
every engine, the greedy tokens through a prefill and a decode instance are the colocated engine's.

Without the option they may differ: the prefill instance cuts a prompt into chunks of its own step budget
and the decode instance recomputes the last prompt token alone, and the attention kernels round by the
number of queries in a step (docs/kernels.md); README promises bit-equal output only with the option."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer import LLMEngine
from rawinfer.frontends.disagg.connector import DecodeConfig, DecodeConnector
from rawinfer.frontends.disagg.prefill import PrefillConfig, PrefillServer

from test_disagg import FAST, assert_no_leak, colocated, generate, pump, reqs  # noqa: E402

OPTS = dict(device="cpu", kv_cache_memory="96MiB", max_num_batched_tokens=512, max_num_seqs=16, warmup=False,
            batch_invariant=True)


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_quantized_model_through_both_roles_equals_the_colocated_engine(quant, request):
    model = request.getfixturevalue(f"smollm2_{quant}_dir")
    # the prefill instance with its own step budget: it cuts a long prompt into other chunks than the
    # colocated engine does
    colo, dec = (LLMEngine(model, **OPTS) for _ in range(2))
    pre = LLMEngine(model, **{**OPTS, "max_num_batched_tokens": 2048})
    # random prompts of a scratch check against servers; without the option the int8 model's tokens for
    # the one of 900 (two chunks colocated, one step on the prefill side) differ from the second on. 129 is
    # one token into a block; 10 is prefilled on the decode side (under min_remote_tokens)
    rng = np.random.default_rng(1)
    drawn = [rng.integers(100, 49000, n).tolist() for n in (700, 900, 1500, 2048, 20, 130, 64, 65, 15, 300, 129)]
    prompts = [drawn[i] for i in (1, 10, 0, 5, 6, 9)] + [drawn[4][:10]]
    # one request at a time, as a client's lone requests (a lone sequence takes the fused few-row path)
    want = {}
    for r in reqs(prompts, "p", max_tokens=12):
        want.update(colocated(colo, [r]))
    server = PrefillServer(pre, PrefillConfig(bind="tcp://127.0.0.1:*"))
    conn = DecodeConnector(dec, DecodeConfig(prefill=[server.endpoint], **{**FAST, "transfer_timeout_s": 60.0,
                                                                           "peer_timeout_s": 30.0}))
    server.dead = False
    try:
        pump([server], conn, until=lambda: len(conn.peers_up()) == 1)
        got, failed = {}, []
        for r in reqs(prompts, "p", max_tokens=12):
            out, lost = generate([server], conn, [r], limit_s=60.0)
            got.update(out)
            failed += lost
    finally:
        conn.close()
        server.close()
    assert not failed and got == want
    assert conn.counters["remote"] == 6 and conn.counters["local"] == 1 and conn.counters["fallbacks"] == 0
    assert_no_leak(pre, dec)
