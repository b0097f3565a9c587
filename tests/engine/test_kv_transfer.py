"""KV transfer between two engines in one process (engine/kv_transfer.py): a prompt prefilled by one engine,
its blocks' bytes written into blocks another reserved, generation there equal to a colocated engine's;
aborts, cancels and bad data leave no block behind on either side."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer import LLMEngine, SamplingParams
from rawinfer.engine.kv_transfer import Fingerprint

OPTS = dict(device="cpu", kv_cache_memory="4MiB", max_num_batched_tokens=256, max_num_seqs=32, warmup=False)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return LLMEngine(tiny_llama_dir, **OPTS), LLMEngine(tiny_llama_dir, **OPTS), LLMEngine(tiny_llama_dir, **OPTS)


def drain(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def transfer(prefill, decode, rid, prompt, params) -> int:
    """Queue rid on decode, prefill it remotely through bytes; returns the blocks that travelled (0: local)."""
    decode.add_request(rid, prompt, params)
    r = decode.kv_transfer.reserve(rid)
    if r is None:
        return 0
    prefill.kv_transfer.add_export(rid, prompt, r.start_block)
    drain(prefill)
    (exp,) = prefill.kv_transfer.take_ready()
    assert exp.num_blocks == len(r.block_ids) and exp.num_tokens == len(prompt) - 1
    for layer, arr in enumerate(exp.layers):
        decode.kv_transfer.write(rid, layer, memoryview(arr.tobytes()))
    decode.kv_transfer.complete(rid)
    return exp.num_blocks


def assert_clean(*engines):
    for e in engines:
        e.scheduler.check_invariants()
        s = e.stats()
        assert s["kv_blocks_used"] == 0 and s["receiving_kv"] == 0, s


def test_transferred_prompts_generate_what_a_colocated_engine_does(engines):
    colo, prefill, decode = engines
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 500, 40).tolist()
    prompts = [rng.integers(3, 500, int(rng.integers(2, 70))).tolist() for _ in range(10)]
    prompts += [shared + rng.integers(3, 500, int(rng.integers(1, 30))).tolist() for _ in range(6)]
    prompts += [[7, 8, 9], [5], list(range(10, 42)), list(range(10, 43))]     # under a block, 1 token, 2 and 2+1 blocks
    want = {}
    for i, p in enumerate(prompts):
        colo.add_request(f"r{i}", p, SamplingParams(max_tokens=6, **GREEDY))
    want = drain(colo)
    moved = 0
    for i, p in enumerate(prompts):
        moved += transfer(prefill, decode, f"r{i}", p, SamplingParams(max_tokens=6, **GREEDY))
    got = drain(decode)
    assert got == want
    assert moved > 0 and decode.stats()["prefix_cache_hit_tokens"] > 0      # the shared prefix did not travel
    assert_clean(prefill, decode)


def test_abort_while_receiving_and_cancel_free_every_block(engines):
    _, prefill, decode = engines
    prompt = list(range(20, 90))
    decode.add_request("a", prompt, SamplingParams(max_tokens=3, **GREEDY))
    assert decode.kv_transfer.reserve("a") is not None and decode.stats()["receiving_kv"] == 1
    assert decode.stats()["kv_blocks_used"] > 0
    outs = decode.abort("a")
    assert outs and outs[0].finish_reason == "abort"
    with pytest.raises(ValueError, match="not waiting for K/V"):
        decode.kv_transfer.write("a", 0, b"")
    assert_clean(decode)
    # cancel: the request prefills locally and still produces its tokens
    decode.add_request("b", prompt, SamplingParams(max_tokens=3, **GREEDY))
    decode.kv_transfer.reserve("b")
    decode.kv_transfer.write("b", 0, bytes(decode.kv_transfer.block_bytes(5) // decode.model_config.num_layers))
    with pytest.raises(ValueError, match="lacks"):
        decode.kv_transfer.complete("b")
    assert decode.kv_transfer.cancel("b")
    assert len(drain(decode)["b"]) == 3
    prefill.kv_transfer.add_export("x", prompt, 0)
    prefill.kv_transfer.abort_export("x")
    assert_clean(prefill, decode)


def test_discard_all_empties_the_transfers_the_link_holds(engines):
    """The last resort after a failed step: the engine starts over, and the KVTransfer object a decode link
    took at its start (the same object) forgets the reservations and exports of the discarded requests."""
    _, prefill, decode = engines
    link_side, prompt = decode.kv_transfer, list(range(30, 100))
    decode.add_request("d", prompt, SamplingParams(max_tokens=3, **GREEDY))
    assert link_side.reserve("d") is not None and link_side.is_receiving("d")
    prefill.kv_transfer.add_export("e", prompt, 0)
    for e in (decode, prefill):
        e.discard_all()
    assert decode.kv_transfer is link_side and not link_side.is_receiving("d")
    assert not prefill.kv_transfer.take_ready() and not prefill.has_unfinished()
    assert transfer(prefill, decode, "d2", prompt, SamplingParams(max_tokens=3, **GREEDY)) > 0
    assert len(drain(decode)["d2"]) == 3
    assert_clean(prefill, decode)


def test_bad_bytes_are_refused_and_nothing_leaks(engines):
    _, _, decode = engines
    decode.add_request("c", list(range(30, 80)), SamplingParams(max_tokens=2, **GREEDY))
    decode.kv_transfer.reserve("c")
    with pytest.raises(ValueError, match="bytes of K/V"):
        decode.kv_transfer.write("c", 0, b"\0" * 12)
    with pytest.raises(ValueError, match="outside the model"):
        decode.kv_transfer.write("c", 99, b"")
    decode.kv_transfer.cancel("c")
    drain(decode)
    assert_clean(decode)


def test_fingerprint_mismatch_names_both_values(engines, tiny_qwen2_dir):
    colo, prefill, _ = engines
    a = prefill.kv_transfer.fingerprint
    assert a == colo.kv_transfer.fingerprint and Fingerprint.from_dict(a.to_dict()) == a
    other = LLMEngine(tiny_qwen2_dir, **OPTS).kv_transfer.fingerprint
    msg = a.mismatch(other)
    assert "weights" in msg and a.weights in msg and other.weights in msg
    import dataclasses                                   # K/V of the same layout from other arithmetic
    assert "int8_activations False here vs True there" in a.mismatch(dataclasses.replace(a, int8_activations=True))
    with pytest.raises(ValueError, match="exactly the fields"):
        Fingerprint.from_dict({"weights": "x"})


def test_short_or_fully_cached_prompts_stay_local(engines):
    _, _, decode = engines
    decode.add_request("s", [4, 5, 6], SamplingParams(max_tokens=1, **GREEDY))
    assert decode.kv_transfer.reserve("s", min_tokens=3) is None
    decode.add_request("lp", list(range(40)), SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY))
    assert decode.kv_transfer.reserve("lp") is None
    drain(decode)
    assert_clean(decode)
