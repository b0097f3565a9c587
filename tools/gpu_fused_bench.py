"""The fused CUDA ops and the decode graphs, timed: each fused kernel against the separate ops it replaces,
and a decode step eager and as a graph, with the fused ops and with the separate ones, at batch 1 and 64.

    PYTHONPATH=. python tools/gpu_fused_bench.py [--out DIR]   # a GPU: Llama-3-8B's shape, bf16, random weights
    PYTHONPATH=. python tools/gpu_fused_bench.py --shim        # no GPU: a tiny shape on the host shim
                                                               # (tests/cuda_shim), to check the script itself

Ops (fused_rope_kv_write with and without the q/k norm, norm_add_rmsnorm) at 1, 64 and 2,048 rows, each
timed as a captured graph replayed many times (device time, no launch overhead) and eagerly (what a step
without graphs pays). Decode: one engine (random weights, 128-token prompts), the forward pass of the
batch's bucket timed eagerly and as a replayed graph, fused and separate (the Backend defaults: the
former op sequence), and the engine's whole step (scheduler, forward, sampler) with graphs on and off.
Writes fused.json and fused-table.txt into DIR (if given) and prints the table last. The separate ops'
graph is captured anew for the comparison, so each figure compares like with like.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from contextlib import contextmanager
from unittest import mock

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUSED_OPS = ("fused_rope_kv_write", "norm_add_rmsnorm")


def shim_launcher():
    """--shim: the host shim's launcher with capture() (launches and GEMMs recorded, replayed in order):
    tests/cuda_shim/harness.py's CapturingShimLauncher, as the tests use."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from cuda_shim import harness
    return harness.CapturingShimLauncher(harness.build_all())


def timer(backend):
    """seconds_per_call(fn, repeats): device time between two events on a GPU, wall time on the shim."""
    if not backend.on_gpu:
        def wall(fn, repeats):
            fn()
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            return (time.perf_counter() - t) / repeats
        return wall
    cp = backend.xp

    def events(fn, repeats):
        fn()
        backend.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / 1e3 / repeats
    return events


@contextmanager
def separate_ops(backend):
    """The backend with its fused ops replaced by the base class's composition of the separate ops."""
    from rawinfer.backend.base import Backend
    for op in FUSED_OPS:
        setattr(backend, op, types.MethodType(getattr(Backend, op), backend))
    try:
        yield
    finally:
        for op in FUSED_OPS:
            delattr(backend, op)


def device(backend, host, dtype):
    arr = backend.empty(host.shape, dtype)
    backend.upload(arr, host.astype(np.float32))
    return arr


def time_ops(backend, shape, tokens, dtype, repeats, log) -> dict:
    """{name: (fused graph s, separate graph s, fused eager s, separate eager s)} of each op at each row count."""
    from rawinfer.backend.base import Backend
    H, Hkv, D, C = shape
    rng, seconds, out = np.random.default_rng(0), timer(backend), {}
    for T in tokens:
        nb = -(-T // 16) + 1
        qkv = device(backend, rng.standard_normal((T, (H + 2 * Hkv) * D)), dtype)
        k, v = (device(backend, np.zeros((nb, Hkv, 16, D)), dtype) for _ in range(2))
        pos = backend.as_index_array(rng.integers(0, 4096, T))
        slots = backend.as_index_array(rng.permutation(nb * 16)[:T])
        cos_sin = device(backend, rng.standard_normal((4096, D)), np.float32)
        qn, kn = (device(backend, 1 + 0.1 * rng.standard_normal(D), dtype) for _ in range(2))
        x, w1, w2 = (device(backend, rng.standard_normal(s), dtype) for s in ((T, C), (C,), (C,)))
        res, normed = device(backend, rng.standard_normal((T, C)), np.float32), backend.empty((T, C), dtype)
        cases = {
            "fused_rope_kv_write": lambda be: be.fused_rope_kv_write(qkv, pos, cos_sin, k, v, slots, H, Hkv),
            "fused_rope_kv_write + q/k norm": lambda be: be.fused_rope_kv_write(qkv, pos, cos_sin, k, v, slots, H, Hkv,
                                                                                qn, kn, 1e-6),
            "norm_add_rmsnorm": lambda be: be.norm_add_rmsnorm(x, w1, res, w2, 1e-6, normed),
        }
        base = types.SimpleNamespace(**{op: types.MethodType(getattr(Backend, op), backend) for op in FUSED_OPS})
        for name, call in cases.items():
            fused_graph = backend.capture_graph(lambda: call(backend))
            separate_graph = backend.capture_graph(lambda: call(base))
            row = (seconds(fused_graph.replay, repeats), seconds(separate_graph.replay, repeats),
                   seconds(lambda: call(backend), repeats), seconds(lambda: call(base), repeats))
            out[f"{name}, T={T}"] = row
            log(f"{name}, T={T}: graph {row[0] * 1e6:.1f} us fused / {row[1] * 1e6:.1f} us separate; "
                f"eager {row[2] * 1e6:.1f} / {row[3] * 1e6:.1f} us")
    return out


def decode_engine(args, max_seqs: int):
    """An engine over random weights: Llama-3-8B's shape on a GPU, a tiny Llama on the shim."""
    from rawinfer import LLMEngine
    from rawinfer.config import EngineConfig, ModelConfig
    ecfg = EngineConfig(device="cuda", max_num_batched_tokens=2048, max_num_seqs=max_seqs, max_model_len=4096,
                        enable_prefix_caching=False, use_cuda_graphs=True, warmup=False,
                        kv_cache_memory=args.kv_cache_memory, itl_target_ms=0)
    if args.shim:
        from rawinfer.backend.cuda.backend import CUDABackend
        cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096)
        backend = CUDABackend(launcher=shim_launcher())
        with mock.patch("rawinfer.engine.engine.get_backend", lambda *a, **k: backend):
            return LLMEngine.random(cfg, ecfg, seed=0)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from gpu_bench import device_random_weights, llama3_8b_config
    from rawinfer.exec.memory import MemoryPool
    with mock.patch.object(MemoryPool, "init_random_weights", device_random_weights):
        return LLMEngine.random(llama3_8b_config(), ecfg, seed=0)


def time_decode(engine, batch: int, prompt_len: int, steps: int, repeats: int, log) -> dict:
    """Decode at `batch`: forward pass eager / graph x fused / separate, and the engine's step with graphs on / off."""
    from rawinfer import SamplingParams
    from rawinfer.core.step_plan import bucket_for
    rng, be, runner = np.random.default_rng(batch), engine.backend, engine.runner
    params = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(100, 400, prompt_len).tolist(), params)
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < 2:              # every prompt prefilled and decoding
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    engine.step()                                  # a pure decode step: the region holds its inputs
    seconds = timer(be)
    flat = runner.graphs.flat_batch(bucket_for(batch, runner.graphs.buckets))
    forward = lambda: engine.model.forward(flat)  # noqa: E731  (recomputes that step, the same K/V)
    r = {"forward eager fused": seconds(forward, repeats),
         "forward graph fused": seconds(runner.graphs.graph_for(flat.num_tokens).graph.replay, repeats)}
    with separate_ops(be):
        r["forward eager separate"] = seconds(forward, repeats)
        r["forward graph separate"] = seconds(be.capture_graph(forward).replay, repeats)
    for use_graphs in (True, False):
        runner.use_graphs = use_graphs
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        r[f"engine step {'graphs' if use_graphs else 'eager'}"] = (time.perf_counter() - t) / steps
    runner.use_graphs = True
    for rid in ids:
        engine.abort(rid)
    log(f"decode batch {batch}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r.items()))
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for fused.json and fused-table.txt")
    ap.add_argument("--shim", action="store_true", help="no GPU: a tiny shape on the host shim (checks the script)")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    ap.add_argument("--kv-cache-memory", default="8GiB")
    args = ap.parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if args.shim:
        from rawinfer.backend.cuda.backend import CUDABackend
        backend = CUDABackend(launcher=shim_launcher())
        shape, tokens, dtype, repeats, prompt_len, steps = (4, 2, 16, 64), (1, 5), np.float32, 2, 8, 2
    else:
        from rawinfer.backend.cuda.runtime import cuda_status
        usable, why = cuda_status()
        if not usable:
            print(f"gpu_fused_bench: no usable GPU here ({why}); --shim runs the script on the host", file=sys.stderr)
            return 2
        from rawinfer.backend.cuda.backend import CUDABackend
        backend = CUDABackend()
        shape, tokens, dtype, repeats, prompt_len, steps = (32, 8, 128, 4096), (1, 64, 2048), "bfloat16", 50, 128, 16
        dtype = backend.weight_dtype(dtype)
    batches = [int(b) for b in args.batches.split(",")]
    results = {"ops": time_ops(backend, shape, tokens, dtype, repeats, log), "decode": {}}
    engine = decode_engine(args, max(batches))
    for batch in batches:
        results["decode"][batch] = time_decode(engine, batch, prompt_len, steps, repeats, log)
    log(engine.runner.graphs.describe())

    rows = [(name, f"{f * 1e6:.1f} us fused / {s * 1e6:.1f} us separate as graphs ({s / f:.2f}x); eager "
             f"{fe * 1e6:.1f} / {se * 1e6:.1f} us") for name, (f, s, fe, se) in results["ops"].items()]
    for batch, r in results["decode"].items():
        rows.append((f"decode forward, batch {batch}",
                     "graph {:.2f} ms fused / {:.2f} separate; eager {:.2f} fused / {:.2f} separate".format(
                         *(1e3 * r[k] for k in ("forward graph fused", "forward graph separate",
                                                "forward eager fused", "forward eager separate")))))
        rows.append((f"decode engine step, batch {batch}",
                     f"{r['engine step graphs'] * 1e3:.2f} ms with graphs / {r['engine step eager'] * 1e3:.2f} ms eager"))
    rows.append(("decode graphs", engine.runner.graphs.describe().removeprefix("decode graphs: ")))
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fused.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "fused-table.txt"), "w") as f:
            f.write(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
