"""`rawinfer bench roofline`: this machine's ceilings next to what prefill and decode achieve.

Ceilings, measured here: memory copy bandwidth (bytes read + written per second by a large copy) and
the float32 GEMM rate (a square BLAS/cuBLAS matmul); for an int8 or q4 model on the CPU also the rate
of the GEMM its matrices run on (the integer GEMMs of backend/cpu/qgemm.py and q4gemm.py), which is
then its compute ceiling. For one model we then time a prefill of P tokens and a decode step of B
sequences and count, per step,

    FLOPs = 2 x (matrix parameters touched) x tokens  +  4 x H x D x (attended positions)
    bytes = weight bytes (every matrix read once)     +  KV bytes read by attention

Achieved GFLOP/s and GB/s against the ceilings show where a phase sits: arithmetic intensity
(FLOPs / byte) above the ridge point (peak FLOP/s / peak bytes/s) means compute-bound, below it
memory-bound; the percentage says how far from its limit the phase runs.

Last, a whole offline workload (default 64 requests of 128 prompt + 128 output tokens, EOS ignored, all
submitted at once: the batch64 workload of tools/compare_cpu.py): its FLOPs (every prompt's prefill,
every decode step, attention included) over its wall time, against the float32 GEMM ceiling (issue
22's measure of how well the engine uses the machine) and against the model's compute ceiling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from rawinfer.config import ModelConfig
from rawinfer.frontends.options import positive_int
from rawinfer.settings import check_options, is_int, optional, option

DEFAULT_BATCHES = (1, 64)


def _positive(v) -> bool:
    return is_int(v) and v > 0


def workload_argument(text: str):
    """--workload NxP/O (e.g. 64x128/128) -> (N, P, O); "0" -> None."""
    import argparse
    import re
    if text.strip() == "0":
        return None
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or min(int(g) for g in m.groups()) < 1:
        raise argparse.ArgumentTypeError(f"expected N x P / O with positive integers, e.g. 64x128/128 (or 0 to skip); "
                                         f"got {text!r}")
    return tuple(int(g) for g in m.groups())


def _workload(v) -> bool:
    return isinstance(v, (tuple, list)) and len(v) == 3 and all(map(_positive, v))


@dataclass(frozen=True)
class RooflineConfig:
    """What `rawinfer bench roofline` times, besides the engine's options (its flags come from here)."""

    prompt_len: int = option(500, parse=positive_int, check=_positive, what="a positive integer",
                             help="prefill length in tokens (default: 500)")
    batch: list | None = option(None, parse=positive_int, repeat=True, metavar="B",
                                check=optional(lambda v: isinstance(v, (tuple, list)) and len(v) > 0
                                               and all(map(_positive, v))),
                                what="a list of positive integers, or None (1 and 64)",
                                help="decode batch size, repeatable (default: 1 and 64)")
    context: int = option(128, parse=positive_int, check=_positive, what="a positive integer",
                          help="cached tokens per decoding sequence (default: 128)")
    workload: tuple | None = option((64, 128, 128), parse=workload_argument, metavar="NxP/O",
                                    check=optional(_workload), what="(requests, prompt, output tokens), or None",
                                    help="last, N requests of P prompt + O output tokens at once, timed whole and set "
                                         "against the float32 GEMM ceiling; 0 skips it (default: 64x128/128)")

    @property
    def batches(self) -> list[int]:
        return list(self.batch or DEFAULT_BATCHES)


def _best(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_ceilings(xp=np, sync=lambda: None, copy_mib: int = 256, gemm_n: int = 2048, repeat: int = 5,
                     linear=None) -> dict:
    """Copy bandwidth (GB/s, read + write) and float32 GEMM rate (GFLOP/s) with array module xp; the
    GEMM through `linear(x, w, out)` (out = x @ w.T, the backend's own op) when given."""
    n = copy_mib * 1024 * 1024 // 4
    a = xp.ones(n, dtype=xp.float32)
    b = xp.empty_like(a)

    def copy():
        xp.copyto(b, a)
        sync()
    t_copy = _best(copy, repeat)
    x = xp.asarray(np.random.default_rng(0).standard_normal((gemm_n, gemm_n), dtype=np.float32))
    y = xp.empty_like(x)

    def gemm():
        if linear is not None:
            linear(x, x, y)
        else:
            xp.matmul(x, x, out=y)
        sync()
    t_gemm = _best(gemm, repeat)
    return {"copy_GBps": 2 * a.nbytes / t_copy / 1e9, "gemm_GFLOPs": 2 * gemm_n**3 / t_gemm / 1e9,
            "copy_bytes": 2 * a.nbytes, "gemm_n": gemm_n}


def measure_quant_gemm(backend, quant: str, n: int = 2048, repeat: int = 5) -> float | None:
    """GOP/s of the backend's GEMM with `quant` ("int8" or "q4") weights (n x n x n): what such a model's
    matrix products run on (on the CPU the integer GEMMs of backend/cpu/qgemm.py and q4gemm.py where they
    apply). int8 weights without a packed copy are measured on what they run on instead (dequantize +
    float32); q4 ones give None (their float32 tiles have the float32 GEMM's ceiling)."""
    from rawinfer.quant import Int8Weight, Q4Weight, quantize_int8, quantize_q4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n), dtype=np.float32)
    raw = rng.standard_normal((n, n), dtype=np.float32)
    w = backend.prepare_weight(Int8Weight(*quantize_int8(raw)) if quant == "int8" else Q4Weight(*quantize_q4(raw)))
    if quant == "q4" and w.packed is None:
        return None
    y = np.empty_like(x)
    scratch = np.empty(128 * n * 4, np.float32)
    return 2 * n**3 / _best(lambda: backend.linear(x, w, y, scratch=scratch), repeat) / 1e9


def matrix_params(cfg: ModelConfig, lm_head_rows: int, tokens: int) -> tuple[float, float]:
    """(FLOPs of the matrix multiplies for `tokens` tokens with `lm_head_rows` logits rows,
    parameters read) for one forward pass."""
    C, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_layer = cfg.qkv_size * C + C * cfg.q_size + 2 * F * C + F * C
    flops = 2.0 * per_layer * cfg.num_layers * tokens + 2.0 * V * C * lm_head_rows
    params = per_layer * cfg.num_layers + V * C
    return flops, params


def phase_counts(cfg: ModelConfig, tokens: int, logits_rows: int, attended: int, kv_read_tokens: int,
                 weight_bytes_per_param: float, kv_itemsize: float) -> tuple[float, float]:
    """(FLOPs, bytes) of one forward pass; `attended` = sum over queries of the positions each sees,
    `kv_read_tokens` = cached positions whose K and V are streamed once."""
    flops, params = matrix_params(cfg, logits_rows, tokens)
    flops += 4.0 * cfg.num_heads * cfg.head_dim * attended * cfg.num_layers
    kv_bytes = 2.0 * cfg.num_kv_heads * cfg.head_dim * kv_read_tokens * kv_itemsize * cfg.num_layers
    return flops, params * weight_bytes_per_param + kv_bytes


def time_prefill(engine, prompt_len: int, repeat: int = 3) -> float:
    """Seconds to prefill one prompt of prompt_len tokens (logits of its last position only)."""
    from rawinfer.sampling import SamplingParams
    ids = [int(x) for x in np.random.default_rng(1).integers(100, engine.model_config.vocab_size - 100, prompt_len)]

    def once():
        engine.block_manager.reset_prefix_cache()     # a cache hit would skip the work being measured
        engine.add_request(f"roofline-prefill-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
    return _best(once, repeat)


def time_decode(engine, batch: int, context: int, steps: int = 24) -> float:
    """Mean seconds of one decode step with `batch` sequences of about `context` cached tokens."""
    from rawinfer.sampling import SamplingParams
    bs, blocks = engine.config.block_size, engine.block_manager.num_blocks
    need = batch * -(-(context + steps + 2) // bs)
    if need > blocks:                 # else preemptions and recomputed prompts would be timed as decode steps
        raise ValueError(f"a decode batch of {batch} x {context} cached tokens needs {need} KV blocks but the pool "
                         f"holds {blocks}; raise --kv-cache-memory or lower --batch / --context")
    rng = np.random.default_rng(2)
    V = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"roofline-{i}", [int(x) for x in rng.integers(100, V - 100, context)],
                           SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()                 # finish every prefill
    engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t) / steps
    while engine.has_unfinished():
        engine.step()
    return dt


def workload_flops(cfg: ModelConfig, requests: int, prompt_len: int, output_len: int) -> float:
    """FLOPs of `requests` requests of prompt_len + output_len tokens: each prompt's prefill (one logits
    row), then output_len - 1 decode steps of one token (the first output token comes from the prefill)."""
    f_prefill, _ = matrix_params(cfg, 1, prompt_len)
    f_decode, _ = matrix_params(cfg, 1, 1)
    attended = prompt_len * (prompt_len + 1) // 2 + sum(prompt_len + j + 1 for j in range(output_len - 1))
    f_attention = 4.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers * attended
    return requests * (f_prefill + (output_len - 1) * f_decode + f_attention)


def time_workload(engine, requests: int, prompt_len: int, output_len: int) -> float:
    """Wall seconds of `requests` random prompts of prompt_len tokens, output_len greedy tokens each, all
    submitted at once (prefix caching cannot help: every prompt differs from its first token)."""
    from rawinfer.sampling import SamplingParams
    rng = np.random.default_rng(3)
    V = engine.model_config.vocab_size
    engine.block_manager.reset_prefix_cache()
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    for i in range(requests):
        engine.add_request(f"roofline-workload-{i}", [int(x) for x in rng.integers(100, V - 100, prompt_len)], sp)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def weight_bytes_per_param(cfg: ModelConfig, be) -> float:
    """Bytes stored per matrix parameter, averaged over the matrices (a quantized model's: its parts,
    quant.stored_parts; q4 models mix q4 layers with an int8 embedding / LM head)."""
    from rawinfer.exec.memory import weight_shapes
    from rawinfer.quant import storage_kind, stored_parts
    if cfg.quant is None:
        return float(be.weight_dtype(cfg.dtype).itemsize)
    stored = params = 0
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 2:
            parts = stored_parts(name, shape, storage_kind(name, shape, cfg.quant), np.float32)
            stored += sum(int(np.prod(s)) * d.itemsize for _, s, d in parts)
            params += int(np.prod(shape))
    return stored / params


def report(engine, cfg: RooflineConfig = RooflineConfig(), progress: bool = False) -> dict:
    """Ceilings, then prefill, each decode batch and the workload (requests, prompt, output tokens; None:
    skipped) timed; with progress, a bar of these phases on stderr. A ValueError naming the field of a bad
    value of cfg."""
    from tqdm import tqdm
    check_options(cfg, "roofline option")
    bar = tqdm(total=2 + len(cfg.batches) + (cfg.workload is not None), desc="roofline", unit="phase", leave=False,
               disable=None if progress else True)
    try:
        return _report(engine, cfg.prompt_len, cfg.batches, cfg.context, cfg.workload, bar)
    finally:
        bar.close()


def _report(engine, prompt_len: int, batches: list[int], context: int, workload, bar) -> dict:
    cfg = engine.model_config
    be = engine.backend
    bar.set_postfix_str("machine ceilings")
    if be.name == "cuda":
        import cupy
        ceil = measure_ceilings(cupy, cupy.cuda.runtime.deviceSynchronize, copy_mib=1024, gemm_n=8192)
    else:
        ceil = measure_ceilings(linear=be.linear)    # the GEMM path the engine itself runs
        from rawinfer.backend.cpu import blas, isa
        ceil["blas"], ceil["cpu_kernels"] = blas.describe(), isa.describe()
    compute_peak = ceil["gemm_GFLOPs"]
    if cfg.quant in ("int8", "q4") and be.name == "cpu":   # its matrices run on the quantized GEMM instead
        rate = measure_quant_gemm(be, cfg.quant)
        if rate is not None:
            ceil[f"{cfg.quant}_gemm_GOPs"] = compute_peak = rate
    bpp = weight_bytes_per_param(cfg, be)
    k0 = engine.pool.kv.k[0]                         # bytes per cached element (int8: with its row scales)
    kv_item = k0.nbytes / (k0.shape[0] * cfg.num_kv_heads * engine.pool.kv.block_size * cfg.head_dim)
    rows = []
    bar.update(1)
    bar.set_postfix_str(f"prefill of {prompt_len} tokens")
    t = time_prefill(engine, prompt_len)
    bar.update(1)
    f, b = phase_counts(cfg, prompt_len, 1, prompt_len * (prompt_len + 1) // 2, prompt_len, bpp, kv_item)
    rows.append(("prefill", 1, prompt_len, t, f, b))
    for B in batches:
        bar.set_postfix_str(f"decode of {B} sequences")
        t = time_decode(engine, B, context)
        bar.update(1)
        f, b = phase_counts(cfg, B, B, B * (context + 1), B * (context + 1), bpp, kv_item)
        rows.append(("decode", B, B, t, f, b))
    ridge = compute_peak / ceil["copy_GBps"]
    out = {"ceilings": ceil, "compute_ceiling": compute_peak, "ridge_flops_per_byte": ridge, "phases": []}
    for phase, B, tokens, t, f, b in rows:
        ai = f / b
        out["phases"].append({
            "phase": phase, "batch": B, "tokens": tokens, "step_s": t, "tokens_per_s": tokens / t,
            "GFLOPs": f / t / 1e9, "GBps": b / t / 1e9, "flops_per_byte": ai,
            "bound": "compute" if ai > ridge else "memory",
            "pct_of_compute_ceiling": 100 * f / t / 1e9 / compute_peak,
            "pct_of_memory_ceiling": 100 * b / t / 1e9 / ceil["copy_GBps"]})
    if workload is not None:
        n, p, o = workload
        bar.set_postfix_str(f"workload of {n} x {p}/{o} tokens")
        t = time_workload(engine, n, p, o)
        bar.update(1)
        f = workload_flops(cfg, n, p, o)
        out["workload"] = {"requests": n, "prompt_len": p, "output_len": o, "wall_s": t,
                           "output_tokens_per_s": n * o / t, "TFLOP": f / 1e12, "GFLOPs": f / t / 1e9,
                           "pct_of_float32_gemm_ceiling": 100 * f / t / 1e9 / ceil["gemm_GFLOPs"],
                           "pct_of_compute_ceiling": 100 * f / t / 1e9 / compute_peak}
    return out


def print_report(r: dict) -> None:
    c = r["ceilings"]
    int8 = "".join(f", {label} GEMM {c[key]:.1f} GOP/s (the compute ceiling here)"
                   for key, label in (("int8_gemm_GOPs", "int8-weight"), ("q4_gemm_GOPs", "q4-weight")) if key in c)
    print(f"ceilings: copy {c['copy_GBps']:.1f} GB/s, float32 GEMM {c['gemm_GFLOPs']:.1f} GFLOP/s{int8} "
          f"(ridge {r['ridge_flops_per_byte']:.1f} FLOP/byte)")
    if c.get("blas"):
        print(f"BLAS: {c['blas']}; rawinfer's CPU kernels: {c.get('cpu_kernels', 'unknown')}")
    print(f"{'phase':8} {'batch':>5} {'tokens/s':>10} {'GFLOP/s':>9} {'% peak':>7} {'GB/s':>7} {'% peak':>7} "
          f"{'FLOP/B':>7}  bound")
    for p in r["phases"]:
        print(f"{p['phase']:8} {p['batch']:>5} {p['tokens_per_s']:>10.1f} {p['GFLOPs']:>9.1f} "
              f"{p['pct_of_compute_ceiling']:>6.0f}% {p['GBps']:>7.1f} {p['pct_of_memory_ceiling']:>6.0f}% "
              f"{p['flops_per_byte']:>7.1f}  {p['bound']}")
    w = r.get("workload")
    if w:
        print(f"workload {w['requests']} x {w['prompt_len']}/{w['output_len']}: {w['output_tokens_per_s']:.1f} output "
              f"tokens/s, {w['TFLOP']:.2f} TFLOP in {w['wall_s']:.2f} s = {w['GFLOPs']:.1f} GFLOP/s, "
              f"{w['pct_of_float32_gemm_ceiling']:.0f}% of the float32 GEMM ceiling"
              + (f" ({w['pct_of_compute_ceiling']:.0f}% of the compute ceiling)"
                 if w["pct_of_compute_ceiling"] != w["pct_of_float32_gemm_ceiling"] else ""))
