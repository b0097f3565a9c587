"""Greedy decoding must be deterministic: run one prompt many times and compare every run's tokens.

    .venv/bin/python tools/stress_greedy.py --model weights/smollm2-135m-instruct-q4 --runs 20 --busy 2
    .venv/bin/python tools/stress_greedy.py --fresh 10 --busy 1     # each run in a fresh process
    .venv/bin/python tools/stress_greedy.py --int8-activations      # on 8-bit activations (a8gemm.py)
    .venv/bin/python tools/stress_greedy.py --prefix-caching --batch-invariant   # prefix hits, same tokens

--runs N generations in this process (one engine), --fresh N more, each in a new process (the first
calls of a process: kernel cache loads, buffer growth). --busy K starts K busy-loop processes for the
whole experiment, so that the Numba workers share the cores (they are always stopped at the end).
Prefix caching is off unless --prefix-caching: a run that finds the prompt's blocks cached computes
only its tail, with other kernels, and may round differently from a full prefill. Every run is
compared with the first; the exit status is 1 when any differs. --batch-invariant takes every query
through one attention kernel, so that prefix hits give the full prefill's tokens too.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                  # the checkout this file is in, not another installed copy
DEFAULT_PROMPT = "What is the capital of France?"


def _spin() -> None:
    while True:
        pass


def _generate(llm, prompt: str, max_tokens: int) -> list[int]:
    from rawinfer import SamplingParams
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return list(out[0].token_ids)


def _engine(model: str, raw: bool, prompt: str, prefix_caching: bool, a8: bool, invariant: bool):
    from rawinfer import LLM
    from rawinfer.engine.tokenizer import chat_messages, has_chat_template, render_chat
    llm = LLM(model, enable_prefix_caching=prefix_caching, int8_activations=a8, batch_invariant=invariant)
    if not raw and has_chat_template(llm.tokenizer):          # as `rawinfer generate` renders it
        prompt = render_chat(llm.tokenizer, chat_messages(prompt, None))
    return llm, prompt


def _one_run(args) -> int:
    """--child: one engine, --runs generations, one JSON line per run on stdout."""
    llm, prompt = _engine(args.model, args.raw, args.prompt, args.prefix_caching, args.int8_activations,
                          args.batch_invariant)
    for _ in range(args.runs):
        print(json.dumps(_generate(llm, prompt, args.max_tokens)), flush=True)
    return 0


def _child_runs(args) -> list[list[int]]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--runs", "1", "--model", args.model,
           "--max-tokens", str(args.max_tokens), "--prompt", args.prompt] + (["--raw"] if args.raw else []) + \
        (["--prefix-caching"] if args.prefix_caching else []) + \
        (["--int8-activations"] if args.int8_activations else []) + \
        (["--batch-invariant"] if args.batch_invariant else [])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
        return [[-r.returncode]]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(ROOT, "weights", "smollm2-135m-instruct-q4"))
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--prefix-caching", action="store_true", help="keep the engine's prefix caching on")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=10, help="generations in this process")
    p.add_argument("--fresh", type=int, default=0, help="generations, each in a fresh process")
    p.add_argument("--busy", type=int, default=0, help="busy-loop processes during the experiment")
    p.add_argument("--int8-activations", action="store_true", help="8-bit activations (int8 and q4 models)")
    p.add_argument("--batch-invariant", action="store_true", help="one attention kernel for every query")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _one_run(args)

    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    runs: list[tuple[str, list[int]]] = []
    t0 = time.monotonic()
    try:
        for s in spinners:
            s.start()
        if args.runs:
            llm, prompt = _engine(args.model, args.raw, args.prompt, args.prefix_caching, args.int8_activations,
                                  args.batch_invariant)
            for i in range(args.runs):
                runs.append((f"in-process {i}", _generate(llm, prompt, args.max_tokens)))
        for i in range(args.fresh):
            for toks in _child_runs(args):
                runs.append((f"fresh {i}", toks))
    finally:
        for s in spinners:
            s.terminate()
        for s in spinners:
            s.join()
    ref = runs[0][1]
    bad = [(name, toks) for name, toks in runs if toks != ref]
    print(f"{len(runs)} runs in {time.monotonic() - t0:.1f} s, busy={args.busy}: {len(bad)} differ from the first "
          f"({len(ref)} tokens)")
    for name, toks in bad[:5]:
        first = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
        print(f"  {name}: first difference at token {first}: {toks[first:first + 8]} vs {ref[first:first + 8]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
