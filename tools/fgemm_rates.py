"""The CPU's two float32 GEMMs side by side on SmolLM2-135M's four layer products (QKV 960 x 576, o 576 x 576,
gate/up 3,072 x 576, down 576 x 1,536), GFLOP/s by row count: where a prompt chunk of some size should go.

    fgemm  the row-invariant GEMM (fgemm.py): decode batches, and every product with --batch-invariant
    blas   NumPy's OpenBLAS on Numba's pool (blas.py; np.matmul where that cannot run): prompts

    python tools/fgemm_rates.py [--rows 64,128,256,1024] [--layers 30] [--rounds 5]

Each round multiplies --layers distinct random copies of the four matrices (30, as the model has: 425 MB,
so that the weights come from memory as in a step) by each row count, fgemm and BLAS one after the other
(which first alternates by round), on Numba's default thread count. Prints each kernel's median GFLOP/s
and the median over rounds of fgemm's time over BLAS's in the same round (below 1: fgemm is faster), the
ratio to read on a machine shared with other work. `bash tools/test_avx2.sh --run .venv/bin/python
tools/fgemm_rates.py` measures the AVX2 build on an AVX-512 machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba as nb
import numpy as np

from rawinfer.backend.cpu import blas, fgemm, isa

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def product(kind: str):
    """A function (x, w, out) running `kind`'s product with the backend's thread split."""
    threads = nb.get_num_threads()

    def parts(w):
        return max(1, min(threads, w.shape[0] // 64))
    if kind == "fgemm":
        return lambda x, w, o: fgemm.matmul_nt(x, w, o, parts(w))
    if blas.available():
        return lambda x, w, o: blas.matmul_nt(x, w, o, parts(w))
    return lambda x, w, o: np.matmul(x, w.T, out=o)


def one_pass(call, layers, xs, outs) -> float:
    """Seconds for every layer's four products."""
    t = time.perf_counter()
    for mats in layers:
        for w, x, o in zip(mats, xs, outs):
            call(x, w, o)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,96,128,160,192,256,512,1024")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    layers = [[rng.standard_normal((N, K), np.float32) * np.float32(0.05) for N, K in SHAPES]
              for _ in range(args.layers)]
    rows = [int(r) for r in args.rows.split(",")]
    xs = {M: [rng.standard_normal((M, K), np.float32) for _, K in SHAPES] for M in rows}
    outs = {M: [np.empty((M, N), np.float32) for N, _ in SHAPES] for M in rows}
    kinds = ("fgemm", "blas")
    calls = {k: product(k) for k in kinds}
    for k in kinds:                                   # compile or load the kernels
        one_pass(calls[k], layers[:1], xs[rows[0]], outs[rows[0]])
    times = {(k, M): [] for k in kinds for M in rows}
    for r in range(args.rounds):
        for M in rows:
            for k in (kinds if r % 2 == 0 else kinds[::-1]):
                times[k, M].append(one_pass(calls[k], layers, xs[M], outs[M]))
    flop = sum(2 * N * K for N, K in SHAPES) * args.layers
    print(f"CPU kernels for {isa.describe()}; BLAS: {blas.describe() or 'np.matmul'}; {nb.get_num_threads()} threads; "
          f"{args.layers} layers, {args.rounds} rounds")
    print(f"{'rows':>5} {'fgemm GFLOP/s':>14} {'blas GFLOP/s':>13} {'fgemm / blas time':>18}")
    for M in rows:
        f, b = times["fgemm", M], times["blas", M]
        ratio = statistics.median(x / y for x, y in zip(f, b))
        print(f"{M:5d} {flop * M / statistics.median(f) / 1e9:14.1f} {flop * M / statistics.median(b) / 1e9:13.1f} "
              f"{ratio:18.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
