"""`rawinfer bench step-overhead`: the engine's host time per decode step, over a backend whose ops do nothing.

The real LLMEngine (scheduler, step plan, runner, sampler, output rules, detokenizer, metrics) runs on
backend/null.py's NullBackend: its layer ops return at once and its argmax answers one fixed word token, so
what a step costs here is what the engine costs around the device's work, the time an overlapped scheduler
must hide behind the GPU's step. For each batch size B, B requests (seeded random prompts, greedy, EOS
ignored) are prefilled, then every one decodes through warm-up steps and the timed steps, none finishing.

Each timed step is split into the engine's own phases, timed by wrapping the engine's objects' methods for
the run (their behaviour unchanged; the wrappers cost a few perf_counter calls a step):

    schedule   Scheduler.schedule() without the plan: who runs, block tables grown
    plan       build_step_plan(): the step's host arrays
    inputs     ModelRunner.flat_batch(): the plan's arrays as device inputs (as_index_array)
    forward    the rest of ModelRunner.run(): the model's op calls, every one a no-op here
    update     Scheduler.update(): computed tokens, prefix cache, finishes
    sample     Sampler.sample(): greedy rows through the backend's argmax and back to Python ints
    outputs    the rest of the engine's output processing: output rules, detokenizing, metrics
    other      the step's remainder (grammar masks, KV transfer hooks, speculative drafts: idle here)

Phases are reported as means, so they add up to the mean step; the step itself as median and p90 too.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

from rawinfer.backend.null import NullBackend
from rawinfer.config import EngineConfig, ModelConfig, resolve_max_model_len
from rawinfer.core import scheduler as core_scheduler
from rawinfer.engine.engine import LLMEngine
from rawinfer.exec.memory import kv_bytes_per_block
from rawinfer.frontends.bench.throughput import make_workload
from rawinfer.frontends.options import nonnegative_int, positive_int
from rawinfer.sampling import SamplingParams
from rawinfer.settings import check_options, is_int, option

DEFAULT_BATCH_SIZES = (1, 64, 256)
PHASES = ("schedule", "plan", "inputs", "forward", "update", "sample", "outputs", "other")
WORD = " the"     # the token every step samples: an ordinary word, so detokenizing does real work


def batch_sizes_argument(text: str) -> tuple[int, ...]:
    """--batch-sizes 1,64,256 -> (1, 64, 256)."""
    import argparse
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, e.g. 1,64,256; got {text!r}")
    return sizes


def _positive(v) -> bool:
    return is_int(v) and v > 0


@dataclass(frozen=True)
class StepOverheadConfig:
    """What `rawinfer bench step-overhead` measures, besides the engine's options (its flags come from here)."""

    batch_sizes: tuple = option(DEFAULT_BATCH_SIZES, parse=batch_sizes_argument, metavar="B,B,...",
                                check=lambda v: isinstance(v, (tuple, list)) and len(v) > 0 and all(map(_positive, v)),
                                what="one or more positive integers",
                                help="decoding sequences per step, each measured in turn (default: 1,64,256; "
                                     "--max-num-seqs is raised to the largest)")
    steps: int = option(200, parse=positive_int, check=_positive, what="a positive integer",
                        help="timed steps per batch size (default: 200)")
    warmup_steps: int = option(20, parse=nonnegative_int, check=lambda v: is_int(v) and v >= 0, what="an integer of 0 or more",
                               help="decode steps before the timed ones (default: 20)")
    prompt_len: int = option(128, parse=positive_int, check=_positive, what="a positive integer",
                             help="prompt tokens per request, random ids (default: 128)")
    seed: int = option(0, parse=nonnegative_int, check=lambda v: is_int(v) and v >= 0, what="an integer of 0 or more",
                       help="seed of the prompts (default: 0)")


def engine_config(model_dir: str, ecfg: EngineConfig, batch_sizes, prompt_len: int, steps: int) -> EngineConfig:
    """ecfg fitted to the runs: max_num_seqs raised to the largest batch, no warm-up (nothing compiles), prompts
    prefilled at the full step budget (--itl-target-ms 0 unless given: the target shapes only the prefill
    before the timed steps), and unless --kv-cache-memory was given a KV region just large enough for every
    sequence of the largest batch. A ValueError of one sentence where the options cannot hold the runs."""
    if ecfg.speculative_method is not None:
        raise ValueError("step-overhead measures plain decode steps; leave --speculative-method and "
                         "--speculative-model off")
    B = max(batch_sizes)
    if B >= ecfg.max_num_batched_tokens:
        raise ValueError(f"batch {B} needs --max-num-batched-tokens above {B} (it is {ecfg.max_num_batched_tokens}) "
                         "to decode every sequence and prefill beside them; raise it or lower --batch-sizes")
    model = ModelConfig.from_dir(model_dir)
    ecfg = dataclasses.replace(ecfg, max_num_seqs=max(ecfg.max_num_seqs, B), warmup=False,
                               itl_target_ms=0 if ecfg.itl_target_ms is None else ecfg.itl_target_ms)
    limit = resolve_max_model_len(model, ecfg)
    context = context_tokens(ecfg, B, prompt_len, steps)
    if context > limit:
        raise ValueError(f"--prompt-len {prompt_len} and the {context - prompt_len} tokens each request may "
                         f"generate do not fit the context of {limit} tokens; lower --prompt-len or --steps")
    if ecfg.kv_cache_memory is None:
        dtype = NullBackend().kv_dtype(model.dtype, ecfg.kv_cache_dtype, model.quant)
        blocks = B * (-(-context // ecfg.block_size) + 1)
        ecfg = dataclasses.replace(ecfg, kv_cache_memory=blocks * kv_bytes_per_block(model, ecfg.block_size, dtype))
    return ecfg.validate()


def context_tokens(ecfg: EngineConfig, batch: int, prompt_len: int, steps: int) -> int:
    """The most tokens a sequence reaches: its prompt, a token per prefill step of the batch (it may finish its
    prompt in the first and decode through the others), the `steps` (warm-up and timed) and one more, so that
    no request finishes inside the timed steps."""
    prefill_steps = -(-batch * prompt_len // (ecfg.max_num_batched_tokens - batch)) + 1
    return prompt_len + prefill_steps + steps + 1


def open_null_engine(model_dir: str, ecfg: EngineConfig) -> LLMEngine:
    """The engine of model_dir (its config, weights checked and read, tokenizer) on a NullBackend whose
    argmax answers WORD's token."""
    backend = NullBackend()
    engine = LLMEngine(model_dir, ecfg, backend=backend)
    if engine.tokenizer is not None:
        backend.token_id = engine.encode_prompt(WORD)[-1]
    return engine


def _timed(acc: dict, name: str, fn):
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t
    return timed


@contextmanager
def phase_timers(engine: LLMEngine):
    """Wrap the engine's step phases in timers for the block; yields the dict of seconds per wrapped call,
    which the caller zeroes before each step. Everything is put back as it was afterwards."""
    acc = dict.fromkeys(("schedule", "plan", "inputs", "run", "update", "sample", "outputs"), 0.0)
    wrapped = [(engine.scheduler, "schedule", "schedule"), (engine.scheduler, "update", "update"),
               (engine.runner, "flat_batch", "inputs"), (engine.runner, "run", "run"),
               (engine.sampler, "sample", "sample"), (engine, "_outputs", "outputs")]
    for obj, attr, name in wrapped:     # instance attributes shadow the class's methods
        setattr(obj, attr, _timed(acc, name, getattr(obj, attr)))
    plan = core_scheduler.build_step_plan
    core_scheduler.build_step_plan = _timed(acc, "plan", plan)
    try:
        yield acc
    finally:
        core_scheduler.build_step_plan = plan
        for obj, attr, _ in wrapped:
            delattr(obj, attr)


def _phases(acc: dict, total: float) -> dict:
    """One step's seconds per PHASES entry from the wrapped calls' (nested calls subtracted)."""
    p = {"schedule": acc["schedule"] - acc["plan"], "plan": acc["plan"], "inputs": acc["inputs"],
         "forward": acc["run"] - acc["inputs"], "update": acc["update"], "sample": acc["sample"],
         "outputs": acc["outputs"] - acc["sample"]}
    p["other"] = total - sum(p.values())
    return p


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _start(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int) -> list[str]:
    """Queue `batch` requests and step until each has its first token (prefill done); returns their ids."""
    V = engine.model_config.vocab_size
    wl = make_workload(batch, prompt_len, 1, 0.0, V, seed)
    generated = context_tokens(engine.config, batch, prompt_len, steps) - prompt_len
    params = SamplingParams(max_tokens=generated, temperature=0.0, ignore_eos=True)
    ids = [f"step-overhead-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, wl.prompts):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    for _ in range(generated):      # once a request could have finished, the pool cannot hold them all
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
        if len(started) == batch:
            return ids
    for rid in ids:
        engine.abort(rid)
    raise RuntimeError(_too_small(engine, batch))


def _too_small(engine: LLMEngine, batch: int) -> str:
    return (f"the KV region ({engine.block_manager.num_blocks} blocks) cannot hold {batch} decoding sequences at "
            "once; give a larger --kv-cache-memory (or leave it out: the benchmark sizes it)")


def measure(engine: LLMEngine, batch: int, steps: int = 200, warmup_steps: int = 20, prompt_len: int = 128,
            seed: int = 0) -> dict:
    """Host time of `steps` decode steps of `batch` sequences after `warmup_steps` more; every request is
    aborted afterwards. A RuntimeError where a timed step did not advance every sequence by one token (a KV
    region too small for them: preemption)."""
    ids = _start(engine, batch, prompt_len, warmup_steps + steps, seed)
    preempted = engine.scheduler.num_preemptions
    totals, phases = [], []
    try:
        for _ in range(warmup_steps):
            engine.step()
        with phase_timers(engine) as acc:
            for _ in range(steps):
                for k in acc:
                    acc[k] = 0.0
                t = time.perf_counter()
                outs = engine.step()
                total = time.perf_counter() - t
                tokens = sum(len(o.new_token_ids) for o in outs)
                if tokens != batch or any(o.finished for o in outs):
                    why = (_too_small(engine, batch) if engine.scheduler.num_preemptions > preempted else
                           "a request reached its max_tokens: its prefill took more steps than counted")
                    raise RuntimeError(f"a timed step advanced {tokens} of {batch} sequences by a token; {why}")
                totals.append(total)
                phases.append(_phases(acc, total))
    finally:
        for rid in ids:
            engine.abort(rid)
    return summarize_steps(batch, totals, phases)


def summarize_steps(batch: int, totals: list[float], phases: list[dict]) -> dict:
    ms = [1e3 * t for t in totals]
    median = statistics.median(ms)
    return {"batch": batch, "steps": len(ms),
            "step_ms": {"median": median, "p90": _percentile(ms, 0.9), "mean": statistics.fmean(ms),
                        "min": min(ms), "max": max(ms)},
            "per_sequence_us": 1e3 * median / batch,
            "phases_mean_ms": {k: 1e3 * statistics.fmean(p[k] for p in phases) for k in PHASES}}


def run(model_dir: str, ecfg: EngineConfig, cfg: StepOverheadConfig = StepOverheadConfig(), progress: bool = False,
        freeze: bool = False) -> dict:
    """The benchmark: one engine over the NullBackend, each of cfg's batch sizes measured in turn (measure()).
    ecfg: engine_config()'s for the same options. freeze: once the engine is built, its objects are moved out of
    the garbage collector's sight (gc.freeze), as the command line's open_engine leaves a serving process.
    A ValueError naming the field of a bad value of cfg."""
    check_options(cfg, "step-overhead option")
    t0 = time.monotonic()
    engine = open_null_engine(model_dir, ecfg)
    if freeze:
        gc.collect()
        gc.freeze()
    results = []
    for batch in cfg.batch_sizes:
        if progress:
            print(f"batch {batch}: {cfg.steps} timed steps after {cfg.warmup_steps}", file=sys.stderr)
        results.append(measure(engine, batch, cfg.steps, cfg.warmup_steps, cfg.prompt_len, cfg.seed))
    return {"benchmark": "step-overhead", "model": model_dir, "backend": engine.backend.name,
            "model_config": {"architecture": engine.model_config.architecture, "layers": engine.model_config.num_layers,
                             "vocab_size": engine.model_config.vocab_size, "quant": engine.model_config.quant},
            "engine": {"max_num_seqs": ecfg.max_num_seqs, "max_num_batched_tokens": ecfg.max_num_batched_tokens,
                       "block_size": ecfg.block_size, "prefix_caching": ecfg.enable_prefix_caching},
            "prompt_len": cfg.prompt_len, "warmup_steps": cfg.warmup_steps, "sampled_token": engine.backend.token_id,
            "seconds": time.monotonic() - t0, "results": results}


def print_report(r: dict, file=None) -> None:
    """The table: per batch size the step's median and p90, the host time per sequence, the mean per phase."""
    file = file or sys.stdout
    print(f"host time per decode step, {r['model']} ({r['model_config']['layers']} layers), null backend; "
          "phases: mean ms", file=file)
    head = f"{'batch':>6} {'median ms':>10} {'p90 ms':>8} {'us/seq':>8} " + " ".join(f"{p:>8}" for p in PHASES)
    print(head, file=file)
    for x in r["results"]:
        s = x["step_ms"]
        print(f"{x['batch']:>6} {s['median']:>10.3f} {s['p90']:>8.3f} {x['per_sequence_us']:>8.1f} "
              + " ".join(f"{x['phases_mean_ms'][p]:>8.3f}" for p in PHASES), file=file)
