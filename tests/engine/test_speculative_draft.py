"""The draft-model proposer (rawinfer/engine/draft.py) on the real weights: its proposals are the draft model's
own greedy continuation, its KV follows the accepted tokens (rollback, no leaked blocks), a batch proposes what
each sequence alone does, a foreign vocabulary is refused and a full pool means no proposal, never an error."""

from __future__ import annotations

import gc

import pytest

from rawinfer import LLMEngine, SamplingParams
from rawinfer.config import EngineConfig, ModelConfig
from rawinfer.core.sequence import Sequence
from rawinfer.engine.draft import DECODE_CATCH_UP, DRAFT_KV_SHARE, DraftProposer

TARGET = DRAFT = ""      # SmolLM2 float32 and q4: set by _models from the session's fixtures
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who", "List three colors:\n1."]

@pytest.fixture(scope="module", autouse=True)
def _models(smollm2_dir, smollm2_q4_dir):
    """The target (float32) and draft (q4) SmolLM2 folders, converted by the session's fixtures (a fresh clone
    has no weights/ q4 folder), before any fixture of this module reads them."""
    global TARGET, DRAFT
    TARGET, DRAFT = smollm2_dir, smollm2_q4_dir


@pytest.fixture(autouse=True)
def _free_engines():
    """Engines hold reference cycles around hundreds of MiB: collect after each test (test_speculative.py)."""
    yield
    gc.collect()


def _ecfg(**kw) -> EngineConfig:
    return EngineConfig(**{"device": "cpu", "kv_cache_memory": 64 << 20, "warmup": False, **kw})


@pytest.fixture(scope="module")
def target_config() -> ModelConfig:
    return ModelConfig.from_dir(TARGET)


@pytest.fixture(scope="module")
def proposer(target_config) -> DraftProposer:
    return DraftProposer(DRAFT, target_config, _ecfg())


@pytest.fixture(scope="module")
def reference():
    """The q4 model alone: greedy continuations of token ids, as generation computes them."""
    engine = LLMEngine(DRAFT, _ecfg(enable_prefix_caching=False, kv_cache_memory=16 << 20))
    calls = iter(range(1 << 30))

    def greedy(ids: list[int], n: int) -> list[int]:
        rid = f"ref{next(calls)}"
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        return out
    greedy.encode = engine.encode_prompt
    return greedy


def _seq(seq_id: str, ids: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, prompt_token_ids=ids, params=SamplingParams())


def _extend(seq: Sequence, tokens: list[int]) -> None:
    for t in tokens:
        seq.append_token(t, 0.0)


def _check_blocks(p: DraftProposer, seq_id: str) -> None:
    """The draft holds exactly the blocks its computed tokens need."""
    bs = p.block_manager.block_size
    assert p.num_blocks(seq_id) == -(-len(p.computed_tokens(seq_id)) // bs)
    p.block_manager.check_invariants()


def test_proposals_are_the_draft_models_greedy_continuation(proposer, reference):
    for n, text in enumerate(PROMPTS[:3]):
        ids = reference.encode(text)
        expected = reference(ids, 9)
        seq = _seq(f"greedy{n}", ids)
        assert proposer.propose([seq], [4]) == [expected[:4]]
        # every draft accepted and the target's bonus token: two tokens to catch up, then the next four
        _extend(seq, expected[:5])
        assert proposer.propose([seq], [4]) == [expected[5:9]]
        assert proposer.computed_tokens(seq.seq_id) == ids + expected[:8]
        _check_blocks(proposer, seq.seq_id)
        proposer.release(seq.seq_id)
    assert proposer.block_manager.num_used_blocks == 0


def _recording(p: DraftProposer) -> list:
    """The plans p's runner runs from now on (the runner itself still runs them)."""
    plans, run = [], p.runner.run

    def record(plan):
        plans.append(plan)
        return run(plan)
    p.runner.run = record
    return plans


def test_short_catch_ups_run_as_one_decode_pass(proposer, reference):
    """Catch-ups of 1 to DECODE_CATCH_UP tokens run as decode rows (the sequence's first uncomputed token, the
    rest as `draft` rows) in one pass, a longer one as a chunk; the proposals are the same either way: the draft
    model's greedy continuation."""
    ids = [reference.encode(t) for t in PROMPTS[:2]]
    cont = [reference(x, DECODE_CATCH_UP + 4) for x in ids]
    for catch_ups, decode in (((1, 2, 5, DECODE_CATCH_UP), True), ((2, DECODE_CATCH_UP + 1), False)):
        seqs = [_seq(f"c{c}.{i}", ids[i % 2]) for i, c in enumerate(catch_ups)]
        assert proposer.propose(seqs, [1] * len(seqs)) == [cont[i % 2][:1] for i in range(len(seqs))]
        for i, (seq, c) in enumerate(zip(seqs, catch_ups)):
            _extend(seq, cont[i % 2][:c])
        plans = _recording(proposer)
        try:
            got = proposer.propose(seqs, [3] * len(seqs))
        finally:
            del proposer.runner.run
        assert got == [cont[i % 2][c:c + 3] for i, c in enumerate(catch_ups)]
        first = plans[0]            # the catch-up; then two decode passes of one row per sequence
        assert len(plans) == 3 and (first.max_query_len == 1) == decode
        assert first.num_tokens == sum(catch_ups) and first.logits_indices.size == (sum(catch_ups) if decode else 2)
        for seq in seqs:
            _check_blocks(proposer, seq.seq_id)
            proposer.release(seq.seq_id)
    assert proposer.block_manager.num_used_blocks == 0


def test_rollback_follows_the_accepted_tokens(proposer, reference):
    ids = reference.encode(PROMPTS[3])
    seq = _seq("rollback", ids)
    drafts = proposer.propose([seq], [12])[0]      # past the first block: the rollback gives one back
    assert len(drafts) == 12 and proposer.computed_tokens("rollback") == ids + drafts[:11]
    assert proposer.num_blocks("rollback") == 2
    other = (drafts[1] + 1) % 49152
    _extend(seq, [drafts[0], other])            # the first draft accepted, the second replaced by the target
    again = proposer.propose([seq], [4])[0]
    assert proposer.num_blocks("rollback") == 1
    fresh = proposer.propose([_seq("fresh", seq.token_ids)], [4])[0]
    assert again == fresh == reference(seq.token_ids, 4)
    assert proposer.computed_tokens("rollback") == seq.token_ids + again[:3]
    _check_blocks(proposer, "rollback")
    # the same id now names a shorter sequence (recomputed from an earlier point): rolled back further
    short = _seq("rollback", ids[:-3])
    assert proposer.propose([short], [2]) == [reference(ids[:-3], 2)]
    assert proposer.computed_tokens("rollback") == ids[:-3] + reference(ids[:-3], 1)
    _check_blocks(proposer, "rollback")
    # the same id with an earlier token changed (not a pattern the engine makes): recomputed from there
    changed = ids[:2] + [(ids[2] + 1) % 49152] + ids[3:]
    assert proposer.propose([_seq("rollback", changed)], [3]) == [reference(changed, 3)]
    assert proposer.computed_tokens("rollback") == changed + reference(changed, 2)
    _check_blocks(proposer, "rollback")
    for seq_id in ("rollback", "fresh", "unknown"):
        proposer.release(seq_id)
    assert proposer.block_manager.num_used_blocks == 0 and proposer.computed_tokens("rollback") == []


def test_a_batch_proposes_what_each_sequence_alone_does(proposer, reference):
    prompts = [reference.encode(t) for t in PROMPTS[:3]]
    ks = [3, 1, 4]
    batch = [_seq(f"b{i}", ids) for i, ids in enumerate(prompts)]
    together = proposer.propose(batch, ks)
    alone = [proposer.propose([_seq(f"a{i}", ids)], [k])[0] for i, (ids, k) in enumerate(zip(prompts, ks))]
    assert together == alone and [len(d) for d in together] == ks
    for i, seq in enumerate(batch):             # a second round: all, one or none of the drafts accepted
        _extend(seq, together[i][:[3, 1, 0][i]] + [7 + i])
    ks = [2, 0, 3]
    second = proposer.propose(batch, ks)
    assert second[1] == [] and second == [proposer.propose([_seq(f"c{i}", s.token_ids)], [k])[0]
                                          for i, (s, k) in enumerate(zip(batch, ks))]
    for i in range(3):
        for prefix in "abc":
            proposer.release(f"{prefix}{i}")
    assert proposer.block_manager.num_used_blocks == 0


def test_a_draft_with_another_vocabulary_is_refused(target_config, tiny_llama_dir):
    with pytest.raises(ValueError, match=r"tiny-llama.*does not share the tokenizer.*49152.*--speculative-model"):
        DraftProposer(tiny_llama_dir, target_config, _ecfg())


def test_no_room_means_no_proposal_and_small_steps_split_the_work(target_config, reference):
    bs = 16
    draft_cfg = ModelConfig.from_dir(DRAFT)
    block_bytes = 2 * draft_cfg.num_layers * draft_cfg.num_kv_heads * draft_cfg.head_dim * bs * 2   # float16 K and V
    # a step of 8 tokens and 1 sequence: the catch-up and the drafts run in several passes
    p = DraftProposer(DRAFT, target_config, _ecfg(kv_cache_memory=DRAFT_KV_SHARE * 3 * block_bytes, block_size=bs,
                                                 max_model_len=40, max_num_batched_tokens=8, max_num_seqs=1))
    assert p.block_manager.num_blocks == 3
    short, mid = reference.encode(PROMPTS[0]), reference.encode(PROMPTS[2])
    assert len(short) + 2 <= bs < len(mid) + 2 <= 2 * bs
    a, b, c = _seq("a", mid), _seq("b", short), _seq("c", short)
    assert p.propose([a, b, c], [3, 3, 3]) == [reference(mid, 3), reference(short, 3), []]   # c: no block left
    assert p.propose([c], [3]) == [[]] and p.block_manager.num_used_blocks == 3
    p.release("a")
    assert p.propose([c], [3]) == [reference(short, 3)]
    _extend(b, [1] * (40 - len(short)))         # at the context's end: nothing to propose, its blocks go back
    assert p.propose([b], [3]) == [[]] and p.num_blocks("b") == 0
    p.release("c")
    assert p.block_manager.num_used_blocks == 0


def test_the_warm_up_leaves_nothing_behind(target_config, reference):
    p = DraftProposer(DRAFT, target_config, _ecfg(warmup=True))
    assert p.block_manager.num_used_blocks == 0 and p.computed_tokens(("warm-up", 0)) == []
    ids = reference.encode(PROMPTS[1])
    assert p.propose([_seq("w", ids)], [3]) == [reference(ids, 3)]


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_every_weight_format_drafts_its_own_greedy_continuation(fmt, target_config, request):
    """The float32 model (drafting for itself) and its int8 copy: proposals are that model's greedy generation,
    before and after a rollback."""
    model = TARGET if fmt == "float32" else request.getfixturevalue("smollm2_int8_dir")
    p = DraftProposer(model, target_config, _ecfg())
    ref = LLMEngine(model, _ecfg(enable_prefix_caching=False, kv_cache_memory=16 << 20))
    ids = ref.encode_prompt(PROMPTS[2])
    ref.add_request("r", ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    expected = []
    while ref.has_unfinished():
        expected += [t for o in ref.step() for t in o.new_token_ids]
    seq = _seq("s", ids)
    assert p.propose([seq], [5]) == [expected[:5]]
    _extend(seq, expected[:4])                  # three drafts kept, then the model's own token
    assert p.propose([seq], [5]) == [expected[4:9]]
    _check_blocks(p, "s")
    p.release("s")
    assert p.block_manager.num_used_blocks == 0


# ---- through the engine: LLM(target, speculative_model=draft) ---------------------------------------------
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a Python function that reverses a string."}],
         [{"role": "user", "content": "Name three colors of the rainbow and say one thing about each."}]]


def _llm(model: str, **opts):
    """An LLM; a speculating one drafts K tokens for every decoding sequence whatever the step-cost model would
    choose (these tests are about the draft, and under load the cost model may rightly choose none)."""
    from rawinfer import LLM
    llm = LLM(model, **{"device": "cpu", "kv_cache_memory": "64MiB", "warmup": False, **opts})
    if llm.engine.speculator is not None:
        k = llm.engine.speculator.k
        llm.engine.speculator.choose_k = lambda *_: k
    return llm


def _results(llm, params, chats=CHATS) -> list:
    outs = llm.chat(chats, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs and c.logprobs.logprobs) for c in r.outputs]
            for r in outs]


def _counting_proposals(engine) -> list:
    """The proposals the engine's Speculator hands the scheduler from now on, one int per step: how many."""
    counts, propose = [], engine.speculator.propose

    def count(*args):
        drafts = propose(*args)
        counts.append(len(drafts))
        return drafts
    engine.speculator.propose = count
    return counts


@pytest.fixture(scope="module")
def plain32():
    return _llm(TARGET)


@pytest.fixture(scope="module")
def spec32():
    """float32 SmolLM2 with its q4 copy drafting 3 tokens, warmed up as a server's engine is."""
    llm = _llm(TARGET, speculative_model=DRAFT, num_speculative_tokens=3, warmup=True)
    s = llm.engine.stats()["speculative"]
    assert s["method"] == "draft" and s["num_drafts"] == s["num_draft_tokens"] == 0     # the warm-up's not counted
    assert llm.engine.speculator.proposer.block_manager.num_used_blocks == 0
    return llm


def test_the_draft_lives_in_the_targets_pool(spec32):
    """One allocation: the draft model's weights and KV are views of the target pool's arena, after the target's
    KV, and the two block managers hold the same number of tokens out of the one --kv-cache-memory."""
    engine, draft = spec32.engine, spec32.engine.speculator.proposer
    arena = engine.pool.arena
    assert draft.pool.arena is arena and engine.pool.guest_region[1] + draft.pool.total_bytes <= arena.nbytes
    base = arena.__array_interface__["data"][0]
    target_end = max(v.__array_interface__["data"][0] + v.nbytes for v in engine.pool.kv.k + engine.pool.kv.v)
    for view in [*draft.pool.weights.values(), *draft.pool.kv.k, *draft.pool.kv.v]:
        start = view.__array_interface__["data"][0]
        assert target_end <= start and start + view.nbytes <= base + arena.nbytes
    assert draft.block_manager.num_blocks == engine.block_manager.num_blocks
    assert engine.pool.kv_bytes + engine.pool.guest_kv_bytes <= 64 << 20


def test_greedy_output_and_logprobs_equal_float32_alone(plain32, spec32):
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=2)
    counts = _counting_proposals(spec32.engine)
    try:
        spec = _results(spec32, params)
    finally:
        del spec32.engine.speculator.propose
    assert spec == _results(plain32, params)
    s = spec32.engine.stats()["speculative"]
    assert s["method"] == "draft" and s["num_drafts"] == sum(counts) > 0
    assert 0 < s["num_accepted_tokens"] <= s["num_draft_tokens"] <= 3 * s["num_drafts"]
    assert spec32.engine.speculator.proposer.block_manager.num_used_blocks == 0


def test_seeded_sampling_with_n_equals_float32_alone(plain32, spec32):
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=11, n=2)
    assert _results(spec32, params) == _results(plain32, params)
    assert spec32.engine.speculator.proposer.block_manager.num_used_blocks == 0


def test_abort_releases_the_drafts_blocks(spec32):
    engine, draft = spec32.engine, spec32.engine.speculator.proposer
    engine.add_request("a", spec32.tokenizer.encode("Tell me a long story about a dragon."),
                       SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    engine.step()
    seq_id = engine.sequences("a")[0].seq_id
    for _ in range(150):                        # until it proposed (the Speculator decides when it pays)
        if draft.num_blocks(seq_id):
            break
        engine.step()
    assert draft.num_blocks(seq_id) > 0 and draft.computed_tokens(seq_id)
    assert [o.finish_reason for o in engine.abort("a")] == ["abort"]
    assert draft.block_manager.num_used_blocks == 0 and draft.computed_tokens(seq_id) == []
    assert not engine.has_unfinished()


def test_small_target_pool_preempts_and_stays_equal(plain32):
    """8 MiB of target KV (a few hundred positions) for three chats: sequences are preempted and recomputed,
    the draft follows them (its own pool is smaller still: some steps get no proposal) and frees every block."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    spec = _llm(TARGET, speculative_model=DRAFT, kv_cache_memory="8MiB")
    assert _results(spec, params) == _results(plain32, params)
    st = spec.engine.stats()
    assert st["num_preemptions"] > 0 and st["speculative"]["num_drafts"] > 0
    assert spec.engine.speculator.proposer.block_manager.num_used_blocks == 0


def test_q4_target_with_an_int8_draft_equals_q4_alone(smollm2_int8_dir):
    params = SamplingParams(max_tokens=32, temperature=0)
    spec = _llm(DRAFT, speculative_model=smollm2_int8_dir)
    assert _results(spec, params) == _results(_llm(DRAFT), params)
    assert spec.engine.stats()["speculative"]["num_accepted_tokens"] > 0


# ---- a sliding-window draft model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory) -> str:
    from conftest import _convert_tiny
    return _convert_tiny(tmp_path_factory, "tiny-mistral-swa")


def test_a_sliding_window_draft_holds_its_window_and_proposes_its_greedy_continuation(swa_dir):
    """tiny-mistral-swa (every layer slides through 24 positions) drafting for itself in a draft pool of 6 blocks
    of 16: a 40-token prompt and 120 more tokens (10 blocks) follow the target through every acceptance pattern,
    holding the window's blocks only, and each proposal is the model's greedy continuation; a sequence rolled
    back past the given-back blocks is recomputed from its start."""
    swa = swa_dir
    cfg = ModelConfig.from_dir(swa)
    bs, k = 16, 3
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * bs * cfg.head_dim * 4      # float32 K and V
    p = DraftProposer(swa, cfg, _ecfg(kv_cache_memory=DRAFT_KV_SHARE * 6 * block_bytes, block_size=bs))
    assert p.window == 24 and p.block_manager.num_blocks == 6
    ref = LLMEngine(swa, _ecfg(enable_prefix_caching=False, block_size=bs))
    calls = iter(range(1 << 30))

    def greedy(ids: list[int], n: int) -> list[int]:
        rid = str(next(calls))
        ref.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return [t for _ in iter(ref.has_unfinished, False) for o in ref.step() for t in o.new_token_ids]
    prompt = [(i * 37 + 11) % 509 + 3 for i in range(40)]
    seq, held, step = _seq("w", prompt), [], 0
    while seq.num_output_tokens < 120:
        drafts = p.propose([seq], [k])[0]
        assert drafts == greedy(seq.token_ids, k)
        held.append(p.block_manager.num_used_blocks)
        assert held[-1] == p.num_blocks("w")
        kept = step % (k + 1)                   # 0 .. k drafts kept, then the target's token: another than the
        _extend(seq, drafts[:kept] + [(drafts[kept] + 1) % 512 if kept < k else 7])   # next draft (rejected)
        step += 1
    assert max(held) <= -(-(24 + k) // bs) + 1 < -(-seq.num_tokens // bs)
    short = _seq("w", seq.token_ids[:45])       # the same id, rolled back before the window's blocks
    assert p.propose([short], [k]) == [greedy(short.token_ids, k)]
    assert p.computed_tokens("w") == short.token_ids + greedy(short.token_ids, k - 1)
    p.release("w")
    assert p.block_manager.num_used_blocks == 0


def test_a_sliding_window_model_drafting_for_itself_through_the_engine(swa_dir):
    """tiny-mistral-swa (window 24) as its own draft model, a KV region of 32 blocks' bytes shared by the two models
    (16 blocks each): generations far past the window (12 blocks each, 24 for both) equal those without speculation,
    every draft is kept, and no block stays behind."""
    swa = swa_dir
    cfg = ModelConfig.from_dir(swa)
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * 16 * cfg.head_dim * 4
    opts = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory=32 * block_bytes)
    prompts = [[(i * p + 11) % 509 + 3 for i in range(30)] for p in (37, 41)]
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    plain = _llm(swa, **{**opts, "kv_cache_memory": 64 * block_bytes}).generate(prompts, params, use_tqdm=False)
    spec = _llm(swa, speculative_model=swa, **opts)
    # the step-cost model rightly stops a model drafting for itself (the draft costs what the target does) once it
    # has measured a few steps; this test is about the draft's window, so every decoding sequence drafts K
    k = spec.engine.speculator.k
    spec.engine.speculator.choose_k = lambda decoding, seqs, cost: k
    assert spec.engine.speculator.proposer.block_manager.num_blocks == spec.engine.block_manager.num_blocks == 16
    assert 16 < 2 * -(-(30 + 150) // 16)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in plain]
    s = spec.engine.stats()["speculative"]
    # all but a few of each sequence's 150 tokens were drafts kept: the window's blocks always had room
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] >= 2 * 100
    assert spec.engine.speculator.proposer.block_manager.num_used_blocks == 0
