"""Decode attention on the GPU: today's kernel (GC = 8 query heads per K/V read, about 16 splits a context)
against the former one (GC = 4, fixed 512-position splits), in achieved KV-read bandwidth.

    PYTHONPATH=. python tools/gpu_decode_bench.py [--batches 1,64] [--contexts 2048,8192] [--out DIR]
    PYTHONPATH=. python tools/gpu_decode_bench.py --shim    # no GPU: a tiny shape on the host shim
                                                            # (tests/cuda_shim), to check the script itself

GPU defaults: Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16, KV blocks of 16 in
shuffled order, every sequence a distinct set of blocks). For each batch and context, four settings of
CUDABackend.paged_attention_decode run on the same inputs: "former" (decode_heads_per_pass 4,
decode_min_partition 512: every split decode_partition long), "GC 8, fixed splits" (the new kernel
alone), "today" (the defaults) and "32 splits" (decode_target_splits 32, the next candidate default).
Each is checked against the former first (max relative difference within the storage dtype's
tolerance), then timed as a captured graph of 10 calls (decode kernel and merge; the shim: 2) replayed
--repeats times, the median replay over the calls in it (CUDA events on a GPU, wall time on the shim), so
that the host's launch cost is not counted. Bandwidth counted: the K and V bytes of every sequence's
context, B * ctx * Hkv * D * 2 * itemsize, over the time. Writes decode.json and decode-table.txt into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = {"float32": 2e-5, "float16": 2 * 2.0**-10, "bfloat16": 2 * 2.0**-7}
SETTINGS = {  # name -> backend attributes
    "former": {"decode_heads_per_pass": 4, "decode_min_partition": 512},
    "GC 8, fixed splits": {"decode_min_partition": 512},
    "today": {},
    "32 splits": {"decode_target_splits": 32},
}
ATTRS = ("decode_heads_per_pass", "decode_min_partition", "decode_target_splits")


def make_inputs(backend, shape, batch: int, ctx: int, dtype, block_size: int = 16):
    """Device arrays of paged_attention_decode: one query per sequence, caches of B * ceil(ctx / BS)
    distinct blocks filled chunk by chunk (the whole cache is never on the host), shuffled tables."""
    heads, kv_heads, head_dim = shape
    rng = np.random.default_rng(0)
    per_seq = -(-ctx // block_size)
    nblocks = batch * per_seq
    chunk = max(1, min(nblocks, (64 << 20) // (kv_heads * block_size * head_dim * 4)))
    noise = rng.standard_normal((chunk, kv_heads, block_size, head_dim), np.float32).astype(dtype)
    caches = []
    for _ in range(2):
        cache = backend.empty((nblocks, kv_heads, block_size, head_dim), dtype)
        for i in range(0, nblocks, chunk):
            n = min(chunk, nblocks - i)
            backend.upload(cache[i:i + n], noise[:n])
        caches.append(cache)
    host = {"qkv": rng.standard_normal((batch, (heads + 2 * kv_heads) * head_dim), np.float32).astype(dtype)}
    ints = {"block_tables": rng.permutation(nblocks).astype(np.int32).reshape(batch, per_seq),
            "context_lens": np.full(batch, ctx, np.int32),
            "query_start_loc": np.arange(batch + 1, dtype=np.int32)}
    dev = {}
    for name, a in {**host, **ints}.items():
        dev[name] = backend.empty(a.shape, a.dtype if name in ints else dtype)
        backend.upload(dev[name], a)
    return dev["qkv"], caches[0], caches[1], dev["block_tables"], dev["context_lens"], dev["query_start_loc"]


def time_case(backend, shape, batch: int, ctx: int, dtype, timer, repeats: int, graph_calls: int) -> dict:
    """Agreement and timing of every setting at one (batch, context)."""
    heads, kv_heads, head_dim = shape
    inputs = make_inputs(backend, shape, batch, ctx, dtype)
    scale = head_dim ** -0.5
    kv_bytes = batch * ctx * kv_heads * head_dim * 2 * np.dtype(dtype).itemsize
    defaults = {name: getattr(backend, name) for name in ATTRS}
    result, outs = {}, {}
    for name, attrs in SETTINGS.items():
        for attr, value in {**defaults, **attrs}.items():
            setattr(backend, attr, value)
        out = backend.empty((batch, heads * head_dim), dtype)

        def call(out=out):
            backend.paged_attention_decode(*inputs, scale, out, ctx)
        call()
        backend.synchronize()
        outs[name] = np.asarray(backend.to_host(out), np.float64)
        # a graph: a batch-1 call reads a few MB, which the device does faster than Python launches it
        graph = backend.capture_graph(lambda: [call() for _ in range(graph_calls)])
        seconds = timer(graph.replay, repeats) / graph_calls
        split_range = backend.decode_split_range(heads // kv_heads, head_dim, 16, np.dtype(dtype).itemsize)
        splits = -(-ctx // backend.decode_split_len(ctx, 16, split_range))
        diff = float(np.max(np.abs(outs[name] - outs["former"]) / np.maximum(1.0, np.abs(outs["former"]))))
        result[name] = {"us": seconds * 1e6, "GB/s": kv_bytes / seconds / 1e9, "splits": splits,
                        "blocks": splits * kv_heads * batch, "max_relative_difference": diff}
    for attr, value in defaults.items():
        setattr(backend, attr, value)
    return result


def table(results: dict, label: str) -> str:
    rows = [("decode attention", label)]
    for case, r in results.items():
        cells = [f"{name} {v['us']:.1f} us = {v['GB/s']:.0f} GB/s ({v['splits']} splits, {v['blocks']} blocks)"
                 for name, v in r.items()]
        rows.append((case, "; ".join(cells) + f"; today / former {r['former']['us'] / r['today']['us']:.2f}x"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shim", action="store_true", help="no GPU: a tiny shape on the host shim (checks the script)")
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,64; --shim 1,3)")
    ap.add_argument("--contexts", default=None, help="comma-separated (default 2048,8192; --shim 40,100)")
    ap.add_argument("--repeats", type=int, default=None, help="default 20 (--shim 1)")
    ap.add_argument("--out", help="folder for decode.json and decode-table.txt")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from gpu_attention_bench import cuda_timer, host_timer

    from rawinfer.backend.cuda.backend import CUDABackend
    if args.shim:
        from gpu_fused_bench import shim_launcher  # the host shim's launcher, with capture()
        backend = CUDABackend(launcher=shim_launcher())
        backend.decode_partition, backend.decode_min_partition, backend.decode_target_splits = 64, 16, 4
        shape, dtype, timer, graph_calls = (8, 1, 16), np.dtype(np.float32), host_timer, 2
        defaults = ("1,3", "40,100", 1)
    else:
        from rawinfer.backend.cuda.runtime import cuda_status
        usable, why = cuda_status()
        if not usable:
            print(f"gpu_decode_bench: no usable GPU here ({why}); --shim runs the script on the host", file=sys.stderr)
            return 2
        import cupy as cp
        backend = CUDABackend()
        shape, timer, defaults, graph_calls = (32, 8, 128), cuda_timer(cp), ("1,64", "2048,8192", 20), 10
        dtype = backend.weight_dtype("bfloat16")
    batches = [int(b) for b in (args.batches or defaults[0]).split(",")]
    contexts = [int(c) for c in (args.contexts or defaults[1]).split(",")]
    repeats = args.repeats or defaults[2]
    results = {}
    for batch in batches:
        for ctx in contexts:
            results[f"batch {batch}, ctx {ctx}"] = time_case(backend, shape, batch, ctx, dtype, timer, repeats,
                                                               graph_calls)
    label = f"H={shape[0]} Hkv={shape[1]} D={shape[2]} {np.dtype(dtype).name}, KV blocks of 16"
    text = table(results, label)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "decode-table.txt"), "w") as f:
            f.write(text + "\n")
    tol = TOLERANCE[np.dtype(dtype).name]
    agree = all(v["max_relative_difference"] <= 2 * tol for r in results.values() for v in r.values())
    if not agree:
        print("gpu_decode_bench: the settings disagree beyond the dtype's tolerance", file=sys.stderr)
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
