"""Structured output (engine/structured.py): real llguidance grammars on the engine, through LLM.generate / chat
and LLMEngine.add_request / step.

Two models: SmolLM2 (the default model, conftest's smollm2_engine) for outputs a real model writes (JSON that
must validate against its schema), and a tiny random Llama with SmolLM2's tokenizer and a vocabulary padded
past it (V = 49152 + 40, not a multiple of 32) for the rules: every output follows its grammar whatever the
weights say, padding ids are never sampled, batch invariance, n > 1, preemption, aborts, errors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import jsonschema
import numpy as np
import pytest

from conftest import DATA, SMOLLM2_DIR
from rawinfer import LLM, LLMEngine, SamplingParams
from rawinfer.engine.engine import RequestRejected
from rawinfer.engine.structured import GrammarError, drop_eos, spec_key

PAD = 40                      # ids past SmolLM2's 49152 that the tiny model's head has
TOKENIZER_VOCAB = 49152

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "email": {"type": "string", "maxLength": 16},                     # optional
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "paid"],
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object", "additionalProperties": False,
                                            "required": ["sku", "qty"],
                                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                        "paid": {"type": "boolean"}, "note": {"anyOf": [{"type": "null"}, {"enum": ["gift", "rush"]}]}}}
SCORE = {"type": "object", "additionalProperties": False, "required": ["score", "label"],
         "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                        "label": {"enum": ["positive", "negative", "neutral"]}}}
SCHEMAS = [PERSON, ORDER, SCORE]


@pytest.fixture(scope="session")
def padded_vocab_dir(tmp_path_factory) -> str:
    """tests/data/tiny-llama with random embeddings and head for V = 49152 + PAD ids, converted, with the
    default model's tokenizer.json beside it (EOS id 2 in both)."""
    from safetensors.numpy import load_file, save_file

    from rawinfer.convert import convert
    src = tmp_path_factory.mktemp("hf") / "tiny-padded"
    src.mkdir()
    with open(os.path.join(DATA, "tiny-llama", "config.json")) as f:
        cfg = json.load(f)
    V = TOKENIZER_VOCAB + PAD
    cfg["vocab_size"], cfg["max_position_embeddings"] = V, 2048
    (src / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(os.path.join(DATA, "tiny-llama", "model.safetensors"))
    rng = np.random.default_rng(0)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        tensors[name] = (rng.standard_normal((V, cfg["hidden_size"])) * 0.5).astype(np.float32)
    save_file(tensors, str(src / "model.safetensors"))
    dst = str(tmp_path_factory.mktemp("models") / "tiny-padded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(str(src), dst, progress=False)
    shutil.copy(os.path.join(SMOLLM2_DIR, "tokenizer.json"), dst)
    return dst


@pytest.fixture(scope="module")
def tiny(padded_vocab_dir) -> LLM:
    return LLM(padded_vocab_dir, device="cpu", kv_cache_memory="64MiB", max_num_seqs=16)


@pytest.fixture(scope="module")
def smol(smollm2_engine) -> LLM:
    return LLM.from_engine(smollm2_engine)


def greedy(n: int = 64, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def prompts(k: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(100, 40000, int(rng.integers(3, 20)))] for _ in range(k)]


# ---- every output follows its grammar ------------------------------------------------------------------------
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "order", "score"])
def test_json_schema_outputs_of_the_real_model_validate(smol, schema):
    msgs = [[{"role": "user", "content": f"Write one JSON example for this schema: {json.dumps(schema)}"}],
            [{"role": "user", "content": "Reply in JSON."}]]
    sampled = SamplingParams(max_tokens=200, temperature=0.9, seed=3, n=2, structured_outputs={"json": schema})
    for r in smol.chat(msgs, greedy(200, structured_outputs={"json": schema}), use_tqdm=False) + \
            smol.chat(msgs[:1], sampled, use_tqdm=False):
        for c in r.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)


def test_random_weights_still_follow_every_kind_of_grammar(tiny):
    """The tiny model's weights are noise: whatever it would say, the mask keeps it inside the grammar, and
    a padding id (past the tokenizer) is never sampled even when biased up."""
    kinds = [({"json": s}, lambda t, s=s: jsonschema.validate(json.loads(t), s)) for s in (PERSON, ORDER)] + [
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
        ({"regex": r"[0-9]{3}-[a-f]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-f]{2,4}", t) or pytest.fail(t)),
        ({"choice": ["yes", "no", 'say "maybe"']}, lambda t: t in ("yes", "no", 'say "maybe"') or pytest.fail(t)),
        ({"grammar": 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'},
         lambda t: re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3})*", t) or pytest.fail(t)),
        ({"grammar": 'root ::= "a" ("b" | "c")+'}, lambda t: re.fullmatch("a[bc]+", t) or pytest.fail(t)),   # GBNF
    ]
    bias = {TOKENIZER_VOCAB + 3: 100.0, TOKENIZER_VOCAB + PAD - 1: 100.0}
    for so, check in kinds:
        ps = [greedy(300, structured_outputs=so, logit_bias=bias),
              SamplingParams(max_tokens=300, temperature=1.0, seed=7, n=3, structured_outputs=so, logit_bias=bias)]
        for r in tiny.generate(prompts(2, seed=len(str(so))), ps, use_tqdm=False):
            for c in r.outputs:
                assert max(c.token_ids) < TOKENIZER_VOCAB
                fresh = tiny.engine.structured.compiler.compile(so).result().matcher().matcher
                assert fresh.consume_tokens(c.token_ids), (so, c.text)      # a prefix of a match, at least
                if c.finish_reason == "stop":       # else an open-ended grammar ran to max_tokens
                    check(c.text)
                    assert fresh.is_accepting()


def test_ignore_eos_and_min_tokens_never_force_a_forbidden_token(tiny):
    """EOS is masked where the request would ignore it, unless the grammar allows nothing else: a grammar
    that may go on goes on to max_tokens; a complete one ends the sample before min_tokens."""
    open_ended = tiny.generate(prompts(1), greedy(12, ignore_eos=True, structured_outputs={"regex": "x+"}),
                               use_tqdm=False)[0]
    assert open_ended.finish_reason == "length" and len(open_ended.token_ids) == 12
    assert set(open_ended.text) == {"x"}
    closed = tiny.generate(prompts(1), greedy(12, min_tokens=10, structured_outputs={"choice": ["yes", "no"]}),
                           use_tqdm=False)[0]
    assert closed.finish_reason == "stop" and closed.text in ("yes", "no") and len(closed.token_ids) < 10


def test_drop_eos_keeps_eos_when_it_is_all_the_grammar_allows():
    row = np.zeros(4, np.int32)
    row[0] = 1 << 2                                     # EOS (id 2) alone
    drop_eos(row, [2])
    assert row[0] == 4
    row[3] = np.int32(-2**31)                           # id 127 too: EOS goes
    drop_eos(row, [2])
    assert row[0] == 0 and row[3] == np.int32(-2**31)


def test_stop_strings_and_logprobs_compose_with_a_grammar(tiny):
    r = tiny.generate(prompts(1), greedy(20, stop=["-"], logprobs=2, structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"}),
                      use_tqdm=False)[0]
    assert r.finish_reason == "stop" and re.fullmatch("[0-9]{1,3}", r.text), r.text
    lp = r.outputs[0].logprobs                          # of the raw logits: finite, alternatives the grammar forbids
    assert np.isfinite(lp.logprobs).all() and np.isfinite(np.asarray(lp.top_logprobs)).all()


# ---- scheduling: batch invariance, forks, preemption, prefix cache, chunked prefill ---------------------------
def test_greedy_output_does_not_depend_on_the_batch(tiny):
    ps = prompts(6, seed=5)
    kinds = [{"json": PERSON}, None, {"regex": "[a-z]{2,9}( [a-z]{2,9}){0,5}"}, None, {"json": ORDER},
             {"choice": ["alpha", "beta"]}]
    params = [greedy(48, ignore_eos=so is None, structured_outputs=so) for so in kinds]
    alone = [tiny.generate([p], [sp], use_tqdm=False)[0].token_ids for p, sp in zip(ps, params)]
    batch = [r.token_ids for r in tiny.generate(ps, params, use_tqdm=False)]
    assert batch == alone
    plain = tiny.generate(ps[1], greedy(48, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert batch[1] == plain                            # an unconstrained row is never masked


def test_forks_each_get_their_own_matcher(tiny):
    p = SamplingParams(max_tokens=200, temperature=1.0, seed=11, n=4, structured_outputs={"json": ORDER})
    r = tiny.generate(prompts(1, seed=9), p, use_tqdm=False)[0]
    texts = [c.text for c in r.outputs]
    for t in texts:
        jsonschema.validate(json.loads(t), ORDER)
    assert len(set(texts)) > 1


def test_preemption_and_a_small_pool_change_nothing(padded_vocab_dir, tiny):
    """A pool too small for the batch preempts sequences (their output tokens are kept and recomputed) and a
    budget of 8 tokens a step chunks the prompts: the matchers never consume a token twice and a chunk
    samples nothing, so the outputs equal the roomy engine's."""
    ps = prompts(6, seed=21)
    params = [greedy(160, structured_outputs={"json": PERSON}) if i % 2 else
              greedy(160, ignore_eos=True, structured_outputs={"regex": "[a-z ]+"}) for i in range(6)]
    want = [r.token_ids for r in tiny.generate(ps, params, use_tqdm=False)]
    small = LLM(padded_vocab_dir, device="cpu", kv_cache_memory=24 * 16 * 512, max_num_batched_tokens=8,
                warmup=False)                         # 24 blocks of 16 tokens (512 bytes of K/V per token)
    got = [r.token_ids for r in small.generate(ps, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == want
    again = [r.token_ids for r in small.generate(ps[:2], params[:2], use_tqdm=False)]   # prefix-cache hits
    assert again == want[:2] and small.engine.block_manager.stats.hit_tokens > 0


# ---- compiling: off the engine thread, cached, errors -------------------------------------------------------
def test_a_request_waits_for_its_grammar_while_the_others_step(tiny):
    eng = tiny.engine
    wide = {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}$"} for i in range(120)}
    schema = {**PERSON, "properties": {**PERSON["properties"], **wide}}    # not compiled yet: tens of ms
    eng.add_request("plain", prompts(1)[0], greedy(3, ignore_eos=True))
    eng.add_request("held", prompts(1)[0], greedy(200, structured_outputs={"json": schema}))
    assert "held" in eng.structured.held
    seen, texts = [], {"held": ""}
    while eng.has_unfinished():
        for o in eng.step():
            seen.append(o.request_id)
            texts[o.request_id] = texts.get(o.request_id, "") + o.text_delta
    assert not eng.structured.held and seen.count("plain") == 3
    jsonschema.validate(json.loads(texts["held"]), schema)
    assert eng.structured.compiler.compile({"json": json.dumps(schema)}).done()    # cached, as a string too


def test_a_grammar_that_does_not_compile_is_one_clear_error(tiny):
    eng = tiny.engine
    bad = {"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}
    with pytest.raises(RequestRejected, match=r"prompt 0: structured_outputs 'json' does not compile: .*strin"):
        tiny.generate(prompts(1), greedy(5, structured_outputs=bad), use_tqdm=False)
    with pytest.raises(RequestRejected, match="structured_outputs 'json' does not compile"):     # cached failure
        eng.add_request("again", prompts(1)[0], greedy(5, structured_outputs=bad))
    eng.add_request("regex", prompts(1)[0], SamplingParams(n=2, structured_outputs={"regex": "a(b"}))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [(o.index, o.finished, o.finish_reason) for o in outs] == [(0, True, "error"), (1, True, "error")]
    assert "structured_outputs 'regex' does not compile" in outs[0].error and "unclosed group" in outs[0].error
    assert eng.num_requests == 0


def test_abort_while_held_or_running_frees_everything(tiny):
    eng = tiny.engine
    eng.add_request("held", prompts(1)[0], greedy(30, structured_outputs={"json": {**ORDER, "title": "new"}}))
    eng.add_request("running", prompts(1)[0], greedy(30, structured_outputs={"regex": "[a-z]+"}))
    eng.step()
    assert [o.finish_reason for o in eng.abort("held") + eng.abort("running")] == ["abort", "abort"]
    assert not eng.structured.held and eng.num_requests == 0 and not eng.has_unfinished()
    assert eng.block_manager.num_used_blocks == 0


def test_structured_outputs_is_checked_by_name():
    with pytest.raises(ValueError, match=r"structured_outputs=.* exactly one of the keys json, json_object, regex"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
    with pytest.raises(ValueError, match=r"structured_outputs=.*'choice' is a non-empty list"):
        SamplingParams(structured_outputs={"choice": []})
    assert spec_key({"json": '{"b": 1, "a": 2}'}) == spec_key({"json": {"a": 2, "b": 1}})
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tiny_llama_dir):
    eng = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", warmup=False)
    with pytest.raises(RequestRejected, match="structured_outputs needs the model's tokenizer"):
        eng.add_request("r", [5, 6, 7], SamplingParams(structured_outputs={"regex": "a"}))
    assert isinstance(GrammarError("x"), ValueError)


def test_bench_throughput_structured_output_runs_both_workloads(tiny, capsys):
    from rawinfer.frontends.bench.throughput import make_workload, run_structured
    r = run_structured(tiny.engine, make_workload(4, 8, 6, 0.0, tiny.engine.model_config.vocab_size, 0))
    assert r["unconstrained"]["output_tokens"] == r["constrained"]["output_tokens"] == 24   # no grammar ended early
    assert r["grammar_compile_ms"] > 0 and r["mask_ms_per_step"] > 0 and r["decode_tokens_ratio"] > 0
    assert "% of decode tokens/s" in capsys.readouterr().out


@pytest.mark.gpu
def test_on_cuda_outputs_follow_their_grammar(padded_vocab_dir):
    """The device path: the mask filled on a thread during the forward pass, applied by grammar_mask.cu,
    greedy argmax and filtered draws on the device (skipped without a GPU)."""
    from rawinfer.backend.cuda.runtime import cuda_status
    usable, why = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {why}")
    llm = LLM(padded_vocab_dir, device="cuda", kv_cache_memory="64MiB", warmup=False)
    bias = {TOKENIZER_VOCAB + 3: 100.0}
    params = [greedy(300, structured_outputs={"json": PERSON}, logit_bias=bias),
              SamplingParams(max_tokens=300, temperature=1.0, seed=2, n=3, structured_outputs={"json": ORDER}),
              greedy(300, structured_outputs={"regex": "[0-9]{3}-[a-f]{2,4}"}), greedy(48, ignore_eos=True)]
    out = llm.generate(prompts(4, seed=3), params, use_tqdm=False)
    for r, schema in zip(out[:2], (PERSON, ORDER)):
        for c in r.outputs:
            assert c.finish_reason == "stop" and max(c.token_ids) < TOKENIZER_VOCAB
            jsonschema.validate(json.loads(c.text), schema)
    assert re.fullmatch("[0-9]{3}-[a-f]{2,4}", out[2].text) and len(out[3].token_ids) == 48
