"""Log-probabilities (issue 17): agreement with the golden SmolLM2 logits, the same values alone, in a batch,
in prefill chunks and after preemption, and nothing paid by requests that do not ask."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rawinfer import LLMEngine, SamplingParams

from conftest import DATA  # noqa: E402

GOLDEN = os.path.join(DATA, "smollm2")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def cases() -> list[str]:
    with open(os.path.join(GOLDEN, "index.json")) as f:
        return [c["name"] for c in json.load(f)["cases"]]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return LLMEngine(smollm2_dir, device="cpu", kv_cache_memory="64MiB", warmup=False)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request to its end: request id -> its outputs in order."""
    for rid, (prompt, p) in requests.items():
        engine.add_request(rid, prompt, p)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def prompt_lp(outputs):
    return next(o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None)


def test_prompt_logprobs_agree_with_the_golden_logits(smol):
    """Teacher-forced prompt + first greedy token: the last position has the reference's full logits, so its
    log-softmax is exact; at every earlier position the reference has its top 8 logits, which fix the
    log-probability differences between those tokens (the normaliser cancels)."""
    worst_full = worst_rel = 0.0
    for name in cases():
        ref = np.load(os.path.join(GOLDEN, f"{name}.npz"))
        prompt = ref["prompt_ids"].tolist() + ref["greedy_ids"][:1].tolist()
        outs = run(smol, {name: (prompt, SamplingParams(max_tokens=0, prompt_logprobs=20))})[name]
        assert [o.finish_reason for o in outs] == ["length"] and outs[0].new_token_ids == []
        lp = prompt_lp(outs)
        assert lp.token_ids == prompt[1:] and len(lp) == len(prompt) - 1
        want = log_softmax(ref["last_prompt_logits"])
        worst_full = max(worst_full, abs(lp.logprobs[-1] - want[prompt[-1]]))
        assert lp.top_token_ids[-1][:5] == np.argsort(-want)[:5].tolist()
        worst_full = max(worst_full, float(np.abs(np.asarray(lp.top_logprobs[-1]) - want[lp.top_token_ids[-1]]).max()))
        assert lp.ranks[-1] == 1 + int((want > want[prompt[-1]]).sum())
        for i, (ids, logits) in enumerate(zip(ref["prompt_topk_ids"], ref["prompt_topk_logits"])):
            got = dict(zip(lp.top_token_ids[i], lp.top_logprobs[i]))
            ids = [int(t) for t in ids if int(t) in got][:4]     # the reference's likeliest that we list too
            assert len(ids) >= 3, (name, i)
            rel = np.asarray([got[t] - got[ids[0]] for t in ids])
            ref_rel = np.asarray([logits[list(ref["prompt_topk_ids"][i]).index(t)] for t in ids]) - \
                logits[list(ref["prompt_topk_ids"][i]).index(ids[0])]
            worst_rel = max(worst_rel, float(np.abs(rel - ref_rel).max()))
    print(f"worst last-position log-prob error {worst_full:.2e}, worst top-k relative error {worst_rel:.2e}")
    assert worst_full < 2e-3 and worst_rel < 2e-3


def test_logprobs_are_the_log_softmax_of_the_engines_own_logits(smol):
    """Generated-token and prompt log-probabilities equal log_softmax(score logits) at the same positions."""
    prompt = list(range(100, 140))
    outs = run(smol, {"a": (prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=20,
                                                   prompt_logprobs=3))})["a"]
    gen = [t for o in outs for t in o.new_token_ids]
    lps = [o.logprobs for o in outs]
    assert all(len(lp) == len(o.new_token_ids) for lp, o in zip(lps, outs))
    got = [x for lp in lps for x in lp.logprobs] 
    ref = log_softmax(smol.score(prompt + gen))
    assert np.allclose(got, ref[np.arange(len(prompt) - 1, len(prompt) + 4), gen], atol=1e-4)
    assert all(lp.ranks == [1] for lp in lps)                  # greedy picks the most likely token
    plp = prompt_lp(outs)
    assert np.allclose(plp.logprobs, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    assert all(len(t) == 3 for t in plp.top_token_ids) and all(len(t) == 20 for lp in lps for t in lp.top_token_ids)


def test_logprobs_do_not_depend_on_the_batch_or_the_chunks(smollm2_dir, smol):
    """One request alone, in a batch of others, and with its prompt prefilled in chunks of 7 tokens (and a
    pool so small that requests are preempted): the same tokens and the same log-probabilities."""
    p = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=4, prompt_logprobs=2)
    prompt = list(range(200, 237))

    def summary(outs):
        lp = [(o.logprobs.logprobs, o.logprobs.ranks, o.logprobs.top_token_ids, o.logprobs.top_logprobs)
              for o in outs if o.logprobs is not None]
        p_lp = prompt_lp(outs)
        return [t for o in outs for t in o.new_token_ids], lp, (p_lp.logprobs, p_lp.top_token_ids, p_lp.top_logprobs)

    alone = summary(run(smol, {"x": (prompt, p)})["x"])
    others = {f"o{i}": (list(range(300 + i, 330 + 3 * i)), SamplingParams(max_tokens=8, temperature=0.0, logprobs=i % 2 or None))
              for i in range(5)}
    batched = summary(run(smol, {**others, "x": (prompt, p)})["x"])
    chunked = LLMEngine(smollm2_dir, device="cpu", kv_cache_memory="64MiB", warmup=False, max_num_batched_tokens=7,
                        max_num_seqs=4)
    in_chunks = summary(run(chunked, {**others, "x": (prompt, p)})["x"])
    # The same tokens; values within float32 rounding: the float32 model's products (BLAS) and attention
    # kernels round a row's logits by the step's shape, while log-probabilities are computed per row
    # (test_backend_logprobs_are_row_local holds that part bit for bit).
    for other in (batched, in_chunks):
        assert other[0] == alone[0]
        for a, b in zip(alone[1] + [alone[2]], other[1] + [other[2]]):
            assert np.allclose(np.asarray(a[0]), np.asarray(b[0]), atol=1e-4)
            assert np.allclose(np.asarray(a[-1]), np.asarray(b[-1]), atol=1e-4)
        assert [x[2] for x in other[1]] == [x[2] for x in alone[1]]      # the same alternatives


def test_backend_logprobs_are_row_local(smol):
    """backend.logprobs gives a row the same bits alone and among other rows, whatever k."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 512)) * 4).astype(np.float32)
    logits[3, :40] = logits[3].max() + 1                      # ties: resolved by the smaller id
    toks = rng.integers(0, 512, 6)
    every = smol.backend.logprobs(logits, np.arange(6), toks, 20)
    for r in range(6):
        one = smol.backend.logprobs(logits[r:r + 1].copy(), np.array([0]), toks[r:r + 1], 20)
        for f in ("logprobs", "ranks", "top_ids", "top_logprobs"):
            assert np.array_equal(getattr(one, f)[0], getattr(every, f)[r]), f
    want = log_softmax(logits)
    assert np.allclose(every.logprobs, want[np.arange(6), toks], atol=1e-5)
    assert every.ranks.tolist() == [1 + int((logits[r] > logits[r, toks[r]]).sum()) for r in range(6)]
    assert every.top_ids[3, :5].tolist() == [0, 1, 2, 3, 4]
    order = np.lexsort((np.arange(512)[None].repeat(6, 0), -logits))[:, :20]
    assert np.array_equal(every.top_ids, order) and np.allclose(every.top_logprobs,
                                                                np.take_along_axis(want, order, 1), atol=1e-5)
    repeat = smol.backend.logprobs(logits, np.array([2, 2]), np.array([5, 9]), 0)
    assert repeat.top_ids.shape == (2, 0) and np.allclose(repeat.logprobs, want[2, [5, 9]], atol=1e-5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smol.backend.logprobs(logits, np.array([0]), np.array([512]), 1)


def test_a_request_that_does_not_ask_pays_nothing(smol, monkeypatch):
    """Greedy requests without logprobs: backend.logprobs is never called and the logits reach the host once
    per step, for the argmax (the CPU's argmax reads them where they are); with a logprobs request beside
    them, only its own row goes to backend.logprobs."""
    calls, copies, steps = [], [], []
    real_lp, real_host, real_step = smol.backend.logprobs, smol.backend.to_host, smol.step
    monkeypatch.setattr(smol.backend, "logprobs", lambda lg, rows, toks, k: calls.append(list(rows)) or
                        real_lp(lg, rows, toks, k))
    monkeypatch.setattr(smol.backend, "to_host", lambda x: copies.append(x.shape) or real_host(x))
    monkeypatch.setattr(smol, "step", lambda: steps.append(1) or real_step())
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    run(smol, {"a": ([5, 6, 7], plain), "b": ([8, 9], plain)})
    assert calls == [] and len(copies) == len(steps)
    run(smol, {"a": ([5, 6, 7], plain), "b": ([8, 9], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1)),
               "c": ([10, 11, 12, 13], plain)})
    assert len(calls) == 3 and all(c == [1] for c in calls)


def test_n_samples_share_the_prompt_logprobs_and_get_their_own(smol):
    outs = run(smol, {"n": (list(range(50, 70)), SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=3, logprobs=0,
                                                            prompt_logprobs=0))})["n"]
    by_index = {i: [o for o in outs if o.index == i] for i in range(3)}
    firsts = [prompt_lp(v) for v in by_index.values()]
    assert all(f.logprobs == firsts[0].logprobs and len(f) == 19 for f in firsts)
    for v in by_index.values():
        assert sum(o.prompt_logprobs is not None for o in v) == 1
        assert [t for o in v for t in o.logprobs.token_ids] == [t for o in v for t in o.new_token_ids]


def test_penalties_and_logit_bias_change_the_choice(smol):
    prompt = list(range(400, 420))
    base = run(smol, {"b": (prompt, SamplingParams(max_tokens=1, temperature=0.0))})["b"][0].new_token_ids[0]
    biased = run(smol, {"b": (prompt, SamplingParams(max_tokens=1, temperature=0.0, logit_bias={base: -100, 7: 100}))})
    assert biased["b"][0].new_token_ids == [7]
    rep = run(smol, {"r": (prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                  frequency_penalty=2.0, presence_penalty=2.0, logprobs=0))})["r"]
    ids = [t for o in rep for t in o.new_token_ids]
    assert len(set(ids)) >= 8                  # the penalties push away from repeating
    with pytest.raises(ValueError, match="logit_bias names token id"):
        smol.add_request("bad", prompt, SamplingParams(logit_bias={10**6: 1}))


def test_prompt_logprobs_survive_preemption(tiny_llama_dir):
    """A pool too small for every request at once: prefills are preempted and recomputed, and each request's
    prompt log-probabilities are still complete and equal to those it gets alone."""
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    prompts = {f"r{i}": [3 + i + 7 * j % 500 for j in range(60)] for i in range(4)}
    alone = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="16MiB", warmup=False)
    want = {rid: run(alone, {rid: (pr, p)})[rid] for rid, pr in prompts.items()}
    small = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory=12 * 16 * 2 * 2 * 2 * 16 * 4, warmup=False,
                      max_num_batched_tokens=32)
    got = run(small, {rid: (pr, p) for rid, pr in prompts.items()})
    assert small.stats()["num_preemptions"] > 0
    for rid in prompts:
        a, b = prompt_lp(want[rid]), prompt_lp(got[rid])
        assert b.token_ids == prompts[rid][1:] and np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert [t for o in got[rid] for t in o.new_token_ids] == [t for o in want[rid] for t in o.new_token_ids]
        assert sum(o.prompt_logprobs is not None for o in got[rid]) == 1
