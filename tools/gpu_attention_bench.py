"""Prefill attention on the GPU: the tensor-core kernel (flash_attention_prefill.cu) against the FMA kernel
(paged_attention_prefill.cu) on one prompt, in TFLOP/s.

    PYTHONPATH=. python tools/gpu_attention_bench.py [--tokens 2048] [--heads 32] [--kv-heads 8]
        [--head-dim 128] [--dtype bf16] [--window 0] [--out OUTDIR]

Defaults: Llama-3-8B's attention shape, one 2,048-token prompt, bf16, KV blocks of 16 in shuffled order.
Both kernels run through CUDABackend.paged_attention_prefill (flash_prefill on / off) on the same inputs;
the run first checks that they agree (max |difference| against the storage dtype's tolerance), then
times each (median of --repeats launches, CUDA events), and the device's own limit beside them: a cuBLAS
GEMM of the same dtype through CUDABackend.linear, [T, --gemm] x [--gemm, --gemm] (Llama-3-8B's o_proj).  FLOPs counted: 4 H D per visible (query, key)
pair (Q K^T and P V), i.e. 4 H D T (T + 1) / 2 for a causal prompt without a window.  tools/gpu_check.sh
runs it and prints the table; OUTDIR gets attention.json and attention-table.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

TOLERANCE = {"f16": 2 * 2.0**-10, "bf16": 2 * 2.0**-7}


def visible_pairs(tokens: int, window: int) -> int:
    """(query, key) pairs a causal prompt of `tokens` attends to, with a sliding window W > 0 or none."""
    q = np.arange(tokens, dtype=np.int64)
    return int(np.sum(np.minimum(q + 1, window) if window else q + 1))


def make_inputs(backend, args, dtype):
    """Device arrays of paged_attention_prefill for one prompt: qkv, caches with shuffled blocks, tables."""
    rng = np.random.default_rng(0)
    block_size = 16
    nblocks = -(-args.tokens // block_size)
    width = (args.heads + 2 * args.kv_heads) * args.head_dim
    host = {
        "qkv": rng.standard_normal((args.tokens, width), np.float32),
        "k_cache": rng.standard_normal((nblocks, args.kv_heads, block_size, args.head_dim), np.float32),
        "v_cache": rng.standard_normal((nblocks, args.kv_heads, block_size, args.head_dim), np.float32),
    }
    dev = {}
    for name, a in host.items():
        dev[name] = backend.empty(a.shape, dtype)
        backend.upload(dev[name], a.astype(dtype))
    ints = {"block_tables": rng.permutation(nblocks).astype(np.int32)[None, :],
            "context_lens": np.array([args.tokens], np.int32),
            "query_start_loc": np.array([0, args.tokens], np.int32)}
    for name, a in ints.items():
        dev[name] = backend.empty(a.shape, np.int32)
        backend.upload(dev[name], a)
    return dev


def run(backend, args, timer: Callable[[Callable[[], None], int], float]) -> dict:
    """Agreement and timings of both prefill kernels; timer(fn, repeats) -> median seconds of one fn()."""
    from ml_dtypes import bfloat16

    dtype = {"bf16": bfloat16, "f16": np.float16}[args.dtype]
    inputs = make_inputs(backend, args, dtype)
    scale = args.head_dim ** -0.5
    outs = {}
    seconds = {}
    for name, flash in (("tensor cores", True), ("FMA", False)):
        backend.flash_prefill = flash
        out = backend.empty((args.tokens, args.heads * args.head_dim), dtype)

        def call(out=out):
            backend.paged_attention_prefill(inputs["qkv"], inputs["k_cache"], inputs["v_cache"],
                                            inputs["block_tables"], inputs["context_lens"],
                                            inputs["query_start_loc"], scale, out, args.tokens, args.window)
        call()
        backend.synchronize()
        outs[name] = np.asarray(backend.to_host(out), np.float64)
        seconds[name] = timer(call, args.repeats)
    backend.flash_prefill = True
    x, w = backend.empty((args.tokens, args.gemm), dtype), backend.empty((args.gemm, args.gemm), dtype)
    for a in (x, w):
        backend.upload(a, np.random.default_rng(1).standard_normal(a.shape, np.float32).astype(dtype))
    y = backend.empty((args.tokens, args.gemm), dtype)
    gemm_s = timer(lambda: backend.linear(x, w, y), args.repeats)
    gemm_tflops = 2.0 * args.tokens * args.gemm * args.gemm / gemm_s / 1e12
    flops = 4.0 * args.heads * args.head_dim * visible_pairs(args.tokens, args.window)
    diff = float(np.max(np.abs(outs["tensor cores"] - outs["FMA"]) / np.maximum(1.0, np.abs(outs["FMA"]))))
    return {
        "shape": f"T={args.tokens} H={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype} W={args.window}",
        "max_relative_difference": diff,
        "agree": diff <= 2 * TOLERANCE[args.dtype],
        "flash_ms": seconds["tensor cores"] * 1e3,
        "fma_ms": seconds["FMA"] * 1e3,
        "flash_tflops": flops / seconds["tensor cores"] / 1e12,
        "fma_tflops": flops / seconds["FMA"] / 1e12,
        "speedup": seconds["FMA"] / seconds["tensor cores"],
        "gemm_tflops": gemm_tflops,
        "flash_share_of_gemm": flops / seconds["tensor cores"] / 1e12 / gemm_tflops,
    }


def table(r: dict) -> str:
    rows = [("prefill attention", r["shape"]),
            ("kernels agree (max rel. difference)", f"{r['agree']} ({r['max_relative_difference']:.2g})"),
            ("tensor cores (flash_attention_prefill)", f"{r['flash_ms']:.3f} ms = {r['flash_tflops']:.1f} TFLOP/s"),
            ("FMA (paged_attention_prefill)", f"{r['fma_ms']:.3f} ms = {r['fma_tflops']:.1f} TFLOP/s"),
            ("speed-up", f"{r['speedup']:.1f}x"),
            ("cuBLAS GEMM, same dtype (the limit)", f"{r['gemm_tflops']:.1f} TFLOP/s; tensor-core attention "
                                                    f"at {100 * r['flash_share_of_gemm']:.0f} % of it")]
    return "\n".join(f"{k:<40s} {v}" for k, v in rows)


def cuda_timer(cp):
    def timer(fn, repeats):
        times = []
        for _ in range(repeats):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
        return float(np.median(times))
    return timer


def host_timer(fn, repeats):
    """Wall time (the host shim: proves the script runs, says nothing about a GPU)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--gemm", type=int, default=4096, help="K = N of the reference GEMM")
    ap.add_argument("--out", help="folder for attention.json and attention-table.txt")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from rawinfer.backend.cuda.runtime import cuda_status
    usable, why = cuda_status()
    if not usable:
        print(f"gpu_attention_bench: no usable GPU here ({why})", file=sys.stderr)
        return 2
    import cupy as cp

    from rawinfer.backend.cuda.backend import CUDABackend
    result = run(CUDABackend(), args, cuda_timer(cp))
    text = table(result)
    print(text, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "attention.json").write_text(json.dumps(result, indent=2) + "\n")
        (Path(args.out) / "attention-table.txt").write_text(text + "\n")
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
