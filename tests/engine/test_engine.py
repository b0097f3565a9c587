"""Continuous batching end to end: batch invariance, prefix caching, preemption, abort, n > 1, API."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer import LLMEngine, SamplingParams
from rawinfer.engine.engine import RequestRejected
from rawinfer.engine.llm import LLM

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_llm(path, **opts) -> LLM:
    base = dict(device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256, max_num_seqs=64)
    base.update(opts)
    return LLM(path, **base)


def mixed_prompts(n, seed=0, lo=3, hi=60, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def run(llm, prompts, max_tokens):
    params = [SamplingParams(max_tokens=int(m), **GREEDY) for m in max_tokens]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module", params=[None, "int8", "q4"], ids=["float32", "int8", "q4"])
def tiny_any_dir(request, tmp_path_factory):
    """The tiny Llama in every weight format: batch invariance holds for each."""
    from conftest import _convert_tiny
    return _convert_tiny(tmp_path_factory, "tiny-llama", quant=request.param)


def test_batch_invariance_32_mixed_requests(tiny_any_dir):
    tiny_llama_dir = tiny_any_dir
    llm = make_llm(tiny_llama_dir)
    prompts = mixed_prompts(32)
    max_tokens = np.random.default_rng(1).integers(1, 24, 32)
    batched = run(llm, prompts, max_tokens)
    for i in (0, 5, 17, 31):
        alone = run(llm, [prompts[i]], [max_tokens[i]])[0]
        assert alone.token_ids == batched[i].token_ids
    # logits within float32 tolerance: one request scored in one chunk vs in chunks of 5 (quantized
    # models: their int8 KV cache rounds the K/V the two attention kernels computed a little apart)
    seq = prompts[3] + batched[3].token_ids
    alone_logits = llm.engine.score(seq)
    atol = 1e-4 if llm.engine.model_config.quant is None else 5e-3
    np.testing.assert_allclose(alone_logits[-1], llm.engine.score(seq, [5] * 100)[-1], atol=atol)
    assert all(len(r.token_ids) == m for r, m in zip(batched, max_tokens))


def test_prefix_cache_hits_give_the_same_outputs(tiny_llama_dir):
    prefix = list(range(10, 10 + 40))              # 2.5 blocks of 16 shared by every prompt
    prompts = [prefix + [100 + i, 200 + i] for i in range(6)]
    cold = run(make_llm(tiny_llama_dir, enable_prefix_caching=False), prompts, [12] * 6)
    llm = make_llm(tiny_llama_dir)
    first = run(llm, prompts[:1], [12])            # fills the cache
    warm = run(llm, prompts[1:], [12] * 5)
    assert [r.token_ids for r in first + warm] == [r.token_ids for r in cold]
    assert all(r.metrics.cached_prompt_tokens == 32 for r in warm)
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0.3
    # a prompt cached in full still recomputes its last token to get logits
    again = run(llm, [prefix[:32]], [5])[0]
    assert again.metrics.cached_prompt_tokens == 16
    assert again.token_ids == run(make_llm(tiny_llama_dir, enable_prefix_caching=False), [prefix[:32]], [5])[0].token_ids


def test_tiny_pool_preempts_and_still_matches(tiny_any_dir):
    tiny_llama_dir = tiny_any_dir
    prompts = mixed_prompts(16, seed=3, lo=20, hi=50)
    ample = run(make_llm(tiny_llama_dir), prompts, [30] * 16)
    # 12 blocks of 16 tokens: room for about 2 of these sequences at a time
    pool = make_llm(tiny_llama_dir).engine.pool            # the KV bytes of one block in this format
    per_block = pool.kv_bytes // (pool.kv.num_blocks + (pool.kv.padding_block is not None))
    small = make_llm(tiny_llama_dir, kv_cache_memory=12 * per_block, max_num_batched_tokens=64)
    assert small.engine.block_manager.num_blocks == 12
    tight = run(small, prompts, [30] * 16)
    assert [r.token_ids for r in tight] == [r.token_ids for r in ample]
    assert small.engine.stats()["num_preemptions"] > 0
    assert sum(r.metrics.preemptions for r in tight) == small.engine.stats()["num_preemptions"]
    assert small.engine.block_manager.num_free_blocks == 12
    small.engine.block_manager.check_invariants()


def test_abort_in_prefill_and_in_decode_returns_every_block(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=32)
    bm = engine.block_manager
    start = bm.num_free_blocks
    engine.add_request("long", list(range(1, 200)), SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()                                      # "long" is mid-prefill (32-token budget)
    assert bm.num_free_blocks < start
    outs = engine.abort("long")
    assert [o.finish_reason for o in outs] == ["abort"] and outs[0].finished
    for _ in range(3):
        engine.step()                                  # "short" is decoding
    outs = engine.abort("short")
    assert outs[0].finish_reason == "abort" and outs[0].metrics.generated_tokens >= 1
    assert bm.num_free_blocks == start and not engine.has_unfinished()
    assert engine.abort("short") == [] and engine.abort("never-seen") == []
    engine.add_request("many", [1, 2, 3], SamplingParams(max_tokens=5, n=3, **GREEDY))
    outs = engine.abort("many")                        # before its prompt ran: one final per sample
    assert sorted(o.index for o in outs) == [0, 1, 2] and all(o.finish_reason == "abort" for o in outs)
    assert bm.num_free_blocks == start
    bm.check_invariants()


def test_chunked_prefill_interleaves_with_decodes(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=16)
    steps = []
    real_schedule = engine.scheduler.schedule

    def schedule(*args):
        batch = real_schedule(*args)
        if not batch.is_empty:
            steps.append({s.seq.request_id: s.num_new_tokens for s in batch.seqs})
        return batch
    engine.scheduler.schedule = schedule
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))
    engine.step()
    engine.add_request("b", list(range(1, 100)), SamplingParams(max_tokens=2, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    # "a" decodes one token every step while "b" prefills in chunks filling the rest of the budget
    b_chunks = [st["b"] for st in steps if "b" in st]
    assert b_chunks[:7] == [15, 15, 15, 15, 15, 15, 9] and sum(b_chunks[:7]) == 99
    assert all(st.get("a") == 1 for st in steps[1:8])
    assert all(sum(st.values()) <= 16 for st in steps)


def test_sampling_seed_and_n(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=7, ignore_eos=True)
    a = llm.generate([[1, 2, 3, 4]], p, use_tqdm=False)[0]
    b = llm.generate([[1, 2, 3, 4], [9, 9, 9]], [p, p], use_tqdm=False)[0]
    assert a.token_ids == b.token_ids                   # same seed, same output, whatever the batch
    many = llm.generate([[1, 2, 3, 4] * 5], SamplingParams(max_tokens=10, temperature=1.0, n=4, seed=3,
                                                           ignore_eos=True), use_tqdm=False)[0]
    assert len(many.outputs) == 4 and all(len(c.token_ids) == 10 for c in many.outputs)
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_fork_shares_prompt_blocks_copy_on_write(tiny_llama_dir):
    """n samples of one prompt: greedy samples are identical, and share the prompt's blocks."""
    llm = make_llm(tiny_llama_dir)
    prompt = list(range(1, 24))                          # 23 tokens: the second block is partial
    single = run(llm, [prompt], [8])[0]
    res = llm.generate([prompt], SamplingParams(max_tokens=8, n=3, **GREEDY), use_tqdm=False)[0]
    assert [c.token_ids for c in res.outputs] == [single.token_ids] * 3


def test_samples_beyond_max_num_seqs_wait_their_turn(tiny_llama_dir):
    """n samples fork into more running sequences than one step may take (max_num_seqs): each step
    takes at most max_num_seqs of them, and every sample still equals the greedy single answer."""
    llm = make_llm(tiny_llama_dir, max_num_seqs=2)
    prompt = list(range(1, 24))
    single = run(llm, [prompt], [8])[0]
    res = llm.generate([prompt, prompt[:10]], SamplingParams(max_tokens=8, n=4, **GREEDY), use_tqdm=False)
    assert [c.token_ids for c in res[0].outputs] == [single.token_ids] * 4
    assert all(len(c.token_ids) == 8 for c in res[1].outputs)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("order", ["parent first", "lookalike first"])
def test_request_ids_that_look_like_forked_samples(tiny_llama_dir, order):
    """A request "x" of n = 2 forks a second sample; a request named "x#1" (the name forked samples once
    had) runs beside it, in either order: once it crashed the server's engine thread."""
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", warmup=False)
    reqs = [("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, n=2, **GREEDY)),
            ("x#1", [9, 8, 7], SamplingParams(max_tokens=6, **GREEDY))]
    got: dict = {}

    def step():
        for o in engine.step():
            got.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    for rid, prompt, params in (reqs if order == "parent first" else reqs[::-1]):
        engine.add_request(rid, prompt, params)
        step()                                            # the first one is prefilled (and forked) first
    while engine.has_unfinished():
        step()
    assert sorted(got) == [("x", 0), ("x", 1), ("x#1", 0)] and all(len(t) == 6 for t in got.values())
    assert got[("x", 0)] == got[("x", 1)]
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0


def test_a_refused_prompt_leaves_the_llm_usable(tiny_llama_dir):
    """One bad prompt in a generate call: the call raises naming it, none of its requests stays queued, and
    the next calls (which once found their request ids still in use) run normally."""
    llm = make_llm(tiny_llama_dir)
    want = run(llm, [[1, 2, 3]], [4])[0].token_ids
    with pytest.raises(RequestRejected, match="prompt 2: .*outside the vocabulary"):
        run(llm, [[1, 2, 3], [4, 5, 6], [1, 99999]], [4] * 3)
    assert llm.engine.num_requests == 0 and llm.engine.block_manager.num_used_blocks == 0
    assert run(llm, [[1, 2, 3]], [4])[0].token_ids == want
    assert llm.generate([], use_tqdm=False) == []


def test_rejections_and_validation(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB")
    with pytest.raises(RequestRejected, match="maximum context"):
        engine.add_request("x", [1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request("x", [1, 512], SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("x", [], SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="no tokenizer"):
        engine.add_request("x", "hello", SamplingParams(max_tokens=1))
    engine.add_request("dup", [1], SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("dup", [1], SamplingParams(max_tokens=1))
    small = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory=4 * 16 * 2 * 2 * 2 * 16 * 4)
    with pytest.raises(RequestRejected, match="kv-cache-memory"):
        small.add_request("big", [1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="unknown engine option"):
        LLMEngine(tiny_llama_dir, kv_cache=1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=2), dict(n=0),
                dict(repetition_penalty=0), dict(seed=-1), dict(stop=[""]), dict(presence_penalty=2.5),
                dict(frequency_penalty=-3), dict(logit_bias={"x": 1}), dict(logit_bias={3: 101}),
                dict(logprobs=21), dict(prompt_logprobs=-1), dict(logprobs=True), dict(stop=5), dict(stop=0),
                dict(stop={"a": 1}), dict(stop_token_ids=5), dict(logit_bias={"9" * 5000: 1}),
                dict(min_tokens=257)):
        with pytest.raises(ValueError, match=list(bad)[0]):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match=r"stop_token_ids=\[-1, .*\.\.\. \(\d+ characters\)") as e:
        SamplingParams(stop_token_ids=[-1] * 100000)          # the message shows the start of a huge value
    assert len(str(e.value)) < 400


def test_kv_cache_dtype(tiny_llama_dir):
    """float16 K/V: twice the blocks in the same memory, greedy outputs of the float32 cache (tiny model,
    40 tokens), batch-invariant; int8 K/V (a float32 scale per row): ~3.8x the blocks, batch-invariant;
    bad values named with the choices."""
    f32 = make_llm(tiny_llama_dir)
    f16 = make_llm(tiny_llama_dir, kv_cache_dtype="float16")
    i8 = make_llm(tiny_llama_dir, kv_cache_dtype="int8")
    assert f32.engine.pool.kv.k[0].dtype == np.float32 and f16.engine.pool.kv.k[0].dtype == np.float16
    assert i8.engine.pool.kv.k[0].dtype == np.int8
    assert f16.engine.pool.kv.num_blocks >= 2 * f32.engine.pool.kv.num_blocks - 1
    D = i8.engine.model_config.head_dim                 # int8: D + 4 bytes per row against 4 D
    assert i8.engine.pool.kv.num_blocks >= int(4 * D / (D + 4) * f32.engine.pool.kv.num_blocks) - 1
    assert "float16 KV" in f16.engine.pool.describe() and "int8 KV" in i8.engine.pool.describe()
    prompts = [[1, 2, 3, 4, 5], [7] * 30, list(range(10, 60))]
    ref = [r.token_ids for r in run(f32, prompts, [40] * 3)]
    agree = []
    for llm in (f16, i8):
        alone = [run(llm, [p], [40])[0].token_ids for p in prompts]
        together = [r.token_ids for r in run(llm, prompts, [40] * 3)]
        assert together == alone
        agree.append([next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 40) for x, y in zip(together, ref)])
    assert agree[0] == [40] * 3             # float16, measured: all 3 x 40 tokens equal to float32's
    assert min(agree[1]) >= 10              # int8 (random weights, near-tied logits): measured 18, 40, 20
    with pytest.raises(ValueError, match="kv_cache_dtype.*one of auto, float32, float16, int8"):
        LLMEngine(tiny_llama_dir, kv_cache_dtype="int4")


def test_metrics_and_stats(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    r = run(llm, [[1, 2, 3]], [6])[0]
    m = r.metrics
    assert m.prompt_tokens == 3 and m.generated_tokens == 6 and len(m.itl_s) == 5
    assert 0 <= m.ttft_s <= m.e2e_s and m.mean_itl_s >= 0
    s = llm.engine.stats()
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "prefix_cache_hit_rate",
                "num_preemptions", "recent_tokens_per_s"):
        assert key in s


def test_chat_renders_the_template_as_the_server_does(smollm2_engine, tiny_llama_dir):
    """LLM.chat: one conversation or several, each rendered with the model's chat template (the server's
    rendering of `messages`); a model without a template, or no conversation at all, is one clear error."""
    from rawinfer.engine.tokenizer import ChatTemplateError, render_chat
    llm = LLM.from_engine(smollm2_engine)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    france = [{"role": "user", "content": "What is the capital of France?"}]
    germany = [{"role": "system", "content": "Answer in one word."},
               {"role": "user", "content": "What is the capital of Germany?"}]
    one = llm.chat(france, params, use_tqdm=False)
    assert len(one) == 1 and "Paris" in one[0].text
    both = llm.chat([france, germany], params, use_tqdm=False)
    assert both[0].token_ids == one[0].token_ids
    rendered = llm.generate(render_chat(llm.tokenizer, germany), params, use_tqdm=False)
    assert both[1].token_ids == rendered[0].token_ids and both[1].prompt_token_ids == rendered[0].prompt_token_ids
    begun = france + [{"role": "assistant", "content": "The capital of France is"}]
    cont = llm.chat(begun, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert cont[0].text.startswith(" Paris")
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([], params)
    with pytest.raises(ChatTemplateError):
        make_llm(tiny_llama_dir).chat(france, params)
