#!/usr/bin/env python3
"""Single-stream decode while other processes keep cores busy: default threads vs --threads 1.

For each number of busy processes (each a `yes > /dev/null`), rawinfer decodes 128 greedy tokens of
the chat prompt in a fresh process, once with the default thread count (every core, narrowed by the
thread governor while others are busy) and once with one thread, alternating, `--rounds` times; the
best of each is reported with its ratio. The busy processes are killed whatever happens.

    python tools/busy_core.py [--model weights/smollm2-135m-instruct-int8] [--busy 0,1,2] [--json out.json]
                              [--int8-activations]    # int8 / q4 models on 8-bit activations (a8gemm.py)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DECODE = r'''
import json, sys
from rawinfer import LLM, SamplingParams
model, threads, a8 = sys.argv[1], (int(sys.argv[2]) or None), sys.argv[3] == "1"
llm = LLM(model, device="cpu", num_threads=threads, kv_cache_memory="512MiB", int8_activations=a8)
text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a long story about a lighthouse."}])
r = llm.generate([text], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)[0]
m = r.metrics
print(json.dumps({"tokens_per_s": (m.generated_tokens - 1) / (m.finished_time - m.first_token_time),
                  "threads_at_end": getattr(llm.engine.backend, "threads", None)}))
'''


def decode(model: str, threads: int, a8: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", DECODE, model, str(threads), str(int(a8))], capture_output=True,
                       text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else str(r.returncode))
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "weights", "smollm2-135m-instruct-int8"))
    ap.add_argument("--busy", default="0,1", help="comma-separated numbers of busy processes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--int8-activations", action="store_true", help="8-bit activations (int8 and q4 models)")
    args = ap.parse_args()
    rows = []
    for n in (int(b) for b in args.busy.split(",")):
        hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(n)]
        try:
            time.sleep(1.0)
            runs = {"default": [], "one": []}
            for rnd in range(args.rounds):
                for name, threads in (("default", 0), ("one", 1)):
                    runs[name].append(decode(args.model, threads, args.int8_activations))
                    print(f"busy {n}, round {rnd + 1}, {name}: {runs[name][-1]}", file=sys.stderr)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        best = {k: max(r["tokens_per_s"] for r in v) for k, v in runs.items()}
        rows.append({"busy": n, **best, "ratio": best["default"] / best["one"], "runs": runs})
    print(f"{'busy processes':>14} {'default tok/s':>14} {'--threads 1':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['busy']:>14} {r['default']:>14.1f} {r['one']:>12.1f} {r['ratio']:>6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model,
                       "int8_activations": args.int8_activations, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
