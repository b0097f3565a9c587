"""The one-way step (LLMEngine.step): scoring as a request kind beside generation, forks scheduled by the
scheduler, and the prompt-only requests the scheduler finishes."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer import LLMEngine, SamplingParams
from rawinfer.engine.engine import RequestRejected

OPTS = dict(device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=64, max_num_seqs=8, warmup=False)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def drain(engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def tokens(outs, rid, index=0) -> list[int]:
    return [t for o in outs if (o.request_id, o.index) == (rid, index) for t in o.new_token_ids]


def test_a_scoring_request_comes_out_of_step_beside_generation(tiny_llama_dir):
    """add_score beside two generating requests: its logits come with its final output, equal to score() run
    alone, and the generated tokens equal those of a run without it."""
    engine = LLMEngine(tiny_llama_dir, **OPTS)
    ids = list(range(3, 40))
    alone = engine.score(ids, [20, 1, 16])
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", list(range(50, 70)), GREEDY)
    plain = drain(engine)
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_score("s", ids, [20, 1, 16])
    engine.add_request("b", list(range(50, 70)), GREEDY)
    with pytest.raises(RuntimeError, match="in flight; queue it with add_score"):
        engine.score(ids)
    outs = drain(engine)
    (final,) = [o for o in outs if o.request_id == "s"]
    assert final.finished and final.finish_reason == "length" and final.new_token_ids == []
    assert np.array_equal(final.scores, alone) and final.scores.shape == (37, engine.model_config.vocab_size)
    assert all(o.scores is None for o in outs if o.request_id != "s")
    assert tokens(outs, "a") == tokens(plain, "a") and tokens(outs, "b") == tokens(plain, "b")
    assert engine.num_requests == 0 and engine.block_manager.num_used_blocks == 0


def test_an_aborted_scoring_request_frees_its_blocks_and_sends_no_scores(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, **OPTS)
    engine.add_score("s", list(range(3, 40)), 10)
    assert engine.step() == []                             # the first of four chunks
    (out,) = engine.abort("s")
    assert out.finish_reason == "abort" and out.scores is None
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    with pytest.raises(RequestRejected, match="chunk_sizes cover 5 of 37 tokens"):
        engine.add_score("t", list(range(3, 40)), [5])
    with pytest.raises(RequestRejected, match="chunk sizes must be positive"):
        engine.add_score("t", [1, 2, 3], 0)


def test_forks_draw_their_first_token_in_the_step_that_computes_the_prompt(tiny_llama_dir):
    """n = 3: every sample's first token comes out of the prompt's step (the scheduler forked them), and each
    sample's tokens are those it draws when the request runs beside others."""
    engine = LLMEngine(tiny_llama_dir, **OPTS)
    params = SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=4, ignore_eos=True)
    engine.add_request("n", list(range(10, 30)), params)
    first = engine.step()
    assert sorted((o.index, len(o.new_token_ids)) for o in first) == [(0, 1), (1, 1), (2, 1)]
    assert [st.seq.seq_id for st in engine._requests["n"]] == ["n", ("n", 1), ("n", 2)]
    alone = first + drain(engine)
    engine.add_request("x", list(range(100, 140)), GREEDY)
    engine.add_request("n", list(range(10, 30)), params)
    engine.add_request("y", [7, 8], GREEDY)
    beside = drain(engine)
    assert all(tokens(beside, "n", i) == tokens(alone, "n", i) and len(tokens(alone, "n", i)) == 5 for i in range(3))
    assert len({tuple(tokens(alone, "n", i)) for i in range(3)}) > 1


def test_a_prompt_only_request_ends_every_sample_in_its_prompt_step(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, **OPTS)
    engine.add_request("p", list(range(10, 30)), SamplingParams(max_tokens=0, n=2, prompt_logprobs=1))
    engine.add_request("g", [5, 6], GREEDY)
    outs = engine.step()
    done = sorted((o.index, o.finish_reason, len(o.prompt_logprobs)) for o in outs if o.request_id == "p")
    assert done == [(0, "length", 19), (1, "length", 19)]
    assert [o.new_token_ids for o in outs if o.request_id == "g"] and engine.num_requests == 1
