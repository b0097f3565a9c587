"""`rawinfer bench step-overhead`: the NullBackend computes nothing while the real engine steps over it (requests
run their whole max_tokens, their text detokenized), the benchmark's numbers per batch size, its instrumentation
put back afterwards, its refusals, and the command end to end."""

from __future__ import annotations

import json
import os

import pytest
from cli_util import rawinfer

from rawinfer.backend.null import NullBackend
from rawinfer.config import EngineConfig
from rawinfer.core import scheduler as core_scheduler
from rawinfer.engine.engine import LLMEngine
from rawinfer.frontends.bench import step_overhead as so
from rawinfer.sampling import SamplingParams


def _run_all(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(100):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if not engine.has_unfinished():
            return outs
    raise AssertionError("the requests did not finish")


def test_null_backend_computes_nothing_and_the_engine_runs_every_request_to_its_length(smollm2_dir):
    backend = NullBackend()
    engine = LLMEngine(smollm2_dir, EngineConfig(warmup=False, kv_cache_memory=16 << 20), backend=backend)
    assert engine.backend is backend
    word = engine.encode_prompt(" the")[-1]
    backend.token_id = word
    lengths = {"a": 3, "b": 7, "c": 12}
    for rid, n in lengths.items():     # prompts of different lengths, so that steps mix prefill and decode
        engine.add_request(rid, list(range(200, 200 + 5 * n)), SamplingParams(max_tokens=n, temperature=0,
                                                                               ignore_eos=True))
    outs = _run_all(engine)
    for rid, n in lengths.items():
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        assert tokens == [word] * n
        assert outs[rid][-1].finish_reason == "length"
        assert "".join(o.text_delta for o in outs[rid]) == " the" * n     # the detokenizer did its work
    assert backend.op_calls > 0                   # the forward passes called the ops...
    assert not engine.pool.arena.any()            # ...and nothing (weights, KV, activations, logits) was written


def test_null_backend_fills_every_abstract_op():
    assert not NullBackend.__abstractmethods__
    backend = NullBackend(token_id=7)
    assert backend.argmax(backend.alloc_arena(3 * 4).view("float32").reshape(3, 1)).tolist() == [7, 7, 7]


def test_measure_reports_each_batch_size_and_puts_the_engine_back(smollm2_dir):
    ecfg = so.engine_config(smollm2_dir, EngineConfig(), (1, 5), prompt_len=20, steps=3 + 6)
    assert ecfg.max_num_seqs >= 5 and not ecfg.warmup and ecfg.kv_cache_memory is not None
    engine = so.open_null_engine(smollm2_dir, ecfg)
    plan = core_scheduler.build_step_plan
    r = so.measure(engine, 5, steps=6, warmup_steps=3, prompt_len=20)
    assert r["batch"] == 5 and r["steps"] == 6
    s = r["step_ms"]
    assert 0 < s["min"] <= s["median"] <= s["p90"] <= s["max"]
    assert list(r["phases_mean_ms"]) == list(so.PHASES)
    assert sum(r["phases_mean_ms"].values()) == pytest.approx(s["mean"], rel=1e-6)
    for phase in ("schedule", "plan", "forward", "update", "sample", "outputs"):
        assert r["phases_mean_ms"][phase] > 0, phase
    # the requests are gone and the timers unwrapped: the engine runs as before
    assert engine.num_requests == 0 and not engine.has_unfinished()
    assert core_scheduler.build_step_plan is plan
    for obj, attr in ((engine.scheduler, "schedule"), (engine.runner, "run"), (engine, "_outputs")):
        assert attr not in vars(obj)
    assert so.measure(engine, 1, steps=2, warmup_steps=0, prompt_len=20)["steps"] == 2


def test_a_kv_region_too_small_for_the_batch_is_named(smollm2_dir):
    ecfg = so.engine_config(smollm2_dir, EngineConfig(kv_cache_memory=4 << 20), (8,), prompt_len=40, steps=4)
    engine = so.open_null_engine(smollm2_dir, ecfg)
    with pytest.raises(RuntimeError, match="cannot hold 8 decoding sequences at once; give a larger --kv-cache"):
        so.measure(engine, 8, steps=2, warmup_steps=2, prompt_len=40)
    assert engine.num_requests == 0


def test_engine_config_refusals(smollm2_dir):
    with pytest.raises(ValueError, match="needs --max-num-batched-tokens above 64"):
        so.engine_config(smollm2_dir, EngineConfig(max_num_batched_tokens=64), (1, 64), 8, 4)
    with pytest.raises(ValueError, match="do not fit the context of 100 tokens"):
        so.engine_config(smollm2_dir, EngineConfig(max_model_len=100), (1,), 90, 20)
    with pytest.raises(ValueError, match="plain decode steps"):
        so.engine_config(smollm2_dir, EngineConfig(speculative_method="ngram"), (1,), 8, 4)


def test_cli_step_overhead_end_to_end(tmp_path, tiny_llama_dir):
    # a model without a tokenizer: the sampled token is 0, its outputs carry no text
    out = os.path.join(str(tmp_path), "so.json")
    r = rawinfer("bench", "step-overhead", "--model", tiny_llama_dir, "--batch-sizes", "1,3", "--steps", "4",
                 "--warmup-steps", "1", "--prompt-len", "6", "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.load(open(out))
    assert res["backend"] == "null" and res["sampled_token"] == 0
    assert [x["batch"] for x in res["results"]] == [1, 3]
    for x in res["results"]:
        assert x["steps"] == 4 and x["step_ms"]["median"] > 0 and set(x["phases_mean_ms"]) == set(so.PHASES)
    assert res["config"]["batch_sizes"] == [1, 3]
    table = r.stdout.splitlines()
    assert table[1].split()[:4] == ["batch", "median", "ms", "p90"]
    assert [line.split()[0] for line in table[2:4]] == ["1", "3"]
    assert table[-1] == f"wrote {out}"
    bad = rawinfer("-q", "bench", "step-overhead", "--model", tiny_llama_dir, "--batch-sizes", "0,4")
    assert bad.returncode == 2 and "expected positive integers separated by commas" in bad.stderr
