"""A short GPU benchmark on a randomly initialised Llama-3-8B-shaped model in bfloat16.

    PYTHONPATH=. python tools/gpu_bench.py [--out DIR]

Measures, through the real engine (scheduler, runner with its decode CUDA graphs, sampler, CUDA
backend, the pool sized from free device memory as `rawinfer` sizes it by default):
  - prefill tokens/s for one 2,048-token prompt;
  - decode tokens/s at batch 1, with CUDA graphs and eagerly (graphs switched off), and at batch 64
    with graphs (prompts of 128 tokens, greedy);
  - the bytes one batch-64 decode step must read (weights + the batch's KV cache) divided by its
    time, next to the device's copy bandwidth measured with a CuPy device-to-device copy;
  - the same decode step's forward pass alone, eager and as the runner's replayed graph, which
    separates GPU time from Python launch overhead.
Writes bench.json and bench-table.txt into DIR (if given) and prints the table last.  Runs in about
a minute or two on an H100/H200; random weights are drawn on the device (a host draw of 8 billion
normals would take longer than the whole benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from unittest import mock

import numpy as np

BLOCK_SIZE = 16
PROMPT_LEN = 128
DECODE_STEPS = 32


def llama3_8b_config():
    from rawinfer.config import ModelConfig, RopeConfig
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       max_position_embeddings=8192, dtype="bfloat16", bos_token_id=None,
                       rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=8192))


def device_random_weights(pool, seed: int = 0, std: float = 0.02) -> None:
    """MemoryPool.init_random_weights, drawn on the device (norms = 1)."""
    from rawinfer.exec.memory import weight_shapes
    cp = pool.backend.xp
    rs = cp.random.RandomState(seed)
    for name, shape in weight_shapes(pool.cfg).items():
        view = pool.weights[name]
        if name.endswith("norm"):
            pool.backend.upload(view, np.ones(shape, np.float32))
            continue
        x = rs.standard_normal(int(np.prod(shape)), dtype=cp.float32) * std
        flat = view.reshape(-1)
        if view.dtype == cp.uint16:            # bfloat16 bits: the top half of the float32 bits
            flat[...] = (x.view(cp.uint32) >> 16).astype(cp.uint16)
        else:
            flat[...] = x.astype(view.dtype)
        del x
    pool.backend.synchronize()


def copy_bandwidth(cp, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = cp.empty(nbytes, cp.uint8)
    dst = cp.empty(nbytes, cp.uint8)
    src.fill(1)
    cp.copyto(dst, src)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        cp.copyto(dst, src)
    stop.record()
    stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1000.0
    del src, dst
    return 2 * nbytes * repeats / seconds


@contextmanager
def timed(log, what):
    t = time.perf_counter()
    yield
    log(f"{what}: {time.perf_counter() - t:.1f} s")


def run_until_done(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for bench.json and bench-table.txt")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    from rawinfer.backend.cuda.runtime import cuda_status
    usable, why = cuda_status()
    if not usable:
        print(f"gpu_bench: no usable GPU here ({why})", file=sys.stderr)
        return 2
    import cupy as cp

    from rawinfer import LLMEngine, SamplingParams
    from rawinfer.config import EngineConfig
    from rawinfer.exec.memory import MemoryPool

    rng = np.random.default_rng(0)
    results: dict[str, float | str] = {}
    props = cp.cuda.runtime.getDeviceProperties(0)
    results["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    log(f"device: {results['device']}, cupy {cp.__version__}")

    results["copy_bandwidth_GBps"] = copy_bandwidth(cp) / 1e9
    log(f"device copy bandwidth (read + write): {results['copy_bandwidth_GBps']:.0f} GB/s")
    cp.get_default_memory_pool().free_all_blocks()   # give the copy buffers back before sizing the pool

    cfg = llama3_8b_config()
    # kv_cache_memory left unset: the pool takes gpu_memory_utilization of the free memory (the default)
    ecfg = EngineConfig(device="cuda", block_size=BLOCK_SIZE, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_num_batched_tokens=max(2048, args.prefill_len), max_num_seqs=args.batch,
                        max_model_len=4096, enable_prefix_caching=False, use_cuda_graphs=True)
    with timed(log, "engine start (kernel compile or cache load, pool, device-side random weights)"):
        with mock.patch.object(MemoryPool, "init_random_weights", device_random_weights):
            engine = LLMEngine.random(cfg, ecfg, seed=0)
    log(engine.pool.describe())
    runner = engine.runner
    if runner.graphs is None:
        log("CUDA graphs are off in this engine (the launcher cannot capture): graph numbers will be missing")
    greedy_one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prompt(n):
        return rng.integers(100, cfg.vocab_size - 100, n).tolist()

    # ---- prefill ----------------------------------------------------------------------------------
    engine.add_request("warm", prompt(args.prefill_len), greedy_one)   # warm-up: cuBLAS heuristics, caches
    run_until_done(engine)
    times = []
    for i in range(3):
        engine.add_request(f"prefill{i}", prompt(args.prefill_len), greedy_one)
        t = time.perf_counter()
        run_until_done(engine)
        times.append(time.perf_counter() - t)
    results["prefill_tokens_per_s"] = args.prefill_len / float(np.median(times))
    log(f"prefill {args.prefill_len} tokens: {np.median(times) * 1e3:.1f} ms "
        f"-> {results['prefill_tokens_per_s']:.0f} tokens/s")

    # ---- decode -----------------------------------------------------------------------------------
    def decode(batch: int, tag: str) -> tuple[float, int]:
        params = SamplingParams(max_tokens=DECODE_STEPS + 8, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{tag}{batch}-{i}", prompt(PROMPT_LEN), params)
        produced: dict[str, int] = {}
        while len(produced) < batch or min(produced.values()) < 2:   # every prompt prefilled
            for out in engine.step():
                produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
        t = time.perf_counter()
        tokens = 0
        for _ in range(DECODE_STEPS):
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        step = (time.perf_counter() - t) / DECODE_STEPS
        return step, tokens

    step1, tokens1 = decode(1, "graph")
    run_until_done(engine)
    results["decode_tokens_per_s_batch1"] = tokens1 / (step1 * DECODE_STEPS)
    log(f"decode batch 1 ({'CUDA graphs' if runner.graphs else 'eager'}): {step1 * 1e3:.2f} ms/step -> "
        f"{results['decode_tokens_per_s_batch1']:.1f} tokens/s")
    runner.use_graphs = False
    step1e, tokens1e = decode(1, "eager")
    run_until_done(engine)
    runner.use_graphs = runner.graphs is not None
    results["decode_tokens_per_s_batch1_eager"] = tokens1e / (step1e * DECODE_STEPS)
    log(f"decode batch 1 (eager): {step1e * 1e3:.2f} ms/step -> "
        f"{results['decode_tokens_per_s_batch1_eager']:.1f} tokens/s")

    step_b, tokens_b = decode(args.batch, "graph")
    results[f"decode_tokens_per_s_batch{args.batch}"] = tokens_b / (step_b * DECODE_STEPS)
    log(f"decode batch {args.batch}: {step_b * 1e3:.2f} ms/step -> "
        f"{results[f'decode_tokens_per_s_batch{args.batch}']:.0f} tokens/s")
    if runner.graphs is not None:
        results["graph_buckets_captured"] = str(runner.graphs.captured)
        log(f"decode graphs captured for batch buckets {runner.graphs.captured}")

    # Bytes a decode step of the batch must read: every weight except the embedding table (only B rows
    # are gathered) and the RoPE table, plus each sequence's cached K/V in every layer.
    itemsize = 2
    embed = cfg.vocab_size * cfg.hidden_size * itemsize
    rope = cfg.max_position_embeddings * cfg.head_dim * 4
    context = PROMPT_LEN + DECODE_STEPS // 2 + 2   # mean context over the timed steps
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    step_bytes = engine.pool.weight_bytes - embed - rope + args.batch * context * kv_per_token
    results["decode_step_bytes_GB"] = step_bytes / 1e9
    results["decode_step_ms"] = step_b * 1e3
    results["decode_bandwidth_GBps"] = step_bytes / step_b / 1e9

    # ---- the forward pass alone: eager vs CUDA graph ----------------------------------------------
    # The batch's decode graph and its input buffers still hold the last timed step: replaying it, or
    # running the same padded batch eagerly, recomputes that step (rewriting the same K/V).
    def time_gpu(fn, repeats=10) -> float:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / 1000.0 / repeats

    if runner.graphs is not None:
        from rawinfer.core.step_plan import bucket_for
        bucket = bucket_for(args.batch, runner.graphs.buckets)
        flat = runner.graphs.flat_batch(bucket)
        forward = lambda: engine.model.forward(flat)  # noqa: E731
        forward()
        engine.backend.synchronize()
        results["forward_eager_ms"] = time_gpu(forward) * 1e3
        log(f"decode forward (batch {bucket}), eager: {results['forward_eager_ms']:.2f} ms")
        try:
            graph = runner.graphs.graph_for(bucket)
            results["forward_graph_ms"] = time_gpu(graph.graph.replay) * 1e3
            results["graph_bandwidth_GBps"] = step_bytes / (results["forward_graph_ms"] / 1e3) / 1e9
            log(f"decode forward as a CUDA graph: {results['forward_graph_ms']:.2f} ms "
                f"-> {results['graph_bandwidth_GBps']:.0f} GB/s")
        except Exception as e:  # noqa: BLE001 - report and keep the rest of the numbers
            results["forward_graph_ms"] = f"capture failed: {type(e).__name__}: {e}"[:200]
            log(f"CUDA graph capture failed: {e}")
    else:
        results["forward_eager_ms"] = float("nan")
        results["forward_graph_ms"] = "no graphs in this engine"

    # ---- table ------------------------------------------------------------------------------------
    copy_bw = results["copy_bandwidth_GBps"]
    rows = [
        ("device", results["device"]),
        ("decode tokens/s, batch 1, CUDA graphs", f"{results['decode_tokens_per_s_batch1']:.1f}"),
        ("decode tokens/s, batch 1, eager", f"{results['decode_tokens_per_s_batch1_eager']:.1f}"),
        (f"decode tokens/s, batch {args.batch}", f"{results[f'decode_tokens_per_s_batch{args.batch}']:.0f}"),
        (f"prefill tokens/s, {args.prefill_len}-token prompt", f"{results['prefill_tokens_per_s']:.0f}"),
        (f"decode step, batch {args.batch}", f"{step_b * 1e3:.2f} ms, reads {step_bytes / 1e9:.2f} GB"),
        ("decode step bandwidth (engine step)",
         f"{results['decode_bandwidth_GBps']:.0f} GB/s = {100 * results['decode_bandwidth_GBps'] / copy_bw:.0f}% of copy"),
        ("decode forward, eager / graph", f"{results['forward_eager_ms']:.2f} ms / " + (
            f"{results['forward_graph_ms']:.2f} ms ({100 * results['graph_bandwidth_GBps'] / copy_bw:.0f}% of copy)"
            if isinstance(results["forward_graph_ms"], float) else str(results["forward_graph_ms"]))),
        ("device copy bandwidth (read + write)", f"{copy_bw:.0f} GB/s"),
        ("memory pool (GiB)", "{:.1f} = weights {:.1f} + workspace {:.1f} + KV {:.1f} ({} blocks)".format(
            *(b / 1024**3 for b in (engine.pool.total_bytes, engine.pool.weight_bytes,
                                    engine.pool.workspace_bytes, engine.pool.kv_bytes)), engine.pool.kv.num_blocks)),
    ]
    width = max(len(r[0]) for r in rows)
    table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "bench-table.txt"), "w") as f:
            f.write(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
