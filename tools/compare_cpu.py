#!/usr/bin/env python3
"""Side-by-side CPU comparison on SmolLM2-135M-Instruct (or, --preset gemma3, Gemma 3 270M): rawinfer vs
llama.cpp vs transformers.

Workloads (measured one after the other, each engine in its own process, 2 threads each):
  decode   single-stream greedy decode of 128 tokens, best of 2   peer: llama.cpp (llama-cpp-python), same GGUF
  prefill  one 500-token prompt, logits of the last position       peer: transformers (torch, float32)
  batch64  64 requests, 128 prompt + 128 output tokens, ignore EOS peer: transformers generate, left-padded batch

rawinfer runs each workload on three conversions of the same GGUF: float32, int8 (--quant int8) and
q4 (--quant q4, the file's own 4-bit blocks), and on the int8 and q4 ones with --int8-activations
("int8a8", "q4a8": activations in 8 bits per block of 32, as llama.cpp's q8_0); the ratio takes the best
of them (--models narrows it).

Peers are optional: give a Python that has them with --peer-python (llama_cpp and/or torch +
transformers + gguf installed there); a missing peer prints "n/a". rawinfer runs in this Python.

    python tools/compare_cpu.py --peer-python /path/to/peers/bin/python [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
RAW_PROMPT = "Once upon a time, a lighthouse keeper found a message in a bottle. It said"
# preset -> (folder under weights/, GGUF file in the cache, prompt mode: the chat template or raw text)
PRESETS = {"smollm2": ("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", "chat"),
           "gemma3": ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", "raw")}

# ---- the measurement scripts (run in a fresh interpreter each) ----------------------------------
RAWINFER = r'''
import json, sys, time, numpy as np
from rawinfer import LLM, SamplingParams
model, workload, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompt, raw, a8 = sys.argv[4], sys.argv[5] == "raw", sys.argv[6] == "a8"
llm = LLM(model, device="cpu", num_threads=threads, kv_cache_memory="2GiB", max_num_batched_tokens=2048,
          max_num_seqs=64, int8_activations=a8)
V = llm.engine.model_config.vocab_size
rng = np.random.default_rng(0)
warm = llm.generate([[100, 200, 300]] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
if workload == "decode":
    text = prompt if raw else llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    value = 0.0
    for rep in range(2):                      # the best of two, as the llama.cpp script takes
        r = llm.generate([text], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        m = r.metrics
        value = max(value, (m.generated_tokens - 1) / (m.finished_time - m.first_token_time))
elif workload == "prefill":
    ids = [int(x) for x in rng.integers(100, V - 100, 500)]
    best = 1e9
    for i in range(3):
        r = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
        best = min(best, r.metrics.ttft_s)
        llm.engine.block_manager.reset_prefix_cache()
    value = 500 / best
else:
    prompts = [[int(x) for x in rng.integers(100, V - 100, 128)] for _ in range(64)]
    t = time.perf_counter()
    res = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
    value = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t)
print(json.dumps({"value": value}))
'''

LLAMA_CPP = r'''
import json, sys, time
from llama_cpp import Llama
gguf, threads, prompt, raw = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "raw"
llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
if raw:
    toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
else:
    msgs = "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n"
    toks = llm.tokenize(msgs.encode(), add_bos=False, special=True)
best = 0.0
for rep in range(2):
    llm.reset()
    times = []
    for i, tok in enumerate(llm.generate(toks, top_k=1, top_p=1.0, temp=0.0, reset=True)):
        times.append(time.perf_counter())
        if len(times) == 128:
            break
    best = max(best, 127 / (times[-1] - times[0]))
print(json.dumps({"value": best}))
'''

TRANSFORMERS = r'''
import json, sys, time, os
import numpy as np, torch
from transformers import AutoModelForCausalLM
gguf, workload, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                             torch_dtype=torch.float32)
model.eval()
V = model.config.vocab_size
rng = np.random.default_rng(0)
with torch.inference_mode():
    if workload == "prefill":
        ids = torch.tensor([rng.integers(100, V - 100, 500)])
        model(ids[:, :16], logits_to_keep=1)
        best = 1e9
        for _ in range(3):
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            best = min(best, time.perf_counter() - t)
        value = 500 / best
    else:
        ids = torch.tensor(rng.integers(100, V - 100, (64, 128)))
        mask = torch.ones_like(ids)   # equal lengths: the left padding is empty
        model.generate(ids[:2, :8], attention_mask=mask[:2, :8], max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=128, min_new_tokens=128, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
        value = (out.shape[1] - 128) * 64 / (time.perf_counter() - t)
print(json.dumps({"value": value}))
'''


def user_env() -> dict:
    """This process's environment as a user's machine would have it: without the OPENBLAS_CORETYPE /
    OPENBLAS_L2_SIZE pins these test machines set for old OpenBLAS builds, with this checkout first."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def blas_kernel() -> tuple[str, str]:
    """The OpenBLAS kernel the measured processes run and the path of rawinfer's CPU kernels there (asked in
    a process with their environment)."""
    code = "import numpy; from rawinfer.backend.cpu import blas, isa; print(blas.describe()); print(isa.describe())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=user_env())
    lines = r.stdout.strip().splitlines()
    return (lines[0], lines[1]) if len(lines) == 2 else ("unknown", "unknown")


def run_script(python: str, script: str, *args: str, timeout: float = 1800) -> float | None:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        env = user_env()
        r = subprocess.run([python, f.name, *args], capture_output=True, text=True, timeout=timeout, env=env)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        print(f"  (failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})",
              file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["value"]


def has_module(python: str, *mods: str) -> bool:
    code = "import importlib.util, sys; sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)"
    return subprocess.run([python, "-c", code, *mods], capture_output=True).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2",
                    help="the model: its folders under weights/, its GGUF in the cache, chat or raw prompt")
    ap.add_argument("--model", default=None, help="float32 rawinfer model (default: the preset's)")
    ap.add_argument("--int8-model", default=None,
                    help="int8 rawinfer model (converted with --quant int8 when missing)")
    ap.add_argument("--q4-model", default=None, help="q4 rawinfer model (converted with --quant q4 when missing)")
    ap.add_argument("--gguf", default=None, help="the GGUF the peers load (default: the preset's, in the cache)")
    ap.add_argument("--peer-python", default=sys.executable, help="Python with llama_cpp / torch+transformers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="float32,int8,int8a8,q4,q4a8",
                    help="comma-separated rawinfer models to run (int8a8, q4a8: the int8 and q4 models with "
                         "--int8-activations)")
    ap.add_argument("--workloads", default="decode,prefill,batch64", help="comma-separated subset to run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every engine this many times, interleaved, and keep each one's best "
                         "(these shared machines drift by 20%% over minutes)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chosen = set(args.workloads.split(","))
    folder, gguf_name, prompt_mode = PRESETS[args.preset]
    args.model = args.model or os.path.join(ROOT, "weights", folder)
    args.int8_model = args.int8_model or os.path.join(ROOT, "weights", folder + "-int8")
    args.q4_model = args.q4_model or os.path.join(ROOT, "weights", folder + "-q4")
    args.gguf = args.gguf or os.path.join(os.environ.get("RAWINFER_CACHE", os.path.expanduser("~/.cache/rawinfer")),
                                          gguf_name)

    models = {"float32": args.model, "int8": args.int8_model, "int8a8": args.int8_model, "q4": args.q4_model,
              "q4a8": args.q4_model}
    unknown = set(args.models.split(",")) - set(models)
    if unknown:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))}; choose from {', '.join(models)}")
    models = {k: v for k, v in models.items() if k in args.models.split(",")}
    for quant in ("int8", "int8a8", "q4", "q4a8"):
        if quant in models and not os.path.isfile(os.path.join(models[quant], "config.json")):
            from rawinfer.convert import convert
            print(f"converting {args.gguf} -> {models[quant]} ({quant})", file=sys.stderr)
            convert(args.gguf, models[quant], quant=quant.removesuffix("a8"), progress=False)
    th = str(args.threads)
    prompt = RAW_PROMPT if prompt_mode == "raw" else PROMPT
    blas_info, kernels = blas_kernel()
    print(f"BLAS of the measured processes: {blas_info}; rawinfer's CPU kernels: {kernels}", file=sys.stderr)
    have_llama = has_module(args.peer_python, "llama_cpp")
    have_hf = has_module(args.peer_python, "torch", "transformers", "gguf")
    rows = []

    def measure(workload, peer_name, peer):
        if workload not in chosen:
            return
        runs = {f"rawinfer_{name}": [] for name in models} | {"peer_value": []}
        for rnd in range(args.rounds):
            tag = f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""
            for name, path in models.items():
                print(f"[{workload}] rawinfer {name}{tag} ...", file=sys.stderr)
                a8 = "a8" if name.endswith("a8") else "-"
                runs[f"rawinfer_{name}"].append(run_script(sys.executable, RAWINFER, path, workload, th, prompt,
                                                           prompt_mode, a8))
            print(f"[{workload}] {peer_name}{tag} ...", file=sys.stderr)
            runs["peer_value"].append(peer())
        best = {k: max((v for v in vals if v is not None), default=None) for k, vals in runs.items()}
        rows.append({"workload": workload, "peer": peer_name, **best, "all_runs": runs})

    measure("decode", "llama.cpp", lambda: run_script(args.peer_python, LLAMA_CPP, args.gguf, th, prompt, prompt_mode)
            if have_llama else None)
    measure("prefill", "transformers", lambda: run_script(args.peer_python, TRANSFORMERS, args.gguf, "prefill", th)
            if have_hf else None)
    measure("batch64", "transformers", lambda: run_script(args.peer_python, TRANSFORMERS, args.gguf, "batch64", th)
            if have_hf else None)

    targets = {"decode": 1.5, "prefill": 3.0, "batch64": 4.0}     # issue 22's
    units = {"decode": "decode tokens/s", "prefill": "prefill tokens/s", "batch64": "output tokens/s"}
    fmt = (lambda v: "n/a" if v is None else f"{v:.1f}")
    print(f"\n{'workload':9} {'metric':17} {'rawinfer f32':>12} {'int8':>7} {'int8a8':>7} {'q4':>7} {'q4a8':>7} "
          f"{'peer':>13} "
          f"{'value':>8} {'best ratio':>10} {'target':>7}  met")
    for r in rows:
        best = max(v for v in [r[f"rawinfer_{name}"] for name in models] + [0.0] if v is not None)
        ratio = best / r["peer_value"] if r["peer_value"] else None
        r["ratio"], r["target"] = ratio, targets[r["workload"]]
        r["met"] = None if ratio is None else ratio >= r["target"]
        print(f"{r['workload']:9} {units[r['workload']]:17} {fmt(r.get('rawinfer_float32')):>12} "
              f"{fmt(r.get('rawinfer_int8')):>7} {fmt(r.get('rawinfer_int8a8')):>7} {fmt(r.get('rawinfer_q4')):>7} "
              f"{fmt(r.get('rawinfer_q4a8')):>7} "
              f"{r['peer']:>13} {fmt(r['peer_value']):>8} "
              f"{'n/a' if ratio is None else f'{ratio:.2f}x':>10} {r['target']:>6.1f}x  "
              f"{'n/a' if r['met'] is None else ('yes' if r['met'] else 'NO')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "rounds": args.rounds,
                       "blas": blas_info, "cpu_kernels": kernels, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
