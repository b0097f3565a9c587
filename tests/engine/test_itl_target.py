"""The inter-token target on a real engine: the warm-up seeds the step-cost model and every step refines it;
a target prefill cannot meet cuts a long prompt into one-block chunks beside a decoding stream, where target 0
(the fixed token budget) takes it whole, and the greedy tokens are the same either way; by default a 2,048-token
prompt beside a decoding stream on SmolLM2 goes in chunks (issue 50); bad values are refused by name."""

from __future__ import annotations

import argparse

import pytest

from rawinfer import LLMEngine, SamplingParams
from rawinfer.config import EngineConfig
from rawinfer.frontends.options import CLIError, add_engine_args, engine_config_from_args

GREEDY = dict(temperature=0.0, ignore_eos=True)


def chunks_beside_a_decode(engine: LLMEngine) -> tuple[list[int], dict[str, list[int]]]:
    """'short' decodes while 'long' (200 prompt tokens) prefills: the chunks of 'long', and every output."""
    chunks, tokens = [], {"short": [], "long": []}
    real = engine.scheduler.schedule

    def schedule(*args):
        batch = real(*args)
        chunks.extend(s.num_new_tokens for s in batch.seqs if s.seq.request_id == "long" and s.num_new_tokens > 1)
        return batch
    engine.scheduler.schedule = schedule
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=40, **GREEDY))
    for o in engine.step():
        tokens[o.request_id] += o.new_token_ids
    engine.add_request("long", list(range(1, 201)), SamplingParams(max_tokens=8, **GREEDY))
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    return chunks, tokens


def test_warm_up_seeds_the_step_cost_and_steps_refine_it(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256)
    cost = engine.scheduler.step_cost
    assert cost.usable() and cost.num_observed >= 5
    seeded = cost.num_observed
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert cost.num_observed == seeded + 4 and engine.scheduler.step_cost is cost


def test_a_target_prefill_cannot_meet_leaves_one_block_a_step_and_the_same_tokens(tiny_llama_dir):
    """batch_invariant: every chunking rounds alike, so the tokens must be equal to the bit."""
    opts = dict(device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256, block_size=16, batch_invariant=True)
    tight, tight_tokens = chunks_beside_a_decode(LLMEngine(tiny_llama_dir, itl_target_ms=1e-6, **opts))
    fixed, fixed_tokens = chunks_beside_a_decode(LLMEngine(tiny_llama_dir, itl_target_ms=0, **opts))
    assert fixed == [200]
    assert tight == [16] * 12 + [8]
    assert tight_tokens == fixed_tokens and len(tight_tokens["long"]) == 8


def test_by_default_a_long_prompt_never_stalls_a_decoding_stream(smollm2_dir):
    """Issue 50's finding on the real model: a 2,048-token prompt arriving beside a decoding stream went into
    one step, which the stream waited for. With the default (automatic) target it goes in chunks (each worth
    about a decode step of half of max_num_seqs rows: a few dozen tokens on a CPU) and the stream gets a token
    in every step meanwhile."""
    engine = LLMEngine(smollm2_dir, device="cpu", kv_cache_memory="256MiB")
    chunks, tokens = [], []
    real = engine.scheduler.schedule

    def schedule(*args):
        batch = real(*args)
        new = {s.seq.request_id: s.num_new_tokens for s in batch.seqs}
        if "long" in new:                                   # max_tokens 1: every step of it is a prefill chunk
            chunks.append(new["long"])
            assert new.get("short") == 1                    # the stream advances in every such step
        return batch
    engine.scheduler.schedule = schedule
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=200, **GREEDY))
    engine.step()
    engine.add_request("long", list(range(100, 2148)), SamplingParams(max_tokens=1, **GREEDY))
    while "long" in engine._requests:
        tokens += [t for o in engine.step() if o.request_id == "short" for t in o.new_token_ids]
    assert sum(chunks) == 2048 and len(chunks) >= 4 and max(chunks) <= 1024, chunks
    assert len(tokens) >= len(chunks)


def test_bad_targets_are_refused_by_name(capsys):
    for bad in (-1, float("nan"), float("inf"), "10", True):
        with pytest.raises(ValueError, match=f"^engine option itl_target_ms={bad!r} is invalid: it must be a number "
                                             r"of milliseconds >= 0 \(0: off\) or None \(auto\)$"):
            EngineConfig(itl_target_ms=bad).validate()
    assert EngineConfig(itl_target_ms=0).validate().itl_target_ms == 0
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--itl-target-ms", "80"])).itl_target_ms == 80
    assert engine_config_from_args(p.parse_args([])).itl_target_ms is None
    with pytest.raises(SystemExit):                   # the option's check, as argparse's one line
        p.parse_args(["--itl-target-ms", "-5"])
    assert "argument --itl-target-ms: must be a number of milliseconds >= 0 (0: off), got -5" in capsys.readouterr().err
    args = p.parse_args([])
    args.itl_target_ms = -5.0                         # a caller that set it past the parser: named by its flag
    with pytest.raises(CLIError, match=r"^--itl-target-ms=-5.0 is invalid: it must be a number of milliseconds"):
        engine_config_from_args(args)
