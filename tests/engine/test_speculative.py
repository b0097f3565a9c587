"""Speculative decoding (engine/speculative.py): n-gram lookup, lossless verification, KV rollback and the
prefix cache's hygiene, the back-off, the counters.

Greedy and seeded outputs with speculation equal those without it token for token and log-probability for
log-probability: a sequence verifying k drafts runs as k + 1 decode rows (core/step_plan.py), and the decode
products are row-invariant, so each row's logits are the bits its own decode step would have had.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from rawinfer.core.block_hashes import BlockHashes
from rawinfer.engine.speculative import NgramProposer, ngram_lookup
from tests.engine.test_batch_invariance import FORMATS, model  # noqa: F401  (the fixture)

CODE = '''def free(self, seq_id):
    state = self._get(seq_id)
    del self._seqs[seq_id]
    for block in reversed(state.blocks):
        self._release(block)
'''
PROMPTS = ["Repeat this code exactly:\n" + CODE + "\nHere it is again:\n", "Count from 1 to 20: 1, 2, 3,",
           "Write a list of ten fruits, one per line:"]


@pytest.fixture(autouse=True)
def _free_engines():
    """Engines hold reference cycles (an engine and its KV transfer) around hundreds of MiB of arrays, which
    the garbage collector, counting objects rather than bytes, may leave for a long time: collect after each
    test, so the suite's memory does not grow with the engines this module builds."""
    yield
    gc.collect()


def _force_k(engine) -> None:
    """Every decoding sequence drafts K tokens, whatever the step-cost model would choose (no cycle: K only)."""
    k = engine.speculator.k
    engine.speculator.choose_k = lambda *_: k


def test_ngram_lookup_takes_the_latest_occurrence_of_the_longest_suffix():
    assert ngram_lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]          # suffix 1 2 3 at 0
    assert ngram_lookup([1, 2, 7, 5, 2, 8, 6, 1, 2], 2) == [7, 5]           # 1 2 (not just 2) decides
    assert ngram_lookup([5, 6, 1, 5, 6, 2, 5, 6], 4) == [2, 5, 6]           # the latest earlier 5 6
    assert ngram_lookup([1, 2, 3, 4], 3) == []                              # no earlier match
    assert ngram_lookup([4, 4, 4], 5) == [4]                                # overlapping match, cut at the end
    assert ngram_lookup([1, 2], 3) == [] and ngram_lookup([1, 2, 1, 2], 0) == []


def _generate(model_dir, prompts, params, always: bool = True, **opts):
    """Outputs of `prompts` (and the LLM); always: every decoding sequence speculates with K drafts, whatever the
    cost model would choose (the tests of losslessness want drafts in every batch)."""
    from rawinfer import LLM
    llm = LLM(model_dir, device="cpu", kv_cache_memory="256MiB", **opts)
    if always and llm.engine.speculator is not None:
        _force_k(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.scheduler.check_invariants()
    return [[(s.token_ids, s.text, s.finish_reason, s.logprobs and s.logprobs.logprobs) for s in r.outputs]
            for r in outs], llm


@pytest.mark.parametrize("model", FORMATS, indirect=True)
def test_ngram_greedy_output_equals_plain_decoding(model):
    """Every weight format: the same tokens, text and log-probabilities, alone and batched, with the n-gram
    proposer's drafts accepted and rejected along the way."""
    from rawinfer import SamplingParams
    model_dir, opts = model
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=1)
    plain, _ = _generate(model_dir, PROMPTS, params, **opts)
    spec, llm = _generate(model_dir, PROMPTS, params, speculative_method="ngram", **opts)
    alone = [_generate(model_dir, [p], params, speculative_method="ngram", **opts)[0][0] for p in PROMPTS[:1]]
    s = llm.engine.stats()["speculative"]
    assert spec == plain and alone == plain[:1]
    assert s["num_accepted_tokens"] > 0 and s["num_accepted_tokens"] < s["num_draft_tokens"]


@pytest.mark.parametrize("fixture", ["smollm2_dir", "smollm2_q4_dir"])
def test_drafts_verified_beside_prefill_chunks_keep_their_bits(fixture, request, staggered_generation):
    """Requests joining one per step, in chunks of 8 prompt tokens: drafts are verified in steps that also
    prefill, and the greedy tokens still equal plain decoding's."""
    from rawinfer.engine.engine import LLMEngine
    model_dir = request.getfixturevalue(fixture)
    opts = dict(device="cpu", kv_cache_memory="128MiB", long_prefill_token_threshold=8, itl_target_ms=0)
    prompts = {str(i): p for i, p in enumerate(PROMPTS * 2)}
    plain = staggered_generation(LLMEngine(model_dir, **opts), prompts, 32)
    eng = LLMEngine(model_dir, speculative_method="ngram", **opts)
    _force_k(eng)                                                    # whatever the batch
    assert staggered_generation(eng, prompts, 32) == plain
    assert eng.stats()["speculative"]["num_accepted_tokens"] > 0


def test_seeded_sampling_penalties_and_n_are_unchanged(smollm2_q4_dir):
    """Sampled rows draw from the sequence's generator once per kept token, as without speculation."""
    from rawinfer import SamplingParams
    for params in (SamplingParams(max_tokens=40, temperature=0.8, seed=7, n=2),
                   SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.2, frequency_penalty=0.3),
                   SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, min_tokens=30, seed=1)):
        plain, _ = _generate(smollm2_q4_dir, PROMPTS, params)
        spec, _ = _generate(smollm2_q4_dir, PROMPTS, params, speculative_method="ngram")
        assert spec == plain


class _Oracle:
    """Proposes what greedy decoding will produce (from a plain run), with every other token wrong by `wrong`."""
    method = "oracle"

    def __init__(self, outputs: dict, wrong: int = 0, vocab: int = 49152):
        self.outputs, self.wrong, self.vocab = outputs, wrong, vocab

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            full = self.outputs[tuple(seq.prompt_token_ids)]
            d = list(full[seq.num_output_tokens:seq.num_output_tokens + k])
            if self.wrong and d:
                d[min(len(d) - 1, 1)] = (d[min(len(d) - 1, 1)] + self.wrong) % self.vocab
            drafts.append(d)
        return drafts

    def release(self, seq_id):
        pass


def _stepwise(engine, prompts, params):
    """Run to the end, checking the scheduler's invariants (a running sequence owns ceil(computed / BS) blocks)
    after every step; returns each request's token ids."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.scheduler.check_invariants()
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("wrong", [0, 7])
def test_rollback_frees_rejected_blocks_and_never_caches_a_rejected_token(smollm2_q4_dir, wrong):
    """Blocks of 4 tokens and 8 drafts: rejected drafts fill whole blocks, which go back at once. Every digest in
    the prefix cache afterwards is one of a real sequence's (prompt + kept output) blocks."""
    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    opts = dict(device="cpu", kv_cache_memory="64MiB", block_size=4)
    plain = LLMEngine(smollm2_q4_dir, **opts)
    prompts = [plain.encode_prompt(p) for p in PROMPTS]
    expected = _stepwise(plain, prompts, params)
    eng = LLMEngine(smollm2_q4_dir, speculative_method="ngram", num_speculative_tokens=8, **opts)
    eng.speculator.proposer = _Oracle({tuple(p): e for p, e in zip(prompts, expected)}, wrong)
    _force_k(eng)                                                    # the bookkeeping under test, whatever pays
    assert _stepwise(eng, prompts, params) == expected
    s = eng.stats()["speculative"]
    assert s["num_drafts"] > 0 and (s["acceptance_rate"] == 1.0) == (wrong == 0)
    allowed = set()
    for p, e in zip(prompts, expected):
        allowed |= set(BlockHashes().upto(p + e, len(p + e) // 4, 4))
    bm = eng.block_manager
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks > 0
    assert set(bm._cached) <= allowed
    assert eng.stats_tracker.tokens_generated == sum(map(len, expected))


def test_stop_string_and_max_tokens_inside_the_kept_drafts(smollm2_q4_dir):
    """A stop string, an EOS or max_tokens reached in the middle of a step's kept tokens ends the sequence
    there, exactly as plain decoding ends it."""
    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    for params in (SamplingParams(max_tokens=37, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=60, temperature=0, stop=["4,"]),
                   SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[28])):
        plain = LLMEngine(smollm2_q4_dir, device="cpu", kv_cache_memory="64MiB")
        prompts = [plain.encode_prompt(p) for p in PROMPTS]
        expected = _stepwise(plain, prompts, params)
        eng = LLMEngine(smollm2_q4_dir, device="cpu", kv_cache_memory="64MiB", speculative_method="ngram",
                        num_speculative_tokens=5)
        eng.speculator.proposer = _Oracle({tuple(p): e + [13] * 8 for p, e in zip(prompts, expected)})
        _force_k(eng)
        assert _stepwise(eng, prompts, params) == expected
        assert eng.block_manager.num_used_blocks == 0


def test_backoff_after_rejected_proposals(smollm2_q4_dir):
    """A proposal rejected whole makes the sequence wait 1, 2, 4, ... steps; an accepted one resets it."""
    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    eng = LLMEngine(smollm2_q4_dir, device="cpu", kv_cache_memory="64MiB", speculative_method="ngram")

    class Wrong:
        method, calls = "wrong", []

        def propose(self, seqs, ks):
            self.calls.append(len(seqs))
            return [[0] * k for k in ks]        # token 0 never comes next here

        def release(self, seq_id):
            pass
    eng.speculator.proposer = Wrong()
    _force_k(eng)                                                    # the cost model would stop proposing
    eng.add_request("a", "The capital of France is", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        before = len(Wrong.calls)
        eng.step()
        steps.append(len(Wrong.calls) - before)
    proposing = [i for i, n in enumerate(steps) if n]
    assert np.diff(proposing).tolist()[:4] == [2, 3, 5, 9]      # waits 1, 2, 4, 8 steps between proposals


def _decoding(n: int, length: int = 300):
    from rawinfer.core.sequence import Sequence
    from rawinfer.sampling import SamplingParams
    seqs = [Sequence(str(i), str(i), 0, list(range(length)), SamplingParams()) for i in range(n)]
    for s in seqs:
        s.num_computed_tokens = length - 1
    return seqs


def test_drafts_per_step_follow_the_cost_model():
    """A step cost of 10 ms + 1 ms per row: one sequence speculates with every draft, a large batch with none,
    and less acceptance means fewer drafts; a proposer's own time per draft counts against them. Above MAX_BATCH
    decoding sequences none speculates, whatever the estimate; without one, K drafts up to there."""
    from rawinfer.core.step_cost import Coefficients, StepCost
    from rawinfer.engine.speculative import MAX_BATCH, Speculator
    sp = Speculator(NgramProposer(), 4, 4096, max_batch=1 << 30)
    cost = StepCost(Coefficients(0.010, 0.001, 0.001, 0.0))

    def k_at(batch, acceptance, proposer_seconds=0.0):
        seqs = _decoding(batch)
        sp._acceptance = {s.seq_id: acceptance for s in seqs}
        sp._proposer_times.clear()
        sp._proposer_times.append(proposer_seconds)
        return sp.choose_k(seqs, seqs, cost)
    assert k_at(1, 0.9) == 4 and k_at(64, 0.6) == 0 and k_at(16, 0.3) == 0
    assert k_at(4, 0.3) < k_at(4, 0.6) <= k_at(4, 0.9)
    assert k_at(1, 0.6, proposer_seconds=0.02) < k_at(1, 0.6)
    sp = Speculator(NgramProposer(), 4, 4096)
    seqs = _decoding(MAX_BATCH + 1)
    assert sp.choose_k(seqs[:MAX_BATCH], seqs, StepCost()) == 4 and sp.choose_k(seqs, seqs, None) == 0
    sp._acceptance = {s.seq_id: 0.9 for s in seqs}
    assert sp.choose_k(seqs[:MAX_BATCH], seqs[:MAX_BATCH], cost) > 0 and sp.choose_k(seqs, seqs, cost) == 0


def test_a_stateful_proposer_takes_sequences_only_at_their_first_decode_step():
    """A draft model computes a sequence's whole text at its first proposal: a sequence first met later (the
    batch was too large for drafts at its first decode step) never joins; one that joined keeps proposing."""
    from rawinfer.engine.speculative import Speculator

    class Echo:
        method = "echo"

        def propose(self, seqs, ks):
            return [[seq.token_ids[-1]] * k for seq, k in zip(seqs, ks)]

        def release(self, seq_id):
            pass
    sp = Speculator(Echo(), 2, 4096, keeps_state=True)
    first, late = _decoding(2, 20)
    first.append_token(7, 0.0)       # 1 output token: its first decode step
    for t in (7, 8):
        late.append_token(t, 0.0)    # 2: first met after its first decode step
    for s in (first, late):
        s.num_computed_tokens = s.num_tokens - 1
    assert set(sp.propose([first, late])) == {first.seq_id}
    first.append_token(9, 0.0)
    first.num_computed_tokens += 1
    assert set(sp.propose([first, late])) == {first.seq_id}
    assert set(Speculator(Echo(), 2, 4096).propose([late])) == {late.seq_id}


def test_no_speculation_in_a_large_batch(smollm2_q4_dir):
    """32 requests on the engine's own measured step cost: a step of 32 decode rows is not bound by reading
    the weights, and no draft is proposed."""
    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    eng = LLMEngine(smollm2_q4_dir, device="cpu", kv_cache_memory="64MiB", speculative_method="ngram")
    for i in range(32):
        eng.add_request(str(i), PROMPTS[i % 3] + f" ({i})", SamplingParams(max_tokens=12, temperature=0))
    eng.step()
    while eng.has_unfinished() and len(eng.scheduler.running) > 24:
        eng.step()
    assert eng.stats()["speculative"]["num_drafts"] == 0


def test_counters_in_stats_and_metrics(smollm2_q4_dir):
    from rawinfer import SamplingParams
    _, llm = _generate(smollm2_q4_dir, PROMPTS[1:2], SamplingParams(max_tokens=40, temperature=0),
                       speculative_method="ngram")
    st = llm.engine.stats()
    s, counters = st["speculative"], st["metrics"]["counters"]
    assert s["method"] == "ngram" and 0 < s["acceptance_rate"] <= 1
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert counters["spec_decode_num_drafts_total"] == {"ngram": s["num_drafts"]}
    assert counters["spec_decode_num_accepted_tokens_total"] == {"ngram": s["num_accepted_tokens"]}
    assert counters["spec_decode_num_accepted_tokens_per_pos_total"]["0"] == s["accepted_per_pos"][0]
    assert st["metrics"]["labels"]["spec_decode_num_drafts_total"] == "method"


def test_options_are_checked():
    from rawinfer.config import EngineConfig
    assert EngineConfig(speculative_model="weights").validate().speculative_method == "draft"
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="draft").validate()
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0).validate()
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa").validate()


# chi-square critical value at p = 0.001 for 7 degrees of freedom (8 tokens under top_k = 8)
CHI2_7_P001 = 24.32


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_models_distribution(tiny_llama_dir):
    """Temperature 0.8, top-k 8, 4,000 seeded requests of 3 tokens on the tiny Llama; at the second token each
    proposes the most likely token e after its first: the second token's frequencies (x1 = d1, the likeliest
    first token) and the third's after d1 e (drawn from the verification row) pass a chi-square test against
    the model's own distributions."""
    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.engine.sampler import filtered_probs
    prompt = [5, 17, 99, 3, 42]
    eng = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="16MiB", speculative_method="ngram",
                    num_speculative_tokens=1)
    base = SamplingParams(temperature=0.8, top_k=8)

    def probs(ids):
        return filtered_probs(eng.score(ids)[-1], base)
    p1 = probs(prompt)
    likeliest = {x1: int(np.argmax(probs(prompt + [x1]))) for x1 in np.flatnonzero(p1)}
    d1 = int(np.argmax(p1))
    p2, p3 = probs(prompt + [d1]), probs(prompt + [d1, likeliest[d1]])

    class Likeliest:
        method = "likeliest"

        def propose(self, seqs, ks):
            return [[likeliest[seq.token_ids[-1]]] for seq in seqs]

        def release(self, seq_id):
            pass
    eng.speculator.proposer = Likeliest()
    eng.speculator.choose_k = lambda *_: 1                          # every request verifies its draft
    seconds, thirds = [], []
    for batch in range(500):
        for i in range(8):
            eng.add_request(f"{batch}.{i}", prompt, SamplingParams(max_tokens=3, temperature=0.8, top_k=8,
                                                                   seed=batch * 8 + i))
        got: dict = {}
        while eng.has_unfinished():
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for x1, x2, x3 in got.values():
            if x1 == d1:
                seconds.append(x2)
                if x2 == likeliest[d1]:
                    thirds.append(x3)
    s = eng.stats()["speculative"]
    assert s["num_drafts"] == 4000 and 0 < s["num_accepted_tokens"] < 4000
    c2 = np.bincount(seconds, minlength=p2.size)[p2 > 0]
    c3 = np.bincount(thirds, minlength=p3.size)[p3 > 0]
    assert len(thirds) > 100
    assert _chi2(c2, p2[p2 > 0]) < CHI2_7_P001 and _chi2(c3, p3[p3 > 0]) < CHI2_7_P001


def test_sliding_window_model_rolls_back_inside_its_window(tmp_path_factory):
    """tiny-mistral-swa (every layer slides through 24 positions), blocks of 4, a pool of 16 blocks for a
    generation of 120 tokens (the window's blocks given back as it slides, rejected drafts' blocks after each
    step): drafts half wrong, the same tokens as plain decoding, the scheduler's invariants after every step."""
    from conftest import _convert_tiny
    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    path = _convert_tiny(tmp_path_factory, "tiny-mistral-swa")
    opts = dict(device="cpu", kv_cache_memory=16 * 2 * 2 * 2 * 4 * 16 * 4, block_size=4,      # 16 blocks
                max_num_batched_tokens=32, enable_prefix_caching=True)
    prompt = np.random.default_rng(5).integers(3, 500, 30).tolist()
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    plain = LLMEngine(path, device="cpu", kv_cache_memory="16MiB", block_size=4)
    expected = _stepwise(plain, [prompt], params)
    eng = LLMEngine(path, speculative_method="ngram", num_speculative_tokens=6, **opts)
    assert eng.model_config.kv_window == 24
    eng.speculator.proposer = _Oracle({tuple(prompt): expected[0] + [1] * 8}, wrong=3, vocab=512)
    eng.speculator.choose_k = lambda *_: 6
    assert _stepwise(eng, [prompt], params) == expected
    assert eng.stats()["speculative"]["num_accepted_tokens"] > 0


def test_the_decode_side_of_a_transfer_speculates(tiny_llama_dir):
    """Prefill/decode disaggregation in one process (tests/engine/test_kv_transfer.py's transfer): prompts
    prefilled by one engine, their K/V written into blocks the speculating decode engine reserved, generate
    plain decoding's tokens with drafts kept and rejected, and leave no block behind."""
    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    from tests.engine.test_kv_transfer import OPTS, assert_clean, drain, transfer
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, int(rng.integers(20, 60))).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    colo = LLMEngine(tiny_llama_dir, **OPTS)
    expected = _stepwise(colo, prompts, params)
    prefill = LLMEngine(tiny_llama_dir, **OPTS)
    decode = LLMEngine(tiny_llama_dir, speculative_method="ngram", **OPTS)
    decode.speculator.proposer = _Oracle({tuple(p): e + [1] * 8 for p, e in zip(prompts, expected)}, wrong=2,
                                         vocab=512)
    _force_k(decode)
    moved = sum(transfer(prefill, decode, str(i), p, params) for i, p in enumerate(prompts))
    got = drain(decode)
    assert [got[str(i)] for i in range(len(prompts))] == expected and moved > 0
    assert decode.stats()["speculative"]["num_accepted_tokens"] > 0
    assert_clean(prefill, decode)


def test_structured_output_speculates_inside_its_grammar(smollm2_q4_dir):
    """JSON under a schema, greedy and seeded: drafts the grammar refuses are cut before the step, each draft
    row is masked by the grammar after the drafts before it, and the outputs equal plain decoding's (every
    output still parses); drafts half wrong to have rejections too."""
    import json as _json

    from rawinfer import SamplingParams
    from rawinfer.engine.engine import LLMEngine
    schema = {"type": "object", "additionalProperties": False, "required": ["fruits", "count"],
              "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                        "maxItems": 6},
                             "count": {"type": "integer", "minimum": 0, "maximum": 100}}}
    opts = dict(device="cpu", kv_cache_memory="64MiB")
    plain = LLMEngine(smollm2_q4_dir, **opts)
    prompts = [plain.encode_prompt(plain.tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in
               ("List some fruits as JSON.", "Name six red fruits and count them, as JSON.")]
    for params in (SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json": schema}),
                   SamplingParams(max_tokens=80, temperature=0.8, seed=4, structured_outputs={"json": schema})):
        expected = _stepwise(plain, prompts, params)
        eng = LLMEngine(smollm2_q4_dir, speculative_method="ngram", **opts)
        eng.speculator.proposer = _Oracle({tuple(p): e + [28] * 8 for p, e in zip(prompts, expected)}, wrong=9)
        _force_k(eng)
        assert _stepwise(eng, prompts, params) == expected
        assert eng.stats()["speculative"]["num_accepted_tokens"] > 0
        for e in expected:
            _json.loads(eng.tokenizer.decode(e))
