"""What chunking costs a prompt: one prompt prefilled in one step, and in chunks of N tokens
(--long-prefill-token-threshold N, no decodes beside it, no inter-token target), timed round-robin so
that every chunk size sees the same load; prints each one's median and its ratio to the first.

    python tools/prefill_chunk_cost.py --model weights/smollm2-135m-instruct --prompt-len 1024 \
        --chunks 1024 512 256 128 64 --rounds 5

Where chunks of some size cost far more per token than the whole prompt, a scheduler that sizes prefill
chunks to an inter-token target pays that (docs/benchmarks.md, "Fair under load").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="weights/smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 512, 256, 128, 64])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from rawinfer import SamplingParams
    from rawinfer.backend.cpu import isa
    from rawinfer.engine.llm import LLM
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 40000, args.prompt_len)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engines = {c: LLM(args.model, device="cpu", kv_cache_memory="128MiB", max_num_batched_tokens=args.prompt_len,
                      long_prefill_token_threshold=c, enable_prefix_caching=False, itl_target_ms=0)
               for c in args.chunks}
    times: dict[int, list[float]] = {c: [] for c in args.chunks}
    for _ in range(args.rounds):
        for c, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[c].append(time.perf_counter() - t0)
    base = statistics.median(times[args.chunks[0]])
    print(f"{args.model}, {args.prompt_len}-token prompt, CPU kernels for {isa.describe()}")
    for c, ts in times.items():
        m = statistics.median(ts)
        print(f"  chunks of {c:5d}: {m * 1e3:7.0f} ms  {m / base:.2f}x")


if __name__ == "__main__":
    main()
