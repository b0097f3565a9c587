"""The `rawinfer` command line: generate, convert, serve, client, bench. Shared option groups live here."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from rawinfer.config import DEFAULT_MODEL, EngineConfig, ModelFormatError, parse_size
from rawinfer.quant import QUANT_TYPES
from rawinfer.sampling import SamplingParams

log = logging.getLogger("rawinfer")


class CLIError(Exception):
    """A user error reported as one line, exit status 2."""


# ---- shared option groups ---------------------------------------------------------------------
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
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
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
    if args.prompt is not None:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError("no prompt: give it as an argument or on stdin")
    text = sys.stdin.read()
    if not text.strip():
        raise CLIError("the prompt on stdin is empty")
    return text


def result_json(text: str, token_ids: list[int], prompt_token_ids: list[int], finish_reason: str | None,
                ttft_s: float | None, itl_s: float | None, tokens_per_s: float | None) -> dict:
    """The --json object of `rawinfer generate` and `rawinfer client` (same keys)."""
    return {"text": text, "token_ids": token_ids, "prompt_token_ids": prompt_token_ids,
            "finish_reason": finish_reason, "ttft_s": ttft_s, "itl_s": itl_s, "tokens_per_s": tokens_per_s}


def summary_line(n_prompt: int, n_gen: int, ttft: float | None, itl: float | None, tps: float | None) -> str:
    ms = (lambda v: "n/a" if v is None else f"{v * 1000:.1f} ms")
    return (f"[prompt {n_prompt} tokens | generated {n_gen} tokens | TTFT {ms(ttft)} | mean ITL {ms(itl)} | "
            f"{'n/a' if tps is None else f'{tps:.1f}'} tokens/s]")


def build_chat_or_raw(tokenizer, prompt: str, raw: bool, system: str | None = None) -> str:
    if raw or tokenizer is None or not tokenizer.config.chat_template:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


# ---- generate -----------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from rawinfer.engine.engine import LLMEngine
    params = sampling_params_from_args(args)
    prompt = read_prompt(args)
    engine = LLMEngine(args.model, engine_config_from_args(args))
    text_prompt = build_chat_or_raw(engine.tokenizer, prompt, args.raw, args.system)
    ids = engine.add_request("generate", text_prompt, params)
    out_ids: list[int] = []
    text = []
    final = None
    t0 = time.monotonic()
    while engine.has_unfinished():
        for out in engine.step():
            out_ids.extend(out.new_token_ids)
            text.append(out.text_delta)
            if not args.json and out.text_delta:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
            if out.finished:
                final = out
    m = final.metrics
    gen_s = (m.finished_time - m.first_token_time) if m.first_token_time and m.finished_time else None
    tps = (m.generated_tokens - 1) / gen_s if gen_s and m.generated_tokens > 1 else None
    if args.json:
        print(json.dumps(result_json("".join(text), out_ids, ids, final.finish_reason, m.ttft_s, m.mean_itl_s, tps)))
    else:
        sys.stdout.write("\n")
        print(summary_line(len(ids), len(out_ids), m.ttft_s, m.mean_itl_s, tps), file=sys.stderr)
    log.debug("total %.2f s", time.monotonic() - t0)
    return 0


def cmd_convert(args) -> int:
    from rawinfer.convert import convert
    cfg = convert(args.src, args.dst, dtype=args.dtype, quant=args.quant, progress=not args.quiet,
                  overwrite=args.force)
    print(f"converted {args.src} -> {args.dst} ({cfg.architecture}, {cfg.num_layers} layers, "
          f"{cfg.num_params() / 1e6:.1f}M parameters, {cfg.dtype}{', ' + cfg.quant if cfg.quant else ''})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rawinfer", description="A readable LLM inference engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate text for one prompt, streaming")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when absent)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("convert", help="convert a Hugging Face folder or a GGUF file into rawinfer's format")
    p.add_argument("src", help="Hugging Face model folder or .gguf file")
    p.add_argument("dst", help="output folder (e.g. weights/NAME)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quant", default=None, choices=QUANT_TYPES,
                   help="weight-only quantization: int8 rows, or q4 blocks for the layers (rawinfer/quant.py)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=cmd_convert)

    from rawinfer.frontends.bench import throughput as bench
    bench.add_parser(sub)
    from rawinfer.frontends.cli import serve
    serve.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="rawinfer: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("rawinfer: interrupted", file=sys.stderr)
        return 130
    except (CLIError, ModelFormatError, ValueError, RuntimeError, OSError) as e:
        if args.verbose:
            raise
        print(f"rawinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
