"""Speculative decoding against plain decoding, side by side in one process (issue 51's table).

    python tools/spec_bench.py --workload ngram              # batch 1, input-grounded prompts, float32 + q4
    python tools/spec_bench.py --workload draft              # batch 1, chat prompts: q4 drafts for float32
    python tools/spec_bench.py --workload batch --concurrency 32     # output throughput at 32 requests
    python tools/spec_bench.py --workload sweep              # tokens/s by batch size: the cost model's drafts, K
    python tools/spec_bench.py --workload pool               # the draft in the target's pool vs in its own

Each engine is built once; the runs alternate (plain, speculative, plain, ...) for --rounds rounds so both
see the same machine load. Batch 1 reports the mean inter-token latency (decode time / (tokens - 1)), the
batch workloads output tokens/s; every row says whether the greedy outputs were identical and the
acceptance. Unset OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE first (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
F32, Q4 = str(ROOT / "weights/smollm2-135m-instruct"), str(ROOT / "weights/smollm2-135m-instruct-q4")
CHAT = ["What is the capital of France? Answer in two sentences.", "Explain what a hash table is.",
        "Write a short poem about autumn leaves.", "Give three tips for learning to cook."]


def grounded_prompts() -> list[list[dict]]:
    """Input-grounded chat prompts: rewrite a given code file with one change; answer quoting a given passage."""
    code = (ROOT / "rawinfer/core/free_list.py").read_text().split("\n\n\n")[1][:1400]
    passage = (ROOT / "README.md").read_text()[:1200]
    return [[{"role": "user", "content": "Rewrite this Python code, renaming the variable `block` to `blk`. "
                                         "Output the whole code.\n\n" + code}],
            [{"role": "user", "content": "Here is a passage:\n\n" + passage + "\n\nQuote the passage's first "
                                         "paragraph word for word."}]]


def engine(model: str, **opts):
    from rawinfer.engine.llm import LLM
    return LLM(model, device="cpu", kv_cache_memory="512MiB", **opts)


def run(llm, prompts, max_tokens: int) -> tuple[list, float, float]:
    """(token ids per prompt, seconds, mean inter-token latency in ms over the prompts run one by one...)
    for all prompts submitted together."""
    from rawinfer import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    itls = [o.metrics.mean_itl_s for o in outs if o.metrics and o.metrics.mean_itl_s]
    return [o.token_ids for o in outs], dt, 1e3 * statistics.mean(itls) if itls else float("nan")


def chat_ids(llm, conversations) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]


def compare(name: str, plain, spec, prompts, args, batch: bool) -> None:
    """Alternate plain and speculative runs; print one table row."""
    base, fast, same = [], [], True
    for _ in range(args.rounds):
        for llm, acc in ((plain, base), (spec, fast)):
            if batch:
                ids, dt, _ = run(llm, prompts, args.max_tokens)
                acc.append((ids, sum(map(len, ids)) / dt))
            else:
                runs = [run(llm, [p], args.max_tokens) for p in prompts]
                acc.append(([r[0][0] for r in runs], statistics.mean(r[2] for r in runs)))
        same &= base[-1][0] == fast[-1][0]
    b, f = statistics.median(x for _, x in base), statistics.median(x for _, x in fast)
    s = spec.engine.stats()["speculative"]
    ratio = f / b if batch else b / f
    unit = "output tok/s" if batch else "mean ITL ms"
    print(f"| {name} | {unit} {b:.1f} -> {f:.1f} | {ratio:.2f}x | identical: {same} | acceptance "
          f"{s['acceptance_rate']:.2f}, mean length {s['mean_acceptance_length']:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("ngram", "draft", "batch", "sweep", "pool"), default="ngram")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    from rawinfer.backend.cpu import isa
    print(f"CPU kernels for {isa.describe()}; k = {args.k}", flush=True)
    if args.workload == "ngram":
        for model in (F32, Q4):
            plain, spec = engine(model), engine(model, speculative_method="ngram", num_speculative_tokens=args.k)
            compare(f"ngram, {Path(model).name}, batch 1, grounded", plain, spec, chat_ids(plain, grounded_prompts()),
                    args, batch=False)
    elif args.workload == "draft":
        plain = engine(F32)
        spec = engine(F32, speculative_model=Q4, num_speculative_tokens=args.k)
        prompts = chat_ids(plain, [[{"role": "user", "content": q}] for q in CHAT])
        compare("draft q4 -> float32, batch 1, chat", plain, spec, prompts, args, batch=False)
    elif args.workload == "batch":
        for method, extra in (("ngram", {}), ("draft", {"speculative_model": Q4})):
            plain = engine(F32)
            spec = engine(F32, speculative_method=method, num_speculative_tokens=args.k, **extra)
            convs = [[{"role": "user", "content": CHAT[i % len(CHAT)] + f" (#{i})"}] for i in range(args.concurrency)]
            compare(f"{method}, float32, {args.concurrency} concurrent", plain, spec, chat_ids(plain, convs), args,
                    batch=True)
    elif args.workload == "pool":
        pool(args)
    else:
        sweep(args)


def pool(args) -> None:
    """The draft model in the target's memory pool (as the engine builds it) against a draft with a pool of its own
    beside a target that keeps the whole KV region (as before they shared one): batch 1 chat prompts and 32
    concurrent, each against plain decoding."""
    import dataclasses
    from rawinfer.engine.draft import DraftProposer
    from rawinfer.engine.speculative import Speculator
    plain = engine(F32)
    shared = engine(F32, speculative_model=Q4, num_speculative_tokens=args.k)
    own = engine(F32)
    e = own.engine
    ecfg = dataclasses.replace(e.config, speculative_method="draft", speculative_model=Q4)
    e.speculator = Speculator(DraftProposer(Q4, e.model_config, ecfg), args.k, e.max_model_len, keeps_state=True)
    prompts = chat_ids(plain, [[{"role": "user", "content": q}] for q in CHAT])
    convs = [[{"role": "user", "content": CHAT[i % len(CHAT)] + f" (#{i})"}] for i in range(args.concurrency)]
    for name, llm in (("shared pool", shared), ("own pool", own)):
        compare(f"draft q4 -> float32 ({name}), batch 1, chat", plain, llm, prompts, args, batch=False)
        compare(f"draft q4 -> float32 ({name}), {args.concurrency} concurrent", plain, llm, chat_ids(plain, convs),
                args, batch=True)


def sweep(args) -> None:
    """Output tokens/s at batch 1, 2, 4, 8, 16: the drafts the step-cost model chooses (auto), and K drafts
    for every decoding sequence whatever it costs (forced), each against plain decoding."""
    for model in (Q4, F32):
        plain = engine(model)
        auto = engine(model, speculative_method="ngram", num_speculative_tokens=args.k)
        forced = engine(model, speculative_method="ngram", num_speculative_tokens=args.k)
        forced.engine.speculator.choose_k = lambda *_: args.k
        convs = grounded_prompts()
        for b in (1, 2, 4, 8, 16):
            prompts = chat_ids(plain, [[{"role": "user", "content": convs[i % len(convs)][0]["content"] + f" (#{i})"}]
                                       for i in range(b)])
            for name, spec in (("auto", auto), ("forced", forced)):
                compare(f"ngram {name}, {Path(model).name}, batch {b}", plain, spec, prompts, args, batch=True)


if __name__ == "__main__":
    main()
