"""The CPU's integer GEMMs side by side on SmolLM2-135M's four layer products (QKV 960 x 576, o 576 x 576,
gate/up 3,072 x 576, down 576 x 1,536; random weights, one of each), GOP/s by weight format and row count:

    i8     int8 weights, 16-bit activations            (qgemm.py)
    q4     q4 weights, 16-bit activations              (q4gemm.py)
    a8     int8 weights, 8-bit activations             (a8gemm.py on a8tile.py)
    a8q4   q4 weights, 8-bit activations               (a8gemm.py on a8q4tile.py)

    python tools/gemm_rates.py [--rows 1,64,512] [--repeat 30]

Each number is the best of --repeat calls of the four products, on Numba's default thread count. The
weights (3.5 MB as int8) stay in the caches, so one row measures the kernels' own speed, not memory's.
`bash tools/test_avx2.sh --run .venv/bin/python tools/gemm_rates.py` measures the AVX2 builds on an AVX-512
machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rawinfer.backend.cpu import a8gemm, a8q4tile, isa, q4gemm, qgemm
from rawinfer.quant import quantize_int8, quantize_q4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
KINDS = ("i8", "q4", "a8", "a8q4")


def weights(rng):
    out = []
    for N, K in SHAPES:
        w = rng.standard_normal((N, K)).astype(np.float32)
        qs, dm = quantize_q4(w)
        q8, s8 = quantize_int8(w)
        out.append({"K": K, "N": N, "s8": s8, "dm": dm.view(np.uint16), "i8": qgemm.pack_weights(q8),
                    "q4": q4gemm.pack_weights(qs, dm), "a8": a8gemm.pack_weights(q8),
                    "a8q4": a8q4tile.pack_q4(q4gemm.unpack_nibbles(qs), dm)})
    return out


def rate(kind: str, W, M: int, repeat: int, rng) -> float:
    """GOP/s of the four products for M rows (2 M N K operations each)."""
    xs = [rng.standard_normal((M, w["K"])).astype(np.float32) for w in W]
    outs = [np.empty((M, w["N"]), np.float32) for w in W]
    kmax = max(K for _, K in SHAPES)
    nx, ns = a8gemm.x_buffer_sizes(M, kmax)
    a8b = (np.empty(nx, np.int8), np.empty(ns, np.float32), np.empty(ns, np.int32))
    sizes = q4gemm.x_buffer_sizes(M, kmax)
    i16b = (np.empty(sizes[0], np.int16), np.empty(sizes[1], np.float32), np.empty(sizes[2], np.float32))
    calls = {"i8": lambda x, w, o: qgemm.int8_matmul(x, w["i8"], w["s8"], o, *i16b[:2]),
             "q4": lambda x, w, o: q4gemm.q4_matmul(x, w["q4"], o, *i16b),
             "a8": lambda x, w, o: a8gemm.a8_matmul(x, w["a8"], w["s8"], o, *a8b),
             "a8q4": lambda x, w, o: a8gemm.a8_matmul(x, w["a8q4"], w["dm"], o, *a8b)}
    best = float("inf")
    for _ in range(repeat + 1):                   # the first call compiles or loads the kernels
        t = time.perf_counter()
        for x, w, o in zip(xs, W, outs):
            calls[kind](x, w, o)
        best = min(best, time.perf_counter() - t)
    return sum(2 * M * N * K for N, K in SHAPES) / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64,512")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    W = weights(rng)
    kinds = KINDS if a8gemm.available() else KINDS[:2]
    print(f"CPU path: {isa.describe()}; GOP/s of SmolLM2's four layer products")
    print(f"{'rows':>5} " + " ".join(f"{k:>7}" for k in kinds))
    for M in (int(r) for r in args.rows.split(",")):
        print(f"{M:5d} " + " ".join(f"{rate(k, W, M, args.repeat, rng):7.1f}" for k in kinds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
