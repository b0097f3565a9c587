"""The option groups every command shares (engine, sampling, the prompt) and CLIError, the one-line user error.

A leaf of the front-end layer: it imports only the shared vocabulary (config, sampling), so the command
modules in cli/ and the benchmarks in bench/ can both use it without importing each other.
"""

from __future__ import annotations

import argparse
import sys

from rawinfer.config import DEFAULT_MODEL, EngineConfig, parse_size
from rawinfer.sampling import SamplingParams


class CLIError(Exception):
    """A user error reported as one line, exit status 2."""


def add_engine_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    g = p.add_argument_group("engine")
    if model:
        g.add_argument("--model", default=DEFAULT_MODEL, help="converted model folder (default: %(default)s)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (default: auto)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="memory for KV blocks, e.g. 2GiB (default: 1GiB on the CPU; on CUDA what "
                        "--gpu-memory-utilization of the free GPU memory leaves after weights and workspace)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "int8"],
                   help="element type of the KV cache (default: auto = the model's dtype on CUDA; on the CPU "
                        "int8 for int8 models, float32 for float models; int8: CPU only, a float32 scale per "
                        "token and kv head)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=128, help="sequences in one step at most")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: all cores, fewer while other processes keep cores busy)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="CUDA: share of free device memory")
    g.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run decode steps eagerly")


def engine_config_from_args(args) -> EngineConfig:
    try:
        kv = None if args.kv_cache_memory is None else parse_size(args.kv_cache_memory)
    except ValueError as e:
        raise CLIError(f"--kv-cache-memory: {e}") from None
    cfg = EngineConfig(block_size=args.block_size, kv_cache_memory=kv, kv_cache_dtype=args.kv_cache_dtype,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                       device=args.device, num_threads=args.threads,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       use_cuda_graphs=not args.no_cuda_graphs)
    try:
        return cfg.validate()
    except ValueError as e:
        raise CLIError(str(e).replace("engine option ", "--").replace("_", "-", 0)) from None


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params_from_args(args) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise CLIError(str(e).replace("SamplingParams.", "--").replace("_", "-")) from None


def read_prompt(args) -> str:
    """The positional prompt, else stdin (not a terminal, not empty)."""
    if args.prompt is not None:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError("no prompt: give it as an argument or on stdin")
    text = sys.stdin.read()
    if not text.strip():
        raise CLIError("the prompt on stdin is empty")
    return text
